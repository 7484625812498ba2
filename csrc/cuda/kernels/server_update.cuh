// CUDA kernel (device code and host launcher, torch-free) of the server optimizer step `fedopt_C::server_update_` (schema:
// csrc/registration.cpp; formulas: fedopt/math.h server_update_*, shared with the CPU
// kernel; oracle: python_ref/server_optimizers.py).  FedAvg / FedExP (rule sgd),
// FedAvgM / ASNES (momentum, optionally Nesterov), FedAdagrad / FedAdam / FedYogi
// (adaptive) in ONE launch over all tensors of a call, in place.
//
// Traffic per element, in words: sgd 3 (read x, D; write x), momentum 5 (+ read/write
// b), adaptive 7 (+ read/write m and v).  D (the round's mean update) is in the acc
// dtype (fp32, fp64 for fp64 params); x, b = m and v are in the params' dtype.  The
// step is purely elementwise: nothing is reduced, so the result does not depend on the
// chunking or the launch shape and is deterministic.
//
// Work layout: the chunk rows of fedopt/chunks.h (the one layout and chunk rule of every
// multi-tensor launcher, shared with the Triton backend): one block per chunk, each row
// [x, D, m, v, len, 0, flags, 0] holding the ADDRESSES of the chunk's first x, D, m, v
// element (m, v 0 where the rule has no such state), so a block finds its data with one
// 64-byte read and no indirection through per-tensor arrays.  The rows come from the
// device table cache (fedopt/table_cache.h): uploaded once per distinct set of tensors
// (pinned host copy, non_blocking, no host sync), found again by content, so the list
// form is capturable into a CUDA graph after one warm-up call.  The chunking changes no
// result: the step is elementwise.
//
// Vectorisation: V = 16 / sizeof(param) elements per thread step (8 fp16/bf16, 4 fp32,
// 2 fp64), so x, m and v move in one 16-byte load/store each and D (acc, at least as
// wide) in one or two.  Decided PER CHUNK from the addresses themselves, because the
// updates are views into one flat [N] vector at arbitrary element offsets (only 4- or
// 8-byte aligned as soon as a tensor before them has a size that is not a multiple of
// 4 fp32 / 2 fp64 elements) while params and state normally come from the allocator:
//   * x, m, v and D 16-byte aligned: all vector loads/stores;
//   * x, m, v aligned, D not: x, m, v vectors, D with V scalar loads per step at the
//     same positions (the lanes of a warp touch the same sectors as the vector load
//     would, so DRAM traffic is unchanged; only the load instruction count grows);
//   * otherwise (views of a flat param buffer): scalar loads/stores throughout.
// The row's flags bit 0 (kChunkAligned16) says "all four"; the x/m/v-only case is
// tested on the row's addresses.  The branch is block-uniform and taken once per chunk,
// never inside the element loop.  Chunk starts are multiples of kMinChunk, itself a
// multiple of every V, so a chunk inherits its tensor's alignment; the < V elements at a
// chunk's end take the scalar loop.
//
// Arithmetic: the rule (and nesterov) are template parameters, so math.h's tests of
// them fold away and the element loop is straight-line code; 6 instantiations per
// dtype.  The formulas are evaluated with acc_t = Unfused<float|double>
// (cuda_utils.cuh): every operation separately rounded as the contract and the CPU
// kernels do, no FMA contraction; division and sqrt are IEEE round-to-nearest.  The
// stored values are rounded to the params' dtype by round-to-nearest-even conversions,
// as torch's .to() does.
//
// Device-side scalars: lr_tensor / gamma_tensor (0-d acc) and skip (0-d bool) are read
// inside the kernel, never with .item(): every block first reads skip and returns
// before writing anything when it is true (block-uniform), so a skipped step keeps
// every bit of params and state without a host sync.
//
// This header includes no torch: csrc/cuda/server_update.cu (the ATen binding: argument
// checks, the chunk rows and their device table) and tools/gpu_harness (a plain CUDA
// program) both launch the kernel through launch_server_update.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "fedopt/chunks.h"
#include "fedopt/cuda_utils.cuh"
#include "fedopt/math.h"

