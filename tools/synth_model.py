"""Synthetic GGUF models: random weights of a real architecture and shape, a real tokenizer, any
of the formats users download, quantized by the project's reference quantizers.

    python -m tools.synth_model --preset llama-3.2-1b --format Q4_K_M -o llama1b.gguf
    python -m tools.synth_model --arch qwen3 --preset qwen3-0.6b --layers 2 --hidden 256 ...
    python -m tools.synth_model --list

Owns: the shape presets (`PRESETS`, Hugging Face config fields), the random weights
(`random_state_dict`: normal with std 0.02 as transformers initialises them, norms near 1), and
`write_gguf(path, arch, config, state_dict, ...)`, which writes a Hugging Face-named state dict
and config as llama.cpp's converter (convert_hf_to_gguf.py) would: its metadata keys, tensor names
(gguf's own name map) and layouts (llama, smollm3: Q/K rows permuted for llama.cpp's RoPE;
qwen2 / qwen3 / phi3 / gemma2 / gemma3 unpermuted; phi3's fused attn_qkv and ffn_up = gate+up as
the checkpoint holds them; gemma2 / gemma3 norms stored as weight + 1; qwen3moe's experts, stacked as
transformers holds them, as blk.N.ffn_{gate,up,down}_exps, its router ffn_gate_inp left float32),
then quantized with `models.gguf_quantize` as `llama-quantize` mixes formats (weights pass
through float16 first, as from an F16 file, so `synth F16` + `llama-quantize Q4_K_M` gives this
tool's Q4_K_M bytes). Tests write transformers' own tiny random models with it.

The tokenizer is real, copied from a GGUF the project fetches: Gemma 3 270M's (262,144 tokens)
for gemma3 and gemma2 (whose 256,000-token vocabulary is its first tokens), SmolLM2's (GPT-2 style BPE, 49,152 tokens) for llama, qwen2, qwen3, qwen3moe, phi3
and smollm3, whose own tokenizers no package ships. The vocabulary is the tokenizer's by default, so a Qwen- or
Phi-shaped file has SmolLM2's 49,152 tokens and head rows, not 151,936 or 32,064; `--vocab N`
sets it (`--vocab 128256` for Llama 3.2's head size): a smaller vocabulary keeps the first N
tokens, a larger one pads with unused tokens no text encodes to.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import zlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, MODEL_ARCH_NAMES, GGMLQuantizationType
from gguf.tensor_mapping import get_tensor_name_map

from models.arch import specs
from models.arch.spec import ArchSpec
from models.arch.synth import head_dim as _head_dim
from models.arch.synth import rope_params as _rope
from models.arch.synth import rotary_dims as _rotary_dims
from models.fetch import model_path
from models.gguf_quantize import FTYPES, mix_types, quantize

Q = GGMLQuantizationType
# The architectures this tool writes, by their GGUF name: the specs with a synth part.
SPECS: dict[str, ArchSpec] = {
    s.gguf_architecture: s for s in specs() if s.synth is not None and s.gguf_architecture
}
ARCHES = tuple(SPECS)
# Architectures whose converter permutes q/k rows for llama.cpp's RoPE pairs.
PERMUTED = tuple(a for a, s in SPECS.items() if s.gguf_tensors and s.gguf_tensors.permuted_qk)
_GGUF_ARCH = {name: arch for arch, name in MODEL_ARCH_NAMES.items()}
# Which fetchable model's GGUF lends its tokenizer, per architecture.
TOKENIZER_FROM = {a: s.synth.tokenizer_from for a, s in SPECS.items() if s.synth}
# Hugging Face config fields of the published checkpoints' text models: name -> (arch, fields).
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    name: (a, dict(fields))
    for a, s in SPECS.items()
    if s.synth
    for name, fields in s.synth.presets.items()
}

# HF config field -> the command line flag that overrides it.
OVERRIDES = (
    ("num_hidden_layers", "--layers"),
    ("hidden_size", "--hidden"),
    ("intermediate_size", "--ffn"),
    ("num_attention_heads", "--heads"),
    ("num_key_value_heads", "--kv-heads"),
    ("head_dim", "--head-dim"),
    ("vocab_size", "--vocab"),
    ("max_position_embeddings", "--context"),
    ("sliding_window", "--sliding-window"),
    ("num_experts", "--experts"),
    ("num_experts_per_tok", "--experts-used"),
    ("moe_intermediate_size", "--expert-ffn"),
)

INIT_STD = 0.02
UNUSED_TOKEN = 5  # llama.cpp's token type for a padding token no text encodes to  # transformers' initializer_range for all of these families


# -- the tokenizer ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Tokenizer:
    """A GGUF file's `tokenizer.*` metadata, ready to copy: key -> (value, type, array item type)."""

    fields: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]]
    source: str

    @property
    def vocab_size(self) -> int:
        return len(self.fields["tokenizer.ggml.tokens"][0])

    def resized(self, n: int) -> Tokenizer:
        """`n` tokens: more pads with unused tokens (as llama.cpp's converter pads Phi-3's
        vocabulary), so a file can carry its preset's real vocabulary and head size; fewer
        keeps the first `n` (`truncated`)."""
        if n <= self.vocab_size:
            return self.truncated(n)
        extra = n - self.vocab_size
        fields = dict(self.fields)
        value, vtype, sub = fields["tokenizer.ggml.tokens"]
        pads = [f"<|synthetic_unused_{i}|>" for i in range(extra)]
        fields["tokenizer.ggml.tokens"] = (list(value) + pads, vtype, sub)
        if "tokenizer.ggml.token_type" in fields:
            value, vtype, sub = fields["tokenizer.ggml.token_type"]
            fields["tokenizer.ggml.token_type"] = (list(value) + [UNUSED_TOKEN] * extra, vtype, sub)
        if "tokenizer.ggml.scores" in fields:
            value, vtype, sub = fields["tokenizer.ggml.scores"]
            fields["tokenizer.ggml.scores"] = (list(value) + [-10000.0] * extra, vtype, sub)
        return Tokenizer(fields, self.source)

    def truncated(self, n: int) -> Tokenizer:
        """The first `n` tokens (a tiny test model's vocabulary): merges that make or use a token
        past `n` are dropped, special ids past it forgotten."""
        if n >= self.vocab_size:
            return self
        fields = dict(self.fields)
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
            if key in fields:
                value, vtype, sub = fields[key]
                fields[key] = (value[:n], vtype, sub)
        kept = set(fields["tokenizer.ggml.tokens"][0])
        if "tokenizer.ggml.merges" in fields:
            value, vtype, sub = fields["tokenizer.ggml.merges"]
            ok = []
            for merge in value:
                a, _, b = merge.partition(" ")
                if a in kept and b in kept and a + b in kept:
                    ok.append(merge)
            fields["tokenizer.ggml.merges"] = (ok, vtype, sub)
        for key in list(fields):
            if key.endswith("_token_id") and int(fields[key][0]) >= n:
                del fields[key]
        return Tokenizer(fields, self.source)


