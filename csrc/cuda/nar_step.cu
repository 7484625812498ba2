// The ATen binding of the FedNAR step: `fedopt_C::nar_step_` (a list of tensors forming
// one group), `fedopt_C::nar_step_batched_` (the rows of [C, N] tensors, one group per
// row), `nar_sq_norm` and `nar_apply_`.  It checks the arguments, allocates the outputs
// and partials, builds the chunk rows (fedopt/chunks.h) and their device table
// (fedopt/table_cache.h), decides the finalize pass, and queues the kernels through
// launch_nar.  The kernels, the launch order and why: csrc/cuda/kernels/nar_step.cuh.
#include <ATen/Dispatch.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>

#include <cerrno>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "fedopt/chunks.h"
#include "fedopt/cuda_aten.h"
#include "fedopt/table_cache.h"
#include "kernels/nar_step.cuh"
#include "ops.h"

namespace fedopt {
namespace cuda {

int64_t max_redundant_partials() {
  const char* env = std::getenv("FEDOPT_MAX_REDUNDANT_PARTIALS");
  if (env == nullptr || *env == '\0') return kMaxRedundantPartials;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(env, &end, 10);
  TORCH_CHECK(end != env && *end == '\0' && errno == 0 && v >= 0,
              "fedopt_C: FEDOPT_MAX_REDUNDANT_PARTIALS must be a non-negative integer, got '", env, "'");
  return static_cast<int64_t>(v);
}

namespace {

// The part shared by every op: hyperparameters, outputs, launches.  kNormOnly returns
// the sum of squares as `norm` (the other two outputs are unset); kApply reads it from
// `sq_in` (one element on `device`).  `max_group_partials`: the most chunks of any group
// (decides the finalize pass).
std::tuple<at::Tensor, at::Tensor, at::Tensor> run_nar(
    const char* op, const NarLayout& layout, int64_t num_chunks, int64_t num_groups, int64_t max_group_partials,
    at::ScalarType dtype, const at::Device& device, at::IntArrayRef stats_shape, int64_t hyper_groups, double lr,
    const std::optional<at::Tensor>& lr_tensor, double weight_decay,
    const std::optional<at::Tensor>& weight_decay_tensor, double max_norm, int64_t mode, double momentum,
    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
    NarPhase phase = NarPhase::kStep, const std::optional<at::Tensor>& sq_in = std::nullopt) {
  TORCH_CHECK(num_chunks <= std::numeric_limits<int32_t>::max(), op, ": too many chunks (", num_chunks, ")");
  TORCH_CHECK(num_groups <= std::numeric_limits<int32_t>::max(), op, ": too many groups (", num_groups, ")");
  const at::ScalarType acc = acc_type_of(dtype);
  const HyperTensor lr_h = hyper_tensor(lr_tensor, op, "lr_tensor", acc, device, hyper_groups);
  const HyperTensor wd_h = hyper_tensor(weight_decay_tensor, op, "weight_decay_tensor", acc, device, hyper_groups);
  const HyperTensor gs_h = hyper_tensor(grad_scale, op, "grad_scale", acc, device);
  const FoundInf fi = found_inf_flag(found_inf, op, device);

  const auto opts = at::TensorOptions().dtype(acc).device(device);
  at::Tensor norm = at::empty(stats_shape, opts);
  at::Tensor scale = at::empty(stats_shape, opts);
  at::Tensor skipped = at::empty(stats_shape, opts.dtype(at::kBool));
  if (num_groups == 0) return {norm, scale, skipped};
  if (phase == NarPhase::kNormOnly && num_chunks == 0) return {at::zeros(stats_shape, opts), scale, skipped};
  at::Tensor sq;  // nar_apply_'s norm^2 in the acc dtype
  if (phase == NarPhase::kApply) {
    TORCH_CHECK(sq_in.has_value() && sq_in->defined() && sq_in->numel() == 1, op,
                ": sq_norm must be a one-element tensor");
    TORCH_CHECK(sq_in->device() == device, op, ": sq_norm is on ", sq_in->device(), " but the data is on ", device);
    sq = sq_in->to(acc).contiguous();
  }
  // Decided on the host from the table's metadata only.
  const bool finalize = phase == NarPhase::kStep && num_chunks > 0 && max_group_partials > max_redundant_partials();
  // nar_apply_ reads its norm from sq_in: no partials
  at::Tensor partials = phase == NarPhase::kApply ? at::Tensor() : at::empty({num_chunks}, opts);
  at::Tensor sums = finalize ? at::empty({num_groups}, opts) : at::Tensor();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "fedopt_nar_step_cuda", [&] {
    using acc_t = acc_type<scalar_t>;
    NarArgs<acc_t> a;
    a.w = layout;
    a.partials = partials.defined() ? partials.data_ptr<acc_t>() : nullptr;
    a.lr = static_cast<acc_t>(lr);
    a.weight_decay = static_cast<acc_t>(weight_decay);
    a.max_norm = static_cast<acc_t>(max_norm);
    a.momentum = static_cast<acc_t>(momentum);
    a.lr_ptr = static_cast<const acc_t*>(lr_h.ptr);
    a.lr_stride = lr_h.stride;
    a.wd_ptr = static_cast<const acc_t*>(wd_h.ptr);
    a.wd_stride = wd_h.stride;
    a.grad_scale = static_cast<const acc_t*>(gs_h.ptr);
    a.found_inf = fi.ptr;
    a.found_kind = fi.kind;
    a.mode = mode;
    a.norm_out = norm.data_ptr<acc_t>();
    a.scale_out = scale.data_ptr<acc_t>();
    a.skipped_out = skipped.data_ptr<bool>();
    a.num_groups = num_groups;
    a.group_sq = sq.defined() ? sq.const_data_ptr<acc_t>() : nullptr;
    C10_CUDA_CHECK(launch_nar<scalar_t>(a, num_chunks, phase, finalize,
                                        sums.defined() ? sums.data_ptr<acc_t>() : nullptr, stream));
  });
  return {norm, scale, skipped};
}

void check_mode(const char* op, int64_t mode) {
  TORCH_CHECK(mode >= 0 && mode <= 2, op, ": mode must be 0 (co), 1 (grad) or 2 (none), got ", mode);
}

// The chunk rows of a list op (nar_step_, nar_sq_norm, nar_apply_; one group), their
// device copy (from the table cache) kept alive in `table`.
struct ListLayout {
  NarLayout layout;
  at::Tensor table;
  int64_t num_chunks = 0;
  int64_t max_group_partials = 0;
  at::Device device{at::kCUDA};
  at::ScalarType dtype = at::kFloat;
};

ListLayout list_layout(const char* op, at::TensorList params, at::TensorList grads,
                       at::TensorList momentum_buffers, int64_t mode, double momentum) {
  TORCH_CHECK(!params.empty(), op, ": params must hold at least one tensor");
  TORCH_CHECK(grads.size() == params.size(), op, ": grads has ", grads.size(), " tensors but params has ",
              params.size());
  check_mode(op, mode);
  const bool use_mom = momentum != 0.0;
  TORCH_CHECK(!use_mom || momentum_buffers.size() == params.size(), op, ": momentum = ", momentum,
              " needs one momentum buffer per param, got ", momentum_buffers.size(), " for ", params.size(),
              " params");
  const FirstTensor first = check_first_tensor(op, "params", params[0]);
  const at::Device device = first.device;
  const at::ScalarType dtype = first.dtype;
  const c10::cuda::CUDAGuard guard(device);

  const size_t T = params.size();
  auto check = [&](const at::Tensor& t, const char* name, size_t i) {
    TORCH_CHECK(t.defined(), op, ": ", name, "[", i, "] is undefined");
    TORCH_CHECK(t.device() == device, op, ": ", name, "[", i, "] is on ", t.device(), " but params[0] is on ",
                device);
    TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, "[", i, "] has dtype ", t.scalar_type(),
                " but params[0] has ", dtype);
    TORCH_CHECK(is_flat_dense(t), op, ": ", name, "[", i, "] must be dense without gaps or overlaps, got sizes ",
                t.sizes(), " strides ", t.strides());
  };
  std::vector<ChunkTensor> tensors(T);
  for (size_t i = 0; i < T; ++i) {
    check(params[i], "params", i);
    check(grads[i], "grads", i);
    TORCH_CHECK(same_layout(grads[i], params[i]), op, ": grads[", i, "] (sizes ", grads[i].sizes(), ", strides ",
                grads[i].strides(), ") does not match params[", i, "] (sizes ", params[i].sizes(), ", strides ",
                params[i].strides(), ")");
    if (use_mom) {
      check(momentum_buffers[i], "momentum_buffers", i);
      TORCH_CHECK(same_layout(momentum_buffers[i], params[i]), op, ": momentum_buffers[", i,
                  "] does not match params[", i, "] in sizes or strides");
    }
    ChunkTensor& t = tensors[i];
    t.numel = params[i].numel();
    if (t.numel == 0) continue;  // no row, and no data_ptr() of an empty tensor is ever used
    t.ptr[0] = address_of(params[i]);
    t.ptr[1] = address_of(grads[i]);
    t.ptr[2] = use_mom ? address_of(momentum_buffers[i]) : 0;
  }
  const int64_t esize = static_cast<int64_t>(c10::elementSize(dtype));
  const ChunkRows rows = build_chunk_rows(tensors, {esize, esize, esize, 0}, /*num_groups=*/1);

