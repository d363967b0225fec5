// The K formats (Q2_K .. Q6_K) for many activation rows on AVX512-VNNI CPUs: prefill and batched
// decode of a GGUF file's rows.
//
// A thread's outputs go 16 at a time into a panel: the 16 rows laid out so that one 64-byte vector
// holds the same four values of all 16 rows, then per block the sub-scales as int32, the minimums
// (or Q6_K / Q3_K's scales per 16) as int16 pairs, d and dmin. Q4_K and Q6_K (a Q4_K_M file's
// formats) are built from the file's bytes, transposed as dwords before their bits are split; the
// others from unpack_k's rows.
// A panel is built once and met by every activation row, 8 at a time: a sub-block's values meet
// an activation row's four bytes (broadcast) in vpdpbusd, 16 outputs x 4 values each, and its
// sub-scale is applied once per sub-block with one vpmulld; the minimums' term is vpdpwssd against
// the activation sums. No horizontal sums: a lane is an output.
//
// The arithmetic is dot_k's exact one (kquant_k.cpp): per block, I1 and I2 are whole integers (the
// same numbers in any order), then c += I1 (d dx) - I2 (dmin dx) in fp32, one lane per output, so
// an activation row's result is the same bits here and on the file-row path of decode.
//
// With AMX (cbserve::cpu_has_amx), Q4_K and Q5_K meet sixteen activation rows at a time on the
// tiles instead. Their 6-bit sub-scales go into a copy of the values as two 3-bit digits, small
// enough that a value times one is still a byte (split_scales), so a block's I1 = sum over
// sub-blocks of sc (x . q) is two tile dots over all 256 inputs, with no scaling between
// sub-blocks. The minimums' term and the fp32 step are then the VNNI rows' own: the same bits.
#include "kquant_k.h"

namespace cbserve_kquant {
namespace {

constexpr int PANEL = 16;  // outputs a panel (one 512-bit lane each)
constexpr int RA = 8;      // activation rows a micro-kernel call

template <int T>
constexpr int subs() {
  return scaled16(T) ? 16 : 8;
}
// A panel's block: values (64 groups of 4 values x 16 rows), sub-scales (int32), the correction
// pairs (two int16 a row), d and dmin (16 floats each).
template <int T>
constexpr int64_t panel_block() {
  return 4096 + 96 * subs<T>() + 128;
}
constexpr int64_t PANEL_SCALES = 4096;  // after the values
template <int T>
constexpr int64_t panel_corr() {
  return 4096 + 64 * subs<T>();
}
template <int T>
constexpr int64_t panel_dd() {
  return 4096 + 96 * subs<T>();
}

// Lane i of a panel block's scalars: the sub-scales as int32, the correction values (the mins, or
// the scales per 16) as int16 pairs, d and dmin.
template <int T, typename S, typename C>
CB_VNNI inline void put_lane(uint8_t* pb, int64_t i, const S* sc, const C* corr, float d, float dmin) {
  for (int s = 0; s < subs<T>(); ++s) {
    const int32_t v = sc[s];
    std::memcpy(pb + PANEL_SCALES + 64 * s + 4 * i, &v, 4);
  }
  for (int q = 0; q < subs<T>() / 2; ++q) {
    const int16_t c2[2] = {static_cast<int16_t>(corr[2 * q]), static_cast<int16_t>(corr[2 * q + 1])};
    std::memcpy(pb + panel_corr<T>() + 64 * q + 4 * i, c2, 4);
  }
  std::memcpy(pb + panel_dd<T>() + 4 * i, &d, 4);
  std::memcpy(pb + panel_dd<T>() + 64 + 4 * i, &dmin, 4);
}

// Bytes at .. at + 15 of 16 blocks (blk[i], row i's) as four vectors: dword d of every row, lane i
// row i's (a 16 x 4 dword transpose by two-source permutes).
CB_VNNI inline void lanes16x16(const uint8_t* const* blk, int64_t at, __m512i v[4]) {
  __m512i z[4];
  for (int g = 0; g < 4; ++g) {
    auto row = [&](int r) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[4 * g + r] + at)); };
    const __m512i two = _mm512_inserti32x4(_mm512_castsi128_si512(row(0)), row(1), 1);
    z[g] = _mm512_inserti32x4(_mm512_inserti32x4(two, row(2), 2), row(3), 3);
  }
  for (int d = 0; d < 4; ++d) {
    // lane i < 8: row i's dword d in z[i / 4] (index 4 (i % 4) + d, + 16 for the second source)
    alignas(64) int32_t idx[16];
    for (int i = 0; i < 16; ++i) idx[i] = 16 * ((i / 4) % 2) + 4 * (i % 4) + d;
    const __m512i ix = _mm512_load_si512(idx);
    v[d] = _mm512_mask_blend_epi32(0xFF00, _mm512_permutex2var_epi32(z[0], ix, z[1]),
                                   _mm512_permutex2var_epi32(z[2], ix, z[3]));
  }
}

