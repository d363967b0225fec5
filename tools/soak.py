"""Soak test: minutes of mixed, partly hostile traffic against a real server; nothing may be lost.

    python -m tools.soak --minutes 30 [--model smollm2-135m-instruct] [--server-args "..."]
    python -m tools.soak --minutes 30 --base-url http://127.0.0.1:8000 [--server-pid PID]
    python -m tools.soak --minutes 5 --rate 3 --json soak.json

Without `--base-url` it starts `python -m server --model M` on a free loopback port
(`loadtest.sweep.server_process`) with `--server-args` (default `--max-waiting 64`: at twice the
sustainable rate a queue of 1,024 would only turn the soak into minutes-long waits; a short queue
exercises the 429 path instead). The traffic is `tools.soak_traffic`'s mix, sent open loop with
Poisson arrivals (`loadtest.trace.arrival_times`) at `--rate` requests/s, or by default at twice
the sustainable rate, found first by a short probe: the same mix without bad requests or
disconnects at 0.25, 0.5, 1, ... requests/s (halving instead when the first rate fails), each for
`--probe-seconds`; the sustainable rate is the highest at which at least 90% of requests finish
within the SLO (`--slo-ttft`, `--slo-itl`: a stream by TTFT and mean inter-token gap, a whole
request by its end-to-end time against the same budget).

While it runs it samples, every `--sample-every` seconds, the server's RSS (from /proc: the
process listening on the URL's port, or `--server-pid`) and its /metrics gauges (running,
waiting, paused requests, used KV blocks). When the time is up it stops sending, lets every
request it sent end, and waits (`--drain-timeout`) for the server's gauges to return to 0.

It prints (and with `--json` writes) requests sent, finished, disconnected on purpose, rejected
as they should be, refused by status, ended by an error event, lost, 5xx, RSS at start, end and
peak with the time series, and the gauges after the traffic. The exit code is 1 when a count
that must be 0 is not: lost, 5xx (seen by a client, or counted by the server's own
`cbserve_requests_total`), bad requests accepted, malformed answers, or gauges that did not drain.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import shlex
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np

from clients.protocol import normalize_base_url
from loadtest.metrics import SLO, distribution
from loadtest.runner import fetch_model_info
from loadtest.sweep import free_port, server_command, server_process
from loadtest.trace import arrival_times
from tools.soak_traffic import OUTCOMES, Clock, Mix, Outcome, Plan, plan_request, send

# /metrics gauges that must be back to 0 once the traffic has ended.
GAUGES = {
    "running": "cbserve_num_requests_running",
    "waiting": "cbserve_num_requests_waiting",
    "paused": "cbserve_num_requests_paused",
    "kv_blocks_used": "cbserve_kv_cache_blocks_used",
}
_STATUS_SERIES = re.compile(r"^cbserve_requests_total\{([^}]*)\}\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


# --- the server as a process: its pid and memory ------------------------------------------------


def listening_pid(port: int) -> int | None:
    """The pid of the local process listening on TCP `port`, from /proc (None when not found or
    not visible to us, e.g. a server behind Docker's port proxy: pass --server-pid then)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in list(f)[1:]:
                cols = line.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{inode}]")
    if not inodes:
        return None
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{entry}/fd/{fd}") in inodes:
                        return int(entry)
    return None


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


@dataclass(frozen=True, slots=True)
class Scrape:
    """The /metrics figures the soak watches."""

    gauges: dict[str, float]
    server_5xx: int  # cbserve_requests_total with a 5xx status, over all endpoints


def parse_metrics(text: str) -> Scrape:
    values: dict[str, float] = {}
    server_5xx = 0
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        if m := _STATUS_SERIES.match(line):
            labels = dict(_LABEL.findall(m.group(1)))
            if labels.get("status", "").startswith("5"):
                server_5xx += int(float(m.group(2)))
            continue
        name, _, value = line.partition(" ")
        values[name] = float(value)
    gauges = {key: values[name] for key, name in GAUGES.items() if name in values}
    return Scrape(gauges, server_5xx)


