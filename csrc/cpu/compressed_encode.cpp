// CPU kernels of the client's fused fp8 encode, fedopt_C::block_quantize with kind 2
// (float8_e4m3fn codes, one fp32 scale per block; oracle: python_ref/compression.py
// fp8_encode; the int8 / int4 kinds: compressed_aggregate.cpp), and of the top-k encode
// fedopt_C::topk_encode (at the end; oracle: python_ref's topk_encode).  Schemas:
// csrc/registration.cpp.
//
// One pass over a block for its absmax (the block, at most a few KiB, is then in L1),
// a second over the same block for the codes: python_ref's torch code makes ~8 passes
// over the whole vector (pad, abs, amax, repeat_interleave, where, div, clamp, convert).
// Every step is python_ref's, one rounding each (x / s, the e4m3 rounding), so the bits
// are the same under every ISA level and thread count.  The loop is compiled three times
// in this translation unit, for the DEFAULT, AVX2 and AVX-512 levels torch itself runs
// (at::get_cpu_capability), as compressed_aggregate.cpp does; GCC vectorises
// fp8_encode_block's branch-free loops.
#include "compressed_prologue.h"  // no contraction, as compressed_aggregate.cpp

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <fedopt/fp8_e4m3.h>

namespace fedopt::cpu::compressed {
namespace DEFAULT {
#include "compressed_encode_kernels.h"
}  // namespace DEFAULT
}  // namespace fedopt::cpu::compressed

#if FEDOPT_COMPRESSED_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace fedopt::cpu::compressed {
namespace AVX2 {
#include "compressed_encode_kernels.h"
}  // namespace AVX2
}  // namespace fedopt::cpu::compressed
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace fedopt::cpu::compressed {
namespace AVX512 {
#include "compressed_encode_kernels.h"
}  // namespace AVX512
}  // namespace fedopt::cpu::compressed
#pragma GCC pop_options
#endif

namespace fedopt::cpu::compressed {

using at::Tensor;

namespace {

using EncodeBlock = float (*)(const float*, int64_t, uint8_t*);

EncodeBlock fp8_encode_loop() {
  static const EncodeBlock chosen = [] {
#if FEDOPT_COMPRESSED_X86
    const std::string cap = at::get_cpu_capability();
    if (cap == "AVX512") return &AVX512::fp8_encode_block;
    if (cap == "AVX2") return &AVX2::fp8_encode_block;
#endif
    return &DEFAULT::fp8_encode_block;
  }();
  return chosen;
}

constexpr int64_t kMinColumnsPerThread = int64_t(1) << 16;

}  // namespace

// block_quantize's kind 2 (called by block_quantize_into_cpu once the arguments and the
// outputs are checked): x a 1-D floating-point CPU tensor, block a positive multiple of
// 32; writes codes (uint8 [N], the float8_e4m3fn bits) and scales (float32
// [ceil(N / block)]).
void fp8_block_encode_into_cpu(const Tensor& x, int64_t block, Tensor& codes, Tensor& scales) {
  const Tensor xf = x.to(at::kFloat).contiguous();  // fp16 / bf16 widen exactly; fp64 rounds once
  const int64_t N = xf.numel(), nb = (N + block - 1) / block;
  const float* xp = xf.const_data_ptr<float>();
  float* sp = scales.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  const EncodeBlock run = fp8_encode_loop();
  const int64_t grain = std::max<int64_t>(1, kMinColumnsPerThread / block);
  at::parallel_for(0, nb, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t j0 = b * block, len = std::min(block, N - j0);
      sp[b] = run(xp + j0, len, cp + j0);
    }
  });
}

// ---------------------------------------------------------------------------------------
// Top-k: the k largest |x_j| (x taken as fp32), a tie to the lower index, indices returned
// ascending with their values -- python_ref's stable descending sort of |x|, whose order
// is a strict total order on (|x|, -j): NaN above +Inf (torch.sort puts NaN first when
// descending; all NaNs equal), -0 equal to +0.  So any selection algorithm finds the same
// set; std::nth_element on one 64-bit key per element, (order of |x| << 32) | ~j (greater
// key first), is O(N) on average and needs no sort of the whole vector.  Above 2^32
// elements the index does not fit beside the key: pairs, with the same order.

