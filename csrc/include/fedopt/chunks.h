// Host-side work partition shared by the CPU and CUDA kernels.
//
// Every multi-tensor kernel of fedopt_kernels walks a *chunk table*: the tensors of a
// call are cut into chunks of at most `chunk_size` elements, each chunk belongs to one
// tensor and one group (a group is the set of tensors that share a norm: all tensors of
// `nar_step_`, one row of `nar_step_batched_`).  Tensors are listed group by group, so
// the chunks of a group are contiguous and the group owns the partial sums
// [group_begin[g], group_begin[g + 1]).
//
// Why a table of chunks over the original tensors rather than a flat buffer: a flat
// buffer costs a gather and a scatter copy per step (2 extra words per parameter each
// way), which would more than double the traffic of a 5-word step.  The table only
// depends on the sizes, never on values, so building it needs no device sync.
//
// Determinism: a reduction writes one partial per chunk and combines a group's
// partials in chunk order.  The chunk boundaries depend only on the tensor sizes and
// `chunk_size` (never on the thread or block count), so results are bitwise
// reproducible run to run.
#pragma once

#include <cstdint>
#include <vector>

namespace fedopt {

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
