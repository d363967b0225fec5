// The GGUF block formats' shared pieces (kquant*.cpp): ggml type ids and block sizes, decoding a
// block (to the bytes the int8 kernels meet, or to float32), the quantized activations and the
// interface by which each format family computes a tile of outputs.
//
// Layout of the family files: kquant.cpp owns the op (activation quantization, the threads, the
// epilogue) and the float32-activation path; kquant_b32.cpp the int8 dots of the 32-value formats
// (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, and IQ4_XS as eight 32-value sub-blocks with a scale each;
// kquant_b32_vnni.cpp their AVX512-VNNI panels for many activation rows);
// kquant_k.cpp those of the 256-value K formats (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K); kquant_mxfp4.cpp
// those of MXFP4 (OCP microscaled FP4).
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
enum Type : int64_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20,
  IQ4_XS = 23, MXFP4 = 39
};

// f(std::integral_constant<int64_t, T>{}) for the format T = t; false for a type not read in place.
template <typename F>
inline bool with_type(int64_t t, F&& f) {
  return cbserve::with_value<Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4>(
      t, std::forward<F>(f));
}
// The kinds (GGUF rows, float32 or int8 activations) and epilogues shared with the other ops.
constexpr int64_t GGML_F32 = cbserve::GGML, GGML_A8 = cbserve::GGML_A8;
constexpr int64_t NONE = cbserve::NONE, SILU_MUL = cbserve::SILU_MUL, GELU_MUL = cbserve::GELU_MUL;

constexpr int MR = 4;  // up to this many activation rows the dots read the file's rows (decode)

// The K formats' int8 dots take activations per 256 with sums per 16 (kquant_k.cpp); every other
// format's take them per 32 (kquant_b32.cpp).
constexpr bool k_family(int64_t t) { return t == Q2_K || t == Q3_K || t == Q4_K || t == Q5_K || t == Q6_K; }
// K formats with a scale per 16 values: Q6_K (u 0..63) and Q3_K (u 0..7) with a fixed offset
// (w = d sc (u - offset), sc signed), Q2_K (u 0..3) with a minimum per 16 (w = d sc u - dmin m);
// Q4_K and Q5_K have a scale and a minimum per 32.
constexpr bool scaled16(int64_t t) { return t == Q2_K || t == Q3_K || t == Q6_K; }
constexpr int k16_offset_shift(int64_t t) { return t == Q6_K ? 5 : 2; }  // log2 of the offset (Q6_K, Q3_K)
constexpr int64_t block_values(int64_t t) { return k_family(t) || t == IQ4_XS ? 256 : 32; }
// Formats whose values are signed bytes (w = u s, no offset): Q8_0 and the IQ4 table's values.
constexpr bool signed_values(int64_t t) { return t == Q8_0 || t == IQ4_NL || t == IQ4_XS; }
constexpr int64_t block_bytes(int64_t t) {
  switch (t) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    case Q3_K: return 110;
    case Q2_K: return 84;
    case IQ4_NL: return 18;
    case IQ4_XS: return 136;
    case MXFP4: return 17;
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

// 16 bytes of nibbles -> 32 values: byte j's low nibble is value j, its high nibble value j + 16
// (the 16 bytes in both halves, the upper half shifted by 4: one shift).
inline __m256i nibbles32(const uint8_t* p) {
  const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi64(q, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
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

// IQ4_NL / IQ4_XS: 16 bytes of nibbles -> 32 signed values, each nibble an index into llama.cpp's
// non-linear table (kvalues_iq4nl), looked up by one vpshufb.
inline __m256i iq4_table() {
  return _mm256_broadcastsi128_si256(_mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113));
}
inline __m256i iq4_values(const uint8_t* p) { return _mm256_shuffle_epi8(iq4_table(), nibbles32(p)); }

// MXFP4: a block is {uint8 e; 16 bytes of nibbles}, value j = kvalues_mxfp4[nibble j] * 2^(e - 128),
// kvalues_mxfp4 the E2M1 values doubled (so every value is an integer, -12..12) and the scale
// halved to match (ggml-common.h, ggml_e8m0_to_fp32_half). The nibbles index the table as IQ4's do.
inline __m256i mxfp4_table() {
  return _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12));
}
inline __m256i mxfp4_values(const uint8_t* b) { return _mm256_shuffle_epi8(mxfp4_table(), nibbles32(b + 1)); }
// 2^(e - 128) as float32, bit for bit ggml's (e 0 and 1: the denormals 2^-128 and 2^-127).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? uint32_t(0x00200000) << e : uint32_t(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// IQ4_XS: sub-block j's (of 8) scale in units of d: six bits (four from scales_l, two from
// scales_h) minus 32.
inline int iq4xs_scale(const uint8_t* b, int j) {
  uint16_t h;
  std::memcpy(&h, b + 2, 2);
  return (((b[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | (((h >> (2 * j)) & 3) << 4)) - 32;
}
// ... and its 32 values.
inline __m256i iq4xs_values(const uint8_t* b, int j) { return iq4_values(b + 8 + 16 * j); }

// Q6_K's half n (128 values, unsigned 0..63) as four 32-byte vectors in the block's value order:
// the low nibbles from ql, bits 4-5 from qh moved in place with 16-bit shifts (a byte's bits 4-5
// then come only from its own bits 0-1, 2-3, 4-5 or 6-7) and one mask.
inline void q6k_values(__m256i u[4], const uint8_t* b, int n) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * n));
  const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * n + 32));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * n));
  u[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
  u[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
  u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30));
  u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                         _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
}

