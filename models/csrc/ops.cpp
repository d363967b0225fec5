// The op schemas of torch.ops.cbserve and their CPU implementations.
#include <torch/library.h>

#include "common.h"
#include "ops.h"

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

