"""Random GGUF block rows and the reference arithmetic the quantized kernels must repeat: the
rows' fp16 scales placed so any other byte is a valid block, the kernels' rounding of int8
activations, the gated epilogues' torch activations, and a mixture of experts' weights and routes.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from models import ops
from models.quant import GGMLTensor

# byte offsets of each block's fp16 scales (the other bytes: any pattern is a valid block)
SCALES = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),  # its sub-block scales are in the random bytes: all 64 values occur
    Q.MXFP4: (),  # its scale is a power of two: an exponent byte (`random_rows`)
}


def random_rows(qtype: Q, n: int, k: int, seed: int = 0) -> GGMLTensor:
    """n rows of k values in `qtype`: random bytes with fp16 scales of either sign."""
    rng = np.random.default_rng(seed)
    values, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // values, size), dtype=np.uint8)
    for off in SCALES[qtype]:
        scale = rng.uniform(0.002, 0.01, (n, k // values)) * rng.choice([-1, 1], (n, k // values))
        raw[..., off : off + 2] = scale.astype(np.float16).view(np.uint8).reshape(n, -1, 2)
    if qtype == Q.MXFP4:  # scales 2^-12 .. 2^-8 (times values up to 12)
        raw[..., 0] = rng.integers(116, 121, (n, k // values), dtype=np.uint8)
    return GGMLTensor([(int(qtype), torch.from_numpy(raw.reshape(n, -1)))], k)


def linear(x, packed, bias=None, residual=None, act=0):
    p = packed
    return p.op(x, p.qs, p.d, p.m, p.kind, p.out_features, bias, residual, act)


def round_activations(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the kernel's int8 activations stand for it: per `group` inputs q = round(x / d),
    d = max|x| / 127 (the kernel's own float32 arithmetic, ties to even)."""
    m, k = x.shape
    xb = x.view(m, k // group, group)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros(()))
    return (torch.round(xb * inv) * d).view(m, k)


def group_of(qtype: Q) -> int:
    """The inputs per int8 activation scale: 256 for the K formats (llama.cpp's Q8_K), 32 for
    the rest (IQ4_XS's 256-value blocks have a scale per 32 values)."""
    return 256 if qtype in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K) else 32


# Each gated epilogue and torch's own activation it must match (GeGLU: the tanh GELU).
GATED = {
    ops.Act.SILU_MUL: F.silu,
    ops.Act.GELU_MUL: lambda g: F.gelu(g, approximate="tanh"),
}


def moe_weights(n_experts: int, k: int, f: int, d: int, up_type: Q, down_type: Q, seed: int = 0):
    """Every expert's [gate; up] (2f x k) and down (d x f) GGUF rows in one byte tensor, as a
    file map holds them, and `ops.moe_experts`' tables; with each expert's GGMLTensors."""
    raws, tables, experts, offset = [], {"gate_up": [], "down": []}, [], 0
    for e in range(n_experts):
        gate = random_rows(up_type, f, k, seed=seed + 3 * e)
        up = random_rows(up_type, f, k, seed=seed + 3 * e + 1)
        down = random_rows(down_type, d, f, seed=seed + 3 * e + 2)
        rows = []
        for w in (gate, up, down):
            ((typ, raw),) = w.parts
            rows.append([typ, raw.shape[0], offset])
            raws.append(raw.reshape(-1))
            offset += raw.numel()
        tables["gate_up"].append(rows[:2])
        tables["down"].append(rows[2:])
        experts.append((GGMLTensor.cat([gate, up]), down))

    def table(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        t = tables[name]
        index = torch.tensor([0] + [len(r) for r in t]).cumsum(0)
        return torch.tensor([r for rows in t for r in rows]), index

    return (torch.cat(raws), *table("gate_up"), *table("down"), d), experts


def routes(t: int, n_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(n_experts, generator=g)[:top_k] for _ in range(t)])
    weights = torch.rand(t, top_k, generator=g) + 0.1
    return ids, weights / weights.sum(-1, keepdim=True)
