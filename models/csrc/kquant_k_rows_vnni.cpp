// Decode's K-format rows (up to MR activation rows, the file's bytes) in 512-bit vectors on
// AVX512-VNNI CPUs: Q4_K and Q5_K, the bulk of a Q4_K_M / Q5_K_M file; Q6_K, its head and half
// its down projections; Q3_K and Q2_K, the bulk of Q3_K_M and Q2_K files.
//
// At one to four activation rows the weights are used once each, so a row's cost is the
// instructions that turn its bytes into integer sums; dot_k's 256-bit loop (kquant_k.cpp) spends
// about 90 a block and row, more than DRAM needs on these CPUs. Here one 64-byte load holds two
// 32-value steps of a block: its low nibbles are sub-blocks 4c and 4c + 2, its high ones 4c + 1
// and 4c + 3, so the activations are gathered to match once per block (two 32-byte halves a
// vector, shared by every weight row), and each vector of values is one vpmaddubsw and one
// vpdpwssd (sub-scales as 16-bit lanes, the multiply-add of the pairs and the running sum in one).
// The formats with a scale per 16 values take the activations in their own order instead
// (dot_k16_512).
//
// The arithmetic is dot_k's exact one: per block and (weight row, activation row) pair the integer
// sums I1 and I2 are whole numbers (the same in any order), then exact_block's fp32 chain, so a
// row's result is the same bits as on the 256-bit rows and the VNNI panels of prefill.
#include "kquant_k.h"

namespace cbserve_kquant {
namespace {

// vpshufb controls that pick, from the block's 16 scale and min bytes (scales_mins_k4) in every
// 128-bit lane, the sub-scales of 64-byte chunk c's low (h = 0) or high (h = 1) nibbles as 16-bit
// lanes: sub-block 4c + h in the lower 256 bits, 4c + 2 + h in the upper.
CB_VNNI inline __m512i k4_scale_ctrl512(int c, int h) {
  auto lanes = [](int s) { return _mm256_set1_epi16(static_cast<int16_t>(0x8000 | (s < 4 ? s : s + 4))); };
  return _mm512_inserti64x4(_mm512_castsi256_si512(lanes(4 * c + h)), lanes(4 * c + 2 + h), 1);
}

// The counts of a variable 16-bit shift: a in the lower 256 bits, b in the upper.
CB_VNNI inline __m512i counts(int a, int b) {
  return _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(a)), _mm256_set1_epi16(static_cast<int16_t>(b)), 1);
}

// Bit a of every byte in the lower 256 bits, bit b in the upper.
CB_VNNI inline __m512i bits(int a, int b) {
  return _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << a)), _mm256_set1_epi8(static_cast<char>(1 << b)), 1);
}

// NR file rows w[n] against activation rows r0 .. r0 + R: res[n * R + r] (rows_of's DOT).
template <int T, int NR, int R>
CB_VNNI void dot_k4_512(const uint8_t* const* w, const Acts& a, int64_t r0, int64_t nb, float* res,
                        const uint8_t* pf) {
  static_assert(T == Q4_K || T == Q5_K);
  constexpr int64_t BB = block_bytes(T);
  constexpr int PAIRS = NR * R, I2_AT = PAIRS <= 4 ? 4 : 8;
  const bool pf_l2 = NR * nb * BB > L1_GROUP_BYTES;
  const __m512i m4 = _mm512_set1_epi8(0x0F), m16 = _mm512_set1_epi8(0x10);
  __m128 exact4 = _mm_setzero_ps();
  __m256 exact8 = _mm256_setzero_ps();
  const int64_t nbx = a.K / 256;
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_slice(pf, b, NR * BB, pf_l2);
    // Activation row r's vectors for chunk c's low (2c) and high (2c + 1) nibbles, its sums per 32.
    __m512i xv[R][4];
    __m128i pairs[R];
    alignas(32) float dxs[8] = {}, dn[8] = {}, dminn[8] = {};
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * nbx + b;
      const int8_t* x = a.q256 + rb * 256;
      for (int c = 0; c < 2; ++c)
        for (int h = 0; h < 2; ++h)
          xv[r][2 * c + h] = _mm512_inserti64x4(_mm512_castsi256_si512(load256(x + 128 * c + 32 * h)),
                                                load256(x + 128 * c + 64 + 32 * h), 1);
      pairs[r] = pair_sums(a.bs16 + rb * 16);
      for (int n = 0; n < NR; ++n) dxs[n * R + r] = a.d256[rb];
    }
    __m256i ints[16];
    for (int i = 0; i < 16; ++i) ints[i] = _mm256_setzero_si256();
    for (int n = 0; n < NR; ++n) {
      const uint8_t* blk = w[n] + b * BB;
      const __m256i sm = scales_mins_k4(blk + 4);
      const __m512i sm512 = _mm512_broadcast_i32x4(_mm256_castsi256_si128(sm));
      // Q5_K: bit 2j (2j + 1) of qh byte i is the fifth bit of step j's low (high) value i; the
      // lower half of chunk c is step 2c, the upper step 2c + 1.
      const __m512i qh = T == Q5_K ? _mm512_broadcast_i64x4(load256(blk + 16)) : _mm512_setzero_si512();
      __m512i acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
      for (int c = 0; c < 2; ++c) {
        const __m512i q = _mm512_loadu_si512(blk + (T == Q4_K ? 16 : 48) + 64 * c);
        __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
        if constexpr (T == Q5_K) {  // a byte mask of each half's qh bit, then 16 added where set
          lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(qh, bits(4 * c, 4 * c + 2)), lo, m16);
          hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(qh, bits(4 * c + 1, 4 * c + 3)), hi, m16);
        }
        const __m512i slo = _mm512_shuffle_epi8(sm512, k4_scale_ctrl512(c, 0));
        const __m512i shi = _mm512_shuffle_epi8(sm512, k4_scale_ctrl512(c, 1));
        for (int r = 0; r < R; ++r) {
          acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_maddubs_epi16(lo, xv[r][2 * c]), slo);
          acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_maddubs_epi16(hi, xv[r][2 * c + 1]), shi);
        }
      }
      const __m128i mins = k4_mins(sm);
      const float d = fp16(blk), dmin = fp16(blk + 2);
      for (int r = 0; r < R; ++r) {
        ints[n * R + r] = _mm256_add_epi32(_mm512_castsi512_si256(acc[r]), _mm512_extracti64x4_epi64(acc[r], 1));
        ints[I2_AT + n * R + r] = _mm256_zextsi128_si256(_mm_madd_epi16(mins, pairs[r]));
        dn[n * R + r] = d;
        dminn[n * R + r] = dmin;
      }
    }
    exact_block<PAIRS, has_min(T)>(ints, dn, dminn, dxs, exact4, exact8);
  }
  exact_result<PAIRS>(exact4, exact8, res);
}

