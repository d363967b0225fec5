"""The HTTP edge: an OpenAI-compatible FastAPI app over the engine (docs/architecture.md says
which module owns what).

`create_app(tokenizer, card, engine_client, settings)` builds the app; `EngineClient` is the seam
to the engine and `AsyncEngineDriver` its in-process implementation; `python -m server` runs it.
Names are imported lazily, so importing the package alone loads no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "create_app": "server.http.app",
    "ServerSettings": "server.http.app",
    "AsyncEngineDriver": "server.engine_client.driver",
    "EngineClient": "server.engine_client.interface",
    "EngineObserver": "server.engine_client.interface",
    "Health": "server.engine_client.interface",
    "OutputStream": "server.engine_client.interface",
    "ModelCard": "server.openai.protocol",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'server' has no attribute {name!r}")
