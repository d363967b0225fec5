// The recurrent mixers' sequence ops over a step's state slots (models/recurrent.py holds the
// pure-torch references they must match):
//
// causal_conv1d: depthwise causal convolution over time, each sequence continuing the K - 1
//   inputs kept in its slot of the conv pool (LFM2's short conv, Gated DeltaNet's and Mamba2's
//   conv over q/k/v or xBC), optional bias and SiLU.
// gated_delta_rule: Gated DeltaNet's recurrence (Qwen3.5, Qwen3-Next), token by token per value
//   head over the (dk, dv) state in the sequence's slot, q/k L2-normalised here.
// mamba2_scan: Mamba2's selective scan (Granite 4.0-H), token by token per head over the
//   (head_dim, d_state) state.
//
// Every op takes the step's sequences as `seqs` (S, 3) int64 rows [first token, tokens, slot]
// (decode rows are sequences of one token) and `snapshots` (P, 3) int64 rows [sequence, tokens
// after which, slot] sorted by sequence then tokens: the state after that many of the
// sequence's tokens is copied into that slot on the way (the prefix cache's snapshots). Work is
// split over (sequence, head) or (sequence, channel block), so one call updates every running
// request's state, each task touching its own slice of its own slot. Plain loops over
// contiguous float32 whose inner loop is element-wise, which -O3 vectorises for AVX2 (and for
// AVX-512 where built for it).
#include <cmath>

#include "common.h"
#include "ops.h"

