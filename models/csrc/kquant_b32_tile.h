// The 32-value formats' (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, IQ4_XS's sub-blocks) int8 tiles,
// written once over a vector width V (simd.h): kquant_b32.cpp instantiates them with Vec256
// (AVX2), kquant_b32_vnni.cpp with Vec512 and the 256-bit VNNI dot (defining CB_TILE as CB_VNNI
// before including this file, so every function here carries its target). Below, "block" means a
// 32-value block or sub-block.
//
// A panel is V::LANES weight rows: per block, the rows' 32 value bytes transposed so that one vector
// holds four consecutive bytes of every row (chunk c of the block), then the rows' scales s and
// offsets o as LANES floats each (w = u s + o; Q8_0, IQ4: signed bytes, no o). A chunk meets one
// activation row's four bytes broadcast to all lanes, so the lanes of a result are already the
// rows' partial dots: no horizontal adds. A tile of panels (kept in L2) is built once a call and
// met by every activation row, RA at a time, NP panels sharing each broadcast (the micro-kernel:
// NP x LANES outputs x RA rows).
//
// The arithmetic of one (weight row, activation row) pair, the same on every path and width: per
// block b in order, I = the block's exact integer dot (u x, or w x for signed values), then
//   acc = fma(float(I), s * d32, acc); acc = fma(o, s32, acc) (not for signed values),
// acc starting at 0 and being the result. A row is one float lane, so its result does not depend
// on which lane, panel, tile, width or batch size it meets. Only how I is summed differs: Vec256
// sums vpmaddubsw's int16 pairs over as many chunks as cannot overflow, then vpmaddwd with ones
// (signed values: |w| times x with w's sign, a chunk at a time); Vec512 sums vpdpbusd in int32
// (signed values stored as w + 128, the sum starting at -128 sum(x), Acts::i32).
#pragma once

#include "kquant_b32.h"
#include "simd.h"

namespace cbserve_kquant {
namespace {

// Per width: the micro-kernel's NP panels x RA rows, a tile's size, and a block's values as the
// panel holds them (`values`: the blocks b .. b + BYTES / 32 of one row as one vector) and as its
// integer dot meets them (`signed_dot`, `init`).
template <class V>
struct B32;

template <>
struct B32<Vec256> {
  using I = __m256i;
  static constexpr int NP = 2, RA = 4;
  static constexpr int64_t TILE_BYTES = 1 << 16;  // a tile's panels: at most this (L2), at most 4
  template <int T>
  static I values(const uint8_t* w, int64_t b, bool) { return sub_values<T>(w, b); }
  template <int T>
  static I stored(I v) { return v; }
  // The sum's start for a row's block (i32: sum(x) of it).
  template <int T>
  static I init(int32_t) { return _mm256_setzero_si256(); }
  // |w| x (x with w's sign) = w x keeps vpmaddubsw's operands unsigned x signed; each result is up
  // to 2 x 128 x 127, so every chunk goes to int32 at once.
  static I signed_dot(I acc, I w, I x) {
    const I p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
  }
  // Unsigned values: chunks summed in int16 before widening (u <= 15: a whole block, 8 x 2 x 15 x
  // 127 < 2^15; u <= 31: four).
  template <int T>
  static constexpr int chunks() { return T == Q5_0 || T == Q5_1 ? 4 : 8; }
  static I widen(I acc, I n) { return _mm256_add_epi32(acc, _mm256_madd_epi16(n, _mm256_set1_epi16(1))); }
};

template <>
struct B32<Vec512> {
  using I = __m512i;
  static constexpr int NP = 1, RA = 8;
  static constexpr int64_t TILE_BYTES = 1 << 17;
  // Blocks b and b + 1 (when `two`; else zeros) of the row at w as one 64-byte vector. The Q5
  // formats' fifth bits: the two blocks' 64 bits are one byte mask for a masked add, instead of
  // bits32's shuffle, compare and mask per block.
  template <int T>
  CB_VNNI static I values(const uint8_t* w, int64_t b, bool two) {
    if constexpr (T == Q5_0 || T == Q5_1) {
      constexpr int64_t BB = block_bytes(T), QH = T == Q5_0 ? 2 : 4;
      const uint8_t* p0 = w + b * BB;
      const __m256i hi = two ? nibbles32(p0 + BB + QH + 4) : _mm256_setzero_si256();
      const I nib = _mm512_inserti64x4(_mm512_castsi256_si512(nibbles32(p0 + QH + 4)), hi, 1);
      const uint64_t bits = static_cast<uint32_t>(cbserve::load_i32(p0 + QH)) |
                            (two ? static_cast<uint64_t>(static_cast<uint32_t>(cbserve::load_i32(p0 + BB + QH))) << 32
                                 : 0);
      return _mm512_mask_add_epi8(nib, bits, nib, _mm512_set1_epi8(0x10));
    } else {
      const __m256i hi = two ? sub_values<T>(w, b + 1) : _mm256_setzero_si256();
      return _mm512_inserti64x4(_mm512_castsi256_si512(sub_values<T>(w, b)), hi, 1);
    }
  }
  // vpdpbusd multiplies unsigned by signed bytes: signed values are stored as w + 128 (w XOR 0x80)
  // and their sum starts at -128 sum(x): sum (w + 128) x - 128 sum(x) = sum w x.
  template <int T>
  CB_VNNI static I stored(I v) {
    return signed_values(T) ? _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80))) : v;
  }
  template <int T>
  CB_VNNI static I init(int32_t i32) {
    return signed_values(T) ? _mm512_set1_epi32(-128 * i32) : _mm512_setzero_si512();
  }
  CB_VNNI static I signed_dot(I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, w, x); }
  template <int T>
  static constexpr int chunks() { return 8; }
  CB_VNNI static I widen(I acc, I n) { return _mm512_add_epi32(acc, n); }
};

