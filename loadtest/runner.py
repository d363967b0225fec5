"""The open-loop load generator: sends a trace over HTTP and times every streamed chunk.

Owns the client side of a run. Each request is sent at its arrival time whether or not earlier
ones have finished (open loop: a slow server faces a growing queue instead of a politely waiting
client), as a streaming /v1/completions (or /v1/chat/completions) request with
`ignore_eos` and `max_tokens=output_len`, so every request does the work the trace asked for,
and greedy (`temperature=0`) unless the run is given other sampling fields (`SERVER_DEFAULTS`:
none, so the server applies its model's defaults, as for a client that sets nothing). Errors
become records, never exceptions; a global time limit cancels what is left and records it as
"timeout". Also owns the few other HTTP calls a run needs: /v1/models
metadata, /tokenize for exact text lengths, a warm-up request, and reading counters from a
server's Prometheus /metrics.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import httpx
from tqdm import tqdm

from clients.protocol import (
    DONE,
    ClientError,
    SSEDecoder,
    auth_headers,
    carries_tokens,
    error_from_body,
    normalize_base_url,
    parse_chunk,
)
from loadtest.metrics import TIMEOUT, RequestRecord
from loadtest.trace import Trace, TraceRequest

Endpoint = Literal["completions", "chat"]
# Sampling fields every request of a run carries.
Sampling = tuple[tuple[str, Any], ...]
GREEDY: Sampling = (("temperature", 0),)
SERVER_DEFAULTS: Sampling = ()


def parse_sampling(text: str) -> Sampling:
    """`greedy`, `server` (send no sampling field: the server's defaults) or a JSON object of
    fields, e.g. '{"temperature": 0.7, "top_p": 0.9}'."""
    if text == "greedy":
        return GREEDY
    if text == "server":
        return SERVER_DEFAULTS
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"sampling must be greedy, server or a JSON object: {exc}") from None
    if not isinstance(fields, dict):
        raise ValueError("sampling must be greedy, server or a JSON object")
    return tuple(sorted(fields.items()))


def add_sampling_argument(parser: Any) -> None:
    """`--sampling greedy|server|JSON` on an argparse parser or group (greedy by default)."""
    parser.add_argument(
        "--sampling", type=parse_sampling, default=GREEDY, metavar="greedy|server|JSON",
        help="sampling fields each request sends: greedy (temperature 0, the default), server "
        "(none: the server's defaults, as a client that sets nothing) or a JSON object",
    )  # fmt: skip


def describe_sampling(sampling: Sampling) -> str:
    if sampling == GREEDY:
        return "greedy"
    return json.dumps(dict(sampling)) if sampling else "the server's defaults"


PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the server says about the model it serves (optional fields are None when unsaid)."""

    id: str
    parameter_count: int | None = None
    torch_version: str | None = None


@dataclass(frozen=True, slots=True)
class RunResult:
    """The records of one run, the wall time it took (s), and the most requests in flight."""

    records: tuple[RequestRecord, ...]
    duration: float
    peak_concurrency: int
    started_at: str


def _lookup(entry: dict[str, Any], key: str) -> Any:
    # Servers that add fields put them at the top of the model entry or under "metadata".
    if key in entry:
        return entry[key]
    metadata = entry.get("metadata")
    return metadata.get(key) if isinstance(metadata, dict) else None


def scrape_metrics(
    base_url: str, prefixes: tuple[str, ...], timeout: float = 30.0
) -> dict[str, float]:
    """The samples of `base_url`'s /metrics whose name (labels included) starts with one of
    `prefixes`, by that name. Raises httpx's errors for a server that does not answer."""
    response = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout)
    response.raise_for_status()
    values: dict[str, float] = {}
    for line in response.text.splitlines():
        if line.startswith(prefixes):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def fetch_model_info(
    base_url: str, model: str | None = None, api_key: str | None = None
) -> ModelInfo:
    """The entry of `model` (default: the first listed) from GET /v1/models."""
    with httpx.Client(base_url=normalize_base_url(base_url), headers=auth_headers(api_key)) as http:
        response = http.get("/v1/models", timeout=30)
    if response.status_code >= 400:
        raise error_from_body(response.status_code, response.content, response.reason_phrase)
    entries = response.json().get("data") or []
    if not entries:
        raise ClientError("the server lists no models")
    entry = next((e for e in entries if e.get("id") == model), None) if model else entries[0]
    if entry is None:
        # An OpenAI-compatible server may serve a name it does not list; trust the user.
        return ModelInfo(id=str(model))
    count, version = _lookup(entry, "parameter_count"), _lookup(entry, "torch_version")
    return ModelInfo(
        id=str(entry["id"]),
        parameter_count=int(count) if count is not None else None,
        torch_version=str(version) if version is not None else None,
    )


