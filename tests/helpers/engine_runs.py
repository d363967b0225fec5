"""Requests run through an engine to completion: a batch of specs, each request alone (the
reference a batch must reproduce), greedy continuations, and the logits an engine samples from."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from engine import ContinuousBatchEngine, EngineBase, Request, SamplingParams
from models import LoadedModel

Spec = tuple[list[int], int]  # (prompt token ids, max_tokens)


def mixed_specs(n: int = 20, seed: int = 0, max_prompt: int = 120, max_out: int = 40) -> list[Spec]:
    """Mixed prompt lengths and output budgets, random byte prompts."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(256) for _ in range(rng.randint(3, max_prompt))], rng.randint(1, max_out))
        for _ in range(n)
    ]


def greedy(n: int, i: int) -> SamplingParams:
    return SamplingParams(max_tokens=n)


def seeded(n: int, i: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.8, top_p=0.9, seed=1000 + i)


def serve(
    engine,
    specs: list[Spec],
    params: Callable[[int, int], SamplingParams] = greedy,
    max_steps: int = 100_000,
) -> list[list[int]]:
    """Add every request up front, step until done; the output tokens of each, in spec order."""
    ids = []
    outputs: dict[str, list[int]] = {}
    for i, (prompt, n) in enumerate(specs):
        r = Request(prompt_token_ids=list(prompt), params=params(n, i))
        ids.append(r.request_id)
        outputs[r.request_id] = []
        engine.add_request(r)
    steps = 0
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].extend(out.token_ids)
        steps += 1
        assert steps < max_steps, "engine did not finish"
    return [outputs[i] for i in ids]


def serve_individually(model, specs: list[Spec], params=greedy, engine_cls=ContinuousBatchEngine):
    """Each request alone in a fresh engine: the reference a batch must reproduce."""
    return [
        serve(engine_cls(model, max_batch_size=1), [spec], lambda n, _i, i=i: params(n, i))[0]
        for i, spec in enumerate(specs)
    ]


def engine_greedy(lm: LoadedModel, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuations of all prompts, batched together in the continuous-batching engine."""
    engine = ContinuousBatchEngine(lm.model, max_batch_size=len(prompts), kv_cache_memory_gib=0.1)
    return run_greedy(engine, prompts, n)


def run_greedy(engine: EngineBase, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt's n greedy tokens (EOS ignored), all added to `engine` at once and stepped until
    it has no work."""
    reqs = [
        Request(prompt_token_ids=p, params=SamplingParams(max_tokens=n, ignore_eos=True))
        for p in prompts
    ]
    for r in reqs:
        engine.add_request(r)
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    with torch.inference_mode():
        while engine.has_work():
            for o in engine.step():
                out[o.request_id].extend(o.token_ids)
    return [out[r.request_id] for r in reqs]


def engine_logits(
    lm: LoadedModel, prompt: list[int], n: int, engine: ContinuousBatchEngine | None = None
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation in `engine` (by default one that prefills in chunks of 16 over blocks
    of 4, then decodes) and the logits of every sampled position, recorded at the head."""
    rows: list[torch.Tensor] = []
    head = lm.model.compute_logits

    def recording(hidden):
        out = head(hidden)
        rows.append(out[-1].clone())
        return out

    engine = engine or ContinuousBatchEngine(
        lm.model, max_batch_size=2, block_size=4, max_num_batched_tokens=16, num_blocks=64
    )
    req = Request(prompt_token_ids=prompt, params=SamplingParams(max_tokens=n, ignore_eos=True))
    engine.add_request(req)
    out: list[int] = []
    lm.model.compute_logits = recording
    try:
        with torch.inference_mode():
            while engine.has_work():
                out += [t for o in engine.step() for t in o.token_ids]
    finally:
        del lm.model.compute_logits
    return out, rows
