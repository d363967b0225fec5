"""LFM2 (Liquid AI's LFM2-350M .. 2.6B): a hybrid of attention layers and gated short
convolutions, each layer pre-norm with a SwiGLU MLP.

- Conv layers (`Lfm2ConvLayer`): `[B, C, x] = in_proj(h)`, the product B * x through a
  depthwise causal convolution of width L (3; no bias, no activation) over time, then C * that,
  then `out_proj`. A request's state per conv layer is its last L - 1 products B * x.
- Attention layers (`Lfm2AttentionLayer`): grouped-query attention with an RMSNorm over each q
  and k head before RoPE (Qwen3's QK-norm), full-head NEOX RoPE.
- The final norm is called `embedding_norm` (GGUF: token_embd_norm); the head is tied.

Hugging Face names: `operator_norm` / `ffn_norm` around `self_attn` (q/k/v_proj, out_proj,
q_layernorm, k_layernorm) or `conv` (in_proj, conv, out_proj) and `feed_forward` (w1 gate, w3
up, w2 down). The shared pieces (attention, MLP, norms) are `models.decoder`'s.

LFM2-MoE (LFM2-8B-A1B, LFM2-24B-A2B; `Lfm2MoeForCausalLM`): the same layers, the MLP of every
layer after the first `num_dense_layers` a sparse one (`Lfm2MoeBlock`: sigmoid gating, the top
k chosen by sigmoid plus a learned expert bias, weighted by their sigmoids renormalized; each
expert w1 / w3 / w2 under `feed_forward.experts.E.`, the router `feed_forward.gate`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from models.config import ModelConfig
from models.decoder import MLP, Attention, DecoderLayer, HFLoader, Linear, RMSNorm
from models.hybrid import HybridForCausalLM, RecurrentLayer, conv_parameter, take_conv_weight
from models.moe import SparseMoeBlock
from models.recurrent import causal_conv1d

if TYPE_CHECKING:
    from models.packing import Packer

NORMS = ("operator_norm", "ffn_norm")
FFN = "feed_forward."


def _ffn_names(prefix: str) -> set[str]:
    """A gated MLP's w1 (gate), w3 (up), w2 (down) below `prefix`."""
    return {f"{prefix}{w}.weight" for w in ("w1", "w2", "w3")}


def _load_mlp(loader: HFLoader, src: str, dst: str) -> None:
    loader.put(
        f"{dst}gate_up_proj.weight", loader.fused("", [f"{src}w1.weight", f"{src}w3.weight"])
    )
    loader.put(f"{dst}down_proj.weight", loader.take(f"{src}w2.weight"))


def _pack_mlp(mlp: MLP, packer: Packer, src: str, rows: bool = False) -> None:
    gate_up = [[f"{src}w1.weight", f"{src}w3.weight"]]
    mlp.gate_up_proj = packer(mlp.gate_up_proj, gate_up, gate_up=True, rows=rows)
    mlp.down_proj = packer(mlp.down_proj, [[f"{src}w2.weight"]], rows=rows)


class _DenseFFN:
    """A layer's `feed_forward` (its `mlp`): the dense gated MLP."""

    mlp: nn.Module

    @staticmethod
    def make_ffn(config: ModelConfig) -> nn.Module:
        return MLP(config)

    @classmethod
    def ffn_names(cls, config: ModelConfig, prefix: str) -> set[str]:
        return _ffn_names(f"{prefix}{FFN}")

    def load_ffn(self, loader: HFLoader, src: str, dst: str) -> None:
        _load_mlp(loader, f"{src}{FFN}", f"{dst}mlp.")

    def pack_ffn(self, packer: Packer, src: str) -> None:
        assert isinstance(self.mlp, MLP)
        _pack_mlp(self.mlp, packer, f"{src}{FFN}")


class Lfm2MoeBlock(SparseMoeBlock):
    """LFM2-MoE's sparse MLP under its checkpoint's names (experts' w1 / w3 / w2)."""

    @classmethod
    def expert_weight_names(cls, config: ModelConfig, prefix: str) -> set[str]:
        return _ffn_names(prefix)

    def load_expert(self, expert: MLP, loader: HFLoader, src: str, dst: str) -> None:
        _load_mlp(loader, src, dst)

    def pack_expert(self, expert: MLP, packer: Packer, src: str) -> None:
        _pack_mlp(expert, packer, src, rows=True)


class _SparseFFN(_DenseFFN):
    """A layer's `feed_forward` as LFM2-MoE's sparse MLP."""

    @staticmethod
    def make_ffn(config: ModelConfig) -> nn.Module:
        return Lfm2MoeBlock(config)

    @classmethod
    def ffn_names(cls, config: ModelConfig, prefix: str) -> set[str]:
        return Lfm2MoeBlock.hf_weight_names(config, f"{prefix}{FFN}")

    def load_ffn(self, loader: HFLoader, src: str, dst: str) -> None:
        self.mlp.load(loader, f"{src}{FFN}", f"{dst}mlp.")

    def pack_ffn(self, packer: Packer, src: str) -> None:
        self.mlp.pack(packer, f"{src}{FFN}")


