"""GGUF block formats multiplied in place (`models.ops.ggml_linear`, models/csrc/kquant.cpp).

Every format's decoding against the gguf package's dequantizer (bit for bit); the linear op with
float32 activations against the float matmul of gguf's dequantized weights, and with int8
activations against the float matmul of the rounded activations (the same rounding, done here
in torch); batch invariance; fused projections mixing formats; the epilogues; and a GGUF file in
these formats loading with no float copy of its projections.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from models import kernels, ops
from models.quant import (
    GGML,
    GGML_A8,
    Q4_1,
    Q8_0,
    Q8_0X,
    BlockEmbedding,
    PanelEmbedding,
    QTensor,
    pack,
    pack_rows,
    quantize,
)
from tests.helpers.kquant_rows import GATED, group_of, linear, random_rows, round_activations
from tests.helpers.model_files import random_ids, write_gguf
from tests.helpers.oracles import our_logits

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason=f"CPU kernels unavailable: {kernels.unavailable_reason()}"
)

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
TYPES += [Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4]


@pytest.mark.parametrize("qtype", TYPES)
def test_each_format_decodes_like_ggufs_dequantize(qtype):
    w = random_rows(qtype, 5, 512, seed=int(qtype))
    raw = w.parts[0][1]
    ref = dequantize(raw.numpy(), qtype).reshape(5, 512)
    ids = torch.tensor([[4, 0], [2, 2]])
    got = ops.ggml_rows(raw.reshape(-1), int(qtype), 512, ids)
    assert got.shape == (2, 2, 512)
    assert torch.equal(got, torch.from_numpy(ref)[ids])
    assert torch.equal(w.dequantize(), torch.from_numpy(ref))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m", [1, 3, 6])
def test_float_activations_match_the_matmul_of_the_dequantized_weights(qtype, m):
    torch.manual_seed(m)
    n, k = 37, 512
    w = random_rows(qtype, n, k, seed=m)
    x, bias, res = torch.randn(m, k), torch.randn(n), torch.randn(m, n)
    ref = (x.double() @ w.dequantize().double().T + bias.double() + res.double()).float()
    got = linear(x, pack_rows(w, int8=False), bias, res)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m", [1, 5])
def test_int8_activations_are_the_matmul_of_the_rounded_activations(qtype, m):
    torch.manual_seed(10 + m)
    n, k = 21, 768
    w = random_rows(qtype, n, k, seed=m + 7)
    x = torch.randn(m, k) * torch.linspace(0.1, 4, k)  # blocks of different magnitudes
    wd = w.dequantize().double()
    xq = round_activations(x, group_of(qtype))
    got = linear(x, pack_rows(w, int8=True))
    ref = (xq.double() @ wd.T).float()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-4)
    # ... and within the int8 rounding's own error of the float result
    exact = x.double() @ wd.T
    assert ((got.double() - exact).norm() / exact.norm()).item() < 0.02


B32_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.IQ4_XS]


@pytest.mark.parametrize("qtype", B32_TYPES)
def test_int8_dots_of_32_value_formats_agree_on_the_files_rows_and_unpacked(qtype):
    """Up to 4 activation rows the int8 kernel reads the file's blocks; from 5 it unpacks each
    weight row once for all of them. K = 640 is 20 blocks: the last group of eight is partial
    (IQ4_XS: 768, three 256-value blocks of 8 sub-blocks each). Both paths give the float
    reference, and the same bits for a row whichever path it takes."""
    torch.manual_seed(int(qtype))
    n, k = 19, 768 if qtype == Q.IQ4_XS else 640
    w = random_rows(qtype, n, k, seed=int(qtype) + 1)
    packed = pack_rows(w, int8=True)
    x = torch.randn(6, k) * torch.linspace(0.2, 3, k)
    ref = (round_activations(x, 32).double() @ w.dequantize().double().T).float()
    alone = torch.cat([linear(x[i : i + 1], packed) for i in range(6)])
    torch.testing.assert_close(alone, ref, rtol=1e-5, atol=2e-4)
    for m in (2, 3, 4, 5, 6):
        assert torch.equal(linear(x[:m], packed), alone[:m]), f"M = {m} changed a row"


def test_amx_tiles_are_used_where_the_cpu_has_them():
    """Where the CPU lists AMX-INT8 the kernels ask Linux for the tile state and use it (so the
    batch-invariance test below runs Q4_K / Q5_K's 16-row tiles against the one-row path)."""
    flags = next(
        (
            line.split(":", 1)[1].split()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        ),
        [],
    )
    wanted = "amx_int8" in flags and kernels.has_int8_dot() and os.environ.get("CBSERVE_AMX") != "0"
    assert kernels.has_amx_tiles() == wanted


# Each format's int8 product for several batch sizes, printed as the bytes of its results (run
# here and under ATEN_CPU_CAPABILITY=avx2 by the test below).
_WIDTH_SCRIPT = """
import hashlib, sys, torch
sys.path[:0] = sys.argv[1:2]
from test_kquant import TYPES, linear, random_rows
from models.quant import pack_rows
torch.manual_seed(4)
x = torch.randn(55, 512)
for qtype in TYPES:
    packed = pack_rows(random_rows(qtype, 40, 512, seed=int(qtype)), True)
    outs = [linear(x[:m], packed) for m in (1, 2, 5, 9, 16, 40, 55)]
    print(int(qtype), hashlib.sha256(b"".join(o.numpy().tobytes() for o in outs)).hexdigest())
"""


@pytest.mark.skipif(
    not kernels.has_int8_dot(),
    reason="compares the AVX512-VNNI kernels with the AVX2 ones; this CPU runs the AVX2 ones only",
)
def test_the_avx2_and_avx512_kernels_give_the_same_bits():
    """The panels and decode rows are written once over a vector width (models/csrc/simd.h): the
    256-bit and 512-bit instantiations (and AMX's tiles) sum the same exact integers and take the
    same float steps, so every format's rows are the same bits with the ISA capped at AVX2 as
    on this CPU's own kernels, for every batch size."""
    import subprocess
    import sys

    def run(env: dict[str, str]) -> str:
        cmd = [sys.executable, "-c", _WIDTH_SCRIPT, str(Path(__file__).parent)]
        done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    wide, narrow = run({}), run({"ATEN_CPU_CAPABILITY": "avx2"})
    assert len(wide.splitlines()) == len(TYPES)
    assert wide == narrow


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K])
@pytest.mark.parametrize("act", [0, 1])
def test_a_long_prompts_rows_go_in_blocks_that_keep_every_rows_bits(qtype, act):
    """A call of many int8 rows runs them in blocks that fit L2 (600 rows of 1,024 inputs: three
    blocks of 200, and 2 + 1 in the shifted batch), for plain and gated outputs alike: each row is
    the same bits as computed alone, wherever its block boundary falls."""
    torch.manual_seed(5)
    packed = pack_rows(random_rows(qtype, 48, 1024, seed=6), True)
    x = torch.randn(601, 1024)
    whole = linear(x[:600], packed, act=act)
    shifted = linear(x[1:601], packed, act=act)
    for i in (0, 1, 199, 200, 201, 399, 400, 599):
        alone = linear(x[i : i + 1], packed, act=act)
        assert torch.equal(whole[i : i + 1], alone), f"row {i} changed in a block"
        if i:
            assert torch.equal(shifted[i - 1 : i], alone), f"row {i} changed in the shifted batch"


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("int8", [False, True])
def test_a_rows_result_does_not_depend_on_the_batch_around_it(qtype, int8):
    torch.manual_seed(2)
    packed = pack_rows(random_rows(qtype, 40, 512, seed=3), int8)
    x = torch.randn(55, 512)  # up to 55 rows: three of AMX's 16-row tiles and a VNNI remainder
    alone = torch.cat([linear(x[i : i + 1], packed) for i in range(55)])
    for m in (2, 3, 4, 5, 9, 16, 23, 55):
        batched = torch.cat([linear(x[i : i + m], packed) for i in range(0, 55, m)])
        assert torch.equal(batched, alone), f"batch of {m} changed a row"


