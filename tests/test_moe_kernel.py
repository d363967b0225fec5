"""`ops.moe_experts` (models/csrc/moe.cpp), a mixture of experts' experts in one op, against the
same experts one at a time through `ggml_linear` (the arithmetic it must repeat, up to the last
multiply-add's rounding) and against the float reference of their blocks (gguf's dequantize);
a token's result alone and in any batch, bit for bit; bad tables refused. (Its opcheck:
tests/test_kernels_opcheck.py; the Qwen3-MoE model around it: tests/test_models_arch.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from models import kernels, ops
from models.ops import Act, Kind
from tests.helpers.kquant_rows import moe_weights, routes

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason=f"CPU kernels unavailable: {kernels.unavailable_reason()}"
)


def one_by_one(x, ids, weights, fused, kind):
    """Each token's experts in id order, each through `ggml_linear` (gated, then down)."""
    qs, gu, gu_index, dn, dn_index, d = fused
    out = torch.zeros(x.shape[0], d)
    for t in range(x.shape[0]):
        for j in sorted(range(ids.shape[1]), key=lambda j: int(ids[t, j])):
            e = int(ids[t, j])
            g = gu[gu_index[e] : gu_index[e + 1]]
            n = int(g[:, 1].sum())
            h = ops.ggml_linear(x[t : t + 1], qs, None, g, kind, n, act=Act.SILU_MUL)
            down = dn[dn_index[e] : dn_index[e + 1]]
            out[t] += weights[t, j] * ops.ggml_linear(h, qs, None, down, kind, d)[0]
    return out


CASES = [  # (gate/up format, down format, in, expert size, out): Qwen3-MoE's Q4_K_M mixes
    (Q.Q4_K, Q.Q6_K, 512, 256, 256),
    (Q.Q4_K, Q.Q4_K, 256, 256, 512),
    (Q.Q8_0, Q.Q5_0, 64, 32, 64),
]


@pytest.mark.parametrize("kind", [Kind.GGML, Kind.GGML_A8], ids=["f32-acts", "int8-acts"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].name}-{c[1].name}-{c[2]}")
def test_the_op_is_each_expert_through_ggml_linear(case, kind):
    up_type, down_type, k, f, d = case
    fused, _ = moe_weights(6, k, f, d, up_type, down_type)
    for t, top_k in ((1, 2), (5, 3), (40, 2)):  # 40 x 2 pairs: experts with many rows (panels)
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
        ids, weights = routes(t, 6, top_k, seed=t)
        got = ops.moe_experts(x, ids, weights, *fused, kind, Act.SILU_MUL)
        want = one_by_one(x, ids, weights, fused, kind)
        # (the op's last multiply-add may round once where torch rounds twice)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].name}-{c[1].name}-{c[2]}")
def test_float_activations_give_the_dequantized_experts(case):
    up_type, down_type, k, f, d = case
    fused, experts = moe_weights(4, k, f, d, up_type, down_type)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(1))
    ids, weights = routes(7, 4, 2, seed=2)
    got = ops.moe_experts(x, ids, weights, *fused, Kind.GGML, Act.SILU_MUL)
    want = torch.zeros(7, d, dtype=torch.float64)
    xd = x.double()
    for t in range(7):
        for j in range(2):
            gate_up, down = experts[int(ids[t, j])]
            g, u = (xd[t] @ gate_up.dequantize().double().T).chunk(2)
            want[t] += weights[t, j] * (down.dequantize().double() @ (F.silu(g) * u))
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("kind", [Kind.GGML, Kind.GGML_A8], ids=["f32-acts", "int8-acts"])
def test_a_token_gives_the_same_bits_alone_and_in_any_batch(kind):
    fused, _ = moe_weights(8, 256, 256, 256, Q.Q4_K, Q.Q6_K)
    x = torch.randn(24, 256, generator=torch.Generator().manual_seed(3))
    ids, weights = routes(24, 8, 3, seed=4)
    batch = ops.moe_experts(x, ids, weights, *fused, kind, Act.SILU_MUL)
    for i in range(24):
        alone = ops.moe_experts(x[i : i + 1], ids[i : i + 1], weights[i : i + 1], *fused, kind, 1)
        assert torch.equal(alone, batch[i : i + 1])
    part = ops.moe_experts(x[5:17], ids[5:17], weights[5:17], *fused, kind, Act.SILU_MUL)
    assert torch.equal(part, batch[5:17])


