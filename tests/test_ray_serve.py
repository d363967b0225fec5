"""cbserve on Ray Serve, end to end: a real local Ray cluster, two engine replicas, HTTP clients.

Ray does not stay on loopback by itself (it binds the host's routable address), so the suite
runs inside a network namespace that has only `lo`: outside one, the single test here re-runs
this module under `unshare -n` (root) with a short temp folder that holds Ray's session files
and a private HOME (Ray writes an auth token there), and removes it afterwards. Inside, one
module-scoped cluster serves three applications of TinyGPT, deployed together: "prefix" (the
prefix-aware router, 2 engine replicas) at /, "pow2" (Serve's default power-of-two router, 2
replicas) at /pow2 and "disagg" (1 prefill + 1 decode replica) at /disagg; a one-process server is
the reference for outputs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve", reason="the [ray] extra is not installed")

pytestmark = [pytest.mark.slow, pytest.mark.ray]

IN_NAMESPACE = os.environ.get("CBSERVE_RAY_NETNS") == "1"


if not IN_NAMESPACE:

    def _kill_leftovers(tag: str) -> None:
        """Kill the processes the suite started that outlived it (Ray's daemons re-parent to
        init): those whose environment carries this run's tag, by pid."""
        needle = f"CBSERVE_RAY_SUITE={tag}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    os.kill(int(entry.name), signal.SIGKILL)

    @pytest.mark.timeout(900)
    def test_ray_serve_suite_in_a_loopback_only_network_namespace() -> None:
        if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("ip")):
            pytest.skip("needs root, unshare and ip for a loopback-only network namespace")
        # Short: Ray's unix sockets live under it (a socket path has at most 107 bytes).
        base = Path(tempfile.mkdtemp(prefix="cbray-"))
        try:
            (base / "home").mkdir()
            # The kernel and model caches stay where they are (they are found through HOME,
            # which is private in the namespace): the inner run loads the kernels built for these
            # sources instead of compiling them again inside this test's timeout.
            from models.base import model_dir
            from models.kernels import cache_dir

            env = {
                # not this run's pytest-xdist worker variables: the inner run is a session of its own
                **{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")},
                "CBSERVE_KERNEL_DIR": str(cache_dir()),
                "CBSERVE_MODEL_DIR": str(model_dir()),
                "CBSERVE_RAY_NETNS": "1",
                "HOME": str(base / "home"),
            }
            env["RAY_USAGE_STATS_ENABLED"] = "0"
            env["CBSERVE_RAY_SUITE"] = str(base)
            inner = [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-x",
                "-p",
                "no:cacheprovider",
                "--durations=0",
            ]
            inner += ["--basetemp", str(base / "pytest"), __file__]
            script = 'ip link set lo up && exec "$@"'
            r = subprocess.run(
                ["unshare", "-n", "sh", "-c", script, "sh", *inner],
                env=env,
                cwd=Path(__file__).resolve().parents[1],
                capture_output=True,
                text=True,
                timeout=840,
            )
            print(r.stdout[-6000:])
            assert r.returncode == 0, r.stdout[-8000:] + "\n" + r.stderr[-4000:]
            assert " passed" in r.stdout and "skipped" not in r.stdout
        finally:
            _kill_leftovers(str(base))
            shutil.rmtree(base, ignore_errors=True)

else:
    import openai
    import ray
    from ray import serve
    from ray.serve.api import RunTarget

    from engine import EngineConfig
    from server.http.app import ServerSettings
    from server.openai.protocol import ModelCard
    from server.ray.deploy import DeploySpec, build_app
    from server.ray.replica import EngineSpec
    from server.ray.wire import Probe
    from tests.helpers.servers import run_server

    ENGINE = {"max_batch_size": 8, "kv_cache_memory_gib": 0.05}

    @dataclass
    class Cluster:
        port: int

        def url(self, app: str, path: str) -> str:
            prefix = "" if app == "prefix" else f"/{app}"  # pow2, disagg
            return f"http://127.0.0.1:{self.port}{prefix}{path}"

    def _free_port() -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    @pytest.fixture(scope="module")
    def cluster(tiny_lm, tmp_path_factory) -> Iterator[Cluster]:
        temp = tmp_path_factory.getbasetemp() / "ray"
        t0 = time.monotonic()
        ray.init(
            num_cpus=8,  # logical: 6 replicas of 1 CPU, and room for a restarted one
            include_dashboard=False,
            _temp_dir=str(temp),
            logging_level="warning",
            log_to_driver=False,
        )
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        card = ModelCard(("tinygpt",), 2048, tiny_lm.num_parameters(), "continuous-batch")
        spec = DeploySpec(
            engine=EngineSpec(
                "tinygpt", config=EngineConfig(**ENGINE), num_threads=1, shutdown_timeout=2
            ),
            replicas=2,
            replica_num_cpus=1,
            health_check_period_s=1,
            health_check_timeout_s=10,
        )
        card = replace(card, max_model_len=tiny_lm.config.max_position_embeddings)
        settings = ServerSettings(shutdown_timeout=2)
        pow2 = replace(spec, prefix_routing=False)
        disagg = replace(spec, disaggregated=True, prefill_replicas=1, decode_replicas=1)
        # All at once: the replicas start in parallel (start-up is most of this module's time).
        serve.run_many(
            [
                RunTarget(build_app(s, tiny_lm.tokenizer, card, settings), name, prefix)
                for s, name, prefix in (
                    (spec, "prefix", "/"),
                    (pow2, "pow2", "/pow2"),
                    (disagg, "disagg", "/disagg"),
                )
            ]
        )
        print(f"cluster up in {time.monotonic() - t0:.1f}s")
        try:
            yield Cluster(port)
        finally:
            serve.shutdown()
            ray.shutdown()

    @pytest.fixture(scope="module")
    def reference(tiny_lm):
        with run_server(tiny_lm, engine_options=ENGINE) as live:
            yield live

    def engine_replicas(app: str, deployment: str = "Engine") -> list[str]:
        names = ray.util.list_named_actors(all_namespaces=True)
        prefix = f"SERVE_REPLICA::{app}#{deployment}#"
        return sorted(n["name"][len(prefix) :] for n in names if n["name"].startswith(prefix))

    def probe(app: str, deployment: str = "Engine") -> dict[str, dict]:
        """Each engine replica's state, keyed by the id the replica reports. Under the prefix
        router a `Probe` is pinned to the replica it names; under Serve's default router it
        lands anywhere, so ask until every replica has answered."""
        handle = serve.get_deployment_handle(deployment, app_name=app)
        want = engine_replicas(app, deployment)
        out: dict[str, dict] = {}
        for attempt in range(40):
            missing = [r for r in want if r not in out]
            if not missing:
                break
            with contextlib.suppress(Exception):  # a replica being replaced
                state = handle.probe.remote(Probe(missing[attempt % len(missing)])).result(
                    timeout_s=30
                )
                out[state["replica"]] = state
        return out

    def post(url: str, body: dict) -> dict:
        r = httpx.post(url, json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    BODIES = [
        {"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0},
        {
            "prompt": "Seeded sampling, two choices",
            "max_tokens": 20,
            "temperature": 0.9,
            "seed": 1234,
            "n": 2,
            "ignore_eos": True,
        },
        {"prompt": "x" * 90, "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "seed": 7},
    ]

    def test_outputs_equal_one_process_token_for_token(cluster, reference):
        for body in BODIES:
            body = {"model": "tinygpt", **body, "logprobs": 1}
            via_ray = post(cluster.url("prefix", "/v1/completions"), body)
            direct = post(reference.url("/v1/completions"), body)
            assert via_ray["choices"] == direct["choices"], body
            assert via_ray["usage"] == direct["usage"]
        # Concurrent requests batch together on the replicas: still the same tokens.
        results: dict[int, dict] = {}

        def one(i: int) -> None:
            body = {"model": "tinygpt", **BODIES[i % 3], "prompt": f"{i} concurrent"}
            results[i] = post(cluster.url("prefix", "/v1/completions"), body)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, got in results.items():
            body = {"model": "tinygpt", **BODIES[i % 3], "prompt": f"{i} concurrent"}
            assert got["choices"] == post(reference.url("/v1/completions"), body)["choices"]

    def test_openai_sdk_streams_through_the_ray_ingress(cluster):
        client = openai.OpenAI(base_url=cluster.url("prefix", "/v1"), api_key="none")
        messages = [{"role": "user", "content": "Say something"}]
        full = client.chat.completions.create(
            model="tinygpt", messages=messages, max_tokens=12, temperature=0
        )
        stream = client.chat.completions.create(
            model="tinygpt", messages=messages, max_tokens=12, temperature=0, stream=True
        )
        chunks = list(stream)
        assert len(chunks) >= 3  # streamed, not one body
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == full.choices[0].message.content
        # Errors keep their OpenAI shape through Ray.
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tinygpt", prompt="x", temperature=-1)
        assert e.value.body["param"] == "temperature"

    TOOL = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["a"],
                "additionalProperties": False,
            },
        },
    }

    def test_tool_and_schema_grammars_cross_the_handle_as_specs(cluster):
        # A compiled grammar does not pickle: the spec crosses, the replica compiles it.
        client = openai.OpenAI(base_url=cluster.url("prefix", "/v1"), api_key="none")
        messages = [{"role": "user", "content": "Call f"}]
        for seed in range(3):
            out = client.chat.completions.create(
                model="tinygpt",
                messages=messages,
                tools=[TOOL],
                tool_choice="required",
                parallel_tool_calls=False,
                max_tokens=150,
                temperature=1,
                seed=seed,
            )
            assert out.choices[0].finish_reason == "tool_calls"
            args = json.loads(out.choices[0].message.tool_calls[0].function.arguments)
            assert isinstance(args["a"], int) and 0 <= args["a"] <= 99 and set(args) == {"a"}
        schema = {
            "type": "object",
            "properties": {"b": {"type": "boolean"}},
            "required": ["b"],
            "additionalProperties": False,
        }
        out = client.responses.create(
            model="tinygpt",
            input="json",
            max_output_tokens=40,
            temperature=1,
            text={"format": {"type": "json_schema", "name": "b", "schema": schema}},
        )
        assert isinstance(json.loads(out.output_text)["b"], bool)
        # The disaggregated tiers cannot carry a grammar's state: a clear 400, not a hang.
        r = httpx.post(
            cluster.url("disagg", "/v1/chat/completions"),
            json={"messages": messages, "tools": [TOOL], "tool_choice": "required"},
            timeout=60,
        )
        assert r.status_code == 400 and "disaggregated" in r.json()["error"]["message"]

    def test_a_grammar_that_would_crash_a_process_is_refused_at_the_ingress(cluster):
        # The ingress checks every new spec out of process before a replica compiles it: a $ref
        # chain that overflows llguidance's stack is a 400, and every replica still serves.
        defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(3000)}
        defs["d3000"] = {"type": "string"}
        schema = {"$defs": defs, "$ref": "#/$defs/d0"}
        body = {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema},
            },
        }
        r = httpx.post(cluster.url("prefix", "/v1/chat/completions"), json=body, timeout=60)
        assert r.status_code == 400 and "nests or chains too deeply" in r.json()["error"]["message"]
        for i in range(4):  # both replicas (the router spreads fresh prompts)
            ok = {"model": "tinygpt", "prompt": f"still here {i}", "max_tokens": 2}
            r = httpx.post(cluster.url("prefix", "/v1/completions"), json=ok, timeout=60)
            assert r.status_code == 200, r.text

    def test_client_disconnect_aborts_the_request_on_its_replica(cluster):
        before = sum(p["aborted_on_cancel"] for p in probe("prefix").values())
        body = {
            "model": "tinygpt",
            "prompt": "never ending",
            "max_tokens": 1500,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST", cluster.url("prefix", "/v1/completions"), json=body, timeout=60
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(3):
                assert next(lines).startswith("data: ")
                next(lines)
            running = sum(p["stats"].num_running for p in probe("prefix").values())
            assert running == 1
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            state = probe("prefix")
            aborted = sum(p["aborted_on_cancel"] for p in state.values())
            idle = all(
                p["stats"].num_running == 0
                and p["stats"].num_free_blocks == p["stats"].num_total_blocks
                for p in state.values()
            )
            if aborted > before and idle:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the replica did not abort the request: {state}")

    def _tenant_trace(
        cluster: Cluster, app: str, until_both: bool = False
    ) -> tuple[list[set[str]], float]:
        """4 tenants, each with its own 300-byte system prompt, 4 requests each, one at a time
        (`until_both`: more tenants, up to 12, until both replicas have served one: rendezvous
        hashing over random replica ids puts 4 tenants on one replica with probability 1/8).
        Returns each tenant's set of replicas and the trace's prefix-cache hit rate."""
        tenants: list[set[str]] = []
        before = probe(app)
        hits0 = sum(p["stats"].prefix_cache_hits for p in before.values())
        queries0 = sum(p["stats"].prefix_cache_queries for p in before.values())
        for t in range(12):
            if len(tenants) >= 4 and (not until_both or len(set().union(*tenants)) == 2):
                break
            system = f"[{app} tenant {t}] " + f"You are assistant number {t}. " * 12
            served = {r: p["served"] for r, p in probe(app).items()}
            for q in range(4):
                post(
                    cluster.url(app, "/v1/completions"),
                    {
                        "model": "tinygpt",
                        "prompt": system[:300] + f" Question {q}?",
                        "max_tokens": 2,
                        "temperature": 0,
                    },
                )
            after = probe(app)
            tenants.append({r for r, p in after.items() if p["served"] > served.get(r, 0)})
        after = probe(app)
        hits = sum(p["stats"].prefix_cache_hits for p in after.values()) - hits0
        queries = sum(p["stats"].prefix_cache_queries for p in after.values()) - queries0
        return tenants, hits / queries

    def test_tenants_stay_on_one_replica_with_prefix_hits_unlike_pow2(cluster):
        sticky, sticky_rate = _tenant_trace(cluster, "prefix", until_both=True)
        spread, spread_rate = _tenant_trace(cluster, "pow2")
        print(f"prefix-aware hit rate {sticky_rate:.2f}, power of two {spread_rate:.2f}")
        assert all(len(s) == 1 for s in sticky), sticky
        assert len(set().union(*sticky)) == 2  # and the tenants use both (fails with p = 2^-11)
        assert any(len(s) == 2 for s in spread), spread  # (fails with probability ~1/4096)
        assert sticky_rate > spread_rate
        metrics = httpx.get(cluster.url("prefix", "/metrics")).text
        preferred = next(
            line
            for line in metrics.splitlines()
            if line.startswith('cbserve_router_decisions_total{outcome="preferred"}')
        )
        assert float(preferred.rsplit(" ", 1)[1]) >= 16  # the trace's calls, at least

    def metric(cluster: Cluster, app: str, name: str) -> float:
        text = httpx.get(cluster.url(app, "/metrics")).text
        line = next(x for x in text.splitlines() if x.startswith(name + " "))
        return float(line.rsplit(" ", 1)[1])

    # Every choice goes on past its first token, so each is handed off once; prompts new to both
    # servers, so prefix-cache hits (usage.prompt_tokens_details) match too.
    DISAGG_BODIES = [
        {"prompt": "A split brown fox", "max_tokens": 24, "temperature": 0, "ignore_eos": True},
        {
            "prompt": "Two seeded choices on split tiers; " * 3,
            "max_tokens": 20,
            "temperature": 0.9,
            "seed": 1234,
            "n": 2,
            "ignore_eos": True,
        },
        {
            "prompt": "y" * 70,
            "max_tokens": 16,
            "temperature": 0.7,
            "top_p": 0.9,
            "seed": 7,
            "ignore_eos": True,
            "frequency_penalty": 0.5,
        },
    ]

    def test_disaggregated_outputs_equal_one_process_and_the_kv_is_counted(cluster, reference):
        # TinyGPT's K/V of one 16-token block: 2 (K, V) x 6 layers x 16 x 2 heads x 32 x 4 bytes.
        per_block = 49_152
        transfers = metric(cluster, "disagg", "cbserve_kv_transfers_total")
        kv_bytes = sum(p["kv_bytes"] for p in probe("disagg", "Decode").values())
        blocks = handed = 0
        for body in DISAGG_BODIES:
            body = {"model": "tinygpt", **body, "logprobs": 1}
            split = post(cluster.url("disagg", "/v1/completions"), body)
            direct = post(reference.url("/v1/completions"), body)
            assert split["choices"] == direct["choices"], body
            assert split["usage"] == direct["usage"]
            n = body.get("n", 1)
            handed += n
            blocks += n * -(-direct["usage"]["prompt_tokens"] // 16)
        # Concurrent requests share both tiers' batches: still the same tokens.
        results: dict[int, dict] = {}

        def one(i: int) -> None:
            body = {"model": "tinygpt", **DISAGG_BODIES[i % 3], "prompt": f"{i} at once " * 3}
            results[i] = post(cluster.url("disagg", "/v1/completions"), body)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, got in results.items():
            body = {"model": "tinygpt", **DISAGG_BODIES[i % 3], "prompt": f"{i} at once " * 3}
            direct = post(reference.url("/v1/completions"), body)
            assert got["choices"] == direct["choices"]
            n = body.get("n", 1)
            handed += n
            blocks += n * -(-direct["usage"]["prompt_tokens"] // 16)
        # Every choice crossed once, with exactly its prompt's blocks; the ingress counts what
        # the prefill tier sent (K/V plus a small header per payload) and the decode tier took.
        assert metric(cluster, "disagg", "cbserve_kv_transfers_total") - transfers == handed
        decode = probe("disagg", "Decode")
        assert sum(p["kv_bytes"] for p in decode.values()) - kv_bytes == blocks * per_block
        prefill = probe("disagg", "Prefill")
        sent = sum(p["handed_off_bytes"] for p in prefill.values())
        assert metric(cluster, "disagg", "cbserve_kv_transfer_bytes_total") == sent
        seconds = metric(cluster, "disagg", "cbserve_kv_transfer_seconds_total")
        assert seconds > 0
        print(  # for docs/scale-out.md (TinyGPT, a shared 2-core machine)
            f"disagg: {handed} transfers, {sent} payload bytes, "
            f"{seconds / metric(cluster, 'disagg', 'cbserve_kv_transfers_total') * 1000:.1f} ms "
            "per hand-off (ingress-side, incl. object-store fetch)"
        )
        assert all(p["stats"].num_running == 0 for p in (*decode.values(), *prefill.values()))
        # Each hand-off's K/V object is released (a ReleaseCall, sent asynchronously) once its
        # decode replica has it: nothing stays pinned on the prefill tier.
        deadline = time.monotonic() + 10
        while sum(p["pinned"] for p in probe("disagg", "Prefill").values()):
            assert time.monotonic() < deadline, probe("disagg", "Prefill")
            time.sleep(0.1)

    def test_disaggregated_streaming_and_disconnect_free_both_tiers(cluster, reference):
        # A stop string ends each choice at a different token, wherever it runs then (prefill
        # or decode tier): the ingress aborts it there while the other choice goes on.
        body = {
            "model": "tinygpt",
            "prompt": "Stop strings across the tiers",
            "max_tokens": 30,
            "temperature": 1.0,
            "seed": 3,  # (which choices stop depends on the seed and the sampler's draws)
            "n": 3,
            "stop": ["e", "a"],
            "ignore_eos": True,
        }
        split = post(cluster.url("disagg", "/v1/completions"), body)
        assert split["choices"] == post(reference.url("/v1/completions"), body)["choices"]
        reasons = sorted(c["finish_reason"] for c in split["choices"])
        assert reasons == ["length", "length", "stop"]  # one choice stopped, two went on
        client = openai.OpenAI(base_url=cluster.url("disagg", "/v1"), api_key="none")
        messages = [{"role": "user", "content": "Say something"}]
        full = client.chat.completions.create(
            model="tinygpt", messages=messages, max_tokens=12, temperature=0
        )
        chunks = list(
            client.chat.completions.create(
                model="tinygpt", messages=messages, max_tokens=12, temperature=0, stream=True
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == full.choices[0].message.content
        before = sum(p["aborted_on_cancel"] for p in probe("disagg", "Decode").values())
        body = {
            "model": "tinygpt",
            "prompt": "never ending, split",
            "max_tokens": 1500,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST", cluster.url("disagg", "/v1/completions"), json=body, timeout=60
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(3):
                assert next(lines).startswith("data: ")
                next(lines)
            assert sum(p["stats"].num_running for p in probe("disagg", "Decode").values()) == 1
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            tiers = (probe("disagg", "Decode"), probe("disagg", "Prefill"))
            aborted = sum(p["aborted_on_cancel"] for p in tiers[0].values())
            idle = all(
                p["stats"].num_running == 0
                and p["stats"].num_free_blocks == p["stats"].num_total_blocks
                and p.get("pinned", 0) == 0  # the prefill tier released every hand-off
                for t in tiers
                for p in t.values()
            )
            if aborted > before and idle:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the decode replica did not abort the request: {tiers}")

    def test_a_killed_replica_fails_its_streams_and_serve_replaces_it(cluster):
        body = {
            "model": "tinygpt",
            "prompt": "doomed stream",
            "max_tokens": 1500,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST", cluster.url("prefix", "/v1/completions"), json=body, timeout=60
        ) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            victim = next(rid for rid, p in probe("prefix").items() if p["stats"].num_running)
            ray.kill(ray.get_actor(f"SERVE_REPLICA::prefix#Engine#{victim}", namespace="serve"))
            rest = list(lines)
        payloads = [line.removeprefix("data: ") for line in rest if line.startswith("data: ")]
        assert payloads[-1] == "[DONE]"
        events = [json.loads(p) for p in payloads[:-1]]
        assert "error" in events[-1], events[-3:]
        assert events[-1]["error"]["code"] == "engine_unavailable"
        # New requests go to the survivor (after Serve notices the death: allow a few seconds).
        deadline = time.monotonic() + 30
        ok = 0
        while ok < 5 and time.monotonic() < deadline:
            r = httpx.post(
                cluster.url("prefix", "/v1/completions"),
                json={"model": "tinygpt", "prompt": f"after {ok}", "max_tokens": 3},
                timeout=60,
            )
            ok = ok + 1 if r.status_code == 200 else 0
        assert ok == 5
        # Serve starts a replacement.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            engine = serve.status().applications["prefix"].deployments["Engine"]
            running = engine.replica_states.get("RUNNING", 0)
            if running == 2 and victim not in engine_replicas("prefix"):
                break
            time.sleep(1)
        else:
            pytest.fail(f"no replacement replica: {engine_replicas('prefix')}")

    def test_no_running_decode_replica_turns_ingress_health_503_until_serve_replaces_it(cluster):
        """The disagg app's only decode replica dies mid-stream: that stream ends with an error
        event, the ingress's /health says 503 while Serve has no RUNNING decode replica (it
        polls Serve's status), and 200 again once Serve has started a replacement."""
        assert httpx.get(cluster.url("disagg", "/health")).status_code == 200
        body = {
            "model": "tinygpt",
            "prompt": "doomed split stream",
            "max_tokens": 1500,
            "ignore_eos": True,
            "stream": True,
        }
        (victim,) = engine_replicas("disagg", "Decode")
        with httpx.stream(
            "POST", cluster.url("disagg", "/v1/completions"), json=body, timeout=60
        ) as r:
            lines = r.iter_lines()
            for _ in range(3):  # past the first token: the request is on the decode replica
                assert next(lines).startswith("data: ")
                next(lines)
            ray.kill(ray.get_actor(f"SERVE_REPLICA::disagg#Decode#{victim}", namespace="serve"))
            rest = list(lines)
        payloads = [line.removeprefix("data: ") for line in rest if line.startswith("data: ")]
        assert payloads[-1] == "[DONE]"
        assert json.loads(payloads[-2])["error"]["code"] == "engine_unavailable"
        statuses = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            health = httpx.get(cluster.url("disagg", "/health"), timeout=10)
            statuses.append(health.status_code)
            if 503 in statuses and health.status_code == 200:
                break
            if health.status_code == 503:
                assert "Decode" in health.json()["error"]["message"]
            time.sleep(0.5)
        else:
            pytest.fail(f"/health went {statuses[:3]}...{statuses[-3:]}")
        assert victim not in engine_replicas("disagg", "Decode")
        # And the replacement serves.
        post(cluster.url("disagg", "/v1/completions"), {"model": "tinygpt", "prompt": "again"})
