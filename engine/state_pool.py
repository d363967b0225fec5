"""Recurrent state slots in plain Python ints: which slot each running request computes in, and
which slots hold the prefix cache's state snapshots. No tensors (the model runner owns them).

A hybrid model (LFM2, Qwen3.5, Granite 4.0-H) keeps, per request and recurrent layer, a
fixed-size state that every token overwrites (`models.config.StateLayout`). The pool has three
kinds of slot, numbered in this order:

- live slots, one per running request: taken on admission, given back on finish, abort and
  preemption (a preempted request recomputes its state from its tokens, as its K/V). They bound
  how many requests run at once, so the engine's batch is no larger than their number;
- snapshot slots: the state at the end of a block, kept for the prefix cache under that block's
  key (`engine.block_manager.block_keys`). A prefix hit on a hybrid model must end where a
  snapshot is: its state is copied into the request's live slot and computing resumes after it.
  The recurrent layers write snapshots during the forward, at the token they are taken after
  (`snapshot_points`: every `SNAPSHOT_INTERVAL` tokens of a prompt and at its last full block),
  so no prompt chunk is cut short for them; a snapshot is dropped when its block is evicted
  from the prefix cache, and otherwise evicted least recently used first when a new one needs
  the room;
- one scratch slot, which nothing owns: the warm-up forward computes in it.

A slot's content changes outside a forward by copies, which the runner applies before it next
runs the model (`take_ops`): a fresh request's slot zeroed, a hit's snapshot copied in.
Free live slots are reused last-freed first, so a quiet server touches (and keeps resident) few.

Why every `SNAPSHOT_INTERVAL` tokens: a shared prefix (a system prompt) ends anywhere, and a
later request can resume only from a snapshot at or before that end; kept every 256 tokens, a
hit loses at most 255 of the shared tokens, whatever the earlier request's chunks were. A
snapshot costs one copy of the state (1.1 MB a layer for Qwen3.5-0.8B) per 256 prompt tokens,
against hundreds of milliseconds of compute for those tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

# Prompt positions (multiples of the block size) after which a snapshot is kept.
SNAPSHOT_INTERVAL = 256


def snapshot_points(start: int, end: int, num_prompt_tokens: int, block_size: int) -> list[int]:
    """The positions p in (start, end] after which a chunk computing tokens [start, end) keeps
    a snapshot: every multiple of the interval (rounded up to a whole block) and the prompt's
    last full block, never past the prompt."""
    interval = -(-SNAPSHOT_INTERVAL // block_size) * block_size
    last = num_prompt_tokens // block_size * block_size
    top = min(end, last)
    points = list(range((start // interval + 1) * interval, top + 1, interval))
    if start < last <= end and (not points or points[-1] != last):
        points.append(last)
    return points


class StateOp(NamedTuple):
    """Make slot `dst` a copy of slot `src`, or zeros when `src` is None."""

    src: int | None
    dst: int


@dataclass(slots=True)
class SnapshotCounters:
    taken: int = 0  # snapshots copied out of a live slot
    restored: int = 0  # prefix hits that resumed from one
    evicted: int = 0  # dropped for room or with their block


class StateSlots:
    """The state pool's bookkeeping (see the module docstring)."""

    def __init__(self, num_live: int, num_snapshots: int) -> None:
        if num_live < 1:
            raise ValueError(f"a hybrid model needs at least one live state slot, got {num_live}")
        if num_snapshots < 0:
            raise ValueError(f"num_snapshots must be >= 0, got {num_snapshots}")
        self.num_live = num_live
        self.num_snapshots = num_snapshots
        self.scratch = num_live + num_snapshots
        self.num_slots = self.scratch + 1
        # stacks: pop() gives the lowest-numbered (then the most recently freed) slot
        self._free_live = list(range(num_live - 1, -1, -1))
        self._free_snapshots = list(range(self.scratch - 1, num_live - 1, -1))
        self._snapshot_of_key: OrderedDict[bytes, int] = OrderedDict()  # least recent first
        self.pending: list[StateOp] = []
        self.counters = SnapshotCounters()

    # -- live slots ------------------------------------------------------------------------------

    @property
    def num_free_live(self) -> int:
        return len(self._free_live)

    def take_live(self, restore_from: bytes | None = None) -> int | None:
        """A live slot for a request starting now (None: all taken), zeroed, or holding the
        snapshot of block key `restore_from` (which must exist: `has_snapshot`)."""
        if not self._free_live:
            return None
        slot = self._free_live.pop()
        if restore_from is None:
            self.pending.append(StateOp(None, slot))
        else:
            src = self._snapshot_of_key[restore_from]
            self._snapshot_of_key.move_to_end(restore_from)
            self.pending.append(StateOp(src, slot))
            self.counters.restored += 1
        return slot

    def release_live(self, slot: int) -> None:
        assert 0 <= slot < self.num_live and slot not in self._free_live, f"slot {slot} freed twice"
        self._free_live.append(slot)

    # -- snapshots -------------------------------------------------------------------------------

    @property
    def num_cached_snapshots(self) -> int:
        return len(self._snapshot_of_key)

    def has_snapshot(self, key: bytes) -> bool:
        return key in self._snapshot_of_key

    def snapshot(self, key: bytes) -> int | None:
        """A snapshot slot for block `key`'s state, which the step's forward will write (None:
        that block's is kept already, or there are no snapshot slots). The least recently used
        snapshot makes room if none is free."""
        if self.num_snapshots == 0:
            return None
        if key in self._snapshot_of_key:
            self._snapshot_of_key.move_to_end(key)
            return None
        if self._free_snapshots:
            slot = self._free_snapshots.pop()
        else:
            _, slot = self._snapshot_of_key.popitem(last=False)
            self.counters.evicted += 1
        self._snapshot_of_key[key] = slot
        self.counters.taken += 1
        return slot

    def drop(self, key: bytes) -> None:
        """Forget block `key`'s snapshot (the block left the prefix cache)."""
        slot = self._snapshot_of_key.pop(key, None)
        if slot is not None:
            self._free_snapshots.append(slot)
            self.counters.evicted += 1

    # -- for the runner --------------------------------------------------------------------------

    def take_ops(self) -> list[StateOp]:
        """The copies recorded since the last call, in order; the runner applies them before it
        next reads or writes a slot."""
        ops, self.pending = self.pending, []
        return ops
