// int8-activation dots of the 32-value GGUF formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL), and
// of IQ4_XS as eight 32-value sub-blocks with a scale each, on AVX2: kquant_b32_tile.h's kernels
// at 256 bits, and the tile that picks one by the number of activation rows.
//
// One activation row (decode) meets each row's blocks as the file holds them and reduces eight
// rows' partial sums across (row1); two to four unpack each 8-row panel a few blocks at a time into
// L1 and meet it at once (tile_rows); more (prefill, a batch's lm head) unpack a tile of panels
// whole and run every four activation rows over two panels at a time (panels_b32; on AVX512-VNNI
// CPUs kquant_b32_vnni.cpp's 16-row panels instead). All of them prefetch the next panel's bytes
// while reading one, and all compute kquant_b32_tile.h's arithmetic: a row's result is the same
// bits on every path.
#include "kquant_b32_tile.h"

namespace cbserve_kquant {
namespace {

constexpr int64_t ROWS_MAX_M = MR;  // up to this many activation rows, panels of a few blocks
constexpr int64_t ROWS_GROUP = 8;   // blocks per panel piece on that path (2.5 KB, stays in L1)

// row1's block integers with vpmaddubsw and vpmaddwd.
struct Dot256 {
  // IQ4 (values -127..113): |x| (w with x's sign) = w x, |x| made once for the eight rows
  template <int T>
  static __m256i prep(__m256i xv) {
    return signed_values(T) && T != Q8_0 ? _mm256_sign_epi8(xv, xv) : xv;
  }
  template <int T>
  static __m256i dot(const uint8_t* w, int64_t b, __m256i xv, [[maybe_unused]] __m256i xa) {
    const __m256i ones = _mm256_set1_epi16(1), wv = sub_values<T>(w, b);
    if constexpr (T == Q8_0)  // -128 has no negation in int8, so |w| (x with w's sign)
      return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv)), ones);
    else if constexpr (signed_values(T))
      return _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(wv, xv)), ones);
    else
      return _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones);
  }
  template <int T>
  static __m256i fix(__m256i isum, int32_t) { return isum; }
};

// Decode: each 8-row panel a few blocks at a time, unpacked into L1 and met at once by all R rows.
template <int T, int R>
void tile_rows(const Part& p, int64_t n0, int64_t n1, const Acts& a, float* y, int64_t ldy) {
  using V = Vec256;
  static_assert(ROWS_GROUP % subs<T>() == 0, "a piece starts on a block of T");
  constexpr int64_t L = V::LANES;
  uint8_t* buf = scratch(ROWS_GROUP * b32_block<V>());
  const int64_t nb = row_blocks<T>(p);
  for (int64_t n = n0; n < n1; n += L) {
    const int64_t rows = std::min(L, n1 - n);
    const uint8_t* w[L];
    panel_rows<L>(p, n, rows, w);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += ROWS_GROUP) {
      const int64_t g = std::min(ROWS_GROUP, nb - b0);
      build_panel<V, T>(w, b0, b0 + g, nb, buf, w[0] + L * p.row_bytes, L * p.row_bytes);
      panel_dot<V, T, 1, R>(buf, 0, g, a, 0, b0, acc);
    }
    for (int r = 0; r < R; ++r) V::store_lanes(y + r * ldy + n, acc[r], rows);
  }
}

// VNNI (AVX512-VNNI CPUs): one activation row runs on kquant_b32_vnni.cpp's row1, more than
// ROWS_MAX_M on its panels, the same arithmetic.
template <int T, bool VNNI>
void tile_b32(const Part& p, int64_t n0, int64_t n1, const Acts& a, int64_t M, float* y, int64_t ldy) {
  switch (M <= ROWS_MAX_M ? M : 0) {
    case 1:
      if constexpr (VNNI) {
        static const TileFn one = row1_b32_vnni(T);
        return one(p, n0, n1, a, 1, y, ldy);
      }
      return row1<T, Dot256>(p, n0, n1, a, y);
    case 2: return tile_rows<T, 2>(p, n0, n1, a, y, ldy);
    case 3: return tile_rows<T, 3>(p, n0, n1, a, y, ldy);
    case 4: return tile_rows<T, 4>(p, n0, n1, a, y, ldy);
    default:
      if constexpr (VNNI) {
        static const TileFn panels = panels_b32_vnni(T);
        return panels(p, n0, n1, a, M, y, ldy);
      }
      return panels_b32<Vec256, T>(p, n0, n1, a, M, y, ldy);
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
