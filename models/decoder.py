"""The decoder pieces every family builds from: RMSNorm, RoPE, grouped-query attention
(optionally QK-normed, sliding-window, soft-capped), gated MLPs (SwiGLU, GeGLU), and
`DecoderForCausalLM`, the model around a stack of layers (embedding, head, loading under Hugging
Face names, packing for the kernels, the layer stack as one op).

A family is a layer class (`models.llama`'s pre-norm layer, `models.gemma3`'s four-norm one,
`models.moe`'s sparse MLP) on these pieces, chosen per layer by its model class
(`DecoderForCausalLM.layer_classes`). Each layer names its own checkpoint tensors, loads and
packs itself (`DecoderLayer`), so layers of different kinds mix in one stack. Attention goes
through `models.attention` with explicit metadata, so no module holds per-request state. Q/K/V
and gate/up are fused into one projection each: one matmul instead of three (or two) per layer,
which matters on CPU where every op has overhead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple, Self

import torch
import torch.nn.functional as F
from torch import nn

from models import ops
from models.attention import AttentionMetadata, paged_attention
from models.base import is_stand_in
from models.config import ModelConfig, RopeScaling, YarnScaling
from models.cpu import has_native_bf16
from models.ops import Act, Kind
from models.quant import (
    KIND_NAMES,
    Q8_0X,
    BlockEmbedding,
    GGMLTensor,
    PackedWeight,
    PanelEmbedding,
    RowsEmbedding,
)

if TYPE_CHECKING:
    from models.packing import Packer


def _inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """RoPE frequencies; `local`: of the layers flagged so (`Attention.local_rope`): Gemma 3's
    sliding-window ones (their own base, unscaled), SmolLM3's NoPE ones (all zero: cos 1, sin 0,
    q and k as they are)."""
    hd = config.rope_dims
    if local and config.nope_layers is not None:
        return torch.zeros(hd // 2, dtype=torch.float64)
    theta = config.rope_local_theta if local else config.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    if local:
        return inv
    if config.rope_linear_factor != 1.0:
        inv = inv / config.rope_linear_factor
    rs: RopeScaling | None = config.rope_scaling
    if rs is not None:
        # Llama 3: leave high frequencies alone, divide low ones by `factor`, blend in between.
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        scaled = torch.where(mid, (1 - smooth) * inv / rs.factor + smooth * inv, scaled)
        inv = scaled
    if config.rope_yarn is not None:
        inv = _yarn(inv, config.rope_yarn, hd, theta)
    factors = config.rope_long_factors if config.rope_long else config.rope_freq_factors
    if factors is not None:
        if len(factors) != hd // 2:
            raise ValueError(f"RoPE frequency factors: {len(factors)} entries, not {hd // 2}")
        inv = inv / torch.tensor(factors, dtype=torch.float64)
    return inv


def _yarn(inv: torch.Tensor, y: YarnScaling, dim: int, theta: float) -> torch.Tensor:
    """YaRN's frequencies (transformers' _compute_yarn_parameters, ggml's rope_yarn): each
    `inv` kept (extrapolated) below the correction range's low dim, divided by the factor
    (interpolated) above its high one, blended linearly between."""

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times
        original = y.original_max_position_embeddings
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (as both do: no division by zero)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp  # the share of the original frequency
    return inv / y.factor * ramp + inv * extrapolated


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    if all(is_stand_in(p) for p in parts):
        return parts[0][:1, :1].expand(sum(p.shape[0] for p in parts), parts[0].shape[1])
    return torch.cat(parts, dim=0)


class _SkipInit(torch.overrides.TorchFunctionMode):
    """Skip `torch.nn.init.*` (they dispatch through torch function modes); run all else."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


