// The output buffers of a block encode (fedopt_C::block_quantize_into, CPU and CUDA):
// what the kernels write, checked before anything is written.  codes: int8 [N] (kind 0),
// uint8 [ceil(N / 2)] (kind 1, two nibbles per byte), uint8 [N] (kind 2, the e4m3fn
// bits); scales: float32 [ceil(N / block)]; both contiguous, on x's device.  A reply
// arena hands these out as views of one host mapping (fedopt_kernels/compression/reply_arena.py),
// so the encode writes where the aggregation will read, with no copy.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace fedopt {

inline void check_block_encode_outputs(const char* op, const at::Tensor& x, int64_t kind, int64_t block,
                                       const at::Tensor& codes, const at::Tensor& scales) {
  const int64_t N = x.numel(), nb = (N + block - 1) / block;
  const int64_t code_numel = kind == 1 ? (N + 1) / 2 : N;
  const at::ScalarType code_dtype = kind == 0 ? at::kChar : at::kByte;
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
