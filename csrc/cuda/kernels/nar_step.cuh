// CUDA kernels of the FedNAR step (device code and host launcher, torch-free): `fedopt_C::nar_step_` (a list of tensors forming one
// group) and `fedopt_C::nar_step_batched_` (the rows of [C, N] tensors, one group per
// row).  Formulas: python_ref/fednar.py; every value decision goes
// through fedopt/math.h, shared with the CPU kernels.
//
// Two launches per step, whatever the number of tensors or rows:
//
//  1. nar_norm_kernel: block b reduces chunk b to ONE partial sum of squares of the
//     clipped-on vector (g + wd x in mode co, g otherwise; g unscaled by grad_scale),
//     written to partials[b].  No atomics.
//  2. nar_update_kernel: block b first combines the partials of ITS chunk's group
//     [pbegin, pend) in a fixed order (thread t adds partials pbegin+t, +256, ... in
//     order, then the fixed-tree block_sum), so every block of a group computes the
//     bitwise same norm, hence the same scale and the same skip decision.  It then
//     updates its chunk in place, or writes nothing at all when the group is skipped
//     (non-finite norm or found_inf), which keeps skipped params/buffers bit-identical.
//     The first block of each group (blockIdx.x == pbegin) writes the group's stats.
//
// Why a redundant per-block combine instead of a third "finalize" launch: a launch
// costs a few microseconds of stream time, which is the whole budget of a small model's
// step, while the combine reads partials that are hot in L2.  Its cost is bounded by
// the chunk rule (fedopt/chunks.h: a group has at most ~kTargetChunks = 1024 full chunks
// plus one tail chunk per tensor, under 800 for the 62 tensors of ResNet-18), i.e. a few
// loads per thread and ~1% extra (L2) traffic over the 5 words per element of the step.
//
// Finalize pass: the combine costs partials^2 over a group (every block re-reads all of
// them), which the tail chunks make large for lists of thousands of small tensors.
// When a group has more than kMaxRedundantPartials (4096) partials, the launcher adds
// nar_group_sum_kernel between the two passes: ONE block per group runs exactly the
// combine loop and block_sum of the update kernel and writes sums[group], and the
// update kernel reads sums[group] instead (the mechanism nar_apply_'s `sq_norm` uses).
// The same loop over the same partials gives the bitwise same sum, so the choice never
// changes a result.  It is decided on the host from metadata only (the row counts of
// the table).  For tests, the environment variable FEDOPT_MAX_REDUNDANT_PARTIALS (a
// non-negative integer, read at every call) replaces the threshold: 0 forces the
// finalize pass, a large value the redundant combine.
//
// Work layout: nar_step_ walks chunk rows (fedopt/chunks.h): [x, g, b, 0, len, group,
// flags, 0] with the chunk's own addresses, plus each group's partial range; the blob
// comes from the device table cache (fedopt/table_cache.h): uploaded once per distinct
// set of tensors, found again by content, capturable into a CUDA graph after one
// warm-up call.  nar_step_batched_ needs no table: chunk b of row r is computed
// arithmetically (rows are contiguous), with the same chunk rule on n = N.
//
// nar_sq_norm / nar_apply_ (one norm over several calls, ops.nar_step_groups_) reuse
// the kernels: nar_sq_norm runs the norm kernel and then nar_group_sum_kernel over its
// one group (the combine loop again), so sqrt of its result is bitwise the norm
// nar_step_ would use; nar_apply_ runs the update kernel reading its norm^2 from
// `sq_norm` instead of combining.
//
// Vectorisation is decided PER CHUNK, per block, inside one kernel: a chunk whose
// addresses are all 16-byte aligned (list form: flags bit 0 of its row; batched: the
// addresses base + (row * N + start) * esize computed in the kernel) runs the 16-byte
// body, any other chunk the scalar body, so one misaligned view only slows its own
// chunks.  The result does not depend on the body: the norm kernel's scalar body
// visits the elements in the vector body's order (thread t takes the V-element groups
// t, t + 256, ... and adds their V terms in order, then the same < V tail), so a
// chunk's partial is bitwise the same on both; the update is elementwise.  Both need
// the same arithmetic in both bodies as well: nvcc contracts a * b + c into an FMA per
// inlined copy, and once fused FedNAR's grad/none direction one way in the vector
// body and the other way in the scalar one (issue 47).  So every operation is spelled
// (math.h's rn::add/sub/mul/div, rn::fma for the sum of squares), and
// tests/test_cuda_fp_contraction.py checks the PTX of both bodies.
//
// This header includes no torch: csrc/cuda/nar_step.cu (the ATen binding: argument
// checks, allocations, the table cache) and tools/gpu_harness (a plain CUDA program)
// both launch the kernels through launch_nar below.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "fedopt/chunks.h"
#include "fedopt/cuda_utils.cuh"
#include "fedopt/math.h"

