// The counter-based Gaussian noise of differentially private aggregation, shared by the
// CPU and CUDA kernels (the Triton kernels write the same steps in
// fedopt_kernels/backends/triton/_noise.py).  The definition and the oracle are
// python_ref/gaussian_noise.py; this is that module step for step, and the bits are the
// same on every backend and every CPU ISA:
//
//   normal(key, j) = sqrt(-2 ln u_a) * cos(2 pi u_b),  u = ((x >> 8) | 1) * 2^-24,
//   (x0, x1, _, _) = Philox4x32-10(key = (key lo, key hi), counter = (j lo, j hi, 0, 0)),
//
// with ln and cos as fixed polynomials.  Why not logf/cosf: they differ by an ulp
// between glibc, SLEEF (at::vec), CUDA's libdevice and Triton, and then the noise of a
// run would depend on the machine; +, -, *, / and sqrt each correctly rounded (never
// contracted into an FMA: the CPU kernels compile with fp-contract=off, and on the GPU
// every step below is an __f*_rn intrinsic) give the same bits everywhere.
//
// Cost: ten Philox rounds (two 32x32->64 multiplies each) and ~35 fp32 operations per
// element.  Written as straight-line code with selects instead of branches, so that a
// loop of normal() over a block of indices vectorises (GCC turns the ternaries into
// blends and the 64-bit products into vpmuludq).
#pragma once

#include <cstdint>

#include "math.h"  // FEDOPT_HD

namespace fedopt::noise {

#if defined(__CUDA_ARCH__)
FEDOPT_HD float add(float a, float b) { return __fadd_rn(a, b); }
FEDOPT_HD float sub(float a, float b) { return __fsub_rn(a, b); }
FEDOPT_HD float mul(float a, float b) { return __fmul_rn(a, b); }
FEDOPT_HD float div(float a, float b) { return __fdiv_rn(a, b); }
FEDOPT_HD float sqrt_rn(float a) { return __fsqrt_rn(a); }
FEDOPT_HD uint32_t float_bits(float f) { return __float_as_uint(f); }
FEDOPT_HD float bits_float(uint32_t u) { return __uint_as_float(u); }
#else
FEDOPT_HD float add(float a, float b) { return a + b; }
FEDOPT_HD float sub(float a, float b) { return a - b; }
FEDOPT_HD float mul(float a, float b) { return a * b; }
FEDOPT_HD float div(float a, float b) { return a / b; }
FEDOPT_HD float sqrt_rn(float a) { return __builtin_sqrtf(a); }  // IEEE sqrt: sqrtss / vsqrtps
FEDOPT_HD uint32_t float_bits(float f) { return __builtin_bit_cast(uint32_t, f); }
FEDOPT_HD float bits_float(uint32_t u) { return __builtin_bit_cast(float, u); }
#endif

// Philox4x32 (Salmon et al., SC 2011): multipliers and Weyl key increments.
constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;

// The fp32 constants of python_ref/gaussian_noise.py's class C, as exact hex literals.
constexpr float kTwoM24 = 0x1p-24f;
constexpr float kSqrt2 = 0x1.6a09e6p+0f;  // 2 * C.SQRT1_2
constexpr float kLn2Hi = 0x1.62e4p-1f;
constexpr float kLn2Lo = 0x1.7f7d1cp-20f;
constexpr float kL3 = 0x1.555556p-1f, kL5 = 0x1.99999ap-2f, kL7 = 0x1.24924ap-2f, kL9 = 0x1.c71c72p-3f,
                kL11 = 0x1.745d18p-3f;
constexpr float kTwoPi = 0x1.921fb6p+2f;
constexpr float kC2 = -0x1p-1f, kC4 = 0x1.555556p-5f, kC6 = -0x1.6c16c2p-10f, kC8 = 0x1.a01a02p-16f;
constexpr float kS3 = -0x1.555556p-3f, kS5 = 0x1.111112p-7f, kS7 = -0x1.a01a02p-13f, kS9 = 0x1.71de3ap-19f;

// The first two words (x0, x1) of Philox4x32-10 of counter (j lo, j hi, c2, c3) under
// `key` (python_ref's philox4x32_10).  The one copy of the rounds: the noise draws at
// (j, 0, 0) (philox_x01), the codecs' stochastic rounding at (j, client, stream)
// (csrc/cpu/compressed_kernels.h).  Callers compiled inside a target namespace get it
// inlined (no fedopt::noise:: symbol in the library: tests/test_noise_cpu_isa.py).
FEDOPT_HD void philox4x32_10(uint64_t key, uint64_t j, uint32_t c2, uint32_t c3, uint32_t& x0, uint32_t& x1) {
  uint32_t c0 = static_cast<uint32_t>(j), c1 = static_cast<uint32_t>(j >> 32);
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
#if defined(__CUDACC__)  // nvcc, both passes: its host front end warns on GCC's pragma
#pragma unroll
#else
#pragma GCC unroll 10  // straight-line code: a loop of normal() over lanes then vectorises
#endif
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kM1) * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(p1);
    c3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c2 = n2;
    k0 += kW0;
    k1 += kW1;
  }
  x0 = c0;
  x1 = c1;
}

