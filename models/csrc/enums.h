// The integer codes the ops take, mirrored by models/ops.py's IntEnums `Kind` and `Act` (the op
// enum_values lists these, and tests/test_kernels_opcheck.py checks the two sides agree). Each list
// is an X-macro so the enum and that listing cannot drift apart.
#pragma once

#include <cstdint>

namespace cbserve {

// A packed weight's block format (models/quant.py): the X kinds are the int8-activation layouts;
// GGML and GGML_A8 are GGUF rows as the file holds them (kquant.cpp), float32 or int8 activations.
#define CBSERVE_KINDS(X) X(F32, 0) X(Q8_0, 1) X(Q4_1, 2) X(Q8_0X, 3) X(Q4_1X, 4) \
  X(GGML, 5) X(GGML_A8, 6)
// What a packed linear's epilogue emits: the plain result, or a gated MLP's act(gate) * up
// (SWIGLU_OAI: gpt-oss's clamped SwiGLU, common.h's swiglu_oai8).
#define CBSERVE_ACTS(X) X(NONE, 0) X(SILU_MUL, 1) X(GELU_MUL, 2) X(SWIGLU_OAI, 3)

// decoder_layers' strides (layers.cpp): entries a layer in its `weights` and `layout` lists.
#define CBSERVE_LAYER(X) X(TENSORS, 21) X(INTS, 12)

#define CB_ENUM_ITEM(name, value) name = value,
#define CB_LAYER_ITEM(name, value) LAYER_##name = value,
enum Kind : int64_t { CBSERVE_KINDS(CB_ENUM_ITEM) };
enum Act : int64_t { CBSERVE_ACTS(CB_ENUM_ITEM) };
enum LayerStride : int64_t { CBSERVE_LAYER(CB_LAYER_ITEM) };
#undef CB_ENUM_ITEM
#undef CB_LAYER_ITEM

}  // namespace cbserve
