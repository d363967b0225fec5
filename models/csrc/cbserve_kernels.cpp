// cbserve CPU kernels: AVX2 + FMA + F16C (x86-64-v3), fp32 activations and accumulation.
// Built and loaded by models/kernels.py; registered as torch.ops.cbserve.*.
//
// packed_linear: y = x @ W^T (+ bias) (+ residual) or silu(gate) * up, for weights stored in
//   16-output panels: f32, q8_0 (int8 x fp16 scale per 32 inputs) or q4_1 (4-bit x fp16 scale and
//   fp16 min per 32 inputs). Activations and accumulation are fp32.
//   On CPUs with AVX512-VNNI the quantized formats also come in an int8-activation layout
//   (Q4_1X / Q8_0X): each row of x is quantized per 32 inputs to int8 (llama.cpp's Q8_1 / Q8_0
//   activations) and multiplied with vpdpbusd, four times the multiply-adds of fp32 FMA per
//   instruction; the per-block scales are applied in fp32.
// rms_norm: y = x / rms(x) * w.
// argmax_rows: torch.argmax(x, -1) of float32 rows (first maximum; NaN counts as the largest).
// attention: RoPE on q and k, K/V written into the paged pool, then causal attention of every
//   token over its sequence's pool blocks, read in place by one paged kernel for decode rows and
//   prefill chunks alike. The pool holds float32, float16 or int8 rows (int8: per 32 values one
//   float32 scale after the row's values, as llama.cpp's q8_0); attention computes in float32
//   (int8 pools with AVX512-VNNI: q.k as integer dot products, the query rounded as the keys).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace cbserve {
namespace {

constexpr int NR = 16;  // outputs per panel
constexpr int QB = 32;  // inputs per quantization block

enum Kind : int64_t { F32 = 0, Q8_0 = 1, Q4_1 = 2, Q8_0X = 3, Q4_1X = 4 };
enum Act : int64_t { NONE = 0, SILU_MUL = 1 };

inline __m256 load_h8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return load_h8(p); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for x <= 0 (softmax after subtracting the max), Cephes-style polynomial; rel err ~1e-7.
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  __m256 x2 = _mm256_mul_ps(x, x);
  y = _mm256_fmadd_ps(y, x2, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// silu(g) = g * sigmoid(g), with exp only of non-positive arguments (exp256's domain):
// sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) for g < 0, where e = exp(-|g|).
inline __m256 silu8(__m256 g) {
  const __m256 e = exp256(_mm256_or_ps(g, _mm256_set1_ps(-0.f)));  // exp(-|g|)
  const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_add_ps(_mm256_set1_ps(1.f), e));
  const __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
  return _mm256_mul_ps(g, _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), neg));
}

// ------------------------------------------------------------------------------------------------
// packed_linear
// ------------------------------------------------------------------------------------------------

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
  int64_t N;  // outputs of the layer (before silu_mul halves them)
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
    if (act == SILU_MUL) {  // panel p = gate[8p:8p+8] then up[8p:8p+8]
      float* o = out + r * ldo + p * 8;
      const __m256 y = _mm256_mul_ps(silu8(t0), t1);
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

#define CB_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define CB_DECL(r) __m256 a##r##0 = _mm256_setzero_ps(), a##r##1 = _mm256_setzero_ps();
#define CB_FMA(r)                                          \
  if constexpr (MR > r) {                                  \
    __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);      \
    a##r##0 = _mm256_fmadd_ps(w0, xv, a##r##0);            \
    a##r##1 = _mm256_fmadd_ps(w1, xv, a##r##1);            \
  }
#define CB_SPILL(r)                                        \
  if constexpr (MR > r) {                                  \
    float* cr = c + r * NR;                                \
    if (accumulate) {                                      \
      a##r##0 = _mm256_add_ps(a##r##0, _mm256_load_ps(cr));        \
      a##r##1 = _mm256_add_ps(a##r##1, _mm256_load_ps(cr + 8));    \
    }                                                      \
    _mm256_store_ps(cr, a##r##0);                          \
    _mm256_store_ps(cr + 8, a##r##1);                      \
  }

// MR rows x 16 outputs over inputs [k0, k1), weights dequantized in registers as they stream.
// c: MR x 16 partial sums (added to when accumulate).
template <int MR, int KIND>
inline void micro_direct(const float* x, int64_t ldx, Panel<KIND>& pan, int64_t b0, int64_t b1,
                         float* c, bool accumulate) {
  CB_ROWS(CB_DECL)
  for (int64_t b = b0; b < b1; ++b) {
    pan.block(b);
    for (int64_t k = b * QB; k < (b + 1) * QB; ++k) {
      __m256 w0, w1;
      pan.weights(k, w0, w1);
      CB_ROWS(CB_FMA)
    }
  }
  CB_ROWS(CB_SPILL)
}

// MR rows x 16 outputs over kc inputs whose weights were dequantized into w (kc x 16).
template <int MR>
inline void micro_buf(const float* x, int64_t ldx, const float* w, int64_t kc, float* c,
                      bool accumulate) {
  CB_ROWS(CB_DECL)
  for (int64_t k = 0; k < kc; ++k) {
    __m256 w0 = _mm256_load_ps(w + k * NR), w1 = _mm256_load_ps(w + k * NR + 8);
    CB_ROWS(CB_FMA)
  }
  CB_ROWS(CB_SPILL)
}

template <int KIND>
void dequant_blocks(Panel<KIND>& pan, int64_t b0, int64_t b1, float* w) {
  for (int64_t b = b0; b < b1; ++b) {
    pan.block(b);
    for (int64_t k = b * QB; k < (b + 1) * QB; ++k) {
      __m256 w0, w1;
      pan.weights(k, w0, w1);
      float* dst = w + (k - b0 * QB) * NR;
      _mm256_store_ps(dst, w0);
      _mm256_store_ps(dst + 8, w1);
    }
  }
}

template <int MR>
inline void micro_buf_n(int64_t mr, const float* x, int64_t ldx, const float* w, int64_t kc,
                        float* c, bool acc) {
  switch (mr) {
    case 1: micro_buf<1>(x, ldx, w, kc, c, acc); break;
    case 2: micro_buf<2>(x, ldx, w, kc, c, acc); break;
    case 3: micro_buf<3>(x, ldx, w, kc, c, acc); break;
    case 4: micro_buf<4>(x, ldx, w, kc, c, acc); break;
    case 5: micro_buf<5>(x, ldx, w, kc, c, acc); break;
    default: micro_buf<6>(x, ldx, w, kc, c, acc); break;
  }
}

template <int KIND>
void linear_kernel(const float* x, int64_t M, int64_t K, const uint8_t* qs, const at::Half* d,
                   const at::Half* m, int64_t P, const Epilogue& ep) {
  const int64_t B = K / QB;
  const int64_t qstride = KIND == F32 ? K * NR * 4 : KIND == Q8_0 ? K * NR : K * NR / 2;
  const int64_t sstride = B * NR;
  // Rows handled with weights dequantized on the fly; more rows reuse a dequantized chunk.
  constexpr int64_t DIRECT_MAX = 4;
  constexpr int64_t KCB = 4;  // blocks per chunk: 128 inputs x 16 outputs x 4 B = 8 KiB (L1)
  // Grains sized so a parallel region only opens for work worth waking a thread for (tens of
  // microseconds): on 2 cores an OpenMP fork/join costs more than a small op itself.
  const int64_t panel_grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, M * K * NR));
  at::parallel_for(0, P, panel_grain, [&](int64_t p0, int64_t p1) {
    std::vector<float> cbuf(static_cast<size_t>(std::max<int64_t>(M, 6)) * NR + 16);
    float* c = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(cbuf.data()) + 31) & ~uintptr_t(31));
    alignas(64) float wbuf[KCB * QB * NR];
    for (int64_t p = p0; p < p1; ++p) {
      Panel<KIND> pan{qs + p * qstride, d ? d + p * sstride : nullptr, m ? m + p * sstride : nullptr};
      if (M <= DIRECT_MAX) {
        // Same summation order as the buffered path below (chunks of KCB blocks summed from
        // zero, then added to the running total), so a row's result never depends on how many
        // rows share the step: batching must not change a single token.
        for (int64_t b0 = 0; b0 < B; b0 += KCB) {
          const int64_t b1 = std::min(B, b0 + KCB);
          switch (M) {
            case 1: micro_direct<1, KIND>(x, K, pan, b0, b1, c, b0 > 0); break;
            case 2: micro_direct<2, KIND>(x, K, pan, b0, b1, c, b0 > 0); break;
            case 3: micro_direct<3, KIND>(x, K, pan, b0, b1, c, b0 > 0); break;
            default: micro_direct<4, KIND>(x, K, pan, b0, b1, c, b0 > 0); break;
          }
        }
      } else {
        for (int64_t b0 = 0; b0 < B; b0 += KCB) {
          const int64_t b1 = std::min(B, b0 + KCB);
          const float* w = wbuf;
          if constexpr (KIND == F32) {
            w = reinterpret_cast<const float*>(pan.q) + b0 * QB * NR;
          } else {
            dequant_blocks<KIND>(pan, b0, b1, wbuf);
          }
          const int64_t kc = (b1 - b0) * QB;
          for (int64_t r = 0; r < M; r += 6)
            micro_buf_n<6>(std::min<int64_t>(6, M - r), x + r * K + b0 * QB, K, w, kc, c + r * NR, b0 > 0);
        }
      }
      for (int64_t r = 0; r < M; ++r) ep.apply(r, p, c + r * NR);
    }
  });
}