class Rotary(nn.Module):
    """cos/sin of RoPE for the step's positions (HF 'rotate_half' layout), computed per step:
    a table for the whole context would hold context x head_dim values twice per RoPE base
    (Gemma 3's 32k context x 256 x 2 bases: 128 MB), where a step needs a few rows."""

    def __init__(self, config: ModelConfig, local: bool = False) -> None:
        super().__init__()
        self.dtype = config.dtype
        self.register_buffer("inv_freq", _inv_freq(config, local), persistent=False)  # float64
        # LongRoPE's attention factor multiplies cos and sin: the rotated values of q and k, not
        # the ones a partial rotary embedding passes through (so not the softmax scale).
        self.mscale = 1.0 if local else config.rope_attention_factor

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, R/2) float64 cos and sin, R the rotated values of a head."""
        freqs = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        if self.mscale == 1.0:
            return freqs.cos(), freqs.sin()
        return freqs.cos() * self.mscale, freqs.sin() * self.mscale

    def halves(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Only the (T, R/2) float32 cos and sin the fused attention kernel takes (what
        `forward(..., halves=True)` adds), for the planned layer loop, which needs no others."""
        cos_h, sin_h = self._cos_sin(positions)
        return cos_h.to(self.dtype).float(), sin_h.to(self.dtype).float()

    def forward(self, positions: torch.Tensor, halves: bool = False) -> RopeTables:
        """cos and signed sin for these positions, (T, 1, R) each: computed once per step and
        shared by every layer; with `halves`, also the plain (T, R/2) tables the fused
        attention kernel takes."""
        cos_h, sin_h = self._cos_sin(positions)
        # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi]: fold the sign in here.
        cos = torch.cat([cos_h, cos_h], dim=-1).to(self.dtype).unsqueeze(1)  # (T, 1, R)
        signed = torch.cat([-sin_h, sin_h], dim=-1).to(self.dtype).unsqueeze(1)
        if not halves:
            return RopeTables(cos, signed)
        return RopeTables(
            cos,
            signed,
            cos_h.to(self.dtype).float().contiguous(),
            sin_h.to(self.dtype).float().contiguous(),
        )


class RopeTables(NamedTuple):
    cos: torch.Tensor  # (T, 1, R): R the rotated values of a head (`ModelConfig.rope_dims`)
    sin: torch.Tensor  # (T, 1, R), sign of rotate_half folded in
    cos_half: torch.Tensor | None = None  # (T, R/2) float32, for the fused kernel
    sin_half: torch.Tensor | None = None


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """x: (T, heads, hd) with cos/sin from `Rotary.forward`. `interleaved`: x's head values in
    GGML's order, pair i being (2i, 2i + 1) rather than (i, i + hd/2). Tables narrower than hd
    (a partial rotary embedding) rotate the first values only; the rest pass through."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        rotated = apply_rotary(x[..., :rot], cos, sin, interleaved)
        return torch.cat([rotated, x[..., rot:]], dim=-1)
    if interleaved:
        half = x.shape[-1] // 2
        c, s = cos[..., :half], sin[..., half:]  # (T, 1, hd/2): the tables' halves
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


_NATIVE_BF16 = has_native_bf16()

# The gated MLPs' activations by `ModelConfig.hidden_act`, as the kernels' epilogue codes.
GATED_ACTS = {"silu": Act.SILU_MUL, "gelu_tanh": Act.GELU_MUL, "swiglu_oai": Act.SWIGLU_OAI}
# gpt-oss's clamped SwiGLU (transformers' swiglu_alpha / swiglu_limit; llama.cpp's constants)
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0


def gated_act(act: int, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up for a gated MLP (`Act` code): what the kernels' epilogues compute."""
    if act == Act.SWIGLU_OAI:
        gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
        up = up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
        return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA))
    if act == Act.GELU_MUL:
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate) * up


