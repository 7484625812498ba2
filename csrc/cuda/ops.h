// Host entry points of the CUDA kernels (csrc/cuda/*.cu), registered for the CUDA
// dispatch key of the `fedopt_C` ops in module.cpp.  The signatures follow the schemas
// of csrc/registration.cpp (Tensor[] -> TensorList, Tensor? -> optional, float ->
// double, int -> int64_t); keeping them in one header makes a mismatch a compile error
// rather than an undefined symbol at import time.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "kernels/aggregate_tiling.h"

namespace fedopt {
namespace cuda {

std::tuple<at::Tensor, at::Tensor, at::Tensor> nar_step_(
    at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, double lr,
    const std::optional<at::Tensor>& lr_tensor, double weight_decay,
    const std::optional<at::Tensor>& weight_decay_tensor, double max_norm, int64_t mode, double momentum,
    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);

std::tuple<at::Tensor, at::Tensor, at::Tensor> nar_step_batched_(
    const at::Tensor& params, const at::Tensor& grads, const std::optional<at::Tensor>& momentum_buffers,
    double lr, const std::optional<at::Tensor>& lr_tensor, double weight_decay,
    const std::optional<at::Tensor>& weight_decay_tensor, double max_norm, int64_t mode, double momentum,
    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);

at::Tensor nar_sq_norm(at::TensorList params, at::TensorList grads, double weight_decay,
                       const std::optional<at::Tensor>& weight_decay_tensor, int64_t mode,
                       const std::optional<at::Tensor>& grad_scale);

std::tuple<at::Tensor, at::Tensor, at::Tensor> nar_apply_(
    at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, const at::Tensor& sq_norm,
    double lr, const std::optional<at::Tensor>& lr_tensor, double weight_decay,
    const std::optional<at::Tensor>& weight_decay_tensor, double max_norm, int64_t mode, double momentum,
    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf);

std::tuple<at::Tensor, at::Tensor> aggregate(at::TensorList clients, const at::Tensor& weights, double gamma,
                                             const std::optional<at::Tensor>& gamma_tensor, const at::Tensor& out,
                                             const std::optional<at::Tensor>& skip, std::optional<int64_t> noise_key,
                                             double noise_std, const std::optional<at::Tensor>& noise_std_tensor);

void add_noise_(const at::Tensor& out, int64_t noise_key, double noise_std,
                const std::optional<at::Tensor>& noise_std_tensor, const std::optional<at::Tensor>& skip);

at::Tensor client_dots(at::TensorList clients, const at::Tensor& g);

void server_update_(at::TensorList params, at::TensorList updates, at::TensorList exp_avg,
                    at::TensorList exp_avg_sq, int64_t rule, double lr, const std::optional<at::Tensor>& lr_tensor,
                    double gamma, const std::optional<at::Tensor>& gamma_tensor, double beta1, double beta2,
                    double tau, bool nesterov, const std::optional<at::Tensor>& skip);

// Host-side launch decisions, exposed for the diagnostic ops of module.cpp (tests).

// The aggregation's tiling rule (struct AggTiling, aggregate_tiling(n, esize)):
// kernels/aggregate_tiling.h, included above.

// nar_step_'s finalize threshold: a group with more partials than this gets the
// one-block-per-group sum pass (fedopt::kMaxRedundantPartials, or the environment
// variable FEDOPT_MAX_REDUNDANT_PARTIALS, read at every call).
int64_t max_redundant_partials();

}  // namespace cuda
}  // namespace fedopt