async def scrape(http: httpx.AsyncClient) -> Scrape | None:
    try:
        response = await http.get("/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    return parse_metrics(response.text) if response.status_code == 200 else None


@dataclass(frozen=True, slots=True)
class Sample:
    t: float  # seconds since the soak started
    rss_mib: float | None
    in_flight: int  # requests our client has open
    gauges: dict[str, float]


class Sampler:
    """Samples RSS and the gauges every `every` seconds in a background task."""

    def __init__(
        self, http: httpx.AsyncClient, pid: int | None, clock: Clock, every: float, quiet: bool
    ) -> None:
        self.http, self.pid, self.clock, self.every, self.quiet = http, pid, clock, every, quiet
        self.samples: list[Sample] = []
        self.in_flight = 0
        self.counts: Counter[str] = Counter()
        self._task: asyncio.Task[None] | None = None

    async def sample(self) -> Sample:
        got = await scrape(self.http)
        s = Sample(
            round(self.clock.now(), 1),
            rss_mib(self.pid),
            self.in_flight,
            got.gauges if got else {},
        )
        self.samples.append(s)
        return s

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.every)
            s = await self.sample()
            if not self.quiet:
                rss = f"{s.rss_mib:.0f} MiB" if s.rss_mib is not None else "n/a"
                done = ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))
                gauges = " ".join(f"{k} {v:g}" for k, v in s.gauges.items())
                print(f"t={s.t:6.0f}s RSS {rss} open {s.in_flight} | {gauges} | {done}", flush=True)


# --- traffic ------------------------------------------------------------------------------------


async def run_traffic(
    http: httpx.AsyncClient,
    model: str,
    rate: float,
    seconds: float,
    mix: Mix,
    seed: int,
    clock: Clock,
    timeout: float,
    sampler: Sampler | None = None,
) -> list[Outcome]:
    """Open loop: Poisson arrivals at `rate` for `seconds`; returns once every request ended."""
    rng = random.Random(seed)
    expected = rate * seconds
    # Poisson counts stay within a few standard deviations of the mean: 1.5x + 50 is plenty.
    arrivals = arrival_times(int(expected * 1.5) + 50, rate, 1.0, np.random.default_rng([seed, 0]))
    start = clock.now()
    tasks: list[asyncio.Task[Outcome]] = []

    async def one(plan: Plan) -> Outcome:
        if sampler is not None:
            sampler.in_flight += 1
        try:
            out = await send(http, plan, clock, timeout)
        finally:
            if sampler is not None:
                sampler.in_flight -= 1
        if sampler is not None:
            sampler.counts[out.outcome] += 1
        return out

    for arrival in arrivals:
        if arrival >= seconds:
            break
        delay = start + arrival - clock.now()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(plan_request(rng, model, mix))))
    return list(await asyncio.gather(*tasks))


def slo_fraction(outcomes: list[Outcome], slo: SLO) -> float:
    return sum(o.meets(slo) for o in outcomes) / len(outcomes) if outcomes else 0.0


@dataclass(frozen=True, slots=True)
class ProbeStep:
    rate: float
    seconds: float
    requests: int
    within_slo: float
    outcomes: dict[str, int]


async def probe(
    http: httpx.AsyncClient,
    model: str,
    mix: Mix,
    args: argparse.Namespace,
    clock: Clock,
    slo: SLO,
) -> tuple[float, list[ProbeStep], list[Outcome]]:
    """The sustainable rate: doubling from `--probe-start` while >= `--slo-fraction` of the
    requests meet the SLO (halving instead when the first rate fails). Well-formed requests
    only, no disconnects. Returns the rate, the steps, and every probe request's outcome."""
    quiet_mix = replace(
        mix, bad_fraction=0.0, stream_disconnect_fraction=0.0, whole_disconnect_fraction=0.0
    )
    steps: list[ProbeStep] = []
    everything: list[Outcome] = []
    rate, best, direction = args.probe_start, None, 0
    for i in range(args.probe_max_steps):
        # At least ~8 requests per step, or the fraction means little.
        seconds = max(args.probe_seconds, 8 / rate)
        outs = await run_traffic(
            http, model, rate, seconds, quiet_mix, args.seed + 1000 + i, clock, args.request_timeout
        )
        everything += outs
        fraction = slo_fraction(outs, slo)
        steps.append(
            ProbeStep(rate, seconds, len(outs), fraction, dict(Counter(o.outcome for o in outs)))
        )
        print(
            f"probe {rate:g} req/s for {seconds:.0f} s: {len(outs)} requests, "
            f"{fraction:.0%} within SLO",
            flush=True,
        )
        await wait_drained(http, args.drain_timeout)
        passed = fraction >= args.slo_fraction
        if passed:
            best = rate if best is None else max(best, rate)
        if direction == 0:
            direction = 1 if passed else -1
        if (direction == 1 and not passed) or (direction == -1 and passed):
            break
        rate = rate * 2 if direction == 1 else rate / 2
    if best is None:
        best = steps[-1].rate / 2
        print(f"no probed rate met the SLO; taking {best:g} req/s as sustainable", flush=True)
    return best, steps, everything