def read_tokenizer(gguf_path: str | Path) -> Tokenizer:
    """The `tokenizer.*` metadata of a GGUF file."""
    reader = GGUFReader(str(gguf_path))
    fields: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]] = {}
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = GGUFValueType(field.types[0])
        sub = GGUFValueType(field.types[1]) if vtype == GGUFValueType.ARRAY else None
        fields[key] = (field.contents(), vtype, sub)
    return Tokenizer(fields, str(gguf_path))


def default_tokenizer(arch: str, fetch: bool = True) -> Tokenizer:
    """The real tokenizer this tool uses for `arch` (see the module docstring)."""
    return read_tokenizer(model_path(TOKENIZER_FROM[arch], fetch=fetch))


# -- configs and random weights --------------------------------------------------------------------


def make_config(preset: str, **overrides: Any) -> tuple[str, dict[str, Any]]:
    """(arch, HF config) for a preset with fields overridden (None leaves a field as it is)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {list(PRESETS)}")
    arch, config = PRESETS[preset]
    config = dict(config)
    config.update({k: v for k, v in overrides.items() if v is not None})
    config = _synth(arch).fit(config)
    rope = _rope(config)
    if rope.get("rope_type") == "longrope" and "long_factor" not in rope:
        config["rope_scaling"] = {**config["rope_scaling"], **_longrope_factors(config)}
    return arch, config


def _longrope_factors(config: Mapping[str, Any]) -> dict[str, list[float]]:
    """LongRoPE factors for the rotated dims of `config`'s heads, shaped like Phi-3.5's (the
    published ones are not shipped here): short ones rising from 1 to 2.5, long ones from
    1.08 to about 50, both toward the low frequencies."""
    n = _rotary_dims(config) // 2
    ramp = [i / max(n - 1, 1) for i in range(n)]
    return {
        "short_factor": [round(1 + 1.5 * r**3, 4) for r in ramp],
        "long_factor": [round(1.08 * 47**r, 4) for r in ramp],
    }


def hf_shapes(arch: str, config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The Hugging Face checkpoint's tensor names and shapes for `arch` and `config`."""
    return _synth(arch).hf_shapes(config)


