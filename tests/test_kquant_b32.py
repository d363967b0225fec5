"""The register tiling of the 32-value formats' int8 dots (models/csrc/kquant_b32.cpp).

Weight rows go eight to a panel (a float lane each) and activation rows up to four to a micro-tile;
one activation row takes its own path, 2..4 rows the panels a few blocks at a time, more a tile of
whole panels (on AVX512-VNNI CPUs: kquant_b32_vnni.cpp's panels of 16 weight rows met by 8
activation rows at a time). Every test here puts rows in partial panels and partial micro-tiles and
checks two things: the result is gguf's dequantized weights times the rounded activations (the
oracle), and a row's bits do not depend on the batch, the panel lane or the fused part around it.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from models import kernels
from models.quant import GGMLTensor, pack_rows
from tests.helpers.kquant_rows import GATED, group_of, linear, random_rows, round_activations

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason=f"CPU kernels unavailable: {kernels.unavailable_reason()}"
)

# IQ4_XS: 256-value blocks whose eight 32-value sub-blocks the same tiles take one by one
B32_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.IQ4_XS]
BATCHES = (1, 4, 5, 7, 8, 33, 64)


def reference(x: torch.Tensor, w: GGMLTensor) -> torch.Tensor:
    """Each part's dequantized rows times the activations rounded as its format's dots take them."""
    outs = []
    for t, raw in w.parts:
        part = GGMLTensor([(t, raw)], w.in_features).dequantize().double()
        outs.append(round_activations(x, group_of(Q(t))).double() @ part.T)
    return torch.cat(outs, dim=1).float()


def check_batches(w: GGMLTensor, x: torch.Tensor) -> torch.Tensor:
    """Every batch size in BATCHES (from offsets 0 and 3, so a row meets different micro-tile
    slots) gives each row the bits it has alone; the rows alone match the oracle."""
    packed = pack_rows(w, int8=True)
    alone = torch.cat([linear(x[i : i + 1], packed) for i in range(x.shape[0])])
    torch.testing.assert_close(alone, reference(x, w), rtol=1e-5, atol=2e-4)
    for m in BATCHES:
        for start in (0, 3):
            if start + m <= x.shape[0]:
                got = linear(x[start : start + m], packed)
                assert torch.equal(got, alone[start : start + m]), (
                    f"M = {m} from row {start} changed a row"
                )
    return alone


@pytest.mark.parametrize("qtype", B32_TYPES)
def test_partial_panels_and_micro_tiles_keep_each_rows_bits(qtype):
    """27 weight rows: three panels and a partial one; K = 640 is 20 blocks (not a multiple of 8;
    IQ4_XS: 1280, five blocks of eight sub-blocks)."""
    torch.manual_seed(int(qtype))
    n, k = 27, 1280 if qtype == Q.IQ4_XS else 640
    w = random_rows(qtype, n, k, seed=int(qtype) + 11)
    x = torch.randn(67, k) * torch.linspace(0.2, 3, k)
    alone = check_batches(w, x)
    # A weight row moved to another lane (the matrix without its first 3 rows) keeps its bits.
    t, raw = w.parts[0]
    shifted = pack_rows(GGMLTensor([(t, raw[3:].contiguous())], k), int8=True)
    for m in (1, 3, 9):
        assert torch.equal(linear(x[:m], shifted), alone[:m, 3:])


@pytest.mark.parametrize("k", [32, 640])
@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q8_0, Q.Q4_1])
def test_one_block_rows_and_twenty_block_rows(qtype, k):
    torch.manual_seed(k)
    w = random_rows(qtype, 13, k, seed=k + int(qtype))
    check_batches(w, torch.randn(40, k))


def test_a_fused_iq4_xs_and_q5_k_weight_splits_mid_panel():
    """llama-quantize's IQ4_XS gives q and k IQ4_XS and some layers' v Q5_K: 13 rows of the
    32-value family's tiles then 11 of the K family's, meeting inside a panel of eight."""
    torch.manual_seed(6)
    k = 512
    a, b = random_rows(Q.IQ4_XS, 13, k, seed=23), random_rows(Q.Q5_K, 11, k, seed=24)
    fused = GGMLTensor.cat([a, b])
    assert [t for t, _ in fused.parts] == [Q.IQ4_XS, Q.Q5_K]
    check_batches(fused, torch.randn(40, k) * torch.linspace(0.5, 2, k))


def test_a_fused_q5_0_and_q8_0_weight_splits_mid_panel():
    """13 Q5_0 rows then 11 Q8_0 rows: the formats meet inside a panel of eight."""
    torch.manual_seed(5)
    k = 640
    a, b = random_rows(Q.Q5_0, 13, k, seed=21), random_rows(Q.Q8_0, 11, k, seed=22)
    fused = GGMLTensor.cat([a, b])
    x = torch.randn(40, k) * torch.linspace(0.5, 2, k)
    alone = check_batches(fused, x)
    for m in (1, 4, 33):
        side_by_side = torch.cat(
            [linear(x[:m], pack_rows(a, int8=True)), linear(x[:m], pack_rows(b, int8=True))], dim=1
        )
        assert torch.equal(alone[:m], side_by_side)


@pytest.mark.parametrize("qtype", B32_TYPES)
def test_many_outputs_and_activation_rows_keep_each_rows_bits(qtype):
    """150 weight rows: several tiles of panels and a partial last panel (150 = 9 x 16 + 6);
    K = 96, three blocks (an odd count; IQ4_XS: 512, two blocks of eight); up to 130 activation
    rows, more than 8 micro-tiles and not a multiple of 8."""
    torch.manual_seed(int(qtype) + 100)
    k = 512 if qtype == Q.IQ4_XS else 96
    w = random_rows(qtype, 150, k, seed=int(qtype) + 31)
    x = torch.randn(133, k) * torch.linspace(0.3, 2, k)
    alone = check_batches(w, x)
    packed = pack_rows(w, int8=True)
    for m, start in ((130, 0), (101, 3), (17, 116)):
        assert torch.equal(linear(x[start : start + m], packed), alone[start : start + m])


@pytest.mark.parametrize("act", list(GATED))
def test_a_gated_weight_of_fused_parts_keeps_each_rows_bits(act):
    """[gate; up] of 40 + 40 rows whose parts (Q5_0 17 rows, Q8_0 23, then IQ4_NL 40) meet inside
    panels: the gated pass hands each part's tile its chunk of outputs with y based at the chunk's
    first output, and every batch gives a row the bits it has alone."""
    torch.manual_seed(8)
    k = 320
    gate = GGMLTensor.cat(
        [random_rows(Q.Q5_0, 17, k, seed=41), random_rows(Q.Q8_0, 23, k, seed=42)]
    )
    up = random_rows(Q.IQ4_NL, 40, k, seed=43)
    packed = pack_rows(GGMLTensor.cat([gate, up]), int8=True)
    x = torch.randn(140, k) * 2
    bias = torch.randn(80)
    alone = torch.cat([linear(x[i : i + 1], packed, bias, act=act) for i in range(x.shape[0])])
    g, u = linear(x, packed, bias).chunk(2, dim=-1)
    want = GATED[act](g) * u
    torch.testing.assert_close(alone, want, rtol=1e-5, atol=1e-6 * want.abs().max())
    for m, start in ((5, 0), (9, 3), (64, 7), (140, 0)):
        assert torch.equal(
            linear(x[start : start + m], packed, bias, act=act), alone[start : start + m]
        )
