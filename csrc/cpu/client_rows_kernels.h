// The passes over C client rows on the CPU: the aggregation (weighted sum, every
// client's squared norm, the result's squared norm) and client_dots, both streaming
// each client's row over L2-resident stripes.
#pragma once

#ifndef CPU_CAPABILITY
#error "client_rows_kernels.h is included by kernels.h (via isa_*.cpp, which define CPU_CAPABILITY)"
#endif

#include "noise_kernels.h"
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

// A client's kN lanes in memory += its block accumulator `s` (kK vectors): the end of
// its pass over one chunk.
template <typename acc_t>
C10_ALWAYS_INLINE void add_to_lanes(acc_t* lanes, const Vectorized<acc_t>* s) {
  using B = Block<acc_t>;
  for (int64_t k = 0; k < B::kK; ++k) (Vectorized<acc_t>::loadu(lanes + k * B::kW) + s[k]).store(lanes + k * B::kW);
}

// The walk over client rows that both passes make: R rows (R = 1 or 4) of m columns
// each, block by block, body(j, xv) with xv[r] the block of row r at column j converted
// to acc_t.  The ragged end is zero-padded (load_tail), so a body treats it as a whole
// block: the padding adds 0 to squares, w * 0 to the aggregate's total padding (cleared
// before use) and 0 * 0 to dots.  Each row prefetches kAheadBytes ahead, all R before
// any load, so that R streams are in flight.
// Codegen notes (GCC 12, checked on the disassembly and timed): bodies are always-inline
// lambdas, since one GCC did not inline once kept an accumulator on the stack (bcefc43);
// and xv is declared per block, not once per walk: declared once, GCC stored every
// loaded block to the stack before using it, and four-client client_dots ran ~15%
// slower.  Declared per block, the loads fold into the arithmetic as in the hand-written
// loops this replaced.
// kBase (only where scalar_t is acc_t: fp32, fp64): the rows are the updates base - x_r,
// subtracted here, in registers, from the block of `base` (the stripe's, L2-resident)
// loaded once for the R rows -- one IEEE subtraction per element, the same bits as
// stage_chunk's scalar one, without staging the row through a buffer (measured: the
// staging made a pass over 20 ResNet-18 replies ~1.5-1.8x slower than over their models).
template <int R, typename acc_t, bool kBase = false, typename scalar_t, typename Body>
C10_ALWAYS_INLINE void walk_rows(const scalar_t* const* x, int64_t m, const Body& body,
                                 const scalar_t* base = nullptr) {
  using B = Block<acc_t>;
  using Vec = typename B::Vec;
  constexpr int64_t kN = B::kN;
  static_assert(!kBase || std::is_same_v<scalar_t, acc_t>, "the walk subtracts from a base only in acc_t");
  auto subtract = [&](const Vec* bv, auto& xv) C10_ALWAYS_INLINE_ATTRIBUTE {
    for (int r = 0; r < R; ++r) {
      for (int64_t k = 0; k < B::kK; ++k) xv[r][k] = bv[k] - xv[r][k];
    }
  };
  int64_t j = 0;
  for (; j + kN <= m; j += kN) {
    for (int r = 0; r < R; ++r) {
      prefetch<kN * sizeof(scalar_t)>(reinterpret_cast<uintptr_t>(x[r] + j) + kAheadBytes);
    }
    Vec xv[R][B::kK];
    for (int r = 0; r < R; ++r) B::load(x[r] + j, xv[r]);
    if constexpr (kBase) {
      Vec bv[B::kK];
      B::load(base + j, bv);
      subtract(bv, xv);
    }
    body(j, xv);
  }
  if (j < m) {
    Vec xv[R][B::kK];
    for (int r = 0; r < R; ++r) B::load_tail(x[r] + j, m - j, xv[r]);
    if constexpr (kBase) {  // zero-padded both: the padding stays 0 - 0 = 0
      Vec bv[B::kK];
      B::load_tail(base + j, m - j, bv);
      subtract(bv, xv);
    }
    body(j, xv);
  }
}

// A compile-time client count for stream_clients' groups.
template <int R>
using Rows = std::integral_constant<int, R>;

