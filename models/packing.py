"""Packing a model for the cbserve kernels: `pack_for_kernels(model, options, blocks)` returns the
model whose projections are packed weights (`models.quant`) and whose norms, attention and layer
stack run through `models.ops`.

Owns: `Packer`, the one rule for turning a projection into a packed one (the checkpoint's own
blocks where it has them in a usable format, else its float weight quantized per the scheme), and
the check that no loader stand-in survives packing. What a model packs (which modules, from
which checkpoint tensors) is the model's own `CausalLM.pack`; this module knows no family.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from models.base import CausalLM, is_stand_in
from models.quant import (
    F32,
    GGML,
    GGML_A8,
    QB,
    SCHEME_KINDS,
    GGMLTensor,
    KernelOptions,
    PackedWeight,
    QTensor,
    gate_up_bias,
    pack,
    quantize,
)

# A checkpoint's own quantized blocks of a tensor by its Hugging Face name (None: it has none in
# a format the kernels multiply), e.g. `models.gguf_loader.GGUFWeights.blocks`.
Blocks = Callable[[str], QTensor | GGMLTensor | None]


class Packer:
    """Turns projections into packed ones for one scheme (see `pack_for_kernels`).

    A model's `pack` calls it once per projection with the checkpoint tensors that hold it (fused
    or in parts); it returns the module that replaces the projection.
    """

    def __init__(self, scheme: str, blocks: Blocks | None, activations: str) -> None:
        self.scheme, self.activations = scheme, activations
        self.target = SCHEME_KINDS[scheme]
        self._blocks = None if scheme == "none" else blocks
        self._pinned: dict[str, QTensor | GGMLTensor | None] = {}

    def blocks(self, name: str) -> QTensor | GGMLTensor | None:
        """The checkpoint's blocks of tensor `name` (None: none, or the scheme is "none")."""
        if name in self._pinned:
            return self._pinned[name]
        return None if self._blocks is None else self._blocks(name)

    def pin(self, name: str) -> QTensor | GGMLTensor | None:
        """`blocks(name)`, and the same object on every later call: one table serving both an
        embedding lookup and a tied head."""
        self._pinned[name] = self.blocks(name)
        return self._pinned[name]

    def packed_weight(
        self,
        weight: torch.Tensor,
        sources: list[list[str]],
        gate_up: bool = False,
        rows: bool = False,
    ) -> PackedWeight:
        """`weight` (out, in) packed: from the checkpoint's blocks of the first group of
        `sources` it has them all for (in the scheme's format, unless "auto"), else quantized
        from the float weight. `rows`: a GGUF file's blocks stay its rows in any format
        (`models.quant.pack`)."""
        parts: list = []
        if self._blocks is not None:
            for names in sources:
                parts = [self.blocks(n) for n in names]
                if all(p is not None for p in parts):
                    break
        usable = (
            parts
            and all(p is not None for p in parts)
            and (self.target is None or all(p.kind == self.target for p in parts))
        )
        if usable:
            qt = QTensor.cat(parts)
        else:
            qt = quantize(weight.float(), F32 if self.target is None else self.target)
        int8 = qt.kind != F32 and self.activations != "float32"
        return pack(qt, gate_up=gate_up, int8=int8, rows=rows)

    def __call__(
        self,
        linear: nn.Module,
        sources: list[list[str]],
        gate_up: bool = False,
        rows: bool = False,
    ) -> nn.Module:
        """The projection `linear` packed (`packed_weight`), its bias kept; a projection already
        packed, or whose input width is no multiple of a block, is returned as it is."""
        from models.decoder import PackedLinear  # (the module the decoder runs packed weights in)

        if isinstance(linear, PackedLinear) or linear.weight.shape[1] % QB:
            return linear
        packed = self.packed_weight(linear.weight, sources, gate_up=gate_up, rows=rows)
        bias = linear.bias
        if gate_up and bias is not None:  # (gpt-oss's experts: in the panels' order)
            if packed.kind not in (GGML, GGML_A8) and (bias.shape[0] // 2) % 8:
                return linear  # (a partial last panel's epilogue would miss up's bias)
            bias = gate_up_bias(bias.detach(), packed)
        return PackedLinear(packed, bias)


def pack_for_kernels(
    model: CausalLM, options: KernelOptions, blocks: Blocks | None = None
) -> CausalLM:
    """`model` packed for the kernels (the caller checked `models.kernels.available()`), per
    `options.quantization`:

    - auto: the checkpoint's own blocks where `blocks(name)` has them (GGUF Q4_0, Q4_1, Q5_0,
      Q5_1, Q8_0, Q2_K .. Q6_K, IQ4_NL, IQ4_XS, MXFP4, so the model computes exactly what the file
      holds; a fused projection may mix them), else the float weights;
    - none: the float weights (float32 panels: the same numbers as F.linear);
    - q8_0 / q4_1: that format, quantized from the float weights unless the checkpoint already
      holds it.

    The float copies are dropped: the packed weights replace them. `options.activations`
    ("auto", "int8", "float32"): quantized projections multiply int8 activations (per row and
    32 or 256 inputs) with integer dot products ("auto" is int8, as `KernelOptions` says why).
    Raises ValueError for a model not in float32, or one a loader's stand-in for a weight left
    in the file survived (it was neither loaded nor packed).
    """
    if model.config.matmul_dtype not in (None, torch.float32):
        raise ValueError("the kernels run float32 activations; load the model in float32")
    model.pack(Packer(options.quantization, blocks, options.activations))
    unread = [n for n, p in model.named_parameters() if is_stand_in(p)]
    if unread:
        raise ValueError(f"{unread[0]} was neither loaded nor packed")
    return model
