"""Reference GGUF quantizers: float32 tensors -> Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K,
IQ4_NL, IQ4_XS, MXFP4 blocks, byte for byte what llama.cpp's `llama-quantize` writes without an
importance matrix, and which of those formats each tensor of a Q4_K_M / Q5_K_M / IQ4_NL / IQ4_XS /
MXFP4_MOE (or single-format) file gets (without an importance matrix, the IQ4 formats' scale
search weighs each value by x * x).

Owns: `quantize(array, qtype)` (the blocks, as `gguf.quants.quantize` lays them out: the last axis
in bytes) and `mix_types(tensors, ftype)` (llama-quantize's per-tensor choice of format for the
common architectures). The synthetic-model tool (`tools.synth_model`) writes files with them, so
our quantized files are the files users get from llama.cpp, and tests compare the bytes with
`llama-quantize` where llama.cpp is built.

Byte identity needs llama.cpp's float32 arithmetic in its order: every sum here runs element by
element in the C loop's order (numpy's own reductions are pairwise), products and quotients are
float32 with the C expression's association, `nearest_int` is round-half-to-even (the C function
adds 1.5 * 2^23), `roundf` rounds half away from zero, and float-to-int casts truncate. The work
is vectorised over blocks: each loop over a block's 16, 32 or 256 values is one numpy operation
over all blocks at once. llama.cpp's reference code is built without FMA contraction (ggml-base has
no -march), so no fused multiply-adds to mirror.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

Q = GGMLQuantizationType
F32 = np.float32

FORMATS = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS)
FORMATS += (Q.MXFP4,)

# What `llama-quantize IN OUT TYPE` takes -> the file type it writes and its default tensor format.
FTYPES: dict[str, tuple[LlamaFileType, GGMLQuantizationType]] = {
    "F32": (LlamaFileType.ALL_F32, Q.F32),
    "F16": (LlamaFileType.MOSTLY_F16, Q.F16),
    "Q8_0": (LlamaFileType.MOSTLY_Q8_0, Q.Q8_0),
    "Q4_0": (LlamaFileType.MOSTLY_Q4_0, Q.Q4_0),
    "Q4_1": (LlamaFileType.MOSTLY_Q4_1, Q.Q4_1),
    "Q5_0": (LlamaFileType.MOSTLY_Q5_0, Q.Q5_0),
    "Q5_1": (LlamaFileType.MOSTLY_Q5_1, Q.Q5_1),
    "Q4_K_M": (LlamaFileType.MOSTLY_Q4_K_M, Q.Q4_K),
    "Q5_K_M": (LlamaFileType.MOSTLY_Q5_K_M, Q.Q5_K),
    "Q6_K": (LlamaFileType.MOSTLY_Q6_K, Q.Q6_K),
    "IQ4_NL": (LlamaFileType.MOSTLY_IQ4_NL, Q.IQ4_NL),
    "IQ4_XS": (LlamaFileType.MOSTLY_IQ4_XS, Q.IQ4_XS),
    # gpt-oss as published: the experts MXFP4, every other quantizable tensor Q8_0
    "MXFP4_MOE": (LlamaFileType.MOSTLY_MXFP4_MOE, Q.MXFP4),
}

# Values per numpy pass: the temporaries (a few dozen float32 copies of a chunk) stay in cache.
_CHUNK_VALUES = 1 << 16


# -- helpers mirroring C semantics ------------------------------------------------------------------


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """llama.cpp's nearest_int: round half to even (of a float32 value)."""
    return np.rint(v).astype(np.int32)


def _roundf(v: np.ndarray) -> np.ndarray:
    """C's roundf: half away from zero, exactly (x - trunc(x) is exact in float32)."""
    t = np.trunc(v)
    return (t + np.where(np.abs(v - t) >= F32(0.5), np.sign(v), F32(0))).astype(np.int32)


