"""Every cbserve op through `torch.library.opcheck`, and the two sides' integer codes.

opcheck runs an op with its schema checked against what it does (an argument written in place must
be declared `Tensor(a!)`, an undeclared write or alias fails), its fake implementation
(`models.ops`) against the real output's shape and dtype, and under AOT dispatch with dynamic
shapes. Small shapes: each case runs the op a handful of times.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from models import kernels, ops
from models.quant import F32, Q4_1, Q8_0, GGMLTensor, pack, pack_rows, quantize
from tests.helpers.kquant_rows import moe_weights, routes

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason=f"CPU kernels unavailable: {kernels.unavailable_reason()}"
)
OP = ops.overloads() if kernels.available() else {}


def test_every_op_in_the_library_is_wrapped_and_checked_here():
    in_library = {
        name.split("::")[1]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("cbserve::")
    }
    assert in_library == set(OP)
    checked = {
        "packed_linear",
        "ggml_linear",
        "ggml_rows",
        "moe_experts",
        "rms_norm",
        "head_rms_norm",
        "argmax_rows",
        "top_candidates",
        "attention",
        "decoder_layers",
        "has_int8_dot",
        "has_amx_tiles",
        "enum_values",
        "causal_conv1d",
        "gated_delta_rule",
        "mamba2_scan",
    }
    assert checked == set(OP), "a new op needs its opcheck case below"


def test_python_and_cpp_agree_on_every_code():
    enums = (ops.Kind, ops.Act, ops.Layer)
    want = {f"{enum.__name__}.{m.name}": int(m) for enum in enums for m in enum}
    assert ops.enum_values() == want


def _linear_args(kind: int, act: int, m: int = 3, with_extras: bool = True) -> tuple:
    torch.manual_seed(kind)
    n, k = 48, 64
    packed = pack(quantize(torch.randn(n, k) * 0.1, kind), gate_up=act != ops.Act.NONE)
    bias = torch.randn(n) if with_extras else None
    residual = torch.randn(m, n) if with_extras and act == ops.Act.NONE else None
    return (torch.randn(m, k), packed.qs, packed.d, packed.m, packed.kind, n, bias, residual, act)


@pytest.mark.parametrize("kind", [F32, Q8_0, Q4_1])
@pytest.mark.parametrize("act", list(ops.Act))
def test_packed_linear_opcheck(kind, act):
    torch.library.opcheck(OP["packed_linear"], _linear_args(kind, act))


@pytest.mark.skipif(not kernels.has_int8_dot(), reason="this CPU has no AVX512-VNNI")
@pytest.mark.parametrize("kind", [Q8_0, Q4_1])
def test_packed_linear_int8_activations_opcheck(kind):
    torch.manual_seed(kind)
    packed = pack(quantize(torch.randn(32, 64) * 0.1, kind), int8=True)
    args = (torch.randn(5, 64), packed.qs, packed.d, packed.m, packed.kind, 32, None, None, 0)
    torch.library.opcheck(OP["packed_linear"], args)


def _gguf_rows(n: int, k: int) -> GGMLTensor:
    """Q4_K rows (the commonest K-quant) as gguf's own quantizer would not write them: any bytes
    are a valid block once its two fp16 scales are finite."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    raw[..., 0:4] = np.full((n, k // 256, 2), 0.004, np.float16).view(np.uint8)
    return GGMLTensor([(int(GGMLQuantizationType.Q4_K), torch.from_numpy(raw.reshape(n, -1)))], k)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("act", list(ops.Act))
def test_ggml_linear_opcheck(int8, act):
    packed = pack_rows(_gguf_rows(32, 256), int8)
    bias = torch.randn(32)
    residual = torch.randn(3, 32) if act == ops.Act.NONE else None
    args = (
        torch.randn(3, 256),
        packed.qs,
        packed.d,
        packed.m,
        packed.kind,
        32,
        bias,
        residual,
        act,
    )
    torch.library.opcheck(OP["ggml_linear"], args)


