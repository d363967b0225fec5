"""The path of a chat request with tools through server/: each module entered once.

A chat request is prepared in one pass (`server.openai.serving`): each helper module is called
once for its whole job (the tool plan, the grammars: the tools' schemas checked and the output's
grammar compiled, the prompt: bounded, rendered and encoded, the sampling parameters), and the
submission goes to the generation loop. This test records that path on a real server (SmolLM2,
loopback, the real engine) with a profiler on every thread, and fails when a module is entered
twice: a job split over two calls, or a callback into a module that was already left.

"Entered": a function of a server module starts (a new frame, not a resumed coroutine) called
from another server module. Its caller is the nearest server frame beneath it on its thread;
for a frame with none (a task the event loop starts, a thread pool's work item) it is the
module that handed the work off (`asyncio.ensure_future` / `create_task`, `Executor.submit`).
The path runs from the chat route's call into `OpenAIServing.chat` until the submission enters
`GenerationLoop.respond` (streaming then repeats the loop's per-output calls by design). Not
steps of the path: reading the request body's own models (`server.openai.protocol` and
`server.openai.body`: field accessors and validators) and dataclass-generated methods (no code
of their module runs).
"""

from __future__ import annotations

import asyncio
import concurrent.futures.thread as pool_thread
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import httpx
import pytest

from server.generation.loop import GenerationLoop
from server.openai.serving import OpenAIServing
from tests.helpers.servers import LiveServer, run_server

BODY_MODELS = ("server.openai.protocol", "server.openai.body")
START = OpenAIServing.chat.__code__
END = GenerationLoop.respond.__code__
SUBMIT = pool_thread.ThreadPoolExecutor.submit.__code__
WORK_ITEM = pool_thread._WorkItem.run.__code__
TASK_MAKERS = {
    asyncio.ensure_future.__code__: "coro_or_future",
    asyncio.create_task.__code__: "coro",
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def module_of(frame: FrameType | None) -> str | None:
    return frame.f_globals.get("__name__") if frame is not None else None


def server_caller(frame: FrameType | None) -> str | None:
    """The module of the nearest server frame at or beneath `frame`."""
    while frame is not None:
        name = module_of(frame) or ""
        if name.startswith("server."):
            return name
        frame = frame.f_back
    return None


class ModuleEntries:
    """A profiler (every thread) recording the module entries of one request's path."""

    def __init__(self) -> None:
        self.armed = False
        self.recording = False
        self.path: list[tuple[str, str, str]] = []  # (caller, module, function)
        self.outside: list[tuple[str, str]] = []  # entries with no server caller
        self._seen: set[int] = set()
        self._keep: list[Any] = []  # what the ids above name stays alive while recording
        self._handoffs: dict[int, str | None] = {}

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not self.armed:
            return
        code = frame.f_code
        if code is START and not self.recording:
            self.recording = True
        if not self.recording:
            return
        if code is SUBMIT:
            self._handoff(frame.f_locals.get("fn"), frame.f_back)
        elif code in TASK_MAKERS:
            self._handoff(frame.f_locals.get(TASK_MAKERS[code]), frame.f_back)
        module = module_of(frame) or ""
        if not module.startswith("server.") or id(frame) in self._seen:
            return  # not ours, or a resumed coroutine
        self._seen.add(id(frame))
        self._keep.append(frame)
        if module in BODY_MODELS or code.co_filename != frame.f_globals.get("__file__"):
            return
        caller = server_caller(frame.f_back)
        if caller is None:
            caller = self._handed_off_by(frame)
        if code is START:
            self.path.append(("server.http.app", module, code.co_name))
        elif caller is None:
            self.outside.append((module, code.co_name))
        elif caller != module:
            self.path.append((caller, module, code.co_name))
        if code is END:
            self.recording = False
            self.armed = False

    def _handoff(self, work: Any, beneath: FrameType | None) -> None:
        if work is not None:
            self._handoffs[id(work)] = server_caller(beneath)
            self._keep.append(work)

    def _handed_off_by(self, frame: FrameType) -> str | None:
        """The module that handed off the task or work item `frame` starts, if any."""
        f: FrameType | None = frame
        while f is not None:  # a thread pool's work item
            if f.f_code is WORK_ITEM:
                return self._handoffs.get(id(f.f_locals["self"].fn))
            f = f.f_back
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no event loop in this thread
            return None
        coro = task.get_coro() if task is not None else None
        if coro is not None and getattr(coro, "cr_frame", None) is frame:
            return self._handoffs.get(id(coro))
        return None


@pytest.fixture(scope="module")
def traced(smollm2_lm) -> Iterator[tuple[LiveServer, ModuleEntries]]:
    entries = ModuleEntries()
    threading.setprofile(entries)  # every thread the server starts from here on
    try:
        with run_server(smollm2_lm) as live:
            yield live, entries
    finally:
        threading.setprofile(None)
        sys.setprofile(None)


def chat(live: LiveServer, tool_choice: Any) -> str:
    body = {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER],
        "tool_choice": tool_choice,
        "stream": True,
        "max_tokens": 4,
    }
    with httpx.stream("POST", live.v1 + "/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        return r.read().decode()


@pytest.mark.parametrize(
    "tool_choice",
    ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["auto", "required", "named"],
)
def test_a_streamed_chat_request_with_tools_enters_each_server_module_once(traced, tool_choice):
    live, entries = traced
    chat(live, tool_choice)  # the check worker started, the tokenizer's trie built
    entries.path.clear()
    entries.armed = True
    assert chat(live, tool_choice).rstrip().endswith("data: [DONE]")
    assert not entries.armed, "the request never reached the generation loop"
    path = entries.path
    print("\n".join(f"{caller} -> {module}.{fn}" for caller, module, fn in path))
    modules = [module for _, module, _ in path]
    again = sorted({m for m in modules if modules.count(m) > 1})
    assert not again, f"entered more than once: {again}\n{path}"
    # The steps that were split before: one entry each, from the surface.
    callers = {module: caller for caller, module, _ in path}
    for step in (
        "server.tooling.plan",
        "server.grammars.compiler",
        "server.openai.prompt_tokens",
        "server.openai.sampling_params",
        "server.generation.loop",
    ):
        assert callers.get(step) == "server.openai.serving", (step, path)
    assert callers["server.tooling.chat_template"] == "server.openai.prompt_tokens"
    assert modules[0] == "server.openai.serving" and modules[-1] == "server.generation.loop"