def _seq_sum(terms: np.ndarray) -> np.ndarray:
    """Sum over the last axis in index order from +0, as `for (...) s += t[i];` does."""
    acc = np.zeros(terms.shape[:-1], dtype=F32)
    for i in range(terms.shape[-1]):
        acc = acc + terms[..., i]
    return acc


def _first_absmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(amax, the signed value there) with a strict `>` scan from 0, as the C loops keep it."""
    amax = np.zeros(x.shape[:-1], dtype=F32)
    vmax = np.zeros(x.shape[:-1], dtype=F32)
    for i in range(x.shape[-1]):
        ax = np.abs(x[..., i])
        take = ax > amax
        amax = np.where(take, ax, amax)
        vmax = np.where(take, x[..., i], vmax)
    return amax, vmax


def _f16(v: np.ndarray) -> np.ndarray:
    """GGML_FP32_TO_FP16 (round to nearest even), as little-endian bytes (..., 2)."""
    return np.asarray(v, dtype=F32).astype("<f2").view(np.uint8).reshape(*np.shape(v), 2)


def _f16_back(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, dtype=F32).astype(np.float16).astype(F32)


def _inv(d: np.ndarray) -> np.ndarray:
    """`d ? 1.0f/d : 0.0f`."""
    with np.errstate(divide="ignore"):
        return np.where(d != 0, F32(1) / d, F32(0)).astype(F32)


# -- 32-value block formats ----------------------------------------------------------------------


def _q8_0(x: np.ndarray) -> np.ndarray:
    amax = np.abs(x).max(axis=1)
    d = amax / F32(127)
    q = _roundf(x * _inv(d)[:, None]).astype(np.int8).view(np.uint8)
    return np.concatenate([_f16(d), q], axis=1)


def _pack_nibbles(lo_hi: np.ndarray) -> np.ndarray:
    """32 values 0..15 -> 16 bytes: value j in the low nibble of byte j, value j+16 in the high."""
    v = lo_hi.astype(np.uint8)
    return (v[:, :16] & 0xF) | ((v[:, 16:] & 0xF) << 4)


def _qh_bits(v: np.ndarray) -> np.ndarray:
    """Bit 4 of each of 32 values, value j at bit j of a little-endian uint32."""
    bits = (v.astype(np.uint32) >> 4) & 1
    qh = (bits << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    return qh.astype("<u4").view(np.uint8).reshape(-1, 4)


def _symmetric(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0 / Q5_0: d = max / -levels, q = min(2*levels-1, (int8)(x/d + levels + 0.5))."""
    _, vmax = _first_absmax(x)
    d = vmax / F32(-levels)
    q = np.trunc(x * _inv(d)[:, None] + F32(levels + 0.5)).astype(np.int32)
    return d, np.minimum(2 * levels - 1, q)


