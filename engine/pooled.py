"""Engines made of pools: `PooledEngine`, the base of the disaggregated engine and its tiers.

A pooled engine owns no request table of its own. Each live request is in exactly one of its
pools (`BatchEngine`s, driven through their hand-off API) or in its `held` queue (between two
pools: prefilled and waiting for a decode slot, or arrived from another process with its K/V), and
`requests` is a view over those; so a request that finishes or is aborted in a pool is gone from
the engine too, with no second table to prune.

What the disaggregated engine (`engine.disaggregated`) and the tiers (`engine.tiers`) share is
here, once: the prompt-fit check (`_check_split_fits`), the step that admits held requests into a
decode pool and writes their K/V (`_admit_held`), and the stats merge (`_merged_stats`).
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable, Mapping
from dataclasses import fields

from engine.batch import BatchEngine
from engine.core import EngineBase
from engine.errors import RequestTooLongError
from engine.interface import EngineConfig, EngineStats
from engine.kv_connector import KVConnector
from engine.request import Request, RequestState, StepOutput
from models.base import CausalLM, LoadedModel


class PooledEngine(EngineBase):
    """An engine whose requests live in its `pools` or, between two pools, in `held`."""

    def __init__(
        self, model: CausalLM | LoadedModel, config: EngineConfig, pools: tuple[BatchEngine, ...]
    ) -> None:
        super().__init__(model, config)
        if not self.model_config.kv_layout.uniform:
            # (K/V moves between pools as one tensor of every layer's blocks: engine.kv_connector)
            raise ValueError(
                f"{self.name}: the K/V of a model whose layers differ in KV shape or share K/V "
                "cannot move between pools"
            )
        self.pools = pools
        # Requests in no pool, oldest first (a dict: ordered, and found by id).
        self.held: dict[str, RequestState] = {}

    @property
    def requests(self) -> Mapping[str, RequestState]:  # type: ignore[override]
        return ChainMap(*(p.requests for p in self.pools), self.held)

    def _dequeue(self, state: RequestState) -> None:
        for pool in self.pools:
            if state.request_id in pool.requests:
                pool.remove(state)
                return
        del self.held[state.request_id]
        self._drop_held(state)

    def _drop_held(self, state: RequestState) -> None:
        """A held request was aborted: free what it holds outside the pools' bookkeeping."""

    def _step_pools(self, *pools: BatchEngine) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        for pool in pools:
            outputs += pool.step()
        self.total_slot_steps = sum(p.total_slot_steps for p in self.pools)
        self.wasted_slot_steps = sum(p.wasted_slot_steps for p in self.pools)
        return outputs

    # -- shared by the disaggregated engine and the tiers ---------------------------------------

    @staticmethod
    def _check_split_fits(
        request: Request,
        total_tokens: int,
        prefill: BatchEngine | None,
        decode: BatchEngine | None,
    ) -> None:
        """Refuse a request whose prompt could never fit the prefill pool, or whose prompt plus
        output could never fit the decode pool (either may be absent: another process's)."""
        if prefill is not None:
            bm = prefill.block_manager
            n_prompt = len(request.prompt_token_ids)
            need = bm.blocks_for(n_prompt)
            if need > bm.num_usable_blocks:
                raise RequestTooLongError(
                    f"a {n_prompt}-token prompt needs {need} KV blocks but the prefill pool has "
                    f"{bm.num_usable_blocks}"
                )
        if decode is not None:
            decode.check_fits(total_tokens)

    def _admit_held(
        self,
        pool: BatchEngine,
        connector: KVConnector,
        take_payload: Callable[[RequestState], bytes],
    ) -> None:
        """Move held requests into `pool`, oldest first, while it has a free slot and blocks for
        the whole sequence so far (the sampled token too, so its first decode step needs no new
        block); `take_payload` gives each one's K/V, which is written into its new blocks.
        Requests the pool preempted go first: they were there before any newcomer."""
        while self.held and not pool.scheduler.waiting:
            state = next(iter(self.held.values()))
            if not pool.can_admit(state.num_tokens):
                return
            del self.held[state.request_id]
            payload = take_payload(state)
            pool.admit_running(state)
            num_blocks = pool.block_manager.blocks_for(state.num_computed_tokens)
            connector.receive(payload, pool.runner, state.block_ids[:num_blocks], state.state_slot)

    def _merged_stats(self) -> dict[str, int]:
        """Every pool's `EngineStats` fields, summed."""
        each = [p.stats() for p in self.pools]
        merged = {f.name: sum(getattr(s, f.name) for s in each) for f in fields(EngineStats)}
        merged["state_bytes_per_slot"] = max(s.state_bytes_per_slot for s in each)
        return merged
