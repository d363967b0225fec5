"""Helpers shared by the engine tests: run a set of requests through an engine to completion."""

from __future__ import annotations

import random
from collections.abc import Callable

from engine import ContinuousBatchEngine, Request, SamplingParams

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
