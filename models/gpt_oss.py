"""gpt-oss (OpenAI's gpt-oss-20b / -120b): the Llama layer with attention biases (q/k/v and o),
attention sinks, sliding windows on every other layer and a sparse MLP whose router has a bias,
picks the top k scores and weights them by a softmax over those k, and whose experts have biases
and gpt-oss's clamped SwiGLU (`models.decoder.gated_act`). RoPE is YaRN-scaled (`ModelConfig`).

Owns: the sparse MLP's checkpoint forms. transformers holds the experts stacked, gate and up
interleaved by column: `experts.gate_up_proj` (experts, d, 2 f), gate = [..., ::2] and up =
[..., 1::2], `experts.down_proj` (experts, f, d), and `_bias` tensors beside them. The published
checkpoints hold those weights as MXFP4 instead (`_blocks` (experts, rows, k / 32, 16) of
nibbles, element 2i the low nibble of byte i, and `_scales` (experts, rows, k / 32) exponents,
value = E2M1 x 2^(scale - 127), rows gate/up-interleaved too): `Mxfp4Checkpoint` re-lays them
as GGUF's MXFP4 blocks (the converter's repacking: {exponent, 16 bytes with element j low and
j + 16 high}, the same values), which the kernels multiply in place. llama.cpp's converter splits
the experts into blk.N.ffn_{gate,up,down}_exps (+ .bias), which the GGUF loader hands over one
expert at a time (`mlp.experts.E.gate_proj.weight`, ...), as `Mxfp4Checkpoint` does. Each expert
becomes `models.decoder.MLP`'s fused [gate; up] and down, so the packed experts run in
`ops.moe_experts` as Qwen3-MoE's do, biases and act included.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import torch

from models.config import ModelConfig
from models.decoder import DecoderForCausalLM, HFLoader
from models.llama import LlamaDecoderLayer
from models.moe import SparseMoeBlock
from models.quant import GGML_MXFP4, GGMLTensor

# transformers' stacked expert tensors, below "model.layers.N.mlp."
_STACKED = (
    "experts.gate_up_proj",
    "experts.gate_up_proj_bias",
    "experts.down_proj",
    "experts.down_proj_bias",
)


class GptOssMoe(SparseMoeBlock):
    """gpt-oss's sparse MLP: a router (`router` in the checkpoint) with a bias, experts with
    biases, loaded from transformers' stacked tensors or llama.cpp's split ones."""

    ROUTER = "router"

    @classmethod
    def hf_weight_names(cls, config: ModelConfig, prefix: str) -> set[str]:
        return super().hf_weight_names(config, prefix) | {prefix + n for n in _STACKED}

    def load(self, loader: HFLoader, src: str, dst: str) -> None:
        if f"{src}experts.gate_up_proj" not in loader.tensors:  # one expert at a time (GGUF)
            super().load(loader, src, dst)
            return
        loader.put(f"{dst}gate.weight", loader.take(f"{src}{self.ROUTER}.weight"))
        loader.put(f"{dst}gate.bias", loader.take(f"{src}{self.ROUTER}.bias"))
        gate_up = loader.take(f"{src}experts.gate_up_proj")  # (E, d, 2f): gate, up interleaved
        gate_up_bias = loader.take(f"{src}experts.gate_up_proj_bias")  # (E, 2f)
        down = loader.take(f"{src}experts.down_proj")  # (E, f, d)
        down_bias = loader.take(f"{src}experts.down_proj_bias")  # (E, d)
        for e in range(self.num_experts):
            d = f"{dst}experts.{e}."
            # [gate; up] rows (2f, d), as the decoder's fused projection holds them
            rows = torch.cat([gate_up[e, :, 0::2].T, gate_up[e, :, 1::2].T])
            loader.put(f"{d}gate_up_proj.weight", rows)
            bias = torch.cat([gate_up_bias[e, 0::2], gate_up_bias[e, 1::2]])
            loader.put(f"{d}gate_up_proj.bias", bias)
            loader.put(f"{d}down_proj.weight", down[e].T)
            loader.put(f"{d}down_proj.bias", down_bias[e])


class GptOssDecoderLayer(LlamaDecoderLayer):
    """The Llama layer (biases, sinks and window from the config) with gpt-oss's sparse MLP."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__(config, layer)
        self.mlp = GptOssMoe(config)

    @classmethod
    def mlp_weight_names(cls, config: ModelConfig, prefix: str) -> set[str]:
        return GptOssMoe.hf_weight_names(config, f"{prefix}mlp.")


class GptOssForCausalLM(DecoderForCausalLM):
    layer_class = GptOssDecoderLayer

    def num_active_parameters(self) -> int:
        c = self.config
        f, d = c.moe_intermediate_size, c.hidden_size
        per_expert = 3 * d * f + 2 * f + d  # gate, up, down and their biases
        return (
            self.num_parameters()
            - c.num_layers * (c.num_experts - c.num_experts_per_tok) * per_expert
        )


# transformers' MXFP4 tensors of a layer's experts: model.layers.N.mlp.experts.{proj}_{blocks,scales}
_MXFP4_RE = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)_(blocks|scales)"
)


