// The output buffers of a block encode (fedopt_C::block_quantize and block_quantize_into, CPU and CUDA):
// what the kernels write, checked before anything is written.  codes: int8 [N] (kind 0),
// uint8 [ceil(N / 2)] (kind 1, two nibbles per byte), uint8 [N] (kind 2, the e4m3fn
// bits); scales: float32 [ceil(N / block)]; both contiguous, on x's device.  A reply
// arena hands these out as views of one host mapping (fedopt_kernels/compression/reply_arena.py),
// so the encode writes where the aggregation will read, with no copy.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <tuple>

namespace fedopt {

// The layout of kind `kind`'s outputs for N values.
inline int64_t block_code_numel(int64_t kind, int64_t N) { return kind == 1 ? (N + 1) / 2 : N; }
inline at::ScalarType block_code_dtype(int64_t kind) { return kind == 0 ? at::kChar : at::kByte; }
inline int64_t block_num_scales(int64_t N, int64_t block) { return (N + block - 1) / block; }

// Fresh outputs for block_quantize (the op that returns them), on x's device.
inline std::tuple<at::Tensor, at::Tensor> empty_block_encode_outputs(const at::Tensor& x, int64_t kind, int64_t block) {
  const int64_t N = x.numel();
  return {at::empty({block_code_numel(kind, N)}, x.options().dtype(block_code_dtype(kind))),
          at::empty({block_num_scales(N, block)}, x.options().dtype(at::kFloat))};
}

inline void check_block_encode_outputs(const char* op, const at::Tensor& x, int64_t kind, int64_t block,
                                       const at::Tensor& codes, const at::Tensor& scales) {
  const int64_t N = x.numel(), nb = block_num_scales(N, block);
  const int64_t code_numel = block_code_numel(kind, N);
  const at::ScalarType code_dtype = block_code_dtype(kind);
  TORCH_CHECK(codes.scalar_type() == code_dtype && codes.dim() == 1 && codes.numel() == code_numel &&
                  codes.is_contiguous() && codes.device() == x.device(),
              op, ": codes must be a contiguous 1-D ", code_dtype, " tensor of ", code_numel, " values on ",
              x.device(), ", got ", codes.scalar_type(), " ", codes.sizes(), " on ", codes.device());
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 1 && scales.numel() == nb &&
                  scales.is_contiguous() && scales.device() == x.device(),
              op, ": scales must be a contiguous 1-D float32 tensor of ", nb, " values on ", x.device(), ", got ",
              scales.scalar_type(), " ", scales.sizes(), " on ", scales.device());
}

}  // namespace fedopt
