// GGUF block formats multiplied in place: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K,
// Q6_K, IQ4_NL, IQ4_XS, MXFP4.
// AVX2 + FMA + F16C (x86-64-v3); registered as torch.ops.cbserve.ggml_linear / ggml_rows.
//
// The weights are the file's own bytes, one row per output (a row is K / block_size blocks laid
// out exactly as llama.cpp's ggml-common.h defines them), so memory is the file's size and the
// loader's row permutation and q/k/v or gate/up fusion are plain row gathers and concatenations.
// A fused weight may join parts of different formats (Q4_K q/k with a Q6_K v): `m` lists them.
//
// Two ways to multiply (the caller picks, per `kind`):
// - float32 activations: each weight block is decoded to float32 (w = u * s + o, the same float
//   as gguf's dequantize) and multiplied with FMA, for up to MR activation rows per decode.
// - int8 activations: each row of x is quantized (per 32 inputs for the 32-value formats and
//   IQ4_XS, per 256 with sums per 16 for the K formats: llama.cpp's Q8_0 / Q8_K activations;
//   IQ4_XS's 32-value sub-blocks have their own scales, so per 32 is exact and finer) and the nibbles meet
//   them in vpmaddubsw (unsigned weight x signed activation pairs) then vpmaddwd with the block's
//   integer sub-scales; fp32 only once per block (per 256 inputs for the K formats). A format's
//   zero point or minimum enters through the activation block sums.
//   The dots and their tiling belong to the families (kquant_b32.cpp, kquant_k.cpp): both read
//   the file's rows for a few activation rows (decode) and register-tile rows unpacked once for
//   more (prefill, batched decode), with one arithmetic for both.
// A row's result does not depend on the batch: every activation row goes through the same
// sequence of operations whatever tile it falls in, and its sums run in one fixed order.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "kquant.h"
#include "ops.h"

namespace cbserve_kquant {
namespace {

// 32 floats times inv, rounded (nearest, ties to even) to int8 in dst; the sums of each 16.
inline void round32(const float* x, float inv, int8_t* dst, int32_t& sum0, int32_t& sum1) {
  const __m256 vi = _mm256_set1_ps(inv);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), vi));
  sum0 = hsum_i32(_mm256_add_epi32(q[0], q[1]));
  sum1 = hsum_i32(_mm256_add_epi32(q[2], q[3]));
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

inline float absmax(const float* x, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

void quantize32(const float* x, int64_t K, int8_t* q, float* d, int32_t* is, float* s) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const float dd = absmax(x + 32 * b, 32) / 127.f;
    const float inv = dd > 0.f ? 1.f / dd : 0.f;
    int32_t s0, s1;
    round32(x + 32 * b, inv, q + 32 * b, s0, s1);
    d[b] = dd;
    is[b] = s0 + s1;
    s[b] = dd * static_cast<float>(is[b]);
  }
}

void quantize256(const float* x, int64_t K, int8_t* q, float* d, int16_t* bs) {
  for (int64_t b = 0; b < K / 256; ++b) {
    const float dd = absmax(x + 256 * b, 256) / 127.f;
    const float inv = dd > 0.f ? 1.f / dd : 0.f;
    for (int i = 0; i < 8; ++i) {
      int32_t s0, s1;
      round32(x + 256 * b + 32 * i, inv, q + 256 * b + 32 * i, s0, s1);
      bs[16 * b + 2 * i] = static_cast<int16_t>(s0);
      bs[16 * b + 2 * i + 1] = static_cast<int16_t>(s1);
    }
    d[b] = dd;
  }
}

// -- float32 activations --------------------------------------------------------------------------

// A row decoded to K floats (unpack_f32); R activation rows, two accumulators each.
template <int T>
void unpack_f32(const uint8_t* w, int64_t nb, uint8_t* dst) {
  float* out = reinterpret_cast<float*>(dst);
  for (int64_t b = 0; b < nb; ++b) decode_block<T>(w + b * block_bytes(T), out + b * block_values(T));
}

template <int R>
void dot_f32(const uint8_t* w_, const Acts& a, int64_t r0, int64_t, float* res) {
  const float* w = reinterpret_cast<const float*>(w_);
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) { acc0[r] = _mm256_setzero_ps(); acc1[r] = _mm256_setzero_ps(); }
  for (int64_t k = 0; k < a.K; k += 16) {
    const __m256 w0 = _mm256_load_ps(w + k), w1 = _mm256_load_ps(w + k + 8);
    for (int r = 0; r < R; ++r) {
      const float* xr = a.x + (r0 + r) * a.K + k;
      acc0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc0[r]);
      acc1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) res[r] = hsum(_mm256_add_ps(acc0[r], acc1[r]));
}

