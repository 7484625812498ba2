// Streaming kernels of the CPU backend, compiled once per instruction set.
//
// Each isa_*.cpp defines CPU_CAPABILITY (DEFAULT, AVX2, AVX512) and the matching
// CPU_CAPABILITY_* macro, sets the compiler's target, and includes this file; it
// expands to the kernel table `fedopt::cpu::<CPU_CAPABILITY>::kTable` (kernel_api.h).
// All functions here have internal linkage, so the per-ISA copies can never be mixed
// up by the linker.
//
// Determinism.  Every sum is taken in a fixed logical layout that does not depend on
// the vector width: a chunk is read in blocks of kN = 128 bytes of acc_t (32 floats or
// 16 doubles) and element j of a block always goes to lane j; one 256-bit vector holds
// 8 of these lanes and one 512-bit vector 16, so the same kN lanes exist for every
// ISA.  At the end of a chunk the lanes are added in a fixed tree (reduce_lanes).  The
// ragged end of a chunk goes through a zero-filled block whose unused lanes are forced
// to +0 before they are summed.  The TUs are compiled without floating-point
// contraction (no FMA; isa_*.cpp), so the elementwise math is the separately rounded
// math of python_ref: every ISA gives bitwise the same results, and when the clip scale
// is exactly 1 the updated params match python_ref bit for bit.
//
// Cache reuse.  nar_update walks its chunks from last to first: the norm pass has just
// streamed them first to last, so the update pass starts on the data still in the L2/L3
// caches.  Candidly, the gain is small on the machine this was tuned on (Zen 5 EPYC
// VM, 2 cores, ~40-50 GB/s from DRAM): 5-10% for 4-8M fp32 parameters with 2
// threads, within the noise for a ResNet-18 (90 MB of x and g against a 32 MB L3).
// It costs nothing (the update is elementwise, so the order changes no result).
#pragma once

#ifndef CPU_CAPABILITY
#error "kernels.h is included by isa_*.cpp, which define CPU_CAPABILITY"
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

// ---------------------------------------------------------------------------------
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

// ---------------------------------------------------------------------------------
// Passes over C client rows (aggregate, client_dots): row streaming over stripes of
// kStripe column chunks.  Per stripe, the clients, four at a time and in client order,
// stream their rows of the stripe through an L2-resident acc_t buffer (the aggregate's
// running total, or g converted), each chunk's per-client lanes summed into its
// partials as soon as the clients have passed it.
//
// Why rows and not column blocks (measured on 100 x 90.5K fp32, the case where the data,
// 36 MB, is about the size of an L3; 2 threads of a Zen 5 EPYC VM; caches flushed
// before every call; speed relative to the floor torch.sum(X, dim=0)).  Visiting all C
// rows per 1024-column block, the buffer in L1 (the design before), ran the aggregation
// at 0.69-0.77 of the floor: every switch of row restarts a hardware prefetch stream.
// (On 20 x 11.2M that design needed a software prefetch of each row's NEXT block, one
// round of C rows ahead, to get from 70-90 ms to ~40 ms.)  Row streaming runs at
// 0.89-0.94 (2.1-2.2x a loop of add_ + dot, against 1.8-1.9x).  Its parameters, swept
// with a 64 MiB flush: a stripe of one 16 Ki-column chunk 0.74 of the floor, stripes of
// 32 Ki to 96 Ki columns the same within noise (0.78-0.81); the even split by columns
// over the threads (aggregate.cpp) +4%; a software prefetch 2 to 8 KiB ahead in each
// row the same, 512 B ahead 0.75, none 0.64.  On 20 x 11.2M (rows far larger than any
// cache) both designs run at 1.25-1.33x the floor.
constexpr int64_t kStripe = 16;
constexpr int64_t kAheadBytes = 4096;

// An uninitialised acc_t buffer of one slot of kAggChunk elements per chunk of a stripe
// (a whole number of blocks, so a ragged chunk's zero padding stays in its own slot),
// sized for the widest stripe of the chunks [c0, c1): a small model's call does not
// allocate or zero 256 KiB it never uses.
template <typename acc_t>
class StripeBuffer {
  static_assert(kAggChunk % Block<acc_t>::kN == 0, "a chunk slot must hold whole blocks");
  struct alignas(64) Line {
    acc_t v[64 / sizeof(acc_t)];
  };
  std::unique_ptr<Line[]> lines_;

