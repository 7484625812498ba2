// The ATen binding of fedopt_C::coordinate_select on CUDA: argument checks, the [C, N]
// stack of a list, the flags tensor, then launch_coordinate_select.  The kernel and its
// trade-offs: csrc/cuda/kernels/robust_select.cuh.
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>

#include "fedopt/cuda_aten.h"
#include "kernels/robust_select.cuh"

namespace fedopt {
namespace cuda {
namespace {

at::Tensor coordinate_select_cuda(at::TensorList clients, const at::Tensor& keep, const at::Tensor& count,
                                  int64_t mode, const at::Tensor& out, const std::optional<at::Tensor>& skip) {
  const char* op = "fedopt_C::coordinate_select";
  TORCH_CHECK(!clients.empty(), op, ": clients must hold one [C, N] tensor or C 1-D tensors");
  // A list is stacked once (O(C N)); a [C, N] tensor is read in place.
  at::Tensor X = clients.size() == 1 && clients[0].dim() == 2 ? clients[0] : at::stack(clients);
  TORCH_CHECK(X.is_cuda() && X.is_contiguous() && X.dim() == 2, op, ": clients must be contiguous CUDA rows");
  const at::ScalarType dtype = X.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": clients has unsupported dtype ", dtype, " (expected float16, bfloat16, float32 or float64)");
  const int64_t C = X.size(0), N = X.size(1);
  TORCH_CHECK(C <= kMaxClients, op, ": at most ", kMaxClients, " clients on CUDA, got ", C);
  TORCH_CHECK(keep.device() == X.device() && keep.scalar_type() == at::kBool && keep.numel() == C &&
                  keep.is_contiguous(),
              op, ": keep must be a contiguous bool tensor of ", C, " elements on ", X.device());
  TORCH_CHECK(count.device() == X.device() && count.scalar_type() == at::kLong && count.numel() == 1, op,
              ": count must be a one-element int64 tensor on ", X.device());
  TORCH_CHECK(mode == 0 || mode == 1, op, ": mode must be 0 (trim) or 1 (closest to the median), got ", mode);
  const at::ScalarType acc = dtype == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(out.device() == X.device() && out.is_contiguous() && out.numel() == N &&
                  (out.scalar_type() == dtype || out.scalar_type() == acc),
              op, ": out must be a contiguous tensor of ", N, " elements with dtype ", dtype, " or ", acc);
  const bool* skip_ptr = nullptr;
  if (skip.has_value()) {
    TORCH_CHECK(skip->device() == X.device() && skip->numel() == 1 && skip->scalar_type() == at::kBool, op,
                ": skip must be a one-element bool tensor on ", X.device());
    skip_ptr = skip->const_data_ptr<bool>();
  }
  const c10::cuda::CUDAGuard guard(X.device());
  at::Tensor bad = at::zeros({C}, X.options().dtype(at::kInt));
  if (N > 0) {
    const bool out_acc = out.scalar_type() != dtype;
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(X.device().index()).stream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "coordinate_select", [&] {
      using acc_t = acc_type<scalar_t>;
      const scalar_t* x = X.const_data_ptr<scalar_t>();
      const bool* k = keep.const_data_ptr<bool>();
      const int64_t* n = count.const_data_ptr<int64_t>();
      int* b = bad.data_ptr<int>();
      const int m = static_cast<int>(mode);
      if (out_acc) {
        C10_CUDA_CHECK(launch_coordinate_select<scalar_t>(x, k, n, m, C, N, out.data_ptr<acc_t>(), b, skip_ptr, stream));
      } else {
        C10_CUDA_CHECK(
            launch_coordinate_select<scalar_t>(x, k, n, m, C, N, out.data_ptr<scalar_t>(), b, skip_ptr, stream));
      }
    });
  }
  return bad.ne(0);
}

}  // namespace
}  // namespace cuda
}  // namespace fedopt

TORCH_LIBRARY_IMPL(fedopt_C, CUDA, m) { m.impl("coordinate_select", &fedopt::cuda::coordinate_select_cuda); }
