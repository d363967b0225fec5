// The K formats (Q2_K .. Q6_K) for many activation rows (prefill, batched decode), written once over
// a vector width V (simd.h): kquant_k_panels.cpp instantiates it with Vec256 (AVX2),
// kquant_k_vnni.cpp with Vec512 (AVX512-VNNI), which defines CB_TILE as CB_VNNI before including
// this file so that every function here carries its target.
//
// A thread's outputs go V::LANES at a time into a panel: the rows laid out so that one vector holds
// the same four values of every row (a group; 64 groups a block), then per block each sub-block's
// scale (V::scale_word: an int16 pair a lane for Vec256, an int32 for Vec512), the correction
// values (the mins, or Q6_K / Q3_K's scales per 16, Q2_K's minimums) as int16 pairs, d and dmin.
// Q4_K and Q6_K (a Q4_K_M file's formats) are built from the file's bytes, transposed as dwords
// before their bits are split; the others from unpack_k's blocks. A tile of NP panels is built once
// a call and met by every activation row, RA rows at a time (the micro-kernel: NP x LANES outputs x
// RA rows): a group meets an activation row's four bytes (broadcast, shared by the NP panels) in
// V::narrow, whose sums go through V::widen with the sub-scale once per sub-block (Vec256: as many
// groups summed in int16 as cannot overflow, then vpmaddwd; Vec512: vpdpbusd, then vpmulld); the
// minimums' term is V::madd_acc against the activation sums. No horizontal sums: a lane is an output.
//
// The arithmetic is dot_k's exact one (kquant_k.cpp): per block, I1 and I2 are whole integers (the
// same numbers in any order), then c += I1 (d dx) - I2 (dmin dx) in fp32, one lane per output, so
// an activation row's result is the same bits here, on either width and on decode's file rows.
#pragma once

#include "kquant_k.h"
#include "simd.h"

