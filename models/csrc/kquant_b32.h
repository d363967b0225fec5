// The 32-value formats' (Q4_0 .. Q8_0, IQ4_NL, IQ4_XS's sub-blocks) pieces shared by the AVX2 tiles
// (kquant_b32.cpp) and the AVX512-VNNI panels (kquant_b32_vnni.cpp): a block's values, eight rows'
// scales and offsets as both paths give them to the fp32 arithmetic (the same float operations, so
// a row's result is the same bits on either), the row pointers of a panel and its prefetch.
#pragma once

#include "kquant.h"

namespace cbserve_kquant {

// The fp16 at byte `off` of eight rows, as floats (one conversion for the eight).
inline __m256 halves8(const uint8_t* const* w, int64_t off) {
  auto h = [&](int n) {
    uint16_t v;
    std::memcpy(&v, w[n] + off, 2);
    return static_cast<int>(v);
  };
  __m128i v = _mm_cvtsi32_si128(h(0));
  v = _mm_insert_epi16(v, h(1), 1);
  v = _mm_insert_epi16(v, h(2), 2);
  v = _mm_insert_epi16(v, h(3), 3);
  v = _mm_insert_epi16(v, h(4), 4);
  v = _mm_insert_epi16(v, h(5), 5);
  v = _mm_insert_epi16(v, h(6), 6);
  v = _mm_insert_epi16(v, h(7), 7);
  return _mm256_cvtph_ps(v);
}

// The 32-value blocks in one block of T (IQ4_XS: 8 sub-blocks; the others: 1), and in a row of p.
template <int T>
constexpr int64_t subs() { return block_values(T) / 32; }
template <int T>
inline int64_t row_blocks(const Part& p) { return p.nb * subs<T>(); }

// Block j's values (of the row's K / 32 blocks) of the row at w.
template <int T>
inline __m256i sub_values(const uint8_t* w, int64_t j) {
  if constexpr (T == IQ4_XS) return iq4xs_values(w + j / 8 * block_bytes(T), static_cast<int>(j % 8));
  else return values32<T>(w + j * block_bytes(T));
}

// The scales s of eight rows for blocks b .. b + subs<T>() (one block of T; b a multiple of
// subs<T>()) into s[]. IQ4_XS: d times each sub-block's integer scale (the float multiply gguf's
// dequantize does), the 64 six-bit scales unpacked in lanes, a row a lane, once per 256 values.
template <int T>
inline void block_scales8(const uint8_t* const* w, int64_t b, __m256* s) {
  if constexpr (T == IQ4_XS) {
    const int64_t off = b / 8 * block_bytes(T);
    auto u32 = [&](int n, int at) {
      int32_t v;
      std::memcpy(&v, w[n] + off + at, 4);
      return v;
    };
    // lane n: row n's bytes 0..3 (d, scales_h) and 4..7 (scales_l)
    const __m256i hi = _mm256_srli_epi32(
        _mm256_setr_epi32(u32(0, 0), u32(1, 0), u32(2, 0), u32(3, 0), u32(4, 0), u32(5, 0), u32(6, 0), u32(7, 0)), 16);
    const __m256i lo =
        _mm256_setr_epi32(u32(0, 4), u32(1, 4), u32(2, 4), u32(3, 4), u32(4, 4), u32(5, 4), u32(6, 4), u32(7, 4));
    const __m256 d = halves8(w, off);
    #pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256i l = _mm256_and_si256(_mm256_srli_epi32(lo, 4 * j), _mm256_set1_epi32(0x0F));
      const __m256i h = _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hi, 2 * j), _mm256_set1_epi32(3)), 4);
      s[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(l, h), _mm256_set1_epi32(32))));
    }
  } else {
    s[0] = halves8(w, b * block_bytes(T));
  }
}

// The offsets o of eight rows' block b (w = u s + o; unsigned formats only), from their scales s:
// -8 s or -16 s (the float multiply gguf's dequantize does), or the block's stored minimum.
template <int T>
inline __m256 block_offsets8(const uint8_t* const* w, int64_t b, __m256 s) {
  static_assert(!signed_values(T), "signed values have no offset");
  if constexpr (T == Q4_0 || T == Q5_0) return _mm256_mul_ps(s, _mm256_set1_ps(T == Q4_0 ? -8.f : -16.f));
  else return halves8(w, b * block_bytes(T) + 2);
}

// A panel's rows are one run of bytes, read a block at a time as PR streams 1 row apart, which the
// hardware prefetcher follows poorly (a panel starts with PR misses): while block b of a panel is
// read, ask for the b-th share of the next panel's bytes (`next`, `bytes` of them).
inline void prefetch_share(const uint8_t* next, int64_t bytes, int64_t b, int64_t nb) {
  for (int64_t o = b * bytes / nb & ~int64_t(63), e = (b + 1) * bytes / nb; o < e; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(next + o), _MM_HINT_T0);
}

// Row pointers of the PR-row panel at output n (absolute in `p`), `rows` of them real; the lanes
// past a partial panel's end repeat its last row (their results are never stored).
template <int64_t PR>
inline void panel_rows(const Part& p, int64_t n, int64_t rows, const uint8_t** w) {
  for (int64_t i = 0; i < PR; ++i) w[i] = p.data + (n - p.n0 + std::min(i, rows - 1)) * p.row_bytes;
}

}  // namespace cbserve_kquant
