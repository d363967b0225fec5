"""Qwen3.5 (dense: 0.8B .. 27B; the text model of the multimodal checkpoints): three Gated
DeltaNet layers to one gated attention layer, every layer pre-norm with a SwiGLU MLP, all
norms zero-centred (x / rms(x) * (1 + w); the loaders hand this module 1 + w).

- Gated DeltaNet layers (`Qwen35DeltaLayer`, Hugging Face's `linear_attn`): [q | k | v] =
  `in_proj_qkv(x)` through a depthwise causal conv of width 4 and SiLU; beta = sigmoid(b), the
  log decay g = -exp(A_log) softplus(a + dt_bias) (b, a: `in_proj_b`, `in_proj_a`); the gated
  delta rule (`models.recurrent.gated_delta_rule`) over per-request state (v heads, dk, dv);
  its output RMS-normed per head (a plain weight), times silu(z) (z: `in_proj_z`), `out_proj`.
  A request's state per such layer: the conv's last 3 inputs of q | k | v and the (Hv, dk, dv)
  state.
- Attention layers (`Qwen35AttentionLayer`): `q_proj` gives each head's query and an output
  gate side by side ([q | gate] per head); QK-norm; RoPE on the first quarter of each head (the
  multimodal RoPE sections coincide with plain RoPE for text); the output times sigmoid(gate).

The projections are fused for one matmul each: q/k/v (with the gates), in_proj_qkv with
in_proj_z, in_proj_b with in_proj_a, gate/up.

Qwen3.5-MoE (35B-A3B, 122B-A10B, 397B-A17B; `Qwen35MoeForCausalLM`): the same layers with a
sparse MLP in every one (`models.moe.SparseMoeBlock`: softmax over the experts, the top k
renormalized, plus a shared expert times sigmoid of its gate).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from models import ops
from models.config import ModelConfig
from models.decoder import MLP, Attention, HFLoader, Linear, RMSNorm
from models.hybrid import HybridForCausalLM, RecurrentLayer, conv_parameter, take_conv_weight
from models.llama import LlamaDecoderLayer
from models.moe import SparseMlp
from models.recurrent import causal_conv1d, gated_delta_rule, rowwise

if TYPE_CHECKING:
    from models.packing import Packer


class GatedAttention(Attention):
    """Attention whose q projection also gives an output gate per head ([q | gate] per head,
    `2 head_dim` rows a head): the attention output times sigmoid(gate), then `o_proj`."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        self.qkv_proj = Linear(
            config.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )

    def forward(self, x, rope, kv_cache, meta, residual=None) -> torch.Tensor:
        y = self.qkv_proj(x)  # (T, H 2hd + 2 KV hd): [q | gate] per head, k, v
        t = y.shape[0]
        qg = y[:, : 2 * self.q_size].view(t, self.n_heads, 2, self.hd)
        qkv = torch.cat([qg[:, :, 0].reshape(t, self.q_size), y[:, 2 * self.q_size :]], dim=1)
        if self.q_norm is not None:
            self._norm_qk(qkv)
        o = self.attend(qkv, rope, kv_cache, meta)  # (T, H hd)
        o = rowwise(lambda o, g: o * torch.sigmoid(g), o, qg[:, :, 1].reshape(t, self.q_size))
        return self.o_proj(o, residual)


