"""server.heap: freed heap memory goes back to the OS, once per idle spell of the engine."""

from __future__ import annotations

import sys

import pytest

from server.engine_client import heap
from server.engine_client.heap import IdleHeapTrimmer, release_free_heap

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or heap._TRIM is None, reason="glibc malloc_trim only"
)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_release_free_heap_returns_freed_pages():
    # 64 KiB blocks come from malloc's arenas (below its mmap threshold); the one kept last
    # pins the arena's top, so glibc does not shrink it by itself on free.
    blocks = [bytearray(64 * 1024) for _ in range(2000)]
    keep = blocks[-1]
    del blocks
    before = _rss_mib()
    assert release_free_heap()
    after = _rss_mib()
    assert before - after > 64, (before, after)
    assert len(keep) == 64 * 1024


def test_trims_once_per_idle_spell(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "release_free_heap", lambda: calls.append(1) or True)
    t = IdleHeapTrimmer()
    t.idle()  # first wait: what loading left
    t.idle()
    assert len(calls) == 1
    t.stepped()
    t.stepped()
    assert len(calls) == 1  # never while steps run
    t.idle()
    t.idle()
    assert len(calls) == 2 and t.trims == 2