def _load_norms(loader: HFLoader, src: str, dst: str) -> None:
    for n in NORMS:
        loader.put(f"{dst}{n}.weight", loader.norm(f"{src}{n}.weight"))


class Lfm2AttentionLayer(_DenseFFN, DecoderLayer):
    NORMS = NORMS

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.operator_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.make_ffn(config)

    def forward(self, x, rope, kv_cache, meta) -> torch.Tensor:
        x = self.self_attn(self.operator_norm(x), rope, kv_cache, meta, residual=x)
        return self.mlp(self.ffn_norm(x), residual=x)

    @classmethod
    def hf_weight_names(cls, config: ModelConfig, prefix: str) -> set[str]:
        a = f"{prefix}self_attn."
        names = {f"{a}{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "out_proj")}
        names |= {f"{a}{n}_layernorm.weight" for n in "qk"}
        return names | cls.ffn_names(config, prefix) | {f"{prefix}{n}.weight" for n in NORMS}

    def load(self, loader: HFLoader, src: str, dst: str) -> None:
        a, d = f"{src}self_attn.", f"{dst}self_attn."
        qkv = [f"{a}{n}_proj.weight" for n in "qkv"]
        loader.put(f"{d}qkv_proj.weight", loader.fused("", qkv))
        loader.put(f"{d}o_proj.weight", loader.take(f"{a}out_proj.weight"))
        loader.put(f"{d}q_norm.weight", loader.norm(f"{a}q_layernorm.weight"))
        loader.put(f"{d}k_norm.weight", loader.norm(f"{a}k_layernorm.weight"))
        self.load_ffn(loader, src, dst)
        _load_norms(loader, src, dst)

    def pack(self, packer: Packer, src: str) -> None:
        a, attn = f"{src}self_attn.", self.self_attn
        attn.qkv_proj = packer(attn.qkv_proj, [[f"{a}{n}_proj.weight" for n in "qkv"]])
        attn.o_proj = packer(attn.o_proj, [[f"{a}out_proj.weight"]])
        self.pack_ffn(packer, src)


class Lfm2ConvLayer(_DenseFFN, RecurrentLayer):
    """A gated short-convolution layer (see the module docstring)."""

    NORMS = NORMS

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        assert config.recurrent is not None
        d = config.hidden_size
        self.hidden = d
        self.operator_norm = RMSNorm(d, config.rms_norm_eps)
        self.in_proj = Linear(d, 3 * d, bias=False)
        self.conv = conv_parameter(d, config.recurrent.conv_kernel)  # (d, L)
        self.out_proj = Linear(d, d, bias=False)
        self.ffn_norm = RMSNorm(d, config.rms_norm_eps)
        self.mlp = self.make_ffn(config)

    def forward(self, x, pools, state) -> torch.Tensor:  # type: ignore[override]
        bcx = self.in_proj(self.operator_norm(x))  # (T, 3d): B, C, x
        b, c, h = bcx.split(self.hidden, dim=-1)
        y = causal_conv1d(b * h, self.conv, None, pools[0], state, False, self.use_kernel)
        x = self.out_proj(c * y, residual=x)
        return self.mlp(self.ffn_norm(x), residual=x)

    @classmethod
    def hf_weight_names(cls, config: ModelConfig, prefix: str) -> set[str]:
        c = f"{prefix}conv."
        names = {f"{c}in_proj.weight", f"{c}conv.weight", f"{c}out_proj.weight"}
        return names | cls.ffn_names(config, prefix) | {f"{prefix}{n}.weight" for n in NORMS}

    def load(self, loader: HFLoader, src: str, dst: str) -> None:
        c = f"{src}conv."
        loader.put(f"{dst}in_proj.weight", loader.take(f"{c}in_proj.weight"))
        loader.put(f"{dst}conv", take_conv_weight(loader, f"{c}conv.weight", self.hidden))
        loader.put(f"{dst}out_proj.weight", loader.take(f"{c}out_proj.weight"))
        self.load_ffn(loader, src, dst)
        _load_norms(loader, src, dst)

    def pack(self, packer: Packer, src: str) -> None:
        super().pack(packer, src)
        c = f"{src}conv."
        self.in_proj = packer(self.in_proj, [[f"{c}in_proj.weight"]])
        self.out_proj = packer(self.out_proj, [[f"{c}out_proj.weight"]])
        self.pack_ffn(packer, src)


class Lfm2ForCausalLM(HybridForCausalLM):
    attention_layer = Lfm2AttentionLayer
    recurrent_layer = Lfm2ConvLayer
    FINAL_NORM = "model.embedding_norm.weight"


class Lfm2MoeAttentionLayer(_SparseFFN, Lfm2AttentionLayer):
    pass


class Lfm2MoeConvLayer(_SparseFFN, Lfm2ConvLayer):
    pass


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """LFM2's layers, the MLPs past the first `moe_dense_layers` sparse."""

    @classmethod
    def layer_classes(cls, config: ModelConfig) -> list[type[DecoderLayer]]:
        sparse = {Lfm2AttentionLayer: Lfm2MoeAttentionLayer, Lfm2ConvLayer: Lfm2MoeConvLayer}
        return [
            c if i < config.moe_dense_layers else sparse[c]
            for i, c in enumerate(super().layer_classes(config))
        ]