// 16 fp16 values (blk[i] + at) as floats, lane i row i's.
CB_VNNI inline __m512 halves16(const uint8_t* const* blk, int64_t at) {
  alignas(32) uint16_t h[16];
  for (int i = 0; i < 16; ++i) std::memcpy(h + i, blk[i] + at, 2);
  return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(h)));
}

// Rows t0 .. t0 + rows of the part (rows <= 16; the panel's other lanes are zeros) into `panel`;
// `tmp` holds 16 unpacked rows.
template <int T>
CB_VNNI void build_panel(const Part& p, int64_t t0, int64_t rows, uint8_t* tmp, uint8_t* panel) {
  constexpr int64_t UB = unpacked_block<T>(), PB = panel_block<T>(), NS = subs<T>();
  const int64_t nb = p.nb, row_ub = nb * UB;
  for (int64_t i = 0; i < PANEL; ++i) {
    uint8_t* dst = tmp + i * row_ub;
    if (i < rows)
      unpack_k<T>(p.data + (t0 + i - p.n0) * p.row_bytes, nb, dst);
    else
      std::memset(dst, 0, row_ub);
  }
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* pb = panel + b * PB;
    for (int q = 0; q < 4; ++q) {  // values 64 q .. 64 q + 63 of the 16 rows
      __m512i v[16];
      for (int i = 0; i < PANEL; ++i) v[i] = _mm512_loadu_si512(tmp + i * row_ub + b * UB + 64 * q);
      cbserve::transpose16(v);
      for (int g = 0; g < 16; ++g) _mm512_store_si512(pb + 64 * (16 * q + g), v[g]);
    }
    for (int64_t i = 0; i < PANEL; ++i) {
      const uint8_t* u = tmp + i * row_ub + b * UB;
      int16_t sc[NS], corr[NS];
      for (int s = 0; s < NS; ++s) std::memcpy(sc + s, u + k_scale_at<T>(s), 2);
      std::memcpy(corr, u + K_CORR, sizeof(corr));
      float dd[2];
      std::memcpy(dd, u + k_dd<T>(), 8);
      put_lane<T>(pb, i, sc, corr, dd[0], dd[1]);
    }
  }
}

// Q4_K's panel straight from the file's bytes (no unpack_k): its 128 bytes of nibbles transposed as
// 32 dwords (byte 32 j + 4 q + t holds value 64 j + 4 q + t low, 64 j + 32 + 4 q + t high), split
// into the two groups; the scales and mins from their 12 bytes. The same panel as build_panel's.
CB_VNNI void build_panel_q4k(const Part& p, int64_t t0, int64_t rows, uint8_t* panel) {
  constexpr int64_t PB = panel_block<Q4_K>();
  alignas(64) static const uint8_t zeros[block_bytes(Q4_K)] = {};
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < p.nb; ++b) {
    uint8_t* pb = panel + b * PB;
    const uint8_t* blk[PANEL];
    panel_blocks<Q4_K, PANEL>(p, t0, rows, b, zeros, blk);
    for (int h = 0; h < 2; ++h) {  // nibble bytes 64 h .. 64 h + 63: chunks j = 2 h, 2 h + 1
      __m512i v[16];
      for (int i = 0; i < PANEL; ++i) v[i] = _mm512_loadu_si512(blk[i] + 16 + 64 * h);
      cbserve::transpose16(v);
      for (int d = 0; d < 16; ++d) {
        const int j = 2 * h + d / 8, q = d % 8;
        _mm512_store_si512(pb + 64 * (16 * j + q), _mm512_and_si512(v[d], m4));
        _mm512_store_si512(pb + 64 * (16 * j + 8 + q), _mm512_and_si512(_mm512_srli_epi16(v[d], 4), m4));
      }
    }
    // The 16 rows' d, dmin and 12 scale bytes as dwords (lane = row): scales_k4's bit moves on
    // all rows at once (dword 1: sc0..3, 2: mn0..3, 3: the low / high nibbles of sc4..7 / mn4..7).
    __m512i v[4];
    lanes16x16(blk, 0, v);
    const __m512i m63 = _mm512_set1_epi32(63), m15 = _mm512_set1_epi32(15), m48 = _mm512_set1_epi32(48);
    __m512i mn[8];
    for (int k = 0; k < 4; ++k) {
      const __m512i sc_lo = _mm512_and_si512(_mm512_srli_epi32(v[1], 8 * k), m63);
      const __m512i sc_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(v[3], 8 * k), m15),
                                            _mm512_and_si512(_mm512_srli_epi32(v[1], 8 * k + 2), m48));
      mn[k] = _mm512_and_si512(_mm512_srli_epi32(v[2], 8 * k), m63);
      mn[4 + k] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(v[3], 8 * k + 4), m15),
                                  _mm512_and_si512(_mm512_srli_epi32(v[2], 8 * k + 2), m48));
      _mm512_store_si512(pb + PANEL_SCALES + 64 * k, sc_lo);
      _mm512_store_si512(pb + PANEL_SCALES + 64 * (4 + k), sc_hi);
    }
    for (int q = 0; q < 4; ++q)
      _mm512_store_si512(pb + panel_corr<Q4_K>() + 64 * q,
                         _mm512_or_si512(mn[2 * q], _mm512_slli_epi32(mn[2 * q + 1], 16)));
    const __m512i lo16 = _mm512_set1_epi32(0xFFFF);
    _mm512_store_ps(pb + panel_dd<Q4_K>(), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_and_si512(v[0], lo16))));
    _mm512_store_ps(pb + panel_dd<Q4_K>() + 64, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v[0], 16))));
  }
}

// Q6_K's panel straight from the file's bytes: its 128 bytes of low nibbles and 64 of high bit
// pairs transposed as dwords, then q6k_values' bit moves on the 16 rows at once; its 16 int8 scales
// (and the same scales as the offset's pairs). The same panel as build_panel's.
CB_VNNI void build_panel_q6k(const Part& p, int64_t t0, int64_t rows, uint8_t* panel) {
  constexpr int64_t PB = panel_block<Q6_K>();
  alignas(64) static const uint8_t zeros[256] = {};
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  for (int64_t b = 0; b < p.nb; ++b) {
    uint8_t* pb = panel + b * PB;
    const uint8_t* blk[PANEL];
    panel_blocks<Q6_K, PANEL>(p, t0, rows, b, zeros, blk);
    __m512i ql[32], qh[16];
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < PANEL; ++i) ql[16 * h + i] = _mm512_loadu_si512(blk[i] + 64 * h);
      cbserve::transpose16(ql + 16 * h);
    }
    for (int i = 0; i < PANEL; ++i) qh[i] = _mm512_loadu_si512(blk[i] + 128);
    cbserve::transpose16(qh);
    for (int n = 0; n < 2; ++n)
      for (int d = 0; d < 8; ++d) {  // q6k_values, dword d of each 32-byte vector of half n
        const __m512i l0 = ql[16 * n + d], l1 = ql[16 * n + 8 + d], hb = qh[8 * n + d];
        const __m512i u[4] = {
            _mm512_or_si512(_mm512_and_si512(l0, m4), _mm512_and_si512(_mm512_slli_epi16(hb, 4), m30)),
            _mm512_or_si512(_mm512_and_si512(l1, m4), _mm512_and_si512(_mm512_slli_epi16(hb, 2), m30)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), m4), _mm512_and_si512(hb, m30)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), m4),
                            _mm512_and_si512(_mm512_srli_epi16(hb, 2), m30))};
        for (int k = 0; k < 4; ++k) _mm512_store_si512(pb + 64 * (32 * n + 8 * k + d), u[k]);
      }
    // The 16 rows' 16 int8 scales as dwords (lane = row), sign-extended to int32 (the
    // sub-scales) and paired as int16 (the offset's correction).
    __m512i v[4];
    lanes16x16(blk, 192, v);
    __m512i sc[16];
    for (int s = 0; s < 16; ++s) {
      sc[s] = _mm512_srai_epi32(_mm512_slli_epi32(v[s / 4], 24 - 8 * (s % 4)), 24);
      _mm512_store_si512(pb + PANEL_SCALES + 64 * s, sc[s]);
    }
    const __m512i lo16 = _mm512_set1_epi32(0xFFFF);
    for (int q = 0; q < 8; ++q)
      _mm512_store_si512(pb + panel_corr<Q6_K>() + 64 * q,
                         _mm512_or_si512(_mm512_and_si512(sc[2 * q], lo16), _mm512_slli_epi32(sc[2 * q + 1], 16)));
    _mm512_store_ps(pb + panel_dd<Q6_K>(), halves16(blk, 208));
    _mm512_store_ps(pb + panel_dd<Q6_K>() + 64, _mm512_setzero_ps());
  }
}

// The panel's 16 outputs for activation rows r0 .. r0 + R into c[r * 16 + lane]. `corr`: per
// (activation row, block) the sums that meet the correction pairs: Q4_K / Q5_K's sums per 32
// (8 int16), the others' sums per 16 (16 int16, Acts::bs16).
template <int T, int R>
CB_VNNI void panel_dot(const uint8_t* panel, int64_t nb, const Acts& a, const int16_t* corr, int64_t r0, float* c) {
  constexpr int64_t PB = panel_block<T>();
  constexpr int NS = subs<T>(), GS = 64 / NS, CW = scaled16(T) ? 16 : 8;
  const int64_t nbx = a.K / 256;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* pb = panel + b * PB;
    const int8_t* x[R];
    for (int r = 0; r < R; ++r) x[r] = a.q256 + ((r0 + r) * nbx + b) * 256;
    __m512i i1[R];
    for (int r = 0; r < R; ++r) i1[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
    for (int s = 0; s < NS; ++s) {
      __m512i sv[R];
      for (int r = 0; r < R; ++r) sv[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int g = 0; g < GS; ++g) {
        const int grp = s * GS + g;
        const __m512i w = _mm512_load_si512(pb + 64 * grp);
        for (int r = 0; r < R; ++r) sv[r] = _mm512_dpbusd_epi32(sv[r], w, _mm512_set1_epi32(cbserve::load_i32(x[r] + 4 * grp)));
      }
      const __m512i sc = _mm512_load_si512(pb + PANEL_SCALES + 64 * s);
      for (int r = 0; r < R; ++r) i1[r] = _mm512_add_epi32(i1[r], _mm512_mullo_epi32(sv[r], sc));
    }
    __m512i i2[R];
    for (int r = 0; r < R; ++r) i2[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int q = 0; q < NS / 2; ++q) {
      const __m512i cv = _mm512_load_si512(pb + panel_corr<T>() + 64 * q);
      for (int r = 0; r < R; ++r) {
        const int16_t* src = corr + ((r0 + r) * nbx + b) * CW;
        i2[r] = _mm512_dpwssd_epi32(i2[r], cv, _mm512_set1_epi32(cbserve::load_i32(src + 2 * q)));
      }
    }
    const __m512 vd = _mm512_load_ps(pb + panel_dd<T>()), vdmin = _mm512_load_ps(pb + panel_dd<T>() + 64);
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(a.d256[(r0 + r) * nbx + b]);
      if constexpr (T == Q2_K || !scaled16(T)) {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1[r]), _mm512_mul_ps(vd, dx), acc[r]);
        acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(i2[r]), _mm512_mul_ps(vdmin, dx), acc[r]);
      } else {
        const __m512i tot = _mm512_sub_epi32(i1[r], _mm512_slli_epi32(i2[r], k16_offset_shift(T)));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), _mm512_mul_ps(vd, dx), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(c + PANEL * r, acc[r]);
}

// AMX's copy of a panel's values with the 6-bit sub-scales in them (Q4_K / Q5_K): per block, each
// value times its sub-scale's high three bits (4096 bytes), then times its low three (4096), at most
// 31 x 7, still a byte. A block's I1 = sum over sub-blocks of sc (x . q) = 8 (x . q hi) + (x . q lo):
// two tile dots over its 256 inputs, no scaling between sub-blocks. (Q6_K's 8-bit scales would take
// five such dots in base-4 digits: slower than VNNI here, measured.)
constexpr int64_t SPLIT_BLOCK = 8192;

template <int T>
constexpr bool amx_format() {
  return T == Q4_K || T == Q5_K;
}

// v's bytes times f (per 32-bit lane, in both of its 16-bit halves; every product < 256).
CB_AMX inline __m512i times_lane(__m512i v, __m512i f) {
  const __m512i even = _mm512_and_si512(v, _mm512_set1_epi16(0x00FF)), odd = _mm512_srli_epi16(v, 8);
  return _mm512_or_si512(_mm512_mullo_epi16(even, f), _mm512_slli_epi16(_mm512_mullo_epi16(odd, f), 8));
}

template <int T>
CB_AMX void split_scales(const uint8_t* panel, int64_t nb, uint8_t* split) {
  static_assert(amx_format<T>());
  constexpr int64_t PB = panel_block<T>();
  constexpr int NS = subs<T>(), GS = 64 / NS;
  const __m512i halves = _mm512_set1_epi32(0x10001), low3 = _mm512_set1_epi32(7);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* pb = panel + b * PB;
    uint8_t* out = split + b * SPLIT_BLOCK;
    for (int s = 0; s < NS; ++s) {
      const __m512i sc = _mm512_load_si512(pb + PANEL_SCALES + 64 * s);  // int32 a lane, < 64
      for (int j = 0; j < 2; ++j) {  // the high three bits, then the low three
        const __m512i f = _mm512_mullo_epi32(_mm512_and_si512(_mm512_srli_epi32(sc, 3 - 3 * j), low3), halves);
        for (int g = 0; g < GS; ++g) {
          const int64_t at = 64 * (GS * s + g);
          _mm512_store_si512(out + 4096 * j + at, times_lane(_mm512_load_si512(pb + at), f));
        }
      }
    }
  }
}

// panel_dot for the activation rows 0 .. M16 on the tiles (cbserve::amx_tiles_begin(64)), 16 at a
// time, into c[r * 16 + lane]: a block's two dots over its 256 inputs in four 64-input steps, I1 =
// 8 C0 + C1, the rest as panel_dot. Block by block, every row group meeting it while its 12 KB
// (values and split copy) stay in L1.
template <int T>
CB_AMX void panel_dot_amx(const uint8_t* panel, const uint8_t* split, int64_t nb, const Acts& a, const int16_t* corr,
                          int64_t M16, float* c) {
  static_assert(amx_format<T>());
  constexpr int64_t PB = panel_block<T>();
  constexpr int NS = subs<T>(), CW = 8;
  const int64_t nbx = a.K / 256;
  alignas(64) int32_t dots[2][16 * 16];
  for (int64_t r = 0; r < M16; ++r) _mm512_store_ps(c + PANEL * r, _mm512_setzero_ps());
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* pb = panel + b * PB;
    const uint8_t* sp = split + b * SPLIT_BLOCK;
    const __m512 vd = _mm512_load_ps(pb + panel_dd<T>()), vdmin = _mm512_load_ps(pb + panel_dd<T>() + 64);
    for (int64_t r0 = 0; r0 < M16; r0 += 16) {
      const int8_t* x = a.q256 + (r0 * nbx + b) * 256;  // row r at x + r K
      _tile_zero(0);
      _tile_zero(1);
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        _tile_loadd(4, x + 64 * k, a.K);
        _tile_loadd(6, sp + 1024 * k, 64);
        _tile_loadd(7, sp + 4096 + 1024 * k, 64);
        _tile_dpbsud(0, 4, 6);
        _tile_dpbsud(1, 4, 7);
      }
      _tile_stored(0, dots[0], 64);
      _tile_stored(1, dots[1], 64);
      for (int r = 0; r < 16; ++r) {
        const int16_t* src = corr + ((r0 + r) * nbx + b) * CW;
        __m512i i2 = _mm512_setzero_si512();
        for (int q = 0; q < NS / 2; ++q)
          i2 = _mm512_dpwssd_epi32(i2, _mm512_load_si512(pb + panel_corr<T>() + 64 * q),
                                   _mm512_set1_epi32(cbserve::load_i32(src + 2 * q)));
        const __m512i i1 = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(dots[0] + 16 * r), 3),
                                            _mm512_load_si512(dots[1] + 16 * r));
        const __m512 dx = _mm512_set1_ps(a.d256[(r0 + r) * nbx + b]);
        float* cr = c + PANEL * (r0 + r);
        __m512 acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(vd, dx), _mm512_load_ps(cr));
        acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(i2), _mm512_mul_ps(vdmin, dx), acc);
        _mm512_store_ps(cr, acc);
      }
    }
  }
}