 public:
  StripeBuffer(int64_t c0, int64_t c1)
      : lines_(new Line[std::max<int64_t>(1, std::min(kStripe, c1 - c0)) * kAggChunk * sizeof(acc_t) /
                        sizeof(Line)]) {}
  acc_t* slot(int64_t k) { return lines_[0].v + k * kAggChunk; }
};

// m rounded up to whole blocks.
template <typename acc_t>
constexpr int64_t padded(int64_t m) {
  constexpr int64_t kN = Block<acc_t>::kN;
  return (m + kN - 1) / kN * kN;
}

// The C clients over the stripe of chunks [c, c + nk): in groups of four where
// `four(i)` (clients i .. i + 3) allows, else one at a time.  run(i, r, chunk, k, lanes)
// adds clients [i, i + r)'s kN lanes each over chunk k of the stripe, and the lanes
// of chunk k go to partials[(c + k) * C + i + j].
template <typename acc_t, typename Four, typename Run>
C10_ALWAYS_INLINE void stream_clients(const Chunk* chunks, int64_t c, int64_t nk, int64_t C, acc_t* partials,
                                      const Four& four, const Run& run) {
  using B = Block<acc_t>;
  alignas(64) acc_t lanes[4 * B::kN];
  auto group = [&](int64_t i, int r) {
    for (int64_t k = 0; k < nk; ++k) {
      std::fill(lanes, lanes + r * B::kN, acc_t(0));
      run(i, r, chunks[c + k], k, lanes);
      for (int j = 0; j < r; ++j) partials[(c + k) * C + i + j] = B::reduce_lanes(lanes + j * B::kN);
    }
  };
  int64_t i = 0;
  for (; i + 4 <= C; i += 4) {
    if (four(i)) {
      group(i, 4);
    } else {
      for (int r = 0; r < 4; ++r) group(i + r, 1);
    }
  }
  for (; i < C; ++i) group(i, 1);
}

// ---------------------------------------------------------------------------------
// Aggregation: per stripe, `total` is zeroed, the clients stream through it: total +=
// w_i * x_i (exactly python_ref's `total = total + w_i * x_i`; a client with w_i == 0 is
// never multiplied, and four clients go together only if none has w_i == 0) while their
// squares go to their lanes.  Last, per chunk, out = gamma * total and ||total||^2.

// One client over one chunk of m columns: its squares are added to its lanes `q`, and
// (kWeighted) w * x to `total`, which is rounded up to whole blocks.
// The accumulators are locals (not captured by a lambda) so that they stay in
// registers.
template <bool kWeighted, typename scalar_t, typename acc_t>
C10_ALWAYS_INLINE void aggregate_client(const scalar_t* x, int64_t m, const Vectorized<acc_t>& w, acc_t* total,
                                        acc_t* q) {
  using B = Block<acc_t>;
  using Vec = typename B::Vec;
  constexpr int64_t kN = B::kN, kW = B::kW, kK = B::kK;
  Vec sq[kK], xv[kK];
  B::zero(sq);
  int64_t j = 0;
  for (; j + kN <= m; j += kN) {
    prefetch<kN * sizeof(scalar_t)>(reinterpret_cast<uintptr_t>(x + j) + kAheadBytes);
    B::load(x + j, xv);
    for (int64_t k = 0; k < kK; ++k) {
      sq[k] = sq[k] + xv[k] * xv[k];
      if constexpr (kWeighted) (Vec::loadu(total + j + k * kW) + w * xv[k]).store(total + j + k * kW);
    }
  }
  if (j < m) {  // zero-padded: adds 0 to the squares, w * 0 to total's padding
    B::load_tail(x + j, m - j, xv);
    for (int64_t k = 0; k < kK; ++k) {
      sq[k] = sq[k] + xv[k] * xv[k];
      if constexpr (kWeighted) (Vec::loadu(total + j + k * kW) + w * xv[k]).store(total + j + k * kW);
    }
  }
  for (int64_t k = 0; k < kK; ++k) (Vec::loadu(q + k * kW) + sq[k]).store(q + k * kW);
}

