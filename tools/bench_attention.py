"""Decode attention alone: the cbserve attention op over a paged pool, as the model's layers see it.

    python -m tools.bench_attention [--batch 32] [--context 1280] [--kv-dtypes float16,int8]
                                    [--layouts contiguous,runs,scattered] [--layers 30] [--rounds 5]
                                    [--heads 9 --kv-heads 3 --head-dim 64] [--window 0]

Owns: timing one decode step's attention per layer (SmolLM2's shapes by default: 9 query heads,
3 kv heads, head_dim 64) for each pool dtype and block-table layout, with one distinct pool per
layer cycled as a model's forward cycles them. That matters: a single layer's pool (17.7 MB for
32 x 1,280 int8 tokens) stays in this machine's 32 MB L3 across repetitions and then looks bound
by arithmetic; 30 pools (530 MB) are read from DRAM every step, as in the server. Layouts:
`contiguous` (each sequence's blocks in order, sequences one after another, as
`tools.bench_model` lays them out), `runs` (each sequence as runs of `--run` consecutive blocks
at random places: the engine's allocator gives runs of ~10 blocks in the long-prompt peak) and
`scattered` (every block at random). Rounds interleave every (dtype, layout) so machine noise
hits them alike; it prints the best and median of the rounds, the bytes of K/V read a layer, and
this machine's streaming read bandwidth measured in the same run, for scale.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from models import kernels, ops

BLOCK = 16


def stream_read_gbps(mib: int = 256, reps: int = 5) -> float:
    """Best read bandwidth of a float32 sum over `mib` MiB (a plain sequential stream)."""
    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    best = min(_timed(x.sum) for _ in range(reps))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def block_tables(
    layout: str, seqs: int, per_seq: int, run: int, gen: torch.Generator
) -> torch.Tensor:
    """(seqs, per_seq) block ids into a pool of seqs * per_seq + 1 blocks (block 0 unused)."""
    n = seqs * per_seq
    if layout == "contiguous":
        ids = torch.arange(n)
    elif layout == "scattered":
        ids = torch.randperm(n, generator=gen)
    elif layout == "runs":
        starts = torch.arange(0, n, run)
        ids = torch.cat(
            [
                torch.arange(s, min(s + run, n))
                for s in starts[torch.randperm(len(starts), generator=gen)]
            ]
        )
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return (ids + 1).view(seqs, per_seq)


def make_pool(
    blocks: int, kv_heads: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    """A pool of random rows as the kernel stores them (int8: values, then float32 scales)."""
    x = torch.randn(blocks, BLOCK, kv_heads, head_dim, generator=gen)
    if dtype != torch.int8:
        return x.to(dtype)
    q = (x * 40).round().clamp(-127, 127).to(torch.int8)
    scales = torch.full((blocks, BLOCK, kv_heads, head_dim // 32), 0.025).view(torch.int8)
    return torch.cat([q, scales], -1).contiguous()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=1280, help="tokens each sequence holds")
    ap.add_argument("--kv-dtypes", default="float16,int8")
    ap.add_argument("--layouts", default="contiguous,runs,scattered")
    ap.add_argument("--run", type=int, default=10, help="blocks a run in the `runs` layout")
    ap.add_argument(
        "--layers", type=int, default=30, help="distinct pools cycled (1: cache-resident)"
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=0, help="sliding window (0: every key)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--stream-mib", type=int, default=256, help="size of the bandwidth probe")
    args = ap.parse_args(argv)
    if not kernels.available():
        raise SystemExit(
            f"the cbserve kernels are not available here: {kernels.unavailable_reason()}"
        )
    torch.set_num_threads(args.threads)
    B, L, H, KVH, D = args.batch, args.context, args.heads, args.kv_heads, args.head_dim  # noqa: N806
    per_seq = -(-(L + 1) // BLOCK)
    blocks = B * per_seq + 1
    gen = torch.Generator().manual_seed(0)
    dtypes = [getattr(torch, name) for name in args.kv_dtypes.split(",")]
    layouts = args.layouts.split(",")
    pools = {
        dt: [
            (make_pool(blocks, KVH, D, dt, gen), make_pool(blocks, KVH, D, dt, gen))
            for _ in range(args.layers)
        ]
        for dt in dtypes
    }
    tables = {lay: block_tables(lay, B, per_seq, args.run, gen) for lay in layouts}
    lens = torch.full((B,), L, dtype=torch.int64)
    qkv = torch.randn(B, (H + 2 * KVH) * D, generator=gen)
    cos, sin = torch.ones(B, D // 2), torch.zeros(B, D // 2)
    no_meta, no_tables = torch.empty(0, 3, dtype=torch.int64), torch.empty(0, 1, dtype=torch.int64)

    def step(dt: torch.dtype, lay: str) -> float:
        """One decode step's attention over every layer's pool; seconds per layer."""
        t = tables[lay]
        slots = t[:, (L - 1) // BLOCK] * BLOCK + (L - 1) % BLOCK  # the new token's slot
        t0 = time.perf_counter()
        for kc, vc in pools[dt]:
            ops.attention(qkv.clone(), cos=cos, sin=sin, k_cache=kc, v_cache=vc, slots=slots, num_decode=B,
                          decode_tables=t, decode_lens=lens, chunk_meta=no_meta, chunk_tables=no_tables,
                          num_heads=H, num_kv_heads=KVH, head_dim=D, scale=D**-0.5,
                          window=args.window)  # fmt: skip
        return (time.perf_counter() - t0) / args.layers

    cases = [(dt, lay) for dt in dtypes for lay in layouts]
    for case in cases:
        step(*case)  # warm-up
    times: dict[tuple[torch.dtype, str], list[float]] = {c: [] for c in cases}
    for _ in range(args.rounds):
        for case in cases:
            times[case].extend(step(*case) for _ in range(3))
    bw = stream_read_gbps(args.stream_mib)
    print(f"decode attention: batch {B}, context {L}, {H} heads / {KVH} kv heads x {D}, block {BLOCK}, "
          f"{args.layers} pools cycled, {args.threads} threads, {args.rounds} interleaved rounds of 3 steps; "
          f"torch {torch.__version__}; load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"machine: streaming read {bw:.1f} GB/s (float32 sum over {args.stream_mib} MiB)")
    print(
        f"{'kv dtype':>9} {'layout':>11} {'best ms':>8} {'median ms':>9} {'MB a layer':>10} {'GB/s (median)':>13}"
    )
    for dt, lay in cases:
        ts = times[(dt, lay)]
        row = pools[dt][0][0].shape[-1] * dt.itemsize
        mb = 2 * B * L * KVH * row / 1e6
        med = statistics.median(ts)
        print(f"{str(dt).removeprefix('torch.'):>9} {lay:>11} {min(ts) * 1e3:8.2f} {med * 1e3:9.2f} {mb:10.1f} "
              f"{mb / 1e3 / med:13.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
