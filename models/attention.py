"""Paged attention: reads and writes the KV block pool through explicit per-step metadata.

The engine's model runner lays out one step as a flat batch of tokens: first the decode tokens
(one per decoding sequence), then each prefill chunk's tokens back to back. It describes that
layout in `AttentionMetadata`; this module is the only code that turns the metadata into reads and
writes of the pool. There is no global context: everything attention needs is passed in.

Pool layout per layer: `(num_blocks, block_size, num_kv_heads, head_dim)` for K and for V. A token's
slot is `block_id * block_size + offset`; a sequence's block table lists its blocks in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from models.state import StateMetadata


@dataclass(slots=True)
class PrefillChunk:
    """One sequence that feeds more than one token (or its first chunk) this step."""

    token_start: int  # index of the chunk's first token in the flat batch
    num_tokens: int  # tokens of this chunk
    context_len: int  # tokens in the sequence once this chunk is written (past + chunk)
    block_table: torch.Tensor | None  # (num_blocks_of_seq,) long; None when running without a pool
    mask: torch.Tensor | None = field(init=False, default=None)  # (n, L) when the chunk has a past

    def __post_init__(self) -> None:
        past = self.context_len - self.num_tokens
        if past:
            # query i sits at absolute position past + i and sees keys 0 .. past + i
            qpos = torch.arange(past, self.context_len)[:, None]
            self.mask = torch.arange(self.context_len)[None, :] <= qpos  # (n, L)


@dataclass(slots=True)
class AttentionMetadata:
    """Where each new token's K/V goes and what each query attends to, for one step."""

    slot_mapping: torch.Tensor | None  # (T,) long: pool slot of each new K/V; None = no pool
    num_decode_tokens: int  # decode tokens come first in the flat batch, one per sequence
    decode_block_tables: torch.Tensor | None  # (B_dec, max_blocks) long, padded with block 0
    decode_context_lens: torch.Tensor | None  # (B_dec,) long: tokens each decode query attends to
    prefills: list[PrefillChunk]
    # A hybrid model's recurrent state slots for the step (None: no recurrent layers, or no
    # pool: a full recompute from zero state).
    state: StateMetadata | None = None
    # Built by the first layer and reused by the rest (the step's layers all share one layout):
    # which padded key slots each decode row may see.
    decode_mask: torch.Tensor | None = field(default=None, repr=False)  # (B_dec, 1, 1, L) bool
    _chunk_meta: torch.Tensor | None = field(default=None, repr=False)
    _chunk_tables: torch.Tensor | None = field(default=None, repr=False)

    def chunk_meta(self) -> torch.Tensor:
        """(C, 3) long rows [token_start, num_tokens, context_len], for the fused kernel."""
        if self._chunk_meta is None:
            rows = [[c.token_start, c.num_tokens, c.context_len] for c in self.prefills]
            self._chunk_meta = torch.tensor(rows, dtype=torch.long).view(-1, 3)
        return self._chunk_meta

    def kernel_args(self) -> tuple:
        """The step as the fused attention kernel takes it (`models.ops.attention`, and
        `decoder_layers` for every layer): slots, num_decode, decode block tables and context
        lengths (empty without decode rows), chunk_meta, chunk_tables."""
        empty = torch.empty(0, dtype=torch.long)
        tables, lens = self.decode_block_tables, self.decode_context_lens
        return (
            self.slot_mapping,
            self.num_decode_tokens,
            empty.view(0, 0) if tables is None else tables,
            empty if lens is None else lens,
            self.chunk_meta(),
            self.chunk_tables(),
        )

    def chunk_tables(self) -> torch.Tensor:
        """(C, max_blocks) long: each chunk's block table, padded with block 0."""
        if self._chunk_tables is None:
            tables = [c.block_table for c in self.prefills if c.block_table is not None]
            if not tables:
                self._chunk_tables = torch.zeros((len(self.prefills), 1), dtype=torch.long)
            else:
                width = max(len(t) for t in tables)
                out = torch.zeros((len(tables), width), dtype=torch.long)
                for i, t in enumerate(tables):
                    out[i, : len(t)] = t
                self._chunk_tables = out
        return self._chunk_tables


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Scatter this step's K/V (T, kv_heads, head_dim) into their pool slots."""
    n_kv, hd = k.shape[1], k.shape[2]
    k_cache.view(-1, n_kv, hd).index_copy_(0, slots, k)
    v_cache.view(-1, n_kv, hd).index_copy_(0, slots, v)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence's K or V: (length, kv_heads, head_dim)."""
    n_kv, hd = cache.shape[2], cache.shape[3]
    return cache[block_table].view(-1, n_kv, hd)[:length]