namespace cbserve {
namespace {

struct Seq {
  int64_t start, n, slot;
  int64_t snap_begin, snap_end;  // its rows of `snapshots`
};

// The step's sequences with their snapshot ranges, checked against the batch and the pool.
std::vector<Seq> read_seqs(const at::Tensor& seqs, const at::Tensor& snapshots, int64_t T, int64_t slots) {
  TORCH_CHECK(seqs.dim() == 2 && seqs.size(1) == 3 && seqs.scalar_type() == at::kLong, "seqs must be (S, 3) int64");
  TORCH_CHECK(snapshots.dim() == 2 && snapshots.size(1) == 3 && snapshots.scalar_type() == at::kLong,
              "snapshots must be (P, 3) int64");
  const auto s = seqs.contiguous();
  const auto p = snapshots.contiguous();
  const int64_t* sd = s.data_ptr<int64_t>();
  const int64_t* pd = p.data_ptr<int64_t>();
  const int64_t S = s.size(0), P = p.size(0);
  std::vector<Seq> out(S);
  int64_t j = 0;
  for (int64_t i = 0; i < S; ++i) {
    const int64_t start = sd[3 * i], n = sd[3 * i + 1], slot = sd[3 * i + 2];
    TORCH_CHECK(start >= 0 && n >= 1 && start + n <= T, "sequence ", i, " lies outside the batch");
    TORCH_CHECK(slot >= 0 && slot < slots, "sequence ", i, "'s state slot ", slot, " is outside the pool");
    out[i] = {start, n, slot, j, j};
    int64_t last = 0;
    while (j < P && pd[3 * j] == i) {
      const int64_t after = pd[3 * j + 1], dst = pd[3 * j + 2];
      TORCH_CHECK(after >= 1 && after <= n && after >= last, "snapshot ", j, " is not within its sequence, in order");
      TORCH_CHECK(dst >= 0 && dst < slots && dst != slot, "snapshot ", j, "'s slot is outside the pool or its own");
      last = after;
      ++j;
    }
    out[i].snap_end = j;
  }
  TORCH_CHECK(j == P, "snapshots must be sorted by sequence, each of a sequence of the step");
  return out;
}

inline float silu(float y) { return y / (1.0f + std::exp(-y)); }

constexpr int64_t CONV_BLOCK = 256;  // channels a task: its inputs stay in L1 across the taps

}  // namespace

at::Tensor causal_conv1d(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                         const at::Tensor& conv_pool, const at::Tensor& seqs, const at::Tensor& snapshots,
                         bool silu_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be (T, C) float32 rows");
  const int64_t T = x.size(0), C = x.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == C && weight.scalar_type() == at::kFloat, "weight must be (C, K)");
  const int64_t K = weight.size(1);
  TORCH_CHECK(K >= 2, "a causal convolution needs K >= 2");
  TORCH_CHECK(conv_pool.dim() == 3 && conv_pool.size(1) == K - 1 && conv_pool.size(2) == C &&
                  conv_pool.scalar_type() == at::kFloat && conv_pool.is_contiguous(),
              "conv_pool must be a contiguous (slots, K - 1, C) float32 pool");
  if (bias.has_value())
    TORCH_CHECK(bias->numel() == C && bias->scalar_type() == at::kFloat, "bias must be (C,) float32");
  const auto list = read_seqs(seqs, snapshots, T, conv_pool.size(0));
  const auto wt = weight.t().contiguous();  // (K, C): one tap's weights across channels
  const auto b = bias.has_value() ? bias->contiguous() : at::Tensor();
  auto out = at::empty({T, C}, x.options());
  const float* xd = x.data_ptr<float>();
  const int64_t xs = x.stride(0);
  const float* wd = wt.data_ptr<float>();
  const float* bd = b.defined() ? b.data_ptr<float>() : nullptr;
  float* pool = conv_pool.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const auto snaps_c = snapshots.contiguous();
  const int64_t* snaps = snaps_c.data_ptr<int64_t>();
  const int64_t H = K - 1, nblocks = (C + CONV_BLOCK - 1) / CONV_BLOCK;
  at::parallel_for(0, static_cast<int64_t>(list.size()) * nblocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> hist(H * CONV_BLOCK);
    for (int64_t task = begin; task < end; ++task) {
      const Seq& s = list[task / nblocks];
      const int64_t c0 = (task % nblocks) * CONV_BLOCK, w = std::min(CONV_BLOCK, C - c0);
      float* slot = pool + s.slot * H * C;
      for (int64_t i = 0; i < H; ++i) std::memcpy(&hist[i * CONV_BLOCK], slot + i * C + c0, w * sizeof(float));
      // input p of the sequence (p < 0: the kept history), channels c0 .. c0 + w
      auto src = [&](int64_t p) -> const float* {
        return p < 0 ? &hist[(H + p) * CONV_BLOCK] : xd + (s.start + p) * xs + c0;
      };
      for (int64_t t = 0; t < s.n; ++t) {
        float* o = od + (s.start + t) * C + c0;
        if (bd)
          for (int64_t c = 0; c < w; ++c) o[c] = bd[c0 + c];
        else
          for (int64_t c = 0; c < w; ++c) o[c] = 0.0f;
        for (int64_t j = 0; j < K; ++j) {
          const float* in = src(t + j - H);
          const float* wj = wd + j * C + c0;
          for (int64_t c = 0; c < w; ++c) o[c] += wj[c] * in[c];
        }
        if (silu_out)
          for (int64_t c = 0; c < w; ++c) o[c] = silu(o[c]);
      }
      for (int64_t q = s.snap_begin; q < s.snap_end; ++q) {
        const int64_t after = snaps[3 * q + 1];
        float* dst = pool + snaps[3 * q + 2] * H * C;
        for (int64_t i = 0; i < H; ++i) std::memcpy(dst + i * C + c0, src(after - H + i), w * sizeof(float));
      }
      // the last K - 1 inputs (read from `hist` and x, never from the slot being written)
      for (int64_t i = 0; i < H; ++i) std::memcpy(slot + i * C + c0, src(s.n - H + i), w * sizeof(float));
    }
  });
  return out;
}