// ------------------------------------------------------------------------------------------------
// packed_linear with int8 activations (AVX512-VNNI)
// ------------------------------------------------------------------------------------------------
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

#define CB_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))

inline int32_t load_i32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

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
// L2 made all of SmolLM2's projections 0.93-0.999x the time at 1 row (median ~0.95 over four
// interleaved runs), 0.85x at 8 rows, 0.94-0.98x at 32 (in-process A/B). `ratio`: the stream's
// bytes a block over this array's (the scales move 4 KB / ratio ahead, in step with the weights).
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
      switch (mr) {
        case 1: int8_tile<1, KIND>(x, r0, w, dp, ap, c); break;
        case 2: int8_tile<2, KIND>(x, r0, w, dp, ap, c); break;
        case 3: int8_tile<3, KIND>(x, r0, w, dp, ap, c); break;
        case 4: int8_tile<4, KIND>(x, r0, w, dp, ap, c); break;
        case 5: int8_tile<5, KIND>(x, r0, w, dp, ap, c); break;
        case 6: int8_tile<6, KIND>(x, r0, w, dp, ap, c); break;
        case 7: int8_tile<7, KIND>(x, r0, w, dp, ap, c); break;
        default: int8_tile<8, KIND>(x, r0, w, dp, ap, c); break;
      }
      for (int64_t r = 0; r < mr; ++r) ep.apply(r0 + r, p, c + r * NR);
    }
  }
}

// torch's own ISA cap (ATEN_CPU_CAPABILITY=avx2 or default) caps these kernels too, so an AVX-512
// machine can run, and test, exactly what an AVX2-only CPU runs.
bool isa_capped() {
  const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
  return cap && (std::strcmp(cap, "avx2") == 0 || std::strcmp(cap, "default") == 0);
}

bool cpu_has_vnni() {
  static const bool ok = !isa_capped() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("avx512vnni");
  return ok;
}

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

at::Tensor packed_linear(const at::Tensor& x_, const at::Tensor& qs, const c10::optional<at::Tensor>& d_,
                         const c10::optional<at::Tensor>& m_, int64_t kind, int64_t N,
                         const c10::optional<at::Tensor>& bias_, const c10::optional<at::Tensor>& residual_,
                         int64_t act) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && x_.dim() == 2, "x must be a 2-D float32 tensor");
  at::Tensor x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % QB == 0, "in_features must be a multiple of 32");
  const int64_t P = qs.size(0);
  TORCH_CHECK(P * NR >= N, "N exceeds the packed panels");
  const int64_t out_n = act == SILU_MUL ? N / 2 : N;
  at::Tensor out = at::empty({M, out_n}, x.options());
  if (M == 0) return out;
  at::Tensor bias, residual, d, m;
  if (bias_.has_value() && bias_->defined()) bias = bias_->contiguous();
  if (residual_.has_value() && residual_->defined()) {
    residual = residual_->contiguous();
    TORCH_CHECK(residual.size(0) == M && residual.size(1) == N, "residual must be (M, N)");
  }
  if (d_.has_value() && d_->defined()) d = d_->contiguous();
  if (m_.has_value() && m_->defined()) m = m_->contiguous();
  Epilogue ep{bias.defined() ? bias.data_ptr<float>() : nullptr,
              residual.defined() ? residual.data_ptr<float>() : nullptr,
              residual.defined() ? residual.size(1) : 0, act, out.data_ptr<float>(), out_n, N};
  const uint8_t* q = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const at::Half* dp = d.defined() ? d.data_ptr<at::Half>() : nullptr;
  const at::Half* mp = m.defined() && m.scalar_type() == at::kHalf ? m.data_ptr<at::Half>() : nullptr;
  const float* xp = x.data_ptr<float>();
  switch (kind) {
    case F32: linear_kernel<F32>(xp, M, K, q, nullptr, nullptr, P, ep); break;
    case Q8_0: linear_kernel<Q8_0>(xp, M, K, q, dp, nullptr, P, ep); break;
    case Q4_1: linear_kernel<Q4_1>(xp, M, K, q, dp, mp, P, ep); break;
    case Q8_0X:  // m holds the int32 offset corrections
      TORCH_CHECK(m.defined() && m.scalar_type() == at::kInt, "q8_0x needs its int32 corrections");
      linear_int8(xp, M, K, kind, q, dp, m.data_ptr<int32_t>(), P, ep);
      break;
    case Q4_1X: linear_int8(xp, M, K, kind, q, dp, mp, P, ep); break;
    default: TORCH_CHECK(false, "unknown weight kind ", kind);
  }
  return out;
}

// ------------------------------------------------------------------------------------------------
// rms_norm
// ------------------------------------------------------------------------------------------------

at::Tensor rms_norm(const at::Tensor& x_, const at::Tensor& w_, double eps) {
  at::Tensor x = x_.contiguous(), w = w_.contiguous();
  const int64_t T = x.size(0), D = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, (1 << 16) / D), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* xr = xp + t * D;
      float* orow = op + t * D;
      __m256 acc = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= D; i += 8) { __m256 v = _mm256_loadu_ps(xr + i); acc = _mm256_fmadd_ps(v, v, acc); }
      float ss = hsum(acc);
      for (; i < D; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / D + static_cast<float>(eps));
      const __m256 vinv = _mm256_set1_ps(inv);
      for (i = 0; i + 8 <= D; i += 8)
        _mm256_storeu_ps(orow + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), vinv), _mm256_loadu_ps(wp + i)));
      for (; i < D; ++i) orow[i] = xr[i] * inv * wp[i];
    }
  });
  return out;
}

// ------------------------------------------------------------------------------------------------
// argmax over the last dim
// ------------------------------------------------------------------------------------------------

