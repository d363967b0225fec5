"""Gemma 4 (text): Gemma 3's four-norm layer with what Gemma 4 adds, on the shared decoder pieces.

What differs from `models.gemma3` (the config fields are `models.config.ModelConfig`'s):
- plain RMSNorm weights (x̂ · w, no 1 + w) and attention scale 1.0: q and k are RMS-normed per
  head (QK-norm), and V too, without a weight (`v_norm`);
- two attention shapes (`layer_head_dims`, `layer_kv_heads`): sliding-window layers with
  256-dim heads and RoPE over all of them (base 10,000), global layers with 512-dim heads and
  "proportional" RoPE (base 1,000,000; the first quarter of the frequencies, with exponents over
  the whole head, the others zero: `rope_freq_factors` of 1 and infinity, as llama.cpp's
  converter writes 1 and 1e30);
- KV sharing (`kv_sources`): the last layers compute queries only and attend over the K/V of the
  last earlier layer of their kind, reading its pool blocks in place (the runner hands them that
  layer's pools; the attention kernel takes queries alone and writes nothing);
- per-layer MLP widths (`layer_intermediate_sizes`: the shared layers' double-wide MLP);
- per-layer input embeddings (PLE, `per_layer_input_size`): per token and layer a 256-value
  input, (the table's row x 16 + RMSNorm(W_p · embedding / sqrt(hidden))) / sqrt(2), which each
  layer gates into its stream after the MLP: x += RMSNorm(W_up(gelu(W_gate x) * input)); the
  table (vocabulary x layers x 256) is read a few rows a step where it lies in the file
  (`models.row_table.RowTable`);
- a learned scalar multiplying each layer's output (`layer_scalar`).
Without a KV pool (the naive engine's full recompute) the model attends over pools of its own
for the one step, so a shared layer reads its source layer's K/V there too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from models import ops
from models.attention import AttentionMetadata, PrefillChunk, paged_attention
from models.config import ModelConfig
from models.decoder import (
    MLP,
    Attention,
    DecoderForCausalLM,
    DecoderLayer,
    HFLoader,
    Linear,
    RMSNorm,
    apply_rotary,
)
from models.gemma3 import Gemma3DecoderLayer
from models.row_table import RowTable, RowTables

if TYPE_CHECKING:
    from models.packing import Packer

PLE_TABLE = "model.embed_tokens_per_layer.weight"
PLE_PROJECTION = "model.per_layer_model_projection.weight"
PLE_NORM = "model.per_layer_projection_norm.weight"


class Gemma4Attention(Attention):
    """QK-norm and an unweighted V norm, scale 1.0; a layer sharing an earlier layer's K/V has
    a q projection only and reads that layer's pool."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        self.shared = config.kv_source(layer) != layer
        self.v_norm = config.v_norm
        if self.shared:  # queries only: the pool it reads holds its source layer's K/V
            self.qkv_proj = Linear(config.hidden_size, self.q_size, bias=False)
            self.k_norm = None

    def qk_weight(self) -> torch.Tensor | None:
        """The per-head norm weights of the projection's heads, q then k then v (ones: V's norm
        has no weight); a shared layer's, q only."""
        q = self.q_norm.weight.expand(self.n_heads, -1)
        if self.shared:
            return q.contiguous()
        parts = [q, self.k_norm.weight.expand(self.n_kv, -1)]
        if self.v_norm:
            parts.append(torch.ones(self.n_kv, self.hd, dtype=q.dtype))
        return torch.cat(parts).contiguous()

    def attend(self, qkv, rope, kv_cache, meta) -> torch.Tensor:
        if not self.shared:
            return super().attend(qkv, rope, kv_cache, meta)
        if rope.cos_half is not None:
            # (the kernel takes queries alone: roped, attending over the pools, nothing written)
            return ops.attention(
                qkv, rope.cos_half, rope.sin_half, *kv_cache, *meta.kernel_args(),
                num_heads=self.n_heads, num_kv_heads=self.n_kv, head_dim=self.hd,
                scale=self.scale, window=self.window, softcap=self.softcap,
            )  # fmt: skip
        t = qkv.shape[0]
        q = apply_rotary(qkv.view(t, self.n_heads, self.hd), rope.cos, rope.sin)
        o = paged_attention(q, None, None, kv_cache, meta, self.scale, self.window, self.softcap)
        return o.reshape(t, self.q_size)

    def load(self, loader: HFLoader, src: str, dst: str) -> None:
        if not self.shared:
            super().load(loader, src, dst)
            return
        # (a checkpoint may hold k/v projections for a shared layer too: never used)
        a, d = f"{src}self_attn.", f"{dst}self_attn."
        loader.put(f"{d}qkv_proj.weight", loader.take(f"{a}q_proj.weight"))
        loader.put(f"{d}q_norm.weight", loader.norm(f"{a}q_norm.weight"))
        loader.put(f"{d}o_proj.weight", loader.take(f"{a}o_proj.weight"))

    def pack(self, packer: Packer, src: str) -> None:
        if not self.shared:
            super().pack(packer, src)
            return
        a = f"{src}self_attn."
        self.qkv_proj = packer(self.qkv_proj, [[f"{a}q_proj.weight"]])
        self.o_proj = packer(self.o_proj, [[f"{a}o_proj.weight"]])


