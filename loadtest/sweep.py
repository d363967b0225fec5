"""Measurements end to end: one run against a server, and sweeps over engines and arrival rates.

Owns orchestration: building the trace for a server (text prompts need its tokenizer), warming it
up, running, summarizing and writing results; and, for a sweep, starting the project's own server
once per engine as a subprocess (`python -m server --model M --engine E --host 127.0.0.1 --port P`)
on a free loopback port, waiting for `GET /health`, and stopping it (SIGTERM, then kill).
The server is only ever a command line and a URL here: nothing of it is imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

from clients.protocol import ClientError
from loadtest.metrics import SLO, Summary, summarize
from loadtest.report import (
    Conditions,
    SweepPoint,
    format_rate,
    format_summary,
    format_sweep_table,
    local_conditions,
    plot_sweep,
    run_json,
    to_json,
    write_json,
)
from loadtest.runner import (
    GREEDY,
    Endpoint,
    RunResult,
    Sampling,
    TokenCounter,
    describe_sampling,
    fetch_model_info,
    run_trace,
    warm_up,
)
from loadtest.trace import TraceSpec, build_trace


@dataclass(frozen=True, slots=True)
class MeasureOptions:
    """How to measure, apart from the trace. `model` None means the server's first model."""

    endpoint: Endpoint = "completions"
    model: str | None = None
    api_key: str | None = None
    time_limit: float | None = 600.0
    progress: bool = True
    slo: SLO = SLO()
    warmup: int = 1
    parameter_count: int | None = None
    sampling: Sampling = GREEDY  # sampling fields each request sends (SERVER_DEFAULTS: none)


@dataclass(frozen=True, slots=True)
class Measurement:
    conditions: Conditions
    summary: Summary
    result: RunResult


def measure(
    base_url: str, spec: TraceSpec, options: MeasureOptions, counter: TokenCounter | None = None
) -> Measurement:
    """Run `spec` once against the server at `base_url` and summarize it.

    Text prompts are counted with `counter` when given (a sweep shares one per server, so the
    same prompts are not tokenized again at every rate), else with a fresh one.
    """
    info = fetch_model_info(base_url, options.model, options.api_key)
    if spec.prompt_kind == "text":
        with contextlib.ExitStack() as stack:
            if counter is None:
                counter = stack.enter_context(TokenCounter(base_url, info.id, options.api_key))
            trace = build_trace(spec, counter)
    else:
        trace = build_trace(spec)
    for _ in range(options.warmup):
        asyncio.run(
            warm_up(
                base_url, info.id, trace[0], options.endpoint, options.api_key, options.sampling
            )
        )
    result = asyncio.run(
        run_trace(
            trace,
            base_url=base_url,
            model=info.id,
            endpoint=options.endpoint,
            api_key=options.api_key,
            time_limit=options.time_limit,
            progress=options.progress,
            sampling=options.sampling,
        )
    )
    summary = summarize(result.records, result.duration, result.peak_concurrency, options.slo)
    described = spec.describe()
    if options.sampling != GREEDY:  # greedy is the protocol's default: said only when it differs
        described += f", sampling {describe_sampling(options.sampling)}"
    conditions = local_conditions(
        model=info.id,
        parameter_count=options.parameter_count or info.parameter_count,
        torch_version=info.torch_version,
        trace=described,
        rates=[spec.rate],
        date=result.started_at,
    )
    return Measurement(conditions, summary, result)


def print_measurement(m: Measurement, label: str = "") -> None:
    title = f"{label} @ {format_rate(m.conditions.rates[0])} req/s" if label else ""
    print(format_summary(m.summary, title=title or "Serving Benchmark Result"))
    print(m.conditions.line())


# --- the project's server as a subprocess -------------------------------------------------------


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time."""


def free_port() -> int:
    """A loopback port nobody listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_command(model: str, engine: str, port: int, extra_args: Sequence[str] = ()) -> list[str]:
    return [
        sys.executable, "-m", "server",
        "--model", model,
        "--engine", engine,
        "--host", "127.0.0.1",
        "--port", str(port),
        *extra_args,
    ]  # fmt: skip


