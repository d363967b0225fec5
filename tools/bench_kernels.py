"""Each linear of a model, and its prefill attention, against this machine's int8 GEMM, in one run.

    python -m tools.bench_kernels [--model smollm2-135m-instruct | --model FILE.gguf]
                                  [--preset llama-3.2-1b --format Q4_K_M [--vocab 128256]]
                                  [--tokens 512,2048] [--decode-batch 32] [--threads N] [--reps 5]

Owns: the kernel-level figures that say how near the int8 GEMM rate the prompt path runs. For
every distinct linear of the model (shape, GGUF formats, epilogue; the head only at the decode
batch, since prefill computes logits for the rows that sample) and for M = each token count and
the decode batch, it times our op (`models.ops`, as the model calls it: float32 rows in, the
activations quantized inside, the fused epilogue) beside, on the same (M, K) x (K, N) shape and in
the same run:

- `torch._int_mm` (int8 x int8 -> int32, the weight (N, K) contiguous as a model keeps it; the CPU
  op takes any M, so M is not padded). Where the CPU lacks AVX512-VNNI, torch has no fast path for
  it (a reference loop, ~1 G ops/s on Zen 3), so the tool also times
- fbgemm's dynamic int8 linear (`torch.ops.quantized.linear_dynamic`: float32 rows quantized per
  call, vpmaddubsw on AVX2, float32 out: what our op computes, with the weight prepacked outside
  the timing), and
- float32 `torch.mm`.

Ops are counted 2 M N K (a gated projection's N is its gate and up rows). Rates are best of
`--reps` after a warm-up; a ratio is ours over the reference, so a busy machine distorts both
sides of it alike. The "all linears" rows weigh each shape by how often the model runs it per
token (its layer count): the share of the int8 GEMM rate that the model's linears reach.

Attention: one sequence's prefill of T tokens (`models.ops.attention`: RoPE, the K/V write into the
model's pool dtype and causal attention; a sliding window where the model has one), ops counted
4 H D x (keys each query sees), beside `_int_mm` and float32 `torch.mm` of the same per-KV-head
products (Q (G T, D) x K^T and P (G T, T) x V, all T keys: 4 H D T^2 ops).

A `--preset` (tools.synth_model's shapes) is written as a one-layer random-weight GGUF in a
temporary folder (every layer of a preset has the same linears), so a 1B shape is measured in
a minute without a 1B file.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from models import load_model
from models.cpu import cpu_flags
from models.ops import Act
from tools.conditions import cpu_name

# The CPU features that decide which kernels (ours and the references') run.
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_int8")


def cpu_kind() -> str:
    flags = cpu_flags()
    have = [f for f in FLAGS if f in flags]
    return f"{cpu_name()} ({', '.join(have) or 'flags unknown'})"


# The clock timings read: wall time, or (--clock cpu) the process's CPU time over its threads,
# which on a machine shared with other work leaves out the time the threads waited for a core.
CLOCK: dict[str, Callable[[], float]] = {"wall": time.perf_counter}


def cpu_seconds() -> float:
    return time.process_time() / torch.get_num_threads()


def best_seconds(fns: list[Callable[[], object]], reps: int) -> list[float]:
    """Each function's best of `reps` timed calls after a warm-up, the functions taking turns so
    that a burst from another process falls on all of them alike (and only ever lengthens a
    sample). A call of a second or more (`_int_mm` without a fast path) is timed once."""
    clock = CLOCK["wall"]
    best = [math.inf] * len(fns)
    for i, fn in enumerate(fns):  # the warm-up, timed: a call of a second or more is not repeated
        t0 = clock()
        fn()
        best[i] = clock() - t0
    slow = [b >= 1.0 for b in best]
    best = [b if s else math.inf for b, s in zip(best, slow, strict=True)]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            if slow[i]:
                continue
            t0 = clock()
            fn()
            best[i] = min(best[i], clock() - t0)
    return best


@dataclass(frozen=True)
class Linear:
    """One distinct linear of the model: its weight, epilogue and how often a token runs it."""

    name: str  # the first module with this shape
    packed: object  # models.quant.PackedWeight
    bias: torch.Tensor | None
    act: int
    count: int
    head: bool

    @property
    def n(self) -> int:
        return self.packed.out_features

    @property
    def k(self) -> int:
        return self.packed.in_features

    def formats(self) -> str:
        return "+".join(sorted(self.packed.formats()))

    def run(self, x: torch.Tensor) -> torch.Tensor:
        p = self.packed
        return p.op(
            x, qs=p.qs, d=p.d, m=p.m, kind=p.kind, out_features=p.out_features,
            bias=self.bias, residual=None, act=self.act,
        )  # fmt: skip


def model_linears(model: torch.nn.Module) -> list[Linear]:
    """The model's packed projections, one per (shape, formats, epilogue), with their counts."""
    modules = dict(model.named_modules())
    found: dict[tuple, Linear] = {}
    for name, mod in modules.items():
        packed = getattr(mod, "packed", None)
        if packed is None:
            continue
        act = Act.NONE
        if name.endswith("gate_up_proj"):
            parent = modules[name.rsplit(".", 1)[0]]
            act = Act.GELU_MUL if getattr(parent, "gelu", False) else Act.SILU_MUL
        head = name == "lm_head"
        key = (packed.out_features, packed.in_features, tuple(sorted(packed.formats())), act, head)
        if key in found:
            old = found[key]
            found[key] = Linear(old.name, old.packed, old.bias, act, old.count + 1, head)
        else:
            found[key] = Linear(name, packed, getattr(mod, "bias", None), act, 1, head)
    return list(found.values())


