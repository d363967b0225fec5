// GGUF block formats multiplied in place: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K.
// AVX2 + FMA + F16C (x86-64-v3); registered as torch.ops.cbserve.ggml_linear / ggml_rows.
//
// The weights are the file's own bytes, one row per output (a row is K / block_size blocks laid
// out exactly as llama.cpp's ggml-common.h defines them), so memory is the file's size and the
// loader's row permutation and q/k/v or gate/up fusion are plain row gathers and concatenations.
// A fused weight may join parts of different formats (Q4_K q/k with a Q6_K v): `m` lists them.
//
// Two ways to multiply (the caller picks, per `kind`):
// - float32 activations: each weight block is decoded to float32 (w = u * s + o, the same float
//   as gguf's dequantize) and multiplied with FMA, for up to MR activation rows per decode.
// - int8 activations: each row of x is quantized (per 32 inputs for the 32-value formats, per 256
//   with sums per 16 for the K formats: llama.cpp's Q8_0 / Q8_K activations) and the nibbles meet
//   them in vpmaddubsw (unsigned weight x signed activation pairs) then vpmaddwd with the block's
//   integer sub-scales; fp32 only once per block (per 256 inputs for the K formats). A format's
//   zero point or minimum enters through the activation block sums.
//   The 32-value formats' dots read the file's rows for a few activation rows (decode) and a
//   copy unpacked once per weight row for more (prefill); both do the same arithmetic.
// A row's result does not depend on the batch: every activation row goes through the same
// sequence of operations whatever MR tile it falls in, and its sums run in one fixed order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"
#include "enums.h"
#include "ops.h"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace cbserve_kquant {
namespace {

// ggml type ids (ggml.h / gguf.GGMLQuantizationType).
enum Type : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
// The kinds (GGUF rows, float32 or int8 activations) and epilogues shared with the other ops.
constexpr int64_t GGML_F32 = cbserve::GGML, GGML_A8 = cbserve::GGML_A8;
constexpr int64_t NONE = cbserve::NONE, SILU_MUL = cbserve::SILU_MUL;

constexpr int MR = 4;  // activation rows per weight-row decode
constexpr int64_t ROWS_MAX_M = MR;  // up to this many activation rows, no unpacked copy of a row

inline int64_t block_values(int64_t t) { return t >= Q4_K ? 256 : 32; }
inline int64_t block_bytes(int64_t t) {
  switch (t) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
  }
}

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

using cbserve::hsum;

inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// -- unpacking ------------------------------------------------------------------------------------

// 16 bytes of nibbles -> 32 values: byte j's low nibble is value j, its high nibble value j + 16.
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
}

// 32 bits -> 32 bytes, byte j = 0x10 if bit j is set (the fifth bit of the Q5 formats).
inline __m256i bits32(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
  const __m256i mask = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask), _mm256_set1_epi8(0x10));
}

// Q6_K: half n (0 or 1) of a super-block's 6-bit values (128 of them, unsigned 0..63) as four
// 32-byte vectors, from its low nibbles (ql) and high two bits (qh), in the block's value order.
inline void q6k_half(__m256i u[4], const uint8_t* b, int n) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
  const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * n));
  const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * n + 32));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * n));
  u[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4));
  u[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4),
                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4));
  u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4));
  u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                         _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4));
}

// Q4_K / Q5_K: 8 six-bit scales and 8 six-bit mins from their 12 packed bytes.
inline void scales_k4(const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = q[j] & 63;
    mn[j] = q[j + 4] & 63;
    sc[j + 4] = (q[j + 8] & 0x0F) | ((q[j] >> 6) << 4);
    mn[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
  }
}