@pytest.mark.parametrize("int8", [False, True])
def test_a_fused_projection_of_mixed_formats_is_its_parts_side_by_side(int8):
    """q and k in Q4_K, v in Q6_K (llama.cpp's Q4_K_M does this), and a Q8_0 part."""
    parts = [
        random_rows(Q.Q4_K, 32, 256, seed=1),
        random_rows(Q.Q4_K, 16, 256, seed=2),
        random_rows(Q.Q6_K, 16, 256, seed=3),
        random_rows(Q.Q8_0, 8, 256, seed=4),
    ]
    fused = QTensor.cat(parts)
    assert [t for t, _ in fused.parts] == [Q.Q4_K, Q.Q6_K, Q.Q8_0]  # like formats merge
    x, bias = torch.randn(3, 256), torch.randn(72)
    got = linear(x, pack(fused, int8=int8), bias)
    alone = torch.cat([linear(x, pack_rows(p, int8)) for p in parts], 1) + bias
    torch.testing.assert_close(got, alone, rtol=0, atol=1e-5)
    assert pack(fused, int8=int8).formats().keys() == {
        f"{n}{'+a8' if int8 else ''}" for n in ("q4_k", "q6_k", "q8_0")
    }


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q4_K])
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("act", list(GATED))
@pytest.mark.parametrize("m", [1, 5, 700])
def test_gated_epilogue_matches_torch(qtype, int8, act, m):
    """2 x 203 rows: the gated pass's 8-wide loop and its tail; 700 activation rows: gate and
    up rows taken in several chunks a thread (each chunk's tail too), with a bias."""
    w = random_rows(qtype, 406, 512, seed=5)
    x = torch.randn(m, 512) * 3  # gates well past the activations' bends, both signs
    bias = torch.randn(406)
    packed = pack_rows(w, int8)
    gate, up = linear(x, packed, bias).chunk(2, dim=-1)
    got = linear(x, packed, bias, act=act)
    want = GATED[act](gate) * up
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max())


