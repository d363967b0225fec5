// Shared by every kernel file: SIMD helpers, the CPU feature checks and the target attributes of
// the AVX-512 code paths. The library is compiled for x86-64-v3 (AVX2, FMA, F16C); AVX-512 code
// carries its own target attribute and runs only where the CPU checks below say so.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "enums.h"

namespace cbserve {

#define CB_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
// AMX tiles (kquant_k_vnni.cpp's many-row tile): AVX512-VNNI's set plus the tile instructions.
#define CB_AMX \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,amx-tile,amx-int8")))
#define CB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

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

// sigmoid(z) with exp only of non-positive arguments (exp256's domain): 1 / (1 + e) for z >= 0
// and e / (1 + e) for z < 0, where e = exp(-|z|).
inline __m256 sigmoid8(__m256 z) {
  const __m256 e = exp256(_mm256_or_ps(z, _mm256_set1_ps(-0.f)));  // exp(-|z|)
  const __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_add_ps(_mm256_set1_ps(1.f), e));
  const __m256 neg = _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_LT_OQ);
  return _mm256_blendv_ps(inv, _mm256_mul_ps(e, inv), neg);
}

// silu(g) = g * sigmoid(g).
inline __m256 silu8(__m256 g) { return _mm256_mul_ps(g, sigmoid8(g)); }

// The tanh GELU (torch's approximate="tanh"): 0.5 g (1 + tanh(u)) with u = sqrt(2/pi) (g +
// 0.044715 g^3), which is g * sigmoid(2u): no tanh needed, and no overflow for large |g|.
inline __m256 gelu8(__m256 g) {
  const __m256 g2 = _mm256_mul_ps(g, g);
  const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(g2, _mm256_set1_ps(0.044715f)), g, g);
  return _mm256_mul_ps(g, sigmoid8(_mm256_mul_ps(inner, _mm256_set1_ps(2.f * 0.7978845608028654f))));
}

// gpt-oss's gated activation (transformers' GptOssExperts._apply_gate, llama.cpp's swiglu_oai):
// gate clamped above at 7, up to [-7, 7], then (up + 1) * gate * sigmoid(1.702 gate).
constexpr float kSwigluOaiAlpha = 1.702f, kSwigluOaiLimit = 7.f;
inline __m256 swiglu_oai8(__m256 gate, __m256 up) {
  const __m256 limit = _mm256_set1_ps(kSwigluOaiLimit);
  gate = _mm256_min_ps(gate, limit);
  up = _mm256_max_ps(_mm256_min_ps(up, limit), _mm256_set1_ps(-kSwigluOaiLimit));
  const __m256 glu = _mm256_mul_ps(gate, sigmoid8(_mm256_mul_ps(gate, _mm256_set1_ps(kSwigluOaiAlpha))));
  return _mm256_mul_ps(_mm256_add_ps(up, _mm256_set1_ps(1.f)), glu);
}

// A gated MLP's act(gate) * up (act SILU_MUL, GELU_MUL or SWIGLU_OAI, enums.h).
inline __m256 gated8(int64_t act, __m256 gate, __m256 up) {
  if (act == SWIGLU_OAI) return swiglu_oai8(gate, up);
  return _mm256_mul_ps(act == GELU_MUL ? gelu8(gate) : silu8(gate), up);
}

// A linear's result width for `act` (enums.h) over N outputs: N, or N / 2 for a gated act of
// [gate; up] rows; `op` names the linear in the error.
inline int64_t act_outputs(int64_t act, int64_t N, const char* op) {
  TORCH_CHECK(act == NONE || ((act == SILU_MUL || act == GELU_MUL || act == SWIGLU_OAI) && N % 2 == 0), op,
              ": bad act ", act, " for ", N, " outputs");
  return act == NONE ? N : N / 2;
}