@contextlib.contextmanager
def server_process(
    command: Sequence[str],
    base_url: str,
    log_path: Path,
    startup_timeout: float = 300.0,
    stop_timeout: float = 15.0,
) -> Iterator[str]:
    """Run `command` until the block ends; yields `base_url` once GET /health answers 200.

    Output goes to `log_path` so a failed start can be diagnosed without flooding the terminal.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(process, base_url, log_path, startup_timeout)
            yield base_url
        finally:
            _stop(process, stop_timeout)


def _wait_healthy(
    process: subprocess.Popen[bytes], base_url: str, log_path: Path, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=base_url, timeout=5.0) as http:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise ServerStartError(
                    f"server exited with code {process.returncode}; log {log_path}:\n"
                    + _tail(log_path)
                )
            with contextlib.suppress(httpx.TransportError):
                if http.get("/health").status_code == 200:
                    return
            # Polling is the only way to learn a subprocess is ready; 0.2 s is below model load times.
            time.sleep(0.2)
    raise ServerStartError(
        f"server not healthy after {timeout:g} s; log {log_path}:\n" + _tail(log_path)
    )


def _stop(process: subprocess.Popen[bytes], timeout: float) -> None:
    if process.poll() is not None:
        return
    process.terminate()  # SIGTERM: let the server drain and release its port
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# --- sweeps ------------------------------------------------------------------------------------


def sweep(
    engines: Sequence[str],
    rates: Sequence[float],
    spec: TraceSpec,
    options: MeasureOptions,
    out_dir: Path,
    *,
    base_url: str | None = None,
    server_model: str = "tinygpt",
    server_args: Sequence[str] = (),
    startup_timeout: float = 300.0,
) -> list[SweepPoint]:
    """Measure every engine at every rate, writing per-run JSON, a markdown table and plots.

    Without `base_url` each engine gets its own server subprocess; with it, the running server is
    measured and the engine names are only labels. An engine whose server fails to start or
    answer is reported and skipped, so one broken engine does not lose the others' results.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    points: list[SweepPoint] = []
    first: Conditions | None = None
    failures: list[str] = []
    for engine in engines:
        if base_url is not None:
            server: contextlib.AbstractContextManager[str] = contextlib.nullcontext(base_url)
        else:
            port = free_port()
            server = server_process(
                server_command(server_model, engine, port, server_args),
                f"http://127.0.0.1:{port}",
                out_dir / f"server-{engine}.log",
                startup_timeout=startup_timeout,
            )
        try:
            with server as url, TokenCounter(url, options.model, options.api_key) as counter:
                for rate in rates:
                    m = measure(url, replace(spec, rate=rate), options, counter)
                    print_measurement(m, label=engine)
                    write_json(
                        out_dir / f"{engine}-rate{format_rate(rate)}.json",
                        run_json(m.conditions, m.summary, m.result.records, label=engine),
                    )
                    points.append(SweepPoint(engine, rate, m.summary))
                    first = first or m.conditions
        except (ServerStartError, ClientError, httpx.HTTPError) as exc:
            print(f"engine {engine} failed: {exc}", file=sys.stderr)
            failures.append(engine)
    if first is not None:
        conditions = replace(first, rates=tuple(rates))
        write_sweep_files(points, conditions, out_dir, failures)
    return points


def write_sweep_files(
    points: Sequence[SweepPoint],
    conditions: Conditions,
    out_dir: Path,
    failures: Sequence[str] = (),
) -> None:
    """results.md (conditions, SLO, table, plots), sweep.json and the PNG plots."""
    plots = plot_sweep(points, out_dir, title=conditions.line())
    slo = points[0].summary.slo.describe() if points else ""
    lines = [
        "# Load sweep",
        "",
        conditions.line(),
        "",
        f"Goodput SLO: {slo}. Latencies in ms.",
        "",
        format_sweep_table(points),
        "",
        *(f"![{p.stem}]({p.name})" for p in plots),
    ]
    if failures:
        lines += ["", "Engines that failed: " + ", ".join(failures)]
    (out_dir / "results.md").write_text("\n".join(lines) + "\n")
    write_json(
        out_dir / "sweep.json",
        to_json(
            {
                "conditions": {**asdict(conditions), "line": conditions.line()},
                "points": [
                    {"label": p.label, "rate": p.rate, "summary": asdict(p.summary)} for p in points
                ],
            }
        ),
    )