// torch.argmax(x, -1) for a (B, V) float32 matrix, same answer: the first index of the row's
// maximum, or of its first NaN (torch treats NaN as the largest). torch's own reduction reads
// ~4.5 GB/s here (1.1-1.4 ms for 32 x 49,152 logits, 4% of a 32-row decode step); this one
// keeps 16 running maxima with the index where each lane first reached its value, rows split
// over threads.
int64_t argmax_row(const float* x, int64_t V) {
  if (V < 16) {
    int64_t best = 0;
    for (int64_t i = 0; i < V; ++i) {
      if (std::isnan(x[i])) return i;
      if (x[i] > x[best]) best = i;
    }
    return best;
  }
  __m256 m0 = _mm256_loadu_ps(x), m1 = _mm256_loadu_ps(x + 8);
  __m256i i0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), i1 = _mm256_add_epi32(i0, _mm256_set1_epi32(8));
  __m256i c0 = _mm256_add_epi32(i0, _mm256_set1_epi32(16)), c1 = _mm256_add_epi32(i0, _mm256_set1_epi32(24));
  const __m256i step = _mm256_set1_epi32(16);
  __m256 nan = _mm256_or_ps(_mm256_cmp_ps(m0, m0, _CMP_UNORD_Q), _mm256_cmp_ps(m1, m1, _CMP_UNORD_Q));
  int64_t i = 16;
  for (; i + 16 <= V; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    const __m256 ga = _mm256_cmp_ps(a, m0, _CMP_GT_OQ), gb = _mm256_cmp_ps(b, m1, _CMP_GT_OQ);
    m0 = _mm256_blendv_ps(m0, a, ga);
    m1 = _mm256_blendv_ps(m1, b, gb);
    i0 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(i0), _mm256_castsi256_ps(c0), ga));
    i1 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(i1), _mm256_castsi256_ps(c1), gb));
    nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)));
    c0 = _mm256_add_epi32(c0, step);
    c1 = _mm256_add_epi32(c1, step);
  }
  if (_mm256_movemask_ps(nan)) {
    for (int64_t j = 0; j < V; ++j)
      if (std::isnan(x[j])) return j;
  }
  alignas(32) float mv[16];
  alignas(32) int32_t iv[16];
  _mm256_store_ps(mv, m0);
  _mm256_store_ps(mv + 8, m1);
  _mm256_store_si256(reinterpret_cast<__m256i*>(iv), i0);
  _mm256_store_si256(reinterpret_cast<__m256i*>(iv + 8), i1);
  // Each lane holds its maximum and where it first reached it: the row's first maximum is the
  // smallest index among the lanes holding the largest value.
  float best = mv[0];
  int64_t at = iv[0];
  for (int k = 1; k < 16; ++k)
    if (mv[k] > best || (mv[k] == best && iv[k] < at)) { best = mv[k]; at = iv[k]; }
  for (; i < V; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > best) { best = x[i]; at = i; }
  }
  return at;
}

at::Tensor argmax_rows(const at::Tensor& x_) {
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kFloat, "argmax_rows needs a 2-D float32 tensor");
  TORCH_CHECK(x_.size(1) > 0 && x_.size(1) < (int64_t{1} << 31), "argmax_rows: bad row length ", x_.size(1));
  at::Tensor x = x_.contiguous();
  const int64_t B = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({B}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, std::max<int64_t>(1, (1 << 16) / V), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) op[b] = argmax_row(xp + b * V, V);
  });
  return out;
}

// ------------------------------------------------------------------------------------------------
// attention
// ------------------------------------------------------------------------------------------------

// Softmax's exponentials in place: s[j] = exp(s[j] - mx) over [0, L); returns 1 / their sum.
inline float softmax_exp(float* s, int64_t L, float mx) {
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= L; j += 8) {
    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx));
    _mm256_storeu_ps(s + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = hsum(vsum);
  for (; j < L; ++j) { s[j] = std::exp(s[j] - mx); sum += s[j]; }
  return 1.f / sum;
}

// One kv head's row of K or V in the pool. float32 and float16 rows are its D values. An int8 row
// is D int8 values, then D/32 float32 scales (x = q * scale per 32 values): 72 bytes at head_dim
// 64 where float16 takes 128. Decode attention reads every past row of every sequence each step,
// and at long contexts that read is the step (memory-bound), so fewer bytes a row is a faster step.
template <typename C>
constexpr int64_t row_width(int64_t D) { return D; }  // elements of C a row occupies
template <>
constexpr int64_t row_width<int8_t>(int64_t D) { return D + D / 8; }

inline float row_scale(const int8_t* r, int64_t D, int64_t i) {  // the scale of value i
  float s;
  std::memcpy(&s, r + D + 4 * (i / 32), sizeof s);  // rows are not 4-byte aligned in general
  return s;
}

// Values [i, i + 8) of a row, as float32.
inline __m256 row8(const float* r, int64_t i, int64_t) { return _mm256_loadu_ps(r + i); }
inline __m256 row8(const at::Half* r, int64_t i, int64_t) { return load_h8(r + i); }
inline __m256 row8(const int8_t* r, int64_t i, int64_t D) {
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + i));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_set1_ps(row_scale(r, D, i)));
}

// Write one row of D float32 values into the pool.
template <typename C>
inline void store_row(C* dst, const float* x, int64_t D) {
  int64_t i = 0;
  for (; i + 8 <= D; i += 8) store8(dst + i, _mm256_loadu_ps(x + i));
  for (; i < D; ++i) dst[i] = static_cast<C>(x[i]);
}
// 32 float32 values times `inv`, clamped to [-127, 127] and rounded to int8 (nearest, ties to even:
// _mm256_cvtps_epi32 under the default rounding mode, as std::nearbyint), into dst[0 .. 32); returns
// their sum. AVX2, so every CPU the kernels run on writes the same bytes.
inline int32_t round_block32(const float* x, float inv, int8_t* dst) {
  const __m256 vi = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) {
    // Clamped before rounding, so an overflow (inf) cannot wrap; NaN (0 times the infinite inverse
    // of a denormal scale) becomes 0, as the scalar cast gave.
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), vi);
    const __m256 c = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
    q[i] = _mm256_cvtps_epi32(_mm256_and_ps(c, _mm256_cmp_ps(v, v, _CMP_ORD_Q)));
  }
  // packs interleave 128-bit lanes: bytes come out as dwords 0 4 1 5 2 6 3 7 of the wanted order
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  return _mm_cvtsi128_si32(t);
}

// max |x| over 32 values (a NaN is passed over, as std::max(amax, NaN) does); `finite`: all are.
inline float absmax32(const float* x, bool* finite) {
  const __m256 sign = _mm256_set1_ps(-0.f), inf = _mm256_set1_ps(INFINITY);
  __m256 m = _mm256_setzero_ps(), ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (int i = 0; i < 4; ++i) {
    const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * i));
    m = _mm256_max_ps(a, m);  // maxps returns its second operand when either is NaN
    ok = _mm256_and_ps(ok, _mm256_cmp_ps(a, inf, _CMP_LT_OQ));
  }
  if (finite) *finite = _mm256_movemask_ps(ok) == 0xFF;
  __m128 r = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  r = _mm_max_ps(r, _mm_movehl_ps(r, r));
  r = _mm_max_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// int8: symmetric per 32 values, scale = max|x| / 127, q = x * (1 / scale) rounded to nearest even.
template <>
inline void store_row<int8_t>(int8_t* dst, const float* x, int64_t D) {
  for (int64_t g = 0; g < D; g += 32) {
    const float scale = absmax32(x + g, nullptr) / 127.f;
    round_block32(x + g, scale > 0.f ? 1.f / scale : 0.f, dst + g);
    std::memcpy(dst + D + 4 * (g / 32), &scale, sizeof scale);
  }
}

// q: D floats (roped), scores of keys [0, L) of one kv head, softmax, weighted sum of values.
// The generic path (any head_dim, any group size).
template <typename C>
void decode_one(const float* q, const C* kc, const C* vc, const int64_t* table, int64_t L, int64_t bs,
                int64_t tok_stride, int64_t blk_stride, int64_t D, float scale, float* out, float* s) {
  // scores
  float mx = -INFINITY;
  const int64_t nb = (L + bs - 1) / bs;
  for (int64_t bi = 0, j = 0; bi < nb; ++bi) {
    const C* kb = kc + table[bi] * blk_stride;
    for (int64_t t = 0, n = std::min(bs, L - bi * bs); t < n; ++t, ++j) {
      const C* kr = kb + t * tok_stride;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 16 <= D; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), row8(kr, i, D), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), row8(kr, i + 8, D), a1);
      }
      for (; i < D; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), row8(kr, i, D), a0);
      s[j] = hsum(_mm256_add_ps(a0, a1)) * scale;
      mx = std::max(mx, s[j]);
    }
  }
  const float inv = softmax_exp(s, L, mx);
  // values: D <= 256
  __m256 acc[32];
  const int64_t nv = D / 8;
  for (int64_t i = 0; i < nv; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t bi = 0, j = 0; bi < nb; ++bi) {
    const C* vb = vc + table[bi] * blk_stride;
    for (int64_t t = 0, n = std::min(bs, L - bi * bs); t < n; ++t, ++j) {
      const C* vr = vb + t * tok_stride;
      const __m256 p = _mm256_set1_ps(s[j]);
      for (int64_t i = 0; i < nv; ++i) acc[i] = _mm256_fmadd_ps(p, row8(vr, 8 * i, D), acc[i]);
    }
  }
  const __m256 vinv = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < nv; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(acc[i], vinv));
}