// Client i's row over the columns [start, start + len) of a PieceTable (kernel_api.h):
// read in place where those columns lie inside one piece and there is no base, else
// staged into `buf` (len <= kAggChunk elements) -- copied piece by piece, or base - x
// with one subtraction rounded to scalar_t (c10::Half and c10::BFloat16 subtract in
// float and round once, as torch.sub and NumPy's float16 do).  Staging costs a write
// and a read of a cache-resident buffer per element, against the row's one read from
// memory; a reply's layers are rarely a multiple of the chunk, so most chunks of a
// model with biases straddle two pieces.
template <typename scalar_t>
const scalar_t* stage_chunk(const PieceTable& t, int64_t i, int64_t start, int64_t len, scalar_t* buf) {
  const int64_t L = t.num_pieces;
  // the piece holding column `start`: the last p with starts[p] <= start (so never an
  // empty piece: those share their start with the next one)
  int64_t p = std::upper_bound(t.starts, t.starts + L + 1, start) - t.starts - 1;
  const void* const* ptrs = t.ptrs + i * L;
  const scalar_t* base = t.base != nullptr ? static_cast<const scalar_t*>(t.base) + start : nullptr;
  if (base == nullptr && start + len <= t.starts[p + 1]) {
    return static_cast<const scalar_t*>(ptrs[p]) + (start - t.starts[p]);
  }
  for (int64_t j = 0; j < len;) {
    while (start + j >= t.starts[p + 1]) ++p;
    const int64_t n = std::min(len - j, t.starts[p + 1] - (start + j));
    const scalar_t* src = static_cast<const scalar_t*>(ptrs[p]) + (start + j - t.starts[p]);
    if (base != nullptr) {
      for (int64_t k = 0; k < n; ++k) buf[j + k] = static_cast<scalar_t>(base[j + k] - src[k]);
    } else {
      std::copy(src, src + n, buf + j);
    }
    j += n;
  }
  return buf;
}

// The C clients over the stripe of chunks [c, c + nk): in groups of four where
// `four(i)` (clients i .. i + 3) allows, else one at a time.  run(Rows<R>, i, m, k, x,
// base, q) adds clients [i, i + R) over chunk k of the stripe (m columns): x[r] is
// client i + r's row at the chunk's start (`clients[i + r]`, or staged from `pieces`
// when given), q[r] its kN lanes, whose sum goes to partials[(c + k) * C + i + r].
// `base` is null unless the pieces have a base and scalar_t is acc_t: then x[r] are the
// replies as they are (read in place, or copied where a chunk straddles two pieces) and
// the walk subtracts them from `base` (the base at the chunk's start) in registers
// (walk_rows' kBase); otherwise stage_chunk subtracts while staging.
template <typename scalar_t, typename acc_t, typename Four, typename Run>
C10_ALWAYS_INLINE void stream_clients(const void* const* clients, const PieceTable* pieces, const Chunk* chunks,
                                      int64_t c, int64_t nk, int64_t C, acc_t* partials, const Four& four,
                                      const Run& run) {
  using B = Block<acc_t>;
  alignas(64) acc_t lanes[4 * B::kN];
  // one staging buffer per client of a group (4 x 16 KiB of fp32)
  std::unique_ptr<scalar_t[]> staging(pieces != nullptr ? new scalar_t[4 * kAggChunk] : nullptr);
  const bool walk_subtracts = std::is_same_v<scalar_t, acc_t> && pieces != nullptr && pieces->base != nullptr;
  PieceTable raw{};  // the pieces without their base (what the walk subtracts from it)
  if (walk_subtracts) {
    raw = *pieces;
    raw.base = nullptr;
  }
  const PieceTable* read = walk_subtracts ? &raw : pieces;
  auto group = [&](int64_t i, auto rows) {
    constexpr int R = decltype(rows)::value;
    acc_t* q[R];
    for (int r = 0; r < R; ++r) q[r] = lanes + r * B::kN;
    for (int64_t k = 0; k < nk; ++k) {
      const Chunk& ch = chunks[c + k];
      const scalar_t* x[R];
      for (int r = 0; r < R; ++r) {
        x[r] = read == nullptr ? static_cast<const scalar_t*>(clients[i + r]) + ch.start
                               : stage_chunk(*read, i + r, ch.start, ch.len, staging.get() + r * kAggChunk);
      }
      const scalar_t* base = walk_subtracts ? static_cast<const scalar_t*>(pieces->base) + ch.start : nullptr;
      std::fill(lanes, lanes + R * B::kN, acc_t(0));
      run(rows, i, ch.len, k, x, base, q);
      for (int r = 0; r < R; ++r) partials[(c + k) * C + i + r] = B::reduce_lanes(q[r]);
    }
  };
  int64_t i = 0;
  for (; i + 4 <= C; i += 4) {
    if (four(i)) {
      group(i, Rows<4>{});
    } else {
      for (int r = 0; r < 4; ++r) group(i + r, Rows<1>{});
    }
  }
  for (; i < C; ++i) group(i, Rows<1>{});
}

