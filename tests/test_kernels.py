"""The cbserve CPU kernels against the pure-torch path they replace.

packed_linear for every weight format (and its epilogues), with float32 and (where the CPU has
AVX512-VNNI) int8 activations, batch invariance of a row's result,
GGUF block decoding against the gguf package's own dequantizer, the fused attention op against
`paged_attention` (decode rows, chunks with and without a past, float32, float16 and int8 pools;
the int8 pool's rows against a reference quantizer), and the
whole SmolLM2 model through the kernels against the float model with the same weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models import kernels, ops
from models.attention import AttentionMetadata, PrefillChunk, paged_attention
from models.decoder import apply_rotary
from models.quant import (
    F32,
    Q4_1,
    Q8_0,
    QB,
    QTensor,
    _block_sums,
    from_gguf_blocks,
    pack,
    quantize,
)
from tests.helpers.attention_refs import (
    BS,
    KVH,
    NB,
    H,
    check_fused_attention,
    from_pool,
    query_as_the_kernel_reads_it,
    rope_tables,
    rotate,
    to_pool,
)
from tests.helpers.kquant_rows import GATED

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason=f"CPU kernels unavailable: {kernels.unavailable_reason()}"
)
KINDS = [F32, Q8_0, Q4_1]


def _linear(x, packed, bias=None, residual=None, act=0):
    p = packed
    return ops.packed_linear(x, p.qs, p.d, p.m, p.kind, p.out_features, bias, residual, act)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 3, 4, 5, 7, 13, 64])
def test_packed_linear_matches_float_matmul_of_the_same_weights(kind, m):
    torch.manual_seed(kind * 100 + m)
    n, k = 72, 96  # N not a multiple of the 16-row panel: padding must not leak
    w = torch.randn(n, k) * 0.1
    qt = quantize(w, kind)
    x, bias, res = torch.randn(m, k), torch.randn(n), torch.randn(m, n)
    ref = F.linear(x, qt.dequantize(), bias) + res
    got = _linear(x, pack(qt), bias, res)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("act", list(GATED))
def test_gated_epilogue_matches_torch(kind, act):
    torch.manual_seed(1)
    f, k = 44, 64  # 44 = 5 panels of 8 gate + 8 up rows and a partial one
    w = torch.randn(2 * f, k) * 0.5
    qt = quantize(w, kind)
    x = torch.randn(6, k)  # gates of both signs, up to ~10
    gate, up = F.linear(x, qt.dequantize()).chunk(2, dim=-1)
    got = _linear(x, pack(qt, gate_up=True), act=act)
    torch.testing.assert_close(got, GATED[act](gate) * up, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_result_does_not_depend_on_the_batch_around_it(kind):
    """Batching must never change a token: bit-identical rows alone and in batches of any size
    (the kernel switches strategy above 4 rows; the summation order must not change)."""
    torch.manual_seed(2)
    w = torch.randn(48, 576) * 0.05
    packed = pack(quantize(w, kind))
    x = torch.randn(37, 576)
    alone = torch.cat([_linear(x[i : i + 1], packed) for i in range(37)])
    for m in (2, 4, 5, 6, 12, 37):
        batched = torch.cat([_linear(x[i : i + m], packed) for i in range(0, 37, m)])
        assert torch.equal(batched, alone), f"batch of {m} changed a row"


# -- int8 activations (AVX512-VNNI) -------------------------------------------------------------

needs_int8 = pytest.mark.skipif(
    not kernels.has_int8_dot(), reason="this CPU has no AVX512-VNNI int8 dot products"
)
INT8_KINDS = [Q8_0, Q4_1]


def _int8_activations(x: torch.Tensor) -> torch.Tensor:
    """What the int8 kernel multiplies: x rounded per row and 32 inputs to da * round(x / da),
    da = max|x| / 127 (the activations llama.cpp feeds its quantized dot products)."""
    m, k = x.shape
    xb = x.view(m, k // QB, QB)
    da = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(da > 0, 1 / da, torch.zeros(()))
    return (torch.round(xb * inv) * da).view(m, k)


@needs_int8
@pytest.mark.parametrize("kind", INT8_KINDS)
@pytest.mark.parametrize("m", [1, 3, 8, 9, 13, 64])
def test_int8_activation_kernel_is_the_matmul_of_the_rounded_activations(kind, m):
    """The integer dot products are exact: the result is the float matmul of the rounded
    activations with the same weights, up to float rounding of the per-block scales."""
    torch.manual_seed(kind * 10 + m)
    n, k = 72, 96
    qt = quantize(torch.randn(n, k) * 0.1, kind)
    x, bias, res = torch.randn(m, k) * 3, torch.randn(n), torch.randn(m, n)
    ref = F.linear(_int8_activations(x), qt.dequantize(), bias) + res
    got = _linear(x, pack(qt, int8=True), bias, res)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    # and close to the float32-activation result (what int8 rounding costs)
    flt = _linear(x, pack(qt), bias, res)
    assert float((got - flt).abs().max()) < 0.05 * float(flt.abs().max())


@needs_int8
@pytest.mark.parametrize("kind", INT8_KINDS)
@pytest.mark.parametrize("act", list(GATED))
def test_int8_gated_epilogue(kind, act):
    torch.manual_seed(11)
    f, k = 40, 64
    qt = quantize(torch.randn(2 * f, k) * 0.1, kind)
    x = torch.randn(6, k)
    gate, up = F.linear(_int8_activations(x), qt.dequantize()).chunk(2, dim=-1)
    got = _linear(x, pack(qt, gate_up=True, int8=True), act=act)
    torch.testing.assert_close(got, GATED[act](gate) * up, rtol=1e-5, atol=1e-5)


@needs_int8
@pytest.mark.parametrize("kind", INT8_KINDS)
def test_int8_rows_do_not_depend_on_the_batch_around_them(kind):
    """Row tiles of 8 and their remainders run different unrollings: every row must still come
    out bit-identical alone and in any batch."""
    torch.manual_seed(12)
    packed = pack(quantize(torch.randn(48, 576) * 0.05, kind), int8=True)
    x = torch.randn(37, 576)
    alone = torch.cat([_linear(x[i : i + 1], packed) for i in range(37)])
    for m in (2, 5, 8, 9, 16, 37):
        batched = torch.cat([_linear(x[i : i + m], packed) for i in range(0, 37, m)])
        assert torch.equal(batched, alone), f"batch of {m} changed a row"


def test_int8_layout_refuses_float_weights():
    with pytest.raises(ValueError, match="int8 activations need"):
        pack(quantize(torch.randn(16, 32), F32), int8=True)


def test_int8_layouts_block_sums_in_slices_are_the_whole_sum():
    q = torch.randint(-128, 128, (10, 16, 3, QB), dtype=torch.int8)
    want = q.sum(-1, dtype=torch.int32)
    assert torch.equal(_block_sums(q, rows=3), want)
    assert torch.equal(_block_sums(q), want)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_decode_exactly_like_the_gguf_package(name):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from gguf.quants import quantize as gguf_quantize

    qtype = GGMLQuantizationType[name]
    rng = np.random.default_rng(3)
    w = rng.standard_normal((24, 128)).astype(np.float32)
    raw = gguf_quantize(w, qtype)
    qt = from_gguf_blocks(raw, int(qtype), 24, 128)
    assert qt is not None
    np.testing.assert_array_equal(qt.dequantize().numpy(), dequantize(raw, qtype).reshape(24, 128))


def test_fused_qkv_rows_keep_their_blocks():
    torch.manual_seed(4)
    parts = [quantize(torch.randn(r, 64), Q4_1) for r in (32, 16, 16)]
    fused = QTensor.cat(parts)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    order = torch.randperm(64)
    assert torch.equal(fused.rows(order).dequantize(), fused.dequantize()[order])


# -- attention ----------------------------------------------------------------------------------


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("D", [32, 64])  # 64: the AVX-512 grouped decode kernel where it runs
def test_fused_attention_matches_paged_attention(pool_dtype, D):  # noqa: N803
    check_fused_attention(pool_dtype, H, KVH, D)


def _ggml_order(x: torch.Tensor) -> torch.Tensor:
    """Each head's values (last dim) as llama.cpp's converter stores q/k rows: (i, i + D/2) -> (2i, 2i + 1)."""
    d = x.shape[-1]
    return x.unflatten(-1, (2, d // 2)).transpose(-1, -2).flatten(-2)


def _one_chunk(t: int, bs: int) -> AttentionMetadata:
    """A prefill chunk of t tokens with no past, in pool block 1 (block size bs)."""
    return AttentionMetadata(
        slot_mapping=torch.arange(bs, bs + t),
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_context_lens=None,
        prefills=[PrefillChunk(0, t, t, torch.tensor([1]))],
    )


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.int8])
def test_interleaved_rope_on_ggml_ordered_heads_is_the_halves_rope(pool_dtype):
    """A llama-architecture GGUF's q/k rows taken in the file's order: the op rotating adjacent
    pairs gives the same attention as rotating halves on Hugging Face's order (q.k does not see
    the shared permutation), and its pool holds the same keys in the file's order; so does the
    torch path (`apply_rotary`)."""
    torch.manual_seed(3)
    h, kvh, d, t, bs = 6, 2, 64, 9, 16
    qkv = torch.randn(t, (h + 2 * kvh) * d)
    cos, sin = rope_tables(torch.arange(t), d)
    qk = qkv[:, : (h + kvh) * d].view(t, h + kvh, d)
    filed = torch.cat([_ggml_order(qk).flatten(1), qkv[:, (h + kvh) * d :]], dim=1)
    meta = _one_chunk(t, bs)
    width = d + d // 8 if pool_dtype == torch.int8 else d
    outs, pools = [], []
    for x, interleaved in ((qkv, False), (filed, True)):
        pool = [torch.zeros(3, bs, kvh, width, dtype=pool_dtype) for _ in range(2)]
        outs.append(
            ops.attention(
                x.clone(),
                cos,
                sin,
                *pool,
                meta.slot_mapping,
                0,
                torch.empty(0, 1, dtype=torch.int64),
                torch.empty(0, dtype=torch.int64),
                meta.chunk_meta(),
                meta.chunk_tables(),
                h,
                kvh,
                d,
                d**-0.5,
                interleaved=interleaved,
            )  # fmt: skip
        )
        pools.append(from_pool(pool[0], d)[1, :t])
    tol = 2e-2 if pool_dtype == torch.int8 else 1e-5  # (int8 groups hold other values per order)
    torch.testing.assert_close(outs[1], outs[0], rtol=tol, atol=tol)
    torch.testing.assert_close(pools[1], _ggml_order(pools[0]), rtol=tol, atol=tol)

    full_cos = torch.cat([cos, cos], -1)[:, None]
    full_sin = torch.cat([-sin, sin], -1)[:, None]
    halves = apply_rotary(qk, full_cos, full_sin)
    pairs = apply_rotary(_ggml_order(qk), full_cos, full_sin, interleaved=True)
    torch.testing.assert_close(pairs, _ggml_order(halves), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "pairs"])
def test_partial_rotary_rotates_the_first_values_of_each_head_only(interleaved):
    """A partial rotary embedding (Phi-4-mini: 96 of 128): tables for R < D values rotate the
    first R of each q/k head, pairs (i, i + R/2) or, interleaved, (2i, 2i + 1), and pass the
    rest through; in the op (its attention and the keys it writes) and in the torch path."""
    torch.manual_seed(4)
    h, kvh, d, r, t, bs = 4, 2, 64, 48, 7, 16
    qkv = torch.randn(t, (h + 2 * kvh) * d)
    cos, sin = rope_tables(torch.arange(t), r)  # (T, R/2)
    qk = qkv[:, : (h + kvh) * d].view(t, h + kvh, d)
    head, rest = qk[..., :r], qk[..., r:]
    if interleaved:
        a, b, c, s = head[..., 0::2], head[..., 1::2], cos[:, None], sin[:, None]
        head = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    else:
        head = rotate(head, cos, sin)
    roped = torch.cat([head, rest], dim=-1)
    q, k = roped.split([h, kvh], dim=1)
    v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
    meta = _one_chunk(t, bs)
    pool = [torch.zeros(3, bs, kvh, d) for _ in range(2)]
    got = ops.attention(
        qkv.clone(), cos, sin, *pool, meta.slot_mapping, 0, torch.empty(0, 1, dtype=torch.int64),
        torch.empty(0, dtype=torch.int64), meta.chunk_meta(), meta.chunk_tables(), h, kvh, d,
        d**-0.5, interleaved=interleaved,
    )  # fmt: skip
    ref_pool = tuple(torch.zeros(3, bs, kvh, d) for _ in range(2))
    want = paged_attention(q, k, v, ref_pool, meta, d**-0.5).reshape(t, h * d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[0][1, :t], k, rtol=1e-6, atol=1e-6)
    full_cos = torch.cat([cos, cos], -1)[:, None]
    full_sin = torch.cat([-sin, sin], -1)[:, None]
    torch.testing.assert_close(
        apply_rotary(qk, full_cos, full_sin, interleaved), roped, rtol=1e-6, atol=1e-6
    )


# (query heads, kv heads, head_dim): every group size 1..8 and the new families' head sizes --
# Phi-3's 96, Qwen3's and Llama 3 8B's 128, Gemma 3's 256 (270M: 4 query heads on 1 kv head).
SHAPES = [
    (2, 2, 96),
    (4, 2, 128),
    (6, 2, 64),
    (4, 1, 256),
    (10, 2, 96),
    (12, 2, 128),
    (7, 1, 64),
    (16, 2, 256),
]


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv{s[2]}")
@pytest.mark.parametrize("window", [0, 6])
def test_fused_attention_head_sizes_group_sizes_and_sliding_windows(pool_dtype, shape, window):
    """Decode rows and prefill chunks (with a past, without) of every group size and the new
    families' head sizes, with and without a sliding window (6 keys: most of the batch's tokens
    see more than that), against the reference."""
    check_fused_attention(pool_dtype, *shape, window=window)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize(
    "shape", [(4, 2, 64), (8, 4, 256), (8, 1, 64)], ids=lambda s: f"{s[0]}q{s[1]}kv{s[2]}"
)
@pytest.mark.parametrize("window", [0, 6])
def test_fused_attention_soft_caps_scores_as_the_reference(pool_dtype, shape, window):
    """Gemma 2's soft-capped scores (a cap of 1.5, which these random scores reach: uncapped,
    the results differ) in decode rows and prefill chunks, head_dim 64 (whose AVX-512 kernels
    have no cap and give way) and 256, against the reference."""
    check_fused_attention(pool_dtype, *shape, window=window, softcap=1.5)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        check_fused_attention(pool_dtype, *shape, window=window, softcap=1.5, ref_softcap=0.0)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize(
    "shape", [(4, 2, 64), (8, 1, 64), (6, 2, 32)], ids=lambda s: f"{s[0]}q{s[1]}kv{s[2]}"
)
@pytest.mark.parametrize("window", [0, 6])
def test_fused_attention_takes_attention_sinks_as_the_reference(pool_dtype, shape, window):
    """gpt-oss's sinks (a logit per query head joining its softmax without a value) in decode
    rows and prefill chunks, with and without a window, head_dim 64 (whose AVX-512 kernels have
    no sinks and give way) and 32, against the reference; large enough that without them the
    results differ."""
    sinks = torch.linspace(-1.0, 3.0, shape[0])
    check_fused_attention(pool_dtype, *shape, window=window, sinks=sinks)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        check_fused_attention(pool_dtype, *shape, window=window, sinks=sinks, ref_sinks=None)


def assert_chunks_and_decode_rows_agree(
    qkv, table, H, KVH, D, pool_dtype, window, softcap=0.0, sinks=None
):  # noqa: N803
    """The fused attention of qkv's tokens (positions 0..n-1 over `table`'s blocks) prefilled
    as one chunk, as chunks of 3, and as 4 tokens then decode rows: bit-identical outputs."""
    n = qkv.shape[0]
    cos, sin = rope_tables(torch.arange(n), D)
    slots = table[torch.arange(n) // BS] * BS + torch.arange(n) % BS
    none2, none1 = torch.empty(0, 1, dtype=torch.long), torch.empty(0, dtype=torch.long)

    def run(pieces):
        k = to_pool(torch.zeros(NB, BS, KVH, D), pool_dtype)
        v = to_pool(torch.zeros(NB, BS, KVH, D), pool_dtype)
        outs = []
        for start, size, as_decode in pieces:
            sl = slice(start, start + size)
            if as_decode:
                args = (1, table.view(1, -1), torch.tensor([start + 1]),
                        torch.empty(0, 3, dtype=torch.long), none2)  # fmt: skip
            else:
                args = (0, none2, none1, torch.tensor([[0, size, start + size]]), table.view(1, -1))
            outs.append(ops.attention(
                qkv[sl].clone(), cos[sl], sin[sl], k, v, slots[sl], *args, H, KVH, D, D**-0.5,
                window, False, softcap, sinks,
            ))  # fmt: skip
        return torch.cat(outs)

    whole = run([(0, n, False)])
    assert torch.equal(run([(i, min(3, n - i), False) for i in range(0, n, 3)]), whole)
    assert torch.equal(run([(0, 4, False)] + [(i, 1, True) for i in range(4, n)]), whole)


@pytest.mark.parametrize("pool_dtype", [torch.float16, torch.int8])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("heads", [(4, 2), (8, 1), (6, 2)])
def test_with_sinks_a_prefill_chunk_and_decode_rows_give_the_same_bits(pool_dtype, window, heads):
    """The sinks enter every path's softmax alike: a prompt as one chunk, as chunks of 3 and
    token by token gives bit-identical outputs."""
    H, KVH = heads  # noqa: N806
    D, n = 64, 29  # noqa: N806
    torch.manual_seed(9)
    table = torch.tensor([5, 2, 9, 17, 3, 30, 22, 11])  # 8 blocks of 4
    qkv = torch.randn(n, (H + 2 * KVH) * D)
    sinks = torch.randn(H) + 1
    assert_chunks_and_decode_rows_agree(qkv, table, H, KVH, D, pool_dtype, window, sinks=sinks)


def test_int8_rounding_ties_extremes_and_denormals_in_pool_rows_and_queries():
    """The int8 pool's writer and the VNNI query quantizer round half to even, clamp to +-127 and
    keep zeros at 0 even where a denormal scale makes the inverse infinite; a chunk's attention
    over such rows is still the reference's (the rows and queries rounded as torch rounds them)."""
    h, kvh, d, bs, t = 9, 3, 64, 16, 4
    torch.manual_seed(11)
    qkv = torch.randn(t, (h + 2 * kvh) * d)
    ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.5] + [0.0] * 22)
    k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)
    v = qkv[:, (h + kvh) * d :].view(t, kvh, d)
    for x in (k, v):
        x[0, 0, :32] = ties  # scale exactly 1: every .5 is a tie
        x[1, 1, 32:] = torch.linspace(-1e30, 1e30, 32)  # huge values
        x[2, 2, :32] = 0.0
        x[2, 2, :4] = torch.tensor([1e-40, -1e-40, 0.0, 2e-40])  # a denormal group
    qkv[1, :32] = ties * 0.01  # a query head with ties after its own scaling
    cos, sin = torch.ones(t, d // 2), torch.zeros(t, d // 2)
    table = torch.tensor([[2]])
    pools = [torch.zeros(4, bs, kvh, d + d // 8, dtype=torch.int8) for _ in range(2)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(2 * bs, 2 * bs + t),
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_context_lens=None,
        prefills=[PrefillChunk(0, t, t, table[0])],
    )
    got = ops.attention(
        qkv.clone(), cos, sin, pools[0], pools[1], meta.slot_mapping, 0,
        torch.empty(0, 1, dtype=torch.int64), torch.empty(0, dtype=torch.int64),
        meta.chunk_meta(), meta.chunk_tables(), h, kvh, d, d**-0.5,
    )  # fmt: skip
    for pool, x in zip(pools, (k, v), strict=True):
        rows = pool[2, :t]
        want = to_pool(x, torch.int8)
        normal = torch.ones(t, kvh, dtype=torch.bool)
        normal[2, 2] = False
        assert torch.equal(rows[normal], want[normal])
        assert rows[0, 0, :10].tolist() == [127, 0, 2, 2, 0, -2, -2, 126, -126, 4]
        # the denormal group: scale > 0, its inverse infinite: signs at full scale, zeros stay 0
        assert rows[2, 2, :32].tolist() == [127, -127, 0, 127] + [0] * 28
        assert torch.equal(rows[2, 2, 32:], want[2, 2, 32:])
    if kernels.has_int8_dot():  # where queries are rounded too, the reference must round them
        q = query_as_the_kernel_reads_it(qkv[:, : h * d].view(t, h, d), torch.int8, d**-0.5)
        ref_k, ref_v = from_pool(pools[0], d), from_pool(pools[1], d)
        want = paged_attention(
            q, ref_k[2, :t].clone(), ref_v[2, :t].clone(), (ref_k, ref_v), meta, d**-0.5
        )
        torch.testing.assert_close(got, want.reshape(t, h * d), rtol=1e-4, atol=1e-4)


# -- the whole model ----------------------------------------------------------------------------


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16, torch.int8])
def test_a_decode_rows_attention_does_not_depend_on_how_many_rows_share_the_step(pool_dtype):
    """From 8 decode rows on, an int8 pool's rows go whole through the kernel (every kv head in
    one pass), fewer as (row, kv head) items: each row's result must be the same bits either way,
    as for the float pools (batching never changes a token)."""
    torch.manual_seed(4)
    h, kvh, d, bs, rows = 9, 3, 64, 16, 9
    lens = torch.randint(1, 200, (rows,))
    lens[0] = 16 * 5  # whole blocks only
    per_row = -(-int(lens.max()) // bs)
    tables = torch.randperm(rows * per_row).view(rows, per_row) + 1  # scattered blocks
    pool = [to_pool(torch.randn(rows * per_row + 1, bs, kvh, d), pool_dtype) for _ in range(2)]
    qkv = torch.randn(rows, (h + 2 * kvh) * d)
    last = lens - 1
    slots = tables[torch.arange(rows), last // bs] * bs + last % bs
    cos, sin = torch.ones(rows, d // 2), torch.zeros(rows, d // 2)
    none = torch.empty(0, 3, dtype=torch.long), torch.empty(0, 1, dtype=torch.long)

    def attend(idx):
        kc, vc = pool[0].clone(), pool[1].clone()
        return ops.attention(
            qkv[idx].clone(), cos[idx], sin[idx], kc, vc, slots[idx], len(idx), tables[idx], lens[idx],
            *none, h, kvh, d, d**-0.5,
        )  # fmt: skip

    together = attend(torch.arange(rows))
    for r in range(rows):
        assert torch.equal(attend(torch.tensor([r]))[0], together[r]), r


@pytest.mark.parametrize("pool_dtype", [torch.float16, torch.int8])
def test_a_non_finite_query_head_gives_nan_for_that_head_only(pool_dtype):
    """A NaN or an infinity in one query head (a broken model) shows as NaN in that head's
    output, on every path (the int8 pool's integer q.k path included), and leaves the others."""
    torch.manual_seed(3)
    h, kvh, d = 9, 3, 64
    pool = [to_pool(torch.randn(4, 16, kvh, d), pool_dtype) for _ in range(2)]
    for bad in (float("nan"), float("inf")):
        qkv = torch.randn(1, (h + 2 * kvh) * d)
        qkv[0, 5] = bad  # query head 0
        out = ops.attention(
            qkv, torch.ones(1, d // 2), torch.zeros(1, d // 2), pool[0], pool[1], torch.tensor([20]), 1,
            torch.tensor([[1, 2]]), torch.tensor([21]), torch.empty(0, 3, dtype=torch.long),
            torch.empty(0, 1, dtype=torch.long), h, kvh, d, d**-0.5,
        )  # fmt: skip
        assert out[0, :d].isnan().all()
        assert out[0, d:].isfinite().all()


def test_slots_and_blocks_outside_the_pool_are_refused_not_written():
    """A bad slot or block id raises instead of writing or reading outside the pools."""
    h, kvh, d = 2, 1, 32
    pool = [torch.zeros(4, 16, kvh, d, dtype=torch.float16) for _ in range(2)]
    qkv = torch.randn(1, (h + 2 * kvh) * d)
    rope = torch.ones(1, d // 2), torch.zeros(1, d // 2)
    chunkless = torch.empty(0, 3, dtype=torch.long), torch.empty(0, 1, dtype=torch.long)

    def attend(slot, table, length):
        return ops.attention(
            qkv.clone(), *rope, *pool, torch.tensor([slot]), 1, torch.tensor([table]),
            torch.tensor([length]), *chunkless, h, kvh, d, d**-0.5,
        )  # fmt: skip

    assert attend(63, [3], 16).isfinite().all()  # the pool's last row
    for slot, table, length in ((64, [3], 16), (-1, [3], 16), (5, [4], 16), (5, [0], 17)):
        with pytest.raises(RuntimeError, match="KV pool|blocks"):
            attend(slot, table, length)
    with pytest.raises(RuntimeError, match="outside the step"):
        ops.attention(
            qkv.clone(), *rope, *pool, torch.tensor([0]), 0, chunkless[1], torch.empty(0, dtype=torch.long),
            torch.tensor([[0, 2, 2]]), torch.tensor([[0]]), h, kvh, d, d**-0.5,
        )  # fmt: skip


@pytest.mark.parametrize("pool_dtype", [torch.float16, torch.int8])
@pytest.mark.parametrize("D", [32, 64, 256])
@pytest.mark.parametrize("window", [0, 5])
# query heads per kv head 3, 1, 2, 4, 5 and 8: each size of the tiles a long chunk goes in
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (4, 2), (8, 2), (10, 2), (8, 1)])
@pytest.mark.parametrize("softcap", [0.0, 1.5], ids=["", "capped"])
def test_a_tokens_attention_is_the_same_in_a_prefill_chunk_and_as_a_decode_row(
    D, pool_dtype, window, heads, softcap
):  # noqa: N803
    """One kernel computes both: a prompt prefilled as one chunk, as chunks of 3, and token by
    token as decode rows gives bit-identical attention outputs (so chunking, preemption and
    recompute never change a token), with a sliding window too."""
    H, KVH = heads  # noqa: N806
    torch.manual_seed(8)
    n, table = 37, torch.tensor([5, 2, 9, 17, 3, 30, 22, 11, 26, 38])  # 10 blocks of 4
    qkv = torch.randn(n, (H + 2 * KVH) * D)
    assert_chunks_and_decode_rows_agree(qkv, table, H, KVH, D, pool_dtype, window, softcap)


@pytest.mark.slow
def test_smollm2_through_the_kernels_matches_the_float_model_of_the_same_weights(smollm2_file):
    """The GGUF's own Q4_1/Q8_0 blocks in the kernels vs the dequantized float32 model in
    pure torch: the same weights, so logits agree to float rounding (float32 KV here)."""
    from models import load_model
    from models.gguf_loader import load_gguf

    fast = load_model("smollm2-135m-instruct", kv_cache_dtype="float32", activations="float32")
    assert set(fast.model.weight_formats()) == {"q4_1", "q8_0"}
    ref = load_gguf(smollm2_file)  # float32, pure torch
    ids = fast.tokenizer.encode("The capital of France is")
    n = len(ids)
    outs = []
    with torch.inference_mode():
        for model in (fast.model, ref.model):
            layout = model.config.kv_layout
            pool = torch.zeros(layout.pool_shape(4, 16), dtype=layout.dtype)
            caches = [(pool[i, 0], pool[i, 1]) for i in range(layout.num_layers)]
            chunk = PrefillChunk(0, n, n, torch.tensor([1, 2]))
            meta = AttentionMetadata(torch.arange(16, 16 + n), 0, None, None, [chunk])
            hidden = model(torch.tensor(ids), torch.arange(n), caches, meta)
            outs.append(model.compute_logits(hidden[-1:]))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-3, atol=1e-3)
    assert int(outs[0].argmax()) == int(outs[1].argmax())


@needs_int8
@pytest.mark.slow
def test_smollm2_with_int8_activations_stays_close_to_float_activations(smollm2_file):
    """The default where the CPU has VNNI: the same weights with int8 activations. Not the same
    numbers (the point is to round), so: every position's greedy token equal on these texts
    and logits highly correlated (measured: max |diff| ~1.3, cosine >= 0.996). Perplexity over a
    longer text is in `python -m tools.quant_quality`."""
    from models import load_model

    outs = []
    texts = ["The capital of France is", "Once upon a time, there was a little"]
    for activations in ("float32", "int8"):
        lm = load_model("smollm2-135m-instruct", kv_cache_dtype="float32", activations=activations)
        outs.append([_prefill_logits(lm, t) for t in texts])
    assert all(k.endswith("+a8") for k in lm.model.weight_formats())
    for flt, i8 in zip(*outs, strict=True):
        assert torch.equal(flt.argmax(-1), i8.argmax(-1))
        assert float(F.cosine_similarity(flt, i8, dim=-1).min()) > 0.99


def _prefill_logits(lm, text: str) -> torch.Tensor:
    """Logits at every position of `text`, prefilled as one chunk into a small pool."""
    model = lm.model
    ids = lm.tokenizer.encode(text)
    n = len(ids)
    layout = model.config.kv_layout
    pool = torch.zeros(layout.pool_shape(8, 16), dtype=layout.dtype)
    caches = [(pool[i, 0], pool[i, 1]) for i in range(layout.num_layers)]
    meta = AttentionMetadata(
        torch.arange(16, 16 + n), 0, None, None, [PrefillChunk(0, n, n, torch.tensor([1, 2, 3]))]
    )
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), caches, meta))


