"""The soak's traffic: what one request asks for, and what its client saw of it.

Owns the request mix of `python -m tools.soak` and the exchange of a single request over HTTP,
nothing about rates, servers or reports. `plan_request` draws one request: an endpoint
(completions or chat), streamed or whole, one feature (plain, n > 1, logprobs, stop strings, or a
`response_format` JSON schema), and with some probability a deliberately bad body that must get a
4xx, or a client that disconnects on purpose (a stream closed after a random number of chunks, a
whole request abandoned after a random delay). `send` carries it out and returns an `Outcome`:

- finished      200 and a complete answer (a stream ends with `[DONE]` and no error event; a
                whole body has its n choices, each with a finish_reason; a schema-constrained
                answer that finished with "stop" parses as JSON)
- disconnected  our client went away on purpose before the answer was complete
- rejected      a bad request got the 4xx it deserved
- status        a good request refused with an HTTP status (429 under overload, or a bug)
- stream_error  a 200 stream that ended with an OpenAI error event (the client saw it)
- accepted_bad  a bad request answered 200 (a validation hole)
- malformed     a 200 whose body is not what was asked for (wrong choice count, broken JSON),
                an error status without an OpenAI error body, or a 429 without Retry-After
- lost          accepted (or at least connected) but neither finished nor ended with an error the
                client could see: a stream cut before `[DONE]`, a reset connection, no answer
                within the request timeout

Bodies are sent as ASCII JSON bytes (`json.dumps` escapes everything), so a lone surrogate can be
sent on purpose. SSE framing, error events and token chunks are read with `clients.protocol`;
prompts are made of `loadtest.trace.WORDS`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from clients.protocol import DONE, ClientError, SSEDecoder, carries_tokens, parse_chunk
from loadtest.metrics import SLO, RequestRecord, meets_slo
from loadtest.trace import WORDS

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
FEATURES = ("plain", "n", "logprobs", "stop", "json_schema")

# A small schema the model can fill within its token budget.
PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}

# Bodies the server must refuse (endpoint, the status it must give); apart from the one fault,
# each body is well formed.
BAD_REQUESTS: dict[str, tuple[str, int]] = {
    "negative_temperature": ("completions", 400),
    "string_max_tokens": ("completions", 400),
    "unknown_model": ("completions", 404),
    "lone_surrogate": ("chat", 400),
    "not_json": ("completions", 400),
    "too_many_choices": ("chat", 400),
    "beyond_context": ("completions", 400),
    "top_logprobs_without_logprobs": ("chat", 400),
    "empty_messages": ("chat", 400),
    "bad_schema": ("chat", 400),
}

OUTCOMES = (
    "finished",
    "disconnected",
    "rejected",
    "status",
    "stream_error",
    "accepted_bad",
    "malformed",
    "lost",
)


@dataclass(frozen=True, slots=True)
class Mix:
    """How the soak's requests are drawn. Fractions are of all requests."""

    bad_fraction: float = 0.08
    # Of well-formed streamed requests: closed after a random number of chunks (0 = right after
    # the response headers); of whole ones: abandoned after a random delay.
    stream_disconnect_fraction: float = 0.15
    whole_disconnect_fraction: float = 0.05
    max_tokens: tuple[int, int] = (8, 48)
    prompt_words: tuple[int, int] = (4, 40)
    max_n: int = 3


@dataclass(frozen=True, slots=True)
class Plan:
    """One request to send. `content` is the exact body; `expect_status` is 200 or a 4xx."""

    kind: str  # "completions/plain/stream", "bad/unknown_model", ...
    path: str
    content: bytes
    stream: bool
    expect_status: int = 200
    n: int = 1
    max_tokens: int = 0
    schema: bool = False
    disconnect_after_chunks: int | None = None
    disconnect_after_s: float | None = None


@dataclass(slots=True)
class Outcome:
    """What the client saw. Times are seconds since the soak's clock origin."""

    plan: Plan
    outcome: str = "lost"
    status: int | None = None
    detail: str = ""
    send_time: float = 0.0
    end_time: float | None = None
    chunk_times: list[float] = field(default_factory=list)

    def meets(self, slo: SLO) -> bool:
        """Within the SLO: a finished stream by TTFT and mean ITL (`loadtest.metrics`), a finished
        whole request by its end-to-end time against the same budget for its max_tokens."""
        if self.outcome != "finished" or self.end_time is None:
            return False
        if self.plan.stream:
            record = RequestRecord(
                index=0,
                arrival=self.send_time,
                prompt_len=0,
                output_len=self.plan.max_tokens,
                send_time=self.send_time,
                chunk_times=tuple(self.chunk_times),
                end_time=self.end_time,
            )
            return meets_slo(record, slo)
        budget = slo.ttft + slo.itl_mean * max(self.plan.max_tokens - 1, 0)
        return self.end_time - self.send_time <= budget


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode("ascii")