// Q3_K's half n (128 values, unsigned 0..7: two bits from qs, the third from hmask) as four
// 32-byte vectors in the block's value order (vector k: qs bits 2k..2k+1, hmask bit 4n + k).
inline void q3k_values(__m256i u[4], const uint8_t* b, int n) {
  const __m256i m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(4);
  const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 + 32 * n));
  for (int k = 0; k < 4; ++k) {
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * k), m3);
    // hmask bit s = 4n + k moved straight to bit 2 (a 16-bit shift of at most 5: bit 2 of each
    // byte then still comes from that byte)
    const int sh = 4 * n + k;
    const __m256i hi = _mm256_and_si256(sh >= 2 ? _mm256_srli_epi16(hm, sh - 2) : _mm256_slli_epi16(hm, 2 - sh), m4);
    u[k] = _mm256_or_si256(lo, hi);
  }
}

// Q3_K: its 16 six-bit scales (four bits from bytes 0..7, two from bytes 8..11) minus 32, as
// int8 in one vector (word-parallel bit moves, then one byte subtraction).
inline __m128i q3k_scales(const uint8_t* b) {
  uint32_t a[3];
  std::memcpy(a, b + 96, 12);
  const uint32_t m4 = 0x0F0F0F0F, m2 = 0x03030303;
  const __m128i v = _mm_setr_epi32(static_cast<int32_t>((a[0] & m4) | ((a[2] & m2) << 4)),
                                   static_cast<int32_t>((a[1] & m4) | (((a[2] >> 2) & m2) << 4)),
                                   static_cast<int32_t>(((a[0] >> 4) & m4) | (((a[2] >> 4) & m2) << 4)),
                                   static_cast<int32_t>(((a[1] >> 4) & m4) | (((a[2] >> 6) & m2) << 4)));
  return _mm_sub_epi8(v, _mm_set1_epi8(32));
}

// ... of two blocks at once, one a 128-bit lane, in vector steps (per row, the scalar bit moves
// above cost a decode row as much as the rest of its block): the low four bits are bytes 0..7's
// nibbles, the top two of scale j bits 2 (j / 4) .. 2 (j / 4) + 1 of byte 8 + j % 4, moved down
// by one variable shift (scales 4g .. 4g + 3, one 32-bit lane, share the count 2g).
inline __m256i q3k_scales2(const uint8_t* b0, const uint8_t* b1) {
  const __m128i ctrl = _mm_setr_epi8(8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  // bytes 92..107 of each block (a load from byte 96 would pass the 110-byte block's end), moved down four
  const __m256i q = _mm256_srli_si256(_mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(b1 + 92),
                                                          reinterpret_cast<const __m128i*>(b0 + 92)), 4);
  const __m256i lo4 = _mm256_unpacklo_epi64(_mm256_and_si256(q, m4), _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
  const __m256i top = _mm256_shuffle_epi8(q, _mm256_broadcastsi128_si256(ctrl));
  const __m256i hi2 = _mm256_and_si256(_mm256_srlv_epi32(top, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6)), _mm256_set1_epi8(3));
  return _mm256_sub_epi8(_mm256_or_si256(lo4, _mm256_slli_epi16(hi2, 4)), _mm256_set1_epi8(32));
}
// ... of NR weight rows' block b.
template <int NR>
inline void q3k_scales_rows(const uint8_t* const* w, int64_t b, __m128i* sc) {
  constexpr int64_t BB = block_bytes(Q3_K);
  for (int n = 0; n < NR; n += 2) {
    const __m256i two = q3k_scales2(w[n] + b * BB, w[n + 1 < NR ? n + 1 : n] + b * BB);
    sc[n] = _mm256_castsi256_si128(two);
    if (n + 1 < NR) sc[n + 1] = _mm256_extracti128_si256(two, 1);
  }
}

