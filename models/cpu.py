"""What the host CPU can do natively, read once from /proc/cpuinfo (Linux x86; elsewhere empty),
and keeping its cores' OpenMP threads to one team.

Used to pick defaults (`--dtype auto`), to decide whether the compiled kernels can run, and to
choose a bfloat16 matmul that is exact where the CPU has no native bfloat16 arithmetic.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bfloat16 dot products in hardware, which oneDNN uses."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def in_passing_thread(fn: Callable[..., T], /, *args: object, **kwargs: object) -> T:
    """fn(*args, **kwargs) in a thread that ends when it returns (its result or exception passes
    through).

    Every thread that runs parallel torch ops gets its own OpenMP thread team, kept until the
    thread exits. A server that loads its model in the main thread and steps the engine in
    another has two teams: more OpenMP threads than cores, so libgomp stops spinning between
    parallel regions and every region pays a wake-up (measured on 2 cores: a batch-1 SmolLM2
    decode step 4.2 ms on the thread that loaded the model, 9.7 ms on a second thread). Loading
    in a passing thread leaves the engine's thread the only team.
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="passing") as pool:
        return pool.submit(fn, *args, **kwargs).result()