@pytest.mark.parametrize("int8", [False, True])
def test_moe_experts_opcheck(int8):
    fused, _ = moe_weights(4, 256, 256, 256, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K)
    ids, weights = routes(3, 4, 2, seed=0)
    kind = ops.Kind.GGML_A8 if int8 else ops.Kind.GGML
    args = (torch.randn(3, 256), ids, weights, *fused, kind, ops.Act.SILU_MUL)
    torch.library.opcheck(OP["moe_experts"], args)


@pytest.mark.parametrize("int8", [False, True])
def test_moe_experts_with_biases_and_mxfp4_opcheck(int8):
    """gpt-oss's experts: MXFP4 rows, biases, the clamped SwiGLU."""
    from tests.helpers.kquant_rows import moe_weights, routes

    mx = GGMLQuantizationType.MXFP4
    fused, _ = moe_weights(4, 64, 32, 64, mx, mx)
    ids, weights = routes(3, 4, 2, seed=0)
    kind = ops.Kind.GGML_A8 if int8 else ops.Kind.GGML
    biases = (torch.randn(4, 64), torch.randn(4, 64))
    args = (torch.randn(3, 64), ids, weights, *fused, kind, ops.Act.SWIGLU_OAI, *biases)
    torch.library.opcheck(OP["moe_experts"], args)


def test_ggml_rows_opcheck():
    table = _gguf_rows(10, 256)
    ((typ, raw),) = table.parts
    args = (raw.reshape(-1), typ, 256, torch.tensor([[3, 0], [9, 3]]))
    torch.library.opcheck(OP["ggml_rows"], args)


def test_rms_norm_opcheck():
    torch.library.opcheck(OP["rms_norm"], (torch.randn(4, 40), torch.randn(40), 1e-5))
    x = torch.randn(4, 40)
    torch.library.opcheck(OP["rms_norm"], (x, torch.randn(40), 1e-5, torch.randn(4, 40)))


def test_head_rms_norm_opcheck():
    qkv = torch.randn(3, 5 * 16)  # 3 q/k heads normed, 2 v heads left
    torch.library.opcheck(OP["head_rms_norm"], (qkv, torch.randn(3, 16), 16, 1e-6))


# Two sequences of a step (4 tokens from slot 0, 3 from slot 1), the first snapshotting its state
# after 2 tokens into slot 2: rows [first token, tokens, slot] and [sequence, after, slot].
SEQS = torch.tensor([[0, 4, 0], [4, 3, 1]])
SNAPSHOTS = torch.tensor([[0, 2, 2]])


@pytest.mark.parametrize("silu", [False, True])
def test_causal_conv1d_opcheck(silu):
    x, weight, bias = torch.randn(7, 16), torch.randn(16, 4), torch.randn(16)
    conv_pool = torch.randn(3, 3, 16)  # (slots, K - 1, C): the inputs each slot keeps
    torch.library.opcheck(OP["causal_conv1d"], (x, weight, bias, conv_pool, SEQS, SNAPSHOTS, silu))
    torch.library.opcheck(OP["causal_conv1d"], (x, weight, None, conv_pool, SEQS, SNAPSHOTS, silu))


@pytest.mark.parametrize("tiled", [False, True])
def test_gated_delta_rule_opcheck(tiled):
    q, k = torch.randn(7, 2, 8), torch.randn(7, 2, 8)  # two q/k heads for four value heads
    v, g, beta = torch.randn(7, 4, 8), -torch.rand(7, 4), torch.rand(7, 4)
    ssm_pool = torch.randn(3, 4, 8, 8)  # (slots, value heads, dk, dv)
    args = (q, k, v, g, beta, ssm_pool, SEQS, SNAPSHOTS, tiled)
    torch.library.opcheck(OP["gated_delta_rule"], args)


def test_mamba2_scan_opcheck():
    x, dt = torch.randn(7, 4, 8), torch.randn(7, 4)  # four heads of 8 over two groups
    b, c = torch.randn(7, 2, 16), torch.randn(7, 2, 16)
    a, d, dt_bias = -torch.rand(4) - 0.5, torch.randn(4), torch.randn(4)
    ssm_pool = torch.randn(3, 4, 8, 16)  # (slots, heads, head_dim, N)
    args = (x, dt, a, b, c, d, dt_bias, ssm_pool, SEQS, SNAPSHOTS)
    torch.library.opcheck(OP["mamba2_scan"], args)


