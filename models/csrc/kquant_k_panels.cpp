// The K formats (Q2_K .. Q6_K) for many activation rows on AVX2 CPUs without VNNI: prefill and
// batched decode of a GGUF file's rows.
//
// A thread's outputs go 8 at a time into a panel: the 8 rows laid out so that one 32-byte vector
// holds the same four values of all 8 rows, then per block each sub-block's scale as an int16 pair
// a row, the correction values (the mins, or Q6_K / Q3_K's scales per 16, Q2_K's minimums) as
// int16 pairs, d and dmin. A panel is built once a call and met by every activation row: a group
// of four values meets an activation row's four bytes (broadcast) in vpmaddubsw, and its int16 pair
// sums are added in int16 over as many groups as cannot overflow (a whole 32-value sub-block of
// Q4_K, half of one of Q5_K, an eighth of a Q6_K block's 16-value sub-block pair) before one
// vpmaddwd applies the sub-scale. That is about one multiply per 32 products where the file-row
// kernel (kquant_k.cpp's dot_k) spends two, and no horizontal sums: a lane is an output.
//
// The arithmetic is dot_k's exact one: per block, I1 and I2 are whole integers (the same numbers
// in any order), then c += I1 (d dx) - I2 (dmin dx) in fp32, one lane per output, so an activation
// row's result is the same bits here and on the file-row path of decode.
#include "kquant_k.h"

