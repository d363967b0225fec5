"""llama.cpp as an oracle where it is built (outside CI): its binaries from $LLAMA_CPP_BIN (default:
../shared/peers.md's build) or PATH, skipping the test with the reason where they are missing, and
llama-server's greedy tokens for a prompt of token ids."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.servers import free_port

DEFAULT_LLAMA_CPP_BIN = "/work/peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"


def llama_cpp_tool(name: str) -> Path:
    """A llama.cpp binary from $LLAMA_CPP_BIN (default: ../shared/peers.md's build) or PATH."""
    tool = Path(os.environ.get("LLAMA_CPP_BIN", DEFAULT_LLAMA_CPP_BIN)) / name
    if tool.is_file() and os.access(tool, os.X_OK):
        return tool
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"llama.cpp's {name} is not built ({tool}; set LLAMA_CPP_BIN)")
    return Path(found)


def llama_server_greedy(model, ids: list[int], n: int, ctx: int = 512) -> list[int]:
    return llama_server_greedy_each(model, [ids], n, ctx)[0]


def llama_server_greedy_each(
    model,
    prompts: list[list[int]],
    n: int,
    ctx: int = 512,
    threads: int = 2,
    cache_type: str | None = None,
) -> list[list[int]]:
    """llama-server's n greedy tokens (EOS ignored: it bans its end-of-generation tokens) after
    each prompt of token ids, one server started for all of them (a prompt at a time: one slot).
    `cache_type`: its K/V cache's type (its default: f16)."""
    tool = llama_cpp_tool("llama-server")
    port = free_port()
    cmd = [str(tool), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-np", "1", "-c", str(ctx), "--no-warmup",
           # (its flash attention takes queries to float16: a random model's near ties flip)
           "-fa", "off"]  # fmt: skip
    if cache_type is not None:
        cmd += ["-ctk", cache_type, "-ctv", cache_type]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, "llama-server did not start"
            time.sleep(0.2)
        out = []
        for ids in prompts:
            body = {"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1,
                    "return_tokens": True, "ignore_eos": True,
                    "cache_prompt": False}  # fmt: skip
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )  # fmt: skip
            with urllib.request.urlopen(req, timeout=120) as r:
                out.append(json.loads(r.read())["tokens"])
        return out
    finally:
        proc.terminate()
        proc.wait(10)
