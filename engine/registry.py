"""The one list of engines by short name, and `make_engine` to build one.

Classes are named by "module:attribute" and imported on first use, so the command lines can list
the names (`--engine` choices, `--help`) without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.core import EngineBase
    from engine.interface import EngineConfig
    from models.base import CausalLM, LoadedModel

# short name -> implementation. A new engine is a class implementing `engine.interface.Engine`
# whose constructor takes (model, config: EngineConfig | None = None, **config fields), plus a
# line here.
ENGINES: dict[str, str] = {
    "continuous": "engine.batch:ContinuousBatchEngine",
    "static": "engine.batch:StaticBatchEngine",
    "naive": "engine.core:NaiveEngine",
    "disaggregated": "engine.disaggregated:DisaggregatedEngine",
}


def engine_names() -> list[str]:
    return list(ENGINES)


def engine_class(kind: str) -> type[EngineBase]:
    """The class registered under `kind`; ValueError listing the names if there is none."""
    try:
        module, _, attr = ENGINES[kind].partition(":")
    except KeyError:
        raise ValueError(f"unknown engine {kind!r}; choose one of {sorted(ENGINES)}") from None
    return getattr(importlib.import_module(module), attr)


def make_engine(
    kind: str,
    model: CausalLM | LoadedModel,
    config: EngineConfig | None = None,
    **options: object,
) -> EngineBase:
    """Build an engine by its short name: `make_engine("continuous", model, max_batch_size=8)`
    or `make_engine("static", model, EngineConfig(...))`."""
    return engine_class(kind)(model, config, **options)