namespace {

inline uint32_t magnitude_order(float v) {
  const uint32_t u = fp8::float_bits(v) & 0x7FFFFFFFu;  // |v|: the bits of a non-negative float order as it does
  return u > 0x7F800000u ? 0x7F800001u : u;  // every NaN one key, above +Inf
}

}  // namespace

namespace {

// The key of element j (N <= 2^32): its magnitude order above, then ~j -- all distinct,
// and "the k largest keys" is python_ref's selection.
inline uint64_t topk_key(const float* xp, int64_t j) {
  return (uint64_t(magnitude_order(xp[j])) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(j));
}

constexpr int64_t kTopkChunk = int64_t(1) << 16;  // the fixed work unit of the passes (not the thread count's)
constexpr int64_t kTopkBins = int64_t(1) << 16;   // a 16-bit digit of the magnitude order

// The histogram of the magnitude orders' high 16 bits (no `high`), or of the low 16 bits of
// those whose high bits are `high`: one histogram per thread, added up into bins (integer
// counts: the same whatever the threads).
void topk_histogram(const float* xp, int64_t N, std::optional<uint32_t> high, std::vector<int64_t>& bins) {
  const int64_t chunks = (N + kTopkChunk - 1) / kTopkChunk;
  const int threads = at::get_num_threads();
  std::vector<uint32_t> hist(static_cast<size_t>(threads) * kTopkBins, 0u);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    uint32_t* h = hist.data() + static_cast<size_t>(at::get_thread_num()) * kTopkBins;
    for (int64_t j = c0 * kTopkChunk, end = std::min(N, c1 * kTopkChunk); j < end; ++j) {
      const uint32_t m = magnitude_order(xp[j]);
      if (!high) {
        ++h[m >> 16];
      } else if ((m >> 16) == *high) {
        ++h[m & 0xFFFFu];
      }
    }
  });
  bins.assign(kTopkBins, 0);
  for (int t = 0; t < threads; ++t)
    for (int64_t b = 0; b < kTopkBins; ++b) bins[b] += hist[static_cast<size_t>(t) * kTopkBins + b];
}

// The digit d where the count from the top reaches `want`; `above` gets the count of the
// digits above it.
uint32_t topk_pick(const std::vector<int64_t>& bins, int64_t want, int64_t& above) {
  above = 0;
  for (int64_t d = kTopkBins - 1;; --d) {
    if (above + bins[d] >= want) return static_cast<uint32_t>(d);
    above += bins[d];
  }
}

// Per fixed chunk, how many j satisfy pred(j); returns the chunks' prefix sums (size chunks + 1).
template <typename Pred>
std::vector<int64_t> topk_chunk_offsets(int64_t N, Pred pred) {
  const int64_t chunks = (N + kTopkChunk - 1) / kTopkChunk;
  std::vector<int64_t> offset(static_cast<size_t>(chunks) + 1, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t n = 0;
      for (int64_t j = c * kTopkChunk, end = std::min(N, (c + 1) * kTopkChunk); j < end; ++j) n += pred(j);
      offset[c + 1] = n;
    }
  });
  for (int64_t c = 0; c < chunks; ++c) offset[c + 1] += offset[c];
  return offset;
}

