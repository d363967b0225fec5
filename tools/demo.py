"""A short demo: the same prompts through static and continuous batching with TinyGPT.

    python -m tools.demo

Prints each engine's steps, slot-steps and wasted slot-steps, and checks that both produced the
same tokens (batching is a scheduling change, not a different model).
"""

from __future__ import annotations

import time

from engine import ContinuousBatchEngine, Request, SamplingParams, StaticBatchEngine
from models import load_model


def main() -> None:
    lm = load_model("tinygpt")
    prompts = [f"Request {i}: tell me about batching." for i in range(12)]
    lengths = [4 + (i * 7) % 40 for i in range(12)]
    results = {}
    for cls in (StaticBatchEngine, ContinuousBatchEngine):
        engine = cls(lm, max_batch_size=4)
        ids = []
        for p, n in zip(prompts, lengths, strict=True):
            r = Request(lm.tokenizer.encode(p), SamplingParams(max_tokens=n, ignore_eos=True))
            ids.append(r.request_id)
            engine.add_request(r)
        out: dict[str, list[int]] = {i: [] for i in ids}
        t0 = time.perf_counter()
        while engine.has_work():
            for o in engine.step():
                out[o.request_id] += o.token_ids
        took = time.perf_counter() - t0
        results[cls.name] = [out[i] for i in ids]
        print(
            f"{cls.name:>17}: {engine.num_steps} steps, {engine.total_slot_steps} slot-steps, "
            f"{engine.wasted_slot_steps} wasted, {took * 1e3:.0f} ms"
        )
    same = results["static-batch"] == results["continuous-batch"]
    print(f"identical tokens from both engines: {same}")
    print(
        f"sample continuation (random weights, so gibberish): {lm.tokenizer.decode(results['continuous-batch'][0])!r}"
    )


if __name__ == "__main__":
    main()