// Q2_K's half n (128 values, 0..3): vector k holds qs bits 2k..2k+1.
inline void q2k_values(__m256i u[4], const uint8_t* b, int n) {
  const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * n));
  for (int k = 0; k < 4; ++k) u[k] = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * k), _mm256_set1_epi8(3));
}
// ... its 16 four-bit minimums (the high nibbles of its scale bytes).
inline __m128i q2k_mins(const uint8_t* b) {
  return _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 4), _mm_set1_epi8(0x0F));
}

// Q6_K / Q3_K / Q2_K: the block's 16 int8 scales, its values (half n), d (and Q2_K's dmin).
template <int T>
inline __m128i k16_scales(const uint8_t* b) {
  if constexpr (T == Q6_K) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
  else if constexpr (T == Q3_K) return q3k_scales(b);
  else return _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), _mm_set1_epi8(0x0F));
}
template <int T>
inline void k16_values(__m256i u[4], const uint8_t* b, int n) {
  if constexpr (T == Q6_K) q6k_values(u, b, n);
  else if constexpr (T == Q3_K) q3k_values(u, b, n);
  else q2k_values(u, b, n);
}
template <int T>
inline float k16_d(const uint8_t* b) { return fp16(b + (T == Q6_K ? 208 : T == Q3_K ? 108 : 80)); }
inline float q2k_dmin(const uint8_t* b) { return fp16(b + 82); }

// Q4_K / Q5_K: 8 six-bit scales and 8 six-bit mins from their 12 packed bytes.
inline void scales_k4(const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = q[j] & 63;
    mn[j] = q[j + 4] & 63;
    sc[j + 4] = (q[j + 8] & 0x0F) | ((q[j] >> 6) << 4);
    mn[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
  }
}

// A 32-value block's values as bytes u (unsigned; signed_values(T): signed), in its value order.
template <int T>
inline __m256i values32(const uint8_t* b) {
  if constexpr (T == Q4_0) return nibbles32(b + 2);
  else if constexpr (T == Q4_1) return nibbles32(b + 4);
  else if constexpr (T == Q5_0) return _mm256_or_si256(nibbles32(b + 6), bits32(b + 2));
  else if constexpr (T == Q5_1) return _mm256_or_si256(nibbles32(b + 8), bits32(b + 4));
  else if constexpr (T == IQ4_NL) return iq4_values(b + 2);
  else return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
}

// ... with the block's scale s and offset o: w = u * s + o (signed values: o = 0).
template <int T>
inline __m256i block32(const uint8_t* b, float& s, float& o) {
  s = fp16(b);
  o = T == Q4_0 ? -8.f * s : T == Q5_0 ? -16.f * s : T == Q4_1 || T == Q5_1 ? fp16(b + 2) : 0.f;
  return values32<T>(b);
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
  } else if constexpr (scaled16(T)) {
    const float d = k16_d<T>(b);
    alignas(16) int8_t sc[16], mn[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(sc), k16_scales<T>(b));
    if constexpr (T == Q2_K) _mm_store_si128(reinterpret_cast<__m128i*>(mn), q2k_mins(b));
    const float dmin = T == Q2_K ? q2k_dmin(b) : 0.f;
    constexpr float offset = 1 << k16_offset_shift(T);
    for (int n = 0; n < 2; ++n) {
      __m256i u[4];
      k16_values<T>(u, b, n);
      for (int k = 0; k < 4; ++k) {
        alignas(32) uint8_t bytes[32];
        _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), u[k]);
        for (int i = 0; i < 4; ++i) {  // 8 values; a scale per 16
          const int j = 8 * n + 2 * k + i / 2;
          const float s = d * sc[j], o = T == Q2_K ? -(dmin * mn[j]) : -offset * s;
          const __m256 v = _mm256_cvtepi32_ps(
              _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8 * i))));
          _mm256_store_ps(dst + 128 * n + 32 * k + 8 * i, _mm256_fmadd_ps(v, _mm256_set1_ps(s), _mm256_set1_ps(o)));
        }
      }
    }
  } else if constexpr (T == MXFP4) {
    store_floats<true>(mxfp4_values(b), _mm256_set1_ps(e8m0_half(b[0])), _mm256_setzero_ps(), dst);
  } else if constexpr (T == IQ4_XS) {
    const float d = fp16(b);
    for (int j = 0; j < 8; ++j)
      store_floats<true>(iq4xs_values(b, j), _mm256_set1_ps(d * static_cast<float>(iq4xs_scale(b, j))),
                         _mm256_setzero_ps(), dst + 32 * j);
  } else {
    float s, o;
    const __m256i u = block32<T>(b, s, o);
    store_floats<signed_values(T)>(u, _mm256_set1_ps(s), _mm256_set1_ps(o), dst);
  }
}

