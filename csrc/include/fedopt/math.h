// Math shared by the CPU and CUDA kernels of fedopt_kernels.
//
// Everything that decides a *value* (the clip scale, the step direction, the skip
// rule) lives here as __host__ __device__ inline functions, so the CPU build and its
// tests exercise exactly the code the GPU runs.  The kernels themselves only decide how
// data moves.  The formulas and the oracle are python_ref/fednar.py.
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

// ---------------------------------------------------------------------------------
// Server update (fedopt_C::server_update_): the elementwise step of every server
// optimizer on the round's mean update D (python_ref/server_optimizers.py; the rule
// integers are part of the op schema).  Per element, all in acc_t, separately rounded:
//
//   kSgd:      x <- gamma * (x - lr * D)                          (FedAvg, FedExP)
//   kMomentum: b <- beta1 * b + D ;  s = nesterov ? beta1 * b + D : b ;
//              x <- x - lr * s                                    (FedAvgM, ASNES)
//   adaptive:  m <- beta1 * m + (1 - beta1) * D
//              kAdagrad: v <- v + D * D
//              kAdam:    v <- beta2 * v + (1 - beta2) * (D * D)
//              kYogi:    v <- v - (1 - beta2) * (D * D) * sign(v - D * D)
//              x <- x - lr * (m / (sqrt(v) + tau))                (FedAdagrad/Adam/Yogi)
//
// `m` (or `b`) and `v` are stored in the params' dtype, so the values carried to the
// next round are the rounded ones, as torch.optim keeps its state in the param dtype.
enum class ServerRule : int64_t { kSgd = 0, kMomentum = 1, kAdagrad = 2, kAdam = 3, kYogi = 4 };

template <typename acc_t>
struct ServerParams {
  acc_t lr;
  acc_t gamma;     // kSgd only
  acc_t beta1;     // kMomentum: the momentum; adaptive: the first-moment factor
  acc_t beta2;     // kAdam, kYogi
  acc_t tau;       // adaptive rules
  bool nesterov;   // kMomentum
  ServerRule rule;
};

template <typename acc_t>
FEDOPT_HD void server_update_sgd(acc_t& x, acc_t d, const ServerParams<acc_t>& p) {
  x = p.gamma * (x - p.lr * d);
}

template <typename acc_t>
FEDOPT_HD void server_update_momentum(acc_t& x, acc_t d, acc_t& b, const ServerParams<acc_t>& p) {
  b = p.beta1 * b + d;
  const acc_t s = p.nesterov ? p.beta1 * b + d : b;
  x = x - p.lr * s;
}

// sign(a): -1 or 1 for a negative or positive a, a itself for +-0 and NaN (torch.sign
// gives +0 for -0 and 0 for NaN; in Yogi's v - c * d2 * sign(v - d2) that changes at
// most the sign of a zero term or a NaN's payload, never a value).  sign_of and
// sqrt_of are templates of their own so that the CPU kernels can specialize them for
// SIMD vectors (kernels.h), where `?:` on a comparison and std::sqrt do not apply.
template <typename acc_t>
FEDOPT_HD acc_t sign_of(acc_t a) {
  return a > acc_t(0) ? acc_t(1) : (a < acc_t(0) ? acc_t(-1) : a);
}

// sqrt(a), correctly rounded.
template <typename acc_t>
FEDOPT_HD acc_t sqrt_of(acc_t a) {
#if defined(__CUDA_ARCH__)
  return sqrt(a);
#else
  return std::sqrt(a);
#endif
}

template <typename acc_t>
FEDOPT_HD void server_update_adaptive(acc_t& x, acc_t d, acc_t& m, acc_t& v, const ServerParams<acc_t>& p) {
  m = p.beta1 * m + (acc_t(1) - p.beta1) * d;
  const acc_t d2 = d * d;
  if (p.rule == ServerRule::kAdagrad) {
    v = v + d2;
  } else if (p.rule == ServerRule::kAdam) {
    v = p.beta2 * v + (acc_t(1) - p.beta2) * d2;
  } else {
    v = v - (acc_t(1) - p.beta2) * d2 * sign_of(v - d2);
  }
  x = x - p.lr * (m / (sqrt_of(v) + p.tau));
}

}  // namespace fedopt
