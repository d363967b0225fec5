"""Weight-only quantization: GGUF-style blocks, read from a GGUF file or made from float weights,
and packed into the panel layout `models.ops.packed_linear` reads.

Formats (32 inputs per block, one scale per block and output row, as llama.cpp defines them):
- Q8_0: int8 q, fp16 d; w = q * d.
- Q4_1: 4-bit q in 0..15, fp16 d and fp16 m; w = q * d + m. (GGUF's Q4_0, w = (q - 8) * d, is
  the Q4_1 block with m = -8 d, exact in fp16, so it needs no kernel of its own.)
- F32: float weights in the same panel layout (for models kept in float).

Every other GGUF block format (Q5_0, Q5_1, Q2_K .. Q6_K, IQ4_NL, IQ4_XS, MXFP4), and Q4_0 / Q4_1 / Q8_0 where the
activations are int8 on a CPU without AVX512-VNNI, is a `GGMLTensor`: the file's own rows of
blocks, byte for byte, multiplied in place by `models.ops.ggml_linear`
(models/csrc/kquant.cpp) with float32 or int8 activations (kinds GGML / GGML_A8). Its memory is
the file's; a fused projection may join parts of different formats (a Q4_K q with a Q6_K v).

`QTensor` holds a quantized matrix row by row, so the loader can do to it what it does to float
weights (undo llama.cpp's Q/K row permutation, fuse q/k/v and gate/up by concatenating rows)
without dequantizing: the SmolLM2 GGUF runs on its own 4-bit blocks, bit for bit.

Packed layout (`PackedWeight`): outputs in panels of 16 rows; for each panel and input k the 16
weights are adjacent (F32: 16 floats; Q8_0: 16 int8; Q4_1: 8 bytes, byte i holding output i in the
low nibble and output 8 + i in the high one), and the scales are (panels, blocks, 16). A gate/up
projection is packed with panel p holding gate rows 8p..8p+8 then up rows 8p..8p+8, so the kernel
can emit silu(gate) * up for 8 outputs per panel without a second pass.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from models import ops
from models.ops import Kind

NR = 16  # outputs per panel
QB = 32  # inputs per block

F32, Q8_0, Q4_1 = Kind.F32, Kind.Q8_0, Kind.Q4_1
# The same blocks laid out for int8 activations (AVX512-VNNI dot products; see `pack`).
Q8_0X, Q4_1X = Kind.Q8_0X, Kind.Q4_1X
# GGUF rows as the file holds them (`GGMLTensor`), float32 or int8 activations.
GGML, GGML_A8 = Kind.GGML, Kind.GGML_A8
KIND_NAMES = {
    F32: "f32",
    Q8_0: "q8_0",
    Q4_1: "q4_1",
    Q8_0X: "q8_0+a8",
    Q4_1X: "q4_1+a8",
    GGML: "ggml",
    GGML_A8: "ggml+a8",
}
# --quantization choices -> the panel kind weights are rounded to (None: keep a GGUF file's own
# blocks where the kernels read them, else float)
SCHEME_KINDS: dict[str, Kind | None] = {"auto": None, "none": F32, "q8_0": Q8_0, "q4_1": Q4_1}
SCHEMES = tuple(SCHEME_KINDS)
# The layouts whose projections multiply int8 activations
INT8_KINDS = frozenset({Q8_0X, Q4_1X, GGML_A8})
ACTIVATIONS = ("auto", "int8", "float32")  # --activation-dtype choices


@dataclass(frozen=True)
class KernelOptions:
    """How a model runs through the kernels: its weights' format (`SCHEMES`, see
    `models.packing.pack_for_kernels`) and its projections' activations (`ACTIVATIONS`): int8
    (quantized per row and 32 inputs, or 256 for the K formats, multiplied with integer dot
    products: AVX512-VNNI, or AVX2's vpmaddubsw on GGUF rows, as llama.cpp does for its quantized
    formats) or float32. "auto" is int8 for every quantized projection, on AVX512-VNNI and on
    AVX2 alike: on AVX2 the int8 rows beat the float panels of Q4_0 / Q4_1 / Q8_0 too, at one
    row and in prefill (SmolLM2 Q4_1 on Zen 3: a decode step 10.4 -> 8.6 ms, prefill 541 -> 708
    tokens/s)."""

    quantization: str = "auto"
    activations: str = "auto"


@dataclass
class QTensor:
    """A (N, K) weight matrix as quantized blocks, one row per output."""

    kind: int
    q: torch.Tensor  # (N, K): int8 (Q8_0), uint8 0..15 (Q4_1) or float32 (F32)
    d: torch.Tensor | None = None  # (N, K/32) fp16
    m: torch.Tensor | None = None  # (N, K/32) fp16

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def rows(self, index: torch.Tensor) -> QTensor:
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        return QTensor(self.kind, self.q[index], pick(self.d), pick(self.m))

    @staticmethod
    def cat(parts: list[QTensor | GGMLTensor]) -> QTensor | GGMLTensor:
        """The rows of `parts` in order; GGUF rows of different formats stay separate parts."""
        if len(parts) == 1:
            return parts[0]
        kinds = {p.kind for p in parts}
        if len(kinds) != 1 or any(isinstance(p, GGMLTensor) for p in parts):
            return GGMLTensor.cat(parts)

        def join(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
            return None if ts[0] is None else torch.cat(ts)  # type: ignore[arg-type]

        return QTensor(
            parts[0].kind,
            torch.cat([p.q for p in parts]),
            join([p.d for p in parts]),
            join([p.m for p in parts]),
        )

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix these blocks stand for (what the kernel multiplies by)."""
        if self.kind == F32:
            return self.q.float()
        n, k = self.shape
        q = self.q.view(n, k // QB, QB).float()
        w = q * self.d.float()[..., None]  # type: ignore[union-attr]
        if self.kind == Q4_1:
            w = w + self.m.float()[..., None]  # type: ignore[union-attr]
        return w.view(n, k)

    def to_ggml(self) -> GGMLTensor:
        """The same blocks as GGUF rows (Q8_0 / Q4_1 bytes as the file would hold them)."""
        n, k = self.shape
        b = k // QB
        if self.kind == Q8_0:
            d = self.d.contiguous().view(torch.uint8).view(n, b, 2)  # type: ignore[union-attr]
            raw = torch.cat([d, self.q.view(torch.uint8).view(n, b, QB)], -1)
            return GGMLTensor([(GGML_Q8_0, raw.reshape(n, -1).contiguous())], k)
        if self.kind == Q4_1:
            d = self.d.contiguous().view(torch.uint8).view(n, b, 2)  # type: ignore[union-attr]
            m = self.m.contiguous().view(torch.uint8).view(n, b, 2)  # type: ignore[union-attr]
            q = self.q.view(n, b, 2, 16)
            raw = torch.cat([d, m, q[:, :, 0] | (q[:, :, 1] << 4)], -1)
            return GGMLTensor([(GGML_Q4_1, raw.reshape(n, -1).contiguous())], k)
        raise ValueError(f"{KIND_NAMES[self.kind]} weights have no GGUF block form")


def quantize(w: torch.Tensor, kind: int) -> QTensor:
    """Round float weights (N, K) to blocks, as llama.cpp's reference quantizers do."""
    w = w.detach().float()
    if kind == F32:
        return QTensor(F32, w.contiguous())
    n, k = w.shape
    if k % QB:
        raise ValueError(f"in_features {k} is not a multiple of {QB}")
    wb = w.view(n, k // QB, QB)
    if kind == Q8_0:
        d = (wb.abs().amax(-1) / 127).half()
        inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros(()))
        q = (wb * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
        return QTensor(Q8_0, q.view(n, k), d)
    if kind == Q4_1:
        lo, hi = wb.amin(-1), wb.amax(-1)
        d = ((hi - lo) / 15).half()
        m = lo.half()
        inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros(()))
        q = ((wb - m.float()[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
        return QTensor(Q4_1, q.view(n, k), d, m)
    raise ValueError(f"unknown weight format {kind}")


# -- GGUF blocks ------------------------------------------------------------------------------

# ggml type ids (gguf.GGMLQuantizationType) of the block formats read without dequantizing.
GGML_Q4_0, GGML_Q4_1, GGML_Q8_0 = 2, 3, 8
GGML_Q5_0, GGML_Q5_1, GGML_Q4_K, GGML_Q5_K, GGML_Q6_K = 6, 7, 12, 13, 14
GGML_Q2_K, GGML_Q3_K, GGML_IQ4_NL, GGML_IQ4_XS = 10, 11, 20, 23
GGML_MXFP4 = 39
# type -> (values, bytes) a block, and the name weight_formats() reports
GGML_BLOCKS = {
    GGML_Q4_0: (32, 18),
    GGML_Q4_1: (32, 20),
    GGML_Q5_0: (32, 22),
    GGML_Q5_1: (32, 24),
    GGML_Q8_0: (32, 34),
    GGML_Q2_K: (256, 84),
    GGML_Q3_K: (256, 110),
    GGML_Q4_K: (256, 144),
    GGML_Q5_K: (256, 176),
    GGML_Q6_K: (256, 210),
    GGML_IQ4_NL: (32, 18),
    GGML_IQ4_XS: (256, 136),
    GGML_MXFP4: (32, 17),
}
GGML_NAMES = {
    GGML_Q4_0: "q4_0",
    GGML_Q4_1: "q4_1",
    GGML_Q5_0: "q5_0",
    GGML_Q5_1: "q5_1",
    GGML_Q8_0: "q8_0",
    GGML_Q2_K: "q2_k",
    GGML_Q3_K: "q3_k",
    GGML_Q4_K: "q4_k",
    GGML_Q5_K: "q5_k",
    GGML_Q6_K: "q6_k",
    GGML_IQ4_NL: "iq4_nl",
    GGML_IQ4_XS: "iq4_xs",
    GGML_MXFP4: "mxfp4",
}


@dataclass
class GGMLTensor:
    """A (N, K) weight matrix as GGUF rows of blocks: parts of (ggml type, (rows, row bytes)
    uint8), their rows the outputs in order. One part per file tensor; a fused projection
    concatenates them, and parts of one format merge."""

    parts: list[tuple[int, torch.Tensor]]
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return sum(int(t.shape[0]) for _, t in self.parts), self.in_features

    @property
    def kind(self) -> int:
        """Q8_0 or Q4_1 where every part is one of the formats the panels also hold (Q4_0 as
        Q4_1), else GGML."""
        types = {t for t, _ in self.parts}
        if types == {GGML_Q8_0}:
            return Q8_0
        if types <= {GGML_Q4_0, GGML_Q4_1}:
            return Q4_1
        return GGML

    def rows(self, index: torch.Tensor) -> GGMLTensor:
        if len(self.parts) != 1:
            raise ValueError("row selection of a fused GGUF weight")
        t, raw = self.parts[0]
        return GGMLTensor([(t, raw[index].contiguous())], self.in_features)

    @staticmethod
    def cat(parts: list[QTensor | GGMLTensor]) -> GGMLTensor:
        tensors = [p.to_ggml() if isinstance(p, QTensor) else p for p in parts]
        if len({t.in_features for t in tensors}) != 1:
            raise ValueError("cannot fuse weights with different in_features")
        out: list[tuple[int, torch.Tensor]] = []
        for t in tensors:
            for typ, raw in t.parts:
                # (parts that are views of one file map stay apart: `pack_rows` reads them
                # where they lie, where joining them would copy them)
                if out and out[-1][0] == typ and not _one_storage([out[-1][1], raw]):
                    out[-1] = (typ, torch.cat([out[-1][1], raw]))
                else:
                    out.append((typ, raw))
        return GGMLTensor(out, tensors[0].in_features)

    def legacy(self) -> QTensor | None:
        """The same blocks as a panel QTensor (Q8_0, or Q4_0/Q4_1 as Q4_1), else None."""
        if self.kind == GGML:
            return None
        parts = [
            from_gguf_blocks(raw.numpy(), t, raw.shape[0], self.in_features)
            for t, raw in self.parts
        ]
        return QTensor.cat(parts)  # type: ignore[arg-type,return-value]

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix, by gguf's own dequantizer (the reference the kernel must match)."""
        from gguf.quants import dequantize

        out = [
            torch.from_numpy(dequantize(raw.numpy(), t).reshape(raw.shape[0], self.in_features))
            for t, raw in self.parts
        ]
        return torch.cat(out).float()


def gguf_rows(data: np.ndarray, ggml_type: int, n: int, k: int) -> GGMLTensor | None:
    """A GGUF tensor's raw blocks (uint8, n rows of k values) as a GGMLTensor, or None for
    formats the kernels do not read. Bytes of a read-only file map (a GGUF reader's) stay where
    they are (`file_view`); others are copied."""
    if ggml_type not in GGML_BLOCKS or k % GGML_BLOCKS[ggml_type][0]:
        return None
    values, nbytes = GGML_BLOCKS[ggml_type]
    raw = file_view(data)
    if raw is None:
        raw = torch.from_numpy(np.array(data, dtype=np.uint8, copy=True))
    return GGMLTensor([(ggml_type, raw.view(n, k // values * nbytes))], k)


def file_view(data: np.ndarray) -> torch.Tensor | None:
    """`data`, bytes of a read-only memory map, as a uint8 tensor over the same memory, sliced
    from one tensor over the whole map so that every tensor of a file shares one storage
    (`pack_rows` then addresses a fused projection's parts by offset, without joining them).
    The weights' memory is then the file's pages: the page cache's, shared with other processes
    mapping the file, never a second copy. None when `data` is not such a view.

    The map must never be written: the kernels only read their weights."""
    root = data
    while isinstance(root.base, np.ndarray):
        root = root.base
    if (
        root.flags.writeable
        or root.dtype != np.uint8
        or root.ndim != 1
        or not data.flags.c_contiguous
        or data.dtype != np.uint8
    ):
        return None
    start = data.ctypes.data - root.ctypes.data
    if not 0 <= start <= root.nbytes - data.nbytes:
        return None
    with warnings.catch_warnings():  # (torch warns that the array is not writable: see above)
        warnings.simplefilter("ignore", UserWarning)
        whole = torch.from_numpy(root)
    return whole[start : start + data.nbytes]


def _one_storage(raws: list[torch.Tensor]) -> bool:
    """Every tensor of `raws` is a contiguous view of one storage (the file map, `file_view`)."""
    storage = raws[0].untyped_storage()
    base, size = storage.data_ptr(), storage.nbytes()
    return all(
        t.is_contiguous()
        and t.untyped_storage().data_ptr() == base
        and t.untyped_storage().nbytes() == size
        for t in raws
    )


def from_gguf_blocks(data: np.ndarray, ggml_type: int, n: int, k: int) -> QTensor | None:
    """A GGUF tensor's raw blocks (uint8, n rows) as a QTensor, or None for other formats."""
    if ggml_type not in (GGML_Q4_0, GGML_Q4_1, GGML_Q8_0) or k % QB:
        return None
    raw = np.ascontiguousarray(data).reshape(n, k // QB, -1)
    if ggml_type == GGML_Q8_0:  # {fp16 d, 32 x int8}
        d = raw[..., 0:2].copy().view(np.float16)[..., 0]
        q = raw[..., 2:34].copy().view(np.int8).reshape(n, k)
        return QTensor(Q8_0, torch.from_numpy(q), torch.from_numpy(d))
    if ggml_type in (GGML_Q4_0, GGML_Q4_1):
        off = 2 if ggml_type == GGML_Q4_0 else 4
        d = raw[..., 0:2].copy().view(np.float16)[..., 0]
        nib = raw[..., off : off + 16]  # byte j: weight j (low nibble), weight j + 16 (high)
        q = np.concatenate([nib & 15, nib >> 4], axis=-1).reshape(n, k)
        if ggml_type == GGML_Q4_1:
            m = raw[..., 2:4].copy().view(np.float16)[..., 0]
        else:  # w = (q - 8) d = q d + (-8 d); -8 d is exact in fp16 (a power-of-two multiple)
            m = (-8 * d.astype(np.float32)).astype(np.float16)
        return QTensor(Q4_1, torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))
    return None


class BlockEmbedding(torch.nn.Module):
    """An embedding table looked up from quantized blocks, never a float32 copy: a lookup
    decodes only the rows it reads."""

    num_embeddings: int
    embedding_dim: int


class RowsEmbedding(BlockEmbedding):
    """An embedding table kept as the file's GGUF rows: a lookup decodes only the rows it reads
    (`models.ops.ggml_rows`, the same floats as gguf's dequantize), so a large vocabulary
    costs its file size, not a float32 copy (Gemma 3's 262k x 640 table: 170 MB, not 671)."""

    def __init__(self, w: GGMLTensor) -> None:
        super().__init__()
        ((typ, raw),) = w.parts
        self.ggml_type, self.num_embeddings, self.embedding_dim = typ, raw.shape[0], w.in_features
        self.register_buffer("qs", raw.reshape(-1), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ops.ggml_rows(self.qs, self.ggml_type, self.embedding_dim, ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows={GGML_NAMES[self.ggml_type]}"


class PanelEmbedding(BlockEmbedding):
    """A tied table looked up from the head's Q8_0X panels (`pack(..., int8=True)` of a Q8_0
    table, the AVX512-VNNI layout): the lookup reads the copy the head multiplies, so the
    file's rows are never touched after loading and stay out of the resident set (the 360M
    shape's 49,152 x 960 table: 48 MiB; Gemma 3's: 170 MiB). The same floats as the rows: a
    block's float16 scale times its int8 values, exact in float32."""

    def __init__(self, head: PackedWeight, num_embeddings: int) -> None:
        super().__init__()
        if head.kind != Q8_0X:
            raise ValueError(f"PanelEmbedding reads Q8_0X panels, not {KIND_NAMES[head.kind]}")
        self.num_embeddings, self.embedding_dim = num_embeddings, head.in_features
        self.register_buffer("qs", head.qs, persistent=False)  # (panel, block, group, row, 4)
        self.register_buffer("d", head.d, persistent=False)  # (panel, block, row) float16

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).long()
        panel, row = flat // NR, flat % NR
        q = self.qs[panel, :, :, row, :].reshape(len(flat), -1, QB)  # (ids, block, 32)
        d = self.d[panel, :, row].float().unsqueeze(-1)  # (ids, block, 1)
        return (q.float() * d).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, panels=q8_0+a8"


# -- panels -------------------------------------------------------------------------------------


@dataclass
class PackedWeight:
    """Arguments of `models.ops.packed_linear` for one weight matrix."""

    kind: int
    qs: torch.Tensor
    d: torch.Tensor | None
    m: torch.Tensor | None
    out_features: int  # N (before a fused gated act halves it)
    in_features: int

    def nbytes(self) -> int:
        """Bytes of the weight (GGUF rows: of its own rows, not of the file map they lie in)."""
        if self.kind in (GGML, GGML_A8):
            return sum(self.formats().values())
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    @property
    def op(self) -> Callable[..., torch.Tensor]:
        """The `models.ops` wrapper that multiplies this layout (both take the same arguments)."""
        return ops.ggml_linear if self.kind in (GGML, GGML_A8) else ops.packed_linear

    def formats(self) -> dict[str, int]:
        """Bytes by format name ("q4_k", "q6_k+a8", "f32", ...)."""
        if self.kind not in (GGML, GGML_A8):
            return {KIND_NAMES[self.kind]: self.nbytes()}
        out: dict[str, int] = {}
        suffix = "+a8" if self.kind == GGML_A8 else ""
        for typ, rows, _ in self.m.tolist():  # type: ignore[union-attr]
            name = GGML_NAMES[typ] + suffix
            values, nbytes = GGML_BLOCKS[typ]
            out[name] = out.get(name, 0) + rows * self.in_features // values * nbytes
        return out


def pack_rows(w: GGMLTensor, int8: bool) -> PackedWeight:
    """GGUF rows for `ggml_linear`: `qs` bytes and `m` the parts' (type, rows, byte offset into
    qs) table. Parts that are views of one file map are read where they lie (`qs` the whole map,
    the offsets theirs in it); other parts are joined into one tensor, back to back."""
    raws = [raw for _, raw in w.parts]
    if len(raws) == 1:
        qs, offsets = raws[0].reshape(-1).contiguous(), [0]
    elif _one_storage(raws):
        whole = raws[0].untyped_storage().nbytes()
        qs = raws[0].as_strided((whole,), (1,), 0)  # the map, as one uint8 tensor
        offsets = [raw.data_ptr() - qs.data_ptr() for raw in raws]
    else:
        qs = torch.cat([raw.reshape(-1) for raw in raws])
        offsets = np.cumsum([0] + [raw.numel() for raw in raws[:-1]]).tolist()
    table = [(typ, raw.shape[0], off) for (typ, raw), off in zip(w.parts, offsets, strict=True)]
    n, k = w.shape
    kind = GGML_A8 if int8 else GGML
    return PackedWeight(kind, qs, None, torch.tensor(table), n, k)


def _vnni() -> bool:
    from models.kernels import has_int8_dot  # (models.kernels is importable on its own)

    return has_int8_dot()


def _gate_up_order(n: int) -> torch.Tensor:
    """Row order putting gate rows 8p..8p+8 then up rows 8p..8p+8 in panel p (-1 = zero row)."""
    f = n // 2
    order = []
    for p in range(-(-f // 8)):
        gate = [i if i < f else -1 for i in range(8 * p, 8 * p + 8)]
        order += gate + [f + i if i >= 0 else -1 for i in gate]
    return torch.tensor(order)


def gate_up_bias(bias: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """A fused [gate; up] projection's bias (2 f,) in the order `packed` multiplies its outputs:
    the panels' (gate 8p..8p+8 then up 8p..8p+8, as `pack(gate_up=True)` lays the rows; the
    epilogue adds bias[16 p + j] to panel p's output j), or as it is for GGUF rows, whose
    gated epilogue reads gate and up apart."""
    if packed.kind in (GGML, GGML_A8):
        return bias
    order = _gate_up_order(bias.shape[0])
    return _take_rows(bias.float(), order, len(order)).contiguous()


def _take_rows(t: torch.Tensor, order: torch.Tensor | None, rows: int) -> torch.Tensor:
    """t's rows in `order` (-1 = zeros), padded with zero rows to `rows`."""
    if order is not None:
        t = torch.where((order >= 0).view(-1, *[1] * (t.dim() - 1)), t[order.clamp_min(0)], 0)
    if t.shape[0] < rows:
        t = torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])
    return t


def _block_sums(q: torch.Tensor, rows: int = 1024) -> torch.Tensor:
    """int32 sums over q's last dimension, `rows` leading entries at a time: `sum(dtype=int32)`
    widens its whole input first (Gemma 3's 262k-row Q8_0 head: 671 MB for a 21 MB result)."""
    out = torch.empty(q.shape[:-1], dtype=torch.int32)
    for i in range(0, q.shape[0], rows):
        torch.sum(q[i : i + rows], -1, dtype=torch.int32, out=out[i : i + rows])
    return out


def pack(
    w: QTensor | GGMLTensor, gate_up: bool = False, int8: bool = False, rows: bool = False
) -> PackedWeight:
    """Lay a QTensor out in panels. `gate_up`: rows are [gate; up], to be fused with a gated act (silu_mul, gelu_mul).

    A GGMLTensor stays GGUF rows (`pack_rows`), unless it holds only Q4_0/Q4_1/Q8_0 and the
    panels multiply it (float32 activations, or int8 with AVX512-VNNI). int8 activations
    without VNNI take GGUF rows for every quantized format (the AVX2 vpmaddubsw kernel).
    `rows`: a GGMLTensor stays GGUF rows whatever its format (a mixture of experts' experts, which
    `ops.moe_experts` multiplies where they lie in the file).

    `int8` (Q8_0 / Q4_1 only): the layout of the int8-activation kernel (kinds Q8_0X / Q4_1X),
    whose inner step is vpdpbusd over 16 outputs x 4 inputs: per panel and block, groups of 64
    bytes where byte 4 o + j is output o's weight at input 4 g + j (Q8_0X), or, for Q4_1X, input
    8 g + j in the low nibble and 8 g + 4 + j in the high one. Q8_0X's `m` is int32 128 * sum(q)
    per output and block, the correction for activations entering as unsigned x + 128."""
    if isinstance(w, GGMLTensor):
        legacy = w.legacy() if not rows and (not int8 or _vnni()) else None
        return pack(legacy, gate_up, int8) if legacy is not None else pack_rows(w, int8)
    if int8 and w.kind != F32 and not _vnni():
        return pack_rows(w.to_ggml(), int8)
    n, k = w.shape
    if k % QB:
        raise ValueError(f"in_features {k} is not a multiple of {QB}")
    order = _gate_up_order(n) if gate_up else None
    rows = len(order) if order is not None else n
    p = -(-rows // NR)
    q = _take_rows(w.q, order, p * NR)

    def scales(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return _take_rows(t, order, p * NR).view(p, NR, k // QB).transpose(1, 2).contiguous()

    if int8:
        b = k // QB
        if w.kind == Q4_1:
            q6 = q.view(p, NR, b, 4, 2, 4)  # (panel, output, block, group, nibble, j)
            qs = (q6[:, :, :, :, 0] | (q6[:, :, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)
            return PackedWeight(Q4_1X, qs.contiguous(), scales(w.d), scales(w.m), n, k)
        if w.kind == Q8_0:
            qs = q.view(p, NR, b, 8, 4).permute(0, 2, 3, 1, 4).contiguous()
            comp = _block_sums(q.view(p, NR, b, QB)).mul_(128).transpose(1, 2).contiguous()
            return PackedWeight(Q8_0X, qs, scales(w.d), comp, n, k)
        raise ValueError(f"int8 activations need q8_0 or q4_1 weights, not {KIND_NAMES[w.kind]}")
    if w.kind == Q4_1:
        halves = q.view(p, 2, 8, k)
        qs = (halves[:, 0] | (halves[:, 1] << 4)).transpose(1, 2).contiguous()  # (P, K, 8)
    else:
        qs = q.view(p, NR, k).transpose(1, 2).contiguous()  # (P, K, 16)
    return PackedWeight(w.kind, qs, scales(w.d), scales(w.m), n, k)
