"""Reading a GGUF file's header fast: `GGUFHeaderReader`, gguf's GGUFReader without its
per-string memmap cost (and, for the loader, without parsing the tokenizer's arrays),
`transformers_reads_fast()`, which has transformers' GGUF reading (the tokenizer conversion, test
oracles) parse with it, and `is_gguf_file` (a file known by its magic, whatever its name).
"""

from __future__ import annotations

import contextlib
import functools
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderField

GGUF_MAGIC = b"GGUF"  # a GGUF file's first four bytes


def is_gguf_file(path: Path) -> bool:
    """Whether `path` is a file that starts as GGUF does: a GGUF named otherwise (Ollama keeps
    its models as blobs/sha256-<digest>, and llama.cpp loads those as they are)."""
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


class GGUFHeaderReader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memory map.

    GGUFReader slices its `np.memmap` once per metadata string (98k of them for a 49k-token
    vocabulary), and every memmap slice runs Python-level `__array_finalize__`: 2 s for SmolLM2's
    header. The same bytes viewed as a plain ndarray (still memory-mapped, not copied) parse in
    0.7 s. The reader assigns `self.data` once in `__init__`; this property converts it there.
    """

    def __init__(self, path: Path, skip_tokenizer_arrays: bool = False) -> None:
        self.skip_tokenizer_arrays = skip_tokenizer_arrays
        super().__init__(path)

    @property
    def data(self) -> np.ndarray:
        return self._array

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._array = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    def _build_fields(self, offs: int, count: int) -> int:
        """GGUFReader's, except that with `skip_tokenizer_arrays` the tokenizer's arrays are only
        counted (`array_lengths`), not parsed.

        GGUFReader makes an ndarray per array item: for Gemma's 262,144 tokens, scores and types
        that is ~1M objects, 330 MB of RSS held as long as the reader, and ~10 s. The loader's
        tokenizer reads those arrays itself (models.spm_tokenizer, or transformers), so it skips
        them here; every other field is parsed as GGUFReader does.
        """
        self.array_lengths: dict[str, int] = {}
        if not self.skip_tokenizer_arrays or self.byte_order == "S":  # (S: byte-swapped file)
            return super()._build_fields(offs, count)
        for _ in range(count):
            start = offs
            key_len, key = self._get_str(offs)
            offs += int(key_len.nbytes + key.nbytes)
            kind = self._get(offs, np.uint32)
            offs += int(kind.nbytes)
            name = str(bytes(key), encoding="utf-8")
            if kind[0] == GGUFValueType.ARRAY and name.startswith("tokenizer.ggml."):
                item, n = int(self._get(offs, np.uint32)[0]), int(self._get(offs + 4, np.uint64)[0])
                offs = _skip_array(self.data, offs + 12, item, n)
                self.array_lengths[name] = n
                continue
            size, parts, idxs, types = self._get_field_parts(offs, kind[0])
            self._push_field(
                ReaderField(
                    start, name, [key_len, key, kind, *parts], [i + 3 for i in idxs], types
                ),
                skip_sum=True,
            )
            offs += size
        return offs


def _skip_array(data: np.ndarray, offs: int, item: int, n: int) -> int:
    """The offset just past a GGUF array of `n` items of type `item` starting at `offs`."""
    if item == GGUFValueType.STRING:
        buf = memoryview(data)
        for _ in range(n):
            offs += 8 + struct.unpack_from("<Q", buf, offs)[0]
        return offs
    size = GGUFReader.gguf_scalar_to_np.get(GGUFValueType(item))
    if size is None:  # arrays of arrays: no tokenizer key has them
        raise ValueError(f"unsupported GGUF array item type {item}")
    return offs + n * np.dtype(size).itemsize


def _with_architecture(field: ReaderField, name: str) -> ReaderField:
    """`general.architecture`'s field saying `name` instead."""
    value = np.frombuffer(name.encode(), dtype=np.uint8)
    length = np.array([len(value)], dtype=np.uint64)
    parts = [*field.parts[:3], length, value]
    return ReaderField(field.offset, field.name, parts, [4], field.types)


@contextlib.contextmanager
def transformers_reads_fast(architecture_aliases: dict[str, str] | None = None) -> Iterator[None]:
    """While inside, transformers' GGUF reading (it imports `gguf.GGUFReader` when it reads a
    file) parses the header with `GGUFHeaderReader` (all fields, the same values: 2.3x faster
    converting a 152k-token vocabulary), and gguf's tensor-name table, which transformers
    rebuilds for every submodule when it maps tensor names, is built once.

    `architecture_aliases`: a file of an architecture transformers does not read is shown to it
    as the one named here (its other `{arch}.*` keys then unseen), for what does not depend on
    the architecture: the tokenizer."""
    import gguf

    aliases = architecture_aliases or {}

    class Reader(GGUFHeaderReader):
        def __init__(self, path: Path, skip_tokenizer_arrays: bool = False) -> None:
            super().__init__(path, skip_tokenizer_arrays)
            field = self.fields.get("general.architecture")
            if field is not None and field.contents() in aliases:
                original = field.contents()
                self.fields["general.architecture"] = _with_architecture(field, aliases[original])
                for key in [k for k in self.fields if k.startswith(original + ".")]:
                    del self.fields[key]  # (unseen, even where transformers has a reader)

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = Reader if aliases else GGUFHeaderReader
    gguf.get_tensor_name_map = functools.cache(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved
