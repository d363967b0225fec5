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
// (each weight is used once and streams from DRAM). More (prefill) meet a tile of weight rows
// unpacked once into the very vectors the file-row path builds in registers, scales included, in
// micro-tiles (dot_u) of 2 weight rows x 4 activation rows whose 8 integer sums stay in registers:
// each activation vector then serves 2 weight rows and each weight vector 4 activation rows.
//
// Batch invariance: every (weight row, activation row) pair goes through the same integer lanes,
// the same fp32 multiply-adds per block in block order and the same final reduction (reduce4),
// whatever NR and R are and whichever path, so the tiles may group rows as they like. On
// AVX512-VNNI CPUs prefill runs on kquant_k_vnni.cpp's panels instead, Q4_K / Q5_K decode on
// kquant_k_rows_vnni.cpp's 512-bit rows, and the other formats' decode here takes their arithmetic
// (EXACT: whole-block integers, then one fp32 chain per pair).
#include "kquant_k.h"

namespace cbserve_kquant {
namespace {

// res[i] = the horizontal sum of acc[i], i < n <= 4, by one fixed tree whatever n is (the missing
// vectors are zeros, and lanes of different vectors never meet).
inline void reduce4(const __m256* acc, int n, float* res) {
  const __m256 z = _mm256_setzero_ps();
  const __m256 a0 = acc[0], a1 = n > 1 ? acc[1] : z, a2 = n > 2 ? acc[2] : z, a3 = n > 3 ? acc[3] : z;
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  alignas(16) float out[4];
  _mm_store_ps(out, s);
  for (int i = 0; i < n; ++i) res[i] = out[i];
}

// The micro-kernel of prefill: NR unpacked weight rows (`stride` apart) against activation rows
// r0 .. r0 + R, all NR x R integer sums in registers, so each activation vector is loaded once
// for NR weight rows and each weight vector once for R activation rows. `pairs`: Q4_K / Q5_K's
// activation sums per 32 for every (activation row, block), made once per call.
// res[n * R + r]: the same lanes, fp32 operations and reduce4 as dot_k on the file's rows.
template <int T, int NR, int R>
void dot_u(const uint8_t* w, int64_t stride, const Acts& a, const int16_t* pairs, int64_t r0, int64_t nb,
           float* res) {
  constexpr int64_t UB = unpacked_block<T>();
  __m256 acc[NR * R];
  for (int i = 0; i < NR * R; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t nbx = a.K / 256;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk[NR];
    for (int n = 0; n < NR; ++n) blk[n] = w + n * stride + b * UB;
    const int8_t* x[R];
    for (int r = 0; r < R; ++r) x[r] = a.q256 + ((r0 + r) * nbx + b) * 256;
    __m256i sumi[NR * R];
    for (int i = 0; i < NR * R; ++i) sumi[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int v = 0; v < 8; ++v) {
      __m256i wv[NR];
      for (int n = 0; n < NR; ++n) wv[n] = load256(blk[n] + 32 * v);
      for (int r = 0; r < R; ++r) {
        const __m256i xv = load256(x[r] + 32 * v);
        for (int n = 0; n < NR; ++n) {
          __m256i& s = sumi[n * R + r];
          s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(wv[n], xv), load256(blk[n] + 256 + 32 * v)));
          keep(s);
        }
      }
    }
    for (int n = 0; n < NR; ++n) {
      float d[2];
      std::memcpy(d, blk[n] + (scaled16(T) ? 544 : 528), 8);
      const __m256 vd = _mm256_set1_ps(d[0]);
      for (int r = 0; r < R; ++r) {
        const int64_t rb = (r0 + r) * nbx + b;
        const __m256 dx = _mm256_set1_ps(a.d256[rb]);
        __m256& c = acc[n * R + r];
        if constexpr (T == Q2_K) {
          const __m256i pm = _mm256_madd_epi16(load256(blk[n] + 512), load256(a.bs16 + rb * 16));
          c = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[n * R + r]), _mm256_mul_ps(vd, dx), c);
          c = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(pm), _mm256_mul_ps(_mm256_set1_ps(d[1]), dx), c);
        } else if constexpr (scaled16(T)) {
          const __m256i off = _mm256_madd_epi16(load256(blk[n] + 512), load256(a.bs16 + rb * 16));
          const __m256i tot = _mm256_sub_epi32(sumi[n * R + r], _mm256_slli_epi32(off, k16_offset_shift(T)));
          c = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_mul_ps(vd, dx), c);
        } else {
          const __m128i mins = _mm_load_si128(reinterpret_cast<const __m128i*>(blk[n] + 512));
          const __m128i pr = _mm_loadu_si128(reinterpret_cast<const __m128i*>(pairs + 8 * rb));
          const __m256i pm = _mm256_zextsi128_si256(_mm_madd_epi16(mins, pr));
          c = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[n * R + r]), _mm256_mul_ps(vd, dx), c);
          c = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(pm), _mm256_mul_ps(_mm256_set1_ps(d[1]), dx), c);
        }
      }
    }
  }
  for (int i = 0; i < NR * R; i += 4) reduce4(acc + i, std::min(4, NR * R - i), res + i);
}