// The formats with a scale per 16 values (Q6_K, Q3_K, Q2_K), a half block (128 values) at a time:
// one vector holds the half's values 0..63, another 64..127, in the activations' own order, so
// the activations are not gathered (each weight row reads them from L1 as the vpmaddubsw operand)
// and each vector is one vpmaddubsw and one vpdpwssd, its four sub-scales (one a 128-bit lane)
// picked from the half's scales by one vpshufb. A vector's bytes come from the half's packed bits,
// loaded once into both 256-bit halves, each half moved by its own count in one variable shift:
// - Q6_K: the half's 64 low-nibble bytes hold values 0..63 (low nibbles) and 64..127 (high
//   nibbles); its 32 bytes of top bits give each 32 values their two bits (shifted to bits 4-5).
// - Q2_K: the half's 32 bytes hold four 32-value steps, two bits each (bits 2k..2k+1 for step k).
// - Q3_K: the same two bits from qs, the third from hmask bit 4h + k (one byte-mask test, then a
//   masked add of 4).
// The offset (Q6_K 32, Q3_K 4) leaves through the activation sums per 16, and Q2_K's minimums
// meet them, as in dot_k: the same whole-block integers.
template <int T>
CB_VNNI inline void k16_values512(const uint8_t* blk, int h, __m512i& lo, __m512i& hi) {
  if constexpr (T == Q6_K) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i q = _mm512_loadu_si512(blk + 64 * h);
    const __m512i qh = _mm512_broadcast_i64x4(load256(blk + 128 + 32 * h));
    // top bits: values 0..31 take bits 0-1 (<< 4), 32..63 bits 2-3 (<< 2), 64..95 bits 4-5 (as
    // they are), 96..127 bits 6-7 (>> 2), each then masked to bits 4-5
    lo = _mm512_or_si512(_mm512_and_si512(q, m4), _mm512_and_si512(_mm512_sllv_epi16(qh, counts(4, 2)), m30));
    hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q, 4), m4),
                         _mm512_and_si512(_mm512_srlv_epi16(qh, counts(0, 2)), m30));
  } else {
    const __m512i m3 = _mm512_set1_epi8(3);
    const __m512i qs = _mm512_broadcast_i64x4(load256(blk + (T == Q2_K ? 16 : 32) + 32 * h));
    lo = _mm512_and_si512(_mm512_srlv_epi16(qs, counts(0, 2)), m3);
    hi = _mm512_and_si512(_mm512_srlv_epi16(qs, counts(4, 6)), m3);
    if constexpr (T == Q3_K) {  // the third bit: a byte mask of hmask's bits 4h + k, then 4 added where set
      const __m512i four = _mm512_set1_epi8(4), hm = _mm512_broadcast_i64x4(load256(blk));
      lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(hm, bits(4 * h, 4 * h + 1)), lo, four);
      hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(hm, bits(4 * h + 2, 4 * h + 3)), hi, four);
    }
  }
}

