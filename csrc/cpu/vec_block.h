// The shared pieces of the per-ISA CPU kernels (kernels.h and its families):
// math.h's sign and sqrt on this build's vectors, the software prefetch, the
// fixed-lane Block that makes every sum independent of the vector width (the
// determinism rule of kernels.h), and the dtype / mode dispatch.
#pragma once

#ifndef CPU_CAPABILITY
#error "vec_block.h is included by kernels.h (via isa_*.cpp, which define CPU_CAPABILITY)"
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "kernel_api.h"

namespace fedopt {

// math.h's sign_of and sqrt_of for the vectors of this build, so that its server
// update runs unchanged on vectors (at::vec's classes live in a per-ISA inline
// namespace: every isa_*.cpp specializes for its own types, no two collide).
//  * sign: two selects on ordered comparisons.  NaN compares false with 0 both ways
//    and, like +0 and -0, passes through as itself: sign_of's `: a`.
//  * sqrt: at::vec's is sqrtps/sqrtpd or std::sqrt per lane, IEEE's correctly rounded
//    square root in every build, as std::sqrt is.
template <typename T>
C10_ALWAYS_INLINE at::vec::Vectorized<T> vec_sign(const at::vec::Vectorized<T>& a) {
  using Vec = at::vec::Vectorized<T>;
  const Vec zero(T(0));
  return Vec::blendv(Vec::blendv(a, Vec(T(-1)), a < zero), Vec(T(1)), a > zero);
}

template <>
C10_ALWAYS_INLINE at::vec::Vectorized<float> sign_of(at::vec::Vectorized<float> a) { return vec_sign(a); }
template <>
C10_ALWAYS_INLINE at::vec::Vectorized<double> sign_of(at::vec::Vectorized<double> a) { return vec_sign(a); }
template <>
C10_ALWAYS_INLINE at::vec::Vectorized<float> sqrt_of(at::vec::Vectorized<float> a) { return a.sqrt(); }
template <>
C10_ALWAYS_INLINE at::vec::Vectorized<double> sqrt_of(at::vec::Vectorized<double> a) { return a.sqrt(); }

}  // namespace fedopt

namespace fedopt::cpu::CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

// Prefetch the cache lines of [a, a + kBytes) (a hint: never faults, so it may point
// past the end of the data; the address is an integer, formed without pointer
// arithmetic).
template <int64_t kBytes>
C10_ALWAYS_INLINE void prefetch(uintptr_t a) {
#if defined(__GNUC__) || defined(__clang__)
  for (int64_t off = 0; off < kBytes; off += 64) __builtin_prefetch(reinterpret_cast<const void*>(a + off));
#else
  (void)a;
#endif
}

// A block of kN elements held as kK vectors of acc_t.
template <typename acc_t>
struct Block {
  using Vec = Vectorized<acc_t>;
  static constexpr int64_t kN = 128 / int64_t(sizeof(acc_t));
  static constexpr int64_t kW = Vec::size();
  static constexpr int64_t kK = kN / kW;
  static_assert(kK * kW == kN, "a block must be a whole number of vectors");

  // kN elements of scalar_t, converted to acc_t.
  template <typename scalar_t>
  static C10_ALWAYS_INLINE void load(const scalar_t* p, Vec* v) {
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      for (int64_t k = 0; k < kK; ++k) v[k] = Vec::loadu(p + k * kW);
    } else {
      using SVec = Vectorized<scalar_t>;
      static_assert(SVec::size() == 2 * kW, "a reduced-precision vector converts to two");
      for (int64_t k = 0; k < kK; k += 2) {
        auto [lo, hi] = at::vec::convert_to_float<scalar_t>(SVec::loadu(p + k * kW));
        v[k] = lo;
        v[k + 1] = hi;
      }
    }
  }

  template <typename scalar_t>
  static C10_ALWAYS_INLINE void store(scalar_t* p, const Vec* v) {
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      for (int64_t k = 0; k < kK; ++k) v[k].store(p + k * kW);
    } else {
      for (int64_t k = 0; k < kK; k += 2) {
        at::vec::convert_from_float<scalar_t>(v[k], v[k + 1]).store(p + k * kW);
      }
    }
  }

  // The first n < kN elements; the other lanes read as 0.
  template <typename scalar_t>
  static C10_ALWAYS_INLINE void load_tail(const scalar_t* p, int64_t n, Vec* v) {
    alignas(64) scalar_t buf[kN];
    std::memset(static_cast<void*>(buf), 0, sizeof(buf));
    std::memcpy(static_cast<void*>(buf), p, n * sizeof(scalar_t));
    load(buf, v);
  }

  template <typename scalar_t>
  static C10_ALWAYS_INLINE void store_tail(scalar_t* p, int64_t n, const Vec* v) {
    alignas(64) scalar_t buf[kN];
    store(buf, v);
    std::memcpy(static_cast<void*>(p), buf, n * sizeof(scalar_t));
  }

  // Lanes >= n set to +0 (whatever they held, NaN included).
  static C10_ALWAYS_INLINE void keep_first(Vec* v, int64_t n) {
    for (int64_t k = 0; k < kK; ++k) {
      v[k] = Vec::set(Vec(acc_t(0)), v[k], std::clamp<int64_t>(n - k * kW, 0, kW));
    }
  }

  static C10_ALWAYS_INLINE void zero(Vec* v) {
    for (int64_t k = 0; k < kK; ++k) v[k] = Vec(acc_t(0));
  }

  // Sum of kN lanes in memory, in a fixed tree: lane i += lane i + w for w = kN/2 .. 1.
  static acc_t reduce_lanes(acc_t* lanes) {
    for (int64_t w = kN / 2; w >= 1; w /= 2) {
      for (int64_t i = 0; i < w; ++i) lanes[i] = lanes[i] + lanes[i + w];
    }
    return lanes[0];
  }

  static acc_t reduce(const Vec* v) {
    alignas(64) acc_t lanes[kN];
    for (int64_t k = 0; k < kK; ++k) v[k].store(lanes + k * kW);
    return reduce_lanes(lanes);
  }
};

// ---------------------------------------------------------------------------------
// Type and mode dispatch.

template <typename T>
struct Tag {
  using type = T;
};

template <typename acc_t, typename F>
void dispatch_kind(ScalarKind kind, const F& f) {
  if constexpr (std::is_same_v<acc_t, double>) {
    f(Tag<double>{});
  } else {
    switch (kind) {
      case ScalarKind::kHalf: f(Tag<c10::Half>{}); break;
      case ScalarKind::kBFloat16: f(Tag<c10::BFloat16>{}); break;
      default: f(Tag<float>{}); break;
    }
  }
}

template <NarMode M>
using ModeTag = std::integral_constant<NarMode, M>;

template <typename F>
void dispatch_mode(NarMode mode, const F& f) {
  switch (mode) {
    case NarMode::kCo: f(ModeTag<NarMode::kCo>{}); break;
    case NarMode::kGrad: f(ModeTag<NarMode::kGrad>{}); break;
    default: f(ModeTag<NarMode::kNone>{}); break;
  }
}

// The hyperparameters broadcast to vectors, with the mode a compile-time constant so
// that math.h's mode tests fold away inside the loops.
template <NarMode M, typename acc_t>
C10_ALWAYS_INLINE NarParams<Vectorized<acc_t>> vec_params(const NarParams<acc_t>& p) {
  using Vec = Vectorized<acc_t>;
  return {Vec(p.lr), Vec(p.weight_decay), Vec(p.momentum), Vec(p.inv_grad_scale), M};
}

}  // namespace
}  // namespace fedopt::cpu::CPU_CAPABILITY
