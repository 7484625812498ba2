// CUDA kernels (device code and host launchers, torch-free) of the weighted aggregation (`fedopt_C::aggregate`) and of its backward
// (`fedopt_C::client_dots`).  Formulas: python_ref/aggregation.py.
//
// One pass over the data (each client read once, out written once):
//
//  * rows_kernel: the columns [0, N) are cut into tiles of T threads x U vectors of 16
//    bytes (T * U * V columns, V = 16 / sizeof(client dtype)); block b owns the tiles
//    b, b + nb, b + 2 nb, ...  For each tile it loops over the clients in order, keeps
//    the weighted column sums in registers (aggregate) or the tile of g (client_dots),
//    and reduces each client's tile contribution (x^2 or x*g) with a fixed warp shuffle
//    tree; warp sums are staged in shared memory for a batch of 32 clients, then thread
//    k < 32 adds the T / 32 warp sums of client i0+k in warp order and accumulates them
//    into partials[i][b] (only that thread of block b ever touches that slot, so a plain
//    read-modify-write, no atomics).  Aggregate then writes out = gamma * sum for the
//    tile and accumulates ||sum||^2 of its valid columns, reduced per block into
//    partials[C][b].
//  * finalize_rows_kernel: block r adds partials[r][0..nb) in a fixed order (strided
//    per thread, then block_sum) into client_sq_norms[r] / sq_norm (or dots[r]).
//  * DP noise (aggregate with noise_key; rows_kernel's kNoise): as a tile is stored,
//    out[j] = gamma * sum[j] + std * normal(key, j) (include/fedopt/gaussian_noise.h:
//    Philox4x32-10 of the column index, Box-Muller by fixed polynomials, every step a
//    correctly rounded __f*_rn), std read on the device when given as a tensor: the same
//    bits as the CPU kernels and python_ref/gaussian_noise.py.  ||sum||^2 is that of the
//    sum without noise.  add_noise_kernel is the same noise as a separate in-place pass.
//
// Tiling rule (aggregate_tiling): the tile shape is chosen from N and the dtype ONLY,
// never from the device (SM count), so the partial sums, hence the results, are
// bitwise the same on every GPU.  Candidates, largest tile first:
//
//     threads x vectors   fp16/bf16 columns   fp32 columns   fp64 columns
//       256   x   2             4096              2048           1024
//       256   x   1             2048              1024            512
//       128   x   1             1024               512            256
//        64   x   1              512               256            128
//        32   x   1              256               128             64
//
// The first candidate that gives at least kMinBlocks = 256 tiles is taken (so the
// largest N keep the old 256 x 2 tiles: 8 KiB per client per tile), else the last one;
// nb = min(tiles, 1024).  Examples (fp32): N = 62,000 (C = 100, a small CNN) -> 32 x 1,
// 485 blocks (was 31 blocks of 2048 columns on a 132-SM H100); N = 200,000 -> 128 x 1,
// 391 blocks; N = 600,000 -> 256 x 2, 293 blocks; N = 11.7M (ResNet-18) -> 256 x 2,
// 1024 blocks of ~5.6 tiles each.  fp16 N = 62,000 -> 32 x 1, 243 blocks.
//
// Latency: a thread loads its vectors of several clients before it reduces any of them
// (a group of UC clients: at most 8 and at most 128 bytes of acc values, e.g. 4 for fp32
// 256 x 2 tiles, 8 for fp32 32 x 1 tiles, 2 for fp16 256 x 2 tiles), so a warp
// has UC client loads in flight instead of one; with C = 100 and a small N the kernel
// is bound by the number of dependent memory round trips per warp, not by the block
// count alone.  The clients of a batch are still reduced one after the other in order,
// so this changes no result.  A list's client addresses and the weights of a batch are
// read once per warp (lane k holds client i0 + k) and passed by shuffles.
//
// Columns: slot j = u * V + r of thread t is column tile0 + (u * T + t) * V + r, whether
// the loads are 16-byte vectors or scalars (misaligned clients, out or g, or a [C, N]
// whose row length in bytes is not a multiple of 16: a per-call decision, as one
// misaligned client makes every tile misaligned), so the sums do not depend on
// alignment.  A client with weight exactly 0 is never multiplied (no 0 * nan in out)
// but its ||X_i||^2 is still computed.  `skip` (0-d bool on the device) is read by
// the kernels: when true rows_kernel returns at once (out untouched) and the finalize
// kernel writes zeros, so there is no host sync.
//
// Clients: a [C, N] tensor (client i at base + i * N, nothing uploaded), one 1-D tensor,
// or a list of C 1-D tensors whose addresses come from the device table cache
// (fedopt/table_cache.h: uploaded once per distinct list, capturable after a warm-up).
//
// This header includes no torch: csrc/cuda/aggregate.cu (the ATen binding: argument
// checks, allocations, the table cache) and tools/gpu_harness (a plain CUDA program)
// both launch the kernels through the launchers at its end.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "aggregate_tiling.h"
#include "fedopt/cuda_utils.cuh"
#include "fedopt/gaussian_noise.h"

