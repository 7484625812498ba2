// CUDA kernels (device code and host launcher, torch-free) of the client's top-k encode
// fedopt_C::topk_encode (schema: csrc/registration.cpp; oracle: python_ref/compression.py
// topk_encode, a stable descending sort of |x| in fp32; the CPU twin:
// csrc/cpu/compressed_encode.cpp topk_encode_cpu).
//
// The order.  Element j has the key (m_j, ~j): m_j the fp32 bits of |x_j| with the sign
// cleared (x widened to fp32 as python_ref does: fp16 / bf16 exactly, fp64 rounded once;
// the bits of a non-negative float order as the float does, -0 == +0), every NaN mapped
// to 0x7F800001 (above +Inf, all NaNs equal), then the complemented index (a tie goes to
// the lower index).  All keys are distinct and "the k largest keys" is exactly the first
// k of python_ref's stable sort; the indices come back ascending, so no sort is needed.
// The index takes 32 bits when N <= 2^32, 64 above (two 64-bit words then).
//
// A radix select, most significant 8-bit digit first, with no host synchronisation (k
// is a host integer: the outputs' sizes are known):
//   per pass p  topk_histogram_kernel: a shared-memory histogram (integer atomics) of
//               digit p over the elements whose key matches the prefix found so far,
//               added into the pass's global histogram (integer atomics: the counts,
//               hence every decision, do not depend on the order of the blocks);
//               topk_pick_kernel (one thread): walks the 256 buckets from the top to the
//               one that holds the remaining k-th largest key, appends that digit to the
//               prefix, subtracts the keys above it; when the bucket's count equals the
//               remaining k the selection is complete (threshold = prefix then zeros
//               selects exactly that bucket and everything above it) and `done` is set:
//               later passes return at once.  Keys are distinct, so the last digit's
//               bucket holds one key: the last pass always completes it.
//   compaction  select = key >= threshold (exactly k elements), in index order:
//               topk_count_kernel (per tile of 4096 elements, a cub::BlockReduce),
//               topk_scan_kernel (one block, cub::BlockScan over the tiles' counts: the
//               tiles' output offsets), topk_write_kernel (per tile, cub::BlockLoad into
//               a blocked arrangement, cub::BlockScan of the per-thread counts, then each
//               thread writes its selected (index, fp32 value) pairs in order).
// State (prefix, remaining k, done) and histograms live in a device workspace zeroed by
// one cudaMemsetAsync.  Launches: 1 memset + 2 per pass (8 passes for 32-bit indices,
// 12 for 64-bit: fixed on the host from the key width) + 3.
//
// Why 8-bit digits and not 11: a 256-bin histogram is 1 KiB of shared memory (a block
// zeroes and flushes it in one step of 256 threads) and the pick is 256 steps; 11-bit
// digits save 2 of 8 launch pairs but need 8 KiB bins flushed per block and fewer
// elements per bin (more atomic traffic to global per block).  Passes that run after
// `done` read nothing, and on real data the magnitude's 32 bits decide in 3-4 passes.
// Why not cub::DeviceSelect::If (stable, one pass, a functor could read the threshold
// from device memory): its decoupled look-back in CUDA 13.0's CUB compiles to
// ld.relaxed.gpu / st.relaxed.gpu and nanosleep.u32, and the PTX simulator the kernels
// are verified on (tools/gpu_harness on GPGPU-Sim) does not parse `.relaxed` (tried: a
// parse error before any launch).  The 3-phase count/scan/write here reads x once more
// than DeviceSelect would, is stable, and uses only block-level CUB (BlockLoad,
// BlockReduce, BlockScan).  On a GPU alone, DeviceSelect would be the simpler choice.
//
// Performance model (N = 11.2M fp32, k = 1%; not measured): on Gaussian-like data the
// digits of |x| settle the selection after 4 histogram passes (pass 0 matches all
// elements, pass 1 ~5%, then a few thousand), each reading x (4 B/element); the other
// 4 launch pairs return at once; count and write read x once each: ~24 B/element,
// ~270 MB, 20 launches (1 memset, 16 tiny or reading, 3 compaction).  torch.sort's
// stable pair sort of |x| with int64 indices moves ~100+ B/element.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_load.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

