// The passes over C client rows on the CPU: the aggregation (weighted sum, every
// client's squared norm, the result's squared norm) and client_dots, both streaming
// each client's row over L2-resident stripes.
#pragma once

#ifndef CPU_CAPABILITY
#error "client_rows_kernels.h is included by kernels.h (via isa_*.cpp, which define CPU_CAPABILITY)"
#endif

#include "vec_block.h"

namespace fedopt::cpu::CPU_CAPABILITY {
namespace {

// Passes over C client rows (aggregate, client_dots): row streaming over stripes of
// kStripe column chunks.  Per stripe, the clients, four at a time and in client order,
// stream their rows of the stripe through an L2-resident acc_t buffer (the aggregate's
// running total, or g converted), each chunk's per-client lanes summed into its
// partials as soon as the clients have passed it.
//
// Why rows and not column blocks: visiting all C rows per column block (the design
// before) restarts a hardware prefetch stream at every switch of row; streaming a
// whole row of a stripe keeps one stream per client.  Measured against the floor
// torch.sum(X, dim=0) with caches flushed, 100 x 90.5K fp32 (data about the size of an
// L3): column blocks 0.69-0.77 of the floor, row streaming 0.89-0.94; on rows far larger
// than any cache both run at 1.25-1.33x the floor.  kStripe and kAheadBytes are the
// flat optimum of a sweep (stripes of 32-96 Ki columns within noise of each other, a
// prefetch 2-8 KiB ahead the same, 512 B ahead or none clearly worse).  The machine,
// the sweep and the alternatives: docs/benchmarks.md, "CPU kernels".
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

}  // namespace
}  // namespace fedopt::cpu::CPU_CAPABILITY