// res[r] = sum_k w[k] x[r0 + r][k] for a weight row w of nb blocks, rows r < R (R = the index in
// the tables below).
using DotFn = void (*)(const uint8_t* w, const Acts& a, int64_t r0, int64_t nb, float* res);
// Prepares a file row for a DotFn into dst (a row used by many activation rows is unpacked once).
using UnpackFn = void (*)(const uint8_t* w, int64_t nb, uint8_t* dst);

// The row-at-a-time tile: NT weight rows, each prepared by `unpack` (when given; else the dots
// read the file's row), then met by every MR activation rows through dots[mr].
inline void tile_by_rows(const DotFn* dots, UnpackFn unpack, int64_t unpacked_bytes, const Part& p, int64_t n0,
                         int64_t n1, const Acts& a, int64_t M, float* y, int64_t ldy) {
  constexpr int64_t NT = 16;
  float res[MR];
  uint8_t* buf = scratch(NT * unpacked_bytes);
  for (int64_t t0 = n0; t0 < n1; t0 += NT) {
    const int64_t t1 = std::min(n1, t0 + NT);
    const uint8_t* rows[NT];
    for (int64_t n = t0; n < t1; ++n) {
      const uint8_t* raw = p.data + (n - p.n0) * p.row_bytes;
      if (unpack) {
        uint8_t* dst = buf + (n - t0) * unpacked_bytes;
        unpack(raw, p.nb, dst);
        rows[n - t0] = dst;
      } else {
        rows[n - t0] = raw;
      }
    }
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
      const int64_t mr = std::min<int64_t>(MR, M - m0);
      for (int64_t n = t0; n < t1; ++n) {
        dots[mr](rows[n - t0], a, m0, p.nb, res);
        for (int64_t r = 0; r < mr; ++r) y[(m0 + r) * ldy + n] = res[r];
      }
    }
  }
}

template <int T>
void tile_f32(const Part& p, int64_t n0, int64_t n1, const Acts& a, int64_t M, float* y, int64_t ldy) {
  static const DotFn dots[MR + 1] = {nullptr, dot_f32<1>, dot_f32<2>, dot_f32<3>, dot_f32<4>};
  tile_by_rows(dots, unpack_f32<T>, p.nb * block_values(T) * 4, p, n0, n1, a, M, y, ldy);
}

TileFn tile_for(int64_t type, bool int8) {
  if (int8) return type == MXFP4 ? tile_mxfp4_a8() : k_family(type) ? tile_k_a8(type) : tile_b32_a8(type);
  TileFn f = nullptr;
  with_type(type, [&](auto t) { f = tile_f32<decltype(t)::value>; });
  return f;
}

// o[j] = act(g[j]) * u[j], j < n, 8 at a time; the tail through one padded vector, so every
// output goes through the same arithmetic.
inline void gated_row(int64_t act, const float* g, const float* u, int64_t n, float* o) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(o + j, cbserve::gated8(act, _mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j)));
  if (j < n) {
    alignas(32) float gt[8] = {}, ut[8] = {}, ot[8];
    std::memcpy(gt, g + j, (n - j) * sizeof(float));
    std::memcpy(ut, u + j, (n - j) * sizeof(float));
    _mm256_store_ps(ot, cbserve::gated8(act, _mm256_load_ps(gt), _mm256_load_ps(ut)));
    std::memcpy(o + j, ot, (n - j) * sizeof(float));
  }
}

}  // namespace

Weight::Weight(const int64_t* table, int64_t P, const uint8_t* base, int64_t base_bytes, int64_t K, bool int8,
               const char* op) {
  for (int64_t i = 0; i < P; ++i) {
    const int64_t* row = table + 3 * i;
    const int64_t type = row[0], bb = block_bytes(type), bv = block_values(type);
    TORCH_CHECK(bb > 0, op, ": unsupported ggml type ", type);
    TORCH_CHECK(K % bv == 0, op, ": in_features ", K, " is not a multiple of ", bv);
    const Part p{type, N, row[1], K / bv * bb, K / bv, base + row[2]};
    TORCH_CHECK(row[1] >= 0 && row[2] >= 0 && row[2] + p.rows * p.row_bytes <= base_bytes, op, ": part ", i,
                " lies outside qs");
    (k_family(type) ? need256 : need32) = true;
    parts.push_back(p);
    tiles.push_back(tile_for(type, int8));
    N += p.rows;
  }
}