class Linear(nn.Linear):
    """nn.Linear whose matmul may run in a narrower dtype than the activations around it.

    With bfloat16 weights (`load_model(..., dtype="bfloat16")`) the input is rounded to bfloat16
    for the matmul only and the result comes back in the activations' dtype, so the residual
    stream, norms, attention and logits stay float32. Running the whole model in bfloat16 instead
    turned SmolLM2's "The capital of France is Paris." into "L'Étoile, la Marseillaise, ...".

    On a CPU without native bfloat16 (AVX2), torch's emulated bfloat16 GEMM loses enough
    precision against SmolLM2's massive activations (~25,000 in one channel) to change that same
    answer, so there the bfloat16 operands are widened and multiplied in float32: the same
    rounding of inputs and weights as the native path, exact accumulation. (It saves memory, not
    time; `--dtype auto` picks float32 on such CPUs.)
    """

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T (+ bias), plus `residual` when given (the decoder's skip connection)."""
        w = self.weight
        if w.dtype == x.dtype:
            y = F.linear(x, w, self.bias)
        elif w.dtype == torch.bfloat16 and not _NATIVE_BF16:
            y = F.linear(x.to(w.dtype).to(x.dtype), w.to(x.dtype), self.bias)
        else:
            y = F.linear(x.to(w.dtype), w, self.bias).to(x.dtype)
        return y if residual is None else residual + y

    def gated(self, x: torch.Tensor, act: int) -> torch.Tensor:
        """act(gate) * up for a fused [gate; up] projection (`gated_act`)."""
        gate, up = self(x).chunk(2, dim=-1)
        return gated_act(act, gate, up)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for a fused [gate; up] projection."""
        gate, up = self(x).chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up for a fused [gate; up] projection (GeGLU)."""
        gate, up = self(x).chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class PackedLinear(nn.Module):
    """A projection whose weight lives in packed blocks (`models.quant`), multiplied by the
    cbserve kernel with float32 activations; the bias, the residual add and a gated MLP's
    act(gate) * up (SwiGLU, GeGLU) happen in the kernel's epilogue rather than as separate passes."""

    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.packed = packed
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    def _run(self, x: torch.Tensor, residual: torch.Tensor | None, act: int) -> torch.Tensor:
        p = self.packed
        return p.op(
            x, qs=p.qs, d=p.d, m=p.m, kind=p.kind, out_features=p.out_features,
            bias=self.bias, residual=residual, act=act,
        )  # fmt: skip

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self._run(x, residual, Act.NONE)

    def gated(self, x: torch.Tensor, act: int) -> torch.Tensor:
        return self._run(x, None, act)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, None, Act.SILU_MUL)

    def gelu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, None, Act.GELU_MUL)

    def extra_repr(self) -> str:
        kind = KIND_NAMES[self.packed.kind]
        return f"in={self.in_features}, out={self.out_features}, weights={kind}"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    fused = False  # set by `pack`: one pass in the cbserve kernel instead of ~6 ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dim() == 2 and x.dtype == torch.float32:
            return ops.rms_norm(x, self.weight, eps=self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _qk_norm(qkv: torch.Tensor, weight: torch.Tensor, hd: int, eps: float, fused: bool) -> None:
    """RMSNorm each q and k head of a fused qkv (T, (H + 2 KV) hd) in place, before RoPE (which
    the attention kernel applies): `weight` (H + KV, hd) from `Attention.qk_weight`. `fused`: in
    one kernel op, where torch's rms_norm and the copy back are ~10."""
    if fused:
        ops.head_rms_norm(qkv, weight, hd, eps)
        return
    heads = qkv.view(qkv.shape[0], -1, hd).narrow(1, 0, weight.shape[0])  # (T, H + KV, hd)
    heads.copy_(F.rms_norm(heads, (hd,), eps=eps) * weight)


class Attention(nn.Module):
    """Self-attention of one layer: fused QKV projection, optional per-head QK-norm (Qwen3,
    Gemma 3), RoPE, paged attention over the layer's window, output projection."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.n_heads = config.num_heads
        self.n_kv, self.hd = config.kv_heads_of(layer), config.head_dim_of(layer)
        self.q_size, self.kv_size = self.n_heads * self.hd, self.n_kv * self.hd
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_out_bias)
        # gpt-oss's attention sinks: a logit per query head (`paged_attention`'s `sinks`)
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if config.attention_sinks else None
        self.scale = config.attention_scale or self.hd**-0.5
        self.window = config.window(layer)
        self.softcap = config.attn_logit_softcapping or 0.0
        # Windowed layers rotate with the local RoPE tables where the family has them; NoPE
        # layers take the local tables too, which rotate nothing.
        self.local_rope = (self.window > 0 and config.rope_local_theta is not None) or bool(
            config.nope_layers and config.nope_layers[layer]
        )
        self.rope_interleaved = config.rope_interleaved
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeTables,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        meta: AttentionMetadata,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Self-attention of x (T, d) over the pool, plus `residual` when given."""
        qkv = self.qkv_proj(x)  # (T, (H + 2 KV) * hd)
        if self.q_norm is not None:
            self._norm_qk(qkv)
        return self.o_proj(self.attend(qkv, rope, kv_cache, meta), residual)

    def qk_weight(self) -> torch.Tensor | None:
        """The QK-norm weights as one (H + KV, hd) table, q heads then k heads (`_qk_norm`)."""
        if self.q_norm is None:
            return None
        q, k = self.q_norm.weight, self.k_norm.weight
        return torch.cat([q.expand(self.n_heads, -1), k.expand(self.n_kv, -1)]).contiguous()

    def _norm_qk(self, qkv: torch.Tensor) -> None:
        fused = self.q_norm.fused and qkv.dtype == torch.float32 and qkv.is_contiguous()
        _qk_norm(qkv, self.qk_weight(), self.hd, self.q_norm.eps, fused)

    def attend(
        self,
        qkv: torch.Tensor,
        rope: RopeTables,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """RoPE, K/V into the pool and attention for a fused qkv (T, (H + 2 KV) * hd): the
        kernel when the model runs it, else the reference path. Returns (T, H * hd)."""
        if rope.cos_half is not None and kv_cache is not None:
            # One kernel: RoPE, K/V into the pool, attention reading the pool's blocks in place
            # (keys outside a sliding window masked there too).
            return ops.attention(
                qkv, rope.cos_half, rope.sin_half, *kv_cache, *meta.kernel_args(),
                num_heads=self.n_heads, num_kv_heads=self.n_kv, head_dim=self.hd, scale=self.scale,
                window=self.window, interleaved=self.rope_interleaved, softcap=self.softcap,
                sinks=self.sinks,
            )  # fmt: skip
        t = qkv.shape[0]
        # Rotate q and k in one go: they are adjacent columns of the fused projection.
        qk = apply_rotary(
            qkv[:, : self.q_size + self.kv_size].view(t, self.n_heads + self.n_kv, self.hd),
            rope.cos,
            rope.sin,
            self.rope_interleaved,
        )
        q, k = qk.split([self.n_heads, self.n_kv], dim=1)  # (T, H, hd), (T, KV, hd)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.n_kv, self.hd)  # (T, KV, hd)
        o = paged_attention(
            q, k, v, kv_cache, meta, self.scale, self.window, self.softcap, self.sinks
        )
        return o.reshape(t, self.q_size)

    # -- its checkpoint tensors, under Hugging Face's names below `prefix` ("model.layers.N.") ----

    @staticmethod
    def hf_weight_names(config: ModelConfig, prefix: str) -> set[str]:
        """q/k/v apart (Llama, Qwen) or fused (Phi-3's qkv_proj), o; Qwen2's q/k/v biases,
        gpt-oss's o bias and sinks (named `sinks`, or `sinks.weight` as a GGUF's), and Qwen3's /
        Gemma 3's QK-norm weights where the config has them."""
        a = f"{prefix}self_attn."
        names = {f"{a}{proj}_proj.weight" for proj in ("q", "k", "v", "o", "qkv")}
        if config.attention_bias:
            names.update(f"{a}{proj}_proj.bias" for proj in ("q", "k", "v", "qkv"))
        if config.attention_out_bias:
            names.add(f"{a}o_proj.bias")
        if config.attention_sinks:
            names.update((f"{a}sinks", f"{a}sinks.weight"))
        if config.qk_norm:
            names.update(f"{a}{n}_norm.weight" for n in "qk")
        return names

    def load(self, loader: HFLoader, src: str, dst: str) -> None:
        """Take its parameters (below `dst`) from the checkpoint's tensors below `src`."""
        a, d = f"{src}self_attn.", f"{dst}self_attn."
        qkv = [f"{a}{n}_proj.weight" for n in "qkv"]
        loader.put(f"{d}qkv_proj.weight", loader.fused(f"{a}qkv_proj.weight", qkv))
        if self.qkv_proj.bias is not None:
            qkv_b = [f"{a}{n}_proj.bias" for n in "qkv"]
            loader.put(f"{d}qkv_proj.bias", loader.fused(f"{a}qkv_proj.bias", qkv_b))
        if self.q_norm is not None:
            loader.put(f"{d}q_norm.weight", loader.norm(f"{a}q_norm.weight"))
            loader.put(f"{d}k_norm.weight", loader.norm(f"{a}k_norm.weight"))
        loader.put(f"{d}o_proj.weight", loader.take(f"{a}o_proj.weight"))
        if self.o_proj.bias is not None:
            loader.put(f"{d}o_proj.bias", loader.take(f"{a}o_proj.bias"))
        if self.sinks is not None:
            loader.put(f"{d}sinks", loader.fused(f"{a}sinks", [f"{a}sinks.weight"]))

    def pack(self, packer: Packer, src: str) -> None:
        """Its projections packed from the checkpoint tensors below `src`."""
        a = f"{src}self_attn."
        self.qkv_proj = packer(
            self.qkv_proj,
            [[f"{a}qkv_proj.weight"], [f"{a}{n}_proj.weight" for n in "qkv"]],
        )
        self.o_proj = packer(self.o_proj, [[f"{a}o_proj.weight"]])


class MLP(nn.Module):
    """The gated MLP: down(act(gate) * up) with SiLU (SwiGLU), tanh GELU (GeGLU) or gpt-oss's
    clamped SwiGLU (`gated_act`), with biases where the config has them (`mlp_bias`)."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.ffn = intermediate_size or config.intermediate_size
        self.act = GATED_ACTS[config.hidden_act]
        bias = config.mlp_bias
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.ffn, bias=bias)
        self.down_proj = Linear(self.ffn, config.hidden_size, bias=bias)

    @property
    def gelu(self) -> bool:
        return self.act == Act.GELU_MUL

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.gated(x, self.act), residual)

    # -- its checkpoint tensors, under Hugging Face's names below `prefix` ("model.layers.N.mlp.",
    # or an expert's "model.layers.N.mlp.experts.E.") ----------------------------------------------

    @staticmethod
    def hf_weight_names(config: ModelConfig, prefix: str) -> set[str]:
        """gate/up apart (Llama, Qwen) or fused (Phi-3's gate_up_proj), and down; their biases
        where the config has them."""
        projs = ("gate", "up", "down", "gate_up")
        suffixes = ("weight", "bias") if config.mlp_bias else ("weight",)
        return {f"{prefix}{proj}_proj.{s}" for proj in projs for s in suffixes}

    def load(self, loader: HFLoader, src: str, dst: str) -> None:
        """Take its parameters (below `dst`) from the checkpoint's tensors below `src`."""
        kinds = ("weight", "bias") if self.down_proj.bias is not None else ("weight",)
        for kind in kinds:
            gate_up = [f"{src}{n}_proj.{kind}" for n in ("gate", "up")]
            fused = loader.fused(f"{src}gate_up_proj.{kind}", gate_up)
            loader.put(f"{dst}gate_up_proj.{kind}", fused)
            loader.put(f"{dst}down_proj.{kind}", loader.take(f"{src}down_proj.{kind}"))

    def pack(self, packer: Packer, src: str, rows: bool = False) -> None:
        """Its projections packed from the checkpoint tensors below `src` (`rows`: see
        `models.packing.Packer.packed_weight`)."""
        self.gate_up_proj = packer(
            self.gate_up_proj,
            [[f"{src}gate_up_proj.weight"], [f"{src}{n}_proj.weight" for n in ("gate", "up")]],
            gate_up=True,
            rows=rows,
        )
        self.down_proj = packer(self.down_proj, [[f"{src}down_proj.weight"]], rows=rows)


class HFLoader:
    """`DecoderForCausalLM.load_hf_weights`' helpers, which each layer's `load` uses: checkpoint
    tensors under Hugging Face names into the model's parameters, every one set once."""

    def __init__(
        self,
        params: Mapping[str, nn.Parameter],
        tensors: Mapping[str, torch.Tensor],
        adopt: bool,
        norm_offset: float,
    ) -> None:
        self.params, self.tensors, self.adopt = params, tensors, adopt
        self.norm_offset = norm_offset
        self.loaded: set[str] = set()

    def put(self, name: str, value: torch.Tensor) -> None:
        """Parameter `name` := `value` (shapes must agree)."""
        p = self.params[name]
        if tuple(p.shape) != tuple(value.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != {tuple(p.shape)}")
        if self.adopt:
            p.data = value if is_stand_in(value) else value.to(p.dtype).contiguous()
        else:
            p.copy_(value.to(p.dtype))
        self.loaded.add(name)

    def take(self, name: str) -> torch.Tensor:
        """The checkpoint's tensor `name`; ValueError if it has none."""
        if name not in self.tensors:
            raise ValueError(f"checkpoint is missing tensor {name}")
        return self.tensors[name]

    def fused(self, name: str, parts: list[str]) -> torch.Tensor:
        """The fused tensor `name` if the checkpoint has it, else its `parts` stacked by rows."""
        if name in self.tensors:
            return self.tensors[name]
        # (_cat_rows keeps the loader's stand-ins for weights the kernels read in place)
        return _cat_rows([self.take(p) for p in parts])

    def norm(self, name: str) -> torch.Tensor:
        """An RMSNorm weight, plus the family's offset (`DecoderForCausalLM.hf_norm_offset`)."""
        w = self.take(name)
        return w.float() + self.norm_offset if self.norm_offset else w


class DecoderLayer(nn.Module):
    """What every layer of a `DecoderForCausalLM` is: a module from the residual stream to the
    residual stream that names, loads and packs its own checkpoint tensors. Attention layers keep
    their `Attention` as `self_attn` and their MLP as `mlp`, and name their RMSNorms in `NORMS`
    (Hugging Face names, which `hf_weight_names`, `load` and the layer-stack op read)."""

    NORMS: tuple[str, ...] = ()
    self_attn: Attention
    mlp: nn.Module

    def forward(self, x, rope, kv_cache, meta) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def mlp_weight_names(cls, config: ModelConfig, prefix: str) -> set[str]:
        """The MLP's tensor names below layer `prefix` ("model.layers.N.")."""
        return MLP.hf_weight_names(config, f"{prefix}mlp.")

    @classmethod
    def hf_weight_names(cls, config: ModelConfig, prefix: str) -> set[str]:
        """Every tensor name below `prefix` ("model.layers.N.") a checkpoint may hold for it."""
        names = Attention.hf_weight_names(config, prefix) | cls.mlp_weight_names(config, prefix)
        return names | {f"{prefix}{norm}.weight" for norm in cls.NORMS}

    def load(self, loader: HFLoader, src: str, dst: str) -> None:
        """Its parameters (below `dst`, "layers.N.") from the tensors below `src`."""
        self.self_attn.load(loader, src, dst)
        self.mlp.load(loader, f"{src}mlp.", f"{dst}mlp.")
        for n in self.NORMS:
            loader.put(f"{dst}{n}.weight", loader.norm(f"{src}{n}.weight"))

    def pack(self, packer: Packer, src: str) -> None:
        """Its projections packed from the tensors below `src` ("model.layers.N.")."""
        self.self_attn.pack(packer, src)
        self.mlp.pack(packer, f"{src}mlp.")


EMBED = "model.embed_tokens.weight"


class DecoderForCausalLM(nn.Module):
    """Decoder over a flat token batch: embedding, a stack of `DecoderLayer`s, final RMSNorm and
    head. `forward` returns hidden states; `compute_logits` the head. A family subclasses it
    with its layer class (`layer_class`, or `layer_classes` for one per layer)."""

    layer_class: type[DecoderLayer]
    # Added to every RMSNorm weight a Hugging Face checkpoint holds (Gemma stores w and
    # multiplies by 1 + w; this module multiplies by its weight).
    hf_norm_offset = 0.0
    # The final norm's Hugging Face name (LFM2 calls it embedding_norm).
    FINAL_NORM = "model.norm.weight"

    @classmethod
    def layer_classes(cls, config: ModelConfig) -> list[type[DecoderLayer]]:
        """Each layer's class: `layer_class` for all (a family with layers of several kinds
        chooses per layer from its config)."""
        return [cls.layer_class] * config.num_layers

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            layer(config, i) for i, layer in enumerate(self.layer_classes(config))
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._rotaries(config)

    def _rotaries(self, config: ModelConfig) -> None:
        self.rotary = Rotary(self._global_rope_config(config))
        self.rotary_local = None
        if any(layer.self_attn.local_rope for layer in self.layers):
            self.rotary_local = Rotary(config, local=True)

    def _global_rope_config(self, config: ModelConfig) -> ModelConfig:
        """The config the global layers' RoPE is built from (a family whose global heads differ
        from the sliding layers' gives their shape)."""
        return config

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings (T, d_model), scaled where the family scales them."""
        x = self.embed_tokens(input_ids)
        if self.config.embedding_scale is not None:
            x = x * self._embedding_scale(x.dtype)
        return x

    def ropes(self, positions: torch.Tensor) -> tuple[RopeTables, RopeTables]:
        """The global and the sliding-window layers' RoPE tables for `positions` (the same
        tables where the family has one RoPE)."""
        rope = self.rotary(positions, halves=self.kernels)
        local = rope if self.rotary_local is None else self.rotary_local(positions, self.kernels)
        return rope, local

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: (T,). Returns final hidden states (T, d_model)."""
        x = self.embed(input_ids)  # (T, d)
        if self._plan is not None and kv_caches is not None:
            tables = self.rotary.halves(positions)
            local_tables = (
                tables if self.rotary_local is None else self.rotary_local.halves(positions)
            )
            return self._forward_planned(x, tables, local_tables, kv_caches, meta)
        rope, local = self.ropes(positions)
        for i, layer in enumerate(self.layers):
            layer_rope = local if layer.self_attn.local_rope else rope
            x = layer(x, layer_rope, None if kv_caches is None else kv_caches[i], meta)
        return self.norm(x)

    # `ops.decoder_stack`'s (weights, layout), set by `pack` when every layer is packed
    _plan: tuple[list, list[int]] | None = None

    def _embedding_scale(self, dtype: torch.dtype) -> float:
        """The embedding multiplier rounded to the embedding dtype, as transformers computes it
        (a Python float: one op a step, where a fresh 0-d tensor cost three)."""
        scales = self.__dict__.setdefault("_embedding_scales", {})
        if dtype not in scales:
            scales[dtype] = float(torch.tensor(self.config.embedding_scale).to(dtype))
        return scales[dtype]

    def _forward_planned(self, x, tables, local_tables, kv_caches, meta) -> torch.Tensor:
        """The layer stack as one op (`models.ops.decoder_layers`): what the layers' `forward`
        computes, op for op, without the interpreter between the ops. On SmolLM2 a step's ~180
        kernel calls cost a few microseconds each from Python, ~10% of a batch-1 decode step.
        `tables`, `local_tables`: (cos, sin) halves (`Rotary.halves`) of the global and the
        sliding-window layers."""
        c = self.config
        weights, layout = self._plan
        return ops.decoder_layers(
            x, weights, layout, [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches],
            tables, local_tables, *meta.kernel_args(), c.num_heads, c.num_kv_heads, c.head_dim,
            self.layers[0].self_attn.scale, c.rms_norm_eps, self.norm.weight,
            self.layers[0].self_attn.softcap,
        )  # fmt: skip

    @classmethod
    def without_weights(cls, config: ModelConfig) -> Self:
        """A model whose parameters are allocated but not initialised, for loaders to fill.

        Random init of a 135M-parameter model costs ~1.5 s on 2 cores, all of it thrown away when
        a checkpoint is loaded. `_SkipInit` turns the `torch.nn.init` calls into no-ops for this
        construction only (a torch function mode is thread-local, so other threads building
        models are unaffected). Not the meta device: its `normal_` imports torch._dynamo (1.5 s).
        """
        with _SkipInit():
            return cls(config)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, d_model) -> (N, vocab) in fp32."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def num_parameters(self) -> int:
        n = sum(p.numel() for p in self.parameters())
        for name, mod in self.named_modules():
            if isinstance(mod, PackedLinear) and name != "lm_head":
                n += mod.in_features * mod.out_features + (
                    0 if mod.bias is None else mod.out_features
                )
        if isinstance(self.embed_tokens, BlockEmbedding):
            n += self.embed_tokens.num_embeddings * self.embed_tokens.embedding_dim
        head = self.lm_head
        if isinstance(head, PackedLinear):
            if not self.config.tie_word_embeddings:
                n += head.in_features * head.out_features
        elif self.config.tie_word_embeddings and head.weight is not self.embed_tokens.weight:
            n -= head.weight.numel()  # a bfloat16 copy of the tied table is not a parameter more
        return n

    def num_active_parameters(self) -> int:
        """The parameters one token's forward pass multiplies: all of them (a mixture of experts
        leaves out the experts a token did not choose)."""
        return self.num_parameters()

    # -- serving options -----------------------------------------------------------------------

    def reconfigure(self, config: ModelConfig) -> None:
        """Serve with `config` (the KV pool's dtype, the context and so LongRoPE's factors); the
        RoPE tables follow it."""
        self.config = config
        self._rotaries(config)

    def cast_matmuls(self, dtype: torch.dtype) -> None:
        """Every layer's projections in `dtype`; the head gets its own copy in it (with tied
        embeddings the float32 table stays for the lookup, which reads a few rows, while every
        step reads the whole head)."""
        for layer in self.layers:
            for module in layer.modules():
                if isinstance(module, Linear):
                    module.to(dtype)
        head = self.lm_head
        head.weight = nn.Parameter(head.weight.detach().to(dtype), requires_grad=False)
        self.config = replace(self.config, matmul_dtype=dtype)

    # -- kernels -------------------------------------------------------------------------------

    kernels = False  # True once packed (`models.packing.pack_for_kernels`)

    @torch.no_grad()
    def pack(self, packer: Packer) -> None:
        """Every layer's projections and the head packed by `packer`; attention fused with RoPE
        and the K/V write over the paged pool, RMSNorms in one kernel pass, and the layer stack
        as one op where every layer allows (`_make_plan`). A tied head over a GGUF table packs
        the table's blocks; the embedding then looks tokens up in the head's panels or the
        file's rows."""
        table = packer.pin(EMBED)  # one table: the lookup's and the tied head's
        for i, layer in enumerate(self.layers):
            layer.pack(packer, f"model.layers.{i}.")
        tied = self.config.tie_word_embeddings
        # The table's (or the head's) blocks, packed like any projection: a tied head over a
        # GGUF table with int8 activations on AVX2 multiplies the lookup's own rows, where they
        # lie in the file map (Gemma 3's 262k x 640 Q8_0: no second 170 MB copy).
        self.lm_head = packer(self.lm_head, [[EMBED if tied else "lm_head.weight"]])
        head = self.lm_head.packed if isinstance(self.lm_head, PackedLinear) else None
        shape = tuple(self.embed_tokens.weight.shape)
        if (
            tied
            and table is not None
            and head is not None
            and head.kind == Q8_0X
            and (head.out_features, head.in_features) == shape
        ):
            # the head's panels are a copy of the table: look tokens up there, and the file's
            # rows are not read again (they leave the resident set after loading)
            self.embed_tokens = PanelEmbedding(head, shape[0])
        elif (
            isinstance(table, GGMLTensor) and len(table.parts) == 1 and tuple(table.shape) == shape
        ):
            # looked up from the file's rows (`ggml_rows` decodes only the rows a step reads)
            self.embed_tokens = RowsEmbedding(table)
        for mod in self.modules():
            if isinstance(mod, RMSNorm):
                mod.fused = True
        self.kernels = True
        self._plan = self._make_plan()

    def _make_plan(self) -> tuple[list, list[int]] | None:
        """`_forward_planned`'s layer lists, or None unless every layer is attention and a dense
        gated MLP with every projection packed, and the layers share what the one op takes once
        (eps, attention scale and soft cap, one attention shape and each its own K/V)."""

        def args(m: nn.Module) -> tuple:
            p = m.packed
            return (p.qs, p.d, p.m, p.kind, p.out_features, m.bias)

        layers = []
        c = self.config
        if not c.kv_layout.uniform:
            return None
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if not isinstance(mlp, MLP):  # (a sparse MLP runs layer by layer)
                return None
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(isinstance(m, PackedLinear) for m in linears) or attn.sinks is not None:
                return None  # (the one op takes no attention sinks)
            norms = [getattr(layer, n) for n in layer.NORMS]
            qk_norms = [] if attn.q_norm is None else [attn.q_norm, attn.k_norm]
            first = self.layers[0].self_attn
            if (attn.scale, attn.softcap) != (first.scale, first.softcap) or any(
                n.eps != c.rms_norm_eps for n in norms + qk_norms
            ):
                return None
            layers.append(
                ops.DecoderLayer(
                    linears=tuple(args(m) for m in linears),  # type: ignore[arg-type]
                    norms=tuple(n.weight for n in norms),
                    qk_norm=attn.qk_weight(),
                    local_rope=attn.local_rope,
                    window=attn.window,
                    ffn_act=mlp.act,
                    rope_interleaved=attn.rope_interleaved,
                )
            )
        if self.norm.eps != c.rms_norm_eps:
            return None
        return ops.decoder_stack(layers)

    def packed_kinds(self) -> set[Kind]:
        """The layout (`models.ops.Kind`) of every packed projection and head."""
        return {m.packed.kind for m in self.modules() if isinstance(m, PackedLinear)}

    def weight_formats(self) -> dict[str, int]:
        """Bytes of projection and head weights by format ("f32", "q4_1", ...)."""
        out: dict[str, int] = {}
        for mod in self.modules():
            if isinstance(mod, PackedLinear):
                for k, n in mod.packed.formats().items():
                    out[k] = out.get(k, 0) + n
            elif isinstance(mod, Linear):
                k = str(mod.weight.dtype).removeprefix("torch.")
                out[k] = out.get(k, 0) + mod.weight.numel() * mod.weight.element_size()
        return out

    # -- loading -------------------------------------------------------------------------------

    @classmethod
    def hf_weight_names(cls, config: ModelConfig) -> set[str]:
        """The Hugging Face tensor names `load_hf_weights` may take for this config: the
        embedding, final norm and head, and each layer's (`DecoderLayer.hf_weight_names`)."""
        names = {EMBED, cls.FINAL_NORM}
        if not config.tie_word_embeddings:
            names.add("lm_head.weight")
        for i, layer in enumerate(cls.layer_classes(config)):
            names |= layer.hf_weight_names(config, f"model.layers.{i}.")
        return names

    def _load_more(self, loader: HFLoader) -> None:
        """A family's own tensors outside the layers and the embedding, norm and head (none)."""

    @torch.no_grad()
    def load_hf_weights(self, tensors: Mapping[str, torch.Tensor], adopt: bool = False) -> None:
        """Load Hugging Face names (model.layers.N.self_attn.q_proj.weight, ...).

        Separate q/k/v and gate/up tensors are fused into this module's projections; fused ones
        (qkv_proj, gate_up_proj) are taken as they are. Missing or unexpected tensors raise, so a
        checkpoint is never half-loaded. `adopt=True` makes the parameters use the given
        tensors' memory instead of copying into their own: for loaders whose mapping hands out
        fresh tensors (touching a second copy of fresh memory costs seconds per 500 MB on a VM);
        the caller must not reuse them.
        """
        c = self.config
        loader = HFLoader(dict(self.named_parameters()), tensors, adopt, self.hf_norm_offset)
        loader.put("embed_tokens.weight", loader.take(EMBED))
        loader.put("norm.weight", loader.norm(self.FINAL_NORM))
        if not c.tie_word_embeddings:
            loader.put("lm_head.weight", loader.take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            layer.load(loader, f"model.layers.{i}.", f"layers.{i}.")
        self._load_more(loader)
        missing = set(loader.params) - loader.loaded
        if c.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint left parameters unset: {sorted(missing)[:5]}")
