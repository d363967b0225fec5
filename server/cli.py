"""`python -m server`: parse flags, load the model, build the engine, driver and app, run uvicorn.

The model's weights stay in this process with the engine; the app gets only the tokenizer and a
`ModelCard`.

Owns the command line and process-level setup (logging, torch threads, graceful shutdown through
uvicorn). The app's heavy imports wait until after argument parsing; the parser itself imports the
modules that define the names its flags offer (scheduling policies, quantization schemes, KV
dtypes), which loads torch.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import signal
import sys
from typing import TYPE_CHECKING

from engine.registry import engine_names
from server.http.options import add_options, env_api_keys

if TYPE_CHECKING:
    from engine import EngineConfig

DEFAULT_MODEL = "smollm2-135m-instruct"


def build_parser() -> argparse.ArgumentParser:
    # The names the flags offer are defined once, by the modules that use them.
    from engine.policy import SchedulingPolicy
    from models.loader import KV_DTYPES
    from models.quant import ACTIVATIONS, SCHEMES

    p = argparse.ArgumentParser(
        prog="python -m server",
        description="OpenAI-compatible LLM server with continuous batching on CPU torch.",
    )
    m = p.add_argument_group("model and engine")
    m.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help='"tinygpt", "smollm2-135m-instruct", "gemma-3-270m" (fetched on first use; '
        "`python -m models.fetch --list`), a .gguf file or a Hugging Face directory "
        "(default: %(default)s)",
    )
    m.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="name(s) clients use in `model`; the first is reported (default: the model's name)",
    )
    m.add_argument(
        "--embedding-pooling",
        choices=("mean", "last"),
        default="mean",
        help="how /v1/embeddings pools a prompt's final hidden states: mean, or the last "
        "token's (for models whose card says so)",
    )
    m.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|none|DIR",
        help="default sampling parameters for fields a request leaves out. auto: the model's "
        "generation_config.json, or the built-in preset (SmolLM2: temperature 0.2, top_p 0.9); "
        "none: OpenAI's defaults (temperature 1); DIR: a folder with a generation_config.json "
        "(default: %(default)s)",
    )
    m.add_argument(
        "--override-generation-config",
        default=None,
        metavar="JSON",
        help='replace single defaults, e.g. \'{"temperature": 0.7, "top_k": 40}\' '
        "(fields: temperature, top_p, top_k, min_p, repetition_penalty, max_tokens)",
    )
    m.add_argument(
        "--engine",
        choices=engine_names(),
        default="continuous",
        help="batching policy (default: %(default)s)",
    )
    # Serving defaults, measured on 2 cores with SmolLM2: 128 slots (on the short trace at 16
    # req/s with fresh prompts, 76% of requests in SLO with 128 slots, 49% with 64, 24% with 32,
    # Zen 4; the highest rate held when prompts repeat; a batch-128 decode step is ~110 ms); steps
    # sized to ~120 ms while requests decode (each step's prefill chunk is what fits), so every
    # inter-token gap stays well under a 200 ms SLO, and up to 512 tokens when none decode, so an
    # idle server prefills a prompt at full speed.
    m.add_argument(
        "--max-batch-size",
        type=int,
        default=128,
        help="running requests per step (default: %(default)s)",
    )
    m.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="most tokens one step computes; long prompts are prefilled in chunks "
        "(default: %(default)s)",
    )
    m.add_argument(
        "--target-step-ms",
        type=float,
        default=120.0,
        help="while requests decode, give each step the tokens that keep it about this long, "
        "learned from measured steps (a deep queue may lengthen it: each request waiting for "
        "its first token gets as much of a step as each decoding one); 0 turns it off (a "
        "fixed budget every step) (default: %(default)s)",
    )
    m.add_argument(
        "--kv-cache-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="KV cache budget in GiB; the pool's pages are reserved up front and touched as "
        "used, and the prefix cache keeps freed blocks until the pool cycles, so a busy "
        "server's RSS ends up ~this much above the model's (default: every slot's full "
        "context, capped at 0.75 GiB and at 40,960 tokens: 0.5 GiB of SmolLM2 with the int8 "
        "cache `auto` picks on AVX512-VNNI CPUs, 0.75 GiB = 34,900 tokens with float16)",
    )
    m.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV pool size in blocks (instead of --kv-cache-memory)",
    )
    m.add_argument(
        "--block-size", type=int, default=None, help="tokens per KV block (engine default 16)"
    )
    m.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="cap the context length (a LongRoPE model within its original context takes its "
        "short factors)",
    )
    m.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse KV blocks of shared prompt prefixes (engine default)",
    )
    m.add_argument(
        "--scheduling",
        choices=[policy.value for policy in SchedulingPolicy],
        default=SchedulingPolicy.FCFS.value,
        help="who runs first: fcfs (arrival order), priority (the request's `priority`, lower "
        "first, with aging) or fair (clients share batch slots and each step's tokens evenly; a "
        "client is its X-Client-Id header, else its API key, else its address) "
        "(default: %(default)s)",
    )
    m.add_argument(
        "--num-threads", type=int, default=None, help="torch intra-op threads for the engine step"
    )
    m.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="activations and (unless quantized) weights. auto: float32 through the cbserve CPU "
        "kernels where they run (x86-64 with AVX2); else bfloat16 matmuls on CPUs with native "
        "bfloat16 (AVX512-BF16, AMX), else float32. bfloat16 is a pure-torch mode whose tokens "
        "differ from float32's (default: %(default)s)",
    )
    m.add_argument(
        "--quantization",
        choices=SCHEMES,
        default="auto",
        help="projection and head weights in the CPU kernels. auto: a GGUF file's own "
        "Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q2_K..Q6_K/IQ4_NL/IQ4_XS blocks as they are, float weights otherwise; "
        "none: float (a GGUF file dequantized); q8_0 / q4_1: quantize at load "
        "(default: %(default)s)",
    )
    m.add_argument(
        "--kv-cache-dtype",
        choices=("auto", *KV_DTYPES),
        default="auto",
        help="KV pool storage. auto: int8 where the projections run int8 activations "
        "(quantized weights), else float16 with quantized weights (as llama.cpp), "
        "else float32; int8: per 32 values an int8 and a float32 scale (q8_0), about half of "
        "float16's bytes; attention computes in float32 either way (default: %(default)s)",
    )
    m.add_argument(
        "--activation-dtype",
        choices=ACTIVATIONS,
        default="auto",
        help="what quantized projections multiply. int8: each row's activations quantized per "
        "32 inputs (per 256 for the K formats) and multiplied with integer dot products "
        "(AVX512-VNNI, or AVX2's vpmaddubsw; as llama.cpp does); auto: int8 for quantized "
        "weights where the CPU has VNNI, and on AVX2 for the formats that decode slowly to "
        "float (Q5_0, Q5_1, K formats), else float32 (default: %(default)s)",
    )

    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    s.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    s.add_argument(
        "--api-key",
        action="append",
        default=env_api_keys(),
        help="require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize (env "
        "CBSERVE_API_KEY); repeat it for several keys",
    )
    add_options(s)  # --api-key-file, --allowed-origins, --chat-template, parsers (shared with Ray)
    s.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        help="requests waiting for a batch slot beyond which new ones get 429 (requests the "
        "next step can start do not count); 0: no limit (default: %(default)s)",
    )
    s.add_argument(
        "--max-concurrent-per-client",
        type=int,
        default=0,
        metavar="N",
        help="open generation requests one client (X-Client-Id, else API key, else address) may "
        "have; more get 429; 0: no limit (default: %(default)s)",
    )
    s.add_argument(
        "--max-buffered-tokens",
        type=int,
        default=16,
        metavar="N",
        help="unread output tokens per request (a client not reading its stream) beyond which "
        "the request is paused rather than buffered; 0: no bound (default: %(default)s)",
    )
    s.add_argument(
        "--stall-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="a streaming client that reads nothing for this long has its request aborted "
        "(blocks freed) and its connection closed; 0: never (default: %(default)s)",
    )
    s.add_argument(
        "--max-body-size",
        type=int,
        default=4 * 2**20,
        metavar="BYTES",
        help="larger request bodies get 413 (default: %(default)s)",
    )
    s.add_argument(
        "--step-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="/health reports 503 while one engine step runs longer than this (default: %(default)s)",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        # Docker's grace between SIGTERM and SIGKILL is 10 s: with an 8 s drain `docker stop`
        # returned in 8.4-9.3 s, so 7 s keeps ~2 s for the exit on a slower host.
        default=7.0,
        metavar="SECONDS",
        help="on SIGTERM, how long in-flight requests may take to finish; then open streams get "
        "an error event and [DONE], other requests a 503 (default: %(default)s, under "
        "Docker's 10 s stop grace)",
    )
    s.add_argument(
        "--request-read-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="close a connection that has not sent a whole request (headers and body) this "
        "long after its first byte (default: %(default)s)",
    )
    s.add_argument(
        "--keep-alive-timeout",
        type=int,
        default=5,
        metavar="SECONDS",
        help="close an idle kept-alive connection after this long (default: %(default)s)",
    )
    s.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="(default: %(default)s)",
    )
    s.add_argument(
        "--log-prompts", action="store_true", help="include prompt text in the request log"
    )
    s.add_argument(
        "--no-web-ui",
        dest="web_ui",
        action="store_false",
        help="do not serve the web page (chat box and live engine view) at /",
    )
    return p


def resolve_dtype(choice: str) -> str:
    """`auto`: float32 where the cbserve kernels run (their quantized float32 path is the fast
    one on every x86 CPU); elsewhere bfloat16 only where the CPU multiplies it natively
    (emulated bfloat16 is slower than float32)."""
    if choice != "auto":
        return choice
    from models import kernels
    from models.cpu import has_native_bf16

    if kernels.available():
        return "float32"
    return "bfloat16" if has_native_bf16() else "float32"


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's config from the flags; unset flags keep the engine's defaults. A block count
    takes the place of the memory budget."""
    from engine import EngineConfig

    options = {
        "max_batch_size": args.max_batch_size,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "num_blocks": args.num_kv_blocks,
        "kv_cache_memory_gib": None if args.num_kv_blocks else args.kv_cache_memory,
        "block_size": args.block_size,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": args.prefix_caching,
        "target_step_ms": args.target_step_ms or None,
        "scheduling": args.scheduling,
    }
    return EngineConfig(**{k: v for k, v in options.items() if v is not None})


