// int8-activation dots of the 256-value K formats (Q2_K .. Q6_K) against llama.cpp's Q8_K
// activations (int8 per 256 inputs, with sums per 16), and the tiles that run them.
//
// The 2- to 6-bit values meet the activations in vpmaddubsw, their integer sub-scales in
// vpmaddwd (each sub-scale broadcast to 16-bit lanes by one vpshufb from a register holding the
// block's scales); a format's minimum or offset enters through the activation sums per 16; fp32
// once per 256 inputs. Decode's kernel, dot_k, takes NR weight rows against R activation rows so
// that the activations' per-block work (scale, sums) and the final horizontal sums are shared,
// and several rows' independent chains keep the multiply pipes busy.
//
// Up to MR activation rows (decode) the kernel reads the file's rows, prefetching the next rows
// (each weight is used once and streams from DRAM). More (prefill, batched decode) meet panels of
// weight rows built once per call: kquant_k_panels.cpp on AVX2 CPUs, kquant_k_vnni.cpp on
// AVX512-VNNI ones (where decode runs on kquant_k_rows_vnni.cpp's 512-bit rows).
//
// Batch invariance: every path computes, per block and (weight row, activation row) pair, the same
// whole-block integers (exact, in any order) and then the same fp32 chain per pair in block order,
// so an activation row's result is the same bits whatever the batch and whichever path.
#include "kquant_k.h"

namespace cbserve_kquant {
namespace {

// NR weight rows w[n] (nb blocks of type T each, the file's) against activation rows r0 .. r0 + R:
// res[n * R + r] = sum_k w[n][k] x[r0 + r][k].
// Per block and (weight row, activation row) pair the integer lanes give I1 (the scaled sum, an
// offset taken out) and I2 (the minimums' term); each is summed across lanes (a whole-block
// integer, exact), then c += I1 (d dx) - I2 (dmin dx) in fp32, one float per pair: the arithmetic
// of the panels, which compute the same whole-block integers in another order.
template <int T, int NR, int R>
void dot_k(const uint8_t* const* w, const Acts& a, int64_t r0, int64_t nb, float* res, const uint8_t* pf) {
  constexpr int64_t BB = block_bytes(T);
  const bool pf_l2 = NR * nb * BB > L1_GROUP_BYTES;
  static_assert(NR * R <= 8, "the exact epilogue keeps one lane per pair");
  // Pair n * R + r's integer vectors, I1 at [pair] and I2 at [I2_AT + pair] (up to 4 pairs
  // share one reduction), and its float in lane n * R + r.
  constexpr int PAIRS = NR * R, I2_AT = PAIRS <= 4 ? 4 : 8;
  __m256i ints[16];
  for (int i = 0; i < 16; ++i) ints[i] = _mm256_setzero_si256();
  __m128 exact4 = _mm_setzero_ps();
  __m256 exact8 = _mm256_setzero_ps();
  const int64_t nbx = a.K / 256;
  // Each pair's d, dmin and activation scale, set per block (the lanes past PAIRS stay zeros: zeroed
  // once here, not per block).
  alignas(32) float dn[8] = {}, dminn[8] = {}, dxs[8] = {};
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_slice(pf, b, NR * BB, pf_l2);
    // The activation rows' share of the block, used by every weight row.
    const int8_t* x[R];
    __m128i pairs[R];  // Q4_K / Q5_K: the sums per 32 (one per min)
    __m256i bs[R];     // Q6_K / Q3_K / Q2_K: the sums per 16 (one per scale)
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * nbx + b;
      x[r] = a.q256 + rb * 256;
      const int16_t* s16 = a.bs16 + rb * 16;
      if constexpr (scaled16(T)) {
        bs[r] = load256(s16);
      } else {
        pairs[r] = pair_sums(s16);
      }
    }
    __m128i scs[NR];
    if constexpr (T == Q3_K) q3k_scales_rows<NR>(w, b, scs);
#pragma GCC unroll 1
    for (int n = 0; n < NR; ++n) {
      const uint8_t* blk = w[n] + b * BB;
      // Each weight row reloads the activations from L1 (cheap, folded into vpmaddubsw): kept
      // live across rows they would not fit in the registers (and the compiler spills them).
      const int8_t* xs[R];
      for (int r = 0; r < R; ++r) {
        xs[r] = x[r];
        asm volatile("" : "+r"(xs[r]));
      }
      __m256i sumi[R], i2[R];
      for (int r = 0; r < R; ++r) sumi[r] = i2[r] = _mm256_setzero_si256();
      float d, dmin = 0.f;
      if constexpr (scaled16(T)) {
        const __m128i sc = T == Q3_K ? scs[n] : k16_scales<T>(blk);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          __m256i u[4];
          k16_values<T>(u, blk, h);
          const __m256i scv = half_scales16(sc, h);
#pragma GCC unroll 4
          for (int k = 0; k < 4; ++k) {
            const __m256i s = _mm256_shuffle_epi8(scv, q6k_scale_ctrl(k));
            for (int r = 0; r < R; ++r) {
              sumi[r] = _mm256_add_epi32(
                  sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u[k], load256(xs[r] + 128 * h + 32 * k)), s));
              keep(sumi[r]);
            }
          }
        }
        d = k16_d<T>(blk);
        if constexpr (T == Q2_K) {  // w = d sc u - dmin m: m x (the sums per 16) meets dmin
          const __m256i mn16 = all_scales16(q2k_mins(blk));
          dmin = q2k_dmin(blk);
          for (int r = 0; r < R; ++r) i2[r] = _mm256_madd_epi16(mn16, bs[r]);
        } else {  // w = d sc (u - offset): take offset sc x (the sums per 16) back out, in the same lanes
          const __m256i sc16 = all_scales16(sc);
          for (int r = 0; r < R; ++r)
            sumi[r] = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs[r]), k16_offset_shift(T)));
        }
      } else {
        const __m256i sm = scales_mins_k4(blk + 4);
        __m256i qh = T == Q5_K ? load256(blk + 16) : _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          __m256i lo, hi;
          k4_values<T>(blk, j, qh, lo, hi);
          const __m256i s0 = _mm256_shuffle_epi8(sm, k4_scale_ctrl(2 * j));
          const __m256i s1 = _mm256_shuffle_epi8(sm, k4_scale_ctrl(2 * j + 1));
          for (int r = 0; r < R; ++r) {
            const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load256(xs[r] + 64 * j)), s0);
            const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load256(xs[r] + 64 * j + 32)), s1);
            sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(p0, p1));
            keep(sumi[r]);
          }
        }
        const __m128i mins = k4_mins(sm);
        d = fp16(blk);
        dmin = fp16(blk + 2);
        for (int r = 0; r < R; ++r) i2[r] = _mm256_zextsi128_si256(_mm_madd_epi16(mins, pairs[r]));
      }
      for (int r = 0; r < R; ++r) {
        ints[n * R + r] = sumi[r];
        if constexpr (has_min(T)) ints[I2_AT + n * R + r] = i2[r];
        dn[n * R + r] = d;
        dminn[n * R + r] = dmin;
      }
    }
    for (int n = 0; n < NR; ++n)
      for (int r = 0; r < R; ++r) dxs[n * R + r] = a.d256[(r0 + r) * nbx + b];
    exact_block<PAIRS, has_min(T)>(ints, dn, dminn, dxs, exact4, exact8);
  }
  exact_result<PAIRS>(exact4, exact8, res);
}

