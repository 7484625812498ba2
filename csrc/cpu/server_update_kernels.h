// The server optimizers' elementwise step on the CPU (math.h's server_update_*).
#pragma once

#ifndef CPU_CAPABILITY
#error "server_update_kernels.h is included by kernels.h (via isa_*.cpp, which define CPU_CAPABILITY)"
#endif

#include "vec_block.h"

namespace fedopt::cpu::CPU_CAPABILITY {
namespace {

// Server update: x (and m, v) in place by math.h's server_update_*, with the rule and
// nesterov compile-time constants so that math.h's tests of them fold away and the
// loop is straight-line vector code.  (Except in the DEFAULT build on x86, where
// at::vec's vectors are plain arrays and GCC keeps server_update_adaptive out of line:
// one call and one well-predicted rule test per 8 lanes.  Forcing it inline with
// __attribute__((flatten)) measured 1.7x slower for Adam there: GCC then no longer
// vectorized the division.)  Elementwise: no sums, so the chunk order is free; the
// ragged end of a chunk runs the same vector code on a zero-padded block of which only
// the first lanes are stored.

template <ServerRule R, bool kNesterov>
struct RuleTag {
  static constexpr ServerRule rule = R;
  static constexpr bool nesterov = kNesterov;
};

template <typename F>
void dispatch_rule(ServerRule rule, bool nesterov, const F& f) {
  switch (rule) {
    case ServerRule::kSgd: f(RuleTag<ServerRule::kSgd, false>{}); break;
    case ServerRule::kMomentum:
      if (nesterov) {
        f(RuleTag<ServerRule::kMomentum, true>{});
      } else {
        f(RuleTag<ServerRule::kMomentum, false>{});
      }
      break;
    case ServerRule::kAdagrad: f(RuleTag<ServerRule::kAdagrad, false>{}); break;
    case ServerRule::kAdam: f(RuleTag<ServerRule::kAdam, false>{}); break;
    default: f(RuleTag<ServerRule::kYogi, false>{}); break;
  }
}

template <ServerRule R>
constexpr bool kHasM = R != ServerRule::kSgd;
template <ServerRule R>
constexpr bool kHasV = R != ServerRule::kSgd && R != ServerRule::kMomentum;

template <typename scalar_t, typename acc_t, ServerRule R, bool kNesterov>
void server_update_chunk(scalar_t* x, const acc_t* d, scalar_t* m, scalar_t* v, int64_t n,
                         const ServerParams<acc_t>& hp) {
  using B = Block<acc_t>;
  using Vec = typename B::Vec;
  const ServerParams<Vec> p = {Vec(hp.lr), Vec(hp.gamma), Vec(hp.beta1), Vec(hp.beta2), Vec(hp.tau), kNesterov, R};
  Vec xv[B::kK], dv[B::kK], mv[B::kK], vv[B::kK];
  auto update = [&]() C10_ALWAYS_INLINE_ATTRIBUTE {
    for (int64_t k = 0; k < B::kK; ++k) {
      if constexpr (R == ServerRule::kSgd) {
        server_update_sgd(xv[k], dv[k], p);
      } else if constexpr (R == ServerRule::kMomentum) {
        server_update_momentum(xv[k], dv[k], mv[k], p);
      } else {
        server_update_adaptive(xv[k], dv[k], mv[k], vv[k], p);
      }
    }
  };
  int64_t i = 0;
  for (; i + B::kN <= n; i += B::kN) {
    B::load(x + i, xv);
    B::load(d + i, dv);
    if constexpr (kHasM<R>) B::load(m + i, mv);
    if constexpr (kHasV<R>) B::load(v + i, vv);
    update();
    B::store(x + i, xv);
    if constexpr (kHasM<R>) B::store(m + i, mv);
    if constexpr (kHasV<R>) B::store(v + i, vv);
  }
  if (i < n) {  // the padding lanes may compute 0 / 0 (tau = 0): they are never stored
    B::load_tail(x + i, n - i, xv);
    B::load_tail(d + i, n - i, dv);
    if constexpr (kHasM<R>) B::load_tail(m + i, n - i, mv);
    if constexpr (kHasV<R>) B::load_tail(v + i, n - i, vv);
    update();
    B::store_tail(x + i, n - i, xv);
    if constexpr (kHasM<R>) B::store_tail(m + i, n - i, mv);
    if constexpr (kHasV<R>) B::store_tail(v + i, n - i, vv);
  }
}

template <typename acc_t>
void server_update_pass(const ServerUpdateArgs<acc_t>& a, int64_t c0, int64_t c1) {
  dispatch_kind<acc_t>(a.kind, [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    dispatch_rule(a.params.rule, a.params.nesterov, [&](auto rule) {
      constexpr ServerRule R = decltype(rule)::rule;
      for (int64_t c = c0; c < c1; ++c) {
        const Chunk& ch = a.chunks[c];
        auto* x = static_cast<scalar_t*>(a.x[ch.tensor]) + ch.start;
        const acc_t* d = a.d[ch.tensor] + ch.start;
        scalar_t* m = kHasM<R> ? static_cast<scalar_t*>(a.m[ch.tensor]) + ch.start : nullptr;
        scalar_t* v = kHasV<R> ? static_cast<scalar_t*>(a.v[ch.tensor]) + ch.start : nullptr;
        server_update_chunk<scalar_t, acc_t, R, decltype(rule)::nesterov>(x, d, m, v, ch.len, a.params);
      }
    });
  });
}

}  // namespace
}  // namespace fedopt::cpu::CPU_CAPABILITY
