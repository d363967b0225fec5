"""What structured output costs per engine step.

    python -m tools.bench_structured [--model smollm2-135m-instruct] [--batch 8] [--threads 1]

Decodes `batch` greedy requests (an extraction prompt, max_tokens 48) twice: all unconstrained,
then all constrained by a JSON schema. Each step is timed whole, and so are its two grammar
parts: the sampler (`sample()`: mask computation by llguidance, unpacking the bits, masking the
rows, then the argmax) and advancing the grammars with the sampled tokens (`accept`). The
grammar's cost is the constrained run's sampler time minus the unconstrained run's, plus accept;
it is measured with the grammars advancing token by token as in serving (llguidance caches a
mask for a state it has seen, so timing `sample()` repeatedly on one state would flatter it).
Grammars are compiled before timing (the server compiles them off the step path). The forward
dominates a step and is noisy on a shared machine: read the sampler and accept columns.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import engine.batch
from engine import ContinuousBatchEngine, Request, SamplingParams
from engine.structured import GrammarCompiler, GrammarConstraint, StructuredSpec
from models import ModelLoadError, load_model
from tools.conditions import conditions

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population_millions": {"type": "number"},
    },
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}
PROMPT = (
    "Paris is the capital of France and has 2.1 million people. "
    "Give the city, country and population as JSON."
)


def bench_steps(lm, compiler: GrammarCompiler, batch: int, constrained: bool) -> dict:
    eng = ContinuousBatchEngine(lm.model, max_batch_size=batch, max_num_batched_tokens=4096)
    prompt = lm.tokenizer.encode(
        lm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
        if lm.tokenizer.chat_template
        else PROMPT
    )
    spec = StructuredSpec.json_schema(SCHEMA)
    for _ in range(batch):
        c = compiler.constraint(spec) if constrained else None
        eng.add_request(Request(list(prompt), SamplingParams(max_tokens=48), constraint=c))
    eng.step()  # prefill (prompts share their prefix)
    steps, samples, accepts = [], [], []
    tokens = 0
    while eng.has_work():
        timer["sample"] = timer["accept"] = 0.0
        t0 = time.perf_counter()
        outs = eng.step()
        steps.append(time.perf_counter() - t0)
        samples.append(timer["sample"])
        accepts.append(timer["accept"])
        tokens += sum(len(o.token_ids) for o in outs)
    return {
        "constrained": constrained,
        "decode_steps": len(steps),
        "step_ms": statistics.median(steps) * 1e3,
        "sample_ms": statistics.median(samples) * 1e3,
        "accept_ms": statistics.median(accepts) * 1e3,
        "tokens": tokens,
    }


timer = {"sample": 0.0, "accept": 0.0}


def _instrument() -> None:
    """Time the sampler and grammar advances inside real steps (this tool only)."""
    sample, accept = engine.batch.sample, GrammarConstraint.accept

    def timed_sample(*a):
        t0 = time.perf_counter()
        try:
            return sample(*a)
        finally:
            timer["sample"] += time.perf_counter() - t0

    def timed_accept(self, token_id):
        t0 = time.perf_counter()
        try:
            return accept(self, token_id)
        finally:
            timer["accept"] += time.perf_counter() - t0

    engine.batch.sample = timed_sample
    GrammarConstraint.accept = timed_accept


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench_structured", description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        lm = load_model(args.model)
    except ModelLoadError as e:
        print(f"error: {e}")
        return 1
    compiler = GrammarCompiler(lm.tokenizer)
    t0 = time.perf_counter()
    compiler.constraint(StructuredSpec.json_schema(SCHEMA))
    print(
        f"model {lm.name}, vocab {lm.config.vocab_size}, batch {args.batch}, "
        f"threads {args.threads}; {conditions(lm)}"
    )
    print(f"first compile (tokenizer trie + schema): {(time.perf_counter() - t0) * 1e3:.0f} ms")
    _instrument()
    print("decode steps, medians per step (greedy, max_tokens 48):")
    results = {}
    with torch.inference_mode():
        for constrained in (False, True):
            r = results[constrained] = bench_steps(lm, compiler, args.batch, constrained)
            print(
                f"  {'constrained  ' if constrained else 'unconstrained'}: step {r['step_ms']:.1f} ms,"
                f" sampler {r['sample_ms']:.2f} ms, accept {r['accept_ms']:.2f} ms"
                f" ({r['decode_steps']} steps, {r['tokens']} tokens)"
            )
    extra = results[True]["sample_ms"] - results[False]["sample_ms"] + results[True]["accept_ms"]
    print(
        f"grammar overhead: {extra:.2f} ms per step for {args.batch} constrained rows "
        f"({extra / args.batch:.3f} ms per row), "
        f"{100 * extra / results[False]['step_ms']:.1f}% of an unconstrained step"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