template <class V>
constexpr int64_t b32_block() {
  return 10 * V::BYTES;  // 8 chunks, then s, then o
}

// Blocks [b0, b1) of the V::LANES rows w[] (nb blocks a row; b0 a multiple of subs<T>()) into
// consecutive panel blocks at `pan`, V::BYTES / 32 blocks a step (one row's bytes of them are one
// transpose row), asking for the matching shares of the next panel's `next_bytes` at `next` on the
// way.
template <class V, int T>
CB_TILE void build_panel(const uint8_t* const* w, int64_t b0, int64_t b1, int64_t nb, uint8_t* pan,
                         const uint8_t* next, int64_t next_bytes) {
  using I = typename V::I;
  constexpr int64_t PB = b32_block<V>(), STEP = V::BYTES / 32;
  __m256 s[V::LANES / 8][subs<T>()];  // the current block of T's scales, rows 8g .. 8g + 7
  for (int64_t b = b0; b < b1; b += STEP) {
    const bool two = b + 1 < b1;
    for (int64_t k = 0; k < STEP && b + k < b1; ++k) prefetch_share(next, next_bytes, b + k, nb);
    I v[V::LANES];
    for (int i = 0; i < V::LANES; ++i) v[i] = B32<V>::template values<T>(w[i], b, two);
    V::transpose(v);  // v[d]: dword d of every row (d < 8: block b's, then b + 1's)
    for (int64_t k = 0; k < STEP && b + k < b1; ++k) {
      const int64_t bk = b + k;
      uint8_t* pb = pan + (bk - b0) * PB;
      for (int c = 0; c < 8; ++c) V::store(pb + V::BYTES * c, B32<V>::template stored<T>(v[8 * k + c]));
      for (int g = 0; g < V::LANES / 8; ++g) {
        if (bk % subs<T>() == 0) block_scales8<T>(w + 8 * g, bk, s[g]);
        const __m256 sg = s[g][bk % subs<T>()];
        _mm256_store_ps(reinterpret_cast<float*>(pb + 8 * V::BYTES + 32 * g), sg);
        if constexpr (!signed_values(T))
          _mm256_store_ps(reinterpret_cast<float*>(pb + 9 * V::BYTES + 32 * g), block_offsets8<T>(w + 8 * g, bk, sg));
      }
    }
  }
}

// NP panels (`pans`, `panel_bytes` apart) through `nblk` panel blocks against activation blocks
// b0 .. of rows r0 + r, r < R: acc[q * R + r] (LANES outputs in lanes), the arithmetic the file-top
// comment gives.
template <class V, int T, int NP, int R>
CB_TILE inline void panel_dot(const uint8_t* pans, int64_t panel_bytes, int64_t nblk, const Acts& a, int64_t r0,
                              int64_t b0, typename V::F* acc) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr int64_t PB = b32_block<V>(), B = V::BYTES;
  constexpr int CH = B32<V>::template chunks<T>();
  const int8_t* xr[R];
  const float* d32[R];
  const float* s32[R];
  const int32_t* i32[R];
  for (int r = 0; r < R; ++r) {
    const int64_t i = (r0 + r) * a.nb32 + b0;
    xr[r] = a.q32 + i * 32;
    d32[r] = a.d32 + i;
    s32[r] = a.s32 + i;
    i32[r] = a.i32 + i;
  }
  for (int64_t b = 0; b < nblk; ++b) {
    const uint8_t* pb[NP];
    for (int q = 0; q < NP; ++q) pb[q] = pans + q * panel_bytes + b * PB;
    I isum[NP][R];
    for (int q = 0; q < NP; ++q)
      for (int r = 0; r < R; ++r) isum[q][r] = B32<V>::template init<T>(i32[r][b]);
    if constexpr (signed_values(T) && V::NARROW16) {
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        I w[NP];
        for (int q = 0; q < NP; ++q) w[q] = V::load(pb[q] + B * c);
        for (int r = 0; r < R; ++r) {
          const I xv = V::bcast4(xr[r] + 32 * b + 4 * c);
          for (int q = 0; q < NP; ++q) {
            isum[q][r] = B32<V>::signed_dot(isum[q][r], w[q], xv);
            V::keep(isum[q][r]);
          }
        }
      }
    } else {
#pragma GCC unroll 2
      for (int h = 0; h < 8 / CH; ++h) {
        I n[NP][R];
        for (int q = 0; q < NP; ++q)
          for (int r = 0; r < R; ++r) n[q][r] = V::zero();
#pragma GCC unroll 8
        for (int c = h * CH; c < h * CH + CH; ++c) {
          I w[NP];
          for (int q = 0; q < NP; ++q) w[q] = V::load(pb[q] + B * c);
          for (int r = 0; r < R; ++r) {
            const I xv = V::bcast4(xr[r] + 32 * b + 4 * c);
            for (int q = 0; q < NP; ++q) {
              n[q][r] = V::narrow(n[q][r], w[q], xv);
              V::keep(n[q][r]);
            }
          }
        }
        for (int q = 0; q < NP; ++q)
          for (int r = 0; r < R; ++r) isum[q][r] = B32<V>::widen(isum[q][r], n[q][r]);
      }
    }
    for (int q = 0; q < NP; ++q) {
      const F ws = V::loadf(pb[q] + 8 * B);
      for (int r = 0; r < R; ++r) {
        F& c = acc[q * R + r];
        c = V::fmadd(V::cvt(isum[q][r]), V::mul(ws, V::set1f(d32[r][b])), c);
        if constexpr (!signed_values(T)) c = V::fmadd(V::loadf(pb[q] + 9 * B), V::set1f(s32[r][b]), c);
      }
    }
  }
}

