// Attention kernels for AVX-512 CPUs, head_dim 64: a kv head's query heads together over each K
// and V row, and over int8 pools with AVX512-VNNI, scores as integer dot products (the query
// rounded as the keys), whole decode rows and groups of prefill tokens.
#include "kv_pool.h"

namespace cbserve {
namespace {

// int8 pools with AVX512-VNNI: scores through integer dot products. Each query head is quantized
// as the pool's rows are (int8 per 32 values, scale max|x| / 127), so a score is sq * sk * (an
// exact integer dot product), 64 multiply-adds an instruction (vpdpbusd) instead of 16. The K rows
// of a tile of up to 16 keys are transposed (4 bytes of a row a lane: lane t is key t), so a key's
// score is one lane: no horizontal sums, and the same whatever keys are around it (a token's
// attention stays the same in a prefill chunk and as a decode row). vpdpbusd multiplies unsigned
// by signed bytes: keys are offset by 128 (their sign bit flipped) and 128 * (the sum of the
// query's values) is subtracted from each integer sum.
struct QueryInt8 {
  int32_t words[16];  // the quantized query's bytes 4d .. 4d + 3, as one dword each
  float scale[2];     // its scales, per 32 values
  int32_t corr[2];    // 128 * the sum of its values, per 32
};

// q: one head's 64 values (roped); `softmax_scale` folded in before quantizing.
inline void quantize_query(const float* q, float softmax_scale, QueryInt8& out) {
  alignas(32) float x[64];
  const __m256 vs = _mm256_set1_ps(softmax_scale);
  for (int i = 0; i < 64; i += 8) _mm256_store_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(q + i), vs));
  int8_t* bytes = reinterpret_cast<int8_t*>(out.words);
  for (int h = 0; h < 2; ++h) {
    bool finite;
    const float amax = absmax32(x + 32 * h, &finite);
    // A non-finite query (a broken model) gives NaN scores, as the float path would.
    out.scale[h] = finite ? amax / 127.f : NAN;
    const float inv = finite && amax > 0.f ? 127.f / amax : 0.f;
    out.corr[h] = 128 * round_block32(x + 32 * h, inv, bytes + 32 * h);
  }
}

// A tile of up to 16 keys, transposed for vpdpbusd (r[d]: dword d of each key, key t in lane t,
// offset to unsigned), and the keys' two scales (lane t: key t's).
struct KeyTile {
  __m512i r[16];
  __m512 k0, k1;
};

// The n <= 16 K rows from `first` as a KeyTile; lanes from n on hold a zero key.
CB_VNNI inline void load_key_tile(const int8_t* first, int n, int64_t tok_stride, KeyTile& kt) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  alignas(64) float sk0[16], sk1[16];
  for (int t = 0; t < 16; ++t) {
    if (t < n) {
      const int8_t* kr = first + t * tok_stride;
      kt.r[t] = _mm512_xor_si512(_mm512_loadu_si512(kr), flip);
      std::memcpy(&sk0[t], kr + 64, 4);
      std::memcpy(&sk1[t], kr + 68, 4);
    } else {
      kt.r[t] = flip;
      sk0[t] = sk1[t] = 0.f;
    }
  }
  transpose16(kt.r);
  kt.k0 = _mm512_load_ps(sk0);
  kt.k1 = _mm512_load_ps(sk1);
}

