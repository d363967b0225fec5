"""The project's kernel ops (`torch.ops.cbserve`, built by `models.kernels`), wrapped.

Owns every call into the library: one function per op, its arguments named, and the integer
codes the ops take defined once for both sides: `Kind` (how a packed weight's blocks are stored)
and `Act` (what a packed linear's epilogue computes) are IntEnums whose values
models/csrc/enums.h mirrors (`enum_values` reads the C++ side; tests/test_kernels_opcheck.py
checks that the two agree). It also registers each op's fake (shape-only) implementation, which
`torch.library.opcheck` and tracing use.

No other module calls `torch.ops.cbserve`: the ops exist once `models.kernels.available()` is
True, and a wrapper called where they cannot be built raises `RuntimeError` saying why.
"""

from __future__ import annotations

import threading
from enum import IntEnum
from typing import NamedTuple

import torch


class Kind(IntEnum):
    """A packed weight's block format (`models.quant`): 32 inputs a block, 16 outputs a panel."""

    F32 = 0  # float weights in the panel layout
    Q8_0 = 1  # int8 x fp16 scale
    Q4_1 = 2  # 4-bit x fp16 scale + fp16 min (GGUF's Q4_0 too)
    Q8_0X = 3  # Q8_0 laid out for int8 activations (AVX512-VNNI)
    Q4_1X = 4  # Q4_1 laid out for int8 activations (AVX512-VNNI)
    GGML = 5  # GGUF rows as the file holds them (`models.quant.GGMLTensor`), float32 activations
    GGML_A8 = 6  # the same rows, int8 activations


class Act(IntEnum):
    """What a packed linear's epilogue emits."""

    NONE = 0  # x @ W^T (+ bias) (+ residual)
    SILU_MUL = 1  # silu(gate) * up of a gate/up panel layout (`models.quant.pack(gate_up=True)`)
    GELU_MUL = 2  # gelu_tanh(gate) * up (GeGLU), the same layout
    # gpt-oss's clamped SwiGLU: gate <= 7, -7 <= up <= 7, (up + 1) * gate * sigmoid(1.702 gate)
    SWIGLU_OAI = 3


_lock = threading.Lock()
_NAMES = (
    "packed_linear",
    "ggml_linear",
    "ggml_rows",
    "moe_experts",
    "rms_norm",
    "head_rms_norm",
    "argmax_rows",
    "top_candidates",
    "attention",
    "decoder_layers",
    "causal_conv1d",
    "gated_delta_rule",
    "mamba2_scan",
    "has_int8_dot",
    "has_amx_tiles",
    "enum_values",
)


def _load() -> None:
    """Load the library (building it if needed), register the fakes and bind each op's overload
    to this module's `_<name>`, so a wrapper's call costs one global lookup."""
    with _lock:
        if globals()["_packed_linear"] is not _unloaded["packed_linear"]:
            return
        from models import kernels  # (kernels imports this module too)

        if not kernels.available():
            raise RuntimeError(
                f"the cbserve kernels are unavailable: {kernels.unavailable_reason()}"
            )
        _register_fakes()
        for name in _NAMES:
            globals()[f"_{name}"] = getattr(torch.ops.cbserve, name).default


def _stub(name: str):
    def call(*args):
        _load()
        return globals()[f"_{name}"](*args)

    return call


_unloaded = {name: _stub(name) for name in _NAMES}
_packed_linear = _unloaded["packed_linear"]
_ggml_linear = _unloaded["ggml_linear"]
_ggml_rows = _unloaded["ggml_rows"]
_moe_experts = _unloaded["moe_experts"]
_rms_norm = _unloaded["rms_norm"]
_head_rms_norm = _unloaded["head_rms_norm"]
_argmax_rows = _unloaded["argmax_rows"]
_top_candidates = _unloaded["top_candidates"]
_attention = _unloaded["attention"]
_decoder_layers = _unloaded["decoder_layers"]
_causal_conv1d = _unloaded["causal_conv1d"]
_gated_delta_rule = _unloaded["gated_delta_rule"]
_mamba2_scan = _unloaded["mamba2_scan"]
_has_int8_dot = _unloaded["has_int8_dot"]
_has_amx_tiles = _unloaded["has_amx_tiles"]
_enum_values = _unloaded["enum_values"]