// ip[0, k) = the indices of the k largest keys of x[0, N), ascending (0 < k < N <= 2^32).
// The key of j is (m_j << 32) | ~j, m_j its magnitude order: all keys distinct, and "the k
// largest" is python_ref's selection (a tie to the lower index).  A radix select with no
// sort: the histograms of m's high, then low, 16 bits give the magnitude M of the k-th
// largest key and how many of that magnitude it takes (need); the need-th j with m_j == M,
// in index order, closes the threshold key T; then every j with key >= T is written in index
// order, by fixed chunks (a count per chunk, prefix sums, each chunk's writes).  x is read
// six times (about 24 B a value, streamed), whatever the values: equal magnitudes (an
// all-zero update) cost what distinct ones do.  The previous form wrote a key per value and
// ran std::nth_element over all N of them: 60 ms for 11.2M values on Zen 5.
void topk_select_32(const float* xp, int64_t N, int64_t k, int64_t* ip) {
  std::vector<int64_t> bins;
  int64_t above_high = 0, above_low = 0;
  topk_histogram(xp, N, std::nullopt, bins);
  const uint32_t high = topk_pick(bins, k, above_high);
  topk_histogram(xp, N, high, bins);
  const uint32_t magnitude = (high << 16) | topk_pick(bins, k - above_high, above_low);
  const int64_t need = k - above_high - above_low;  // >= 1 of the values of that magnitude, lowest index first
  const std::vector<int64_t> equal =
      topk_chunk_offsets(N, [&](int64_t j) { return magnitude_order(xp[j]) == magnitude; });
  const int64_t chunk = std::upper_bound(equal.begin(), equal.end(), need - 1) - equal.begin() - 1;
  int64_t seen = equal[chunk], last = -1;
  for (int64_t j = chunk * kTopkChunk; seen < need; ++j) {
    if (magnitude_order(xp[j]) == magnitude) {
      ++seen;
      last = j;
    }
  }
  const uint64_t threshold = topk_key(xp, last);
  const std::vector<int64_t> offset = topk_chunk_offsets(N, [&](int64_t j) { return topk_key(xp, j) >= threshold; });
  const int64_t chunks = static_cast<int64_t>(offset.size()) - 1;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* out = ip + offset[c];
      for (int64_t j = c * kTopkChunk, end = std::min(N, (c + 1) * kTopkChunk); j < end; ++j)
        if (topk_key(xp, j) >= threshold) *out++ = j;
    }
  });
}

}  // namespace

std::tuple<Tensor, Tensor> topk_encode_cpu(const Tensor& x, int64_t k) {
  const char* op = "fedopt_C::topk_encode";
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 1 && x.is_floating_point(), op,
              ": x must be a 1-D floating-point CPU tensor, got ", x.scalar_type(), " ", x.sizes());
  const Tensor xf = x.to(at::kFloat).contiguous();  // fp16 / bf16 widen exactly; fp64 rounds once
  const int64_t N = xf.numel();
  TORCH_CHECK(k >= 0 && k <= N, op, ": k must be in [0, ", N, "], got ", k);
  Tensor values = at::empty({k}, x.options().dtype(at::kFloat));
  Tensor indices = at::empty({k}, x.options().dtype(at::kLong));
  if (k == 0) return {values, indices};
  const float* xp = xf.const_data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  if (k == N) {
    for (int64_t j = 0; j < N; ++j) ip[j] = j;
  } else if (N <= int64_t(0xFFFFFFFF)) {
    topk_select_32(xp, N, k, ip);
    float* vp = values.data_ptr<float>();
    at::parallel_for(0, k, kMinColumnsPerThread, [&](int64_t a, int64_t b) {
      for (int64_t t = a; t < b; ++t) vp[t] = xp[ip[t]];
    });
    return {values, indices};
  } else {
    std::vector<std::pair<uint32_t, int64_t>> key(static_cast<size_t>(N));
    for (int64_t j = 0; j < N; ++j) key[j] = {magnitude_order(xp[j]), j};
    std::nth_element(key.begin(), key.begin() + (k - 1), key.end(), [](const auto& a, const auto& b) {
      return a.first != b.first ? a.first > b.first : a.second < b.second;
    });
    for (int64_t t = 0; t < k; ++t) ip[t] = key[t].second;
  }
  std::sort(ip, ip + k);
  float* vp = values.data_ptr<float>();
  for (int64_t t = 0; t < k; ++t) vp[t] = xp[ip[t]];
  return {values, indices};
}

}  // namespace fedopt::cpu::compressed

TORCH_LIBRARY_IMPL(fedopt_C, CPU, m) {
  m.impl("topk_encode", &fedopt::cpu::compressed::topk_encode_cpu);
}
