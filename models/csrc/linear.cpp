// packed_linear: y = x @ W^T (+ bias) (+ residual) or act(gate) * up, for weights stored in
// 16-output panels: f32, q8_0 (int8 x fp16 scale per 32 inputs) or q4_1 (4-bit x fp16 scale and
// fp16 min per 32 inputs). Activations and accumulation are fp32; the int8-activation kinds go to
// linear_int8.cpp.
#include "blocks.h"
#include "ops.h"

namespace cbserve {
namespace {

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
  with_count<MR>(mr, [&](auto n) { micro_buf<n>(x, ldx, w, kc, c, acc); });
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
          with_count<DIRECT_MAX>(M, [&](auto n) { micro_direct<n, KIND>(x, K, pan, b0, b1, c, b0 > 0); });
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

}  // namespace

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
  const int64_t out_n = act_outputs(act, N, "packed_linear");
  at::Tensor out = output_matrix(M, out_n, x.options());
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
  if (kind == Q8_0X) {  // m holds the int32 offset corrections
    TORCH_CHECK(m.defined() && m.scalar_type() == at::kInt, "q8_0x needs its int32 corrections");
    linear_int8(xp, M, K, kind, q, dp, m.data_ptr<int32_t>(), P, ep);
  } else if (kind == Q4_1X) {
    linear_int8(xp, M, K, kind, q, dp, mp, P, ep);
  } else {
    // The float-activation kinds; a kind's Panel reads only the scales it has.
    const bool known = with_value<F32, Q8_0, Q4_1>(
        kind, [&](auto k) { linear_kernel<decltype(k)::value>(xp, M, K, q, dp, mp, P, ep); });
    TORCH_CHECK(known, "unknown weight kind ", kind);
  }
  return out;
}

}  // namespace cbserve