// Decode's rows (rows_by, kquant_k.h) through dot_k.
template <int T>
struct DotK {
  template <int NR, int R>
  static void dot(const uint8_t* const* w, const Acts& a, int64_t r0, int64_t nb, float* res, const uint8_t* pf) {
    dot_k<T, NR, R>(w, a, r0, nb, res, pf);
  }
};
template <int T, int R>
constexpr RowsFn rows_k = rows_by<DotK<T>, R>;

// Up to MR activation rows (decode) the file's rows, on AVX512-VNNI CPUs in 512-bit vectors where
// the format has them (the same bits); more meet the panels of the CPU's kind.
template <int T>
void tile_k(const Part& p, int64_t n0, int64_t n1, const Acts& a, int64_t M, float* y, int64_t ldy) {
  if (M <= MR) {
    static const RowsFn rows[MR + 1] = {nullptr, rows_k<T, 1>, rows_k<T, 2>, rows_k<T, 3>, rows_k<T, 4>};
    static const RowsFn wide[MR + 1] = {nullptr, rows_k_vnni(T, 1), rows_k_vnni(T, 2), rows_k_vnni(T, 3),
                                        rows_k_vnni(T, 4)};
    const uint8_t* end = p.data + p.rows * p.row_bytes;
    return (wide[M] ? wide[M] : rows[M])(p.data + (n0 - p.n0) * p.row_bytes, p.row_bytes, n1 - n0, end, a, p.nb, 0,
                                         y + n0, ldy);
  }
  static const TileFn panels = cbserve::cpu_has_vnni() ? panels_k_vnni(T) : panels_k_avx2(T);
  panels(p, n0, n1, a, M, y, ldy);
}

}  // namespace

TileFn tile_k_a8(int64_t type) {
  TileFn f = nullptr;
  cbserve::with_value<Q2_K, Q3_K, Q4_K, Q5_K, Q6_K>(type, [&](auto t) { f = tile_k<decltype(t)::value>; });
  return f;
}

}  // namespace cbserve_kquant
