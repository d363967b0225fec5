// The K formats' (Q2_K .. Q6_K) pieces shared by decode's rows (kquant_k.cpp, kquant_k_rows_vnni.cpp)
// and the panels for many activation rows (kquant_k_panels.cpp on AVX2, kquant_k_vnni.cpp on
// AVX512-VNNI): a row's blocks unpacked (the panels of the formats they do not build from the
// file's bytes), the activation sums per 32, decode's exact epilogue.
#pragma once

#include "kquant.h"

namespace cbserve_kquant {

// Q4_K / Q5_K: the 12 packed bytes of 8 six-bit scales and 8 six-bit mins -> one vector of bytes
// [sc0..3, mn0..3, sc4..7, mn4..7] in both 128-bit halves (word-parallel bit moves instead of a
// byte loop; vpshufb then picks any of them zero-extended to 16-bit lanes).
inline __m256i scales_mins_k4(const uint8_t* q) {
  uint64_t lo;
  uint32_t hi;
  std::memcpy(&lo, q, 8);
  std::memcpy(&hi, q + 8, 4);
  const uint64_t h = hi | (static_cast<uint64_t>(hi >> 4) << 32);
  const uint64_t first = lo & 0x3F3F3F3F3F3F3F3FULL;  // sc0..3 | mn0..3: the low six bits
  // sc4..7 | mn4..7: four bits from bytes 8..11, the top two from the top of bytes 0..7
  const uint64_t second = (h & 0x0F0F0F0F0F0F0F0FULL) | ((lo >> 2) & 0x3030303030303030ULL);
  return _mm256_broadcastsi128_si256(
      _mm_set_epi64x(static_cast<int64_t>(second), static_cast<int64_t>(first)));
}

// vpshufb controls: sub-block i's scale (byte i, or i + 4 from the fifth) in every 16-bit lane.
inline __m256i k4_scale_ctrl(int i) {
  const int byte = i < 4 ? i : i + 4;
  return _mm256_set1_epi16(static_cast<int16_t>(0x8000 | byte));
}
// ... and the 8 mins as 16-bit lanes (low half).
inline __m128i k4_mins(__m256i sm) {
  return _mm_shuffle_epi8(_mm256_castsi256_si128(sm),
                          _mm_setr_epi8(4, -1, 5, -1, 6, -1, 7, -1, 12, -1, 13, -1, 14, -1, 15, -1));
}

// Q6_K / Q3_K: the vpshufb control that, from a half's 8 scales as 16-bit lanes (half_scales16), gives
// vector k of that half (32 values, a scale per 16) scale 2k in its low half, 2k + 1 in its high.
inline __m256i q6k_scale_ctrl(int k) {
  const int16_t lo = static_cast<int16_t>(0x0100 + 0x0202 * (2 * k)), hi = static_cast<int16_t>(lo + 0x0202);
  return _mm256_setr_epi16(lo, lo, lo, lo, lo, lo, lo, lo, hi, hi, hi, hi, hi, hi, hi, hi);
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// A block unpacked into the vectors the file-row kernel builds in registers, scales included
// (the panels transpose these for the formats they do not build from the file's bytes):
// 8 value vectors (32 values each, vector v meets sub-block v's scale), 8 scale vectors (that
// scale in every 16-bit lane), then Q4_K / Q5_K: the mins as 16-bit lanes, d and dmin;
// Q6_K / Q3_K: all 16 scales as 16-bit lanes (for the offset) and d; Q2_K: its 16 minimums as
// 16-bit lanes, d and dmin.
template <int T>
constexpr int64_t unpacked_block() {
  return scaled16(T) ? 576 : 544;
}

// Q4_K / Q5_K: values 64j .. 64j + 63 of a block (low and high halves); qh (Q5_K's fifth bits)
// is shifted down two bits a step, so its bits 0 and 1 are step j's.
template <int T>
inline void k4_values(const uint8_t* blk, int j, __m256i& qh, __m256i& lo, __m256i& hi) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m16 = _mm256_set1_epi8(0x10);
  const __m256i q = load256(blk + (T == Q4_K ? 16 : 48) + 32 * j);
  lo = _mm256_and_si256(q, m4);
  hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
  if constexpr (T == Q5_K) {  // bit 2j of qh byte i is value 64j + i's fifth bit, bit 2j + 1 value 64j + 32 + i's
    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(qh, 4), m16));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(qh, 3), m16));
    qh = _mm256_srli_epi16(qh, 2);
  }
}

// Q6_K / Q3_K: from the 16 int8 scales (k16_scales), half h's 8 as 16-bit lanes in both 128-bit
// halves (for q6k_scale_ctrl), and all 16 as 16-bit lanes (met by the activation sums per 16
// for the offset).
inline __m256i half_scales16(__m128i sc, int h) {
  return _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(h == 0 ? sc : _mm_srli_si128(sc, 8)));
}
inline __m256i all_scales16(__m128i sc) { return _mm256_cvtepi8_epi16(sc); }