// The type dispatch of both passes: f(Tag<scalar_t>, Tag<other_t>) with scalar_t the
// clients' element type (`kind`) and other_t that of the one other data tensor
// (aggregate's out, client_dots' g), which holds acc_t or else the clients' type.
template <typename acc_t, typename F>
void dispatch_clients_and(ScalarKind kind, bool other_is_acc, const F& f) {
  dispatch_kind<acc_t>(kind, [&](auto clients) {
    if (other_is_acc) {
      f(clients, Tag<acc_t>{});
    } else {
      f(clients, clients);
    }
  });
}

// The stripes of chunks [c0, c1): fn(c, nk) for the nk <= kStripe chunks from c.
template <typename F>
C10_ALWAYS_INLINE void for_stripes(int64_t c0, int64_t c1, const F& fn) {
  for (int64_t c = c0; c < c1; c += kStripe) fn(c, std::min(kStripe, c1 - c));
}

// ---------------------------------------------------------------------------------
// Aggregation: per stripe, `total` is zeroed, the clients stream through it: total +=
// w_i * x_i (exactly python_ref's `total = total + w_i * x_i`; a client with w_i == 0 is
// never multiplied, and four clients go together only if none has w_i == 0) while their
// squares go to their lanes.  Last, per chunk, out = gamma * total (+ std * noise with
// DP noise) and ||total||^2.

// R clients over one chunk of m columns: the squares of client r are added to its lanes
// q[r], and (kWeighted) w[r] * x_r to `total`, which is rounded up to whole blocks.  The
// additions keep python_ref's client order: (((total + w0 x0) + w1 x1) + ...).  Four
// clients at once (R = 4, all with non-zero weights) load and store `total` once per
// block instead of four times, and stream four rows concurrently.
template <int R, bool kWeighted, bool kBase, typename scalar_t, typename acc_t>
C10_ALWAYS_INLINE void aggregate_rows(const scalar_t* const* x, int64_t m, const acc_t* w, acc_t* total,
                                      acc_t* const* q, const scalar_t* base) {
  using B = Block<acc_t>;
  using Vec = typename B::Vec;
  constexpr int64_t kW = B::kW, kK = B::kK;
  Vec wv[R], sq[R][kK];
  for (int r = 0; r < R; ++r) {
    if constexpr (kWeighted) wv[r] = Vec(w[r]);
    B::zero(sq[r]);
  }
  walk_rows<R, acc_t, kBase>(x, m, [&](int64_t j, const auto& xv) C10_ALWAYS_INLINE_ATTRIBUTE {
    for (int64_t k = 0; k < kK; ++k) {
      for (int r = 0; r < R; ++r) sq[r][k] = sq[r][k] + xv[r][k] * xv[r][k];
      if constexpr (kWeighted) {
        Vec t = Vec::loadu(total + j + k * kW);
        for (int r = 0; r < R; ++r) t = t + wv[r] * xv[r][k];
        t.store(total + j + k * kW);
      }
    }
  }, base);
  for (int r = 0; r < R; ++r) add_to_lanes(q[r], sq[r]);
}