template <int T>
CB_VNNI void panels_k(const Part& p, int64_t n0, int64_t n1, const Acts& a, int64_t M, float* y, int64_t ldy) {
  const int64_t nb = p.nb, nbx = a.K / 256;
  const int64_t panel_bytes = nb * panel_block<T>(), tmp_bytes = T == Q4_K || T == Q6_K ? 0 : PANEL * nb * unpacked_block<T>();
  // rows the tiles take (AMX CPUs): Q4_K / Q5_K's, 16 at a time, from 32 rows on (fewer do not pay
  // for the split copy)
  const int64_t M16 = amx_format<T>() && M >= 32 && cbserve::cpu_has_amx() ? M / 16 * 16 : 0;
  const int64_t split_bytes = M16 ? nb * SPLIT_BLOCK : 0;
  uint8_t* buf = scratch(split_bytes + M16 * PANEL * 4 + panel_bytes + tmp_bytes + (!scaled16(T) ? 16 * M * nbx : 0));
  uint8_t* split = buf;
  float* c16 = reinterpret_cast<float*>(buf + split_bytes);  // the tile rows' results
  buf += split_bytes + M16 * PANEL * 4;
  uint8_t* panel = buf;
  uint8_t* tmp = buf + panel_bytes;
  const int16_t* corr = a.bs16;
  if constexpr (!scaled16(T)) {  // Q4_K / Q5_K's minimums meet the sums per 32
    int16_t* pairs = reinterpret_cast<int16_t*>(tmp + tmp_bytes);
    pair_sums_all(a, M, pairs);
    corr = pairs;
  }
  alignas(64) float c[RA * PANEL];
  if (M16) cbserve::amx_tiles_begin(64);
  for (int64_t t0 = n0; t0 < n1; t0 += PANEL) {
    const int64_t rows = std::min<int64_t>(PANEL, n1 - t0);
    if constexpr (T == Q4_K)
      build_panel_q4k(p, t0, rows, panel);
    else if constexpr (T == Q6_K)
      build_panel_q6k(p, t0, rows, panel);
    else
      build_panel<T>(p, t0, rows, tmp, panel);
    if constexpr (amx_format<T>()) {
      if (M16) {
        split_scales<T>(panel, nb, split);
        panel_dot_amx<T>(panel, split, nb, a, corr, M16, c16);
        for (int64_t r = 0; r < M16; ++r)
          for (int64_t i = 0; i < rows; ++i) y[r * ldy + t0 + i] = c16[PANEL * r + i];
      }
    }
    for (int64_t m0 = M16; m0 < M; m0 += RA) {
      const int64_t mr = std::min<int64_t>(RA, M - m0);
      cbserve::with_count<RA>(mr, [&](auto n) { panel_dot<T, decltype(n)::value>(panel, nb, a, corr, m0, c); });
      for (int64_t r = 0; r < mr; ++r)
        for (int64_t i = 0; i < rows; ++i) y[(m0 + r) * ldy + t0 + i] = c[PANEL * r + i];
    }
  }
  if (M16) cbserve::amx_tiles_end();
}

}  // namespace

TileFn panels_k_vnni(int64_t type) {
  TileFn f = nullptr;
  cbserve::with_value<Q2_K, Q3_K, Q4_K, Q5_K, Q6_K>(type, [&](auto t) { f = panels_k<decltype(t)::value>; });
  return f;
}

}  // namespace cbserve_kquant
