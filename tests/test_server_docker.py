"""The Docker image's recipe. No Docker daemon runs here, so: the Dockerfile is checked for what
`docker run -p 8000:8000 IMAGE` relies on, and its install script (scripts/docker-install.sh) is
run for real into a temporary venv, whose installed server then starts and answers."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_dockerfile_runs_the_install_script_as_a_non_root_server_on_port_8000():
    text = (ROOT / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines()]
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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_docker_install_script_builds_a_venv_whose_server_starts(tmp_path):
    venv = tmp_path / "venv"
    env = {
        **os.environ,
        "TORCH_INDEX": "",
        "SKIP_MODEL": "1",
        "CBSERVE_MODEL_DIR": str(tmp_path / "models"),
    }
    subprocess.run(
        [str(ROOT / "scripts" / "docker-install.sh"), str(venv)],
        env=env,
        check=True,
        timeout=540,
        capture_output=True,
    )
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
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