async def wait_drained(http: httpx.AsyncClient, timeout: float) -> tuple[bool, dict[str, float]]:
    """Poll /metrics until every watched gauge is 0 (True) or `timeout` passes (False)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    gauges: dict[str, float] = {}
    while True:
        got = await scrape(http)
        if got is not None:
            gauges = got.gauges
            if len(gauges) == len(GAUGES) and not any(gauges.values()):
                return True, gauges
        if loop.time() >= deadline:
            return False, gauges
        await asyncio.sleep(0.5)


# --- the report ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Report:
    conditions: str
    base_url: str
    model: str
    rate: float
    rate_source: str  # "--rate" or "2 x probe"
    sustainable_rate: float | None
    probe: list[ProbeStep]
    slo: str
    minutes: float
    traffic_seconds: float = 0.0
    sent: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    refused_by_status: dict[str, int] = field(default_factory=dict)
    stream_errors: dict[str, int] = field(default_factory=dict)
    rejected_otherwise: dict[str, int] = field(default_factory=dict)  # another 4xx than expected
    client_5xx: int = 0
    server_5xx: int | None = None
    lost_examples: list[str] = field(default_factory=list)
    malformed_examples: list[str] = field(default_factory=list)
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    finished_within_slo: float = 0.0
    ttft_ms: dict[str, float] = field(default_factory=dict)
    e2e_ms: dict[str, float] = field(default_factory=dict)
    rss_idle_mib: float | None = None
    rss_start_mib: float | None = None
    rss_end_mib: float | None = None
    rss_peak_mib: float | None = None
    drained: bool = False
    drain_seconds: float = 0.0
    gauges_after: dict[str, float] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def count(self, outcome: str) -> int:
        return self.outcomes.get(outcome, 0)


def _ms(values: list[float]) -> dict[str, float]:
    d = distribution(values)
    if d is None:
        return {}
    return {k: round(getattr(d, k) * 1000, 1) for k in ("p50", "p90", "p99", "max")}


def tally(report: Report, outcomes: list[Outcome], slo: SLO) -> None:
    """Fill the counts of `report` from the soak's outcomes and decide what failed."""
    report.sent = len(outcomes)
    report.outcomes = {k: v for k, v in Counter(o.outcome for o in outcomes).most_common()}
    report.refused_by_status = dict(
        Counter(str(o.status) for o in outcomes if o.outcome == "status").most_common()
    )
    report.stream_errors = dict(
        Counter(o.detail.split(":")[0] for o in outcomes if o.outcome == "stream_error")
    )
    report.rejected_otherwise = dict(
        Counter(
            f"{o.plan.kind} {o.status}"
            for o in outcomes
            if o.outcome == "rejected" and o.status != o.plan.expect_status
        )
    )
    report.client_5xx = sum(1 for o in outcomes if o.status is not None and o.status >= 500)
    report.lost_examples = [f"{o.plan.kind}: {o.detail}" for o in outcomes if o.outcome == "lost"][
        :10
    ]
    report.malformed_examples = [
        f"{o.plan.kind}: {o.detail}" for o in outcomes if o.outcome in ("malformed", "accepted_bad")
    ][:10]
    by_kind: dict[str, Counter[str]] = {}
    for o in outcomes:
        by_kind.setdefault(o.plan.kind, Counter())[o.outcome] += 1
    report.by_kind = {k: dict(v) for k, v in sorted(by_kind.items())}
    finished = [o for o in outcomes if o.outcome == "finished"]
    report.finished_within_slo = slo_fraction(finished, slo)
    report.ttft_ms = _ms(
        [o.chunk_times[0] - o.send_time for o in finished if o.plan.stream and o.chunk_times]
    )
    report.e2e_ms = _ms([o.end_time - o.send_time for o in finished if o.end_time is not None])