class References:
    """The reference GEMMs of one (M, K) x (K, N) shape: the same random data for each."""

    def __init__(self, m: int, k: int, n: int) -> None:
        self.a8 = torch.randint(-127, 128, (m, k), dtype=torch.int8)
        self.w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)  # a weight's (N, K) rows
        self.x = torch.randn(m, k)
        self.w = torch.randn(n, k)
        with warnings.catch_warnings():  # (torch deprecates quantized tensors; fbgemm's op stays)
            warnings.simplefilter("ignore")
            scale = self.w.abs().amax(1).clamp_min(1e-6) / 127
            qw = torch.quantize_per_channel(
                self.w, scale, torch.zeros(n, dtype=torch.long), 0, torch.qint8
            )
            self.fbgemm = torch.ops.quantized.linear_prepack(qw, None)

    def int_mm(self) -> torch.Tensor:
        return torch._int_mm(self.a8, self.w8.t())

    def linear_dynamic(self) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(self.x, self.fbgemm, True)

    def mm(self) -> torch.Tensor:
        return torch.mm(self.x, self.w.t())


def ref_names() -> list[str]:
    return ["_int_mm", "fbgemm", "fp32"]


def g(ops: float, seconds: float) -> float:
    return ops / seconds / 1e9


def header() -> str:
    refs = " ".join(f"{n + ' G/s':>12}" for n in ref_names())
    return (
        f"{'':2}{'linear':<28} {'formats':<18} {'x':>3} {'M':>5} {'N':>6} {'K':>5} "
        f"{'ours G/s':>9} {refs} {'/_int_mm':>8} {'/fbgemm':>8}"
    )


def row(label: str, fmt: str, count: int | str, m: int, n: int, k: int, ours: float,
        refs: list[float], ops: float) -> str:  # fmt: skip
    rates = [g(ops, s) for s in refs]
    mine = g(ops, ours)
    cols = " ".join(f"{r:>12.1f}" for r in rates)
    return (
        f"  {label:<28} {fmt:<18} {count!s:>3} {m:>5} {n:>6} {k:>5} {mine:>9.1f} {cols} "
        f"{mine / rates[0]:>8.1%} {mine / rates[1]:>8.1%}"
    )


def bench_linears(linears: list[Linear], m: int, reps: int, head: bool) -> None:
    """Rows for one M: each linear, then every linear weighed by its count."""
    total_ours, total_refs, total_ops = 0.0, [0.0] * len(ref_names()), 0.0
    for lin in linears:
        if lin.head != head:
            continue
        x = torch.randn(m, lin.k)
        r = References(m, lin.k, lin.n)
        ours, *refs = best_seconds(
            [lambda lin=lin, x=x: lin.run(x), r.int_mm, r.linear_dynamic, r.mm], reps
        )
        ops = 2 * m * lin.n * lin.k
        print(row(lin.name, lin.formats(), lin.count, m, lin.n, lin.k, ours, refs, ops))
        total_ours += lin.count * ours
        total_refs = [t + lin.count * s for t, s in zip(total_refs, refs, strict=True)]
        total_ops += lin.count * ops
    if total_ops:
        print(row("all of them, by count", "", "", m, 0, 0, total_ours, total_refs, total_ops))


def attention_ops(t: int, heads: int, head_dim: int, window: int) -> int:
    """4 H D x the keys each of t queries sees (causal; within `window` when > 0)."""
    keys = sum(min(i + 1, window) if window else i + 1 for i in range(t))
    return 4 * heads * head_dim * keys


