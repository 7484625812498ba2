// CPU kernel of fedopt_C::coordinate_select: the coordinate-wise median, beta-trimmed
// mean and Bulyan's closest-to-median mean in ONE pass over the kept clients
// (schema and semantics: csrc/registration.cpp; oracle: python_ref/robust.py).
//
// The columns are cut into blocks of kSelectBlock; a thread owns whole blocks.  Inside
// a block it takes kLanes columns at a time: it loads the m kept clients' values of
// those columns into a [m][kLanes] tile (acc dtype), orders every lane with lane-wise
// min/max compare-exchanges (branch-free, vectorised across the lanes: an odd-even
// transposition sort, or for a small trim only k bubble passes each way), then
// reduces each lane:
//
//   mode 0 (trim):    k = min(count, (m - 1) / 2);  out = sum(v[k .. m-k)) / (m - 2k)
//                     (the median is k = (m - 1) / 2: the middle value or the mean of
//                     the two middle ones)
//   mode 1 (closest): beta = clamp(count, 1, m); med = median(v); the window of beta
//                     sorted values closest to med, found by dropping the farther end
//                     (the upper one on a tie) until beta are left; out = its mean.
//
// Sums run over the rows [k, m-k) in row order: deterministic, independent of the
// thread count.  The same pass flags every kept client holding a NaN/Inf (one flag
// byte per (block, client), OR-ed afterwards): the ops layer then reruns the pass
// without them (a second pass only when some client is non-finite).
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "ops_common.h"