void Weight::gated(int64_t c, int64_t w, const Acts& a, int64_t M, int64_t act, const float* bias, float* out,
                   int64_t ldo) const {
  const int64_t F = N / 2, ld = 2 * w;
  // (its own buffer: the tiles use `scratch` for their unpacked weights)
  static thread_local std::vector<float> results;
  if (results.size() < static_cast<size_t>(M * ld)) results.resize(M * ld);
  float* buf = results.data();
  // (the buffer's column j holds output c + j, then F + c + j: the tiles add the absolute output
  // index to the base they are given)
  outputs(c, c + w, a, M, buf - c, ld);
  outputs(F + c, F + c + w, a, M, buf + w - (F + c), ld);
  for (int64_t m = 0; m < M; ++m) {
    float* g = buf + m * ld;
    float* u = g + w;
    if (bias)
      for (int64_t j = 0; j < w; ++j) {
        g[j] += bias[c + j];
        u[j] += bias[F + c + j];
      }
    gated_row(act, g, u, w, out + m * ldo + c);
  }
}

QuantizedRows::QuantizedRows(const float* x, int64_t M, int64_t K, bool int8, bool need32, bool need256)
    : acts{x, K, nullptr, 0, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr} {
  if (!int8) return;
  const int64_t nb32 = b32_groups(K / 32) * 8;  // zero blocks pad rows to whole groups of 8
  if (need32) {
    q32.assign(M * nb32 * 32, 0);
    d32.assign(M * nb32, 0.f);
    i32.assign(M * nb32, 0);
    s32.assign(M * nb32, 0.f);
  }
  if (need256) { q256.resize(M * K); d256.resize(M * K / 256); bs16.resize(M * K / 16); }
  at::parallel_for(0, M, std::max<int64_t>(1, (1 << 14) / K), [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      if (need32)
        quantize32(x + r * K, K, q32.data() + r * nb32 * 32, d32.data() + r * nb32, i32.data() + r * nb32,
                   s32.data() + r * nb32);
      if (need256)
        quantize256(x + r * K, K, q256.data() + r * K, d256.data() + r * K / 256, bs16.data() + r * K / 16);
    }
  });
  acts = Acts{x, K, q32.data(), nb32, d32.data(), i32.data(), s32.data(), q256.data(), d256.data(), bs16.data()};
}

Acts QuantizedRows::from_row(int64_t r) const {
  Acts a = acts;
  const int64_t K = a.K;
  a.x += r * K;
  if (a.q32) { a.q32 += r * a.nb32 * 32; a.d32 += r * a.nb32; a.i32 += r * a.nb32; a.s32 += r * a.nb32; }
  if (a.q256) { a.q256 += r * K; a.d256 += r * K / 256; a.bs16 += r * K / 16; }
  return a;
}