// torch's own ISA cap (ATEN_CPU_CAPABILITY=avx2 or default) caps these kernels too, so an AVX-512
// machine can run, and test, exactly what an AVX2-only CPU runs.
inline bool isa_capped() {
  const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
  return cap && (std::strcmp(cap, "avx2") == 0 || std::strcmp(cap, "default") == 0);
}

inline bool cpu_has_vnni() {
  static const bool ok = !isa_capped() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("avx512vnni");
  return ok;
}

// AMX-INT8 tiles (Sapphire Rapids and later), usable: Linux hands a process the 8 KiB tile state
// only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); without the grant a tile
// instruction is SIGILL. Asked once here. CBSERVE_AMX=0 keeps to the VNNI tiles (same bits).
inline bool cpu_has_amx() {
  static const bool ok = [] {
    const char* off = std::getenv("CBSERVE_AMX");
    if (!cpu_has_vnni() || (off && std::strcmp(off, "0") == 0)) return false;
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8")) return false;
    constexpr long ARCH_GET_XCOMP_PERM = 0x1022, ARCH_REQ_XCOMP_PERM = 0x1023, XTILEDATA = 18;
    unsigned long granted = 0;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XTILEDATA) == 0 &&
           syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &granted) == 0 && ((granted >> XTILEDATA) & 1);
  }();
  return ok;
}

// The tile shapes of the AMX kernel (kquant_k_vnni.cpp), loaded into the calling thread: C0..C3 (tiles 0-3) 16 x 16 int32; A0/A1 (4, 5) 16 activation rows x `k_bytes`
// int8 (one block or sub-block); B0/B1 (6, 7) its weights, four to a row x 16 outputs. A thread
// ends with amx_tiles_end, so it carries no tile state into other work (or a context switch).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

CB_AMX inline void amx_tiles_begin(int k_bytes) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(t >= 6 ? k_bytes / 4 : 16);
    cfg.colsb[t] = static_cast<uint16_t>(t >= 4 && t < 6 ? k_bytes : 64);
  }
  asm volatile("" : : "r"(&cfg) : "memory");  // GCC's ldtilecfg builtin does not say it reads cfg
  _tile_loadconfig(&cfg);
}

CB_AMX inline void amx_tiles_end() { _tile_release(); }

inline bool cpu_has_avx512() {
  static const bool ok = !isa_capped() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return ok;
}

// Four bytes as an int32 (for a broadcast), whatever their alignment.
inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// 8 rows of 8 dwords -> vector d holding dword d of the 8 rows.
inline void transpose8(__m256i r[8]) {
  __m256i t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m256i u[8];
  for (int i = 0; i < 2; ++i) {  // u[4i + j], 128-bit half c: dword 4c + j of rows 4i .. 4i + 3
    u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
    r[4 + j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
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

// Dispatch: a kernel templated on a small count or a type, picked for a runtime value by one call
// instead of a switch over every case.

// f(std::integral_constant<int, n>{}) for the runtime count n in [1, MAX] (a larger n: MAX).
template <int MAX, int I = 1, typename F>
inline void with_count(int64_t n, F&& f) {
  if constexpr (I >= MAX)
    f(std::integral_constant<int, MAX>{});
  else if (n <= I)
    f(std::integral_constant<int, I>{});
  else
    with_count<MAX, I + 1>(n, std::forward<F>(f));
}

// f(std::integral_constant<int64_t, V>{}) for the V among Vs equal to v; false when none is.
template <int64_t... Vs, typename F>
inline bool with_value(int64_t v, F&& f) {
  return ((v == Vs ? (f(std::integral_constant<int64_t, Vs>{}), true) : false) || ...);
}

// f(C{}) for C the element type of a KV pool of dtype t: float, at::Half or int8_t.
template <typename F>
inline void with_pool_type(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: return f(float{});
    case at::kHalf: return f(at::Half{});
    case at::kChar: return f(int8_t{});
    default: TORCH_CHECK(false, "KV pool dtype must be float32, float16 or int8, not ", t);
  }
}

}  // namespace cbserve