namespace cbserve_kquant {
namespace {

constexpr int PANEL = 8;  // outputs a panel (one 32-bit lane each)
constexpr int RA = 4;     // activation rows a micro-kernel call (with the panel: 10 of the 16 vectors)

template <int T>
constexpr int subs() {
  return scaled16(T) ? 16 : 8;
}
// Groups of four values that may be summed in int16 lanes before the sub-scale: each vpmaddubsw
// lane is at most 2 x umax x 127 (activations are within +-127), the sum must stay below 2^15.
template <int T>
constexpr int chunk() {
  constexpr int umax = T == Q4_K ? 15 : T == Q5_K ? 31 : T == Q6_K ? 63 : T == Q3_K ? 7 : 3;
  constexpr int fit = 32767 / (2 * umax * 127), groups = 64 / subs<T>();
  return fit < groups ? fit : groups;
}
static_assert(chunk<Q4_K>() == 8 && chunk<Q5_K>() == 4 && chunk<Q6_K>() == 2 && chunk<Q3_K>() == 4);

// A panel's block: values (64 groups of 4 values x 8 rows), sub-scales (an int16 pair a row), the
// correction pairs, d and dmin (8 floats each).
constexpr int64_t PANEL_SCALES = 2048;  // after the values
template <int T>
constexpr int64_t panel_corr() {
  return PANEL_SCALES + 32 * subs<T>();
}
template <int T>
constexpr int64_t panel_dd() {
  return PANEL_SCALES + 48 * subs<T>();
}
template <int T>
constexpr int64_t panel_block() {
  return panel_dd<T>() + 64;
}

// Rows t0 .. t0 + rows of the part (rows <= 8; the panel's other lanes are zeros) into `panel`,
// block by block through unpack_k (`tmp`: 8 unpacked blocks).
template <int T>
void build_panel(const Part& p, int64_t t0, int64_t rows, uint8_t* tmp, uint8_t* panel) {
  constexpr int64_t UB = unpacked_block<T>(), PB = panel_block<T>(), NS = subs<T>();
  for (int64_t b = 0; b < p.nb; ++b) {
    for (int64_t i = 0; i < PANEL; ++i) {
      uint8_t* dst = tmp + i * UB;
      if (i < rows)
        unpack_k<T>(p.data + (t0 + i - p.n0) * p.row_bytes + b * block_bytes(T), 1, dst);
      else
        std::memset(dst, 0, UB);
    }
    uint8_t* pb = panel + b * PB;
    for (int v = 0; v < 8; ++v) {  // values 32 v .. 32 v + 31 of the 8 rows: groups 8 v .. 8 v + 7
      __m256i r[8];
      for (int i = 0; i < PANEL; ++i) r[i] = load256(tmp + i * UB + 32 * v);
      cbserve::transpose8(r);
      for (int g = 0; g < 8; ++g) _mm256_store_si256(reinterpret_cast<__m256i*>(pb + 32 * (8 * v + g)), r[g]);
    }
    for (int64_t i = 0; i < PANEL; ++i) {
      const uint8_t* u = tmp + i * UB;
      int16_t corr[NS];
      std::memcpy(corr, u + K_CORR, sizeof(corr));
      for (int s = 0; s < NS; ++s) {
        int16_t sc[2];
        std::memcpy(sc, u + k_scale_at<T>(s), 2);
        sc[1] = sc[0];
        std::memcpy(pb + PANEL_SCALES + 32 * s + 4 * i, sc, 4);
      }
      for (int q = 0; q < NS / 2; ++q) std::memcpy(pb + panel_corr<T>() + 32 * q + 4 * i, corr + 2 * q, 4);
      std::memcpy(pb + panel_dd<T>() + 4 * i, u + k_dd<T>(), 4);
      std::memcpy(pb + panel_dd<T>() + 32 + 4 * i, u + k_dd<T>() + 4, 4);
    }
  }
}

// Bytes at .. at + 15 of 8 blocks as four vectors: dword d of every row, lane i row i's.
inline void lanes8x4(const uint8_t* const* blk, int64_t at, __m256i v[4]) {
  __m256i z[4], t[4];
  for (int i = 0; i < 4; ++i)
    z[i] = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(blk[4 + i] + at),
                               reinterpret_cast<const __m128i*>(blk[i] + at));
  t[0] = _mm256_unpacklo_epi32(z[0], z[1]);
  t[1] = _mm256_unpackhi_epi32(z[0], z[1]);
  t[2] = _mm256_unpacklo_epi32(z[2], z[3]);
  t[3] = _mm256_unpackhi_epi32(z[2], z[3]);
  v[0] = _mm256_unpacklo_epi64(t[0], t[2]);
  v[1] = _mm256_unpackhi_epi64(t[0], t[2]);
  v[2] = _mm256_unpacklo_epi64(t[1], t[3]);
  v[3] = _mm256_unpackhi_epi64(t[1], t[3]);
}

// Eight fp16 values, the low 16 bits of each lane, as floats.
inline __m256 halves8(__m256i v) {
  const __m256i h = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
  return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}

// Two int32 vectors' low 16 bits as int16 pairs (a in the low half of each lane, b the high).
inline __m256i pair16(__m256i a, __m256i b) {
  return _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(b, 16));
}

inline void store256(uint8_t* at, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(at), v); }

