"""ModelConfig: the shape, special tokens and per-family options of one decoder.

Every loader (TinyGPT, GGUF, Hugging Face directories) produces one of these; the decoder, the
engine (EOS ids, context length, the KV pool's `KVLayout`, a hybrid model's recurrent
`StateLayout`) and the server (model name) read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3 style frequency-dependent RoPE scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class YarnScaling:
    """YaRN RoPE scaling ("rope_type": "yarn"; gpt-oss, long-context Qwen): frequencies whose
    wavelength fits in the original context many times (above `beta_fast` rotations) are kept,
    those rotating fewer than `beta_slow` times are divided by `factor`, and a linear ramp over
    the dims between blends the two. `truncate`: that range's ends rounded out to whole dims, as
    ggml always does and transformers by default (gpt-oss's config says False: the exact ends).
    The attention factor (0.1 ln(factor) + 1 unless the checkpoint gives another) multiplies cos
    and sin: `ModelConfig.rope_attention_factor`."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass(frozen=True, slots=True)
class KVGroup:
    """The layers whose pools have one shape: one tensor of the KV pool holds them all,
    `KVLayout.group_shape`."""

    num_kv_heads: int
    head_dim: int
    layers: tuple[int, ...]  # the model layers that own these pools, in order


@dataclass(frozen=True, slots=True)
class KVLayout:
    """How the KV pool stores one token: K and V of `num_kv_heads x head_dim` per layer.

    A float32 or float16 row (one kv head of one token) is its `head_dim` values. An int8 row is
    `head_dim` int8 values followed by one float32 scale per 32 of them (x = q * scale, as
    llama.cpp's q8_0), `row_width` bytes in all: only the cbserve attention kernel reads it.

    Layers may differ (`layer_shapes`: each layer's kv heads and head_dim, as Gemma 4's 512-dim
    global layers among 256-dim sliding ones), and a layer may own no pool at all (`sources`:
    the layer whose pool each layer reads and writes, itself or an earlier layer whose K/V it
    shares). The pool is then one tensor per shape (`groups`), and the bytes a token occupies
    count the layers that own a pool only.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    # Each k head's values in GGML's order (`ModelConfig.rope_interleaved`): a pool filled by
    # one model is read by another only if both order their keys alike.
    interleaved_keys: bool = False
    # Per layer, where layers differ: (kv_heads, head_dim); None: every layer's are the above.
    layer_shapes: tuple[tuple[int, int], ...] | None = None
    # Per layer: the layer whose pool it reads and writes; None: each its own.
    sources: tuple[int, ...] | None = None

    def width(self, head_dim: int) -> int:
        """Elements of `dtype` one kv head of one token occupies at `head_dim`."""
        return head_dim + head_dim // 8 if self.dtype == torch.int8 else head_dim

    @property
    def row_width(self) -> int:
        """Elements of `dtype` one kv head of one token occupies (at `head_dim`)."""
        return self.width(self.head_dim)

    def shape(self, layer: int) -> tuple[int, int]:
        """Layer `layer`'s (kv_heads, head_dim)."""
        if self.layer_shapes is None:
            return self.num_kv_heads, self.head_dim
        return self.layer_shapes[layer]

    def source(self, layer: int) -> int:
        """The layer whose pool layer `layer` reads (and, if it is itself, writes)."""
        return layer if self.sources is None else self.sources[layer]

    @property
    def uniform(self) -> bool:
        """Every layer owns a pool of one shape (one tensor, `pool_shape`)."""
        return len(self.groups()) == 1 and len(self.groups()[0].layers) == self.num_layers

    def groups(self) -> tuple[KVGroup, ...]:
        """The layers owning a pool, grouped by shape (in the order each shape first occurs)."""
        by_shape: dict[tuple[int, int], list[int]] = {}
        for layer in range(self.num_layers):
            if self.source(layer) == layer:
                by_shape.setdefault(self.shape(layer), []).append(layer)
        return tuple(KVGroup(kv, hd, tuple(ls)) for (kv, hd), ls in by_shape.items())

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V that one token occupies across all the layers that own a pool."""
        per_layer = sum(
            len(g.layers) * g.num_kv_heads * self.width(g.head_dim) for g in self.groups()
        )
        return 2 * per_layer * self.dtype.itemsize

    def group_shape(self, group: KVGroup, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """(group layers, 2 (K, V), num_blocks, block_size, kv_heads, row width)."""
        return (
            len(group.layers), 2, num_blocks, block_size, group.num_kv_heads,
            self.width(group.head_dim),
        )  # fmt: skip

    def allocate(
        self, num_blocks: int, block_size: int
    ) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """The pool's tensors (one per group, `group_shape`) and each layer's (K, V) pools in
        them: a layer that shares another's K/V gets that layer's, so it owns no memory.

        zeros, not empty: padded attention reads masked slots, and 0 * NaN from uninitialised
        memory would poison the output. numpy's zeros come from calloc, whose large blocks are
        fresh anonymous pages the kernel zeroes on first touch, so RSS grows with use (torch's
        own zeros writes every page up front: a 1 GiB pool would be 1 GiB resident at start)."""
        np_dtype = torch.empty((), dtype=self.dtype).numpy().dtype
        pools: list[torch.Tensor] = []
        own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for group in self.groups():
            pool = torch.from_numpy(
                np.zeros(self.group_shape(group, num_blocks, block_size), np_dtype)
            )
            pools.append(pool)
            for j, layer in enumerate(group.layers):
                own[layer] = (pool[j, 0], pool[j, 1])
        return pools, [own[self.source(i)] for i in range(self.num_layers)]

    def pool_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """(layers, 2 (K, V), num_blocks, block_size, kv_heads, row_width), of a uniform layout
        (ValueError otherwise: its pool is one tensor per group)."""
        if not self.uniform:
            raise ValueError("the KV pool of layers of several shapes is one tensor per group")
        return (self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.row_width)


@dataclass(frozen=True, slots=True)
class StateLayout:
    """The fixed-size recurrent state one request keeps for each recurrent layer, float32: the
    short convolution's history (`conv_shape`: its last K - 1 inputs, (K - 1, channels)) and the
    recurrence's state (`ssm_shape`; (0,), no floats, for a layer that is a convolution only,
    LFM2's)."""

    num_layers: int
    conv_shape: tuple[int, int]
    ssm_shape: tuple[int, ...] = (0,)

    @property
    def floats_per_layer(self) -> int:
        return math.prod(self.conv_shape) + math.prod(self.ssm_shape)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one request's state across all recurrent layers."""
        return 4 * self.num_layers * self.floats_per_layer

    def pool_shapes(self, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(layers, slots, K - 1, channels) and (layers, slots, *ssm_shape)."""
        return (
            (self.num_layers, num_slots, *self.conv_shape),
            (self.num_layers, num_slots, *self.ssm_shape),
        )


@dataclass(frozen=True, slots=True)
class RecurrentConfig:
    """The recurrent layers of a hybrid model and their mixer's shape.

    `kind`: "short_conv" (LFM2: a gated short convolution, its state the conv history only),
    "gated_delta" (Qwen3.5, Qwen3-Next: Gated DeltaNet, `num_k_heads` q/k heads of `k_head_dim`
    and `num_v_heads` value heads of `v_head_dim`, state (v heads, k dim, v dim) each) or
    "mamba2" (Granite 4.0-H: `num_v_heads` heads of `v_head_dim`, `num_groups` groups of B and C
    of `state_size`, state (heads, head dim, state size)). `conv_kernel`: the causal
    convolution's width K. `v_heads_tiled`: value head h reads q/k head h % num_k_heads (the
    order llama.cpp's converter writes for qwen35), else h // (num_v_heads / num_k_heads)
    (Hugging Face's). `conv_bias`: the convolution has a bias (Mamba2).
    """

    kind: str
    layers: tuple[int, ...]
    conv_kernel: int
    num_k_heads: int = 0
    num_v_heads: int = 0
    k_head_dim: int = 0
    v_head_dim: int = 0
    state_size: int = 0
    num_groups: int = 0
    v_heads_tiled: bool = False
    conv_bias: bool = False

    KINDS = ("short_conv", "gated_delta", "mamba2")

    def conv_channels(self, hidden_size: int) -> int:
        """Channels of the short convolution (what its history keeps per position)."""
        if self.kind == "short_conv":
            return hidden_size
        if self.kind == "gated_delta":
            return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim
        return self.num_v_heads * self.v_head_dim + 2 * self.num_groups * self.state_size

    def state_layout(self, hidden_size: int) -> StateLayout:
        conv = (self.conv_kernel - 1, self.conv_channels(hidden_size))
        if self.kind == "short_conv":
            ssm: tuple[int, ...] = (0,)
        elif self.kind == "gated_delta":
            ssm = (self.num_v_heads, self.k_head_dim, self.v_head_dim)
        else:
            ssm = (self.num_v_heads, self.v_head_dim, self.state_size)
        return StateLayout(len(self.layers), conv, ssm)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_yarn: YarnScaling | None = None
    # llama.cpp's per-frequency RoPE divisors (GGUF tensor rope_freqs, how Llama 3.x GGUFs carry
    # their rope scaling): inv_freq[i] /= rope_freq_factors[i]. None = no scaling by factors.
    rope_freq_factors: tuple[float, ...] | None = None
    # LongRoPE (Phi-3.5, Phi-3 128k, Phi-4-mini): `rope_freq_factors` holds its short factors,
    # these the long ones, used instead when the model serves contexts longer than
    # `rope_original_context` (its max_position_embeddings above it; llama.cpp's rule, by
    # context size: a sequence's keys never mix the two); `rope_attention_factor` multiplies
    # cos and sin either way (the rotated values of q and k).
    rope_long_factors: tuple[float, ...] | None = None
    rope_original_context: int | None = None
    rope_attention_factor: float = 1.0
    # Values of each q/k head RoPE rotates, the first ones (a partial rotary embedding, e.g.
    # Phi-4-mini's 96 of 128); None: all head_dim.
    rotary_dim: int | None = None
    # q/k rows in GGML's order (a llama-architecture GGUF's, taken as the file holds them): RoPE
    # rotates adjacent pairs (2i, 2i + 1) instead of Hugging Face's halves (i, i + head_dim/2).
    rope_interleaved: bool = False
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q/k/v projections
    attention_out_bias: bool = False  # gpt-oss: a bias on the output projection too
    # gpt-oss: a learned logit per query head and layer that joins the head's softmax with no
    # value (the "sink" column is dropped after the softmax), so a head may attend to nothing
    attention_sinks: bool = False
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each q and k head before RoPE
    # the gated MLP's activation: "silu" (SwiGLU), "gelu_tanh" (GeGLU) or "swiglu_oai" (gpt-oss:
    # gate <= 7, -7 <= up <= 7, (up + 1) * gate * sigmoid(1.702 gate))
    hidden_act: str = "silu"
    mlp_bias: bool = False  # biases on the MLP's (every expert's) gate, up and down projections
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    # Sliding-window attention per layer: layer i's queries at position p see keys in
    # (p - layer_windows[i], p]; 0 = the whole context. None: every layer sees the whole context.
    layer_windows: tuple[int, ...] | None = None
    rope_local_theta: float | None = None  # Gemma 3: the RoPE base of windowed layers
    # SmolLM3: True for the layers whose q and k are not rotated at all (NoPE, every fourth)
    nope_layers: tuple[bool, ...] | None = None
    # HF "linear" RoPE scaling (positions / factor); Gemma 3 applies it to its global layers only
    rope_linear_factor: float = 1.0
    embedding_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    # Granite 4.0-H: each layer's mixer and MLP outputs times this before their residual adds
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0  # Granite 4.0-H: the logits divided by this
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # Gemma 2: attention scores (after the scale) = cap * tanh(scores / cap) before the softmax
    attn_logit_softcapping: float | None = None
    # Mixture of experts (Qwen3-MoE, gpt-oss): every layer's MLP is `num_experts` gated MLPs of
    # `moe_intermediate_size`, of which a router picks `num_experts_per_tok` per token. Gating
    # "softmax": softmax over all experts, then the top k (`norm_topk_prob`: their weights
    # rescaled to sum to 1); "topk_softmax": the top k scores, then a softmax over those k
    # (gpt-oss). `moe_router_bias`: the router has a bias. 0 experts: the dense MLP of
    # `intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_gating: str = "softmax"
    moe_router_bias: bool = False
    # Gating "sigmoid" (LFM2-MoE): each expert's score through a sigmoid; the top k by sigmoid
    # plus `moe_expert_bias` (a learned per-expert bias that steers the choice only), weighted
    # by their sigmoids (`norm_topk_prob`: rescaled to sum to 1), times `moe_routed_scale`.
    moe_expert_bias: bool = False
    moe_routed_scale: float = 1.0
    # A shared expert beside the routed ones (Qwen3.5-MoE, Qwen3-Next): a gated MLP of this size
    # every token goes through, times sigmoid of a one-output gate; 0: none.
    moe_shared_expert_size: int = 0
    # Leading layers whose MLP is the dense one of `intermediate_size` (LFM2-MoE's first two).
    moe_dense_layers: int = 0
    # Layers of several attention shapes (Gemma 4: 512-dim heads on its global layers, 256 on
    # the sliding ones): each layer's head_dim and kv heads; None: head_dim and num_kv_heads
    # everywhere.
    layer_head_dims: tuple[int, ...] | None = None
    layer_kv_heads: tuple[int, ...] | None = None
    # KV sharing (Gemma 4): the layer whose K/V each layer attends over, itself or an earlier
    # layer of the same shape (whose pool it reads; it computes queries only and owns no
    # pool). None: every layer its own.
    kv_sources: tuple[int, ...] | None = None
    # Each layer's MLP width where they differ (Gemma 4's double-wide MLP on its shared layers)
    layer_intermediate_sizes: tuple[int, ...] | None = None
    v_norm: bool = False  # Gemma 4: each V head RMS-normalised (no weight) before the pool
    # Per-layer input embeddings (Gemma 4 E2B/E4B): values a layer (0: none) and table rows
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    # A hybrid model's recurrent layers (which, and their mixer); None: every layer attends.
    recurrent: RecurrentConfig | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    dtype: torch.dtype = torch.float32  # activations, norms, embeddings, logits
    matmul_dtype: torch.dtype | None = None  # the decoder layers' projection weights; None: dtype
    kv_cache_dtype: torch.dtype | None = None  # the KV pool; None: float32
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.layer_windows is not None and len(self.layer_windows) != self.num_layers:
            raise ValueError(
                f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers"
            )
        if self.nope_layers is not None:
            if len(self.nope_layers) != self.num_layers:
                raise ValueError(
                    f"nope_layers has {len(self.nope_layers)} entries for {self.num_layers} layers"
                )
            if self.rope_local_theta is not None:
                raise ValueError("NoPE layers and a local RoPE base are not supported together")
        rot = self.rope_dims
        if rot % 2 or not 0 < rot <= self.head_dim:
            raise ValueError(f"rotary_dim {rot} must be even and within head_dim {self.head_dim}")
        if self.rope_long_factors is not None and self.rope_original_context is None:
            raise ValueError("LongRoPE's long factors need rope_original_context")
        if self.num_experts and not (
            0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0
        ):
            raise ValueError(
                f"{self.num_experts} experts, {self.num_experts_per_tok} a token, "
                f"expert size {self.moe_intermediate_size}: not a mixture of experts"
            )
        self._check_per_layer()
        rec = self.recurrent
        if rec is not None:
            if rec.kind not in RecurrentConfig.KINDS:
                raise ValueError(f"recurrent layer kind {rec.kind!r} is not supported")
            if not rec.layers or not all(0 <= i < self.num_layers for i in rec.layers):
                raise ValueError(f"recurrent layers {rec.layers} outside 0..{self.num_layers - 1}")
            if self.layer_head_dims or self.layer_kv_heads or self.kv_sources:
                raise ValueError("recurrent layers beside per-layer attention shapes or shared K/V")
        if self.hidden_act not in ("silu", "gelu_tanh", "swiglu_oai"):
            raise ValueError(
                f"hidden_act {self.hidden_act!r} is not supported (silu, gelu_tanh, swiglu_oai)"
            )
        if self.moe_gating not in ("softmax", "topk_softmax", "sigmoid"):
            raise ValueError(
                f"moe_gating {self.moe_gating!r} is not softmax, topk_softmax or sigmoid"
            )
        if self.moe_expert_bias and self.moe_gating != "sigmoid":
            raise ValueError("an expert bias steers sigmoid gating only")
        if self.rope_yarn is not None and self.rope_scaling is not None:
            raise ValueError("YaRN and Llama 3 RoPE scaling are not supported together")

    def _check_per_layer(self) -> None:
        for name in ("layer_head_dims", "layer_kv_heads", "kv_sources", "layer_intermediate_sizes"):
            value = getattr(self, name)
            if value is not None and len(value) != self.num_layers:
                raise ValueError(f"{name} has {len(value)} entries for {self.num_layers} layers")
        for layer in range(self.num_layers):
            kv = self.kv_heads_of(layer)
            if kv <= 0 or self.num_heads % kv:
                raise ValueError(f"layer {layer}: {self.num_heads} heads over {kv} kv heads")
            src = self.kv_source(layer)
            if src != layer and not (
                0 <= src < layer
                and self.kv_source(src) == src
                and self.head_dim_of(src) == self.head_dim_of(layer)
                and self.kv_heads_of(src) == kv
                and self.window(src) == self.window(layer)
            ):
                raise ValueError(
                    f"layer {layer} cannot share layer {src}'s K/V: an earlier layer that owns "
                    "its own, of the same shape and window"
                )

    def head_dim_of(self, layer: int) -> int:
        """Layer `layer`'s head_dim."""
        return self.head_dim if self.layer_head_dims is None else self.layer_head_dims[layer]

    def kv_heads_of(self, layer: int) -> int:
        """Layer `layer`'s kv heads."""
        return self.num_kv_heads if self.layer_kv_heads is None else self.layer_kv_heads[layer]

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V layer `layer` attends over (itself unless it shares another's)."""
        return layer if self.kv_sources is None else self.kv_sources[layer]

    def intermediate_size_of(self, layer: int) -> int:
        """Layer `layer`'s MLP width."""
        if self.layer_intermediate_sizes is None:
            return self.intermediate_size
        return self.layer_intermediate_sizes[layer]

    @property
    def rope_dims(self) -> int:
        """Values of each q/k head that RoPE rotates."""
        return self.rotary_dim or self.head_dim

    @property
    def rope_long(self) -> bool:
        """LongRoPE's long factors apply (see `rope_long_factors`)."""
        return self.rope_long_factors is not None and self.max_position_embeddings > (
            self.rope_original_context or 0
        )

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: it attends to the whole context)."""
        return 0 if self.layer_windows is None else self.layer_windows[layer]

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV pool's dtype: float32 unless the loader chose float16 or int8 (which only the
        cbserve attention kernel reads; it computes in float32 either way). Never bfloat16: CPU
        attention is slower in bfloat16 than in float32."""
        return self.kv_cache_dtype or torch.float32

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that attend (and so have K/V in the pool), in order."""
        recurrent = set(self.recurrent.layers) if self.recurrent is not None else set()
        return tuple(i for i in range(self.num_layers) if i not in recurrent)

    @property
    def state_layout(self) -> StateLayout | None:
        """The recurrent state a request keeps (None: a model with attention layers only)."""
        if self.recurrent is None:
            return None
        return self.recurrent.state_layout(self.hidden_size)

    @property
    def kv_layout(self) -> KVLayout:
        shapes = None
        if self.layer_head_dims is not None or self.layer_kv_heads is not None:
            shapes = tuple(
                (self.kv_heads_of(i), self.head_dim_of(i)) for i in range(self.num_layers)
            )
        return KVLayout(
            len(self.attention_layers), self.num_kv_heads, self.head_dim, self.kv_dtype,
            self.rope_interleaved, shapes, self.kv_sources,
        )  # fmt: skip

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V that one token occupies across all layers."""
        return self.kv_layout.bytes_per_token
