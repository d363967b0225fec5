"""The async engine driver on its own (no HTTP): thread ownership, sleeping without work, group
submission, admission limits and aborts of requests the engine has not seen yet."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import pytest

from engine import QueueFullError, Request, RequestTooLongError, SamplingParams, make_engine
from server.engine_client.driver import AsyncEngineDriver


def req(rid: str, max_tokens: int = 4, prompt: list[int] | None = None) -> Request:
    return Request(
        prompt or [1, 2, 3], SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=rid
    )


@pytest.fixture
def engine(tiny_lm):
    return make_engine("continuous", tiny_lm.model, max_batch_size=4, kv_cache_memory_gib=0.02)


def count_calls(engine, name: str) -> list[int]:
    """Wrap engine.<name> so that calls[0] counts its calls."""
    calls = [0]
    method = getattr(engine, name)

    def counted(*args):
        calls[0] += 1
        return method(*args)

    setattr(engine, name, counted)
    return calls


async def run(driver: AsyncEngineDriver, requests: list[Request]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    async for out in await driver.submit(requests):
        tokens[out.request_id] += out.token_ids
    return tokens


async def test_the_engine_is_touched_by_one_thread_only_and_not_the_loops(engine):
    threads: dict[str, set[int]] = {"add": set(), "abort": set(), "step": set()}
    add, abort, step = engine.add_request, engine.abort, engine.step
    engine.add_request = lambda r: (threads["add"].add(threading.get_ident()), add(r))[1]
    engine.abort = lambda rid: (threads["abort"].add(threading.get_ident()), abort(rid))[1]
    engine.step = lambda: (threads["step"].add(threading.get_ident()), step())[1]
    driver = AsyncEngineDriver(engine, num_threads=1)
    await driver.start()
    try:
        for i in range(3):
            tokens = await run(driver, [req(f"r{i}"), req(f"s{i}")])
            assert [len(t) for t in tokens.values()] == [4, 4]
        stream = await driver.submit([req("cut", max_tokens=1000)])
        await stream.__anext__()
        driver.abort("cut")
        await run(driver, [req("after")])  # the abort was applied before this one's steps
    finally:
        await driver.stop()
    assert len(threads["add"] | threads["abort"] | threads["step"]) == 1
    assert threading.get_ident() not in threads["step"]


async def test_the_engine_keeps_stepping_while_the_loop_is_busy(engine):
    # The engine thread does not wait for the loop between steps: while the loop thread is
    # blocked (a slow route, say), steps go on and their outputs queue up for it.
    steps = count_calls(engine, "step")
    driver = AsyncEngineDriver(engine, num_threads=1)
    await driver.start()
    try:
        stream = await driver.submit([req("a", max_tokens=200)])
        await stream.__anext__()
        before = steps[0]
        time.sleep(0.5)  # blocks the event loop
        assert steps[0] - before >= 3
        tokens = 1 + sum([len(out.token_ids) async for out in stream])
        assert tokens == 200  # nothing was lost while the loop was away
    finally:
        await driver.stop()


async def test_idle_driver_sleeps_instead_of_polling(engine):
    calls = count_calls(engine, "has_work")
    driver = AsyncEngineDriver(engine, num_threads=1)
    await driver.start()
    try:
        await run(driver, [req("a")])
        await asyncio.sleep(0.1)  # let the engine thread reach its wait
        idle_calls = calls[0]
        await asyncio.sleep(0.3)  # a polling driver would check for work many times meanwhile
        assert calls[0] == idle_calls
        assert len((await run(driver, [req("b")]))["b"]) == 4  # and a submit wakes it
    finally:
        await driver.stop()


async def test_a_group_is_admitted_whole_or_not_at_all(engine):
    driver = AsyncEngineDriver(engine, num_threads=1)
    await driver.start()
    try:
        with pytest.raises(RequestTooLongError):
            await driver.submit([req("ok"), req("too-long", max_tokens=4000)])
        assert engine.requests == {}  # "ok" was undone
        assert driver.stats().num_running == 0
    finally:
        await driver.stop()


async def test_max_waiting_counts_only_requests_beyond_the_free_slots(engine):
    driver = AsyncEngineDriver(engine, num_threads=1, max_waiting=2)
    await driver.start()
    try:
        # Idle with 4 slots: six at once are all taken (4 start now, 2 wait).
        burst = [asyncio.ensure_future(run(driver, [req(f"r{i}", max_tokens=8)])) for i in range(6)]
        await asyncio.sleep(0)  # every submit has queued its request
        assert driver.stats().num_cannot_start == 2
        with pytest.raises(QueueFullError):  # the engine's own queue is at its limit
            await driver.submit([req("x")])
        assert all(len(next(iter(r.values()))) == 8 for r in await asyncio.gather(*burst))
        # A group larger than slots + limit, arriving at an empty queue, is still taken.
        assert len(await run(driver, [req(f"g{i}") for i in range(7)])) == 7
    finally:
        await driver.stop()


async def test_abort_right_after_submit_drops_the_request(engine):
    # Whether the engine thread took the group before the abort is a race; either way the
    # aborted request yields nothing and leaves nothing behind, and its sibling runs.
    driver = AsyncEngineDriver(engine, num_threads=1)
    await driver.start()
    try:
        for i in range(5):
            submit = asyncio.ensure_future(driver.submit([req(f"gone{i}"), req(f"kept{i}")]))
            await asyncio.sleep(0)  # submit has queued the group
            driver.abort(f"gone{i}")
            tokens = {}
            async for out in await submit:
                tokens.setdefault(out.request_id, []).extend(out.token_ids)
            assert list(tokens) == [f"kept{i}"] and len(tokens[f"kept{i}"]) == 4
        await run(driver, [req("flush")])  # a later window has applied every abort
        assert engine.requests == {}
    finally:
        await driver.stop()


async def test_stop_ends_open_streams(engine):
    from engine import EngineDeadError

    driver = AsyncEngineDriver(engine, num_threads=1)
    await driver.start()
    stream = await driver.submit([req("long", max_tokens=1000)])
    await stream.__anext__()
    await driver.stop()
    with pytest.raises(EngineDeadError):
        async for _ in stream:
            pass
    assert engine.requests == {}


async def test_the_gil_switch_interval_is_short_while_the_driver_runs_and_restored_after(engine):
    # The event loop and the step thread share the GIL: a short interval bounds how long the
    # loop waits for it while a step runs Python (server.driver's docstring).
    original = sys.getswitchinterval()
    sys.setswitchinterval(0.004)
    try:
        driver = AsyncEngineDriver(engine, num_threads=1, gil_switch_interval=0.0005)
        await driver.start()
        try:
            assert sys.getswitchinterval() == pytest.approx(0.0005)
        finally:
            await driver.stop()
        assert sys.getswitchinterval() == pytest.approx(0.004)
    finally:
        sys.setswitchinterval(original)