def bench_attention(lm, t: int, window: int, reps: int) -> None:
    """One sequence's t-token prefill through `ops.attention`, beside the same products as
    int8 and float32 GEMMs."""
    from models import ops

    c = lm.config
    h, kvh, d = c.num_heads, c.num_kv_heads, c.head_dim
    block = 16
    blocks = -(-t // block)
    shape = (blocks, block, kvh, c.kv_layout.row_width)
    k_cache, v_cache = torch.zeros(shape, dtype=c.kv_dtype), torch.zeros(shape, dtype=c.kv_dtype)
    qkv = torch.randn(t, (h + 2 * kvh) * d)
    angles = torch.rand(t, d // 2)
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    empty = torch.empty(0, dtype=torch.long)
    meta = torch.tensor([[0, t, t]], dtype=torch.long)
    table = torch.arange(blocks).view(1, -1)

    def ours() -> torch.Tensor:
        return ops.attention(
            qkv.clone(), cos, sin, k_cache, v_cache, torch.arange(t), 0, empty.view(0, 0),
            empty, meta, table, num_heads=h, num_kv_heads=kvh, head_dim=d, scale=d**-0.5,
            window=window,
        )  # fmt: skip

    grp = h // kvh
    q8 = torch.randint(-127, 128, (grp * t, d), dtype=torch.int8)
    k8 = torch.randint(-127, 128, (t, d), dtype=torch.int8)
    p8 = torch.randint(-127, 128, (grp * t, t), dtype=torch.int8)
    v8 = torch.randint(-127, 128, (t, d), dtype=torch.int8)
    qf, kf, pf, vf = q8.float(), k8.float(), p8.float(), v8.float()

    def int_mm() -> None:
        for _ in range(kvh):
            torch._int_mm(q8, k8.t())
            torch._int_mm(p8, v8)

    def mm() -> None:
        for _ in range(kvh):
            torch.mm(qf, kf.t())
            torch.mm(pf, vf)

    # (the input copy is not the kernel's: timed apart and taken off)
    copy, mine, s_int, s_mm = best_seconds([lambda: qkv.clone(), ours, int_mm, mm], reps)
    full = 4 * h * d * t * t
    rate_ours = g(attention_ops(t, h, d, window), max(mine - copy, 1e-9))
    rate_int = g(full, s_int)
    rate_mm = g(full, s_mm)
    label = f"attention T={t}" + (f" window {window}" if window else "")
    print(
        f"  {label:<28} {'kv ' + str(c.kv_dtype).removeprefix('torch.'):<18} {h:>3}h {d:>4}d "
        f"ours {rate_ours:>7.1f} G/s  _int_mm {rate_int:>7.1f}  fp32 {rate_mm:>7.1f}  "
        f"ours/_int_mm {rate_ours / rate_int:>6.1%}  ours/fp32 {rate_ours / rate_mm:>6.1%}"
    )


def synthesize(preset: str, fmt: str, vocab: int | None, folder: str) -> str:
    """A one-layer random-weight GGUF of a tools.synth_model preset (its linears' shapes)."""
    from tools.synth_model import write_synthetic

    path = os.path.join(folder, f"{preset}-{fmt}-1layer.gguf")
    write_synthetic(path, preset, fmt, vocab_size=vocab, num_hidden_layers=1)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.bench_kernels",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a name or a GGUF file")
    ap.add_argument("--preset", help="a tools.synth_model preset instead of --model")
    ap.add_argument("--format", default="Q4_K_M", help="the preset's GGUF format")
    ap.add_argument("--vocab", type=int, help="the preset's vocabulary (default: its tokenizer's)")
    ap.add_argument("--tokens", default="512,2048", help="prefill token counts (M)")
    ap.add_argument("--decode-batch", type=int, default=32, help="M of the batched decode rows")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-attention", action="store_true")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: the process's CPU time over its threads (a busy machine's estimate of wall time)",
    )
    args = ap.parse_args(argv)
    if args.clock == "cpu":
        CLOCK["wall"] = cpu_seconds
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="bench-kernels-") as tmp:
        if args.preset:
            source = synthesize(args.preset, args.format, args.vocab, tmp)
            name = f"{args.preset} {args.format} (one random layer)"
        else:
            source, name = args.model, args.model
        lm = load_model(source)
    tokens = [int(t) for t in args.tokens.split(",")]
    print(
        f"model {name}; CPU {cpu_kind()}; {os.cpu_count()} CPUs; torch {torch.__version__}; "
        f"{torch.get_num_threads()} threads; {args.clock} clock; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    linears = model_linears(lm.model)
    with torch.inference_mode():
        print(header())
        for m in tokens:
            bench_linears(linears, m, args.reps, head=False)
        bench_linears(linears, args.decode_batch, args.reps, head=False)
        bench_linears(linears, args.decode_batch, args.reps, head=True)
        if not args.no_attention:
            windows = sorted({0, *(lm.config.layer_windows or ())})
            for t in tokens:
                for w in windows:
                    if w and w >= t:
                        continue
                    bench_attention(lm, t, w, args.reps)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
