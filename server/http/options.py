"""Server options both command lines share (chat template, tool and reasoning parsers, CORS,
several API keys, what one request may cost): their flags, what they become in
`ServerSettings`, and the CORS middleware.

Owns `add_options` (the flags, added to `python -m server`'s parser, so `python -m server.ray`
has them too), `settings_fields` (flags -> `ServerSettings` fields, files read here so a bad
path fails at start, not per request), `api_keys` (every key a server accepts) and
`add_cors` (Starlette's CORS middleware, outermost, only when `--allowed-origins` is given:
browsers on other origins are refused by default).
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

# Light on imports: `python -m server --help` builds the parser without torch.
from server.tooling.formats import PARSER_CHOICES
from server.tooling.reasoning import REASONING_PARSERS

if TYPE_CHECKING:
    from fastapi import FastAPI


def add_options(s: argparse._ArgumentGroup) -> None:
    s.add_argument(
        "--api-key-file",
        help="a file of API keys, one a line (blank lines and # comments skipped); any of them, "
        "or of --api-key, is accepted",
    )
    s.add_argument(
        "--allowed-origins",
        nargs="+",
        default=None,
        metavar="ORIGIN",
        help="browser origins allowed to call the API (CORS), e.g. https://app.example or *; "
        "default: none (no CORS headers)",
    )
    s.add_argument(
        "--chat-template",
        help="a Jinja chat template (a file, or the template text) used instead of the model's",
    )
    s.add_argument(
        "--tool-call-parser",
        choices=PARSER_CHOICES,
        default="auto",
        help="how tool calls are written and parsed: hermes (<tool_call>), llama3 (JSON), "
        "mistral ([TOOL_CALLS]), generic (tools described in the prompt, output constrained), "
        "or auto: from the chat template (default: %(default)s)",
    )
    s.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="return <think>...</think> as reasoning_content: qwen3 (when the output opens "
        "with <think>) or deepseek_r1 (the output starts inside it); harmony (gpt-oss's "
        "channels: analysis as reasoning_content, final as content, commentary calls as "
        "tool_calls) is implied by a harmony chat template",
    )
    # What one request may cost (server.openai.serving, server.grammars.check_worker).
    s.add_argument(
        "--response-budget",
        type=int,
        default=512 * 1024,
        metavar="ENTRIES",
        help="most entries one response may carry: logprobs (a token's own and each top "
        "alternative, prompt and generated, over every choice) or embedded input tokens; a "
        "request that could exceed it is a 400 before it runs (default: %(default)s, about "
        "35 MB of JSON logprobs)",
    )
    s.add_argument(
        "--grammar-check-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how long compiling a new JSON schema, regex or grammar (its first masks "
        "included) may take, checked in a separate process before the server compiles it; "
        "longer is a 400 (default: %(default)s)",
    )
    s.add_argument(
        "--grammar-check-memory",
        type=int,
        default=1024,
        metavar="MIB",
        help="how much memory that check may use; more is a 400 (default: %(default)s)",
    )


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key (repeatable; env CBSERVE_API_KEY) and the keys of --api-key-file."""
    keys = [k for k in (args.api_key or []) if k]
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.append(line)
        if not keys:
            raise ValueError(f"--api-key-file {args.api_key_file} holds no key")
    return tuple(dict.fromkeys(keys))


def settings_fields(args: argparse.Namespace) -> dict[str, Any]:
    """`ServerSettings` fields for these flags. ValueError/OSError: a bad flag (the CLI says so)."""
    from server.grammars.check_worker import CheckBudget
    from server.tooling.chat_template import load_chat_template

    if args.response_budget < 1:
        raise ValueError("--response-budget must be at least 1")
    if args.grammar_check_timeout <= 0 or args.grammar_check_memory < 64:
        raise ValueError("--grammar-check-timeout must be > 0 and --grammar-check-memory >= 64")
    return {
        "api_keys": api_keys(args),
        "allowed_origins": tuple(args.allowed_origins or ()),
        "chat_template": load_chat_template(args.chat_template) if args.chat_template else None,
        "tool_call_parser": args.tool_call_parser,
        "reasoning_parser": args.reasoning_parser,
        "response_budget": args.response_budget,
        "grammar_budget": CheckBudget(
            seconds=args.grammar_check_timeout, memory_mib=args.grammar_check_memory
        ),
    }


def env_api_keys() -> list[str]:
    """--api-key's default: CBSERVE_API_KEY, when set."""
    key = os.environ.get("CBSERVE_API_KEY")
    return [key] if key else []


def add_cors(app: FastAPI, origins: tuple[str, ...]) -> None:
    """CORS for `origins` (added last, so it runs first: a preflight is answered before the
    API-key check, as browsers send no credentials on it)."""
    if not origins:
        return
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(origins),
        allow_methods=["GET", "POST", "OPTIONS"],
        allow_headers=["*"],
        expose_headers=["Retry-After"],
    )