namespace cbserve_kquant {
namespace {

// The micro-kernel's shape per width: NP panels x RA activation rows. Vec256: two panels share each
// broadcast activation (16 of its 32 bytes a load instead of 8), the int32 sums of 8 (panel, row)
// pairs then live in memory between sub-blocks; the next tile's rows are prefetched on the first
// rows' pass, so its build does not wait on memory. Vec512: one panel, 8 rows, all in registers.
template <class V>
struct KTile;
template <>
struct KTile<Vec256> {
  static constexpr int NP = 2, RA = 4;
  static constexpr bool PREFETCH = true;
};
template <>
struct KTile<Vec512> {
  static constexpr int NP = 1, RA = 8;
  static constexpr bool PREFETCH = false;
};

template <int T>
constexpr int subs() {
  return scaled16(T) ? 16 : 8;
}
// Groups of four values summed in V::narrow before the sub-scale: a whole sub-block, or for int16
// lanes as many as cannot overflow (each vpmaddubsw lane is at most 2 x umax x 127, activations
// being within +-127; the sum must stay below 2^15).
template <class V, int T>
constexpr int chunk() {
  constexpr int umax = T == Q4_K ? 15 : T == Q5_K ? 31 : T == Q6_K ? 63 : T == Q3_K ? 7 : 3;
  constexpr int fit = 32767 / (2 * umax * 127), groups = 64 / subs<T>();
  return !V::NARROW16 || fit >= groups ? groups : fit;
}
static_assert(chunk<Vec256, Q4_K>() == 8 && chunk<Vec256, Q5_K>() == 4 && chunk<Vec256, Q6_K>() == 2 &&
              chunk<Vec256, Q3_K>() == 4);

// A panel's block: values (64 groups of V::BYTES), sub-scales (V::BYTES each), the correction pairs
// (V::BYTES per two), d and dmin (V::BYTES each).
template <class V>
constexpr int64_t panel_scales() {
  return 64 * V::BYTES;
}
template <class V, int T>
constexpr int64_t panel_corr() {
  return panel_scales<V>() + V::BYTES * subs<T>();
}
template <class V, int T>
constexpr int64_t panel_dd() {
  return panel_corr<V, T>() + V::BYTES * subs<T>() / 2;
}
template <class V, int T>
constexpr int64_t panel_block() {
  return panel_dd<V, T>() + 2 * V::BYTES;
}

// The bytes [at, at + len) (len a multiple of V::BYTES) of the LANES rows blk[i] as dwords across
// lanes: out[k] lane i = row i's dword at / 4 + k.
template <class V>
CB_TILE inline void row_dwords(const uint8_t* const* blk, int64_t at, int64_t len, typename V::I* out) {
  for (int64_t c = 0; c < len; c += V::BYTES) {
    typename V::I* v = out + c / 4;
    for (int i = 0; i < V::LANES; ++i) v[i] = V::loadu(blk[i] + at + c);
    V::transpose(v);
  }
}

// Rows t0 .. t0 + rows of the part (rows <= LANES; the panel's other lanes are zeros) into `panel`,
// block by block through unpack_k (`tmp`: LANES unpacked blocks).
template <class V, int T>
CB_TILE void build_panel(const Part& p, int64_t t0, int64_t rows, uint8_t* tmp, uint8_t* panel) {
  constexpr int64_t UB = unpacked_block<T>(), PB = panel_block<V, T>(), NS = subs<T>(), B = V::BYTES;
  constexpr int L = V::LANES;
  for (int64_t b = 0; b < p.nb; ++b) {
    const uint8_t* u[L];
    for (int64_t i = 0; i < L; ++i) {
      uint8_t* dst = tmp + i * UB;
      if (i < rows)
        unpack_k<T>(p.data + (t0 + i - p.n0) * p.row_bytes + b * block_bytes(T), 1, dst);
      else
        std::memset(dst, 0, UB);
      u[i] = dst;
    }
    uint8_t* pb = panel + b * PB;
    typename V::I v[64];  // the block's 256 values as 64 groups
    row_dwords<V>(u, 0, 256, v);
    for (int g = 0; g < 64; ++g) V::store(pb + B * g, v[g]);
    for (int64_t i = 0; i < L; ++i) {
      int16_t corr[NS];
      std::memcpy(corr, u[i] + K_CORR, sizeof(corr));
      for (int s = 0; s < NS; ++s) {
        int16_t sc;
        std::memcpy(&sc, u[i] + k_scale_at<T>(s), 2);
        V::put_scale(pb + panel_scales<V>() + B * s + 4 * i, sc);
      }
      for (int q = 0; q < NS / 2; ++q) std::memcpy(pb + panel_corr<V, T>() + B * q + 4 * i, corr + 2 * q, 4);
      std::memcpy(pb + panel_dd<V, T>() + 4 * i, u[i] + k_dd<T>(), 4);
      std::memcpy(pb + panel_dd<V, T>() + B + 4 * i, u[i] + k_dd<T>() + 4, 4);
    }
  }
}

// Q4_K's panel block straight from the file's bytes (no unpack_k): the LANES rows' blocks blk[i]
// into pb, their 128 bytes of nibbles as dwords across lanes (byte 32 j + 4 q + t holds value
// 64 j + 4 q + t low, 64 j + 32 + 4 q + t high), each split into its two groups; the scales and
// mins by scales_k4's bit moves on all rows at once. The same panel as build_panel's.
template <class V>
CB_TILE void build_block_q4k(const uint8_t* const* blk, uint8_t* pb) {
  constexpr int64_t B = V::BYTES;
  const typename V::I m4 = V::set1_8(0x0F);
  typename V::I v[32];
  row_dwords<V>(blk, 16, 128, v);
  for (int k = 0; k < 32; ++k) {
    const int j = k / 8, q = k % 8;
    V::store(pb + B * (16 * j + q), V::and_(v[k], m4));
    V::store(pb + B * (16 * j + 8 + q), V::and_(V::srli16(v[k], 4), m4));
  }
  // dword 0: d, dmin; 1: sc0..3; 2: mn0..3; 3: the low / high nibbles of sc4..7 / mn4..7
  typename V::I w[4];
  V::lanes4(blk, 0, w);
  const typename V::I m63 = V::set1(63), m15 = V::set1(15), m48 = V::set1(48);
  typename V::I mn[8];
  for (int k = 0; k < 4; ++k) {
    const typename V::I sc_lo = V::and_(V::srli32(w[1], 8 * k), m63);
    const typename V::I sc_hi = V::or_(V::and_(V::srli32(w[3], 8 * k), m15), V::and_(V::srli32(w[1], 8 * k + 2), m48));
    mn[k] = V::and_(V::srli32(w[2], 8 * k), m63);
    mn[4 + k] = V::or_(V::and_(V::srli32(w[3], 8 * k + 4), m15), V::and_(V::srli32(w[2], 8 * k + 2), m48));
    V::store(pb + panel_scales<V>() + B * k, V::scale_word(sc_lo));
    V::store(pb + panel_scales<V>() + B * (4 + k), V::scale_word(sc_hi));
  }
  for (int q = 0; q < 4; ++q) V::store(pb + panel_corr<V, Q4_K>() + B * q, V::pair16(mn[2 * q], mn[2 * q + 1]));
  V::storef(pb + panel_dd<V, Q4_K>(), V::halves(w[0]));
  V::storef(pb + panel_dd<V, Q4_K>() + B, V::halves(V::srli32(w[0], 16)));
}

// Q6_K's panel block straight from the file's bytes: its 128 bytes of low nibbles and 64 of high bit
// pairs as dwords across lanes, then q6k_values' bit moves on all rows at once; its 16 int8 scales
// as the sub-scales and as the offset's pairs. The same panel as build_panel's.
template <class V>
CB_TILE void build_block_q6k(const uint8_t* const* blk, uint8_t* pb) {
  constexpr int64_t B = V::BYTES;
  const typename V::I m4 = V::set1_8(0x0F), m30 = V::set1_8(0x30);
  typename V::I qh[16];
  row_dwords<V>(blk, 128, 64, qh);
  for (int n = 0; n < 2; ++n) {
    typename V::I ql[16];
    row_dwords<V>(blk, 64 * n, 64, ql);
    for (int d = 0; d < 8; ++d) {  // q6k_values, dword d of each 32-byte vector of half n
      const typename V::I l0 = ql[d], l1 = ql[8 + d], hb = qh[8 * n + d];
      const typename V::I u[4] = {V::or_(V::and_(l0, m4), V::and_(V::slli16(hb, 4), m30)),
                                  V::or_(V::and_(l1, m4), V::and_(V::slli16(hb, 2), m30)),
                                  V::or_(V::and_(V::srli16(l0, 4), m4), V::and_(hb, m30)),
                                  V::or_(V::and_(V::srli16(l1, 4), m4), V::and_(V::srli16(hb, 2), m30))};
      for (int k = 0; k < 4; ++k) V::store(pb + B * (32 * n + 8 * k + d), u[k]);
    }
  }
  typename V::I w[4];
  V::lanes4(blk, 192, w);
  typename V::I sc[16];
  for (int s = 0; s < 16; ++s) {
    sc[s] = V::srai32(V::slli32(w[s / 4], 24 - 8 * (s % 4)), 24);
    V::store(pb + panel_scales<V>() + B * s, V::scale_word(sc[s]));
  }
  for (int q = 0; q < 8; ++q) V::store(pb + panel_corr<V, Q6_K>() + B * q, V::pair16(sc[2 * q], sc[2 * q + 1]));
  alignas(64) uint16_t h[V::LANES];
  for (int i = 0; i < V::LANES; ++i) std::memcpy(h + i, blk[i] + 208, 2);
  V::storef(pb + panel_dd<V, Q6_K>(), V::halves_of(h));
  V::storef(pb + panel_dd<V, Q6_K>() + B, V::zerof());
}

// Rows t0 .. t0 + rows of the part into `panel`: Q4_K and Q6_K from the file's bytes, a block at a
// time (rows past `rows` read a zero block), the others through unpack_k (`tmp`).
template <class V, int T>
CB_TILE void build_any(const Part& p, int64_t t0, int64_t rows, uint8_t* tmp, uint8_t* panel) {
  if constexpr (T == Q4_K || T == Q6_K) {
    alignas(64) static const uint8_t zeros[256] = {};  // (Q6_K's reads reach byte 207 of a 210-byte block)
    for (int64_t b = 0; b < p.nb; ++b) {
      const uint8_t* blk[V::LANES];
      panel_blocks<T, V::LANES>(p, t0, rows, b, zeros, blk);
      if constexpr (T == Q4_K)
        build_block_q4k<V>(blk, panel + b * panel_block<V, T>());
      else
        build_block_q6k<V>(blk, panel + b * panel_block<V, T>());
    }
  } else {
    build_panel<V, T>(p, t0, rows, tmp, panel);
  }
}

// NP panels (`panels`, `panel_bytes` apart) against activation rows r0 .. r0 + R into
// c[(q * R + r) * LANES + lane] (panel q, row r). `corr`: per (activation row, block) the sums that
// meet the correction pairs: Q4_K / Q5_K's sums per 32 (8 int16), the others' sums per 16 (16 int16,
// Acts::bs16). `pf` (or null): the next tile's rows to prefetch, a slice a block (prefetch_slice;
// into L2 with `pf_l2`).
template <class V, int T, int NP, int R>
CB_TILE void panel_dot(const uint8_t* panels, int64_t panel_bytes, int64_t nb, const Acts& a, const int16_t* corr,
                       int64_t r0, float* c, const uint8_t* pf, bool pf_l2) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr int64_t PB = panel_block<V, T>(), B = V::BYTES;
  constexpr int NS = subs<T>(), GS = 64 / NS, CH = chunk<V, T>(), CW = scaled16(T) ? 16 : 8;
  const int64_t nbx = a.K / 256;
  F acc[NP][R];
  for (int q = 0; q < NP; ++q)
    for (int r = 0; r < R; ++r) acc[q][r] = V::zerof();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* pb[NP];
    for (int q = 0; q < NP; ++q) pb[q] = panels + q * panel_bytes + b * PB;
    prefetch_slice(pf, b, NP * V::LANES * block_bytes(T), pf_l2);
    const int8_t* x[R];
    for (int r = 0; r < R; ++r) x[r] = a.q256 + ((r0 + r) * nbx + b) * 256;
    I i1[NP][R];
    for (int q = 0; q < NP; ++q)
      for (int r = 0; r < R; ++r) i1[q][r] = V::zero();
#pragma GCC unroll 1
    for (int s = 0; s < NS; ++s) {
#pragma GCC unroll 2
      for (int h = 0; h < GS / CH; ++h) {
        I n[NP][R];
        for (int q = 0; q < NP; ++q)
          for (int r = 0; r < R; ++r) n[q][r] = V::zero();
#pragma GCC unroll 8
        for (int g = 0; g < CH; ++g) {
          const int grp = s * GS + h * CH + g;
          I w[NP];
          for (int q = 0; q < NP; ++q) w[q] = V::load(pb[q] + B * grp);
          for (int r = 0; r < R; ++r) {
            const I xv = V::bcast4(x[r] + 4 * grp);
            for (int q = 0; q < NP; ++q) {
              n[q][r] = V::narrow(n[q][r], w[q], xv);
              V::keep(n[q][r]);
            }
          }
        }
        for (int q = 0; q < NP; ++q) {
          const I sc = V::load(pb[q] + panel_scales<V>() + B * s);
          for (int r = 0; r < R; ++r) i1[q][r] = V::widen(i1[q][r], n[q][r], sc);
        }
      }
    }
    for (int q = 0; q < NP; ++q) {
      I i2[R];
      for (int r = 0; r < R; ++r) i2[r] = V::zero();
#pragma GCC unroll 8
      for (int k = 0; k < NS / 2; ++k) {
        const I cv = V::load(pb[q] + panel_corr<V, T>() + B * k);
        for (int r = 0; r < R; ++r)
          i2[r] = V::madd_acc(i2[r], cv, V::bcast4(corr + ((r0 + r) * nbx + b) * CW + 2 * k));
      }
      const F vd = V::loadf(pb[q] + panel_dd<V, T>()), vdmin = V::loadf(pb[q] + panel_dd<V, T>() + B);
      for (int r = 0; r < R; ++r) {
        const F dx = V::set1f(a.d256[(r0 + r) * nbx + b]);
        if constexpr (has_min(T)) {
          acc[q][r] = V::fmadd(V::cvt(i1[q][r]), V::mul(vd, dx), acc[q][r]);
          acc[q][r] = V::fnmadd(V::cvt(i2[r]), V::mul(vdmin, dx), acc[q][r]);
        } else {
          const I tot = V::sub32(i1[q][r], V::slli32(i2[r], k16_offset_shift(T)));
          acc[q][r] = V::fmadd(V::cvt(tot), V::mul(vd, dx), acc[q][r]);
        }
      }
    }
  }
  for (int q = 0; q < NP; ++q)
    for (int r = 0; r < R; ++r) V::storef(c + (q * R + r) * V::LANES, acc[q][r]);
}