def _synth(arch: str):
    spec = SPECS.get(arch)
    if spec is None or spec.synth is None:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {ARCHES}")
    return spec.synth


class LazyStateDict(Mapping[str, np.ndarray]):
    """Tensors made on access (a 4B-parameter body never sits in memory whole)."""

    def __init__(self, makers: Mapping[str, tuple[tuple[int, ...], Callable[[], np.ndarray]]]):
        self._makers = dict(makers)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._makers[name][0]

    def __getitem__(self, name: str) -> np.ndarray:
        return self._makers[name][1]()

    def __iter__(self):
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)


def random_state_dict(arch: str, config: Mapping[str, Any], seed: int = 0) -> LazyStateDict:
    """Random HF-named weights: normal(0, 0.02) matrices and biases, norms 1 + normal(0, 0.02)
    (norms around 0 where the family's checkpoints store norm - 1, as Gemma's; the spec's
    `random` hook fits others to their role). Each tensor's values depend on the seed and its
    name only."""
    synth = _synth(arch)
    norm_mean = synth.norm_mean

    def maker(name: str, shape: tuple[int, ...]) -> Callable[[], np.ndarray]:
        def make() -> np.ndarray:
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            std = INIT_STD
            if len(shape) >= 2 and "embed_tokens" not in name and "lm_head" not in name:
                # A narrow test shape keeps a 2048-wide model's activation sizes, so its layers
                # outweigh the embedding as a real model's do (else greedy repeats the input).
                std = max(INIT_STD, 0.9 / math.sqrt(shape[-1]))
            x = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
            if (name.endswith("norm.weight") or name.endswith(synth.scales)) and norm_mean:
                x += np.float32(norm_mean)
            if synth.random is not None:
                x = synth.random(name, x)
            return x

        return make

    return LazyStateDict({n: (s, maker(n, s)) for n, s in hf_shapes(arch, config).items()})


