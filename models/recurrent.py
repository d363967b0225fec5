"""The recurrent mixers' sequence ops over a step's state slots: the short causal convolution
with its history (LFM2, Gated DeltaNet, Mamba2), the gated delta rule (Qwen3.5, Qwen3-Next) and
the Mamba2 selective scan (Granite 4.0-H).

Each op takes one step's flat token batch and its `models.state.StateMetadata`: per sequence,
its tokens in the batch and the slot of the state pools it starts from and leaves its new state
in, and the snapshots to copy out on the way (the state after some of its tokens). A decode row
is a sequence of one token; all rows of a step go through one op call per layer.

Every op has a pure-torch reference here and a C++ kernel (`models.ops`, csrc/recurrent.cpp)
that computes the same recurrence token by token; `use_kernel` picks. The recurrences run
token by token in prefill too (as llama.cpp's CPU ops do): a row's result is then the same
whatever the chunks its prompt was split into and whatever else shares the step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from models import ops
from models.state import StateMetadata

# torch's element-wise CPU loops compute full vectors of 2 x 8 (AVX2) or 2 x 16 (AVX-512)
# floats with one formula and a remainder with another (exp, sigmoid, ... differ in the last
# bit), and split a tensor over threads past 32,768 elements: where a row's values fall then
# depends on the rows beside it. `rowwise` pads each row to a multiple of 64 floats and calls
# in slabs of at most 32,768, so every value takes the vector path whatever the batch.
_ROW_MULTIPLE = 64
_SLAB = 32_768


def rowwise(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    """fn (element-wise) over 2-D tensors xs (T, W) of one shape, each row's result independent
    of the other rows (see above). -> (T, W)."""
    t, w = xs[0].shape
    wp = -(-w // _ROW_MULTIPLE) * _ROW_MULTIPLE
    padded = [F.pad(x, (0, wp - w)) if wp != w else x.contiguous() for x in xs]
    rows = max(1, _SLAB // wp)
    if t <= rows:
        return fn(*padded)[:, :w]
    parts = [fn(*(x[i : i + rows] for x in padded)) for i in range(0, t, rows)]
    return torch.cat(parts)[:, :w]


def _kernel(use_kernel: bool, *tensors: torch.Tensor) -> bool:
    return use_kernel and all(t.dtype == torch.float32 for t in tensors)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_pool: torch.Tensor,
    state: StateMetadata,
    silu: bool,
    use_kernel: bool = False,
) -> torch.Tensor:
    """Depthwise causal convolution over time of x (T, C) with weight (C, K) (w[:, 0] meets the
    oldest input), each sequence continuing the K - 1 inputs kept in its slot of `conv_pool`
    (slots, K - 1, C), which then holds its last K - 1 inputs; (+ bias) (then SiLU). -> (T, C)."""
    if _kernel(use_kernel, x, weight, conv_pool):
        return ops.causal_conv1d(x, weight, bias, conv_pool, state.seqs, state.snapshots, silu)
    k = weight.shape[1]
    out = torch.empty_like(x)
    for start, n, slot, snaps in state.rows():
        xs = torch.cat([conv_pool[slot], x[start : start + n]])  # (K - 1 + n, C)
        y = xs[k - 1 : k - 1 + n] * weight[:, k - 1]
        for j in range(k - 2, -1, -1):
            y = y + xs[j : j + n] * weight[:, j]
        if bias is not None:
            y = y + bias
        out[start : start + n] = F.silu(y) if silu else y
        for after, dst in snaps:
            conv_pool[dst] = xs[after : after + k - 1]
        conv_pool[slot] = xs[n:]
    return out


def v_head_map(num_k_heads: int, num_v_heads: int, tiled: bool) -> torch.Tensor:
    """The q/k head each value head reads: h % Hk (tiled, llama.cpp's qwen35 order) or
    h // (Hv / Hk) (grouped, Hugging Face's)."""
    h = torch.arange(num_v_heads)
    return h % num_k_heads if tiled else h // (num_v_heads // num_k_heads)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (Gated DeltaNet's q/k norm, FLA's)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_pool: torch.Tensor,
    state: StateMetadata,
    tiled: bool,
    use_kernel: bool = False,
) -> torch.Tensor:
    """The gated delta rule, token by token, per value head h (state S (dk, dv) in its slot of
    `ssm_pool` (slots, Hv, dk, dv)):

        S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t

    q, k (T, Hk, dk) raw (L2-normalised here, q scaled by dk^-0.5), v (T, Hv, dv), g (T, Hv) the
    log decay, beta (T, Hv). Value head h reads q/k head `v_head_map(...)[h]`. -> (T, Hv, dv)."""
    if _kernel(use_kernel, q, k, v, g, beta, ssm_pool):
        return ops.gated_delta_rule(q, k, v, g, beta, ssm_pool, state.seqs, state.snapshots, tiled)
    hk, hv = q.shape[1], v.shape[1]
    heads = v_head_map(hk, hv, tiled)
    q = (l2norm(q) * q.shape[-1] ** -0.5)[:, heads]  # (T, Hv, dk)
    k = l2norm(k)[:, heads]
    decay = g.exp()
    out = torch.empty_like(v)
    for start, n, slot, snaps in state.rows():
        s = ssm_pool[slot].clone()  # (Hv, dk, dv)
        at = dict(snaps)
        for i in range(n):
            t = start + i
            s.mul_(decay[t][:, None, None])
            kv = torch.einsum("hk,hkv->hv", k[t], s)
            delta = beta[t][:, None] * (v[t] - kv)
            s.add_(k[t][:, :, None] * delta[:, None, :])
            out[t] = torch.einsum("hk,hkv->hv", q[t], s)
            if i + 1 in at:
                ssm_pool[at[i + 1]] = s
        ssm_pool[slot] = s
    return out


def mamba2_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_pool: torch.Tensor,
    state: StateMetadata,
    use_kernel: bool = False,
) -> torch.Tensor:
    """Mamba2's selective scan, token by token, per head h (state S (head_dim, N) in its slot
    of `ssm_pool` (slots, H, head_dim, N)), h reading group g = h // (H / G) of B and C:

        dt_t = softplus(dt_raw + dt_bias);  S <- exp(dt_t A) S + dt_t x_t B_t^T;  y_t = S C_t + D x_t

    x (T, H, head_dim), dt (T, H) raw, a (H) (A = -exp(A_log)), b, c (T, G, N), d, dt_bias (H).
    -> y (T, H, head_dim)."""
    if _kernel(use_kernel, x, dt, a, b, c, d, dt_bias, ssm_pool):
        return ops.mamba2_scan(x, dt, a, b, c, d, dt_bias, ssm_pool, state.seqs, state.snapshots)
    t, nh, _ = x.shape
    groups = b.shape[1]
    heads = torch.arange(nh) // (nh // groups)
    dt = F.softplus(dt + dt_bias)  # (T, H)
    decay = torch.exp(dt * a)
    bh, ch = b[:, heads], c[:, heads]  # (T, H, N)
    out = torch.empty_like(x)
    for start, n, slot, snaps in state.rows():
        s = ssm_pool[slot].clone()  # (H, head_dim, N)
        at = dict(snaps)
        for i in range(n):
            j = start + i
            s.mul_(decay[j][:, None, None])
            s.add_((dt[j][:, None] * x[j])[:, :, None] * bh[j][:, None, :])
            out[j] = torch.einsum("hpn,hn->hp", s, ch[j]) + d[:, None] * x[j]
            if i + 1 in at:
                ssm_pool[at[i + 1]] = s
        ssm_pool[slot] = s
    return out
