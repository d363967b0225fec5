// The 32-value formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, IQ4_XS's sub-blocks) for many
// activation rows on AVX512-VNNI CPUs: prefill and batched decode of a GGUF file's rows.
//
// A thread's outputs go 16 at a time into a panel built from the file's bytes: per block, the 16
// rows' 32 values transposed so that one 64-byte vector holds the same four values of all 16 rows
// (chunk c), then the rows' scales s and offsets o as 16 floats each. A tile of panels (kept in L2)
// is built once and met by every activation row, 8 at a time: a chunk meets an activation row's
// four bytes (broadcast) in vpdpbusd, 16 outputs x 4 values each, so a lane is an output and no
// horizontal sums are needed.
//
// vpdpbusd multiplies unsigned by signed bytes. The unsigned formats' values u are the unsigned
// operand as they are; signed values w (Q8_0, IQ4) are stored as w + 128 (w XOR 0x80), and their
// accumulator starts at -128 sum(x) of the activation block (Acts::i32): sum (w + 128) x - 128 sum(x)
// = sum w x.
// Either way the block's integer I is exact, the same number the AVX2 tiles compute.
//
// The arithmetic is kquant_b32.cpp's (its file-top comment): per block in order,
//   acc = fma(float(I), s * d32, acc); acc = fma(o, s32, acc) (unsigned formats),
// with s and o the same floats (kquant_b32.h's block_scales8 / block_offsets8), one lane per
// output: an activation row's result is the same bits here as on the decode paths.
#include "kquant_b32.h"

