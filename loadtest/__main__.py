"""Command line: `python -m loadtest run ...` (one rate, one server) and `... sweep ...`.

Owns argument parsing and turning arguments into a `TraceSpec`, an `SLO` and `MeasureOptions`;
all work happens in `loadtest.sweep`.

    python -m loadtest run --base-url http://127.0.0.1:8000 --rate 4 --num-requests 100
    python -m loadtest sweep --engines static,continuous --rates 1,4,8,16 --model tinygpt \\
        --out results/continuous
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx

from clients.protocol import ClientError
from loadtest.metrics import SLO
from loadtest.report import run_json, write_json
from loadtest.runner import add_sampling_argument
from loadtest.sweep import MeasureOptions, measure, print_measurement, sweep
from loadtest.trace import TraceSpec

DEFAULT_BASE_URL = "http://127.0.0.1:8000"


def int_range(text: str) -> tuple[int, int]:
    """'32:96' -> (32, 96) inclusive; '64' -> (64, 64)."""
    lo, sep, hi = text.partition(":")
    try:
        return (int(lo), int(hi)) if sep else (int(lo), int(lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI, got {text!r}") from None


def rate_list(text: str) -> list[float]:
    try:
        return [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected rates like 1,4,8,16, got {text!r}") from None


def _add_common(parser: argparse.ArgumentParser) -> None:
    trace = parser.add_argument_group("trace")
    trace.add_argument("--num-requests", type=int, default=100)
    trace.add_argument("--prompt-len", type=int_range, default=(32, 96), metavar="LO:HI")
    trace.add_argument("--output-len", type=int_range, default=(16, 48), metavar="LO:HI")
    trace.add_argument("--seed", type=int, default=7)
    trace.add_argument(
        "--burstiness", type=float, default=1.0, help="Gamma shape: 1 is Poisson, <1 burstier"
    )
    trace.add_argument("--prompt-kind", choices=("tokens", "text"), default="tokens")
    trace.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="N",
        help="N common tokens before each prompt",
    )
    trace.add_argument(
        "--token-ids", type=int_range, default=(32, 126), metavar="LO:HI",
        help="range of random prompt token ids (keep clear of special tokens)",
    )  # fmt: skip

    run = parser.add_argument_group("requests")
    run.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    run.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    run.add_argument("--api-key", default=None)
    run.add_argument(
        "--time-limit", type=float, default=600.0, help="seconds per run; the rest is cancelled"
    )
    add_sampling_argument(run)
    run.add_argument("--warmup", type=int, default=1, help="warm-up requests before each run")
    run.add_argument("--no-progress", action="store_true")
    run.add_argument(
        "--parameter-count", type=int, default=None,
        help="for the conditions line when /v1/models does not give parameter_count",
    )  # fmt: skip

    slo = parser.add_argument_group("goodput SLO (seconds)")
    slo.add_argument("--slo-ttft", type=float, default=1.0)
    slo.add_argument("--slo-itl", type=float, default=0.05, help="bound on a request's mean ITL")
    slo.add_argument("--slo-itl-p99", type=float, default=None, help="bound on a request's p99 ITL")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="measure one running server at one rate")
    run.add_argument("--base-url", default=DEFAULT_BASE_URL)
    run.add_argument("--rate", type=float, default=4.0, help="requests/s; inf sends all at once")
    run.add_argument("--label", default="", help="name for this run in the report")
    run.add_argument("--out", type=Path, default=None, help="write summary and records as JSON")
    _add_common(run)

    sweep_cmd = commands.add_parser("sweep", help="measure engines x arrival rates")
    sweep_cmd.add_argument(
        "--engines", default="continuous", help="comma list, passed to the server's --engine"
    )
    sweep_cmd.add_argument("--rates", type=rate_list, default=[1.0, 4.0, 8.0, 16.0])
    sweep_cmd.add_argument("--out", type=Path, default=Path("results/sweep"))
    sweep_cmd.add_argument(
        "--base-url", default=None,
        help="measure this running server instead of starting one per engine (engines are labels)",
    )  # fmt: skip
    sweep_cmd.add_argument(
        "--server-arg", action="append", default=[], metavar="ARG",
        help="extra argument for the server command line (repeatable; use --server-arg=--flag)",
    )  # fmt: skip
    sweep_cmd.add_argument("--startup-timeout", type=float, default=300.0)
    _add_common(sweep_cmd)
    return parser


def spec_from(args: argparse.Namespace, rate: float) -> TraceSpec:
    return TraceSpec(
        num_requests=args.num_requests,
        rate=rate,
        burstiness=args.burstiness,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        seed=args.seed,
        prompt_kind=args.prompt_kind,
        shared_prefix=args.shared_prefix,
        token_ids=args.token_ids,
    )


def options_from(args: argparse.Namespace, model: str | None) -> MeasureOptions:
    return MeasureOptions(
        endpoint=args.endpoint,
        model=model,
        api_key=args.api_key,
        time_limit=args.time_limit,
        progress=not args.no_progress,
        slo=SLO(ttft=args.slo_ttft, itl_mean=args.slo_itl, itl_p99=args.slo_itl_p99),
        warmup=args.warmup,
        parameter_count=args.parameter_count,
        sampling=args.sampling,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.endpoint == "chat" and args.prompt_kind != "text":
        parser.error("--endpoint chat sends messages, which need --prompt-kind text")
    try:
        spec_from(args, args.rate if args.command == "run" else 1.0)  # validate before any I/O
    except ValueError as exc:
        parser.error(str(exc))

    if args.command == "run":
        try:
            m = measure(args.base_url, spec_from(args, args.rate), options_from(args, args.model))
        except (ClientError, httpx.HTTPError) as exc:
            print(f"error: {args.base_url}: {exc}", file=sys.stderr)
            return 1
        print_measurement(m, label=args.label)
        if args.out is not None:
            write_json(args.out, run_json(m.conditions, m.summary, m.result.records, args.label))
        return 0

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or not args.rates:
        parser.error("need at least one engine and one rate")
    # A server we start serves --model (default tinygpt); requests then use its first listed name.
    points = sweep(
        engines,
        args.rates,
        spec_from(args, args.rates[0]),
        options_from(args, args.model if args.base_url else None),
        args.out,
        base_url=args.base_url,
        server_model=args.model or "tinygpt",
        server_args=args.server_arg,
        startup_timeout=args.startup_timeout,
    )
    measured = {p.label for p in points}
    print(f"wrote {args.out / 'results.md'}" if points else "nothing was measured", file=sys.stderr)
    return 0 if measured == set(engines) else 1


if __name__ == "__main__":
    sys.exit(main())