def overloads() -> dict[str, torch._ops.OpOverload]:
    """Each op's overload by name (for `torch.library.opcheck`); loads the library."""
    _load()
    return {name: getattr(torch.ops.cbserve, name).default for name in _NAMES}


def packed_linear(
    x: torch.Tensor,
    qs: torch.Tensor,
    d: torch.Tensor | None,
    m: torch.Tensor | None,
    kind: int,
    out_features: int,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    act: int = Act.NONE,
) -> torch.Tensor:
    """x (M, K) float32 @ the packed weight (`models.quant.PackedWeight`: qs, d, m, kind,
    out_features) (+ bias) (+ residual (M, out_features)); with `act=Act.SILU_MUL` (`GELU_MUL`),
    silu(gate) * up (gelu_tanh(gate) * up), (M, out_features / 2), of a gate/up packing. Returns
    float32."""
    return _packed_linear(x, qs, d, m, kind, out_features, bias, residual, act)


def ggml_linear(
    x: torch.Tensor,
    qs: torch.Tensor,
    d: torch.Tensor | None,
    m: torch.Tensor | None,
    kind: int,
    out_features: int,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    act: int = Act.NONE,
) -> torch.Tensor:
    """`packed_linear` for a weight kept as the file's GGUF rows (`models.quant.pack_rows`):
    `qs` the rows' bytes, `m` (parts, 3) int64 of each fused part's (ggml type, rows, byte offset),
    `kind` Kind.GGML (float32 activations) or Kind.GGML_A8 (int8, llama.cpp's Q8_0 / Q8_K forms)."""
    return _ggml_linear(x, qs, d, m, kind, out_features, bias, residual, act)