def _affine(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 / Q5_1: d = (max - min) / (levels - 1), q = (int)((x - min)/d + 0.5)."""
    lo = x.min(axis=1)
    hi = x.max(axis=1)
    d = (hi - lo) / F32(levels - 1)
    q = np.trunc((x - lo[:, None]) * _inv(d)[:, None] + F32(0.5)).astype(np.int32)
    return d, lo, q


def _q4_0(x: np.ndarray) -> np.ndarray:
    d, q = _symmetric(x, 8)
    return np.concatenate([_f16(d), _pack_nibbles(q)], axis=1)


def _q5_0(x: np.ndarray) -> np.ndarray:
    d, q = _symmetric(x, 16)
    return np.concatenate([_f16(d), _qh_bits(q), _pack_nibbles(q)], axis=1)


def _q4_1(x: np.ndarray) -> np.ndarray:
    d, lo, q = _affine(x, 16)
    q = np.minimum(15, q)
    return np.concatenate([_f16(d), _f16(lo), _pack_nibbles(q)], axis=1)


def _q5_1(x: np.ndarray) -> np.ndarray:
    d, lo, q = _affine(x, 32)
    q = q & 0xFF  # (uint8_t) cast; the values are 0..31
    return np.concatenate([_f16(d), _f16(lo), _qh_bits(q), _pack_nibbles(q)], axis=1)


# -- k-quants (256-value super-blocks) ------------------------------------------------------------


def _make_qkx2(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """make_qkx2_quants (squared error) over rows of 32: (scale, the_min, L).

    Works on the transpose (value index, row) so that each step of the C loops over a row's
    values is one contiguous vector over all rows; levels stay float32 (exact small integers)."""
    xt = np.ascontiguousarray(x.T)
    wt = np.ascontiguousarray(w.T)
    lo = xt[0].copy()
    hi = xt[0].copy()
    sum_w = wt[0].copy()
    sum_x = sum_w * xt[0]
    for i in range(1, xt.shape[0]):
        lo = np.where(xt[i] < lo, xt[i], lo)
        hi = np.where(xt[i] > hi, xt[i], hi)
        sum_w = sum_w + wt[i]
        sum_x = sum_x + wt[i] * xt[i]
    lo = np.where(lo > 0, F32(0), lo).astype(F32)
    flat = hi == lo
    top = F32(nmax)
    span = np.where(flat, F32(1), hi - lo).astype(F32)
    iscale = top / span
    scale = F32(1) / iscale
    L = np.clip(np.rint(iscale * (xt - lo)), F32(0), top)
    diff = scale * L + lo - xt
    best = _seq_sum0(wt * (diff * diff))
    mins = lo
    for step in range(nstep + 1):
        # The C loop overwrites `min` with a better fit's, and later steps measure from it.
        span = np.where(flat, F32(1), hi - mins).astype(F32)
        iscale = ((F32(rmin) + F32(rdelta) * F32(step)) + top) / span
        laux = np.clip(np.rint(iscale * (xt - mins)), F32(0), top)
        wl = wt * laux
        sum_l = _seq_sum0(wl)
        sum_l2 = _seq_sum0(wl * laux)
        sum_xl = _seq_sum0(wl * xt)
        big_d = sum_w * sum_l2 - sum_l * sum_l
        ok = big_d > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            safe_d = np.where(ok, big_d, F32(1)).astype(F32)
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe_d
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe_d
            pos = this_min > 0
            this_min = np.where(pos, F32(0), this_min).astype(F32)
            this_scale = np.where(pos, sum_xl / np.where(pos, sum_l2, F32(1)), this_scale)
        diff = this_scale * laux + this_min - xt
        cur = _seq_sum0(wt * (diff * diff))
        better = ok & (cur < best) & ~flat
        L = np.where(better, laux, L)
        best = np.where(better, cur, best)
        scale = np.where(better, this_scale, scale).astype(F32)
        mins = np.where(better, this_min, mins).astype(F32)
    L = np.where(flat, F32(0), L)
    scale = np.where(flat, F32(0), scale).astype(F32)
    return scale, -mins, np.ascontiguousarray(L.T).astype(np.int32)


def _seq_sum0(terms: np.ndarray) -> np.ndarray:
    """`_seq_sum` over the first axis."""
    acc = np.zeros(terms.shape[1:], dtype=F32)
    for i in range(terms.shape[0]):
        acc = acc + terms[i]
    return acc


def _kx_block(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """What Q4_K and Q5_K share: per 32 a scale and a min (make_qkx2_quants), both stored as
    6 bits of a super-block scale; returns (d, dmin, ls, lm, L)."""
    nb = x.shape[0]
    sub = x.reshape(nb * 8, 32)
    av_x = np.sqrt(_seq_sum(sub * sub) / F32(32))
    w = av_x[:, None] + np.abs(sub)
    scales, mins, L = _make_qkx2(sub, w, nmax, rmin, rdelta, nstep)
    scales = scales.reshape(nb, 8)
    mins = mins.reshape(nb, 8)
    max_scale = np.zeros(nb, dtype=F32)
    max_min = np.zeros(nb, dtype=F32)
    for j in range(8):
        max_scale = np.where(scales[:, j] > max_scale, scales[:, j], max_scale)
        max_min = np.where(mins[:, j] > max_min, mins[:, j], max_min)
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0)).astype(F32)
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0)).astype(F32)
    ls = np.minimum(63, _nearest_int(inv_scale[:, None] * scales) & 0xFF)
    lm = np.minimum(63, _nearest_int(inv_min[:, None] * mins) & 0xFF)
    d = max_scale / F32(63)
    dmin = max_min / F32(63)
    dd = _f16_back(d)[:, None] * ls.astype(F32)
    dm = _f16_back(dmin)[:, None] * lm.astype(F32)
    xs = sub.reshape(nb, 8, 32)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(_nearest_int((xs + dm[..., None]) / dd[..., None]), 0, nmax)
    L = np.where((dd != 0)[..., None], requant, L.reshape(nb, 8, 32))
    return d, dmin, ls, lm, L.reshape(nb, 256)


def _k_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins into 12 bytes (the get_scale_min_k4 layout)."""
    s = np.zeros((ls.shape[0], 12), dtype=np.uint8)
    s[:, 0:4] = ls[:, 0:4]
    s[:, 4:8] = lm[:, 0:4]
    s[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    s[:, 0:4] |= ((ls[:, 4:8] >> 4) << 6).astype(np.uint8)
    s[:, 4:8] |= ((lm[:, 4:8] >> 4) << 6).astype(np.uint8)
    return s


def _q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, ls, lm, L = _kx_block(x, 15, -1.0, 0.1, 20)
    L = L.astype(np.uint8).reshape(-1, 4, 2, 32)
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_f16(d), _f16(dmin), _k_scales(ls, lm), qs], axis=1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, ls, lm, L = _kx_block(x, 31, -0.5, 0.1, 15)
    L = L.astype(np.uint8).reshape(-1, 4, 2, 32)
    qs = ((L[:, :, 0] & 0xF) | ((L[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    high = (L >> 4) & 1  # (nb, 4 chunks, 2 halves, 32)
    shifts = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8)
    qh = (high << shifts[None, :, :, None]).sum(axis=(1, 2)).astype(np.uint8)
    return np.concatenate([_f16(d), _f16(dmin), _k_scales(ls, lm), qh, qs], axis=1)


def _make_qx_rmse1(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """make_qx_quants(n, nmax, x, L, rmse_type=1, no weights) over rows: (scale, L in 0..2nmax-1).
    On the transpose, as `_make_qkx2`."""
    xt = np.ascontiguousarray(x.T)
    amax, vmax = _first_absmax(x)
    zero = amax < F32(1e-15)
    vmax = np.where(zero, F32(1), vmax).astype(F32)
    wx = (xt * xt) * xt  # w * x with w = x * x
    ww = xt * xt

    def trial(iscale):
        lf = np.clip(np.rint(iscale * xt), F32(-nmax), F32(nmax - 1))
        return lf, _seq_sum0(wx * lf), _seq_sum0((ww * lf) * lf)

    lf, sumlx, suml2 = trial(F32(-nmax) / vmax)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, F32(1)), F32(0))
    scale = scale.astype(F32)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(F32(nmax) + F32(0.1) * F32(step)) / vmax
        lj, sumlx, suml2 = trial(iscale)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        lf = np.where(better, lj, lf)
        with np.errstate(divide="ignore", invalid="ignore"):
            new_scale = (sumlx / np.where(better, suml2, F32(1))).astype(F32)
        scale = np.where(better, new_scale, scale).astype(F32)
        best = np.where(better, scale * sumlx, best).astype(F32)
    scale = np.where(zero, F32(0), scale).astype(F32)
    L = np.where(zero, F32(0), lf + F32(nmax))
    return scale, np.ascontiguousarray(L.T).astype(np.int32)


def _q6_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    sub = x.reshape(nb * 16, 16)
    scales, L = _make_qx_rmse1(sub, 32)
    scales = scales.reshape(nb, 16)
    max_abs = np.zeros(nb, dtype=F32)
    max_scale = np.zeros(nb, dtype=F32)
    for j in range(16):
        a = np.abs(scales[:, j])
        take = a > max_abs
        max_abs = np.where(take, a, max_abs)
        max_scale = np.where(take, scales[:, j], max_scale)
    zero = max_abs < F32(1e-15)
    safe = np.where(zero, F32(1), max_scale).astype(F32)
    iscale = F32(-128) / safe
    d = F32(1) / iscale
    sc = np.minimum(127, _nearest_int(iscale[:, None] * scales))
    dd = _f16_back(d)[:, None] * sc.astype(F32)
    xs = sub.reshape(nb, 16, 16)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(_nearest_int(xs / dd[..., None]), -32, 31) + 32
    L = np.where((dd != 0)[..., None], requant, L.reshape(nb, 16, 16)).reshape(nb, 2, 4, 32)
    L = L.astype(np.uint8)  # (nb, half of 128, quarter of 32, 32)
    ql = np.concatenate(
        [
            (L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4),
            (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4),
        ],
        axis=2,
    ).reshape(nb, 128)
    qh = (
        (L[:, :, 0] >> 4)
        | ((L[:, :, 1] >> 4) << 2)
        | ((L[:, :, 2] >> 4) << 4)
        | ((L[:, :, 3] >> 4) << 6)
    ).reshape(nb, 64)
    out = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16(d)], axis=1)
    out[zero] = 0
    return out


# -- non-linear 4-bit (IQ4_NL: 32-value blocks; IQ4_XS: 256-value super-blocks of eight) ---------

# kvalues_iq4nl: the 16 levels a nibble indexes, as float32 (the C compares and subtracts them so).
_IQ4_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=F32
)
_GROUP_MAX_EPS = F32(1e-15)
# best_index_int8 by table: the levels are integers, so every v in [k, k + 1) lies between the
# same two; for k = -127 .. 113 (at k + 127) the index of the upper one and both levels.
_IQ4_UPPER = np.clip(np.searchsorted(_IQ4_VALUES, np.arange(-127, 114), side="right"), 1, 15)
_IQ4_BELOW = _IQ4_VALUES[_IQ4_UPPER - 1]
_IQ4_ABOVE = _IQ4_VALUES[_IQ4_UPPER]
_IQ4_UPPER = _IQ4_UPPER.astype(np.int8)


