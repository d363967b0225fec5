"""Mixture-of-experts decoders: Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, Qwen3-235B-A22B),
and the sparse MLP gpt-oss's layer (`models.gpt_oss`) builds on.

Owns: the sparse MLP (`SparseMoeBlock`: a router scoring every expert, the top k per token by the
config's gating (softmax, top-k-then-softmax, or sigmoid with an expert bias steering the
choice), each expert a gated MLP of `moe_intermediate_size`, with biases where the config has
them, and a shared expert behind a sigmoid gate where it has one), its decoder class and what
differs in its tensor names and packing. The hybrid families' sparse layers (`models.qwen35`,
`models.lfm2`) use the same block. Attention,
norms and RoPE are the Llama layer's (`models.llama`).

Tokens are grouped by expert: each expert that has tokens in the step multiplies just their rows
(the kernels' packed projections, each expert's blocks where they lie in the file), so a step
reads the weights of the experts its tokens chose, not all of them. A token's output is its
experts' outputs, weighted, summed in expert order whatever else is in the batch, and the router
runs as float32 panels (batch-invariant, where a float GEMM's blocking may change with the
batch's size): a row's result does not depend on the batch it is in.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from models import ops
from models.config import ModelConfig
from models.decoder import MLP, DecoderForCausalLM, HFLoader, Linear, PackedLinear
from models.llama import LlamaDecoderLayer
from models.ops import Kind
from models.quant import F32, pack, quantize
from models.recurrent import rowwise

if TYPE_CHECKING:
    from models.packing import Packer


class FusedExperts(NamedTuple):
    """`ops.moe_experts`' weight arguments: every expert's GGUF rows in one file map."""

    qs: torch.Tensor
    gate_up: torch.Tensor
    gate_up_index: torch.Tensor
    down: torch.Tensor
    down_index: torch.Tensor
    out_features: int
    kind: int
    act: int
    gate_up_bias: torch.Tensor | None  # (E, 2 f): every expert's, or None
    down_bias: torch.Tensor | None  # (E, d)


def _fuse(experts: list[MLP]) -> FusedExperts | None:
    """The experts' packed projections as one op's tables, or None unless all are GGUF rows of
    one kind in one storage (a GGUF file's map; the tables' offsets are then into all of it)."""
    linears = [m for e in experts for m in (e.gate_up_proj, e.down_proj)]
    if not all(isinstance(m, PackedLinear) for m in linears):
        return None
    if len({m.bias is None for m in linears}) != 1:
        return None  # (biases on some projections only: the torch loop takes them)
    kinds = {m.packed.kind for m in linears}
    storage = linears[0].packed.qs.untyped_storage()
    if len(kinds) != 1 or kinds & {Kind.GGML, Kind.GGML_A8} != kinds:
        return None
    if any(m.packed.qs.untyped_storage().data_ptr() != storage.data_ptr() for m in linears):
        return None
    base = torch.empty(0, dtype=torch.uint8).set_(storage)

    def table(ms: list[PackedLinear]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for m in ms:
            t = m.packed.m.clone()
            t[:, 2] += m.packed.qs.data_ptr() - base.data_ptr()  # offsets into the whole map
            rows.append(t)
        index = torch.tensor([0] + [len(t) for t in rows]).cumsum(0)
        return torch.cat(rows), index

    gate_up, gate_up_index = table([e.gate_up_proj for e in experts])
    down, down_index = table([e.down_proj for e in experts])
    out = experts[0].down_proj.out_features
    biased = linears[0].bias is not None
    gate_up_bias = torch.stack([e.gate_up_proj.bias for e in experts]) if biased else None
    down_bias = torch.stack([e.down_proj.bias for e in experts]) if biased else None
    return FusedExperts(
        base, gate_up, gate_up_index, down, down_index, out, kinds.pop(), experts[0].act,
        gate_up_bias, down_bias,
    )  # fmt: skip


class SparseMoeBlock(nn.Module):
    """The MLP of a mixture-of-experts layer (Hugging Face's names: `gate` the router, `ROUTER`
    in the checkpoint, `experts.{e}` the gated MLPs)."""

    ROUTER = "gate"  # the router's name in the checkpoint
    EXPERT_BIAS = "expert_bias"  # (sigmoid gating's choice bias)
    SHARED = "shared_expert"  # the shared expert and its gate ("shared_expert_gate")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.topk_softmax = config.moe_gating == "topk_softmax"
        self.sigmoid = config.moe_gating == "sigmoid"
        self.routed_scale = config.moe_routed_scale
        self.gate = Linear(config.hidden_size, self.num_experts, bias=config.moe_router_bias)
        self.expert_bias = (
            nn.Parameter(torch.zeros(self.num_experts)) if config.moe_expert_bias else None
        )
        expert = replace(config, intermediate_size=config.moe_intermediate_size)
        self.experts = nn.ModuleList(MLP(expert) for _ in range(self.num_experts))
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Module | None = None
        if config.moe_shared_expert_size:
            self.shared_expert = MLP(config, config.moe_shared_expert_size)
            self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)
        self.fused: FusedExperts | None = None  # set by `fuse` once the experts are packed

    def fuse(self) -> None:
        """Run the experts as one op (`ops.moe_experts`) where their packed weights allow."""
        self.fused = _fuse(list(self.experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, k) expert ids and their weights: softmax over every expert's score, the k best;
        or (`topk_softmax`) the k best scores, softmax over them; or (`sigmoid`) the k best
        sigmoids plus the expert bias, weighted by their sigmoids."""
        scores = self.gate(x).float()
        if self.sigmoid:
            probs = rowwise(torch.sigmoid, scores)  # (vector and scalar lanes round alike)
            choice = probs if self.expert_bias is None else probs + self.expert_bias.float()
            experts = torch.topk(choice, self.top_k, dim=-1).indices
            weights = probs.gather(1, experts)
            if self.norm_topk_prob:  # (transformers' epsilon)
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
            return experts, (weights * self.routed_scale).to(x.dtype)
        if self.topk_softmax:
            top, experts = torch.topk(scores, self.top_k, dim=-1)
            return experts, torch.softmax(top, dim=-1).to(x.dtype)
        probs = torch.softmax(scores, dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x (T, d) -> the experts' weighted sum (T, d) (and the gated shared expert's), plus
        `residual` when given."""
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            gate = rowwise(torch.sigmoid, self.shared_expert_gate(x).float()).to(x.dtype)
            shared = self.shared_expert(x) * gate
            residual = shared if residual is None else residual + shared
        experts, weights = self.route(x)
        if self.fused is not None and x.dtype == torch.float32:
            out = ops.moe_experts(x, experts, weights, *self.fused)
            return out if residual is None else residual + out
        flat = experts.reshape(-1)
        # (token, slot) pairs grouped by expert: stable, so an expert's tokens keep their order
        order = torch.argsort(flat, stable=True)
        tokens = order // self.top_k
        pair_weights = weights.reshape(-1, 1)[order]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start : start + n]
            h = self.experts[e](x.index_select(0, rows))
            out.index_add_(0, rows, h * pair_weights[start : start + n])
            start += n
        return out if residual is None else residual + out

    # -- its checkpoint tensors, under Hugging Face's names below `prefix` ("model.layers.N.mlp.")

    @classmethod
    def hf_weight_names(cls, config: ModelConfig, prefix: str) -> set[str]:
        names = {f"{prefix}{cls.ROUTER}.weight"}
        if config.moe_router_bias:
            names.add(f"{prefix}{cls.ROUTER}.bias")
        if config.moe_expert_bias:
            names.add(f"{prefix}{cls.EXPERT_BIAS}")
        if config.moe_shared_expert_size:
            names |= MLP.hf_weight_names(config, f"{prefix}{cls.SHARED}.")
            names.add(f"{prefix}{cls.SHARED}_gate.weight")
        for e in range(config.num_experts):
            names |= cls.expert_weight_names(config, f"{prefix}experts.{e}.")
        return names

    @classmethod
    def expert_weight_names(cls, config: ModelConfig, prefix: str) -> set[str]:
        """One expert's tensors below `prefix` ("...mlp.experts.E.")."""
        return MLP.hf_weight_names(config, prefix)

    def load_expert(self, expert: MLP, loader: HFLoader, src: str, dst: str) -> None:
        expert.load(loader, src, dst)

    def pack_expert(self, expert: MLP, packer: Packer, src: str) -> None:
        # the file's rows in every format (no panels of Q4_0/Q8_0 experts): one op takes them all
        expert.pack(packer, src, rows=True)

    def load(self, loader: HFLoader, src: str, dst: str) -> None:
        loader.put(f"{dst}gate.weight", loader.take(f"{src}{self.ROUTER}.weight"))
        if self.gate.bias is not None:
            loader.put(f"{dst}gate.bias", loader.take(f"{src}{self.ROUTER}.bias"))
        if self.expert_bias is not None:
            loader.put(f"{dst}expert_bias", loader.take(f"{src}{self.EXPERT_BIAS}"))
        if self.shared_expert is not None:
            self.shared_expert.load(loader, f"{src}{self.SHARED}.", f"{dst}shared_expert.")
            gate = loader.take(f"{src}{self.SHARED}_gate.weight")
            loader.put(f"{dst}shared_expert_gate.weight", gate.reshape(1, -1))
        for e, expert in enumerate(self.experts):
            self.load_expert(expert, loader, f"{src}experts.{e}.", f"{dst}experts.{e}.")

    def pack(self, packer: Packer, src: str) -> None:
        # the router (and the shared expert's gate) in float32 panels whatever the scheme: its
        # scores pick the experts
        self.gate = _f32_panels(self.gate)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            self.shared_expert_gate = _f32_panels(self.shared_expert_gate)
            self.shared_expert.pack(packer, f"{src}{self.SHARED}.")
        for e, expert in enumerate(self.experts):
            self.pack_expert(expert, packer, f"{src}experts.{e}.")
        self.fuse()


def _f32_panels(linear: nn.Module) -> nn.Module:
    if isinstance(linear, PackedLinear):
        return linear
    return PackedLinear(pack(quantize(linear.weight.float(), F32)), linear.bias)


class SparseMlp:
    """Mixed in before a decoder layer class: the layer's MLP is a `SparseMoeBlock`."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)  # type: ignore[call-arg]
        self.mlp = SparseMoeBlock(config)

    @classmethod
    def mlp_weight_names(cls, config: ModelConfig, prefix: str) -> set[str]:
        return SparseMoeBlock.hf_weight_names(config, f"{prefix}mlp.")


class MoeDecoderLayer(SparseMlp, LlamaDecoderLayer):
    """The Llama layer with a sparse MLP."""


class MoeForCausalLM(DecoderForCausalLM):
    """Qwen3-MoE: Qwen3's attention (QK-norm) with a sparse MLP in every layer."""

    layer_class = MoeDecoderLayer

    def num_active_parameters(self) -> int:
        c = self.config
        idle = (c.num_experts - c.num_experts_per_tok) * 3 * c.hidden_size * c.moe_intermediate_size
        return self.num_parameters() - c.num_layers * idle
