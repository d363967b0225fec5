"""The project's CPU kernels (models/csrc/*.cpp), built once into one library, loaded as torch ops.

Owns compiling the C++ sources into a shared library, caching it, and loading it so its ops appear
under `torch.ops.cbserve` (called only through `models.ops`, which wraps every one). The sources
use AVX2, FMA and F16C and are compiled for `x86-64-v3`, so one build runs on every x86 CPU that
has those (Intel since 2013, AMD since 2015) and can be baked into a Docker image built
elsewhere. Where it cannot run (another architecture, no C++ compiler, `CBSERVE_KERNELS=0`)
`available()` is False and the models use their pure-torch path, which computes the same thing,
slower.

The library is cached in `$CBSERVE_KERNEL_DIR` (default `~/.cache/cbserve/kernels`), keyed by the
sources and headers, the compiler flags and torch's version: an upgrade rebuilds, nothing else does.

    python -m models.kernels        # build now (the install script does), print where it is
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from models.cpu import cpu_flags

log = logging.getLogger("models.kernels")

CSRC = Path(__file__).with_name("csrc")
# -fopenmp: at::parallel_for is inline code that parallelises through OpenMP pragmas (serial
# without the flag); libgomp then resolves to torch's own copy through the rpath.
FLAGS = ("-O3", "-march=x86-64-v3", "-mtune=generic", "-fopenmp", "-std=c++20", "-shared", "-fPIC")
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")

_lock = threading.Lock()
_state: dict[str, object] = {}


class KernelBuildError(RuntimeError):
    """The kernels could not be built here; the message says why."""


def cache_dir() -> Path:
    root = os.environ.get("CBSERVE_KERNEL_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "cbserve" / "kernels"


def _cpu_supported() -> str | None:
    """None if this CPU can run the kernels, else the reason it cannot."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernels are x86-64 only (this is {platform.machine()})"
    flags = cpu_flags()
    if not flags:
        return None  # not Linux: let the compiler and the loader decide
    missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in flags]
    return f"this CPU lacks {', '.join(missing)}" if missing else None


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def sources() -> list[Path]:
    """Every translation unit: each .cpp in csrc/ (a new kernel file is built by being there)."""
    return sorted(CSRC.glob("*.cpp"))


def _key() -> str:
    h = hashlib.sha256()
    for path in sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")]):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(" ".join(FLAGS).encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:16]


def build(force: bool = False) -> Path:
    """Compile the kernels unless a build for this source, flags and torch is cached (a cached
    build needs no compiler: a Docker image carries one built in its build stage)."""
    reason = _cpu_supported()
    if reason:
        raise KernelBuildError(reason)
    out_dir = cache_dir()
    target = out_dir / f"cbserve_kernels-{_key()}.so"
    if target.is_file() and not force:
        return target
    compiler = _compiler()
    if compiler is None:
        raise KernelBuildError("no C++ compiler found (set CXX, or install g++)")
    out_dir.mkdir(parents=True, exist_ok=True)
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libdir = cpp_extension.library_paths()[0]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    # One build at a time per cache (several servers may start together); the loser of the race
    # finds the library already built.
    with open(out_dir / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file() and not force:
            return target
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out_dir)
        os.close(fd)
        log.info("building the CPU kernels (once per machine, ~1 min): %s", target.name)
        with tempfile.TemporaryDirectory(prefix=".build-", dir=out_dir) as objs:
            # One compiler process per source, as many at once as there are CPUs, then one link.
            compile_flags = [f for f in FLAGS if f != "-shared"]

            def compile_one(src: Path) -> tuple[Path, subprocess.CompletedProcess]:
                obj = Path(objs) / f"{src.stem}.o"
                cmd = [compiler, *compile_flags, abi, *includes, "-c", str(src), "-o", str(obj)]
                return obj, subprocess.run(cmd, capture_output=True, text=True)

            with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
                done = list(pool.map(compile_one, sources()))
            failed = [(o, r) for o, r in done if r.returncode != 0]
            if not failed:
                link = [
                    compiler, *FLAGS, *(str(o) for o, _ in done), "-o", tmp,
                    f"-L{libdir}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{libdir}",
                ]  # fmt: skip
                linked = subprocess.run(link, capture_output=True, text=True)
                if linked.returncode != 0:
                    failed = [(Path(tmp), linked)]
        if failed:
            Path(tmp).unlink(missing_ok=True)  # (a failed link may have removed it)
            obj, result = failed[0]
            raise KernelBuildError(f"building {obj.stem} failed:\n{result.stderr[-3000:]}")
        # Readable by all (mkstemp's file was not), so an image's non-root user can load it.
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    return target


def available() -> bool:
    """True once the kernels are loaded (building them on first use); False where they cannot
    run. The outcome is decided once per process."""
    with _lock:
        if "ok" not in _state:
            _state["ok"], _state["why"] = _load()
        return bool(_state["ok"])


def unavailable_reason() -> str | None:
    available()
    return _state.get("why")  # type: ignore[return-value]


def _load() -> tuple[bool, str | None]:
    if os.environ.get("CBSERVE_KERNELS", "1") == "0":
        return False, "disabled by CBSERVE_KERNELS=0"
    try:
        path = build()
        torch.ops.load_library(str(path))
    except (KernelBuildError, OSError, RuntimeError) as e:
        log.warning("CPU kernels unavailable, using the pure-torch path: %s", e)
        return False, str(e)
    return True, None


def has_int8_dot() -> bool:
    """True where the kernels run and the CPU multiplies int8 with AVX512-VNNI (the
    int8-activation layouts of `models.quant.pack`)."""
    # The op itself, not models.ops' wrapper: ops loads the library through this module.
    return available() and bool(torch.ops.cbserve.has_int8_dot())


def has_amx_tiles() -> bool:
    """True where the kernels run on AMX-INT8 tiles (`models.ops.has_amx_tiles`)."""
    return available() and bool(torch.ops.cbserve.has_amx_tiles())


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = build(force="--force" in sys.argv)
    except KernelBuildError as e:
        print(f"models.kernels: {e}", file=sys.stderr)
        return 1
    torch.ops.load_library(str(path))
    print(
        f"cbserve kernels: {path} (int8 dot products: {has_int8_dot()}, AMX tiles: {has_amx_tiles()})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
