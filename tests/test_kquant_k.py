"""The K formats' int8-activation tiles (models/csrc/kquant_k*.cpp): decode's rows take several
weight rows per kernel call (2 or 4, by the number of activation rows); more activation rows meet
panels of 8 weight rows (16 on AVX512-VNNI) built once per call, 4 (8) activation rows a
micro-kernel call; the thread's range is split anywhere. Row counts here are odd so partial
weight-row groups, partial panels and micro-kernel calls on both axes (M = 5, 7, 9, 33, 130 leave
1, 3, 1, 1, 2 activation rows) and parts whose boundary falls inside a group are all met; the
oracle is gguf's dequantize times the int8-rounded activations, and a row's bits must not depend
on M, its place in the batch or the thread count."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from models import kernels
from models.quant import GGMLTensor, QTensor, pack, pack_rows
from tests.helpers.kquant_rows import SCALES, linear, random_rows, round_activations

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason=f"CPU kernels unavailable: {kernels.unavailable_reason()}"
)

K_TYPES = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
BATCHES = (1, 2, 3, 4, 5, 7, 8, 9, 33, 64, 130)


def reference(x: torch.Tensor, w) -> torch.Tensor:
    return (round_activations(x, 256).double() @ w.dequantize().double().T).float()


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # blocks of different magnitudes
    return torch.randn(m, k, generator=g) * torch.linspace(0.1, 4, k)


@pytest.mark.parametrize("qtype", K_TYPES)
@pytest.mark.parametrize("k", [256, 2304])
def test_every_batch_size_gives_the_reference_and_the_same_bits(qtype, k):
    """37 weight rows: 9 groups of 4 and one row left, 2 tiles of 16 and 5 rows left. K = 256 is
    one block, 2304 nine (an odd count, not a power of two)."""
    n = 37
    w = random_rows(qtype, n, k, seed=int(qtype) + k)
    packed = pack_rows(w, int8=True)
    x = activations(max(BATCHES), k, seed=k)
    alone = torch.cat([linear(x[i : i + 1], packed) for i in range(x.shape[0])])
    torch.testing.assert_close(alone, reference(x, w), rtol=1e-5, atol=5e-4)
    for m in BATCHES[1:]:
        got = linear(x[:m], packed)
        assert torch.equal(got, alone[:m]), f"M = {m} changed a row"
        # the same rows at another offset in the batch (another place in the activation tiles)
        if m < x.shape[0]:
            shifted = linear(x[1 : m + 1], packed)
            assert torch.equal(shifted, alone[1 : m + 1]), f"M = {m} from row 1 changed a row"


def test_a_fused_weight_of_k_formats_splits_its_groups_at_the_part_boundaries():
    """Q4_K rows then Q6_K then Q5_K, with boundaries (7, 17) inside the kernel's weight-row
    groups: each part is its own rows, against the oracle, the same bits for every M."""
    k = 512
    parts = [
        random_rows(Q.Q4_K, 7, k, seed=1),
        random_rows(Q.Q6_K, 10, k, seed=2),
        random_rows(Q.Q5_K, 6, k, seed=3),
    ]
    fused = pack(QTensor.cat(parts), int8=True)
    assert fused.formats().keys() == {"q4_k+a8", "q6_k+a8", "q5_k+a8"}
    x = activations(9, k, seed=4)
    ref = torch.cat([reference(x, p) for p in parts], 1)
    alone = torch.cat([linear(x[i : i + 1], fused) for i in range(9)])
    torch.testing.assert_close(alone, ref, rtol=1e-5, atol=5e-4)
    for m in (2, 3, 4, 5, 9):
        assert torch.equal(linear(x[:m], fused), alone[:m]), f"M = {m} changed a row"


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_the_thread_count_does_not_change_a_bit(qtype):
    """Threads split the outputs at any row, so a group of rows may start anywhere."""
    w = pack_rows(random_rows(qtype, 203, 512, seed=7), int8=True)
    x = activations(6, 512, seed=8)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [linear(x[:m], w) for m in (1, 4, 6)]
        torch.set_num_threads(2)
        two = [linear(x[:m], w) for m in (1, 4, 6)]
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_long_rows_give_the_reference_and_the_same_bits(qtype):
    """K = 8192 (32 blocks): long panels (80-92 KB a panel of 8 rows on AVX2), 13 rows make a full
    panel and a partial one."""
    k, n = 8192, 13
    w = random_rows(qtype, n, k, seed=int(qtype) + 11)
    packed = pack_rows(w, int8=True)
    x = activations(9, k, seed=12)
    alone = torch.cat([linear(x[i : i + 1], packed) for i in range(9)])
    torch.testing.assert_close(alone, reference(x, w), rtol=1e-5, atol=2e-3)
    for m in (5, 9):
        assert torch.equal(linear(x[:m], packed), alone[:m]), f"M = {m} changed a row"


@pytest.mark.parametrize("qtype", K_TYPES)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_largest_codes_against_full_scale_activations_do_not_overflow(qtype, sign):
    """Every byte of the blocks set (each value at its format's largest code, the largest
    sub-scales and minimums) against activations that all round to +127 or -127: the int16 sums
    the tiles keep before a sub-scale are then at their bound, and one group too many would wrap
    them and miss the reference by thousands. Decode's rows and prefill's tiles alike."""
    n, k = 19, 512
    values, size = GGML_QUANT_SIZES[qtype]
    raw = np.full((n, k // values, size), 0xFF, dtype=np.uint8)
    for off in SCALES[qtype]:
        raw[..., off : off + 2] = np.array([0.01], np.float16).view(np.uint8)
    w = GGMLTensor([(int(qtype), torch.from_numpy(raw.reshape(n, -1)))], k)
    packed = pack_rows(w, int8=True)
    x = torch.full((9, k), 3.0 * sign)
    want = reference(x, w)
    for m in (1, 4, 5, 9):
        torch.testing.assert_close(linear(x[:m], packed), want[:m], rtol=1e-5, atol=1e-3)
