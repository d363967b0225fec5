"""Model-level benchmark of a real checkpoint (default SmolLM2-135M-Instruct) on this machine.

    python -m tools.bench_model [--model smollm2-135m-instruct] [--prompt-len 512,2048] [--batches 1,8,32]
                           [--decode-context 128] [--decode-steps 16] [--threads N] [--no-profile]

Owns: measuring the decoder itself, through the same paged-attention path the engine drives but
with the KV pool and metadata laid out here (contiguous block tables), so no scheduling cost is
counted (`python -m tools.bench_engine --model ...` measures the engine on top). It reports load time, prefill tokens/s for one prompt, decode tokens/s at several
batch sizes, resident memory of weights and KV, this machine's fp32 matmul throughput and memory
bandwidth measured in the same run, and what fraction of them the model reaches (a token costs
~2 x parameters FLOPs and, at batch 1, one read of all weights). Then it profiles a decode step.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from dataclasses import dataclass

import torch

from engine.sampling import argmax_rows
from models import AttentionMetadata, CausalLM, PrefillChunk
from tools.conditions import conditions
from tools.model_args import add_model_args, load_from_args

BLOCK = 16


@dataclass
class Pool:
    """A KV pool where sequence i owns blocks [i * per_seq, (i + 1) * per_seq)."""

    caches: list[tuple[torch.Tensor, torch.Tensor]]
    per_seq: int
    bytes: int

    @classmethod
    def create(cls, model: CausalLM, seqs: int, max_len: int) -> Pool:
        c = model.config
        per_seq = math.ceil(max_len / BLOCK)
        shape = (seqs * per_seq, BLOCK, c.num_kv_heads, c.kv_layout.row_width)
        dt = c.kv_dtype
        caches = [
            (torch.zeros(shape, dtype=dt), torch.zeros(shape, dtype=dt))
            for _ in range(c.num_layers)
        ]
        return cls(caches, per_seq, 2 * c.num_layers * math.prod(shape) * dt.itemsize)

    def table(self, seq: int) -> torch.Tensor:
        return torch.arange(seq * self.per_seq, (seq + 1) * self.per_seq)

    def slots(self, seq: int, start: int, n: int) -> torch.Tensor:
        return seq * self.per_seq * BLOCK + torch.arange(start, start + n)


def prefill(model: CausalLM, pool: Pool, seq: int, ids: list[int]) -> int:
    """Write one prompt's K/V into the pool; returns the greedy next token."""
    n = len(ids)
    meta = AttentionMetadata(
        slot_mapping=pool.slots(seq, 0, n),
        num_decode_tokens=0,
        decode_block_tables=None,
        decode_context_lens=None,
        prefills=[PrefillChunk(0, n, n, pool.table(seq))],
    )
    hidden = model(torch.tensor(ids), torch.arange(n), pool.caches, meta)
    return int(model.compute_logits(hidden[-1:]).argmax(-1))


def decode_step(model: CausalLM, pool: Pool, tokens: list[int], lens: list[int]) -> list[int]:
    """One token for each sequence i (context lens[i] before it); returns the greedy next tokens."""
    b = len(tokens)
    pos = torch.tensor(lens)
    meta = AttentionMetadata(
        slot_mapping=torch.cat([pool.slots(i, lens[i], 1) for i in range(b)]),
        num_decode_tokens=b,
        decode_block_tables=torch.stack([pool.table(i) for i in range(b)]),
        decode_context_lens=pos + 1,
        prefills=[],
    )
    hidden = model(torch.tensor(tokens), pos, pool.caches, meta)
    # the engine's greedy argmax (its kernel), so the step's profile shows what a served step spends
    return argmax_rows(model.compute_logits(hidden))


