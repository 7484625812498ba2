// CUDA kernels (device code and host launchers, torch-free) of the client's fused encode
// fedopt_C::block_quantize for int8 / int4 (and fp8 at the end of this file) (schema: csrc/registration.cpp; oracle:
// python_ref/compression.py quantize; the CPU twin: csrc/cpu/compressed_kernels.h
// quantize_block, the Triton one: backends/triton/compressed.py block_quantize_kernel).
//
// One thread block per quantisation block b of `block` values (a multiple of 32):
//   s_b = max|x_b| / qmax         (one rounding, __fdiv_rn; NaN if the block holds a NaN)
//   t   = x / s_b                 (__fdiv_rn; 0 where s_b == 0)
//   q   = rint(t)                 (round half to even: the default rounding mode)
//         or, stochastic, floor(t) + [u < t - floor(t)], u = (x0 >> 8) 2^-24 with x0 the
//         first word of Philox4x32-10(key, (j lo, j hi, client, 0x51))
//   q   = 0 where NaN, clamped to [-qmax, qmax]; int8 as is, int4 two nibbles a byte
//         (low = even element).
// max is exact whatever the order, so the block's reduction (shared memory, a fixed
// tree) is deterministic; every other step is elementwise: the bits are python_ref's.
// A thread owns element PAIRS (2p, 2p + 1) of its block, so an int4 byte is written by
// one thread and no two threads touch a byte.
//
// The Philox rounds are gaussian_noise.h's philox4x32_10 (the one copy, shared with the
// noise and the CPU codec), at counter (j lo, j hi, client, stream).
//
// This header includes no torch: csrc/cuda/compressed_aggregate.cu (the ATen binding)
// and tools/gpu_harness both launch it through launch_block_quantize.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "fedopt/fp8_e4m3.h"  // e4m3fn_bits (c10's conversion, shared with the CPU encode)
#include "fedopt/gaussian_noise.h"  // philox4x32_10

