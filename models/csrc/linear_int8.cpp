// packed_linear with int8 activations, on CPUs with AVX512-VNNI: the quantized formats in an
// int8-activation layout (Q4_1X / Q8_0X). Each row of x is quantized per 32 inputs to int8
// (llama.cpp's Q8_1 / Q8_0 activations) and multiplied with vpdpbusd, four times the
// multiply-adds of fp32 FMA per instruction; the per-block scales are applied in fp32.
#include "blocks.h"

namespace cbserve {
namespace {

//
// Layouts (made by models/quant.py `pack(..., int8=True)`), per 16-output panel and 32-input block:
// - Q4_1X: 256 bytes = 4 groups of 64; in group g, byte 4 o + j holds output o's weight at input
//   8 g + j (low nibble) and 8 g + 4 + j (high nibble): one 64-byte load and two masks give the
//   u8 operands of two vpdpbusd (16 outputs x 4 inputs each).
// - Q8_0X: 512 bytes = 8 groups of 64; in group g, byte 4 o + j is output o's int8 weight at input
//   4 g + j. The `m` tensor then holds int32 128 * sum(q) per output and block: activations enter
//   vpdpbusd as unsigned (x + 128), and that term takes the offset back out, exactly.
// Per row and block the activation scale is da = max|x| / 127 (xq = round(x / da)), and for Q4_1
// sa = da * sum(xq) carries the block minimum: sum_k w x = d da sum(q xq) + m sa.
// A row's result is the same whatever the batch: integer block sums are exact and the fp32
// accumulation over blocks runs in one order for every row (one code path for every M).


struct Int8Rows {
  const uint8_t* q;  // (M, K) int8 (or x + 128 as uint8 for Q8_0X)
  const float* da;   // (M, B) scales
  const float* sa;   // (M, B) da * sum(q) (Q4_1X only)
  int64_t K, B;
};

CB_VNNI void quantize_rows(const float* x, int64_t r0, int64_t r1, int64_t K, bool offset, uint8_t* q,
                           float* da, float* sa) {
  const int64_t B = K / QB;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < B; ++b) {
      const float* xb = x + r * K + b * QB;
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float d = amax / 127.f;
      const __m512 id = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
      __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id));
      __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
      da[r * B + b] = d;
      if (offset) {
        q0 = _mm512_add_epi32(q0, _mm512_set1_epi32(128));
        q1 = _mm512_add_epi32(q1, _mm512_set1_epi32(128));
      } else {
        sa[r * B + b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
      }
      uint8_t* qb = q + r * K + b * QB;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtepi32_epi8(q1));
    }
  }
}

// The weights are one stream a step (panels in order, blocks in order), read once, and the
// hardware prefetchers stay too close behind it: prefetching each block's lines 4 KB ahead into
// L2 makes every projection faster, at 1 row and at many (0.93-1.0 of the time at 1 row, 0.85 at
// 8, Zen 4). `ratio`: the stream's bytes a block over this array's (the scales move 4 KB / ratio
// ahead, in step with the weights).
inline void prefetch_ahead(const void* p, int bytes, int ratio = 1) {
  const char* c = static_cast<const char*>(p) + 4096 / ratio;
  for (int l = 0; l < bytes; l += 64) _mm_prefetch(c + l, _MM_HINT_T1);
}