// Unpacked rows [0, count) against activation rows m0 .. m0 + R in micro-tiles of 2 weight rows.
template <int T, int R>
void rows_u(const uint8_t* first, int64_t stride, int64_t count, const Acts& a, const int16_t* pairs, int64_t nb,
            int64_t m0, float* y, int64_t ldy) {
  constexpr int NR = 2;
  float res[NR * R];
  int64_t i = 0;
  for (; i + NR <= count; i += NR) {
    dot_u<T, NR, R>(first + i * stride, stride, a, pairs, m0, nb, res);
    for (int k = 0; k < NR; ++k)
      for (int r = 0; r < R; ++r) y[(m0 + r) * ldy + i + k] = res[k * R + r];
  }
  for (; i < count; ++i) {
    dot_u<T, 1, R>(first + i * stride, stride, a, pairs, m0, nb, res);
    for (int r = 0; r < R; ++r) y[(m0 + r) * ldy + i] = res[r];
  }
}

// NR weight rows w[n] (nb blocks of type T each, the file's) against activation rows r0 .. r0 + R:
// res[n * R + r] = sum_k w[n][k] x[r0 + r][k].
// Per block and (weight row, activation row) pair the integer lanes give I1 (the scaled sum, an
// offset taken out) and I2 (the minimums' term); then c += I1 (d dx) - I2 (dmin dx) in fp32.
// EXACT = false (AVX2 CPUs): c is 8 lanes of partial sums, reduced once at the end (reduce4).
// EXACT = true (AVX512-VNNI CPUs): each block's I1 and I2 are summed across lanes first (exact
// integers), so c is one float per pair: the arithmetic of the VNNI panels, which compute the
// same whole-block integers in another order (kquant_k_vnni.cpp).
template <int T, int NR, int R, bool EXACT>
void dot_k(const uint8_t* const* w, const Acts& a, int64_t r0, int64_t nb, float* res, const uint8_t* pf) {
  constexpr int64_t BB = block_bytes(T);
  const bool pf_l2 = NR * nb * BB > L1_GROUP_BYTES;
  static_assert(!EXACT || NR * R <= 8, "the exact epilogue keeps one lane per pair");
  __m256 acc[NR * R];
  for (int i = 0; i < NR * R; ++i) acc[i] = _mm256_setzero_ps();
  // EXACT: pair n * R + r's integer vectors, I1 at [pair] and I2 at [I2_AT + pair] (up to 4 pairs
  // share one reduction), and its float in lane n * R + r.
  constexpr int PAIRS = NR * R, I2_AT = PAIRS <= 4 ? 4 : 8;
  __m256i ints[16];
  for (int i = 0; i < 16; ++i) ints[i] = _mm256_setzero_si256();
  __m128 exact4 = _mm_setzero_ps();
  __m256 exact8 = _mm256_setzero_ps();
  const int64_t nbx = a.K / 256;
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_slice(pf, b, NR * BB, pf_l2);
    // The activation rows' share of the block, used by every weight row.
    const int8_t* x[R];
    __m256 dx[R];
    __m128i pairs[R];  // Q4_K / Q5_K: the sums per 32 (one per min)
    __m256i bs[R];     // Q6_K / Q3_K / Q2_K: the sums per 16 (one per scale)
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * nbx + b;
      x[r] = a.q256 + rb * 256;
      dx[r] = _mm256_set1_ps(a.d256[rb]);
      const int16_t* s16 = a.bs16 + rb * 16;
      if constexpr (scaled16(T)) {
        bs[r] = load256(s16);
      } else {
        pairs[r] = pair_sums(s16);
      }
    }
    alignas(32) float dn[8] = {}, dminn[8] = {};  // EXACT: each pair's d and dmin
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
        const __m128i sc = k16_scales<T>(blk);
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
      if constexpr (EXACT) {
        for (int r = 0; r < R; ++r) {
          ints[n * R + r] = sumi[r];
          if constexpr (has_min(T)) ints[I2_AT + n * R + r] = i2[r];
          dn[n * R + r] = d;
          dminn[n * R + r] = dmin;
        }
      } else {
        const __m256 vd = _mm256_set1_ps(d), vdmin = _mm256_set1_ps(dmin);
        for (int r = 0; r < R; ++r) {
          __m256& c = acc[n * R + r];
          c = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_mul_ps(vd, dx[r]), c);
          if constexpr (has_min(T)) c = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(i2[r]), _mm256_mul_ps(vdmin, dx[r]), c);
        }
      }
    }
    if constexpr (EXACT) {
      alignas(32) float dxs[8] = {};
      for (int n = 0; n < NR; ++n)
        for (int r = 0; r < R; ++r) dxs[n * R + r] = a.d256[(r0 + r) * nbx + b];
      exact_block<PAIRS, has_min(T)>(ints, dn, dminn, dxs, exact4, exact8);
    }
  }
  if constexpr (EXACT) {
    exact_result<PAIRS>(exact4, exact8, res);
  } else {
    for (int i = 0; i < NR * R; i += 4) reduce4(acc + i, std::min(4, NR * R - i), res + i);
  }
}

