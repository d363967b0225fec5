// The ops' entry points, registered by ops.cpp.
#pragma once

#include <ATen/ATen.h>

namespace cbserve {

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& qs, const c10::optional<at::Tensor>& d,
                         const c10::optional<at::Tensor>& m, int64_t kind, int64_t N,
                         const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                         int64_t act);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, const c10::optional<at::Tensor>& residual);
void head_rms_norm(const at::Tensor& qkv, const at::Tensor& w, int64_t head_dim, double eps);
at::Tensor argmax_rows(const at::Tensor& x);
at::Tensor attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& kcache, const at::Tensor& vcache, const at::Tensor& slots,
                     int64_t num_decode, const at::Tensor& dec_tables, const at::Tensor& dec_lens,
                     const at::Tensor& chunk_meta, const at::Tensor& chunk_tables, int64_t H,
                     int64_t KVH, int64_t D, double scale, int64_t window, bool interleaved,
                     double softcap, const c10::optional<at::Tensor>& sinks);

// A decoder's layer stack over the paged pools (layers.cpp): `weights` LAYER_TENSORS a layer,
// `layout` LAYER_INTS a layer, as that file lays them out.
at::Tensor decoder_layers(const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& weights,
                          at::IntArrayRef layout, at::TensorList k_caches, at::TensorList v_caches,
                          const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& local_cos,
                          const at::Tensor& local_sin, const at::Tensor& slots, int64_t num_decode,
                          const at::Tensor& dec_tables, const at::Tensor& dec_lens, const at::Tensor& chunk_meta,
                          const at::Tensor& chunk_tables, int64_t H, int64_t KVH, int64_t D, double scale,
                          double eps, const at::Tensor& final_norm, double softcap);

// GGUF rows as the file holds them (kquant.cpp): `parts` lists each fused part's (ggml type,
// rows, byte offset); kind GGML (float32 activations) or GGML_A8 (int8).
at::Tensor ggml_linear(const at::Tensor& x, const at::Tensor& qs, const c10::optional<at::Tensor>& d,
                       const c10::optional<at::Tensor>& parts, int64_t kind, int64_t N,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                       int64_t act);
at::Tensor ggml_rows(const at::Tensor& qs, int64_t type, int64_t K, const at::Tensor& ids);
// A mixture of experts' experts over GGUF rows (moe.cpp): see its schema in ops.cpp.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights, const at::Tensor& qs,
                       const at::Tensor& gate_up, const at::Tensor& gate_up_index, const at::Tensor& down,
                       const at::Tensor& down_index, int64_t out_features, int64_t kind, int64_t act,
                       const c10::optional<at::Tensor>& gate_up_bias, const c10::optional<at::Tensor>& down_bias);

// A linear's (M, N) float32 result (misc.cpp): large ones reuse one buffer that no earlier result
// still holds, so a result stays valid for as long as it is referenced.
at::Tensor output_matrix(int64_t M, int64_t N, const at::TensorOptions& options);

// The sampler's candidates (sampling.cpp): per row with temps[b] > 0, the k largest x / temps[b]
// (best first, ties by lower id), their ids, and log(sum(exp(x / temps[b]))).
std::tuple<at::Tensor, at::Tensor, at::Tensor> top_candidates(const at::Tensor& x, const at::Tensor& temps,
                                                              int64_t k);
// The recurrent mixers' sequence ops over state slots (recurrent.cpp): see their schemas in ops.cpp.
at::Tensor causal_conv1d(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                         const at::Tensor& conv_pool, const at::Tensor& seqs, const at::Tensor& snapshots,
                         bool silu);
at::Tensor gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, const at::Tensor& ssm_pool, const at::Tensor& seqs,
                            const at::Tensor& snapshots, bool tiled);
at::Tensor mamba2_scan(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                       const at::Tensor& C, const at::Tensor& D, const at::Tensor& dt_bias, const at::Tensor& ssm_pool,
                       const at::Tensor& seqs, const at::Tensor& snapshots);
}  // namespace cbserve
