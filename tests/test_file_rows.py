"""GGUF weights computed where the file's map holds them (`models.quant.file_view`), and a tied
head over the embedding's own rows (int8 activations on AVX2): no second copy of a quantized
matrix. The oracle is the float model dequantized from the same file (gguf's
dequantize, pure torch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models import kernels, load_model
from models.decoder import PackedLinear
from models.quant import GGML, GGML_A8, PanelEmbedding, gguf_rows
from tests.helpers.oracles import our_logits
from tools import synth_model

TINY = dict(
    num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=1,
    intermediate_size=512, head_dim=64, vocab_size=512, max_position_embeddings=1024,
    sliding_window=8,
)  # fmt: skip

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no kernels")


def gemma_file(tmp_path, tokenizer, fmt: str, preset: str = "gemma-3-270m"):
    shape = TINY if preset.startswith("gemma") else {**TINY, "sliding_window": None}
    return synth_model.write_synthetic(
        tmp_path / f"{preset}-{fmt}.gguf", preset, fmt, seed=4, tokenizer=tokenizer, **shape
    )


def test_rows_of_a_read_only_map_are_views_and_other_arrays_are_copied(tmp_path):
    data = np.arange(4 * 34, dtype=np.uint8)
    path = tmp_path / "blocks.bin"
    data.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    view = gguf_rows(mapped[34:].view(np.ndarray).reshape(3, 34), 8, 3, 32)  # Q8_0 rows
    assert view.parts[0][1].data_ptr() == mapped.ctypes.data + 34
    owned = np.array(data[34:]).reshape(3, 34)
    copied = gguf_rows(owned, 8, 3, 32)
    assert copied.parts[0][1].data_ptr() != owned.ctypes.data
    assert torch.equal(view.parts[0][1], copied.parts[0][1])


@pytest.mark.parametrize("preset", ["gemma-3-270m", "llama-3.2-1b"])
def test_k_quant_projections_and_embedding_read_the_file_map_in_place(
    tmp_path, smol_tokenizer, preset
):
    """Fused q/k/v and gate/up included: their parts are addressed where they lie in the map.
    A llama-architecture file's q/k rows too, in the order its converter permuted them (RoPE
    then pairs them as GGML does); the float oracle un-permutes them as transformers does."""
    path = gemma_file(tmp_path, smol_tokenizer, "Q4_K_M", preset)
    lm = load_model(str(path), activations="float32", kv_cache_dtype="float32")
    assert lm.config.rope_interleaved == preset.startswith("llama")
    model = lm.model
    size = path.stat().st_size
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert {m.packed.kind for m in linears} == {GGML}
    rows = [m.packed.qs for m in linears] + [model.embed_tokens.qs]
    storages = {qs.untyped_storage().data_ptr() for qs in rows}
    assert len(storages) == 1 and rows[0].untyped_storage().nbytes() == size
    assert len(model.layers[0].self_attn.qkv_proj.packed.m) == 3  # q, k, v where they lie
    floats = load_model(str(path), use_kernels=False)
    ids = [1, *range(40, 60)]
    want = our_logits(floats, ids)
    torch.testing.assert_close(our_logits(lm, ids), want, rtol=0, atol=2e-4 * want.abs().max())


@pytest.mark.parametrize("activations", ["auto", "float32"])
def test_a_tied_q8_0_head_is_the_embeddings_rows_or_a_packed_copy(
    tmp_path, smol_tokenizer, activations
):
    """int8 activations on AVX2 multiply the lookup's own rows; on AVX512-VNNI the head is a
    packed copy of the table and the lookup reads that copy (the file's rows are not touched
    again); float32 activations multiply a packed copy and look up the file's rows."""
    path = gemma_file(tmp_path, smol_tokenizer, "Q8_0")
    lm = load_model(str(path), kv_cache_dtype="float32", activations=activations)
    head, table = lm.model.lm_head.packed, lm.model.embed_tokens.qs
    shared = head.qs.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()
    rows = activations == "auto" and not kernels.has_int8_dot()
    panels = activations == "auto" and kernels.has_int8_dot()
    assert shared == (rows or panels)
    assert (head.kind == GGML_A8) == rows
    assert isinstance(lm.model.embed_tokens, PanelEmbedding) == panels
    floats = load_model(str(path), use_kernels=False)
    ids = [1, *range(40, 60)]
    want = our_logits(floats, ids)
    got = our_logits(lm, ids)
    # int8 activations (per 32 inputs) in the head: within a few hundredths of the logits' range
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * want.abs().max())
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_loading_leaves_no_touched_file_pages_resident(smollm2_file):
    """Pages of the file that loading read (to copy into panels, permute, ...) leave the
    resident set once the model is built; what the kernels read in place faults back in."""
    from models.gguf_loader import _open, _release_pages

    path = smollm2_file
    reader = _open(path)
    data = np.asarray(reader.data)
    touched = _rss_mib()
    assert int(data[:: 4096 // data.itemsize].sum()) >= 0  # read every page of the map
    full = _rss_mib()
    size = path.stat().st_size / 2**20
    assert full - touched > 0.8 * size, "reading the map did not bring its pages in"
    _release_pages(reader)
    assert full - _rss_mib() > 0.8 * size
    assert int(data[:: 4096 // data.itemsize].sum()) >= 0  # and the map still reads
