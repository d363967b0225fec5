// attention: RoPE on q and k, K/V written into the paged pool, then causal attention of every
// token over its sequence's pool blocks, read in place by one paged kernel for decode rows and
// prefill chunks alike. The pool holds float32, float16 or int8 rows (int8: per 32 values one
// float32 scale after the row's values, as llama.cpp's q8_0); attention computes in float32
// (int8 pools with AVX512-VNNI: q.k as integer dot products, the query rounded as the keys).
#include "kv_pool.h"
#include "ops.h"

namespace cbserve {
namespace {

// The keys a query attends to: [first_key(L, window), L) for a query at position L - 1 (a sliding
// window of `window` keys ending at the query's own, as Gemma's local layers; 0: all of them).
inline int64_t first_key(int64_t L, int64_t window) { return window > 0 ? std::max<int64_t>(0, L - window) : 0; }

// A scaled score, soft-capped to (-softcap, softcap) as Gemma 2 does (softcap * tanh(v / softcap))
// before the softmax; softcap <= 0: as it is.
inline float capped(float v, float softcap) { return softcap > 0 ? softcap * std::tanh(v / softcap) : v; }

// The AVX-512 head_dim-64 kernels (decode_group_avx512, and over int8 pools with VNNI the whole
// rows and prefill groups) take this attention: they have no soft cap and no sinks.
inline bool avx512_head64(int64_t D, float softcap, const float* sinks) {
  return D == 64 && softcap <= 0 && !sinks && cpu_has_avx512();
}

// A query head's softmax over its scores s[0, n) (max mx) and, where the head has one, its
// attention sink (gpt-oss): a learned logit that joins the denominator and has no value, so the
// head may attend to nothing. The scores' exps in place, relative to max(mx, sink); returns
// 1 / (their sum + exp(sink - that max)). No sink (nullptr): softmax_exp as it is.
inline float softmax_inv(float* s, int64_t n, float mx, const float* sink) {
  if (!sink) return softmax_exp(s, n, mx);
  const float m = std::max(mx, *sink);
  return softmax_exp(s, n, m, std::exp(*sink - m));
}

// G query heads of one kv head (q: G * D floats, roped; out likewise) over keys [j0, L): scores,
// softmax, weighted sum of values. The generic path: any head_dim (a multiple of 8), AVX2. Each K
// and V row is loaded and widened once for all G heads; a key's score is one dot product summed
// in one order, and the values accumulate key by key in order, so a query's result depends only
// on its own keys (the same in a prefill chunk as a decode row, whatever the batch). s: G * (L -
// j0) floats of scratch. Blocks are prefetched one ahead as the AVX-512 kernels do (prefetch_next).
template <typename C, int G>
void decode_group(const float* q, const C* kc, const C* vc, const int64_t* table, int64_t j0, int64_t L, int64_t bs,
                  int64_t tok_stride, int64_t blk_stride, int64_t D, float scale, float softcap, const float* sinks,
                  float* out, float* s, bool streamed) {
  const int64_t n = L - j0, nb = (L + bs - 1) / bs;
  const int64_t b0 = j0 / bs;
  prefetch_rows(vc + table[b0] * blk_stride, std::min(bs, L - b0 * bs), tok_stride, D);  // V's first block
  float mx[G];
  for (int g = 0; g < G; ++g) mx[g] = -INFINITY;
  // scores: one pass over the K rows, G accumulators
  for (int64_t bi = b0, j = j0; bi < nb; ++bi) {
    const C* kb = kc + table[bi] * blk_stride;
    if (prefetch_next(table, bi, nb, streamed))
      prefetch_rows(kc + table[bi + 1] * blk_stride, std::min(bs, L - (bi + 1) * bs), tok_stride, D);
    for (int64_t t = j - bi * bs, e = std::min(bs, L - bi * bs); t < e; ++t, ++j) {
      const C* kr = kb + t * tok_stride;
      // NA accumulators a head (two for small groups, so a key's FMAs are not one chain)
      constexpr int NA = G <= 2 ? 2 : 1;
      __m256 a[G][NA];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < NA; ++c) a[g][c] = _mm256_setzero_ps();
      for (int64_t i = 0; i < D; i += 8 * NA) {
        for (int c = 0; c < NA; ++c) {
          if (i + 8 * c < D) {
            const __m256 k = row8(kr, i + 8 * c, D);
            for (int g = 0; g < G; ++g)
              a[g][c] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + i + 8 * c), k, a[g][c]);
          }
        }
      }
      for (int g = 0; g < G; ++g) {
        for (int c = 1; c < NA; ++c) a[g][0] = _mm256_add_ps(a[g][0], a[g][c]);
        const float v = capped(hsum(a[g][0]) * scale, softcap);
        s[g * n + (j - j0)] = v;
        mx[g] = std::max(mx[g], v);
      }
    }
  }
  float inv[G];
  for (int g = 0; g < G; ++g) inv[g] = softmax_inv(s + g * n, n, mx[g], sinks ? sinks + g : nullptr);
  // values: TV vectors of 8 values a head a pass, so the G x TV accumulators stay in registers;
  // each block's rows take every pass while they are in L1, the running sums kept in `out`
  constexpr int TV = G == 1 ? 8 : G == 2 ? 4 : G <= 4 ? 2 : 1;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < D; i += 8) _mm256_storeu_ps(out + g * D + i, _mm256_setzero_ps());
  for (int64_t bi = b0, j = j0; bi < nb; ++bi) {
    const C* vb = vc + table[bi] * blk_stride;
    if (prefetch_next(table, bi, nb, streamed))
      prefetch_rows(vc + table[bi + 1] * blk_stride, std::min(bs, L - (bi + 1) * bs), tok_stride, D);
    const int64_t t0 = j - bi * bs, e = std::min(bs, L - bi * bs);
    for (int64_t d0 = 0; d0 < D; d0 += 8 * TV) {
      const int nv = static_cast<int>(std::min<int64_t>(TV, (D - d0) / 8));
      __m256 acc[G][TV];
      for (int g = 0; g < G; ++g)
        for (int v = 0; v < TV; ++v)
          if (v < nv) acc[g][v] = _mm256_loadu_ps(out + g * D + d0 + 8 * v);
      for (int64_t t = t0; t < e; ++t) {
        const C* vr = vb + t * tok_stride;
        const float* st = s + (bi * bs + t - j0);
        for (int v = 0; v < TV; ++v) {
          if (v < nv) {
            const __m256 x = row8(vr, d0 + 8 * v, D);
            for (int g = 0; g < G; ++g) acc[g][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(st + g * n), x, acc[g][v]);
          }
        }
      }
      for (int g = 0; g < G; ++g)
        for (int v = 0; v < TV; ++v)
          if (v < nv) _mm256_storeu_ps(out + g * D + d0 + 8 * v, acc[g][v]);
    }
    j = bi * bs + e;
  }
  for (int g = 0; g < G; ++g) {
    const __m256 vinv = _mm256_set1_ps(inv[g]);
    for (int64_t i = 0; i < D; i += 8)
      _mm256_storeu_ps(out + g * D + i, _mm256_mul_ps(_mm256_loadu_ps(out + g * D + i), vinv));
  }
}

