// The ATen binding of the client's top-k encode fedopt_C::topk_encode on CUDA: argument
// checks (before any launch), the outputs and the workspace, then the host launcher.
// The radix select and its trade-offs: csrc/cuda/kernels/topk_encode.cuh.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "kernels/topk_encode.cuh"

namespace fedopt::cuda {

using at::Tensor;

std::tuple<Tensor, Tensor> topk_encode(const Tensor& x, int64_t k) {
  const char* op = "fedopt_C::topk_encode";
  const auto t = x.scalar_type();
  TORCH_CHECK(x.is_cuda() && x.dim() == 1 &&
                  (t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble),
              op, ": x must be a 1-D float16, bfloat16, float32 or float64 CUDA tensor, got ", t, " ", x.sizes(),
              " on ", x.device());
  const int64_t N = x.numel();
  TORCH_CHECK(k >= 0 && k <= N, op, ": k must be in [0, ", N, "] (x's length), got ", k);
  const c10::cuda::CUDAGuard guard(x.device());
  const Tensor xc = x.contiguous();  // read in its own dtype: the kernels widen to fp32 as python_ref does
  Tensor values = at::empty({k}, x.options().dtype(at::kFloat));
  Tensor indices = at::empty({k}, x.options().dtype(at::kLong));
  if (k == 0) return {values, indices};
  const bool select = k < N;
  Tensor workspace = at::empty({select ? static_cast<int64_t>(topk_workspace_bytes(N)) : 0},
                               x.options().dtype(at::kByte));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  void* ws = select ? workspace.data_ptr() : nullptr;
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  // c10::Half / c10::BFloat16 (the extension is built with __CUDA_NO_HALF_CONVERSIONS__:
  // these convert to float themselves; tools/gpu_harness uses __half / __nv_bfloat16)
  cudaError_t err = cudaSuccess;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t, "fedopt_topk_encode_cuda", [&] {
    err = launch_topk_encode<scalar_t>(xc.const_data_ptr<scalar_t>(), N, k, vp, ip, ws, stream);
  });
  C10_CUDA_CHECK(err);
  return {values, indices};
}

}  // namespace fedopt::cuda

TORCH_LIBRARY_IMPL(fedopt_C, CUDA, m) { m.impl("topk_encode", TORCH_FN(fedopt::cuda::topk_encode)); }
