"""Untrusted grammars checked out of harm's way, before the server compiles them: the server's
side of the check worker (`server.grammars.check_worker`, which says why a process of its own).

Owns `GrammarWorker`: it runs one long-lived worker process, hands it the tokenizer's
`engine.grammar.Vocabulary` once, and asks it for a verdict per spec: the spec's llguidance
grammar text, or a client's 400 message. Verdicts are cached per spec (a digest of it);
identical checks in flight share one job; a check whose client goes away is cancelled (its job
killed). If the worker itself dies it is started again.

What passes is compiled again in the server (`engine.structured.GrammarCompiler`, within
`engine.grammar.PARSER_LIMITS`, which also bound each mask on the step thread). The Ray ingress
runs the same check, so replicas only compile specs that passed it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import queue
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future

from engine.errors import InvalidRequestError
from engine.grammar import StructuredSpec, Vocabulary
from server.grammars.check_worker import CheckBudget, frame, frames


class WorkerUnavailable(RuntimeError):
    """The check worker could not be started or died with checks in flight."""


class GrammarWorker:
    """Verdicts on specs from a worker process (see the module docstring). Thread-safe; `check`
    is awaited on an event loop."""

    def __init__(
        self,
        vocabulary: Callable[[], Vocabulary],
        budget: CheckBudget | None = None,
        cache_size: int = 4096,
    ) -> None:
        self._vocabulary = vocabulary
        self.budget = budget or CheckBudget()
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._jobs: dict[int, _Job] = {}  # in flight, by job id
        self._by_key: dict[bytes, _Job] = {}  # in flight, by spec digest
        self._verdicts: OrderedDict[bytes, str | None] = OrderedDict()  # None: passed
        self._next_id = 0
        self._closed = False
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # (worker, message) to write
        self._writer: threading.Thread | None = None
        self.checks = 0  # specs sent to the worker (cache misses)

    # -- public

    def start(self) -> None:
        """Start the worker now (server startup), so the first check does not wait for it."""
        with self._lock:
            self._ensure_started()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            proc, self._proc = self._proc, None
        self._outbox.put((None, None))
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    async def check(self, spec: StructuredSpec) -> str | None:
        """The spec's llguidance grammar text when it passes (None when it passed before: the
        caller converts it again), or `InvalidRequestError` naming the spec's field. Cancelling
        the await cancels the check unless another request waits for the same spec."""
        job = self._submit(spec)
        if isinstance(job, str | type(None)):
            return _verdict(spec, job)
        try:
            result = await asyncio.shield(asyncio.wrap_future(job.future))
        except asyncio.CancelledError:
            self._leave(job)
            raise
        return _result(spec, result)

    # -- internals

    def _submit(self, spec: StructuredSpec) -> _Job | str | None:
        """A cached verdict (str: refused, None: passed), or the job that will give it."""
        key = _digest(spec)
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
            job = self._by_key.get(key)
            if job is not None:
                job.waiters += 1
                return job
            self._ensure_started()
            self._next_id += 1
            job = _Job(self._next_id, key, self._proc)
            self._jobs[job.id] = job
            self._by_key[key] = job
            self.checks += 1
            self._outbox.put((self._proc, ("check", job.id, spec.kind, spec.value, spec.param)))
            return job

    def _leave(self, job: _Job) -> None:
        with self._lock:
            job.waiters -= 1
            if job.waiters > 0 or job.future.done():
                return
            self._jobs.pop(job.id, None)
            self._by_key.pop(job.key, None)
            job.future.cancel()
            self._outbox.put((job.proc, ("cancel", job.id)))

    def _ensure_started(self) -> None:
        """Under the lock: a live worker process."""
        if self._closed:
            raise WorkerUnavailable("the grammar check worker is stopped")
        if self._proc is not None and self._proc.poll() is None:
            return
        env = dict(os.environ)
        # The worker imports this package from wherever the server does.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(
            [sys.executable, "-m", "server.grammars.check_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        self._proc = proc
        self._outbox.put((proc, (self._vocabulary(), self.budget)))
        threading.Thread(
            target=self._read, args=(proc,), name="grammar-worker-reader", daemon=True
        ).start()
        if self._writer is None:
            self._writer = threading.Thread(
                target=self._write, name="grammar-worker-writer", daemon=True
            )
            self._writer.start()

    def _write(self) -> None:
        """The one writer to worker pipes, so no caller (the event loop) blocks on a pipe."""
        while True:
            proc, message = self._outbox.get()
            if proc is None:
                return
            try:
                proc.stdin.write(frame(message))
                proc.stdin.flush()
            except (OSError, ValueError):  # that worker is gone: its reader fails its jobs
                pass

    def _read(self, proc: subprocess.Popen) -> None:
        buf = bytearray()
        fd = proc.stdout.fileno()
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buf += chunk
            for job_id, result in frames(buf):
                self._resolve(job_id, result)
        proc.wait()
        with self._lock:  # the worker is gone: whatever it had is lost
            lost = [j for j in self._jobs.values() if j.proc is proc]
            if self._proc is proc:
                self._proc = None
            for job in lost:
                self._jobs.pop(job.id, None)
                self._by_key.pop(job.key, None)
        for job in lost:
            if not job.future.done():
                job.future.set_exception(WorkerUnavailable("the grammar check worker died"))

    def _resolve(self, job_id: int, result: tuple[str, str]) -> None:
        with self._lock:
            job = self._jobs.pop(job_id, None)
            if job is None:
                return  # cancelled
            self._by_key.pop(job.key, None)
            self._verdicts[job.key] = None if result[0] == "ok" else result[1]
            while len(self._verdicts) > self.cache_size:
                self._verdicts.popitem(last=False)
        if not job.future.done():
            job.future.set_result(result)


class _Job:
    __slots__ = ("id", "key", "proc", "future", "waiters")

    def __init__(self, job_id: int, key: bytes, proc: subprocess.Popen) -> None:
        self.id = job_id
        self.key = key
        self.proc = proc  # the worker it was sent to
        self.future: Future = Future()
        self.waiters = 1


def _digest(spec: StructuredSpec) -> bytes:
    # SHA-256, not hash(): one client must not be able to collide with another's spec.
    return hashlib.sha256(f"{spec.kind}\0{spec.value}".encode("utf-8", "surrogatepass")).digest()


def _verdict(spec: StructuredSpec, cached: str | None) -> None:
    if cached is not None:
        raise InvalidRequestError(cached, spec.param)
    return None


def _result(spec: StructuredSpec, result: tuple[str, str]) -> str:
    kind, text = result
    if kind != "ok":
        raise InvalidRequestError(text, spec.param)
    return text