// One sequence's G query heads of one kv head (adjacent in q and out) over keys [first_key(L,
// window), L): the AVX-512 group kernel for head_dim 64, groups of up to 8 and every key, else
// the generic one, up to 8 heads at a time. sinks: the G heads' sink logits, or nullptr.
template <typename C>
void decode_heads(const float* q, int64_t G, const C* kc, const C* vc, const int64_t* table, int64_t L,
                  int64_t window, int64_t bs, int64_t tok_stride, int64_t blk_stride, int64_t D, float scale,
                  float softcap, const float* sinks, float* out, float* s, bool streamed) {
  const int64_t j0 = first_key(L, window);
  if (j0 == 0 && G <= 8 && avx512_head64(D, softcap, sinks))
    return decode_group_avx512<C>(G, q, kc, vc, table, L, bs, tok_stride, blk_stride, scale, out, s, streamed);
  for (int64_t g0 = 0; g0 < G; g0 += 8) {
    with_count<8>(G - g0, [&](auto g) {
      decode_group<C, g>(q + g0 * D, kc, vc, table, j0, L, bs, tok_stride, blk_stride, D, scale, softcap,
                         sinks ? sinks + g0 : nullptr, out + g0 * D, s, streamed);
    });
  }
}

// GGML's "normal" RoPE: pair i is (x[2i], x[2i + 1]), rotated by angle i. A llama-architecture
// GGUF stores each q/k head's rows in this order (its converter interleaved the halves that
// Hugging Face's rotate_half pairs), so taking the file's rows as they are needs this rotation; q.k
// is the same as with the halves, the pool just holds each k head's values in the file's order.
inline void rope_pairs(float* x, const float* c, const float* s, int64_t half) {
  int64_t i = 0;
  for (; i + 4 <= half; i += 4) {
    // (a0 b0 a1 b1 ..) * (c0 c0 c1 c1 ..) -/+ (b0 a0 b1 a1 ..) * (s0 s0 s1 s1 ..): addsub
    // subtracts in the even lanes and adds in the odd ones.
    const __m128 c4 = _mm_loadu_ps(c + i), s4 = _mm_loadu_ps(s + i);
    const __m256 vc = _mm256_set_m128(_mm_unpackhi_ps(c4, c4), _mm_unpacklo_ps(c4, c4));
    const __m256 vs = _mm256_set_m128(_mm_unpackhi_ps(s4, s4), _mm_unpacklo_ps(s4, s4));
    const __m256 v = _mm256_loadu_ps(x + 2 * i);
    const __m256 swapped = _mm256_permute_ps(v, 0xB1);
    _mm256_storeu_ps(x + 2 * i, _mm256_addsub_ps(_mm256_mul_ps(v, vc), _mm256_mul_ps(swapped, vs)));
  }
  for (; i < half; ++i) {
    const float a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = a * c[i] - b * s[i];
    x[2 * i + 1] = b * c[i] + a * s[i];
  }
}