namespace fedopt {
namespace cuda {

constexpr int kClientBatch = 32;  // clients whose warp sums are staged before one combine
static_assert(kClientBatch == kWarpSize, "lane k of every warp holds client i0 + k of the batch");

template <typename acc_t>
struct RowsArgs {
  const int64_t* ptrs;  // client i at ptrs[i] when set, else at base + i * row_stride elements
  int64_t base;
  int64_t row_stride;
  int64_t C, N, num_tiles;
  bool aligned;  // clients, out / g and the row stride allow 16-byte accesses
  // aggregate
  const acc_t* weights;  // [C]
  acc_t gamma;
  const acc_t* gamma_ptr;  // when set, gamma = *gamma_ptr
  const bool* skip;        // when set and true: nothing is written
  void* out;               // [N] of out_t
  // DP noise (rows_kernel's kNoise): out[j] = gamma * sum[j] + std * normal(noise_key, j)
  uint64_t noise_key;
  acc_t noise_std;
  const acc_t* noise_std_ptr;  // when set, std = *noise_std_ptr
  // client_dots
  const void* g;  // [N] of other_t
  acc_t* partials;  // [rows][nb], rows = C (+ 1 for ||sum||^2 in aggregate)
};

template <typename scalar_t, typename acc_t>
__device__ __forceinline__ int64_t client_address(const RowsArgs<acc_t>& a, int64_t i) {
  return a.ptrs != nullptr ? *global_ptr(a.ptrs + i)
                           : a.base + i * a.row_stride * static_cast<int64_t>(sizeof(scalar_t));
}

// Column of slot j (= u * VEC + r) of this thread in the tile starting at tile0.
template <int VEC>
__device__ __forceinline__ int64_t tile_column(int64_t tile0, int j) {
  return tile0 + (static_cast<int64_t>(j / VEC) * blockDim.x + threadIdx.x) * VEC + j % VEC;
}

// v[j] = p[tile_column(j)] as acc_t, 0 past the end n: a 16-byte vector load per u when
// `aligned` and the vector is whole, else scalar loads of the same columns.  T may be
// wider than the VEC elements' 16 bytes (acc-dtype out/g with fp16 clients): load_vec
// then issues 2 loads.
template <int VEC, int EPT, typename T, typename acc_t>
__device__ __forceinline__ void load_tile(const T* p, int64_t tile0, int64_t n, bool aligned, acc_t (&v)[EPT]) {
#pragma unroll
  for (int u = 0; u < EPT / VEC; ++u) {
    const int64_t e = tile0 + (static_cast<int64_t>(u) * blockDim.x + threadIdx.x) * VEC;
    if (aligned && e + VEC <= n) {
      load_vec<VEC>(p + e, v + u * VEC);
    } else {
#pragma unroll
      for (int r = 0; r < VEC; ++r) v[u * VEC + r] = e + r < n ? load_one<acc_t>(p + e + r) : acc_t(0);
    }
  }
}

// p[tile_column(j)] = scale * v[j] for the columns < n.  kNoise (the DP noise):
// p[tile_column(j)] = scale * v[j] + sd * normal(key, tile_column(j)), each product and
// the sum rounded on its own (the __f*_rn / __d*_rn intrinsics of Unfused, which nvcc
// never contracts into an FMA), as the CPU kernels and python_ref compute it; the noise
// is drawn for the stored columns only.
template <int VEC, bool kNoise = false, int EPT, typename T, typename acc_t>
__device__ __forceinline__ void store_tile(T* p, int64_t tile0, int64_t n, bool aligned, const acc_t (&v)[EPT],
                                           acc_t scale, [[maybe_unused]] uint64_t key = 0,
                                           [[maybe_unused]] acc_t sd = acc_t(0)) {
  using U = Unfused<acc_t>;
#pragma unroll
  for (int u = 0; u < EPT / VEC; ++u) {
    const int64_t e = tile0 + (static_cast<int64_t>(u) * blockDim.x + threadIdx.x) * VEC;
    acc_t s[VEC];
#pragma unroll
    for (int r = 0; r < VEC; ++r) {
      if constexpr (kNoise) {
        const acc_t z = e + r < n ? static_cast<acc_t>(noise::normal(key, static_cast<uint64_t>(e + r))) : acc_t(0);
        s[r] = (U(scale) * U(v[u * VEC + r]) + U(sd) * U(z)).v;
      } else {
        s[r] = scale * v[u * VEC + r];
      }
    }
    if (aligned && e + VEC <= n) {
      store_vec<VEC>(p + e, s);
    } else {
#pragma unroll
      for (int r = 0; r < VEC; ++r)
        if (e + r < n) store_one(p + e + r, s[r]);
    }
  }
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most kThreads): as
// block_sum, with the warp count of this launch (fixed by the tiling rule).
template <typename T>
__device__ __forceinline__ T block_sum_dyn(T v, T* smem) {
  return block_sum_warps(v, smem, static_cast<int>(blockDim.x) / kWarpSize);
}

// kDots = false: aggregate (other_t = out's dtype).  kDots = true: client_dots
// (other_t = g's dtype).  kU: 16-byte vectors per thread per client per tile.  kNoise
// (aggregate only): the DP noise added as out is stored (store_tile<VEC, true>); a separate
// instantiation, so the noise-free kernel is unchanged.  Launched with blockDim.x = the
// tiling rule's threads.  See the header comment for the order.
template <typename scalar_t, typename other_t, int kU, bool kDots, bool kNoise = false>
__global__ void __launch_bounds__(kThreads) rows_kernel(const RowsArgs<acc_type<scalar_t>> a) {
  using acc_t = acc_type<scalar_t>;
  constexpr int VEC = vec16<scalar_t>();
  constexpr int EPT = VEC * kU;
  // Clients loaded together: at most 8, and at most 128 bytes (32 registers) of x values.
  constexpr int kFit = 128 / (EPT * static_cast<int>(sizeof(acc_t)));
  constexpr int UC = kFit < 1 ? 1 : (kFit > 8 ? 8 : kFit);
  static_assert(kClientBatch % UC == 0, "a group of clients never straddles a batch");
  __shared__ acc_t staged[kClientBatch][kWarps];
  __shared__ acc_t smem[kWarps];
  if (!kDots && a.skip != nullptr && *a.skip) return;  // block-uniform

  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int nwarps = static_cast<int>(blockDim.x) / kWarpSize;
  const int64_t nb = gridDim.x;
  const int64_t tile_cols = static_cast<int64_t>(blockDim.x) * EPT;
  [[maybe_unused]] acc_t gamma = acc_t(1);
  if constexpr (!kDots) gamma = a.gamma_ptr != nullptr ? *a.gamma_ptr : a.gamma;
  [[maybe_unused]] acc_t noise_std = acc_t(0);
  if constexpr (kNoise) noise_std = a.noise_std_ptr != nullptr ? *a.noise_std_ptr : a.noise_std;
  acc_t sq_sum = acc_t(0);  // this thread's share of ||sum_i w_i X_i||^2 (aggregate)

  for (int64_t tile = blockIdx.x; tile < a.num_tiles; tile += nb) {
    const int64_t tile0 = tile * tile_cols;
    const bool first = tile == static_cast<int64_t>(blockIdx.x);
    acc_t other[EPT];  // kDots: g of this tile; else: sum_i w_i x_i of this tile
    if constexpr (kDots) {
      load_tile<VEC>(static_cast<const other_t*>(a.g), tile0, a.N, a.aligned, other);
    } else {
#pragma unroll
      for (int j = 0; j < EPT; ++j) other[j] = acc_t(0);
    }
    for (int64_t i0 = 0; i0 < a.C; i0 += kClientBatch) {
      const int kb = static_cast<int>(a.C - i0 < kClientBatch ? a.C - i0 : kClientBatch);
      // Thread k < kb combines client i0 + k of this batch into its slot of partials
      // (only this thread of this block ever touches that slot).  The slot's previous
      // value is fetched now so the read overlaps the batch's loads instead of stalling
      // the block between the two barriers.
      const bool combiner = static_cast<int>(threadIdx.x) < kb;
      acc_t* slot = a.partials + (i0 + threadIdx.x) * nb + blockIdx.x;
      acc_t prev = acc_t(0);
      if (combiner && !first) prev = *slot;
      // Lane k of every warp holds client i0 + k's address and weight.
      const int64_t my_addr = lane < kb ? client_address<scalar_t>(a, i0 + lane) : 0;
      [[maybe_unused]] acc_t my_w = acc_t(0);
      if constexpr (!kDots) my_w = lane < kb ? a.weights[i0 + lane] : acc_t(0);
      for (int k0 = 0; k0 < kb; k0 += UC) {
        acc_t x[UC][EPT];
#pragma unroll
        for (int u = 0; u < UC; ++u) {  // UC clients' loads in flight together
          const int64_t addr = __shfl_sync(0xffffffffu, my_addr, k0 + u);
          if (k0 + u < kb) {
            load_tile<VEC>(reinterpret_cast<const scalar_t*>(addr), tile0, a.N, a.aligned, x[u]);
          } else {
#pragma unroll
            for (int j = 0; j < EPT; ++j) x[u][j] = acc_t(0);
          }
        }
#pragma unroll
        for (int u = 0; u < UC; ++u) {  // then reduced one client after the other, in order
          const int k = k0 + u;
          [[maybe_unused]] acc_t w = acc_t(0);
          if constexpr (!kDots) w = __shfl_sync(0xffffffffu, my_w, k);
          if (k < kb) {  // block-uniform
            acc_t s = acc_t(0);
            if constexpr (kDots) {
#pragma unroll
              for (int j = 0; j < EPT; ++j) s += x[u][j] * other[j];
            } else {
#pragma unroll
              for (int j = 0; j < EPT; ++j) s += x[u][j] * x[u][j];
              if (w != acc_t(0)) {  // weight 0 adds exactly 0: x (maybe nan) is not multiplied
#pragma unroll
                for (int j = 0; j < EPT; ++j) other[j] += w * x[u][j];
              }
            }
            s = warp_sum(s);
            if (lane == 0) staged[k][warp] = s;
          }
        }
      }
      __syncthreads();
      if (combiner) {
        acc_t t = staged[threadIdx.x][0];
        for (int w = 1; w < nwarps; ++w) t += staged[threadIdx.x][w];
        *slot = first ? t : prev + t;
      }
      __syncthreads();  // staged is rewritten by the next batch
    }
    if constexpr (!kDots) {
#pragma unroll
      for (int j = 0; j < EPT; ++j)
        if (tile_column<VEC>(tile0, j) < a.N) sq_sum += other[j] * other[j];
      store_tile<VEC, kNoise>(static_cast<other_t*>(a.out), tile0, a.N, a.aligned, other, gamma, a.noise_key,
                              noise_std);
    }
  }
  if constexpr (!kDots) {
    sq_sum = block_sum_dyn(sq_sum, smem);
    if (threadIdx.x == 0) a.partials[a.C * nb + blockIdx.x] = sq_sum;
  }
}

// dst of row r (r < C: first[r]; r == C: *second) = sum_b partials[r][b], fixed order;
// zeros when `skip` is set and true.
template <typename acc_t>
__global__ void __launch_bounds__(kThreads)
    finalize_rows_kernel(const acc_t* partials, int64_t nb, int64_t C, acc_t* first, acc_t* second,
                         const bool* skip) {
  __shared__ acc_t smem[kWarps];
  const int64_t r = blockIdx.x;
  const bool on = skip == nullptr || !*skip;
  acc_t s = acc_t(0);
  if (on)
    for (int64_t b = threadIdx.x; b < nb; b += kThreads) s += partials[r * nb + b];
  s = block_sum(s, smem);
  if (threadIdx.x == 0) {
    if (r < C)
      first[r] = s;
    else
      *second = s;
  }
}

// add_noise_: out[j] = out[j] + std * normal(key, j) (acc_t; the product and the sum
// each rounded, no FMA), grid-stride over int64 indices.  Elementwise: the launch shape
// changes no bit.  `skip` (when given and true, read here) leaves out untouched.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    add_noise_kernel(scalar_t* out, int64_t n, uint64_t key, acc_type<scalar_t> std_value,
                     const acc_type<scalar_t>* std_ptr, const bool* skip) {
  using acc_t = acc_type<scalar_t>;
  using U = Unfused<acc_t>;
  if (skip != nullptr && *skip) return;  // grid-uniform
  const acc_t sd = std_ptr != nullptr ? *std_ptr : std_value;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += stride) {
    const acc_t z = static_cast<acc_t>(noise::normal(key, static_cast<uint64_t>(j)));
    store_one(out + j, (U(load_one<acc_t>(out + j)) + U(sd) * U(z)).v);
  }
}

