"""In-process decode benchmark: tokens/s and step time at several batch sizes.

    python -m tools.bench_engine [--model tinygpt] [--batch-sizes 1,8,32] [--steps 64] [--threads N]
                           [--prompt-len 64]
                           [--dtype float32|bfloat16] [--temperature 0.2 --top-p 0.9]

Each batch size gets a fresh continuous-batching engine with that many requests (prompts of
`--prompt-len` tokens, 64 by default, none a prefix of another; ignore_eos), prefilled in one
step: at batch 1 and 512 tokens the prefill figure is what `llama-bench -p 512` measures.
After every request has prefilled, `--steps` pure decode steps are timed one by one; the median step time and decode tokens/s (batch / median step) are printed with the
conditions. Greedy unless `--temperature` is given (SmolLM2's preset, what a client that sends no
sampling fields gets from the server, is `--temperature 0.2 --top-p 0.9`). No HTTP: this is the
engine's ceiling, not what a client sees.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine import ContinuousBatchEngine, Request, SamplingParams
from models import CausalLM
from tools.conditions import conditions
from tools.model_args import add_model_args, load_from_args


def bench_decode(
    model: CausalLM, batch: int, steps: int, prompt_len: int = 64, **sampling: float
) -> dict[str, float]:
    engine = ContinuousBatchEngine(
        model, max_batch_size=batch, max_num_batched_tokens=max(2048, batch * prompt_len)
    )
    vocab = min(model.config.vocab_size, 256)
    for i in range(batch):
        prompt = [(i * 31 + j * 7) % vocab for j in range(prompt_len)]
        params = SamplingParams(max_tokens=steps + 8, ignore_eos=True, seed=i, **sampling)
        engine.add_request(Request(prompt, params))
    t0 = time.perf_counter()
    engine.step()  # every prompt fits the budget: one prefill step
    prefill_s = time.perf_counter() - t0
    engine.step()  # warm-up decode
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t0)
        assert len(outs) == batch
    med = statistics.median(times)
    return {
        "batch": batch,
        "prefill_tok_s": batch * prompt_len / prefill_s,
        "step_ms_p50": med * 1e3,
        "step_ms_p90": statistics.quantiles(times, n=10)[-1] * 1e3,
        "decode_tok_s": batch / med,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="tinygpt")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    add_model_args(ap)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_from_args(args)
    sampling = {"temperature": args.temperature, "top_p": args.top_p}
    print(f"Conditions: {conditions(lm)}; sampling {sampling}")
    print(
        f"{'batch':>5} {'prefill tok/s':>14} {'step p50 ms':>12} {'step p90 ms':>12} {'decode tok/s':>13}"
    )
    for b in (int(x) for x in args.batch_sizes.split(",")):
        r = bench_decode(lm.model, b, args.steps, args.prompt_len, **sampling)
        print(
            f"{b:>5} {r['prefill_tok_s']:>14.0f} {r['step_ms_p50']:>12.2f} "
            f"{r['step_ms_p90']:>12.2f} {r['decode_tok_s']:>13.0f}"
        )


if __name__ == "__main__":
    main()