// `half` pairs a head are rotated: D / 2, or fewer for a partial rotary embedding (Phi-4-mini's
// first 96 of 128 values), whose remaining values pass through unrotated.
// `write` false: qkv holds the queries only (a layer reading K/V another layer wrote), which are
// roped; nothing is written.
template <typename C>
void rope_and_write(float* qkv, int64_t T, int64_t H, int64_t KVH, int64_t D, int64_t half, const float* cos,
                    const float* sin, bool interleaved, const int64_t* slots, C* kcache, C* vcache, bool write) {
  const int64_t width = (write ? H + 2 * KVH : H) * D, roped = write ? H + KVH : H;
  at::parallel_for(0, T, std::max<int64_t>(1, (1 << 15) / width), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* row = qkv + t * width;
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      for (int64_t h = 0; h < roped; ++h) {  // q heads then k heads
        float* x = row + h * D;
        if (interleaved) {
          rope_pairs(x, c, s, half);
          continue;
        }
        int64_t i = 0;
        for (; i + 8 <= half; i += 8) {
          __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
          __m256 vc = _mm256_loadu_ps(c + i), vs = _mm256_loadu_ps(s + i);
          _mm256_storeu_ps(x + i, _mm256_fmsub_ps(x1, vc, _mm256_mul_ps(x2, vs)));
          _mm256_storeu_ps(x + half + i, _mm256_fmadd_ps(x2, vc, _mm256_mul_ps(x1, vs)));
        }
        for (; i < half; ++i) {
          const float x1 = x[i], x2 = x[half + i];
          x[i] = x1 * c[i] - x2 * s[i];
          x[half + i] = x2 * c[i] + x1 * s[i];
        }
      }
      if (!write) continue;
      const int64_t W = row_width<C>(D);
      const float* k = row + H * D;
      const float* v = row + (H + KVH) * D;
      C* kd = kcache + slots[t] * KVH * W;
      C* vd = vcache + slots[t] * KVH * W;
      for (int64_t h = 0; h < KVH; ++h) {
        store_row<C>(kd + h * W, k + h * D, D);
        store_row<C>(vd + h * W, v + h * D, D);
      }
    }
  });
}

// One key's scores for a prefill tile's tokens rlo .. rhi x G heads (prefill_tile): decode_group's
// arithmetic per (token, head) up to the soft cap, into srow[r * G + g][j - first[r]] (j the key's
// index), and their running maxima; the tokens outside [rlo, rhi] do not see the key. DC: head_dim when a compile-time constant (64, 128,
// 256: the loops unroll and the accumulators stay in registers), else 0 and D at run time.
template <typename C, int G, int R, int DC, bool Masked>
inline void tile_scores(const float* q, int64_t q_stride, const C* kr, int64_t D_, float scale, int rlo, int rhi, int64_t j, const int64_t* first, float* const* srow, float (&mx)[R][G]) {
  constexpr int NA = G <= 2 ? 2 : 1;  // as decode_group
  const int64_t D = DC ? DC : D_;
  __m256 a[R][G][NA];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < NA; ++c) a[r][g][c] = _mm256_setzero_ps();