// One 32-value block of a 32-value format as unsigned bytes u with w = u * s + o (Q8_0: signed
// bytes, o = 0).
template <int T>
inline __m256i block32(const uint8_t* b, float& s, float& o) {
  s = fp16(b);
  if constexpr (T == Q4_0) {
    o = -8.f * s;
    return nibbles32(b + 2);
  } else if constexpr (T == Q4_1) {
    o = fp16(b + 2);
    return nibbles32(b + 4);
  } else if constexpr (T == Q5_0) {
    o = -16.f * s;
    return _mm256_or_si256(nibbles32(b + 6), bits32(b + 2));
  } else if constexpr (T == Q5_1) {
    o = fp16(b + 2);
    return _mm256_or_si256(nibbles32(b + 8), bits32(b + 4));
  } else {  // Q8_0
    o = 0.f;
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  }
}

// The 32 values u[0..32) as floats u * s + o into dst (u unsigned, or signed for Q8_0).
template <bool SIGNED>
inline void store_floats(__m256i u, __m256 s, __m256 o, float* dst) {
  alignas(32) uint8_t bytes[32];
  _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), u);
  for (int i = 0; i < 4; ++i) {
    const __m128i b8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8 * i));
    const __m256i v = SIGNED ? _mm256_cvtepi8_epi32(b8) : _mm256_cvtepu8_epi32(b8);
    _mm256_store_ps(dst + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), s, o));
  }
}

// One block of type T decoded to float32 (block_values(T) values), bit for bit gguf's dequantize.
template <int T>
inline void decode_block(const uint8_t* b, float* dst) {
  if constexpr (T == Q4_K || T == Q5_K) {
    const float d = fp16(b), dmin = fp16(b + 2);
    uint8_t sc[8], mn[8];
    scales_k4(b + 4, sc, mn);
    const uint8_t* qs = b + (T == Q4_K ? 16 : 48);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i qh = T == Q5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)) : _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      if constexpr (T == Q5_K) {
        const __m256i one = _mm256_set1_epi8(1);
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4));
      }
      store_floats<false>(lo, _mm256_set1_ps(d * sc[2 * j]), _mm256_set1_ps(-(dmin * mn[2 * j])), dst + 64 * j);
      store_floats<false>(hi, _mm256_set1_ps(d * sc[2 * j + 1]), _mm256_set1_ps(-(dmin * mn[2 * j + 1])),
                          dst + 64 * j + 32);
    }
  } else if constexpr (T == Q6_K) {
    const float d = fp16(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
    for (int n = 0; n < 2; ++n) {
      __m256i u[4];
      q6k_half(u, b, n);
      for (int k = 0; k < 4; ++k) {
        alignas(32) uint8_t bytes[32];
        _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), u[k]);
        for (int i = 0; i < 4; ++i) {  // 8 values; a scale per 16
          const float s = d * sc[8 * n + 2 * k + i / 2];
          const __m256 v = _mm256_cvtepi32_ps(
              _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8 * i))));
          _mm256_store_ps(dst + 128 * n + 32 * k + 8 * i,
                          _mm256_fmadd_ps(v, _mm256_set1_ps(s), _mm256_set1_ps(-32.f * s)));
        }
      }
    }
  } else {
    float s, o;
    const __m256i u = block32<T>(b, s, o);
    store_floats<T == Q8_0>(u, _mm256_set1_ps(s), _mm256_set1_ps(o), dst);
  }
}

// -- activations ----------------------------------------------------------------------------------

// int8 rows of x: per 32 inputs (d32 = max|x| / 127, s32 = d32 * sum(q)) and per 256 inputs
// (d256, sums per 16 in bs16), whichever the weight formats of the call need.
struct Acts {
  const float* x;  // (M, K) float32 (the float path)
  int64_t K;
  const int8_t* q32;  // rows of nb32 blocks: K / 32 rounded up to 8, the padding zeros
  int64_t nb32;
  const float* d32;
  const float* s32;
  const int8_t* q256;
  const float* d256;
  const int16_t* bs16;
};

