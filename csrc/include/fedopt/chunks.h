// Host-side work partition of the multi-tensor kernels: ONE chunk-table layout and ONE
// chunk rule for every GPU launcher (the CUDA kernels of csrc/cuda and the Triton
// launcher, whose Python twin fedopt_kernels/backends/_chunks.py mirrors this file
// exactly), plus the older per-tensor partition the CPU kernels keep.
//
// Every multi-tensor kernel walks a *chunk table*: the tensors of a call are cut into
// chunks of at most `chunk_size` elements, one block (Triton: one program) per chunk.
// A *group* is a set of tensors that share a norm (all tensors of `nar_step_`, one row
// of `nar_step_batched_`); ops without groups put everything in group 0.
//
// The rule (GPU launchers)
// ------------------------
//   chunk_size = chunk_size_for(n): the smallest power of two >= kMinChunk (2048) that
//   is >= ceil(n / kTargetChunks) (1024), n = the element count of the LARGEST group of
//   the call (all elements for ops without groups; a row's N for nar_step_batched_).
// So a group has at most ~kTargetChunks full chunks plus one tail chunk per tensor
// (ResNet-18, 11.7M parameters in 62 tensors: 16Ki-element chunks, under 800 of them).  Small
// calls keep 2048-element chunks (8 KiB of fp32: a few 16-byte steps per thread of a
// 256-thread block), enough blocks to fill a GPU from ~0.3M parameters up.  The
// chunking depends only on the sizes (never on the device, the thread count or the
// values), so every reduction over it is bitwise reproducible across runs and GPUs.
// kMinChunk is a multiple of 8 elements, so a chunk start keeps its tensor's 16-byte
// alignment for every dtype (8 fp16 elements, 4 fp32, 2 fp64 = 16 bytes).
//
// The layout (GPU launchers)
// --------------------------
// One row of 8 int64 (64 bytes) per chunk, for every multi-tensor kernel:
//
//     [ptr0, ptr1, ptr2, ptr3, len, group, flags, 0]
//
//   ptrK   device address of the chunk's FIRST element in array K (already advanced by
//          start * element size of array K; 0 where the op has no such array):
//          FedNAR          param, grad, momentum buffer (0 without momentum), 0
//          server update   param, update (acc dtype), exp_avg, exp_avg_sq
//   len    elements in the chunk, 1..chunk_size
//   group  the group whose norm the chunk feeds (0 for ops without groups)
//   flags  bit 0 = kChunkAligned16: every nonzero pointer of the row is 16-byte aligned
//          (the block may use 16-byte vector loads/stores for the whole chunk)
//
// Chunks are cut at multiples of chunk_size inside each tensor; empty tensors give no
// row; tensors are listed group by group, so the rows of a group are contiguous.  A
// separate [num_groups, 2] int64 array gives each group's partial range [pbegin, pend)
// (the indices of its rows = of its per-chunk partial sums).  The CUDA launchers upload
// the rows followed by that array as ONE int64 blob (build_chunk_rows below) and cache
// it on the device by content (fedopt/table_cache.h).
//
// Why this layout, compared with apex and PyTorch
// -----------------------------------------------
// apex's multi_tensor_apply and PyTorch's _foreach / fused optimizers
// (ATen/native/cuda/MultiTensorApply.cuh) pass the work list as a KERNEL ARGUMENT
// (TensorListMetadata: tensor addresses, sizes, block -> (tensor, chunk) maps) with a
// fixed chunk (65536 elements in both) and a cap per launch: 110 / 64 / 48 / 36 / 30
// tensors for 1..5 arrays and 320 blocks, from the 4 KiB kernel-parameter limit
// (PyTorch has 32 KiB variants for CUDA >= 12.1).  The host loop launches again whenever
// a list fills up.  That needs no device memory, no upload, and is trivially capturable
// into a CUDA graph, but a large model costs many launches per pass.  Our kernels must
// REDUCE over all tensors of a group (the clip norm) and then update them, in exactly
// two launches whatever the number of tensors, and each update
// block combines its group's partials, so all partials must be complete before any
// update block runs: one launch per pass, hence a table in device memory without a size
// limit.  The cost of that choice is an upload, which the device table cache pays once
// per distinct table (an optimizer steps the same tensors every time) so that the
// steady state does no host-to-device copy and the list forms are capturable after one
// warm-up call.
//   Each row carries the chunk's own pointers, already advanced (the old nar_step_ table
// was {tensor, start, len, group} plus per-tensor pointer arrays: two dependent loads
// before the first data load); a block reads its 64-byte row (one cache line) and
// starts.  The alignment flag per row follows PyTorch's foreach functors, which test
// alignment per chunk, not per launch: one misaligned view (a tensor at an odd offset of
// a flat buffer) sends only its own chunks to the scalar body.
//   The chunk size scales with the largest group (apex/PyTorch: fixed 64Ki) so that the
// partials of a group stay ~kTargetChunks: the FedNAR update kernel re-combines its
// group's partials in every block (no third launch), which is cheap for ~1k partials
// but quadratic in their number; above kMaxRedundantPartials partials in one group (a
// list of thousands of tensors: one tail chunk each) the launcher runs a one-block-per-
// group finalize pass instead (csrc/cuda/nar_step.cu).  PyTorch's _foreach_norm does
// the same two-stage reduction (per-chunk partials, then one cleanup block per tensor).
//
// The CPU partition (build_chunk_table)
// -------------------------------------
// The CPU kernels keep their own partition (fixed 64Ki-element chunks, {tensor, start,
// len, group} with per-tensor pointer arrays, combined on the host in chunk order); it
// is a different, equally deterministic order, so CPU and GPU norms agree to rounding,
// not bitwise.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <vector>

