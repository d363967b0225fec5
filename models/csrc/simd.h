// The vector widths the GGUF panel kernels are written over, once: Vec256 (AVX2, the library's
// baseline: vpmaddubsw products summed in int16, then vpmaddwd) and Vec512 (AVX512-VNNI:
// vpdpbusd / vpdpwssd into int32; its functions carry CB_VNNI and run only where
// cbserve::cpu_has_vnni()). A kernel templated on V (kquant_k_tile.h, kquant_b32_tile.h) is one
// body; kquant_k_panels.cpp and kquant_b32.cpp instantiate it with Vec256, kquant_k_vnni.cpp and
// kquant_b32_vnni.cpp with Vec512 (their functions marked CB_TILE = CB_VNNI, see below).
//
// A panel is LANES weight rows side by side, one 32-bit lane each: a vector of a panel holds the
// same four values of every row (a "group"), and one activation row's four bytes broadcast to
// every lane meet it in one instruction. What differs by width is only how the four products a
// lane are summed: Vec256 adds vpmaddubsw's int16 pair sums over as many groups as cannot
// overflow before one vpmaddwd widens them with a sub-scale (`narrow` / `widen`); Vec512's
// vpdpbusd sums them in int32 at once and a sub-scale is a vpmulld. Either way the integers are
// exact, so a row's result is the same whichever width computed it.
#pragma once

#include "common.h"

// The target of a kernel templated on V: empty for Vec256; a file instantiating Vec512 defines it as
// CB_VNNI before including its kernels' header (and after the headers it shares with the AVX2 files).
#ifndef CB_TILE
#define CB_TILE
#endif

namespace cbserve {

struct Vec256 {
  static constexpr int LANES = 8, BYTES = 32;
  using I = __m256i;
  using F = __m256;
  // The int8 sums of a group go through int16 lanes (vpmaddubsw): the caller bounds how many groups
  // may be summed there before `widen`.
  static constexpr bool NARROW16 = true;

  static I load(const void* p) { return _mm256_load_si256(static_cast<const __m256i*>(p)); }
  static I loadu(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static void store(void* p, I v) { _mm256_store_si256(static_cast<__m256i*>(p), v); }
  static I zero() { return _mm256_setzero_si256(); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I set1_8(char v) { return _mm256_set1_epi8(v); }
  static I bcast4(const void* p) { return _mm256_set1_epi32(load_i32(p)); }  // 4 bytes to every lane
  static I add32(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub32(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  static I slli32(I a, int n) { return _mm256_slli_epi32(a, n); }
  static I srli32(I a, int n) { return _mm256_srli_epi32(a, n); }
  static I srai32(I a, int n) { return _mm256_srai_epi32(a, n); }
  static I srli16(I a, int n) { return _mm256_srli_epi16(a, n); }
  static I slli16(I a, int n) { return _mm256_slli_epi16(a, n); }

  static F zerof() { return _mm256_setzero_ps(); }
  static F set1f(float v) { return _mm256_set1_ps(v); }
  static F loadf(const void* p) { return _mm256_load_ps(static_cast<const float*>(p)); }
  static void storef(void* p, F v) { _mm256_store_ps(static_cast<float*>(p), v); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  // The first n lanes of v to dst (a whole vector: one store; a runtime-length copy is a byte loop).
  static void store_lanes(float* dst, F v, int64_t n) {
    if (n == LANES) return _mm256_storeu_ps(dst, v);
    alignas(32) float t[LANES];
    _mm256_store_ps(t, v);
    std::memcpy(dst, t, n * sizeof(float));
  }

  // An int16 pair a lane: a's low 16 bits, then b's.
  static I pair16(I a, I b) { return _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(b, 16)); }
  // The low 16 bits of each lane as fp16, converted to float.
  static F halves(I v) {
    const I h = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
  }
  // LANES fp16 values (h[i] to lane i) as floats.
  static F halves_of(const uint16_t* h) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))); }
  // LANES x LANES dwords transposed: r[d] lane i <- r[i] lane d.
  static void transpose(I* r) { transpose8(r); }
  // Bytes at .. at + 15 of the LANES rows blk[i] as four vectors: v[d] lane i = row i's dword d.
  static void lanes4(const uint8_t* const* blk, int64_t at, I v[4]) {
    I z[4], t[4];
    for (int i = 0; i < 4; ++i)
      z[i] = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(blk[4 + i] + at),
                                 reinterpret_cast<const __m128i*>(blk[i] + at));
    t[0] = _mm256_unpacklo_epi32(z[0], z[1]);
    t[1] = _mm256_unpackhi_epi32(z[0], z[1]);
    t[2] = _mm256_unpacklo_epi32(z[2], z[3]);
    t[3] = _mm256_unpackhi_epi32(z[2], z[3]);
    v[0] = _mm256_unpacklo_epi64(t[0], t[2]);
    v[1] = _mm256_unpackhi_epi64(t[0], t[2]);
    v[2] = _mm256_unpacklo_epi64(t[1], t[3]);
    v[3] = _mm256_unpackhi_epi64(t[1], t[3]);
  }

