"""The async engine driver on its own (no HTTP): thread ownership, sleeping without work, group
submission, admission limits and aborts of requests the engine has not seen yet."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest

from engine import Request, RequestTooLongError, SamplingParams, make_engine
from server.driver import AsyncEngineDriver, QueueFullError


def req(rid: str, max_tokens: int = 4, prompt: list[int] | None = None) -> Request:
    return Request(
        prompt or [1, 2, 3], SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=rid
    )


@pytest.fixture
def engine(tiny_lm):
    return make_engine("continuous", tiny_lm.model, max_batch_size=4, kv_cache_memory_gib=0.02)


async def run(driver: AsyncEngineDriver, requests: list[Request]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    async for out in await driver.submit(requests):
        tokens[out.request_id] += out.token_ids
    return tokens


async def test_engine_is_mutated_on_the_loop_thread_and_stepped_on_one_worker(engine):
    threads: dict[str, set[int]] = {"add": set(), "step": set()}
    add, step = engine.add_request, engine.step
    engine.add_request = lambda r: (threads["add"].add(threading.get_ident()), add(r))[1]
    engine.step = lambda: (threads["step"].add(threading.get_ident()), step())[1]
    driver = AsyncEngineDriver(engine, num_threads=1)
    await driver.start()
    try:
        for i in range(3):
            tokens = await run(driver, [req(f"r{i}"), req(f"s{i}")])
            assert [len(t) for t in tokens.values()] == [4, 4]
    finally:
        await driver.stop()
    assert threads["add"] == {threading.get_ident()}  # the event loop's thread
    assert len(threads["step"]) == 1 and threading.get_ident() not in threads["step"]


async def test_idle_driver_sleeps_instead_of_polling(engine):
    calls = [0]
    has_work = engine.has_work
    engine.has_work = lambda: (calls.__setitem__(0, calls[0] + 1), has_work())[1]
    driver = AsyncEngineDriver(engine, num_threads=1)
    await driver.start()
    try:
        await run(driver, [req("a")])
        for _ in range(5):  # let the driver reach its wait
            await asyncio.sleep(0)
        idle_calls = calls[0]
        for _ in range(200):  # an idle loop would check for work on some of these turns
            await asyncio.sleep(0)
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


async def test_abort_before_the_engine_saw_the_request_drops_it(engine):
    added: list[str] = []
    add = engine.add_request
    engine.add_request = lambda r: (added.append(r.request_id), add(r))[1]
    driver = AsyncEngineDriver(engine, num_threads=1)
    await driver.start()
    try:
        submit = asyncio.ensure_future(driver.submit([req("gone"), req("kept")]))
        await asyncio.sleep(0)  # submit has queued the group; the driver has not run yet
        driver.abort("gone")
        tokens = {}
        async for out in await submit:
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        assert added == ["kept"]
        assert list(tokens) == ["kept"]
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