// MR rows (from row r0) x one panel's 16 outputs; c: MR x 16 results.
template <int MR, int KIND>
CB_VNNI inline void int8_tile(const Int8Rows& x, int64_t r0, const uint8_t* w, const at::Half* d,
                              const void* aux, float* c) {
  __m512 f[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) f[r] = _mm512_setzero_ps();
  const __m512i nib = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < x.B; ++b) {
    __m512i acc[MR];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_si512();
    const uint8_t* xb = x.q + r0 * x.K + b * QB;
    if constexpr (KIND == Q4_1X) {
      const uint8_t* wb = w + b * 256;
      prefetch_ahead(wb, 256);
      if (b % 2 == 0) {  // 32 bytes of d and of m a block: a line every other block
        prefetch_ahead(d + b * NR, 64, 8);
        prefetch_ahead(static_cast<const at::Half*>(aux) + b * NR, 64, 8);
      }
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        const __m512i v = _mm512_loadu_si512(wb + 64 * g);
        const __m512i lo = _mm512_and_si512(v, nib);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
          const uint8_t* xr = xb + r * x.K + 8 * g;
          acc[r] = _mm512_dpbusd_epi32(acc[r], lo, _mm512_set1_epi32(load_i32(xr)));
          acc[r] = _mm512_dpbusd_epi32(acc[r], hi, _mm512_set1_epi32(load_i32(xr + 4)));
        }
      }
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + b * NR)));
      const __m512 mw = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const at::Half*>(aux) + b * NR)));
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const int64_t rb = (r0 + r) * x.B + b;
        const __m512 s = _mm512_mul_ps(dw, _mm512_set1_ps(x.da[rb]));
        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), s, f[r]);
        f[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.sa[rb]), f[r]);
      }
    } else {  // Q8_0X
      const uint8_t* wb = w + b * 512;
      prefetch_ahead(wb, 512);
      prefetch_ahead(static_cast<const int32_t*>(aux) + b * NR, 64, 8);
      if (b % 2 == 0) prefetch_ahead(d + b * NR, 64, 16);
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        const __m512i v = _mm512_loadu_si512(wb + 64 * g);
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r)
          acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_set1_epi32(load_i32(xb + r * x.K + 4 * g)), v);
      }
      const __m512i comp = _mm512_loadu_si512(static_cast<const int32_t*>(aux) + b * NR);
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + b * NR)));
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const __m512 s = _mm512_mul_ps(dw, _mm512_set1_ps(x.da[(r0 + r) * x.B + b]));
        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r], comp)), s, f[r]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(c + r * NR, f[r]);
}

constexpr int64_t INT8_MR = 8;

template <int KIND>
CB_VNNI void int8_panels(const Int8Rows& x, int64_t M, const uint8_t* qs, const at::Half* d,
                         const void* aux, int64_t p0, int64_t p1, const Epilogue& ep) {
  const int64_t wstride = x.B * (KIND == Q4_1X ? 256 : 512);
  const int64_t sstride = x.B * NR;
  alignas(64) float c[INT8_MR * NR];
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* w = qs + p * wstride;
    const at::Half* dp = d + p * sstride;
    const void* ap = KIND == Q4_1X ? static_cast<const void*>(static_cast<const at::Half*>(aux) + p * sstride)
                                   : static_cast<const void*>(static_cast<const int32_t*>(aux) + p * sstride);
    for (int64_t r0 = 0; r0 < M; r0 += INT8_MR) {
      const int64_t mr = std::min(INT8_MR, M - r0);
      with_count<INT8_MR>(mr, [&](auto n) { int8_tile<n, KIND>(x, r0, w, dp, ap, c); });
      for (int64_t r = 0; r < mr; ++r) ep.apply(r0 + r, p, c + r * NR);
    }
  }
}

}  // namespace

void linear_int8(const float* x, int64_t M, int64_t K, int64_t kind, const uint8_t* qs, const at::Half* d,
                 const void* aux, int64_t P, const Epilogue& ep) {
  TORCH_CHECK(cpu_has_vnni(), "int8-activation weights need AVX512-VNNI, which this CPU lacks");
  const int64_t B = K / QB;
  std::vector<uint8_t> q(static_cast<size_t>(M * K));
  std::vector<float> da(static_cast<size_t>(M * B)), sa(static_cast<size_t>(M * B));
  const bool offset = kind == Q8_0X;
  at::parallel_for(0, M, std::max<int64_t>(1, (1 << 14) / K), [&](int64_t r0, int64_t r1) {
    quantize_rows(x, r0, r1, K, offset, q.data(), da.data(), sa.data());
  });
  const Int8Rows rows{q.data(), da.data(), sa.data(), K, B};
  // Work per panel ~ M x K multiply-adds at 4x fp32's rate: the same grain rule as the fp32 path.
  const int64_t grain = std::max<int64_t>(1, (1 << 18) / std::max<int64_t>(1, M * K * NR));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
    if (kind == Q4_1X)
      int8_panels<Q4_1X>(rows, M, qs, d, aux, p0, p1, ep);
    else
      int8_panels<Q8_0X>(rows, M, qs, d, aux, p0, p1, ep);
  });
}

}  // namespace cbserve