// The end of one chunk of m columns, once every client has passed: out = gamma * total
// (out at the chunk's start), and ||total||^2 returned.  total's padding is cleared
// first: the clients added w * 0 to it, which is NaN for w = inf.
// kNoise: out = gamma * total + std * normal(key, start + j) (noise_kernels.h) for the
// chunk's columns j from global column `start`, the noise of a block drawn into lanes
// while its total is in registers; ||total||^2 stays that of the sum without noise.
// Without it (a separate instantiation) the loop is the noise-free one, unchanged.
template <bool kNoise, typename out_t, typename acc_t>
C10_ALWAYS_INLINE acc_t finish_total(acc_t* total, int64_t m, const Vectorized<acc_t>& gamma, out_t* out,
                                     [[maybe_unused]] const AggregateArgs<acc_t>& a,
                                     [[maybe_unused]] int64_t start) {
  using B = Block<acc_t>;
  using Vec = typename B::Vec;
  constexpr int64_t kN = B::kN, kW = B::kW, kK = B::kK;
  std::fill(total + m, total + padded<acc_t>(m), acc_t(0));
  Vec tv[kK], sq[kK];
  B::zero(sq);
  [[maybe_unused]] const Vec std_v(a.noise_std);
  for (int64_t j = 0; j < padded<acc_t>(m); j += kN) {
    for (int64_t kk = 0; kk < kK; ++kk) {
      tv[kk] = Vec::loadu(total + j + kk * kW);
      sq[kk] = sq[kk] + tv[kk] * tv[kk];
      tv[kk] = gamma * tv[kk];
    }
    if constexpr (kNoise) {
      Vec nv[kK];
      noise_terms(a.noise_key, static_cast<uint64_t>(start + j), std_v, nv);
      for (int64_t kk = 0; kk < kK; ++kk) tv[kk] = tv[kk] + nv[kk];
    }
    if (j + kN <= m) {
      B::store(out + j, tv);
    } else {
      B::store_tail(out + j, m - j, tv);
    }
  }
  return B::reduce(sq);
}

template <typename scalar_t, typename out_t, typename acc_t>
void aggregate_chunks(const AggregateArgs<acc_t>& a, int64_t c0, int64_t c1) {
  StripeBuffer<acc_t> buffer(c0, c1);
  const Vectorized<acc_t> gamma(a.gamma);
  out_t* out = static_cast<out_t*>(a.out);
  auto nonzero_four = [&](int64_t i) {
    const acc_t* w = a.weights + i;
    return w[0] != acc_t(0) && w[1] != acc_t(0) && w[2] != acc_t(0) && w[3] != acc_t(0);
  };

  for_stripes(c0, c1, [&](int64_t c, int64_t nk) {
    for (int64_t k = 0; k < nk; ++k) {
      std::fill(buffer.slot(k), buffer.slot(k) + padded<acc_t>(a.chunks[c + k].len), acc_t(0));
    }
    stream_clients<scalar_t>(a.clients, a.pieces, a.chunks, c, nk, a.num_clients, a.client_partials, nonzero_four,
                             [&](auto rows, int64_t i, int64_t m, int64_t k, const scalar_t* const* x,
                                 const scalar_t* base, acc_t* const* q) {
      auto rows_of = [&](auto subtracts) C10_ALWAYS_INLINE_ATTRIBUTE {
        constexpr bool kBase = decltype(subtracts)::value;
        if constexpr (decltype(rows)::value == 4) {
          aggregate_rows<4, true, kBase>(x, m, a.weights + i, buffer.slot(k), q, base);
        } else if (a.weights[i] != acc_t(0)) {
          aggregate_rows<1, true, kBase>(x, m, a.weights + i, buffer.slot(k), q, base);
        } else {
          aggregate_rows<1, false, kBase>(x, m, a.weights + i, buffer.slot(k), q, base);
        }
      };
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        if (base != nullptr) {
          rows_of(std::true_type{});
          return;
        }
      }
      rows_of(std::false_type{});
    });

    for (int64_t k = 0; k < nk; ++k) {
      const Chunk& ch = a.chunks[c + k];
      acc_t* total = buffer.slot(k);
      a.sum_partials[c + k] = a.noise ? finish_total<true>(total, ch.len, gamma, out + ch.start, a, ch.start)
                                      : finish_total<false>(total, ch.len, gamma, out + ch.start, a, ch.start);
    }
  });
}

template <typename acc_t>
void aggregate_pass(const AggregateArgs<acc_t>& a, int64_t c0, int64_t c1) {
  dispatch_clients_and<acc_t>(a.kind, a.out_is_acc, [&](auto clients, auto out) {
    aggregate_chunks<typename decltype(clients)::type, typename decltype(out)::type, acc_t>(a, c0, c1);
  });
}