namespace fedopt {
namespace cuda {

// Where the chunks are.  List mode (rows != null): chunk b is row b of the chunk rows,
// its group's partial range in `ranges`.  Rows mode: chunk b is chunk (b % row_chunks)
// of row (b / row_chunks) of contiguous [C, row_len] tensors.
struct NarLayout {
  const int64_t* rows = nullptr;    // [num_chunks, kChunkRowWords]
  const int64_t* ranges = nullptr;  // [num_groups, 2]: [pbegin, pend)
  int64_t x_base = 0, g_base = 0, b_base = 0;  // rows mode addresses; b_base 0 without momentum
  int64_t row_len = 0, row_chunks = 0, chunk_size = 0;
};

template <typename acc_t>
struct NarArgs {
  NarLayout w;
  acc_t* partials;  // [num_chunks]: written by the norm kernel, read by the update kernel
  acc_t lr, weight_decay, max_norm, momentum;
  const acc_t* lr_ptr;  // when set: lr of group k = lr_ptr[k * lr_stride]
  int64_t lr_stride;
  const acc_t* wd_ptr;
  int64_t wd_stride;
  const acc_t* grad_scale;  // null: 1
  const void* found_inf;    // null: never
  int found_kind;
  int64_t mode;
  acc_t* norm_out;  // [num_groups]
  acc_t* scale_out;
  bool* skipped_out;
  int64_t num_groups;
  // When set, norm^2 of group k is group_sq[k] (finalize pass, or nar_apply_'s sq_norm
  // for its one group) and the update kernel does not combine partials.
  const acc_t* group_sq = nullptr;
  acc_t* sums_out = nullptr;  // nar_group_sum_kernel's destination
};

template <typename scalar_t>
struct ChunkView {
  scalar_t* x;
  const scalar_t* g;
  scalar_t* b;  // null without momentum
  int64_t len, group, pbegin, pend;
  bool vec;  // every address 16-byte aligned: the 16-byte body
};

__device__ __forceinline__ void group_range(const NarLayout& w, int64_t group, int64_t& pbegin, int64_t& pend) {
  if (w.rows != nullptr) {
    pbegin = *global_ptr(w.ranges + 2 * group);
    pend = *global_ptr(w.ranges + 2 * group + 1);
  } else {
    pbegin = group * w.row_chunks;
    pend = pbegin + w.row_chunks;
  }
}

template <typename scalar_t, typename acc_t>
__device__ __forceinline__ ChunkView<scalar_t> locate_chunk(const NarArgs<acc_t>& a, int64_t blk) {
  ChunkView<scalar_t> v;
  const NarLayout& w = a.w;
  if (w.rows != nullptr) {
    const int64_t* r = global_ptr(w.rows + blk * kChunkRowWords);
    v.x = reinterpret_cast<scalar_t*>(r[kRowPtr0 + 0]);
    v.g = reinterpret_cast<const scalar_t*>(r[kRowPtr0 + 1]);
    const int64_t b = r[kRowPtr0 + 2];
    v.b = b != 0 ? reinterpret_cast<scalar_t*>(b) : nullptr;
    v.len = r[kRowLen];
    v.group = r[kRowGroup];
    v.vec = (r[kRowFlags] & kChunkAligned16) != 0;
  } else {
    const int64_t row = blk / w.row_chunks;
    const int64_t start = (blk - row * w.row_chunks) * w.chunk_size;
    const int64_t rest = w.row_len - start;
    v.len = rest < w.chunk_size ? rest : w.chunk_size;
    v.group = row;
    const int64_t offset = row * w.row_len + start;
    v.x = reinterpret_cast<scalar_t*>(w.x_base) + offset;
    v.g = reinterpret_cast<const scalar_t*>(w.g_base) + offset;
    v.b = w.b_base != 0 ? reinterpret_cast<scalar_t*>(w.b_base) + offset : nullptr;
    // The chunk's own addresses decide, as a list row's flags do (a row of N elements
    // whose size in bytes is not a multiple of 16 has aligned and misaligned rows).
    const int64_t bytes = offset * static_cast<int64_t>(sizeof(scalar_t));
    const int64_t addr_or = (w.x_base + bytes) | (w.g_base + bytes) | (w.b_base != 0 ? w.b_base + bytes : 0);
    v.vec = (addr_or & (kAlignBytes - 1)) == 0;
  }
  group_range(w, v.group, v.pbegin, v.pend);
  return v;
}

template <typename acc_t>
__device__ __forceinline__ NarParams<acc_t> group_params(const NarArgs<acc_t>& a, int64_t group) {
  NarParams<acc_t> p;
  p.lr = a.lr_ptr != nullptr ? a.lr_ptr[group * a.lr_stride] : a.lr;
  p.weight_decay = a.wd_ptr != nullptr ? a.wd_ptr[group * a.wd_stride] : a.weight_decay;
  p.momentum = a.momentum;
  p.inv_grad_scale = a.grad_scale != nullptr ? acc_t(1) / *a.grad_scale : acc_t(1);
  p.mode = static_cast<NarMode>(a.mode);
  return p;
}

// This thread's share of the chunk's sum of squares.  Both bodies visit the elements
// in ONE order: thread t takes the V-element groups t, t + kThreads, ... (V = 16 bytes
// of scalar_t) and adds their V terms in index order, then the < V tail elements
// nvec * V + t.  kVec loads a group with 16-byte loads, !kVec with V scalar loads, so
// the partial of a chunk is bitwise independent of the body.
template <bool kVec, typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t chunk_sq(const scalar_t* __restrict__ x, const scalar_t* __restrict__ g,
                                          int64_t len, const NarParams<acc_t>& p, bool need_x) {
  constexpr int V = vec16<scalar_t>();
  const int64_t nvec = len / V;
  acc_t sq = 0;
#pragma unroll 2
  for (int64_t v = threadIdx.x; v < nvec; v += kThreads) {
    acc_t xv[V], gv[V];
    if constexpr (kVec) {
      load_vec<V>(g + v * V, gv);
      if (need_x) {
        load_vec<V>(x + v * V, xv);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) xv[j] = acc_t(0);
      }
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        gv[j] = load_one<acc_t>(g + v * V + j);
        xv[j] = need_x ? load_one<acc_t>(x + v * V + j) : acc_t(0);
      }
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const acc_t t = nar_norm_term(xv[j], nar_unscale(gv[j], p), p);
      sq = rn::fma(t, t, sq);
    }
  }
  for (int64_t e = nvec * V + threadIdx.x; e < len; e += kThreads) {
    const acc_t xe = need_x ? load_one<acc_t>(x + e) : acc_t(0);
    const acc_t t = nar_norm_term(xe, nar_unscale(load_one<acc_t>(g + e), p), p);
    sq = rn::fma(t, t, sq);
  }
  return sq;
}