namespace cbserve_kquant {
namespace {

constexpr int64_t PANEL = 16;            // outputs a panel (one 512-bit lane each)
constexpr int RA = 8;                    // activation rows a micro-kernel call
constexpr int64_t PB = 8 * 64 + 2 * 64;  // bytes of a panel's block: 8 chunks, then s[16], o[16]
constexpr int64_t TILE_BYTES = 1 << 17;  // a tile's panels: at most this (L2), at most 4 panels

CB_VNNI inline __m512 join(__m256 lo, __m256 hi) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

// Block b's scales and offsets of the 16 rows (s: the two halves' scales) into panel block pb.
template <int T>
CB_VNNI inline void put_scalars(const uint8_t* const* w, int64_t b, __m256 s0, __m256 s1, uint8_t* pb) {
  _mm512_store_ps(pb + 512, join(s0, s1));
  if constexpr (!signed_values(T))
    _mm512_store_ps(pb + 576, join(block_offsets8<T>(w, b, s0), block_offsets8<T>(w + 8, b, s1)));
}

// Blocks b and b + 1 (when `two`; else zeros) of the row at w as one 64-byte vector. The Q5
// formats' fifth bits: the two blocks' 64 bits are one byte mask for a masked add, instead of
// bits32's shuffle, compare and mask per block.
template <int T>
CB_VNNI inline __m512i values64(const uint8_t* w, int64_t b, bool two) {
  if constexpr (T == Q5_0 || T == Q5_1) {
    constexpr int64_t BB = block_bytes(T), QH = T == Q5_0 ? 2 : 4;
    const uint8_t* p0 = w + b * BB;
    const __m256i hi = two ? nibbles32(p0 + BB + QH + 4) : _mm256_setzero_si256();
    const __m512i nib = _mm512_inserti64x4(_mm512_castsi256_si512(nibbles32(p0 + QH + 4)), hi, 1);
    const uint64_t bits = static_cast<uint32_t>(cbserve::load_i32(p0 + QH)) |
                          (two ? static_cast<uint64_t>(static_cast<uint32_t>(cbserve::load_i32(p0 + BB + QH))) << 32 : 0);
    return _mm512_mask_add_epi8(nib, bits, nib, _mm512_set1_epi8(0x10));
  } else {
    const __m256i hi = two ? sub_values<T>(w, b + 1) : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_castsi256_si512(sub_values<T>(w, b)), hi, 1);
  }
}

// The panel of the 16 rows w[] (nb blocks) into `pan`, two blocks at a time (the 64 bytes of two
// blocks of a row are one transpose16 row), asking for the matching shares of the next panel's
// `next_bytes` at `next` on the way.
template <int T>
CB_VNNI void build_panel(const uint8_t* const* w, int64_t nb, uint8_t* pan, const uint8_t* next, int64_t next_bytes) {
  const __m512i flip = _mm512_set1_epi8(signed_values(T) ? static_cast<char>(0x80) : 0);
  __m256 s[2][subs<T>()];  // the current block of T's scales, rows 0..7 and 8..15
  for (int64_t b = 0; b < nb; b += 2) {
    const bool two = b + 1 < nb;
    prefetch_share(next, next_bytes, b, nb);
    if (two) prefetch_share(next, next_bytes, b + 1, nb);
    __m512i v[16];
    for (int i = 0; i < PANEL; ++i) v[i] = values64<T>(w[i], b, two);
    cbserve::transpose16(v);  // v[d]: dword d of the 16 rows (d < 8: block b's, then b + 1's)
    for (int64_t k = 0; k < (two ? 2 : 1); ++k) {
      const int64_t bk = b + k;
      uint8_t* pb = pan + bk * PB;
      for (int c = 0; c < 8; ++c) _mm512_store_si512(pb + 64 * c, _mm512_xor_si512(v[8 * k + c], flip));
      if (bk % subs<T>() == 0) {
        block_scales8<T>(w, bk, s[0]);
        block_scales8<T>(w + 8, bk, s[1]);
      }
      put_scalars<T>(w, bk, s[0][bk % subs<T>()], s[1][bk % subs<T>()], pb);
    }
  }
}

// The panel's `rows` outputs from output n for activation rows m0 .. m0 + R, into y[m * ldy + n].
template <int T, int R>
CB_VNNI void panel_dot(const uint8_t* pan, int64_t nb, const Acts& a, int64_t m0, int64_t n,
                       int64_t rows, float* y, int64_t ldy) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* pb = pan + b * PB;
    const int8_t* x[R];
    __m512i isum[R];
    for (int r = 0; r < R; ++r) {
      x[r] = a.q32 + ((m0 + r) * a.nb32 + b) * 32;
      isum[r] = signed_values(T) ? _mm512_set1_epi32(-128 * a.i32[(m0 + r) * a.nb32 + b]) : _mm512_setzero_si512();
    }
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m512i wv = _mm512_load_si512(pb + 64 * c);
      for (int r = 0; r < R; ++r)
        isum[r] = _mm512_dpbusd_epi32(isum[r], wv, _mm512_set1_epi32(cbserve::load_i32(x[r] + 4 * c)));
    }
    const __m512 ws = _mm512_load_ps(pb + 512);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m0 + r) * a.nb32 + b;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(ws, _mm512_set1_ps(a.d32[i])), acc[r]);
      if constexpr (!signed_values(T))
        acc[r] = _mm512_fmadd_ps(_mm512_load_ps(pb + 576), _mm512_set1_ps(a.s32[i]), acc[r]);
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (m0 + r) * ldy + n, keep, acc[r]);
}

// A tile of panels built whole, then every 8 activation rows over each panel of it.
template <int T>
CB_VNNI void panels_b32(const Part& p, int64_t n0, int64_t n1, const Acts& a, int64_t M, float* y, int64_t ldy) {
  const int64_t nb = row_blocks<T>(p), panel_bytes = nb * PB;
  const int64_t np = std::clamp<int64_t>(TILE_BYTES / panel_bytes, 1, 4);
  uint8_t* buf = scratch(np * panel_bytes);
  for (int64_t t0 = n0; t0 < n1; t0 += np * PANEL) {
    const int64_t t1 = std::min(n1, t0 + np * PANEL);
    for (int64_t n = t0; n < t1; n += PANEL) {
      const uint8_t* w[PANEL];
      panel_rows<PANEL>(p, n, std::min(PANEL, t1 - n), w);
      build_panel<T>(w, nb, buf + (n - t0) / PANEL * panel_bytes, w[0] + PANEL * p.row_bytes, PANEL * p.row_bytes);
    }
    for (int64_t m0 = 0; m0 < M; m0 += RA) {
      const int64_t mr = std::min<int64_t>(RA, M - m0);
      for (int64_t n = t0; n < t1; n += PANEL) {
        const uint8_t* pan = buf + (n - t0) / PANEL * panel_bytes;
        const int64_t rows = std::min(PANEL, t1 - n);
        cbserve::with_count<RA>(mr, [&](auto r) { panel_dot<T, decltype(r)::value>(pan, nb, a, m0, n, rows, y, ldy); });
      }
    }
  }
}