namespace fedopt {
namespace cuda {

template <typename acc_t>
struct ServerArgs {
  const int64_t* rows;  // [gridDim.x, kChunkRowWords] (fedopt/chunks.h)
  acc_t lr, gamma, beta1, beta2, tau;
  const acc_t* lr_ptr;     // when set: lr = *lr_ptr (read on the device)
  const acc_t* gamma_ptr;  // when set: gamma = *gamma_ptr
  const bool* skip;        // when set and true: nothing is written
};

template <ServerRule R>
constexpr bool kHasM = R != ServerRule::kSgd;
template <ServerRule R>
constexpr bool kHasV = R != ServerRule::kSgd && R != ServerRule::kMomentum;

// One element through math.h.  m and v are only touched by the rules that have them
// (they are not even loaded otherwise).
template <ServerRule R, typename acc_t>
__device__ __forceinline__ void server_step(acc_t& x, acc_t d, acc_t& m, acc_t& v,
                                            const ServerParams<Unfused<acc_t>>& p) {
  Unfused<acc_t> xu(x);
  if constexpr (R == ServerRule::kSgd) {
    server_update_sgd(xu, Unfused<acc_t>(d), p);
  } else if constexpr (R == ServerRule::kMomentum) {
    Unfused<acc_t> bu(m);
    server_update_momentum(xu, Unfused<acc_t>(d), bu, p);
    m = bu.v;
  } else {
    Unfused<acc_t> mu(m), vu(v);
    server_update_adaptive(xu, Unfused<acc_t>(d), mu, vu, p);
    m = mu.v;
    v = vu.v;
  }
  x = xu.v;
}

// The vectorised part of a chunk (x, m, v 16-byte aligned; D too when kVecD): thread t
// takes the V-element steps t, t + 256, ...  Returns the number of elements done.
template <ServerRule R, bool kVecD, typename scalar_t, typename acc_t>
__device__ __forceinline__ int64_t server_chunk_vec(scalar_t* __restrict__ x, const acc_t* __restrict__ d,
                                                    scalar_t* __restrict__ m, scalar_t* __restrict__ v,
                                                    int64_t len, const ServerParams<Unfused<acc_t>>& p) {
  constexpr int V = vec16<scalar_t>();
  const int64_t nvec = len / V;
  for (int64_t i = threadIdx.x; i < nvec; i += kThreads) {
    const int64_t e = i * V;
    acc_t xv[V], dv[V], mv[V], vv[V];
    load_vec<V>(x + e, xv);
    if constexpr (kVecD) {
      load_vec<V>(d + e, dv);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) dv[j] = load_one<acc_t>(d + e + j);
    }
    if constexpr (kHasM<R>) load_vec<V>(m + e, mv);
    if constexpr (kHasV<R>) load_vec<V>(v + e, vv);
#pragma unroll
    for (int j = 0; j < V; ++j) server_step<R>(xv[j], dv[j], mv[j], vv[j], p);
    store_vec<V>(x + e, xv);
    if constexpr (kHasM<R>) store_vec<V>(m + e, mv);
    if constexpr (kHasV<R>) store_vec<V>(v + e, vv);
  }
  return nvec * V;
}

template <typename scalar_t, ServerRule R, bool kNesterov>
__global__ void __launch_bounds__(kThreads) server_update_kernel(const ServerArgs<acc_type<scalar_t>> a) {
  using acc_t = acc_type<scalar_t>;
  // First, before anything else is read: a skipped step writes nothing (block-uniform).
  if (a.skip != nullptr && *global_ptr(a.skip)) return;
  const int64_t* row = global_ptr(a.rows + static_cast<int64_t>(blockIdx.x) * kChunkRowWords);
  const int64_t cx = row[kRowPtr0 + 0], cd = row[kRowPtr0 + 1], cm = row[kRowPtr0 + 2], cv = row[kRowPtr0 + 3];
  const int64_t len = row[kRowLen];
  const bool all_aligned = (row[kRowFlags] & kChunkAligned16) != 0;

  ServerParams<Unfused<acc_t>> p;
  p.lr = a.lr_ptr != nullptr ? *global_ptr(a.lr_ptr) : a.lr;
  p.gamma = (R == ServerRule::kSgd && a.gamma_ptr != nullptr) ? *global_ptr(a.gamma_ptr) : a.gamma;
  p.beta1 = a.beta1;
  p.beta2 = a.beta2;
  p.tau = a.tau;
  p.nesterov = kNesterov;  // compile-time constants: math.h's branches on them fold away
  p.rule = R;

  scalar_t* __restrict__ x = reinterpret_cast<scalar_t*>(cx);
  const acc_t* __restrict__ d = reinterpret_cast<const acc_t*>(cd);
  scalar_t* __restrict__ m = kHasM<R> ? reinterpret_cast<scalar_t*>(cm) : nullptr;
  scalar_t* __restrict__ v = kHasV<R> ? reinterpret_cast<scalar_t*>(cv) : nullptr;

  int64_t done = 0;
  const int64_t state_addr = cx | (kHasM<R> ? cm : 0) | (kHasV<R> ? cv : 0);
  if (all_aligned) {
    done = server_chunk_vec<R, true>(x, d, m, v, len, p);
  } else if ((state_addr & (kAlignBytes - 1)) == 0) {
    done = server_chunk_vec<R, false>(x, d, m, v, len, p);
  }
  for (int64_t e = done + threadIdx.x; e < len; e += kThreads) {
    acc_t xe = load_one<acc_t>(x + e), me, ve;
    if constexpr (kHasM<R>) me = load_one<acc_t>(m + e);
    if constexpr (kHasV<R>) ve = load_one<acc_t>(v + e);
    server_step<R>(xe, load_one<acc_t>(d + e), me, ve, p);
    store_one(x + e, xe);
    if constexpr (kHasM<R>) store_one(m + e, me);
    if constexpr (kHasV<R>) store_one(v + e, ve);
  }
}

// The host launcher: one block per chunk row of `a.rows` (num_chunks > 0 rows in device
// memory), rule and nesterov turned into template parameters.  Returns the launch error.
template <typename scalar_t, ServerRule R, bool kNesterov>
cudaError_t launch_server_rule(const ServerArgs<acc_type<scalar_t>>& a, int64_t num_chunks, cudaStream_t stream) {
  server_update_kernel<scalar_t, R, kNesterov>
      <<<dim3(static_cast<unsigned int>(num_chunks)), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t launch_server_update(const ServerArgs<acc_type<scalar_t>>& a, int64_t num_chunks, ServerRule r,
                                 bool nesterov, cudaStream_t stream) {
  switch (r) {
    case ServerRule::kSgd: return launch_server_rule<scalar_t, ServerRule::kSgd, false>(a, num_chunks, stream);
    case ServerRule::kMomentum:
      return nesterov ? launch_server_rule<scalar_t, ServerRule::kMomentum, true>(a, num_chunks, stream)
                      : launch_server_rule<scalar_t, ServerRule::kMomentum, false>(a, num_chunks, stream);
    case ServerRule::kAdagrad: return launch_server_rule<scalar_t, ServerRule::kAdagrad, false>(a, num_chunks, stream);
    case ServerRule::kAdam: return launch_server_rule<scalar_t, ServerRule::kAdam, false>(a, num_chunks, stream);
    case ServerRule::kYogi: return launch_server_rule<scalar_t, ServerRule::kYogi, false>(a, num_chunks, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace fedopt
