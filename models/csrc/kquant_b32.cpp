// int8-activation dots of the 32-value GGUF formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): the nibbles
// (or Q8_0's signed bytes) meet the activations' int8 blocks in vpmaddubsw then vpmaddwd; fp32 only
// once per block. A few activation rows (decode) read the file's rows; more (prefill) meet a copy
// of each row unpacked once; both do the same arithmetic (the same result for a row whatever M).
#include "kquant.h"

namespace cbserve_kquant {
namespace {

constexpr int64_t ROWS_MAX_M = MR;  // up to this many activation rows, no unpacked copy of a row

// A row of a 32-value format unpacked for the int8 kernel: the blocks' bytes u (unsigned, or
// signed for Q8_0), then per block the float scale s and offset o (w = u s + o), the block count
// rounded up to 8 with zero blocks.
inline int64_t b32_unpacked_bytes(int64_t nb) { return b32_groups(nb) * 8 * (32 + 8); }

template <int T>
void unpack_b32(const uint8_t* w, int64_t nb, uint8_t* dst) {
  const int64_t nbp = b32_groups(nb) * 8;
  float* ws = reinterpret_cast<float*>(dst + nbp * 32);
  float* wo = ws + nbp;
  for (int64_t b = 0; b < nbp; ++b) {
    __m256i u = _mm256_setzero_si256();
    ws[b] = wo[b] = 0.f;
    if (b < nb) u = block32<T>(w + b * block_bytes(T), ws[b], wo[b]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(dst + 32 * b), u);
  }
}

// The 32-value formats, eight blocks at a time: each block's integer dot product is reduced to
// one int32, and the eight then meet their scales (weight s x activation d) and the zero point or
// minimum (weight o x activation d sum(q)) as vectors, rather than a float multiply-add a block.
// u: the group's 8 x 32 value bytes (unsigned, or signed for Q8_0); ws, wo: their s and o.
template <bool SIGNED, int R>
inline void group_a8_b32(const uint8_t* u, __m256 vws, __m256 vwo, const Acts& a, int64_t r0, int64_t g,
                         __m256* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) {
    const int64_t rb = (r0 + r) * a.nb32 + 8 * g;
    const int8_t* xr = a.q32 + rb * 32;
    __m256i p[8];
    for (int j = 0; j < 8; ++j) {
      const __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(u + 32 * j));
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32 * j));
      if constexpr (SIGNED)  // |w| * (x with w's sign) = w x, within vpmaddubsw's operands
        p[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv)), ones);
      else
        p[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones);
    }
    const __m256 dx = _mm256_loadu_ps(a.d32 + rb);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums8(p)), _mm256_mul_ps(vws, dx), acc[r]);
    if constexpr (!SIGNED) acc[r] = _mm256_fmadd_ps(vwo, _mm256_loadu_ps(a.s32 + rb), acc[r]);
  }
}

// `w`: a row unpacked by unpack_b32 (prefill: unpacked once, met by every activation row).
template <bool SIGNED, int R>
void dot_a8_b32(const uint8_t* w, const Acts& a, int64_t r0, int64_t nb, float* res) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t ng = b32_groups(nb);
  const float* ws = reinterpret_cast<const float*>(w + ng * 8 * 32);
  const float* wo = ws + ng * 8;
  for (int64_t g = 0; g < ng; ++g)
    group_a8_b32<SIGNED, R>(w + g * 256, _mm256_load_ps(ws + 8 * g), _mm256_load_ps(wo + 8 * g), a, r0, g, acc);
  for (int r = 0; r < R; ++r) res[r] = hsum(acc[r]);
}

