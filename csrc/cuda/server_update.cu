// The ATen binding of the server optimizer step `fedopt_C::server_update_`: the
// memory-safety checks, the chunk rows (fedopt/chunks.h) and their device table
// (fedopt/table_cache.h), the device-side scalars, then launch_server_update.  The
// kernel, its layout and its arithmetic: csrc/cuda/kernels/server_update.cuh.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>

#include <limits>
#include <vector>

#include "fedopt/chunks.h"
#include "fedopt/cuda_aten.h"
#include "fedopt/table_cache.h"
#include "kernels/server_update.cuh"
#include "ops.h"

namespace fedopt {
namespace cuda {

void server_update_(at::TensorList params, at::TensorList updates, at::TensorList exp_avg,
                    at::TensorList exp_avg_sq, int64_t rule, double lr, const std::optional<at::Tensor>& lr_tensor,
                    double gamma, const std::optional<at::Tensor>& gamma_tensor, double beta1, double beta2,
                    double tau, bool nesterov, const std::optional<at::Tensor>& skip) {
  const char* op = "fedopt_C::server_update_ (CUDA)";
  // Only what would be memory-unsafe is checked here (the ops layer validates values).
  TORCH_CHECK(rule >= 0 && rule <= 4, op,
              ": rule must be 0 (sgd), 1 (momentum), 2 (adagrad), 3 (adam) or 4 (yogi), got ", rule);
  const ServerRule r = static_cast<ServerRule>(rule);
  const bool has_m = r != ServerRule::kSgd;
  const bool has_v = has_m && r != ServerRule::kMomentum;
  const size_t T = params.size();
  TORCH_CHECK(updates.size() == T, op, ": ", updates.size(), " updates for ", T, " params");
  TORCH_CHECK(!has_m || exp_avg.size() == T, op, ": rule ", rule, " needs one exp_avg per param, got ",
              exp_avg.size(), " for ", T, " params");
  TORCH_CHECK(!has_v || exp_avg_sq.size() == T, op, ": rule ", rule, " needs one exp_avg_sq per param, got ",
              exp_avg_sq.size(), " for ", T, " params");
  if (T == 0) return;

  const FirstTensor first = check_first_tensor(op, "params", params[0]);
  const at::Device device = first.device;
  const at::ScalarType dtype = first.dtype;
  const at::ScalarType acc = acc_type_of(dtype);
  const c10::cuda::CUDAGuard guard(device);

  // Every tensor is read as the flat array [data_ptr, data_ptr + numel) in the
  // params' logical order (D is a flat vector in that order): contiguous, same numel.
  auto check = [&](const at::Tensor& t, const char* name, size_t i, at::ScalarType want, int64_t numel) {
    TORCH_CHECK(t.defined(), op, ": ", name, "[", i, "] is undefined");
    TORCH_CHECK(t.device() == device, op, ": ", name, "[", i, "] is on ", t.device(), " but params[0] is on ",
                device);
    TORCH_CHECK(t.scalar_type() == want, op, ": ", name, "[", i, "] has dtype ", t.scalar_type(), ", expected ",
                want);
    TORCH_CHECK(t.is_contiguous(), op, ": ", name, "[", i, "] must be contiguous, got sizes ", t.sizes(),
                " strides ", t.strides());
    TORCH_CHECK(t.numel() == numel, op, ": ", name, "[", i, "] has ", t.numel(), " elements but params[", i,
                "] has ", numel);
  };
  for (size_t i = 0; i < T; ++i) {
    const int64_t n = params[i].defined() ? params[i].numel() : 0;
    check(params[i], "params", i, dtype, n);
    check(updates[i], "updates", i, acc, n);
    if (has_m) check(exp_avg[i], "exp_avg", i, dtype, n);
    if (has_v) check(exp_avg_sq[i], "exp_avg_sq", i, dtype, n);
  }
  // The chunk rows (fedopt/chunks.h): x, D, m, v; no groups.
  std::vector<ChunkTensor> tensors(T);
  for (size_t i = 0; i < T; ++i) {
    ChunkTensor& t = tensors[i];
    t.numel = params[i].numel();
    if (t.numel == 0) continue;  // no row, and no data_ptr() of an empty tensor is ever used
    t.ptr[0] = address_of(params[i]);
    t.ptr[1] = address_of(updates[i]);
    t.ptr[2] = has_m ? address_of(exp_avg[i]) : 0;
    t.ptr[3] = has_v ? address_of(exp_avg_sq[i]) : 0;
  }
  const int64_t esize = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t dsize = static_cast<int64_t>(c10::elementSize(acc));
  const ChunkRows rows = build_chunk_rows(tensors, {esize, dsize, esize, esize}, /*num_groups=*/1);
  const int64_t num_chunks = rows.num_rows;
  if (num_chunks == 0) return;  // all tensors empty: launch (and convert, upload) nothing
  TORCH_CHECK(num_chunks <= std::numeric_limits<int32_t>::max(), op, ": too many chunks (", num_chunks, ")");
  const HyperTensor lr_h = hyper_tensor(lr_tensor, op, "lr_tensor", acc, device);
  const HyperTensor gamma_h = hyper_tensor(gamma_tensor, op, "gamma_tensor", acc, device);
  const BoolFlag skip_f = bool_flag(skip, op, "skip", device);
  const at::Tensor table = device_table(rows.blob, device, op);  // alive until the launch is queued
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "fedopt_server_update_cuda", [&] {
    using acc_t = acc_type<scalar_t>;
    ServerArgs<acc_t> a;
    a.rows = table.data_ptr<int64_t>();
    // Rounded once to acc, as the CPU kernel and torch (a Python float in an acc op) do.
    a.lr = static_cast<acc_t>(lr);
    a.gamma = static_cast<acc_t>(gamma);
    a.beta1 = static_cast<acc_t>(beta1);
    a.beta2 = static_cast<acc_t>(beta2);
    a.tau = static_cast<acc_t>(tau);
    a.lr_ptr = static_cast<const acc_t*>(lr_h.ptr);
    a.gamma_ptr = static_cast<const acc_t*>(gamma_h.ptr);
    a.skip = skip_f.ptr;
    C10_CUDA_CHECK(launch_server_update<scalar_t>(a, num_chunks, r, nesterov, stream));
  });
}

}  // namespace cuda
}  // namespace fedopt

