"""Granite 4.0-H (IBM's granite-4.0-h-micro, -h-1b, -h-350m): Mamba2 layers beside a few
attention layers, every layer pre-norm with a SwiGLU MLP (the "shared MLP"), and Granite's
scalars: embeddings times `embedding_multiplier`, the softmax scale `attention_multiplier`, each
mixer's and MLP's output times `residual_multiplier` before its residual add
(`ModelConfig.residual_multiplier`), the logits divided by `logits_scaling`. The hybrids carry no
RoPE (the attention layers see positions only through the Mamba2 layers' state).

- Mamba2 layers (`GraniteMambaLayer`, Hugging Face's `mamba`): [z | xBC | dt] = `in_proj(h)`;
  xBC through a depthwise causal conv of width 4 with a bias, then SiLU, split [x | B | C]; the
  selective scan (`models.recurrent.mamba2_scan`) per head over per-request state (heads,
  head_dim, N), B and C shared by the heads of a group; y * silu(z) RMS-normed per group
  (gate before norm), times its weight, then `out_proj`. A request's state per such layer: the
  conv's last 3 inputs of xBC and the (heads, head_dim, N) state.
- Attention layers (`GraniteAttentionLayer`): grouped-query attention without QK-norm.

Hugging Face names: `input_layernorm` / `post_attention_layernorm` around `self_attn` or `mamba`
(in_proj, conv1d, dt_bias, A_log, D, norm, out_proj) and `shared_mlp` (input_linear = [gate |
up], output_linear); a GGUF file's split gate and up load as `shared_mlp.gate_proj` / `up_proj`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from models import ops
from models.config import ModelConfig
from models.decoder import MLP, Attention, DecoderLayer, HFLoader, Linear, RMSNorm, Rotary
from models.hybrid import HybridForCausalLM, RecurrentLayer, conv_parameter, take_conv_weight
from models.recurrent import causal_conv1d, mamba2_scan, rowwise

if TYPE_CHECKING:
    from models.packing import Packer

NORMS = ("input_layernorm", "post_attention_layernorm")
SHARED = "shared_mlp."
# (the GGUF file's split gate and up, under these names)
GATE_UP_PARTS = ("gate_proj", "up_proj")


def _residual(x: torch.Tensor, y: torch.Tensor, multiplier: float) -> torch.Tensor:
    return x + y if multiplier == 1.0 else torch.add(x, y, alpha=multiplier)


def _mlp_names(prefix: str) -> set[str]:
    m = f"{prefix}{SHARED}"
    names = {f"{m}input_linear.weight", f"{m}output_linear.weight"}
    return names | {f"{m}{p}.weight" for p in GATE_UP_PARTS}


def _load_mlp(loader: HFLoader, src: str, dst: str) -> None:
    m = f"{src}{SHARED}"
    parts = [f"{m}{p}.weight" for p in GATE_UP_PARTS]
    loader.put(f"{dst}mlp.gate_up_proj.weight", loader.fused(f"{m}input_linear.weight", parts))
    loader.put(f"{dst}mlp.down_proj.weight", loader.take(f"{m}output_linear.weight"))
    for n in NORMS:
        loader.put(f"{dst}{n}.weight", loader.norm(f"{src}{n}.weight"))


def _pack_mlp(mlp: MLP, packer: Packer, src: str) -> None:
    m = f"{src}{SHARED}"
    mlp.gate_up_proj = packer(
        mlp.gate_up_proj,
        [[f"{m}input_linear.weight"], [f"{m}{p}.weight" for p in GATE_UP_PARTS]],
        gate_up=True,
    )
    mlp.down_proj = packer(mlp.down_proj, [[f"{m}output_linear.weight"]])


class _GraniteLayer(DecoderLayer):
    """What both kinds of layer share: the norms, the shared MLP, the residual multiplier."""

    NORMS = NORMS

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.residual_multiplier = config.residual_multiplier

    def _add(self, x: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
        """x + m mixed, then the MLP's block: + m mlp(norm(.))."""
        m = self.residual_multiplier
        x = _residual(x, mixed, m)
        h = self.post_attention_layernorm(x)
        if m == 1.0:
            return self.mlp(h, residual=x)
        return _residual(x, self.mlp(h), m)


class GraniteAttentionLayer(_GraniteLayer):
    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config)
        self.self_attn = Attention(config, layer)

    def forward(self, x, rope, kv_cache, meta) -> torch.Tensor:
        return self._add(x, self.self_attn(self.input_layernorm(x), rope, kv_cache, meta))

    @classmethod
    def hf_weight_names(cls, config: ModelConfig, prefix: str) -> set[str]:
        names = Attention.hf_weight_names(config, prefix) | _mlp_names(prefix)
        return names | {f"{prefix}{n}.weight" for n in NORMS}

    def load(self, loader: HFLoader, src: str, dst: str) -> None:
        self.self_attn.load(loader, src, dst)
        _load_mlp(loader, src, dst)

    def pack(self, packer: Packer, src: str) -> None:
        self.self_attn.pack(packer, src)
        _pack_mlp(self.mlp, packer, src)


