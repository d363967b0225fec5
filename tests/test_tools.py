"""The in-process tools run end to end on TinyGPT (tools.replay has its own tests)."""

from __future__ import annotations

import pytest
import torch

from models import kernels
from tools import bench_attention, bench_engine, demo


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_demo_shows_both_engines_giving_identical_tokens(capsys):
    demo.main()
    out = capsys.readouterr().out
    assert "static-batch:" in out and "continuous-batch:" in out
    assert "identical tokens from both engines: True" in out


def test_engine_bench_prints_the_conditions_and_a_row_per_batch_size(capsys):
    bench_engine.main(["--batch-sizes", "1,2", "--steps", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Conditions: model tinygpt (5,838,080 params")
    assert [line.split()[0] for line in lines[2:]] == ["1", "2"]


@pytest.mark.skipif(not kernels.available(), reason="the cbserve kernels are not available here")
def test_attention_bench_prints_a_row_per_dtype_and_layout(capsys):
    args = "--batch 2 --context 40 --layers 2 --rounds 1 --threads 1 --stream-mib 8"
    assert bench_attention.main([*args.split(), "--kv-dtypes", "float16,int8"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[3:]]
    assert [r[:2] for r in rows] == [
        [dt, lay] for dt in ("float16", "int8") for lay in ("contiguous", "runs", "scattered")
    ]
    assert all(float(r[2]) > 0 for r in rows)
    # the bytes read a layer: 2 (K, V) x 2 sequences x 40 tokens x 3 kv heads x a row
    assert [r[4] for r in rows] == ["0.1"] * 3 + ["0.0"] * 3  # 61,440 and 34,560 bytes


def test_attention_bench_tables_cover_every_block_once():
    gen = torch.Generator().manual_seed(0)
    for layout in ("contiguous", "runs", "scattered"):
        t = bench_attention.block_tables(layout, 4, 5, 3, gen)
        assert t.shape == (4, 5) and sorted(t.flatten().tolist()) == list(range(1, 21))
