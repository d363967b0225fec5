"""The hybrid families (LFM2, Qwen3.5, their mixtures of experts, Granite 4.0-H) against transformers' own classes on tiny random configs
(nothing downloaded): a random model of each is saved as a Hugging Face directory and, written
by tools.synth_model as llama.cpp's converter writes it, as a GGUF file; both load here and must
give transformers' logits: a full forward, and through the engine with its recurrent state pool
(chunked prefill carrying the state across chunks over small blocks, decode, preemption by
recompute, a prefix-cache hit resuming from a state snapshot), with the CPU kernels and without;
greedy 32 tokens equal transformers' generate on 5 prompts.

Tolerance as tests/test_models_arch.py: 1e-3 absolute on fp32 logits, argmax equal everywhere.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers: nothing here touches a hub

from pathlib import Path

import pytest
import torch

from engine import ContinuousBatchEngine, DisaggregatedEngine, Request, SamplingParams
from models import kernels, load_model
from tests.helpers.engine_runs import engine_logits, run_greedy
from tests.helpers.hybrid_configs import (
    VOCAB,
    granite_hybrid_config,
    lfm2_config,
    lfm2_moe_config,
    qwen35_config,
    qwen35_moe_config,
)
from tests.helpers.model_files import (
    byte_level_tokenizer,
    random_ids,
    randomize_,
    write_hf_checkpoint,
)
from tests.helpers.oracles import ATOL, assert_logits_match, hf_logits, our_logits

CONFIGS = {
    "lfm2": lfm2_config,
    "qwen35": qwen35_config,
    "qwen35_moe": qwen35_moe_config,
    "lfm2_moe": lfm2_moe_config,
    "granitehybrid": granite_hybrid_config,
}
GGUF_ARCH = {"lfm2": "lfm2", "qwen35": "qwen35", "qwen35_moe": "qwen35moe", "lfm2_moe": "lfm2moe",
             "granitehybrid": "granitehybrid"}  # fmt: skip


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(name, HF directory, GGUF file, the transformers model that wrote them)."""
    name = request.param
    path = tmp_path_factory.mktemp(name)
    ref = write_hf_checkpoint(path, CONFIGS[name](), seed=len(name))
    gguf = write_gguf(path.parent / f"{name}.gguf", GGUF_ARCH[name], ref)
    return name, path, gguf, ref


def byte_tokenizer(vocab: int):
    """A byte-level GPT-2 style tokenizer as GGUF metadata (what tools.synth_model copies)."""
    from gguf import GGUFValueType as V
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from tools.synth_model import Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + list(bytes_to_unicode().values()) + ["Ġt", "Ġth", "Ġthe"]
    tokens += [f"<unused{i}>" for i in range(vocab - len(tokens))]
    types = [3] * len(specials) + [1] * (262 - len(specials)) + [5] * (vocab - 262)
    fields = {
        "tokenizer.ggml.model": ("gpt2", V.STRING, None),
        "tokenizer.ggml.pre": ("default", V.STRING, None),
        "tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING),
        "tokenizer.ggml.token_type": (types, V.ARRAY, V.INT32),
        "tokenizer.ggml.merges": (["Ġ t", "Ġt h", "Ġth e"], V.ARRAY, V.STRING),
        "tokenizer.ggml.bos_token_id": (1, V.UINT32, None),
        "tokenizer.ggml.eos_token_id": (2, V.UINT32, None),
    }
    return Tokenizer(fields, "bytes")


def write_gguf(path: Path, arch: str, ref) -> Path:
    """`ref` as a float32 GGUF written by tools.synth_model (the converter's names, keys and
    value changes: squeezed convs, Qwen3.5's 1 + w norms, -exp(A_log), tiled value heads,
    Granite's split gate/up and (groups, size) norm)."""
    from tools.synth_model import write_gguf as synth_write

    state = {k: v.detach() for k, v in ref.state_dict().items()}
    return synth_write(path, arch, ref.config.to_dict(), state, byte_tokenizer(VOCAB), "F32")


def _engine(lm, **kw):
    options = dict(max_batch_size=2, block_size=4, max_num_batched_tokens=16, num_blocks=64)
    return ContinuousBatchEngine(lm.model, **{**options, **kw})


def check_engine(lm, ref, prompt: list[int], n: int, engine=None) -> None:
    got, rows = engine_logits(lm, prompt, n, engine)
    expected = hf_logits(ref, prompt + got)[len(prompt) - 1 : -1]
    assert torch.equal(torch.stack(rows).argmax(-1), expected.argmax(-1))
    assert (torch.stack(rows) - expected).abs().max().item() <= ATOL


