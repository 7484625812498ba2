// The robust aggregators' kernels on the CPU, compiled once per instruction set
// (kernels.h): the clients' Gram matrix (gram_pass, Krum / Multi-Krum / Bulyan / the
// geometric median / centered clipping) and coordinate_select's blocks (select_pass:
// the coordinate-wise median, trimmed mean and Bulyan's closest-to-median mean).
// Host side, schemas and what the results are: robust_select.cpp, csrc/registration.cpp.
//
// Both are compute-bound (the Gram matrix does K(K+1)/2 products per column, the
// selection sorts m values per column), so they are written on GCC vector extensions
// (the Gram's 64 bytes, which each build lowers to its registers: one zmm, two ymm,
// four xmm; the selection's the build's own width, see SelectVec): a logical layout
// fixed in lanes, never in the vector width, so every ISA gives the same bits (the TUs
// are compiled without contraction, isa_prologue.h; tests/test_robust_gram.py).
//
// Both read the clients as rows or, through a PieceTable, as the per-layer arrays of
// the replies with the subtraction from a base done while staging (stage_chunk,
// client_rows_kernels.h): the same values, bit for bit, as the [C, N] rows those
// pieces would be copied into, without writing the rows.
#pragma once

#ifndef CPU_CAPABILITY
#error "robust_kernels.h is included by kernels.h (via isa_*.cpp, which define CPU_CAPABILITY)"
#endif

#include <cstring>
#include <memory>

#include "client_rows_kernels.h"
#include "vec_block.h"

namespace fedopt::cpu::CPU_CAPABILITY {
namespace {

// A vector of 64 bytes of acc_t (16 floats or 8 doubles).
template <typename acc_t>
struct Wide {
  typedef acc_t type __attribute__((vector_size(64)));
};
template <typename acc_t>
constexpr int64_t kWideLanes = 64 / static_cast<int64_t>(sizeof(acc_t));

// n elements of T on a 64-byte boundary (the Wide vectors' alignment).
template <typename T>
struct Aligned64 {
  std::unique_ptr<char[]> raw;
  T* p;
  explicit Aligned64(int64_t n) : raw(new char[n * sizeof(T) + 64]) {
    p = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(raw.get()) + 63) & ~uintptr_t(63));
  }
};

// ---------------------------------------------------------------------------------
// Gram matrix.
//
// G_ij = <x_i, x_j> for i <= j, the columns in blocks of kGramBlock: every row's block
// converted once into an acc_t tile (zero-padded at the ragged end), then for each pair
// the block's dot product in acc_t -- four 64-byte accumulators over the block's
// vectors, added as (s0 + s1) + (s2 + s3), the lanes then halved in a fixed tree -- and
// that value added in double to the chunk's partial, block after block.  The host adds
// the chunks' partials in chunk order.  So every term x_ik x_jk goes through at most
// kGramAccOps roundings in acc_t (its product, 3 (fp32) or 7 (fp64) accumulator adds, 2
// combining adds, 4 or 3 tree adds: 10 for fp32 acc, 13 for fp64) and then only double
// additions, one per block and one per chunk:
//
//   |G_ij - <x_i, x_j>| <= (gamma_10(u_acc) + gamma_{n_blocks + n_chunks}(2^-53))
//                          * sum_k |x_ik x_jk|,     gamma_n(u) = n u / (1 - n u),
//
// where a float64 Gram in one pass (the design before this one, and BLAS's dgemm) has
// the second term only; an fp32 sgemm of the whole block would have gamma_{block} in
// place of gamma_10.  fp16/bf16 products are exact in fp32 (11 + 11 and 8 + 8 bits).
//
// With float64_products the blocks of fp32/fp16/bf16 data are converted to double and
// summed as fp64 data's are: the products are exact (24 + 24 bits < 53) and a term
// goes through at most 12 double roundings in its block, so the bound is
// gamma_{12 + n_blocks + n_chunks}(2^-53) sum_k |x_ik x_jk| -- a float64 Gram's, at
// twice the fp32 blocks' instructions.
constexpr int64_t kGramBlock = 256;

