"""Turns scheduled work into flat tensors, runs the model once, returns logits for sampling rows.

It owns the KV pool tensors: one `(layers, 2, num_blocks, block_size, kv_heads, head_dim)` tensor
(the model config's `KVLayout`), allocated once from the block count; a model whose layers differ
in shape has one such tensor per shape (`KVLayout.groups`), and a layer that shares an earlier
layer's K/V is handed that layer's pools (`kv_caches`), owning none. For a hybrid model it also
owns the recurrent state pool (the config's `StateLayout`: conv histories and recurrent states,
float32, one slot per `engine.state_pool.StateSlots` slot). It needs of the model only
`models.base.CausalLM`. Per step it builds input ids, positions, the slot each new
K/V goes to, block tables and context lengths, and each sequence's state slot and snapshots
(`models.state.StateMetadata`); it never decides who runs.

Rows that feed one token (decodes, and a prompt's last single-token chunk) form the batched decode
group and come first; multi-token chunks follow. A wasted row (static batching's finished member)
re-feeds its last computed token at its own position and writes the K/V into the reserved block 0,
so it costs a full decode row without disturbing anything a live request reads.
"""

from __future__ import annotations

import numpy as np
import torch

from engine import prompt_outputs
from engine.block_manager import NULL_BLOCK
from engine.scheduler import ScheduledRequest
from engine.state_pool import StateSlots
from models.attention import AttentionMetadata, PrefillChunk
from models.base import CausalLM
from models.state import StateMetadata


