"""The Docker image: built and run for real where a Docker daemon answers, and its recipe and the
install scripts it runs checked everywhere.

Where `docker version` reaches a daemon (the `DOCKER_HOST` it names, or the default socket), the
image is built from this tree and started; it must answer /health, list its model and complete a
prompt through the `openai` SDK, and exit 0 on `docker stop`. Where no daemon answers that test is
skipped with the reason (../shared/tools/verify-dockerfile.sh starts one on a machine without it).
Build arguments for that build (a torch index, a network mode) come from
`CBSERVE_DOCKER_BUILD_ARGS`, split as a shell would.

Without a daemon, what the image relies on is still checked: the Dockerfile for what
`docker run -p 8000:8000 IMAGE` and `docker build --build-arg ...` rely on; scripts/install.sh's
choice of torch with `--print-torch` against loopback indexes; the image's install script
(scripts/docker-install.sh) run for real into a temporary venv, whose pruned, installed server
then starts and answers; and the tokenizer cache key, which the baked image relies on, checked to
ignore mtimes.
"""

from __future__ import annotations

import http.server
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTALL = ROOT / "scripts" / "install.sh"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def dockerfile_lines() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    joined, current = [], ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        current += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            joined.append(current)
            current = ""
    return joined


def stages() -> list[list[str]]:
    out: list[list[str]] = []
    for line in dockerfile_lines():
        if line.startswith("FROM "):
            out.append([])
        out[-1].append(line)
    return out


def test_dockerfile_runs_the_install_script_as_a_non_root_server_on_port_8000():
    text = (ROOT / "Dockerfile").read_text()
    lines = dockerfile_lines()
    assert any(
        line.startswith("RUN ") and "scripts/docker-install.sh /opt/venv" in line for line in lines
    )
    assert "EXPOSE 8000" in lines
    assert any(line.startswith("HEALTHCHECK ") for line in lines)
    assert "/health" in text
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    entry = next(line for line in lines if line.startswith("ENTRYPOINT "))
    assert '"0.0.0.0"' in entry and '"8000"' in entry and '"server"' in entry
    assert "CBSERVE_MODEL_DIR=/opt/models" in text
    # Everything the image copies is in the build context.
    ignored = (ROOT / ".dockerignore").read_text().split()
    for line in lines:
        if line.startswith("COPY ") and "--from" not in line:
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src
                assert src.rstrip("/") not in ignored, src


def test_dockerfile_takes_the_torch_index_and_pip_options_as_build_arguments():
    build = stages()[0]
    args = dict(
        line.removeprefix("ARG ").split("=", 1) for line in build if line.startswith("ARG ")
    )
    assert args["TORCH_INDEX"] == CPU_INDEX
    assert args["PIP_OPTIONS"] == ""
    assert "TORCH_VERSION" in args
    run = next(line for line in build if "docker-install.sh" in line)
    assert 'TORCH_INDEX="$TORCH_INDEX"' in run and 'PIP_OPTIONS="$PIP_OPTIONS"' in run
    # No index is hard-coded where a build argument cannot reach it.
    assert all("download.pytorch.org" not in line for line in build if line.startswith("RUN "))


def test_final_image_stage_takes_only_the_venv_the_model_and_the_kernels_from_the_build():
    *_, final = stages()
    assert len(stages()) == 2
    copies = [line for line in final if line.startswith("COPY ")]
    assert copies and all("--from=build" in line for line in copies)
    targets = sorted(line.split()[-1] for line in copies)
    assert targets == ["/opt/kernels", "/opt/models", "/opt/venv"]
    # Nothing installed or downloaded in the final stage: no apt, no pip, no build tools.
    assert not any(
        word in line for line in final if line.startswith("RUN ") for word in ("apt", "pip")
    )


# scripts/install.sh --print-torch: which torch and from where, without installing anything.


@pytest.fixture(scope="module")
def torch_index(tmp_path_factory) -> Iterator[str]:
    """A PEP 503 index on loopback whose torch page lists one (empty) wheel."""
    root = tmp_path_factory.mktemp("index")
    (root / "simple" / "torch").mkdir(parents=True)
    (root / "simple" / "torch" / "torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl").touch()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/simple"
    httpd.shutdown()
    thread.join(10)


def print_torch(**env: str) -> subprocess.CompletedProcess:
    # A proxy that refuses at once: nothing here may reach the network, and the probe of
    # PyTorch's real index must fail fast, as where the index is unreachable.
    proxy = "http://127.0.0.1:9"
    base = {k: v for k, v in os.environ.items() if k not in ("TORCH_INDEX", "TORCH_VERSION")}
    full = {**base, "https_proxy": proxy, "http_proxy": proxy, "no_proxy": "127.0.0.1", **env}
    return subprocess.run(
        [str(INSTALL), "--print-torch"], env=full, capture_output=True, text=True, timeout=60
    )


X86_LINUX = sys.platform == "linux" and platform.machine() == "x86_64"
CPU_PIN = "torch==2.13.0+cpu" if X86_LINUX else "torch==2.13.0"


def test_install_pins_the_cpu_build_and_adds_a_reachable_torch_index(torch_index):
    done = print_torch(TORCH_INDEX=torch_index)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [CPU_PIN, "--extra-index-url", torch_index]


def test_install_skips_an_unreachable_cpu_index_at_once_and_keeps_the_cpu_pin():
    start = time.monotonic()
    done = print_torch()
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [CPU_PIN]  # pip's own sources (find-links, a mirror) only
    assert time.monotonic() - start < 15  # one bounded probe, not pip's retries per package
    if X86_LINUX:
        assert "unreachable" in done.stderr


