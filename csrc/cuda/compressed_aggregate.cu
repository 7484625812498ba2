// CUDA kernels of fedopt_C::block_decode_aggregate and fedopt_C::topk_decode_aggregate
// (schemas: csrc/registration.cpp; oracle: python_ref/compression.py; the CPU twin:
// csrc/cpu/compressed_aggregate.cpp, the Triton one: backends/triton/compressed.py).
//
// Block codecs: block b of the grid owns kTile consecutive columns and loops over the
// clients in order; each thread decodes its columns' codes in registers (v = s_b * q,
// one rounding: __fmul_rn), adds w_i * v to its running totals (__fadd_rn / __fmul_rn:
// never contracted into an FMA, so out is bit for bit the CPU kernel's and python_ref's)
// and the block sums v^2 with the fixed tree of cuda_utils.cuh into one partial per
// (client, tile).  row_sums adds each row of partials in tile order: deterministic, no
// float atomics.  The codes are read in place; a list of replies is first stacked into
// one [C, L] tensor of CODES on the device (1/4 or 1/8 of the bytes of fp32; no host
// copy, no sync) so that the kernel needs no pointer table.
//
// Top-k: one scatter launch per client, in client order, adds w_i * value at its
// strictly increasing (so distinct) indices into an fp32 accumulator: no two threads of a
// launch touch one column.  Then finish writes out = gamma * acc with the partials of
// ||acc||^2.  Trade-off: C small launches instead of one; a reply's k is small, and the
// order of the sum (client order) is what makes it deterministic without atomics.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "fedopt/cuda_utils.cuh"

namespace fedopt::cuda {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

constexpr int kCThreads = 256;
constexpr int kPerThread = 4;
constexpr int64_t kTile = int64_t(kCThreads) * kPerThread;

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

__device__ __forceinline__ float code_value(const uint8_t* row, int64_t j, int kind) {
  if (kind == 0) return static_cast<float>(static_cast<int8_t>(row[j]));
  if (kind == 1) {
    const int32_t byte = static_cast<int8_t>(row[j >> 1]);
    return static_cast<float>((j & 1) ? (byte >> 4) : ((byte << 28) >> 28));
  }
  return fp8_e4m3fn(row[j]);
}

__device__ __forceinline__ float block_total(float v, float* smem) { return block_sum_warps<float>(v, smem, kCThreads / 32); }

__global__ void __launch_bounds__(kCThreads) block_decode_aggregate_kernel(
    const uint8_t* __restrict__ codes, const float* __restrict__ scales, const float* __restrict__ w,
    float* __restrict__ out, float* __restrict__ part, const bool* __restrict__ skip, const float* gamma_ptr,
    float gamma_value, int64_t C, int64_t N, int64_t L, int64_t NB, int64_t block, int64_t ntiles, int kind) {
  if (skip != nullptr && *skip) return;
  __shared__ float smem[kCThreads / 32];
  const float gamma = gamma_ptr != nullptr ? *gamma_ptr : gamma_value;
  const int64_t tile = blockIdx.x;
  const int64_t base = tile * kTile;
  float total[kPerThread];
#pragma unroll
  for (int r = 0; r < kPerThread; ++r) total[r] = 0.0f;
  for (int64_t i = 0; i < C; ++i) {
    const uint8_t* row = codes + i * L;
    const float* s = scales + i * NB;
    const float wi = w[i];
    float sq = 0.0f;
#pragma unroll
    for (int r = 0; r < kPerThread; ++r) {
      const int64_t j = base + r * kCThreads + threadIdx.x;  // coalesced
      if (j < N) {
        const float v = __fmul_rn(s[j / block], code_value(row, j, kind));
        sq = __fadd_rn(sq, __fmul_rn(v, v));
        if (wi != 0.0f) total[r] = __fadd_rn(total[r], __fmul_rn(v, wi));
      }
    }
    const float t = block_total(sq, smem);
    if (threadIdx.x == 0) part[i * ntiles + tile] = t;
  }
  float tq = 0.0f;
#pragma unroll
  for (int r = 0; r < kPerThread; ++r) {
    const int64_t j = base + r * kCThreads + threadIdx.x;
    if (j < N) {
      tq = __fadd_rn(tq, __fmul_rn(total[r], total[r]));
      out[j] = __fmul_rn(gamma, total[r]);
    }
  }
  const float t = block_total(tq, smem);
  if (threadIdx.x == 0) part[C * ntiles + tile] = t;
}

__global__ void __launch_bounds__(kCThreads) topk_scatter_kernel(const float* __restrict__ val,
                                                                 const int64_t* __restrict__ idx,
                                                                 const float* __restrict__ w, float* __restrict__ acc,
                                                                 float* __restrict__ part, int64_t i, int64_t k,
                                                                 int64_t nparts, int64_t N) {
  __shared__ float smem[kCThreads / 32];
  const int64_t t = int64_t(blockIdx.x) * kCThreads + threadIdx.x;
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
  const float s = block_total(sq, smem);
  if (threadIdx.x == 0) part[i * nparts + blockIdx.x] = s;
}

__global__ void __launch_bounds__(kCThreads) topk_finish_kernel(const float* __restrict__ acc, float* __restrict__ out,
                                                                float* __restrict__ part, const bool* __restrict__ skip,
                                                                const float* gamma_ptr, float gamma_value, int64_t N) {
  if (skip != nullptr && *skip) return;
  __shared__ float smem[kCThreads / 32];
  const float gamma = gamma_ptr != nullptr ? *gamma_ptr : gamma_value;
  const int64_t j = int64_t(blockIdx.x) * kCThreads + threadIdx.x;
  float sq = 0.0f;
  if (j < N) {
    const float a = acc[j];
    sq = __fmul_rn(a, a);
    out[j] = __fmul_rn(gamma, a);
  }
  const float s = block_total(sq, smem);
  if (threadIdx.x == 0) part[blockIdx.x] = s;
}

// q[r] (r < C) / total (r == C) = sum of row r of part [C + 1, nparts], in order; 0 when skipped.
__global__ void __launch_bounds__(kCThreads) row_sums_kernel(const float* __restrict__ part, float* __restrict__ q,
                                                             float* __restrict__ total, const bool* __restrict__ skip,
                                                             int64_t C, int64_t nparts) {
  __shared__ float smem[kCThreads / 32];
  const int64_t r = blockIdx.x;
  float s = 0.0f;
  if (skip == nullptr || !*skip) {
    for (int64_t p = threadIdx.x; p < nparts; p += kCThreads) s = __fadd_rn(s, part[r * nparts + p]);
  }
  s = block_total(s, smem);
  if (threadIdx.x == 0) {
    if (r < C) q[r] = s;
    else *total = s;
  }
}

struct Common {
  Tensor w, skip, gamma;
  float gamma_value = 1.0f;
};

Common common(const Tensor& weights, int64_t C, double gamma, const OptTensor& gamma_tensor, const Tensor& out,
              int64_t N, const OptTensor& skip, const char* op) {
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == at::kFloat && out.dim() == 1 && out.is_contiguous() &&
                  out.numel() == N,
              op, ": out must be a contiguous [", N, "] float32 CUDA tensor, got ", out.scalar_type(), " ",
              out.sizes(), " on ", out.device());
  TORCH_CHECK(weights.device() == out.device() && weights.dim() == 1 && weights.size(0) == C, op,
              ": weights must be a [", C, "] tensor on ", out.device());
  Common c;
  c.w = weights.to(at::kFloat).contiguous();
  if (gamma_tensor.has_value()) {
    TORCH_CHECK(gamma_tensor->device() == out.device() && gamma_tensor->numel() == 1, op,
                ": gamma_tensor must be one element on ", out.device());
    c.gamma = gamma_tensor->to(at::kFloat).reshape({1}).contiguous();
  }
  c.gamma_value = static_cast<float>(gamma);
  if (skip.has_value()) {
    TORCH_CHECK(skip->device() == out.device() && skip->numel() == 1, op, ": skip must be one element on ",
                out.device());
    c.skip = skip->to(at::kBool).reshape({1}).contiguous();
  }
  return c;
}

