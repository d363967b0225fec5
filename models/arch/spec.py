"""`ArchSpec`: everything the loaders, the registry and tools.synth_model know of one architecture,
in one value that its family's module in `models.arch` defines.

A spec names the architecture as Hugging Face (`model_type`) and llama.cpp (`general.architecture`)
call it, reads both kinds of config into `ModelConfig` fields, maps GGUF tensor names onto the
Hugging Face names the model class loads (with the value changes llama.cpp's converter makes,
undone), names the model class, and carries tools.synth_model's presets and what it needs to write
a file of the architecture as llama.cpp's converter would.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from models.arch.readers import GGUFMeta
    from models.base import CausalLM, LoadedModel

# A config reader's result: `ModelConfig` fields (all but the name, dtype and special tokens,
# which the loaders fill in).
Fields = dict[str, Any]

# GGUF names shared by every decoder, and the Hugging Face names they load under.
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# The projections the kernels may multiply in a GGUF file's own blocks (`models.gguf_loader`),
# by Hugging Face name: layer, module and projection (the third group: its name, which
# `DECODER_FUSED` fuses with others).
DECODER_PROJECTIONS = re.compile(
    r"model\.layers\.(\d+)\.(self_attn|mlp|mlp\.experts\.\d+)\.(\w+_proj)\.weight"
)
# Projections the model fuses into one (q/k/v, gate/up): all of a group in blocks, or none.
DECODER_FUSED = {
    "q_proj": ("q_proj", "k_proj", "v_proj"),
    "k_proj": ("q_proj", "k_proj", "v_proj"),
    "v_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_proj": ("gate_proj", "up_proj"),
    "up_proj": ("gate_proj", "up_proj"),
}

# A stacked expert projection's (gate, up, down of blk.N.ffn_*_exps) Hugging Face name per expert,
# below the layer ("{e}": the expert).
EXPERT_NAMES = {p: f"mlp.experts.{{e}}.{p}_proj" for p in ("gate", "up", "down")}


@dataclass(frozen=True, slots=True)
class ValueTransform:
    """A change llama.cpp's converter makes to the values of some tensors (e.g. Gemma's norm
    weights stored as w + 1): `to_file` does it (tools.synth_model, on numpy arrays), `from_file`
    undoes it (the GGUF loader, on float torch tensors). A tensor it applies to is always
    dequantized, never taken as blocks."""

    applies: Callable[[str], bool]  # by Hugging Face name
    to_file: Callable[[Any], Any]
    from_file: Callable[[Any], Any]
    # the file's shape for the checkpoint's (a converter that squeezes a conv weight's (C, 1, K)
    # to (C, K)); None: the same shape
    file_shape: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None


@dataclass(frozen=True, slots=True)
class GGUFTensorMap:
    """An architecture's GGUF tensor names -> Hugging Face names, and how the converter stored
    them.

    `blocks`: per-layer names, "attn_q" (of "blk.N.attn_q.weight") -> "self_attn.q_proj" (of
    "model.layers.N.self_attn.q_proj.weight"; the .weight / .bias suffix, where the file's name
    has one, stays), or a name with its suffix -> the whole Hugging Face name below the layer
    ("ssm_dt.bias" -> "linear_attn.dt_bias", Gemma 4's "layer_output_scale.weight" -> its
    "layer_scalar"); a tensor in neither `blocks` nor `globals` is refused by name.
    `stacked_experts`: blk.N.ffn_{gate,up,down}_exps, (experts, rows, in) each,
    read as one Hugging Face tensor an expert (mlp.experts.E.{gate,up,down}_proj; `expert_names`:
    another family's names below the layer, "{e}" the expert, as LFM2-MoE's
    feed_forward.experts.{e}.w1).
    `permuted_qk`: the converter permuted q/k rows for GGML's RoPE pairs (the loader undoes it,
    or keeps the file's order and rotates GGML's pairs: `ModelConfig.rope_interleaved`).
    `projections`, `fused`: which Hugging Face tensors the model packs, and which of them it
    fuses into one projection (see `DECODER_PROJECTIONS`).
    """

    blocks: Mapping[str, str]
    globals: Mapping[str, str] = field(default_factory=lambda: dict(GLOBAL_NAMES))
    stacked_experts: bool = False
    expert_names: Mapping[str, str] = field(default_factory=lambda: dict(EXPERT_NAMES))
    permuted_qk: bool = False
    transforms: tuple[ValueTransform, ...] = ()
    projections: re.Pattern[str] = DECODER_PROJECTIONS
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: dict(DECODER_FUSED))

    def transform(self, hf_name: str) -> ValueTransform | None:
        """The value change the converter made to this tensor, if any."""
        return next((t for t in self.transforms if t.applies(hf_name)), None)

    def gguf_name(self, hf_name: str) -> str | None:
        """The file's name of a Hugging Face tensor, where `blocks` or `globals` give it."""
        for gguf, hf in self.globals.items():
            if hf == hf_name:
                return gguf
        parts = hf_name.split(".")
        if parts[:2] != ["model", "layers"] or len(parts) < 4:
            return None
        layer, rest = parts[2], ".".join(parts[3:])
        for gguf, hf in self.blocks.items():
            if hf == rest:  # (a name given with its suffix)
                return f"blk.{layer}.{gguf}"
            for suffix in (".weight", ".bias"):
                if hf + suffix == rest:
                    return f"blk.{layer}.{gguf}{suffix}"
        return None