namespace fedopt {
namespace cuda {

constexpr int kEncodeThreads = 128;
constexpr uint32_t kStreamRounding = 0x51;  // python_ref/compression.py STREAM_ROUNDING

// The code of x (as a float integer in [-qmax, qmax]) under scale s at element j.
__device__ __forceinline__ float quantize_code(float x, float s, int64_t j, float qmax, bool stochastic,
                                               uint64_t key, uint32_t client) {
  const float t = s == 0.0f ? 0.0f : __fdiv_rn(x, s);
  float q;
  if (stochastic) {
    const float f = floorf(t);
    uint32_t x0, x1;
    noise::philox4x32_10(key, static_cast<uint64_t>(j), client, kStreamRounding, x0, x1);
    const float u = __fmul_rn(static_cast<float>(static_cast<int32_t>(x0 >> 8)), 0x1p-24f);  // exact
    q = __fadd_rn(f, u < __fsub_rn(t, f) ? 1.0f : 0.0f);
  } else {
    q = rintf(t);  // half to even
  }
  q = q == q ? q : 0.0f;  // NaN (a NaN value or scale: a reply the server refuses) codes 0
  return fminf(fmaxf(q, -qmax), qmax);
}

template <typename scalar_t>
__global__ void __launch_bounds__(kEncodeThreads)
    block_quantize_kernel(const scalar_t* __restrict__ x, uint8_t* __restrict__ codes, float* __restrict__ scales,
                          int64_t N, int64_t block, int int4, int stochastic, uint64_t key, uint32_t client) {
  __shared__ float smax[kEncodeThreads];
  __shared__ int snan[kEncodeThreads];
  const int64_t b = blockIdx.x, j0 = b * block;
  const int64_t len = N - j0 < block ? N - j0 : block;
  const float qmax = int4 ? 7.0f : 127.0f;
  float amax = 0.0f;
  int nan = 0;
  for (int64_t t = threadIdx.x; t < len; t += kEncodeThreads) {
    const float v = static_cast<float>(x[j0 + t]);
    nan |= v != v;
    amax = fmaxf(amax, fabsf(v));
  }
  smax[threadIdx.x] = amax;
  snan[threadIdx.x] = nan;
  __syncthreads();
  for (int h = kEncodeThreads / 2; h > 0; h >>= 1) {
    if (threadIdx.x < h) {
      smax[threadIdx.x] = fmaxf(smax[threadIdx.x], smax[threadIdx.x + h]);
      snan[threadIdx.x] |= snan[threadIdx.x + h];
    }
    __syncthreads();
  }
  const float s = snan[0] ? __int_as_float(0x7fc00000) : __fdiv_rn(smax[0], qmax);
  if (threadIdx.x == 0) scales[b] = s;
  const bool sr = stochastic != 0;
  for (int64_t p = threadIdx.x; 2 * p < len; p += kEncodeThreads) {
    const int64_t je = j0 + 2 * p, jo = je + 1;
    const int qe = static_cast<int>(quantize_code(static_cast<float>(x[je]), s, je, qmax, sr, key, client));
    const bool has_odd = 2 * p + 1 < len;
    const int qo =
        has_odd ? static_cast<int>(quantize_code(static_cast<float>(x[jo]), s, jo, qmax, sr, key, client)) : 0;
    if (int4) {
      codes[j0 / 2 + p] = static_cast<uint8_t>((qe & 0xF) | ((qo & 0xF) << 4));
    } else {
      codes[je] = static_cast<uint8_t>(static_cast<int8_t>(qe));
      if (has_odd) codes[jo] = static_cast<uint8_t>(static_cast<int8_t>(qo));
    }
  }
}

// The host launcher: x [N] on the device (any float dtype, widened to fp32: fp16/bf16
// exactly; fp64 is rounded once by the caller first), codes [N] (int8) or [(N + 1) / 2]
// (int4) bytes, scales [ceil(N / block)] fp32.  block a positive multiple of 32 (so
// every block starts at an even element); key < 2^63.  N == 0 launches nothing.
template <typename scalar_t>
cudaError_t launch_block_quantize(const scalar_t* x, uint8_t* codes, float* scales, int64_t N, int64_t block,
                                  bool int4, bool stochastic, uint64_t key, uint32_t client, cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  const int64_t nb = (N + block - 1) / block;
  block_quantize_kernel<scalar_t><<<nb, kEncodeThreads, 0, stream>>>(x, codes, scales, N, block, int4 ? 1 : 0,
                                                                     stochastic ? 1 : 0, key, client);
  return cudaGetLastError();
}

// The fp8 (e4m3fn) encode, block_quantize's kind 2 (python_ref/compression.py fp8_encode;
// the CPU twin: csrc/cpu/compressed_encode_kernels.h): one thread block per block b,
//   s_b = max|x_b| / 448 (__fdiv_rn; NaN if the block holds a NaN: the same fixed tree
//   as above), t = x / s_b (__fdiv_rn; +0 where s_b == 0), clamped to +-448 keeping a
//   NaN, codes = e4m3fn_bits(t) (fp8_e4m3.h, round half to even), one byte per element.
// The one difference from the CPU: the sign of a NaN code (0x7f or 0xff) is the sign of
// the NaN the GPU's division returns (Inf / Inf is +NaN here, -NaN on x86); both decode
// to NaN, which the aggregation leaves out.
__global__ void __launch_bounds__(kEncodeThreads)
    fp8_encode_kernel(const float* __restrict__ x, uint8_t* __restrict__ codes, float* __restrict__ scales, int64_t N,
                      int64_t block) {
  __shared__ float smax[kEncodeThreads];
  __shared__ int snan[kEncodeThreads];
  const int64_t b = blockIdx.x, j0 = b * block;
  const int64_t len = N - j0 < block ? N - j0 : block;
  float amax = 0.0f;
  int nan = 0;
  for (int64_t t = threadIdx.x; t < len; t += kEncodeThreads) {
    const float v = x[j0 + t];
    nan |= v != v;
    amax = fmaxf(amax, fabsf(v));
  }
  smax[threadIdx.x] = amax;
  snan[threadIdx.x] = nan;
  __syncthreads();
  for (int h = kEncodeThreads / 2; h > 0; h >>= 1) {
    if (threadIdx.x < h) {
      smax[threadIdx.x] = fmaxf(smax[threadIdx.x], smax[threadIdx.x + h]);
      snan[threadIdx.x] |= snan[threadIdx.x + h];
    }
    __syncthreads();
  }
  const float s = snan[0] ? __int_as_float(0x7fc00000) : __fdiv_rn(smax[0], 448.0f);
  if (threadIdx.x == 0) scales[b] = s;
  for (int64_t t = threadIdx.x; t < len; t += kEncodeThreads) {
    float v = s == 0.0f ? 0.0f : __fdiv_rn(x[j0 + t], s);
    v = v > 448.0f ? 448.0f : (v < -448.0f ? -448.0f : v);  // a NaN passes through
    codes[j0 + t] = fp8::e4m3fn_bits(v);
  }
}

// The host launcher: x [N] fp32 on the device, codes [N] bytes, scales [ceil(N / block)]
// fp32; block a positive multiple of 32.  N == 0 launches nothing.
inline cudaError_t launch_fp8_encode(const float* x, uint8_t* codes, float* scales, int64_t N, int64_t block,
                                     cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  const int64_t nb = (N + block - 1) / block;
  fp8_encode_kernel<<<nb, kEncodeThreads, 0, stream>>>(x, codes, scales, N, block);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace fedopt
