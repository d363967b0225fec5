// int8-activation dots of the 32-value GGUF formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL), and
// of IQ4_XS as eight 32-value sub-blocks with a scale each, register-tiled. Below, "block" means a
// 32-value block or sub-block.
//
// Eight weight rows form a panel: per block, the eight rows' 32 value bytes are transposed so that
// one 32-byte vector holds four consecutive bytes of every row (chunk c of the block), followed by
// the rows' scales s and offsets o as 8 floats (w = u s + o; Q8_0, IQ4: signed bytes, no o). A chunk
// meets one activation row's four bytes broadcast to all lanes in vpmaddubsw then vpmaddwd, so the
// 8 int32 lanes of a result are already the 8 rows' partial dots: no horizontal adds, and a chunk
// unpacked once serves up to four activation rows held in registers (the micro-tile: 8 weight rows
// x 4 activation rows).
//
// The arithmetic of one (weight row, activation row) pair, the same on every path: per block b in
// order, I = the block's exact integer dot (u x, or w x for signed values), then
//   acc = fma(float(I), s * d32, acc); acc = fma(o, s32, acc) (not for signed values),
// acc starting at 0 and being the result. A row is one float lane, so its result does not depend
// on which lane, panel, tile or batch size it meets.
//
// One activation row meets each row's blocks as the file holds them and reduces the eight rows'
// partial sums across (tile_row1); two to four unpack each panel a few blocks at a time into L1;
// more (prefill, a batch's lm head) unpack a tile of panels whole and run every four activation
// rows over it (on AVX512-VNNI CPUs kquant_b32_vnni.cpp's 16-row panels instead). All of them
// prefetch the next panel's bytes while reading one.
#include "kquant_b32.h"

namespace cbserve_kquant {
namespace {

constexpr int64_t PR = 8;                // weight rows per panel (the float lanes)
constexpr int64_t PB = 8 * 32 + 2 * 32;  // bytes of a panel's block: 8 chunks, then s[8], o[8]
constexpr int64_t ROWS_MAX_M = MR;       // up to this many activation rows, panels of a few blocks
constexpr int64_t ROWS_GROUP = 8;        // blocks per panel piece on that path (2.5 KB, stays in L1)
constexpr int64_t TILE_BYTES = 1 << 16;  // a prefill tile's panels: at most this (L2), at most 4 panels

// 8 x 8 int32 transpose: v[c] lane n <- v[n] lane c.
inline void transpose8(__m256i* v) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    v[c] = _mm256_permute2x128_si256(u[c], u[c + 4], 0x20);
    v[c + 4] = _mm256_permute2x128_si256(u[c], u[c + 4], 0x31);
  }
}

// Block `b` of eight rows (w[n]: row n's first byte; rows past a partial panel's end repeat its
// last row, their lanes never stored), with their scales s, into one panel block at dst.
template <int T>
inline void unpack_block8(const uint8_t* const* w, int64_t b, __m256 s, uint8_t* dst) {
  __m256i v[8];
  for (int n = 0; n < 8; ++n) v[n] = sub_values<T>(w[n], b);
  transpose8(v);
  for (int c = 0; c < 8; ++c) _mm256_store_si256(reinterpret_cast<__m256i*>(dst + 32 * c), v[c]);
  _mm256_store_ps(reinterpret_cast<float*>(dst + 256), s);
  if constexpr (!signed_values(T)) _mm256_store_ps(reinterpret_cast<float*>(dst + 288), block_offsets8<T>(w, b, s));
}

// acc[r] (8 rows in lanes) through `nblk` panel blocks at `pan`, activation blocks b0.. of rows
// r0 + r, r < R: the arithmetic the file-top comment gives.
template <int T, int R>
inline void panel_dot(const uint8_t* pan, int64_t nblk, const Acts& a, int64_t r0, int64_t b0, __m256* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nblk; ++b) {
    const uint8_t* pb = pan + b * PB;
    const int8_t* x[R];
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) x[r] = a.q32 + ((r0 + r) * a.nb32 + b0 + b) * 32;
    __m256i isum[R];
    auto bcast = [](const int8_t* p) {
      int32_t v;
      std::memcpy(&v, p, 4);
      return _mm256_set1_epi32(v);
    };
    if constexpr (signed_values(T)) {
      // |w| x (x with w's sign) = w x keeps vpmaddubsw's operands unsigned x signed; each result
      // is up to 2 x 128 x 127, so every chunk goes to int32 at once.
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
      #pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(pb + 32 * c));
        const __m256i aw = _mm256_sign_epi8(wv, wv);
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bcast(x[r] + 4 * c), wv));
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, ones));
          keep(isum[r]);
        }
      }
    } else {
      // u <= 31: four chunks' vpmaddubsw results (each up to 2 x 31 x 127) add up in int16.
      #pragma GCC unroll 8
      for (int h = 0; h < 2; ++h) {
        __m256i s16[R];
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) s16[r] = _mm256_setzero_si256();
        #pragma GCC unroll 8
        for (int c = 4 * h; c < 4 * h + 4; ++c) {
          const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(pb + 32 * c));
          #pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(wv, bcast(x[r] + 4 * c)));
            keep(s16[r]);
          }
        }
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256i s32 = _mm256_madd_epi16(s16[r], ones);
          isum[r] = h == 0 ? s32 : _mm256_add_epi32(isum[r], s32);
        }
      }
    }
    const __m256 ws = _mm256_load_ps(reinterpret_cast<const float*>(pb + 256));
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * a.nb32 + b0 + b;
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(ws, _mm256_set1_ps(a.d32[i])), acc[r]);
      if constexpr (!signed_values(T))
        acc[r] = _mm256_fmadd_ps(_mm256_load_ps(reinterpret_cast<const float*>(pb + 288)), _mm256_set1_ps(a.s32[i]),
                                 acc[r]);
    }
  }
}