def test_install_refuses_a_torch_index_that_does_not_answer():
    done = print_torch(TORCH_INDEX="http://127.0.0.1:9/simple")
    assert done.returncode == 1
    assert "does not answer" in done.stderr


def test_install_uses_a_torch_version_with_a_local_label_as_given(torch_index):
    done = print_torch(TORCH_INDEX=torch_index, TORCH_VERSION="2.13.0+cu126")
    assert done.stdout.split()[0] == "torch==2.13.0+cu126"


# The tokenizer cache the image bakes at build time and reads at every start.


def test_tokenizer_cache_key_ignores_mtime_and_path_but_not_content(tmp_path, monkeypatch):
    from models.hf_tokenizer import _gguf_cache_dir

    monkeypatch.setenv("CBSERVE_MODEL_DIR", str(tmp_path / "cache"))
    a = tmp_path / "a" / "m.gguf"
    a.parent.mkdir()
    a.write_bytes(os.urandom(1 << 16))
    key = _gguf_cache_dir(a)
    st = a.stat()
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns // 10**9 * 10**9))  # a layer's rounding
    assert _gguf_cache_dir(a) == key
    b = tmp_path / "b" / "m.gguf"
    b.parent.mkdir()
    shutil.copyfile(a, b)
    assert _gguf_cache_dir(b) == key
    data = bytearray(a.read_bytes())
    data[100] ^= 1
    b.write_bytes(bytes(data))
    assert _gguf_cache_dir(b) != key


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_docker_install_script_builds_a_pruned_venv_whose_server_answers(tmp_path):
    venv = tmp_path / "venv"
    env = {
        **os.environ,
        "TORCH_INDEX": "",
        "SKIP_MODEL": "1",
        "STRIP": "1" if shutil.which("strip") else "0",
        "CBSERVE_MODEL_DIR": str(tmp_path / "models"),
        # pip writes no byte-code the script then deletes with every __pycache__ (a third of pip's
        # time here); the script's own start writes back what a server imports, as in the image
        "PIP_OPTIONS": f"{os.environ.get('PIP_OPTIONS', '')} --no-compile".strip(),
    }
    subprocess.run(
        [str(ROOT / "scripts" / "docker-install.sh"), str(venv)],
        env=env,
        check=True,
        timeout=540,
        capture_output=True,
    )
    torch_dir = next(venv.glob("lib/python*/site-packages/torch"))
    assert not (torch_dir / "include").exists() and not (torch_dir / "test").exists()
    assert [p.name for p in (torch_dir / "bin").iterdir()] == ["torch_shm_manager"]
    assert not list(venv.glob("lib/python*/site-packages/pip"))
    # The installed package, run from elsewhere: not the source tree.
    proc = subprocess.Popen(
        [str(venv / "bin" / "python"), "-m", "server", "--model", "tinygpt", "--port", "0"],
        cwd=tmp_path,
        env={**env, "PYTHONUNBUFFERED": "1"},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = None
        for line in proc.stderr:
            if "Uvicorn running on " in line:
                url = line.split("Uvicorn running on ")[1].split()[0]
                break
        assert url, "server did not start"
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        models = httpx.get(url + "/v1/models", timeout=30).json()
        assert models["data"][0]["id"] == "tinygpt"
        body = {"model": "tinygpt", "prompt": "Hello", "max_tokens": 5, "temperature": 0}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert reply["usage"]["completion_tokens"] >= 1  # TinyGPT may draw EOS early
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# The image itself, where a Docker daemon answers.


def docker_unavailable() -> str | None:
    """Why no image can be built here, or None where a daemon answers."""
    if shutil.which("docker") is None:
        return "no `docker` command here"
    try:
        done = subprocess.run(
            ["docker", "version", "--format", "{{.Server.Version}}"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        return "`docker version` did not answer within 30 s"
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"no Docker daemon answers (`docker version`: {why})"
    return None


def docker(*args: str, timeout: float = 120) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"docker {args[0]} failed:\n{done.stderr[-4000:]}"
    return done.stdout.strip()


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_image_builds_runs_as_its_user_and_serves_the_model():
    import openai

    reason = docker_unavailable()
    if reason:
        pytest.skip(reason)
    tag = f"cbserve-test:{os.getpid()}"
    build_args = shlex.split(os.environ.get("CBSERVE_DOCKER_BUILD_ARGS", ""))
    docker("build", "-q", *build_args, "-t", tag, str(ROOT), timeout=3300)
    cid = None
    try:
        cid = docker("run", "-d", "-p", "127.0.0.1::8000", tag)
        host_port = docker("port", cid, "8000/tcp").splitlines()[0]  # 127.0.0.1:NNNNN
        url = f"http://{host_port}"
        deadline = time.monotonic() + 300  # the model loads before the server listens
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            state = docker("inspect", "--format", "{{.State.Status}}", cid)
            assert state == "running", docker("logs", cid)[-4000:]
            assert time.monotonic() < deadline, "the container never answered /health"
            time.sleep(0.5)
        assert docker("inspect", "--format", "{{.Config.User}}", cid) == "cbserve"
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120)
        [model] = client.models.list().data
        assert "smollm2" in model.id.lower()
        reply = client.completions.create(
            model=model.id, prompt="The capital of France is", max_tokens=4, temperature=0
        )
        assert reply.choices[0].text.strip() and reply.usage.completion_tokens >= 1
        docker("stop", cid, timeout=60)
        assert docker("inspect", "--format", "{{.State.ExitCode}}", cid) == "0"
    finally:
        if cid:
            subprocess.run(["docker", "rm", "-f", cid], capture_output=True, timeout=60)
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, timeout=120)