def _iq4_index(v: np.ndarray) -> np.ndarray:
    """best_index_int8 over the IQ4 levels (int8): the nearer of the two levels around v, the
    upper one unless the lower is strictly nearer (float32 differences); v beyond the first or
    last level takes it (clamping v first gives that index through the same comparison)."""
    vc = np.clip(v, _IQ4_VALUES[0], _IQ4_VALUES[15])
    k = np.floor(vc).astype(np.intp) + 127
    below = np.take(_IQ4_BELOW, k, mode="clip")
    above = np.take(_IQ4_ABOVE, k, mode="clip")
    return np.take(_IQ4_UPPER, k, mode="clip") - ((vc - below) < (above - vc))


def _iq4_scales(sub: np.ndarray) -> np.ndarray:
    """quantize_row_iq4_nl_impl's scale search over rows of 32 without an importance matrix
    (weights x * x, ntry 7): each row's scale, 0 where its |max| is below GROUP_MAX_EPS. On the
    transpose, as `_make_qkx2`."""
    xt = np.ascontiguousarray(sub.T)
    w = xt * xt
    amax, vmax = _first_absmax(sub)
    zero = amax < _GROUP_MAX_EPS
    vmax = np.where(zero, F32(1), vmax).astype(F32)

    def trial(iscale):
        q = np.take(_IQ4_VALUES, _iq4_index(iscale * xt))
        wq = w * q
        return _seq_sum0(wq * xt), _seq_sum0(wq * q)

    # Both signs are tried: the first fit puts the max at the top level, the 15 tries near the
    # bottom one (-127 +- 7).
    first = -vmax / F32(_IQ4_VALUES[0])
    sumqx, sumq2 = trial(F32(1) / first)
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.where(sumq2 > 0, sumqx / np.where(sumq2 > 0, sumq2, F32(1)), F32(0)).astype(F32)
    best = d * sumqx
    for itry in range(-7, 8):
        # (itry + values[0]) is an int, converted to float for the division by the signed max.
        sumqx, sumq2 = trial(F32(itry + int(_IQ4_VALUES[0])) / vmax)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        with np.errstate(divide="ignore", invalid="ignore"):
            new_d = (sumqx / np.where(better, sumq2, F32(1))).astype(F32)
        d = np.where(better, new_d, d).astype(F32)
        best = np.where(better, d * sumqx, best).astype(F32)
    return np.where(zero, F32(0), d).astype(F32)