def mxfp4_to_gguf(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' MXFP4 rows (blocks (rows, G, 16), scales (rows, G) uint8) as GGUF's MXFP4
    rows (rows, G * 17): per block the scale byte, then the nibbles re-paired so that byte j holds
    element j (low) and element j + 16 (high), where transformers' byte i holds 2i and 2i + 1."""
    lo, hi = blocks & 0x0F, blocks >> 4
    values = torch.stack([lo, hi], dim=-1).flatten(-2)  # (rows, G, 32): element order
    qs = values[..., :16] | (values[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), qs], dim=-1).flatten(-2).contiguous()


class Mxfp4Checkpoint(Mapping[str, torch.Tensor]):
    """A gpt-oss checkpoint whose experts are MXFP4 (`ArchSpec.hf_checkpoint`), under the names
    the model loads: every expert's gate, up and down projection and biases apart
    (`mlp.experts.E.{gate,up,down}_proj.{weight,bias}`, as the GGUF loader gives them), the rest
    as the checkpoint holds them. `blocks(name)` gives a projection's GGUF MXFP4 rows; each
    layer's experts are re-laid once, into one buffer (so `ops.moe_experts` finds them in one
    storage). A projection's float tensor is its blocks dequantized (gguf's dequantize, the
    oracle the kernels match), or with `in_place` a stride-0 stand-in the kernels replace."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], in_place: bool) -> None:
        self._tensors, self._in_place = tensors, in_place
        self._names: dict[str, tuple[int, str, int, str]] = {}  # -> (layer, proj, expert, kind)
        self._plain = [n for n in tensors if not _MXFP4_RE.fullmatch(n)]
        self._layers: dict[int, dict[str, GGMLTensor]] = {}
        stacked = {}
        for n in tensors:
            m = _MXFP4_RE.fullmatch(n)
            if m is not None and m.group(3) == "scales":
                stacked[(int(m.group(1)), m.group(2))] = tuple(tensors[n].shape)
        for (layer, proj), shape in stacked.items():
            p = f"model.layers.{layer}.mlp.experts."
            self._plain.remove(f"{p}{proj}_bias")  # (split per expert below)
            for e in range(shape[0]):
                parts = ("gate", "up") if proj == "gate_up_proj" else ("down",)
                for part in parts:
                    for kind in ("weight", "bias"):
                        self._names[f"{p}{e}.{part}_proj.{kind}"] = (layer, proj, e, part)
        self._plain_set = set(self._plain)

    def _layer(self, layer: int) -> dict[str, GGMLTensor]:
        """The layer's experts' projections as GGUF rows, views of one buffer, by name."""
        if layer not in self._layers:
            p = f"model.layers.{layer}.mlp.experts."
            rows: list[tuple[str, torch.Tensor, int]] = []
            for proj, parts in (("gate_up_proj", ("gate", "up")), ("down_proj", ("down",))):
                blocks, scales = (
                    self._tensors[f"{p}{proj}_blocks"],
                    self._tensors[f"{p}{proj}_scales"],
                )
                k = int(scales.shape[-1]) * 32
                for e in range(int(scales.shape[0])):
                    for i, part in enumerate(parts):  # gate/up rows interleaved: even, odd
                        sl = slice(i, None, len(parts))
                        raw = mxfp4_to_gguf(blocks[e, sl], scales[e, sl])
                        rows.append((f"{p}{e}.{part}_proj.weight", raw, k))
            buffer = torch.cat([raw.reshape(-1) for _, raw, _ in rows])
            out, offset = {}, 0
            for name, raw, k in rows:
                view = buffer[offset : offset + raw.numel()].view(raw.shape)
                out[name] = GGMLTensor([(GGML_MXFP4, view)], k)
                offset += raw.numel()
            self._layers[layer] = out
        return self._layers[layer]

    def blocks(self, name: str) -> GGMLTensor | None:
        info = self._names.get(name)
        if info is None or not name.endswith(".weight"):
            return None
        return self._layer(info[0])[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        info = self._names.get(name)
        if info is None:
            return self._tensors[name]
        layer, proj, e, part = info
        if name.endswith(".bias"):
            bias = self._tensors[f"model.layers.{layer}.mlp.experts.{proj}_bias"][e]
            return bias[0::2] if part == "gate" else bias[1::2] if part == "up" else bias
        blocks = self._layer(layer)[name]
        if self._in_place:
            return torch.zeros((), dtype=torch.float32).expand(*blocks.shape)
        return blocks.dequantize()

    def __iter__(self) -> Iterator[str]:
        yield from self._plain
        yield from self._names

    def __contains__(self, name: object) -> bool:
        return name in self._names or name in self._plain_set

    def __len__(self) -> int:
        return len(self._plain) + len(self._names)


def hf_checkpoint(
    tensors: Mapping[str, torch.Tensor], in_place: bool
) -> Mapping[str, torch.Tensor]:
    """`ArchSpec.hf_checkpoint`: a checkpoint with MXFP4 experts mapped (`Mxfp4Checkpoint`), a
    float one as it is."""
    if not any(_MXFP4_RE.fullmatch(n) for n in tensors):
        return tensors
    return Mxfp4Checkpoint(tensors, in_place)
