"""`python -m server.ray`: serve the model on Ray Serve with N engine replicas.

Connects to a running Ray cluster (`--address`, e.g. `auto` on a cluster node) or starts a local
one (dashboard off, temp dir from `--ray-temp-dir`). Loads the model once here for its tokenizer
and model card (the ingress needs no weights), deploys the two tiers, and serves until SIGINT or
SIGTERM, then shuts Serve down, draining in-flight streams.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import sys
import threading
from typing import Any

from server.cli import (
    DEFAULT_MODEL,
    build_parser,
    engine_config,
    generation_defaults,
    resolve_dtype,
)


def build_ray_parser() -> argparse.ArgumentParser:
    # Every flag of `python -m server` keeps its meaning (engine sizing is per replica);
    # --num-threads becomes --threads-per-replica.
    p = build_parser()
    p.prog = "python -m server.ray"
    p.description = "cbserve on Ray Serve: engine replicas behind a prefix-aware router."
    r = p.add_argument_group("ray serve")
    r.add_argument("--address", default=None, help="Ray cluster to join (default: start one here)")
    r.add_argument("--ray-temp-dir", default=None, help="Ray's session folder for a local cluster")
    r.add_argument(
        "--num-cpus",
        type=int,
        default=None,
        help="CPUs a local cluster offers Ray (as `ray start --num-cpus`; default: the machine's). "
        "Each engine replica reserves --threads-per-replica of them, so more replicas than cores "
        "need a larger figure (they then share the cores)",
    )
    r.add_argument("--replicas", type=int, default=2, help="engine replicas (default: %(default)s)")
    r.add_argument(
        "--threads-per-replica",
        type=int,
        default=1,
        help="torch threads (and Ray CPUs) per engine replica (default: %(default)s)",
    )
    r.add_argument("--min-replicas", type=int, default=None, help="autoscaling lower bound")
    r.add_argument("--max-replicas", type=int, default=None, help="autoscaling upper bound")
    r.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=None,
        help="autoscaling target per replica (default: --max-batch-size)",
    )
    r.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=None,
        help="requests Serve hands one replica at once (default: slots + its waiting queue)",
    )
    r.add_argument(
        "--routing",
        choices=("prefix", "default"),
        default="prefix",
        help="prefix: prefix-aware rendezvous routing; default: Serve's power of two choices",
    )
    r.add_argument(
        "--imbalance-bound",
        type=int,
        default=4,
        help="in-flight requests the preferred replica may have beyond the least loaded one "
        "before the router falls back to the least loaded (default: %(default)s)",
    )
    r.add_argument(
        "--route-blocks",
        type=int,
        default=4,
        help="leading full KV blocks of the prompt that form the route key (default: %(default)s)",
    )
    d = p.add_argument_group("disaggregated prefill and decode")
    d.add_argument(
        "--disaggregated",
        action="store_true",
        help="prefill and decode on different replicas: the prompt's K/V moves from a prefill "
        "replica to a decode replica through Ray's object store (--replicas is then unused)",
    )
    d.add_argument(
        "--prefill-replicas", type=int, default=1, help="prefill replicas (default: %(default)s)"
    )
    d.add_argument(
        "--decode-replicas", type=int, default=1, help="decode replicas (default: %(default)s)"
    )
    p.set_defaults(model=DEFAULT_MODEL, max_waiting=None)
    return p


def make_app(args: argparse.Namespace) -> Any:
    """The Serve application for parsed flags."""
    from server.ray.deploy import build_app

    return build_app(*deploy_parts(args))


def deploy_parts(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """`build_app`'s arguments for parsed flags: (DeploySpec, tokenizer, ModelCard,
    ServerSettings). Loads the model here once for its tokenizer, card and sampling defaults (the
    ingress needs no weights); the replicas load their own copies."""
    from engine.registry import engine_class
    from models import load_model
    from server.http.app import settings_from_flags
    from server.openai.protocol import ModelCard
    from server.ray.deploy import DeploySpec
    from server.ray.replica import EngineSpec

    dtype = resolve_dtype(args.dtype)
    # ModelLoadError: the caller reports it
    lm = load_model(
        args.model,
        dtype=dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        activations=args.activation_dtype,
        max_model_len=args.max_model_len,
    )
    config = engine_config(args)  # ValueError likewise
    # The model's sampling defaults, as `python -m server` applies them (ModelLoadError likewise):
    # without them a request that leaves out top_p or temperature samples differently here.
    defaults = generation_defaults(lm, args.generation_config, args.override_generation_config)
    limit = lm.config.max_position_embeddings
    card = ModelCard(
        names=tuple(args.served_model_name or (lm.name,)),
        max_model_len=min(config.max_model_len or limit, limit),
        parameter_count=lm.num_parameters(),
        engine="disaggregated" if args.disaggregated else engine_class(args.engine).name,
        default_sampling_params=defaults,
    )
    if args.disaggregated and (args.prefill_replicas < 1 or args.decode_replicas < 1):
        raise ValueError("--prefill-replicas and --decode-replicas must be >= 1")
    spec = DeploySpec(
        engine=EngineSpec(
            model=args.model,
            dtype=dtype,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            activation_dtype=args.activation_dtype,
            engine=args.engine,
            config=config,
            max_waiting=args.max_waiting or None,
            step_timeout=args.step_timeout,
            num_threads=args.threads_per_replica,
            shutdown_timeout=args.shutdown_timeout,
        ),
        replicas=args.replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests,
        max_ongoing_requests=args.max_ongoing_requests,
        prefix_routing=args.routing == "prefix",
        imbalance_bound=args.imbalance_bound,
        route_blocks=args.route_blocks,
        replica_num_cpus=float(args.threads_per_replica),
        disaggregated=args.disaggregated,
        prefill_replicas=args.prefill_replicas,
        decode_replicas=args.decode_replicas,
    )
    settings = settings_from_flags(args)  # python -m server's too; OSError/ValueError: a bad flag
    return spec, lm.tokenizer, card, settings


def app_builder(config: dict[str, str]) -> Any:
    """For Serve config files (`serve run`, `serve deploy`, KubeRay's `serveConfigV2`):
    `import_path: server.ray.cli:app_builder` with `args: {flags: "--model ... --replicas 2"}`.
    The flags are those of `python -m server.ray`; --address, --host and --port do not apply
    (the cluster and its HTTP options come from the config file)."""
    return make_app(build_ray_parser().parse_args(shlex.split(config.get("flags", ""))))


def main(argv: list[str] | None = None) -> int:
    args = build_ray_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        import ray
        from ray import serve
    except ImportError:
        print("error: Ray is not installed; pip install '.[ray]'", file=sys.stderr)
        return 1
    from models import ModelLoadError

    try:
        app = make_app(args)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(include_dashboard=False, _temp_dir=args.ray_temp_dir, num_cpus=args.num_cpus)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(app, name="cbserve", route_prefix="/")
    print(f"serving on http://{args.host}:{args.port} with Ray Serve", flush=True)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    # Serve drains: replicas finish in-flight calls (graceful_shutdown_timeout_s) before exiting.
    serve.delete("cbserve")
    serve.shutdown()
    if not args.address:
        ray.shutdown()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
