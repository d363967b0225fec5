"""Tables read a few rows at a time where they lie: a checkpoint tensor too large to copy (Gemma 4's
per-layer input embeddings: 35 x 256 values a token over 262,144 tokens, 2.35 billion values,
1.9 GB at Q6_K and 9.4 GB as float32) stays in the file's map, and a lookup decodes only the rows
a step reads.

Owns `RowTable` (the lookup) and `RowTables`, what a weights mapping offers for such a table
(`table(name)`: the tensor as its file holds it, never converted whole). A GGUF file's table of
blocks is decoded by the kernel (`models.ops.ggml_rows`) once the model runs on the kernels, else
by gguf's own dequantize of the rows read (the same floats); a float table (float32, float16,
bfloat16: a GGUF's or a safetensors file's, both memory-mapped) is indexed and widened to float32.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from models import ops
from models.quant import GGMLTensor


@runtime_checkable
class RowTables(Protocol):
    """A weights mapping that hands a table out as its file holds it (`RowTable`'s source)."""

    def table(self, name: str) -> torch.Tensor | GGMLTensor:
        """Tensor `name` unconverted: the file's blocks (GGUF) or a float tensor over the file's
        map, its rows read where they lie."""
        ...


class RowTable(nn.Module):
    """A (rows, width) table looked up by row ids: (..., width) float32 for ids (...). Its memory
    is its source's (the file map); nothing is copied but the rows a lookup reads."""

    def __init__(self, source: torch.Tensor | GGMLTensor) -> None:
        super().__init__()
        self.source = source
        if isinstance(source, GGMLTensor):
            ((typ, raw),) = source.parts
            self.ggml_type = typ
            self.num_rows, self.width = int(raw.shape[0]), source.in_features
            self._raw = raw  # (rows, row bytes) uint8
        else:
            if source.dim() != 2:
                raise ValueError(f"a row table is 2-D, not {tuple(source.shape)}")
            self.ggml_type = None
            self.num_rows, self.width = (int(d) for d in source.shape)
        self.kernels = False  # set by the model once it runs on the kernels

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).long()
        if self.ggml_type is None:
            rows = self.source[flat].float()  # type: ignore[index]
        elif self.kernels:
            rows = ops.ggml_rows(self._raw.reshape(-1), self.ggml_type, self.width, flat)
        else:
            from gguf.quants import dequantize

            picked = self._raw[flat].numpy()  # (n, row bytes): only these rows are read
            rows = torch.from_numpy(np.ascontiguousarray(dequantize(picked, self.ggml_type)))
        return rows.reshape(*ids.shape, self.width)

    def nbytes(self) -> int:
        """Bytes of the table where it lies."""
        if self.ggml_type is not None:
            return int(self._raw.numel())
        return self.source.numel() * self.source.element_size()  # type: ignore[union-attr]

    def extra_repr(self) -> str:
        kind = str(self.source.dtype) if self.ggml_type is None else f"ggml type {self.ggml_type}"
        return f"{self.num_rows}, {self.width}, {kind}"