def matmul_gflops(n: int = 2048, reps: int = 10) -> float:
    """fp32 GEMM throughput of this machine (square n x n), GFLOP/s, best of reps."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(reps))
    return 2 * n**3 / best / 1e9


def copy_gbps(mib: int = 256, reps: int = 10) -> float:
    """Memory bandwidth as a tensor copy sees it (read + write), GB/s, best of reps."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(reps))
    return 2 * src.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def rss_mib() -> float:
    """Resident set size of this process (Linux /proc; else peak RSS from getrusage)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def weight_bytes(model: torch.nn.Module) -> int:
    """Parameters (tied counted once) plus packed projection weights (`models.quant`)."""
    packed = sum(m.packed.nbytes() for m in model.modules() if hasattr(m, "packed"))
    return packed + sum(p.numel() * p.element_size() for p in model.parameters())


def bench_prefill(model: CausalLM, prompt_len: int, reps: int = 3) -> float:
    """Seconds to prefill one prompt of prompt_len tokens (best of reps, after a warm-up)."""
    ids = torch.randint(0, model.config.vocab_size, (prompt_len,)).tolist()
    pool = Pool.create(model, 1, prompt_len)
    prefill(model, pool, 0, ids)
    return min(_timed(lambda: prefill(model, pool, 0, ids)) for _ in range(reps))


def bench_decode(model: CausalLM, batch: int, context: int, steps: int) -> tuple[list[float], Pool]:
    """Per-step seconds of `steps` decode steps of `batch` sequences that start at `context`."""
    pool = Pool.create(model, batch, context + steps + 1)
    tokens = []
    for i in range(batch):
        ids = torch.randint(0, model.config.vocab_size, (context,)).tolist()
        tokens.append(prefill(model, pool, i, ids))
    lens = [context] * batch
    tokens = decode_step(model, pool, tokens, lens)  # warm-up
    lens = [n + 1 for n in lens]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tokens = decode_step(model, pool, tokens, lens)
        times.append(time.perf_counter() - t0)
        lens = [n + 1 for n in lens]
    return times, pool


def profile_decode(model: CausalLM, batch: int, context: int, rows: int = 15) -> str:
    from torch.profiler import ProfilerActivity, profile

    pool = Pool.create(model, batch, context + 8)
    tokens = [prefill(model, pool, i, list(range(1, context + 1))) for i in range(batch)]
    lens = [context] * batch
    tokens = decode_step(model, pool, tokens, lens)
    lens = [n + 1 for n in lens]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            tokens = decode_step(model, pool, tokens, lens)
            lens = [n + 1 for n in lens]
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.bench_model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompt-len", default="512", help="prefill lengths, comma-separated")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--decode-context", type=int, default=128, help="tokens each sequence holds")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-profile", action="store_true")
    add_model_args(ap, dtype=False)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    rss0 = rss_mib()
    t0 = time.perf_counter()
    lm = load_from_args(args)
    load_s = time.perf_counter() - t0
    model, params = lm.model, lm.num_parameters()
    # A token multiplies its active parameters: a mixture of experts' chosen experts only.
    active = model.num_active_parameters()
    flops_per_token = 2 * active
    wbytes = weight_bytes(model)
    print(f"Conditions: {conditions(lm)}")
    print(
        f"load {load_s:.2f} s; weights {wbytes / 2**20:.0f} MiB resident "
        f"(process RSS {rss0:.0f} -> {rss_mib():.0f} MiB); "
        f"KV {lm.config.kv_bytes_per_token / 1024:.1f} KiB per token"
    )
    # Best of several short runs: a burst from another process only ever lowers a sample.
    peak = max(matmul_gflops() for _ in range(3))
    bw = max(copy_gbps() for _ in range(3))
    print(f"machine: fp32 matmul {peak:.1f} GFLOP/s (2048^2 GEMM), copy bandwidth {bw:.1f} GB/s")
    print(
        "(model FLOP/s counts 2 x active params per token; attention score FLOPs are left out"
        + (
            f"; {active:,} of {params:,} params active a token, the weights GB/s column scaled"
            " by that share)\n"
            if active != params
            else ")\n"
        )
    )

    with torch.inference_mode():
        for n in (int(x) for x in args.prompt_len.split(",")):
            pre_s = bench_prefill(model, n)
            pre_tps = n / pre_s
            print(
                f"prefill {n} tokens: {pre_s * 1e3:.0f} ms, {pre_tps:,.0f} tok/s, "
                f"{pre_tps * flops_per_token / 1e9:.1f} GFLOP/s = "
                f"{pre_tps * flops_per_token / 1e9 / peak:.0%} of matmul peak"
            )
        print()
        print(
            f"decode (context {args.decode_context}+, {args.decode_steps} steps): "
            f"{'batch':>5} {'step p50 ms':>11} {'tok/s':>8} {'GFLOP/s':>8} {'of peak':>7} "
            f"{'weights GB/s':>12} {'KV MiB used/pool':>17} {'RSS MiB':>8}"
        )
        for b in (int(x) for x in args.batches.split(",")):
            times, pool = bench_decode(model, b, args.decode_context, args.decode_steps)
            med = statistics.median(times)
            tps = b / med
            kv_used = b * (args.decode_context + args.decode_steps) * lm.config.kv_bytes_per_token
            print(
                f"{'':>44} {b:>5} {med * 1e3:>11.1f} {tps:>8.1f} "
                f"{tps * flops_per_token / 1e9:>8.2f} {tps * flops_per_token / 1e9 / peak:>7.1%} "
                f"{wbytes * active / params / med / 1e9:>12.2f} "
                f"{kv_used / 2**20:>8.0f}/{pool.bytes / 2**20:<8.0f} {rss_mib():>8.0f}"
            )
            del pool
        if not args.no_profile:
            b = 8 if "8" in args.batches.split(",") else int(args.batches.split(",")[0])
            print(f"\nprofile of 4 decode steps at batch {b}, context {args.decode_context}:")
            print(profile_decode(model, b, args.decode_context))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
