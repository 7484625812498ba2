// FedNAR's two passes on the CPU: the sum of squares of the clipped-on vector per
// chunk (pass 1) and the in-place update through math.h (pass 2).
//
// Cache reuse.  nar_update walks its chunks from last to first: the norm pass has just
// streamed them first to last, so the update pass starts on the data still in the L2/L3
// caches.  The gain is small (measured: docs/benchmarks.md, "CPU kernels"), within the
// noise once x and g are far larger than the last-level cache; it costs nothing (the
// update is elementwise, so the order changes no result).
#pragma once

#ifndef CPU_CAPABILITY
#error "nar_kernels.h is included by kernels.h (via isa_*.cpp, which define CPU_CAPABILITY)"
#endif

#include "vec_block.h"

namespace fedopt::cpu::CPU_CAPABILITY {
namespace {

// FedNAR, pass 1: sum of squares of the clipped-on vector (g + wd x in mode co, g
// otherwise; the other modes never read x).

template <typename scalar_t, typename acc_t, NarMode M>
acc_t nar_norm_chunk(const scalar_t* x, const scalar_t* g, int64_t n, const NarParams<acc_t>& hp) {
  using B = Block<acc_t>;
  using Vec = typename B::Vec;
  constexpr bool kReadX = M == NarMode::kCo;
  const NarParams<Vec> p = vec_params<M>(hp);
  Vec acc[B::kK], xv[B::kK], gv[B::kK];
  B::zero(acc);
  B::zero(xv);
  auto accumulate = [&]() C10_ALWAYS_INLINE_ATTRIBUTE {
    for (int64_t k = 0; k < B::kK; ++k) {
      const Vec t = nar_norm_term(xv[k], nar_unscale(gv[k], p), p);
      acc[k] = acc[k] + t * t;
    }
  };
  // Two levels: `acc` collects kInner blocks at a time and is then added to `sum`, so
  // each lane adds ~n / 32 / kInner + kInner terms in sequence rather than n / 32
  // (a few times less rounding error, for nothing in a memory-bound loop).
  constexpr int64_t kInner = 16;
  Vec sum[B::kK];
  B::zero(sum);
  int64_t i = 0;
  while (i + B::kN <= n) {
    const int64_t stop = std::min(n - B::kN, i + (kInner - 1) * B::kN);
    for (; i <= stop; i += B::kN) {
      if constexpr (kReadX) B::load(x + i, xv);
      B::load(g + i, gv);
      accumulate();
    }
    for (int64_t k = 0; k < B::kK; ++k) {
      sum[k] = sum[k] + acc[k];
      acc[k] = Vec(acc_t(0));
    }
  }
  if (i < n) {  // zero-padded; the padding lanes are forced to +0 (0 * inf would be NaN)
    if constexpr (kReadX) B::load_tail(x + i, n - i, xv);
    B::load_tail(g + i, n - i, gv);
    accumulate();  // acc is zero here
    B::keep_first(acc, n - i);
    for (int64_t k = 0; k < B::kK; ++k) sum[k] = sum[k] + acc[k];
  }
  return B::reduce(sum);
}

template <typename acc_t>
void nar_norm_pass(const NarArgs<acc_t>& a, int64_t c0, int64_t c1) {
  dispatch_kind<acc_t>(a.kind, [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    dispatch_mode(a.mode, [&](auto mode) {
      for (int64_t c = c0; c < c1; ++c) {
        const Chunk& ch = a.chunks[c];
        const auto* x = static_cast<const scalar_t*>(a.x[ch.tensor]) + ch.start;
        const auto* g = static_cast<const scalar_t*>(a.g[ch.tensor]) + ch.start;
        a.partials[c] =
            nar_norm_chunk<scalar_t, acc_t, decltype(mode)::value>(x, g, ch.len, a.params[ch.group]);
      }
    });
  });
}

// ---------------------------------------------------------------------------------
// FedNAR, pass 2: x <- x - lr * d (or through the momentum buffer), math.h's update.

template <typename scalar_t, typename acc_t, NarMode M, bool kMomentum>
void nar_update_chunk(scalar_t* x, const scalar_t* g, scalar_t* b, int64_t n,
                      const NarParams<acc_t>& hp, acc_t scale) {
  using B = Block<acc_t>;
  using Vec = typename B::Vec;
  const NarParams<Vec> p = vec_params<M>(hp);
  const Vec s(scale);
  Vec xv[B::kK], gv[B::kK], bv[B::kK];
  auto update = [&]() C10_ALWAYS_INLINE_ATTRIBUTE {
    for (int64_t k = 0; k < B::kK; ++k) {
      if constexpr (kMomentum) {
        nar_update_momentum(xv[k], nar_unscale(gv[k], p), bv[k], s, p);
      } else {
        nar_update_plain(xv[k], nar_unscale(gv[k], p), s, p);
      }
    }
  };
  int64_t i = 0;
  for (; i + B::kN <= n; i += B::kN) {
    B::load(x + i, xv);
    B::load(g + i, gv);
    if constexpr (kMomentum) B::load(b + i, bv);
    update();
    B::store(x + i, xv);
    if constexpr (kMomentum) B::store(b + i, bv);
  }
  if (i < n) {
    B::load_tail(x + i, n - i, xv);
    B::load_tail(g + i, n - i, gv);
    if constexpr (kMomentum) B::load_tail(b + i, n - i, bv);
    update();
    B::store_tail(x + i, n - i, xv);
    if constexpr (kMomentum) B::store_tail(b + i, n - i, bv);
  }
}

template <typename acc_t>
void nar_update_pass(const NarArgs<acc_t>& a, int64_t c0, int64_t c1) {
  dispatch_kind<acc_t>(a.kind, [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    dispatch_mode(a.mode, [&](auto mode) {
      auto run = [&](auto momentum) {
        for (int64_t c = c1 - 1; c >= c0; --c) {  // last to first: see "Cache reuse"
          const Chunk& ch = a.chunks[c];
          if (a.skip[ch.group]) continue;
          auto* x = static_cast<scalar_t*>(a.x[ch.tensor]) + ch.start;
          const auto* g = static_cast<const scalar_t*>(a.g[ch.tensor]) + ch.start;
          scalar_t* b = decltype(momentum)::value ? static_cast<scalar_t*>(a.b[ch.tensor]) + ch.start : nullptr;
          nar_update_chunk<scalar_t, acc_t, decltype(mode)::value, decltype(momentum)::value>(
              x, g, b, ch.len, a.params[ch.group], a.scale[ch.group]);
        }
      };
      if (a.momentum) {
        run(std::true_type{});
      } else {
        run(std::false_type{});
      }
    });
  });
}

}  // namespace
}  // namespace fedopt::cpu::CPU_CAPABILITY