// One activation row (decode): kquant_b32.cpp's tile_row1 (its arithmetic and prefetch, eight
// rows' block integers reduced across by sums8), each row's block integer by one vpdpbusd: the
// unsigned values against the signed activations as they are (no vpmaddubsw / vpmaddwd pair), the
// Q5 formats' fifth bits by one masked add (instead of bits32's shuffle, compare and mask), signed
// values as w + 128 (w XOR 0x80) with 128 sum(x) taken from the eight sums, as the panels do
// (instead of a vpsignb per row, or two for Q8_0). About half tile_row1's instructions a block,
// where one row's decode is bound by them rather than DRAM.
template <int T>
CB_VNNI inline __m256i values32_vnni(const uint8_t* w, int64_t j) {
  if constexpr (T == Q5_0 || T == Q5_1) {
    constexpr int64_t QH = T == Q5_0 ? 2 : 4;
    const uint8_t* blk = w + j * block_bytes(T);
    const __m256i nib = nibbles32(blk + QH + 4);
    const auto bits = static_cast<__mmask32>(static_cast<uint32_t>(cbserve::load_i32(blk + QH)));
    return _mm256_mask_add_epi8(nib, bits, nib, _mm256_set1_epi8(0x10));
  } else if constexpr (T == IQ4_NL || T == IQ4_XS) {  // looked up in the table + 128 (a constant)
    const uint8_t* q = T == IQ4_NL ? w + j * block_bytes(T) + 2 : w + j / 8 * block_bytes(T) + 8 + 16 * (j % 8);
    return _mm256_shuffle_epi8(_mm256_xor_si256(iq4_table(), _mm256_set1_epi8(static_cast<char>(0x80))), nibbles32(q));
  } else if constexpr (signed_values(T)) {
    return _mm256_xor_si256(sub_values<T>(w, j), _mm256_set1_epi8(static_cast<char>(0x80)));
  } else {
    return sub_values<T>(w, j);
  }
}

template <int T>
CB_VNNI void row1_b32(const Part& p, int64_t n0, int64_t n1, const Acts& a, int64_t, float* y, int64_t) {
  constexpr int64_t R8 = 8;
  const int64_t nb = row_blocks<T>(p);
  for (int64_t n = n0; n < n1; n += R8) {
    const int64_t rows = std::min(R8, n1 - n);
    const uint8_t* w[R8];
    panel_rows<R8>(p, n, rows, w);
    __m256 acc = _mm256_setzero_ps();
    const uint8_t* next = w[0] + R8 * p.row_bytes;
    for (int64_t b0 = 0; b0 < nb; b0 += subs<T>()) {
      __m256 scales[subs<T>()];
      block_scales8<T>(w, b0, scales);
#pragma GCC unroll 8
      for (int j = 0; j < subs<T>(); ++j) {
        const int64_t b = b0 + j;
        prefetch_share(next, R8 * p.row_bytes, b, nb);
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q32 + b * 32));
        __m256i s[8];
        for (int i = 0; i < 8; ++i) s[i] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), values32_vnni<T>(w[i], b), xv);
        __m256i isum = sums8(s);
        if constexpr (signed_values(T)) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(128 * a.i32[b]));
        const __m256 ws = scales[j];
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(ws, _mm256_set1_ps(a.d32[b])), acc);
        if constexpr (!signed_values(T))
          acc = _mm256_fmadd_ps(block_offsets8<T>(w, b, ws), _mm256_set1_ps(a.s32[b]), acc);
      }
    }
    alignas(32) float v[8];
    _mm256_store_ps(v, acc);
    std::memcpy(y + n, v, rows * sizeof(float));
  }
}

}  // namespace

TileFn row1_b32_vnni(int64_t type) {
  TileFn f = nullptr;
  cbserve::with_value<Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, IQ4_XS>(type, [&](auto t) { f = row1_b32<decltype(t)::value>; });
  return f;
}

TileFn panels_b32_vnni(int64_t type) {
  TileFn f = nullptr;
  cbserve::with_value<Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, IQ4_XS>(type, [&](auto t) { f = panels_b32<decltype(t)::value>; });
  return f;
}

}  // namespace cbserve_kquant