// Four clients at once (all with non-zero weights): `total` is loaded and stored once
// per block instead of four times, and four rows stream concurrently.  The additions
// keep python_ref's client order: ((((total + w0 x0) + w1 x1) + w2 x2) + w3 x3).
template <typename scalar_t, typename acc_t>
C10_ALWAYS_INLINE void aggregate_4_clients(const scalar_t* const* x, int64_t m, const acc_t* w, acc_t* total,
                                           acc_t* const* q) {
  using B = Block<acc_t>;
  using Vec = typename B::Vec;
  constexpr int64_t kN = B::kN, kW = B::kW, kK = B::kK;
  const Vec w0(w[0]), w1(w[1]), w2(w[2]), w3(w[3]);
  Vec s0[kK], s1[kK], s2[kK], s3[kK], x0[kK], x1[kK], x2[kK], x3[kK];
  B::zero(s0);
  B::zero(s1);
  B::zero(s2);
  B::zero(s3);
  auto block = [&](int64_t j) C10_ALWAYS_INLINE_ATTRIBUTE {
    for (int64_t k = 0; k < kK; ++k) {
      s0[k] = s0[k] + x0[k] * x0[k];
      s1[k] = s1[k] + x1[k] * x1[k];
      s2[k] = s2[k] + x2[k] * x2[k];
      s3[k] = s3[k] + x3[k] * x3[k];
      Vec t = Vec::loadu(total + j + k * kW);
      t = t + w0 * x0[k];
      t = t + w1 * x1[k];
      t = t + w2 * x2[k];
      t = t + w3 * x3[k];
      t.store(total + j + k * kW);
    }
  };
  int64_t j = 0;
  for (; j + kN <= m; j += kN) {
    for (int r = 0; r < 4; ++r) {
      prefetch<kN * sizeof(scalar_t)>(reinterpret_cast<uintptr_t>(x[r] + j) + kAheadBytes);
    }
    B::load(x[0] + j, x0);
    B::load(x[1] + j, x1);
    B::load(x[2] + j, x2);
    B::load(x[3] + j, x3);
    block(j);
  }
  if (j < m) {
    B::load_tail(x[0] + j, m - j, x0);
    B::load_tail(x[1] + j, m - j, x1);
    B::load_tail(x[2] + j, m - j, x2);
    B::load_tail(x[3] + j, m - j, x3);
    block(j);
  }
  for (int64_t k = 0; k < kK; ++k) {
    (Vec::loadu(q[0] + k * kW) + s0[k]).store(q[0] + k * kW);
    (Vec::loadu(q[1] + k * kW) + s1[k]).store(q[1] + k * kW);
    (Vec::loadu(q[2] + k * kW) + s2[k]).store(q[2] + k * kW);
    (Vec::loadu(q[3] + k * kW) + s3[k]).store(q[3] + k * kW);
  }
}

template <typename scalar_t, typename out_t, typename acc_t>
void aggregate_chunks(const AggregateArgs<acc_t>& a, int64_t c0, int64_t c1) {
  using B = Block<acc_t>;
  using Vec = typename B::Vec;
  constexpr int64_t kN = B::kN, kW = B::kW, kK = B::kK;
  const int64_t C = a.num_clients;
  StripeBuffer<acc_t> buffer(c0, c1);
  const Vec gamma(a.gamma);
  out_t* out = static_cast<out_t*>(a.out);
  auto row = [&](int64_t i, const Chunk& ch) { return static_cast<const scalar_t*>(a.clients[i]) + ch.start; };
  auto nonzero_four = [&](int64_t i) {
    const acc_t* w = a.weights + i;
    return w[0] != acc_t(0) && w[1] != acc_t(0) && w[2] != acc_t(0) && w[3] != acc_t(0);
  };

  for (int64_t c = c0; c < c1; c += kStripe) {
    const int64_t nk = std::min(kStripe, c1 - c);
    for (int64_t k = 0; k < nk; ++k) {
      std::fill(buffer.slot(k), buffer.slot(k) + padded<acc_t>(a.chunks[c + k].len), acc_t(0));
    }
    stream_clients(a.chunks, c, nk, C, a.client_partials, nonzero_four,
                   [&](int64_t i, int r, const Chunk& ch, int64_t k, acc_t* lanes) {
      if (r == 4) {
        const scalar_t* x[4] = {row(i, ch), row(i + 1, ch), row(i + 2, ch), row(i + 3, ch)};
        acc_t* q[4] = {lanes, lanes + kN, lanes + 2 * kN, lanes + 3 * kN};
        aggregate_4_clients(x, ch.len, a.weights + i, buffer.slot(k), q);
      } else if (a.weights[i] != acc_t(0)) {
        aggregate_client<true>(row(i, ch), ch.len, Vec(a.weights[i]), buffer.slot(k), lanes);
      } else {
        aggregate_client<false>(row(i, ch), ch.len, Vec(acc_t(0)), buffer.slot(k), lanes);
      }
    });

    for (int64_t k = 0; k < nk; ++k) {
      const Chunk& ch = a.chunks[c + k];
      acc_t* total = buffer.slot(k);
      const int64_t m = ch.len;
      std::fill(total + m, total + padded<acc_t>(m), acc_t(0));  // w * 0 may be NaN for w = inf
      Vec tv[kK], sq[kK];
      B::zero(sq);
      for (int64_t j = 0; j < padded<acc_t>(m); j += kN) {
        for (int64_t kk = 0; kk < kK; ++kk) {
          tv[kk] = Vec::loadu(total + j + kk * kW);
          sq[kk] = sq[kk] + tv[kk] * tv[kk];
          tv[kk] = gamma * tv[kk];
        }
        if (j + kN <= m) {
          B::store(out + ch.start + j, tv);
        } else {
          B::store_tail(out + ch.start + j, m - j, tv);
        }
      }
      a.sum_partials[c + k] = B::reduce(sq);
    }
  }
}

