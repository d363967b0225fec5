"""Loading GGUF files (llama.cpp's format) into their `models.registry` class.

Owns: a GGUF file's metadata read into a `ModelConfig` by its architecture's spec
(`models.arch`), tensors dequantized to the compute dtype with `gguf.quants.dequantize` (numpy),
llama.cpp's Q/K row permutation undone where the spec says the converter made it (its RoPE
rotates adjacent pairs; NEOX-style families are written as Hugging Face holds them), and each
GGUF tensor name mapped by the spec to its Hugging Face name (the converter's value changes
undone, e.g. Gemma's norms stored as w + 1) for the model's `load_hf_weights`. With the kernels, tensors in a format they multiply in place
are never dequantized: `GGUFWeights.blocks` hands the model the file's rows (`models.quant`), and
the float "weight" it sees is a zero-memory stand-in. The tokenizer and chat template come from
the same file: Gemma's SentencePiece vocabularies through `models.spm_tokenizer` (no derived
merges table), every other one converted by transformers once, in a child process, and then
served from the saved copy without it (`models.hf_tokenizer`, `models.saved_tokenizer`).

Architectures: those of `models.arch` with a `gguf_architecture`, each spec reading its own
`{arch}.*` keys and naming its tensors. What is refused, by name: other architectures, tensor
types outside `SUPPORTED_TYPES`, tensors the decoder has no place for, and what each spec's
config reader refuses.
"""

from __future__ import annotations

import mmap
import re
import struct
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from models.arch.readers import ROPE_FACTOR_TENSORS, GGUFMeta
from models.arch.spec import ArchSpec, GGUFTensorMap
from models.base import LoadedModel, ModelLoadError
from models.config import ModelConfig
from models.gguf_reader import GGUFHeaderReader
from models.hf_loader import check_weight_names
from models.hf_tokenizer import end_ids, load_gguf_bpe_tokenizer
from models.packing import pack_for_kernels
from models.quant import GGML_BLOCKS, GGMLTensor, KernelOptions, file_view, gguf_rows
from models.registry import gguf_spec
from models.spm_tokenizer import SPMTokenizer, read_gguf_tokenizer_metadata, uses_spm_tokenizer
from models.tokenizer import Tokenizer

Q = GGMLQuantizationType
# Types we dequantize and have checked against transformers / round trips; others are refused by
# name rather than trusted blindly.
SUPPORTED_TYPES = frozenset(
    {
        Q.F32,
        Q.F16,
        Q.BF16,
        Q.Q8_0,
        Q.Q4_0,
        Q.Q4_1,
        Q.Q5_0,
        Q.Q5_1,
        Q.Q2_K,
        Q.Q3_K,
        Q.Q4_K,
        Q.Q5_K,
        Q.Q6_K,
        Q.IQ4_NL,
        Q.IQ4_XS,
        Q.MXFP4,
    }
)

# GGUF float types a table is read in as they are (`GGUFWeights.table`)
_FLOAT_TYPES = {int(Q.F32): torch.float32, int(Q.F16): torch.float16, int(Q.BF16): torch.bfloat16}
# A layer's tensor: blk.N.<name>[.weight|.bias] (a name may hold dots, and a few tensors have no
# suffix, as llama.cpp names them); the name maps to the Hugging Face one, the suffix stays.
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+?)(\.weight|\.bias)?")
# A mixture of experts' stacked projections, (experts, rows, in) each, and their biases (experts,
# rows) where the architecture has them (gpt-oss): one Hugging Face tensor per expert
# (`_ExpertSlice`).
_EXPERTS_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)")


def _open(path: Path) -> GGUFReader:
    try:
        return GGUFHeaderReader(path, skip_tokenizer_arrays=True)
    except (ValueError, OSError, KeyError, IndexError, struct.error) as e:
        # past the magic, a parse runs out of bytes where a download or a copy was cut short
        hint = "" if "magic" in str(e) else " (it ends early or is damaged: copy it again?)"
        raise ModelLoadError(f"{path} is not a readable GGUF file{hint}: {e}") from e


def _config(meta: GGUFMeta, tensors: dict[str, Any], name: str, spec: ArchSpec) -> ModelConfig:
    assert spec.gguf_config is not None
    return ModelConfig(name=name, dtype=torch.float32, **spec.gguf_config(meta, tensors))