at::Tensor gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, const at::Tensor& ssm_pool, const at::Tensor& seqs,
                            const at::Tensor& snapshots, bool tiled) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0),
              "q, k must be (T, Hk, dk) and v (T, Hv, dv)");
  for (const auto* t : {&q, &k, &v, &g, &beta})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "q, k, v, g and beta must be float32");
  const int64_t T = q.size(0), Hk = q.size(1), dk = q.size(2), Hv = v.size(1), dv = v.size(2);
  TORCH_CHECK(Hv % Hk == 0, "value heads must be a multiple of q/k heads");
  TORCH_CHECK(g.sizes() == at::IntArrayRef({T, Hv}) && beta.sizes() == g.sizes(), "g and beta must be (T, Hv)");
  TORCH_CHECK(ssm_pool.dim() == 4 && ssm_pool.size(1) == Hv && ssm_pool.size(2) == dk && ssm_pool.size(3) == dv &&
                  ssm_pool.scalar_type() == at::kFloat && ssm_pool.is_contiguous(),
              "ssm_pool must be a contiguous (slots, Hv, dk, dv) float32 pool");
  // rows may be strided (views of a projection's output); within a row, heads back to back
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "q, k, v: heads must be contiguous within a row");
  const auto gc = g.contiguous(), bc = beta.contiguous();
  const auto list = read_seqs(seqs, snapshots, T, ssm_pool.size(0));
  auto out = at::empty({T, Hv, dv}, v.options());
  const float *qd = q.data_ptr<float>(), *kd = k.data_ptr<float>(), *vd = v.data_ptr<float>();
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0);
  const float *gd = gc.data_ptr<float>(), *bd = bc.data_ptr<float>();
  float* pool = ssm_pool.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const auto snaps_c = snapshots.contiguous();
  const int64_t* snaps = snaps_c.data_ptr<int64_t>();
  const int64_t r = Hv / Hk, state = dk * dv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dk));
  at::parallel_for(0, static_cast<int64_t>(list.size()) * Hv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qn(dk), kn(dk), kv(dv), delta(dv);
    for (int64_t task = begin; task < end; ++task) {
      const Seq& s = list[task / Hv];
      const int64_t h = task % Hv, hk = tiled ? h % Hk : h / r;
      float* S = pool + (s.slot * Hv + h) * state;  // (dk, dv), updated in place
      int64_t snap = s.snap_begin;
      for (int64_t i = 0; i < s.n; ++i) {
        const int64_t t = s.start + i;
        const float* qt = qd + t * qs + hk * dk;
        const float* kt = kd + t * ks + hk * dk;
        const float* vt = vd + t * vs + h * dv;
        float qq = 0.0f, kk = 0.0f;
        for (int64_t a = 0; a < dk; ++a) {
          qq += qt[a] * qt[a];
          kk += kt[a] * kt[a];
        }
        const float qf = scale / std::sqrt(qq + 1e-6f), kf = 1.0f / std::sqrt(kk + 1e-6f);
        for (int64_t a = 0; a < dk; ++a) {
          qn[a] = qt[a] * qf;
          kn[a] = kt[a] * kf;
        }
        const float decay = std::exp(gd[t * Hv + h]), b = bd[t * Hv + h];
        // S <- decay S, kv = S^T k (after the decay)
        std::fill(kv.begin(), kv.end(), 0.0f);
        for (int64_t a = 0; a < dk; ++a) {
          float* row = S + a * dv;
          const float ka = kn[a];
          for (int64_t c = 0; c < dv; ++c) {
            row[c] *= decay;
            kv[c] += row[c] * ka;
          }
        }
        for (int64_t c = 0; c < dv; ++c) delta[c] = b * (vt[c] - kv[c]);
        // S <- S + k delta^T, o = S^T q
        float* o = od + (t * Hv + h) * dv;
        std::fill(o, o + dv, 0.0f);
        for (int64_t a = 0; a < dk; ++a) {
          float* row = S + a * dv;
          const float ka = kn[a], qa = qn[a];
          for (int64_t c = 0; c < dv; ++c) {
            row[c] += ka * delta[c];
            o[c] += row[c] * qa;
          }
        }
        while (snap < s.snap_end && snaps[3 * snap + 1] == i + 1) {
          std::memcpy(pool + (snaps[3 * snap + 2] * Hv + h) * state, S, state * sizeof(float));
          ++snap;
        }
      }
    }
  });
  return out;
}