  ListLayout out;
  out.num_chunks = rows.num_rows;
  out.max_group_partials = rows.max_group_rows;
  out.device = device;
  out.dtype = dtype;
  if (rows.num_rows > 0) {
    out.table = device_table(rows.blob, device, op);
    const int64_t* base = out.table.data_ptr<int64_t>();
    out.layout.rows = base;
    out.layout.ranges = base + rows.ranges_offset();
  }
  return out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> nar_step_(
    at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, double lr,
    const std::optional<at::Tensor>& lr_tensor, double weight_decay,
    const std::optional<at::Tensor>& weight_decay_tensor, double max_norm, int64_t mode, double momentum,
    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  const char* op = "fedopt_C::nar_step_ (CUDA)";
  const ListLayout l = list_layout(op, params, grads, momentum_buffers, mode, momentum);
  const c10::cuda::CUDAGuard guard(l.device);
  return run_nar(op, l.layout, l.num_chunks, /*num_groups=*/1, l.max_group_partials, l.dtype, l.device,
                 /*stats_shape=*/{}, /*hyper_groups=*/-1, lr, lr_tensor, weight_decay, weight_decay_tensor, max_norm,
                 mode, momentum, grad_scale, found_inf);
}

at::Tensor nar_sq_norm(at::TensorList params, at::TensorList grads, double weight_decay,
                       const std::optional<at::Tensor>& weight_decay_tensor, int64_t mode,
                       const std::optional<at::Tensor>& grad_scale) {
  const char* op = "fedopt_C::nar_sq_norm (CUDA)";
  const ListLayout l = list_layout(op, params, grads, {}, mode, 0.0);
  const c10::cuda::CUDAGuard guard(l.device);
  return std::get<0>(run_nar(op, l.layout, l.num_chunks, /*num_groups=*/1, l.max_group_partials, l.dtype,
                             l.device, /*stats_shape=*/{}, /*hyper_groups=*/-1, 0.0, std::nullopt, weight_decay,
                             weight_decay_tensor, 1.0, mode, 0.0, grad_scale, std::nullopt, NarPhase::kNormOnly));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> nar_apply_(
    at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, const at::Tensor& sq_norm,
    double lr, const std::optional<at::Tensor>& lr_tensor, double weight_decay,
    const std::optional<at::Tensor>& weight_decay_tensor, double max_norm, int64_t mode, double momentum,
    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  const char* op = "fedopt_C::nar_apply_ (CUDA)";
  const ListLayout l = list_layout(op, params, grads, momentum_buffers, mode, momentum);
  const c10::cuda::CUDAGuard guard(l.device);
  return run_nar(op, l.layout, l.num_chunks, /*num_groups=*/1, l.max_group_partials, l.dtype, l.device,
                 /*stats_shape=*/{}, /*hyper_groups=*/-1, lr, lr_tensor, weight_decay, weight_decay_tensor, max_norm,
                 mode, momentum, grad_scale, found_inf, NarPhase::kApply, sq_norm);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> nar_step_batched_(
    const at::Tensor& params, const at::Tensor& grads, const std::optional<at::Tensor>& momentum_buffers,
    double lr, const std::optional<at::Tensor>& lr_tensor, double weight_decay,
    const std::optional<at::Tensor>& weight_decay_tensor, double max_norm, int64_t mode, double momentum,
    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  const char* op = "fedopt_C::nar_step_batched_ (CUDA)";
  check_mode(op, mode);
  TORCH_CHECK(params.defined() && params.is_cuda(), op, ": params must be a CUDA tensor");
  const at::Device device = params.device();
  const at::ScalarType dtype = params.scalar_type();
  check_supported_float(op, "params", dtype);
  TORCH_CHECK(params.dim() == 2 && params.is_contiguous(), op, ": params must be a contiguous [C, N] tensor, got sizes ",
              params.sizes(), " strides ", params.strides());
  auto check = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
    TORCH_CHECK(t.device() == device && t.scalar_type() == dtype && t.sizes() == params.sizes() &&
                    t.is_contiguous(),
                op, ": ", name, " must be a contiguous ", params.sizes(), " ", dtype, " tensor on ", device, ", got ",
                t.sizes(), " ", t.scalar_type(), " on ", t.device(), (t.is_contiguous() ? "" : " (not contiguous)"));
  };
  check(grads, "grads");
  const bool use_mom = momentum != 0.0;
  if (use_mom) {
    TORCH_CHECK(momentum_buffers.has_value() && momentum_buffers->defined(), op, ": momentum = ", momentum,
                " needs momentum_buffers");
    check(*momentum_buffers, "momentum_buffers");
  }
  const c10::cuda::CUDAGuard guard(device);

  const int64_t C = params.size(0);
  const int64_t N = params.size(1);
  const int64_t cs = chunk_size_for(N);  // the largest group is a row
  const int64_t row_chunks = (N + cs - 1) / cs;
  TORCH_CHECK(row_chunks == 0 || C <= std::numeric_limits<int32_t>::max() / row_chunks, op, ": too many chunks (",
              C, " rows of ", row_chunks, ")");
  const int64_t num_chunks = C * row_chunks;
  NarLayout layout;
  if (num_chunks > 0) {  // no data_ptr() of an empty tensor is ever used
    layout.x_base = address_of(params);
    layout.g_base = address_of(grads);
    layout.b_base = use_mom ? address_of(*momentum_buffers) : 0;
  }
  layout.row_len = N;
  layout.row_chunks = row_chunks;
  layout.chunk_size = cs;
  return run_nar(op, layout, num_chunks, /*num_groups=*/C, /*max_group_partials=*/row_chunks, dtype, device,
                 /*stats_shape=*/{C}, /*hyper_groups=*/C, lr, lr_tensor, weight_decay, weight_decay_tensor, max_norm,
                 mode, momentum, grad_scale, found_inf);
}

}  // namespace cuda
}  // namespace fedopt