def _load(path: Path, use_kernels: bool):
    if use_kernels and not kernels.available():
        pytest.skip(kernels.unavailable_reason() or "no kernels")
    lm = load_model(str(path), use_kernels=use_kernels, kv_cache_dtype="float32")
    assert lm.model.kernels == use_kernels
    return lm


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("use_kernels", [False, True], ids=["torch", "kernels"])
def test_forward_and_engine_match_transformers(checkpoint, source, use_kernels):
    """Full forward; then the engine: a 30-token prompt in chunks of 16 over blocks of 4 (the
    state carried across chunks), 6 decode steps."""
    name, hf_dir, gguf, ref = checkpoint
    lm = _load(hf_dir if source == "hf" else gguf, use_kernels)
    ids = random_ids(40, VOCAB, seed=len(name))
    assert_logits_match(our_logits(lm, ids), hf_logits(ref, ids))
    check_engine(lm, ref, ids[:30], 6)


def test_gguf_reads_the_layer_pattern_and_head_order(checkpoint):
    name, hf_dir, gguf, _ = checkpoint
    a, b = load_model(str(hf_dir), use_kernels=False), load_model(str(gguf), use_kernels=False)
    assert a.config.recurrent is not None
    assert a.config.recurrent.layers == b.config.recurrent.layers
    assert a.config.kv_layout.num_layers == b.config.kv_layout.num_layers
    if name.startswith("qwen35"):  # value heads outnumber q/k heads: the file's order is tiled
        assert (a.config.recurrent.v_heads_tiled, b.config.recurrent.v_heads_tiled) == (False, True)
        assert a.config.rope_dims == b.config.rope_dims == 8
    if name.startswith("lfm2"):
        assert a.config.recurrent.layers == (0, 2, 3)
        assert a.config.kv_layout.num_layers == 2
    moe = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
           "moe_gating", "moe_expert_bias", "moe_shared_expert_size", "moe_dense_layers")  # fmt: skip
    assert [getattr(a.config, f) for f in moe] == [getattr(b.config, f) for f in moe]
    if name == "qwen35_moe":
        assert (a.config.num_experts, a.config.moe_shared_expert_size) == (8, 64)
    if name == "lfm2_moe":  # the first layer dense, sigmoid gating steered by the expert bias
        assert (a.config.moe_dense_layers, a.config.moe_gating) == (1, "sigmoid")
        assert a.config.moe_expert_bias and a.config.intermediate_size == 96


@pytest.mark.parametrize("use_kernels", [False, True], ids=["torch", "kernels"])
def test_preemption_recomputes_the_state(checkpoint, use_kernels):
    """Two requests in a pool too small for both: the newer one is preempted (its state slot
    freed), recomputed from its tokens later, and both still give transformers' logits."""
    name, hf_dir, _, ref = checkpoint
    lm = _load(hf_dir, use_kernels)
    engine = _engine(lm, num_blocks=16)  # 15 usable blocks of 4: 60 tokens for both requests
    prompts = [random_ids(20, VOCAB, seed=s) for s in (1, 2)]
    outs = run_greedy(engine, prompts, 16)
    assert engine.stats().num_preemptions > 0
    assert engine.stats().num_free_state_slots == engine.stats().num_state_slots
    for got, p in zip(outs, prompts, strict=True):
        expected = hf_logits(ref, p + got)[len(p) - 1 : -1]
        assert expected.argmax(-1).tolist() == got


@pytest.mark.parametrize("use_kernels", [False, True], ids=["torch", "kernels"])
def test_a_prefix_hit_resumes_from_a_state_snapshot(checkpoint, use_kernels):
    """A prompt's state is kept at its last full block; a second prompt sharing those tokens
    is served them from the cache (K/V and state) and computes only its own, with
    transformers' logits."""
    name, hf_dir, _, ref = checkpoint
    lm = _load(hf_dir, use_kernels)
    engine = _engine(lm)
    first = random_ids(42, VOCAB, seed=3)  # last full block of 4 ends at 40
    engine_logits(lm, first, 2, engine)
    stats = engine.stats()
    assert stats.num_state_snapshots >= 1 and stats.prefix_cache_hits == 0
    second = first[:40] + random_ids(9, VOCAB, seed=4)
    check_engine(lm, ref, second, 4, engine)
    assert engine.stats().prefix_cache_hits == 40


