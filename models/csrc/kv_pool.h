// The paged KV pool's rows (float32, float16 or int8 with per-32 scales), how they are read,
// written and prefetched, and the pieces both attention files share.
#pragma once

#include "common.h"

namespace cbserve {

// Softmax's exponentials in place: s[j] = exp(s[j] - mx) over [0, L); returns 1 / (their sum +
// `extra`) (extra: the exponential of a logit with no value, an attention sink's; 0: none).
inline float softmax_exp(float* s, int64_t L, float mx, float extra = 0.f) {
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= L; j += 8) {
    __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx));
    _mm256_storeu_ps(s + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = hsum(vsum);
  for (; j < L; ++j) { s[j] = std::exp(s[j] - mx); sum += s[j]; }
  return 1.f / (sum + extra);
}

// One kv head's row of K or V in the pool. float32 and float16 rows are its D values. An int8 row
// is D int8 values, then D/32 float32 scales (x = q * scale per 32 values): 72 bytes at head_dim
// 64 where float16 takes 128. Decode attention reads every past row of every sequence each step,
// and at long contexts that read is the step (memory-bound), so fewer bytes a row is a faster step.
template <typename C>
constexpr int64_t row_width(int64_t D) { return D; }  // elements of C a row occupies
template <>
constexpr int64_t row_width<int8_t>(int64_t D) { return D + D / 8; }

inline float row_scale(const int8_t* r, int64_t D, int64_t i) {  // the scale of value i
  float s;
  std::memcpy(&s, r + D + 4 * (i / 32), sizeof s);  // rows are not 4-byte aligned in general
  return s;
}

// Values [i, i + 8) of a row, as float32.
inline __m256 row8(const float* r, int64_t i, int64_t) { return _mm256_loadu_ps(r + i); }
inline __m256 row8(const at::Half* r, int64_t i, int64_t) { return load_h8(r + i); }
inline __m256 row8(const int8_t* r, int64_t i, int64_t D) {
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + i));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_set1_ps(row_scale(r, D, i)));
}

// Write one row of D float32 values into the pool.
template <typename C>
inline void store_row(C* dst, const float* x, int64_t D) {
  int64_t i = 0;
  for (; i + 8 <= D; i += 8) store8(dst + i, _mm256_loadu_ps(x + i));
  for (; i < D; ++i) dst[i] = static_cast<C>(x[i]);
}
// 32 float32 values times `inv`, clamped to [-127, 127] and rounded to int8 (nearest, ties to even:
// _mm256_cvtps_epi32 under the default rounding mode, as std::nearbyint), into dst[0 .. 32); returns
// their sum. AVX2, so every CPU the kernels run on writes the same bytes.
inline int32_t round_block32(const float* x, float inv, int8_t* dst) {
  const __m256 vi = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) {
    // Clamped before rounding, so an overflow (inf) cannot wrap; NaN (0 times the infinite inverse
    // of a denormal scale) becomes 0, as the scalar cast gave.
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), vi);
    const __m256 c = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
    q[i] = _mm256_cvtps_epi32(_mm256_and_ps(c, _mm256_cmp_ps(v, v, _CMP_ORD_Q)));
  }
  // packs interleave 128-bit lanes: bytes come out as dwords 0 4 1 5 2 6 3 7 of the wanted order
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  return _mm_cvtsi128_si32(t);
}

// max |x| over 32 values (a NaN is passed over, as std::max(amax, NaN) does); `finite`: all are.
inline float absmax32(const float* x, bool* finite) {
  const __m256 sign = _mm256_set1_ps(-0.f), inf = _mm256_set1_ps(INFINITY);
  __m256 m = _mm256_setzero_ps(), ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (int i = 0; i < 4; ++i) {
    const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * i));
    m = _mm256_max_ps(a, m);  // maxps returns its second operand when either is NaN
    ok = _mm256_and_ps(ok, _mm256_cmp_ps(a, inf, _CMP_LT_OQ));
  }
  if (finite) *finite = _mm256_movemask_ps(ok) == 0xFF;
  __m128 r = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  r = _mm_max_ps(r, _mm_movehl_ps(r, r));
  r = _mm_max_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// int8: symmetric per 32 values, scale = max|x| / 127, q = x * (1 / scale) rounded to nearest even.