namespace fedopt {

// ----------------------------------------------------------------------------------
// GPU chunk rule and row layout (mirrored by fedopt_kernels/backends/_chunks.py)
// ----------------------------------------------------------------------------------

constexpr int64_t kMinChunk = 2048;               // elements
constexpr int64_t kTargetChunks = 1024;           // full chunks of the largest group, at most
constexpr int64_t kMaxRedundantPartials = 4096;   // above: finalize pass (nar_step_)
constexpr int64_t kAlignBytes = 16;
static_assert(kMinChunk % 8 == 0, "chunk starts must keep 16-byte alignment for 2-byte dtypes");

// Row layout: column indices, row size, flags.
constexpr int64_t kChunkRowWords = 8;
constexpr int kRowPtr0 = 0;  // ptr0..ptr3 are columns 0..3
constexpr int kRowLen = 4;
constexpr int kRowGroup = 5;
constexpr int kRowFlags = 6;
constexpr int64_t kChunkAligned16 = 1;  // flags bit 0
constexpr int kChunkArrays = 4;         // ptr0..ptr3

// The smallest power of two >= kMinChunk that is >= ceil(n / kTargetChunks); n is the
// element count of the largest group of the call.
inline int64_t chunk_size_for(int64_t n) {
  const int64_t want = n > 0 ? (n + kTargetChunks - 1) / kTargetChunks : 0;
  int64_t cs = kMinChunk;
  while (cs < want) cs *= 2;
  return cs;
}

// One tensor of a call as build_chunk_rows sees it: the base address of its first
// element in each array (0 where the op has no such array), its element count and its
// group.
struct ChunkTensor {
  int64_t ptr[kChunkArrays] = {0, 0, 0, 0};
  int64_t numel = 0;
  int64_t group = 0;
};

// The int64 blob of a call: `num_rows` rows of kChunkRowWords, then `num_groups` pairs
// [pbegin, pend).
struct ChunkRows {
  std::vector<int64_t> blob;
  int64_t num_rows = 0;
  int64_t num_groups = 0;
  int64_t chunk_size = 0;
  int64_t max_group_rows = 0;  // the most partials any group has
  int64_t ranges_offset() const { return num_rows * kChunkRowWords; }
};

// Builds the rows of `tensors` (listed group by group: groups non-decreasing, each in
// [0, num_groups)) with the chunk rule above.  `esize[K]` is the element size in bytes
// of array K (the server update's updates are in the acc dtype, the rest in the
// params'); it is unused where every tensor has ptr[K] == 0.
inline ChunkRows build_chunk_rows(const std::vector<ChunkTensor>& tensors, const int64_t (&esize)[kChunkArrays],
                                  int64_t num_groups) {
  ChunkRows out;
  out.num_groups = num_groups;
  // The chunk size from the largest group.
  std::vector<int64_t> group_numel(static_cast<size_t>(num_groups), 0);
  int64_t prev_group = 0;
  for (const ChunkTensor& t : tensors) {
    if (t.group < prev_group || t.group >= num_groups || t.numel < 0)
      throw std::invalid_argument("build_chunk_rows: tensors must be listed group by group, groups in [0, num_groups)");
    prev_group = t.group;
    group_numel[static_cast<size_t>(t.group)] += t.numel;
  }
  int64_t largest = 0;
  for (int64_t n : group_numel) largest = n > largest ? n : largest;
  const int64_t cs = chunk_size_for(largest);
  out.chunk_size = cs;

  int64_t rows = 0;
  for (const ChunkTensor& t : tensors) rows += (t.numel + cs - 1) / cs;
  out.blob.reserve(static_cast<size_t>(rows * kChunkRowWords + 2 * num_groups));
  std::vector<int64_t> ranges(static_cast<size_t>(2 * num_groups), 0);
  int64_t group = 0;  // groups [0, group) are closed
  int64_t row = 0;
  for (const ChunkTensor& t : tensors) {
    while (group < t.group) {  // close the groups before this tensor's
      ranges[2 * group + 1] = row;
      ranges[2 * (group + 1)] = row;
      ++group;
    }
    for (int64_t start = 0; start < t.numel; start += cs) {
      int64_t flags = kChunkAligned16;
      for (int k = 0; k < kChunkArrays; ++k) {
        const int64_t p = t.ptr[k] != 0 ? t.ptr[k] + start * esize[k] : 0;
        if (p % kAlignBytes != 0) flags &= ~kChunkAligned16;
        out.blob.push_back(p);
      }
      out.blob.push_back(t.numel - start < cs ? t.numel - start : cs);
      out.blob.push_back(t.group);
      out.blob.push_back(flags);
      out.blob.push_back(0);
      ++row;
    }
  }
  while (group < num_groups) {  // close the last group and any empty ones after it
    ranges[2 * group + 1] = row;
    if (group + 1 < num_groups) ranges[2 * (group + 1)] = row;
    ++group;
  }
  out.num_rows = row;
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t n = ranges[2 * g + 1] - ranges[2 * g];
    out.max_group_rows = n > out.max_group_rows ? n : out.max_group_rows;
  }
  out.blob.insert(out.blob.end(), ranges.begin(), ranges.end());
  return out;
}