// Scores of G query heads (qh[0 .. G)) over the tile's first n keys, into s[g * L + j ...]
// (masked to n), their running maxima in vmx[g].
template <int G>
CB_VNNI inline void score_key_tile(const KeyTile& kt, int n, const QueryInt8* qh, float* s, int64_t L, int64_t j,
                                   __m512* vmx) {
  const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    const QueryInt8& qg = qh[g];
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int d = 0; d < 8; ++d) {
      a0 = _mm512_dpbusd_epi32(a0, kt.r[d], _mm512_set1_epi32(qg.words[d]));
      a1 = _mm512_dpbusd_epi32(a1, kt.r[8 + d], _mm512_set1_epi32(qg.words[8 + d]));
    }
    const __m512 w0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(a0, _mm512_set1_epi32(qg.corr[0])));
    const __m512 w1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(a1, _mm512_set1_epi32(qg.corr[1])));
    const __m512 sc = _mm512_fmadd_ps(w1, _mm512_mul_ps(kt.k1, _mm512_set1_ps(qg.scale[1])),
                                      _mm512_mul_ps(w0, _mm512_mul_ps(kt.k0, _mm512_set1_ps(qg.scale[0]))));
    _mm512_mask_storeu_ps(s + g * L + j, m, sc);
    vmx[g] = _mm512_mask_max_ps(vmx[g], m, vmx[g], sc);
  }
}

// Scores of G query heads over n <= 16 keys whose rows start at `first` (see score_key_tile).
template <int G>
CB_VNNI inline void score_tile_int8(const int8_t* first, int n, int64_t tok_stride, const QueryInt8* qh, float* s,
                                    int64_t L, int64_t j, __m512* vmx) {
  KeyTile kt;
  load_key_tile(first, n, tok_stride, kt);
  score_key_tile<G>(kt, n, qh, s, L, j, vmx);
}

// head_dim 64 with AVX-512 (where the CPU has it): the G query heads sharing a kv head together,
// so each K and V row is loaded and widened once for all of them; 4 zmm a row.

// Values [16 i, 16 i + 16) of a head_dim-64 row, as float32.
CB_AVX512 inline __m512 row16(const float* r, int i) { return _mm512_loadu_ps(r + 16 * i); }
CB_AVX512 inline __m512 row16(const at::Half* r, int i) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 16 * i)));
}
CB_AVX512 inline __m512 row16(const int8_t* r, int i) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 16 * i));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(row_scale(r, 64, 16 * i)));
}

// The tiles of up to 16 keys of [0, L), block by block in order (a tile never spans two blocks),
// with prefetch_next's prefetching of this kv head's rows, or with `whole_rows` of each token's
// first `whole_rows` bytes (every kv head): for (KeyTiles it{...}; it.next();) { it.first, it.n, it.j }.
struct KeyTiles {
  const int8_t* kc;
  const int64_t* table;
  int64_t L, bs, tok_stride, blk_stride;
  bool streamed;
  int64_t whole_rows = 0;
  int64_t nb = (L + bs - 1) / bs, bi = -1, t0 = 0, nblk = 0, j = 0;
  const int8_t* first = nullptr;  // the tile's first K row
  int n = 0;                       // its keys; the first is key j
  bool next() {
    j += n;
    t0 += n;
    if (t0 >= nblk) {
      if (++bi >= nb) return false;
      if (prefetch_next(table, bi, nb, streamed)) {
        const int64_t rows = std::min(bs, L - (bi + 1) * bs);
        if (whole_rows)
          prefetch_bytes(kc + table[bi + 1] * blk_stride, rows * whole_rows);
        else
          prefetch_rows(kc + table[bi + 1] * blk_stride, rows, tok_stride);
      }
      t0 = 0;
      nblk = std::min(bs, L - bi * bs);
    }
    first = kc + table[bi] * blk_stride + t0 * tok_stride;
    n = static_cast<int>(std::min<int64_t>(16, nblk - t0));
    return true;
  }
};

