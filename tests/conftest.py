"""Shared fixtures: TinyGPT, the real SmolLM2 model, and a real TinyGPT server per module.

What these are built from (servers, engine hooks, model files, oracles, real-model fetching) is in
tests/helpers/, which test modules import; no test module imports another.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from models import LoadedModel, load_model
from tests.helpers.real_models import SMOLLM2, require_model
from tests.helpers.servers import AbortRecorder, LiveServer, run_server

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # Under pytest-xdist (`-n N`) the workers share the cores: each worker's torch gets its share
    # of intra-op threads, since OpenMP threads spinning past the cores' count slow every op.
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cpus or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


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


# The two tests that take minutes each (a venv installed by scripts/docker-install.sh, a Ray
# cluster in a network namespace) run first: under pytest-xdist (`make test` runs `-n logical
# --dist loadfile --no-loadscope-reorder`) each then starts on its own worker at once and
# overlaps the rest of the suite, instead of being handed out last and running alone.
FIRST = ("tests/test_server_docker.py", "tests/test_ray_serve.py")


def pytest_collection_modifyitems(config, items) -> None:
    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return FIRST.index(path) if path in FIRST else len(FIRST)

    items.sort(key=rank)  # stable: every other test keeps its place