#pragma GCC unroll 32
  for (int64_t i = 0; i < D; i += 8 * NA) {
    for (int c = 0; c < NA; ++c) {
      if (i + 8 * c < D) {
        const __m256 k = row8(kr, i + 8 * c, D);
        for (int r = 0; r < R; ++r)
          if (!Masked || (r >= rlo && r <= rhi))
            for (int g = 0; g < G; ++g)
              a[r][g][c] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * q_stride + g * D + i + 8 * c), k, a[r][g][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    if (Masked && (r < rlo || r > rhi)) continue;
    for (int g = 0; g < G; ++g) {
      for (int c = 1; c < NA; ++c) a[r][g][0] = _mm256_add_ps(a[r][g][0], a[r][g][c]);
      const float v = hsum(a[r][g][0]) * scale;  // (soft-capped by prefill_tile once the row is whole)
      srow[r * G + g][j - first[r]] = v;
      mx[r][g] = std::max(mx[r][g], v);
    }
  }
}

// R consecutive tokens of one prefill chunk with one kv head's G query heads: token r (at position
// L0 - 1 + r) sees keys [first[r], L0 + r) (first[r] = first_key(L0 + r, window)). decode_group's
// arithmetic for every (token, head), step for step in the same order: its scores from its own
// first key (so its softmax sums the same 8-lane chunks), its values summed key by key in order;
// so each result is bit-identical to the token's own decode_group. But each K and V row is loaded
// and widened once for the R tokens instead of once each (the widening of int8 rows was ~45% of a
// long prompt's attention), and the value pass reads the tile's probabilities key-major (pt: one
// pointer, the R x G of a key adjacent) rather than from R x G score rows. q, out: token r's heads
// at + r * q_stride / out_stride. s: scratch of prefill_scratch(G, R, L0 + R) floats. sinks: the
// G heads' sink logits, or nullptr.
template <typename C, int G, int R, int DC>
void prefill_tile(const float* q, int64_t q_stride, const C* kc, const C* vc, const int64_t* table, int64_t L0,
                  int64_t window, int64_t bs, int64_t tok_stride, int64_t blk_stride, int64_t D_, float scale,
                  float softcap, const float* sinks, float* out, int64_t out_stride, float* s) {
  constexpr int RG = R * G;
  const int64_t D = DC ? DC : D_;
  int64_t first[R];
  for (int r = 0; r < R; ++r) first[r] = first_key(L0 + r, window);
  const int64_t j0 = first[0], end = L0 + R - 1, n = end - j0;  // the keys any token sees: [j0, end)
  // keys every token sees: [first[R - 1], L0) (the bulk, no tests in its loop)
  const int64_t all0 = first[R - 1], all1 = L0;
  float* srow[RG];
  for (int rg = 0; rg < RG; ++rg) srow[rg] = s + rg * n;
  float* pt = s + RG * n;  // pt[(j - j0) * RG + r * G + g]
  float mx[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) mx[r][g] = -INFINITY;
  for (int64_t bi = j0 / bs, j = j0; j < end; ++bi) {
    const C* kb = kc + table[bi] * blk_stride;
    for (int64_t t = j - bi * bs, e = std::min(bs, end - bi * bs); t < e; ++t, ++j) {
      const C* kr = kb + t * tok_stride;
      if (j >= all0 && j < all1) {
        tile_scores<C, G, R, DC, false>(q, q_stride, kr, D, scale, 0, R - 1, j, first, srow, mx);
      } else {
        // tokens r see key j from rlo on (causal) up to rhi (the window)
        int rlo = 0, rhi = R - 1;
        while (rlo < R && j >= L0 + rlo) ++rlo;
        while (rhi >= 0 && j < first[rhi]) --rhi;
        tile_scores<C, G, R, DC, true>(q, q_stride, kr, D, scale, rlo, rhi, j, first, srow, mx);
      }
    }
  }
  float inv[RG];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      const int64_t nr = L0 + r - first[r];
      float* row = srow[r * G + g];
      if (softcap > 0) {  // decode_group's capped scores, and their maximum
        mx[r][g] = -INFINITY;
        for (int64_t i = 0; i < nr; ++i) {
          row[i] = capped(row[i], softcap);
          mx[r][g] = std::max(mx[r][g], row[i]);
        }
      }
      inv[r * G + g] = softmax_inv(row, nr, mx[r][g], sinks ? sinks + g : nullptr);
      for (int64_t i = 0; i < nr; ++i) pt[(first[r] + i - j0) * RG + r * G + g] = row[i];
    }
  for (int r = 0; r < R; ++r)
    for (int64_t i = 0; i < G * D; i += 8) _mm256_storeu_ps(out + r * out_stride + i, _mm256_setzero_ps());
  // values: one 8-value slice of every (token, head) a pass over a block's rows (R * G
  // accumulators in registers); each output value still sums its keys in order
  for (int64_t bi = j0 / bs; bi * bs < end; ++bi) {
    const C* vb = vc + table[bi] * blk_stride;
    const int64_t t0 = std::max<int64_t>(0, j0 - bi * bs), e = std::min(bs, end - bi * bs);
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      __m256 acc[R][G];
      for (int r = 0; r < R; ++r)
        for (int g = 0; g < G; ++g) acc[r][g] = _mm256_loadu_ps(out + r * out_stride + g * D + d0);
      // the block's keys every token sees, [u0, u1), between the ones only some do
      const int64_t u0 = std::clamp(all0 - bi * bs, t0, e), u1 = std::clamp(all1 - bi * bs, u0, e);
      auto some = [&](int64_t t) {
        const int64_t j = bi * bs + t;
        const __m256 x = row8(vb + t * tok_stride, d0, D);
        const float* p = pt + (j - j0) * RG;
        for (int r = 0; r < R; ++r)
          if (j < L0 + r && j >= first[r])
            for (int g = 0; g < G; ++g) acc[r][g] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + r * G + g), x, acc[r][g]);
      };
      for (int64_t t = t0; t < u0; ++t) some(t);
      const C* vr = vb + u0 * tok_stride;
      const float* p = pt + (bi * bs + u0 - j0) * RG;
      for (int64_t t = u0; t < u1; ++t, vr += tok_stride, p += RG) {
        const __m256 x = row8(vr, d0, D);
        for (int r = 0; r < R; ++r)
          for (int g = 0; g < G; ++g) acc[r][g] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + r * G + g), x, acc[r][g]);
      }
      for (int64_t t = u1; t < e; ++t) some(t);
      for (int r = 0; r < R; ++r)
        for (int g = 0; g < G; ++g) _mm256_storeu_ps(out + r * out_stride + g * D + d0, acc[r][g]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      float* o = out + r * out_stride + g * D;
      const __m256 vinv = _mm256_set1_ps(inv[r * G + g]);
      for (int64_t i = 0; i < D; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), vinv));
    }
}