template <typename acc_t>
C10_ALWAYS_INLINE acc_t gram_block_dot(const acc_t* x, const acc_t* y) {
  using V = typename Wide<acc_t>::type;
  constexpr int64_t W = kWideLanes<acc_t>;
  constexpr int64_t nv = kGramBlock / W;  // 16 (fp32) or 32 (fp64) vectors
  static_assert(nv % 4 == 0, "four accumulators");
  const V* a = reinterpret_cast<const V*>(x);
  const V* b = reinterpret_cast<const V*>(y);
  V s0 = a[0] * b[0], s1 = a[1] * b[1], s2 = a[2] * b[2], s3 = a[3] * b[3];
  for (int64_t q = 4; q < nv; q += 4) {
    s0 += a[q] * b[q];
    s1 += a[q + 1] * b[q + 1];
    s2 += a[q + 2] * b[q + 2];
    s3 += a[q + 3] * b[q + 3];
  }
  const V t = (s0 + s1) + (s2 + s3);
  alignas(64) acc_t l[W];
  std::memcpy(l, &t, sizeof(t));
  for (int64_t h = W / 2; h >= 1; h /= 2) {
    for (int64_t k = 0; k < h; ++k) l[k] += l[k + h];
  }
  return l[0];
}

// The chunks [c0, c1) with the products and the block sums in dot_t (acc_t, or double
// for float64_products).
template <typename scalar_t, typename dot_t, typename acc_t>
void gram_chunks(const GramArgs<acc_t>& a, int64_t c0, int64_t c1) {
  const int64_t K = a.num_rows;
  Aligned64<dot_t> tile(std::max<int64_t>(K, 1) * kGramBlock);
  std::unique_ptr<scalar_t[]> staging(a.pieces != nullptr ? new scalar_t[kGramBlock] : nullptr);
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t j0 = c * a.chunk;
    const int64_t j1 = std::min(a.N, j0 + a.chunk);
    double* P = a.partials + c * K * K;
    std::fill(P, P + K * K, 0.0);
    for (int64_t j = j0; j < j1; j += kGramBlock) {
      const int64_t w = std::min(kGramBlock, j1 - j);
      for (int64_t i = 0; i < K; ++i) {
        const scalar_t* src = a.pieces != nullptr ? stage_chunk(*a.pieces, i, j, w, staging.get())
                                                  : static_cast<const scalar_t*>(a.rows[i]) + j;
        dot_t* t = tile.p + i * kGramBlock;
        for (int64_t l = 0; l < w; ++l) t[l] = static_cast<dot_t>(static_cast<acc_t>(src[l]));
        for (int64_t l = w; l < kGramBlock; ++l) t[l] = dot_t(0);
      }
      for (int64_t i = 0; i < K; ++i) {
        const dot_t* x = tile.p + i * kGramBlock;
        for (int64_t k = i; k < K; ++k) {
          P[i * K + k] += static_cast<double>(gram_block_dot<dot_t>(x, tile.p + k * kGramBlock));
        }
      }
    }
  }
}

template <typename acc_t>
void gram_pass(const GramArgs<acc_t>& a, int64_t c0, int64_t c1) {
  dispatch_kind<acc_t>(a.kind, [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    if (a.float64_products) {
      gram_chunks<scalar_t, double, acc_t>(a, c0, c1);
    } else {
      gram_chunks<scalar_t, acc_t, acc_t>(a, c0, c1);
    }
  });
}