def _iq4_nl(x: np.ndarray) -> np.ndarray:
    scale = _iq4_scales(x)
    # The levels come from the float32 scale, not from the fp16 one stored.
    L = _iq4_index(_inv(scale)[:, None] * x)
    return np.concatenate([_f16(scale), _pack_nibbles(L)], axis=1)


def _iq4_xs(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    sub = x.reshape(nb * 8, 32)
    scales = _iq4_scales(sub).reshape(nb, 8)
    _, max_scale = _first_absmax(scales)
    d = -max_scale / F32(32)  # -0.0 for an all-zero super-block, as in C
    ls = np.clip(_nearest_int(_inv(d)[:, None] * scales), -32, 31)
    dl = d[:, None] * ls.astype(F32)
    L = _iq4_index(_inv(dl)[..., None] * sub.reshape(nb, 8, 32))
    u = (ls + 32).astype(np.uint16)
    lo = (u & 0xF).astype(np.uint8)
    scales_l = lo[:, 0::2] | (lo[:, 1::2] << 4)
    scales_h = ((u >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1, dtype=np.uint16)
    scales_h = scales_h.astype("<u2").view(np.uint8).reshape(nb, 2)
    qs = _pack_nibbles(L.reshape(nb * 8, 32)).reshape(nb, 128)
    return np.concatenate([_f16(d), scales_h, scales_l, qs], axis=1)


# MXFP4 (OCP microscaling FP4, gpt-oss's experts): ggml's kvalues_mxfp4, the E2M1 values doubled.
_MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=F32)


def _e8m0_half(e: np.ndarray) -> np.ndarray:
    """ggml_e8m0_to_fp32_half: 2^(e - 128) as float32 (e 0 and 1 the denormals)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(F32)


def _mxfp4(x: np.ndarray) -> np.ndarray:
    """quantize_row_mxfp4_ref: e = floor(log2 max|x|) - 2 + 127 (0 for an all-zero block), then
    each value's nearest level of kvalues * 2^(e - 128), the first of equally near ones."""
    amax = np.abs(x).max(axis=1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) - F32(2) + F32(127), F32(0))
    e = np.clip(e, 0, 255).astype(np.uint8)
    levels = _e8m0_half(e)[:, None, None] * _MXFP4_VALUES  # (blocks, 1, 16)
    best = np.argmin(np.abs(levels - x[:, :, None]), axis=-1)  # (the first minimum, as C's `<`)
    return np.concatenate([e[:, None], _pack_nibbles(best)], axis=1)


