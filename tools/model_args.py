"""The model-loading flags the in-process tools share, and loading a model from them."""

from __future__ import annotations

import argparse

from models import LoadedModel, load_model


def add_model_args(ap: argparse.ArgumentParser, dtype: bool = True) -> None:
    """--quantization and --kv-cache-dtype (and --dtype), as `load_model` takes them."""
    if dtype:
        ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--quantization", default="auto", help="auto|none|q8_0|q4_1 (load_model)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto|float32|float16|int8")
    ap.add_argument("--activation-dtype", default="auto", help="auto|int8|float32")


def load_from_args(args: argparse.Namespace) -> LoadedModel:
    return load_model(
        args.model,
        dtype=getattr(args, "dtype", None),
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        activations=args.activation_dtype,
    )