// Q4_K's panel straight from the file's bytes (no unpack_k): a chunk of 32 nibble bytes (byte
// 32 j + 4 q + t holds value 64 j + 4 q + t low, 64 j + 32 + 4 q + t high) transposed as dwords,
// split into the two groups; the scales and mins by scales_k4's bit moves on all 8 rows at once.
// The same panel as build_panel's.
void build_panel_q4k(const Part& p, int64_t t0, int64_t rows, uint8_t* panel) {
  constexpr int64_t PB = panel_block<Q4_K>();
  alignas(32) static const uint8_t zeros[block_bytes(Q4_K)] = {};
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < p.nb; ++b) {
    uint8_t* pb = panel + b * PB;
    const uint8_t* blk[PANEL];
    panel_blocks<Q4_K, PANEL>(p, t0, rows, b, zeros, blk);
    for (int j = 0; j < 4; ++j) {
      __m256i v[8];
      for (int i = 0; i < PANEL; ++i) v[i] = load256(blk[i] + 16 + 32 * j);
      cbserve::transpose8(v);
      for (int q = 0; q < 8; ++q) {
        store256(pb + 32 * (16 * j + q), _mm256_and_si256(v[q], m4));
        store256(pb + 32 * (16 * j + 8 + q), _mm256_and_si256(_mm256_srli_epi16(v[q], 4), m4));
      }
    }
    // dword 0: d, dmin; 1: sc0..3; 2: mn0..3; 3: the low / high nibbles of sc4..7 / mn4..7
    __m256i v[4];
    lanes8x4(blk, 0, v);
    const __m256i m63 = _mm256_set1_epi32(63), m15 = _mm256_set1_epi32(15), m48 = _mm256_set1_epi32(48);
    __m256i mn[8];
    for (int k = 0; k < 4; ++k) {
      const __m256i sc_lo = _mm256_and_si256(_mm256_srli_epi32(v[1], 8 * k), m63);
      const __m256i sc_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(v[3], 8 * k), m15),
                                            _mm256_and_si256(_mm256_srli_epi32(v[1], 8 * k + 2), m48));
      mn[k] = _mm256_and_si256(_mm256_srli_epi32(v[2], 8 * k), m63);
      mn[4 + k] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(v[3], 8 * k + 4), m15),
                                  _mm256_and_si256(_mm256_srli_epi32(v[2], 8 * k + 2), m48));
      store256(pb + PANEL_SCALES + 32 * k, pair16(sc_lo, sc_lo));
      store256(pb + PANEL_SCALES + 32 * (4 + k), pair16(sc_hi, sc_hi));
    }
    for (int q = 0; q < 4; ++q) store256(pb + panel_corr<Q4_K>() + 32 * q, pair16(mn[2 * q], mn[2 * q + 1]));
    _mm256_store_ps(reinterpret_cast<float*>(pb + panel_dd<Q4_K>()), halves8(v[0]));
    _mm256_store_ps(reinterpret_cast<float*>(pb + panel_dd<Q4_K>() + 32), halves8(_mm256_srli_epi32(v[0], 16)));
  }
}

// Q6_K's panel straight from the file's bytes: per half, its 64 bytes of low nibbles and 32 of
// high bit pairs transposed as dwords, then q6k_values' bit moves on the 8 rows at once; its 16
// int8 scales as the sub-scales and as the offset's pairs. The same panel as build_panel's.
void build_panel_q6k(const Part& p, int64_t t0, int64_t rows, uint8_t* panel) {
  constexpr int64_t PB = panel_block<Q6_K>();
  alignas(32) static const uint8_t zeros[block_bytes(Q6_K)] = {};
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  for (int64_t b = 0; b < p.nb; ++b) {
    uint8_t* pb = panel + b * PB;
    const uint8_t* blk[PANEL];
    panel_blocks<Q6_K, PANEL>(p, t0, rows, b, zeros, blk);
    for (int n = 0; n < 2; ++n) {
      __m256i l0[8], l1[8], hb[8];
      for (int i = 0; i < PANEL; ++i) {
        l0[i] = load256(blk[i] + 64 * n);
        l1[i] = load256(blk[i] + 64 * n + 32);
        hb[i] = load256(blk[i] + 128 + 32 * n);
      }
      cbserve::transpose8(l0);
      cbserve::transpose8(l1);
      cbserve::transpose8(hb);
      for (int d = 0; d < 8; ++d) {
        const __m256i u[4] = {
            _mm256_or_si256(_mm256_and_si256(l0[d], m4), _mm256_and_si256(_mm256_slli_epi16(hb[d], 4), m30)),
            _mm256_or_si256(_mm256_and_si256(l1[d], m4), _mm256_and_si256(_mm256_slli_epi16(hb[d], 2), m30)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0[d], 4), m4), _mm256_and_si256(hb[d], m30)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1[d], 4), m4),
                            _mm256_and_si256(_mm256_srli_epi16(hb[d], 2), m30))};
        for (int k = 0; k < 4; ++k) store256(pb + 32 * (32 * n + 8 * k + d), u[k]);
      }
    }
    __m256i v[4];
    lanes8x4(blk, 192, v);
    __m256i sc[16];
    for (int s = 0; s < 16; ++s) {
      sc[s] = _mm256_srai_epi32(_mm256_slli_epi32(v[s / 4], 24 - 8 * (s % 4)), 24);
      store256(pb + PANEL_SCALES + 32 * s, pair16(sc[s], sc[s]));
    }
    for (int q = 0; q < 8; ++q) store256(pb + panel_corr<Q6_K>() + 32 * q, pair16(sc[2 * q], sc[2 * q + 1]));
    alignas(32) float d[PANEL];
    for (int i = 0; i < PANEL; ++i) d[i] = fp16(blk[i] + 208);
    std::memcpy(pb + panel_dd<Q6_K>(), d, sizeof(d));
    std::memset(pb + panel_dd<Q6_K>() + 32, 0, 32);
  }
}