def generation_defaults(lm, generation_config: str, override: str | None) -> dict:
    """The sampling defaults in force (`models.generation_config`), their values checked the way
    a request's are, so a bad default fails at startup instead of in every request."""
    from engine import InvalidRequestError, SamplingParams
    from models import ModelLoadError
    from models.generation_config import resolve_generation_defaults

    defaults = resolve_generation_defaults(lm, generation_config, override)
    try:
        SamplingParams(**defaults)
    except InvalidRequestError as e:
        raise ModelLoadError(f"default sampling parameters {defaults}: {e}") from e
    if defaults:
        logging.getLogger("server").info("default sampling parameters: %s", defaults)
    return defaults


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import torch

    from engine import make_engine
    from models import ModelLoadError, load_model
    from models.cpu import in_passing_thread
    from server.engine_client.driver import AsyncEngineDriver
    from server.http.app import create_app, settings_from_flags
    from server.http.listener import STEP_WAIT, DrainingServer, server_config
    from server.openai.protocol import ModelCard

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    try:
        # Loaded in a passing thread: the engine's step thread must be the only one whose
        # parallel torch ops create an OpenMP team (`models.cpu.in_passing_thread`).
        lm = in_passing_thread(
            load_model,
            args.model,
            dtype=resolve_dtype(args.dtype),
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            activations=args.activation_dtype,
            max_model_len=args.max_model_len,
        )
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        defaults = generation_defaults(lm, args.generation_config, args.override_generation_config)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        engine = in_passing_thread(make_engine, args.engine, lm.model, engine_config(args))
    except ValueError as e:
        print(f"error: cannot build the {args.engine} engine: {e}", file=sys.stderr)
        return 2
    driver = AsyncEngineDriver(
        engine,
        max_waiting=args.max_waiting or None,
        max_buffered_outputs=args.max_buffered_tokens or None,
        step_timeout=args.step_timeout,
        num_threads=args.num_threads,
    )
    card = ModelCard(
        names=tuple(args.served_model_name or (lm.name,)),
        max_model_len=driver.max_model_len,
        parameter_count=lm.num_parameters(),
        engine=driver.engine_name,
        default_sampling_params=defaults,
        embedding_pooling=args.embedding_pooling,
    )
    try:
        settings = settings_from_flags(args)  # keys, CORS, template, parsers: files read here
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    app = create_app(lm.tokenizer, card, driver, settings)
    config = server_config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        drain_timeout=args.shutdown_timeout,
        request_read_timeout=args.request_read_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
    )
    # At the drain deadline stopping the driver fails every open stream: error event + [DONE].
    server = DrainingServer(config, lambda: driver.stop(timeout=STEP_WAIT), args.shutdown_timeout)
    # uvicorn owns SIGINT/SIGTERM while it runs: it stops accepting connections, lets open ones
    # finish (up to the drain deadline), runs the lifespan's shutdown (which stops the engine
    # driver), then re-raises the signal to the handler that was there before. Make that handler
    # a clean exit, so a drained shutdown exits 0 rather than dying of the signal.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    # Everything alive now (torch, transformers, the model) lives as long as the server: move it
    # out of the collector's sight, so a full collection walks only per-request garbage instead
    # of stalling every stream for tens of milliseconds while it holds the GIL.
    gc.collect()
    gc.freeze()
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 0


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)
