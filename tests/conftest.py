"""Shared fixtures: TinyGPT, the real SmolLM2 model, and a real TinyGPT server per module.

What these are built from (servers, engine hooks, model files, oracles, real-model fetching) is in
tests/helpers/, which test modules import; no test module imports another.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from models import LoadedModel, load_model
from tests.helpers.real_models import SMOLLM2, require_model
from tests.helpers.servers import AbortRecorder, LiveServer, run_server


@pytest.fixture(scope="session")
def tiny_lm() -> LoadedModel:
    return load_model("tinygpt")


@pytest.fixture(scope="session")
def smollm2_file() -> Path:
    """SmolLM2-135M-Instruct's GGUF in the model cache, fetched if missing (see
    tests/helpers/real_models.py: fails in CI where it cannot be had)."""
    return require_model(SMOLLM2)


@pytest.fixture(scope="session")
def smollm2_lm(smollm2_file) -> LoadedModel:
    """The real chat model, loaded once per session."""
    return load_model(SMOLLM2)


@pytest.fixture(scope="session")
def smol_tokenizer(smollm2_file):
    """SmolLM2's tokenizer as `tools.synth_model` copies it into synthetic files."""
    from tools.synth_model import read_tokenizer

    return read_tokenizer(smollm2_file)


@pytest.fixture(scope="session")
def written_files_cache(tmp_path_factory) -> Path:
    """A model cache for the model files tests write, shared by the session. A GGUF's converted
    tokenizer is cached by the file's content (models/hf_tokenizer.py), and converting it costs a
    child process that imports transformers (~4 s): a file that several tests write with the same
    bytes (one architecture's checkpoint, loaded with and without the kernels) is converted once."""
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture
def model_cache(written_files_cache: Path, monkeypatch) -> Path:
    """CBSERVE_MODEL_DIR set to the session's cache for written files (never the user's)."""
    monkeypatch.setenv("CBSERVE_MODEL_DIR", str(written_files_cache))
    return written_files_cache


@pytest.fixture(scope="module")
def server(tiny_lm: LoadedModel) -> Iterator[LiveServer]:
    """A TinyGPT server with default settings, shared by a test module."""
    with run_server(tiny_lm) as live:
        yield live


@pytest.fixture
def abort_recorder(server: LiveServer) -> Iterator[AbortRecorder]:
    rec = AbortRecorder(server.engine)
    yield rec
    rec.remove()


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's TinyGPT engines: its ops are too small to gain from a
    second, and on a shared 2-core machine two spinning OpenMP threads make them 20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