_QUANTIZERS = {
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
    Q.IQ4_NL: _iq4_nl,
    Q.IQ4_XS: _iq4_xs,
    Q.MXFP4: _mxfp4,
}


def quantize(array: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """`array` (..., n) -> uint8 (..., n / block * block_bytes) in `qtype`'s GGUF block layout.
    F32 and F16 are plain casts; the last axis must be a multiple of the block size."""
    qtype = Q(qtype)
    data = np.ascontiguousarray(array, dtype=F32)
    if qtype == Q.F32:
        return data.view(np.uint8)
    if qtype == Q.F16:
        return data.astype("<f2").view(np.uint8)
    if qtype not in _QUANTIZERS:
        raise ValueError(
            f"no reference quantizer for {qtype.name}; have {[t.name for t in FORMATS]}"
        )
    block, nbytes = GGML_QUANT_SIZES[qtype]
    if data.ndim == 0 or data.shape[-1] % block:
        raise ValueError(
            f"{qtype.name} needs rows of a multiple of {block} values, got {data.shape}"
        )
    blocks = data.reshape(-1, block)
    out = np.empty((blocks.shape[0], nbytes), dtype=np.uint8)
    step = max(1, _CHUNK_VALUES // block)
    for start in range(0, blocks.shape[0], step):
        out[start : start + step] = _QUANTIZERS[qtype](blocks[start : start + step])
    return out.reshape(*data.shape[:-1], data.shape[-1] // block * nbytes)


# -- which tensor gets which format (llama-quantize's mixes) ---------------------------------------


def _layer(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for key in ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight", "attn_k.weight"):
        if key in name:
            return key.split(".")[0]
    for key in ("attn_q.weight", "attn_output.weight", "ffn_up", "ffn_gate", "ffn_down"):
        if key in name:
            return key.split(".")[0]
    return "other"


def _quantizable(name: str, shape: Sequence[int]) -> bool:
    """llama-quantize's tensor_allows_quantization, for the architectures we write: 2-D and up,
    a name ending in "weight", no norm, no MoE router, no per-layer input projection, no recurrent
    layer's small conv weight."""
    return (
        _n_dims(shape) >= 2
        and name.endswith("weight")
        and "_norm.weight" not in name
        and "ffn_gate_inp.weight" not in name
        and "per_layer_model_proj" not in name  # (Gemma 4's: "not too big", kept as it is)
        and "ssm_conv1d" not in name
        and "shortconv.conv.weight" not in name
    )


def _n_dims(shape: Sequence[int]) -> int:
    """ggml_n_dims: trailing dimensions of 1 do not count (shape in numpy order, rows first)."""
    dims = list(reversed(shape))  # ggml order: ne[0] is the row length
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return len(dims)


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _fallback(qtype: GGMLQuantizationType, ncols: int) -> GGMLQuantizationType:
    """tensor_type_fallback: a row length the block does not divide takes a 32-block format."""
    block = GGML_QUANT_SIZES[qtype][0]
    if ncols % block == 0:
        return qtype
    smaller = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0, Q.IQ4_XS: Q.IQ4_NL}.get(qtype, qtype)
    return smaller if ncols % GGML_QUANT_SIZES[smaller][0] == 0 else Q.F16


def _n_gqa(tensors: Mapping[str, tuple[Sequence[int], GGMLQuantizationType]]) -> int:
    """Query heads per KV head from layer 0's attn_q / attn_k rows (equal head sizes); 1 when the
    file has no separate attn_q and attn_k (a fused qkv: the caller knows the heads)."""
    q = tensors.get("blk.0.attn_q.weight")
    k = tensors.get("blk.0.attn_k.weight")
    if q is None or k is None or int(k[0][0]) == 0:
        return 1
    return int(q[0][0]) // int(k[0][0])


def _n_expert(tensors: Mapping[str, tuple[Sequence[int], GGMLQuantizationType]]) -> int:
    """A mixture of experts' expert count from layer 0's stacked experts (1 for a dense model)."""
    stacked = tensors.get("blk.0.ffn_gate_exps.weight") or tensors.get("blk.0.ffn_down_exps.weight")
    return int(stacked[0][0]) if stacked is not None and len(stacked[0]) == 3 else 1


def mix_types(
    tensors: Mapping[str, tuple[Sequence[int], GGMLQuantizationType]],
    ftype: str,
    n_layer: int | None = None,
    n_gqa: int | None = None,
    n_expert: int | None = None,
) -> dict[str, GGMLQuantizationType]:
    """The format llama-quantize gives each tensor for `ftype` (a key of `FTYPES`).

    `tensors`: GGUF tensor name -> (numpy shape, rows last, i.e. (rows, row length); its type in
    the input file). Tensors it does not quantize (1-D, norms) keep their type. `n_layer`: the
    block count (default: from the names); `n_gqa`: query heads per KV head (default: from layer
    0's attn_q and attn_k shapes). Mirrors llama_tensor_get_type for dense models without an
    importance matrix: the output head (and a tied token embedding) in Q6_K (Q8_0 when its rows
    do not split into the blocks); in the K_M mixes attn_v / attn_qkv and ffn_down of some layers
    in Q6_K; in the IQ4 mixes attn_v / attn_qkv in Q5_K when four or more query heads share a KV
    head and ffn_down of the first eighth of the layers in Q5_K; and a 32-value format where a
    row length does not split into 256. `n_expert` (default: from layer 0's stacked experts):
    with exactly eight experts (Mixtral's count) attn_k and attn_v go to Q8_0 and, in the Q4_K
    and IQ4 mixes, attn_output to Q5_K, as llama-quantize special-cases. MXFP4_MOE (gpt-oss's
    published form): stacked experts MXFP4, every other quantizable tensor (the head too) Q8_0.
    """
    if ftype not in FTYPES:
        raise ValueError(f"unknown file type {ftype!r}; choose one of {list(FTYPES)}")
    _, default = FTYPES[ftype]
    # llama-quantize visits tensors by layer, then by name; its per-layer counters follow that order.
    order = sorted(tensors, key=lambda n: (_layer(n), n))
    cats = {n: _category(n) for n in order}
    n_attn_v = sum(1 for c in cats.values() if c in ("attn_v", "attn_qkv", "attn_kv_b"))
    tied = "output.weight" not in tensors
    if n_layer is None:
        n_layer = max((_layer(n) for n in order), default=-1) + 1
    if n_gqa is None:
        n_gqa = _n_gqa(tensors)
    if n_expert is None:
        n_expert = _n_expert(tensors)
    iq4 = ftype in ("IQ4_NL", "IQ4_XS")
    i_attn_v = 0
    i_ffn_down = 0
    out: dict[str, GGMLQuantizationType] = {}
    for name in order:
        shape, current = tensors[name]
        quantizable = _quantizable(name, shape)
        if not quantizable or default in (Q.F32, Q.F16):
            out[name] = default if quantizable else Q(current)
            continue
        ncols = int(shape[-1])
        cat = cats[name]
        new = default
        if ftype == "MXFP4_MOE":
            # stacked experts (3-D, more than one) MXFP4; the head and everything else Q8_0
            experts = len(shape) == 3 and int(shape[0]) > 1 and cat != "output"
            out[name] = _fallback(Q.MXFP4 if experts else Q.Q8_0, ncols)
            continue
        if cat == "output" or (tied and cat == "token_embd"):
            if ncols % GGML_QUANT_SIZES[new][0] != 0:
                new = Q.Q8_0
            elif new != Q.Q8_0:
                new = Q.Q6_K
        elif cat == "token_embd":
            pass
        elif cat in ("attn_v", "attn_qkv", "attn_kv_b"):
            if iq4 and n_gqa >= 4:
                new = Q.Q5_K
            elif ftype in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i_attn_v, n_attn_v):
                new = Q.Q6_K
            if n_expert == 8:
                new = Q.Q8_0
            i_attn_v += 1
        elif cat == "attn_k" and n_expert == 8:
            new = Q.Q8_0
        elif cat == "attn_output" and n_expert == 8 and ftype in ("Q4_K_M", "IQ4_NL", "IQ4_XS"):
            new = Q.Q5_K
        elif cat == "ffn_down":
            if ftype in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i_ffn_down, n_layer):
                new = Q.Q6_K
            elif iq4 and i_ffn_down < n_layer // 8:
                new = Q.Q5_K
            i_ffn_down += 1
        out[name] = _fallback(new, ncols)
    return out