// Scores of a kv head's G query heads over keys [0, L) (head g's at s + g * L); returns nothing,
// leaves the maxima in mx. The float path: one key at a time, a horizontal sum per head.
template <typename C, int G>
CB_AVX512 void scores_float64(const float* q, const C* kc, const int64_t* table, int64_t L, int64_t bs,
                              int64_t tok_stride, int64_t blk_stride, float scale, float* s, float* mx,
                              bool streamed) {
  constexpr int D = 64;
  const int64_t nb = (L + bs - 1) / bs;
  __m512 qv[G][4];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) qv[g][i] = _mm512_mul_ps(_mm512_loadu_ps(q + g * D + 16 * i), _mm512_set1_ps(scale));
  for (int g = 0; g < G; ++g) mx[g] = -INFINITY;
  for (int64_t bi = 0, j = 0; bi < nb; ++bi) {
    const C* kb = kc + table[bi] * blk_stride;
    if (prefetch_next(table, bi, nb, streamed))
      prefetch_rows(kc + table[bi + 1] * blk_stride, std::min(bs, L - (bi + 1) * bs), tok_stride);
    for (int64_t t = 0, n = std::min(bs, L - bi * bs); t < n; ++t, ++j) {
      const C* kr = kb + t * tok_stride;
      const __m512 k0 = row16(kr, 0), k1 = row16(kr, 1), k2 = row16(kr, 2), k3 = row16(kr, 3);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        __m512 a = _mm512_mul_ps(qv[g][0], k0);
        a = _mm512_fmadd_ps(qv[g][1], k1, a);
        a = _mm512_fmadd_ps(qv[g][2], k2, a);
        a = _mm512_fmadd_ps(qv[g][3], k3, a);
        const float v = _mm512_reduce_add_ps(a);
        s[g * L + j] = v;
        mx[g] = std::max(mx[g], v);
      }
    }
  }
}

// The int8 + VNNI scores of one kv head (as scores_float64), a 16-key tile at a time.
template <int G>
CB_VNNI void scores_int8_64(const float* q, const int8_t* kc, const int64_t* table, int64_t L, int64_t bs,
                            int64_t tok_stride, int64_t blk_stride, float scale, float* s, float* mx,
                            bool streamed) {
  QueryInt8 qh[G];
  for (int g = 0; g < G; ++g) quantize_query(q + g * 64, scale, qh[g]);
  __m512 vmx[G];
  for (int g = 0; g < G; ++g) vmx[g] = _mm512_set1_ps(-INFINITY);
  for (KeyTiles it{kc, table, L, bs, tok_stride, blk_stride, streamed}; it.next();)
    score_tile_int8<G>(it.first, it.n, tok_stride, qh, s, L, it.j, vmx);
  for (int g = 0; g < G; ++g) mx[g] = _mm512_reduce_max_ps(vmx[g]);
}

// acc[g] += the weights s[g * L + j + t] times the n value rows from `first` (in order).
template <typename C, int G>
CB_AVX512 inline void values_rows(const C* first, int64_t n, int64_t tok_stride, const float* s, int64_t L,
                                  int64_t j, __m512 (*acc)[4]) {
  for (int64_t t = 0; t < n; ++t) {
    const C* vr = first + t * tok_stride;
    const __m512 v0 = row16(vr, 0), v1 = row16(vr, 1), v2 = row16(vr, 2), v3 = row16(vr, 3);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(s[g * L + j + t]);
      acc[g][0] = _mm512_fmadd_ps(p, v0, acc[g][0]);
      acc[g][1] = _mm512_fmadd_ps(p, v1, acc[g][1]);
      acc[g][2] = _mm512_fmadd_ps(p, v2, acc[g][2]);
      acc[g][3] = _mm512_fmadd_ps(p, v3, acc[g][3]);
    }
  }
}