// int8 pools with AVX512-VNNI: scores through integer dot products. Each query head is quantized
// as the pool's rows are (int8 per 32 values, scale max|x| / 127), so a score is sq * sk * (an
// exact integer dot product), 64 multiply-adds an instruction (vpdpbusd) instead of 16. The K rows
// of a tile of up to 16 keys are transposed (4 bytes of a row a lane: lane t is key t), so a key's
// score is one lane: no horizontal sums, and the same whatever keys are around it (a token's
// attention stays the same in a prefill chunk and as a decode row). vpdpbusd multiplies unsigned
// by signed bytes: keys are offset by 128 (their sign bit flipped) and 128 * (the sum of the
// query's values) is subtracted from each integer sum.
struct QueryInt8 {
  int32_t words[16];  // the quantized query's bytes 4d .. 4d + 3, as one dword each
  float scale[2];     // its scales, per 32 values
  int32_t corr[2];    // 128 * the sum of its values, per 32
};

// q: one head's 64 values (roped); `softmax_scale` folded in before quantizing.
inline void quantize_query(const float* q, float softmax_scale, QueryInt8& out) {
  alignas(32) float x[64];
  const __m256 vs = _mm256_set1_ps(softmax_scale);
  for (int i = 0; i < 64; i += 8) _mm256_store_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(q + i), vs));
  int8_t* bytes = reinterpret_cast<int8_t*>(out.words);
  for (int h = 0; h < 2; ++h) {
    bool finite;
    const float amax = absmax32(x + 32 * h, &finite);
    // A non-finite query (a broken model) gives NaN scores, as the float path would.
    out.scale[h] = finite ? amax / 127.f : NAN;
    const float inv = finite && amax > 0.f ? 127.f / amax : 0.f;
    out.corr[h] = 128 * round_block32(x + 32 * h, inv, bytes + 32 * h);
  }
}

// 16 rows of 16 dwords -> vector d holding dword d of the 16 rows.
CB_VNNI inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + j], 128-bit quarter c: dword 4c + j of rows 4i .. 4i + 3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i v0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
    t[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    t[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    t[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
  for (int d = 0; d < 16; ++d) r[d] = t[d];
}

// A tile of up to 16 keys, transposed for vpdpbusd (r[d]: dword d of each key, key t in lane t,
// offset to unsigned), and the keys' two scales (lane t: key t's).
struct KeyTile {
  __m512i r[16];
  __m512 k0, k1;
};

// The n <= 16 K rows from `first` as a KeyTile; lanes from n on hold a zero key.
CB_VNNI inline void load_key_tile(const int8_t* first, int n, int64_t tok_stride, KeyTile& kt) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  alignas(64) float sk0[16], sk1[16];
  for (int t = 0; t < 16; ++t) {
    if (t < n) {
      const int8_t* kr = first + t * tok_stride;
      kt.r[t] = _mm512_xor_si512(_mm512_loadu_si512(kr), flip);
      std::memcpy(&sk0[t], kr + 64, 4);
      std::memcpy(&sk1[t], kr + 68, 4);
    } else {
      kt.r[t] = flip;
      sk0[t] = sk1[t] = 0.f;
    }
  }
  transpose16(kt.r);
  kt.k0 = _mm512_load_ps(sk0);
  kt.k1 = _mm512_load_ps(sk1);
}

// Scores of G query heads (qh[0 .. G)) over the tile's first n keys, into s[g * L + j ...]
// (masked to n), their running maxima in vmx[g].
template <int G>
CB_VNNI inline void score_key_tile(const KeyTile& kt, int n, const QueryInt8* qh, float* s, int64_t L, int64_t j,
                                   __m512* vmx) {
  const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    const QueryInt8& qg = qh[g];
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int d = 0; d < 8; ++d) {
      a0 = _mm512_dpbusd_epi32(a0, kt.r[d], _mm512_set1_epi32(qg.words[d]));
      a1 = _mm512_dpbusd_epi32(a1, kt.r[8 + d], _mm512_set1_epi32(qg.words[8 + d]));
    }
    const __m512 w0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(a0, _mm512_set1_epi32(qg.corr[0])));
    const __m512 w1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(a1, _mm512_set1_epi32(qg.corr[1])));
    const __m512 sc = _mm512_fmadd_ps(w1, _mm512_mul_ps(kt.k1, _mm512_set1_ps(qg.scale[1])),
                                      _mm512_mul_ps(w0, _mm512_mul_ps(kt.k0, _mm512_set1_ps(qg.scale[0]))));
    _mm512_mask_storeu_ps(s + g * L + j, m, sc);
    vmx[g] = _mm512_mask_max_ps(vmx[g], m, vmx[g], sc);
  }
}

// Scores of G query heads over n <= 16 keys whose rows start at `first` (see score_key_tile).
template <int G>
CB_VNNI inline void score_tile_int8(const int8_t* first, int n, int64_t tok_stride, const QueryInt8* qh, float* s,
                                    int64_t L, int64_t j, __m512* vmx) {
  KeyTile kt;
  load_key_tile(first, n, tok_stride, kt);
  score_key_tile<G>(kt, n, qh, s, L, j, vmx);
}

// head_dim 64 with AVX-512 (where the CPU has it): the G query heads sharing a kv head together,
// so each K and V row is loaded and widened once for all of them; 4 zmm a row.
#define CB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

// Values [16 i, 16 i + 16) of a head_dim-64 row, as float32.
CB_AVX512 inline __m512 row16(const float* r, int i) { return _mm512_loadu_ps(r + 16 * i); }
CB_AVX512 inline __m512 row16(const at::Half* r, int i) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 16 * i)));
}
CB_AVX512 inline __m512 row16(const int8_t* r, int i) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 16 * i));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(row_scale(r, 64, 16 * i)));
}

// Prefetching, one block ahead, into L2. Decode rows read each past row once per step, from DRAM
// at long contexts (30 layers of pools do not stay in cache between steps), and the hardware
// prefetchers do not follow the reads: a kv head's rows are 72 or 128 bytes at a stride of all kv
// heads' rows, each key's load its own instruction, so a K pass alone ran at ~5 GB/s a thread
// where a plain read gets ~19. Prefetching every next block made decode attention over int8 pools
// 1.4-1.7x faster from DRAM (float16 pools, whose rows are whole cache lines: 1.0-1.04x); T1, not
// T0: L1's few fill buffers made T0 prefetches as slow as none. Prefill chunks re-read one past for each of their tokens, which stays in cache,
// and there prefetching every block cost ~3%: they prefetch across the jumps between scattered
// blocks only, which the hardware cannot foresee at all.
inline bool prefetch_next(const int64_t* table, int64_t bi, int64_t nb, bool streamed) {
  return bi + 1 < nb && (streamed || table[bi + 1] != table[bi] + 1);
}

// First blocks, which prefetch_next cannot reach: each pass's first block. A decode row's V pass
// starts on a block nothing fetched (its K pass read only K), and a whole-row item's K pass on a
// block nothing fetched either: V's first block is prefetched when the row starts, the next row's
// first K block when this row starts. At short contexts that first block is much of the row (5
// blocks at 80 keys) and the pool is out of cache all the same (96 rows x 80 keys x 30 layers of
// K/V is 50 MB): 96 decode rows x 80 keys 0.83-0.85x the time (in-process A/B), 128 x 60 keys
// scattered 0.85x, 8 x 300 0.96x, 32 x 1,280 1.00x, per-head items (1-4 rows) 0.97-0.99x.

