// The K formats (Q2_K .. Q6_K) for many activation rows on AVX512-VNNI CPUs: kquant_k_tile.h's
// panels at 512 bits (Vec512: 16 outputs a panel, met by 8 activation rows at a time; a sub-block's
// values meet an activation row's four bytes in vpdpbusd, its sub-scale applied once per sub-block
// with one vpmulld, the minimums' term by vpdpwssd against the activation sums).
//
// With AMX (cbserve::cpu_has_amx), Q4_K and Q5_K meet sixteen activation rows at a time on the
// tiles instead. Their 6-bit sub-scales go into a copy of the values as two 3-bit digits, small
// enough that a value times one is still a byte (split_scales), so a block's I1 = sum over
// sub-blocks of sc (x . q) is two tile dots over all 256 inputs, with no scaling between
// sub-blocks. The minimums' term and the fp32 step are then the VNNI rows' own: the same bits.
#include "kquant_k.h"

#define CB_TILE CB_VNNI
#include "kquant_k_tile.h"

namespace cbserve_kquant {
namespace {

using V = Vec512;
constexpr int64_t PANEL = V::LANES;
constexpr int64_t PANEL_SCALES = panel_scales<V>();

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
  constexpr int64_t PB = panel_block<V, T>();
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
  constexpr int64_t PB = panel_block<V, T>();
  constexpr int NS = subs<T>(), CW = 8;
  const int64_t nbx = a.K / 256;
  alignas(64) int32_t dots[2][16 * 16];
  for (int64_t r = 0; r < M16; ++r) _mm512_store_ps(c + PANEL * r, _mm512_setzero_ps());
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* pb = panel + b * PB;
    const uint8_t* sp = split + b * SPLIT_BLOCK;
    const __m512 vd = _mm512_load_ps(pb + panel_dd<V, T>()), vdmin = _mm512_load_ps(pb + panel_dd<V, T>() + 64);
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
          i2 = _mm512_dpwssd_epi32(i2, _mm512_load_si512(pb + panel_corr<V, T>() + 64 * q),
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
CB_VNNI void panels_k_vnni_of(const Part& p, int64_t n0, int64_t n1, const Acts& a, int64_t M, float* y, int64_t ldy) {
  const int64_t nb = p.nb;
  // rows the tiles take (AMX CPUs): Q4_K / Q5_K's, 16 at a time, from 32 rows on (fewer do not pay
  // for the split copy)
  const int64_t M16 = amx_format<T>() && M >= 32 && cbserve::cpu_has_amx() ? M / 16 * 16 : 0;
  const int64_t split_bytes = M16 ? nb * SPLIT_BLOCK : 0;
  if (M16) cbserve::amx_tiles_begin(64);
  // (the tile rows' results go through c16, after the split copy in the caller's share of scratch)
  auto on_tile = [&](const uint8_t* panel, uint8_t* extra, const int16_t* corr, int64_t t0, int64_t rows) {
    if constexpr (amx_format<T>()) {
      if (!M16) return;
      float* c16 = reinterpret_cast<float*>(extra + split_bytes);
      split_scales<T>(panel, nb, extra);
      panel_dot_amx<T>(panel, extra, nb, a, corr, M16, c16);
      for (int64_t r = 0; r < M16; ++r)
        for (int64_t i = 0; i < rows; ++i) y[r * ldy + t0 + i] = c16[PANEL * r + i];
    }
  };
  panels_k<V, T>(p, n0, n1, a, M, y, ldy, M16, split_bytes + M16 * PANEL * 4, on_tile);
  if (M16) cbserve::amx_tiles_end();
}

}  // namespace

TileFn panels_k_vnni(int64_t type) {
  TileFn f = nullptr;
  cbserve::with_value<Q2_K, Q3_K, Q4_K, Q5_K, Q6_K>(type, [&](auto t) { f = panels_k_vnni_of<decltype(t)::value>; });
  return f;
}

}  // namespace cbserve_kquant
