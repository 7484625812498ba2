// CUDA kernels (device code and host launchers, torch-free) of
// fedopt_C::block_decode_aggregate and fedopt_C::topk_decode_aggregate (schemas:
// csrc/registration.cpp; oracle: python_ref/compression.py; the CPU twin:
// csrc/cpu/compressed_aggregate.cpp, the Triton one: backends/triton/compressed.py).
//
// Block codecs: block b of the grid owns kCodecTile consecutive columns and loops over
// the clients in order; each thread decodes its columns' codes in registers (v = s_b * q,
// one rounding: __fmul_rn), adds w_i * v to its running totals (__fadd_rn / __fmul_rn:
// never contracted into an FMA, so out is bit for bit the CPU kernel's and python_ref's)
// and the block sums v^2 with the fixed tree of cuda_utils.cuh into one partial per
// (client, tile).  codec_row_sums adds each row of partials in tile order:
// deterministic, no float atomics.  The codes are read in place from one [C, L] array of
// codes (the binding stacks a list of replies on the device: 1/4 or 1/8 of the bytes of
// fp32; no host copy, no sync), so the kernel needs no pointer table.
//
// Top-k: one scatter launch per client, in client order, adds w_i * value at its
// strictly increasing (so distinct) indices into an fp32 accumulator: no two threads of a
// launch touch one column.  Then finish writes out = gamma * acc with the partials of
// ||acc||^2.  Trade-off: C small launches instead of one; a reply's k is small, and the
// order of the sum (client order) is what makes it deterministic without atomics.
//
// This header includes no torch: csrc/cuda/compressed_aggregate.cu (the ATen binding)
// and tools/gpu_harness (a plain CUDA program) both launch it through
// launch_block_decode_aggregate / launch_topk_decode_aggregate.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "fedopt/cuda_utils.cuh"

