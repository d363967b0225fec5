"""A small OpenAI-compatible client (sync and async, streaming) and a CLI; it speaks only HTTP.

It imports nothing from `server`, `engine` or `models`, so it works against any OpenAI-compatible
server. `python -m clients "prompt"` streams an answer to the terminal.
"""

from clients.client import AsyncClient, Client
from clients.protocol import ClientError

__all__ = ["AsyncClient", "Client", "ClientError"]