// Many activation rows (prefill, a batch's lm head): a tile of panels built whole, then every RA
// activation rows over each NP panels of it.
template <class V, int T>
CB_TILE void panels_b32(const Part& p, int64_t n0, int64_t n1, const Acts& a, int64_t M, float* y, int64_t ldy) {
  using F = typename V::F;
  constexpr int L = V::LANES, NP = B32<V>::NP, RA = B32<V>::RA;
  const int64_t nb = row_blocks<T>(p), panel_bytes = nb * b32_block<V>();
  const int64_t np = std::clamp<int64_t>(B32<V>::TILE_BYTES / panel_bytes, 1, 4);
  uint8_t* buf = scratch(np * panel_bytes);
  for (int64_t t0 = n0; t0 < n1; t0 += np * L) {
    const int64_t t1 = std::min(n1, t0 + np * L), tp = (t1 - t0 + L - 1) / L;  // the tile's panels
    for (int64_t k = 0; k < tp; ++k) {
      const uint8_t* w[L];
      panel_rows<L>(p, t0 + k * L, std::min<int64_t>(L, t1 - t0 - k * L), w);
      build_panel<V, T>(w, 0, nb, nb, buf + k * panel_bytes, w[0] + L * p.row_bytes, L * p.row_bytes);
    }
    for (int64_t m0 = 0; m0 < M; m0 += RA) {
      const int64_t mr = std::min<int64_t>(RA, M - m0);
      for (int64_t k = 0; k < tp; k += NP) {
        const int64_t nq = std::min<int64_t>(NP, tp - k);
        F acc[NP * RA];
        cbserve::with_count<NP>(nq, [&](auto q) {
          cbserve::with_count<RA>(mr, [&](auto r) {
            constexpr int Q = decltype(q)::value, R = decltype(r)::value;
            for (int i = 0; i < Q * R; ++i) acc[i] = V::zerof();
            panel_dot<V, T, Q, R>(buf + k * panel_bytes, panel_bytes, nb, a, m0, 0, acc);
            for (int j = 0; j < Q; ++j) {
              const int64_t n = t0 + (k + j) * L, rows = std::min<int64_t>(L, t1 - n);
              for (int i = 0; i < R; ++i) V::store_lanes(y + (m0 + i) * ldy + n, acc[j * R + i], rows);
            }
          });
        });
      }
    }
  }
}

// One activation row (decode) with 256-bit vectors: nothing to share a transposed block with, so
// each row's block meets the activations as it is and the eight rows' int32 partial sums are
// reduced across (sums8), which leaves the eight rows' block dots in lanes as the panels do: the
// same integers, the same floats. `D` is how a block's integer is summed: Dot256 (AVX2: vpmaddubsw,
// vpmaddwd) or kquant_b32_vnni.cpp's (one vpdpbusd). Every panel prefetches the next one's bytes.
template <int T, class D>
CB_TILE void row1(const Part& p, int64_t n0, int64_t n1, const Acts& a, float* y) {
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
        const __m256i xa = D::template prep<T>(xv);
        __m256i s[8];
        for (int i = 0; i < 8; ++i) s[i] = D::template dot<T>(w[i], b, xv, xa);
        const __m256i isum = D::template fix<T>(sums8(s), a.i32[b]);
        const __m256 ws = scales[j];
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(ws, _mm256_set1_ps(a.d32[b])), acc);
        if constexpr (!signed_values(T))
          acc = _mm256_fmadd_ps(block_offsets8<T>(w, b, ws), _mm256_set1_ps(a.s32[b]), acc);
      }
    }
    Vec256::store_lanes(y + n, acc, rows);
  }
}

}  // namespace
}  // namespace cbserve_kquant