def test_rms_norm_kernel_matches_torch():
    torch.manual_seed(6)
    x, w, r = torch.randn(9, 576) * 30, torch.randn(576), torch.randn(9, 576)
    want = F.rms_norm(x, (576,), w, 1e-5)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5, r), want + r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hd", [64, 100, 256])
def test_head_rms_norm_kernel_norms_the_q_and_k_heads_in_place(hd):
    torch.manual_seed(hd)
    t, heads, v_heads = 5, 6, 2
    qkv = torch.randn(t, (heads + v_heads) * hd) * 10
    w = torch.randn(heads, hd)
    want = qkv.clone()
    q_k = want.view(t, -1, hd)[:, :heads]
    q_k.copy_(F.rms_norm(q_k, (hd,), eps=1e-6) * w)
    ops.head_rms_norm(qkv, w, hd, 1e-6)
    torch.testing.assert_close(qkv, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, heads * hd :], want[:, heads * hd :])  # v heads untouched


@pytest.mark.parametrize("V", [1, 7, 16, 17, 33, 1000, 49152])
def test_argmax_kernel_gives_torchs_answer_ties_infinities_and_nans_included(V):  # noqa: N803
    g = torch.Generator().manual_seed(V)
    x = torch.randn(5, V, generator=g)
    ties = x.clone()
    ties.scatter_(1, torch.randint(0, V, (5, 3), generator=g), 100.0)  # the first of them wins
    nans = x.clone()
    nans[:, V // 2] = float("nan")  # torch counts NaN as the largest
    nans[1, V - 1] = float("nan")
    masked = torch.full((5, V), float("-inf"))
    masked[2, V - 1] = -1e30
    for rows in (x, ties, nans, masked, torch.zeros(5, V), x.t().contiguous().t()[:, :V]):
        assert torch.equal(ops.argmax_rows(rows), rows.argmax(-1))


def test_large_results_held_at_once_never_share_memory():
    """Results of 32 MiB and more reuse one buffer (a batch's logits over a large vocabulary),
    but only once no earlier result holds it."""
    torch.manual_seed(21)
    n, k = 1 << 17, 32  # 64 x 131,072 float32 = 32 MiB
    packed = pack(quantize(torch.randn(n, k), Q8_0))
    xs = [torch.randn(64, k) for _ in range(3)]
    first, second = _linear(xs[0], packed), _linear(xs[1], packed)
    assert first.data_ptr() != second.data_ptr()
    # (4-row results are small, each its own allocation; a row does not depend on its batch)
    assert torch.equal(first[:4], _linear(xs[0][:4], packed))
    del first
    third = _linear(xs[2], packed)  # the buffer `first` left, refilled
    assert third.data_ptr() != second.data_ptr()
    assert torch.equal(third[:4], _linear(xs[2][:4], packed))
    assert torch.equal(second[:4], _linear(xs[1][:4], packed))  # untouched by the third


def _torch_candidates(x: torch.Tensor, temps: torch.Tensor, k: int):
    scaled = x / temps[:, None]
    vals, _ = scaled.topk(k, dim=1)
    return scaled, vals, torch.logsumexp(scaled, dim=1)


@pytest.mark.parametrize("V", [9, 300, 4099, 262144])
def test_top_candidates_are_torchs_topk_and_logsumexp_of_the_scaled_rows(V):  # noqa: N803
    g = torch.Generator().manual_seed(V)
    k = min(256, V)
    x = torch.randn(6, V, generator=g) * 4
    x[1, torch.randint(0, V, (V // 3,), generator=g)] = float("-inf")  # a grammar's mask
    x[2] *= 0.1
    x[2, : V // 2] = 1.5  # ties across the cut: the lower ids come first
    temps = torch.tensor([0.7, 1.0, 0.2, 1.3, 0.05, 2.0])
    vals, ids, norms = ops.top_candidates(x, temps, k)
    scaled, want_vals, want_norms = _torch_candidates(x, temps, k)
    assert torch.equal(vals, want_vals)  # the same floats as torch's x / t, best first
    assert torch.equal(scaled.gather(1, ids), vals)  # and the ids they came from
    assert all(len(set(row.tolist())) == k for row in ids)
    tied = ids[2][vals[2] == torch.tensor(1.5) / temps[2]]
    assert len(tied) and torch.equal(tied, torch.arange(len(tied)))
    torch.testing.assert_close(norms, want_norms, rtol=1e-5, atol=1e-5)
    # a row's answer does not depend on its batch
    for b in (0, 3):
        one = ops.top_candidates(x[b : b + 1], temps[b : b + 1], k)
        assert all(
            torch.equal(a[0], full[b]) for a, full in zip(one, (vals, ids, norms), strict=True)
        )


def test_top_candidates_skip_rows_without_a_temperature():
    x = torch.randn(3, 500)
    vals, ids, norms = ops.top_candidates(x, torch.tensor([0.0, 1.0, 0.0]), 8)
    assert torch.isneginf(vals[0]).all() and torch.isneginf(norms[2])
    assert torch.equal(ids[1], x[1].topk(8).indices)


_LOGITS_SCRIPT = """
import json, sys, torch
from models import kernels, load_model
from engine.model_runner import ModelRunner
from models.attention import AttentionMetadata, PrefillChunk
lm = load_model(*sys.argv[1:2] or ["tinygpt"], **dict(a.split("=") for a in sys.argv[2:]))
ids = lm.tokenizer.encode("Batching must never change a token.")
n = len(ids)
runner = ModelRunner(lm.model, num_blocks=8, block_size=16)
meta = AttentionMetadata(torch.arange(16, 16 + n), 0, None, None,
                         [PrefillChunk(0, n, n, torch.tensor([1, 2, 3]))])
with torch.inference_mode():
    h = lm.model(torch.tensor(ids), torch.arange(n), runner.kv_caches, meta)
    logits = lm.model.compute_logits(h[-1:])[0]
print(json.dumps({"kernels": lm.model.kernels, "int8": kernels.has_int8_dot(),
                  "formats": sorted(lm.model.weight_formats()),
                  "kinds": sorted(k.name for k in lm.model.packed_kinds()),
                  "logits": logits.tolist()}))
"""


def _logits_in_subprocess(env: dict, *args: str) -> dict:
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _LOGITS_SCRIPT, *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("env", [{"CBSERVE_KERNELS": "0"}, {"ATEN_CPU_CAPABILITY": "avx2"}])
def test_the_pure_torch_fallback_and_the_avx2_capped_path_compute_the_same_model(env):
    """Where the kernels cannot run (CBSERVE_KERNELS=0 stands in for a CPU without AVX2 or a
    machine without a compiler) the pure-torch path serves the same model; with torch's ISA
    capped at AVX2 (many users' CPUs) the kernel path is unchanged."""

    def run(extra):
        return _logits_in_subprocess(extra)

    base, other = run({}), run(env)
    assert base["kernels"] is True
    assert other["kernels"] is (env.get("CBSERVE_KERNELS") != "0")
    torch.testing.assert_close(
        torch.tensor(other["logits"]), torch.tensor(base["logits"]), rtol=1e-4, atol=1e-4
    )


@needs_int8
@pytest.mark.slow
def test_smollm2_with_the_isa_capped_at_avx2_runs_what_an_avx2_cpu_runs(smollm2_file):
    """ATEN_CPU_CAPABILITY=avx2 caps our kernels too: no VNNI, so int8 activations run on the
    file's own rows (maddubs, kind GGML_A8) instead of the VNNI panels (Q4_1X / Q8_0X); with float32
    activations the capped model is the same model as float activations here."""
    capped = _logits_in_subprocess({"ATEN_CPU_CAPABILITY": "avx2"}, "smollm2-135m-instruct")
    here = _logits_in_subprocess({}, "smollm2-135m-instruct")
    assert capped["int8"] is False and capped["kinds"] == ["GGML_A8"]
    assert capped["formats"] == ["q4_1+a8", "q8_0+a8"]
    assert here["kinds"] == ["Q4_1X", "Q8_0X"]
    f32 = "activations=float32"
    capped_f = _logits_in_subprocess({"ATEN_CPU_CAPABILITY": "avx2"}, "smollm2-135m-instruct", f32)
    here_f = _logits_in_subprocess({}, "smollm2-135m-instruct", f32)
    assert capped_f["formats"] == ["q4_1", "q8_0"]
    want = torch.tensor(here_f["logits"])
    torch.testing.assert_close(torch.tensor(capped_f["logits"]), want, rtol=1e-3, atol=1e-3)
    # int8 activations against the float model: the same next token, and logits as close as
    # int8 rounding allows (each path rounds activations its own way)
    for got in (capped, here):
        logits = torch.tensor(got["logits"])
        assert logits.argmax() == want.argmax()
        assert torch.nn.functional.cosine_similarity(logits, want, dim=0) > 0.999