// The next block's rows of this kv head (64 values: one or two cache lines each).
template <typename C>
inline void prefetch_rows(const C* first, int64_t n, int64_t tok_stride) {
  for (int64_t t = 0; t < n; ++t) {
    const char* p = reinterpret_cast<const char*>(first + t * tok_stride);
    for (size_t off = 0; off < row_width<C>(64) * sizeof(C); off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
  }
}

// The next block's rows of every kv head (see prefetch_next).
inline void prefetch_bytes(const void* first, int64_t bytes) {
  const char* p = static_cast<const char*>(first);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
}

// The tiles of up to 16 keys of [0, L), block by block in order (a tile never spans two blocks),
// with prefetch_next's prefetching of this kv head's rows, or with `whole_rows` of each token's
// first `whole_rows` bytes (every kv head): for (KeyTiles it{...}; it.next();) { it.first, it.n, it.j }.
struct KeyTiles {
  const int8_t* kc;
  const int64_t* table;
  int64_t L, bs, tok_stride, blk_stride;
  bool streamed;
  int64_t whole_rows = 0;
  int64_t nb = (L + bs - 1) / bs, bi = -1, t0 = 0, nblk = 0, j = 0;
  const int8_t* first = nullptr;  // the tile's first K row
  int n = 0;                       // its keys; the first is key j
  bool next() {
    j += n;
    t0 += n;
    if (t0 >= nblk) {
      if (++bi >= nb) return false;
      if (prefetch_next(table, bi, nb, streamed)) {
        const int64_t rows = std::min(bs, L - (bi + 1) * bs);
        if (whole_rows)
          prefetch_bytes(kc + table[bi + 1] * blk_stride, rows * whole_rows);
        else
          prefetch_rows(kc + table[bi + 1] * blk_stride, rows, tok_stride);
      }
      t0 = 0;
      nblk = std::min(bs, L - bi * bs);
    }
    first = kc + table[bi] * blk_stride + t0 * tok_stride;
    n = static_cast<int>(std::min<int64_t>(16, nblk - t0));
    return true;
  }
};

// Scores of a kv head's G query heads over keys [0, L) (head g's at s + g * L); returns nothing,
// leaves the maxima in mx. The float path: one key at a time, a horizontal sum per head.
template <typename C, int G>
CB_AVX512 void scores_float64(const float* q, const C* kc, const int64_t* table, int64_t L, int64_t bs,
                              int64_t tok_stride, int64_t blk_stride, float scale, float* s, float* mx,
                              bool streamed) {
  constexpr int D = 64;
  const int64_t nb = (L + bs - 1) / bs;
  __m512 qv[G][4];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) qv[g][i] = _mm512_mul_ps(_mm512_loadu_ps(q + g * D + 16 * i), _mm512_set1_ps(scale));
  for (int g = 0; g < G; ++g) mx[g] = -INFINITY;
  for (int64_t bi = 0, j = 0; bi < nb; ++bi) {
    const C* kb = kc + table[bi] * blk_stride;
    if (prefetch_next(table, bi, nb, streamed))
      prefetch_rows(kc + table[bi + 1] * blk_stride, std::min(bs, L - (bi + 1) * bs), tok_stride);
    for (int64_t t = 0, n = std::min(bs, L - bi * bs); t < n; ++t, ++j) {
      const C* kr = kb + t * tok_stride;
      const __m512 k0 = row16(kr, 0), k1 = row16(kr, 1), k2 = row16(kr, 2), k3 = row16(kr, 3);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        __m512 a = _mm512_mul_ps(qv[g][0], k0);
        a = _mm512_fmadd_ps(qv[g][1], k1, a);
        a = _mm512_fmadd_ps(qv[g][2], k2, a);
        a = _mm512_fmadd_ps(qv[g][3], k3, a);
        const float v = _mm512_reduce_add_ps(a);
        s[g * L + j] = v;
        mx[g] = std::max(mx[g], v);
      }
    }
  }
}

// The int8 + VNNI scores of one kv head (as scores_float64), a 16-key tile at a time.
template <int G>
CB_VNNI void scores_int8_64(const float* q, const int8_t* kc, const int64_t* table, int64_t L, int64_t bs,
                            int64_t tok_stride, int64_t blk_stride, float scale, float* s, float* mx,
                            bool streamed) {
  QueryInt8 qh[G];
  for (int g = 0; g < G; ++g) quantize_query(q + g * 64, scale, qh[g]);
  __m512 vmx[G];
  for (int g = 0; g < G; ++g) vmx[g] = _mm512_set1_ps(-INFINITY);
  for (KeyTiles it{kc, table, L, bs, tok_stride, blk_stride, streamed}; it.next();)
    score_tile_int8<G>(it.first, it.n, tok_stride, qh, s, L, it.j, vmx);
  for (int g = 0; g < G; ++g) mx[g] = _mm512_reduce_max_ps(vmx[g]);
}

// acc[g] += the weights s[g * L + j + t] times the n value rows from `first` (in order).
template <typename C, int G>
CB_AVX512 inline void values_rows(const C* first, int64_t n, int64_t tok_stride, const float* s, int64_t L,
                                  int64_t j, __m512 (*acc)[4]) {
  for (int64_t t = 0; t < n; ++t) {
    const C* vr = first + t * tok_stride;
    const __m512 v0 = row16(vr, 0), v1 = row16(vr, 1), v2 = row16(vr, 2), v3 = row16(vr, 3);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(s[g * L + j + t]);
      acc[g][0] = _mm512_fmadd_ps(p, v0, acc[g][0]);
      acc[g][1] = _mm512_fmadd_ps(p, v1, acc[g][1]);
      acc[g][2] = _mm512_fmadd_ps(p, v2, acc[g][2]);
      acc[g][3] = _mm512_fmadd_ps(p, v3, acc[g][3]);
    }
  }
}

// values_rows for two tokens' heads at once (weights from s0 and s1): each row widened once.
template <int G>
CB_AVX512 inline void values_rows2(const int8_t* first, int64_t n, int64_t tok_stride, const float* s0,
                                   const float* s1, int64_t L, int64_t j, __m512 (*a0)[4], __m512 (*a1)[4]) {
  for (int64_t t = 0; t < n; ++t) {
    const int8_t* vr = first + t * tok_stride;
    const __m512 v0 = row16(vr, 0), v1 = row16(vr, 1), v2 = row16(vr, 2), v3 = row16(vr, 3);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(s0[g * L + j + t]), r = _mm512_set1_ps(s1[g * L + j + t]);
      a0[g][0] = _mm512_fmadd_ps(p, v0, a0[g][0]);
      a0[g][1] = _mm512_fmadd_ps(p, v1, a0[g][1]);
      a0[g][2] = _mm512_fmadd_ps(p, v2, a0[g][2]);
      a0[g][3] = _mm512_fmadd_ps(p, v3, a0[g][3]);
      a1[g][0] = _mm512_fmadd_ps(r, v0, a1[g][0]);
      a1[g][1] = _mm512_fmadd_ps(r, v1, a1[g][1]);
      a1[g][2] = _mm512_fmadd_ps(r, v2, a1[g][2]);
      a1[g][3] = _mm512_fmadd_ps(r, v3, a1[g][3]);
    }
  }
}

template <typename C, int G>
CB_AVX512 void decode_group64(const float* q, const C* kc, const C* vc, const int64_t* table, int64_t L,
                              int64_t bs, int64_t tok_stride, int64_t blk_stride, float scale, float* out,
                              float* s, bool streamed) {
  constexpr int D = 64;
  const int64_t nb = (L + bs - 1) / bs;
  float mx[G];
  prefetch_rows(vc + table[0] * blk_stride, std::min(bs, L), tok_stride);  // first block: see prefetch_next
  if constexpr (std::is_same_v<C, int8_t>) {
    if (cpu_has_vnni())
      scores_int8_64<G>(q, kc, table, L, bs, tok_stride, blk_stride, scale, s, mx, streamed);
    else
      scores_float64<C, G>(q, kc, table, L, bs, tok_stride, blk_stride, scale, s, mx, streamed);
  } else {
    scores_float64<C, G>(q, kc, table, L, bs, tok_stride, blk_stride, scale, s, mx, streamed);
  }
  float inv[G];
  for (int g = 0; g < G; ++g) inv[g] = softmax_exp(s + g * L, L, mx[g]);
  __m512 acc[G][4];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_setzero_ps();
  for (int64_t bi = 0, j = 0; bi < nb; ++bi) {
    if (prefetch_next(table, bi, nb, streamed))
      prefetch_rows(vc + table[bi + 1] * blk_stride, std::min(bs, L - (bi + 1) * bs), tok_stride);
    const int64_t n = std::min(bs, L - bi * bs);
    values_rows<C, G>(vc + table[bi] * blk_stride, n, tok_stride, s, L, j, acc);
    j += n;
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i)
      _mm512_storeu_ps(out + g * D + 16 * i, _mm512_mul_ps(acc[g][i], _mm512_set1_ps(inv[g])));
}

