"""A hybrid model's recurrent state for one step: the per-request state slots its recurrent
layers read and write, and where in the step's flat token batch each request's tokens are.

The engine's model runner owns the state pool (`engine.state_pool` decides which slot is whose)
and describes a step in `StateMetadata`, which rides in `AttentionMetadata.state`. Every
recurrent layer (`models.recurrent`) reads the same layout: the step's sequences in the flat
batch's order (decode rows, one token each, then prefill chunks), each computing from the state
in its slot and leaving its new state there, and the snapshots to write on the way (the state
after some of a sequence's tokens, copied into a snapshot slot for the prefix cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class StateMetadata:
    """Where each sequence of a step keeps its recurrent state, and which snapshots to take.

    `seqs` (S, 3) long: per sequence in flat-batch order, [first token, tokens, state slot].
    `snapshots` (P, 3) long: [sequence index, tokens of it after which, snapshot slot], sorted
    by sequence then tokens. `pools`: per recurrent layer, its (conv history, recurrent state)
    pools, (slots, K - 1, channels) and (slots, *state) float32 (`models.config.StateLayout`).
    """

    seqs: torch.Tensor
    snapshots: torch.Tensor
    pools: list[tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def fresh(
        cls, spans: list[tuple[int, int]], pools: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> StateMetadata:
        """Sequences (first token, tokens) each in its own slot of `pools` (slot i for
        sequence i), no snapshots: a full recompute's temporary state."""
        seqs = torch.tensor([[s, n, i] for i, (s, n) in enumerate(spans)], dtype=torch.long)
        return cls(seqs.view(-1, 3), torch.empty((0, 3), dtype=torch.long), pools)

    def rows(self) -> list[tuple[int, int, int, list[tuple[int, int]]]]:
        """(first token, tokens, slot, [(after, snapshot slot), ...]) per sequence, as Python
        ints (the pure-torch layers' loop)."""
        snaps: dict[int, list[tuple[int, int]]] = {}
        for seq, after, slot in self.snapshots.tolist():
            snaps.setdefault(seq, []).append((after, slot))
        return [(s, n, slot, snaps.get(i, [])) for i, (s, n, slot) in enumerate(self.seqs.tolist())]