// Outputs [n0, n1) for activation rows [m_first, M), a tile of NP panels at a time. `extra_bytes`
// of the thread's scratch are the caller's: after each tile's build, on_tile(panels, extra, corr,
// t0, rows) may compute rows [0, m_first) its own way (kquant_k_vnni.cpp's AMX tiles).
template <class V, int T, typename OnTile>
CB_TILE void panels_k(const Part& p, int64_t n0, int64_t n1, const Acts& a, int64_t M, float* y, int64_t ldy,
                      int64_t m_first, int64_t extra_bytes, OnTile&& on_tile) {
  constexpr int NP = KTile<V>::NP, RA = KTile<V>::RA, L = V::LANES;
  constexpr int64_t TILE = NP * L;
  const int64_t nb = p.nb, nbx = a.K / 256, panel_bytes = nb * panel_block<V, T>();
  const int64_t tmp_bytes = T == Q4_K || T == Q6_K ? 0 : L * unpacked_block<T>();
  uint8_t* extra = scratch(extra_bytes + NP * panel_bytes + tmp_bytes + (!scaled16(T) ? 16 * M * nbx : 0));
  uint8_t* panels = extra + extra_bytes;
  uint8_t* tmp = panels + NP * panel_bytes;
  const int16_t* corr = a.bs16;
  if constexpr (!scaled16(T)) {  // Q4_K / Q5_K's minimums meet the sums per 32
    int16_t* pairs = reinterpret_cast<int16_t*>(tmp + tmp_bytes);
    pair_sums_all(a, M, pairs);
    corr = pairs;
  }
  alignas(64) float c[NP * RA * L];
  const bool pf_l2 = TILE * p.row_bytes > L1_GROUP_BYTES;
  for (int64_t t0 = n0; t0 < n1; t0 += TILE) {
    int64_t rows[NP];
    for (int q = 0; q < NP; ++q) {
      rows[q] = std::clamp<int64_t>(n1 - (t0 + q * L), 0, L);
      build_any<V, T>(p, t0 + q * L, rows[q], tmp, panels + q * panel_bytes);
    }
    on_tile(panels, extra, corr, t0, rows[0]);
    for (int64_t m0 = m_first; m0 < M; m0 += RA) {
      const int64_t mr = std::min<int64_t>(RA, M - m0);
      // The first rows' pass fetches the next tile's rows (contiguous in the file), a slice a block,
      // so its build does not wait on memory (a 1B-shaped batch-8 step: 87.6 -> 68.1 ms on Zen 3).
      const uint8_t* pf = KTile<V>::PREFETCH && m0 == m_first && t0 + TILE < n1
                              ? p.data + (t0 + TILE - p.n0) * p.row_bytes
                              : nullptr;
      cbserve::with_count<RA>(mr, [&](auto r) {
        panel_dot<V, T, NP, decltype(r)::value>(panels, panel_bytes, nb, a, corr, m0, c, pf, pf_l2);
      });
      for (int q = 0; q < NP; ++q)
        for (int64_t r = 0; r < mr && rows[q] > 0; ++r)
          V::store_lanes(y + (m0 + r) * ldy + t0 + q * L, V::loadf(c + (q * mr + r) * L), rows[q]);
    }
  }
}

}  // namespace
}  // namespace cbserve_kquant