// values_rows for two tokens' heads at once (weights from s0 and s1): each row widened once.
template <int G>
CB_AVX512 inline void values_rows2(const int8_t* first, int64_t n, int64_t tok_stride, const float* s0,
                                   const float* s1, int64_t L, int64_t j, __m512 (*a0)[4], __m512 (*a1)[4]) {
  for (int64_t t = 0; t < n; ++t) {
    const int8_t* vr = first + t * tok_stride;
    const __m512 v0 = row16(vr, 0), v1 = row16(vr, 1), v2 = row16(vr, 2), v3 = row16(vr, 3);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(s0[g * L + j + t]), r = _mm512_set1_ps(s1[g * L + j + t]);
      a0[g][0] = _mm512_fmadd_ps(p, v0, a0[g][0]);
      a0[g][1] = _mm512_fmadd_ps(p, v1, a0[g][1]);
      a0[g][2] = _mm512_fmadd_ps(p, v2, a0[g][2]);
      a0[g][3] = _mm512_fmadd_ps(p, v3, a0[g][3]);
      a1[g][0] = _mm512_fmadd_ps(r, v0, a1[g][0]);
      a1[g][1] = _mm512_fmadd_ps(r, v1, a1[g][1]);
      a1[g][2] = _mm512_fmadd_ps(r, v2, a1[g][2]);
      a1[g][3] = _mm512_fmadd_ps(r, v3, a1[g][3]);
    }
  }
}


template <typename C, int G>
CB_AVX512 void decode_group64(const float* q, const C* kc, const C* vc, const int64_t* table, int64_t L,
                              int64_t bs, int64_t tok_stride, int64_t blk_stride, float scale, float* out,
                              float* s, bool streamed) {
  constexpr int D = 64;
  const int64_t nb = (L + bs - 1) / bs;
  float mx[G];
  prefetch_rows(vc + table[0] * blk_stride, std::min(bs, L), tok_stride);  // first block: see prefetch_next
  if constexpr (std::is_same_v<C, int8_t>) {
    if (cpu_has_vnni())
      scores_int8_64<G>(q, kc, table, L, bs, tok_stride, blk_stride, scale, s, mx, streamed);
    else
      scores_float64<C, G>(q, kc, table, L, bs, tok_stride, blk_stride, scale, s, mx, streamed);
  } else {
    scores_float64<C, G>(q, kc, table, L, bs, tok_stride, blk_stride, scale, s, mx, streamed);
  }
  float inv[G];
  for (int g = 0; g < G; ++g) inv[g] = softmax_exp(s + g * L, L, mx[g]);
  __m512 acc[G][4];
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_setzero_ps();
  for (int64_t bi = 0, j = 0; bi < nb; ++bi) {
    if (prefetch_next(table, bi, nb, streamed))
      prefetch_rows(vc + table[bi + 1] * blk_stride, std::min(bs, L - (bi + 1) * bs), tok_stride);
    const int64_t n = std::min(bs, L - bi * bs);
    values_rows<C, G>(vc + table[bi] * blk_stride, n, tok_stride, s, L, j, acc);
    j += n;
  }
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 4; ++i)
      _mm512_storeu_ps(out + g * D + 16 * i, _mm512_mul_ps(acc[g][i], _mm512_set1_ps(inv[g])));
}

}  // namespace

// One sequence's G <= 8 query heads of one kv head (decode_group64<C, G>).
template <typename C>
void decode_group_avx512(int64_t G, const float* q, const C* kc, const C* vc, const int64_t* table, int64_t L,
                    int64_t bs, int64_t tok_stride, int64_t blk_stride, float scale, float* out, float* s,
                    bool streamed) {
  with_count<8>(G, [&](auto g) {
    decode_group64<C, g>(q, kc, vc, table, L, bs, tok_stride, blk_stride, scale, out, s, streamed);
  });
}
template void decode_group_avx512<float>(int64_t, const float*, const float*, const float*, const int64_t*, int64_t,
                                    int64_t, int64_t, int64_t, float, float*, float*, bool);
template void decode_group_avx512<at::Half>(int64_t, const float*, const at::Half*, const at::Half*, const int64_t*,
                                       int64_t, int64_t, int64_t, int64_t, float, float*, float*, bool);
template void decode_group_avx512<int8_t>(int64_t, const float*, const int8_t*, const int8_t*, const int64_t*, int64_t,
                                     int64_t, int64_t, int64_t, float, float*, float*, bool);