// ---------------------------------------------------------------------------------
// coordinate_select.
//
// A thread owns whole blocks of columns.  Inside a block it takes kSelectLanes columns
// at a time: it loads the m kept clients' values of those columns into a [m][lanes]
// tile (acc dtype), orders every lane with lane-wise min/max compare-exchanges
// (branch-free, vectorised across the lanes: an odd-even transposition sort, or for a
// small trim only k bubble passes each way), then reduces each lane:
//
//   mode 0 (trim):    k = min(count, (m - 1) / 2);  out = sum(v[k .. m-k)) / (m - 2k)
//                     (the median is k = (m - 1) / 2: the middle value or the mean of
//                     the two middle ones)
//   mode 1 (closest): beta = clamp(count, 1, m); med = median(v); the window of beta
//                     sorted values closest to med, found by dropping the farther end
//                     (the upper one on a tie) until beta are left; out = its mean.
//
// Sums run over the rows [k, m-k) in row order: deterministic, independent of the
// thread count and of the ISA.  The same pass flags every kept client holding a
// NaN/Inf.  With pieces, each kept client's columns of kSelectStage at a time are
// staged first (m x kSelectStage values, cache-resident).
constexpr int64_t kSelectLanes = 32;
constexpr int64_t kSelectStage = 256;  // a multiple of kSelectLanes
// The compare-exchanges' vectors: the build's own register width (16, 32, 64 bytes).
// GCC lowers a select (`less ? y : x`) on vectors wider than the target's registers to
// far slower code (measured 4x on the median in the baseline build).  32 lanes a row
// give a bubble pass's dependent compare-exchanges two or more independent vectors each.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kSelectVecBytes = 64;
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int64_t kSelectVecBytes = 32;
#else
constexpr int64_t kSelectVecBytes = 16;
#endif
template <typename acc_t>
struct SelectVec {
  typedef acc_t type __attribute__((vector_size(kSelectVecBytes)));
};

template <typename scalar_t, typename acc_t>
void select_columns(const SelectArgs<acc_t>& a, const scalar_t* const* src, int64_t s, int64_t s1, uint8_t* bad,
                    acc_t* tile) {
  using V = typename SelectVec<acc_t>::type;
  constexpr int64_t kVecsPerRow = kSelectLanes * static_cast<int64_t>(sizeof(acc_t)) / kSelectVecBytes;
  const int64_t m = a.num_kept;
  const acc_t big = std::numeric_limits<acc_t>::max();
  auto cmpx = [&](int64_t i) {  // lanes of rows i and i + 1 into (min, max)
    V* lo = reinterpret_cast<V*>(tile + i * kSelectLanes);
    V* hi = lo + kVecsPerRow;
    for (int64_t q = 0; q < kVecsPerRow; ++q) {
      const V x = lo[q], y = hi[q];
      // swap when y goes first: ascending with NaN after every number (torch.sort's
      // order, python_ref/robust.py); a plain y < x leaves a NaN unordered
      const auto less = (y < x) | ((x != x) & (y == y));
      lo[q] = less ? y : x;
      hi[q] = less ? x : y;
    }
  };
  for (int64_t j = s; j < s1; j += kSelectLanes) {
    const int64_t w = std::min(kSelectLanes, s1 - j);
    for (int64_t i = 0; i < m; ++i) {
      const scalar_t* row = src[i] + (j - s);
      acc_t* t = tile + i * kSelectLanes;
      bool finite = true;
      if (w == kSelectLanes) {
        for (int64_t l = 0; l < kSelectLanes; ++l) {
          t[l] = static_cast<acc_t>(row[l]);
          finite &= std::abs(t[l]) <= big;  // false for NaN and +-Inf
        }
      } else {
        for (int64_t l = 0; l < kSelectLanes; ++l) {
          t[l] = l < w ? static_cast<acc_t>(row[l]) : acc_t(0);
          finite &= std::abs(t[l]) <= big;
        }
      }
      bad[i] |= static_cast<uint8_t>(!finite);
    }
    // Order the lanes.  Mode 0 needs only the k smallest and k largest out of the way:
    // k bubble passes each way cost 2k(m-1) - k(k-1) compare-exchanges against the full
    // sort's m(m-1)/2, so a small trim (beta = 0.1 of 20 clients: 74 against 190) bubbles
    // and the median sorts.  Either leaves rows [k, m-k) holding the kept middle values.
    const int64_t k0 = a.mode == 0 ? std::min(a.count, m > 0 ? (m - 1) / 2 : 0) : 0;
    if (a.mode == 0 && 2 * k0 * (m - 1) - k0 * (k0 - 1) < m * (m - 1) / 2) {
      for (int64_t p = 0; p < k0; ++p) {
        for (int64_t i = m - 2; i >= p; --i) cmpx(i);  // the p-th smallest down to row p
      }
      for (int64_t p = 0; p < k0; ++p) {
        for (int64_t i = k0; i + 1 < m - p; ++i) cmpx(i);  // the p-th largest up to row m-1-p
      }
    } else {
      // odd-even transposition sort: m rounds sort m values
      for (int64_t r = 0; r < m; ++r) {
        for (int64_t i = r & 1; i + 1 < m; i += 2) cmpx(i);
      }
    }
    acc_t res[kSelectLanes];
    if (m == 0) {
      for (int64_t l = 0; l < kSelectLanes; ++l) res[l] = 0;
    } else if (a.mode == 0) {
      const int64_t k = std::min(a.count, (m - 1) / 2);
      for (int64_t l = 0; l < kSelectLanes; ++l) res[l] = 0;
      for (int64_t i = k; i < m - k; ++i) {
        const acc_t* t = tile + i * kSelectLanes;
        for (int64_t l = 0; l < kSelectLanes; ++l) res[l] += t[l];
      }
      const acc_t n = static_cast<acc_t>(m - 2 * k);
      for (int64_t l = 0; l < kSelectLanes; ++l) res[l] /= n;
    } else {
      const int64_t beta = std::max<int64_t>(1, std::min(a.count, m));
      for (int64_t l = 0; l < kSelectLanes; ++l) {
        auto v = [&](int64_t i) { return tile[i * kSelectLanes + l]; };
        const acc_t med = m % 2 ? v((m - 1) / 2) : (v(m / 2 - 1) + v(m / 2)) / acc_t(2);
        int64_t lo = 0, hi = m - 1;
        while (hi - lo + 1 > beta) {
          if (std::abs(v(lo) - med) > std::abs(v(hi) - med)) {
            ++lo;
          } else {
            --hi;
          }
        }
        acc_t sum = 0;
        for (int64_t i = lo; i <= hi; ++i) sum += v(i);
        res[l] = sum / static_cast<acc_t>(beta);
      }
    }
    if (a.out_is_acc) {
      acc_t* o = static_cast<acc_t*>(a.out) + j;
      for (int64_t l = 0; l < w; ++l) o[l] = res[l];
    } else {
      scalar_t* o = static_cast<scalar_t*>(a.out) + j;
      for (int64_t l = 0; l < w; ++l) o[l] = static_cast<scalar_t>(res[l]);
    }
  }
}

