"""The conditions line the in-process tools print: the model, this machine, torch, the date.

(`loadtest.report.Conditions` is the HTTP-side one, for runs against a server that may be
anywhere; `tools.replay` uses it too, so its rows read like a load test's.)
"""

from __future__ import annotations

import datetime as dt
import os
import platform

import torch

from models import LoadedModel


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def conditions(lm: LoadedModel) -> str:
    c = lm.config
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    formats = lm.model.weight_formats()
    weights = "+".join(sorted(formats)) or str(c.matmul_dtype or c.dtype)
    engine = "cbserve kernels" if lm.model.kernels else "pure torch"
    return (
        f"model {lm.name} ({lm.num_parameters():,} params, {c.dtype}, weights {weights}, "
        f"KV {str(c.kv_dtype).removeprefix('torch.')}, {engine}, "
        f"{c.num_layers} layers, d {c.hidden_size}), "
        f"{cores} cores ({cpu_name()}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op threads, "
        f"date {dt.datetime.now(dt.UTC).isoformat(timespec='seconds')}, "
        # other processes on these cores distort every figure: show how busy the machine was
        f"load average {os.getloadavg()[0]:.2f} at start"
    )
