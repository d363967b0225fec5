"""Workload traces: seeded open-loop arrival times and prompts of exact token length.

Owns what is sent and when, never how: a `Trace` is a tuple of frozen `TraceRequest`s built from a
`TraceSpec`. Arrivals are a Poisson process by default, or a Gamma process with a burstiness factor
as vLLM's benchmark_serving draws it (inter-arrival ~ Gamma(shape=b, scale=1/(rate*b)); b=1 is
Poisson, b<1 burstier, b>1 smoother); rate=inf sends everything at t=0. Prompt and output lengths
are uniform over inclusive ranges.

Prompts are random token ids by default (sent as `"prompt": [ids]`, so their length is exact
without asking anyone), or text whose length is counted by the server's `/tokenize` (a
`count_tokens` callable), so it is exact as that server counts it, BOS included.

Arrivals, lengths and prompt contents come from three independent random streams of the one seed,
so a sweep over rates sends the same requests at every rate; only their timing changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

PromptKind = Literal["tokens", "text"]
CountTokens = Callable[[str], int]

# Words for text prompts: common, short and plain ASCII, so every tokenizer handles them well.
# fmt: off
WORDS = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at",
    "from", "his", "her", "they", "this", "which", "be", "or", "an", "had", "not", "are", "but",
    "have", "one", "were", "their", "all", "there", "been", "has", "when", "who", "more", "would",
    "can", "she", "time", "will", "about", "some", "other", "into", "only", "new", "then",
    "could", "people", "than", "first", "over", "after", "also", "two", "most", "made", "river",
    "stone", "light", "house", "garden", "winter", "morning", "music", "letter", "market",
    "window", "forest", "engine", "bridge", "paper", "story", "summer", "island", "doctor",
    "village", "mountain", "teacher", "ocean", "silver", "history",
)
# fmt: on


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. `arrival` is seconds after the run starts.

    `prompt` is a tuple of token ids (immutable, sent as a JSON list) or text; `prompt_len` is its
    length in tokens, shared prefix included.
    """

    index: int
    arrival: float
    prompt: tuple[int, ...] | str
    prompt_len: int
    output_len: int


Trace = tuple[TraceRequest, ...]


@dataclass(frozen=True, slots=True)
class TraceSpec:
    """Everything that determines a trace. The defaults are the book chapter's workload
    (Poisson arrivals at 4/s, prompts of 32-96 tokens, outputs of 16-48, seed 7)."""

    num_requests: int = 100
    rate: float = 4.0
    burstiness: float = 1.0
    prompt_len: tuple[int, int] = (32, 96)
    output_len: tuple[int, int] = (16, 48)
    seed: int = 7
    prompt_kind: PromptKind = "tokens"
    # Prepended to every prompt, on top of the drawn length (as vLLM's random-prefix-len does).
    shared_prefix: int = 0
    # Inclusive; the default avoids the special ids of common vocabularies (TinyGPT's 256-259,
    # SmolLM's 0-16) while being ordinary tokens everywhere.
    token_ids: tuple[int, int] = (32, 126)

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError("num_requests must be at least 1")
        if not self.rate > 0:
            raise ValueError("rate must be positive (use inf to send all at once)")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError("burstiness must be a positive number")
        for name in ("prompt_len", "output_len", "token_ids"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"{name} must be a range lo:hi with 0 <= lo <= hi")
        if self.prompt_len[1] + self.shared_prefix < 1:
            raise ValueError("prompts must have at least one token")
        if self.output_len[0] < 1:
            raise ValueError("output lengths must be at least 1")
        if self.shared_prefix < 0:
            raise ValueError("shared_prefix must be >= 0")
        if self.prompt_kind not in ("tokens", "text"):
            raise ValueError("prompt_kind must be 'tokens' or 'text'")

    def describe(self) -> str:
        """The trace part of a conditions line, e.g. 'poisson, prompt 32-96, output 16-48, seed 7'."""
        arrivals = (
            "poisson" if self.burstiness == 1.0 else f"gamma (burstiness {self.burstiness:g})"
        )
        parts = [
            arrivals,
            f"prompt {self.prompt_len[0]}-{self.prompt_len[1]}",
            f"output {self.output_len[0]}-{self.output_len[1]}",
        ]
        if self.shared_prefix:
            parts.append(f"shared prefix {self.shared_prefix}")
        if self.prompt_kind == "text":
            parts.append("text prompts")
        parts.append(f"seed {self.seed}")
        return ", ".join(parts)


