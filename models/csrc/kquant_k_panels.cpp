// The K formats (Q2_K .. Q6_K) for many activation rows on AVX2 CPUs without VNNI: kquant_k_tile.h's
// panels at 256 bits (Vec256: 8 outputs a panel, two panels x 4 activation rows a micro-kernel,
// vpmaddubsw sums kept in int16 per sub-block, then vpmaddwd with the sub-scale). That is about one
// multiply per 32 products where the file-row kernel (kquant_k.cpp's dot_k) spends two, and no
// horizontal sums: a lane is an output.
#include "kquant_k_tile.h"

namespace cbserve_kquant {

TileFn panels_k_avx2(int64_t type) {
  TileFn f = nullptr;
  cbserve::with_value<Q2_K, Q3_K, Q4_K, Q5_K, Q6_K>(type, [&](auto t) {
    f = [](const Part& p, int64_t n0, int64_t n1, const Acts& a, int64_t M, float* y, int64_t ldy) {
      panels_k<Vec256, decltype(t)::value>(p, n0, n1, a, M, y, ldy, 0, 0, [](auto&&...) {});
    };
  });
  return f;
}

}  // namespace cbserve_kquant
