// CUDA kernel of fedopt_C::coordinate_select (schema and semantics:
// csrc/registration.cpp; the CPU twin: csrc/cpu/robust_select.cpp; oracle:
// python_ref/robust.py).
//
// One pass over the kept clients: thread j owns column j.  It reads the kept clients'
// values of that column in client order (adjacent threads read adjacent columns of each
// row: coalesced) and inserts each into a sorted array in local memory (an insertion
// sort: stable, no comparisons across threads), then reduces the sorted values exactly
// as the CPU kernel does -- mode 0: the mean of v[k .. m-k) with k = min(count,
// (m-1)/2); mode 1: the mean of the `count` values closest to the median, found by
// dropping the farther end (the upper one on a tie).  Sums run in ascending order in
// the acc dtype: deterministic, independent of the launch shape.
//
// A kept client holding a NaN/Inf is flagged with an integer atomicOr (the flags are
// exact whatever the order).  `keep`, `count` and `skip` are read on the device: no
// host sync.  The local array holds kMaxClients values: more clients are refused by
// name (the ops layer checks C first).
//
// Not tuned: insertion sort costs O(m^2) per column, which for m = 20 is a few hundred
// instructions per element -- measured on no GPU here (this machine has none); a
// register sorting network per warp is the obvious next step.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>
#include <optional>

namespace fedopt {
namespace cuda {
namespace {

constexpr int kSelectThreads = 256;

template <int MAXC, typename scalar_t, typename acc_t, typename out_t>
__global__ void coordinate_select_kernel(const scalar_t* __restrict__ X, const bool* __restrict__ keep,
                                         const int64_t* __restrict__ count_ptr, int mode, int64_t C, int64_t N,
                                         out_t* __restrict__ out, int* __restrict__ bad,
                                         const bool* __restrict__ skip) {
  if (skip != nullptr && *skip) return;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= N) return;
  const acc_t big = std::numeric_limits<acc_t>::max();
  acc_t v[MAXC];
  int64_t m = 0;
  for (int64_t i = 0; i < C; ++i) {
    if (!keep[i]) continue;
    const acc_t x = static_cast<acc_t>(X[i * N + j]);
    if (!(fabs(x) <= big)) atomicOr(bad + i, 1);
    int64_t p = m;
    while (p > 0 && x < v[p - 1]) {
      v[p] = v[p - 1];
      --p;
    }
    v[p] = x;
    ++m;
  }
  const int64_t count = *count_ptr;
  acc_t res = 0;
  if (m > 0 && mode == 0) {
    const int64_t k = count < (m - 1) / 2 ? count : (m - 1) / 2;
    for (int64_t i = k; i < m - k; ++i) res += v[i];
    res /= static_cast<acc_t>(m - 2 * k);
  } else if (m > 0) {
    const int64_t beta = count < 1 ? 1 : (count > m ? m : count);
    const acc_t med = m % 2 ? v[(m - 1) / 2] : (v[m / 2 - 1] + v[m / 2]) / acc_t(2);
    int64_t lo = 0, hi = m - 1;
    while (hi - lo + 1 > beta) {
      if (fabs(v[lo] - med) > fabs(v[hi] - med)) {
        ++lo;
      } else {
        --hi;
      }
    }
    for (int64_t i = lo; i <= hi; ++i) res += v[i];
    res /= static_cast<acc_t>(beta);
  }
  out[j] = static_cast<out_t>(res);
}

constexpr int64_t kMaxClients = 1024;

template <int MAXC, typename scalar_t, typename acc_t, typename out_t>
void launch(const at::Tensor& X, const at::Tensor& keep, const at::Tensor& count, int mode, const at::Tensor& out,
            const at::Tensor& bad, const bool* skip) {
  const int64_t C = X.size(0), N = X.size(1);
  const int64_t blocks = (N + kSelectThreads - 1) / kSelectThreads;
  coordinate_select_kernel<MAXC, scalar_t, acc_t, out_t>
      <<<blocks, kSelectThreads, 0, c10::cuda::getCurrentCUDAStream(X.device().index()).stream()>>>(
          X.const_data_ptr<scalar_t>(), keep.const_data_ptr<bool>(), count.const_data_ptr<int64_t>(), mode, C, N,
          out.data_ptr<out_t>(), bad.data_ptr<int>(), skip);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, typename out_t>
void launch_sized(const at::Tensor& X, const at::Tensor& keep, const at::Tensor& count, int mode,
                  const at::Tensor& out, const at::Tensor& bad, const bool* skip) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = X.size(0);
  if (C <= 32) {
    launch<32, scalar_t, acc_t, out_t>(X, keep, count, mode, out, bad, skip);
  } else if (C <= 128) {
    launch<128, scalar_t, acc_t, out_t>(X, keep, count, mode, out, bad, skip);
  } else {
    launch<kMaxClients, scalar_t, acc_t, out_t>(X, keep, count, mode, out, bad, skip);
  }
}

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
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "coordinate_select", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      if (out_acc) {
        launch_sized<scalar_t, acc_t>(X, keep, count, static_cast<int>(mode), out, bad, skip_ptr);
      } else {
        launch_sized<scalar_t, scalar_t>(X, keep, count, static_cast<int>(mode), out, bad, skip_ptr);
      }
    });
  }
  return bad.ne(0);
}

}  // namespace
}  // namespace cuda
}  // namespace fedopt

TORCH_LIBRARY_IMPL(fedopt_C, CUDA, m) { m.impl("coordinate_select", &fedopt::cuda::coordinate_select_cuda); }