// prefill_tile's scratch for a tile ending at key `keys`: its score rows and the probabilities.
inline int64_t prefill_scratch(int64_t G, int64_t R, int64_t keys) { return 2 * G * R * keys + 16; }

// Tokens a prefill tile takes for a group of G query heads a kv head: as many as keep the
// score accumulators (R x G x NA) within 12 of the 16 vector registers; 1: no tiles.
constexpr int tile_tokens(int64_t G) { return G == 1 ? 6 : G == 2 ? 3 : G == 3 ? 4 : G == 4 ? 3 : G <= 6 ? 2 : 1; }

// Calls f(std::integral_constant<int, G>, std::integral_constant<int, R>) for a group size G
// that has tiles (tile_tokens(G) > 1); false if it has none.
template <typename F>
bool with_tile(int64_t G, F&& f) {
  switch (G) {
    case 1: f(std::integral_constant<int, 1>{}, std::integral_constant<int, tile_tokens(1)>{}); return true;
    case 2: f(std::integral_constant<int, 2>{}, std::integral_constant<int, tile_tokens(2)>{}); return true;
    case 3: f(std::integral_constant<int, 3>{}, std::integral_constant<int, tile_tokens(3)>{}); return true;
    case 4: f(std::integral_constant<int, 4>{}, std::integral_constant<int, tile_tokens(4)>{}); return true;
    case 5: f(std::integral_constant<int, 5>{}, std::integral_constant<int, tile_tokens(5)>{}); return true;
    case 6: f(std::integral_constant<int, 6>{}, std::integral_constant<int, tile_tokens(6)>{}); return true;
    default: return false;
  }
}

// Decode rows of an int8 pool go whole (every kv head in one pass, decode_row_int8_64) from this
// many on, when each thread has rows enough; fewer go as (row, kv head) items, spread finer.
// Float16 rows (128 bytes: whole cache lines, no line shared by two kv heads) gain nothing from
// whole-row items (0-10% slower from DRAM, Zen 4), so they keep the (row, kv head) items.
constexpr int64_t kRowsForWholeRowItems = 8;

