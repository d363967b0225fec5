// top_candidates: what a sampled row's top-p / min-p filters start from (engine/sampling.py), per
// row: the k largest temperature-scaled logits, best first, and the log of the scaled row's
// softmax normalizer, without the scaled copy of the row or a sort of the vocabulary.
//
// Selection: a rising threshold. Logits above the current k-th best go into a buffer of 2k; a
// full buffer is cut back to its best k (nth_element), which raises the threshold. After the first
// few thousand logits almost none pass, so the scan is a vector compare per 8 logits. Order is a
// total one on (value, id): larger value first, then lower id (a later logit equal to the k-th best
// never displaces it), and NaN ranks above everything, as in torch.topk.
//
// Scaling divides the selected logits by the temperature (the same float as torch's x / t, and
// division by t > 0 keeps the order); the normalizer is a second pass of exp(x / t - max).
#include <utility>

#include "common.h"
#include "ops.h"

namespace cbserve {
namespace {

// A float's place in the total order as an integer: monotone in the value, NaN the largest.
inline int32_t order_key(float v) {
  if (std::isnan(v)) return INT32_MAX;
  int32_t i;
  std::memcpy(&i, &v, sizeof i);
  return i >= 0 ? i : i ^ INT32_MAX;
}

struct Cand {
  int32_t key;
  int32_t id;
  bool operator<(const Cand& o) const { return key != o.key ? key > o.key : id < o.id; }  // best first
};

// The row's k best (buffer `buf` of 2k holds the running candidates), sorted best first.
void select_row(const float* x, int64_t V, int64_t k, std::vector<Cand>& buf) {
  buf.clear();
  // The k-th best so far (once 2k have been seen; before, INT32_MIN, which no value's key is): its
  // key, and its value for the vector compare. Lanes >= that value (or NaN) are looked at one by
  // one, so equal values meet the key order.
  int32_t thr_key = INT32_MIN;
  float thr = -INFINITY;
  auto consider = [&](int64_t i) {
    const int32_t key = order_key(x[i]);
    if (key <= thr_key) return;  // a later equal value has the higher id: it loses
    buf.push_back({key, static_cast<int32_t>(i)});
    if (static_cast<int64_t>(buf.size()) == 2 * k) {
      std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end());
      buf.resize(k);
      thr_key = buf[k - 1].key;
      thr = thr_key == INT32_MAX ? INFINITY : x[buf[k - 1].id];
    }
  };
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 hit = _mm256_or_ps(_mm256_cmp_ps(v, _mm256_set1_ps(thr), _CMP_GE_OQ), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    for (int mask = _mm256_movemask_ps(hit); mask; mask &= mask - 1) consider(i + __builtin_ctz(mask));
  }
  for (; i < V; ++i) consider(i);
  const int64_t n = std::min<int64_t>(k, static_cast<int64_t>(buf.size()));
  std::partial_sort(buf.begin(), buf.begin() + n, buf.end());
  buf.resize(n);
}

// log(sum(exp(x / t))) given the row's largest scaled value `top` (exp256 clamps its argument at
// -87: each clamped term adds ~1.6e-38 to a sum of at least 1).
float log_norm_row(const float* x, int64_t V, float t, float top) {
  if (std::isinf(top) || std::isnan(top)) return top;  // all masked (-inf), or +inf / NaN logits
  const __m256 vt = _mm256_set1_ps(t), vtop = _mm256_set1_ps(top);
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= V; i += 16) {
    s0 = _mm256_add_ps(s0, exp256(_mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), vt), vtop)));
    s1 = _mm256_add_ps(s1, exp256(_mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(x + i + 8), vt), vtop)));
  }
  double sum = static_cast<double>(hsum(_mm256_add_ps(s0, s1)));
  for (; i < V; ++i) sum += std::exp(std::max(x[i] / t - top, -87.f));
  return top + static_cast<float>(std::log(sum));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> top_candidates(const at::Tensor& x_, const at::Tensor& temps_,
                                                              int64_t k) {
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kFloat, "top_candidates needs a 2-D float32 tensor");
  const int64_t B = x_.size(0), V = x_.size(1);
  TORCH_CHECK(V > 0 && V < (int64_t{1} << 31), "top_candidates: bad row length ", V);
  TORCH_CHECK(k >= 1 && k <= V, "top_candidates: k must be in [1, ", V, "], not ", k);
  TORCH_CHECK(temps_.dim() == 1 && temps_.size(0) == B && temps_.scalar_type() == at::kFloat,
              "top_candidates: temps must be (B,) float32");
  at::Tensor x = x_.contiguous(), temps = temps_.contiguous();
  at::Tensor vals = at::empty({B, k}, x.options());
  at::Tensor ids = at::empty({B, k}, x.options().dtype(at::kLong));
  at::Tensor norms = at::empty({B}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* tp = temps.data_ptr<float>();
  float* vp = vals.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* np = norms.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<Cand> buf;
    buf.reserve(2 * k);
    for (int64_t b = b0; b < b1; ++b) {
      const float t = tp[b];
      if (!(t > 0.f)) {  // not a sampled row: nothing to find
        std::fill(vp + b * k, vp + (b + 1) * k, -INFINITY);
        std::fill(ip + b * k, ip + (b + 1) * k, int64_t{0});
        np[b] = -INFINITY;
        continue;
      }
      const float* row = xp + b * V;
      select_row(row, V, k, buf);
      for (int64_t j = 0; j < k; ++j) {
        vp[b * k + j] = row[buf[j].id] / t;
        ip[b * k + j] = buf[j].id;
      }
      np[b] = log_norm_row(row, V, t, vp[b * k]);
    }
  });
  return {vals, ids, norms};
}

}  // namespace cbserve
