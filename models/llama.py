"""The Llama-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

One implementation serves TinyGPT, SmolLM2, Llama 2/3, Mistral and Qwen2-style checkpoints; they
differ only in `ModelConfig`. Attention goes through `models.attention` with explicit metadata, so
the module itself holds no per-request state. Q/K/V and gate/up are fused into one projection each:
one matmul instead of three (or two) per layer, which matters on CPU where every op has overhead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from models import ops
from models.attention import AttentionMetadata, paged_attention
from models.config import ModelConfig, RopeScaling
from models.cpu import has_native_bf16
from models.ops import Act
from models.quant import (
    F32,
    KIND_NAMES,
    QB,
    GGMLTensor,
    PackedWeight,
    QTensor,
    RowsEmbedding,
    int8_by_default,
    pack,
    quantize,
)
from models.quant import Q4_1 as Q4_1_KIND
from models.quant import Q8_0 as Q8_0_KIND


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


def _unread(t: torch.Tensor) -> bool:
    """A loader's stand-in for a weight the kernels take from the file's blocks instead
    (`GGUFWeights`): a stride-0 view, never read, so no float copy is made of it."""
    return t.dim() == 2 and t.stride() == (0, 0)


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    if all(_unread(p) for p in parts):
        return parts[0][:1, :1].expand(sum(p.shape[0] for p in parts), parts[0].shape[1])
    return torch.cat(parts, dim=0)


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

    def forward(self, positions: torch.Tensor, halves: bool = False) -> RopeTables:
        """cos and signed sin for these positions, (T, 1, hd) each: looked up once per step and
        shared by every layer; with `halves`, also the plain (T, hd/2) tables the fused
        attention kernel takes."""
        half = self.cos.shape[-1] // 2
        cos = self.cos[positions].unsqueeze(1)  # (T, 1, hd)
        sin = self.sin[positions].unsqueeze(1)  # (T, 1, hd)
        # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi]: fold the sign in here.
        signed = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        if not halves:
            return RopeTables(cos, signed)
        return RopeTables(
            cos,
            signed,
            cos[:, 0, :half].float().contiguous(),
            sin[:, 0, :half].float().contiguous(),
        )


class RopeTables(NamedTuple):
    cos: torch.Tensor  # (T, 1, hd)
    sin: torch.Tensor  # (T, 1, hd), sign of rotate_half folded in
    cos_half: torch.Tensor | None = None  # (T, hd/2) float32, for the fused kernel
    sin_half: torch.Tensor | None = None


def _or_empty(t: torch.Tensor | None, dims: int) -> torch.Tensor:
    return t if t is not None else torch.empty((0,) * dims, dtype=torch.long)


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

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for a fused [gate; up] projection."""
        gate, up = self(x).chunk(2, dim=-1)
        return F.silu(gate) * up


