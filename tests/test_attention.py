"""Paged attention against a dense reference: decode rows, chunks with a past, block tables, and
sliding windows (masked by transformers' own sliding-window mask function)."""

from __future__ import annotations

import pytest
import torch
from transformers.masking_utils import sliding_window_causal_mask_function

from models.attention import AttentionMetadata, PrefillChunk, paged_attention

HEADS, KV_HEADS, HD, BS, NUM_BLOCKS = 4, 2, 8, 4, 32
SCALE = HD**-0.5


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, window: int = 0
) -> torch.Tensor:
    """Dense attention of queries (n, H, hd) at absolute positions q_pos over keys (L, KV, hd);
    `window` > 0: Gemma 3's sliding window, as transformers masks it."""
    group = HEADS // KV_HEADS
    k = k.repeat_interleave(group, dim=1)  # (L, H, hd)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * SCALE
    k_pos = torch.arange(k.shape[0])[None, :]
    if window:
        visible = sliding_window_causal_mask_function(window)(0, 0, q_pos[:, None], k_pos)
    else:
        visible = k_pos <= q_pos[:, None]  # (n, L)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def _pool():
    return torch.zeros(NUM_BLOCKS, BS, KV_HEADS, HD), torch.zeros(NUM_BLOCKS, BS, KV_HEADS, HD)


