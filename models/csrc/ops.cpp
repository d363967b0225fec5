// The op schemas of torch.ops.cbserve and their CPU implementations. Python reaches them through
// models/ops.py only, which wraps each with keyword arguments and registers their fake (shape)
// functions. A schema marks what an op writes: `Tensor(a!)` is an argument changed in place.
#include <torch/library.h>

#include <string>

#include "common.h"
#include "enums.h"
#include "ops.h"

namespace {

// "Kind.F32=0 Kind.Q8_0=1 ... Act.NONE=0 ...": the codes as this side defines them.
std::string enum_values() {
  std::string out;
#define CB_KIND(name, value) out += "Kind." #name "=" + std::to_string(value) + " ";
#define CB_ACT(name, value) out += "Act." #name "=" + std::to_string(value) + " ";
#define CB_LAYER(name, value) out += "Layer." #name "=" + std::to_string(value) + " ";
  CBSERVE_KINDS(CB_KIND)
  CBSERVE_ACTS(CB_ACT)
  CBSERVE_LAYER(CB_LAYER)
#undef CB_KIND
#undef CB_ACT
#undef CB_LAYER
  return out;
}

}  // namespace

TORCH_LIBRARY(cbserve, m) {
  // y = x @ W^T (+ bias) (+ residual), or act(gate) * up (act SILU_MUL / GELU_MUL), W packed in panels of
  // `kind` (enums.h); N: the layer's outputs.
  m.def(
      "packed_linear(Tensor x, Tensor qs, Tensor? d, Tensor? m, int kind, int N, Tensor? bias, "
      "Tensor? residual, int act) -> Tensor");
  // The same for a weight kept as the file's GGUF rows (kind GGML / GGML_A8; `m` lists its parts).
  m.def(
      "ggml_linear(Tensor x, Tensor qs, Tensor? d, Tensor? m, int kind, int N, Tensor? bias, "
      "Tensor? residual, int act) -> Tensor");
  // A mixture of experts' experts: for each token (row of x) the sum over its k experts (ids in
  // `experts`, (T, k)) of weight x down(act(gate) * up) of x, each expert's gate_up and down
  // weights GGUF rows of `qs` listed by rows [gate_up_index[e], gate_up_index[e + 1]) of the
  // (parts, 3) table `gate_up` (and likewise `down`, out_features rows each); kind GGML or GGML_A8;
  // gate_up_bias (E, 2F) and down_bias (E, out_features): each expert's biases, where it has them.
  m.def(
      "moe_experts(Tensor x, Tensor experts, Tensor weights, Tensor qs, Tensor gate_up, Tensor gate_up_index, "
      "Tensor down, Tensor down_index, int out_features, int kind, int act, Tensor? gate_up_bias=None, "
      "Tensor? down_bias=None) -> Tensor");
  // Rows `ids` of an embedding table of GGUF blocks of `type`, K values a row, as float32.
  m.def("ggml_rows(Tensor qs, int type, int K, Tensor ids) -> Tensor");
  // x / rms(x) * w per row, plus `residual` when given (a branch normed before it joins the stream).
  m.def("rms_norm(Tensor x, Tensor w, float eps, Tensor? residual=None) -> Tensor");
  // QK-norm in place: head j < w.size(0) of each qkv row becomes head / rms(head) * w[j].
  m.def("head_rms_norm(Tensor(a!) qkv, Tensor w, int head_dim, float eps) -> ()");
  m.def("argmax_rows(Tensor x) -> Tensor");
  // Per row with temps > 0: the k largest x / temps (best first, ties by lower id), their ids, and
  // logsumexp(x / temps); rows with temps <= 0 are skipped (-inf values, ids 0).
  m.def("top_candidates(Tensor x, Tensor temps, int k) -> (Tensor, Tensor, Tensor)");
  m.def("has_int8_dot() -> bool", [] { return cbserve::cpu_has_vnni(); });
  m.def("has_amx_tiles() -> bool", [] { return cbserve::cpu_has_amx(); });
  m.def("enum_values() -> str", &enum_values);
  // RoPE on qkv's q and k heads in place, this step's K/V written into the pools at `slots`, then
  // paged attention of every token (decode rows, then prefill chunks); returns (T, H * D). window
  // > 0: a query at position p sees the keys at positions (p - window, p] only. interleaved: RoPE
  // rotates adjacent pairs (a llama-architecture GGUF's q/k rows as the file holds them), else halves.
  // softcap > 0: scores are soft-capped, softcap * tanh(score / softcap), before the softmax (Gemma 2).
  // sinks: (H,) logits that join each query head's softmax without a value (gpt-oss's attention sinks).
  m.def(
      "attention(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, "
      "Tensor slots, int num_decode, Tensor dec_tables, Tensor dec_lens, Tensor chunk_meta, "
      "Tensor chunk_tables, int H, int KVH, int D, float scale, int window=0, bool interleaved=False, "
      "float softcap=0., Tensor? sinks=None) -> Tensor");
  // A decoder's whole layer stack (norms, projections, QK-norm, attention over the pools written in
  // place) then the final norm: what those ops compute one by one, in one call (layers.cpp).
  m.def(
      "decoder_layers(Tensor x, Tensor?[] weights, int[] layout, Tensor(a!)[] k_caches, "
      "Tensor(b!)[] v_caches, Tensor cos, Tensor sin, Tensor local_cos, Tensor local_sin, Tensor slots, "
      "int num_decode, Tensor dec_tables, Tensor dec_lens, Tensor chunk_meta, Tensor chunk_tables, "
      "int H, int KVH, int D, float scale, float eps, Tensor final_norm, float softcap=0.) -> Tensor");
  // The recurrent mixers over a step's state slots: per sequence of `seqs` (S, 3) [first token, tokens,
  // slot], the state in its slot of the pool continued over its tokens and left there; `snapshots`
  // (P, 3) [sequence, tokens after which, slot] copy the state out on the way (recurrent.cpp).
  // causal_conv1d: x (T, C) through a depthwise causal conv of weight (C, K) over the K - 1 inputs
  // kept in conv_pool (slots, K - 1, C), + bias, then SiLU if `silu`.
  m.def(
      "causal_conv1d(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_pool, Tensor seqs, "
      "Tensor snapshots, bool silu) -> Tensor");
  // gated_delta_rule: q, k (T, Hk, dk) (L2-normalised here, q scaled by dk^-0.5), v (T, Hv, dv),
  // g (T, Hv) log decay, beta (T, Hv); per value head S (dk, dv) in ssm_pool (slots, Hv, dk, dv):
  // S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q. Value head h reads q/k head h % Hk
  // (`tiled`) or h / (Hv / Hk). Returns o (T, Hv, dv).
  m.def(
      "gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) ssm_pool, "
      "Tensor seqs, Tensor snapshots, bool tiled) -> Tensor");
  // mamba2_scan: x (T, H, head_dim), dt (T, H) before dt_bias (H) and softplus, A (H) = -exp(A_log),
  // B, C (T, G, N), D (H); per head S (head_dim, N) in ssm_pool (slots, H, head_dim, N), head h reading
  // group h / (H / G): S <- exp(dt A) S + dt x B^T; y = S C + D x. Returns y (T, H, head_dim).
  m.def(
      "mamba2_scan(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, Tensor dt_bias, "
      "Tensor(a!) ssm_pool, Tensor seqs, Tensor snapshots) -> Tensor");
}
TORCH_LIBRARY_IMPL(cbserve, CPU, m) {
  m.impl("causal_conv1d", &cbserve::causal_conv1d);
  m.impl("gated_delta_rule", &cbserve::gated_delta_rule);
  m.impl("mamba2_scan", &cbserve::mamba2_scan);
  m.impl("decoder_layers", &cbserve::decoder_layers);
  m.impl("packed_linear", &cbserve::packed_linear);
  m.impl("ggml_linear", &cbserve::ggml_linear);
  m.impl("ggml_rows", &cbserve::ggml_rows);
  m.impl("moe_experts", &cbserve::moe_experts);
  m.impl("rms_norm", &cbserve::rms_norm);
  m.impl("head_rms_norm", &cbserve::head_rms_norm);
  m.impl("argmax_rows", &cbserve::argmax_rows);
  m.impl("top_candidates", &cbserve::top_candidates);
  m.impl("attention", &cbserve::attention);
}
