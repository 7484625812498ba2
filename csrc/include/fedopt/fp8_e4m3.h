// fp32 -> float8_e4m3fn bits, shared by the CPU and CUDA fp8 encoders (the Triton one,
// fedopt_kernels/backends/triton/compressed.py, writes the same steps).  It is c10's
// fp8e4m3fn_from_fp32_value (the conversion python_ref's `.to(torch.float8_e4m3fn)`
// runs) step for step, written branch-free so that a loop of it vectorises:
//
//   |f| >= 480 (or NaN)  -> 0x7F (NaN; the fp8 encode clamps to +-448 first, so only a
//                           NaN gets here)
//   |f| <  2^-6          -> subnormal: the bits of (|f| + 2^14) - bits(2^14), the fp32
//                           addition rounding to a multiple of 2^-9 half to even
//   otherwise            -> rebias the exponent (-120 << 23), round the mantissa to 3
//                           bits half to even (+ 0x7FFFF + the kept lsb), take bits 20..27
//
// then the sign bit of f.  Torch-free, host and device.
#pragma once

#include <cstdint>
#include <cstring>

#include "math.h"  // FEDOPT_HD

namespace fedopt::fp8 {

FEDOPT_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

FEDOPT_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

FEDOPT_HD uint8_t e4m3fn_bits(float f) {
  constexpr uint32_t kNaNFrom = UINT32_C(1087) << 20;  // 480.0f: rounds past 448
  constexpr uint32_t kDenormMagic = UINT32_C(141) << 23;  // 2^14
  constexpr uint32_t kMinNormal = UINT32_C(121) << 23;  // 2^-6
  uint32_t u = float_bits(f);
  const uint32_t sign = u & UINT32_C(0x80000000);
  u ^= sign;
#if defined(__CUDA_ARCH__)
  const uint32_t sub = float_bits(__fadd_rn(bits_float(u), bits_float(kDenormMagic))) - kDenormMagic;
#else
  const uint32_t sub = float_bits(bits_float(u) + bits_float(kDenormMagic)) - kDenormMagic;
#endif
  const uint32_t nrm = (u + ((uint32_t)(7 - 127) << 23) + UINT32_C(0x7FFFF) + ((u >> 20) & 1u)) >> 20;
  const uint32_t r = u >= kNaNFrom ? UINT32_C(0x7F) : (u < kMinNormal ? sub : nrm);
  return static_cast<uint8_t>((r & 0xFFu) | (sign >> 24));
}

}  // namespace fedopt::fp8
