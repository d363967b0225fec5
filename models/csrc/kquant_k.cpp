// int8-activation dots of the 256-value K formats (Q4_K, Q5_K, Q6_K) against llama.cpp's Q8_K
// activations (int8 per 256 inputs, with sums per 16): the 4-, 5- or 6-bit values meet the
// activations in vpmaddubsw, their integer sub-scales in vpmaddwd; a format's minimum or offset
// enters through the activation sums; fp32 once per 256 inputs.
#include "kquant.h"

namespace cbserve_kquant {
namespace {

template <int T, int R>
void dot_a8_k4(const uint8_t* w, const Acts& a, int64_t r0, int64_t nb, float* res) {  // Q4_K, Q5_K
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  const int64_t nbx = a.K / 256;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * block_bytes(T);
    const float d = fp16(blk), dmin = fp16(blk + 2);
    uint8_t sc[8], mn[8];
    scales_k4(blk + 4, sc, mn);
    const uint8_t* qs = blk + (T == Q4_K ? 16 : 48);
    const __m256i qh = T == Q5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)) : _mm256_setzero_si256();
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      if constexpr (T == Q5_K) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4));
      }
      const __m256i s0 = _mm256_set1_epi16(sc[2 * j]), s1 = _mm256_set1_epi16(sc[2 * j + 1]);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = a.q256 + ((r0 + r) * nbx + b) * 256 + 64 * j;
        const __m256i p0 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr))), s0);
        const __m256i p1 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32))), s1);
        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(p0, p1));
      }
    }
    const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)));
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * nbx + b;
      const int16_t* bs = a.bs16 + rb * 16;
      const __m128i pairs = _mm_hadd_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bs)),
                                           _mm_loadu_si128(reinterpret_cast<const __m128i*>(bs + 8)));
      const __m256i pm = _mm256_zextsi128_si256(_mm_madd_epi16(mins, pairs));
      const float dx = a.d256[rb];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_set1_ps(d * dx), acc[r]);
      acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(pm), _mm256_set1_ps(dmin * dx), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) res[r] = hsum(acc[r]);
}

template <int R>
void dot_a8_q6k(const uint8_t* w, const Acts& a, int64_t r0, int64_t nb, float* res) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
  const int64_t nbx = a.K / 256;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 210;
    const float d = fp16(blk + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
    for (int n = 0; n < 2; ++n) {
      __m256i u[4];
      q6k_half(u, blk, n);
      __m256i s[4];
      for (int k = 0; k < 4; ++k)
        s[k] = _mm256_set_m128i(_mm_set1_epi16(sc[8 * n + 2 * k + 1]), _mm_set1_epi16(sc[8 * n + 2 * k]));
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = a.q256 + ((r0 + r) * nbx + b) * 256 + 128 * n;
        for (int k = 0; k < 4; ++k) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32 * k));
          sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u[k], xv), s[k]));
        }
      }
    }
    // w = d sc (u - 32): take 32 sc x (the block's sums per 16) back out.
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * nbx + b;
      const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bs16 + rb * 16));
      const __m256i tot = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_set1_ps(d * a.d256[rb]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) res[r] = hsum(acc[r]);
}

template <int T>
void tile_k(const Part& p, int64_t n0, int64_t n1, const Acts& a, int64_t M, float* y, int64_t ldy) {
  if constexpr (T == Q6_K) {
    static const DotFn dots[MR + 1] = {nullptr, dot_a8_q6k<1>, dot_a8_q6k<2>, dot_a8_q6k<3>, dot_a8_q6k<4>};
    tile_by_rows(dots, nullptr, 0, p, n0, n1, a, M, y, ldy);
  } else {
    static const DotFn dots[MR + 1] = {nullptr, dot_a8_k4<T, 1>, dot_a8_k4<T, 2>, dot_a8_k4<T, 3>, dot_a8_k4<T, 4>};
    tile_by_rows(dots, nullptr, 0, p, n0, n1, a, M, y, ldy);
  }
}

}  // namespace

TileFn tile_k_a8(int64_t type) {
  switch (type) {
    case Q4_K: return tile_k<Q4_K>;
    case Q5_K: return tile_k<Q5_K>;
    case Q6_K: return tile_k<Q6_K>;
    default: return nullptr;
  }
}

}  // namespace cbserve_kquant
