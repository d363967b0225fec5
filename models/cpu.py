"""What the host CPU can do natively, read once from /proc/cpuinfo (Linux x86; elsewhere empty).

Used to pick defaults (`--dtype auto`), to decide whether the compiled kernels can run, and to
choose a bfloat16 matmul that is exact where the CPU has no native bfloat16 arithmetic.
"""

from __future__ import annotations

import functools


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