template <int T>
inline void unpack_k(const uint8_t* w, int64_t nb, uint8_t* dst) {
  constexpr int64_t BB = block_bytes(T), UB = unpacked_block<T>();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * BB;
    uint8_t* o = dst + b * UB;
    auto put = [](uint8_t* at, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(at), v); };
    if constexpr (scaled16(T)) {
      const __m128i sc = k16_scales<T>(blk);
      for (int h = 0; h < 2; ++h) {
        __m256i u[4];
        k16_values<T>(u, blk, h);
        const __m256i scv = half_scales16(sc, h);
        for (int k = 0; k < 4; ++k) {
          put(o + 128 * h + 32 * k, u[k]);
          put(o + 256 + 128 * h + 32 * k, _mm256_shuffle_epi8(scv, q6k_scale_ctrl(k)));
        }
      }
      put(o + 512, all_scales16(T == Q2_K ? q2k_mins(blk) : sc));
      const float dd[2] = {k16_d<T>(blk), T == Q2_K ? q2k_dmin(blk) : 0.f};
      std::memcpy(o + 544, dd, 8);
    } else {
      __m256i qh = T == Q5_K ? load256(blk + 16) : _mm256_setzero_si256();
      const __m256i sm = scales_mins_k4(blk + 4);
      for (int j = 0; j < 4; ++j) {
        __m256i lo, hi;
        k4_values<T>(blk, j, qh, lo, hi);
        put(o + 64 * j, lo);
        put(o + 64 * j + 32, hi);
        put(o + 256 + 64 * j, _mm256_shuffle_epi8(sm, k4_scale_ctrl(2 * j)));
        put(o + 256 + 64 * j + 32, _mm256_shuffle_epi8(sm, k4_scale_ctrl(2 * j + 1)));
      }
      _mm_store_si128(reinterpret_cast<__m128i*>(o + 512), k4_mins(sm));
      const float dd[2] = {fp16(blk), fp16(blk + 2)};
      std::memcpy(o + 528, dd, 8);
    }
  }
}

// Where unpack_k puts a block's pieces (bytes from the block's start): the 256 values in order,
// then sub-block s's scale in 16-bit lanes (a scale per 32 values: the vector at 256 + 32 s; a
// scale per 16: the half vector at 256 + 16 s), then at K_CORR the mins (Q4_K / Q5_K: 8) or the
// scales per 16 (Q6_K / Q3_K; Q2_K: its minimums) as 16-bit lanes, then d and dmin as floats.
template <int T>
constexpr int64_t k_scale_at(int s) {
  return scaled16(T) ? 256 + 16 * s : 256 + 32 * s;
}
constexpr int64_t K_CORR = 512;
template <int T>
constexpr int64_t k_dd() {
  return scaled16(T) ? 544 : 528;
}

// Q4_K / Q5_K's minimums meet the activation sums per 32: from an (activation row, block)'s 16
// sums per 16, its 8 sums per 32.
inline __m128i pair_sums(const int16_t* s16) {
  return _mm_hadd_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s16)),
                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(s16 + 8)));
}
// ... for every (activation row, block) of a call: rows x blocks x 8 int16 into `pairs`.
inline void pair_sums_all(const Acts& a, int64_t M, int16_t* pairs) {
  for (int64_t rb = 0; rb < M * (a.K / 256); ++rb)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pairs + 8 * rb), pair_sums(a.bs16 + rb * 16));
}

// The panels (kquant_k_panels.cpp, kquant_k_vnni.cpp): block b of a panel's N rows t0 .. t0 + rows,
// blk[i], or `zeros` (a zero block) past them.
template <int T, int N>
inline void panel_blocks(const Part& p, int64_t t0, int64_t rows, int64_t b, const uint8_t* zeros,
                         const uint8_t** blk) {
  for (int64_t i = 0; i < N; ++i)
    blk[i] = i < rows ? p.data + (t0 + i - p.n0) * p.row_bytes + b * block_bytes(T) : zeros;
}

// Prefetch the slice of the next rows' bytes that matches block b of this group (the group's rows
// are contiguous, so `pf` + b * step covers the next group as this one is walked).
// `to_l2`: into L2 only, for groups too large to sit in L1 beside the group being read (1B-sized
// down projections: 4 rows of 8,192 values are 18-27 KB; fetched into L1 they evict the current
// group and stream at 19.8-20.2 GB/s instead of 27.2-28.9 on Zen 4).
inline void prefetch_slice(const uint8_t* pf, int64_t b, int64_t step, bool to_l2) {
  if (!pf) return;
  const uint8_t* p = pf + b * step;
  if (to_l2)
    for (int64_t o = 0; o < step; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T1);
  else
    for (int64_t o = 0; o < step; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T0);
}
// A group of weight rows whose bytes exceed this is prefetched into L2 (L1d is 32-48 KB).
constexpr int64_t L1_GROUP_BYTES = 12 << 10;

// Formats whose weights carry a minimum per sub-block (w = d sc u - dmin m): its term comes from the
// activation sums and meets dmin; the others' offset is folded into the integer sum.
constexpr bool has_min(int64_t t) { return t == Q2_K || !scaled16(t); }