// vpmaddwd on two registers: given the choice GCC stores the int16 sums to the stack to hand
// vpmaddwd a memory operand, and the reload waits on the store.
inline __m256i madd_rr(__m256i a, __m256i b) {
  __m256i out;
  asm("vpmaddwd %2, %1, %0" : "=x"(out) : "x"(a), "x"(b));
  return out;
}

// The panel against activation rows r0 .. r0 + R, adding into c[r * 8 + lane] (zeroed by the
// caller). `corr`: per (activation row, block) the sums that meet the correction pairs: Q4_K /
// Q5_K's sums per 32 (8 int16), the others' sums per 16. `pf` (or null): bytes to prefetch into
// L1 (or L2 with `pf_l2`), 8 blocks' worth a block (prefetch_slice).
template <int T, int R>
void panel_dot(const uint8_t* panel, int64_t nb, const Acts& a, const int16_t* corr, int64_t r0, float* c,
               const uint8_t* pf, bool pf_l2) {
  constexpr int64_t PB = panel_block<T>();
  constexpr int NS = subs<T>(), GS = 64 / NS, CH = chunk<T>(), CW = scaled16(T) ? 16 : 8;
  const int64_t nbx = a.K / 256;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* pb = panel + b * PB;
    prefetch_slice(pf, b, PANEL * block_bytes(T), pf_l2);
    const int8_t* x[R];
    for (int r = 0; r < R; ++r) x[r] = a.q256 + ((r0 + r) * nbx + b) * 256;
    __m256i i1[R];
    for (int r = 0; r < R; ++r) i1[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int s = 0; s < NS; ++s) {
#pragma GCC unroll 2
      for (int h = 0; h < GS / CH; ++h) {
        __m256i p16[R];
        for (int r = 0; r < R; ++r) p16[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int g = 0; g < CH; ++g) {
          const int grp = s * GS + h * CH + g;
          const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(pb + 32 * grp));
          for (int r = 0; r < R; ++r) {
            const __m256i xv = _mm256_set1_epi32(cbserve::load_i32(x[r] + 4 * grp));
            p16[r] = _mm256_add_epi16(p16[r], _mm256_maddubs_epi16(w, xv));
            keep(p16[r]);
          }
        }
        const __m256i sc = _mm256_load_si256(reinterpret_cast<const __m256i*>(pb + PANEL_SCALES + 32 * s));
        for (int r = 0; r < R; ++r) i1[r] = _mm256_add_epi32(i1[r], madd_rr(p16[r], sc));
      }
    }
    __m256i i2[R];
    for (int r = 0; r < R; ++r) i2[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int q = 0; q < NS / 2; ++q) {
      const __m256i cv = _mm256_load_si256(reinterpret_cast<const __m256i*>(pb + panel_corr<T>() + 32 * q));
      for (int r = 0; r < R; ++r) {
        const int16_t* src = corr + ((r0 + r) * nbx + b) * CW;
        i2[r] = _mm256_add_epi32(i2[r], _mm256_madd_epi16(cv, _mm256_set1_epi32(cbserve::load_i32(src + 2 * q))));
      }
    }
    const __m256 vd = _mm256_load_ps(reinterpret_cast<const float*>(pb + panel_dd<T>()));
    const __m256 vdmin = _mm256_load_ps(reinterpret_cast<const float*>(pb + panel_dd<T>() + 32));
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_set1_ps(a.d256[(r0 + r) * nbx + b]);
      __m256 acc = _mm256_load_ps(c + PANEL * r);
      if constexpr (has_min(T)) {
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1[r]), _mm256_mul_ps(vd, dx), acc);
        acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(i2[r]), _mm256_mul_ps(vdmin, dx), acc);
      } else {
        const __m256i tot = _mm256_sub_epi32(i1[r], _mm256_slli_epi32(i2[r], k16_offset_shift(T)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_mul_ps(vd, dx), acc);
      }
      _mm256_store_ps(c + PANEL * r, acc);
    }
  }
}