// 32 floats times inv, rounded (nearest, ties to even) to int8 in dst; the sums of each 16.
inline void round32(const float* x, float inv, int8_t* dst, int32_t& sum0, int32_t& sum1) {
  const __m256 vi = _mm256_set1_ps(inv);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), vi));
  sum0 = hsum_i32(_mm256_add_epi32(q[0], q[1]));
  sum1 = hsum_i32(_mm256_add_epi32(q[2], q[3]));
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

inline float absmax(const float* x, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

void quantize32(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float dd = absmax(x + 32 * b, 32) / 127.f;
    const float inv = dd > 0.f ? 1.f / dd : 0.f;
    int32_t s0, s1;
    round32(x + 32 * b, inv, q + 32 * b, s0, s1);
    d[b] = dd;
    s[b] = dd * static_cast<float>(s0 + s1);
  }
}

void quantize256(const float* x, int64_t K, int8_t* q, float* d, int16_t* bs) {
  for (int64_t b = 0; b < K / 256; ++b) {
    const float dd = absmax(x + 256 * b, 256) / 127.f;
    const float inv = dd > 0.f ? 1.f / dd : 0.f;
    for (int i = 0; i < 8; ++i) {
      int32_t s0, s1;
      round32(x + 256 * b + 32 * i, inv, q + 256 * b + 32 * i, s0, s1);
      bs[16 * b + 2 * i] = static_cast<int16_t>(s0);
      bs[16 * b + 2 * i + 1] = static_cast<int16_t>(s1);
    }
    d[b] = dd;
  }
}

// -- int8 dot products ----------------------------------------------------------------------------
// res[r] = sum_k w[k] x[r0 + r][k] for a weight row w of nb blocks, rows r < R.

// A row of a 32-value format unpacked for the int8 kernel: the blocks' bytes u (unsigned, or
// signed for Q8_0), then per block the float scale s and offset o (w = u s + o), the block count
// rounded up to 8 with zero blocks.
inline int64_t b32_groups(int64_t nb) { return (nb + 7) / 8; }
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

// Eight 8-lane int32 vectors -> their eight sums, in one vector (lane j = sum of p[j]).
inline __m256i sums8(const __m256i* p) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
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

template <int T, int R>
void dot_a8_k4(const uint8_t* w, const Acts& a, int64_t r0, int64_t nb, float* res) {  // Q4_K, Q5_K
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  const int64_t nbx = a.K / 256;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * block_bytes(T);
    const float d = fp16(blk), dmin = fp16(blk + 2);
    uint8_t sc[8], mn[8];
    scales_k4(blk + 4, sc, mn);
    const uint8_t* qs = blk + (T == Q4_K ? 16 : 48);
    const __m256i qh = T == Q5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)) : _mm256_setzero_si256();
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      if constexpr (T == Q5_K) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4));
      }
      const __m256i s0 = _mm256_set1_epi16(sc[2 * j]), s1 = _mm256_set1_epi16(sc[2 * j + 1]);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = a.q256 + ((r0 + r) * nbx + b) * 256 + 64 * j;
        const __m256i p0 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr))), s0);
        const __m256i p1 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32))), s1);
        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(p0, p1));
      }
    }
    const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)));
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * nbx + b;
      const int16_t* bs = a.bs16 + rb * 16;
      const __m128i pairs = _mm_hadd_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bs)),
                                           _mm_loadu_si128(reinterpret_cast<const __m128i*>(bs + 8)));
      const __m256i pm = _mm256_zextsi128_si256(_mm_madd_epi16(mins, pairs));
      const float dx = a.d256[rb];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_set1_ps(d * dx), acc[r]);
      acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(pm), _mm256_set1_ps(dmin * dx), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) res[r] = hsum(acc[r]);
}

