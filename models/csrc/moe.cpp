// A mixture-of-experts MLP's experts in one op (torch.ops.cbserve.moe_experts): every token's k
// experts, each a gated MLP whose gate/up and down weights are GGUF rows read in place (the
// kquant.cpp families' tiles), with optional biases per expert (gpt-oss), weighted and summed per
// token.
//
// The (token, expert) pairs are grouped by expert, so each expert multiplies the rows of the
// tokens that chose it, once. All experts' work of a projection runs in one parallel region whose
// items (an expert, a chunk of its outputs) the threads take from a shared counter: called per
// expert and projection instead, each call paid a thread fork/join (~20 us on 2 cores, a third of
// an expert's decode time) and a trip through the interpreter.
// A row's result does not depend on the batch: each pair's row meets its expert's weights in the
// family tiles (the same arithmetic for any number of rows), and a token's experts are summed in
// expert order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <atomic>

#include "kquant.h"
#include "ops.h"

namespace cbserve_kquant {
namespace {

// Each of E experts' weights: rows [index[e], index[e + 1]) of a (parts, 3) table.
std::vector<Weight> expert_weights(const at::Tensor& table_, const at::Tensor& index_, const at::Tensor& qs, int64_t K,
                                   bool int8, const char* what) {
  TORCH_CHECK(table_.scalar_type() == at::kLong && table_.dim() == 2 && table_.size(1) == 3, "moe_experts: ", what,
              " must be a (parts, 3) int64 table");
  TORCH_CHECK(index_.scalar_type() == at::kLong && index_.dim() == 1 && index_.numel() >= 2, "moe_experts: ", what,
              "_index must be (experts + 1,) int64");
  const at::Tensor table = table_.contiguous(), index = index_.contiguous();
  const int64_t* ip = index.data_ptr<int64_t>();
  std::vector<Weight> out;
  for (int64_t e = 0; e + 1 < index.numel(); ++e) {
    TORCH_CHECK(0 <= ip[e] && ip[e] < ip[e + 1] && ip[e + 1] <= table.size(0), "moe_experts: ", what,
                "_index is not increasing within the table");
    out.emplace_back(table.data_ptr<int64_t>() + 3 * ip[e], ip[e + 1] - ip[e], qs.data_ptr<uint8_t>(), qs.numel(), K,
                     int8, "moe_experts");
  }
  return out;
}

// Outputs of an expert an item computes: a few items a thread, so that the threads share the
// work evenly, each a long run of consecutive weight rows (one stream for the prefetchers), and
// at least 16 (a panel's outputs).
int64_t item_width(int64_t experts, int64_t n) {
  const int64_t per = experts * n / (4 * std::max<int64_t>(1, at::get_num_threads()));
  return std::clamp<int64_t>((per + 15) / 16 * 16, 16, n);
}

// Runs fn(item) for items [0, n) on the intra-op threads, each taking the next item as it is
// free (items differ in cost: an expert's share of the batch's rows).
template <typename F>
void for_each_item(int64_t n, const F& fn) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  });
}