class TokenCounter:
    """Counts tokens of a text with the server's POST /tokenize (a `CountTokens` for traces).

    Accepts a response with `"count"` or only `"tokens"`; counts include any BOS the server adds,
    which is what it will report as prompt_tokens.
    """

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None) -> None:
        self._http = httpx.Client(
            base_url=normalize_base_url(base_url), headers=auth_headers(api_key), timeout=30
        )
        self._model = model
        # The same texts come back (a binary search's last probe, a sweep's later rates): ask once.
        self._cache: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        if text not in self._cache:
            self._cache[text] = self._count(text)
        return self._cache[text]

    def _count(self, text: str) -> int:
        body: dict[str, Any] = {"prompt": text}
        if self._model:
            body["model"] = self._model
        response = self._http.post("/tokenize", json=body)
        if response.status_code >= 400:
            raise error_from_body(response.status_code, response.content, response.reason_phrase)
        result = response.json()
        return int(result["count"]) if "count" in result else len(result["tokens"])

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> TokenCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def request_body(
    request: TraceRequest, model: str, endpoint: Endpoint, sampling: Sampling = GREEDY
) -> dict[str, Any]:
    """The JSON body that asks for exactly `output_len` tokens, streamed with a usage chunk."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.output_len,
        "ignore_eos": True,
        **dict(sampling),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        if not isinstance(request.prompt, str):
            raise ValueError("the chat endpoint needs text prompts (--prompt-kind text)")
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt if isinstance(request.prompt, str) else list(request.prompt)
    return body


@dataclass(slots=True)
class _Observation:
    """The mutable state of one request while it runs; frozen into a `RequestRecord` at the end.

    Kept outside the request's task so a cancelled task (time limit) still leaves what it saw.
    """

    send_time: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    end_time: float | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None

    def freeze(self, request: TraceRequest) -> RequestRecord:
        finished = self.end_time is not None or self.error is not None
        usage = self.usage or {}
        return RequestRecord(
            index=request.index,
            arrival=request.arrival,
            prompt_len=request.prompt_len,
            output_len=request.output_len,
            send_time=self.send_time,
            chunk_times=tuple(self.chunk_times),
            end_time=self.end_time,
            completion_tokens=usage.get("completion_tokens"),
            prompt_tokens=usage.get("prompt_tokens"),
            error=self.error if finished else TIMEOUT,
        )


class _Run:
    """One run's shared state: the clock origin, in-flight count and every observation."""

    def __init__(
        self,
        trace: Trace,
        http: httpx.AsyncClient,
        model: str,
        endpoint: Endpoint,
        bar: tqdm,
        sampling: Sampling,
    ) -> None:
        self.http = http
        self.model = model
        self.sampling = sampling
        self.path = PATHS[endpoint]
        self.endpoint = endpoint
        self.bar = bar
        self.t0 = time.perf_counter()
        self.in_flight = 0
        self.peak = 0
        self.observations = {request.index: _Observation() for request in trace}

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def send(self, request: TraceRequest) -> None:
        obs = self.observations[request.index]
        body = request_body(request, self.model, self.endpoint, self.sampling)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        obs.send_time = self.now()
        try:
            await self._stream(body, obs)
        except ClientError as exc:
            obs.error = str(exc)
        except Exception as exc:  # any failure of one request is a result, never the run's end
            obs.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.in_flight -= 1
            self.bar.update(1)

    async def _stream(self, body: dict[str, Any], obs: _Observation) -> None:
        async with self.http.stream("POST", self.path, json=body) as response:
            if response.status_code >= 400:
                await response.aread()
                raise error_from_body(
                    response.status_code, response.content, response.reason_phrase
                )
            decoder = SSEDecoder()
            async for line in response.aiter_lines():
                data = decoder.feed(line)
                if data is None:
                    continue
                if data == DONE:
                    obs.end_time = self.now()
                    return
                # Time the chunk before parsing it: parsing is our cost, not the server's.
                arrived = self.now()
                chunk = parse_chunk(data)
                if carries_tokens(chunk):
                    obs.chunk_times.append(arrived)
                if chunk.get("usage"):
                    obs.usage = chunk["usage"]
            if decoder.flush() == DONE:
                obs.end_time = self.now()
            else:
                raise ClientError("stream ended before [DONE]")


