// The GGUF block formats' shared pieces (kquant*.cpp): ggml type ids and block sizes, decoding a
// block (to the bytes the int8 kernels meet, or to float32), the quantized activations and the
// interface by which each format family computes a tile of outputs.
//
// Layout of the family files: kquant.cpp owns the op (activation quantization, the threads, the
// epilogue) and the float32-activation path; kquant_b32.cpp the int8 dots of the 32-value formats
// (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0); kquant_k.cpp those of the 256-value K formats (Q4_K, Q5_K, Q6_K).
// A family may tile its work as it likes, with one rule: an activation row's result does not depend
// on how many rows the call has (the same operations in the same order for any M).
#pragma once

#include <ATen/ATen.h>

#include "common.h"
#include "enums.h"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace cbserve_kquant {

// ggml type ids (ggml.h / gguf.GGMLQuantizationType).
enum Type : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
// The kinds (GGUF rows, float32 or int8 activations) and epilogues shared with the other ops.
constexpr int64_t GGML_F32 = cbserve::GGML, GGML_A8 = cbserve::GGML_A8;
constexpr int64_t NONE = cbserve::NONE, SILU_MUL = cbserve::SILU_MUL;

constexpr int MR = 4;  // activation rows per weight-row decode (the row-at-a-time tile)

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


// Eight 8-lane int32 vectors -> their eight sums, in one vector (lane j = sum of p[j]).
inline __m256i sums8(const __m256i* p) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// The 32-value formats' int8 activations come in groups of 8 blocks (a row's block count rounded
// up to 8 with zero blocks).
inline int64_t b32_groups(int64_t nb) { return (nb + 7) / 8; }

// -- the families' interface ----------------------------------------------------------------------

// One part of a (possibly fused) weight: `rows` outputs from output n0, each row `row_bytes` of
// the file's blocks (nb blocks) from `data`.
struct Part {
  int64_t type, n0, rows, row_bytes, nb;
  const uint8_t* data;
};

// Outputs [n0, n1) (absolute output indices inside `p`) for all M activation rows, written to
// y[m * ldy + n]. One thread's share of a call; may keep per-thread scratch.
using TileFn = void (*)(const Part& p, int64_t n0, int64_t n1, const Acts& a, int64_t M, float* y, int64_t ldy);

// res[r] = sum_k w[k] x[r0 + r][k] for a weight row w of nb blocks, rows r < R (R = the index in
// the tables below).
using DotFn = void (*)(const uint8_t* w, const Acts& a, int64_t r0, int64_t nb, float* res);
// Prepares a file row for a DotFn into dst (a row used by many activation rows is unpacked once).
using UnpackFn = void (*)(const uint8_t* w, int64_t nb, uint8_t* dst);

// The row-at-a-time tile: NT weight rows, each prepared by `unpack` (when given; else the dots
// read the file's row), then met by every MR activation rows through dots[mr].
inline void tile_by_rows(const DotFn* dots, UnpackFn unpack, int64_t unpacked_bytes, const Part& p, int64_t n0,
                         int64_t n1, const Acts& a, int64_t M, float* y, int64_t ldy) {
  constexpr int64_t NT = 16;
  float res[MR];
  // One buffer per thread for the process's life: a decode step's calls then allocate nothing.
  static thread_local std::vector<uint8_t> buf_;
  if (unpack && buf_.size() < static_cast<size_t>(NT * unpacked_bytes + 64)) buf_.resize(NT * unpacked_bytes + 64);
  uint8_t* buf = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf_.data()) + 63) & ~uintptr_t(63));
  for (int64_t t0 = n0; t0 < n1; t0 += NT) {
    const int64_t t1 = std::min(n1, t0 + NT);
    const uint8_t* rows[NT];
    for (int64_t n = t0; n < t1; ++n) {
      const uint8_t* raw = p.data + (n - p.n0) * p.row_bytes;
      if (unpack) {
        uint8_t* dst = buf + (n - t0) * unpacked_bytes;
        unpack(raw, p.nb, dst);
        rows[n - t0] = dst;
      } else {
        rows[n - t0] = raw;
      }
    }
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
      const int64_t mr = std::min<int64_t>(MR, M - m0);
      for (int64_t n = t0; n < t1; ++n) {
        dots[mr](rows[n - t0], a, m0, p.nb, res);
        for (int64_t r = 0; r < mr; ++r) y[(m0 + r) * ldy + n] = res[r];
      }
    }
  }
}

// The families' tiles for int8 activations (the float32 path is kquant.cpp's).
TileFn tile_b32_a8(int64_t type);  // kquant_b32.cpp
TileFn tile_k_a8(int64_t type);    // kquant_k.cpp

}  // namespace cbserve_kquant