// The exact arithmetic (dot_k, the VNNI rows, both kinds of panels), one block: PAIRS (weight row, activation
// row) pairs' whole-block integers, I1 in ints[pair] and I2 in ints[I2_AT + pair] (8-lane vectors
// whose lanes sum to the integer; I2_AT = 4 up to 4 pairs, else 8), meet each pair's d, dmin and
// activation scale: c += I1 (d dx) - I2 (dmin dx), one fp32 lane per pair (exact4 up to 4 pairs).
template <int PAIRS, bool HAS_MIN>
inline void exact_block(const __m256i* ints, const float* dn, const float* dminn, const float* dxs, __m128& exact4,
                        __m256& exact8) {
  static_assert(PAIRS <= 8, "the exact epilogue keeps one lane per pair");
  if constexpr (PAIRS <= 4) {  // lanes 0-3: I1, 4-7: I2
    const __m256 f = _mm256_cvtepi32_ps(sums8(ints));
    const __m128 vdx = _mm_load_ps(dxs);
    exact4 = _mm_fmadd_ps(_mm256_castps256_ps128(f), _mm_mul_ps(_mm_load_ps(dn), vdx), exact4);
    if constexpr (HAS_MIN)
      exact4 = _mm_fnmadd_ps(_mm256_extractf128_ps(f, 1), _mm_mul_ps(_mm_load_ps(dminn), vdx), exact4);
  } else {
    const __m256 vdx = _mm256_load_ps(dxs);
    exact8 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums8(ints)), _mm256_mul_ps(_mm256_load_ps(dn), vdx), exact8);
    if constexpr (HAS_MIN)
      exact8 = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(sums8(ints + 8)), _mm256_mul_ps(_mm256_load_ps(dminn), vdx), exact8);
  }
}
template <int PAIRS>
inline void exact_result(__m128 exact4, __m256 exact8, float* res) {
  alignas(32) float out[8];
  if constexpr (PAIRS <= 4)
    _mm_store_ps(out, exact4);
  else
    _mm256_store_ps(out, exact8);
  for (int i = 0; i < PAIRS; ++i) res[i] = out[i];
}

// Decode: the file's rows [0, count) against activation rows m0 .. m0 + R, in groups of NR weight
// rows through DOT (NR rows) and DOT1 (the last count % NR), both (w, a, m0, nb, res, pf) with
// res[n * R + r]; `stride` from one row to the next. The next group's bytes are prefetched while
// this one is computed, since in a decode step the weights stream from DRAM and each is used once.
using DotFn = void (*)(const uint8_t* const*, const Acts&, int64_t, int64_t, float*, const uint8_t*);
template <int NR, int R, DotFn DOT, DotFn DOT1>
void rows_of(const uint8_t* first, int64_t stride, int64_t count, const uint8_t* end, const Acts& a, int64_t nb,
             int64_t m0, float* y, int64_t ldy) {
  float res[NR * R];
  int64_t i = 0;
  for (; i + NR <= count; i += NR) {
    const uint8_t* w[NR];
    for (int k = 0; k < NR; ++k) w[k] = first + (i + k) * stride;
    const uint8_t* pf = w[0] + NR * stride;
    DOT(w, a, m0, nb, res, pf + NR * stride <= end ? pf : nullptr);
    for (int k = 0; k < NR; ++k)
      for (int r = 0; r < R; ++r) y[(m0 + r) * ldy + i + k] = res[k * R + r];
  }
  for (; i < count; ++i) {
    const uint8_t* w = first + i * stride;
    DOT1(&w, a, m0, nb, res, nullptr);
    for (int r = 0; r < R; ++r) y[(m0 + r) * ldy + i] = res[r];
  }
}
// rows_of with K::dot<NR, R> taking NR weight rows a call (4 for up to 2 activation rows, else 2,
// so that NR x R pairs fit the exact epilogue's lanes) and K::dot<1, R> the last ones.
template <class K, int R>
void rows_by(const uint8_t* first, int64_t stride, int64_t count, const uint8_t* end, const Acts& a, int64_t nb,
             int64_t m0, float* y, int64_t ldy) {
  constexpr int NR = R <= 2 ? 4 : 2;
  rows_of<NR, R, K::template dot<NR, R>, K::template dot<1, R>>(first, stride, count, end, a, nb, m0, y, ldy);
}
// rows_of's signature: a format's decode rows for one R.
using RowsFn = void (*)(const uint8_t*, int64_t, int64_t, const uint8_t*, const Acts&, int64_t, int64_t, float*,
                        int64_t);

// The tile for more than MR activation rows on AVX512-VNNI CPUs (kquant_k_vnni.cpp).
TileFn panels_k_vnni(int64_t type);
// ... and on the others (kquant_k_panels.cpp).
TileFn panels_k_avx2(int64_t type);
// Decode's rows for R = 1 .. MR activation rows in 512-bit vectors on AVX512-VNNI CPUs
// (kquant_k_rows_vnni.cpp; dot_k's exact results), or nullptr for a format they do not cover or
// on a CPU without VNNI.
RowsFn rows_k_vnni(int64_t type, int64_t R);

}  // namespace cbserve_kquant