def _fill(cache: tuple, table: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
    for p in range(k.shape[0]):
        cache[0][table[p // BS], p % BS] = k[p]
        cache[1][table[p // BS], p % BS] = v[p]


def _slots(table: list[int], positions) -> list[int]:
    return [table[p // BS] * BS + p % BS for p in positions]


def test_chunk_with_a_past_matches_dense_attention():
    torch.manual_seed(0)
    past, n = 9, 6
    length = past + n
    q, k, v = (
        torch.randn(length, HEADS, HD),
        torch.randn(length, KV_HEADS, HD),
        torch.randn(length, KV_HEADS, HD),
    )
    table = [7, 3, 12, 5]  # scattered blocks
    cache = _pool()
    _fill(cache, table, k[:past], v[:past])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(_slots(table, range(past, length))),
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_context_lens=None,
        prefills=[PrefillChunk(0, n, length, torch.tensor(table))],
    )
    got = paged_attention(q[past:], k[past:], v[past:], cache, meta, SCALE)
    want = reference(q[past:], k, v, torch.arange(past, length))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_batched_decode_rows_match_dense_attention():
    torch.manual_seed(1)
    lengths = [3, 17, 9]
    tables = [[4], [8, 1, 30, 2, 6], [10, 11, 20]]
    cache = _pool()
    qs, ks, vs, slots = [], [], [], []
    refs = []
    for length, table in zip(lengths, tables, strict=True):
        q = torch.randn(length, HEADS, HD)
        k, v = torch.randn(length, KV_HEADS, HD), torch.randn(length, KV_HEADS, HD)
        _fill(cache, table, k[:-1], v[:-1])
        qs.append(q[-1])
        ks.append(k[-1])
        vs.append(v[-1])
        slots += _slots(table, [length - 1])
        refs.append(reference(q[-1:], k, v, torch.tensor([length - 1]))[0])
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=3,
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_context_lens=torch.tensor(lengths),
        prefills=[],
    )
    got = paged_attention(torch.stack(qs), torch.stack(ks), torch.stack(vs), cache, meta, SCALE)
    torch.testing.assert_close(got, torch.stack(refs), rtol=1e-5, atol=1e-5)


def test_decode_and_chunk_in_one_flat_batch_write_their_own_slots():
    torch.manual_seed(2)
    cache = _pool()
    # decode: a sequence of 5 tokens (4 in the pool); chunk: a fresh 6-token prompt
    dq, dk, dv = (
        torch.randn(5, HEADS, HD),
        torch.randn(5, KV_HEADS, HD),
        torch.randn(5, KV_HEADS, HD),
    )
    cq, ck, cv = (
        torch.randn(6, HEADS, HD),
        torch.randn(6, KV_HEADS, HD),
        torch.randn(6, KV_HEADS, HD),
    )
    dtable, ctable = [2, 9], [14, 15]
    _fill(cache, dtable, dk[:4], dv[:4])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(_slots(dtable, [4]) + _slots(ctable, range(6))),
        num_decode_tokens=1,
        decode_block_tables=torch.tensor([dtable]),
        decode_context_lens=torch.tensor([5]),
        prefills=[PrefillChunk(1, 6, 6, torch.tensor(ctable))],
    )
    got = paged_attention(
        torch.cat([dq[4:], cq]),
        torch.cat([dk[4:], ck]),
        torch.cat([dv[4:], cv]),
        cache,
        meta,
        SCALE,
    )
    torch.testing.assert_close(
        got[:1], reference(dq[4:], dk, dv, torch.tensor([4])), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        got[1:], reference(cq, ck, cv, torch.arange(6)), rtol=1e-5, atol=1e-5
    )
    # the chunk's K/V landed in its blocks, ready for its next decode
    torch.testing.assert_close(cache[0][15, 1], ck[5])


@pytest.mark.parametrize("window", [1, 3, 8, 40])
def test_sliding_window_rows_and_chunks_match_transformers_mask(window):
    """Decode rows, a chunk with a past, a fresh chunk in one batch, and the same fresh chunk
    without a pool: each query sees only the keys at positions (p - window, p]."""
    torch.manual_seed(3)
    cache = _pool()
    lengths, tables = [3, 17], [[4], [8, 1, 30, 2, 6]]  # decode rows
    past, n, ctable = 9, 6, [7, 3, 12, 5]  # a chunk with a past
    fresh, ftable = 7, [14, 15]  # a fresh prompt
    seqs = [(length, 1) for length in lengths] + [(past + n, n), (fresh, fresh)]
    qkv = [
        (torch.randn(L, HEADS, HD), torch.randn(L, KV_HEADS, HD), torch.randn(L, KV_HEADS, HD))
        for L, _ in seqs
    ]
    all_tables = [*tables, ctable, ftable]
    slots, want = [], []
    for (length, new), (q, k, v), table in zip(seqs, qkv, all_tables, strict=True):
        _fill(cache, table, k[: length - new], v[: length - new])
        slots += _slots(table, range(length - new, length))
        want.append(reference(q[length - new :], k, v, torch.arange(length - new, length), window))
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=2,
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_context_lens=torch.tensor(lengths),
        prefills=[
            PrefillChunk(2, n, past + n, torch.tensor(ctable)),
            PrefillChunk(2 + n, fresh, fresh, torch.tensor(ftable)),
        ],
    )

    def new(i: int) -> torch.Tensor:
        return torch.cat([x[L - m :] for (L, m), x in zip(seqs, (t[i] for t in qkv), strict=True)])

    got = paged_attention(new(0), new(1), new(2), cache, meta, SCALE, window=window)
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-5, atol=1e-5)
    # the naive engine's path (no pool): a fresh chunk over its own K/V
    q, k, v = qkv[-1]
    alone = AttentionMetadata(None, 0, None, None, [PrefillChunk(0, fresh, fresh, None)])
    got = paged_attention(q, k, v, None, alone, SCALE, window=window)
    torch.testing.assert_close(got, want[-1], rtol=1e-5, atol=1e-5)


def test_sliding_window_masks_keys_outside_it_for_decode_rows_and_chunks():
    """A decode row, a first chunk and a chunk with a past in one flat batch, window 5 (not a
    multiple of the block size): each query at p sees exactly keys p - 4 .. p."""
    torch.manual_seed(3)
    window = 5
    cache = _pool()
    dq, dk, dv = (
        torch.randn(11, HEADS, HD),
        torch.randn(11, KV_HEADS, HD),
        torch.randn(11, KV_HEADS, HD),
    )
    fq, fk, fv = (
        torch.randn(7, HEADS, HD),
        torch.randn(7, KV_HEADS, HD),
        torch.randn(7, KV_HEADS, HD),
    )
    pq, pk, pv = (
        torch.randn(13, HEADS, HD),
        torch.randn(13, KV_HEADS, HD),
        torch.randn(13, KV_HEADS, HD),
    )
    dtable, ftable, ptable = [2, 9, 17], [14, 15], [20, 21, 22, 23]
    _fill(cache, dtable, dk[:10], dv[:10])
    _fill(cache, ptable, pk[:6], pv[:6])  # 6 tokens of the third sequence already in the pool
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(
            _slots(dtable, [10]) + _slots(ftable, range(7)) + _slots(ptable, range(6, 13))
        ),
        num_decode_tokens=1,
        decode_block_tables=torch.tensor([dtable]),
        decode_context_lens=torch.tensor([11]),
        prefills=[
            PrefillChunk(1, 7, 7, torch.tensor(ftable)),
            PrefillChunk(8, 7, 13, torch.tensor(ptable)),
        ],
    )
    got = paged_attention(
        torch.cat([dq[10:], fq, pq[6:]]),
        torch.cat([dk[10:], fk, pk[6:]]),
        torch.cat([dv[10:], fv, pv[6:]]),
        cache,
        meta,
        SCALE,
        window=window,
    )
    want = [
        reference(dq[10:], dk, dv, torch.tensor([10]), window),
        reference(fq, fk, fv, torch.arange(7), window),
        reference(pq[6:], pk, pv, torch.arange(6, 13), window),
    ]
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-5, atol=1e-5)
    # and the window changed something: full attention differs for the decode row
    assert not torch.allclose(want[0], reference(dq[10:], dk, dv, torch.tensor([10])), atol=1e-3)


def test_a_float16_pool_is_read_in_float32():
    torch.manual_seed(4)
    k, v, q = torch.randn(6, KV_HEADS, HD), torch.randn(6, KV_HEADS, HD), torch.randn(6, HEADS, HD)
    cache = tuple(c.half() for c in _pool())
    table = [3, 4]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(_slots(table, range(6))),
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_context_lens=None,
        prefills=[PrefillChunk(0, 6, 6, torch.tensor(table))],
    )
    got = paged_attention(q, k, v, cache, meta, SCALE)
    assert got.dtype == torch.float32
    want = reference(q, k.half().float(), v.half().float(), torch.arange(6))
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