// Blocks [b0, b1) of eight rows (b0 a multiple of subs<T>()) into consecutive panel blocks at
// dst, asking for the matching shares of the next panel's `next_bytes` at `next` on the way.
template <int T>
inline void unpack_blocks8(const uint8_t* const* w, int64_t b0, int64_t b1, int64_t nb, uint8_t* dst,
                           const uint8_t* next, int64_t next_bytes) {
  for (int64_t b = b0; b < b1; b += subs<T>()) {
    __m256 s[subs<T>()];
    block_scales8<T>(w, b, s);
    for (int64_t j = 0; j < subs<T>() && b + j < b1; ++j) {
      prefetch_share(next, next_bytes, b + j, nb);
      unpack_block8<T>(w, b + j, s[j], dst + (b + j - b0) * PB);
    }
  }
}

template <int R>
inline void store_rows(const __m256* acc, int64_t r0, int64_t n, int64_t rows, float* y, int64_t ldy) {
  if (rows == PR) {  // a whole panel: one store a row (a copy of a runtime length is a byte loop)
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (r0 + r) * ldy + n, acc[r]);
    return;
  }
  alignas(32) float v[8];
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(v, acc[r]);
    std::memcpy(y + (r0 + r) * ldy + n, v, rows * sizeof(float));
  }
}

// One activation row (decode): nothing to share a transposed block with, so each row's block meets
// the activations as it is and the eight rows' int32 partial sums are reduced across (sums8), which
// leaves the eight rows' block dots in lanes as the panels do: the same integers, the same floats.
template <int T>
void tile_row1(const Part& p, int64_t n0, int64_t n1, const Acts& a, float* y) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t nb = row_blocks<T>(p);
  for (int64_t n = n0; n < n1; n += PR) {
    const int64_t rows = std::min(PR, n1 - n);
    const uint8_t* w[PR];
    panel_rows<PR>(p, n, rows, w);
    __m256 acc = _mm256_setzero_ps();
    const uint8_t* next = w[0] + PR * p.row_bytes;
    for (int64_t b0 = 0; b0 < nb; b0 += subs<T>()) {
      __m256 scales[subs<T>()];
      block_scales8<T>(w, b0, scales);
      #pragma GCC unroll 8
      for (int j = 0; j < subs<T>(); ++j) {
        const int64_t b = b0 + j;
        prefetch_share(next, PR * p.row_bytes, b, nb);
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q32 + b * 32));
        // IQ4 (values -127..113): |x| (w with x's sign) = w x, |x| made once for the eight rows;
        // Q8_0's -128 has no negation in int8, so there |w| (x with w's sign)
        [[maybe_unused]] const __m256i xa = signed_values(T) && T != Q8_0 ? _mm256_sign_epi8(xv, xv) : xv;
        __m256i s[8];
        for (int i = 0; i < 8; ++i) {
          const __m256i wv = sub_values<T>(w[i], b);
          if constexpr (T == Q8_0)
            s[i] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv)), ones);
          else if constexpr (signed_values(T))
            s[i] = _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(wv, xv)), ones);
          else
            s[i] = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones);
        }
        const __m256 ws = scales[j];
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums8(s)), _mm256_mul_ps(ws, _mm256_set1_ps(a.d32[b])), acc);
        if constexpr (!signed_values(T))
          acc = _mm256_fmadd_ps(block_offsets8<T>(w, b, ws), _mm256_set1_ps(a.s32[b]), acc);
      }
    }
    store_rows<1>(&acc, 0, n, rows, y, 0);
  }
}