// ---------------------------------------------------------------------------------
// Host launchers (raw device pointers, a stream; each returns the first launch error)
// ---------------------------------------------------------------------------------

template <typename scalar_t, typename other_t, bool kDots, bool kNoise>
cudaError_t launch_rows(const RowsArgs<acc_type<scalar_t>>& a, const AggTiling& t, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned int>(t.blocks));
  const dim3 block(static_cast<unsigned int>(t.threads));
  if (t.vectors == 2)
    rows_kernel<scalar_t, other_t, 2, kDots, kNoise><<<grid, block, 0, stream>>>(a);
  else
    rows_kernel<scalar_t, other_t, 1, kDots, kNoise><<<grid, block, 0, stream>>>(a);
  return cudaGetLastError();
}

// aggregate: out (other_t: the clients' dtype or acc) = gamma * sum_i w_i X_i (+ the DP
// noise when kNoise), sq_norms[i] = ||X_i||^2, *sq_norm = ||sum_i w_i X_i||^2.  `a` is
// filled by the caller (t = aggregate_tiling(N, sizeof(scalar_t)), a.num_tiles =
// t.tiles, a.partials: (C + 1) * t.blocks values); t.blocks == 0 (N == 0) writes zeros.
template <typename scalar_t, typename other_t, bool kNoise>
cudaError_t launch_aggregate(const RowsArgs<acc_type<scalar_t>>& a, const AggTiling& t, acc_type<scalar_t>* sq_norms,
                             acc_type<scalar_t>* sq_norm, cudaStream_t stream) {
  using acc_t = acc_type<scalar_t>;
  if (t.blocks > 0) {
    const cudaError_t err = launch_rows<scalar_t, other_t, false, kNoise>(a, t, stream);
    if (err != cudaSuccess) return err;
  }
  // C + 1 rows: the clients' ||X_i||^2, then ||sum_i w_i X_i||^2 (all 0 when N == 0).
  finalize_rows_kernel<acc_t><<<dim3(static_cast<unsigned int>(a.C + 1)), kThreads, 0, stream>>>(
      a.partials, t.blocks, a.C, sq_norms, sq_norm, a.skip);
  return cudaGetLastError();
}

