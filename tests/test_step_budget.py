"""The adaptive step budget: learns the time per token and keeps decoding steps near the target."""

from __future__ import annotations

from engine.step_budget import StepBudget


def _simulate(sb: StepBudget, per_token: float, overhead: float, decoding: int, steps: int) -> int:
    """Feed the budget steps whose time follows a linear cost model; return the last budget."""
    budget = sb.max_tokens
    for _ in range(steps):
        budget = sb.budget(decoding)
        prefill = max(0, budget - decoding)
        seconds = overhead + per_token * (prefill + decoding * sb.decode_weight)
        sb.observe(decoding, prefill, seconds)
    return budget


def test_no_decodes_means_the_full_budget():
    sb = StepBudget(target_s=0.1, max_tokens=512)
    assert sb.budget(0) == 512
    sb.observe(0, 512, 1.0)
    assert sb.budget(0) == 512


def test_decoding_steps_converge_to_the_target_time():
    sb = StepBudget(target_s=0.12, max_tokens=512)
    sb.observe(1, 0, 0.008)  # a lone decode step: the fixed cost
    budget = _simulate(sb, per_token=0.002, overhead=0.008, decoding=20, steps=30)
    step = 0.008 + 0.002 * (budget - 20 + 20 * sb.decode_weight)
    assert abs(step - 0.12) < 0.01, (budget, step)


def test_prefill_never_starves_even_when_decodes_alone_exceed_the_target():
    sb = StepBudget(target_s=0.05, max_tokens=512, min_chunk=16)
    budget = _simulate(sb, per_token=0.003, overhead=0.0, decoding=32, steps=10)
    assert budget == 32 + 16


def test_budget_never_exceeds_the_configured_maximum():
    sb = StepBudget(target_s=10.0, max_tokens=96)
    assert _simulate(sb, per_token=0.001, overhead=0.0, decoding=4, steps=5) == 96


def test_a_slow_cold_small_step_does_not_zero_the_per_token_cost():
    """A fresh server's first step (small, cold, slow) set the overhead above what the next,
    larger step took: the learned per-token cost was 0 and `budget` divided by it, killing the
    engine at its first requests (found by a Docker run)."""
    sb = StepBudget(0.12, 512)
    sb.observe(0, 2, 0.5)  # cold: taken as overhead
    sb.observe(0, 35, 0.3)  # faster than that "overhead"
    assert sb.per_token_s is not None and sb.per_token_s > 0
    assert 1 <= sb.budget(1) <= 512
    assert sb.overhead_s <= 0.3


def test_a_starving_queue_gets_a_share_of_the_step_by_head_count():
    """A burst: 8 requests decode while 40 wait for their first token. The target alone leaves
    prefill the 16-token minimum. Once the oldest has waited `patience` targets, sharing the step
    by head count gives the 40 five times the decoders' time. Before that, or with a short queue
    whose share is less than the target leaves, nothing changes; the ceiling still holds."""
    sb = StepBudget(target_s=0.12, max_tokens=512)
    sb.observe(1, 0, 0.025)  # a lone decode step: the fixed cost
    sb.observe(8, 64, 0.025 + 0.004 * (64 + 8 * sb.decode_weight))
    decode_s = sb.overhead_s + sb.per_token_s * 8 * sb.decode_weight
    alone = sb.budget(8)
    assert alone == 8 + max(16, int((0.12 - decode_s) / sb.per_token_s))
    starving = sb.patience * 0.12 + 0.01
    assert sb.budget(8, 40, waited_s=starving - 0.02) == alone
    prefill = sb.budget(8, 40, waited_s=starving) - 8
    assert abs(prefill * sb.per_token_s - 5 * decode_s) <= sb.per_token_s, (prefill, decode_s)
    assert sb.budget(8, 1, waited_s=starving) == alone
    assert sb.budget(8, 400, waited_s=starving) == 512