namespace {

// A whole decode row of an int8 pool (all KVH kv heads, H = KVH * G query heads) in one pass over
// its blocks: each 16-key tile's K rows of every kv head, then (after the softmaxes) each block's V
// rows of every kv head. A token's kv heads are adjacent in the pool (216 bytes at SmolLM2's 3 x
// 72), so every cache line is used when it arrives. One (row, kv head) at a time instead reads 72
// of every 216 bytes, and the other heads' items reread the rest, which is slower from DRAM (whole
// rows take 0.85 of its time at 32 x 1,280 keys, Zen 4) and no faster where the pool is
// cache-resident or the blocks scattered. Every score and every accumulation is decode_group64's
// operation in its order (state kept in memory between blocks is exact): the same result either
// way, so a row's attention does not depend on how many rows share the step.
template <int G>
CB_VNNI void decode_row_int8_64(const float* q, const int8_t* kc, const int8_t* vc, const int64_t* table, int64_t L,
                                int64_t bs, int64_t KVH, int64_t tok_stride, int64_t blk_stride, float scale,
                                float* out, float* s, std::vector<QueryInt8>& qh, std::vector<float>& state) {
  constexpr int D = 64;
  constexpr int64_t W = row_width<int8_t>(D);
  const int64_t HH = KVH * G;
  // s: each head's scores; state: each head's running maximum (16 lanes), later its accumulators
  qh.resize(HH);
  for (int64_t h = 0; h < HH; ++h) quantize_query(q + h * D, scale, qh[h]);
  state.resize(HH * D);
  float* st = state.data();
  for (int64_t h = 0; h < HH; ++h) _mm512_storeu_ps(st + 16 * h, _mm512_set1_ps(-INFINITY));
  const int64_t nb = (L + bs - 1) / bs;
  const int64_t row_bytes = KVH * W;
  prefetch_bytes(vc + table[0] * blk_stride, std::min(bs, L) * row_bytes);  // first block: see prefetch_next
  for (KeyTiles it{kc, table, L, bs, tok_stride, blk_stride, true, row_bytes}; it.next();) {
    for (int64_t kvh = 0; kvh < KVH; ++kvh) {
      __m512 vmx[G];
      for (int g = 0; g < G; ++g) vmx[g] = _mm512_loadu_ps(st + 16 * (kvh * G + g));
      score_tile_int8<G>(it.first + kvh * W, it.n, tok_stride, &qh[kvh * G], s + kvh * G * L, L, it.j, vmx);
      for (int g = 0; g < G; ++g) _mm512_storeu_ps(st + 16 * (kvh * G + g), vmx[g]);
    }
  }
  float inv[64];
  for (int64_t h = 0; h < HH; ++h) inv[h] = softmax_exp(s + h * L, L, _mm512_reduce_max_ps(_mm512_loadu_ps(st + 16 * h)));
  for (int64_t i = 0; i < HH * D; ++i) st[i] = 0.f;
  for (int64_t bi = 0, j = 0; bi < nb; ++bi) {
    const int8_t* vb = vc + table[bi] * blk_stride;
    const int64_t n = std::min(bs, L - bi * bs);
    if (prefetch_next(table, bi, nb, true))
      prefetch_bytes(vc + table[bi + 1] * blk_stride, std::min(bs, L - (bi + 1) * bs) * row_bytes);
    for (int64_t kvh = 0; kvh < KVH; ++kvh) {
      float* sa = st + kvh * G * D;
      __m512 a[G][4];
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < 4; ++i) a[g][i] = _mm512_loadu_ps(sa + g * D + 16 * i);
      values_rows<int8_t, G>(vb + kvh * W, n, tok_stride, s + kvh * G * L, L, j, a);
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < 4; ++i) _mm512_storeu_ps(sa + g * D + 16 * i, a[g][i]);
    }
    j += n;
  }
  for (int64_t h = 0; h < HH; ++h)
    for (int i = 0; i < 4; ++i)
      _mm512_storeu_ps(out + h * D + 16 * i, _mm512_mul_ps(_mm512_loadu_ps(st + h * D + 16 * i), _mm512_set1_ps(inv[h])));
}

