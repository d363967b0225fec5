"""Weight-only quantization: GGUF-style blocks, read from a GGUF file or made from float weights,
and packed into the panel layout `models.ops.packed_linear` reads.

Formats (32 inputs per block, one scale per block and output row, as llama.cpp defines them):
- Q8_0: int8 q, fp16 d; w = q * d.
- Q4_1: 4-bit q in 0..15, fp16 d and fp16 m; w = q * d + m. (GGUF's Q4_0, w = (q - 8) * d, is
  the Q4_1 block with m = -8 d, exact in fp16, so it needs no kernel of its own.)
- F32: float weights in the same panel layout (for models kept in float).

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

from dataclasses import dataclass

import numpy as np
import torch

from models.ops import Kind

NR = 16  # outputs per panel
QB = 32  # inputs per block

F32, Q8_0, Q4_1 = Kind.F32, Kind.Q8_0, Kind.Q4_1
# The same blocks laid out for int8 activations (AVX512-VNNI dot products; see `pack`).
Q8_0X, Q4_1X = Kind.Q8_0X, Kind.Q4_1X
KIND_NAMES = {F32: "f32", Q8_0: "q8_0", Q4_1: "q4_1", Q8_0X: "q8_0+a8", Q4_1X: "q4_1+a8"}
SCHEMES = ("auto", "none", "q8_0", "q4_1")  # --quantization choices
ACTIVATIONS = ("auto", "int8", "float32")  # --activation-dtype choices


@dataclass(frozen=True)
class KernelOptions:
    """How a model runs through the kernels: its weights' format (`SCHEMES`, see
    `LlamaForCausalLM.enable_kernels`) and its projections' activations (`ACTIVATIONS`): int8
    (quantized per row and 32 inputs, multiplied with AVX512-VNNI integer dot products, as
    llama.cpp does for its quantized formats) or float32. "auto" is int8 where the weights are
    quantized and the CPU has VNNI, else float32."""

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
    def cat(parts: list[QTensor]) -> QTensor:
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot fuse weights of different formats {sorted(kinds)}")

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


# -- panels -------------------------------------------------------------------------------------


@dataclass
class PackedWeight:
    """Arguments of `models.ops.packed_linear` for one weight matrix."""

    kind: int
    qs: torch.Tensor
    d: torch.Tensor | None
    m: torch.Tensor | None
    out_features: int  # N (before a fused silu_mul halves it)
    in_features: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)


def _gate_up_order(n: int) -> torch.Tensor:
    """Row order putting gate rows 8p..8p+8 then up rows 8p..8p+8 in panel p (-1 = zero row)."""
    f = n // 2
    order = []
    for p in range(-(-f // 8)):
        gate = [i if i < f else -1 for i in range(8 * p, 8 * p + 8)]
        order += gate + [f + i if i >= 0 else -1 for i in gate]
    return torch.tensor(order)


def _take_rows(t: torch.Tensor, order: torch.Tensor | None, rows: int) -> torch.Tensor:
    """t's rows in `order` (-1 = zeros), padded with zero rows to `rows`."""
    if order is not None:
        t = torch.where((order >= 0).view(-1, *[1] * (t.dim() - 1)), t[order.clamp_min(0)], 0)
    if t.shape[0] < rows:
        t = torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])
    return t


def pack(w: QTensor, gate_up: bool = False, int8: bool = False) -> PackedWeight:
    """Lay a QTensor out in panels. `gate_up`: rows are [gate; up], to be fused with silu_mul.

    `int8` (Q8_0 / Q4_1 only): the layout of the int8-activation kernel (kinds Q8_0X / Q4_1X),
    whose inner step is vpdpbusd over 16 outputs x 4 inputs: per panel and block, groups of 64
    bytes where byte 4 o + j is output o's weight at input 4 g + j (Q8_0X), or, for Q4_1X, input
    8 g + j in the low nibble and 8 g + 4 + j in the high one. Q8_0X's `m` is int32 128 * sum(q)
    per output and block, the correction for activations entering as unsigned x + 128."""
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
            comp = q.view(p, NR, b, QB).sum(-1, dtype=torch.int32) * 128  # (P, 16, B)
            comp = comp.transpose(1, 2).contiguous()
            return PackedWeight(Q8_0X, qs, scales(w.d), comp, n, k)
        raise ValueError(f"int8 activations need q8_0 or q4_1 weights, not {KIND_NAMES[w.kind]}")
    if w.kind == Q4_1:
        halves = q.view(p, 2, 8, k)
        qs = (halves[:, 0] | (halves[:, 1] << 4)).transpose(1, 2).contiguous()  # (P, K, 8)
    else:
        qs = q.view(p, NR, k).transpose(1, 2).contiguous()  # (P, K, 16)
    return PackedWeight(w.kind, qs, scales(w.d), scales(w.m), n, k)