template <typename acc_t>
void aggregate_pass(const AggregateArgs<acc_t>& a, int64_t c0, int64_t c1) {
  dispatch_kind<acc_t>(a.kind, [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    if (a.out_is_acc) {
      aggregate_chunks<scalar_t, acc_t, acc_t>(a, c0, c1);
    } else {
      aggregate_chunks<scalar_t, scalar_t, acc_t>(a, c0, c1);
    }
  });
}

// ---------------------------------------------------------------------------------
// client_dots: per stripe, the clients stream past g into their lanes.  g is read in
// place where it already holds acc_t in whole blocks; otherwise (reduced precision, or
// a ragged last chunk) it is first converted, zero-padded, into the stripe buffer: a
// write and a read of g more, which only a pass over few clients would notice.

// One client over one chunk of m columns: x . g (g converted, zero-padded to whole
// blocks) added to its lanes `d`.
template <typename scalar_t, typename acc_t>
C10_ALWAYS_INLINE void dots_client(const scalar_t* x, int64_t m, const acc_t* g, acc_t* d) {
  using B = Block<acc_t>;
  using Vec = typename B::Vec;
  constexpr int64_t kN = B::kN, kW = B::kW, kK = B::kK;
  Vec dot[kK], xv[kK];
  B::zero(dot);
  int64_t j = 0;
  for (; j + kN <= m; j += kN) {
    prefetch<kN * sizeof(scalar_t)>(reinterpret_cast<uintptr_t>(x + j) + kAheadBytes);
    B::load(x + j, xv);
    for (int64_t k = 0; k < kK; ++k) dot[k] = dot[k] + xv[k] * Vec::loadu(g + j + k * kW);
  }
  if (j < m) {  // x and g both zero-padded: the padding adds 0 * 0
    B::load_tail(x + j, m - j, xv);
    for (int64_t k = 0; k < kK; ++k) dot[k] = dot[k] + xv[k] * Vec::loadu(g + j + k * kW);
  }
  for (int64_t k = 0; k < kK; ++k) (Vec::loadu(d + k * kW) + dot[k]).store(d + k * kW);
}

// Four clients at once: each block of g is loaded once for the four.
template <typename scalar_t, typename acc_t>
C10_ALWAYS_INLINE void dots_4_clients(const scalar_t* const* x, int64_t m, const acc_t* g, acc_t* const* d) {
  using B = Block<acc_t>;
  using Vec = typename B::Vec;
  constexpr int64_t kN = B::kN, kW = B::kW, kK = B::kK;
  Vec s0[kK], s1[kK], s2[kK], s3[kK], x0[kK], x1[kK], x2[kK], x3[kK];
  B::zero(s0);
  B::zero(s1);
  B::zero(s2);
  B::zero(s3);
  auto block = [&](int64_t j) C10_ALWAYS_INLINE_ATTRIBUTE {
    for (int64_t k = 0; k < kK; ++k) {
      const Vec gv = Vec::loadu(g + j + k * kW);
      s0[k] = s0[k] + x0[k] * gv;
      s1[k] = s1[k] + x1[k] * gv;
      s2[k] = s2[k] + x2[k] * gv;
      s3[k] = s3[k] + x3[k] * gv;
    }
  };
  int64_t j = 0;
  for (; j + kN <= m; j += kN) {
    for (int r = 0; r < 4; ++r) {
      prefetch<kN * sizeof(scalar_t)>(reinterpret_cast<uintptr_t>(x[r] + j) + kAheadBytes);
    }
    B::load(x[0] + j, x0);
    B::load(x[1] + j, x1);
    B::load(x[2] + j, x2);
    B::load(x[3] + j, x3);
    block(j);
  }
  if (j < m) {  // x and g both zero-padded: the padding adds 0 * 0
    B::load_tail(x[0] + j, m - j, x0);
    B::load_tail(x[1] + j, m - j, x1);
    B::load_tail(x[2] + j, m - j, x2);
    B::load_tail(x[3] + j, m - j, x3);
    block(j);
  }
  for (int64_t k = 0; k < kK; ++k) {
    (Vec::loadu(d[0] + k * kW) + s0[k]).store(d[0] + k * kW);
    (Vec::loadu(d[1] + k * kW) + s1[k]).store(d[1] + k * kW);
    (Vec::loadu(d[2] + k * kW) + s2[k]).store(d[2] + k * kW);
    (Vec::loadu(d[3] + k * kW) + s3[k]).store(d[3] + k * kW);
  }
}