// Prefill chunks over an int8 pool with VNNI: up to kPrefillGroup consecutive tokens of a chunk
// (causal lengths L0, L0 + 1, ...) with one kv head's G query heads, together. A token of a chunk
// at depth attends over the same past as its neighbours, which decode_group64 rereads, transposes
// and widens once a token; here each 16-key tile is loaded and transposed once for the group and
// each V row widened once for each pair of tokens. Every token's scores, softmax and accumulation
// are decode_group64's operations in its order (a key's score is its own lane whatever else the
// tile holds; a pair's accumulators each take their own token's rows in order), so a token's
// attention stays bit-identical to its decode-row form.
constexpr int kPrefillGroup = 4;

template <int G>
CB_VNNI void prefill_group_int8_64(const float* q, int64_t q_stride, int nq, const int8_t* kc, const int8_t* vc,
                                   const int64_t* table, int64_t L0, int64_t bs, int64_t tok_stride,
                                   int64_t blk_stride, float scale, float* out, int64_t out_stride, float* s) {
  constexpr int D = 64;
  const int64_t Lmax = L0 + nq - 1;  // token i's length is L0 + i; its head g's scores at s + (i G + g) Lmax
  QueryInt8 qh[kPrefillGroup][G];
  __m512 vmx[kPrefillGroup][G];
  for (int i = 0; i < nq; ++i)
    for (int g = 0; g < G; ++g) {
      quantize_query(q + i * q_stride + g * D, scale, qh[i][g]);
      vmx[i][g] = _mm512_set1_ps(-INFINITY);
    }
  for (KeyTiles it{kc, table, Lmax, bs, tok_stride, blk_stride, false}; it.next();) {
    KeyTile kt;
    load_key_tile(it.first, it.n, tok_stride, kt);
    for (int i = 0; i < nq; ++i) {
      const int64_t ni = std::min<int64_t>(it.n, L0 + i - it.j);  // the keys token i sees
      if (ni > 0) score_key_tile<G>(kt, static_cast<int>(ni), qh[i], s + i * G * Lmax, Lmax, it.j, vmx[i]);
    }
  }
  float inv[kPrefillGroup][G];
  for (int i = 0; i < nq; ++i)
    for (int g = 0; g < G; ++g)
      inv[i][g] = softmax_exp(s + (i * G + g) * Lmax, L0 + i, _mm512_reduce_max_ps(vmx[i][g]));
  for (int i = 0; i < nq; i += 2) {
    const bool pair = i + 1 < nq;
    const int64_t La = L0 + i;  // rows [0, La) for token i (and i + 1), then row La for token i + 1
    const float* s0 = s + i * G * Lmax;
    const float* s1 = s0 + G * Lmax;
    __m512 a0[G][4], a1[G][4];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
      for (int k = 0; k < 4; ++k) a0[g][k] = a1[g][k] = _mm512_setzero_ps();
    const int64_t nbv = (La + bs - 1) / bs;
    for (int64_t bi = 0, j = 0; bi < nbv; ++bi) {
      if (prefetch_next(table, bi, nbv, false))
        prefetch_rows(vc + table[bi + 1] * blk_stride, std::min(bs, La - (bi + 1) * bs), tok_stride);
      const int64_t n = std::min(bs, La - j);
      if (pair)
        values_rows2<G>(vc + table[bi] * blk_stride, n, tok_stride, s0, s1, Lmax, j, a0, a1);
      else
        values_rows<int8_t, G>(vc + table[bi] * blk_stride, n, tok_stride, s0, Lmax, j, a0);
      j += n;
    }
    if (pair)
      values_rows<int8_t, G>(vc + table[La / bs] * blk_stride + (La % bs) * tok_stride, 1, tok_stride, s1, Lmax, La, a1);
    for (int k = 0; k < (pair ? 2 : 1); ++k) {
      float* o = out + (i + k) * out_stride;
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < 4; ++c)
          _mm512_storeu_ps(o + g * D + 16 * c,
                           _mm512_mul_ps((k ? a1 : a0)[g][c], _mm512_set1_ps(inv[i + k][g])));
    }
  }
}

}  // namespace