def test_bad_ids_and_tables_are_refused():
    fused, _ = moe_weights(3, 64, 32, 64, Q.Q8_0, Q.Q8_0)
    qs, gu, gu_index, dn, dn_index, d = fused
    x = torch.randn(2, 64)
    ids, weights = routes(2, 3, 2, seed=0)
    with pytest.raises(RuntimeError, match="expert id 3 outside"):
        ops.moe_experts(x, ids.clone().fill_(3), weights, *fused, Kind.GGML_A8, Act.SILU_MUL)
    short = qs[: qs.numel() // 2]
    with pytest.raises(RuntimeError, match="lies outside qs"):
        ops.moe_experts(x, ids, weights, short, gu, gu_index, dn, dn_index, d, Kind.GGML, 1)
    with pytest.raises(RuntimeError, match="not 32"):
        ops.moe_experts(x, ids, weights, qs, gu, gu_index, dn, dn_index, 32, Kind.GGML, 1)
    with pytest.raises(RuntimeError, match="gated"):
        ops.moe_experts(x, ids, weights, *fused, Kind.GGML, Act.NONE)


@pytest.mark.parametrize("kind", [Kind.GGML, Kind.GGML_A8], ids=["f32-acts", "int8-acts"])
@pytest.mark.parametrize("act", [Act.SILU_MUL, Act.SWIGLU_OAI])
def test_expert_biases_and_the_clamped_swiglu(kind, act):
    """gpt-oss's experts: MXFP4 gate/up and down with a bias each (gate/up's added before the
    act, down's before the router weight), the clamped SwiGLU: each token's experts one by one
    through `ggml_linear` with those biases, and the tokens' bits alone and in a batch."""
    n_experts, k, f, d = 5, 96, 64, 96
    fused, _ = moe_weights(n_experts, k, f, d, Q.MXFP4, Q.MXFP4, seed=11)
    qs, gu, gu_index, dn, dn_index, _ = fused
    g = torch.Generator().manual_seed(12)
    gate_up_bias, down_bias = torch.randn(n_experts, 2 * f, generator=g), torch.randn(n_experts, d)
    x = 3 * torch.randn(19, k, generator=g)  # large enough that the clamps at 7 bite
    ids, weights = routes(19, n_experts, 2, seed=13)
    got = ops.moe_experts(x, ids, weights, *fused, kind, act, gate_up_bias, down_bias)
    want = torch.zeros(19, d)
    for t in range(19):
        for j in sorted(range(2), key=lambda j: int(ids[t, j])):
            e = int(ids[t, j])
            rows = gu[gu_index[e] : gu_index[e + 1]]
            h = ops.ggml_linear(x[t : t + 1], qs, None, rows, kind, 2 * f, gate_up_bias[e], act=act)
            down = dn[dn_index[e] : dn_index[e + 1]]
            want[t] += weights[t, j] * ops.ggml_linear(h, qs, None, down, kind, d, down_bias[e])[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    without = ops.moe_experts(x, ids, weights, *fused, kind, act)
    assert (without - got).abs().max() > 0.1  # the biases matter
    for i in (0, 7, 18):
        one = ops.moe_experts(x[i : i + 1], ids[i : i + 1], weights[i : i + 1], *fused, kind, act,
                              gate_up_bias, down_bias)  # fmt: skip
        assert torch.equal(one, got[i : i + 1])
    with pytest.raises(RuntimeError, match="gate_up_bias must be"):
        ops.moe_experts(x, ids, weights, *fused, kind, act, down_bias, down_bias)
