"""The grammar check worker: a process of its own that compiles untrusted grammars where a crash
costs nothing (`python -m server.grammars.check_worker`, started by `server.grammars.checker`).

A JSON schema, regex, choice list or Lark/GBNF grammar comes from a client, and llguidance (native
code) compiles it: a `$ref` chain through thousands of definitions overflows its stack (the
process dies of SIGSEGV), and some regex intersections grow without bound in memory and time
before any of llguidance's own limits is consulted. So every spec the server has not seen is
first compiled, and its first masks computed, here. The worker builds the token trie once and
forks a child per check (a zygote): the child sets an address-space limit (`RLIMIT_AS`) and a
lower CPU priority (nice 10), runs the check in a thread whose stack is half what the server's
threads get (so what passes here has room to spare in the server), and writes its verdict to a
pipe. A child that dies (stack overflow, out of memory) or runs past its time is that spec's
400; the worker and the server go on, and there is nothing to rebuild.

Owns the worker's loop (`serve`), one check (`check_spec`), what a check may take
(`CheckBudget`) and the pipe's framing (`frame` / `frames`: a 4-byte length, then a pickle).
It imports nothing of the server, torch or a tokenizer library at the top, so the worker starts
in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import selectors
import signal
import struct
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequestError
from engine.grammar import (
    StructuredSpec,
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


# -- framing: a 4-byte length, then a pickle --------------------------------------------------------


def frame(obj: Any) -> bytes:
    """One message as the pipe carries it."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return struct.pack("<I", len(data)) + data


def frames(buf: bytearray) -> list[Any]:
    """Complete frames at the head of `buf` (consumed)."""
    out = []
    while len(buf) >= 4:
        (n,) = struct.unpack_from("<I", buf)
        if len(buf) < 4 + n:
            break
        out.append(pickle.loads(bytes(buf[4 : 4 + n])))
        del buf[: 4 + n]
    return out


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
            data = frame(result[0])
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
        got = frames(buf)
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
        data = memoryview(frame((job_id, result)))
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
                for message in frames(buf):
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
            results = frames(r.buf)
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