// Mamba2's selective scan: per (sequence, head) task, the head's (head_dim, N) state in the
// sequence's slot, updated in place token by token. Row p of the state meets the token's B and C
// (N values each) with one decay and one dt x_p: its inner loops run over N, contiguous.
at::Tensor mamba2_scan(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                       const at::Tensor& C, const at::Tensor& D, const at::Tensor& dt_bias, const at::Tensor& ssm_pool,
                       const at::Tensor& seqs, const at::Tensor& snapshots) {
  for (const auto* t : {&x, &dt, &A, &B, &C, &D, &dt_bias})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "x, dt, A, B, C, D and dt_bias must be float32");
  TORCH_CHECK(x.dim() == 3, "x must be (T, H, head_dim)");
  const int64_t T = x.size(0), H = x.size(1), P = x.size(2);
  TORCH_CHECK(B.dim() == 3 && B.size(0) == T && C.sizes() == B.sizes(), "B and C must be (T, G, N)");
  const int64_t G = B.size(1), N = B.size(2);
  TORCH_CHECK(G >= 1 && H % G == 0, "heads must be a multiple of groups");
  TORCH_CHECK(dt.sizes() == at::IntArrayRef({T, H}), "dt must be (T, H)");
  TORCH_CHECK(A.numel() == H && D.numel() == H && dt_bias.numel() == H, "A, D and dt_bias must be (H,)");
  TORCH_CHECK(ssm_pool.dim() == 4 && ssm_pool.size(1) == H && ssm_pool.size(2) == P && ssm_pool.size(3) == N &&
                  ssm_pool.scalar_type() == at::kFloat && ssm_pool.is_contiguous(),
              "ssm_pool must be a contiguous (slots, H, head_dim, N) float32 pool");
  // rows may be strided (views of the conv's output); within a row, heads (groups) back to back
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == P, "x: heads must be contiguous within a row");
  for (const auto* t : {&B, &C})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == N, "B, C: groups must be contiguous within a row");
  const auto dtc = dt.contiguous(), ac = A.contiguous(), dc = D.contiguous(), bc = dt_bias.contiguous();
  const auto list = read_seqs(seqs, snapshots, T, ssm_pool.size(0));
  auto out = at::empty({T, H, P}, x.options());
  const float *xd = x.data_ptr<float>(), *Bd = B.data_ptr<float>(), *Cd = C.data_ptr<float>();
  const int64_t xs = x.stride(0), Bs = B.stride(0), Cs = C.stride(0);
  const float *dtd = dtc.data_ptr<float>(), *Ad = ac.data_ptr<float>(), *Dd = dc.data_ptr<float>();
  const float* biasd = bc.data_ptr<float>();
  float* pool = ssm_pool.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const auto snaps_c = snapshots.contiguous();
  const int64_t* snaps = snaps_c.data_ptr<int64_t>();
  const int64_t per_group = H / G, state = P * N;
  at::parallel_for(0, static_cast<int64_t>(list.size()) * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const Seq& s = list[task / H];
      const int64_t h = task % H, g = h / per_group;
      float* S = pool + (s.slot * H + h) * state;  // (head_dim, N), updated in place
      int64_t snap = s.snap_begin;
      for (int64_t i = 0; i < s.n; ++i) {
        const int64_t t = s.start + i;
        // softplus as torch computes it (threshold 20: the input itself above)
        const float raw = dtd[t * H + h] + biasd[h];
        const float dtv = raw > 20.0f ? raw : std::log1p(std::exp(raw));
        const float decay = std::exp(dtv * Ad[h]), dh = Dd[h];
        const float* xt = xd + t * xs + h * P;
        const float* bt = Bd + t * Bs + g * N;
        const float* ct = Cd + t * Cs + g * N;
        float* o = od + (t * H + h) * P;
        for (int64_t p = 0; p < P; ++p) {
          float* row = S + p * N;
          const float xp = dtv * xt[p];
          float acc = 0.0f;
          for (int64_t n = 0; n < N; ++n) {
            row[n] = row[n] * decay + xp * bt[n];
            acc += row[n] * ct[n];
          }
          o[p] = acc + dh * xt[p];
        }
        while (snap < s.snap_end && snaps[3 * snap + 1] == i + 1) {
          std::memcpy(pool + (snaps[3 * snap + 2] * H + h) * state, S, state * sizeof(float));
          ++snap;
        }
      }
    }
  });
  return out;
}

}  // namespace cbserve