def plan_request(rng: random.Random, model: str, mix: Mix) -> Plan:
    """Draw one request of the mix."""
    if rng.random() < mix.bad_fraction:
        return _bad_request(rng, model, mix)
    endpoint = rng.choice(("completions", "chat"))
    stream = rng.random() < 0.5
    feature = rng.choice(FEATURES)
    max_tokens = rng.randint(*mix.max_tokens)
    prompt = _words(rng, *mix.prompt_words)
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": stream}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body["temperature"] = 0.8
        body["seed"] = rng.randrange(2**31)
    n = 1
    if feature == "n":
        n = rng.randint(2, mix.max_n)
        body["n"] = n
    elif feature == "logprobs":
        k = rng.randint(0, 5)
        if endpoint == "chat":
            body["logprobs"] = True
            body["top_logprobs"] = k
        else:
            body["logprobs"] = k
    elif feature == "stop":
        body["stop"] = rng.sample([".", ",", " the", " and", "\n", " of"], rng.randint(1, 3))
    elif feature == "json_schema":
        # Room for the object; the prompt says what is wanted so the model is not fighting it.
        body["max_tokens"] = max_tokens = max(max_tokens, 40)
        text = "Give a JSON object with a name and an age. " + prompt
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA},
        }
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    disconnect_chunks = disconnect_s = None
    if stream and rng.random() < mix.stream_disconnect_fraction:
        disconnect_chunks = rng.randint(0, max(max_tokens // 2, 1))
    elif not stream and rng.random() < mix.whole_disconnect_fraction:
        disconnect_s = rng.uniform(0.05, 2.0)
    mode = "stream" if stream else "whole"
    return Plan(
        kind=f"{endpoint}/{feature}/{mode}",
        path=PATHS[endpoint],
        content=_encode(body),
        stream=stream,
        n=n,
        max_tokens=max_tokens,
        schema=feature == "json_schema",
        disconnect_after_chunks=disconnect_chunks,
        disconnect_after_s=disconnect_s,
    )


def _bad_request(rng: random.Random, model: str, mix: Mix) -> Plan:
    name = rng.choice(sorted(BAD_REQUESTS))
    endpoint, status = BAD_REQUESTS[name]
    stream = rng.random() < 0.5
    prompt = _words(rng, *mix.prompt_words)
    body: dict[str, Any] = {"model": model, "max_tokens": 8, "stream": stream}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    content: bytes | None = None
    if name == "negative_temperature":
        body["temperature"] = -1
    elif name == "string_max_tokens":
        body["max_tokens"] = "8"
    elif name == "unknown_model":
        body["model"] = "no-such-model"
    elif name == "lone_surrogate":
        body["messages"][0]["content"] = prompt + "\ud800"  # valid JSON, invalid Unicode
    elif name == "not_json":
        content = b'{"model": "' + model.encode() + b'", "prompt": "unterminated'
    elif name == "too_many_choices":
        body["n"] = 1000
    elif name == "beyond_context":
        body["max_tokens"] = 10_000_000  # beyond any context this server has
    elif name == "top_logprobs_without_logprobs":
        body["top_logprobs"] = 3
    elif name == "empty_messages":
        body["messages"] = []
    elif name == "bad_schema":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "no-such-type"}},
        }
    return Plan(
        kind=f"bad/{name}",
        path=PATHS[endpoint],
        content=content if content is not None else _encode(body),
        stream=stream,
        expect_status=status,
    )