template <int R>
void dot_a8_q6k(const uint8_t* w, const Acts& a, int64_t r0, int64_t nb, float* res) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
  const int64_t nbx = a.K / 256;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 210;
    const float d = fp16(blk + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
    for (int n = 0; n < 2; ++n) {
      __m256i u[4];
      q6k_half(u, blk, n);
      __m256i s[4];
      for (int k = 0; k < 4; ++k)
        s[k] = _mm256_set_m128i(_mm_set1_epi16(sc[8 * n + 2 * k + 1]), _mm_set1_epi16(sc[8 * n + 2 * k]));
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = a.q256 + ((r0 + r) * nbx + b) * 256 + 128 * n;
        for (int k = 0; k < 4; ++k) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32 * k));
          sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u[k], xv), s[k]));
        }
      }
    }
    // w = d sc (u - 32): take 32 sc x (the block's sums per 16) back out.
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * nbx + b;
      const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bs16 + rb * 16));
      const __m256i tot = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_set1_ps(d * a.d256[rb]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) res[r] = hsum(acc[r]);
}

// -- float32 activations --------------------------------------------------------------------------

// A row decoded to K floats (unpack_f32); R activation rows, two accumulators each.
template <int T>
void unpack_f32(const uint8_t* w, int64_t nb, uint8_t* dst) {
  float* out = reinterpret_cast<float*>(dst);
  constexpr int64_t V = T >= Q4_K ? 256 : 32;
  for (int64_t b = 0; b < nb; ++b) decode_block<T>(w + b * block_bytes(T), out + b * V);
}

template <int R>
void dot_f32(const uint8_t* w_, const Acts& a, int64_t r0, int64_t, float* res) {
  const float* w = reinterpret_cast<const float*>(w_);
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) { acc0[r] = _mm256_setzero_ps(); acc1[r] = _mm256_setzero_ps(); }
  for (int64_t k = 0; k < a.K; k += 16) {
    const __m256 w0 = _mm256_load_ps(w + k), w1 = _mm256_load_ps(w + k + 8);
    for (int r = 0; r < R; ++r) {
      const float* xr = a.x + (r0 + r) * a.K + k;
      acc0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc0[r]);
      acc1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) res[r] = hsum(_mm256_add_ps(acc0[r], acc1[r]));
}

// -- dispatch -------------------------------------------------------------------------------------

using DotFn = void (*)(const uint8_t*, const Acts&, int64_t, int64_t, float*);
using UnpackFn = void (*)(const uint8_t*, int64_t, uint8_t*);

// rows: the 32-value formats' int8 dots read the file's rows (else rows unpacked by unpack_b32).
template <int R>
DotFn dot_for(int64_t type, bool int8, bool rows) {
  if (!int8) return dot_f32<R>;
  switch (type) {
    case Q8_0: return rows ? dot_a8_b32_rows<Q8_0, R> : dot_a8_b32<true, R>;
    case Q4_0: return rows ? dot_a8_b32_rows<Q4_0, R> : dot_a8_b32<false, R>;
    case Q4_1: return rows ? dot_a8_b32_rows<Q4_1, R> : dot_a8_b32<false, R>;
    case Q5_0: return rows ? dot_a8_b32_rows<Q5_0, R> : dot_a8_b32<false, R>;
    case Q5_1: return rows ? dot_a8_b32_rows<Q5_1, R> : dot_a8_b32<false, R>;
    case Q4_K: return dot_a8_k4<Q4_K, R>;
    case Q5_K: return dot_a8_k4<Q5_K, R>;
    default: return dot_a8_q6k<R>;
  }
}