// A whole decode row of an int8 pool (all KVH kv heads, H = KVH * G query heads) in one pass over
// its blocks: each 16-key tile's K rows of every kv head, then (after the softmaxes) each block's V
// rows of every kv head. A token's kv heads are adjacent in the pool (216 bytes at SmolLM2's 3 x
// 72), so every cache line is used when it arrives. One (row, kv head) at a time instead reads 72
// of every 216 bytes, and the other heads' items reread the rest: from DRAM (long contexts) that
// is 15% slower at 32 rows x 1,280 keys in runs of 10 blocks; the same where the pool is
// cache-resident or the blocks scattered. Every score and every accumulation is decode_group64's
// operation in its order (state kept in memory between blocks is exact): the same result either
// way, so a row's attention does not depend on how many rows share the step.
template <int G>
CB_VNNI void decode_row_int8_64(const float* q, const int8_t* kc, const int8_t* vc, const int64_t* table, int64_t L,
                                int64_t bs, int64_t KVH, int64_t tok_stride, int64_t blk_stride, float scale,
                                float* out, float* s, std::vector<QueryInt8>& qh, std::vector<float>& state) {
  constexpr int D = 64;
  constexpr int64_t W = row_width<int8_t>(D);
  const int64_t HH = KVH * G;
  // s: each head's scores; state: each head's running maximum (16 lanes), later its accumulators
  qh.resize(HH);
  for (int64_t h = 0; h < HH; ++h) quantize_query(q + h * D, scale, qh[h]);
  state.resize(HH * D);
  float* st = state.data();
  for (int64_t h = 0; h < HH; ++h) _mm512_storeu_ps(st + 16 * h, _mm512_set1_ps(-INFINITY));
  const int64_t nb = (L + bs - 1) / bs;
  const int64_t row_bytes = KVH * W;
  prefetch_bytes(vc + table[0] * blk_stride, std::min(bs, L) * row_bytes);  // first block: see prefetch_next
  for (KeyTiles it{kc, table, L, bs, tok_stride, blk_stride, true, row_bytes}; it.next();) {
    for (int64_t kvh = 0; kvh < KVH; ++kvh) {
      __m512 vmx[G];
      for (int g = 0; g < G; ++g) vmx[g] = _mm512_loadu_ps(st + 16 * (kvh * G + g));
      score_tile_int8<G>(it.first + kvh * W, it.n, tok_stride, &qh[kvh * G], s + kvh * G * L, L, it.j, vmx);
      for (int g = 0; g < G; ++g) _mm512_storeu_ps(st + 16 * (kvh * G + g), vmx[g]);
    }
  }
  float inv[64];
  for (int64_t h = 0; h < HH; ++h) inv[h] = softmax_exp(s + h * L, L, _mm512_reduce_max_ps(_mm512_loadu_ps(st + 16 * h)));
  for (int64_t i = 0; i < HH * D; ++i) st[i] = 0.f;
  for (int64_t bi = 0, j = 0; bi < nb; ++bi) {
    const int8_t* vb = vc + table[bi] * blk_stride;
    const int64_t n = std::min(bs, L - bi * bs);
    if (prefetch_next(table, bi, nb, true))
      prefetch_bytes(vc + table[bi + 1] * blk_stride, std::min(bs, L - (bi + 1) * bs) * row_bytes);
    for (int64_t kvh = 0; kvh < KVH; ++kvh) {
      float* sa = st + kvh * G * D;
      __m512 a[G][4];
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < 4; ++i) a[g][i] = _mm512_loadu_ps(sa + g * D + 16 * i);
      values_rows<int8_t, G>(vb + kvh * W, n, tok_stride, s + kvh * G * L, L, j, a);
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < 4; ++i) _mm512_storeu_ps(sa + g * D + 16 * i, a[g][i]);
    }
    j += n;
  }
  for (int64_t h = 0; h < HH; ++h)
    for (int i = 0; i < 4; ++i)
      _mm512_storeu_ps(out + h * D + 16 * i, _mm512_mul_ps(_mm512_loadu_ps(st + h * D + 16 * i), _mm512_set1_ps(inv[h])));
}

// Prefill chunks over an int8 pool with VNNI: up to kPrefillGroup consecutive tokens of a chunk
// (causal lengths L0, L0 + 1, ...) with one kv head's G query heads, together. A token of a chunk
// at depth attends over the same past as its neighbours, which decode_group64 rereads, transposes
// and widens once a token; here each 16-key tile is loaded and transposed once for the group and
// each V row widened once for each pair of tokens. Every token's scores, softmax and accumulation
// are decode_group64's operations in its order (a key's score is its own lane whatever else the
// tile holds; a pair's accumulators each take their own token's rows in order), so a token's
// attention stays bit-identical to its decode-row form.
constexpr int kPrefillGroup = 4;

template <int G>
CB_VNNI void prefill_group_int8_64(const float* q, int64_t q_stride, int nq, const int8_t* kc, const int8_t* vc,
                                   const int64_t* table, int64_t L0, int64_t bs, int64_t tok_stride,
                                   int64_t blk_stride, float scale, float* out, int64_t out_stride, float* s) {
  constexpr int D = 64;
  const int64_t Lmax = L0 + nq - 1;  // token i's length is L0 + i; its head g's scores at s + (i G + g) Lmax
  QueryInt8 qh[kPrefillGroup][G];
  __m512 vmx[kPrefillGroup][G];
  for (int i = 0; i < nq; ++i)
    for (int g = 0; g < G; ++g) {
      quantize_query(q + i * q_stride + g * D, scale, qh[i][g]);
      vmx[i][g] = _mm512_set1_ps(-INFINITY);
    }
  for (KeyTiles it{kc, table, Lmax, bs, tok_stride, blk_stride, false}; it.next();) {
    KeyTile kt;
    load_key_tile(it.first, it.n, tok_stride, kt);
    for (int i = 0; i < nq; ++i) {
      const int64_t ni = std::min<int64_t>(it.n, L0 + i - it.j);  // the keys token i sees
      if (ni > 0) score_key_tile<G>(kt, static_cast<int>(ni), qh[i], s + i * G * Lmax, Lmax, it.j, vmx[i]);
    }
  }
  float inv[kPrefillGroup][G];
  for (int i = 0; i < nq; ++i)
    for (int g = 0; g < G; ++g)
      inv[i][g] = softmax_exp(s + (i * G + g) * Lmax, L0 + i, _mm512_reduce_max_ps(vmx[i][g]));
  for (int i = 0; i < nq; i += 2) {
    const bool pair = i + 1 < nq;
    const int64_t La = L0 + i;  // rows [0, La) for token i (and i + 1), then row La for token i + 1
    const float* s0 = s + i * G * Lmax;
    const float* s1 = s0 + G * Lmax;
    __m512 a0[G][4], a1[G][4];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
      for (int k = 0; k < 4; ++k) a0[g][k] = a1[g][k] = _mm512_setzero_ps();
    const int64_t nbv = (La + bs - 1) / bs;
    for (int64_t bi = 0, j = 0; bi < nbv; ++bi) {
      if (prefetch_next(table, bi, nbv, false))
        prefetch_rows(vc + table[bi + 1] * blk_stride, std::min(bs, La - (bi + 1) * bs), tok_stride);
      const int64_t n = std::min(bs, La - j);
      if (pair)
        values_rows2<G>(vc + table[bi] * blk_stride, n, tok_stride, s0, s1, Lmax, j, a0, a1);
      else
        values_rows<int8_t, G>(vc + table[bi] * blk_stride, n, tok_stride, s0, Lmax, j, a0);
      j += n;
    }
    if (pair)
      values_rows<int8_t, G>(vc + table[La / bs] * blk_stride + (La % bs) * tok_stride, 1, tok_stride, s1, Lmax, La, a1);
    for (int k = 0; k < (pair ? 2 : 1); ++k) {
      float* o = out + (i + k) * out_stride;
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < 4; ++c)
          _mm512_storeu_ps(o + g * D + 16 * c,
                           _mm512_mul_ps((k ? a1 : a0)[g][c], _mm512_set1_ps(inv[i + k][g])));
    }
  }
}