// Decode rows of an int8 pool as whole-row items (see decode_row_int8_64); head_dim 64, G <= 8.
void decode_whole_rows_int8(const float* qp, float* op, const int8_t* kbase, const int8_t* vbase, int64_t bs,
                            int64_t num_decode, const int64_t* tp, const int64_t* lp, int64_t maxb, int64_t H,
                            int64_t KVH, int64_t tok_stride, int64_t blk_stride, float scale) {
  const int64_t G = H / KVH, width = (H + 2 * KVH) * 64;
  at::parallel_for(0, num_decode, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> s, state;
    std::vector<QueryInt8> qh;
    for (int64_t b = b0; b < b1; ++b) {
      if (b + 1 < b1)  // the next row's first K block (first blocks: see prefetch_next)
        prefetch_bytes(kbase + tp[(b + 1) * maxb] * blk_stride, std::min(bs, lp[b + 1]) * tok_stride);
      s.resize(H * lp[b] + 16);
      const float* q = qp + b * width;
      float* o = op + b * H * 64;
      with_count<8>(G, [&](auto g) {
        decode_row_int8_64<g>(q, kbase, vbase, tp + b * maxb, lp[b], bs, KVH, tok_stride, blk_stride, scale, o,
                              s.data(), qh, state);
      });
    }
  });
}

// Prefill chunks of an int8 pool (VNNI, head_dim 64, G <= 8) as groups of kPrefillGroup
// consecutive tokens x kv heads (prefill_group_int8_64), groups dealt in zigzag order as tokens
// are in `attend`.
void prefill_groups_int8(const float* qp, float* op, const int8_t* kbase, const int8_t* vbase, int64_t bs,
                         const int64_t* mp, int64_t NC, const int64_t* ctp, int64_t cmaxb, int64_t H, int64_t KVH,
                         int64_t tok_stride, int64_t blk_stride, float scale, int64_t max_len) {
  constexpr int64_t D = 64, W = row_width<int8_t>(D);
  const int64_t G = H / KVH, width = (H + 2 * KVH) * D;
  struct Group {
    int64_t row, L0, chunk;
    int nq;
  };
  std::vector<Group> groups;
  for (int64_t c = 0; c < NC; ++c) {
    const int64_t start = mp[c * 3], n = mp[c * 3 + 1], L = mp[c * 3 + 2];
    for (int64_t t = 0; t < n; t += kPrefillGroup)
      groups.push_back({start + t, L - n + t + 1, c, static_cast<int>(std::min<int64_t>(kPrefillGroup, n - t))});
  }
  const int64_t NG = static_cast<int64_t>(groups.size());
  const int64_t grain = std::max<int64_t>(1, (1 << 17) / (max_len * D * G * kPrefillGroup));
  zigzag_items(NG, KVH, grain, [&](int64_t x, int64_t kvh, std::vector<float>& s) {
    const Group& gr = groups[x];
    s.resize(gr.nq * G * (gr.L0 + gr.nq - 1) + 16);
    const float* q = qp + gr.row * width + kvh * G * D;
    float* o = op + gr.row * H * D + kvh * G * D;
    const int64_t* table = ctp + gr.chunk * cmaxb;
    with_count<8>(G, [&](auto g) {
      prefill_group_int8_64<g>(q, width, gr.nq, kbase + kvh * W, vbase + kvh * W, table, gr.L0, bs, tok_stride,
                               blk_stride, scale, o, H * D, s.data());
    });
  });
}

}  // namespace cbserve