def test_argmax_rows_opcheck():
    torch.library.opcheck(OP["argmax_rows"], (torch.randn(3, 100),))


def test_top_candidates_opcheck():
    args = (torch.randn(3, 100), torch.tensor([0.5, 0.0, 1.0]), 16)
    torch.library.opcheck(OP["top_candidates"], args)


def test_scalar_ops_opcheck():
    torch.library.opcheck(OP["has_int8_dot"], ())
    torch.library.opcheck(OP["has_amx_tiles"], ())
    # AOT dispatch's output comparison handles no strings: the other checks only
    torch.library.opcheck(
        OP["enum_values"],
        (),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


def _attention_args(pool_dtype: torch.dtype, decode: bool, window: int = 0) -> tuple:
    """Two decode rows, or a prefill chunk with a past, over a small pool."""
    torch.manual_seed(7)
    h, kvh, d, bs, nb = 4, 2, 32, 4, 8
    width = d + d // 8 if pool_dtype == torch.int8 else d
    kc = torch.zeros(nb, bs, kvh, width, dtype=pool_dtype)
    vc = torch.zeros_like(kc)
    if decode:
        t, nd = 2, 2
        tables, lens = torch.tensor([[1, 2], [3, 0]]), torch.tensor([6, 2])
        slots = torch.tensor([2 * bs + 1, 3 * bs + 1])  # positions 5 and 1
        chunk_meta, chunk_tables = (
            torch.empty(0, 3, dtype=torch.long),
            torch.empty(0, 1, dtype=torch.long),
        )
    else:
        t, nd = 3, 0
        tables, lens = torch.empty(0, 1, dtype=torch.long), torch.empty(0, dtype=torch.long)
        slots = torch.tensor([4 * bs + 2, 4 * bs + 3, 5 * bs])
        chunk_meta, chunk_tables = torch.tensor([[0, 3, 5]]), torch.tensor([[4, 5]])
    qkv = torch.randn(t, (h + 2 * kvh) * d)
    cos, sin = torch.randn(t, d // 2), torch.randn(t, d // 2)
    args = (
        qkv,
        cos,
        sin,
        kc,
        vc,
        slots,
        nd,
        tables,
        lens,
        chunk_meta,
        chunk_tables,
        h,
        kvh,
        d,
        d**-0.5,
    )
    return args + ((window,) if window else ())


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("window", [0, 2])
def test_attention_opcheck(pool_dtype, decode, window):
    torch.library.opcheck(OP["attention"], _attention_args(pool_dtype, decode, window))


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_attention_with_sinks_opcheck(pool_dtype, decode):
    args = _attention_args(pool_dtype, decode, 2)
    torch.library.opcheck(OP["attention"], (*args, False, 0.0, torch.randn(4)))


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_decoder_layers_opcheck(decode):
    """TinyGPT's six layers (q8_0 projections) over small float16 pools: two decode rows, or a
    prefill chunk with a past."""
    from models import load_model

    model = load_model("tinygpt", quantization="q8_0").model
    weights, layout = model._plan
    c = model.config
    qkv, cos, sin, kc, vc, slots, nd, tables, lens, chunk_meta, chunk_tables, *_ = _attention_args(
        torch.float16, decode
    )
    shape = (kc.shape[0], kc.shape[1], c.num_kv_heads, c.head_dim)
    pools = [torch.zeros(shape, dtype=torch.float16) for _ in range(2 * c.num_layers)]
    half = (qkv.shape[0], c.head_dim // 2)
    cos, sin = torch.randn(half), torch.randn(half)
    args = (
        torch.randn(qkv.shape[0], c.hidden_size), weights, layout, pools[: c.num_layers],
        pools[c.num_layers :], cos, sin, cos, sin, slots, nd, tables, lens, chunk_meta,
        chunk_tables, c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim**-0.5, c.rms_norm_eps,
        model.norm.weight,
    )  # fmt: skip
    torch.library.opcheck(OP["decoder_layers"], args)