class Gemma4DecoderLayer(Gemma3DecoderLayer):
    """Gemma 3's layer (four norms, GeGLU) with Gemma 4's attention, its layer's MLP width, the
    per-layer input gated in after the MLP, and the output scaled by `layer_scalar`."""

    PLE = ("per_layer_input_gate", "per_layer_projection")

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        DecoderLayer.__init__(self)  # (Gemma 3's modules, with Gemma 4's attention and MLP)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = Gemma4Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.pre_feedforward_layernorm = RMSNorm(d, eps)
        self.mlp = MLP(config, config.intermediate_size_of(layer))
        self.post_feedforward_layernorm = RMSNorm(d, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.ple = config.per_layer_input_size > 0
        if self.ple:
            p = config.per_layer_input_size
            self.per_layer_input_gate = Linear(d, p, bias=False)
            self.per_layer_projection = Linear(p, d, bias=False)
            self.post_per_layer_input_norm = RMSNorm(d, eps)

    def forward(self, x, rope, kv_cache, meta, per_layer_input=None) -> torch.Tensor:
        x = super().forward(x, rope, kv_cache, meta)
        if per_layer_input is not None:  # (T, P): this layer's input (`per_layer_inputs`)
            gate = F.gelu(self.per_layer_input_gate(x), approximate="tanh")
            x = x + self.post_per_layer_input_norm(
                self.per_layer_projection(gate * per_layer_input)
            )
        return x * self.layer_scalar

    @classmethod
    def hf_weight_names(cls, config: ModelConfig, prefix: str) -> set[str]:
        names = super().hf_weight_names(config, prefix) | {f"{prefix}layer_scalar"}
        if config.per_layer_input_size:
            names |= {f"{prefix}{n}.weight" for n in (*cls.PLE, "post_per_layer_input_norm")}
        return names

    def load(self, loader: HFLoader, src: str, dst: str) -> None:
        super().load(loader, src, dst)
        loader.put(f"{dst}layer_scalar", loader.take(f"{src}layer_scalar").reshape(1))
        if self.ple:
            for n in self.PLE:
                loader.put(f"{dst}{n}.weight", loader.take(f"{src}{n}.weight"))
            n = "post_per_layer_input_norm.weight"
            loader.put(f"{dst}{n}", loader.norm(f"{src}{n}"))

    def pack(self, packer: Packer, src: str) -> None:
        super().pack(packer, src)
        if self.ple:
            for n in self.PLE:
                setattr(self, n, packer(getattr(self, n), [[f"{src}{n}.weight"]]))


class Gemma4ForCausalLM(DecoderForCausalLM):
    layer_class = Gemma4DecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        p, n = config.per_layer_input_size, config.num_layers
        self.embed_tokens_per_layer: RowTable | None = None  # the file's table, set by loading
        if p:
            self.per_layer_model_projection = Linear(config.hidden_size, n * p, bias=False)
            self.per_layer_projection_norm = RMSNorm(p, config.rms_norm_eps)

    def _global_rope_config(self, config: ModelConfig) -> ModelConfig:
        # The global layers' RoPE spans their own (wider) heads; the sliding layers' theirs.
        glob = next(i for i in range(config.num_layers) if not config.window(i))
        return replace(config, head_dim=config.head_dim_of(glob))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: (T,). Returns final hidden states (T, d_model)."""
        if kv_caches is None:
            kv_caches, meta = self._step_pools(meta)
        x = self.embed(input_ids)  # (T, d)
        ple = self.per_layer_inputs(input_ids, x)  # (T, layers, P) or None
        rope, local = self.ropes(positions)
        for i, layer in enumerate(self.layers):
            layer_rope = local if layer.self_attn.local_rope else rope
            x = layer(x, layer_rope, kv_caches[i], meta, None if ple is None else ple[:, i])
        return self.norm(x)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """Each token's input to each layer, (T, layers, P), from its table row and its scaled
        embedding `x` (T, d); None without per-layer inputs."""
        c = self.config
        p = c.per_layer_input_size
        if not p:
            return None
        assert self.embed_tokens_per_layer is not None, "the per-layer table is loaded"
        t = input_ids.shape[0]
        rows = self.embed_tokens_per_layer(input_ids) * float(p) ** 0.5  # (T, layers * P)
        proj = self.per_layer_model_projection(x) * c.hidden_size**-0.5  # (T, layers * P)
        proj = self.per_layer_projection_norm(proj.view(t * c.num_layers, p))
        return (proj.view(t, c.num_layers, p) + rows.view(t, c.num_layers, p)) * 2.0**-0.5

    def _step_pools(self, meta: AttentionMetadata) -> tuple[list, AttentionMetadata]:
        """Pools for one step without the engine's (each prefill chunk a whole sequence, one
        block each) and the step's metadata over them."""
        size = max(c.num_tokens for c in meta.prefills)
        _, caches = self.config.kv_layout.allocate(len(meta.prefills), size)
        slots, chunks = [], []
        for b, c in enumerate(meta.prefills):
            if c.context_len != c.num_tokens:
                raise ValueError("without a KV pool each chunk is a whole sequence")
            slots.extend(range(b * size, b * size + c.num_tokens))
            table = torch.tensor([b], dtype=torch.long)
            chunks.append(PrefillChunk(c.token_start, c.num_tokens, c.context_len, table))
        step = AttentionMetadata(torch.tensor(slots, dtype=torch.long), 0, None, None, chunks)
        return caches, step

    # -- loading and packing ---------------------------------------------------------------------

    @classmethod
    def hf_weight_names(cls, config: ModelConfig) -> set[str]:
        names = super().hf_weight_names(config)
        if config.per_layer_input_size:
            names |= {PLE_TABLE, PLE_PROJECTION, PLE_NORM}
        return names

    def _load_more(self, loader: HFLoader) -> None:
        if not self.config.per_layer_input_size:
            return
        loader.put("per_layer_model_projection.weight", loader.take(PLE_PROJECTION))
        loader.put("per_layer_projection_norm.weight", loader.norm(PLE_NORM))
        # the table stays where the checkpoint holds it (its file's map), never converted whole
        tensors = loader.tensors
        table = (
            tensors.table(PLE_TABLE) if isinstance(tensors, RowTables) else loader.take(PLE_TABLE)
        )
        rows = RowTable(table)
        c = self.config
        if rows.width != c.num_layers * c.per_layer_input_size:
            raise ValueError(
                f"{PLE_TABLE}: {rows.width} values a row, not {c.num_layers} x "
                f"{c.per_layer_input_size}"
            )
        if rows.num_rows < c.vocab_size:  # (every token id the model takes is a row of it)
            raise ValueError(f"{PLE_TABLE}: {rows.num_rows} rows for {c.vocab_size} tokens")
        self.embed_tokens_per_layer = rows

    def _make_plan(self) -> None:
        """The layer stack as one op does not know per-layer inputs, scalars or shared K/V."""
        return None

    @torch.no_grad()
    def pack(self, packer: Packer) -> None:
        super().pack(packer)
        if self.config.per_layer_input_size:
            self.per_layer_model_projection = packer(
                self.per_layer_model_projection, [[PLE_PROJECTION]]
            )
            assert self.embed_tokens_per_layer is not None
            self.embed_tokens_per_layer.kernels = True

    def num_parameters(self) -> int:
        n = super().num_parameters()
        table = self.embed_tokens_per_layer
        return n + (0 if table is None else table.num_rows * table.width)