bool cpu_has_avx512() {
  static const bool ok = !isa_capped() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return ok;
}

// One sequence's G query heads of kv head `kvh` (adjacent in q and out): the AVX-512 group kernel
// for head_dim 64 and groups of up to 8, else each head through the generic path.
template <typename C>
void decode_heads(const float* q, int64_t G, const C* kc, const C* vc, const int64_t* table, int64_t L,
                  int64_t bs, int64_t tok_stride, int64_t blk_stride, int64_t D, float scale, float* out,
                  float* s, bool streamed) {
  if (D == 64 && G <= 8 && cpu_has_avx512()) {
    switch (G) {
#define CB_G(n) case n: decode_group64<C, n>(q, kc, vc, table, L, bs, tok_stride, blk_stride, scale, out, s, streamed); return;
      CB_G(1) CB_G(2) CB_G(3) CB_G(4) CB_G(5) CB_G(6) CB_G(7) CB_G(8)
#undef CB_G
    }
  }
  for (int64_t g = 0; g < G; ++g)
    decode_one<C>(q + g * D, kc, vc, table, L, bs, tok_stride, blk_stride, D, scale, out + g * D, s);
}

template <typename C>
void rope_and_write(float* qkv, int64_t T, int64_t H, int64_t KVH, int64_t D, const float* cos,
                    const float* sin, const int64_t* slots, C* kcache, C* vcache) {
  const int64_t half = D / 2, width = (H + 2 * KVH) * D;
  at::parallel_for(0, T, std::max<int64_t>(1, (1 << 15) / width), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* row = qkv + t * width;
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      for (int64_t h = 0; h < H + KVH; ++h) {  // q heads then k heads
        float* x = row + h * D;
        int64_t i = 0;
        for (; i + 8 <= half; i += 8) {
          __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
          __m256 vc = _mm256_loadu_ps(c + i), vs = _mm256_loadu_ps(s + i);
          _mm256_storeu_ps(x + i, _mm256_fmsub_ps(x1, vc, _mm256_mul_ps(x2, vs)));
          _mm256_storeu_ps(x + half + i, _mm256_fmadd_ps(x2, vc, _mm256_mul_ps(x1, vs)));
        }
        for (; i < half; ++i) {
          const float x1 = x[i], x2 = x[half + i];
          x[i] = x1 * c[i] - x2 * s[i];
          x[half + i] = x2 * c[i] + x1 * s[i];
        }
      }
      const int64_t W = row_width<C>(D);
      const float* k = row + H * D;
      const float* v = row + (H + KVH) * D;
      C* kd = kcache + slots[t] * KVH * W;
      C* vd = vcache + slots[t] * KVH * W;
      for (int64_t h = 0; h < KVH; ++h) {
        store_row<C>(kd + h * W, k + h * D, D);
        store_row<C>(vd + h * W, v + h * D, D);
      }
    }
  });
}

// Decode rows of an int8 pool go whole (every kv head in one pass, decode_row_int8_64) from this
// many on, when each thread has rows enough; fewer go as (row, kv head) items, spread finer.
// Float16 rows (128 bytes: whole cache lines, no line shared by two kv heads) gained nothing from
// whole-row items (0-10% slower from DRAM), so they keep the (row, kv head) items.
constexpr int64_t kRowsForWholeRowItems = 8;

// Decode rows of an int8 pool as whole-row items (see decode_row_int8_64); head_dim 64, G <= 8.
void decode_whole_rows_int8(const float* qp, float* op, const int8_t* kbase, const int8_t* vbase, int64_t bs,
                            int64_t num_decode, const int64_t* tp, const int64_t* lp, int64_t maxb, int64_t H,
                            int64_t KVH, int64_t tok_stride, int64_t blk_stride, float scale) {
  const int64_t G = H / KVH, width = (H + 2 * KVH) * 64;
  at::parallel_for(0, num_decode, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> s, state;
    std::vector<QueryInt8> qh;
    for (int64_t b = b0; b < b1; ++b) {
      if (b + 1 < b1)  // the next row's first K block (first blocks: see prefetch_next)
        prefetch_bytes(kbase + tp[(b + 1) * maxb] * blk_stride, std::min(bs, lp[b + 1]) * tok_stride);
      s.resize(H * lp[b] + 16);
      const float* q = qp + b * width;
      float* o = op + b * H * 64;
      switch (G) {
#define CB_G(n) case n: decode_row_int8_64<n>(q, kbase, vbase, tp + b * maxb, lp[b], bs, KVH, tok_stride, blk_stride, scale, o, s.data(), qh, state); break;
        CB_G(1) CB_G(2) CB_G(3) CB_G(4) CB_G(5) CB_G(6) CB_G(7) CB_G(8)
#undef CB_G
      }
    }
  });
}

// Prefill chunks of an int8 pool (VNNI, head_dim 64, G <= 8) as groups of kPrefillGroup
// consecutive tokens x kv heads (prefill_group_int8_64), groups dealt in zigzag order as tokens
// are in `attend`.
void prefill_groups_int8(const float* qp, float* op, const int8_t* kbase, const int8_t* vbase, int64_t bs,
                         const int64_t* mp, int64_t NC, const int64_t* ctp, int64_t cmaxb, int64_t H, int64_t KVH,
                         int64_t tok_stride, int64_t blk_stride, float scale, int64_t max_len) {
  constexpr int64_t D = 64, W = row_width<int8_t>(D);
  const int64_t G = H / KVH, width = (H + 2 * KVH) * D;
  struct Group {
    int64_t row, L0, chunk;
    int nq;
  };
  std::vector<Group> groups;
  for (int64_t c = 0; c < NC; ++c) {
    const int64_t start = mp[c * 3], n = mp[c * 3 + 1], L = mp[c * 3 + 2];
    for (int64_t t = 0; t < n; t += kPrefillGroup)
      groups.push_back({start + t, L - n + t + 1, c, static_cast<int>(std::min<int64_t>(kPrefillGroup, n - t))});
  }
  const int64_t NG = static_cast<int64_t>(groups.size());
  const int64_t grain = std::max<int64_t>(1, (1 << 17) / (max_len * D * G * kPrefillGroup));
  at::parallel_for(0, NG * KVH, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> s;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t k = i / KVH, kvh = i % KVH;
      const Group& gr = groups[(k % 2 == 0) ? k / 2 : NG - 1 - k / 2];  // zigzag
      s.resize(gr.nq * G * (gr.L0 + gr.nq - 1) + 16);
      const float* q = qp + gr.row * width + kvh * G * D;
      float* o = op + gr.row * H * D + kvh * G * D;
      const int64_t* table = ctp + gr.chunk * cmaxb;
      switch (G) {
#define CB_G(n) case n: prefill_group_int8_64<n>(q, width, gr.nq, kbase + kvh * W, vbase + kvh * W, table, gr.L0, bs, tok_stride, blk_stride, scale, o, H * D, s.data()); break;
        CB_G(1) CB_G(2) CB_G(3) CB_G(4) CB_G(5) CB_G(6) CB_G(7) CB_G(8)
#undef CB_G
      }
    }
  });
}

