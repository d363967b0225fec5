"""MXFP4 (ggml type 39, gpt-oss's expert weights) multiplied in place: models/csrc/kquant_mxfp4.cpp
(int8 activations) and kquant.cpp's float path, against the gguf package's dequantizer (the
oracle: bit for bit for the decoding, the float matmul of the dequantized weights and the rounded
activations for the dots); a row's bits whatever the batch, pass lane or fused part around it;
and the reference quantizer (`models.gguf_quantize`) against gguf's own.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize

from models import kernels, ops
from models.gguf_quantize import mix_types, quantize
from models.quant import GGMLTensor, pack_rows
from tests.helpers.kquant_rows import linear, random_rows, round_activations

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason=f"CPU kernels unavailable: {kernels.unavailable_reason()}"
)


def mxfp4_rows(
    n: int, k: int, seed: int = 0, exponents: tuple[int, int] = (118, 130)
) -> GGMLTensor:
    """n rows of k values: random nibbles, scale exponents in `exponents` (2^(e - 128))."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(*exponents, (n, k // 32), dtype=np.uint8)
    return GGMLTensor([(int(Q.MXFP4), torch.from_numpy(raw.reshape(n, -1)))], k)


def reference(x: torch.Tensor, w: GGMLTensor) -> torch.Tensor:
    """The dequantized rows times the activations rounded as the int8 dots take them (per 32)."""
    return (round_activations(x, 32).double() @ w.dequantize().double().T).float()


def test_blocks_decode_like_ggufs_dequantize_denormal_scales_included():
    # exponents 0 and 1 are the denormal scales 2^-128 and 2^-127; 254: 2^126
    w = mxfp4_rows(6, 256, seed=1, exponents=(0, 3))
    w.parts[0][1].view(6, 8, 17)[0, :, 0] = torch.tensor([0, 1, 2, 127, 128, 200, 254, 30])
    raw = w.parts[0][1]
    ref = torch.from_numpy(dequantize(raw.numpy(), Q.MXFP4).reshape(6, 256))
    assert torch.equal(w.dequantize(), ref)
    ids = torch.tensor([[5, 0], [3, 3]])
    assert torch.equal(ops.ggml_rows(raw.reshape(-1), int(Q.MXFP4), 256, ids), ref[ids])


@pytest.mark.parametrize("m", [1, 3, 7])
def test_float_activations_match_the_matmul_of_the_dequantized_weights(m):
    n, k = 29, 320
    w = mxfp4_rows(n, k, seed=m)
    x, bias, res = torch.randn(m, k), torch.randn(n), torch.randn(m, n)
    want = (x.double() @ w.dequantize().double().T + bias.double() + res.double()).float()
    got = linear(x, pack_rows(w, int8=False), bias, res)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_int8_activations_keep_each_rows_bits_in_every_batch_and_lane():
    """29 weight rows (three passes of eight and a partial one), K = 2880 (gpt-oss's width: 90
    blocks); batches of 1 (the file's rows as they are) and more (passes unpacked) give every
    row the bits it has alone, and those bits are the oracle's up to float rounding."""
    n, k = 29, 2880
    w = mxfp4_rows(n, k, seed=4)
    x = torch.randn(41, k) * torch.linspace(0.3, 3, k)
    packed = pack_rows(w, int8=True)
    alone = torch.cat([linear(x[i : i + 1], packed) for i in range(len(x))])
    torch.testing.assert_close(alone, reference(x, w), rtol=1e-5, atol=1e-4)
    for start, size in ((0, 2), (3, 5), (0, 41), (7, 33)):
        assert torch.equal(linear(x[start : start + size], packed), alone[start : start + size])
    # a row moved to another lane (the matrix without its first 3 rows) keeps its bits
    shifted = pack_rows(GGMLTensor([(int(Q.MXFP4), w.parts[0][1][3:].contiguous())], k), True)
    for size in (1, 6):
        assert torch.equal(linear(x[:size], shifted), alone[:size, 3:])


@pytest.mark.parametrize("act", [ops.Act.SILU_MUL, ops.Act.SWIGLU_OAI])
def test_a_fused_mxfp4_and_q8_0_gated_weight(act):
    """[gate; up] whose gate is 13 MXFP4 rows then 11 Q8_0 (the formats meeting inside a pass)
    and whose up is MXFP4: every part's tile takes its share, the act applied in the epilogue."""
    from models.decoder import gated_act

    k = 256
    gate = GGMLTensor.cat([mxfp4_rows(13, k, seed=7), random_rows(Q.Q8_0, 11, k, seed=8)])
    up = mxfp4_rows(24, k, seed=9)
    packed = pack_rows(GGMLTensor.cat([gate, up]), int8=True)
    x, bias = torch.randn(9, k) * 2, torch.randn(48)
    g, u = linear(x, packed, bias).chunk(2, dim=-1)
    want = gated_act(act, g, u)
    got = linear(x, packed, bias, act=act)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    for i in range(9):
        assert torch.equal(linear(x[i : i + 1], packed, bias, act=act), got[i : i + 1])


def test_the_reference_quantizer_writes_ggufs_blocks():
    """`models.gguf_quantize`'s MXFP4 (llama.cpp's quantize_row_mxfp4_ref, as `llama-quantize`
    runs it) byte for byte against the gguf package's, zeros and tiny blocks included."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 512)) * rng.uniform(1e-3, 10, (64, 1))).astype(np.float32)
    x[0, :32] = 0  # an all-zero block: e = 0
    x[1, :32] = 1e-30  # a block whose scale is denormal
    ours = quantize(x, Q.MXFP4)
    assert ours.shape == (64, 512 // 32 * 17)
    assert np.array_equal(ours, gguf_quantize(x, Q.MXFP4))
    back = dequantize(ours, Q.MXFP4).reshape(x.shape)
    # within half a level of the largest values' step: 2^(e - 128) * 2 at most
    assert np.abs(back - x).max() <= np.abs(x).max() / 4


def test_mxfp4_moe_mixes_experts_mxfp4_and_the_rest_q8_0():
    f16, f32 = Q.F16, Q.F32
    tensors = {
        "token_embd.weight": ((300, 64), f16),
        "output.weight": ((300, 64), f16),
        "blk.0.attn_q.weight": ((64, 64), f16),
        "blk.0.attn_sinks.weight": ((4,), f32),
        "blk.0.ffn_gate_inp.weight": ((4, 64), f32),
        "blk.0.ffn_gate_exps.weight": ((4, 32, 64), f16),
        "blk.0.ffn_gate_exps.bias": ((4, 32), f32),
        "blk.0.ffn_down_exps.weight": ((4, 64, 32), f16),
        "blk.0.attn_norm.weight": ((64,), f32),
    }
    types = mix_types(tensors, "MXFP4_MOE")
    assert types == {
        "token_embd.weight": Q.Q8_0,
        "output.weight": Q.Q8_0,
        "blk.0.attn_q.weight": Q.Q8_0,
        "blk.0.attn_sinks.weight": f32,
        "blk.0.ffn_gate_inp.weight": f32,
        "blk.0.ffn_gate_exps.weight": Q.MXFP4,
        "blk.0.ffn_gate_exps.bias": f32,
        "blk.0.ffn_down_exps.weight": Q.MXFP4,
        "blk.0.attn_norm.weight": f32,
    }