def _window_mask(qpos: torch.Tensor, length: int, window: int) -> torch.Tensor:
    """(n, length) bool: key j is visible from query position p when j <= p and, with a window,
    j > p - window."""
    kpos = torch.arange(length)[None, :]
    mask = kpos <= qpos[:, None]
    if window:
        mask &= kpos > qpos[:, None] - window
    return mask


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    softcap: float,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention (q (..., H, n, hd), k/v (..., KV, L, hd), bool masks: True
    attends), with Gemma 2's soft-capped scores when `softcap` > 0 and gpt-oss's attention sinks
    when `sinks` (H,) is given, which torch's fused kernel does not take: then scores, cap, mask
    and softmax are spelled out. A sink is a logit that joins its head's softmax as one more
    column and has no value: the column is dropped after the softmax."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    rep = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if is_causal:
        n, length = scores.shape[-2:]
        attn_mask = torch.ones(n, length, dtype=torch.bool).tril(length - n)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ v
    sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(*scores.shape[:-1], 1)  # (..., H, n, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return probs @ v


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for a flat batch. q: (T, heads, hd); k, v: (T, kv_heads, hd). Returns (T, heads, hd).

    With a pool, the new K/V are written first and every query then reads its context from the
    pool (so a chunk sees earlier chunks and cached prefixes). Without one (the naive engine's full
    recompute), each prefill chunk attends causally over its own K/V. `window` > 0 is sliding-window
    attention: the query at position p sees keys at positions in (p - window, p]. `softcap` > 0:
    scores soft-capped (softcap * tanh(score / softcap)) before the softmax, as Gemma 2.
    `sinks` (heads,): a logit per head that joins its softmax without a value, as gpt-oss's.
    `k`, `v` None: this layer computed no K/V and reads the pool only, which an earlier layer
    wrote this step (Gemma 4's shared-KV layers).

    Attention computes in float32 whatever the pool stores (a float16 pool is widened as read);
    int8 pools hold scaled rows only the cbserve kernel reads.
    """
    out_dtype = q.dtype
    if kv_cache is not None:
        k_cache, v_cache = kv_cache
        if k_cache.dtype == torch.int8:
            raise ValueError("an int8 KV pool is read by the cbserve attention kernel only")
        cdt = torch.float32 if k_cache.dtype == torch.float16 else k_cache.dtype
        # Attention runs in the pool's dtype (float32): bfloat16 weights still get fp32 attention.
        q = q.to(cdt)
        if k is not None and v is not None:
            write_kv(k_cache, v_cache, k.to(k_cache.dtype), v.to(k_cache.dtype), meta.slot_mapping)
            k, v = k.to(cdt), v.to(cdt)
    elif k is None or v is None:
        raise ValueError("a layer without K/V of its own reads them from a pool")
    out = torch.empty_like(q)

    nd = meta.num_decode_tokens
    if nd:
        assert kv_cache is not None, "decode needs a KV pool"
        tables = meta.decode_block_tables  # (B, nb)
        bsz, nb = tables.shape
        block_size, n_kv, hd = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        length = nb * block_size
        keys = k_cache[tables].view(bsz, length, n_kv, hd).transpose(1, 2).to(cdt)
        vals = v_cache[tables].view(bsz, length, n_kv, hd).transpose(1, 2).to(cdt)
        if window:
            mask = _window_mask(meta.decode_context_lens - 1, length, window)[:, None, None, :]
        else:
            if meta.decode_mask is None:
                pos = torch.arange(length)
                meta.decode_mask = (pos[None, :] < meta.decode_context_lens[:, None])[
                    :, None, None, :
                ]
            mask = meta.decode_mask  # (B, 1, 1, L)
        qd = q[:nd].unsqueeze(2)  # (B, heads, 1, hd)
        o = _sdpa(qd, keys, vals, scale, softcap, mask, sinks=sinks)  # (B, heads, 1, hd)
        out[:nd] = o.squeeze(2)

    for chunk in meta.prefills:
        s, n = chunk.token_start, chunk.num_tokens
        qc = q[s : s + n].transpose(0, 1).unsqueeze(0)  # (1, heads, n, hd)
        past = chunk.context_len - n
        if k is not None and (kv_cache is None or past == 0):
            # The chunk is the whole context: its own K/V are exactly what the pool now holds.
            kc, vc = k[s : s + n], v[s : s + n]
        else:
            kc = _gather(k_cache, chunk.block_table, chunk.context_len).to(q.dtype)
            vc = _gather(v_cache, chunk.block_table, chunk.context_len).to(q.dtype)
        kc = kc.transpose(0, 1).unsqueeze(0)  # (1, kv, L, hd)
        vc = vc.transpose(0, 1).unsqueeze(0)  # (1, kv, L, hd)
        if window and chunk.context_len > window:
            mask = _window_mask(torch.arange(past, chunk.context_len), chunk.context_len, window)
            o = _sdpa(qc, kc, vc, scale, softcap, mask, sinks=sinks)
        elif past == 0:
            o = _sdpa(qc, kc, vc, scale, softcap, is_causal=True, sinks=sinks)
        else:
            o = _sdpa(qc, kc, vc, scale, softcap, chunk.mask, sinks=sinks)
        out[s : s + n] = o[0].transpose(0, 1)
    return out.to(out_dtype)