class PackedLinear(nn.Module):
    """A projection whose weight lives in packed blocks (`models.quant`), multiplied by the
    cbserve kernel with float32 activations; the bias, the residual add and SwiGLU's
    silu(gate) * up happen in the kernel's epilogue rather than as separate passes."""

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

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, None, Act.SILU_MUL)

    def extra_repr(self) -> str:
        kind = KIND_NAMES[self.packed.kind]
        return f"in={self.in_features}, out={self.out_features}, weights={kind}"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    fused = False  # set by enable_kernels: one pass in the cbserve kernel instead of ~6 ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dim() == 2 and x.dtype == torch.float32:
            return ops.rms_norm(x, self.weight, eps=self.eps)
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
        rope: RopeTables,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        meta: AttentionMetadata,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Self-attention of x (T, d) over the pool, plus `residual` when given."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, (H + 2 KV) * hd)
        if rope.cos_half is not None and kv_cache is not None:
            # One kernel: RoPE, K/V into the pool, attention reading the pool's blocks in place.
            o = ops.attention(
                qkv, cos=rope.cos_half, sin=rope.sin_half, k_cache=kv_cache[0], v_cache=kv_cache[1],
                slots=meta.slot_mapping, num_decode=meta.num_decode_tokens,
                decode_tables=_or_empty(meta.decode_block_tables, 2),
                decode_lens=_or_empty(meta.decode_context_lens, 1),
                chunk_meta=meta.chunk_meta(), chunk_tables=meta.chunk_tables(),
                num_heads=self.n_heads, num_kv_heads=self.n_kv, head_dim=self.hd, scale=self.scale,
            )  # fmt: skip
            return self.o_proj(o, residual)
        rope_full = (rope.cos, rope.sin)
        # Rotate q and k in one go: they are adjacent columns of the fused projection.
        qk = apply_rotary(
            qkv[:, : self.q_size + self.kv_size].view(t, self.n_heads + self.n_kv, self.hd),
            *rope_full,
        )
        q, k = qk.split([self.n_heads, self.n_kv], dim=1)  # (T, H, hd), (T, KV, hd)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.n_kv, self.hd)  # (T, KV, hd)
        o = paged_attention(q, k, v, kv_cache, meta, self.scale)  # (T, H, hd)
        return self.o_proj(o.reshape(t, self.q_size), residual)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ffn = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.ffn, bias=False)
        self.down_proj = Linear(self.ffn, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_mul(x), residual)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, rope, kv_cache, meta) -> torch.Tensor:
        # The skip connections ride into the projections (added in the packed kernel's epilogue).
        x = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


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
        rope = self.rotary(positions, halves=self.kernels)
        if self._plan is not None and kv_caches is not None:
            return self._forward_planned(x, rope, kv_caches, meta)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, None if kv_caches is None else kv_caches[i], meta)
        return self.norm(x)

    _plan: list[tuple] | None = None  # set by enable_kernels when every layer is fully packed

    def _forward_planned(self, x, rope, kv_caches, meta) -> torch.Tensor:
        """The layer loop as straight calls of the kernel ops (what `DecoderLayer.forward`
        computes, op for op) without nn.Module dispatch: ~10 module calls a layer cost ~2 ms a
        step on SmolLM2, a quarter of a batch-1 decode step."""
        attention, norm = ops.attention, ops.rms_norm
        c = self.config
        eps, h, kvh, hd = c.rms_norm_eps, c.num_heads, c.num_kv_heads, c.head_dim
        scale = self.layers[0].self_attn.scale
        cos, sin, slots, nd = (
            rope.cos_half,
            rope.sin_half,
            meta.slot_mapping,
            meta.num_decode_tokens,
        )
        tables = _or_empty(meta.decode_block_tables, 2)
        lens = _or_empty(meta.decode_context_lens, 1)
        chunk_meta, chunk_tables = meta.chunk_meta(), meta.chunk_tables()
        for (n1, qkv_w, o_w, n2, gu_w, down_w), (kc, vc) in zip(self._plan, kv_caches, strict=True):
            qkv = qkv_w[0](norm(x, n1, eps), *qkv_w[1:], None, 0)
            o = attention(
                qkv, cos, sin, kc, vc, slots, nd, tables, lens, chunk_meta, chunk_tables,
                h, kvh, hd, scale,
            )  # fmt: skip
            x = o_w[0](o, *o_w[1:], x, 0)
            g = gu_w[0](norm(x, n2, eps), *gu_w[1:], None, 1)
            x = down_w[0](g, *down_w[1:], x, 0)
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
        for name, mod in self.named_modules():
            if isinstance(mod, PackedLinear) and name != "lm_head":
                n += mod.in_features * mod.out_features + (
                    0 if mod.bias is None else mod.out_features
                )
        if isinstance(self.embed_tokens, RowsEmbedding):
            n += self.embed_tokens.num_embeddings * self.embed_tokens.embedding_dim
        head = self.lm_head
        if isinstance(head, PackedLinear):
            if not self.config.tie_word_embeddings:
                n += head.in_features * head.out_features
        elif self.config.tie_word_embeddings and head.weight is not self.embed_tokens.weight:
            n -= head.weight.numel()  # a bfloat16 copy of the tied table is not a parameter more
        return n

    # -- kernels -------------------------------------------------------------------------------

    kernels = False  # True once enable_kernels ran

    @torch.no_grad()
    def enable_kernels(
        self,
        scheme: str = "auto",
        blocks: Callable[[str], QTensor | GGMLTensor | None] | None = None,
        activations: str = "auto",
    ) -> None:
        """Run through `models.ops` (the caller checked `models.kernels.available()`):
        attention fused with RoPE and the K/V write over the paged pool, and every projection and
        the head as packed weights, per `scheme`:

        - auto: the checkpoint's own blocks where `blocks(name)` has them (GGUF Q4_0, Q4_1, Q5_0,
          Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, so the model computes exactly what the file holds; a
          fused projection may mix them), else the float weights;
        - none: the float weights (float32 panels: the same numbers as F.linear);
        - q8_0 / q4_1: that format, quantized from the float weights unless the checkpoint
          already holds it.
        The float copies are dropped: the packed weights replace them.

        `activations` ("auto", "int8", "float32"): quantized projections multiply int8
        activations (per row and 32 or 256 inputs) with integer dot products ("auto": see
        `models.quant.int8_by_default`).
        """
        if self.config.matmul_dtype not in (None, torch.float32):
            raise ValueError("the kernels run float32 activations; load the model in float32")
        target = {"auto": None, "none": F32, "q8_0": Q8_0_KIND, "q4_1": Q4_1_KIND}[scheme]

        def packed(linear: nn.Module, names: list[str], gate_up: bool = False) -> nn.Module:
            if isinstance(linear, PackedLinear) or linear.weight.shape[1] % QB:
                return linear
            parts = [blocks(n) for n in names] if blocks is not None and scheme != "none" else []
            usable = (
                parts
                and all(p is not None for p in parts)
                and (target is None or all(p.kind == target for p in parts))  # type: ignore[union-attr]
            )
            if usable:
                qt = QTensor.cat(parts)  # type: ignore[arg-type]
            else:
                qt = quantize(linear.weight.float(), F32 if target is None else target)
            int8 = qt.kind != F32 and (
                activations == "int8" or (activations == "auto" and int8_by_default(qt))
            )
            return PackedLinear(pack(qt, gate_up=gate_up, int8=int8), linear.bias)

        for i, layer in enumerate(self.layers):
            src = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj = packed(
                attn.qkv_proj, [f"{src}self_attn.{n}_proj.weight" for n in "qkv"]
            )
            attn.o_proj = packed(attn.o_proj, [f"{src}self_attn.o_proj.weight"])
            mlp.gate_up_proj = packed(
                mlp.gate_up_proj, [f"{src}mlp.{n}_proj.weight" for n in ("gate", "up")], True
            )
            mlp.down_proj = packed(mlp.down_proj, [f"{src}mlp.down_proj.weight"])
        tied = self.config.tie_word_embeddings
        self.lm_head = packed(
            self.lm_head, ["model.embed_tokens.weight" if tied else "lm_head.weight"]
        )
        table = blocks("model.embed_tokens.weight") if blocks is not None else None
        if isinstance(table, GGMLTensor) and len(table.parts) == 1:
            self.embed_tokens = RowsEmbedding(table)
        for mod in self.modules():
            if isinstance(mod, RMSNorm):
                mod.fused = True
        self.kernels = True

        def args(m: nn.Module) -> tuple:
            p = m.packed
            return (p.op, p.qs, p.d, p.m, p.kind, p.out_features, m.bias)

        linears = [
            (ly.self_attn.qkv_proj, ly.self_attn.o_proj, ly.mlp.gate_up_proj, ly.mlp.down_proj)
            for ly in self.layers
        ]
        if all(isinstance(m, PackedLinear) for group in linears for m in group):
            self._plan = [
                (layer.input_layernorm.weight, args(qkv), args(o),
                 layer.post_attention_layernorm.weight, args(gu), args(down))
                for layer, (qkv, o, gu, down) in zip(self.layers, linears, strict=True)
            ]  # fmt: skip

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
                p.data = value if _unread(value) else value.to(p.dtype).contiguous()
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
            put(f"{dst}self_attn.qkv_proj.weight", _cat_rows(qkv))
            if c.attention_bias:
                qkv_b = [take(f"{src}self_attn.{n}_proj.bias") for n in ("q", "k", "v")]
                put(f"{dst}self_attn.qkv_proj.bias", torch.cat(qkv_b, dim=0))
            put(f"{dst}self_attn.o_proj.weight", take(f"{src}self_attn.o_proj.weight"))
            gate_up = [take(f"{src}mlp.{n}_proj.weight") for n in ("gate", "up")]
            put(f"{dst}mlp.gate_up_proj.weight", _cat_rows(gate_up))
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
