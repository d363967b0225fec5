// int8-activation dots of MXFP4 (ggml type 39, OCP microscaling FP4: gpt-oss's expert weights),
// AVX2. A block is 17 bytes, {uint8 e; 16 bytes of nibbles}: 32 signed values -12..12 (E2M1
// doubled, kquant.h's mxfp4_values) times 2^(e - 128) (e8m0_half). It is IQ4_NL with a
// power-of-two scale, and meets the 32-value formats' activations (int8 per 32 inputs, d32).
//
// The arithmetic of one (weight row, activation row) pair, the same on every path: per block b in
// order, I = the block's exact integer dot (w x: |x| x (w with x's sign) in vpmaddubsw, each pair
// at most 2 x 12 x 127), then acc = fma(float(I), s * d32, acc) with s the block's scale, acc
// starting at 0 and being the result. Eight weight rows go together, a float lane each: their
// eight int32 partial sums are reduced across (sums8) so a row's dot lands in its lane, whatever
// lane, pass or batch size it meets.
//
// One activation row reads each row's blocks as the file holds them; more unpack a pass of eight
// rows once (values and scales, ~29 KB at K = 2880: in L1 / L2) and run every activation row over
// it.
#include "kquant.h"

namespace cbserve_kquant {
namespace {

constexpr int64_t BB = 17;         // bytes a block
constexpr int64_t PR = 8;          // weight rows a pass (the float lanes)
constexpr int64_t UB = PR * 32 + PR * 4;  // bytes of an unpacked block of a pass: 8 x 32 values, 8 scales

// The scales of eight rows' block b, row n in lane n.
inline __m256 scales8(const uint8_t* const* w, int64_t b) {
  const int64_t o = b * BB;
  return _mm256_setr_ps(e8m0_half(w[0][o]), e8m0_half(w[1][o]), e8m0_half(w[2][o]), e8m0_half(w[3][o]),
                        e8m0_half(w[4][o]), e8m0_half(w[5][o]), e8m0_half(w[6][o]), e8m0_half(w[7][o]));
}

// acc += the eight rows' block dots (values v[i], scales s) with activation block b of row a.
inline __m256 block_step(const __m256i* v, __m256 s, const Acts& a, int64_t b, __m256 acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q32 + b * 32));
  const __m256i xa = _mm256_sign_epi8(xv, xv);  // |x| (x >= -127: no overflow)
  __m256i p[PR];
  for (int i = 0; i < PR; ++i) p[i] = _mm256_madd_epi16(_mm256_maddubs_epi16(xa, _mm256_sign_epi8(v[i], xv)), ones);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums8(p)), _mm256_mul_ps(s, _mm256_set1_ps(a.d32[b])), acc);
}

inline void store_lanes(__m256 acc, int64_t rows, float* y) {
  if (rows == PR) return _mm256_storeu_ps(y, acc);
  alignas(32) float v[PR];
  _mm256_store_ps(v, acc);
  std::memcpy(y, v, rows * sizeof(float));
}

// Row pointers of the pass at output n (absolute in p), `rows` real: the lanes past a partial
// pass repeat its last row (their results are never stored).
inline void pass_rows(const Part& p, int64_t n, int64_t rows, const uint8_t** w) {
  for (int64_t i = 0; i < PR; ++i) w[i] = p.data + (n - p.n0 + std::min(i, rows - 1)) * p.row_bytes;
}

// One activation row (decode): the file's blocks as they are.
void tile_row1(const Part& p, int64_t n0, int64_t n1, const Acts& a, float* y) {
  for (int64_t n = n0; n < n1; n += PR) {
    const int64_t rows = std::min(PR, n1 - n);
    const uint8_t* w[PR];
    pass_rows(p, n, rows, w);
    const uint8_t* next = w[0] + PR * p.row_bytes;
    const int64_t next_bytes = std::min<int64_t>(PR, std::max<int64_t>(0, p.n0 + p.rows - n - PR)) * p.row_bytes;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < p.nb; ++b) {
      // ask for the next pass's b-th share while this one is read (PR streams a row apart)
      for (int64_t o = b * next_bytes / p.nb & ~int64_t(63), e = (b + 1) * next_bytes / p.nb; o < e; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next + o), _MM_HINT_T0);
      __m256i v[PR];
      for (int i = 0; i < PR; ++i) v[i] = mxfp4_values(w[i] + b * BB);
      acc = block_step(v, scales8(w, b), a, b, acc);
    }
    store_lanes(acc, rows, y + n);
  }
}

// More rows: each pass of eight weight rows unpacked once (per block: the eight rows' 32 values,
// then their eight scales), then met by every activation row in turn.
void tile_rows(const Part& p, int64_t n0, int64_t n1, const Acts& a, int64_t M, float* y, int64_t ldy) {
  uint8_t* buf = scratch(p.nb * UB);
  for (int64_t n = n0; n < n1; n += PR) {
    const int64_t rows = std::min(PR, n1 - n);
    const uint8_t* w[PR];
    pass_rows(p, n, rows, w);
    for (int64_t b = 0; b < p.nb; ++b) {
      uint8_t* dst = buf + b * UB;
      for (int i = 0; i < PR; ++i)
        _mm256_store_si256(reinterpret_cast<__m256i*>(dst + 32 * i), mxfp4_values(w[i] + b * BB));
      _mm256_store_ps(reinterpret_cast<float*>(dst + PR * 32), scales8(w, b));
    }
    for (int64_t m = 0; m < M; ++m) {
      const Acts row = [&] {
        Acts r = a;
        r.q32 += m * a.nb32 * 32;
        r.d32 += m * a.nb32;
        return r;
      }();
      __m256 acc = _mm256_setzero_ps();
      for (int64_t b = 0; b < p.nb; ++b) {
        const uint8_t* src = buf + b * UB;
        __m256i v[PR];
        for (int i = 0; i < PR; ++i) v[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(src + 32 * i));
        acc = block_step(v, _mm256_load_ps(reinterpret_cast<const float*>(src + PR * 32)), row, b, acc);
      }
      store_lanes(acc, rows, y + m * ldy + n);
    }
  }
}

void tile_mxfp4(const Part& p, int64_t n0, int64_t n1, const Acts& a, int64_t M, float* y, int64_t ldy) {
  if (M == 1) return tile_row1(p, n0, n1, a, y);
  tile_rows(p, n0, n1, a, M, y, ldy);
}

}  // namespace

TileFn tile_mxfp4_a8() { return tile_mxfp4; }

}  // namespace cbserve_kquant