namespace fedopt {
namespace cuda {

constexpr int kTopkThreads = 256;
constexpr int kTopkItems = 16;  // per thread of a compaction tile
constexpr int64_t kTopkTile = int64_t(kTopkThreads) * kTopkItems;
constexpr int kTopkBins = 256;                        // 8-bit digits
constexpr int64_t kTopkHistogramBlocksMax = 4096;     // histogram grid (grid-stride beyond)
constexpr int kTopkScanItems = 8;                     // tile counts per thread per step of the scan

// The selection's state in device memory (the workspace's head).
struct TopkState {
  unsigned long long hi, lo;   // the prefix found so far, the key's words (see topk_key)
  unsigned long long remaining;  // how many keys of the current bucket are still to take
  unsigned long long done;       // 1 once the threshold selects exactly k keys
};

// The number of digit passes: 32 bits of magnitude and 32 or 64 of index.
constexpr int topk_passes(bool idx64) { return idx64 ? 12 : 8; }

// Workspace bytes: the state, then one 256-bin histogram per pass (room for 12), then
// one count per compaction tile.  All of it 8-byte aligned.
inline size_t topk_workspace_bytes(int64_t N) {
  const int64_t tiles = (N + kTopkTile - 1) / kTopkTile;
  return sizeof(TopkState) + sizeof(unsigned long long) * (size_t(topk_passes(true)) * kTopkBins + size_t(tiles));
}

__device__ __forceinline__ uint32_t topk_magnitude(float v) {
  const uint32_t u = __float_as_uint(v) & 0x7FFFFFFFu;
  return u > 0x7F800000u ? 0x7F800001u : u;  // every NaN one key, above +Inf
}

template <typename scalar_t>
__device__ __forceinline__ float topk_widen(scalar_t v) {
  return static_cast<float>(v);  // fp16 / bf16 exact; fp64 cvt.rn.f32.f64 (torch's .to(float32))
}

// The key of element j as two 64-bit words, compared lexicographically: 32-bit indices
// give hi = m << 32 | ~j (32 bits), lo = 0; 64-bit ones give hi = m << 32 | (~j >> 32),
// lo = ~j << 32.  Digit p (0 the most significant) is bits [56 - 8p, 64 - 8p) of hi for
// p < 8, of lo for p >= 8.
template <bool kIdx64>
__device__ __forceinline__ void topk_key(float v, int64_t j, unsigned long long& hi, unsigned long long& lo) {
  const unsigned long long m = topk_magnitude(v);
  if constexpr (kIdx64) {
    const unsigned long long c = ~static_cast<unsigned long long>(j);
    hi = (m << 32) | (c >> 32);
    lo = c << 32;
  } else {
    hi = (m << 32) | static_cast<unsigned long long>(~static_cast<uint32_t>(j));
    lo = 0;
  }
}

// The bits above digit p of a word: mask for `above` digits of 8 bits.
__device__ __forceinline__ unsigned long long topk_high_mask(int above) {
  return above <= 0 ? 0ull : (above >= 8 ? ~0ull : ~0ull << (64 - 8 * above));
}

template <typename scalar_t, bool kIdx64>
__global__ void __launch_bounds__(kTopkThreads)
    topk_histogram_kernel(const scalar_t* __restrict__ x, int64_t N, const TopkState* __restrict__ state,
                          unsigned long long* __restrict__ hist, int pass) {
  if (state->done) return;
  __shared__ unsigned int bins[kTopkBins];
  for (int i = threadIdx.x; i < kTopkBins; i += kTopkThreads) bins[i] = 0;
  __syncthreads();
  const unsigned long long phi = state->hi, plo = state->lo;
  const unsigned long long mhi = topk_high_mask(pass), mlo = topk_high_mask(pass - 8);
  const bool in_hi = pass < 8;
  const int shift = 56 - 8 * (in_hi ? pass : pass - 8);
  for (int64_t j = int64_t(blockIdx.x) * kTopkThreads + threadIdx.x; j < N;
       j += int64_t(gridDim.x) * kTopkThreads) {
    unsigned long long hi, lo;
    topk_key<kIdx64>(topk_widen(x[j]), j, hi, lo);
    if ((hi & mhi) != (phi & mhi) || (lo & mlo) != (plo & mlo)) continue;
    atomicAdd(&bins[((in_hi ? hi : lo) >> shift) & 0xFF], 1u);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kTopkBins; i += kTopkThreads)
    if (bins[i]) atomicAdd(&hist[i], static_cast<unsigned long long>(bins[i]));
}

// One thread: the digit of pass p that holds the remaining k-th largest key.
__global__ void topk_pick_kernel(TopkState* __restrict__ state, const unsigned long long* __restrict__ hist,
                                 int pass, unsigned long long k) {
  if (threadIdx.x != 0 || state->done) return;
  const unsigned long long want = pass == 0 ? k : state->remaining;
  unsigned long long above = 0;
  int d = kTopkBins - 1;
  for (; d > 0; --d) {
    if (above + hist[d] >= want) break;
    above += hist[d];
  }
  const unsigned long long rest = want - above;  // keys to take from bucket d, 1 <= rest <= hist[d]
  const int shift = 56 - 8 * (pass < 8 ? pass : pass - 8);
  if (pass < 8)
    state->hi |= static_cast<unsigned long long>(d) << shift;
  else
    state->lo |= static_cast<unsigned long long>(d) << shift;
  state->remaining = rest;
  if (hist[d] == rest) state->done = 1;
}

__device__ __forceinline__ bool topk_selected(unsigned long long hi, unsigned long long lo, unsigned long long thi,
                                              unsigned long long tlo) {
  return hi > thi || (hi == thi && lo >= tlo);
}

template <typename scalar_t, bool kIdx64>
__global__ void __launch_bounds__(kTopkThreads)
    topk_count_kernel(const scalar_t* __restrict__ x, int64_t N, const TopkState* __restrict__ state,
                      unsigned long long* __restrict__ tile_count) {
  using Reduce = cub::BlockReduce<unsigned int, kTopkThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const unsigned long long thi = state->hi, tlo = state->lo;
  const int64_t base = int64_t(blockIdx.x) * kTopkTile;
  unsigned int n = 0;
  for (int i = 0; i < kTopkItems; ++i) {
    const int64_t j = base + int64_t(i) * kTopkThreads + threadIdx.x;  // striped: coalesced, order irrelevant here
    if (j < N) {
      unsigned long long hi, lo;
      topk_key<kIdx64>(topk_widen(x[j]), j, hi, lo);
      n += topk_selected(hi, lo, thi, tlo);
    }
  }
  const unsigned int total = Reduce(tmp).Sum(n);
  if (threadIdx.x == 0) tile_count[blockIdx.x] = total;
}

// One block: tile_count becomes each tile's exclusive offset, in tile order.
__global__ void __launch_bounds__(kTopkThreads)
    topk_scan_kernel(unsigned long long* __restrict__ tile_count, int64_t tiles) {
  using Scan = cub::BlockScan<unsigned long long, kTopkThreads>;
  __shared__ typename Scan::TempStorage tmp;
  unsigned long long carry = 0;
  constexpr int64_t kStep = int64_t(kTopkThreads) * kTopkScanItems;
  for (int64_t s = 0; s < tiles; s += kStep) {
    unsigned long long v[kTopkScanItems];
    for (int i = 0; i < kTopkScanItems; ++i) {
      const int64_t t = s + int64_t(threadIdx.x) * kTopkScanItems + i;  // blocked
      v[i] = t < tiles ? tile_count[t] : 0ull;
    }
    unsigned long long step_total;
    Scan(tmp).ExclusiveSum(v, v, step_total);
    __syncthreads();  // tmp is reused by the next step
    for (int i = 0; i < kTopkScanItems; ++i) {
      const int64_t t = s + int64_t(threadIdx.x) * kTopkScanItems + i;
      if (t < tiles) tile_count[t] = carry + v[i];
    }
    carry += step_total;
  }
}

template <typename scalar_t, bool kIdx64>
__global__ void __launch_bounds__(kTopkThreads)
    topk_write_kernel(const scalar_t* __restrict__ x, int64_t N, const TopkState* __restrict__ state,
                      const unsigned long long* __restrict__ tile_offset, float* __restrict__ values,
                      int64_t* __restrict__ indices) {
  using Load = cub::BlockLoad<scalar_t, kTopkThreads, kTopkItems, cub::BLOCK_LOAD_TRANSPOSE>;
  using Scan = cub::BlockScan<unsigned int, kTopkThreads>;
  __shared__ union {
    typename Load::TempStorage load;
    typename Scan::TempStorage scan;
  } tmp;
  const unsigned long long thi = state->hi, tlo = state->lo;
  const int64_t base = int64_t(blockIdx.x) * kTopkTile;
  const int valid = static_cast<int>(N - base < kTopkTile ? N - base : kTopkTile);
  scalar_t items[kTopkItems];
  Load(tmp.load).Load(x + base, items, valid, static_cast<scalar_t>(0.0f));
  __syncthreads();  // tmp is reused by the scan
  const int64_t j0 = base + int64_t(threadIdx.x) * kTopkItems;  // blocked: this thread's items are j0 .. j0 + 15
  float v[kTopkItems];
  unsigned int sel = 0, n = 0;
  for (int i = 0; i < kTopkItems; ++i) {
    v[i] = topk_widen(items[i]);
    unsigned long long hi, lo;
    topk_key<kIdx64>(v[i], j0 + i, hi, lo);
    const bool s = j0 + i < N && topk_selected(hi, lo, thi, tlo);
    sel |= static_cast<unsigned int>(s) << i;
    n += s;
  }
  unsigned int pos;
  Scan(tmp.scan).ExclusiveSum(n, pos);
  int64_t out = static_cast<int64_t>(tile_offset[blockIdx.x]) + pos;
  for (int i = 0; i < kTopkItems; ++i) {
    if (sel >> i & 1u) {
      values[out] = v[i];
      indices[out] = j0 + i;
      ++out;
    }
  }
}

// k == N: every index, every value widened.
template <typename scalar_t>
__global__ void __launch_bounds__(kTopkThreads)
    topk_all_kernel(const scalar_t* __restrict__ x, int64_t N, float* __restrict__ values,
                    int64_t* __restrict__ indices) {
  for (int64_t j = int64_t(blockIdx.x) * kTopkThreads + threadIdx.x; j < N; j += int64_t(gridDim.x) * kTopkThreads) {
    values[j] = topk_widen(x[j]);
    indices[j] = j;
  }
}

// The selection proper (0 < k < N): kIdx64 the 64-bit index digits, which
// launch_topk_encode takes above 2^32 elements (tools/gpu_harness also runs it on small
// N: the keys' order is the same, only the digits differ).
template <typename scalar_t, bool kIdx64>
cudaError_t launch_topk_select(const scalar_t* x, int64_t N, int64_t k, float* values, int64_t* indices,
                               void* workspace, cudaStream_t stream) {
  TopkState* state = static_cast<TopkState*>(workspace);
  unsigned long long* hist = reinterpret_cast<unsigned long long*>(state + 1);
  constexpr int passes = topk_passes(kIdx64);
  unsigned long long* tile_count = hist + int64_t(passes) * kTopkBins;
  const int64_t tiles = (N + kTopkTile - 1) / kTopkTile;
  cudaError_t err = cudaMemsetAsync(workspace, 0, sizeof(TopkState) + sizeof(unsigned long long) * passes * kTopkBins,
                                    stream);
  if (err != cudaSuccess) return err;
  const int64_t hblocks = tiles < kTopkHistogramBlocksMax ? tiles : kTopkHistogramBlocksMax;
  for (int p = 0; p < passes; ++p) {
    topk_histogram_kernel<scalar_t, kIdx64>
        <<<static_cast<unsigned int>(hblocks), kTopkThreads, 0, stream>>>(x, N, state, hist + p * kTopkBins, p);
    topk_pick_kernel<<<1, 32, 0, stream>>>(state, hist + p * kTopkBins, p, static_cast<unsigned long long>(k));
  }
  topk_count_kernel<scalar_t, kIdx64><<<static_cast<unsigned int>(tiles), kTopkThreads, 0, stream>>>(x, N, state,
                                                                                                     tile_count);
  topk_scan_kernel<<<1, kTopkThreads, 0, stream>>>(tile_count, tiles);
  topk_write_kernel<scalar_t, kIdx64>
      <<<static_cast<unsigned int>(tiles), kTopkThreads, 0, stream>>>(x, N, state, tile_count, values, indices);
  return cudaGetLastError();
}

// The host launcher: x [N] contiguous on the device (fp16, bf16, fp32 or fp64), k in
// [0, N], values float32 [k] and indices int64 [k] on the device, workspace of
// topk_workspace_bytes(N) bytes (any content; 8-byte aligned).  k == 0 launches nothing,
// k == N writes every element (no selection).
template <typename scalar_t>
cudaError_t launch_topk_encode(const scalar_t* x, int64_t N, int64_t k, float* values, int64_t* indices,
                               void* workspace, cudaStream_t stream) {
  if (k <= 0 || N <= 0) return cudaSuccess;
  if (k >= N) {
    const int64_t blocks = (N + kTopkThreads - 1) / kTopkThreads;
    topk_all_kernel<scalar_t><<<static_cast<unsigned int>(blocks < 65536 ? blocks : 65536), kTopkThreads, 0,
                                stream>>>(x, N, values, indices);
    return cudaGetLastError();
  }
  return N <= (int64_t(1) << 32) ? launch_topk_select<scalar_t, false>(x, N, k, values, indices, workspace, stream)
                                 : launch_topk_select<scalar_t, true>(x, N, k, values, indices, workspace, stream);
}

}  // namespace cuda
}  // namespace fedopt
