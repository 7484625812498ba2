// Math shared by the CPU and CUDA kernels of fedopt_kernels.
//
// Everything that decides a *value* (the clip scale, the step direction, the skip
// rule) lives here as __host__ __device__ inline functions, so the CPU build and its
// tests exercise exactly the code the GPU runs.  The kernels themselves only decide how
// data moves.  The formulas are DESIGN.md section 1; python_ref/fednar.py is the oracle.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FEDOPT_HD __host__ __device__ __forceinline__
#else
#define FEDOPT_HD inline
#endif

namespace fedopt {

// Same epsilon as torch.nn.utils.clip_grad_norm_, so the authors' recipe
// (clip_grad_norm_ + SGD) is an exact oracle for mode "co".
constexpr double kClipEps = 1e-6;

// Modes of the FedNAR step; the integers are part of the op schema.
enum class NarMode : int64_t { kCo = 0, kGrad = 1, kNone = 2 };

// Hyperparameters of one FedNAR step as the kernels see them (already resolved from
// floats or device tensors, already in the accumulation type).
template <typename acc_t>
struct NarParams {
  acc_t lr;
  acc_t weight_decay;
  acc_t momentum;
  acc_t inv_grad_scale;  // 1 / GradScaler scale; 1 when unused
  NarMode mode;
};

template <typename acc_t>
FEDOPT_HD bool is_finite(acc_t v) {
#if defined(__CUDA_ARCH__)
  return isfinite(v);
#else
  return std::isfinite(v);
#endif
}

// The vector whose norm is clipped on: v = g + wd * x in mode co, g otherwise.
// (g is already unscaled.)
template <typename acc_t>
FEDOPT_HD acc_t nar_norm_term(acc_t x, acc_t g, const NarParams<acc_t>& p) {
  return p.mode == NarMode::kCo ? g + p.weight_decay * x : g;
}

// s = min(1, A / (n + eps)) for co/grad, 1 for none.  A NaN norm gives a NaN scale, as
// python_ref's torch.clamp(..., max=1) does (the step is skipped then anyway).
template <typename acc_t>
FEDOPT_HD acc_t nar_clip_scale(acc_t norm, acc_t max_norm, NarMode mode) {
  if (mode == NarMode::kNone) return acc_t(1);
  acc_t s = max_norm / (norm + acc_t(kClipEps));
  return s > acc_t(1) ? acc_t(1) : s;
}

// A step is skipped when its norm is not finite or GradScaler found an inf/nan.
template <typename acc_t>
FEDOPT_HD bool nar_skip(acc_t norm, bool found_inf) {
  return found_inf || !is_finite(norm);
}

// The step direction d: s * (g + wd x) in mode co, s * g + wd * x otherwise.
template <typename acc_t>
FEDOPT_HD acc_t nar_direction(acc_t x, acc_t g, acc_t scale, const NarParams<acc_t>& p) {
  return p.mode == NarMode::kCo ? scale * (g + p.weight_decay * x)
                                : scale * g + p.weight_decay * x;
}

// g as the step sees it: the raw gradient times 1 / grad_scale (exact when the scale is
// a power of two, as GradScaler's is).
template <typename acc_t>
FEDOPT_HD acc_t nar_unscale(acc_t g, const NarParams<acc_t>& p) {
  return g * p.inv_grad_scale;
}

// The two branches of nar_update, for callers that decide `momentum != 0` once outside
// their loop (e.g. with SIMD vectors as acc_t, where `!=` is not a bool).
//   plain:     x <- x - lr * d
//   momentum:  b <- beta * b + d ;  x <- x - lr * b
template <typename acc_t>
FEDOPT_HD void nar_update_plain(acc_t& x, acc_t g, acc_t scale, const NarParams<acc_t>& p) {
  x = x - p.lr * nar_direction(x, g, scale, p);
}

template <typename acc_t>
FEDOPT_HD void nar_update_momentum(acc_t& x, acc_t g, acc_t& b, acc_t scale,
                                   const NarParams<acc_t>& p) {
  b = p.momentum * b + nar_direction(x, g, scale, p);
  x = x - p.lr * b;
}

// One element of the update pass.  `b` is read and written only when momentum != 0.
template <typename acc_t>
FEDOPT_HD void nar_update(acc_t& x, acc_t g, acc_t& b, acc_t scale, const NarParams<acc_t>& p) {
  if (p.momentum != acc_t(0)) {
    nar_update_momentum(x, g, b, scale, p);
  } else {
    nar_update_plain(x, g, scale, p);
  }
}

}  // namespace fedopt
