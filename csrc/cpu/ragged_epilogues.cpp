// The elementwise ops around a ragged product, on the clients' real rows only.
//
// In the batched engine's traced graph a hidden layer is
//     h = relu(ragged_bmm(x, W^T) + b)          forward (rows: samples)
//     g = threshold_backward(ragged_bmm(d, W), h, 0)   backward
// over [C, M, N] tensors whose rows past a client's length L_i are padding.  The add,
// the relu and the threshold each read all C*M rows and write them into a fresh tensor
// -- for the MLP on digits (14 real samples of 32 on average) 9% of a round, 40% in a
// process whose heap gave those tensors cold pages.  These in-place ops do the same
// arithmetic on the real rows alone, into the products' results:
//
// ragged_bias_relu_(x [C, M, N], bias [C, 1, N] or [C, N], lengths, relu):
//     x[i, r] = act(x[i, r] + bias[i])   for r < lengths[i]; act(v) = v < 0 ? 0 : v
//     (aten's clamp_min: -0.0 and NaN pass through) or the identity.  Padded rows keep
//     what the product wrote (finite copies of its row 0): graph_passes.fused_epilogues
//     only fuses where every reader of h skips them.
// ragged_relu_backward_(g [C, M, N], h [C, M, N], lengths):
//     g[i, r] = h[i, r] <= 0 ? 0 : g[i, r]   for r < lengths[i] (aten's
//     threshold_backward at 0); the padded rows of g are the product's zeros already,
//     which is what threshold_backward gives there, so g ends equal to its result.
//
// Both are the same IEEE operations as the aten ops on every real element: the same
// bits.  Clients spread over torch's threads (for_real_rows).
#include <cstdint>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops_common.h"

namespace fedopt::cpu {
namespace {

constexpr const char* kBias = "fedopt_C: ragged_bias_relu_: ";
constexpr const char* kGrad = "fedopt_C: ragged_relu_backward_: ";

// x: a [C, M, N] CPU float32/float64 tensor with contiguous rows.
void check_rows(const at::Tensor& x, const char* name, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && (x.scalar_type() == at::kFloat ||
                                                      x.scalar_type() == at::kDouble),
              op, name, " must be a 3-D CPU float32/float64 tensor [C, M, N], got ", x.scalar_type(), " ",
              x.sizes(), " on ", x.device());
  TORCH_CHECK(x.size(2) <= 1 || x.stride(2) == 1, op, name, " must have contiguous rows, got strides ",
              x.strides());
}

// The lengths of x's clients (ops_common.h's checked_lengths, on the CPU).
at::Tensor real_lengths(const at::Tensor& lengths, const at::Tensor& x, const char* op) {
  TORCH_CHECK(lengths.device().is_cpu(), op, "lengths must be a CPU tensor, got ", lengths.device());
  return checked_lengths(lengths, x.size(0), x.size(1), op);
}

// f(i, r) for every real row r < lengths[i] of every client i, the clients spread
// over torch's threads.
template <typename F>
void for_real_rows(int64_t C, const int64_t* l, const F& f) {
  at::parallel_for(0, C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t r = 0; r < l[i]; ++r) f(i, r);
    }
  });
}

at::Tensor& ragged_bias_relu_cpu(at::Tensor& x, const at::Tensor& bias, const at::Tensor& lengths, bool relu) {
  check_rows(x, "x", kBias);
  const at::Tensor L = real_lengths(lengths, x, kBias);
  const int64_t C = x.size(0), N = x.size(2);
  const bool shaped = (bias.dim() == 3 && bias.size(0) == C && bias.size(1) == 1 && bias.size(2) == N) ||
                      (bias.dim() == 2 && bias.size(0) == C && bias.size(1) == N);
  TORCH_CHECK(bias.device().is_cpu() && bias.scalar_type() == x.scalar_type() && shaped, kBias, "bias must be a CPU ",
              x.scalar_type(), " tensor of shape [", C, ", 1, ", N, "] or [", C, ", ", N, "], got ",
              bias.scalar_type(), " ", bias.sizes(), " on ", bias.device());
  const int64_t b0 = bias.stride(0), b1 = bias.stride(bias.dim() - 1);
  const int64_t* l = L.const_data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "ragged_bias_relu_", [&] {
    scalar_t* base = x.data_ptr<scalar_t>();
    const scalar_t* bb = bias.const_data_ptr<scalar_t>();
    for_real_rows(C, l, [&](int64_t i, int64_t r) {
      const scalar_t* b = bb + i * b0;
      scalar_t* row = base + i * x.stride(0) + r * x.stride(1);
      if (b1 == 1 && relu) {  // the common case, a loop the compiler vectorises
        for (int64_t j = 0; j < N; ++j) {
          const scalar_t v = row[j] + b[j];
          row[j] = v < scalar_t(0) ? scalar_t(0) : v;
        }
      } else {
        for (int64_t j = 0; j < N; ++j) {
          const scalar_t v = row[j] + b[j * b1];
          row[j] = relu && v < scalar_t(0) ? scalar_t(0) : v;
        }
      }
    });
  });
  return x;
}

at::Tensor& ragged_relu_backward_cpu(at::Tensor& grad, const at::Tensor& output, const at::Tensor& lengths) {
  check_rows(grad, "grad", kGrad);
  check_rows(output, "output", kGrad);
  TORCH_CHECK(output.sizes() == grad.sizes() && output.scalar_type() == grad.scalar_type(), kGrad,
              "output must have grad's shape ", grad.sizes(), " and dtype ", grad.scalar_type(), ", got ",
              output.sizes(), " ", output.scalar_type());
  const at::Tensor L = real_lengths(lengths, grad, kGrad);
  const int64_t C = grad.size(0), N = grad.size(2);
  const int64_t* l = L.const_data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(grad.scalar_type(), "ragged_relu_backward_", [&] {
    scalar_t* g0 = grad.data_ptr<scalar_t>();
    const scalar_t* h0 = output.const_data_ptr<scalar_t>();
    for_real_rows(C, l, [&](int64_t i, int64_t r) {
      scalar_t* g = g0 + i * grad.stride(0) + r * grad.stride(1);
      const scalar_t* h = h0 + i * output.stride(0) + r * output.stride(1);
      for (int64_t j = 0; j < N; ++j) g[j] = h[j] <= scalar_t(0) ? scalar_t(0) : g[j];
    });
  });
  return grad;
}

}  // namespace
}  // namespace fedopt::cpu

// Additions to the namespace (no existing schema changes); see the top of this file.
TORCH_LIBRARY_FRAGMENT(fedopt_C, m) {
  m.def("ragged_bias_relu_(Tensor(a!) x, Tensor bias, Tensor lengths, bool relu) -> Tensor(a!)");
  m.def("ragged_relu_backward_(Tensor(a!) grad, Tensor output, Tensor lengths) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(fedopt_C, CPU, m) {
  m.impl("ragged_bias_relu_", &fedopt::cpu::ragged_bias_relu_cpu);
  m.impl("ragged_relu_backward_", &fedopt::cpu::ragged_relu_backward_cpu);
}