@pytest.mark.parametrize("kind", [Q8_0, Q4_1])
def test_q8_0_and_q4_1_blocks_as_gguf_rows_compute_the_same_matrix(kind):
    """--quantization q8_0 / q4_1 of float weights, run with int8 activations on AVX2, goes
    through GGUF rows: the same blocks, so the same float matrix."""
    qt = quantize(torch.randn(24, 96) * 0.1, kind)
    assert torch.equal(qt.to_ggml().dequantize(), qt.dequantize())


def test_a_tied_q8_0_table_is_looked_up_from_the_heads_panels(monkeypatch):
    """The AVX512-VNNI head's Q8_0X panels serve the lookup: the same floats as gguf's
    dequantize of the file's rows (the panel layout is torch's work, so any CPU checks it)."""
    from models import quant

    monkeypatch.setattr(quant, "_vnni", lambda: True)
    w = random_rows(Q.Q8_0, 37, 96, seed=3)  # a partial last panel
    head = pack(w, int8=True)
    assert head.kind == Q8_0X
    emb = PanelEmbedding(head, 37)
    ref = torch.from_numpy(dequantize(w.parts[0][1].numpy(), Q.Q8_0).reshape(37, 96))
    ids = torch.tensor([[0, 36, 16], [15, 17, 0]])
    got = emb(ids)
    assert got.shape == (2, 3, 96) and got.dtype == torch.float32
    assert torch.equal(got, ref[ids])
    with pytest.raises(ValueError, match="Q8_0X"):
        PanelEmbedding(pack(w), 37)


