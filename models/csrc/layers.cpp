// decoder_layers: a decoder's whole layer stack in one op, for models whose projections are all
// packed. Each layer calls the same entry points the single ops do (rms_norm, the linears,
// head_rms_norm, attention), in the same order on the same arguments, so its result is the
// Python layer loop's bit for bit; what it saves is the Python interpreter and the dispatcher
// between them (a few microseconds an op, ~180 ops a step on a 30-layer model). Each call is a
// profiler scope named as its op, so torch.profiler still shows where a step goes.
//
// The layers' weights come flat, LAYER_TENSORS a layer (Tensor?[]), and their small parameters
// LAYER_INTS a layer (int[]) (enums.h), in the order the enums below name: models/ops.py's
// `DecoderLayer` builds both lists.
#include <ATen/record_function.h>

#include "common.h"
#include "enums.h"
#include "ops.h"

namespace cbserve {
namespace {

// Per layer, in `weights`: the RMSNorm weights (Llama: input, post-attention; Gemma 3: input,
// post-attention, pre-FFN, post-FFN; unused ones None), the QK-norm table (or None), then each
// linear's (qs, d, m, bias).
enum LayerTensor : int64_t { NORM0, NORM1, NORM2, NORM3, QK_NORM, LINEARS, TENSORS_END = LINEARS + 16 };
// Per layer, in `layout`: each linear's (kind, N), then the RoPE table it uses (1: local), the
// sliding window (0: none), the FFN's activation (Act) and the RoPE pairing (1: interleaved).
enum LayerInt : int64_t { KINDS, USE_LOCAL_ROPE = 8, WINDOW, FFN_ACT, ROPE_INTERLEAVED, INTS_END };
static_assert(TENSORS_END == LAYER_TENSORS && INTS_END == LAYER_INTS, "enums.h's strides");
enum Linear : int64_t { QKV, O, GATE_UP, DOWN };

using Weights = c10::List<c10::optional<at::Tensor>>;

c10::optional<at::Tensor> opt(const Weights& w, int64_t i) {
  c10::optional<at::Tensor> t = w.get(i);
  if (t.has_value() && !t->defined()) return c10::nullopt;
  return t;
}

at::Tensor req(const Weights& w, int64_t i, const char* what) {
  c10::optional<at::Tensor> t = opt(w, i);
  TORCH_CHECK(t.has_value(), "decoder_layers: missing ", what, " (weights entry ", i, ")");
  return *t;
}

}  // namespace

at::Tensor decoder_layers(const at::Tensor& x0, const Weights& weights, at::IntArrayRef layout,
                          at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cos,
                          const at::Tensor& sin, const at::Tensor& local_cos, const at::Tensor& local_sin,
                          const at::Tensor& slots, int64_t num_decode, const at::Tensor& dec_tables,
                          const at::Tensor& dec_lens, const at::Tensor& chunk_meta,
                          const at::Tensor& chunk_tables, int64_t H, int64_t KVH, int64_t D, double scale,
                          double eps, const at::Tensor& final_norm, double softcap) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == L, "decoder_layers: as many v caches as k caches");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == L * LAYER_TENSORS,
              "decoder_layers: weights must hold ", LAYER_TENSORS, " entries a layer");
  TORCH_CHECK(static_cast<int64_t>(layout.size()) == L * LAYER_INTS,
              "decoder_layers: layout must hold ", LAYER_INTS, " ints a layer");
  const c10::optional<at::Tensor> none;
  at::Tensor x = x0;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t w0 = l * LAYER_TENSORS;
    const int64_t* ints = layout.data() + l * LAYER_INTS;
    auto linear = [&](Linear which, const at::Tensor& in, const c10::optional<at::Tensor>& residual,
                      int64_t act) {
      const int64_t base = w0 + LINEARS + 4 * which, kind = ints[KINDS + 2 * which], N = ints[KINDS + 2 * which + 1];
      const at::Tensor qs = req(weights, base, "a linear's blocks");
      const auto d = opt(weights, base + 1), m = opt(weights, base + 2), bias = opt(weights, base + 3);
      if (kind == GGML || kind == GGML_A8) {
        RECORD_FUNCTION("cbserve::ggml_linear", std::vector<c10::IValue>());
        return ggml_linear(in, qs, d, m, kind, N, bias, residual, act);
      }
      RECORD_FUNCTION("cbserve::packed_linear", std::vector<c10::IValue>());
      return packed_linear(in, qs, d, m, kind, N, bias, residual, act);
    };
    auto norm = [&](const at::Tensor& in, const at::Tensor& w, const c10::optional<at::Tensor>& residual) {
      RECORD_FUNCTION("cbserve::rms_norm", std::vector<c10::IValue>());
      return rms_norm(in, w, eps, residual);
    };
    const at::Tensor n0 = req(weights, w0 + NORM0, "a norm"), n1 = req(weights, w0 + NORM1, "a norm");
    const c10::optional<at::Tensor> n2 = opt(weights, w0 + NORM2), n3 = opt(weights, w0 + NORM3);
    const bool llama = !n2.has_value();  // else Gemma 3's four norms
    at::Tensor qkv = linear(QKV, norm(x, n0, none), none, NONE);
    if (const auto qk = opt(weights, w0 + QK_NORM)) {
      RECORD_FUNCTION("cbserve::head_rms_norm", std::vector<c10::IValue>());
      head_rms_norm(qkv, *qk, D, eps);
    }
    const bool local = ints[USE_LOCAL_ROPE] != 0;
    at::Tensor o;
    {
      RECORD_FUNCTION("cbserve::attention", std::vector<c10::IValue>());
      o = attention(qkv, local ? local_cos : cos, local ? local_sin : sin, k_caches[l], v_caches[l], slots,
                    num_decode, dec_tables, dec_lens, chunk_meta, chunk_tables, H, KVH, D, scale, ints[WINDOW],
                  ints[ROPE_INTERLEAVED] != 0, softcap, c10::nullopt);
    }
    if (llama) {  // x + o_proj(o), x + down(act(gate_up(norm(x))))
      x = linear(O, o, x, NONE);
      const at::Tensor g = linear(GATE_UP, norm(x, n1, none), none, ints[FFN_ACT]);
      x = linear(DOWN, g, x, NONE);
    } else {  // Gemma 3: x + norm(o_proj(o)), x + norm(down(act(gate_up(norm(x)))))
      TORCH_CHECK(n3.has_value(), "decoder_layers: a four-norm layer needs its fourth norm");
      x = norm(linear(O, o, none, NONE), n1, x);
      const at::Tensor g = linear(GATE_UP, norm(x, *n2, none), none, ints[FFN_ACT]);
      x = norm(linear(DOWN, g, none, NONE), *n3, x);
    }
  }
  RECORD_FUNCTION("cbserve::rms_norm", std::vector<c10::IValue>());
  return rms_norm(x, final_norm, eps, none);
}

}  // namespace cbserve