// Pass 1: partials[b] = sum over chunk b of nar_norm_term(x, g / grad_scale)^2.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) nar_norm_kernel(const NarArgs<acc_type<scalar_t>> a) {
  using acc_t = acc_type<scalar_t>;
  __shared__ acc_t smem[kWarps];
  const ChunkView<scalar_t> c = locate_chunk<scalar_t>(a, blockIdx.x);
  const NarParams<acc_t> p = group_params(a, c.group);
  const bool need_x = p.mode == NarMode::kCo;  // grad/none clip on ||g||: x is not read
  acc_t sq = c.vec ? chunk_sq<true>(c.x, c.g, c.len, p, need_x)  // block-uniform branch
                   : chunk_sq<false>(c.x, c.g, c.len, p, need_x);
  sq = block_sum(sq, smem);
  if (threadIdx.x == 0) a.partials[blockIdx.x] = sq;
}

// The combine of a group's partials [pbegin, pend): thread t adds pbegin + t,
// + kThreads, ... in order, then block_sum.  The ONE loop of the update kernel and of
// nar_group_sum_kernel (so the redundant and the finalize paths agree bitwise).
template <typename acc_t>
__device__ __forceinline__ acc_t combine_partials(const acc_t* partials, int64_t pbegin, int64_t pend, acc_t* smem) {
  acc_t part = 0;
  for (int64_t i = pbegin + threadIdx.x; i < pend; i += kThreads) part += partials[i];
  return block_sum(part, smem);
}