def _zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor whose pages are touched as used (see `models.config.KVLayout.allocate`)."""
    np_dtype = torch.empty((), dtype=dtype).numpy().dtype
    return torch.from_numpy(np.zeros(shape, dtype=np_dtype))


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        states: StateSlots | None = None,
    ) -> None:
        layout = model.config.kv_layout
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.pools, self.kv_caches = layout.allocate(num_blocks, block_size)
        # (the one pool tensor of a uniform layout, which `read_blocks` moves between pools)
        self.kv = self.pools[0] if layout.uniform else None
        # A hybrid model's recurrent state: (layers, slots, ...) conv histories and states.
        self.states = states
        state_layout = model.config.state_layout
        self.state_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        if state_layout is not None:
            if states is None:
                raise ValueError("a model with recurrent layers needs state slots")
            conv_shape, ssm_shape = state_layout.pool_shapes(states.num_slots)
            self.conv_states = _zeros(conv_shape, torch.float32)
            self.ssm_states = _zeros(ssm_shape, torch.float32)
            self.state_caches = [
                (self.conv_states[i], self.ssm_states[i]) for i in range(state_layout.num_layers)
            ]

    def sync_states(self) -> None:
        """Apply the state pool's pending copies (zeroed slots for new requests, snapshots
        copied in for prefix hits), in the order they were recorded."""
        if self.states is None:
            return
        for src, dst in self.states.take_ops():
            for pool in (self.conv_states, self.ssm_states):
                if src is None:
                    pool[:, dst].zero_()
                else:
                    pool[:, dst] = pool[:, src]

    def read_state(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of one slot's conv histories and states in every recurrent layer."""
        self.sync_states()
        return self.conv_states[:, slot].clone(), self.ssm_states[:, slot].clone()

    def write_state(self, slot: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Overwrite one slot with states laid out as `read_state` returns them."""
        self.sync_states()  # (a pending zeroing of the slot must not land after this)
        self.conv_states[:, slot] = conv
        self.ssm_states[:, slot] = ssm

    @torch.no_grad()
    def warm_up(self) -> None:
        """One forward of the step's two shapes, a prompt chunk and a decode row, and their
        logits, written into the reserved block 0 (as a wasted row's K/V), before any request.

        A first step otherwise pays for what only the first touch costs: every weight page the
        loader handed back to the page cache (or a disk read, on a cold start), the kernels'
        thread pool and scratch; 0.3-1.1 s on the first request after a start of the 1B and
        3.8B files. llama-server runs a warm-up pass at load for the same reason.
        """
        # the decode row at position n, then the chunk at positions 0 .. n-1 (a chunk feeds
        # more than one token, so a block of under 3 slots warms the decode row alone)
        n = min(8, self.block_size - 1) if self.block_size >= 3 else 0
        base = NULL_BLOCK * self.block_size
        table = torch.tensor([NULL_BLOCK], dtype=torch.long)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([base + n, *range(base, base + n)], dtype=torch.long),
            num_decode_tokens=1,
            decode_block_tables=table.view(1, 1),
            decode_context_lens=torch.tensor([n + 1], dtype=torch.long),
            prefills=[PrefillChunk(1, n, n, table)] if n else [],
        )
        if self.states is not None:
            # both rows in the scratch slot (nothing reads it), the chunk after the decode row
            scratch = self.states.scratch
            spans = [[0, 1, scratch]] + ([[1, n, scratch]] if n else [])
            meta.state = StateMetadata(
                torch.tensor(spans, dtype=torch.long),
                torch.empty((0, 3), dtype=torch.long),
                self.state_caches,
            )
        ids = torch.zeros(n + 1, dtype=torch.long)
        positions = torch.tensor([n, *range(n)], dtype=torch.long)
        hidden = self.model(ids, positions, self.kv_caches, meta)
        self.model.compute_logits(hidden[[0, n]])

    def _uniform_pool(self) -> torch.Tensor:
        if self.kv is None:
            raise ValueError("moving KV blocks between pools of layers of several shapes")
        return self.kv

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of whole blocks' K and V in every layer, for moving a cache between pools."""
        index = torch.tensor(block_ids, dtype=torch.long)
        return self._uniform_pool()[:, :, index]  # (layers, 2, n, block_size, kv_heads, head_dim)

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Overwrite whole blocks with K/V laid out as `read_blocks` returns them."""
        self._uniform_pool()[:, :, torch.tensor(block_ids, dtype=torch.long)] = blocks

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, rows: list[ScheduledRequest]) -> tuple[torch.Tensor, list[ScheduledRequest]]:
        """Run one forward over all rows. Returns (logits (N, V), the N rows that sample)."""
        decode_rows = [r for r in rows if r.wasted or r.num_new_tokens == 1]
        chunk_rows = [r for r in rows if not r.wasted and r.num_new_tokens > 1]
        self.sync_states()

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        ctx_lens: list[int] = []
        sample_idx: list[int] = []
        sample_rows: list[ScheduledRequest] = []
        # (state, first flat index, first position, tokens) of rows whose prompt's hidden
        # states are wanted (prompt logprobs, embeddings: engine.prompt_outputs)
        spans: list[tuple] = []

        for r in decode_rows:
            s = r.state
            pos = s.num_computed_tokens - 1 if r.wasted else s.num_computed_tokens
            input_ids.append(s.token_ids[pos])
            positions.append(pos)
            slots.append(NULL_BLOCK * self.block_size if r.wasted else self._slot(s.block_ids, pos))
            tables.append(s.block_ids)
            ctx_lens.append(pos + 1)
            if s.prompt_out is not None and not r.wasted and pos < s.num_prompt_tokens:
                spans.append((s, len(input_ids) - 1, pos, 1))
            if r.samples and not prompt_outputs.is_prefill_only(s):
                sample_idx.append(len(input_ids) - 1)
                sample_rows.append(r)

        prefills: list[PrefillChunk] = []
        for r in chunk_rows:
            s, start, n = r.state, r.state.num_computed_tokens, r.num_new_tokens
            token_start = len(input_ids)
            input_ids.extend(s.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(self._slot(s.block_ids, p) for p in range(start, start + n))
            nb = -(-(start + n) // self.block_size)
            prefills.append(
                PrefillChunk(
                    token_start, n, start + n, torch.tensor(s.block_ids[:nb], dtype=torch.long)
                )
            )
            if s.prompt_out is not None:
                spans.append((s, token_start, start, n))
            if r.samples and not prompt_outputs.is_prefill_only(s):
                sample_idx.append(len(input_ids) - 1)
                sample_rows.append(r)

        decode_tables = decode_lens = None
        if decode_rows:
            width = max(-(-n // self.block_size) for n in ctx_lens)
            decode_tables = torch.tensor(
                [t[:width] + [NULL_BLOCK] * (width - len(t[:width])) for t in tables],
                dtype=torch.long,
            )
            decode_lens = torch.tensor(ctx_lens, dtype=torch.long)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            num_decode_tokens=len(decode_rows),
            decode_block_tables=decode_tables,
            decode_context_lens=decode_lens,
            prefills=prefills,
        )
        if self.states is not None:
            meta.state = self._state_metadata(decode_rows, chunk_rows, prefills)
        ids = torch.tensor(input_ids, dtype=torch.long)
        pos_t = torch.tensor(positions, dtype=torch.long)
        hidden = self.model(ids, pos_t, self.kv_caches, meta)  # (T, d)
        if spans:
            prompt_outputs.collect(self.model, hidden, spans)
        if not sample_rows:
            return hidden.new_empty((0, self.model.config.vocab_size)), []
        logits = self.model.compute_logits(hidden[torch.tensor(sample_idx)])  # (N, V)
        return logits, sample_rows

    def _state_metadata(
        self,
        decode_rows: list[ScheduledRequest],
        chunk_rows: list[ScheduledRequest],
        prefills: list[PrefillChunk],
    ) -> StateMetadata:
        """Each sequence's state slot, in the flat batch's order, and its snapshots. (A wasted
        row, a finished member of a static batch, computes in the slot it still holds.)"""
        assert self.states is not None
        seqs: list[list[int]] = []
        snaps: list[list[int]] = []
        starts = [*range(len(decode_rows)), *(c.token_start for c in prefills)]
        for i, r in enumerate([*decode_rows, *chunk_rows]):
            slot = r.state.state_slot
            assert slot is not None, "a scheduled request of a hybrid model holds a state slot"
            n = 1 if r.wasted else r.num_new_tokens
            seqs.append([starts[i], n, slot])
            snaps += [[i, after, dst] for after, dst in r.snapshots]
        return StateMetadata(
            torch.tensor(seqs, dtype=torch.long).view(-1, 3),
            torch.tensor(snaps, dtype=torch.long).view(-1, 3),
            self.state_caches,
        )


def run_full_sequence(model: CausalLM, token_ids: list[int]) -> torch.Tensor:
    """No pool: attend causally over the whole sequence and return the last logits (1, V).

    The naive engine's path: full recompute, nothing cached.
    """
    n = len(token_ids)
    meta = AttentionMetadata(None, 0, None, None, [PrefillChunk(0, n, n, None)])
    hidden = model(torch.tensor(token_ids, dtype=torch.long), torch.arange(n), None, meta)  # (T, d)
    return model.compute_logits(hidden[-1:])
