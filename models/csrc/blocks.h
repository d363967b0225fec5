// Packed weight panels (models/quant.py `pack`): 16 outputs a panel, 32 inputs a quantization
// block; how one panel's weights widen to float32, and the epilogue every packed linear ends with
// (bias, residual add, or a gated MLP's act(gate) * up).
#pragma once

#include "common.h"
#include "enums.h"

namespace cbserve {

constexpr int NR = 16;  // outputs per panel
constexpr int QB = 32;  // inputs per quantization block

// The 16 weights of one panel at one input index k, as two fp32 vectors.
template <int KIND>
struct Panel {
  const uint8_t* q;     // this panel's weights
  const at::Half* d;    // (blocks, 16) scales
  const at::Half* m;    // (blocks, 16) mins (q4_1)
  __m256 d0, d1, m0, m1;
  inline void block(int64_t b) {
    if constexpr (KIND != F32) { d0 = load_h8(d + b * NR); d1 = load_h8(d + b * NR + 8); }
    if constexpr (KIND == Q4_1) { m0 = load_h8(m + b * NR); m1 = load_h8(m + b * NR + 8); }
  }
  inline void weights(int64_t k, __m256& w0, __m256& w1) const {
    if constexpr (KIND == F32) {
      const float* p = reinterpret_cast<const float*>(q) + k * NR;
      w0 = _mm256_loadu_ps(p);
      w1 = _mm256_loadu_ps(p + 8);
    } else if constexpr (KIND == Q8_0) {
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k * 16));
      w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), d0);
      w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))), d1);
    } else {  // byte i holds output i (low nibble) and output 8 + i (high nibble)
      __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k * 8)));
      w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15))), d0, m0);
      w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), d1, m1);
    }
  }
};

struct Epilogue {
  const float* bias;      // (N,) or null
  const float* residual;  // (M, ldr) or null
  int64_t ldr;
  int64_t act;
  float* out;
  int64_t ldo;
  int64_t N;  // outputs of the layer (before a gated act halves them)
  // acc: 16 sums of panel p for row r.
  inline void apply(int64_t r, int64_t p, const float* acc) const {
    const int64_t n0 = p * NR;
    __m256 t0 = _mm256_loadu_ps(acc), t1 = _mm256_loadu_ps(acc + 8);
    const bool full = n0 + NR <= N;
    if (bias) {
      if (full) {
        t0 = _mm256_add_ps(t0, _mm256_loadu_ps(bias + n0));
        t1 = _mm256_add_ps(t1, _mm256_loadu_ps(bias + n0 + 8));
      } else {
        alignas(32) float b[NR] = {};
        for (int64_t j = 0; j < NR && n0 + j < N; ++j) b[j] = bias[n0 + j];
        t0 = _mm256_add_ps(t0, _mm256_load_ps(b));
        t1 = _mm256_add_ps(t1, _mm256_load_ps(b + 8));
      }
    }
    if (act != NONE) {  // panel p = gate[8p:8p+8] then up[8p:8p+8]
      float* o = out + r * ldo + p * 8;
      const __m256 y = gated8(act, t0, t1);
      const int64_t nv = std::min<int64_t>(8, N / 2 - p * 8);
      if (nv == 8) {
        _mm256_storeu_ps(o, y);
      } else {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, y);
        for (int64_t j = 0; j < nv; ++j) o[j] = tmp[j];
      }
      return;
    }
    float* o = out + r * ldo + n0;
    const float* res = residual ? residual + r * ldr + n0 : nullptr;
    if (full) {
      if (res) {
        t0 = _mm256_add_ps(t0, _mm256_loadu_ps(res));
        t1 = _mm256_add_ps(t1, _mm256_loadu_ps(res + 8));
      }
      _mm256_storeu_ps(o, t0);
      _mm256_storeu_ps(o + 8, t1);
      return;
    }
    alignas(32) float t[NR];
    _mm256_store_ps(t, t0);
    _mm256_store_ps(t + 8, t1);
    for (int64_t j = 0; j < N - n0; ++j) o[j] = t[j] + (res ? res[j] : 0.f);
  }
};


// int8-activation linears (AVX512-VNNI; linear_int8.cpp): kind Q8_0X or Q4_1X.
void linear_int8(const float* x, int64_t M, int64_t K, int64_t kind, const uint8_t* qs, const at::Half* d,
                 const void* aux, int64_t P, const Epilogue& ep);

}  // namespace cbserve