template <typename acc_t>
void select_pass(const SelectArgs<acc_t>& a, int64_t b0, int64_t b1) {
  dispatch_kind<acc_t>(a.kind, [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    const int64_t m = a.num_kept;
    Aligned64<acc_t> tile(std::max<int64_t>(m, 1) * kSelectLanes);
    std::unique_ptr<scalar_t[]> staging(a.pieces != nullptr ? new scalar_t[std::max<int64_t>(m, 1) * kSelectStage]
                                                            : nullptr);
    // (no std::vector here: an out-of-line instantiation compiled for this ISA could be
    // the copy the linker keeps for every TU, isa_prologue.h)
    std::unique_ptr<const scalar_t*[]> src(new const scalar_t*[std::max<int64_t>(m, 1)]);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t j0 = b * a.block;
      const int64_t j1 = std::min(a.N, j0 + a.block);
      uint8_t* bad = a.bad + b * m;
      for (int64_t s = j0; s < j1; s += kSelectStage) {
        const int64_t s1 = std::min(j1, s + kSelectStage);
        for (int64_t r = 0; r < m; ++r) {
          src[r] = a.pieces != nullptr
                       ? stage_chunk(*a.pieces, a.ids[r], s, s1 - s, staging.get() + r * kSelectStage)
                       : static_cast<const scalar_t*>(a.rows[r]) + s;
        }
        select_columns<scalar_t, acc_t>(a, src.get(), s, s1, bad, tile.p);
      }
    }
  });
}

}  // namespace
}  // namespace fedopt::cpu::CPU_CAPABILITY