// The in-place update of one chunk (elementwise, math.h's explicitly rounded operations:
// the result does not depend on the body).
template <bool kVec, typename scalar_t, typename acc_t>
__device__ __forceinline__ void update_chunk(scalar_t* __restrict__ x, const scalar_t* __restrict__ g,
                                             scalar_t* __restrict__ b, int64_t len, acc_t scale,
                                             const NarParams<acc_t>& p) {
  // Decided once per block, with the same test as math.h's nar_update.
  const bool has_mom = p.momentum != acc_t(0);
  int64_t done = 0;
  if constexpr (kVec) {
    constexpr int V = vec16<scalar_t>();
    const int64_t nvec = len / V;
    for (int64_t v = threadIdx.x; v < nvec; v += kThreads) {
      acc_t xv[V], gv[V];
      load_vec<V>(x + v * V, xv);
      load_vec<V>(g + v * V, gv);
      if (has_mom) {
        acc_t bv[V];
        load_vec<V>(b + v * V, bv);
#pragma unroll
        for (int j = 0; j < V; ++j) nar_update_momentum(xv[j], nar_unscale(gv[j], p), bv[j], scale, p);
        store_vec<V>(b + v * V, bv);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) nar_update_plain(xv[j], nar_unscale(gv[j], p), scale, p);
      }
      store_vec<V>(x + v * V, xv);
    }
    done = nvec * V;
  }
  for (int64_t e = done + threadIdx.x; e < len; e += kThreads) {  // coalesced scalar loop
    acc_t xe = load_one<acc_t>(x + e);
    const acc_t ge = nar_unscale(load_one<acc_t>(g + e), p);
    if (has_mom) {
      acc_t be = load_one<acc_t>(b + e);
      nar_update_momentum(xe, ge, be, scale, p);
      store_one(b + e, be);
    } else {
      nar_update_plain(xe, ge, scale, p);
    }
    store_one(x + e, xe);
  }
}

// Pass 2: combine the group's partials (or read group_sq), decide scale/skip (math.h),
// update the chunk.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) nar_update_kernel(const NarArgs<acc_type<scalar_t>> a) {
  using acc_t = acc_type<scalar_t>;
  __shared__ acc_t smem[kWarps];
  const ChunkView<scalar_t> c = locate_chunk<scalar_t>(a, blockIdx.x);
  const NarParams<acc_t> p = group_params(a, c.group);

  const acc_t sumsq =
      a.group_sq != nullptr ? a.group_sq[c.group] : combine_partials(a.partials, c.pbegin, c.pend, smem);
  const acc_t norm = device_sqrt(sumsq);
  const acc_t scale = nar_clip_scale(norm, a.max_norm, p.mode);
  const bool skip = nar_skip(norm, read_found_inf(a.found_inf, a.found_kind));
  if (threadIdx.x == 0 && static_cast<int64_t>(blockIdx.x) == c.pbegin) {
    a.norm_out[c.group] = norm;
    a.scale_out[c.group] = scale;
    a.skipped_out[c.group] = skip;
  }
  if (skip) return;  // block-uniform: nothing of this group is written
  if (c.vec) {       // block-uniform
    update_chunk<true>(c.x, c.g, c.b, c.len, scale, p);
  } else {
    update_chunk<false>(c.x, c.g, c.b, c.len, scale, p);
  }
}