// The noise's draw: counter (j lo, j hi, 0, 0).
FEDOPT_HD void philox_x01(uint64_t key, uint64_t j, uint32_t& x0, uint32_t& x1) {
  philox4x32_10(key, j, 0u, 0u, x0, x1);
}

// ((x >> 8) | 1) * 2^-24: exact, in (0, 1).
// (Through int32: the value is below 2^24, and x86 before AVX-512 has no uint32 -> float
// conversion, which GCC would then branch over instead of vectorising.)
FEDOPT_HD float uniform_open(uint32_t x) { return mul(static_cast<float>(static_cast<int32_t>((x >> 8) | 1u)), kTwoM24); }

// ln u for u in (0, 1) (a normal fp32 number).
FEDOPT_HD float log_open(float u) {
  const uint32_t bits = float_bits(u);
  int32_t e = static_cast<int32_t>(bits >> 23) - 127;
  float m = bits_float((bits & 0x7FFFFFu) | 0x3F800000u);  // [1, 2)
  const bool big = m > kSqrt2;
  const float half = mul(m, 0.5f);  // both sides of every select computed first: no
  m = big ? half : m;               // conditional fp op, so GCC vectorises without masks
  e = big ? e + 1 : e;
  const float ef = static_cast<float>(e);
  const float s = div(sub(m, 1.0f), add(m, 1.0f));
  const float z = mul(s, s);
  float p = add(kL9, mul(z, kL11));
  p = add(kL7, mul(z, p));
  p = add(kL5, mul(z, p));
  p = add(kL3, mul(z, p));
  const float ln_m = add(add(s, s), mul(mul(s, z), p));
  return add(mul(ef, kLn2Hi), add(mul(ef, kLn2Lo), ln_m));
}

// cos(2 pi v) for v in (0, 1), a multiple of 2^-24.
FEDOPT_HD float cos_2pi(float v) {
  const float a = __builtin_fabsf(sub(v, 0.5f));  // exact; cos(2 pi v) = -cos(2 pi a)
  const bool far = a > 0.25f;
  const float a_far = sub(0.5f, a);
  const float b = far ? a_far : a;  // exact
  const bool use_sin = b > 0.125f;
  const float b_sin = sub(0.25f, b);
  const float x = mul(use_sin ? b_sin : b, kTwoPi);  // [0, pi/4]
  const float z = mul(x, x);
  float c = add(kC6, mul(z, kC8));
  c = add(kC4, mul(z, c));
  c = add(kC2, mul(z, c));
  c = add(1.0f, mul(z, c));
  float s = add(kS7, mul(z, kS9));
  s = add(kS5, mul(z, s));
  s = add(kS3, mul(z, s));
  s = add(x, mul(mul(x, z), s));
  const float r = use_sin ? s : c;  // cos(2 pi b)
  return far ? r : -r;              // -cos(2 pi a)
}

// Element j of the standard normal noise of `key` (python_ref/gaussian_noise.normal).
FEDOPT_HD float normal(uint64_t key, uint64_t j) {
  uint32_t x0, x1;
  philox_x01(key, j, x0, x1);
  const float r = sqrt_rn(mul(-2.0f, log_open(uniform_open(x0))));
  return mul(r, cos_2pi(uniform_open(x1)));
}

}  // namespace fedopt::noise
