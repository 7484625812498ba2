// The ATen binding of the weighted aggregation (`fedopt_C::aggregate`), of its backward
// (`fedopt_C::client_dots`) and of `fedopt_C::add_noise_`: argument checks, allocations,
// the clients' address table (fedopt/table_cache.h), then the launchers of
// csrc/cuda/kernels/aggregate.cuh, whose header comment has the kernels, the tiling
// rule and the DP noise.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>

#include <limits>
#include <vector>

#include "fedopt/cuda_aten.h"
#include "fedopt/table_cache.h"
#include "kernels/aggregate.cuh"
#include "ops.h"

namespace fedopt {
namespace cuda {

namespace {

// The clients as the kernels see them, after the memory-safety checks.
struct Clients {
  int64_t C = 0, N = 0;
  at::ScalarType dtype;
  at::Device device = at::Device(at::kCUDA);
  bool aligned = true;
  at::Tensor table;  // the device table (cache) of a list of more than one tensor
  const int64_t* ptrs = nullptr;
  int64_t base = 0, row_stride = 0;
};

void check_first_client(const char* op, at::TensorList clients) {
  TORCH_CHECK(!clients.empty(), op, ": clients must hold a [C, N] tensor or C >= 1 vectors");
  TORCH_CHECK(clients[0].defined() && clients[0].is_cuda(), op, ": clients must be CUDA tensors");
}

// Call with a CUDAGuard on clients[0]'s device (the address table uses it).
Clients check_clients(const char* op, at::TensorList clients) {
  check_first_client(op, clients);
  Clients c;
  const at::Tensor& t0 = clients[0];
  c.device = t0.device();
  c.dtype = t0.scalar_type();
  check_supported_float(op, "clients", c.dtype);
  if (clients.size() == 1 && t0.dim() == 2) {  // one [C, N] tensor
    TORCH_CHECK(t0.is_contiguous(), op, ": clients as a [C, N] tensor must be contiguous, got strides ",
                t0.strides());
    c.C = t0.size(0);
    c.N = t0.size(1);
    c.base = address_of(t0);
    c.row_stride = c.N;
    c.aligned = aligned16(t0.data_ptr()) && (c.N * static_cast<int64_t>(t0.element_size())) % 16 == 0;
    return c;
  }
  c.C = static_cast<int64_t>(clients.size());
  c.N = t0.numel();
  std::vector<int64_t> addresses(clients.size());
  for (size_t i = 0; i < clients.size(); ++i) {
    const at::Tensor& t = clients[i];
    TORCH_CHECK(t.defined() && t.device() == c.device && t.scalar_type() == c.dtype, op, ": clients[", i,
                "] must be a ", c.dtype, " tensor on ", c.device);
    TORCH_CHECK(t.dim() == 1 && t.numel() == c.N && t.is_contiguous(), op, ": clients[", i,
                "] must be a contiguous vector of length ", c.N, ", got sizes ", t.sizes(), " strides ", t.strides());
    addresses[i] = c.N > 0 ? address_of(t) : 0;
    if (c.N > 0) c.aligned = c.aligned && aligned16(t.data_ptr());
  }
  if (c.C == 1) {
    c.base = addresses[0];
  } else if (c.N > 0) {
    c.table = device_table(addresses, c.device, op);
    c.ptrs = c.table.data_ptr<int64_t>();
  }
  return c;
}

// The [N] companion tensor (out or g): contiguous, on the device, clients' or acc dtype.
void check_vector(const char* op, const char* name, const at::Tensor& t, const Clients& c) {
  TORCH_CHECK(t.defined() && t.device() == c.device, op, ": ", name, " must be on ", c.device);
  TORCH_CHECK(t.dim() == 1 && t.numel() == c.N && t.is_contiguous(), op, ": ", name, " must be a contiguous [", c.N,
              "] vector, got sizes ", t.sizes(), " strides ", t.strides());
  TORCH_CHECK(t.scalar_type() == c.dtype || t.scalar_type() == acc_type_of(c.dtype), op, ": ", name,
              " must have dtype ", c.dtype, " or ", acc_type_of(c.dtype), ", got ", t.scalar_type());
}

// The RowsArgs fields both launchers fill alike: where the clients are, the tiling, whether
// the clients and the [N] companion `other` (out or g) allow 16-byte accesses, the partials.
template <typename acc_t>
RowsArgs<acc_t> make_rows_args(const Clients& c, const AggTiling& tiling, const void* other, acc_t* partials) {
  RowsArgs<acc_t> a{};
  a.ptrs = c.ptrs;
  a.base = c.base;
  a.row_stride = c.row_stride;
  a.C = c.C;
  a.N = c.N;
  a.num_tiles = tiling.tiles;
  a.aligned = c.aligned && aligned16(other);
  a.partials = partials;
  return a;
}

// launch_aggregate with other_t = out's dtype: the clients' dtype or acc.
template <typename scalar_t, bool kNoise>
cudaError_t launch_aggregate_for(const RowsArgs<acc_type<scalar_t>>& a, at::ScalarType other, at::ScalarType clients,
                                 const AggTiling& t, acc_type<scalar_t>* sq_norms, acc_type<scalar_t>* sq_norm,
                                 cudaStream_t stream) {
  if (other == clients) return launch_aggregate<scalar_t, scalar_t, kNoise>(a, t, sq_norms, sq_norm, stream);
  return launch_aggregate<scalar_t, acc_type<scalar_t>, kNoise>(a, t, sq_norms, sq_norm, stream);
}

// The DP noise arguments of aggregate and add_noise_, checked before anything is
// launched: a key in [0, 2^63), the std tensor (when given) one float32 / float64
// element on the data's device, converted there to acc (a device op: no host sync).
struct NoiseStd {
  HyperTensor tensor;
};

NoiseStd noise_std_on_device(const char* op, std::optional<int64_t> key,
                             const std::optional<at::Tensor>& std_tensor, at::ScalarType acc,
                             const at::Device& device) {
  if (key.has_value()) TORCH_CHECK(*key >= 0, op, ": noise_key must be in [0, 2^63), got ", *key);
  if (std_tensor.has_value() && std_tensor->defined()) {
    const at::ScalarType t = std_tensor->scalar_type();
    TORCH_CHECK(t == at::kFloat || t == at::kDouble, op, ": noise_std_tensor must be float32 or float64, got ", t);
  }
  return {hyper_tensor(std_tensor, op, "noise_std_tensor", acc, device)};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> aggregate(at::TensorList clients, const at::Tensor& weights, double gamma,
                                             const std::optional<at::Tensor>& gamma_tensor, const at::Tensor& out,
                                             const std::optional<at::Tensor>& skip, std::optional<int64_t> noise_key,
                                             double noise_std, const std::optional<at::Tensor>& noise_std_tensor) {
  const char* op = "fedopt_C::aggregate (CUDA)";
  check_first_client(op, clients);
  const c10::cuda::CUDAGuard guard(clients[0].device());
  const Clients c = check_clients(op, clients);
  TORCH_CHECK(c.C < std::numeric_limits<int32_t>::max(), op, ": too many clients (", c.C, ")");
  const at::ScalarType acc = acc_type_of(c.dtype);
  check_vector(op, "out", out, c);
  TORCH_CHECK(weights.defined() && weights.device() == c.device && weights.numel() == c.C, op,
              ": weights must hold ", c.C, " values on ", c.device);
  TORCH_CHECK(weights.is_floating_point(), op, ": weights must be floating point, got ", weights.scalar_type());
  const at::Tensor w = weights.to(acc).contiguous();
  const HyperTensor gamma_h = hyper_tensor(gamma_tensor, op, "gamma_tensor", acc, c.device);
  const NoiseStd noise_h = noise_std_on_device(op, noise_key, noise_std_tensor, acc, c.device);
  at::Tensor skip_t;
  if (skip.has_value() && skip->defined()) {
    TORCH_CHECK(skip->device() == c.device && skip->numel() == 1, op,
                ": skip must be a one-element tensor on ", c.device);
    skip_t = skip->scalar_type() == at::kBool ? *skip : skip->to(at::kBool);
  }
  const bool* skip_ptr = skip_t.defined() ? skip_t.data_ptr<bool>() : nullptr;

  const auto opts = at::TensorOptions().dtype(acc).device(c.device);
  at::Tensor sq_norms = at::empty({c.C}, opts);
  at::Tensor sq_norm = at::empty({}, opts);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(c.device.index()).stream();
  const AggTiling tiling = aggregate_tiling(c.N, static_cast<int64_t>(c10::elementSize(c.dtype)));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, c.dtype, "fedopt_aggregate_cuda", [&] {
    using acc_t = acc_type<scalar_t>;
    const int64_t nb = tiling.blocks;
    at::Tensor partials = at::empty({(c.C + 1) * nb}, opts);
    RowsArgs<acc_t> a{};
    if (nb > 0) {
      a = make_rows_args<acc_t>(c, tiling, out.data_ptr(), partials.data_ptr<acc_t>());
      a.weights = w.data_ptr<acc_t>();
      a.gamma = static_cast<acc_t>(gamma);
      a.gamma_ptr = static_cast<const acc_t*>(gamma_h.ptr);
      a.out = out.data_ptr();
      if (noise_key.has_value()) {
        a.noise_key = static_cast<uint64_t>(*noise_key);
        a.noise_std = static_cast<acc_t>(noise_std);
        a.noise_std_ptr = static_cast<const acc_t*>(noise_h.tensor.ptr);
      }
    }
    // What the finalize pass reads even when N == 0 (it writes zeros then).
    a.C = c.C;
    a.partials = partials.data_ptr<acc_t>();
    a.skip = skip_ptr;
    acc_t* const q = sq_norms.data_ptr<acc_t>();
    acc_t* const Q = sq_norm.data_ptr<acc_t>();
    if (noise_key.has_value()) {
      C10_CUDA_CHECK((launch_aggregate_for<scalar_t, true>(a, out.scalar_type(), c.dtype, tiling, q, Q, stream)));
    } else {
      C10_CUDA_CHECK((launch_aggregate_for<scalar_t, false>(a, out.scalar_type(), c.dtype, tiling, q, Q, stream)));
    }
  });
  return {sq_norms, sq_norm};
}

void add_noise_(const at::Tensor& out, int64_t noise_key, double noise_std,
                const std::optional<at::Tensor>& noise_std_tensor, const std::optional<at::Tensor>& skip) {
  const char* op = "fedopt_C::add_noise_ (CUDA)";
  TORCH_CHECK(out.defined() && out.is_cuda(), op, ": out must be a CUDA tensor");
  check_supported_float(op, "out", out.scalar_type());
  TORCH_CHECK(out.dim() == 1 && out.is_contiguous(), op, ": out must be a contiguous 1-D tensor, got sizes ",
              out.sizes(), " strides ", out.strides());
  const c10::cuda::CUDAGuard guard(out.device());
  const at::ScalarType acc = acc_type_of(out.scalar_type());
  const NoiseStd noise_h = noise_std_on_device(op, noise_key, noise_std_tensor, acc, out.device());
  at::Tensor skip_t;
  if (skip.has_value() && skip->defined()) {
    TORCH_CHECK(skip->device() == out.device() && skip->numel() == 1, op, ": skip must be a one-element tensor on ",
                out.device());
    skip_t = skip->scalar_type() == at::kBool ? *skip : skip->to(at::kBool);
  }
  const int64_t n = out.numel();
  if (n == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(out.device().index()).stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "fedopt_add_noise_cuda", [&] {
    using acc_t = acc_type<scalar_t>;
    C10_CUDA_CHECK(launch_add_noise<scalar_t>(
        out.data_ptr<scalar_t>(), n, static_cast<uint64_t>(noise_key), static_cast<acc_t>(noise_std),
        static_cast<const acc_t*>(noise_h.tensor.ptr), skip_t.defined() ? skip_t.data_ptr<bool>() : nullptr, stream));
  });
}

at::Tensor client_dots(at::TensorList clients, const at::Tensor& g) {
  const char* op = "fedopt_C::client_dots (CUDA)";
  check_first_client(op, clients);
  const c10::cuda::CUDAGuard guard(clients[0].device());
  const Clients c = check_clients(op, clients);
  TORCH_CHECK(c.C <= std::numeric_limits<int32_t>::max(), op, ": too many clients (", c.C, ")");
  const at::ScalarType acc = acc_type_of(c.dtype);
  check_vector(op, "g", g, c);
  const auto opts = at::TensorOptions().dtype(acc).device(c.device);
  at::Tensor dots = at::empty({c.C}, opts);
  if (c.C == 0) return dots;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(c.device.index()).stream();
  const AggTiling tiling = aggregate_tiling(c.N, static_cast<int64_t>(c10::elementSize(c.dtype)));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, c.dtype, "fedopt_client_dots_cuda", [&] {
    using acc_t = acc_type<scalar_t>;
    const int64_t nb = tiling.blocks;
    at::Tensor partials = at::empty({c.C * nb}, opts);
    RowsArgs<acc_t> a{};
    if (nb > 0) {
      a = make_rows_args<acc_t>(c, tiling, g.data_ptr(), partials.data_ptr<acc_t>());
      a.g = g.data_ptr();
    }
    a.C = c.C;
    a.partials = partials.data_ptr<acc_t>();
    acc_t* const dots_ptr = dots.data_ptr<acc_t>();
    if (g.scalar_type() == c.dtype) {
      C10_CUDA_CHECK((launch_client_dots<scalar_t, scalar_t>(a, tiling, dots_ptr, stream)));
    } else {
      C10_CUDA_CHECK((launch_client_dots<scalar_t, acc_t>(a, tiling, dots_ptr, stream)));
    }
  });
  return dots;
}

}  // namespace cuda
}  // namespace fedopt

