"""`EngineReplica.check_health` (what Serve calls to decide a replica must be replaced) over a real
engine and driver, without a Ray cluster: it passes while steps run normally, raises once a step
has run past `step_timeout` (a stuck step), passes again when the step returns, and raises for
good once a step has failed."""

from __future__ import annotations

import asyncio

import pytest

from engine import Request, SamplingParams, make_engine
from server.engine_client.driver import AsyncEngineDriver
from server.ray.replica import EngineReplica
from tests.helpers.servers import StepGate


class _Replica(EngineReplica):
    def __del__(self) -> None:  # the replica's async __del__ stops a driver; the test does
        pass


def replica_over(driver: AsyncEngineDriver) -> EngineReplica:
    # Serve builds replicas through the async constructor (it loads a model and needs a replica
    # context); the health check only reads the driver, so build the object around one.
    replica = _Replica.__new__(_Replica)
    replica.replica = "test-replica"
    replica.driver = driver
    return replica


async def wait_for(event, timeout: float = 30) -> None:
    assert await asyncio.to_thread(event.wait, timeout)


async def test_check_health_raises_for_a_stuck_step_and_recovers(tiny_lm):
    now = [0.0]
    engine = make_engine("continuous", tiny_lm.model, max_batch_size=2)
    driver = AsyncEngineDriver(engine, step_timeout=5.0, clock=lambda: now[0])
    replica = replica_over(driver)
    gate = StepGate(engine)
    await driver.start()
    try:
        stream = await driver.submit([Request([1, 2, 3], SamplingParams(max_tokens=3))])
        await wait_for(gate.entered)
        await replica.check_health()  # a step is running, not yet for long
        now[0] += 6.0
        with pytest.raises(RuntimeError, match="over 5s"):
            await replica.check_health()
        gate.open()
        outputs = [out async for out in stream]
        assert outputs[-1].finished
        await replica.check_health()  # it came unstuck
    finally:
        gate.remove()
        await driver.stop(timeout=5)


async def test_check_health_raises_once_a_step_failed(tiny_lm):
    engine = make_engine("continuous", tiny_lm.model, max_batch_size=2)
    driver = AsyncEngineDriver(engine, step_timeout=5.0)
    replica = replica_over(driver)

    def broken_step():
        raise RuntimeError("simulated kernel failure")

    engine.step = broken_step
    await driver.start()
    try:
        stream = await driver.submit([Request([1, 2, 3], SamplingParams(max_tokens=3))])
        with pytest.raises(Exception, match="failed"):
            async for _ in stream:
                pass
        with pytest.raises(RuntimeError, match="unhealthy: engine step failed"):
            await replica.check_health()
    finally:
        await driver.stop(timeout=5)
