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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from models.config import ModelConfig
from models.decoder import MLP, Attention, DecoderLayer, HFLoader, Linear, RMSNorm
from models.hybrid import HybridForCausalLM, RecurrentLayer, conv_parameter, take_conv_weight
from models.recurrent import causal_conv1d

if TYPE_CHECKING:
    from models.packing import Packer

NORMS = ("operator_norm", "ffn_norm")
FFN = "feed_forward."


def _ffn_names(prefix: str) -> set[str]:
    return {f"{prefix}{FFN}{w}.weight" for w in ("w1", "w2", "w3")}


def _load_ffn(mlp: MLP, loader: HFLoader, src: str, dst: str) -> None:
    f = f"{src}{FFN}"
    loader.put(
        f"{dst}mlp.gate_up_proj.weight", loader.fused("", [f"{f}w1.weight", f"{f}w3.weight"])
    )
    loader.put(f"{dst}mlp.down_proj.weight", loader.take(f"{f}w2.weight"))


def _pack_ffn(mlp: MLP, packer: Packer, src: str) -> None:
    f = f"{src}{FFN}"
    mlp.gate_up_proj = packer(mlp.gate_up_proj, [[f"{f}w1.weight", f"{f}w3.weight"]], gate_up=True)
    mlp.down_proj = packer(mlp.down_proj, [[f"{f}w2.weight"]])


def _load_norms(loader: HFLoader, src: str, dst: str) -> None:
    for n in NORMS:
        loader.put(f"{dst}{n}.weight", loader.norm(f"{src}{n}.weight"))


class Lfm2AttentionLayer(DecoderLayer):
    NORMS = NORMS

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.operator_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, rope, kv_cache, meta) -> torch.Tensor:
        x = self.self_attn(self.operator_norm(x), rope, kv_cache, meta, residual=x)
        return self.mlp(self.ffn_norm(x), residual=x)

    @classmethod
    def hf_weight_names(cls, config: ModelConfig, prefix: str) -> set[str]:
        a = f"{prefix}self_attn."
        names = {f"{a}{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "out_proj")}
        names |= {f"{a}{n}_layernorm.weight" for n in "qk"}
        return names | _ffn_names(prefix) | {f"{prefix}{n}.weight" for n in NORMS}

    def load(self, loader: HFLoader, src: str, dst: str) -> None:
        a, d = f"{src}self_attn.", f"{dst}self_attn."
        qkv = [f"{a}{n}_proj.weight" for n in "qkv"]
        loader.put(f"{d}qkv_proj.weight", loader.fused("", qkv))
        loader.put(f"{d}o_proj.weight", loader.take(f"{a}out_proj.weight"))
        loader.put(f"{d}q_norm.weight", loader.norm(f"{a}q_layernorm.weight"))
        loader.put(f"{d}k_norm.weight", loader.norm(f"{a}k_layernorm.weight"))
        _load_ffn(self.mlp, loader, src, dst)
        _load_norms(loader, src, dst)

    def pack(self, packer: Packer, src: str) -> None:
        a, attn = f"{src}self_attn.", self.self_attn
        attn.qkv_proj = packer(attn.qkv_proj, [[f"{a}{n}_proj.weight" for n in "qkv"]])
        attn.o_proj = packer(attn.o_proj, [[f"{a}out_proj.weight"]])
        _pack_ffn(self.mlp, packer, src)


class Lfm2ConvLayer(RecurrentLayer):
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
        self.mlp = MLP(config)

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
        return names | _ffn_names(prefix) | {f"{prefix}{n}.weight" for n in NORMS}

    def load(self, loader: HFLoader, src: str, dst: str) -> None:
        c = f"{src}conv."
        loader.put(f"{dst}in_proj.weight", loader.take(f"{c}in_proj.weight"))
        loader.put(f"{dst}conv", take_conv_weight(loader, f"{c}conv.weight", self.hidden))
        loader.put(f"{dst}out_proj.weight", loader.take(f"{c}out_proj.weight"))
        _load_ffn(self.mlp, loader, src, dst)
        _load_norms(loader, src, dst)

    def pack(self, packer: Packer, src: str) -> None:
        super().pack(packer, src)
        c = f"{src}conv."
        self.in_proj = packer(self.in_proj, [[f"{c}in_proj.weight"]])
        self.out_proj = packer(self.out_proj, [[f"{c}out_proj.weight"]])
        _pack_ffn(self.mlp, packer, src)


class Lfm2ForCausalLM(HybridForCausalLM):
    attention_layer = Lfm2AttentionLayer
    recurrent_layer = Lfm2ConvLayer
    FINAL_NORM = "model.embedding_norm.weight"