def test_greedy_32_tokens_equal_transformers_generate(checkpoint):
    """Five prompts batched in the engine (kernels where they run), float32 activations and KV:
    each one's 32 greedy tokens are transformers' generate's."""
    name, hf_dir, _, ref = checkpoint
    lm = load_model(str(hf_dir), activations="float32", kv_cache_dtype="float32")
    prompts = [random_ids(n, VOCAB, seed=10 + n) for n in (3, 11, 17, 26, 40)]
    engine = ContinuousBatchEngine(lm.model, max_batch_size=5, block_size=16)
    outs = run_greedy(engine, prompts, 32)
    with torch.inference_mode():
        for got, p in zip(outs, prompts, strict=True):
            want = ref.generate(
                torch.tensor([p]), max_new_tokens=32, do_sample=False, min_new_tokens=32
            )[0, len(p) :].tolist()
            assert got == want


def sampled_logits(engine, prompts: list[list[int]], n: int) -> list[list[torch.Tensor]]:
    """Every request's logits at each position it sampled, as the runner returned them."""
    got: dict[str, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def recording(rows):
        logits, sampling = execute(rows)
        for row, r in zip(logits, sampling, strict=True):
            got.setdefault(r.state.request_id, []).append(row.clone())
        return logits, sampling

    engine.runner.execute = recording
    reqs = [
        Request(prompt_token_ids=p, params=SamplingParams(max_tokens=n, ignore_eos=True))
        for p in prompts
    ]
    for r in reqs:
        engine.add_request(r)
    with torch.inference_mode():
        while engine.has_work():
            engine.step()
    return [got[r.request_id] for r in reqs]


def test_rows_do_not_depend_on_the_batch(checkpoint):
    """With the kernels, each request's logits batched with others (decode rows together,
    prefill chunks beside them, chunks cut where the budget ends) are the ones it gets alone,
    bit for bit."""
    _, hf_dir, _, _ = checkpoint
    lm = _load(hf_dir, True)
    prompts = [random_ids(n, VOCAB, seed=20 + n) for n in (5, 23, 9, 31)]
    alone = [sampled_logits(_engine(lm, max_batch_size=1), [p], 8)[0] for p in prompts]
    batched = sampled_logits(_engine(lm, max_batch_size=4), prompts, 8)
    for a, b in zip(batched, alone, strict=True):
        assert len(a) == len(b) == 8
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("use_kernels", [False, True], ids=["torch", "kernels"])
def test_disaggregated_engine_hands_the_state_over_with_the_kv(checkpoint, use_kernels):
    """Prefill pool -> decode pool: each request's recurrent state travels with its K/V, and
    the tokens are the continuous engine's."""
    _, hf_dir, _, _ = checkpoint
    lm = _load(hf_dir, use_kernels)
    prompts = [random_ids(n, VOCAB, seed=30 + n) for n in (7, 19, 33)]

    options = dict(max_batch_size=3, block_size=4, max_num_batched_tokens=16, num_blocks=64)
    disagg = DisaggregatedEngine(lm.model, **options)
    assert run_greedy(disagg, prompts, 10) == run_greedy(
        ContinuousBatchEngine(lm.model, **options), prompts, 10
    )
    assert disagg.transfers == len(prompts)
    layout = lm.config.state_layout
    kv = disagg.transferred_bytes - len(prompts) * layout.bytes_per_slot
    assert kv > 0  # (K/V blocks and one state slot a request)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_multimodal_qwen35_directory_loads_its_language_model(tmp_path, moe):
    """model_type "qwen3_5" / "qwen3_5_moe" (image-text): the decoder is its text_config, its
    tensors sit under the language model's prefix, and the vision tower's are left out."""
    import transformers as tf

    if moe:
        config_cls, model_cls, text = (
            tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeForConditionalGeneration, qwen35_moe_config
        )  # fmt: skip
    else:
        config_cls, model_cls, text = (
            tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration, qwen35_config
        )  # fmt: skip
    vision = dict(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64,
        num_position_embeddings=16, patch_size=4,
    )  # fmt: skip
    cfg = config_cls(text_config=text().to_dict(), vision_config=vision)
    torch.manual_seed(0)
    ref = model_cls(cfg).eval()
    randomize_(ref, 5)
    ref.save_pretrained(tmp_path)
    byte_level_tokenizer().save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), use_kernels=False)
    assert lm.config.recurrent is not None and lm.config.recurrent.layers == (0, 1, 2)
    ids = random_ids(30, VOCAB - 8, seed=5)  # (no image or video tokens)
    assert_logits_match(our_logits(lm, ids), hf_logits(ref, ids))