// After the K/V are in the pool: decode rows, then prefill chunks, over pool rows of type C.
// `width`: floats from one token's queries to the next ((H + 2 KVH) D in a fused qkv, H D for
// queries alone); the AVX-512 int8 kernels take the fused qkv only.
template <typename C>
void attend(const float* qp, float* op, const C* kbase, const C* vbase, int64_t bs, int64_t num_decode,
            const at::Tensor& dec_tables_, const at::Tensor& dec_lens_, const at::Tensor& chunk_meta_,
            const at::Tensor& chunk_tables_, int64_t H, int64_t KVH, int64_t D, float scale, int64_t window,
            float softcap, const float* sinks, int64_t width) {
  const bool fused_qkv = width == (H + 2 * KVH) * D;
  const int64_t W = row_width<C>(D), tok_stride = KVH * W, blk_stride = bs * KVH * W;
  const int64_t G = H / KVH;
  if (num_decode > 0) {
    at::Tensor tables = dec_tables_.contiguous(), lens = dec_lens_.contiguous();
    const int64_t* tp = tables.data_ptr<int64_t>();
    const int64_t* lp = lens.data_ptr<int64_t>();
    const int64_t maxb = tables.size(1);
    int64_t max_len = 1;
    for (int64_t b = 0; b < num_decode; ++b) max_len = std::max(max_len, lp[b]);
    bool whole_rows = false;
    if constexpr (std::is_same_v<C, int8_t>) {
      // (every key of every row: the whole-row kernel has no window)
      whole_rows = fused_qkv && G <= 8 && H <= 64 && num_decode >= kRowsForWholeRowItems &&
                   avx512_head64(D, softcap, sinks) &&
                   cpu_has_vnni() && (window <= 0 || max_len <= window);
      if (whole_rows)
        decode_whole_rows_int8(qp, op, kbase, vbase, bs, num_decode, tp, lp, maxb, H, KVH, tok_stride, blk_stride,
                               scale);
    }
    if (!whole_rows) {
      const int64_t task_grain = std::max<int64_t>(1, (1 << 17) / (max_len * D * G));
      at::parallel_for(0, num_decode * KVH, task_grain, [&](int64_t i0, int64_t i1) {
        std::vector<float> s;
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t b = i / KVH, kvh = i % KVH, L = lp[b];
          s.resize(G * L + 16);
          // The group's G query heads are adjacent in q and in out (heads kvh*G .. kvh*G+G-1).
          const float* q = qp + b * width + kvh * G * D;
          float* o = op + b * H * D + kvh * G * D;
          decode_heads<C>(q, G, kbase + kvh * W, vbase + kvh * W, tp + b * maxb, L, window, bs, tok_stride,
                          blk_stride, D, scale, softcap, sinks ? sinks + kvh * G : nullptr, o, s.data(), true);
        }
      });
    }
  }
  // Prefill chunks: every token as a decode row over its own causal prefix, read from the pool
  // (this step's K/V were written above). The same kernel as decode, so a token's attention is
  // bit-identical whether it is computed in a prefill chunk of any size, as a decode step, or
  // recomputed after preemption; and no gather of the past. Tokens are dealt in zigzag order
  // (first, last, second, ...) so the threads' contiguous shares cost about the same. Int8 pools
  // with VNNI take a few consecutive tokens an item (prefill_groups_int8), with the same results.
  const int64_t NC = chunk_meta_.defined() ? chunk_meta_.size(0) : 0;
  if (NC > 0) {
    at::Tensor meta = chunk_meta_.contiguous(), ctables = chunk_tables_.contiguous();
    const int64_t* mp = meta.data_ptr<int64_t>();
    const int64_t* ctp = ctables.data_ptr<int64_t>();
    const int64_t cmaxb = ctables.size(1);
    int64_t max_len = 1;
    for (int64_t c = 0; c < NC; ++c) max_len = std::max(max_len, mp[c * 3 + 2]);
    if constexpr (std::is_same_v<C, int8_t>) {
      if (fused_qkv && G <= 8 && avx512_head64(D, softcap, sinks) && cpu_has_vnni() &&
          (window <= 0 || max_len <= window)) {
        prefill_groups_int8(qp, op, kbase, vbase, bs, mp, NC, ctp, cmaxb, H, KVH, tok_stride, blk_stride, scale,
                            max_len);
        return;
      }
    }
    // Tokens whose decode_heads is decode_group (not the AVX-512 head_dim-64 kernel) go R at a
    // time (prefill_tile, the same results); a chunk's last tokens short of a tile one at a time.
    // Items: (first row, count).
    const int R = avx512_head64(D, softcap, sinks) ? 1 : tile_tokens(G);
    std::vector<int64_t> row, len, chunk, count;
    for (int64_t c = 0; c < NC; ++c) {
      const int64_t start = mp[c * 3], n = mp[c * 3 + 1], L = mp[c * 3 + 2];
      for (int64_t t = 0; t < n;) {
        const int64_t k = n - t >= R ? R : 1;
        row.push_back(start + t);
        len.push_back(L - n + t + 1);
        chunk.push_back(c);
        count.push_back(k);
        t += k;
      }
    }
    const int64_t NT = static_cast<int64_t>(row.size());
    const int64_t task_grain = std::max<int64_t>(1, (1 << 17) / (max_len * D * G * R));
    zigzag_items(NT, KVH, task_grain, [&](int64_t x, int64_t kvh, std::vector<float>& s) {
      const int64_t r = row[x], L = len[x];
      s.resize(std::max(G * L, prefill_scratch(G, R, L + R)) + 16);
      const float* q = qp + r * width + kvh * G * D;
      float* o = op + r * H * D + kvh * G * D;
      const int64_t* table = ctp + chunk[x] * cmaxb;
      if (count[x] == 1)
        return decode_heads<C>(q, G, kbase + kvh * W, vbase + kvh * W, table, L, window, bs, tok_stride, blk_stride,
                               D, scale, softcap, sinks ? sinks + kvh * G : nullptr, o, s.data(), false);
      with_tile(G, [&](auto g, auto rr) {
        constexpr int GC = decltype(g)::value, RC = decltype(rr)::value;
        auto tile = [&](auto dc) {
          prefill_tile<C, GC, RC, decltype(dc)::value>(q, width, kbase + kvh * W, vbase + kvh * W, table, L, window,
                                                       bs, tok_stride, blk_stride, D, scale, softcap,
                                                       sinks ? sinks + kvh * G : nullptr, o, H * D,
                                                       s.data());
        };
        if (!with_value<64, 128, 256>(D, tile)) tile(std::integral_constant<int64_t, 0>{});
      });
    });
  }
}