// -- activations ----------------------------------------------------------------------------------

// int8 rows of x: per 32 inputs (d32 = max|x| / 127, i32 = sum(q), s32 = d32 * i32) and per 256
// inputs (d256, sums per 16 in bs16), whichever the weight formats of the call need.
struct Acts {
  const float* x;  // (M, K) float32 (the float path)
  int64_t K;
  const int8_t* q32;  // rows of nb32 blocks: K / 32 rounded up to 8, the padding zeros
  int64_t nb32;
  const float* d32;
  const int32_t* i32;
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

// A running sum stays one dependency chain in a register: an empty asm the compiler cannot see
// through stops it reassociating the adds into trees of live partial sums, which spill.
inline void keep(__m256i& v) { asm("" : "+x"(v)); }

// A per-thread, 64-byte aligned scratch of at least `bytes`, kept for the process's life so that
// a decode step's calls allocate nothing (a tile uses it for the length of its call only).
inline uint8_t* scratch(int64_t bytes) {
  static thread_local std::vector<uint8_t> buf_;
  if (buf_.size() < static_cast<size_t>(bytes + 64)) buf_.resize(bytes + 64);
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf_.data()) + 63) & ~uintptr_t(63));
}

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

// -- what kquant.cpp's ops share (ggml_linear, and moe.cpp's experts) ---------------------------

// A weight of GGUF rows: its parts from a (P, 3) int64 table of rows [ggml type, rows, byte offset
// into `base`], each with its family's tile. `need32` / `need256`: which int8 activation forms its
// parts read.
struct Weight {
  std::vector<Part> parts;
  std::vector<TileFn> tiles;
  int64_t N = 0;
  bool need32 = false, need256 = false;
  Weight(const int64_t* table, int64_t P, const uint8_t* base, int64_t base_bytes, int64_t K, bool int8,
         const char* op);
  // Outputs [c0, c1) of every one of the M activation rows into y[m * ldy + n] (y addressed by the
  // absolute output index n): each part's share of the range is that part family's tile.
  void outputs(int64_t c0, int64_t c1, const Acts& a, int64_t M, float* y, int64_t ldy) const {
    for (size_t i = 0; i < parts.size(); ++i) {
      const Part& p = parts[i];
      const int64_t lo = std::max(c0, p.n0), hi = std::min(c1, p.n0 + p.rows);
      if (lo < hi) tiles[i](p, lo, hi, a, M, y, ldy);
    }
  }
  // A [gate; up] weight (N = 2F rows): out[m * ldo + c + j] = act(gate + bias) * (up + bias) for
  // gate outputs c + j, j < w (<= gated_chunk(M)), and the up outputs F + c + j. Both halves'
  // results go to a per-thread buffer small enough to stay in L2 (M x 2w floats, ~256 KB) where
  // the epilogue reads them. (A (M, N) float matrix of results, written whole and read back, is
  // 64 MB for a 1B model's 1,024-token prefill: DRAM traffic the size of the multiply's own time.)
  void gated(int64_t c, int64_t w, const Acts& a, int64_t M, int64_t act, const float* bias, float* out,
             int64_t ldo) const;
};

// The gate outputs `Weight::gated` takes at a time for M activation rows.
inline int64_t gated_chunk(int64_t M) { return std::max<int64_t>(16, ((int64_t(1) << 15) / M) & ~int64_t(15)); }

// M rows of activations (K values each) as the tiles take them: the float rows, and with `int8`
// their int8 forms (per 32 and / or per 256, as `need32` / `need256` ask), owning those buffers.
struct QuantizedRows {
  std::vector<int8_t> q32, q256;
  std::vector<float> d32, s32, d256;
  std::vector<int32_t> i32;
  std::vector<int16_t> bs16;
  Acts acts;
  QuantizedRows(const float* x, int64_t M, int64_t K, bool int8, bool need32, bool need256);
  // The activations from row r on (a group of rows a call multiplies on their own).
  Acts from_row(int64_t r) const;
};

// The families' tiles for int8 activations (the float32 path is kquant.cpp's).
TileFn tile_b32_a8(int64_t type);  // kquant_b32.cpp
TileFn tile_k_a8(int64_t type);    // kquant_k.cpp
TileFn tile_mxfp4_a8();            // kquant_mxfp4.cpp
// The AVX512-VNNI panels those tiles use for more than MR activation rows (call only where
// cbserve::cpu_has_vnni()).
TileFn panels_b32_vnni(int64_t type);  // kquant_b32_vnni.cpp
// ... and one activation row of a 32-value format (decode), the same bits as kquant_b32.cpp's
// tile_row1.
TileFn row1_b32_vnni(int64_t type);  // kquant_b32_vnni.cpp

}  // namespace cbserve_kquant
