// The aggregation's tiling rule (csrc/cuda/kernels/aggregate.cuh's header comment has
// the table): the tile shape is chosen from N and the dtype ONLY, never from the device,
// so the partial sums, hence the results, are bitwise the same on every GPU.  Plain C++
// (no CUDA, no torch): the ATen binding, module.cpp's diagnostic op and
// tools/gpu_harness all take the tiling from here.
#pragma once

#include <cstdint>

namespace fedopt {
namespace cuda {

// The tile shape for N columns of `esize`-byte clients: `threads` x `vectors` 16-byte
// vectors per tile of `columns` columns, `tiles` tiles, `blocks` = min(tiles, 1024).
struct AggTiling {
  int threads, vectors;
  int64_t columns, tiles, blocks;
};

namespace tiling_detail {
constexpr int64_t kMinBlocks = 256;
constexpr int64_t kMaxBlocks = 1024;
struct TileShape {
  int threads, vectors;
};
constexpr TileShape kTileShapes[] = {{256, 2}, {256, 1}, {128, 1}, {64, 1}, {32, 1}};
}  // namespace tiling_detail

inline AggTiling aggregate_tiling(int64_t n, int64_t esize) {
  using namespace tiling_detail;
  const int64_t vec = 16 / esize;
  AggTiling t{};
  for (const TileShape& s : kTileShapes) {
    t.threads = s.threads;
    t.vectors = s.vectors;
    t.columns = static_cast<int64_t>(s.threads) * s.vectors * vec;
    t.tiles = (n + t.columns - 1) / t.columns;
    if (t.tiles >= kMinBlocks) break;  // else: on to a smaller tile (the last one stays)
  }
  t.blocks = t.tiles < kMaxBlocks ? t.tiles : kMaxBlocks;
  return t;
}

}  // namespace cuda
}  // namespace fedopt