# -- writing ---------------------------------------------------------------------------------------


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order for its RoPE (pairs interleaved per head)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _metadata(arch: str, config: Mapping[str, Any], vocab: int) -> list[tuple[str, Any]]:
    """(key suffix after "{arch}.", value) pairs as convert_hf_to_gguf.py writes them (a
    family's own keys replace the common ones of the same name: per-layer arrays, other head
    sizes)."""
    hd = _head_dim(config)
    keys: dict[str, Any] = {
        "context_length": int(config["max_position_embeddings"]),
        "embedding_length": int(config["hidden_size"]),
        "block_count": int(config["num_hidden_layers"]),
        "attention.head_count": int(config["num_attention_heads"]),
        "attention.head_count_kv": int(config["num_key_value_heads"]),
        "rope.freq_base": float(_rope(config)["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(config.get("rms_norm_eps", 1e-6)),
    }
    if config.get("intermediate_size") is not None:  # (a mixture of experts may have none)
        keys["feed_forward_length"] = int(config["intermediate_size"])
    if config.get("head_dim") is not None:
        keys |= {"attention.key_length": hd, "attention.value_length": hd}
    keys |= dict(_synth(arch).metadata(config))
    return list(keys.items())


def _gguf_tensors(
    arch: str, config: Mapping[str, Any], state_dict: Mapping[str, Any]
) -> dict[str, tuple[tuple[int, ...], Callable[[], np.ndarray]]]:
    """GGUF name -> (shape, a function giving its float32 values in the file's layout)."""
    n_layers = int(config["num_hidden_layers"])
    names = get_tensor_name_map(_GGUF_ARCH[arch], n_layers)
    tensor_map = SPECS[arch].gguf_tensors
    assert tensor_map is not None
    synth = _synth(arch)
    n_head = int(config["num_attention_heads"])
    n_kv = int(config["num_key_value_heads"])
    out: dict[str, tuple[tuple[int, ...], Callable[[], np.ndarray]]] = {}
    synth = _synth(arch)

    def shape_of(name: str) -> tuple[int, ...]:
        return _shape(state_dict, name)

    def read(name: str) -> np.ndarray:
        return _float32(state_dict[name])

    for hf_name in state_dict:
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings", False):
            continue
        own = synth.tensor(config, shape_of, read, hf_name)
        if own is not None:  # (the family's converter writes it its own way)
            out.update({n: (s, lambda v=v: np.ascontiguousarray(v())) for n, (s, v) in own.items()})
            continue
        if ".mlp.experts." in hf_name:
            out.update(_experts(state_dict, hf_name))
            continue
        gguf_name = tensor_map.gguf_name(hf_name) or names.get_name(
            hf_name, try_suffixes=(".weight", ".bias")
        )
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {hf_name!r} in {arch}")
        if _suffixed(gguf_name, tensor_map):  # (a checkpoint name without .weight that the
            gguf_name += ".weight"  # converter writes with it: Gemma 4's layer_scalar)
        shape = _shape(state_dict, hf_name)
        transform = tensor_map.transform(hf_name)
        if transform is not None and transform.file_shape is not None:
            shape = transform.file_shape(shape)

        def values(hf_name: str = hf_name, transform=transform, shape=shape) -> np.ndarray:
            x = _float32(state_dict[hf_name])
            if tensor_map.permuted_qk and hf_name.endswith("q_proj.weight"):
                x = _permute(x, n_head)
            elif tensor_map.permuted_qk and hf_name.endswith("k_proj.weight"):
                x = _permute(x, n_kv)
            if synth.reorder is not None:  # e.g. Qwen3.5's value heads, tiled
                x = synth.reorder(config, hf_name, x)
            if transform is not None:  # e.g. Gemma's norms: weight + 1
                x = transform.to_file(x)
            return np.ascontiguousarray(x.reshape(shape))

        out[gguf_name] = (tuple(int(s) for s in shape), values)
    for name, values in _synth(arch).tensors(config).items():  # (RoPE factor tables)
        out[name] = (values.shape, lambda v=values: v)
    return out


def _suffixed(gguf_name: str, tensor_map: Any) -> bool:
    """The family's tensor map names this suffix-less layer tensor with ".weight"."""
    parts = gguf_name.split(".")
    return (
        len(parts) == 3
        and parts[0] == "blk"
        and f"{parts[2]}.weight" in tensor_map.blocks
        and parts[2] not in tensor_map.blocks
    )


def _experts(
    state_dict: Mapping[str, Any], hf_name: str
) -> dict[str, tuple[tuple[int, ...], Callable[[], np.ndarray]]]:
    """A mixture of experts' stacked projection as the converter writes it (experts first):
    gate_up_proj (experts, 2 ffn, d) as blk.N.ffn_gate_exps and ffn_up_exps, down_proj as
    ffn_down_exps."""
    blk = f"blk.{hf_name.split('.')[2]}."
    shape = _shape(state_dict, hf_name)
    if hf_name.endswith("down_proj"):
        return {f"{blk}ffn_down_exps.weight": (shape, lambda: _float32(state_dict[hf_name]))}
    half = (shape[0], shape[1] // 2, shape[2])
    halves: dict[int, np.ndarray] = {}  # up's half, kept from gate's read (the file's next tensor)

    def part(i: int) -> np.ndarray:
        if i not in halves:
            halves.update(enumerate(np.split(_float32(state_dict[hf_name]), 2, axis=1)))
        return np.ascontiguousarray(halves.pop(i))

    return {
        f"{blk}ffn_gate_exps.weight": (half, lambda: part(0)),
        f"{blk}ffn_up_exps.weight": (half, lambda: part(1)),
    }


def _shape(state_dict: Mapping[str, Any], name: str) -> tuple[int, ...]:
    if isinstance(state_dict, LazyStateDict):
        return state_dict.shape(name)
    return tuple(int(s) for s in np.shape(state_dict[name]))


def _float32(x: Any) -> np.ndarray:
    """A state dict's tensor (numpy array or torch tensor) as a float32 array."""
    return (x.detach().float().numpy() if hasattr(x, "detach") else np.asarray(x)).astype(
        np.float32
    )


# Tensors the converter keeps in float32 whatever --outtype says (a mixture of experts' router,
# the recurrent layers' convolutions: llama.cpp's convolution ops read float32 only).
_F32_ALWAYS = ("ffn_gate_inp", "ssm_conv1d", "shortconv.conv", "pos_embd", "token_types")


def _f16_source(name: str, shape: tuple[int, ...]) -> bool:
    """The converter writes the tensor in float16 with --outtype f16: 2-D and up, a name ending
    in .weight, not a norm, not in its float32 list."""
    return (
        len(shape) >= 2
        and name.endswith(".weight")
        and not name.endswith("_norm.weight")
        and not any(k in name for k in _F32_ALWAYS)
    )


def write_gguf(
    path: str | Path,
    arch: str,
    config: Mapping[str, Any],
    state_dict: Mapping[str, Any],
    tokenizer: Tokenizer | None = None,
    fmt: str = "F32",
    name: str = "synthetic",
    progress: bool = False,
) -> Path:
    """Write a GGUF of `arch` from a Hugging Face-named `state_dict` (numpy arrays or torch
    tensors) and HF `config`, with `tokenizer` (default: `default_tokenizer(arch)`, truncated to
    the config's vocabulary: cut, or padded with unused tokens) and tensors in `fmt` (a key of `models.gguf_quantize.FTYPES`)."""
    if arch not in ARCHES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {ARCHES}")
    if fmt not in FTYPES:
        raise ValueError(f"unknown format {fmt!r}; choose one of {list(FTYPES)}")
    vocab = int(config["vocab_size"])
    tok = (tokenizer or default_tokenizer(arch)).resized(vocab)
    tensors = _gguf_tensors(arch, config, state_dict)
    ftype, _ = FTYPES[fmt]
    # As from llama.cpp's converter with --outtype f16: 2-D weights float16, the rest float32
    # (and the tensors it always keeps in float32: biases, a mixture of experts' router).
    source = {n: (s, Q.F16 if _f16_source(n, s) else Q.F32) for n, (s, _) in tensors.items()}
    if fmt == "F32":
        types = {n: Q.F32 for n in tensors}
    else:
        gqa = int(config["num_attention_heads"]) // int(config["num_key_value_heads"])
        types = mix_types(source, fmt, n_layer=int(config["num_hidden_layers"]), n_gqa=gqa)

    path = Path(path)
    w = GGUFWriter(str(path), arch)
    w.add_type("model")
    w.add_name(name)
    for key, value in _metadata(arch, config, vocab):
        full = f"{arch}.{key}"
        if isinstance(value, str):
            w.add_string(full, value)
        elif isinstance(value, list):  # one value a layer (as the converter's add_array)
            w.add_array(full, value)
        elif isinstance(value, bool):
            w.add_bool(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        else:
            w.add_uint32(full, value)
    w.add_file_type(int(ftype))
    if fmt not in ("F32", "F16"):
        w.add_quantization_version(2)
    for key, (value, vtype, sub) in tok.fields.items():
        w.add_key_value(key, value, vtype, sub)
    order = list(tensors)
    for n in order:
        shape, _ = tensors[n]
        qtype = types[n]
        block, nbytes = GGML_QUANT_SIZES[qtype]
        count = int(np.prod(shape))
        w.add_tensor_info(n, shape, np.dtype(np.float32), count // block * nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, n in enumerate(order):
        shape, values = tensors[n]
        x = values()
        if source[n][1] == Q.F16 and fmt != "F32":
            x = x.astype(np.float16).astype(np.float32)
        w.write_tensor_data(quantize(x, types[n]))
        if progress:
            print(f"\r{i + 1}/{len(order)} {n} {types[n].name:<40}", end="", file=sys.stderr)
    if progress:
        print(file=sys.stderr)
    w.close()
    return path


def write_synthetic(
    path: str | Path,
    preset: str,
    fmt: str = "Q4_K_M",
    seed: int = 0,
    tokenizer: Tokenizer | None = None,
    progress: bool = False,
    **overrides: Any,
) -> Path:
    """A random-weight GGUF of a preset's architecture and shape (fields overridden by
    `overrides`; `vocab_size` defaults to the tokenizer's)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {list(PRESETS)}")
    tok = tokenizer or default_tokenizer(PRESETS[preset][0])
    overrides.setdefault("vocab_size", None)
    if overrides["vocab_size"] is None:
        overrides["vocab_size"] = tok.vocab_size
    arch, config = make_config(preset, **overrides)
    state = random_state_dict(arch, config, seed)
    # general.name stays off family names: llama.cpp keys tokenizer quirks on it (a "phi-3" name
    # expects Phi-3's own special tokens).
    name = "synthetic random weights"
    return write_gguf(path, arch, config, state, tok, fmt, name=name, progress=progress)


def parameter_count(arch: str, config: Mapping[str, Any]) -> int:
    return sum(int(np.prod(s)) for s in hf_shapes(arch, config).values())


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.synth_model", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--preset", default="smollm2-360m", help=f"one of {', '.join(PRESETS)}")
    p.add_argument("--arch", choices=ARCHES, help="must match the preset's (a check)")
    p.add_argument("--format", default="Q4_K_M", choices=list(FTYPES))
    p.add_argument("-o", "--output", help="the GGUF file to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", help="a GGUF file whose tokenizer to copy (default: see --list)")
    for field, flag in OVERRIDES:
        p.add_argument(flag, dest=field, type=int, help=f"override {field}")
    p.add_argument("--list", action="store_true", help="list the presets and exit")
    args = p.parse_args(list(argv) if argv is not None else None)
    if args.list:
        for name, (arch, config) in PRESETS.items():
            print(
                f"{name:<14} {arch:<8} {parameter_count(arch, config) / 1e6:7.0f}M parameters "
                f"(with its own vocabulary {config['vocab_size']}); tokenizer from "
                f"{TOKENIZER_FROM[arch]}"
            )
        return 0
    if not args.output:
        p.error("-o/--output is required")
    arch, _ = PRESETS.get(args.preset, (None, None))
    if arch is None:
        p.error(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
    if args.arch and args.arch != arch:
        p.error(f"preset {args.preset} is {arch}, not {args.arch}")
    tok = read_tokenizer(args.tokenizer) if args.tokenizer else default_tokenizer(arch)
    overrides = {field: getattr(args, field) for field, _ in OVERRIDES}
    path = write_synthetic(
        args.output, args.preset, args.format, args.seed, tok, progress=True, **overrides
    )
    print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