async def run_trace(
    trace: Trace,
    *,
    base_url: str,
    model: str,
    endpoint: Endpoint = "completions",
    api_key: str | None = None,
    time_limit: float | None = None,
    progress: bool = True,
    sampling: Sampling = GREEDY,
) -> RunResult:
    """Send every request of `trace` at its arrival time and record what the client observes."""
    # Reject a bad trace before the clock starts.
    if len({request.index for request in trace}) != len(trace):
        raise ValueError("trace indices must be unique")
    for request in trace:
        request_body(request, model, endpoint, sampling)
    started_at = _iso_now()
    # No connection limit: httpx's default pool of 100 would quietly queue requests client-side
    # and turn the open loop into a closed one. No read timeout: the time limit bounds the run.
    http = httpx.AsyncClient(
        base_url=normalize_base_url(base_url),
        headers=auth_headers(api_key),
        timeout=httpx.Timeout(None, connect=30.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )
    with tqdm(total=len(trace), disable=not progress, unit="req", desc="requests") as bar:
        async with http:
            run = _Run(trace, http, model, endpoint, bar, sampling)
            tasks: list[asyncio.Task[None]] = []

            async def dispatch() -> None:
                # Sorted, so a hand-made trace out of order is still sent on time.
                for request in sorted(trace, key=lambda r: r.arrival):
                    delay = request.arrival - run.now()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    tasks.append(asyncio.create_task(run.send(request)))
                await asyncio.gather(*tasks)

            limit = time_limit if time_limit is not None and math.isfinite(time_limit) else None
            try:
                async with asyncio.timeout(limit):
                    await dispatch()
            except TimeoutError:
                pass
            # After a timeout the gather is cancelled; make sure every request task has ended.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            duration = run.now()
    records = tuple(run.observations[r.index].freeze(r) for r in trace)
    return RunResult(records, duration, run.peak, started_at)


async def warm_up(
    base_url: str,
    model: str,
    request: TraceRequest,
    endpoint: Endpoint = "completions",
    api_key: str | None = None,
    sampling: Sampling = GREEDY,
) -> None:
    """Send `request` once and wait for it, so first-call costs stay out of the measurement.

    Its prompt is reversed: a valid prompt for this server and endpoint (it comes from the
    trace) that does not warm a prefix cache for the trace's own first request.
    """
    prompt = request.prompt[::-1]
    warm = TraceRequest(0, 0.0, prompt, request.prompt_len, min(request.output_len, 4))
    async with httpx.AsyncClient(
        base_url=normalize_base_url(base_url), headers=auth_headers(api_key), timeout=120
    ) as http:
        body = request_body(warm, model, endpoint, sampling)
        response = await http.post(PATHS[endpoint], json=body)
        if response.status_code >= 400:
            raise error_from_body(response.status_code, response.content, response.reason_phrase)


def _iso_now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