def test_legacy_formats_keep_the_float_panels():
    w = random_rows(Q.Q4_0, 16, 64)
    assert pack(w).kind == Q4_1  # float activations: the existing panel kernel
    assert pack(random_rows(Q.Q5_0, 16, 64)).kind == GGML
    if not kernels.has_int8_dot():
        assert pack(w, int8=True).kind == GGML_A8


def test_bad_arguments_are_refused():
    packed = pack_rows(random_rows(Q.Q4_K, 8, 256), False)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        linear(torch.randn(1, 128), packed)
    with pytest.raises(RuntimeError, match="rows, not N"):
        ops.ggml_linear(torch.randn(1, 256), packed.qs, None, packed.m, GGML, 9, None, None, 0)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.ggml_rows(packed.qs, int(Q.Q4_K), 256, torch.tensor([8]))


# -- a GGUF file in these formats -----------------------------------------------------------------


def test_a_gguf_in_k_and_q5_formats_loads_without_float_copies(tmp_path, monkeypatch):
    """A 2-layer Llama GGUF whose tensors rotate through ten formats (so q/k/v and gate/up fuse
    parts of different formats): every projection, the head and the embedding keep the file's
    blocks, float32 activations give the float model's logits, int8 activations stay close."""
    from models import load_model

    monkeypatch.setenv("CBSERVE_MODEL_DIR", str(tmp_path / "cache"))
    types = [Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q8_0, Q.IQ4_NL, Q.IQ4_XS, Q.Q3_K, Q.Q2_K]
    path = write_gguf(tmp_path / "kquant.gguf", types)
    reference = load_model(str(path), use_kernels=False)
    ids = random_ids(24, reference.config.vocab_size, seed=5)
    ref = our_logits(reference, ids)
    for activations in ("float32", "auto"):
        lm = load_model(str(path), activations=activations)
        formats = lm.model.weight_formats()
        suffix = "+a8" if activations == "auto" else ""
        names = ("q4_k", "q6_k", "q5_0", "q5_1", "q5_k", "iq4_nl", "iq4_xs", "q3_k", "q2_k")
        assert set(formats) >= {f"{n}{suffix}" for n in names}
        assert not any(n.startswith(("f32", "float")) for n in formats), formats
        assert isinstance(lm.model.embed_tokens, BlockEmbedding)  # no float table either
        got = our_logits(lm, ids)
        if activations == "float32":
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-3)
        else:
            assert float(F.cosine_similarity(got, ref, dim=-1).min()) > 0.99


@pytest.mark.slow
def test_smollm2_with_int8_activations_on_gguf_rows_stays_close_to_float_activations(
    smollm2_file,
):
    """--activation-dtype int8 without AVX512-VNNI: SmolLM2's Q4_1 / Q8_0 blocks as GGUF rows
    through the vpmaddubsw kernel. Logits highly correlated with float32 activations', and the
    same greedy token wherever float32's best two are not near a tie (int8 activations move a
    logit by up to ~0.35 on these texts, so a near-tie may go either way)."""
    from models import load_model

    if kernels.has_int8_dot():
        pytest.skip("with AVX512-VNNI int8 activations take the VNNI panels (test_kernels.py)")
    texts = ["The capital of France is", "Once upon a time, there was a little"]
    outs = []
    for activations in ("float32", "int8"):
        lm = load_model("smollm2-135m-instruct", activations=activations)
        outs.append([our_logits(lm, lm.tokenizer.encode(t)) for t in texts])
    assert set(lm.model.weight_formats()) == {"q4_1+a8", "q8_0+a8"}
    for flt, i8 in zip(*outs, strict=True):
        top2 = flt.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > 0.4
        assert clear.float().mean() >= 0.7  # most positions are compared
        assert torch.equal(flt.argmax(-1)[clear], i8.argmax(-1)[clear])
        assert float(F.cosine_similarity(flt, i8, dim=-1).min()) > 0.99