// ---------------------------------------------------------------------------------
// client_dots: per stripe, the clients stream past g into their lanes.  g is read in
// place where it already holds acc_t in whole blocks; otherwise (reduced precision, or
// a ragged last chunk) it is first converted, zero-padded, into the stripe buffer: a
// write and a read of g more, which only a pass over few clients would notice.

// R clients over one chunk of m columns: x_r . g (g converted, zero-padded to whole
// blocks) added to client r's lanes d[r].  Four clients at once (R = 4) load each block
// of g once for the four.
template <int R, bool kBase, typename scalar_t, typename acc_t>
C10_ALWAYS_INLINE void dots_rows(const scalar_t* const* x, int64_t m, const acc_t* g, acc_t* const* d,
                                 const scalar_t* base) {
  using B = Block<acc_t>;
  using Vec = typename B::Vec;
  constexpr int64_t kW = B::kW, kK = B::kK;
  Vec dot[R][kK];
  for (int r = 0; r < R; ++r) B::zero(dot[r]);
  walk_rows<R, acc_t, kBase>(x, m, [&](int64_t j, const auto& xv) C10_ALWAYS_INLINE_ATTRIBUTE {
    for (int64_t k = 0; k < kK; ++k) {
      const Vec gv = Vec::loadu(g + j + k * kW);
      for (int r = 0; r < R; ++r) dot[r][k] = dot[r][k] + xv[r][k] * gv;
    }
  }, base);
  for (int r = 0; r < R; ++r) add_to_lanes(d[r], dot[r]);
}

// One chunk of g (m columns from g) as dots_rows reads it, acc_t in whole blocks: g
// itself where it already is that, else g converted, zero-padded, into `slot`.
template <typename g_t, typename acc_t>
C10_ALWAYS_INLINE const acc_t* g_blocks(const g_t* g, int64_t m, acc_t* slot) {
  using B = Block<acc_t>;
  using Vec = typename B::Vec;
  constexpr int64_t kN = B::kN, kW = B::kW, kK = B::kK;
  if constexpr (std::is_same_v<g_t, acc_t>) {
    if (m % kN == 0) return g;
  }
  Vec v[kK];
  int64_t j = 0;
  for (; j + kN <= m; j += kN) {
    B::load(g + j, v);
    for (int64_t kk = 0; kk < kK; ++kk) v[kk].store(slot + j + kk * kW);
  }
  if (j < m) {  // zero-padded
    B::load_tail(g + j, m - j, v);
    for (int64_t kk = 0; kk < kK; ++kk) v[kk].store(slot + j + kk * kW);
  }
  return slot;
}

template <typename scalar_t, typename g_t, typename acc_t>
void client_dots_chunks(const DotsArgs<acc_t>& a, int64_t c0, int64_t c1) {
  StripeBuffer<acc_t> buffer(c0, c1);
  const g_t* g = static_cast<const g_t*>(a.g);

  for_stripes(c0, c1, [&](int64_t c, int64_t nk) {
    const acc_t* gs[kStripe];
    for (int64_t k = 0; k < nk; ++k) {
      const Chunk& ch = a.chunks[c + k];
      gs[k] = g_blocks(g + ch.start, ch.len, buffer.slot(k));
    }
    stream_clients<scalar_t>(a.clients, a.pieces, a.chunks, c, nk, a.num_clients, a.partials,
                             [](int64_t) { return true; },
                             [&](auto rows, int64_t, int64_t m, int64_t k, const scalar_t* const* x,
                                 const scalar_t* base, acc_t* const* d) {
      constexpr int R = decltype(rows)::value;
      if constexpr (std::is_same_v<scalar_t, acc_t>) {
        if (base != nullptr) {
          dots_rows<R, true>(x, m, gs[k], d, base);
          return;
        }
      }
      dots_rows<R, false>(x, m, gs[k], d, base);
    });
  });
}

template <typename acc_t>
void client_dots_pass(const DotsArgs<acc_t>& a, int64_t c0, int64_t c1) {
  dispatch_clients_and<acc_t>(a.kind, a.g_is_acc, [&](auto clients, auto g) {
    client_dots_chunks<typename decltype(clients)::type, typename decltype(g)::type, acc_t>(a, c0, c1);
  });
}

}  // namespace
}  // namespace fedopt::cpu::CPU_CAPABILITY
