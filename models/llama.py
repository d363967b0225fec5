"""The Llama-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

One implementation serves TinyGPT, SmolLM2, Llama 2/3, Mistral and Qwen2-style checkpoints; they
differ only in `ModelConfig`. Attention goes through `models.attention` with explicit metadata, so
the module itself holds no per-request state. Q/K/V and gate/up are fused into one projection each:
one matmul instead of three (or two) per layer, which matters on CPU where every op has overhead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import AttentionMetadata, paged_attention
from models.config import ModelConfig, RopeScaling
from models.cpu import has_native_bf16


def _inv_freq(config: ModelConfig) -> torch.Tensor:
    hd = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
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
    if config.rope_freq_factors is not None:
        if len(config.rope_freq_factors) != hd // 2:
            raise ValueError(
                f"rope_freq_factors has {len(config.rope_freq_factors)} entries, not {hd // 2}"
            )
        inv = inv / torch.tensor(config.rope_freq_factors, dtype=torch.float64)
    return inv


class _SkipInit(torch.overrides.TorchFunctionMode):
    """Skip `torch.nn.init.*` (they dispatch through torch function modes); run all else."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


class Rotary(nn.Module):
    """Precomputed cos/sin for every position up to the context length (HF 'rotate_half' layout)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        t = torch.arange(config.max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(t, _inv_freq(config))  # (P, hd/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (P, hd)
        self.register_buffer("cos", emb.cos().to(config.dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(config.dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for these positions, (T, 1, hd) each: looked up once per step and
        shared by every layer."""
        half = self.cos.shape[-1] // 2
        cos = self.cos[positions].unsqueeze(1)  # (T, 1, hd)
        sin = self.sin[positions].unsqueeze(1)  # (T, 1, hd)
        # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi]: fold the sign in here.
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, hd) with cos/sin from `Rotary.forward`."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


_NATIVE_BF16 = has_native_bf16()


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.dtype == x.dtype:
            return F.linear(x, w, self.bias)
        if w.dtype == torch.bfloat16 and not _NATIVE_BF16:
            return F.linear(x.to(w.dtype).to(x.dtype), w.to(x.dtype), self.bias)
        return F.linear(x.to(w.dtype), w, self.bias).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = self.n_heads * self.hd, self.n_kv * self.hd
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = self.hd**-0.5

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, (H + 2 KV) * hd)
        # Rotate q and k in one go: they are adjacent columns of the fused projection.
        qk = apply_rotary(
            qkv[:, : self.q_size + self.kv_size].view(t, self.n_heads + self.n_kv, self.hd), *rope
        )
        q, k = qk.split([self.n_heads, self.n_kv], dim=1)  # (T, H, hd), (T, KV, hd)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.n_kv, self.hd)  # (T, KV, hd)
        o = paged_attention(q, k, v, kv_cache, meta, self.scale)  # (T, H, hd)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ffn = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.ffn, bias=False)
        self.down_proj = Linear(self.ffn, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.ffn, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, rope, kv_cache, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Decoder over a flat token batch. `forward` returns hidden states; `compute_logits` the head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: (T,). Returns final hidden states (T, d_model)."""
        x = self.embed_tokens(input_ids)  # (T, d)
        rope = self.rotary(positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, None if kv_caches is None else kv_caches[i], meta)
        return self.norm(x)

    @classmethod
    def without_weights(cls, config: ModelConfig) -> LlamaForCausalLM:
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
        return self.lm_head(hidden).float()

    def num_parameters(self) -> int:
        n = sum(p.numel() for p in self.parameters())
        if self.config.tie_word_embeddings and self.lm_head.weight is not self.embed_tokens.weight:
            n -= (
                self.lm_head.weight.numel()
            )  # a bfloat16 copy of the tied table is not a parameter more
        return n

    # -- loading -------------------------------------------------------------------------------

    @torch.no_grad()
    def load_hf_weights(self, tensors: Mapping[str, torch.Tensor], adopt: bool = False) -> None:
        """Load Hugging Face Llama-style names (model.layers.N.self_attn.q_proj.weight, ...).

        Separate q/k/v and gate/up tensors are fused into this module's projections. Missing or
        unexpected tensors raise, so a checkpoint is never half-loaded. `adopt=True` makes the
        parameters use the given tensors' memory instead of copying into their own: for loaders
        whose mapping hands out fresh tensors (touching a second copy of fresh memory costs
        seconds per 500 MB on a VM); the caller must not reuse them.
        """
        c = self.config
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, value: torch.Tensor) -> None:
            p = params[name]
            if tuple(p.shape) != tuple(value.shape):
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(value.shape)} != {tuple(p.shape)}"
                )
            if adopt:
                p.data = value.to(p.dtype).contiguous()
            else:
                p.copy_(value.to(p.dtype))
            loaded.add(name)

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise ValueError(f"checkpoint is missing tensor {name}")
            return tensors[name]

        put("embed_tokens.weight", take("model.embed_tokens.weight"))
        put("norm.weight", take("model.norm.weight"))
        if not c.tie_word_embeddings:
            put("lm_head.weight", take("lm_head.weight"))
        for i in range(c.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            qkv = [take(f"{src}self_attn.{n}_proj.weight") for n in ("q", "k", "v")]
            put(f"{dst}self_attn.qkv_proj.weight", torch.cat(qkv, dim=0))
            if c.attention_bias:
                qkv_b = [take(f"{src}self_attn.{n}_proj.bias") for n in ("q", "k", "v")]
                put(f"{dst}self_attn.qkv_proj.bias", torch.cat(qkv_b, dim=0))
            put(f"{dst}self_attn.o_proj.weight", take(f"{src}self_attn.o_proj.weight"))
            gate_up = [take(f"{src}mlp.{n}_proj.weight") for n in ("gate", "up")]
            put(f"{dst}mlp.gate_up_proj.weight", torch.cat(gate_up, dim=0))
            put(f"{dst}mlp.down_proj.weight", take(f"{src}mlp.down_proj.weight"))
            put(f"{dst}input_layernorm.weight", take(f"{src}input_layernorm.weight"))
            put(
                f"{dst}post_attention_layernorm.weight",
                take(f"{src}post_attention_layernorm.weight"),
            )
        missing = set(params) - loaded
        if c.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint left parameters unset: {sorted(missing)[:5]}")