// ----------------------------------------------------------------------------------
// CPU partition (csrc/cpu): per-tensor chunks combined on the host
// ----------------------------------------------------------------------------------

struct Chunk {
  int64_t tensor;  // index into the tensor list (or row of a 2-D tensor)
  int64_t start;   // first element of the chunk within that tensor
  int64_t len;     // number of elements, 1 <= len <= chunk_size
  int64_t group;   // group whose norm this chunk contributes to
};

struct ChunkTable {
  std::vector<Chunk> chunks;
  std::vector<int64_t> group_begin;  // size num_groups + 1; partial-sum ranges
};

// `numels[t]` is the size of tensor t, `group_of[t]` its group (non-decreasing in t).
// Empty tensors produce no chunk; a group with no elements has an empty range.
// Determinism: a reduction writes one partial per chunk and combines a group's partials
// in chunk order; the boundaries depend only on the sizes and `chunk_size`.
inline ChunkTable build_chunk_table(const std::vector<int64_t>& numels,
                                    const std::vector<int64_t>& group_of,
                                    int64_t num_groups, int64_t chunk_size) {
  ChunkTable table;
  table.group_begin.assign(num_groups + 1, 0);
  int64_t total = 0;
  for (int64_t n : numels) total += (n + chunk_size - 1) / chunk_size;
  table.chunks.reserve(total);
  int64_t group = 0;
  for (size_t t = 0; t < numels.size(); ++t) {
    while (group < group_of[t]) table.group_begin[++group] = (int64_t)table.chunks.size();
    for (int64_t start = 0; start < numels[t]; start += chunk_size) {
      const int64_t len = numels[t] - start < chunk_size ? numels[t] - start : chunk_size;
      table.chunks.push_back({(int64_t)t, start, len, group_of[t]});
    }
  }
  while (group < num_groups) table.group_begin[++group] = (int64_t)table.chunks.size();
  return table;
}

}  // namespace fedopt