namespace fedopt {
namespace cuda {

constexpr int kCodecThreads = 256;
constexpr int kCodecPerThread = 4;
constexpr int64_t kCodecTile = int64_t(kCodecThreads) * kCodecPerThread;

// fp8 e4m3fn bits -> float, exactly (the Triton kernel's integer decoding).
__device__ __forceinline__ float fp8_e4m3fn(uint32_t b) {
  const uint32_t sign = (b >> 7) & 1u, e = (b >> 3) & 15u, m = b & 7u;
  if (e == 15u && m == 7u) return __int_as_float(0x7fc00000);
  if (e == 0u) {
    const float sub = __fmul_rn(static_cast<float>(m), 0.001953125f);  // m 2^-9, exact
    return sign ? -sub : sub;
  }
  return __uint_as_float((sign << 31) | ((e + 120u) << 23) | (m << 20));
}

// Code j of a row: kind 0 int8, 1 int4 (two nibbles a byte, low first), 2 fp8 e4m3fn.
__device__ __forceinline__ float code_value(const uint8_t* row, int64_t j, int kind) {
  if (kind == 0) return static_cast<float>(static_cast<int8_t>(row[j]));
  if (kind == 1) {
    const int32_t byte = static_cast<int8_t>(row[j >> 1]);
    return static_cast<float>((j & 1) ? (byte >> 4) : ((byte << 28) >> 28));
  }
  return fp8_e4m3fn(row[j]);
}

__device__ __forceinline__ float codec_block_total(float v, float* smem) {
  return block_sum_warps<float>(v, smem, kCodecThreads / 32);
}

__global__ void __launch_bounds__(kCodecThreads) block_decode_aggregate_kernel(
    const uint8_t* __restrict__ codes, const float* __restrict__ scales, const float* __restrict__ w,
    float* __restrict__ out, float* __restrict__ part, const bool* __restrict__ skip, const float* gamma_ptr,
    float gamma_value, int64_t C, int64_t N, int64_t L, int64_t NB, int64_t block, int64_t ntiles, int kind) {
  if (skip != nullptr && *skip) return;
  __shared__ float smem[kCodecThreads / 32];
  const float gamma = gamma_ptr != nullptr ? *gamma_ptr : gamma_value;
  const int64_t tile = blockIdx.x;
  const int64_t base = tile * kCodecTile;
  float total[kCodecPerThread];
#pragma unroll
  for (int r = 0; r < kCodecPerThread; ++r) total[r] = 0.0f;
  for (int64_t i = 0; i < C; ++i) {
    const uint8_t* row = codes + i * L;
    const float* s = scales + i * NB;
    const float wi = w[i];
    float sq = 0.0f;
#pragma unroll
    for (int r = 0; r < kCodecPerThread; ++r) {
      const int64_t j = base + r * kCodecThreads + threadIdx.x;  // coalesced
      if (j < N) {
        const float v = __fmul_rn(s[j / block], code_value(row, j, kind));
        sq = __fadd_rn(sq, __fmul_rn(v, v));
        if (wi != 0.0f) total[r] = __fadd_rn(total[r], __fmul_rn(v, wi));
      }
    }
    const float t = codec_block_total(sq, smem);
    if (threadIdx.x == 0) part[i * ntiles + tile] = t;
  }
  float tq = 0.0f;
#pragma unroll
  for (int r = 0; r < kCodecPerThread; ++r) {
    const int64_t j = base + r * kCodecThreads + threadIdx.x;
    if (j < N) {
      tq = __fadd_rn(tq, __fmul_rn(total[r], total[r]));
      out[j] = __fmul_rn(gamma, total[r]);
    }
  }
  const float t = codec_block_total(tq, smem);
  if (threadIdx.x == 0) part[C * ntiles + tile] = t;
}

__global__ void __launch_bounds__(kCodecThreads) topk_scatter_kernel(const float* __restrict__ val,
                                                                     const int64_t* __restrict__ idx,
                                                                     const float* __restrict__ w,
                                                                     float* __restrict__ acc, float* __restrict__ part,
                                                                     int64_t i, int64_t k, int64_t nparts, int64_t N) {
  __shared__ float smem[kCodecThreads / 32];
  const int64_t t = int64_t(blockIdx.x) * kCodecThreads + threadIdx.x;
  const float wi = w[i];
  float sq = 0.0f;
  if (t < k) {
    const float v = val[t];
    sq = __fmul_rn(v, v);
    const int64_t j = idx[t];
    // An index out of [0, N) is never written (memory safety without a host check; the
    // ops layer refuses such a reply, with its reason, before the launch).
    if (wi != 0.0f && j >= 0 && j < N) acc[j] = __fadd_rn(acc[j], __fmul_rn(v, wi));
  }
  const float s = codec_block_total(sq, smem);
  if (threadIdx.x == 0) part[i * nparts + blockIdx.x] = s;
}

__global__ void __launch_bounds__(kCodecThreads) topk_finish_kernel(const float* __restrict__ acc,
                                                                    float* __restrict__ out, float* __restrict__ part,
                                                                    const bool* __restrict__ skip,
                                                                    const float* gamma_ptr, float gamma_value,
                                                                    int64_t N) {
  if (skip != nullptr && *skip) return;
  __shared__ float smem[kCodecThreads / 32];
  const float gamma = gamma_ptr != nullptr ? *gamma_ptr : gamma_value;
  const int64_t j = int64_t(blockIdx.x) * kCodecThreads + threadIdx.x;
  float sq = 0.0f;
  if (j < N) {
    const float a = acc[j];
    sq = __fmul_rn(a, a);
    out[j] = __fmul_rn(gamma, a);
  }
  const float s = codec_block_total(sq, smem);
  if (threadIdx.x == 0) part[blockIdx.x] = s;
}

// q[r] (r < C) / total (r == C) = sum of row r of part [C + 1, nparts], in order; 0 when skipped.
__global__ void __launch_bounds__(kCodecThreads) codec_row_sums_kernel(const float* __restrict__ part,
                                                                       float* __restrict__ q,
                                                                       float* __restrict__ total,
                                                                       const bool* __restrict__ skip, int64_t C,
                                                                       int64_t nparts) {
  __shared__ float smem[kCodecThreads / 32];
  const int64_t r = blockIdx.x;
  float s = 0.0f;
  if (skip == nullptr || !*skip) {
    for (int64_t p = threadIdx.x; p < nparts; p += kCodecThreads) s = __fadd_rn(s, part[r * nparts + p]);
  }
  s = codec_block_total(s, smem);
  if (threadIdx.x == 0) {
    if (r < C) q[r] = s;
    else *total = s;
  }
}

// Partials per row of `part` ([C + 1, parts], zeroed by the caller).
inline int64_t block_decode_parts(int64_t N) { return N > 0 ? (N + kCodecTile - 1) / kCodecTile : 1; }
inline int64_t topk_decode_parts(int64_t N, int64_t max_k) {
  const int64_t a = (N + kCodecThreads - 1) / kCodecThreads, b = (max_k + kCodecThreads - 1) / kCodecThreads;
  return a > b ? (a > 0 ? a : 1) : (b > 0 ? b : 1);
}

// The block codecs' host launcher.  codes [C, L] bytes (L = N, or (N + 1) / 2 for int4),
// scales [C, NB] fp32 (NB = ceil(N / block)), w [C] fp32, out [N] fp32, part
// [(C + 1) * block_decode_parts(N)] fp32 zeroed, q [C] and total [1] fp32 (the squared
// norms of the decoded updates and of the weighted sum).  gamma: *gamma_ptr when given,
// else gamma_value.  kind 0 int8, 1 int4, 2 fp8; block > 0.  Returns the launch error.
inline cudaError_t launch_block_decode_aggregate(const uint8_t* codes, const float* scales, const float* w, float* out,
                                                 float* part, float* q, float* total, const bool* skip,
                                                 const float* gamma_ptr, float gamma_value, int64_t C, int64_t N,
                                                 int64_t block, int kind, cudaStream_t stream) {
  const int64_t L = kind == 1 ? (N + 1) / 2 : N, NB = (N + block - 1) / block;
  const int64_t ntiles = block_decode_parts(N);
  if (N > 0) {
    block_decode_aggregate_kernel<<<ntiles, kCodecThreads, 0, stream>>>(codes, scales, w, out, part, skip, gamma_ptr,
                                                                        gamma_value, C, N, L, NB, block, ntiles, kind);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  codec_row_sums_kernel<<<C + 1, kCodecThreads, 0, stream>>>(part, q, total, skip, C, ntiles);
  return cudaGetLastError();
}

// Top-k's host launcher.  values[i] / indices[i]: client i's ks[i] kept values (fp32)
// and their strictly increasing int64 indices, device pointers in a HOST array (one
// launch per client, in client order); acc [N] fp32 zeroed; part [(C + 1) * nparts]
// zeroed with nparts = topk_decode_parts(N, max ks[i]); the rest as above.
inline cudaError_t launch_topk_decode_aggregate(const float* const* values, const int64_t* const* indices,
                                                const int64_t* ks, const float* w, float* acc, float* out, float* part,
                                                float* q, float* total, const bool* skip, const float* gamma_ptr,
                                                float gamma_value, int64_t C, int64_t N, int64_t nparts,
                                                cudaStream_t stream) {
  for (int64_t i = 0; i < C; ++i) {
    if (ks[i] == 0) continue;
    topk_scatter_kernel<<<(ks[i] + kCodecThreads - 1) / kCodecThreads, kCodecThreads, 0, stream>>>(
        values[i], indices[i], w, acc, part, i, ks[i], nparts, N);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (N > 0) {
    topk_finish_kernel<<<(N + kCodecThreads - 1) / kCodecThreads, kCodecThreads, 0, stream>>>(
        acc, out, part + C * nparts, skip, gamma_ptr, gamma_value, N);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  codec_row_sums_kernel<<<C + 1, kCodecThreads, 0, stream>>>(part, q, total, skip, C, nparts);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace fedopt