class Clock:
    """Seconds since the soak started (one origin for every record and sample)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0


async def send(http: httpx.AsyncClient, plan: Plan, clock: Clock, timeout: float) -> Outcome:
    """Send `plan` and classify what came back; never raises (but is cancellable)."""
    out = Outcome(plan, send_time=clock.now())
    try:
        if plan.disconnect_after_s is not None:
            try:
                async with asyncio.timeout(plan.disconnect_after_s):
                    await _exchange(http, plan, out, clock, timeout)
            except TimeoutError:
                if out.outcome == "lost":  # no answer yet: our client walks away
                    out.outcome, out.detail = "disconnected", "abandoned a whole request"
        else:
            await _exchange(http, plan, out, clock, timeout)
    except TimeoutError:
        out.outcome, out.detail = "lost", f"no complete answer within {timeout:g} s"
    except httpx.HTTPError as exc:
        out.outcome, out.detail = "lost", f"{type(exc).__name__}: {exc}"
    if out.end_time is None:
        out.end_time = clock.now()
    return out


async def _exchange(
    http: httpx.AsyncClient, plan: Plan, out: Outcome, clock: Clock, timeout: float
) -> None:
    headers = {"Content-Type": "application/json"}
    async with (
        asyncio.timeout(timeout),
        http.stream("POST", plan.path, content=plan.content, headers=headers) as response,
    ):
        out.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            _classify_refusal(plan, out, response)
            return
        if plan.expect_status != 200:
            await response.aread()
            out.outcome, out.detail = "accepted_bad", f"{plan.kind} answered 200"
            return
        if plan.stream:
            await _read_stream(response, plan, out, clock)
        else:
            body = await response.aread()
            out.end_time = clock.now()
            _check_whole(plan, out, body)


def _classify_refusal(plan: Plan, out: Outcome, response: httpx.Response) -> None:
    status = response.status_code
    try:
        error = response.json()["error"]
        out.detail = str(error.get("message", ""))[:200]
        shaped = isinstance(error, dict) and "type" in error
    except (ValueError, KeyError, TypeError):
        shaped = False
        out.detail = response.text[:200]
    if status >= 500:
        out.outcome = "status"
    elif not shaped:
        out.outcome, out.detail = "malformed", f"HTTP {status} without an OpenAI error body"
    elif status == 429 and "retry-after" not in response.headers:
        out.outcome, out.detail = "malformed", "HTTP 429 without Retry-After"
    elif plan.expect_status != 200:
        out.outcome = "rejected" if 400 <= status < 500 else "status"
        if status != plan.expect_status:
            out.detail = f"expected {plan.expect_status}, got {status}: {out.detail}"
    else:
        out.outcome = "status"


async def _read_stream(response: httpx.Response, plan: Plan, out: Outcome, clock: Clock) -> None:
    decoder = SSEDecoder()
    finished: set[int] = set()
    limit = plan.disconnect_after_chunks
    if limit == 0:
        out.outcome, out.detail = "disconnected", "closed after the response headers"
        return
    async for line in response.aiter_lines():
        data = decoder.feed(line)
        if data is None:
            continue
        if data == DONE:
            out.end_time = clock.now()
            if len(finished) < plan.n:
                out.outcome = "malformed"
                out.detail = f"[DONE] after {len(finished)} of {plan.n} choices finished"
            else:
                out.outcome = "finished"
            return
        arrived = clock.now()
        try:
            chunk = parse_chunk(data)
        except ClientError as exc:
            # An error event: the client is told. The stream should then end with [DONE].
            out.outcome, out.detail = "stream_error", f"{exc.code or exc.type}: {exc.message}"
            out.end_time = clock.now()
            return
        if carries_tokens(chunk):
            out.chunk_times.append(arrived)
        for choice in chunk.get("choices") or ():
            if choice.get("finish_reason") is not None:
                finished.add(int(choice.get("index", 0)))
        if limit is not None and len(out.chunk_times) >= limit:
            out.outcome, out.detail = "disconnected", f"closed after {limit} chunks"
            return  # leaving the `stream` block closes the connection mid-stream
    out.outcome, out.detail = "lost", "the stream ended before [DONE] without an error event"


def _check_whole(plan: Plan, out: Outcome, body: bytes) -> None:
    try:
        obj = json.loads(body)
        choices = obj["choices"]
    except (ValueError, KeyError, TypeError):
        out.outcome, out.detail = "malformed", f"not a completion body: {body[:200]!r}"
        return
    if len(choices) != plan.n or any(c.get("finish_reason") is None for c in choices):
        out.outcome, out.detail = "malformed", f"{len(choices)} choices for n={plan.n}"
        return
    if plan.schema:
        for c in choices:
            text = c["message"]["content"] if "message" in c else c["text"]
            if c["finish_reason"] == "stop":
                try:
                    value = json.loads(text)
                except ValueError:
                    out.outcome, out.detail = "malformed", f"not JSON: {text[:100]!r}"
                    return
                if not isinstance(value, dict) or set(value) != {"name", "age"}:
                    out.outcome, out.detail = "malformed", f"not the schema: {text[:100]!r}"
                    return
    out.outcome = "finished"