@dataclass(frozen=True, slots=True)
class SynthSpec:
    """What tools.synth_model needs to write random-weight files of an architecture as
    llama.cpp's converter writes them. Configs are Hugging Face config.json fields.

    `presets`: name -> the published checkpoint's (text model's) config fields.
    `tokenizer_from`: the fetchable model (`models.fetch`) whose GGUF lends its tokenizer.
    `hf_shapes`: the Hugging Face checkpoint's tensor names and shapes for a config.
    `metadata`: the converter's `{arch}.*` keys beyond the ones every decoder has (key suffix
    after "{arch}.", value). `tensors`: tensors the converter adds that the checkpoint does not
    hold (RoPE factor tables), name -> float32 array. `norm_mean`: what a random RMSNorm weight
    is drawn around in the Hugging Face checkpoint (0 where it multiplies by 1 + w); `scales`:
    the name endings of other tensors drawn around it too (multipliers, as Gemma 4's
    layer_scalar). `fit`: the preset's config after overrides, its per-layer fields made to fit
    (a layer pattern refitted to another layer count).
    `tensor(config, shape_of, read, hf_name)`: a checkpoint tensor the family's converter writes
    its own way (gpt-oss's interleaved experts), as {GGUF name: (shape, values function)}, or
    None for the generic rules (`shape_of(name)` its shape, `read(name)` its float32 values).
    Metadata values may be ints, floats, strings or lists (one value a layer).
    """

    presets: Mapping[str, Mapping[str, Any]]
    hf_shapes: Callable[[Mapping[str, Any]], dict[str, tuple[int, ...]]]
    tokenizer_from: str = "smollm2-135m-instruct"
    metadata: Callable[[Mapping[str, Any]], list[tuple[str, Any]]] = lambda config: []
    tensors: Callable[[Mapping[str, Any]], dict[str, Any]] = lambda config: {}
    norm_mean: float = 1.0
    tensor: Callable[..., dict[str, Any] | None] = lambda config, shape_of, read, name: None
    scales: tuple[str, ...] = ()
    fit: Callable[[dict[str, Any]], dict[str, Any]] = lambda config: config
    reorder: Callable[[Mapping[str, Any], str, Any], Any] | None = None
    random: Callable[[str, Any], Any] | None = None


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """One architecture (see the module docstring). `name` is how lists of them name it.

    `hf_model_types`: config.json `model_type`s it reads; `hf_wrapper_types`: model types whose
    config.json holds its config in `text_config` (a multimodal checkpoint whose language model
    it is). `hf_config(cfg, where)`: the (text) config's `ModelConfig` fields, raising
    `ModelLoadError` (or KeyError / TypeError / ValueError, which the loader words) for what it
    does not support. `gguf_config(meta, tensors)`: the same from a GGUF file's metadata and its
    tensors by GGUF name. `builtin`: a model loaded by `name` alone, without a file.
    `describes`: the checkpoints it covers, for messages ("Llama 2/3, SmolLM2").
    `hf_quantizations`: the `quantization_config.quant_method`s of Hugging Face checkpoints it
    reads (others are refused); `hf_checkpoint(tensors, in_place)`: the checkpoint's tensors as
    the model loads them, where they are stored quantized (gpt-oss's MXFP4 experts): a mapping
    under the model's names, with `blocks(name)` (`models.packing.Blocks`) for the tensors the
    kernels may take as they are; `in_place`: they will, so those names may be stand-ins
    (`models.base.is_stand_in`) instead of dequantized.
    """

    name: str
    model_class: type[CausalLM]
    describes: str
    hf_model_types: tuple[str, ...] = ()
    hf_wrapper_types: tuple[str, ...] = ()
    hf_config: Callable[[dict, str], Fields] | None = None
    gguf_architecture: str | None = None
    gguf_config: Callable[[GGUFMeta, Mapping[str, Any]], Fields] | None = None
    gguf_tensors: GGUFTensorMap | None = None
    synth: SynthSpec | None = None
    builtin: Callable[[], LoadedModel] | None = None
    hf_quantizations: tuple[str, ...] = ()
    hf_checkpoint: Callable[[Mapping[str, Any], bool], Mapping[str, Any]] | None = None