def ggml_rows(qs: torch.Tensor, ggml_type: int, k: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (any shape) of an embedding table of GGUF blocks of `ggml_type` with `k` values a
    row, decoded to float32 as gguf's dequantize does: ids.shape + (k,)."""
    return _ggml_rows(qs, ggml_type, k, ids)


def moe_experts(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    qs: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_index: torch.Tensor,
    down: torch.Tensor,
    down_index: torch.Tensor,
    out_features: int,
    kind: int,
    act: int = Act.SILU_MUL,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """A mixture of experts' MLP outputs (T, d) for x (T, K): per token, the sum over its experts
    (`experts` (T, k) int64 ids, `weights` (T, k) float32) of weight x down(act(gate) * up) of its
    row. Every expert's weights are GGUF rows of `qs`: expert e's gate/up parts are rows
    gate_up_index[e]:gate_up_index[e + 1] of the (parts, 3) table `gate_up` (`ggml_linear`'s `m`
    rows, gate then up), its down projection's likewise (`out_features` rows: d); `kind`
    Kind.GGML or Kind.GGML_A8. `gate_up_bias` (E, 2 f) and `down_bias` (E, d) float32: each
    expert's biases (gpt-oss), added before the act and before the weighting."""
    return _moe_experts(
        x,
        experts,
        weights,
        qs,
        gate_up,
        gate_up_index,
        down,
        down_index,
        out_features,
        kind,
        act,
        gate_up_bias,
        down_bias,
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x / rms(x) * weight over the rows of a 2-D float32 x, plus `residual` (x's shape) when
    given."""
    return _rms_norm(x, weight, eps, residual)


def head_rms_norm(qkv: torch.Tensor, weight: torch.Tensor, head_dim: int, eps: float) -> None:
    """QK-norm IN PLACE: in each row of a contiguous 2-D float32 qkv, head j (of `head_dim`
    values) for j < weight.shape[0] becomes head / rms(head) * weight[j]."""
    _head_rms_norm(qkv, weight, head_dim, eps)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) of a 2-D float32 x (the first maximum; NaN counts as the largest)."""
    return _argmax_rows(x)


def top_candidates(
    x: torch.Tensor, temperatures: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sampled row's candidates, for the rows of a 2-D float32 x whose `temperatures` (B,)
    float32 are > 0: the k largest of x / t, best first (ties: lower id first), as (B, k) values
    and int64 ids (torch's topk of the scaled row), and (B,) log(sum(exp(x / t))). Rows with
    t <= 0 are skipped: -inf values, ids 0, -inf normalizer."""
    return _top_candidates(x, temperatures, k)


def has_int8_dot() -> bool:
    """The CPU multiplies int8 with AVX512-VNNI (and no ATEN_CPU_CAPABILITY cap forbids it)."""
    return bool(_has_int8_dot())


def has_amx_tiles() -> bool:
    """The CPU has AMX-INT8 tiles and Linux granted them (Sapphire Rapids and later), VNNI too,
    and neither CBSERVE_AMX=0 nor an ATEN_CPU_CAPABILITY cap forbids them: GGUF rows of Q4_K and
    Q5_K meet 16 activation rows at a time on the tiles."""
    return bool(_has_amx_tiles())


def attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    num_decode: int,
    decode_tables: torch.Tensor,
    decode_lens: torch.Tensor,
    chunk_meta: torch.Tensor,
    chunk_tables: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    window: int = 0,
    interleaved: bool = False,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """RoPE, the K/V write and paged attention of one step's flat batch, in one op.

    qkv (T, (H + 2 KVH) * D) float32, contiguous: q and k heads are roped IN PLACE by cos/sin
    (T, R/2), pair i being (i, i + R/2) (Hugging Face's rotate_half) or, `interleaved`,
    (2i, 2i + 1) (GGML's order, a llama-architecture GGUF's q/k rows as stored), where R is
    the rotated values of a head: D, or fewer for a partial rotary embedding (the rest pass
    through); this step's k and v are written into k_cache / v_cache (IN
    PLACE) at `slots` (T,); then the first `num_decode` tokens attend as decode rows over
    `decode_tables` (B, max_blocks) up to `decode_lens` (B,) keys, and each prefill chunk
    (`chunk_meta` rows [token_start, num_tokens, context_len], `chunk_tables` (C, max_blocks))
    causally over its sequence. Pools: (num_blocks, block_size, KVH, row width) of float32,
    float16 or int8 (`models.config.KVLayout`). `window` > 0: a sliding window, a query at position
    p attends to the keys at positions (p - window, p] only (decode rows and chunks alike).
    `softcap` > 0: each scaled score becomes softcap * tanh(score / softcap) before the softmax
    (Gemma 2's attention logit soft-capping). `sinks` (H,) float32: a logit per query head that
    joins its softmax without a value (gpt-oss's attention sinks); None: no sinks. Returns
    (T, H * D) float32. D: a multiple of 8 up to 512.

    qkv of H * D columns (the queries alone): a layer that attends over K/V an earlier layer
    wrote this step and before (Gemma 4's shared-KV layers): the queries are roped and attend
    over the pools, which are read only.
    """
    return _attention(
        qkv, cos, sin, k_cache, v_cache, slots, num_decode, decode_tables, decode_lens,
        chunk_meta, chunk_tables, num_heads, num_kv_heads, head_dim, scale, window, interleaved,
        softcap, sinks,
    )  # fmt: skip


class Layer(IntEnum):
    """`decoder_layers`' strides: entries a layer in its `weights` and `layout` lists."""

    TENSORS = 21
    INTS = 12


class DecoderLayer(NamedTuple):
    """One layer of `decoder_layers`: what the single ops take for it. `linears`: the packed
    (qs, d, m, kind, out_features, bias) of qkv, o, gate_up and down (`PackedWeight`'s fields);
    `norms`: the RMSNorm weights, 2 (Llama: input, post-attention) or 4 (Gemma 3: input,
    post-attention, pre-FFN, post-FFN); `qk_norm`: `head_rms_norm`'s table or None; `local_rope`:
    the layer rotates with the local tables; `window`: 0 or its sliding window; `ffn_act`: the
    gate/up epilogue (Act.SILU_MUL or GELU_MUL); `rope_interleaved`: `attention`'s
    `interleaved`."""

    linears: tuple[tuple, tuple, tuple, tuple]
    norms: tuple[torch.Tensor, ...]
    qk_norm: torch.Tensor | None
    local_rope: bool
    window: int
    ffn_act: int
    rope_interleaved: bool = False


def decoder_stack(layers: list[DecoderLayer]) -> tuple[list[torch.Tensor | None], list[int]]:
    """`decoder_layers`' flat `weights` and `layout` lists for `layers` (made once per model):
    per layer the norms (4 slots), the QK-norm table, each linear's (qs, d, m, bias); and each
    linear's (kind, out_features), the local-RoPE flag, the window, the FFN act and the RoPE
    pairing."""
    weights: list[torch.Tensor | None] = []
    layout: list[int] = []
    for layer in layers:
        if len(layer.norms) not in (2, 4):
            raise ValueError(f"a layer has 2 or 4 norms, not {len(layer.norms)}")
        weights += [*layer.norms, *[None] * (4 - len(layer.norms)), layer.qk_norm]
        for qs, d, m, kind, n, bias in layer.linears:
            weights += [qs, d, m, bias]
            layout += [int(kind), int(n)]
        layout += [int(layer.local_rope), int(layer.window), int(layer.ffn_act)]
        layout.append(int(layer.rope_interleaved))
    return weights, layout


def decoder_layers(
    x: torch.Tensor,
    weights: list[torch.Tensor | None],
    layout: list[int],
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    rope: tuple[torch.Tensor, torch.Tensor],
    local_rope: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    num_decode: int,
    decode_tables: torch.Tensor,
    decode_lens: torch.Tensor,
    chunk_meta: torch.Tensor,
    chunk_tables: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    eps: float,
    final_norm: torch.Tensor,
    softcap: float = 0.0,
) -> torch.Tensor:
    """A decoder's layer stack and final norm in one op: per layer what `rms_norm`, the linears
    (`packed_linear` / `ggml_linear` by kind), `head_rms_norm` and `attention` compute one by one
    (Llama's layer, skip connections in the projections' epilogues, or Gemma 3's four norms),
    with the same arguments, so the result is those ops' bit for bit. `weights`, `layout`:
    `decoder_stack`'s lists; `k_caches` / `v_caches`: each layer's pools (written IN PLACE);
    `rope` / `local_rope`: the (cos, sin) halves of the global and the sliding-window layers;
    the rest as `attention` takes them. x (T, d) float32; returns the normed hidden (T, d)."""
    return _decoder_layers(
        x, weights, layout, k_caches, v_caches, *rope, *local_rope, slots, num_decode,
        decode_tables, decode_lens, chunk_meta, chunk_tables, num_heads, num_kv_heads, head_dim,
        scale, eps, final_norm, softcap,
    )  # fmt: skip


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_pool: torch.Tensor,
    seqs: torch.Tensor,
    snapshots: torch.Tensor,
    silu: bool,
) -> torch.Tensor:
    """A depthwise causal convolution over time of x (T, C) float32 (rows may be strided) with
    weight (C, K) (w[:, 0] meets the oldest input), each sequence of `seqs` (S, 3) int64 rows
    [first token, tokens, slot] continuing the K - 1 inputs kept in its slot of `conv_pool`
    (slots, K - 1, C) float32, which then holds its last K - 1 inputs (IN PLACE); `snapshots`
    (P, 3) int64 rows [sequence, tokens after which, slot], sorted, copy the inputs kept at that
    point into another slot; + bias (C,), then SiLU if `silu`. Returns (T, C) float32."""
    return _causal_conv1d(x, weight, bias, conv_pool, seqs, snapshots, silu)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_pool: torch.Tensor,
    seqs: torch.Tensor,
    snapshots: torch.Tensor,
    tiled: bool,
) -> torch.Tensor:
    """Gated DeltaNet's recurrence, token by token per value head over the state in each
    sequence's slot of `ssm_pool` (slots, Hv, dk, dv) float32 (IN PLACE; `seqs` and `snapshots`
    as `causal_conv1d` takes them): S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q,
    with q, k (T, Hk, dk) L2-normalised (eps 1e-6) and q scaled by dk^-0.5; v (T, Hv, dv); g, beta
    (T, Hv). Value head h reads q/k head h % Hk (`tiled`) or h // (Hv / Hk). Returns o (T, Hv, dv)
    float32."""
    return _gated_delta_rule(q, k, v, g, beta, ssm_pool, seqs, snapshots, tiled)


def mamba2_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_pool: torch.Tensor,
    seqs: torch.Tensor,
    snapshots: torch.Tensor,
) -> torch.Tensor:
    """Mamba2's selective scan, token by token per head over the state in each sequence's slot
    of `ssm_pool` (slots, H, head_dim, N) float32 (IN PLACE; `seqs` and `snapshots` as
    `causal_conv1d` takes them): dt = softplus(dt + dt_bias); S <- exp(dt A) S + dt x B^T;
    y = S C + D x, head h reading group h // (H / G) of B and C. x (T, H, head_dim), dt (T, H),
    a, d, dt_bias (H), b, c (T, G, N), all float32 (rows may be strided). Returns y
    (T, H, head_dim) float32."""
    return _mamba2_scan(x, dt, a, b, c, d, dt_bias, ssm_pool, seqs, snapshots)


def enum_values() -> dict[str, int]:
    """The C++ side's codes, {"Kind.F32": 0, ...}: what `Kind`, `Act` and `Layer` must equal."""
    text = _enum_values()
    return {name: int(value) for name, value in (line.split("=") for line in text.split())}


def _register_fakes() -> None:
    """Shape-only implementations (for torch.library.opcheck, fake tensors, torch.compile)."""

    @torch.library.register_fake("cbserve::packed_linear")
    def _(x, qs, d, m, kind, N, bias, residual, act):  # noqa: N803
        return x.new_empty((x.shape[0], N if act == Act.NONE else N // 2))

    @torch.library.register_fake("cbserve::ggml_linear")
    def _(x, qs, d, m, kind, N, bias, residual, act):  # noqa: N803
        return x.new_empty((x.shape[0], N if act == Act.NONE else N // 2))

    @torch.library.register_fake("cbserve::ggml_rows")
    def _(qs, typ, K, ids):  # noqa: N803
        return torch.empty((*ids.shape, K), dtype=torch.float32, device=qs.device)

    @torch.library.register_fake("cbserve::moe_experts")
    def _(x, experts, weights, qs, gate_up, gate_up_index, down, down_index, out_features, *_):
        return x.new_empty((x.shape[0], out_features))

    @torch.library.register_fake("cbserve::rms_norm")
    def _(x, w, eps, residual=None):
        return torch.empty_like(x)

    @torch.library.register_fake("cbserve::head_rms_norm")
    def _(qkv, w, head_dim, eps):
        return None

    @torch.library.register_fake("cbserve::argmax_rows")
    def _(x):
        return x.new_empty((x.shape[0],), dtype=torch.long)

    @torch.library.register_fake("cbserve::top_candidates")
    def _(x, temps, k):
        b = x.shape[0]
        return x.new_empty((b, k)), x.new_empty((b, k), dtype=torch.long), x.new_empty((b,))

    @torch.library.register_fake("cbserve::decoder_layers")
    def _(x, *args):
        return torch.empty_like(x)

    @torch.library.register_fake("cbserve::causal_conv1d")
    def _(x, weight, bias, conv_pool, seqs, snapshots, silu):
        return x.new_empty(x.shape)

    @torch.library.register_fake("cbserve::gated_delta_rule")
    def _(q, k, v, g, beta, ssm_pool, seqs, snapshots, tiled):
        return v.new_empty(v.shape)

    @torch.library.register_fake("cbserve::mamba2_scan")
    def _(x, dt, a, b, c, d, dt_bias, ssm_pool, seqs, snapshots):
        return x.new_empty(x.shape)

    @torch.library.register_fake("cbserve::attention")
    def _(qkv, cos, sin, k_cache, v_cache, slots, nd, dt, dl, cm, ct, H, KVH, D, *rest):  # noqa: N803
        return qkv.new_empty((qkv.shape[0], H * D))