template <>
inline void store_row<int8_t>(int8_t* dst, const float* x, int64_t D) {
  for (int64_t g = 0; g < D; g += 32) {
    const float scale = absmax32(x + g, nullptr) / 127.f;
    round_block32(x + g, scale > 0.f ? 1.f / scale : 0.f, dst + g);
    std::memcpy(dst + D + 4 * (g / 32), &scale, sizeof scale);
  }
}

// Prefetching, one block ahead, into L2. Decode rows read each past row once per step, from DRAM
// at long contexts (30 layers of pools do not stay in cache between steps), and the hardware
// prefetchers do not follow the reads: a kv head's rows are 72 or 128 bytes at a stride of all kv
// heads' rows, each key's load its own instruction, so a K pass alone reads at a fraction of a
// plain stream's bandwidth. Prefetching every next block pays most for int8 pools (rows of 72
// bytes straddle lines; float16 rows are whole lines and gain little). T1, not T0: L1's few fill
// buffers make T0 prefetches as slow as none. Prefill chunks re-read one past for each of their
// tokens, which stays in cache, and there prefetching every block costs a little: they prefetch
// across the jumps between scattered blocks only, which the hardware cannot foresee at all.
// (Int8 decode attention at 32 x 1,280 keys from DRAM: 0.63-0.65 of the unprefetched time with
// these T1 prefetches, 0.98-1.06 with T0, on Zen 4.)
inline bool prefetch_next(const int64_t* table, int64_t bi, int64_t nb, bool streamed) {
  return bi + 1 < nb && (streamed || table[bi + 1] != table[bi] + 1);
}

// First blocks, which prefetch_next cannot reach: each pass's first block. A decode row's V pass
// starts on a block nothing fetched (its K pass read only K), and a whole-row item's K pass on a
// block nothing fetched either: V's first block is prefetched when the row starts, the next row's
// first K block when this row starts. At short contexts that first block is much of the row (5
// blocks at 80 keys) and the pool is out of cache all the same (a busy step's pools of every
// layer outgrow L3), so the short-context, many-row steps gain most.

// The next block's rows of this kv head (D values a row: 64 by default, one or two cache lines).
template <typename C>
inline void prefetch_rows(const C* first, int64_t n, int64_t tok_stride, int64_t D = 64) {
  const int64_t bytes = row_width<C>(D) * static_cast<int64_t>(sizeof(C));
  for (int64_t t = 0; t < n; ++t) {
    const char* p = reinterpret_cast<const char*>(first + t * tok_stride);
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
  }
}

// The next block's rows of every kv head (see prefetch_next).
inline void prefetch_bytes(const void* first, int64_t bytes) {
  const char* p = static_cast<const char*>(first);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
}

// A prefill's items, n of them for each of KVH kv heads, dealt to the threads' contiguous shares in
// zigzag order (first, last, second, ...), so the shares cost about the same although an item's
// cost grows with its index (later tokens see more keys): f(item, kv head, the thread's scratch).
template <typename F>
void zigzag_items(int64_t n, int64_t KVH, int64_t grain, F&& f) {
  at::parallel_for(0, n * KVH, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> s;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t k = i / KVH;
      f(k % 2 == 0 ? k / 2 : n - 1 - k / 2, i % KVH, s);
    }
  });
}


// The AVX-512 kernels (attention_avx512.cpp), for head_dim 64 and groups of up to 8 query heads.
template <typename C>
void decode_group_avx512(int64_t G, const float* q, const C* kc, const C* vc, const int64_t* table, int64_t L,
                    int64_t bs, int64_t tok_stride, int64_t blk_stride, float scale, float* out, float* s,
                    bool streamed);
void decode_whole_rows_int8(const float* qp, float* op, const int8_t* kbase, const int8_t* vbase, int64_t bs,
                            int64_t num_decode, const int64_t* tp, const int64_t* lp, int64_t maxb, int64_t H,
                            int64_t KVH, int64_t tok_stride, int64_t blk_stride, float scale);
void prefill_groups_int8(const float* qp, float* op, const int8_t* kbase, const int8_t* vbase, int64_t bs,
                         const int64_t* mp, int64_t NC, const int64_t* ctp, int64_t cmaxb, int64_t H, int64_t KVH,
                         int64_t tok_stride, int64_t blk_stride, float scale, int64_t max_len);

}  // namespace cbserve
