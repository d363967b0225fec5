"""Paged KV bookkeeping in plain Python ints: free queue, ref counts, block tables, prefix cache.

The pool holds `num_blocks` blocks of `block_size` token slots. Block 0 is reserved: it pads block
tables and takes writes that must land somewhere harmless (the static engine's computed-but-wasted
rows), so it is never handed to a request. The tensors themselves live in the model runner; this
module only decides which block ids a request owns.

Prefix caching: a full block is named by a chained key, a BLAKE2b digest of the key of the block
before it and its own token ids (`block_keys`), so equal keys mean equal prefixes. The chain starts
from a root digest of the model's identity and the request's `cache_salt`: requests with different
salts (tenants that opt out of sharing) never share a block. A cryptographic hash, not Python's
`hash()`: a 64-bit non-cryptographic key can be made to collide (or collides by chance at scale), and
a collision would serve one user's KV blocks to another's prompt (vLLM's GHSA-rm76-4mrf-v9r8). A freed block keeps its key and goes to the back of
the free queue; a later request whose prefix matches takes it back (a hit) and shares it by ref
count. Blocks are evicted from the front of the free queue (least recently freed) only when an
allocation needs them.

A hybrid model's recurrent state (`states`, `engine.state_pool.StateSlots`) is allocated and
freed with the blocks: a request takes a live state slot when it first gets blocks and gives it
back when it frees them. Its prefix hits end at a block whose state snapshot is kept (a block's
K/V alone cannot restart a recurrence); `plan_snapshots` says where in a step's prompt chunks
the forward writes them (`engine.state_pool.snapshot_points`), and a snapshot is dropped when
its block is evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.request import RequestState
from engine.state_pool import StateSlots, snapshot_points

NULL_BLOCK = 0

BlockKey = bytes  # 32-byte BLAKE2b digest of (previous block's key, this block's token ids)
_DIGEST = 32


def root_key(model: str | None = None, salt: str | None = None) -> bytes:
    """The chain's start: a digest of the model identity and the cache salt (None: no salt, which
    is distinct from every string salt, the empty one included)."""
    h = hashlib.blake2b(b"cbserve-prefix-v1", digest_size=_DIGEST)
    for part in (model, salt):
        if part is None:
            h.update(b"\x00")
        else:
            raw = part.encode("utf-8", "surrogatepass")
            h.update(b"\x01" + len(raw).to_bytes(8, "little") + raw)
    return h.digest()


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None = None,
    *,
    model: str | None = None,
    parent: bytes | None = None,
    start: int = 0,
) -> list[bytes]:
    """The chained prefix-cache keys of every full block of `token_ids`.

    Key i is BLAKE2b-256(key i-1 || block i's token ids as little-endian int64), key -1 being
    `root_key(model, salt)`. Equal keys mean equal token prefixes under the same model and salt.
    The engine passes its model config's `name` as `model`; a router that predicts which replica
    caches a prompt calls this with the same arguments. `parent` and `start` continue a chain:
    the keys of the full blocks from block `start` on, `parent` being block `start - 1`'s key.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    key = root_key(model, salt) if parent is None else parent
    end = len(token_ids) // block_size * block_size
    begin = start * block_size
    if begin >= end:
        return []
    # One int64 conversion for the whole run, then one digest per block over a slice of it.
    raw = array("q", token_ids[begin:end]).tobytes()
    width = block_size * 8
    blake2b = hashlib.blake2b
    keys: list[bytes] = []
    for i in range(0, len(raw), width):
        key = blake2b(key + raw[i : i + width], digest_size=_DIGEST).digest()
        keys.append(key)
    return keys


@dataclass(slots=True)
class PrefixCacheCounters:
    queried_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        model_identity: str | None = None,
        states: StateSlots | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.model_identity = model_identity  # part of every key's root (see `block_keys`)
        self.ref_counts = [0] * num_blocks
        # Free blocks in eviction order (front first). OrderedDict: O(1) pop-front and removal
        # of a cached block that a prefix hit takes back.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self._key_of_block: dict[int, BlockKey] = {}
        self._block_of_key: dict[BlockKey, int] = {}
        self.counters = PrefixCacheCounters()
        self.states = states  # a hybrid model's state slots, or None

    # -- queries -------------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free, cached or not)."""
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache --------------------------------------------------------------------------

    def _block_keys(self, state: RequestState, num_full_blocks: int) -> list[BlockKey]:
        """The keys of the request's first `num_full_blocks` blocks, kept on the state and
        extended as it grows: a full block's tokens never change (a preempted request keeps its
        tokens), so each block is hashed once in the request's life."""
        keys = state.block_hashes
        if len(keys) < num_full_blocks:
            if not keys:
                parent = root_key(self.model_identity, state.request.cache_salt)
            else:
                parent = keys[-1]
            keys.extend(
                block_keys(
                    state.token_ids[: num_full_blocks * self.block_size],
                    self.block_size,
                    parent=parent,
                    start=len(keys),
                )
            )
        return keys[:num_full_blocks]

    def lookup_prefix(self, state: RequestState) -> list[int]:
        """Cached blocks for the longest run of full blocks of the request's tokens.

        The last token is never served from cache: the step must compute at least one token to
        produce the logits that sample the next.
        """
        # A request that needs its prompt's hidden states (prompt logprobs, an embedding)
        # recomputes them: the cache keeps only K/V (engine.prompt_outputs).
        if not self.enable_prefix_caching or state.prompt_out is not None:
            return []
        max_blocks = (state.num_tokens - 1) // self.block_size
        hits: list[int] = []
        keys = self._block_keys(state, max_blocks)
        for key in keys:
            block = self._block_of_key.get(key)
            if block is None:
                break
            hits.append(block)
        if self.states is not None:
            # a recurrence restarts only from a snapshot: the hit ends at the last one
            snapshots = [i + 1 for i in range(len(hits)) if self.states.has_snapshot(keys[i])]
            hits = hits[: max(snapshots, default=0)]
        return hits

    def count_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """Record a request's first admission: its prompt was looked up, this much was a hit."""
        self.counters.queried_tokens += num_prompt_tokens
        self.counters.hit_tokens += num_hit_tokens

    def cache_full_blocks(self, state: RequestState) -> None:
        """Name every block of the request that is now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = state.num_computed_tokens // self.block_size
        keys = self._block_keys(state, num_full)
        for block, key in zip(state.block_ids[:num_full], keys, strict=True):
            if block in self._key_of_block:
                continue
            # A duplicate (two requests computed the same prefix at once) stays unnamed.
            if key not in self._block_of_key:
                self._key_of_block[block] = key
                self._block_of_key[key] = block

    def plan_snapshots(self, state: RequestState, num_new_tokens: int) -> list[tuple[int, int]]:
        """For a chunk of `num_new_tokens` tokens the request computes from its
        `num_computed_tokens`: where the forward must copy its state out, as (tokens of the
        chunk after which, snapshot slot) pairs, the slots taken now (a hybrid model with
        prefix caching; else none)."""
        if self.states is None or not self.enable_prefix_caching or state.state_slot is None:
            return []
        if state.prompt_out is not None:  # (such a request never hits: nothing to keep)
            return []
        start = state.num_computed_tokens
        points = snapshot_points(
            start, start + num_new_tokens, state.num_prompt_tokens, self.block_size
        )
        if not points:
            return []
        keys = self._block_keys(state, points[-1] // self.block_size)
        out = []
        for p in points:
            slot = self.states.snapshot(keys[p // self.block_size - 1])
            if slot is not None:
                out.append((p - start, slot))
        return out

    # -- allocation ----------------------------------------------------------------------------

    def allocate(
        self, state: RequestState, num_tokens: int, prefix_blocks: list[int] | None = None
    ) -> bool:
        """Make `state.block_ids` cover `num_tokens` tokens, starting from `prefix_blocks` if given.

        All or nothing: returns False (and changes nothing) when the pool cannot deliver.
        """
        prefix_blocks = prefix_blocks or []
        have = len(state.block_ids) + len(prefix_blocks)
        need = self.blocks_for(num_tokens) - have
        # Taking back cached blocks that sit in the free queue uses up free blocks too.
        reclaimed = sum(1 for b in prefix_blocks if self.ref_counts[b] == 0)
        if max(need, 0) + reclaimed > len(self._free):
            return False
        if self.states is not None and state.state_slot is None:
            # (a prefix hit resumes from the snapshot at its last block: `lookup_prefix`)
            restore = self._key_of_block[prefix_blocks[-1]] if prefix_blocks else None
            slot = self.states.take_live(restore_from=restore)
            if slot is None:
                return False
            state.state_slot = slot
        for b in prefix_blocks:
            if self.ref_counts[b] == 0:
                del self._free[b]
            self.ref_counts[b] += 1
        state.block_ids.extend(prefix_blocks)
        for _ in range(max(need, 0)):
            state.block_ids.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        key = self._key_of_block.pop(block, None)
        if key is not None:
            del self._block_of_key[key]
            self.counters.evictions += 1
            if self.states is not None:
                self.states.drop(key)
        self.ref_counts[block] = 1
        return block

    def free(self, state: RequestState) -> None:
        """Release the request's blocks. Tail blocks go first into the free queue, so they are
        evicted before the shared prefix blocks that other requests are more likely to reuse."""
        for block in reversed(state.block_ids):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self._free[block] = None
                if block not in self._key_of_block:
                    # Unnamed blocks hold nothing worth keeping: hand them out first.
                    self._free.move_to_end(block, last=False)
        state.block_ids = []
        if state.state_slot is not None:
            assert self.states is not None
            self.states.release_live(state.state_slot)
            state.state_slot = None
