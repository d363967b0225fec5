"""References for the attention kernels' tests: float32 rows as a KV pool of each dtype holds
them, RoPE tables and rotation in torch, and one flat batch of decode rows and prefill chunks run
through `ops.attention` against `paged_attention` over the float32 pool."""

from __future__ import annotations

import torch

from models import kernels, ops
from models.attention import AttentionMetadata, PrefillChunk, paged_attention

H, KVH, D, BS, NB = 6, 2, 32, 4, 40


def to_pool(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of float32 values (..., head_dim) as a pool of `dtype` holds them. int8: per 32
    values the int8s, then one float32 scale each after the row (`models.config.KVLayout`)."""
    if dtype != torch.int8:
        return x.to(dtype)
    d = x.shape[-1]
    g = x.reshape(*x.shape[:-1], d // 32, 32)
    scale = g.abs().amax(-1, keepdim=True) / 127  # float32 ops, as the kernel's
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = torch.round(g * inv).clamp(-127, 127).to(torch.int8).reshape(x.shape)  # half to even
    return torch.cat([q, scale.squeeze(-1).contiguous().view(torch.int8)], -1)


def from_pool(p: torch.Tensor, d: int) -> torch.Tensor:
    """The float32 values of pool rows (`to_pool`'s inverse, up to its rounding)."""
    if p.dtype != torch.int8:
        return p.float()
    q, scale = p[..., :d], p[..., d:].contiguous().view(torch.float32)
    g = q.float().reshape(*q.shape[:-1], d // 32, 32) * scale[..., None]
    return g.reshape(q.shape)


def rounded_as_pool(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return from_pool(to_pool(x, dtype), x.shape[-1])


def query_as_the_kernel_reads_it(
    q: torch.Tensor, pool_dtype: torch.dtype, scale: float
) -> torch.Tensor:
    """Over an int8 pool with head_dim 64 and AVX512-VNNI the kernel quantizes each query head as
    the pool's rows (int8 per 32 values of q * scale) and takes integer dot products: the same
    query, rounded so, in float32."""
    d = q.shape[-1]
    if pool_dtype != torch.int8 or d != 64 or not kernels.has_int8_dot():
        return q
    x = (q * scale).reshape(*q.shape[:-1], d // 32, 32)
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    r = torch.round(x * inv).clamp(-127, 127) * (amax / 127)
    return r.reshape(q.shape) / scale


def rope_tables(positions: torch.Tensor, D: int = D):  # noqa: N803
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    freqs = torch.outer(positions.double(), inv)
    return freqs.cos().float(), freqs.sin().float()  # (T, D/2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    D = x.shape[-1]  # noqa: N806
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def check_fused_attention(
    pool_dtype, H, KVH, D, window=0, softcap=0.0, ref_softcap=None, sinks=None, ref_sinks=...
):  # noqa: N803
    """Two decode rows, a chunk with a cached past and a fresh prompt, in one flat batch: the op
    against RoPE in torch and `paged_attention` over the float32 pool holding the same values
    (soft-capped by `ref_softcap` if given, else as the op; with `ref_sinks` if given, else the
    op's `sinks`)."""
    torch.manual_seed(5)
    seqs = {  # name: (block table, tokens already in the pool, new tokens this step)
        "dec_a": ([3, 9, 1 + 20], 9, 1),
        "dec_b": ([7], 2, 1),
        "chunk": ([11, 12, 30, 31], 6, 5),
        "fresh": ([14, 15], 0, 7),
        "long": ([32, 33, 34, 35, 36, 37, 38, 39], 25, 6),  # 31 keys: more than one 16-key run
    }
    kpool = torch.zeros(NB, BS, KVH, D)
    vpool = torch.zeros(NB, BS, KVH, D)
    for table, past, _ in seqs.values():  # the past, already roped, as the pool holds it
        for p in range(past):
            kpool[table[p // BS], p % BS] = torch.randn(KVH, D)
            vpool[table[p // BS], p % BS] = torch.randn(KVH, D)
    kpool, vpool = (
        rounded_as_pool(kpool, pool_dtype),
        rounded_as_pool(vpool, pool_dtype),
    )  # same past

    positions, slots, prefills, token = [], [], [], 0
    for name, (table, past, n) in seqs.items():
        pos = list(range(past, past + n))
        positions += pos
        slots += [table[p // BS] * BS + p % BS for p in pos]
        if not name.startswith("dec"):
            nb = -(-(past + n) // BS)
            prefills.append(PrefillChunk(token, n, past + n, torch.tensor(table[:nb])))
        token += n
    t = token
    qkv = torch.randn(t, (H + 2 * KVH) * D)
    cos, sin = rope_tables(torch.tensor(positions), D)

    def meta():
        tables = [seqs["dec_a"][0], seqs["dec_b"][0] + [0, 0]]
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            num_decode_tokens=2,
            decode_block_tables=torch.tensor(tables),
            decode_context_lens=torch.tensor([10, 3]),
            prefills=prefills,
        )

    # reference: rope in torch, the float32 pool, paged_attention
    q = rotate(qkv[:, : H * D].view(t, H, D), cos, sin)
    k = rotate(qkv[:, H * D : (H + KVH) * D].view(t, KVH, D), cos, sin)
    v = qkv[:, (H + KVH) * D :].view(t, KVH, D)
    k, v = (
        rounded_as_pool(k, pool_dtype),
        rounded_as_pool(v, pool_dtype),
    )  # what the pool will hold of them
    lens = torch.tensor(positions) + 1  # each token's keys
    # (the AVX-512 int8 kernels, which round the query, take the tokens that see every key
    # when scores are not soft-capped)
    rounded = query_as_the_kernel_reads_it(q, pool_dtype, D**-0.5)
    if not softcap and sinks is None:
        q = torch.where(((window == 0) | (lens <= window))[:, None, None], rounded, q)
    ref_cache = (kpool.clone(), vpool.clone())
    ref_cap = softcap if ref_softcap is None else ref_softcap
    ref_sink = sinks if ref_sinks is ... else ref_sinks
    want = paged_attention(q, k, v, ref_cache, meta(), D**-0.5, window, ref_cap, ref_sink)
    want = want.reshape(t, H * D)

    cache = (to_pool(kpool, pool_dtype), to_pool(vpool, pool_dtype))
    m = meta()
    got = ops.attention(
        qkv.clone(), cos, sin, cache[0], cache[1], m.slot_mapping, 2,
        m.decode_block_tables, m.decode_context_lens, m.chunk_meta(), m.chunk_tables(),
        H, KVH, D, D**-0.5, window, softcap=softcap, sinks=sinks,
    )  # fmt: skip
    # With a float16 pool a chunk without a past attends over its own unrounded K/V (the kernel
    # never reads them back), the reference over rounded ones: float16 rounding apart.
    tol = 2e-3 if pool_dtype == torch.float16 else 1e-4
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(from_pool(cache[0], D), ref_cache[0], rtol=1e-3, atol=1e-3)
    if pool_dtype == torch.int8:  # the kernel's quantizer is the reference's, value for value
        assert torch.equal(cache[1], to_pool(ref_cache[1], torch.int8))