at::Tensor moe_experts(const at::Tensor& x_, const at::Tensor& experts_, const at::Tensor& weights_,
                       const at::Tensor& qs, const at::Tensor& gate_up, const at::Tensor& gate_up_index,
                       const at::Tensor& down, const at::Tensor& down_index, int64_t out_features, int64_t kind,
                       int64_t act, const c10::optional<at::Tensor>& gate_up_bias_,
                       const c10::optional<at::Tensor>& down_bias_) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && x_.dim() == 2, "moe_experts: x must be a 2-D float32 tensor");
  TORCH_CHECK(kind == GGML_F32 || kind == GGML_A8, "moe_experts: unknown kind ", kind);
  TORCH_CHECK(act == SILU_MUL || act == GELU_MUL || act == cbserve::SWIGLU_OAI,
              "moe_experts: act must be a gated one");
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous(), "moe_experts: qs must be contiguous uint8");
  TORCH_CHECK(experts_.scalar_type() == at::kLong && experts_.dim() == 2 && experts_.size(0) == x_.size(0),
              "moe_experts: experts must be (T, k) int64");
  TORCH_CHECK(weights_.scalar_type() == at::kFloat && weights_.sizes() == experts_.sizes(),
              "moe_experts: weights must be float32 shaped as experts");
  const at::Tensor x = x_.contiguous(), ids = experts_.contiguous(), wts = weights_.contiguous();
  const int64_t T = x.size(0), K = x.size(1), k = ids.size(1), P = T * k;
  const bool int8 = kind == GGML_A8;
  const std::vector<Weight> up = expert_weights(gate_up, gate_up_index, qs, K, int8, "gate_up");
  const int64_t E = static_cast<int64_t>(up.size()), F = up[0].N / 2;
  const std::vector<Weight> dn = expert_weights(down, down_index, qs, F, int8, "down");
  TORCH_CHECK(static_cast<int64_t>(dn.size()) == E, "moe_experts: ", E, " gate_up experts but ", dn.size(), " down");
  const int64_t D = dn[0].N;
  TORCH_CHECK(D == out_features, "moe_experts: the down projections have ", D, " rows, not ", out_features);
  for (int64_t e = 0; e < E; ++e)
    TORCH_CHECK(up[e].N == 2 * F && dn[e].N == D, "moe_experts: expert ", e, " is not shaped as expert 0");
  // Each expert's biases: gate_up_bias (E, 2F) [gate; up], down_bias (E, D); either may be absent.
  auto bias_of = [&](const c10::optional<at::Tensor>& b, int64_t n, const char* what) -> at::Tensor {
    if (!b.has_value() || !b->defined()) return at::Tensor();
    TORCH_CHECK(b->scalar_type() == at::kFloat && b->dim() == 2 && b->size(0) == E && b->size(1) == n,
                "moe_experts: ", what, " must be (", E, ", ", n, ") float32");
    return b->contiguous();
  };
  const at::Tensor gub = bias_of(gate_up_bias_, 2 * F, "gate_up_bias"), db = bias_of(down_bias_, D, "down_bias");
  const float* gubp = gub.defined() ? gub.data_ptr<float>() : nullptr;
  const float* dbp = db.defined() ? db.data_ptr<float>() : nullptr;
  at::Tensor out = at::zeros({T, D}, x.options());
  if (T == 0) return out;

  // The pairs grouped by expert (a stable counting sort: an expert's rows in token order).
  const int64_t* ip = ids.data_ptr<int64_t>();
  std::vector<int64_t> start(E + 1, 0), order(P);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(0 <= ip[p] && ip[p] < E, "moe_experts: expert id ", ip[p], " outside [0, ", E, ")");
    ++start[ip[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < P; ++p) order[fill[ip[p]]++] = p;
  }
  std::vector<int64_t> used;  // experts with rows
  bool need32 = false, need256 = false, dn32 = false, dn256 = false;
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) {
      used.push_back(e);
      need32 |= up[e].need32, need256 |= up[e].need256, dn32 |= dn[e].need32, dn256 |= dn[e].need256;
    }

  // Each pair's input row, in the grouped order; the experts' gated outputs h; their down outputs.
  const float* xp = x.data_ptr<float>();
  // (uninitialized: every value is written before it is read)
  const at::Tensor xs_ = at::empty({P, K}, x.options()), h_ = at::empty({P, F}, x.options()),
                   y_ = at::empty({P, D}, x.options());
  float *xs = xs_.data_ptr<float>(), *h = h_.data_ptr<float>(), *y = y_.data_ptr<float>();
  for (int64_t i = 0; i < P; ++i) std::memcpy(xs + i * K, xp + order[i] / k * K, K * sizeof(float));
  // Items: (expert, first output) of every used expert's outputs, `width` at a time.
  auto items = [&](int64_t n, int64_t width) {
    std::vector<std::pair<int64_t, int64_t>> list;
    for (int64_t e : used)
      for (int64_t c = 0; c < n; c += width) list.emplace_back(e, c);
    return list;
  };
  {
    const QuantizedRows rows(xs, P, K, int8, need32, need256);
    const int64_t width = item_width(static_cast<int64_t>(used.size()), F);
    const auto list = items(F, width);
    for_each_item(static_cast<int64_t>(list.size()), [&](int64_t i) {
      const auto [e, c] = list[i];
      const int64_t r0 = start[e], M = start[e + 1] - r0, end = std::min(F, c + width), g = gated_chunk(M);
      const Acts a = rows.from_row(r0);
      const float* bias = gubp ? gubp + e * 2 * F : nullptr;
      for (int64_t c2 = c; c2 < end; c2 += g) up[e].gated(c2, std::min(g, end - c2), a, M, act, bias, h + r0 * F, F);
    });
  }
  {
    const QuantizedRows rows(h, P, F, int8, dn32, dn256);
    const int64_t width = item_width(static_cast<int64_t>(used.size()), D);
    const auto list = items(D, width);
    for_each_item(static_cast<int64_t>(list.size()), [&](int64_t i) {
      const auto [e, c] = list[i];
      const int64_t r0 = start[e], M = start[e + 1] - r0, end = std::min(D, c + width);
      dn[e].outputs(c, end, rows.from_row(r0), M, y + r0 * D, D);
      if (dbp)
        for (int64_t r = r0; r < r0 + M; ++r)
          for (int64_t j = c; j < end; ++j) y[r * D + j] += dbp[e * D + j];
    });
  }
  // out[t] = sum of weight x down output over t's pairs, in expert order (the grouped order).
  const float* wp = wts.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, D, 256, [&](int64_t c0, int64_t c1) {
    for (int64_t i = 0; i < P; ++i) {
      const float wi = wp[order[i]];
      float* o = op + order[i] / k * D;
      const float* yi = y + i * D;
      for (int64_t c = c0; c < c1; ++c) o[c] += wi * yi[c];
    }
  });
  return out;
}

}  // namespace
}  // namespace cbserve_kquant

namespace cbserve {
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights, const at::Tensor& qs,
                       const at::Tensor& gate_up, const at::Tensor& gate_up_index, const at::Tensor& down,
                       const at::Tensor& down_index, int64_t out_features, int64_t kind, int64_t act,
                       const c10::optional<at::Tensor>& gate_up_bias, const c10::optional<at::Tensor>& down_bias) {
  return cbserve_kquant::moe_experts(x, experts, weights, qs, gate_up, gate_up_index, down, down_index, out_features,
                                     kind, act, gate_up_bias, down_bias);
}
}  // namespace cbserve