// After the K/V are in the pool: decode rows, then prefill chunks, over pool rows of type C.
template <typename C>
void attend(const float* qp, float* op, const C* kbase, const C* vbase, int64_t bs, int64_t num_decode,
            const at::Tensor& dec_tables_, const at::Tensor& dec_lens_, const at::Tensor& chunk_meta_,
            const at::Tensor& chunk_tables_, int64_t H, int64_t KVH, int64_t D, float scale) {
  const int64_t width = (H + 2 * KVH) * D;
  const int64_t W = row_width<C>(D), tok_stride = KVH * W, blk_stride = bs * KVH * W;
  const int64_t G = H / KVH;
  if (num_decode > 0) {
    at::Tensor tables = dec_tables_.contiguous(), lens = dec_lens_.contiguous();
    const int64_t* tp = tables.data_ptr<int64_t>();
    const int64_t* lp = lens.data_ptr<int64_t>();
    const int64_t maxb = tables.size(1);
    int64_t max_len = 1;
    for (int64_t b = 0; b < num_decode; ++b) max_len = std::max(max_len, lp[b]);
    bool whole_rows = false;
    if constexpr (std::is_same_v<C, int8_t>) {
      whole_rows = D == 64 && G <= 8 && H <= 64 && num_decode >= kRowsForWholeRowItems && cpu_has_avx512() &&
                   cpu_has_vnni();
      if (whole_rows)
        decode_whole_rows_int8(qp, op, kbase, vbase, bs, num_decode, tp, lp, maxb, H, KVH, tok_stride, blk_stride,
                               scale);
    }
    if (!whole_rows) {
      const int64_t task_grain = std::max<int64_t>(1, (1 << 17) / (max_len * D * G));
      at::parallel_for(0, num_decode * KVH, task_grain, [&](int64_t i0, int64_t i1) {
        std::vector<float> s;
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t b = i / KVH, kvh = i % KVH, L = lp[b];
          s.resize(G * L + 16);
          // The group's G query heads are adjacent in q and in out (heads kvh*G .. kvh*G+G-1).
          const float* q = qp + b * width + kvh * G * D;
          float* o = op + b * H * D + kvh * G * D;
          decode_heads<C>(q, G, kbase + kvh * W, vbase + kvh * W, tp + b * maxb, L, bs, tok_stride, blk_stride, D,
                          scale, o, s.data(), true);
        }
      });
    }
  }
  // Prefill chunks: every token as a decode row over its own causal prefix, read from the pool
  // (this step's K/V were written above). The same kernel as decode, so a token's attention is
  // bit-identical whether it is computed in a prefill chunk of any size, as a decode step, or
  // recomputed after preemption; and no gather of the past. Tokens are dealt in zigzag order
  // (first, last, second, ...) so the threads' contiguous shares cost about the same. Int8 pools
  // with VNNI take a few consecutive tokens an item (prefill_groups_int8), with the same results.
  const int64_t NC = chunk_meta_.defined() ? chunk_meta_.size(0) : 0;
  if (NC > 0) {
    at::Tensor meta = chunk_meta_.contiguous(), ctables = chunk_tables_.contiguous();
    const int64_t* mp = meta.data_ptr<int64_t>();
    const int64_t* ctp = ctables.data_ptr<int64_t>();
    const int64_t cmaxb = ctables.size(1);
    int64_t max_len = 1;
    for (int64_t c = 0; c < NC; ++c) max_len = std::max(max_len, mp[c * 3 + 2]);
    if constexpr (std::is_same_v<C, int8_t>) {
      if (D == 64 && G <= 8 && cpu_has_avx512() && cpu_has_vnni()) {
        prefill_groups_int8(qp, op, kbase, vbase, bs, mp, NC, ctp, cmaxb, H, KVH, tok_stride, blk_stride, scale,
                            max_len);
        return;
      }
    }
    std::vector<int64_t> row, len, chunk;
    for (int64_t c = 0; c < NC; ++c) {
      const int64_t start = mp[c * 3], n = mp[c * 3 + 1], L = mp[c * 3 + 2];
      for (int64_t t = 0; t < n; ++t) {
        row.push_back(start + t);
        len.push_back(L - n + t + 1);
        chunk.push_back(c);
      }
    }
    const int64_t NT = static_cast<int64_t>(row.size());
    const int64_t task_grain = std::max<int64_t>(1, (1 << 17) / (max_len * D * G));
    at::parallel_for(0, NT * KVH, task_grain, [&](int64_t i0, int64_t i1) {
      std::vector<float> s;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t k = i / KVH, kvh = i % KVH;
        const int64_t x = (k % 2 == 0) ? k / 2 : NT - 1 - k / 2;  // zigzag
        const int64_t r = row[x], L = len[x];
        s.resize(G * L + 16);
        const float* q = qp + r * width + kvh * G * D;
        float* o = op + r * H * D + kvh * G * D;
        decode_heads<C>(q, G, kbase + kvh * W, vbase + kvh * W, ctp + chunk[x] * cmaxb, L, bs, tok_stride,
                        blk_stride, D, scale, o, s.data(), false);
      }
    });
  }
}

template <typename C>
void rope_write_attend(float* qkv, float* out, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kcache,
                       const at::Tensor& vcache, const at::Tensor& slots, int64_t T, int64_t num_decode,
                       const at::Tensor& dec_tables, const at::Tensor& dec_lens, const at::Tensor& chunk_meta,
                       const at::Tensor& chunk_tables, int64_t H, int64_t KVH, int64_t D, float scale) {
  TORCH_CHECK(kcache.size(3) == row_width<C>(D) && vcache.sizes() == kcache.sizes(),
              "the KV pool's rows do not fit head_dim ", D);
  C* kc = kcache.data_ptr<C>();
  C* vc = vcache.data_ptr<C>();
  rope_and_write<C>(qkv, T, H, KVH, D, cos.data_ptr<float>(), sin.data_ptr<float>(), slots.data_ptr<int64_t>(), kc, vc);
  attend<C>(qkv, out, kc, vc, kcache.size(1), num_decode, dec_tables, dec_lens, chunk_meta, chunk_tables, H, KVH, D,
            scale);
}

// chunk_meta: (C, 3) int64 rows [token_start, num_tokens, context_len]; chunk_tables (C, maxb).
// The pools: (num_blocks, block_size, KVH, row width) of float32, float16 or int8 (`row_width`).
at::Tensor attention(const at::Tensor& qkv_, const at::Tensor& cos_, const at::Tensor& sin_,
                     const at::Tensor& kcache, const at::Tensor& vcache, const at::Tensor& slots_,
                     int64_t num_decode, const at::Tensor& dec_tables, const at::Tensor& dec_lens,
                     const at::Tensor& chunk_meta, const at::Tensor& chunk_tables, int64_t H,
                     int64_t KVH, int64_t D, double scale_) {
  at::Tensor qkv = qkv_.contiguous();  // roped in place: it is this op's own input buffer
  at::Tensor cos = cos_.contiguous(), sin = sin_.contiguous(), slots = slots_.contiguous();
  const int64_t T = qkv.size(0);
  const float scale = static_cast<float>(scale_);
  TORCH_CHECK(D % 8 == 0 && D <= 256, "head_dim must be a multiple of 8, at most 256");
  TORCH_CHECK(H % KVH == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(kcache.is_contiguous() && vcache.is_contiguous(), "the KV pools must be contiguous");
  at::Tensor out = at::empty({T, H * D}, qkv.options());
  float* qp = qkv.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (kcache.scalar_type()) {
    case at::kFloat:
      rope_write_attend<float>(qp, op, cos, sin, kcache, vcache, slots, T, num_decode, dec_tables, dec_lens,
                               chunk_meta, chunk_tables, H, KVH, D, scale);
      break;
    case at::kHalf:
      rope_write_attend<at::Half>(qp, op, cos, sin, kcache, vcache, slots, T, num_decode, dec_tables, dec_lens,
                                  chunk_meta, chunk_tables, H, KVH, D, scale);
      break;
    case at::kChar:
      TORCH_CHECK(D % 32 == 0, "an int8 KV pool needs head_dim to be a multiple of 32");
      rope_write_attend<int8_t>(qp, op, cos, sin, kcache, vcache, slots, T, num_decode, dec_tables, dec_lens,
                                chunk_meta, chunk_tables, H, KVH, D, scale);
      break;
    default:
      TORCH_CHECK(false, "KV pool dtype must be float32, float16 or int8, not ", kcache.scalar_type());
  }
  return out;
}

}  // namespace
}  // namespace cbserve


TORCH_LIBRARY(cbserve, m) {
  m.def("packed_linear(Tensor x, Tensor qs, Tensor? d, Tensor? m, int kind, int N, Tensor? bias, Tensor? residual, int act) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("has_int8_dot() -> bool", [] { return cbserve::cpu_has_vnni(); });
  m.def("attention(Tensor qkv, Tensor cos, Tensor sin, Tensor k_cache, Tensor v_cache, Tensor slots, int num_decode, Tensor dec_tables, Tensor dec_lens, Tensor chunk_meta, Tensor chunk_tables, int H, int KVH, int D, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(cbserve, CPU, m) {
  m.impl("packed_linear", &cbserve::packed_linear);
  m.impl("rms_norm", &cbserve::rms_norm);
  m.impl("argmax_rows", &cbserve::argmax_rows);
  m.impl("attention", &cbserve::attention);
}
