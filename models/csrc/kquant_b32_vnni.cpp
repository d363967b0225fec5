// The 32-value formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, IQ4_XS's sub-blocks) on AVX512-VNNI
// CPUs: kquant_b32_tile.h's panels at 512 bits for many activation rows (16 outputs a panel, 8
// activation rows a micro-kernel, vpdpbusd), and its one-row decode with each row's block integer
// by one 256-bit vpdpbusd: the unsigned values against the signed activations as they are (no
// vpmaddubsw / vpmaddwd pair), the Q5 formats' fifth bits by one masked add (instead of bits32's
// shuffle, compare and mask), signed values as w + 128 (w XOR 0x80) with 128 sum(x) taken from the
// eight sums, as the panels do (instead of a vpsignb per row, or two for Q8_0). About half the AVX2
// row's instructions a block, where one row's decode is bound by them rather than DRAM. Either
// way the block's integer is exact: the same numbers, the same floats as the AVX2 kernels.
#include "kquant_b32.h"

#define CB_TILE CB_VNNI
#include "kquant_b32_tile.h"

namespace cbserve_kquant {
namespace {

// row1's block integers with one vpdpbusd.
struct DotVnni {
  template <int T>
  CB_VNNI static __m256i prep(__m256i xv) { return xv; }
  template <int T>
  CB_VNNI static __m256i values(const uint8_t* w, int64_t j) {
    if constexpr (T == Q5_0 || T == Q5_1) {
      constexpr int64_t QH = T == Q5_0 ? 2 : 4;
      const uint8_t* blk = w + j * block_bytes(T);
      const __m256i nib = nibbles32(blk + QH + 4);
      const auto bits = static_cast<__mmask32>(static_cast<uint32_t>(cbserve::load_i32(blk + QH)));
      return _mm256_mask_add_epi8(nib, bits, nib, _mm256_set1_epi8(0x10));
    } else if constexpr (T == IQ4_NL || T == IQ4_XS) {  // looked up in the table + 128 (a constant)
      const uint8_t* q = T == IQ4_NL ? w + j * block_bytes(T) + 2 : w + j / 8 * block_bytes(T) + 8 + 16 * (j % 8);
      return _mm256_shuffle_epi8(_mm256_xor_si256(iq4_table(), _mm256_set1_epi8(static_cast<char>(0x80))),
                                 nibbles32(q));
    } else if constexpr (signed_values(T)) {
      return _mm256_xor_si256(sub_values<T>(w, j), _mm256_set1_epi8(static_cast<char>(0x80)));
    } else {
      return sub_values<T>(w, j);
    }
  }
  template <int T>
  CB_VNNI static __m256i dot(const uint8_t* w, int64_t b, __m256i xv, __m256i) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), values<T>(w, b), xv);
  }
  template <int T>
  CB_VNNI static __m256i fix(__m256i isum, int32_t i32) {
    return signed_values(T) ? _mm256_sub_epi32(isum, _mm256_set1_epi32(128 * i32)) : isum;
  }
};

template <int T>
CB_VNNI void row1_vnni(const Part& p, int64_t n0, int64_t n1, const Acts& a, int64_t, float* y, int64_t) {
  row1<T, DotVnni>(p, n0, n1, a, y);
}

}  // namespace

TileFn row1_b32_vnni(int64_t type) {
  TileFn f = nullptr;
  cbserve::with_value<Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, IQ4_XS>(type, [&](auto t) { f = row1_vnni<decltype(t)::value>; });
  return f;
}

TileFn panels_b32_vnni(int64_t type) {
  TileFn f = nullptr;
  cbserve::with_value<Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, IQ4_XS>(type, [&](auto t) {
    f = panels_b32<Vec512, decltype(t)::value>;
  });
  return f;
}

}  // namespace cbserve_kquant