// How a part's rows are prepared for its DotFn (null: the DotFn reads the file's bytes) and the
// bytes a prepared row takes.
UnpackFn unpack_for(int64_t type, bool int8, bool rows, int64_t K, int64_t& bytes) {
  const int64_t nb = K / block_values(type);
  if (int8 && rows) {
    bytes = 0;
    return nullptr;
  }
  if (!int8) {
    bytes = K * 4;
    switch (type) {
      case Q4_0: return unpack_f32<Q4_0>;
      case Q4_1: return unpack_f32<Q4_1>;
      case Q5_0: return unpack_f32<Q5_0>;
      case Q5_1: return unpack_f32<Q5_1>;
      case Q8_0: return unpack_f32<Q8_0>;
      case Q4_K: return unpack_f32<Q4_K>;
      case Q5_K: return unpack_f32<Q5_K>;
      default: return unpack_f32<Q6_K>;
    }
  }
  bytes = b32_unpacked_bytes(nb);
  switch (type) {
    case Q4_0: return unpack_b32<Q4_0>;
    case Q4_1: return unpack_b32<Q4_1>;
    case Q5_0: return unpack_b32<Q5_0>;
    case Q5_1: return unpack_b32<Q5_1>;
    case Q8_0: return unpack_b32<Q8_0>;
    default: bytes = 0; return nullptr;
  }
}