def _hf_name(gguf_name: str, path: Path, arch: str, names: GGUFTensorMap) -> str:
    if gguf_name in names.globals:
        return names.globals[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m:
        # (a name the map holds with its suffix maps to a whole Hugging Face name: Gemma 4's
        # layer_output_scale.weight is its layer's layer_scalar, Qwen3.5's ssm_dt.bias its dt_bias)
        whole = names.blocks.get(m.group(2) + (m.group(3) or ""))
        if whole is not None and m.group(3):
            return f"model.layers.{m.group(1)}.{whole}"
        hf = names.blocks.get(m.group(2))
        if hf is not None:
            return f"model.layers.{m.group(1)}.{hf}{m.group(3) or ''}"
    raise ModelLoadError(f"{path.name}: tensor {gguf_name!r} has no place in a {arch} decoder")


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (its RoPE rotates adjacent pairs; ours rotates halves).

    The converter reshaped each head's rows as (2, hd/2) and swapped to (hd/2, 2); swapping back
    restores the Hugging Face order. Works for weights (rows, in) and biases (rows,).
    """
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dequantize(t: Any, dtype: torch.dtype) -> torch.Tensor:
    arr = dequantize(t.data, t.tensor_type)  # float32, shape = reversed GGUF dims
    expected = tuple(int(d) for d in reversed(t.shape.tolist()))
    arr = arr.reshape(expected)
    if not arr.flags.writeable:  # F32 tensors come back as views of the read-only file map
        arr = arr.copy()
    return torch.from_numpy(arr).to(dtype)


class _ExpertSlice:
    """One expert's (rows, in) matrix (or (rows,) bias) of a stacked (experts, rows, in) GGUF
    tensor, with the reader tensor's attributes this module reads (`tensor_type`, `shape`
    innermost first, `data` a view of the file's bytes)."""

    def __init__(self, t: Any, expert: int) -> None:
        self.name = f"{t.name}[{expert}]"
        self.tensor_type = t.tensor_type
        self.shape = t.shape[:-1]
        self.data = t.data[expert]


def _expert_slices(t: Any, path: Path, arch: str, names: GGUFTensorMap) -> dict[str, _ExpertSlice]:
    """A stacked expert tensor under its experts' Hugging Face names."""
    m = _EXPERTS_RE.fullmatch(t.name)
    if m is None or not names.stacked_experts:
        raise ModelLoadError(f"{path.name}: tensor {t.name!r} has no place in a {arch} decoder")
    layer, proj, suffix = m.groups()
    dims = 3 if suffix == "weight" else 2
    if len(t.shape) != dims or t.data.shape[0] != int(t.shape[-1]):
        what = "(experts, rows, in)" if dims == 3 else "(experts, rows)"
        raise ModelLoadError(f"{path.name}: {t.name} is not {what}")
    return {
        f"model.layers.{layer}.{names.expert_names[proj].format(e=e)}.{suffix}": _ExpertSlice(t, e)
        for e in range(int(t.shape[-1]))
    }


class GGUFWeights(Mapping[str, torch.Tensor]):
    """A GGUF file's decoder tensors under Hugging Face names, dequantized when looked up.

    Lazy on purpose: `load_hf_weights(adopt=True)` turns each tensor into its parameter right
    after taking it, so the dequantized weights exist once (peak memory ~ the model, not twice it;
    on a VM, first-touch page faults of a second 540 MB copy cost seconds).

    `in_place`: the kernels will take the projections' own blocks (`blocks`), so a projection
    whose every fused part has them is not dequantized at all: its float tensor is a stride-0
    stand-in (`models.decoder` keeps it as such, no memory) that must not be read.
    """

    def __init__(
        self,
        path: Path,
        reader: GGUFReader,
        config: ModelConfig,
        dtype: torch.dtype,
        spec: ArchSpec,
        in_place: bool = False,
    ) -> None:
        assert spec.gguf_tensors is not None and spec.gguf_architecture is not None
        self.dtype = dtype
        self._map = names = spec.gguf_tensors
        arch = spec.gguf_architecture
        heads = (
            {"q_proj": config.num_heads, "k_proj": config.num_kv_heads} if names.permuted_qk else {}
        )
        self._tensors: dict[str, Any] = {}
        for t in reader.tensors:
            if t.name in ROPE_FACTOR_TENSORS:
                continue  # already in the config (rope_freq_factors, rope_long_factors)
            if t.tensor_type not in SUPPORTED_TYPES:
                raise ModelLoadError(
                    f"{path.name}: tensor {t.name} has type {t.tensor_type.name}, which is not "
                    f"supported (supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})"
                )
            m = _BLOCK_RE.fullmatch(t.name)
            if m and int(m.group(1)) >= config.num_layers:
                continue  # a layer past the decoder's (llama.cpp's multi-token-prediction head)
            if "_exps." in t.name:
                self._tensors.update(_expert_slices(t, path, arch, names))
            else:
                self._tensors[_hf_name(t.name, path, arch, names)] = t
        self._unread = self._in_place_names() if in_place else frozenset()
        # When the kernels take every q/k projection's blocks, they take them in the file's
        # order, as views of its pages (reordered, they would be anonymous copies: about a tenth
        # of a Llama file's weights), and RoPE pairs their rows as GGML does
        # (`ModelConfig.rope_interleaved`).
        # (a q/k bias is never taken as blocks: a file with one keeps Hugging Face's order)
        qk = [n for n in self._tensors if n.split(".")[-2] in heads]
        self.rope_interleaved = bool(qk) and all(n in self._unread for n in qk)
        # the rows `self[name]` and `blocks` un-permute, by their projection's head count
        self._heads = {} if self.rope_interleaved else heads

    def _in_place_names(self) -> frozenset[str]:
        """Projection weights the kernels take as blocks: each fused group (q/k/v, gate/up) all
        in formats `gguf_rows` reads, or none of it (a group's float fallback reads them all).
        A projection is what the spec's `projections` pattern matches, its third group the
        projection's name."""

        def has_blocks(name: str) -> bool:
            t = self._tensors.get(name)
            if t is None or int(t.tensor_type) not in GGML_BLOCKS:
                return False
            return int(t.shape[0]) % GGML_BLOCKS[int(t.tensor_type)][0] == 0

        out: set[str] = set()
        # the embedding: looked up from its rows (`models.quant.RowsEmbedding`), the tied head
        # multiplied by them
        groups: list[list[str]] = [["lm_head.weight"], ["model.embed_tokens.weight"]]
        for name in self._tensors:
            m = self._map.projections.fullmatch(name)
            if m is None or self._map.transform(name) is not None:
                continue
            proj = m.group(3)
            members = self._map.fused.get(proj, (proj,))
            if proj == members[0]:  # (a fused group's parts are in one block)
                # (the parts the file holds: a layer that shares another's K/V has a q alone)
                named = (name[: m.start(3)] + p + name[m.end(3) :] for p in members)
                groups.append([n for n in named if n in self._tensors])
        for group in groups:
            if all(has_blocks(n) for n in group):
                out.update(group)
        return frozenset(out)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._unread:
            n, k = (int(d) for d in reversed(self._tensors[name].shape.tolist()))
            return torch.zeros((), dtype=self.dtype).expand(n, k)
        value = _dequantize(self._tensors[name], self.dtype)
        transform = self._map.transform(name)
        if transform is not None:  # the converter's change of the values, undone
            value = transform.from_file(value)
        proj = name.split(".")[-2]
        if proj in self._heads:
            value = _unpermute(value, self._heads[proj])
        return value

    def blocks(self, name: str) -> GGMLTensor | None:
        """The tensor's own quantized blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K .. Q6_K,
        IQ4_NL, IQ4_XS, MXFP4), byte for byte, row-permuted like `self[name]` (q/k rows un-permuted
        unless `rope_interleaved`) but never dequantized; None for other formats or names."""
        t = self._tensors.get(name)
        if t is None or self._map.transform(name) is not None:
            return None
        n, k = (int(d) for d in reversed(t.shape.tolist()))
        qt = gguf_rows(t.data, int(t.tensor_type), n, k)
        proj = name.split(".")[-2]
        if qt is not None and proj in self._heads:
            heads = self._heads[proj]
            order = torch.arange(n).view(heads, n // heads // 2, 2).transpose(1, 2).reshape(-1)
            qt = qt.rows(order)
        return qt

    def table(self, name: str) -> torch.Tensor | GGMLTensor:
        """Tensor `name` as the file holds it, for a table read a few rows at a time
        (`models.row_table`): its blocks, or a float32 / float16 / bfloat16 tensor over the
        file's map; never dequantized whole."""
        t = self._tensors[name]
        n, k = (int(d) for d in reversed(t.shape.tolist()))
        typ = int(t.tensor_type)
        if typ in _FLOAT_TYPES:
            raw = file_view(np.ascontiguousarray(t.data).view(np.uint8))
            if raw is not None:
                return raw.view(_FLOAT_TYPES[typ]).view(n, k)
            return _dequantize(t, torch.float32)  # (not a file map: already in memory)
        rows = gguf_rows(t.data, typ, n, k)
        if rows is None:
            raise ModelLoadError(
                f"{name}: a table of type {t.tensor_type.name} is not read by rows"
            )
        return rows

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __contains__(self, name: object) -> bool:
        # (Mapping's default looks the value up: a dequantization or a read per membership test)
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)


def load_gguf(
    path: str | Path,
    name: str | None = None,
    dtype: torch.dtype = torch.float32,
    kernels: KernelOptions | None = None,
) -> LoadedModel:
    """Load a GGUF file of a supported architecture: weights, tokenizer, chat template, EOS ids.

    `kernels`: how `models.packing.pack_for_kernels` packs the model, which then takes the
    file's own quantized blocks as they are (None: the pure-torch float model)."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"no such GGUF file: {path}")
    t0 = time.perf_counter()
    reader = _open(path)
    meta = GGUFMeta(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    spec = gguf_spec(meta.arch, path.name)
    config = replace(_config(meta, tensors, name or path.stem, spec), dtype=dtype)
    cls = spec.model_class

    # Checked before the tokenizer is converted: an unusable file fails fast.
    in_place = kernels is not None and kernels.quantization == "auto"
    weights = GGUFWeights(path, reader, config, dtype, spec, in_place=in_place)
    check_weight_names(weights, config, path.name, cls)
    config = replace(config, rope_interleaved=weights.rope_interleaved)

    tok = _tokenizer(path, meta)
    eos = tok.eos_token_ids
    bos = meta.get("tokenizer.ggml.bos_token_id", tok.bos_token_id)
    pad = meta.get("tokenizer.ggml.padding_token_id", tok.pad_token_id)
    config = replace(
        config,
        eos_token_ids=eos,
        bos_token_id=None if bos is None else int(bos),
        pad_token_id=None if pad is None else int(pad),
        extra={"source": str(path), "file_type": meta.get("general.file_type")},
    )
    model = cls.without_weights(config)
    try:
        model.load_hf_weights(weights, adopt=True)
    except ValueError as e:
        raise ModelLoadError(f"{path.name}: {e}") from e
    model.eval().requires_grad_(False)
    if kernels is not None:
        # (every stand-in for a weight left in the file must be replaced by its blocks)
        try:
            model = pack_for_kernels(model, kernels, weights.blocks)
        except ValueError as e:
            raise ModelLoadError(f"{path.name}: {e}") from e
    _release_pages(reader)
    config.extra["load_seconds"] = round(time.perf_counter() - t0, 3)
    return LoadedModel(config.name, model, tok, config)


def _release_pages(reader: GGUFReader) -> None:
    """Take the file pages loading read (tensors copied into panels, permuted q/k rows, a tied
    table packed into head panels) out of the process's resident set. The map is read-only and
    file-backed, so nothing is lost: the weights the kernels read in place fault back in from
    the page cache as they are used, and pages only a copy needed stop counting against the
    server's memory."""
    root = reader.data
    while not isinstance(root, np.memmap) and isinstance(getattr(root, "base", None), np.ndarray):
        root = root.base
    mm = getattr(root, "_mmap", None)
    if isinstance(mm, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        mm.madvise(mmap.MADV_DONTNEED)


def load_gguf_file_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer `load_gguf` gives a GGUF file, without its weights (models.fetch: prepare
    it once after a download)."""
    path = Path(path)
    return _tokenizer(path, GGUFMeta(_open(path), path))


def _tokenizer(path: Path, meta: GGUFMeta) -> Tokenizer:
    """The file's tokenizer, its end-of-generation ids set from the file's declared ones."""
    declared = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    spm = {
        "general.architecture": meta.get("general.architecture"),
        "tokenizer.ggml.model": meta.get("tokenizer.ggml.model"),
    }
    if meta.array_len("tokenizer.ggml.merges") is not None:
        spm["tokenizer.ggml.merges"] = True
    if uses_spm_tokenizer(spm):
        try:
            tok = SPMTokenizer.from_gguf_metadata(read_gguf_tokenizer_metadata(path))
        except (ValueError, KeyError, OSError, struct.error) as e:
            raise ModelLoadError(f"cannot read the tokenizer stored in {path}: {e}") from e
        # Known end tokens only among its control tokens: Gemma's "</s>" is a user-defined HTML
        # tag (strikethrough), not an end of text.
        control = {t: i for t, i in tok.added_vocab.items() if i in tok.special_ids}
        tok.eos_token_ids = end_ids(declared, tok.eos_token_id, control)
        return tok
    return load_gguf_bpe_tokenizer(path, declared)