// `w`: the file's row itself (decode, a few activation rows: unpacking the row first would cost
// a store and reload of every weight for one use). Each group of eight blocks is unpacked into
// registers / L1 exactly as unpack_b32 lays it out, so the sums are the same operations on the
// same values whichever path a row takes.
template <int T, int R>
void dot_a8_b32_rows(const uint8_t* w, const Acts& a, int64_t r0, int64_t nb, float* res) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t ng = b32_groups(nb);
  for (int64_t g = 0; g < ng; ++g) {
    if constexpr (R == 1) {  // one activation row: group_a8_b32's operations, the blocks in registers
      if (8 * g + 8 <= nb) {
        const int64_t rb = r0 * a.nb32 + 8 * g;
        const int8_t* xr = a.q32 + rb * 32;
        const __m256i ones = _mm256_set1_epi16(1);
        float ws[8], wo[8];
        __m256i p[8];
        for (int j = 0; j < 8; ++j) {
          const __m256i wv = block32<T>(w + (8 * g + j) * block_bytes(T), ws[j], wo[j]);
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32 * j));
          if constexpr (T == Q8_0)
            p[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv)), ones);
          else
            p[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones);
        }
        const __m256 vws = _mm256_setr_ps(ws[0], ws[1], ws[2], ws[3], ws[4], ws[5], ws[6], ws[7]);
        const __m256 dx = _mm256_loadu_ps(a.d32 + rb);
        acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums8(p)), _mm256_mul_ps(vws, dx), acc[0]);
        if constexpr (T != Q8_0)
          acc[0] = _mm256_fmadd_ps(_mm256_setr_ps(wo[0], wo[1], wo[2], wo[3], wo[4], wo[5], wo[6], wo[7]),
                                   _mm256_loadu_ps(a.s32 + rb), acc[0]);
        continue;
      }
    }
    alignas(32) uint8_t u[256];
    alignas(32) float ws[8], wo[8];
    const int n = static_cast<int>(std::min<int64_t>(8, nb - 8 * g));
    for (int j = 0; j < n; ++j)
      _mm256_store_si256(reinterpret_cast<__m256i*>(u + 32 * j),
                         block32<T>(w + (8 * g + j) * block_bytes(T), ws[j], wo[j]));
    for (int j = n; j < 8; ++j) {  // the zero blocks unpack_b32 pads a row with
      _mm256_store_si256(reinterpret_cast<__m256i*>(u + 32 * j), _mm256_setzero_si256());
      ws[j] = wo[j] = 0.f;
    }
    group_a8_b32<T == Q8_0, R>(u, _mm256_load_ps(ws), _mm256_load_ps(wo), a, r0, g, acc);
  }
  for (int r = 0; r < R; ++r) res[r] = hsum(acc[r]);
}

template <int T>
void tile_b32(const Part& p, int64_t n0, int64_t n1, const Acts& a, int64_t M, float* y, int64_t ldy) {
  constexpr bool SIGNED = T == Q8_0;
  static const DotFn rows[MR + 1] = {nullptr, dot_a8_b32_rows<T, 1>, dot_a8_b32_rows<T, 2>, dot_a8_b32_rows<T, 3>,
                                     dot_a8_b32_rows<T, 4>};
  static const DotFn unpacked[MR + 1] = {nullptr, dot_a8_b32<SIGNED, 1>, dot_a8_b32<SIGNED, 2>,
                                         dot_a8_b32<SIGNED, 3>, dot_a8_b32<SIGNED, 4>};
  if (M <= ROWS_MAX_M)
    tile_by_rows(rows, nullptr, 0, p, n0, n1, a, M, y, ldy);
  else
    tile_by_rows(unpacked, unpack_b32<T>, b32_unpacked_bytes(p.nb), p, n0, n1, a, M, y, ldy);
}

}  // namespace

TileFn tile_b32_a8(int64_t type) {
  switch (type) {
    case Q4_0: return tile_b32<Q4_0>;
    case Q4_1: return tile_b32<Q4_1>;
    case Q5_0: return tile_b32<Q5_0>;
    case Q5_1: return tile_b32<Q5_1>;
    case Q8_0: return tile_b32<Q8_0>;
    default: return nullptr;
  }
}

}  // namespace cbserve_kquant