struct Part {
  int64_t type, n0, rows, row_bytes, nb;
  const uint8_t* data;
  DotFn fn[MR + 1];  // by the number of activation rows
  UnpackFn unpack;
  int64_t unpacked_bytes;
};

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// parts: (P, 3) int64 rows [ggml type, rows, byte offset into qs]; their rows are the outputs in
// order. `d` is unused (the scales live in the blocks); kept so the schema is packed_linear's.
at::Tensor ggml_linear(const at::Tensor& x_, const at::Tensor& qs, const c10::optional<at::Tensor>& d_,
                       const c10::optional<at::Tensor>& parts_, int64_t kind, int64_t N,
                       const c10::optional<at::Tensor>& bias_, const c10::optional<at::Tensor>& residual_,
                       int64_t act) {
  (void)d_;
  TORCH_CHECK(x_.scalar_type() == at::kFloat && x_.dim() == 2, "x must be a 2-D float32 tensor");
  TORCH_CHECK(kind == GGML_F32 || kind == GGML_A8, "ggml_linear: unknown kind ", kind);
  TORCH_CHECK(parts_.has_value() && parts_->scalar_type() == at::kLong && parts_->dim() == 2 && parts_->size(1) == 3,
              "ggml_linear needs its (parts, 3) int64 table");
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous(), "ggml_linear: qs must be contiguous uint8");
  at::Tensor x = x_.contiguous();
  at::Tensor pt = parts_->contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const bool int8 = kind == GGML_A8;
  // A few activation rows (decode): the int8 dots read the file's rows; more (prefill): each
  // 32-value row is unpacked once and met by every MR activation rows.
  const bool rows = M <= ROWS_MAX_M;
  const uint8_t* base = qs.data_ptr<uint8_t>();
  std::vector<Part> parts;
  int64_t n0 = 0;
  bool need32 = false, need256 = false;
  int64_t max_unpacked = 0;
  for (int64_t i = 0; i < pt.size(0); ++i) {
    const int64_t* row = pt.data_ptr<int64_t>() + 3 * i;
    const int64_t type = row[0], bb = block_bytes(type), bv = block_values(type);
    TORCH_CHECK(bb > 0, "ggml_linear: unsupported ggml type ", type);
    TORCH_CHECK(K % bv == 0, "ggml_linear: in_features ", K, " is not a multiple of ", bv);
    Part p{type, n0, row[1], K / bv * bb, K / bv, base + row[2], {}, nullptr, 0};
    p.unpack = unpack_for(type, int8, rows, K, p.unpacked_bytes);
    max_unpacked = std::max(max_unpacked, p.unpacked_bytes);
    TORCH_CHECK(row[2] >= 0 && row[2] + p.rows * p.row_bytes <= qs.numel(), "ggml_linear: part ", i,
                " lies outside qs");
    p.fn[1] = dot_for<1>(type, int8, rows);
    p.fn[2] = dot_for<2>(type, int8, rows);
    p.fn[3] = dot_for<3>(type, int8, rows);
    p.fn[4] = dot_for<4>(type, int8, rows);
    (bv == 32 ? need32 : need256) = true;
    parts.push_back(p);
    n0 += p.rows;
  }
  TORCH_CHECK(n0 == N, "ggml_linear: the parts hold ", n0, " rows, not N = ", N);
  TORCH_CHECK(act == NONE || (act == SILU_MUL && N % 2 == 0), "ggml_linear: bad act ", act);
  const int64_t out_n = act == SILU_MUL ? N / 2 : N;
  at::Tensor out = at::empty({M, out_n}, x.options());
  if (M == 0) return out;
  at::Tensor bias, residual;
  if (bias_.has_value() && bias_->defined()) {
    bias = bias_->contiguous();
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.numel() == N, "bias must be (N,) float32");
  }
  if (residual_.has_value() && residual_->defined()) {
    residual = residual_->contiguous();
    TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.size(0) == M && residual.size(1) == N,
                "residual must be (M, N) float32");
  }
  const float* xp = x.data_ptr<float>();
  Acts acts{xp, K, nullptr, 0, nullptr, nullptr, nullptr, nullptr, nullptr};
  std::vector<int8_t> q32, q256;
  std::vector<float> d32, s32, d256;
  std::vector<int16_t> bs16;
  if (int8) {
    const int64_t nb32 = b32_groups(K / 32) * 8;  // zero blocks pad rows to whole groups of 8
    if (need32) { q32.assign(M * nb32 * 32, 0); d32.assign(M * nb32, 0.f); s32.assign(M * nb32, 0.f); }
    if (need256) { q256.resize(M * K); d256.resize(M * K / 256); bs16.resize(M * K / 16); }
    at::parallel_for(0, M, std::max<int64_t>(1, (1 << 14) / K), [&](int64_t a, int64_t b) {
      for (int64_t r = a; r < b; ++r) {
        if (need32) quantize32(xp + r * K, K, q32.data() + r * nb32 * 32, d32.data() + r * nb32, s32.data() + r * nb32);
        if (need256)
          quantize256(xp + r * K, K, q256.data() + r * K, d256.data() + r * K / 256, bs16.data() + r * K / 16);
      }
    });
    acts = Acts{xp, K, q32.data(), nb32, d32.data(), s32.data(), q256.data(), d256.data(), bs16.data()};
  }
  // Results go straight to `out` (with bias and residual), or for silu_mul to y and then out.
  at::Tensor y = act == SILU_MUL ? at::empty({M, N}, x.options()) : out;
  float* yp = y.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const float* rp = act == NONE && residual.defined() ? residual.data_ptr<float>() : nullptr;
  // A tile of NT weight rows is prepared once (decoded to float, or to the int8 kernel's bytes)
  // and then met by every MR activation rows; a row's result is the same whatever M is.
  constexpr int64_t NT = 16;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, M * K));
  at::parallel_for(0, N, grain, [&](int64_t c0, int64_t c1) {
    float res[MR];
    // One buffer per thread for the process's life: a decode step's calls then allocate nothing.
    static thread_local std::vector<uint8_t> buf_;
    if (buf_.size() < static_cast<size_t>(NT * max_unpacked + 64)) buf_.resize(NT * max_unpacked + 64);
    uint8_t* buf = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf_.data()) + 63) & ~uintptr_t(63));
    for (int64_t t0 = c0; t0 < c1; t0 += NT) {
      const int64_t t1 = std::min(c1, t0 + NT);
      const uint8_t* rows[NT];
      const Part* owner[NT];
      size_t pi = 0;
      for (int64_t n = t0; n < t1; ++n) {
        while (n >= parts[pi].n0 + parts[pi].rows) ++pi;
        const Part& p = parts[pi];
        const uint8_t* raw = p.data + (n - p.n0) * p.row_bytes;
        owner[n - t0] = &p;
        if (p.unpack) {
          uint8_t* dst = buf + (n - t0) * max_unpacked;
          p.unpack(raw, p.nb, dst);
          rows[n - t0] = dst;
        } else {
          rows[n - t0] = raw;
        }
      }
      for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int64_t mr = std::min<int64_t>(MR, M - m0);
        for (int64_t n = t0; n < t1; ++n) {
          const Part& p = *owner[n - t0];
          p.fn[mr](rows[n - t0], acts, m0, p.nb, res);
          for (int64_t r = 0; r < mr; ++r) {
            float v = res[r];
            if (bp) v += bp[n];
            if (rp) v += rp[(m0 + r) * N + n];
            yp[(m0 + r) * y.size(1) + n] = v;
          }
        }
      }
    }
  });
  if (act == SILU_MUL) {
    const int64_t F = N / 2;
    float* op = out.data_ptr<float>();
    at::parallel_for(0, M, std::max<int64_t>(1, (1 << 14) / F), [&](int64_t a, int64_t b) {
      for (int64_t r = a; r < b; ++r)
        for (int64_t j = 0; j < F; ++j) op[r * F + j] = silu(yp[r * N + j]) * yp[r * N + F + j];
    });
  }
  return out;
}

