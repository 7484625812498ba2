// The counter-based Gaussian noise of DP aggregation on the CPU (the definition:
// include/fedopt/gaussian_noise.h, oracle python_ref/gaussian_noise.py): the noise of a
// block of kN lanes, which the aggregation's epilogue adds in the same pass
// (client_rows_kernels.h, finish_total), and add_noise_'s pass over a vector.
//
// Every element's noise is normal(key, j) of its global index j alone, and every add is
// elementwise, so the bits depend neither on the chunking, the thread count nor the ISA.
#pragma once

#ifndef CPU_CAPABILITY
#error "noise_kernels.h is included by kernels.h (via isa_*.cpp, which define CPU_CAPABILITY)"
#endif

#include <fedopt/gaussian_noise.h>

#include "philox_wide.h"  // philox4x32_10_wide (AVX-512)

#include "vec_block.h"

namespace fedopt::cpu::CPU_CAPABILITY {
namespace {

// gaussian_noise.h's philox_x01, as this build vectorises it best; the same integer
// operations, so the same bits.  AVX-512: philox4x32_10_wide (the words in 64-bit lanes;
// measured on a Zen 4 core, the noise loop alone, GCC 12: 306M normals/s against 191M/s).
// AVX2 and SSE2 have no 64-bit lane multiply, and there the 64-bit form is the slower one
// (108M/s against 124M/s, 57M/s against 94M/s): SSE2 keeps the header's philox_x01, AVX2
// has its own (philox_x01_8).
C10_ALWAYS_INLINE void philox_lanes(uint64_t key, uint64_t j, uint32_t& x0, uint32_t& x1) {
#if defined(CPU_CAPABILITY_AVX512)
  noise::philox4x32_10_wide(key, j, 0u, 0u, x0, x1);
#else
  noise::philox_x01(key, j, x0, x1);
#endif
}

#if defined(CPU_CAPABILITY_AVX2)
// AVX2: GCC vectorises the 32 x 32 -> 64 products of the header's Philox with ~27
// shuffles per element (vpshufd, vperm2i128, vpunpcklqdq), and the 64-bit form of
// philox_lanes is slower still (no 64-bit lane multiply).  Written out, eight lanes take
// two vpmuludq per product (the even lanes, then the odd ones shifted down) and two
// blends to gather the high and the low halves: the classic SIMD Philox.  Same integer
// operations, same bits.  Measured on a Zen 4 core (the noise loop alone): 260M
// normals/s against 125M/s.
C10_ALWAYS_INLINE void mulhilo8(__m256i a, __m256i m, __m256i& hi, __m256i& lo) {
  const __m256i even = _mm256_mul_epu32(a, m);                         // lanes 0, 2, 4, 6
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);  // lanes 1, 3, 5, 7
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

// x0, x1 of the eight indices j0 .. j0 + 7; j0 % 8 == 0, so that j0 + 7 has j0's high word.
C10_ALWAYS_INLINE void philox_x01_8(uint64_t key, uint64_t j0, uint32_t* x0, uint32_t* x1) {
  __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(j0))),
                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i c1 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(j0 >> 32)));
  __m256i c2 = _mm256_setzero_si256(), c3 = _mm256_setzero_si256();
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  const __m256i m0 = _mm256_set1_epi64x(noise::kM0), m1 = _mm256_set1_epi64x(noise::kM1);
#pragma GCC unroll 10
  for (int r = 0; r < 10; ++r) {
    __m256i hi0, lo0, hi1, lo1;
    mulhilo8(c0, m0, hi0, lo0);
    mulhilo8(c2, m1, hi1, lo1);
    c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32(static_cast<int>(k0)));
    c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32(static_cast<int>(k1)));
    c1 = lo1;
    c3 = lo0;
    k0 += noise::kW0;
    k1 += noise::kW1;
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x0), c0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x1), c1);
}
#endif