template <typename scalar_t, typename g_t, typename acc_t>
void client_dots_chunks(const DotsArgs<acc_t>& a, int64_t c0, int64_t c1) {
  using B = Block<acc_t>;
  using Vec = typename B::Vec;
  constexpr int64_t kN = B::kN, kW = B::kW, kK = B::kK;
  const int64_t C = a.num_clients;
  StripeBuffer<acc_t> buffer(c0, c1);
  const g_t* g = static_cast<const g_t*>(a.g);
  auto row = [&](int64_t i, const Chunk& ch) { return static_cast<const scalar_t*>(a.clients[i]) + ch.start; };

  for (int64_t c = c0; c < c1; c += kStripe) {
    const int64_t nk = std::min(kStripe, c1 - c);
    const acc_t* gs[kStripe];
    for (int64_t k = 0; k < nk; ++k) {
      const Chunk& ch = a.chunks[c + k];
      if constexpr (std::is_same_v<g_t, acc_t>) {
        if (ch.len % kN == 0) {
          gs[k] = g + ch.start;
          continue;
        }
      }
      acc_t* gk = buffer.slot(k);
      gs[k] = gk;
      Vec v[kK];
      int64_t j = 0;
      for (; j + kN <= ch.len; j += kN) {
        B::load(g + ch.start + j, v);
        for (int64_t kk = 0; kk < kK; ++kk) v[kk].store(gk + j + kk * kW);
      }
      if (j < ch.len) {  // zero-padded
        B::load_tail(g + ch.start + j, ch.len - j, v);
        for (int64_t kk = 0; kk < kK; ++kk) v[kk].store(gk + j + kk * kW);
      }
    }
    stream_clients(a.chunks, c, nk, C, a.partials, [](int64_t) { return true; },
                   [&](int64_t i, int r, const Chunk& ch, int64_t k, acc_t* lanes) {
      if (r == 4) {
        const scalar_t* x[4] = {row(i, ch), row(i + 1, ch), row(i + 2, ch), row(i + 3, ch)};
        acc_t* d[4] = {lanes, lanes + kN, lanes + 2 * kN, lanes + 3 * kN};
        dots_4_clients(x, ch.len, gs[k], d);
      } else {
        dots_client(row(i, ch), ch.len, gs[k], lanes);
      }
    });
  }
}

template <typename acc_t>
void client_dots_pass(const DotsArgs<acc_t>& a, int64_t c0, int64_t c1) {
  dispatch_kind<acc_t>(a.kind, [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    if (a.g_is_acc) {
      client_dots_chunks<scalar_t, acc_t, acc_t>(a, c0, c1);
    } else {
      client_dots_chunks<scalar_t, scalar_t, acc_t>(a, c0, c1);
    }
  });
}

// ---------------------------------------------------------------------------------
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

constexpr KernelTable kTable = {
    C10_STRINGIZE(CPU_CAPABILITY),
    {&nar_norm_pass<float>, &nar_update_pass<float>, &aggregate_pass<float>, &client_dots_pass<float>,
     &server_update_pass<float>},
    {&nar_norm_pass<double>, &nar_update_pass<double>, &aggregate_pass<double>, &client_dots_pass<double>,
     &server_update_pass<double>},
};

}  // namespace fedopt::cpu::CPU_CAPABILITY