const bool* skip_ptr(const Common& c) { return c.skip.defined() ? c.skip.const_data_ptr<bool>() : nullptr; }
const float* gamma_ptr(const Common& c) { return c.gamma.defined() ? c.gamma.const_data_ptr<float>() : nullptr; }

std::tuple<Tensor, Tensor> finish(const Tensor& part, int64_t C, int64_t nparts, const Common& c,
                                  cudaStream_t stream) {
  Tensor q = at::empty({C}, part.options()), total = at::empty({}, part.options());
  row_sums_kernel<<<C + 1, kCThreads, 0, stream>>>(part.const_data_ptr<float>(), q.data_ptr<float>(),
                                                    total.data_ptr<float>(), skip_ptr(c), C, nparts);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q, total};
}

}  // namespace

std::tuple<Tensor, Tensor> block_decode_aggregate(at::TensorList codes, at::TensorList scales, int64_t kind,
                                                  int64_t block, int64_t numel, const Tensor& weights, double gamma,
                                                  const OptTensor& gamma_tensor, const Tensor& out,
                                                  const OptTensor& skip) {
  const char* op = "fedopt_C::block_decode_aggregate";
  const int64_t C = static_cast<int64_t>(codes.size()), N = numel;
  TORCH_CHECK(C > 0 && static_cast<int64_t>(scales.size()) == C, op, ": one codes and one scales tensor per client");
  TORCH_CHECK(kind >= 0 && kind <= 2, op, ": kind must be 0, 1 or 2, got ", kind);
  TORCH_CHECK(block > 0 && block % 32 == 0, op, ": block must be a positive multiple of 32, got ", block);
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t L = kind == 1 ? (N + 1) / 2 : N, NB = (N + block - 1) / block;
  for (int64_t i = 0; i < C; ++i) {
    TORCH_CHECK(codes[i].device() == out.device() && codes[i].dim() == 1 && codes[i].numel() == L &&
                    codes[i].element_size() == 1,
                op, ": codes[", i, "] must be a 1-D one-byte tensor of ", L, " elements on ", out.device());
    TORCH_CHECK(scales[i].device() == out.device() && scales[i].scalar_type() == at::kFloat &&
                    scales[i].dim() == 1 && scales[i].numel() == NB,
                op, ": scales[", i, "] must be a 1-D float32 tensor of ", NB, " elements on ", out.device());
  }
  const Common c = common(weights, C, gamma, gamma_tensor, out, N, skip, op);
  std::vector<Tensor> cs, ss;
  for (int64_t i = 0; i < C; ++i) {
    cs.push_back(codes[i].view(at::kByte));
    ss.push_back(scales[i]);
  }
  const Tensor X = at::stack(cs).contiguous(), S = at::stack(ss).contiguous();
  const int64_t ntiles = std::max<int64_t>(1, (N + kTile - 1) / kTile);
  Tensor part = at::zeros({(C + 1) * ntiles}, out.options());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(out.device().index()).stream();
  if (N > 0) {
    block_decode_aggregate_kernel<<<ntiles, kCThreads, 0, stream>>>(
        X.const_data_ptr<uint8_t>(), S.const_data_ptr<float>(), c.w.const_data_ptr<float>(), out.data_ptr<float>(),
        part.data_ptr<float>(), skip_ptr(c), gamma_ptr(c), c.gamma_value, C, N, L, NB, block, ntiles,
        static_cast<int>(kind));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return finish(part, C, ntiles, c, stream);
}

std::tuple<Tensor, Tensor> topk_decode_aggregate(at::TensorList values, at::TensorList indices, int64_t numel,
                                                 const Tensor& weights, double gamma, const OptTensor& gamma_tensor,
                                                 const Tensor& out, const OptTensor& skip) {
  const char* op = "fedopt_C::topk_decode_aggregate";
  const int64_t C = static_cast<int64_t>(values.size()), N = numel;
  TORCH_CHECK(C > 0 && static_cast<int64_t>(indices.size()) == C, op, ": one values and one indices tensor per client");
  const c10::cuda::CUDAGuard guard(out.device());
  int64_t nparts = std::max<int64_t>(1, (N + kCThreads - 1) / kCThreads);
  for (int64_t i = 0; i < C; ++i) {
    TORCH_CHECK(values[i].device() == out.device() && values[i].scalar_type() == at::kFloat && values[i].dim() == 1 &&
                    values[i].is_contiguous(),
                op, ": values[", i, "] must be a contiguous 1-D float32 tensor on ", out.device());
    TORCH_CHECK(indices[i].device() == out.device() && indices[i].scalar_type() == at::kLong &&
                    indices[i].dim() == 1 && indices[i].is_contiguous() && indices[i].numel() == values[i].numel(),
                op, ": indices[", i, "] must be a contiguous 1-D int64 tensor as long as values[", i, "]");
    // The indices' range and order are the ops layer's check (ops.compressed.check_reply,
    // on the host copy a reply arrives in): reading them here would synchronise.
    nparts = std::max<int64_t>(nparts, (values[i].numel() + kCThreads - 1) / kCThreads);
  }
  const Common c = common(weights, C, gamma, gamma_tensor, out, N, skip, op);
  Tensor part = at::zeros({(C + 1) * nparts}, out.options());
  Tensor acc = at::zeros({N}, out.options());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(out.device().index()).stream();
  for (int64_t i = 0; i < C; ++i) {
    const int64_t k = values[i].numel();
    if (k == 0) continue;
    topk_scatter_kernel<<<(k + kCThreads - 1) / kCThreads, kCThreads, 0, stream>>>(
        values[i].const_data_ptr<float>(), indices[i].const_data_ptr<int64_t>(), c.w.const_data_ptr<float>(),
        acc.data_ptr<float>(), part.data_ptr<float>(), i, k, nparts, N);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (N > 0) {
    topk_finish_kernel<<<(N + kCThreads - 1) / kCThreads, kCThreads, 0, stream>>>(
        acc.const_data_ptr<float>(), out.data_ptr<float>(), part.data_ptr<float>() + C * nparts, skip_ptr(c),
        gamma_ptr(c), c.gamma_value, N);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return finish(part, C, nparts, c, stream);
}

}  // namespace fedopt::cuda

TORCH_LIBRARY_IMPL(fedopt_C, CUDA, m) {
  m.impl("block_decode_aggregate", TORCH_FN(fedopt::cuda::block_decode_aggregate));
  m.impl("topk_decode_aggregate", TORCH_FN(fedopt::cuda::topk_decode_aggregate));
}
