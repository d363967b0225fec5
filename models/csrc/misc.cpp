// rms_norm: y = x / rms(x) * w (+ a residual); head_rms_norm: the same per head of qkv, in place
// (QK-norm). argmax_rows: torch.argmax(x, -1) of float32 rows (first
// maximum; NaN counts as the largest). output_matrix: where the linears' results are allocated.
#include <mutex>

#include "common.h"
#include "ops.h"

namespace cbserve {

// Results this large come from glibc as fresh mmaps, whose first-touch page faults cost more than
// writing the result: a batch's logits over a 262,144-token vocabulary (64 rows, 64 MiB) took
// ~20 ms more a step to allocate and fill than to refill a buffer already mapped.
constexpr int64_t KEEP_BYTES = int64_t{32} << 20;

at::Tensor output_matrix(int64_t M, int64_t N, const at::TensorOptions& options) {
  if (M * N * static_cast<int64_t>(sizeof(float)) < KEEP_BYTES) return at::empty({M, N}, options);
  static std::mutex mu;
  static at::Tensor kept;  // flat float32; its storage's use count is 1 when no result holds it
  std::lock_guard<std::mutex> lock(mu);
  if (kept.defined() && kept.numel() >= M * N && kept.storage().use_count() == 1)
    return kept.narrow(0, 0, M * N).view({M, N});
  kept = at::empty({M * N}, options);  // a held buffer stays with its holder and is freed by it
  return kept.view({M, N});
}
namespace {


// torch.argmax(x, -1) for a (B, V) float32 matrix, same answer: the first index of the row's
// maximum, or of its first NaN (torch treats NaN as the largest). torch's own reduction is slow
// enough over a large vocabulary to show in a decode step; this one keeps 16 running maxima with the index where each lane first reached its value, rows split
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

// One row's x / rms(x) * w (+ r) into o (o may be x: each value is read before it is written).
inline void rms_norm_row(const float* x, const float* w, const float* r, int64_t D, float eps, float* o) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= D; i += 8) { __m256 v = _mm256_loadu_ps(x + i); acc = _mm256_fmadd_ps(v, v, acc); }
  float ss = hsum(acc);
  for (; i < D; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / D + eps);
  const __m256 vinv = _mm256_set1_ps(inv);
  for (i = 0; i + 8 <= D; i += 8) {
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv), _mm256_loadu_ps(w + i));
    if (r) y = _mm256_add_ps(y, _mm256_loadu_ps(r + i));
    _mm256_storeu_ps(o + i, y);
  }
  for (; i < D; ++i) o[i] = x[i] * inv * w[i] + (r ? r[i] : 0.f);
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x_, const at::Tensor& w_, double eps, const c10::optional<at::Tensor>& res_) {
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kFloat, "rms_norm needs a 2-D float32 x");
  at::Tensor x = x_.contiguous(), w = w_.contiguous();
  const int64_t T = x.size(0), D = x.size(1);
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.numel() == D, "rms_norm: weight must be (D,) float32");
  at::Tensor res;
  if (res_.has_value() && res_->defined()) {
    res = res_->contiguous();
    TORCH_CHECK(res.scalar_type() == at::kFloat && res.sizes() == x.sizes(), "rms_norm: residual must be x's shape");
  }
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* rp = res.defined() ? res.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, (1 << 16) / D), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      rms_norm_row(xp + t * D, wp, rp ? rp + t * D : nullptr, D, static_cast<float>(eps), op + t * D);
  });
  return out;
}

void head_rms_norm(const at::Tensor& qkv, const at::Tensor& w_, int64_t head_dim, double eps) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous(),
              "head_rms_norm needs a contiguous 2-D float32 qkv");
  at::Tensor w = w_.contiguous();
  TORCH_CHECK(w.dim() == 2 && w.size(1) == head_dim && w.scalar_type() == at::kFloat,
              "head_rms_norm: weight must be (heads, head_dim) float32");
  const int64_t T = qkv.size(0), heads = w.size(0), width = qkv.size(1);
  TORCH_CHECK(head_dim > 0 && heads * head_dim <= width, "head_rms_norm: more heads than qkv holds");
  float* qp = qkv.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, (1 << 16) / (heads * head_dim)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t j = 0; j < heads; ++j) {
        float* row = qp + t * width + j * head_dim;
        rms_norm_row(row, wp + j * head_dim, nullptr, head_dim, static_cast<float>(eps), row);
      }
  });
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

}  // namespace cbserve
