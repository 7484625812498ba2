// CUDA kernel (device code and host launcher, torch-free) of fedopt_C::coordinate_select (schema and semantics:
// csrc/registration.cpp; the CPU twin: csrc/cpu/robust_select.cpp; oracle:
// python_ref/robust.py).
//
// One pass over the kept clients: thread j owns column j.  It reads the kept clients'
// values of that column in client order (adjacent threads read adjacent columns of each
// row: coalesced) and inserts each into a sorted array in local memory (an insertion
// sort: stable, no comparisons across threads; NaN orders after every number, as
// torch.sort and python_ref/robust.py order it), then reduces the sorted values exactly
// as the CPU kernel does -- mode 0: the mean of v[k .. m-k) with k = min(count,
// (m-1)/2); mode 1: the mean of the `count` values closest to the median, found by
// dropping the farther end (the upper one on a tie).  Sums run in ascending order in
// the acc dtype: deterministic, independent of the launch shape.
//
// A kept client holding a NaN/Inf is flagged with an integer atomicOr (the flags are
// exact whatever the order).  `keep`, `count` and `skip` are read on the device: no
// host sync.  The local array holds kMaxClients values: more clients are refused by
// name (the ops layer checks C first).
//
// Not tuned: insertion sort costs O(m^2) per column, which for m = 20 is a few hundred
// instructions per element -- measured on no GPU here (this machine has none); a
// register sorting network per warp is the obvious next step.
//
// This header includes no torch: csrc/cuda/robust_select.cu (the ATen binding) and
// tools/gpu_harness (a plain CUDA program) both launch it through
// launch_coordinate_select.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

#include "fedopt/cuda_utils.cuh"

namespace fedopt {
namespace cuda {

constexpr int kSelectThreads = 256;

// x goes before y: ascending, NaN after every number (+inf included).  A plain `x < y`
// is false both ways for a NaN, so the insertion sort left a kept client's NaN where it
// was inserted and the trimmed window differed from python_ref's (found on the PTX
// simulator, issue 40).
template <typename acc_t>
__device__ __forceinline__ bool nan_last_less(acc_t x, acc_t y) {
  return x < y || (y != y && x == x);
}

template <int MAXC, typename scalar_t, typename acc_t, typename out_t>
__global__ void coordinate_select_kernel(const scalar_t* __restrict__ X, const bool* __restrict__ keep,
                                         const int64_t* __restrict__ count_ptr, int mode, int64_t C, int64_t N,
                                         out_t* __restrict__ out, int* __restrict__ bad,
                                         const bool* __restrict__ skip) {
  if (skip != nullptr && *skip) return;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= N) return;
  const acc_t big = std::numeric_limits<acc_t>::max();
  acc_t v[MAXC];
  int64_t m = 0;
  for (int64_t i = 0; i < C; ++i) {
    if (!keep[i]) continue;
    const acc_t x = static_cast<acc_t>(X[i * N + j]);
    if (!(fabs(x) <= big)) atomicOr(bad + i, 1);
    int64_t p = m;
    while (p > 0 && nan_last_less(x, v[p - 1])) {
      v[p] = v[p - 1];
      --p;
    }
    v[p] = x;
    ++m;
  }
  const int64_t count = *count_ptr;
  acc_t res = 0;
  if (m > 0 && mode == 0) {
    const int64_t k = count < (m - 1) / 2 ? count : (m - 1) / 2;
    for (int64_t i = k; i < m - k; ++i) res += v[i];
    res /= static_cast<acc_t>(m - 2 * k);
  } else if (m > 0) {
    const int64_t beta = count < 1 ? 1 : (count > m ? m : count);
    const acc_t med = m % 2 ? v[(m - 1) / 2] : (v[m / 2 - 1] + v[m / 2]) / acc_t(2);
    int64_t lo = 0, hi = m - 1;
    while (hi - lo + 1 > beta) {
      if (fabs(v[lo] - med) > fabs(v[hi] - med)) {
        ++lo;
      } else {
        --hi;
      }
    }
    for (int64_t i = lo; i <= hi; ++i) res += v[i];
    res /= static_cast<acc_t>(beta);
  }
  out[j] = static_cast<out_t>(res);
}

constexpr int64_t kMaxClients = 1024;  // the local array's size for the largest C

// The host launcher: X is [C, N] (C <= kMaxClients) row-major on the device, keep [C],
// *count one int64, out [N] (the clients' dtype or acc), bad [C] ints set to non-zero
// for a kept client holding a non-finite value (zero them first).  N == 0 launches
// nothing.  Returns the launch error.
template <typename scalar_t, typename out_t>
cudaError_t launch_coordinate_select(const scalar_t* X, const bool* keep, const int64_t* count, int mode, int64_t C,
                                     int64_t N, out_t* out, int* bad, const bool* skip, cudaStream_t stream) {
  using acc_t = acc_type<scalar_t>;
  if (N == 0) return cudaSuccess;
  const int64_t blocks = (N + kSelectThreads - 1) / kSelectThreads;
  if (C <= 32) {
    coordinate_select_kernel<32, scalar_t, acc_t, out_t>
        <<<blocks, kSelectThreads, 0, stream>>>(X, keep, count, mode, C, N, out, bad, skip);
  } else if (C <= 128) {
    coordinate_select_kernel<128, scalar_t, acc_t, out_t>
        <<<blocks, kSelectThreads, 0, stream>>>(X, keep, count, mode, C, N, out, bad, skip);
  } else {
    coordinate_select_kernel<kMaxClients, scalar_t, acc_t, out_t>
        <<<blocks, kSelectThreads, 0, stream>>>(X, keep, count, mode, C, N, out, bad, skip);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace fedopt