template <typename C>
void rope_write_attend(float* qkv, float* out, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kcache,
                       const at::Tensor& vcache, const at::Tensor& slots, int64_t T, int64_t num_decode,
                       const at::Tensor& dec_tables, const at::Tensor& dec_lens, const at::Tensor& chunk_meta,
                       const at::Tensor& chunk_tables, int64_t H, int64_t KVH, int64_t D, float scale,
                       int64_t window, bool interleaved, float softcap, const float* sinks, bool write) {
  TORCH_CHECK(kcache.size(3) == row_width<C>(D) && vcache.sizes() == kcache.sizes(),
              "the KV pool's rows do not fit head_dim ", D);
  C* kc = kcache.data_ptr<C>();
  C* vc = vcache.data_ptr<C>();
  rope_and_write<C>(qkv, T, H, KVH, D, cos.size(1), cos.data_ptr<float>(), sin.data_ptr<float>(), interleaved,
                    slots.data_ptr<int64_t>(), kc, vc, write);
  attend<C>(qkv, out, kc, vc, kcache.size(1), num_decode, dec_tables, dec_lens, chunk_meta, chunk_tables, H, KVH, D,
            scale, window, softcap, sinks, (write ? H + 2 * KVH : H) * D);
}

// Every pool row the step writes or reads lies inside the pools: a bad slot or block id would
// write or read outside them (a few comparisons a sequence, against memory corruption).
void check_pool_indices(const at::Tensor& slots, int64_t T, int64_t num_decode, const at::Tensor& dec_tables_,
                        const at::Tensor& dec_lens_, const at::Tensor& chunk_meta_, const at::Tensor& chunk_tables_,
                        int64_t num_blocks, int64_t bs) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == T, "slots must be (T,) int64");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_blocks * bs, "slot ", sp[t], " lies outside the KV pool");
  auto check_table = [&](const int64_t* table, int64_t maxb, int64_t len) {
    TORCH_CHECK(len >= 0 && len <= maxb * bs, "a context of ", len, " tokens needs more than ", maxb, " blocks");
    for (int64_t j = 0; j < (len + bs - 1) / bs; ++j)
      TORCH_CHECK(table[j] >= 0 && table[j] < num_blocks, "block ", table[j], " lies outside the KV pool");
  };
  if (num_decode > 0) {
    TORCH_CHECK(num_decode <= T && dec_tables_.dim() == 2 && dec_tables_.size(0) >= num_decode &&
                    dec_lens_.numel() >= num_decode && dec_tables_.scalar_type() == at::kLong &&
                    dec_lens_.scalar_type() == at::kLong,
                "decode rows need (B, max_blocks) int64 tables and (B,) int64 lengths");
    at::Tensor tables = dec_tables_.contiguous(), lens = dec_lens_.contiguous();
    for (int64_t b = 0; b < num_decode; ++b)
      check_table(tables.data_ptr<int64_t>() + b * tables.size(1), tables.size(1), lens.data_ptr<int64_t>()[b]);
  }
  const int64_t NC = chunk_meta_.defined() ? chunk_meta_.size(0) : 0;
  if (NC > 0) {
    TORCH_CHECK(chunk_meta_.dim() == 2 && chunk_meta_.size(1) == 3 && chunk_tables_.dim() == 2 &&
                    chunk_tables_.size(0) >= NC && chunk_meta_.scalar_type() == at::kLong &&
                    chunk_tables_.scalar_type() == at::kLong,
                "chunks need (C, 3) int64 metadata and (C, max_blocks) int64 tables");
    at::Tensor meta = chunk_meta_.contiguous(), tables = chunk_tables_.contiguous();
    const int64_t* mp = meta.data_ptr<int64_t>();
    for (int64_t c = 0; c < NC; ++c) {
      TORCH_CHECK(mp[3 * c] >= 0 && mp[3 * c + 1] >= 0 && mp[3 * c] + mp[3 * c + 1] <= T &&
                      mp[3 * c + 1] <= mp[3 * c + 2],
                  "chunk ", c, "'s tokens lie outside the step");
      check_table(tables.data_ptr<int64_t>() + c * tables.size(1), tables.size(1), mp[3 * c + 2]);
    }
  }
}

}  // namespace