namespace {

// A call's activation rows in blocks, f(first row, rows) each: int8 rows in blocks whose
// activations stay in L2 (about 256 KB) while every tile of a thread's outputs meets them. The
// tiles rebuild their panels for each block, which costs less than streaming all of a long
// prompt's rows from L3 once per tile (2,048 rows of 576 values are 1.2 MB). Float32 rows, whose
// tiles decode whole rows to floats, go in one block. A row's arithmetic is the same in any block.
template <typename F>
void by_row_blocks(int64_t M, int64_t K, bool int8, F&& f) {
  const int64_t most = int8 ? std::clamp<int64_t>((int64_t(1) << 18) / K, 128, 512) : M;
  const int64_t blocks = (M + most - 1) / most, rows = ((M + blocks - 1) / blocks + 7) & ~int64_t(7);
  for (int64_t m0 = 0; m0 < M; m0 += rows) f(m0, std::min(rows, M - m0));
}

// parts: (P, 3) int64 rows [ggml type, rows, byte offset into qs]; their rows are the outputs in
// order. `d` is unused (the scales live in the blocks); kept so the schema is packed_linear's.
at::Tensor ggml_linear(const at::Tensor& x_, const at::Tensor& qs, const c10::optional<at::Tensor>& d_,
                       const c10::optional<at::Tensor>& parts_, int64_t kind, int64_t N,
                       const c10::optional<at::Tensor>& bias_, const c10::optional<at::Tensor>& residual_,
                       int64_t act) {
  (void)d_;
  TORCH_CHECK(x_.scalar_type() == at::kFloat && x_.dim() == 2, "x must be a 2-D float32 tensor");
  TORCH_CHECK(kind == GGML_F32 || kind == GGML_A8, "ggml_linear: unknown kind ", kind);
  TORCH_CHECK(parts_.has_value() && parts_->scalar_type() == at::kLong && parts_->dim() == 2 && parts_->size(1) == 3,
              "ggml_linear needs its (parts, 3) int64 table");
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous(), "ggml_linear: qs must be contiguous uint8");
  at::Tensor x = x_.contiguous();
  at::Tensor pt = parts_->contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const bool int8 = kind == GGML_A8;
  const Weight weight(pt.data_ptr<int64_t>(), pt.size(0), qs.data_ptr<uint8_t>(), qs.numel(), K, int8,
                      "ggml_linear");
  TORCH_CHECK(weight.N == N, "ggml_linear: the parts hold ", weight.N, " rows, not N = ", N);
  const int64_t out_n = cbserve::act_outputs(act, N, "ggml_linear");
  at::Tensor out = cbserve::output_matrix(M, out_n, x.options());
  if (M == 0) return out;
  at::Tensor bias, residual;
  if (bias_.has_value() && bias_->defined()) {
    bias = bias_->contiguous();
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.numel() == N, "bias must be (N,) float32");
  }
  if (residual_.has_value() && residual_->defined()) {
    residual = residual_->contiguous();
    TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.size(0) == M && residual.size(1) == N,
                "residual must be (M, N) float32");
  }
  const QuantizedRows rows(x.data_ptr<float>(), M, K, int8, weight.need32, weight.need256);
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, M * K));
  if (act == NONE) {  // straight to `out`, with bias and residual
    float* yp = out.data_ptr<float>();
    const float* rp = residual.defined() ? residual.data_ptr<float>() : nullptr;
    at::parallel_for(0, N, grain, [&](int64_t c0, int64_t c1) {
      by_row_blocks(M, K, int8, [&](int64_t m0, int64_t mr) {
        weight.outputs(c0, c1, rows.from_row(m0), mr, yp + m0 * N, N);
      });
      if (bp || rp)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = c0; n < c1; ++n) {
            float v = yp[m * N + n];
            if (bp) v += bp[n];
            if (rp) v += rp[m * N + n];
            yp[m * N + n] = v;
          }
    });
    return out;
  }
  // [gate; up] rows: out = act(gate) * up. A thread takes gate rows [f0, f1) and the up rows
  // paired with them, `gated_chunk` outputs at a time (see `Weight::gated`).
  const int64_t F = N / 2;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, F, std::max<int64_t>(1, grain / 2), [&](int64_t f0, int64_t f1) {
    by_row_blocks(M, K, int8, [&](int64_t m0, int64_t mr) {
      const Acts am = rows.from_row(m0);
      const int64_t chunk = gated_chunk(mr);
      for (int64_t c = f0; c < f1; c += chunk)
        weight.gated(c, std::min(chunk, f1 - c), am, mr, act, bp, op + m0 * F, F);
    });
  });
  return out;
}

// Rows `ids` of a (rows, K) GGUF matrix of `type`, decoded to float32: an embedding lookup that
// keeps the table in its file format.
at::Tensor ggml_rows(const at::Tensor& qs, int64_t type, int64_t K, const at::Tensor& ids_) {
  const int64_t bb = block_bytes(type), bv = block_values(type);
  TORCH_CHECK(bb > 0, "ggml_rows: unsupported ggml type ", type);
  TORCH_CHECK(K % bv == 0, "ggml_rows: K ", K, " is not a multiple of ", bv);
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous(), "ggml_rows: qs must be contiguous uint8");
  at::Tensor ids = ids_.to(at::kLong).contiguous();
  const int64_t row_bytes = K / bv * bb, rows = qs.numel() / row_bytes, T = ids.numel();
  at::Tensor out = at::empty({T, K}, at::TensorOptions().dtype(at::kFloat));
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < rows, "ggml_rows: id ", ip[t], " out of range");
  const uint8_t* base = qs.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  with_type(type, [&](auto ty) {
    constexpr int64_t TY = decltype(ty)::value;
    at::parallel_for(0, T, std::max<int64_t>(1, (1 << 14) / K), [&](int64_t a, int64_t b) {
      alignas(32) float buf[256];
      for (int64_t t = a; t < b; ++t) {
        const uint8_t* row = base + ip[t] * row_bytes;
        for (int64_t i = 0; i < K / bv; ++i) {
          decode_block<TY>(row + i * bb, buf);
          std::memcpy(op + t * K + i * bv, buf, bv * sizeof(float));
        }
      }
    });
  });
  std::vector<int64_t> shape = ids_.sizes().vec();
  shape.push_back(K);
  return out.view(shape);
}

}  // namespace
}  // namespace cbserve_kquant

namespace cbserve {
at::Tensor ggml_linear(const at::Tensor& x, const at::Tensor& qs, const c10::optional<at::Tensor>& d,
                       const c10::optional<at::Tensor>& parts, int64_t kind, int64_t N,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                       int64_t act) {
  return cbserve_kquant::ggml_linear(x, qs, d, parts, kind, N, bias, residual, act);
}
at::Tensor ggml_rows(const at::Tensor& qs, int64_t type, int64_t K, const at::Tensor& ids) {
  return cbserve_kquant::ggml_rows(qs, type, K, ids);
}
}  // namespace cbserve