// Decode's rows (rows_of, kquant_k.h) through dot_k.
template <int T, int R, bool EXACT>
void rows_k(const uint8_t* first, int64_t stride, int64_t count, const uint8_t* end, const Acts& a, int64_t nb,
            int64_t m0, float* y, int64_t ldy) {
  constexpr int NR = R <= 2 ? 4 : 2;
  rows_of<NR, R, dot_k<T, NR, R, EXACT>, dot_k<T, 1, R, EXACT>>(first, stride, count, end, a, nb, m0, y, ldy);
}

// EXACT: the AVX512-VNNI CPUs' arithmetic (dot_k); prefill then runs on the VNNI panels.
template <int T, bool EXACT>
void tile_k(const Part& p, int64_t n0, int64_t n1, const Acts& a, int64_t M, float* y, int64_t ldy) {
  static const RowsFn file_rows[MR + 1] = {nullptr, rows_k<T, 1, EXACT>, rows_k<T, 2, EXACT>, rows_k<T, 3, EXACT>,
                                           rows_k<T, 4, EXACT>};
  using URowsFn = void (*)(const uint8_t*, int64_t, int64_t, const Acts&, const int16_t*, int64_t, int64_t, float*,
                           int64_t);
  static const URowsFn unpacked_rows[MR + 1] = {nullptr, rows_u<T, 1>, rows_u<T, 2>, rows_u<T, 3>, rows_u<T, 4>};
  const uint8_t* end = p.data + p.rows * p.row_bytes;
  if (M <= MR) {
    RowsFn rows = file_rows[M];
    if constexpr (EXACT) {  // the 512-bit rows where the format has them (the same bits)
      static const RowsFn wide[MR + 1] = {nullptr, rows_k_vnni(T, 1), rows_k_vnni(T, 2), rows_k_vnni(T, 3),
                                          rows_k_vnni(T, 4)};
      if (wide[M]) rows = wide[M];
    }
    return rows(p.data + (n0 - p.n0) * p.row_bytes, p.row_bytes, n1 - n0, end, a, p.nb, 0, y + n0, ldy);
  }
  if constexpr (EXACT) {
    static const TileFn panels = panels_k_vnni(T);
    return panels(p, n0, n1, a, M, y, ldy);
  }
  // More activation rows (prefill): a tile of nt weight rows is unpacked once, then stays in
  // cache while every MR activation rows meet it: up to 16 rows, fewer (an even count) for long
  // rows so that the tile stays well inside L2 next to the activations.
  const int64_t ub = p.nb * unpacked_block<T>(), nbx = a.K / 256;
  const int64_t nt = std::clamp<int64_t>(((int64_t(128) << 10) / ub) & ~int64_t(1), 2, 16);
  // The tile, then Q4_K / Q5_K's activation sums per 32 (one per min), shared by every weight row.
  uint8_t* buf = scratch(nt * ub + (!scaled16(T) ? 16 * M * nbx : 0));
  int16_t* pairs = reinterpret_cast<int16_t*>(buf + nt * ub);
  if constexpr (!scaled16(T)) pair_sums_all(a, M, pairs);
  for (int64_t t0 = n0; t0 < n1; t0 += nt) {
    const int64_t t1 = std::min(n1, t0 + nt);
    for (int64_t n = t0; n < t1; ++n) unpack_k<T>(p.data + (n - p.n0) * p.row_bytes, p.nb, buf + (n - t0) * ub);
    // The next tile's file bytes are fetched while this one is computed, a slice per activation
    // tile (the unpacking would otherwise wait on DRAM row by row).
    const uint8_t* next = p.data + (t1 - p.n0) * p.row_bytes;
    const int64_t next_bytes = std::min(nt, n1 - t1) * p.row_bytes, steps = (M + MR - 1) / MR;
    const int64_t slice = (next_bytes / steps + 63) & ~int64_t(63);
    for (int64_t m0 = 0, s = 0; m0 < M; m0 += MR, ++s) {
      for (int64_t o = s * slice; o < std::min(next_bytes, (s + 1) * slice); o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next + o), _MM_HINT_T0);
      unpacked_rows[std::min<int64_t>(MR, M - m0)](buf, ub, t1 - t0, a, pairs, p.nb, m0, y + t0, ldy);
    }
  }
}

}  // namespace

TileFn tile_k_a8(int64_t type) {
  const bool vnni = cbserve::cpu_has_vnni();
  TileFn f = nullptr;
  cbserve::with_value<Q2_K, Q3_K, Q4_K, Q5_K, Q6_K>(type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    f = vnni ? tile_k<T, true> : tile_k<T, false>;
  });
  return f;
}

}  // namespace cbserve_kquant