// The block's noise term std * n_j for the kN lanes from global index j0 (each product
// rounded to acc_t on its own: the kernels have no FMA).  normal() of
// include/fedopt/gaussian_noise.h in two steps: its lanes up to the square root's
// argument, r2 = -2 ln u_a, and c = cos(2 pi u_b), in a plain loop that GCC vectorises
// (16 lanes at a time with AVX-512, 8 with AVX2, 4 with SSE2), then n = sqrt(r2) * c
// with at::vec's sqrt (sqrtps / sqrtpd, or std::sqrt per lane: IEEE's correctly rounded
// square root in every build, as the header's sqrt_rn).  Why not normal() in the loop:
// GCC 12 keeps a scalar sqrtf call with its errno branch there (-fno-math-errno would
// drop it, but `#pragma GCC optimize("no-math-errno")` does not reach builtins), and
// that branch stops the vectorisation of the whole loop.
// `flatten` inlines the header's functions here: they are ordinary inline functions,
// the same in every isa_*.cpp, and an out-of-line copy compiled for AVX2 could be the
// one the linker keeps for the DEFAULT build (isa_prologue.h, rule 2); inlined, no copy
// is emitted (tests/test_noise_cpu_isa.py and tests/test_cpu_kernels.py check the
// library for such copies).
template <typename acc_t>
__attribute__((flatten)) void normal_parts(uint64_t key, uint64_t j0, float* __restrict__ r2,
                                          float* __restrict__ c) {
  constexpr int64_t kN = Block<acc_t>::kN;
#if defined(CPU_CAPABILITY_AVX2)
  alignas(32) uint32_t xs0[kN], xs1[kN];
  if (j0 % 8 == 0) {  // always, from the kernels here: blocks start at multiples of kN
    for (int64_t g = 0; g < kN; g += 8) philox_x01_8(key, j0 + static_cast<uint64_t>(g), xs0 + g, xs1 + g);
  } else {
    for (int64_t l = 0; l < kN; ++l) noise::philox_x01(key, j0 + static_cast<uint64_t>(l), xs0[l], xs1[l]);
  }
  for (int64_t l = 0; l < kN; ++l) {
    r2[l] = noise::mul(-2.0f, noise::log_open(noise::uniform_open(xs0[l])));
    c[l] = noise::cos_2pi(noise::uniform_open(xs1[l]));
  }
#else
  for (int64_t l = 0; l < kN; ++l) {
    uint32_t x0, x1;
    philox_lanes(key, j0 + static_cast<uint64_t>(l), x0, x1);
    r2[l] = noise::mul(-2.0f, noise::log_open(noise::uniform_open(x0)));
    c[l] = noise::cos_2pi(noise::uniform_open(x1));
  }
#endif
}

template <typename acc_t>
C10_ALWAYS_INLINE void noise_terms(uint64_t key, uint64_t j0, const Vectorized<acc_t>& std_v,
                                   Vectorized<acc_t>* nv) {
  using B = Block<acc_t>;
  using F = Vectorized<float>;
  constexpr int64_t kF = F::size();
  alignas(64) float r2[B::kN], c[B::kN];
  normal_parts<acc_t>(key, j0, r2, c);
  alignas(64) float n[B::kN];
  for (int64_t l = 0; l < B::kN; l += kF) (F::loadu(r2 + l).sqrt() * F::loadu(c + l)).store(n + l);
  if constexpr (std::is_same_v<acc_t, float>) {
    for (int64_t k = 0; k < B::kK; ++k) nv[k] = std_v * Vectorized<acc_t>::loadu(n + k * B::kW);
  } else {
    alignas(64) acc_t wide[B::kN];
    for (int64_t l = 0; l < B::kN; ++l) wide[l] = static_cast<acc_t>(n[l]);  // exact
    for (int64_t k = 0; k < B::kK; ++k) nv[k] = std_v * Vectorized<acc_t>::loadu(wide + k * B::kW);
  }
}

// add_noise_ over the chunks [c0, c1) of kNoiseChunk elements: out[j] = round(out[j] as
// acc_t + std * n_j), block by block, the ragged end through load_tail / store_tail.
template <typename out_t, typename acc_t>
void add_noise_chunks(const NoiseArgs<acc_t>& a, int64_t c0, int64_t c1) {
  using B = Block<acc_t>;
  using Vec = typename B::Vec;
  constexpr int64_t kN = B::kN;
  out_t* out = static_cast<out_t*>(a.out);
  const Vec std_v(a.std_dev);
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t start = c * a.chunk;
    const int64_t end = std::min(a.n, start + a.chunk);
    for (int64_t j = start; j < end; j += kN) {
      Vec v[B::kK], nv[B::kK];
      noise_terms(a.key, static_cast<uint64_t>(j), std_v, nv);
      if (j + kN <= end) {
        B::load(out + j, v);
        for (int64_t k = 0; k < B::kK; ++k) v[k] = v[k] + nv[k];
        B::store(out + j, v);
      } else {
        B::load_tail(out + j, end - j, v);
        for (int64_t k = 0; k < B::kK; ++k) v[k] = v[k] + nv[k];
        B::store_tail(out + j, end - j, v);
      }
    }
  }
}

template <typename acc_t>
void add_noise_pass(const NoiseArgs<acc_t>& a, int64_t c0, int64_t c1) {
  dispatch_kind<acc_t>(a.kind, [&](auto out) { add_noise_chunks<typename decltype(out)::type, acc_t>(a, c0, c1); });
}

}  // namespace
}  // namespace fedopt::cpu::CPU_CAPABILITY