// client_dots: dots[i] = <X_i, g> (g of other_t: the clients' dtype or acc); a.partials
// holds C * t.blocks values.  C == 0 launches nothing.
template <typename scalar_t, typename other_t>
cudaError_t launch_client_dots(const RowsArgs<acc_type<scalar_t>>& a, const AggTiling& t, acc_type<scalar_t>* dots,
                               cudaStream_t stream) {
  using acc_t = acc_type<scalar_t>;
  if (a.C == 0) return cudaSuccess;
  if (t.blocks > 0) {
    const cudaError_t err = launch_rows<scalar_t, other_t, true, false>(a, t, stream);
    if (err != cudaSuccess) return err;
  }
  finalize_rows_kernel<acc_t><<<dim3(static_cast<unsigned int>(a.C)), kThreads, 0, stream>>>(
      a.partials, t.blocks, a.C, dots, nullptr, nullptr);
  return cudaGetLastError();
}

// add_noise_: out[j] += std * normal(key, j) for j < n, in place; std = *std_ptr when
// set, else std_value; nothing when *skip.  A fixed grid (not from the SM count): about
// 8 elements per thread on large vectors.
template <typename scalar_t>
cudaError_t launch_add_noise(scalar_t* out, int64_t n, uint64_t key, acc_type<scalar_t> std_value,
                             const acc_type<scalar_t>* std_ptr, const bool* skip, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t blocks = (n + kThreads - 1) / kThreads < (int64_t(1) << 16) ? (n + kThreads - 1) / kThreads
                                                                            : (int64_t(1) << 16);
  add_noise_kernel<scalar_t><<<dim3(static_cast<unsigned int>(blocks)), kThreads, 0, stream>>>(out, n, key, std_value,
                                                                                                std_ptr, skip);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace fedopt