namespace fedopt::cpu {
namespace {

using at::Tensor;
using at::TensorList;
using OptTensor = std::optional<Tensor>;

constexpr int64_t kLanes = 16;
constexpr int64_t kSelectBlock = 4096;  // columns per task (a multiple of kLanes)

// GCC/Clang vector extensions: a 16-byte vector of the acc dtype (SSE2 on x86-64, NEON on
// aarch64; the baseline every build has, so no per-ISA build of this file).  The
// compare-exchanges are written on them because the scalar lane loop was left to the
// SLP vectoriser, which vectorised only part of it.
template <typename acc_t>
struct Vec16 {
  typedef acc_t type __attribute__((vector_size(16)));
};
template <typename acc_t>
constexpr int64_t kVecsPerRow = kLanes * static_cast<int64_t>(sizeof(acc_t)) / 16;

template <typename acc_t>
struct SelectArgs {
  std::vector<const void*> rows;  // the kept clients' rows, in client order
  std::vector<int64_t> ids;       // their client indices
  int64_t N = 0;
  int64_t count = 0;
  int mode = 0;
  void* out = nullptr;
  bool out_is_acc = false;
  uint8_t* bad = nullptr;  // [blocks][m]
};

template <typename scalar_t, typename acc_t>
void select_block(const SelectArgs<acc_t>& a, int64_t blk, acc_t* tile) {
  const int64_t m = static_cast<int64_t>(a.rows.size());
  const int64_t j0 = blk * kSelectBlock;
  const int64_t j1 = std::min(a.N, j0 + kSelectBlock);
  uint8_t* bad = a.bad + blk * m;
  const acc_t big = std::numeric_limits<acc_t>::max();
  for (int64_t j = j0; j < j1; j += kLanes) {
    const int64_t w = std::min(kLanes, j1 - j);
    for (int64_t i = 0; i < m; ++i) {
      const scalar_t* row = static_cast<const scalar_t*>(a.rows[i]) + j;
      acc_t* t = tile + i * kLanes;
      bool finite = true;
      if (w == kLanes) {
        for (int64_t l = 0; l < kLanes; ++l) {
          t[l] = static_cast<acc_t>(row[l]);
          finite &= std::abs(t[l]) <= big;  // false for NaN and +-Inf
        }
      } else {
        for (int64_t l = 0; l < kLanes; ++l) {
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
    auto cmpx = [&](int64_t i) {  // lanes of rows i and i + 1 into (min, max), 16 bytes at a time
      using V = typename Vec16<acc_t>::type;
      V* lo = reinterpret_cast<V*>(tile + i * kLanes);
      V* hi = lo + kVecsPerRow<acc_t>;
      for (int64_t q = 0; q < kVecsPerRow<acc_t>; ++q) {
        const V x = lo[q], y = hi[q];
        const auto less = y < x;
        lo[q] = less ? y : x;
        hi[q] = less ? x : y;
      }
    };
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
    acc_t res[kLanes];
    if (m == 0) {
      for (int64_t l = 0; l < kLanes; ++l) res[l] = 0;
    } else if (a.mode == 0) {
      const int64_t k = std::min(a.count, (m - 1) / 2);
      for (int64_t l = 0; l < kLanes; ++l) res[l] = 0;
      for (int64_t i = k; i < m - k; ++i) {
        const acc_t* t = tile + i * kLanes;
        for (int64_t l = 0; l < kLanes; ++l) res[l] += t[l];
      }
      const acc_t n = static_cast<acc_t>(m - 2 * k);
      for (int64_t l = 0; l < kLanes; ++l) res[l] /= n;
    } else {
      const int64_t beta = std::max<int64_t>(1, std::min(a.count, m));
      for (int64_t l = 0; l < kLanes; ++l) {
        auto v = [&](int64_t i) { return tile[i * kLanes + l]; };
        const acc_t med = m % 2 ? v((m - 1) / 2) : (v(m / 2 - 1) + v(m / 2)) / acc_t(2);
        int64_t lo = 0, hi = m - 1;
        while (hi - lo + 1 > beta) {
          if (std::abs(v(lo) - med) > std::abs(v(hi) - med)) {
            ++lo;
          } else {
            --hi;
          }
        }
        acc_t s = 0;
        for (int64_t i = lo; i <= hi; ++i) s += v(i);
        res[l] = s / static_cast<acc_t>(beta);
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

template <typename scalar_t, typename acc_t>
void run_select(SelectArgs<acc_t>& a, int64_t blocks) {
  const int64_t m = static_cast<int64_t>(a.rows.size());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<acc_t> tile(std::max<int64_t>(m, 1) * kLanes);  // malloc: 16-byte aligned (Vec16)
    for (int64_t b = b0; b < b1; ++b) select_block<scalar_t, acc_t>(a, b, tile.data());
  });
}

Tensor coordinate_select_cpu(TensorList clients, const Tensor& keep, const Tensor& count, int64_t mode,
                             const Tensor& out, const OptTensor& skip) {
  const char* op = "fedopt_C::coordinate_select";
  TORCH_CHECK(!clients.empty(), op, ": clients must hold one [C, N] tensor or C 1-D tensors");
  const at::ScalarType dtype = clients[0].scalar_type();
  check_supported_float(op, "clients", dtype);
  std::vector<const void*> rows;
  int64_t C = 0, N = 0;
  if (clients.size() == 1 && clients[0].dim() == 2) {
    const Tensor& X = clients[0];
    check_flat(X, dtype, "clients");
    TORCH_CHECK(X.is_contiguous(), op, ": clients as a [C, N] tensor must be contiguous");
    C = X.size(0);
    N = X.size(1);
    const char* base = static_cast<const char*>(X.const_data_ptr());
    for (int64_t i = 0; i < C; ++i) rows.push_back(base + i * N * X.element_size());
  } else {
    C = static_cast<int64_t>(clients.size());
    N = clients[0].numel();
    for (const Tensor& t : clients) {
      TORCH_CHECK(t.dim() == 1, op, ": clients given as a list must be 1-D tensors, got ", t.sizes());
      check_flat(t, dtype, "clients");
      TORCH_CHECK(t.numel() == N, op, ": clients must all have ", N, " elements, got ", t.numel());
      rows.push_back(t.const_data_ptr());
    }
  }
  TORCH_CHECK(keep.device().is_cpu() && keep.scalar_type() == at::kBool && keep.numel() == C, op,
              ": keep must be a CPU bool tensor of ", C, " elements");
  TORCH_CHECK(count.device().is_cpu() && count.scalar_type() == at::kLong && count.numel() == 1, op,
              ": count must be a one-element CPU int64 tensor");
  TORCH_CHECK(mode == 0 || mode == 1, op, ": mode must be 0 (trim) or 1 (closest to the median), got ", mode);
  const at::ScalarType acc = acc_type(dtype);
  TORCH_CHECK(out.scalar_type() == dtype || out.scalar_type() == acc, op, ": out must have dtype ", dtype, " or ",
              acc, ", got ", out.scalar_type());
  check_flat(out, out.scalar_type(), "out");
  TORCH_CHECK(out.numel() == N, op, ": out must have ", N, " elements, got ", out.numel());
  Tensor flags = at::zeros({C}, at::TensorOptions().dtype(at::kBool));
  if (skip.has_value()) {
    TORCH_CHECK(skip->numel() == 1 && skip->device().is_cpu(), op, ": skip must be a one-element CPU tensor");
    if (skip->item<bool>()) return flags;
  }
  const Tensor keep_c = keep.contiguous();
  const bool* kp = keep_c.const_data_ptr<bool>();
  const int64_t blocks = (N + kSelectBlock - 1) / kSelectBlock;
  auto dispatch = [&](auto acc_zero) {
    using acc_t = decltype(acc_zero);
    SelectArgs<acc_t> a;
    for (int64_t i = 0; i < C; ++i) {
      if (kp[i]) {
        a.rows.push_back(rows[i]);
        a.ids.push_back(i);
      }
    }
    const int64_t m = static_cast<int64_t>(a.rows.size());
    std::vector<uint8_t> bad(blocks * m, 0);
    a.N = N;
    a.count = *count.const_data_ptr<int64_t>();
    TORCH_CHECK(a.count >= 0, op, ": count must be >= 0, got ", a.count);
    a.mode = static_cast<int>(mode);
    a.out = out.data_ptr();
    a.out_is_acc = out.scalar_type() == acc && dtype != acc;
    a.bad = bad.data();
    switch (dtype) {
      case at::kFloat: run_select<float, acc_t>(a, blocks); break;
      case at::kDouble: run_select<double, acc_t>(a, blocks); break;
      case at::kHalf: run_select<c10::Half, acc_t>(a, blocks); break;
      default: run_select<c10::BFloat16, acc_t>(a, blocks); break;
    }
    bool* fp = flags.data_ptr<bool>();
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t i = 0; i < m; ++i) fp[a.ids[i]] = fp[a.ids[i]] || bad[b * m + i];
    }
  };
  if (acc == at::kDouble) {
    dispatch(double(0));
  } else {
    dispatch(float(0));
  }
  return flags;
}

}  // namespace
}  // namespace fedopt::cpu

TORCH_LIBRARY_IMPL(fedopt_C, CPU, m) { m.impl("coordinate_select", &fedopt::cpu::coordinate_select_cpu); }