// Decode: each panel a few blocks at a time, unpacked into L1 and met at once by all R rows.
template <int T, int R>
void tile_rows(const Part& p, int64_t n0, int64_t n1, const Acts& a, float* y, int64_t ldy) {
  static_assert(ROWS_GROUP % subs<T>() == 0, "a piece starts on a block of T");
  uint8_t* buf = scratch(ROWS_GROUP * PB);
  const int64_t nb = row_blocks<T>(p);
  for (int64_t n = n0; n < n1; n += PR) {
    const int64_t rows = std::min(PR, n1 - n);
    const uint8_t* w[PR];
    panel_rows<PR>(p, n, rows, w);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += ROWS_GROUP) {
      const int64_t g = std::min(ROWS_GROUP, nb - b0);
      unpack_blocks8<T>(w, b0, b0 + g, nb, buf, w[0] + PR * p.row_bytes, PR * p.row_bytes);
      panel_dot<T, R>(buf, g, a, 0, b0, acc);
    }
    store_rows<R>(acc, 0, n, rows, y, ldy);
  }
}

template <int T, int R>
inline void quad(const uint8_t* pan, const Part& p, int64_t n, int64_t rows, const Acts& a, int64_t m0, float* y,
                 int64_t ldy) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  panel_dot<T, R>(pan, row_blocks<T>(p), a, m0, 0, acc);
  store_rows<R>(acc, m0, n, rows, y, ldy);
}

// Prefill: a tile of panels unpacked whole, then every four activation rows over each panel.
template <int T>
void tile_panels(const Part& p, int64_t n0, int64_t n1, const Acts& a, int64_t M, float* y, int64_t ldy) {
  const int64_t nb = row_blocks<T>(p);
  const int64_t panel_bytes = nb * PB;
  const int64_t np = std::clamp<int64_t>(TILE_BYTES / panel_bytes, 1, 4);
  uint8_t* buf = scratch(np * panel_bytes);
  for (int64_t t0 = n0; t0 < n1; t0 += np * PR) {
    const int64_t t1 = std::min(n1, t0 + np * PR);
    for (int64_t n = t0; n < t1; n += PR) {
      const uint8_t* w[PR];
      panel_rows<PR>(p, n, std::min(PR, t1 - n), w);
      uint8_t* pan = buf + (n - t0) / PR * panel_bytes;
      unpack_blocks8<T>(w, 0, nb, nb, pan, w[0] + PR * p.row_bytes, PR * p.row_bytes);
    }
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int64_t mr = std::min<int64_t>(4, M - m0);
      for (int64_t n = t0; n < t1; n += PR) {
        const uint8_t* pan = buf + (n - t0) / PR * panel_bytes;
        const int64_t rows = std::min(PR, t1 - n);
        switch (mr) {
          case 1: quad<T, 1>(pan, p, n, rows, a, m0, y, ldy); break;
          case 2: quad<T, 2>(pan, p, n, rows, a, m0, y, ldy); break;
          case 3: quad<T, 3>(pan, p, n, rows, a, m0, y, ldy); break;
          default: quad<T, 4>(pan, p, n, rows, a, m0, y, ldy); break;
        }
      }
    }
  }
}

// VNNI (AVX512-VNNI CPUs): one activation row runs on kquant_b32_vnni.cpp's row1_b32, more than
// ROWS_MAX_M on its panels, the same arithmetic.
template <int T, bool VNNI>
void tile_b32(const Part& p, int64_t n0, int64_t n1, const Acts& a, int64_t M, float* y, int64_t ldy) {
  switch (M <= ROWS_MAX_M ? M : 0) {
    case 1:
      if constexpr (VNNI) {
        static const TileFn row1 = row1_b32_vnni(T);
        return row1(p, n0, n1, a, 1, y, ldy);
      }
      return tile_row1<T>(p, n0, n1, a, y);
    case 2: return tile_rows<T, 2>(p, n0, n1, a, y, ldy);
    case 3: return tile_rows<T, 3>(p, n0, n1, a, y, ldy);
    case 4: return tile_rows<T, 4>(p, n0, n1, a, y, ldy);
    default:
      if constexpr (VNNI) {
        static const TileFn panels = panels_b32_vnni(T);
        return panels(p, n0, n1, a, M, y, ldy);
      }
      return tile_panels<T>(p, n0, n1, a, M, y, ldy);
  }
}

}  // namespace

TileFn tile_b32_a8(int64_t type) {
  const bool vnni = cbserve::cpu_has_vnni();
  TileFn f = nullptr;
  cbserve::with_value<Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, IQ4_XS>(type, [&](auto t) {
    constexpr int T = decltype(t)::value;
    f = vnni ? tile_b32<T, true> : tile_b32<T, false>;
  });
  return f;
}

}  // namespace cbserve_kquant
