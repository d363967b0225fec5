"""Untrusted grammars checked out of harm's way, before the server compiles them.

A JSON schema, regex, choice list or Lark/GBNF grammar comes from a client, and llguidance (native
code) compiles it: a `$ref` chain through thousands of definitions overflows its stack (the
process dies of SIGSEGV), and some regex intersections grow without bound in memory and time
before any of llguidance's own limits is consulted. So every spec the server has not seen is
first compiled, and its first masks computed, in a process of its own that may die:

- `GrammarWorker` (the server side) runs one long-lived worker process (`python -m
  server.grammars.check_worker`), hands it the tokenizer's `engine.grammar.Vocabulary` once, and asks it
  for a verdict per spec: the spec's llguidance grammar text, or a client's 400 message. Verdicts
  are cached per spec (a digest of it); identical checks in flight share one job; a check whose
  client goes away is cancelled (its job killed). If the worker itself dies it is started again.
- The worker builds the token trie once and forks a child per check (a zygote): the child sets
  an address-space limit (`RLIMIT_AS`) and a lower CPU priority (nice 10), runs the check in a
  thread whose stack is half what the server's threads get (so what passes here has room to
  spare in the server), and writes its verdict to a pipe. A child that dies (stack overflow, out of memory) or runs past its time is
  that spec's 400; the worker and the server go on, and there is nothing to rebuild.

What passes is compiled again in the server (`engine.structured.GrammarCompiler`, within
`engine.grammar.PARSER_LIMITS`, which also bound each mask on the step thread). The Ray ingress
runs the same check, so replicas only compile specs that passed it.

This module is the worker's `__main__` too: it imports nothing of the server, torch or a
tokenizer library at the top, so the worker starts in a fraction of a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import pickle
import queue
import selectors
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from engine.grammar import (
    StructuredSpec,
    Vocabulary,
    client_message,
    constraint_error,
    grammar_text,
    parser_limits,
)

# Steps of a deterministic walk after the first mask: lexer states are built lazily, so a grammar
# whose cost explodes a few tokens in is caught here too, not on the engine's step thread.
WALK_STEPS = 16
# The server's threads' stack (Python's default for new threads: glibc takes RLIMIT_STACK, 8 MiB).
SERVER_THREAD_STACK = 8 * 2**20


@dataclass(frozen=True, slots=True)
class CheckBudget:
    """What checking one spec may take: wall time (first masks included) and memory above the
    worker's own."""

    seconds: float = 5.0
    memory_mib: int = 1024
    parallel: int = 2  # checks running at once (each a process); more wait their turn


class WorkerUnavailable(RuntimeError):
    """The check worker could not be started or died with checks in flight."""


# -- framing: a 4-byte length, then a pickle --------------------------------------------------------


def _frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return struct.pack("<I", len(data)) + data


def _frames(buf: bytearray) -> list[Any]:
    """Complete frames at the head of `buf` (consumed)."""
    out = []
    while len(buf) >= 4:
        (n,) = struct.unpack_from("<I", buf)
        if len(buf) < 4 + n:
            break
        out.append(pickle.loads(bytes(buf[4 : 4 + n])))
        del buf[: 4 + n]
    return out


# -- the server side ---------------------------------------------------------------------------------


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
        self.restarts = 0

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
        if self._proc is not None:
            self.restarts += 1
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
                proc.stdin.write(_frame(message))
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
            for job_id, result in _frames(buf):
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


# -- the worker process ------------------------------------------------------------------------------


def check_spec(tok: Any, spec: StructuredSpec) -> tuple[str, str]:
    """("ok", grammar text) or ("invalid", the client's message): the spec converted, compiled
    within the parser limits, its first mask computed and a short deterministic walk taken."""
    import llguidance

    try:
        grammar = grammar_text(spec)
    except InvalidRequestError as e:
        return "invalid", str(e)
    m = llguidance.LLMatcher(tok, grammar, log_level=0, limits=parser_limits())
    if m.is_error():
        return "invalid", f"invalid {spec.what}: {client_message(m.get_error())}"
    eos = set(tok.eos_tokens)
    for step in range(WALK_STEPS):
        mask = m.compute_bitmask()
        if m.is_error():  # from the mask itself
            if not _dead_end(m):  # a limit hit, or llguidance failing otherwise
                return "invalid", constraint_error(m, spec.what)
            if step == 0:
                return "invalid", f"invalid {spec.what}: no text can match it"
            break  # a dead end down this one path; the model may take others
        token = None if m.is_stopped() else _pick(mask, eos, step)
        if token is None:
            break  # complete: only the end may follow
        if not m.consume_token(token) and not _dead_end(m):
            return "invalid", constraint_error(m, spec.what)
    return "ok", grammar


def _dead_end(m: Any) -> bool:
    return m.stop_reason() in ("NoExtension", "NoExtensionBias") or "NoExtension" in m.get_error()


def _pick(mask: bytes, eos: set[int], step: int) -> int | None:
    """An allowed token other than end-of-sequence, the same one every time for a mask: the
    walk (and so the verdict) depends on the spec alone."""
    allowed = []
    for i, byte in enumerate(mask):
        if byte:
            allowed.extend(i * 8 + b for b in range(8) if byte >> b & 1 and i * 8 + b not in eos)
            if len(allowed) > 4096:
                break
    if not allowed:
        return None
    return allowed[(step * 7919) % len(allowed)]


