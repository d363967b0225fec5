"""The in-process tools run end to end on TinyGPT (tools.replay has its own tests)."""

from __future__ import annotations

import pytest
import torch

from tools import bench_engine, demo


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