  // The products of a group: acc (int16 pairs) + u x (vpmaddubsw: u unsigned, x signed).
  static I narrow(I acc, I u, I x) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, x)); }
  // i1 + the narrow sums times a sub-scale (`scale_word`: an int16 pair of it a lane). The asm
  // keeps vpmaddwd on two registers: given the choice GCC stores the int16 sums to the stack to
  // hand it a memory operand, and the reload waits on the store.
  static I widen(I i1, I acc, I sc) {
    I out;
    asm("vpmaddwd %2, %1, %0" : "=x"(out) : "x"(acc), "x"(sc));
    return _mm256_add_epi32(i1, out);
  }
  static I scale_word(I sc) { return pair16(sc, sc); }
  static void put_scale(uint8_t* at, int32_t sc) {
    const int16_t v[2] = {static_cast<int16_t>(sc), static_cast<int16_t>(sc)};
    std::memcpy(at, v, 4);
  }
  // acc + the int16 pairs' products a . b summed a lane (vpmaddwd).
  static I madd_acc(I acc, I a, I b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
  // A running sum stays one dependency chain in a register: an empty asm the compiler cannot see
  // through stops it reassociating the adds into trees of live partial sums, which spill.
  static void keep(I& v) { asm("" : "+x"(v)); }
};

struct Vec512 {
  static constexpr int LANES = 16, BYTES = 64;
  using I = __m512i;
  using F = __m512;
  static constexpr bool NARROW16 = false;

  CB_VNNI static I load(const void* p) { return _mm512_load_si512(p); }
  CB_VNNI static I loadu(const void* p) { return _mm512_loadu_si512(p); }
  CB_VNNI static void store(void* p, I v) { _mm512_store_si512(p, v); }
  CB_VNNI static I zero() { return _mm512_setzero_si512(); }
  CB_VNNI static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  CB_VNNI static I set1_8(char v) { return _mm512_set1_epi8(v); }
  CB_VNNI static I bcast4(const void* p) { return _mm512_set1_epi32(load_i32(p)); }
  CB_VNNI static I add32(I a, I b) { return _mm512_add_epi32(a, b); }
  CB_VNNI static I sub32(I a, I b) { return _mm512_sub_epi32(a, b); }
  CB_VNNI static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  CB_VNNI static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  CB_VNNI static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  CB_VNNI static I slli32(I a, int n) { return _mm512_slli_epi32(a, n); }
  CB_VNNI static I srli32(I a, int n) { return _mm512_srli_epi32(a, n); }
  CB_VNNI static I srai32(I a, int n) { return _mm512_srai_epi32(a, n); }
  CB_VNNI static I srli16(I a, int n) { return _mm512_srli_epi16(a, n); }
  CB_VNNI static I slli16(I a, int n) { return _mm512_slli_epi16(a, n); }

  CB_VNNI static F zerof() { return _mm512_setzero_ps(); }
  CB_VNNI static F set1f(float v) { return _mm512_set1_ps(v); }
  CB_VNNI static F loadf(const void* p) { return _mm512_load_ps(p); }
  CB_VNNI static void storef(void* p, F v) { _mm512_store_ps(p, v); }
  CB_VNNI static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  CB_VNNI static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  CB_VNNI static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  CB_VNNI static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  CB_VNNI static void store_lanes(float* dst, F v, int64_t n) {
    _mm512_mask_storeu_ps(dst, static_cast<__mmask16>((1u << n) - 1), v);
  }

  CB_VNNI static I pair16(I a, I b) {
    return _mm512_or_si512(_mm512_and_si512(a, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(b, 16));
  }
  CB_VNNI static F halves(I v) {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_and_si512(v, _mm512_set1_epi32(0xFFFF))));
  }
  CB_VNNI static F halves_of(const uint16_t* h) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
  }
  CB_VNNI static void transpose(I* r) { transpose16(r); }
  // (a 16 x 4 dword transpose by two-source permutes)
  CB_VNNI static void lanes4(const uint8_t* const* blk, int64_t at, I v[4]) {
    I z[4];
    for (int g = 0; g < 4; ++g) {
      auto row = [&](int r) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[4 * g + r] + at)); };
      const I two = _mm512_inserti32x4(_mm512_castsi128_si512(row(0)), row(1), 1);
      z[g] = _mm512_inserti32x4(_mm512_inserti32x4(two, row(2), 2), row(3), 3);
    }
    for (int d = 0; d < 4; ++d) {
      // lane i < 8: row i's dword d in z[i / 4] (index 4 (i % 4) + d, + 16 for the second source)
      alignas(64) int32_t idx[16];
      for (int i = 0; i < 16; ++i) idx[i] = 16 * ((i / 4) % 2) + 4 * (i % 4) + d;
      const I ix = _mm512_load_si512(idx);
      v[d] = _mm512_mask_blend_epi32(0xFF00, _mm512_permutex2var_epi32(z[0], ix, z[1]),
                                     _mm512_permutex2var_epi32(z[2], ix, z[3]));
    }
  }

  CB_VNNI static I narrow(I acc, I u, I x) { return _mm512_dpbusd_epi32(acc, u, x); }
  CB_VNNI static I widen(I i1, I acc, I sc) { return _mm512_add_epi32(i1, _mm512_mullo_epi32(acc, sc)); }
  CB_VNNI static I scale_word(I sc) { return sc; }
  static void put_scale(uint8_t* at, int32_t sc) { std::memcpy(at, &sc, 4); }
  CB_VNNI static I madd_acc(I acc, I a, I b) { return _mm512_dpwssd_epi32(acc, a, b); }
  static void keep(I&) {}  // (32 registers: no chains to pin)
};

}  // namespace cbserve

namespace cbserve_kquant {
using cbserve::Vec256;
using cbserve::Vec512;
}  // namespace cbserve_kquant