template <int T>
void panels_k(const Part& p, int64_t n0, int64_t n1, const Acts& a, int64_t M, float* y, int64_t ldy) {
  constexpr int64_t UB = unpacked_block<T>();
  const int64_t nb = p.nb, nbx = a.K / 256, panel_bytes = nb * panel_block<T>();
  const int64_t tmp_bytes = T == Q4_K || T == Q6_K ? 0 : PANEL * UB;
  uint8_t* buf = scratch(panel_bytes + tmp_bytes + (!scaled16(T) ? 16 * M * nbx : 0));
  uint8_t* panel = buf;
  uint8_t* tmp = buf + panel_bytes;
  const int16_t* corr = a.bs16;
  if constexpr (!scaled16(T)) {  // Q4_K / Q5_K's minimums meet the sums per 32
    int16_t* pairs = reinterpret_cast<int16_t*>(tmp + tmp_bytes);
    pair_sums_all(a, M, pairs);
    corr = pairs;
  }
  alignas(32) float c[RA * PANEL];
  const bool pf_l2 = PANEL * p.row_bytes > L1_GROUP_BYTES;
  for (int64_t t0 = n0; t0 < n1; t0 += PANEL) {
    const int64_t rows = std::min<int64_t>(PANEL, n1 - t0);
    if constexpr (T == Q4_K)
      build_panel_q4k(p, t0, rows, panel);
    else if constexpr (T == Q6_K)
      build_panel_q6k(p, t0, rows, panel);
    else
      build_panel<T>(p, t0, rows, tmp, panel);
    for (int64_t m0 = 0; m0 < M; m0 += RA) {
      const int64_t mr = std::min<int64_t>(RA, M - m0);
      for (float& v : c) v = 0.f;
      // The first activation rows' pass fetches the next panel's rows (contiguous in the file), a
      // slice a block, so its build does not wait on memory (docs/benchmarks.md).
      const uint8_t* pf = m0 == 0 && t0 + PANEL < n1 ? p.data + (t0 + PANEL - p.n0) * p.row_bytes : nullptr;
      cbserve::with_count<RA>(
          mr, [&](auto r) { panel_dot<T, decltype(r)::value>(panel, nb, a, corr, m0, c, pf, pf_l2); });
      for (int64_t r = 0; r < mr; ++r)
        for (int64_t i = 0; i < rows; ++i) y[(m0 + r) * ldy + t0 + i] = c[PANEL * r + i];
    }
  }
}

}  // namespace

TileFn panels_k_avx2(int64_t type) {
  TileFn f = nullptr;
  cbserve::with_value<Q2_K, Q3_K, Q4_K, Q5_K, Q6_K>(type, [&](auto t) { f = panels_k<decltype(t)::value>; });
  return f;
}

}  // namespace cbserve_kquant