// chunk_meta: (C, 3) int64 rows [token_start, num_tokens, context_len]; chunk_tables (C, maxb).
// window > 0: a query at position p attends to keys at positions (p - window, p] only.
// interleaved: RoPE rotates adjacent pairs (GGML's order, `rope_pairs`), else the halves.
// softcap > 0: each scaled score becomes softcap * tanh(score / softcap) before the softmax.
// sinks: (H,) float32 logits, one per query head, each joining its head's softmax without a value.
// cos/sin: (T, R/2) for the first R <= D values of each q/k head (R < D: a partial rotary
// embedding; the pairs are then (i, i + R/2), or (2i, 2i + 1) interleaved).
// The pools: (num_blocks, block_size, KVH, row width) of float32, float16 or int8 (`row_width`).
// qkv of H * D columns (queries only): roped and attending over the pools, which are not written
// (a layer sharing an earlier layer's K/V reads that layer's pools).
at::Tensor attention(const at::Tensor& qkv, const at::Tensor& cos_, const at::Tensor& sin_,
                     const at::Tensor& kcache, const at::Tensor& vcache, const at::Tensor& slots_,
                     int64_t num_decode, const at::Tensor& dec_tables, const at::Tensor& dec_lens,
                     const at::Tensor& chunk_meta, const at::Tensor& chunk_tables, int64_t H,
                     int64_t KVH, int64_t D, double scale_, int64_t window, bool interleaved, double softcap,
                     const c10::optional<at::Tensor>& sinks_) {
  // qkv is roped in place (the schema declares it written): the caller's own buffer, so it must be
  // one block of memory rather than a view the op would have to copy.
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.dim() == 2 && qkv.is_contiguous(),
              "qkv must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(D % 8 == 0 && D <= 512, "head_dim must be a multiple of 8, at most 512");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no sliding window)");
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: scores not capped)");
  // H * D columns: the queries alone, attending over K/V another layer wrote (a shared-KV layer)
  const bool write = qkv.size(1) == (H + 2 * KVH) * D;
  TORCH_CHECK(write || qkv.size(1) == H * D, "qkv must have (H + 2 KVH) * D columns (or H * D: queries only)");
  TORCH_CHECK(kcache.is_contiguous() && vcache.is_contiguous(), "the KV pools must be contiguous");
  TORCH_CHECK(kcache.dim() == 4 && kcache.scalar_type() == vcache.scalar_type(),
              "the KV pools must be 4-D, of one dtype");
  at::Tensor cos = cos_.contiguous(), sin = sin_.contiguous(), slots = slots_.contiguous();
  const int64_t T = qkv.size(0);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.dim() == 2 && cos.size(0) >= T && cos.size(1) >= 1 &&
                  2 * cos.size(1) <= D && sin.sizes() == cos.sizes() && sin.scalar_type() == at::kFloat,
              "cos and sin must be (T, R/2) float32, R <= D the rotated values of a head");
  check_pool_indices(slots, T, num_decode, dec_tables, dec_lens, chunk_meta, chunk_tables, kcache.size(0),
                     kcache.size(1));
  at::Tensor sinks;
  if (sinks_.has_value() && sinks_->defined()) {
    sinks = sinks_->contiguous();
    TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.dim() == 1 && sinks.size(0) == H,
                "sinks must be (H,) float32: one logit per query head");
  }
  const float* sp = sinks.defined() ? sinks.data_ptr<float>() : nullptr;
  const float scale = static_cast<float>(scale_);
  at::Tensor out = at::empty({T, H * D}, qkv.options());
  float* qp = qkv.data_ptr<float>();
  float* op = out.data_ptr<float>();
  with_pool_type(kcache.scalar_type(), [&](auto c) {
    using C = decltype(c);
    if constexpr (std::is_same_v<C, int8_t>)
      TORCH_CHECK(D % 32 == 0, "an int8 KV pool needs head_dim to be a multiple of 32");
    rope_write_attend<C>(qp, op, cos, sin, kcache, vcache, slots, T, num_decode, dec_tables, dec_lens, chunk_meta,
                         chunk_tables, H, KVH, D, scale, window, interleaved, static_cast<float>(softcap), sp,
                         write);
  });
  return out;
}

}  // namespace cbserve