def arrival_times(
    num: int, rate: float, burstiness: float, rng: np.random.Generator
) -> list[float]:
    """Open-loop arrival offsets in seconds; the first request arrives at 0."""
    if math.isinf(rate):
        return [0.0] * num
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def build_trace(spec: TraceSpec, count_tokens: CountTokens | None = None) -> Trace:
    """Build the trace `spec` describes; text prompts need `count_tokens` (the server's tokenizer)."""
    arrivals_rng, lengths_rng, content_rng = (
        np.random.default_rng([spec.seed, i]) for i in range(3)
    )
    arrivals = arrival_times(spec.num_requests, spec.rate, spec.burstiness, arrivals_rng)
    prompt_lens = lengths_rng.integers(
        spec.prompt_len[0], spec.prompt_len[1], endpoint=True, size=spec.num_requests
    )
    output_lens = lengths_rng.integers(
        spec.output_len[0], spec.output_len[1], endpoint=True, size=spec.num_requests
    )

    prompts: list[tuple[int, ...] | str]
    if spec.prompt_kind == "tokens":
        lo, hi = spec.token_ids
        prefix = content_rng.integers(lo, hi, endpoint=True, size=spec.shared_prefix).tolist()
        prompts = [
            tuple(prefix + content_rng.integers(lo, hi, endpoint=True, size=int(n)).tolist())
            for n in prompt_lens
        ]
    else:
        if count_tokens is None:
            raise ValueError("text prompts need count_tokens (the server's /tokenize)")
        prefix_text = ""
        if spec.shared_prefix:
            prefix_text = fit_text(
                count_tokens, spec.shared_prefix, _words(content_rng, spec.shared_prefix)
            )
        prompts = [
            fit_text(
                count_tokens, spec.shared_prefix + int(n), _words(content_rng, int(n)), prefix_text
            )
            for n in prompt_lens
        ]

    return tuple(
        TraceRequest(
            index=i,
            arrival=arrivals[i],
            prompt=prompts[i],
            prompt_len=spec.shared_prefix + int(prompt_lens[i]),
            output_len=int(output_lens[i]),
        )
        for i in range(spec.num_requests)
    )


def _words(rng: np.random.Generator, num_tokens: int) -> list[str]:
    # Every word is at least one token, so this many words always overshoot the target.
    return [WORDS[i] for i in rng.integers(0, len(WORDS), size=num_tokens + 16)]


# Appended one at a time to close the last gap of a few tokens after whole words: " a" is one
# token for BPE vocabularies, "a" and "." one token for byte-level ones.
_PADDING = (" a", "a", ".")


def fit_text(count_tokens: CountTokens, target: int, words: list[str], base: str = "") -> str:
    """Text that starts with `base` and counts exactly `target` tokens.

    Whole words are added by binary search (token counts grow with words, though not additively:
    BPE merges across boundaries), then single-token padding closes the gap. Raises ValueError
    when the tokenizer cannot hit the target exactly.
    """

    def compose(k: int) -> str:
        return " ".join(([base] if base else []) + words[:k])

    if count_tokens(compose(0)) > target:
        raise ValueError(f"cannot fit {base!r} into {target} tokens")
    lo, hi = 0, len(words)  # count(compose(lo)) <= target; find the largest such lo
    if count_tokens(compose(hi)) <= target:
        raise ValueError(f"{len(words)} words count no more than {target} tokens")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count_tokens(compose(mid)) <= target:
            lo = mid
        else:
            hi = mid
    text = compose(lo)
    count = count_tokens(text)
    while count < target:
        for pad in _PADDING:
            padded_count = count_tokens(text + pad)
            if count < padded_count <= target:
                text, count = text + pad, padded_count
                break
        else:
            raise ValueError(f"cannot pad text to exactly {target} tokens (stuck at {count})")
    return text
