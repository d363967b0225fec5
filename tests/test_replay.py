"""The in-process replay: seeded traces, and a real-time run that serves every request in full."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from engine import ContinuousBatchEngine
from engine.disaggregated import DisaggregatedEngine
from loadtest.trace import TraceSpec, build_trace
from tools.replay import main, replay

pytestmark = pytest.mark.usefixtures("one_thread")

SHORT = TraceSpec(num_requests=8, rate=math.inf, prompt_len=(4, 12), output_len=(3, 6), seed=3)


@pytest.fixture(scope="module")
def model(tiny_lm):
    return tiny_lm.model


def test_trace_is_deterministic_for_a_seed():
    spec = TraceSpec(num_requests=30, rate=8.0, prompt_len=(64, 256), output_len=(16, 48), seed=7)
    assert build_trace(spec) == build_trace(spec)
    other = build_trace(TraceSpec(num_requests=30, rate=8.0, prompt_len=(64, 256), seed=8))
    assert [r.prompt for r in other] != [r.prompt for r in build_trace(spec)]
    arrivals = [r.arrival for r in build_trace(spec)]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0 and arrivals[-1] > 0


def test_chat_like_trace_shares_exactly_its_system_prompt():
    trace = build_trace(TraceSpec(num_requests=6, shared_prefix=40, prompt_len=(16, 64), seed=1))
    system = trace[0].prompt[:40]
    assert all(r.prompt[:40] == system and len(r.prompt) == r.prompt_len for r in trace)
    assert len({r.prompt[40:] for r in trace}) == 6  # distinct questions
    assert all(56 <= r.prompt_len <= 104 for r in trace)


@pytest.mark.parametrize("engine_cls", [ContinuousBatchEngine, DisaggregatedEngine])
def test_short_replay_completes_every_request_with_its_exact_length(model, engine_cls):
    trace = build_trace(SHORT)
    result = replay(engine_cls(model, max_batch_size=4), trace)
    s = result.summary
    assert (s.completed, s.failed, s.length_mismatches) == (8, 0, 0)
    assert [r.completion_tokens for r in result.records] == [r.output_len for r in trace]
    assert s.output_tokens == sum(r.output_len for r in trace) and s.ttft is not None
    if engine_cls is DisaggregatedEngine:
        assert result.transfers == 8 and result.bytes_per_transfer == 49_152  # one block each
    else:
        assert result.transfers is None and result.bytes_per_transfer is None


def test_no_request_is_served_before_it_arrives(model):
    trace = build_trace(TraceSpec(num_requests=5, rate=40.0, prompt_len=(8, 8), output_len=(2, 2)))
    result = replay(ContinuousBatchEngine(model), trace)
    assert all(r.chunk_times[0] >= r.arrival for r in result.records)
    assert result.summary.duration >= trace[-1].arrival


def test_replay_reports_the_prefix_cache_hit_rate(model):
    trace = build_trace(replace(SHORT, shared_prefix=64))
    # One slot: the first request computes the system prompt before the others look it up
    # (requests admitted in one step all miss, none has cached it yet).
    engine = ContinuousBatchEngine(model, max_batch_size=1)
    assert replay(engine, trace).prefix_cache_hit_rate > 0.5
    no_cache = ContinuousBatchEngine(model, max_batch_size=1, enable_prefix_caching=False)
    assert replay(no_cache, trace).prefix_cache_hit_rate == 0.0


def test_command_line_prints_a_row_and_the_conditions(capsys):
    main(
        ["--engine", "disaggregated", "--num-requests", "3", "--rate", "inf,50"]
        + ["--prompt-len", "8:16", "--output-len", "2:3", "--system-prompt-len", "20"]
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["engine", "rate", "done"]
    assert [line.split()[:3] for line in lines[1:3]] == [
        ["disaggregated", "inf", "3"],
        ["disaggregated", "50", "3"],
    ]
    assert lines[3].startswith("Conditions: tinygpt (5,838,080 params)")
    assert "shared prefix 20" in lines[3]