class Mamba2Mixer(nn.Module):
    """Granite 4.0-H's Mamba2 mixer (see the module docstring). `A` is kept as -exp(A_log)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        rc = config.recurrent
        assert rc is not None and rc.kind == "mamba2"
        self.heads, self.head_dim = rc.num_v_heads, rc.v_head_dim
        self.groups, self.n = rc.num_groups, rc.state_size
        self.inner = self.heads * self.head_dim
        self.conv_dim = rc.conv_channels(config.hidden_size)
        self.group_size = self.inner // self.groups
        self.eps = config.rms_norm_eps
        d = config.hidden_size
        self.in_proj = Linear(d, self.inner + self.conv_dim + self.heads, bias=False)
        self.conv1d = conv_parameter(self.conv_dim, rc.conv_kernel)
        self.conv1d_bias = nn.Parameter(torch.zeros(self.conv_dim)) if rc.conv_bias else None
        self.dt_bias = nn.Parameter(torch.zeros(self.heads))
        self.A = nn.Parameter(torch.zeros(self.heads))
        self.D = nn.Parameter(torch.zeros(self.heads))
        self.norm = nn.Parameter(torch.ones(self.groups, self.group_size))
        self.out_proj = Linear(self.inner, d, bias=False)

    def forward(self, x, pools, state, use_kernel: bool) -> torch.Tensor:
        t, di, gn = x.shape[0], self.inner, self.groups * self.n
        y = self.in_proj(x)  # (T, inner + conv_dim + heads): z, xBC, dt
        xbc = causal_conv1d(
            y[:, di : di + self.conv_dim], self.conv1d, self.conv1d_bias, pools[0], state, True,
            use_kernel,
        )  # fmt: skip
        xs = xbc[:, :di].view(t, self.heads, self.head_dim)
        b = xbc[:, di : di + gn].view(t, self.groups, self.n)
        c = xbc[:, di + gn :].view(t, self.groups, self.n)
        dt = y[:, di + self.conv_dim :]
        o = mamba2_scan(
            xs, dt, self.A, b, c, self.D, self.dt_bias, pools[1], state, use_kernel
        ).reshape(t, di)
        # gate before norm: y * silu(z), then RMS over each group
        o = rowwise(lambda o, z: o * F.silu(z), o, y[:, :di])
        if use_kernel and o.dtype == torch.float32:  # (a row's groups alone, in one op)
            o = o.contiguous()
            ops.head_rms_norm(o, self.norm, self.group_size, self.eps)
        else:
            g = o.view(t, self.groups, self.group_size)
            o = (F.rms_norm(g, (self.group_size,), eps=self.eps) * self.norm).reshape(t, di)
        return self.out_proj(o)


class GraniteMambaLayer(RecurrentLayer, _GraniteLayer):
    MIXER = ("in_proj", "out_proj")

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        _GraniteLayer.__init__(self, config)
        self.mamba = Mamba2Mixer(config)

    def forward(self, x, pools, state) -> torch.Tensor:  # type: ignore[override]
        return self._add(x, self.mamba(self.input_layernorm(x), pools, state, self.use_kernel))

    @classmethod
    def hf_weight_names(cls, config: ModelConfig, prefix: str) -> set[str]:
        m = f"{prefix}mamba."
        names = {f"{m}{p}.weight" for p in cls.MIXER}
        names |= {f"{m}conv1d.weight", f"{m}conv1d.bias", f"{m}dt_bias", f"{m}A_log", f"{m}D"}
        names |= {f"{m}norm.weight"} | {f"{prefix}{n}.weight" for n in NORMS}
        return names | _mlp_names(prefix)

    def load(self, loader: HFLoader, src: str, dst: str) -> None:
        m, d, mx = f"{src}mamba.", f"{dst}mamba.", self.mamba
        loader.put(f"{d}in_proj.weight", loader.take(f"{m}in_proj.weight"))
        loader.put(f"{d}conv1d", take_conv_weight(loader, f"{m}conv1d.weight", mx.conv_dim))
        if mx.conv1d_bias is not None:
            loader.put(f"{d}conv1d_bias", loader.take(f"{m}conv1d.bias"))
        loader.put(f"{d}dt_bias", loader.take(f"{m}dt_bias").reshape(-1))
        loader.put(f"{d}A", -loader.take(f"{m}A_log").float().reshape(-1).exp())
        loader.put(f"{d}D", loader.take(f"{m}D").reshape(-1))
        loader.put(f"{d}norm", loader.take(f"{m}norm.weight").reshape(mx.norm.shape))
        loader.put(f"{d}out_proj.weight", loader.take(f"{m}out_proj.weight"))
        _load_mlp(loader, src, dst)

    def pack(self, packer: Packer, src: str) -> None:
        RecurrentLayer.pack(self, packer, src)
        m, mx = f"{src}mamba.", self.mamba
        mx.in_proj = packer(mx.in_proj, [[f"{m}in_proj.weight"]])
        mx.out_proj = packer(mx.out_proj, [[f"{m}out_proj.weight"]])
        _pack_mlp(self.mlp, packer, src)


class GraniteHybridForCausalLM(HybridForCausalLM):
    attention_layer = GraniteAttentionLayer
    recurrent_layer = GraniteMambaLayer

    def _rotaries(self, config: ModelConfig) -> None:
        # Without RoPE (every layer in `nope_layers`): tables of zero frequencies, which rotate
        # nothing (cos 1, sin 0)
        nope = config.nope_layers is not None and all(config.nope_layers)
        self.rotary = Rotary(config, local=nope)
        self.rotary_local = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        scaling = self.config.logits_scaling
        return logits if scaling == 1.0 else logits / scaling