template <int T, int NR, int R>
CB_VNNI void dot_k16_512(const uint8_t* const* w, const Acts& a, int64_t r0, int64_t nb, float* res,
                         const uint8_t* pf) {
  static_assert(scaled16(T));
  constexpr int64_t BB = block_bytes(T);
  constexpr int PAIRS = NR * R, I2_AT = PAIRS <= 4 ? 4 : 8;
  const bool pf_l2 = NR * nb * BB > L1_GROUP_BYTES;
  const __m512i ctrl_lo = _mm512_inserti64x4(_mm512_castsi256_si512(q6k_scale_ctrl(0)), q6k_scale_ctrl(1), 1);
  const __m512i ctrl_hi = _mm512_inserti64x4(_mm512_castsi256_si512(q6k_scale_ctrl(2)), q6k_scale_ctrl(3), 1);
  __m128 exact4 = _mm_setzero_ps();
  __m256 exact8 = _mm256_setzero_ps();
  const int64_t nbx = a.K / 256;
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_slice(pf, b, NR * BB, pf_l2);
    const int8_t* x[R];  // activation row r's values, read by each weight row from L1
    __m256i bs[R];       // its sums per 16
    alignas(32) float dxs[8] = {}, dn[8] = {}, dminn[8] = {};
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * nbx + b;
      x[r] = a.q256 + rb * 256;
      bs[r] = load256(a.bs16 + rb * 16);
      for (int n = 0; n < NR; ++n) dxs[n * R + r] = a.d256[rb];
    }
    __m256i ints[16];
    for (int i = 0; i < 16; ++i) ints[i] = _mm256_setzero_si256();
    __m128i scs[NR];
    if constexpr (T == Q3_K) q3k_scales_rows<NR>(w, b, scs);
    for (int n = 0; n < NR; ++n) {
      const uint8_t* blk = w[n] + b * BB;
      const __m128i sc = T == Q3_K ? scs[n] : k16_scales<T>(blk);
      __m512i acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        __m512i lo, hi;
        k16_values512<T>(blk, h, lo, hi);
        const __m512i scv = _mm512_broadcast_i32x4(_mm_cvtepi8_epi16(h == 0 ? sc : _mm_srli_si128(sc, 8)));
        const __m512i slo = _mm512_shuffle_epi8(scv, ctrl_lo), shi = _mm512_shuffle_epi8(scv, ctrl_hi);
        for (int r = 0; r < R; ++r) {
          acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_maddubs_epi16(lo, _mm512_loadu_si512(x[r] + 128 * h)), slo);
          acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_maddubs_epi16(hi, _mm512_loadu_si512(x[r] + 128 * h + 64)), shi);
        }
      }
      const float d = k16_d<T>(blk);
      if constexpr (T == Q2_K) {  // w = d sc u - dmin m: m x (the sums per 16) meets dmin
        const __m256i mn16 = all_scales16(q2k_mins(blk));
        const float dmin = q2k_dmin(blk);
        for (int r = 0; r < R; ++r) {
          ints[n * R + r] = _mm256_add_epi32(_mm512_castsi512_si256(acc[r]), _mm512_extracti64x4_epi64(acc[r], 1));
          ints[I2_AT + n * R + r] = _mm256_madd_epi16(mn16, bs[r]);
          dn[n * R + r] = d;
          dminn[n * R + r] = dmin;
        }
      } else {  // w = d sc (u - offset): take offset sc x (the sums per 16) back out, in the same lanes
        const __m256i sc16 = all_scales16(sc);
        for (int r = 0; r < R; ++r) {
          const __m256i sum = _mm256_add_epi32(_mm512_castsi512_si256(acc[r]), _mm512_extracti64x4_epi64(acc[r], 1));
          ints[n * R + r] =
              _mm256_sub_epi32(sum, _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs[r]), k16_offset_shift(T)));
          dn[n * R + r] = d;
        }
      }
    }
    exact_block<PAIRS, has_min(T)>(ints, dn, dminn, dxs, exact4, exact8);
  }
  exact_result<PAIRS>(exact4, exact8, res);
}

template <int T>
struct Dot512 {
  template <int NR, int R>
  CB_VNNI static void dot(const uint8_t* const* w, const Acts& a, int64_t r0, int64_t nb, float* res, const uint8_t* pf) {
    if constexpr (scaled16(T))
      dot_k16_512<T, NR, R>(w, a, r0, nb, res, pf);
    else
      dot_k4_512<T, NR, R>(w, a, r0, nb, res, pf);
  }
};
template <int T, int R>
constexpr RowsFn rows_k_512 = rows_by<Dot512<T>, R>;

}  // namespace

RowsFn rows_k_vnni(int64_t type, int64_t R) {
  RowsFn f = nullptr;
  if (R < 1 || R > MR || !cbserve::cpu_has_vnni()) return f;
  cbserve::with_value<Q2_K, Q3_K, Q4_K, Q5_K, Q6_K>(type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    static const RowsFn by_r[MR + 1] = {nullptr, rows_k_512<T, 1>, rows_k_512<T, 2>, rows_k_512<T, 3>,
                                        rows_k_512<T, 4>};
    f = by_r[R];
  });
  return f;
}

}  // namespace cbserve_kquant
