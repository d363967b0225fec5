"""`python -m clients "prompt"`: ask an OpenAI-compatible server and print the answer.

Owns the command line only: it streams the chat answer as it arrives by default, or uses
/v1/completions (`--no-chat`) and/or waits for the whole answer (`--no-stream`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import httpx

from clients.client import Client
from clients.protocol import DEFAULT_BASE_URL, ClientError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m clients", description="Ask an OpenAI-compatible server."
    )
    parser.add_argument("prompt", help="the prompt (a user message unless --no-chat)")
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--no-chat", action="store_true", help="use /v1/completions")
    parser.add_argument("--no-stream", action="store_true", help="print the answer when done")
    return parser


def run(args: argparse.Namespace, out: Any) -> None:
    params: dict[str, Any] = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
    }
    messages = [{"role": "user", "content": args.prompt}]
    with Client(args.base_url, api_key=args.api_key, timeout=None) as client:
        if args.no_stream:
            if args.no_chat:
                body = client.complete(args.prompt, **params)
                out.write(body["choices"][0]["text"])
            else:
                body = client.chat(messages, **params)
                out.write(body["choices"][0]["message"]["content"] or "")
        else:
            deltas = (
                client.stream_complete(args.prompt, **params)
                if args.no_chat
                else client.stream_chat(messages, **params)
            )
            for delta in deltas:
                # Flush each delta so the user watches the answer being generated.
                out.write(delta)
                out.flush()
    out.write("\n")
    out.flush()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args, sys.stdout)
    except ClientError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(f"\nerror: cannot reach {args.base_url}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