class Qwen35AttentionLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        self.self_attn = GatedAttention(config, layer)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear attention (see the module docstring); parameters fused: `in_proj`
    [q | k | v | z], `in_proj_ba` [b | a]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        rc = config.recurrent
        assert rc is not None and rc.kind == "gated_delta"
        self.hk, self.hv, self.dk, self.dv = (
            rc.num_k_heads,
            rc.num_v_heads,
            rc.k_head_dim,
            rc.v_head_dim,
        )
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.tiled = rc.v_heads_tiled
        self.eps = config.rms_norm_eps
        d = config.hidden_size
        self.in_proj = Linear(d, self.conv_dim + self.value_dim, bias=False)
        self.in_proj_ba = Linear(d, 2 * self.hv, bias=False)
        self.conv1d = conv_parameter(self.conv_dim, rc.conv_kernel)
        self.dt_bias = nn.Parameter(torch.zeros(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = nn.Parameter(torch.ones(self.dv))
        self.out_proj = Linear(self.value_dim, d, bias=False)

    def forward(self, x, pools, state, residual, use_kernel: bool) -> torch.Tensor:
        t = x.shape[0]
        y = self.in_proj(x)  # (T, conv_dim + Vd): q, k, v, z
        ba = self.in_proj_ba(x)  # (T, 2 Hv): b, a
        mixed = causal_conv1d(
            y[:, : self.conv_dim], self.conv1d, None, pools[0], state, True, use_kernel
        )  # (T, conv_dim)
        kd = self.key_dim
        q = mixed[:, :kd].view(t, self.hk, self.dk)
        k = mixed[:, kd : 2 * kd].view(t, self.hk, self.dk)
        v = mixed[:, 2 * kd :].view(t, self.hv, self.dv)
        beta = rowwise(torch.sigmoid, ba[:, : self.hv])
        a = (-self.A_log.float().exp()).expand(t, -1)
        g = rowwise(
            lambda x, b, a: a * F.softplus(x + b), ba[:, self.hv :], self.dt_bias.expand(t, -1), a
        )
        o = gated_delta_rule(q, k, v, g, beta, pools[1], state, self.tiled, use_kernel)
        o = o.reshape(t, self.value_dim)
        if use_kernel and o.dtype == torch.float32:  # (a row's norm alone, in one op)
            ops.head_rms_norm(o, self.norm.expand(self.hv, -1).contiguous(), self.dv, self.eps)
        else:
            o = F.rms_norm(o.view(t, self.hv, self.dv), (self.dv,), self.norm, self.eps)
        o = rowwise(lambda o, z: o * F.silu(z), o.reshape(t, self.value_dim), y[:, self.conv_dim :])
        return self.out_proj(o, residual)


class Qwen35DeltaLayer(RecurrentLayer):
    NORMS = ("input_layernorm", "post_attention_layernorm")
    PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.linear_attn = GatedDeltaNet(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, pools, state) -> torch.Tensor:  # type: ignore[override]
        x = self.linear_attn(self.input_layernorm(x), pools, state, x, self.use_kernel)
        return self.mlp(self.post_attention_layernorm(x), residual=x)

    @classmethod
    def hf_weight_names(cls, config: ModelConfig, prefix: str) -> set[str]:
        a = f"{prefix}linear_attn."
        names = {f"{a}{p}.weight" for p in cls.PROJ}
        names |= {f"{a}conv1d.weight", f"{a}dt_bias", f"{a}A_log", f"{a}norm.weight"}
        names |= {f"{prefix}{n}.weight" for n in cls.NORMS}
        return names | cls.mlp_weight_names(config, prefix)

    def load(self, loader: HFLoader, src: str, dst: str) -> None:
        a, d, la = f"{src}linear_attn.", f"{dst}linear_attn.", self.linear_attn
        qkvz = [f"{a}in_proj_qkv.weight", f"{a}in_proj_z.weight"]
        loader.put(f"{d}in_proj.weight", loader.fused("", qkvz))
        loader.put(
            f"{d}in_proj_ba.weight",
            loader.fused("", [f"{a}in_proj_b.weight", f"{a}in_proj_a.weight"]),
        )
        loader.put(f"{d}conv1d", take_conv_weight(loader, f"{a}conv1d.weight", la.conv_dim))
        loader.put(f"{d}dt_bias", loader.take(f"{a}dt_bias"))
        loader.put(f"{d}A_log", loader.take(f"{a}A_log"))
        loader.put(f"{d}norm", loader.take(f"{a}norm.weight"))  # (a plain weight: no offset)
        loader.put(f"{d}out_proj.weight", loader.take(f"{a}out_proj.weight"))
        self.mlp.load(loader, f"{src}mlp.", f"{dst}mlp.")
        for n in self.NORMS:
            loader.put(f"{dst}{n}.weight", loader.norm(f"{src}{n}.weight"))

    def pack(self, packer: Packer, src: str) -> None:
        super().pack(packer, src)
        a, la = f"{src}linear_attn.", self.linear_attn
        la.in_proj = packer(la.in_proj, [[f"{a}in_proj_qkv.weight", f"{a}in_proj_z.weight"]])
        la.in_proj_ba = packer(la.in_proj_ba, [[f"{a}in_proj_b.weight", f"{a}in_proj_a.weight"]])
        la.out_proj = packer(la.out_proj, [[f"{a}out_proj.weight"]])
        self.mlp.pack(packer, f"{src}mlp.")


class Qwen35ForCausalLM(HybridForCausalLM):
    attention_layer = Qwen35AttentionLayer
    recurrent_layer = Qwen35DeltaLayer
    hf_norm_offset = 1.0  # zero-centred norms (the GDN output norm is loaded without it)


class Qwen35MoeAttentionLayer(SparseMlp, Qwen35AttentionLayer):
    pass


class Qwen35MoeDeltaLayer(SparseMlp, Qwen35DeltaLayer):
    pass


class Qwen35MoeForCausalLM(Qwen35ForCausalLM):
    attention_layer = Qwen35MoeAttentionLayer
    recurrent_layer = Qwen35MoeDeltaLayer