// Rows `ids` of a (rows, K) GGUF matrix of `type`, decoded to float32: an embedding lookup that
// keeps the table in its file format.
at::Tensor ggml_rows(const at::Tensor& qs, int64_t type, int64_t K, const at::Tensor& ids_) {
  const int64_t bb = block_bytes(type), bv = block_values(type);
  TORCH_CHECK(bb > 0, "ggml_rows: unsupported ggml type ", type);
  TORCH_CHECK(K % bv == 0, "ggml_rows: K ", K, " is not a multiple of ", bv);
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous(), "ggml_rows: qs must be contiguous uint8");
  at::Tensor ids = ids_.to(at::kLong).contiguous();
  const int64_t row_bytes = K / bv * bb, rows = qs.numel() / row_bytes, T = ids.numel();
  at::Tensor out = at::empty({T, K}, at::TensorOptions().dtype(at::kFloat));
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < rows, "ggml_rows: id ", ip[t], " out of range");
  const uint8_t* base = qs.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, (1 << 14) / K), [&](int64_t a, int64_t b) {
    alignas(32) float buf[256];
    for (int64_t t = a; t < b; ++t) {
      const uint8_t* row = base + ip[t] * row_bytes;
      for (int64_t i = 0; i < K / bv; ++i) {
        switch (type) {
          case Q4_0: decode_block<Q4_0>(row + i * bb, buf); break;
          case Q4_1: decode_block<Q4_1>(row + i * bb, buf); break;
          case Q5_0: decode_block<Q5_0>(row + i * bb, buf); break;
          case Q5_1: decode_block<Q5_1>(row + i * bb, buf); break;
          case Q8_0: decode_block<Q8_0>(row + i * bb, buf); break;
          case Q4_K: decode_block<Q4_K>(row + i * bb, buf); break;
          case Q5_K: decode_block<Q5_K>(row + i * bb, buf); break;
          default: decode_block<Q6_K>(row + i * bb, buf); break;
        }
        std::memcpy(op + t * K + i * bv, buf, bv * sizeof(float));
      }
    }
  });
  std::vector<int64_t> shape = ids_.sizes().vec();
  shape.push_back(K);
  return out.view(shape);
}

}  // namespace
}  // namespace cbserve_kquant

namespace cbserve {
at::Tensor ggml_linear(const at::Tensor& x, const at::Tensor& qs, const c10::optional<at::Tensor>& d,
                       const c10::optional<at::Tensor>& parts, int64_t kind, int64_t N,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                       int64_t act) {
  return cbserve_kquant::ggml_linear(x, qs, d, parts, kind, N, bias, residual, act);
}
at::Tensor ggml_rows(const at::Tensor& qs, int64_t type, int64_t K, const at::Tensor& ids) {
  return cbserve_kquant::ggml_rows(qs, type, K, ids);
}
}  // namespace cbserve
