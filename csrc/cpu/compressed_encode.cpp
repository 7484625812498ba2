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
    std::vector<uint64_t> key(static_cast<size_t>(N));
    at::parallel_for(0, N, kMinColumnsPerThread, [&](int64_t a, int64_t b) {
      for (int64_t j = a; j < b; ++j)
        key[j] = (uint64_t(magnitude_order(xp[j])) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(j));
    });
    std::nth_element(key.begin(), key.begin() + (k - 1), key.end(), std::greater<uint64_t>());
    for (int64_t t = 0; t < k; ++t) ip[t] = int64_t(0xFFFFFFFFu - static_cast<uint32_t>(key[t] & 0xFFFFFFFFu));
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
