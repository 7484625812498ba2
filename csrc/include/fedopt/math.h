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

// ---------------------------------------------------------------------------------
// Explicit rounding: the arithmetic of every formula below
// ---------------------------------------------------------------------------------
// python_ref rounds each +, -, *, / on its own, and so do the CPU kernels (compiled
// with fp-contract=off, csrc/cpu/isa_prologue.h).  nvcc does not: by default (-fmad=true)
// it contracts a * b + c into one FMA, and where it does so is its choice, made per
// inlined copy.  In the FedNAR update kernel it fused `scale * g + wd * x` as
// fma(scale, g, rn(wd * x)) in the 16-byte body and as fma(wd, x, rn(scale * g)) in the
// scalar body, so a row's bits depended on its alignment (issue 47).  So every formula
// here goes through rn::add / sub / mul / div:
//
//  * device, float / double: the __f*_rn / __d*_rn intrinsics, which nvcc and ptxas never
//    merge into an FMA (CUDA C Programming Guide, "Intrinsic Functions"; in PTX they are
//    add.rn / mul.rn ..., which ptxas must keep).  They compile to the same FADD / FMUL /
//    DADD / DMUL instructions, so the only cost is the fusion.
//  * anything else (host scalars, the CPU kernels' SIMD vectors, cuda::Unfused): the
//    plain operator.  The CPU kernels are compiled without contraction, so their bits
//    are what they were; a host pass of nvcc targets baseline x86-64 (no FMA).
//
// rn::fma is the one place where a fused multiply-add IS meant (one rounding of
// a * b + c): __fmaf_rn / __fma_rn on the device, std::fma on the host.  No formula of
// this file uses it (python_ref fuses nothing); the CUDA norm kernels accumulate their
// sums of squares with it.  tests/test_cuda_fp_contraction.py compiles the CUDA kernels
// to PTX and checks that no implicit contraction is left.
namespace rn {

template <typename T>
FEDOPT_HD T add(T a, T b) { return a + b; }
template <typename T>
FEDOPT_HD T sub(T a, T b) { return a - b; }
template <typename T>
FEDOPT_HD T mul(T a, T b) { return a * b; }
template <typename T>
FEDOPT_HD T div(T a, T b) { return a / b; }

#if defined(__CUDACC__) || defined(__HIPCC__)
// Exact-match overloads (preferred over the templates for float / double).  The host
// branches only exist for nvcc's host pass.
#if defined(__CUDA_ARCH__)
#define FEDOPT_RN2(dev, a, b, op) dev(a, b)
#else
#define FEDOPT_RN2(dev, a, b, op) ((a)op(b))
#endif
FEDOPT_HD float add(float a, float b) { return FEDOPT_RN2(__fadd_rn, a, b, +); }
FEDOPT_HD double add(double a, double b) { return FEDOPT_RN2(__dadd_rn, a, b, +); }
FEDOPT_HD float sub(float a, float b) { return FEDOPT_RN2(__fsub_rn, a, b, -); }
FEDOPT_HD double sub(double a, double b) { return FEDOPT_RN2(__dsub_rn, a, b, -); }
FEDOPT_HD float mul(float a, float b) { return FEDOPT_RN2(__fmul_rn, a, b, *); }
FEDOPT_HD double mul(double a, double b) { return FEDOPT_RN2(__dmul_rn, a, b, *); }
FEDOPT_HD float div(float a, float b) { return FEDOPT_RN2(__fdiv_rn, a, b, /); }
FEDOPT_HD double div(double a, double b) { return FEDOPT_RN2(__ddiv_rn, a, b, /); }
#undef FEDOPT_RN2
#endif

// a * b + c with ONE rounding (float / double only).
FEDOPT_HD float fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
FEDOPT_HD double fma(double a, double b, double c) {
#if defined(__CUDA_ARCH__)
  return __fma_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

}  // namespace rn

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
  return p.mode == NarMode::kCo ? rn::add(g, rn::mul(p.weight_decay, x)) : g;
}

// s = min(1, A / (n + eps)) for co/grad, 1 for none.  A NaN norm gives a NaN scale, as
// python_ref's torch.clamp(..., max=1) does (the step is skipped then anyway).
template <typename acc_t>
FEDOPT_HD acc_t nar_clip_scale(acc_t norm, acc_t max_norm, NarMode mode) {
  if (mode == NarMode::kNone) return acc_t(1);
  acc_t s = rn::div(max_norm, rn::add(norm, acc_t(kClipEps)));
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
  return p.mode == NarMode::kCo ? rn::mul(scale, rn::add(g, rn::mul(p.weight_decay, x)))
                                : rn::add(rn::mul(scale, g), rn::mul(p.weight_decay, x));
}

// g as the step sees it: the raw gradient times 1 / grad_scale (exact when the scale is
// a power of two, as GradScaler's is).
template <typename acc_t>
FEDOPT_HD acc_t nar_unscale(acc_t g, const NarParams<acc_t>& p) {
  return rn::mul(g, p.inv_grad_scale);
}

// The two branches of nar_update, for callers that decide `momentum != 0` once outside
// their loop (e.g. with SIMD vectors as acc_t, where `!=` is not a bool).
//   plain:     x <- x - lr * d
//   momentum:  b <- beta * b + d ;  x <- x - lr * b
template <typename acc_t>
FEDOPT_HD void nar_update_plain(acc_t& x, acc_t g, acc_t scale, const NarParams<acc_t>& p) {
  x = rn::sub(x, rn::mul(p.lr, nar_direction(x, g, scale, p)));
}

template <typename acc_t>
FEDOPT_HD void nar_update_momentum(acc_t& x, acc_t g, acc_t& b, acc_t scale,
                                   const NarParams<acc_t>& p) {
  b = rn::add(rn::mul(p.momentum, b), nar_direction(x, g, scale, p));
  x = rn::sub(x, rn::mul(p.lr, b));
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
  x = rn::mul(p.gamma, rn::sub(x, rn::mul(p.lr, d)));
}

template <typename acc_t>
FEDOPT_HD void server_update_momentum(acc_t& x, acc_t d, acc_t& b, const ServerParams<acc_t>& p) {
  b = rn::add(rn::mul(p.beta1, b), d);
  const acc_t s = p.nesterov ? rn::add(rn::mul(p.beta1, b), d) : b;
  x = rn::sub(x, rn::mul(p.lr, s));
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
  m = rn::add(rn::mul(p.beta1, m), rn::mul(rn::sub(acc_t(1), p.beta1), d));
  const acc_t d2 = rn::mul(d, d);
  if (p.rule == ServerRule::kAdagrad) {
    v = rn::add(v, d2);
  } else if (p.rule == ServerRule::kAdam) {
    v = rn::add(rn::mul(p.beta2, v), rn::mul(rn::sub(acc_t(1), p.beta2), d2));
  } else {
    v = rn::sub(v, rn::mul(rn::mul(rn::sub(acc_t(1), p.beta2), d2), sign_of(rn::sub(v, d2))));
  }
  x = rn::sub(x, rn::mul(p.lr, rn::div(m, rn::add(sqrt_of(v), p.tau))));
}

}  // namespace fedopt