def judge(report: Report, probe_outcomes: list[Outcome]) -> None:
    """The must-be-0 checks; each failure is a sentence in `report.failures`."""
    f = report.failures
    if report.count("lost"):
        f.append(f"{report.count('lost')} requests lost (accepted, never finished, no error)")
    if report.client_5xx:
        f.append(f"{report.client_5xx} responses with a 5xx status")
    if report.server_5xx:
        f.append(f"the server counted {report.server_5xx} 5xx responses in /metrics")
    if report.count("accepted_bad"):
        f.append(f"{report.count('accepted_bad')} bad requests answered 200")
    if report.count("malformed"):
        f.append(f"{report.count('malformed')} malformed answers")
    probe_bad = [
        o for o in probe_outcomes if o.outcome in ("lost", "malformed") or (o.status or 0) >= 500
    ]
    if probe_bad:
        f.append(f"{len(probe_bad)} probe requests lost, malformed or 5xx")
    if not report.drained:
        f.append(f"the server's gauges did not drain to 0: {report.gauges_after}")
    if report.sent == 0:
        f.append("no requests were sent")


def format_report(r: Report) -> str:
    def mib(v: float | None) -> str:
        return f"{v:.1f} MiB" if v is not None else "n/a"

    lines = [
        "=" * 20 + " Soak result " + "=" * 20,
        r.conditions,
        f"Rate: {r.rate:g} req/s ({r.rate_source}"
        + (f"; sustainable {r.sustainable_rate:g} req/s" if r.sustainable_rate else "")
        + f"), SLO {r.slo}",
        f"Traffic: {r.traffic_seconds:.0f} s, {r.sent} requests sent",
    ]
    for name in OUTCOMES:
        extra = ""
        if name == "status" and r.refused_by_status:
            extra = f"  {r.refused_by_status}"
        if name == "rejected" and r.rejected_otherwise:
            extra = f"  other 4xx than expected: {r.rejected_otherwise}"
        if name == "stream_error" and r.stream_errors:
            extra = f"  {r.stream_errors}"
        lines.append(f"  {name:<14}{r.count(name):>7}{extra}")
    lines += [
        f"5xx seen by clients: {r.client_5xx}; counted by the server: "
        + (str(r.server_5xx) if r.server_5xx is not None else "n/a"),
        f"Finished within SLO: {r.finished_within_slo:.0%}; TTFT ms {r.ttft_ms}; E2E ms {r.e2e_ms}",
        f"RSS idle {mib(r.rss_idle_mib)}, start {mib(r.rss_start_mib)}, "
        f"end {mib(r.rss_end_mib)}, peak {mib(r.rss_peak_mib)}",
        f"After the traffic: gauges {r.gauges_after} "
        + (f"(0 after {r.drain_seconds:.1f} s)" if r.drained else "(NOT drained)"),
    ]
    for example in r.lost_examples + r.malformed_examples:
        lines.append(f"  ! {example}")
    lines.append("PASS" if not r.failures else "FAIL: " + "; ".join(r.failures))
    return "\n".join(lines)


def conditions_line(model: str, server_args: str) -> str:
    return (
        f"Conditions: {model} ({server_args or 'server defaults'}), {os.cpu_count()}x "
        f"{platform.machine()} CPU, soak niceness {os.nice(0)}, load average "
        f"{os.getloadavg()[0]:.2f} at start, measured {datetime.now(UTC).isoformat(timespec='seconds')}."
    )


# --- the run ------------------------------------------------------------------------------------


