// philox4x32_10 (include/fedopt/gaussian_noise.h) in the form the CPU's AVX-512 builds
// vectorise best: shared by the DP noise (noise_kernels.h) and the codecs' stochastic
// rounding (compressed_kernels.h).  Included before any target switch, as
// gaussian_noise.h is; always inlined into its callers.
#pragma once

#include <cstdint>

#include <fedopt/gaussian_noise.h>

namespace fedopt::noise {

// philox4x32_10's (x0, x1) with the four words held in 64-bit integers whose high halves
// are zero: the same integer operations, so the same bits.  For the CPU's AVX-512 builds
// (csrc/cpu/noise_kernels.h, csrc/cpu/compressed_kernels.h), where GCC then keeps each
// word in 64-bit lanes (a lane multiply per product) from the first round to the last, instead of widening
// and narrowing it around every 32 x 32 -> 64 product: the DP noise loop ran at 306M
// normals/s against 191M/s on a Zen 4 core.  AVX2 and SSE2 have no 64-bit lane multiply;
// there gaussian_noise.h's philox4x32_10 is the faster one.  Always inlined (a caller in
// a target namespace must not share an out-of-line copy: tests/test_noise_cpu_isa.py).
__attribute__((always_inline)) inline void philox4x32_10_wide(uint64_t key, uint64_t j, uint32_t word2,
                                                              uint32_t word3, uint32_t& x0, uint32_t& x1) {
  uint64_t c0 = j & 0xFFFFFFFFu, c1 = j >> 32, c2 = word2, c3 = word3;
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
#pragma GCC unroll 10
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c0;  // c0, c2 < 2^32: no overflow
    const uint64_t p1 = static_cast<uint64_t>(kM1) * c2;
    const uint64_t n0 = (p1 >> 32) ^ c1 ^ k0;
    const uint64_t n2 = (p0 >> 32) ^ c3 ^ k1;
    c1 = p1 & 0xFFFFFFFFu;
    c3 = p0 & 0xFFFFFFFFu;
    c0 = n0;
    c2 = n2;
    k0 += kW0;
    k1 += kW1;
  }
  x0 = static_cast<uint32_t>(c0);
  x1 = static_cast<uint32_t>(c1);
}

}  // namespace fedopt::noise
