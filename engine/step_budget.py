"""The step's token budget, sized from measured step times so decoding requests keep their pace.

A fixed budget is wrong both ways on a CPU: every token a step computes costs about the same
(prefill and decode rows alike are matmul-bound), so a step that carries a 96-token prefill chunk
beside 32 decodes takes several times as long as one without it, and every running request's
inter-token gap stretches by that much; yet with nothing decoding, a small budget only delays the
first token of a long prompt. `StepBudget` learns the time per token from the steps the engine
runs and gives each step a budget that, while requests are decoding, keeps the step near
`target_s` (the rest of the budget goes to prefill chunks); with none decoding, the configured
maximum.

The target protects the decoding requests' pace, but the requests still waiting for their first
token pay for it: when a burst arrives, a 1B model's 120 ms steps admit a 64-token prompt every
few steps, the batch never fills and the queue drains at a fraction of what the cores can do. So
once a request has waited `patience` targets (~1 s) for its first token, the queue is starving
and a step also shares its time by head count: each request waiting for its first token gets as
much of it as each decoding one (prefill time / waiting = decode time / decoding), when that is
more than the target leaves. Below saturation nobody waits that long and the target alone decides
(a burst's decoders keep their gaps while its prompts wait less than a second).

Cost model: step seconds ~ overhead + per_token x (prefill tokens + decode rows x decode_weight),
learned as an exponential moving average over steps large enough to be dominated by their tokens.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepBudget:
    target_s: float  # aim for steps this long while requests are decoding
    max_tokens: int  # the configured ceiling (`max_num_batched_tokens`)
    min_chunk: int = 16  # prefill tokens a step always admits, so prompts never starve
    patience: float = 8.0  # targets a request may wait for its first token before it is starving
    decode_weight: float = 1.25  # a decode row also pays its head matmul and its attention
    smoothing: float = 0.2
    per_token_s: float | None = None  # learned; None until a step large enough was seen
    overhead_s: float = 0.0

    def budget(self, num_decoding: int, num_prefilling: int = 0, waited_s: float = 0.0) -> int:
        """Tokens (decode rows included) for the next step, given how many rows decode, how many
        requests wait for their first token (and could be given prefill this step) and how long
        the oldest of those has waited."""
        if num_decoding == 0 or not self.per_token_s:
            return self.max_tokens
        decode_s = self.overhead_s + self.per_token_s * num_decoding * self.decode_weight
        spare = self.target_s - decode_s
        if waited_s > self.patience * self.target_s:
            # Each request waiting for its first token gets as much of the step as each
            # decoding one: prefill time / waiting = decode time / decoding.
            spare = max(spare, decode_s * num_prefilling / num_decoding)
        prefill = max(self.min_chunk, int(spare / self.per_token_s))
        return max(1, min(self.max_tokens, num_decoding + prefill))

    def observe(self, num_decode_rows: int, num_prefill_tokens: int, seconds: float) -> None:
        """Record a step's size and duration."""
        work = num_prefill_tokens + num_decode_rows * self.decode_weight
        if work < 8:
            # Small steps are dominated by reading the weights and by Python: their time is
            # the overhead, not a per-token cost.
            a = self.smoothing
            self.overhead_s = (
                seconds if self.overhead_s == 0 else (1 - a) * self.overhead_s + a * seconds
            )
            return
        per_token = (seconds - self.overhead_s) / work
        if per_token <= 0:
            # Faster than the overhead estimate: that came from an outlier (a cold first step
            # is slow whatever its size), so this step's time is all the evidence there is.
            per_token = seconds / work
            self.overhead_s = min(self.overhead_s, seconds)
        if self.per_token_s is None:
            self.per_token_s = per_token
        else:
            a = self.smoothing
            self.per_token_s = (1 - a) * self.per_token_s + a * per_token