async def soak(base_url: str, pid: int | None, args: argparse.Namespace) -> Report:
    model = fetch_model_info(base_url).id
    slo = SLO(ttft=args.slo_ttft, itl_mean=args.slo_itl)
    lo, hi = (int(x) for x in args.max_tokens.split(":"))
    mix = Mix(
        bad_fraction=args.bad_fraction,
        stream_disconnect_fraction=args.disconnect_fraction,
        whole_disconnect_fraction=args.whole_disconnect_fraction,
        max_tokens=(lo, hi),
    )
    clock = Clock()
    async with httpx.AsyncClient(
        base_url=base_url,
        timeout=httpx.Timeout(None, connect=30.0),
        # Open loop: no client-side pool limit that would queue requests here.
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    ) as http:
        # Warm-up, a few requests one at a time: first-call costs (grammar compiler, kernels)
        # stay out of the probe. The first has a long prompt, so the engine's first step is a
        # realistic one (a cold first step on a tiny prompt skews what the step budget learns).
        warm = replace(
            mix, bad_fraction=0, stream_disconnect_fraction=0, whole_disconnect_fraction=0
        )
        rng = random.Random(args.seed - 1)
        long_first = replace(warm, prompt_words=(60, 80))
        for i in range(6):
            plan = plan_request(rng, model, long_first if i == 0 else warm)
            await send(http, plan, clock, args.request_timeout)
        await wait_drained(http, args.drain_timeout)
        rss_idle = rss_mib(pid)
        sustainable, steps, probe_outcomes = None, [], []
        if args.rate:
            rate, source = args.rate, "--rate"
        else:
            sustainable, steps, probe_outcomes = await probe(http, model, mix, args, clock, slo)
            rate, source = args.rate_factor * sustainable, f"{args.rate_factor:g} x probe"
        report = Report(
            conditions=conditions_line(model, args.server_args if not args.base_url else ""),
            base_url=base_url,
            model=model,
            rate=rate,
            rate_source=source,
            sustainable_rate=sustainable,
            probe=steps,
            slo=slo.describe(),
            minutes=args.minutes,
            rss_idle_mib=rss_idle,
        )
        print(f"soak: {rate:g} req/s for {args.minutes:g} min ({source})", flush=True)
        sampler = Sampler(http, pid, clock, args.sample_every, args.quiet)
        first = await sampler.sample()
        report.rss_start_mib = first.rss_mib
        sampler.start()
        t0 = clock.now()
        outcomes = await run_traffic(
            http,
            model,
            rate,
            args.minutes * 60,
            mix,
            args.seed,
            clock,
            args.request_timeout,
            sampler,
        )
        report.traffic_seconds = clock.now() - t0
        t1 = clock.now()
        report.drained, report.gauges_after = await wait_drained(http, args.drain_timeout)
        report.drain_seconds = clock.now() - t1
        await sampler.stop()
        last = await sampler.sample()
        report.rss_end_mib = last.rss_mib
        rss = [s.rss_mib for s in sampler.samples if s.rss_mib is not None]
        report.rss_peak_mib = max(rss) if rss else None
        report.samples = sampler.samples
        got = await scrape(http)
        report.server_5xx = got.server_5xx if got else None
    tally(report, outcomes, slo)
    judge(report, probe_outcomes)
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--base-url", default=None, help="a running server (else one is started)")
    p.add_argument("--server-pid", type=int, default=None, help="its pid, for RSS")
    p.add_argument("--model", default="smollm2-135m-instruct", help="for the started server")
    p.add_argument("--engine", default="continuous", help="for the started server")
    p.add_argument(
        "--server-args",
        default="--max-waiting 64",
        help="more flags for the started server (default: %(default)s)",
    )
    p.add_argument("--rate", type=float, default=None, help="req/s (default: probe x factor)")
    p.add_argument("--rate-factor", type=float, default=2.0)
    p.add_argument("--probe-start", type=float, default=0.25)
    p.add_argument("--probe-seconds", type=float, default=20.0)
    p.add_argument("--probe-max-steps", type=int, default=6)
    p.add_argument("--slo-ttft", type=float, default=2.0, help="seconds (default: %(default)s)")
    p.add_argument("--slo-itl", type=float, default=0.2, help="mean seconds between tokens")
    p.add_argument("--slo-fraction", type=float, default=0.9)
    p.add_argument("--max-tokens", default="8:48", help="lo:hi per request")
    p.add_argument("--bad-fraction", type=float, default=0.08)
    p.add_argument("--disconnect-fraction", type=float, default=0.15, help="of streams")
    p.add_argument("--whole-disconnect-fraction", type=float, default=0.05)
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--drain-timeout", type=float, default=120.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the full report here")
    p.add_argument("--log", type=Path, default=None, help="the started server's log")
    p.add_argument("--quiet", action="store_true", help="no line per sample")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.base_url:
        url = normalize_base_url(args.base_url)
        server: contextlib.AbstractContextManager[str] = contextlib.nullcontext(url)
        split = urlsplit(url)
        pid = args.server_pid
        if pid is None and split.hostname in ("127.0.0.1", "localhost", "::1"):
            pid = listening_pid(split.port or 80)
    else:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = args.log or Path(tempfile.gettempdir()) / f"cbserve-soak-{port}.log"
        command = server_command(args.model, args.engine, port, shlex.split(args.server_args))
        print(f"starting {shlex.join(command)} (log {log})", flush=True)
        server = server_process(command, url, log, startup_timeout=args.startup_timeout)
        pid = None
    with server:
        if pid is None:
            pid = args.server_pid or listening_pid(urlsplit(url).port or 80)
        report = asyncio.run(soak(url, pid, args))
    print(format_report(report))
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=1, default=str) + "\n")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