// sums_out[k] = the combine of group k's partials: one block per group (finalize pass
// of nar_step_ / nar_step_batched_, and nar_sq_norm's sum over its one group).
template <typename acc_t>
__global__ void __launch_bounds__(kThreads) nar_group_sum_kernel(const NarArgs<acc_t> a) {
  __shared__ acc_t smem[kWarps];
  const int64_t group = blockIdx.x;
  int64_t pbegin, pend;
  group_range(a.w, group, pbegin, pend);
  const acc_t s = combine_partials(a.partials, pbegin, pend, smem);
  if (threadIdx.x == 0) a.sums_out[group] = s;
}

// Stats of groups without elements (launched only when the call has no chunk at all,
// which is the only way a group of these ops can be empty): norm 0 (nar_apply_:
// sqrt(sq_norm)), its clip scale, skipped iff found_inf (or the norm is not finite).
template <typename acc_t>
__global__ void __launch_bounds__(kThreads) nar_empty_stats_kernel(const NarArgs<acc_t> a) {
  const int64_t group = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (group >= a.num_groups) return;
  const acc_t norm = a.group_sq != nullptr ? device_sqrt(a.group_sq[group]) : acc_t(0);
  a.norm_out[group] = norm;
  a.scale_out[group] = nar_clip_scale(norm, a.max_norm, static_cast<NarMode>(a.mode));
  a.skipped_out[group] = nar_skip(norm, read_found_inf(a.found_inf, a.found_kind));
}

// Which passes run: both (nar_step_, nar_step_batched_), the norm only (nar_sq_norm),
// or the update only with the norm given (nar_apply_).
enum class NarPhase { kStep, kNormOnly, kApply };

// The host launcher of the FedNAR kernels: every pass of one call, queued on `stream`.
// `a` holds device pointers only (partials: num_chunks values, unless kApply; sums:
// num_groups values when `finalize`).  num_chunks == 0 launches the stats of empty
// groups only.  `finalize`: the one-block-per-group sum pass (kStep only; the binding
// decides it from the table's metadata, see max_redundant_partials).  Returns the
// first launch error (cudaGetLastError after each launch), cudaSuccess otherwise.
template <typename scalar_t>
cudaError_t launch_nar(NarArgs<acc_type<scalar_t>> a, int64_t num_chunks, NarPhase phase, bool finalize,
                       acc_type<scalar_t>* sums, cudaStream_t stream) {
  using acc_t = acc_type<scalar_t>;
  cudaError_t err = cudaSuccess;
  if (num_chunks == 0) {
    const dim3 grid(static_cast<unsigned int>((a.num_groups + kThreads - 1) / kThreads));
    nar_empty_stats_kernel<acc_t><<<grid, kThreads, 0, stream>>>(a);
    return cudaGetLastError();
  }
  const dim3 grid(static_cast<unsigned int>(num_chunks));
  const dim3 group_grid(static_cast<unsigned int>(a.num_groups));
  if (phase != NarPhase::kApply) {
    nar_norm_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(a);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (phase == NarPhase::kNormOnly) {  // the group's sum of squares into norm_out
    a.sums_out = a.norm_out;
    nar_group_sum_kernel<acc_t><<<group_grid, kThreads, 0, stream>>>(a);
    return cudaGetLastError();
  }
  if (phase == NarPhase::kStep && finalize) {
    a.sums_out = sums;
    nar_group_sum_kernel<acc_t><<<group_grid, kThreads, 0, stream>>>(a);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
    a.group_sq = sums;
  }
  nar_update_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace fedopt