def _child(tok: Any, spec: StructuredSpec, budget: CheckBudget, out_fd: int) -> None:
    """A forked child's whole life: limits, the check in a thread with half the server's stack,
    the verdict written to `out_fd`. Never returns."""
    import resource

    try:
        # A native abort's message ("memory allocation of N bytes failed") is no server log line.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        # Below the server in the CPU's favour: a check running its budget out must not take a
        # core from the engine's step (other streams' token gaps).
        os.nice(10)
        limit = _vm_size() + budget.memory_mib * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        cpu = int(budget.seconds) + 2  # a backstop to the parent's wall-clock kill
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        result: list[tuple[str, str]] = []

        def run() -> None:
            try:
                result.append(check_spec(tok, spec))
            except MemoryError:
                result.append(("invalid", _failure(spec, 0, False, budget)))
            except RecursionError:
                result.append(("invalid", _failure(spec, signal.SIGSEGV, False, budget)))

        threading.stack_size(SERVER_THREAD_STACK // 2)
        t = threading.Thread(target=run)
        t.start()
        t.join()
        if result:
            data = _frame(result[0])
            view = memoryview(data)
            while view:
                view = view[os.write(out_fd, view) :]
    finally:
        os._exit(0)


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass
class _Running:
    job_id: int
    pid: int
    fd: int
    spec: StructuredSpec
    deadline: float
    buf: bytearray
    timed_out: bool = False


def _failure(spec: StructuredSpec, status: int, timed_out: bool, budget: CheckBudget) -> str:
    """The client's message for a child that ended without a verdict."""
    what = spec.what
    if timed_out or (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXCPU):
        return (
            f"the {what} is too complex: compiling it took longer than the server's limit "
            f"of {budget.seconds:g} s"
        )
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGSEGV, signal.SIGBUS):
        return (
            f"the {what} could not be compiled: it nests or chains too deeply (for example "
            "$ref through thousands of definitions, or rules that each refer to the next)"
        )
    return (
        f"the {what} is too complex: compiling it needed more memory than the server's limit "
        f"of {budget.memory_mib} MiB"
    )


def serve(stdin_fd: int, stdout_fd: int) -> None:
    """The worker's loop: the vocabulary and budget first, then checks and cancels; a child per
    running check; verdicts back as (job id, result) frames. Ends when the server closes its
    end of the pipe."""
    buf = bytearray()
    while True:
        chunk = os.read(stdin_fd, 1 << 16)
        if not chunk:
            return
        buf += chunk
        got = _frames(buf)
        if got:
            vocab, budget = got[0]
            pending_frames = got[1:]
            break
    tok = vocab.ll_tokenizer()
    waiting: deque[tuple[int, StructuredSpec]] = deque()
    running: dict[int, _Running] = {}  # by fd
    sel = selectors.DefaultSelector()
    sel.register(stdin_fd, selectors.EVENT_READ)

    def reply(job_id: int, result: tuple[str, str]) -> None:
        data = memoryview(_frame((job_id, result)))
        while data:
            data = data[os.write(stdout_fd, data) :]

    def take(message: tuple) -> None:
        if message[0] == "check":
            _, job_id, kind, value, param = message
            waiting.append((job_id, StructuredSpec(kind, value, param)))
        elif message[0] == "cancel":
            job_id = message[1]
            for i, (jid, _) in enumerate(waiting):
                if jid == job_id:
                    del waiting[i]
                    break
            for r in running.values():
                if r.job_id == job_id:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(r.pid, signal.SIGKILL)
                    r.job_id = -1  # its verdict goes nowhere

    for message in pending_frames:
        take(message)
    open_stdin = True
    while open_stdin or running:
        while waiting and len(running) < max(1, budget.parallel):
            job_id, spec = waiting.popleft()
            r_fd, w_fd = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child
                os.close(r_fd)
                _child(tok, spec, budget, w_fd)
            os.close(w_fd)
            running[r_fd] = _Running(
                job_id, pid, r_fd, spec, time.monotonic() + budget.seconds, bytearray()
            )
            sel.register(r_fd, selectors.EVENT_READ)
        now = time.monotonic()
        timeout = min((r.deadline for r in running.values()), default=now + 60) - now
        for key, _ in sel.select(timeout=max(0.0, timeout)):
            fd = key.fd
            if fd == stdin_fd:
                chunk = os.read(stdin_fd, 1 << 16)
                if not chunk:  # the server is gone
                    open_stdin = False
                    sel.unregister(stdin_fd)
                    waiting.clear()
                    for r in running.values():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(r.pid, signal.SIGKILL)
                    continue
                buf += chunk
                for message in _frames(buf):
                    take(message)
                continue
            r = running[fd]
            chunk = os.read(fd, 1 << 16)
            if chunk:
                r.buf += chunk
                continue
            sel.unregister(fd)
            os.close(fd)
            del running[fd]
            _, status = os.waitpid(r.pid, 0)
            results = _frames(r.buf)
            if results and results[0][0] in ("ok", "invalid"):
                result = results[0]
            else:
                result = ("invalid", _failure(r.spec, status, r.timed_out, budget))
            if r.job_id >= 0:
                reply(r.job_id, result)
        now = time.monotonic()
        for r in running.values():
            if not r.timed_out and now >= r.deadline:
                r.timed_out = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(r.pid, signal.SIGKILL)


if __name__ == "__main__":
    # Ctrl-C in a terminal reaches the whole process group: the server decides when this ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(sys.stdin.fileno(), sys.stdout.fileno())
