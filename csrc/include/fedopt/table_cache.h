// Device table cache of the CUDA list forms (nar_step_ / nar_sq_norm / nar_apply_,
// server_update_, aggregate / client_dots with a list of clients).
//
// A list form needs an int64 table on the device (chunk rows, fedopt/chunks.h, or client
// addresses).  The table is a pure function of the tensors' metadata (addresses, sizes,
// dtypes), and an optimizer calls with the same tensors every step, so tables are
// cached ON THE DEVICE and found again by CONTENT:
//
//  * key = (device index, the blob's int64 content).  Not the stream, not the call
//    site: a CUDA graph is captured on its own side stream, and the same call from a
//    training loop and from torch.cuda.graph must find the same table.  Content keys
//    cannot go stale: a tensor freed and another one allocated at the same address with
//    the same size gives the same blob, whose table is then right for it as well.
//  * a miss (outside capture): the blob goes into a pinned host tensor (torch's caching
//    host allocator) and is copied with non_blocking=true on the CURRENT stream (no host
//    sync); a CUDA event is recorded after the copy.
//  * a hit from another stream than the upload's, outside capture: the current stream
//    waits for that event (cudaStreamWaitEvent: device-side, no host sync), and the
//    table's memory is recorded as used by that stream (record_stream), so an eviction
//    cannot hand the block to another allocation while that stream still reads it.
//  * during CUDA-graph capture: a hit does NOT wait.  torch.cuda.graph (and the
//    cudagraph trees of torch.compile, which capture through it) synchronise the device
//    before capture begins, so every upload queued before the capture has completed; a
//    wait on an event recorded outside the capture would also be illegal inside it.
//    The entry moves to a never-evicted set: the graph replays its address forever.
//  * a miss during capture is an error (TORCH_CHECK) that says to run the same call
//    once before capturing: the copy would be replayed from a pinned block that is
//    recycled after the call.
//  * bounded: at most kTableCacheCapacity entries outside the captured set, least
//    recently used first out; one std::mutex guards everything (uploads included), so
//    concurrent callers on several threads are safe.
//
// The returned tensor keeps the table alive while the caller queues its launches.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <vector>

namespace fedopt {
namespace cuda {

constexpr int64_t kTableCacheCapacity = 64;

// The device copy of `blob` (int64, same length) on `device`, usable on the current
// stream.  `op` names the caller in the error raised on a miss during capture.  Call
// with `device` current (a CUDAGuard).  `blob` must not be empty.
at::Tensor device_table(const std::vector<int64_t>& blob, const at::Device& device, const char* op);

// Diagnostics for tests: {entries (LRU), captured entries, hits, misses, capacity}.
std::vector<int64_t> table_cache_info();

// Drops the LRU entries and zeroes the counters (captured entries stay: graphs use them).
void table_cache_clear();

}  // namespace cuda
}  // namespace fedopt
