// The device table cache of the CUDA list forms: semantics in fedopt/table_cache.h.
#include "fedopt/table_cache.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <list>
#include <memory>
#include <mutex>

namespace fedopt {
namespace cuda {
namespace {

struct Entry {
  c10::DeviceIndex device = 0;
  uint64_t hash = 0;
  std::vector<int64_t> content;
  at::Tensor table;                       // the device copy
  c10::StreamId upload_stream = 0;        // the stream its copy was queued on
  cudaEvent_t ready = nullptr;            // recorded on upload_stream after the copy
  std::vector<c10::StreamId> recorded;    // other streams recorded with the allocator

  Entry() = default;
  Entry(const Entry&) = delete;
  Entry& operator=(const Entry&) = delete;
  ~Entry() {
    if (ready == nullptr) return;
    try {
      const c10::cuda::CUDAGuard guard(device);
      // Queued waits on the event stay valid: CUDA releases it when they are done.
      (void)cudaEventDestroy(ready);
    } catch (...) {  // a destructor must not throw (as c10's CUDAEvent)
    }
  }
};

struct Cache {
  std::mutex mu;
  std::list<std::shared_ptr<Entry>> lru;              // front: most recently used
  std::vector<std::shared_ptr<Entry>> captured;       // used during a capture: kept forever
  int64_t hits = 0, misses = 0;
};

// Never destroyed: tables are device memory, which must not be freed by static
// destructors after the CUDA runtime has shut down.
Cache& cache() {
  static Cache* c = new Cache();
  return *c;
}

// 64-bit mix of the blob (splitmix64 finaliser per word): a cheap first filter, the
// content is compared in full on a hash match.
uint64_t hash_blob(const std::vector<int64_t>& blob) {
  uint64_t h = 0x9e3779b97f4a7c15ull ^ static_cast<uint64_t>(blob.size());
  for (int64_t w : blob) {
    uint64_t z = static_cast<uint64_t>(w) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    h ^= z ^ (z >> 31);
  }
  return h;
}

}  // namespace

at::Tensor device_table(const std::vector<int64_t>& blob, const at::Device& device, const char* op) {
  TORCH_CHECK(!blob.empty(), op, ": internal error: an empty table was requested");
  TORCH_CHECK(device.is_cuda() && device.has_index(), op, ": internal error: table for device ", device);
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device.index());
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream.stream(), &status));
  const bool capturing = status != cudaStreamCaptureStatusNone;
  const uint64_t h = hash_blob(blob);
  auto matches = [&](const std::shared_ptr<Entry>& e) {
    return e->device == device.index() && e->hash == h && e->content == blob;
  };

  Cache& c = cache();
  const std::lock_guard<std::mutex> lock(c.mu);
  std::shared_ptr<Entry> hit;
  const auto in_captured = std::find_if(c.captured.begin(), c.captured.end(), matches);
  if (in_captured != c.captured.end()) {
    hit = *in_captured;
  } else {
    const auto it = std::find_if(c.lru.begin(), c.lru.end(), matches);
    if (it != c.lru.end()) {
      hit = *it;
      if (capturing) {  // the graph will replay this address: never evict it
        c.captured.push_back(hit);
        c.lru.erase(it);
      } else {
        c.lru.splice(c.lru.begin(), c.lru, it);
      }
    }
  }
  if (hit) {
    ++c.hits;
    // Outside capture, a stream other than the upload's must not read the table before
    // the copy has run.  (During capture: no wait; see table_cache.h.)
    if (!capturing && stream.id() != hit->upload_stream) {
      C10_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(), hit->ready, 0));
      if (std::find(hit->recorded.begin(), hit->recorded.end(), stream.id()) == hit->recorded.end()) {
        c10::cuda::CUDACachingAllocator::recordStream(hit->table.storage().data_ptr(), stream);
        hit->recorded.push_back(stream.id());
      }
    }
    return hit->table;
  }

  TORCH_CHECK(!capturing, op,
              ": this call's pointer table is not on the device yet, and its upload cannot be captured into a "
              "CUDA graph (the graph would replay the copy from a host buffer that is recycled after the call); "
              "run the same call (the same tensors) once before capturing it, as a warm-up, so that the table "
              "is cached on the device");
  ++c.misses;
  auto e = std::make_shared<Entry>();
  e->device = device.index();
  e->hash = h;
  e->content = blob;
  e->upload_stream = stream.id();
  const int64_t n = static_cast<int64_t>(blob.size());
  // Pinned (caching host allocator): copy_ records the copy on the pinned block, so it
  // is not handed out again before the copy has run.
  at::Tensor pinned = at::empty({n}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::memcpy(pinned.data_ptr<int64_t>(), blob.data(), sizeof(int64_t) * blob.size());
  e->table = at::empty({n}, at::TensorOptions().dtype(at::kLong).device(device));
  e->table.copy_(pinned, /*non_blocking=*/true);
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&e->ready, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventRecord(e->ready, stream.stream()));
  c.lru.push_front(e);
  while (static_cast<int64_t>(c.lru.size()) > kTableCacheCapacity) c.lru.pop_back();
  return e->table;
}

std::vector<int64_t> table_cache_info() {
  Cache& c = cache();
  const std::lock_guard<std::mutex> lock(c.mu);
  return {static_cast<int64_t>(c.lru.size()), static_cast<int64_t>(c.captured.size()), c.hits, c.misses,
          kTableCacheCapacity};
}

void table_cache_clear() {
  Cache& c = cache();
  const std::lock_guard<std::mutex> lock(c.mu);
  c.lru.clear();
  c.hits = c.misses = 0;
}

}  // namespace cuda
}  // namespace fedopt
