// Batched matrix products over clients whose batches have different lengths.
//
// The batched simulation engine pads every client's batch to one length B, so that a
// round's clients train as one [C, B, ...] computation; its matrix products then
// spend half their arithmetic on padding (digits: 14 real samples of 32 on average).
// ragged_bmm computes only the real part: client i's product uses the first
// lengths[i] rows of the sample dimension, which is one of
//   dim 1: the rows of a and of the result  (forward and input-gradient products),
//   dim 2: the contraction                  (weight-gradient products),
//   dim 3: the columns of b and of the result.
// For dims 1 and 3 the padded rows (columns) of the result are zeros (`zero_fill`,
// where the padded rows of the sample-dimension operand are zeros: gradients) or
// copies of row (column) 0 (where they are copies of the client's first sample: the
// forward pass).  Either way the result equals torch.bmm of the padded operands in
// value, element for element, up to the rounding of a different kernel.
//
// Each client's product is one BLAS GEMM of its own shape (sgemm_/dgemm_, which
// torch's CPU build links in and exports), run single-threaded (MKL's
// MKL_Set_Num_Threads_Local), the clients spread over torch's threads.  So a client's
// bits depend on its own shape and data alone -- never on which clients share the
// call, how many there are, how many threads run or where its operands lie: the
// batched engine promises that grouping never changes a client's arithmetic.  Where its
// operands lie is MKL's business twice over: fedopt_kernels sets MKL's strict
// reproducibility mode at import (fedopt_kernels/backends/mkl.py; without it MKL's
// kernels on Intel's AVX2/AVX-512 paths and on AMD peel to alignment), and skinny
// products also run on aligned, row-major copies (canonical_gemm), because strict mode
// does not make a skinny product's bits independent of its operands' storage order.
// (MKL's grouped GEMM, cblas_sgemm_batch, was slower here -- 782 against 647 us for the 8 products of an
// MLP step of 20 digits clients, 2 threads -- and splits the work of unequal groups
// among its threads, so a client's bits there follow its neighbours.)
// With another BLAS (OpenBLAS on some platforms) there is no per-thread count to set:
// each GEMM runs as that library threads it.  Its bits should still be the client's
// own as long as it splits rows and columns but not the contraction -- not checked
// here, where only MKL was measured.
// The BLAS symbols are declared weak: a torch without them (built without a BLAS)
// leaves them null, and the op then loops at::mm per client -- correct, but slower
// than the padded bmm, so callers ask ragged_bmm_blas() before choosing this op.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops_common.h"

extern "C" {
// Fortran BLAS (column-major; the hidden string-length arguments are not read by the
// BLAS libraries torch links, as torch's own declarations assume) and MKL's
// per-thread thread count.
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc) __attribute__((weak));
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc) __attribute__((weak));
// (MKL's header maps mkl_set_num_threads_local to this C entry point; the lower-case
// symbol itself is the Fortran one, which takes a pointer.)
int MKL_Set_Num_Threads_Local(int nt) __attribute__((weak));
}

namespace fedopt::cpu {
namespace {

bool blas_for(at::ScalarType t) {
  if (t == at::kFloat) return sgemm_ != nullptr;
  if (t == at::kDouble) return dgemm_ != nullptr;
  return false;
}

// One [C, R, S] operand as C row-major R x S matrices for BLAS: as stored ('N') with
// leading dimension stride(1) when its rows are contiguous, transposed ('T': the
// storage of its transpose) with stride(2) when its columns are; anything else is
// copied.  The batch stride is free, so transposed and expanded views need no copy.
struct BlasOperand {
  at::Tensor t;
  char trans;
  int64_t ld;
};

BlasOperand blas_operand(const at::Tensor& x) {
  const int64_t R = x.size(1), S = x.size(2);
  if (x.stride(2) == 1 && x.stride(1) >= std::max<int64_t>(S, 1)) return {x, 'N', x.stride(1)};
  if (x.stride(1) == 1 && x.stride(2) >= std::max<int64_t>(R, 1)) return {x, 'T', x.stride(2)};
  at::Tensor c = x.contiguous();
  return {c, 'N', std::max<int64_t>(S, 1)};
}

// The (m, n, k) of client i's product for a sample dimension `dim` of length L.
struct Dims {
  int64_t m, n, k;
};
inline Dims client_dims(int64_t dim, int64_t L, int64_t M, int64_t N, int64_t K) {
  return {dim == 1 ? L : M, dim == 3 ? L : N, dim == 2 ? L : K};
}

// Row-major out[m x n] = A[m x k] B[k x n] is column-major out^T = B^T A^T: the
// operands swap, each keeping its own transpose flag.
template <typename T>
void gemm_row_major(const BlasOperand& A, const BlasOperand& B, const T* a, const T* b, T* c, const Dims& d,
                    int64_t ldc) {
  const int m = static_cast<int>(d.n), n = static_cast<int>(d.m), k = static_cast<int>(d.k);
  const int lda = static_cast<int>(B.ld), ldb = static_cast<int>(A.ld), ldcc = static_cast<int>(ldc);
  const T one = 1, zero = 0;
  if constexpr (std::is_same_v<T, float>) {
    sgemm_(&B.trans, &A.trans, &m, &n, &k, &one, b, &lda, a, &ldb, &zero, c, &ldcc);
  } else {
    dgemm_(&B.trans, &A.trans, &m, &n, &k, &one, b, &lda, a, &ldb, &zero, c, &ldcc);
  }
}

// MKL's kernels for skinny products -- fewer than 4 rows or 12 columns of the result,
// measured for m in 1..17, n in 1..200 and k in 3..256 on AVX-512 (AMD EPYC), where every
// such product with k >= 9 was affected and no wider one was -- give bits that
// depend on where the operands and the result lie in memory when MKL's strict mode is
// off: they vectorise along the contraction and peel to alignment.  A client's rows of
// the engine's buffers lie at offsets that change with its place in a group (row stride
// N, not a multiple of 16), so there a client's bits would follow its neighbours.  Such
// products run on canonical copies instead: each operand row-major in a 64-byte aligned
// scratch with leading dimensions rounded up to 16 elements, the result likewise, then
// copied out.  They are small (one side under 4 or 12), so the copies are too.
// Strict mode alone fixes the alignment (measured on the AMD EPYC: one bit pattern over
// 16 offsets for 512 of 512 shapes) but not the storage order: 132 of the 176 skinny
// shapes of that sweep (none of the 80 wider ones) give other bits with an operand
// transposed.  The copies give both, with strict mode or without it.
inline bool skinny(const Dims& d) { return d.m < 4 || d.n < 12; }

inline int64_t padded_ld(int64_t n) { return (n + 15) / 16 * 16; }

template <typename T>
T* aligned_scratch(std::vector<T>& buffer, int64_t elements) {
  buffer.resize(static_cast<size_t>(elements) + 64 / sizeof(T));
  const auto address = reinterpret_cast<std::uintptr_t>(buffer.data());
  return reinterpret_cast<T*>((address + 63) / 64 * 64);
}

// rows x cols of an operand stored as described by `op` (its 'N'/'T' flag and leading
// dimension), from `src`, into row-major `dst` with leading dimension `ld`.
template <typename T>
void copy_rows(const BlasOperand& op, const T* src, int64_t rows, int64_t cols, T* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    T* d = dst + r * ld;
    if (op.trans == 'N') {
      std::copy(src + r * op.ld, src + r * op.ld + cols, d);
    } else {
      for (int64_t c = 0; c < cols; ++c) d[c] = src[c * op.ld + r];
    }
  }
}

template <typename T>
void canonical_gemm(const BlasOperand& A, const BlasOperand& B, const T* a, const T* b, T* c, const Dims& d,
                    int64_t ldc) {
  thread_local std::vector<T> scratch;
  const int64_t lda = padded_ld(d.k), ldb = padded_ld(d.n), ldo = padded_ld(d.n);
  T* sa = aligned_scratch(scratch, d.m * lda + d.k * ldb + d.m * ldo + 32);
  T* sb = sa + padded_ld(d.m * lda);
  T* so = sb + padded_ld(d.k * ldb);
  copy_rows(A, a, d.m, d.k, sa, lda);
  copy_rows(B, b, d.k, d.n, sb, ldb);
  const BlasOperand ca{at::Tensor(), 'N', lda}, cb{at::Tensor(), 'N', ldb};
  gemm_row_major<T>(ca, cb, sa, sb, so, d, ldo);
  for (int64_t r = 0; r < d.m; ++r) std::copy(so + r * ldo, so + r * ldo + d.n, c + r * ldc);
}

template <typename T>
void blas_products(const BlasOperand& A, const BlasOperand& B, at::Tensor& out, const int64_t* L, int64_t dim) {
  const int64_t C = out.size(0), M = out.size(1), N = out.size(2), K = A.t.size(2);
  const T* a0 = A.t.const_data_ptr<T>();
  const T* b0 = B.t.const_data_ptr<T>();
  T* c0 = out.data_ptr<T>();
  // Contiguous runs of clients of about equal arithmetic, one per thread (clients'
  // batches differ up to 10x: an even split by count leaves a thread idle).  Which
  // thread computes a client never changes its bits.
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), C));
  std::vector<int64_t> work(C + 1, 0);
  for (int64_t i = 0; i < C; ++i) {
    const Dims d = client_dims(dim, L[i], M, N, K);
    work[i + 1] = work[i] + d.m * d.n * d.k;
  }
  std::vector<int64_t> first(threads + 1, C);
  first[0] = 0;
  for (int64_t t = 1, i = 0; t < threads; ++t) {
    while (i < C && work[i] * threads < work[C] * t) ++i;
    first[t] = i;
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    // one thread per GEMM, whether or not this runs inside a parallel region
    const int previous = MKL_Set_Num_Threads_Local ? MKL_Set_Num_Threads_Local(1) : 0;
    for (int64_t i = first[begin]; i < first[end]; ++i) {
      const Dims d = client_dims(dim, L[i], M, N, K);
      if (d.m == 0 || d.n == 0 || d.k == 0) continue;  // zeros: fill_padding
      const T* a = a0 + i * A.t.stride(0);
      const T* b = b0 + i * B.t.stride(0);
      if (skinny(d)) {
        canonical_gemm<T>(A, B, a, b, c0 + i * out.stride(0), d, out.stride(1));
      } else {
        gemm_row_major<T>(A, B, a, b, c0 + i * out.stride(0), d, out.stride(1));
      }
    }
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(previous);
  });
}

// What the products did not write: a client whose product is empty (no real samples,
// or K = 0) is all zeros; the padded rows (dim 1) or columns (dim 3) of the others are
// zeros or copies of row (column) 0.
template <typename T>
void fill_padding(at::Tensor& out, const int64_t* L, int64_t K, int64_t dim, bool zero_fill) {
  const int64_t C = out.size(0), M = out.size(1), N = out.size(2), batch = out.stride(0), ld = out.stride(1);
  T* base = out.data_ptr<T>();
  at::parallel_for(0, C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T* o = base + i * batch;
      const Dims d = client_dims(dim, L[i], M, N, K);
      const bool empty = d.m == 0 || d.n == 0 || d.k == 0;
      if (!empty && dim == 2) continue;
      for (int64_t r = 0; r < M; ++r) {
        T* row = o + r * ld;
        if (empty) {
          std::fill(row, row + N, T(0));
        } else if (dim == 1 && r >= L[i]) {
          if (zero_fill) std::fill(row, row + N, T(0));
          else std::copy(o, o + N, row);
        } else if (dim == 3) {
          std::fill(row + L[i], row + N, zero_fill ? T(0) : row[0]);
        }
      }
    }
  });
}

at::Tensor& ragged_bmm_out_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& lengths, int64_t dim,
                               bool zero_fill, bool use_blas, at::Tensor& out) {
  constexpr const char* op = "fedopt_C: ragged_bmm: ";
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3, op, "a and b must be 3-D [C, M, K] and [C, K, N], got ", a.sizes(),
              " and ", b.sizes());
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu() && lengths.device().is_cpu(), op,
              "a, b and lengths must be CPU tensors");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), op, "a and b must have one dtype, got ", a.scalar_type(), " and ",
              b.scalar_type());
  TORCH_CHECK(a.size(0) == b.size(0) && a.size(2) == b.size(1), op, "shapes ", a.sizes(), " and ", b.sizes(),
              " cannot be multiplied batch by batch");
  TORCH_CHECK(dim >= 1 && dim <= 3, op, "dim must be 1 (rows), 2 (contraction) or 3 (columns), got ", dim);
  const int64_t C = a.size(0), M = a.size(1), K = a.size(2), N = b.size(2);
  const int64_t full = dim == 1 ? M : dim == 2 ? K : N;
  const at::Tensor Lt = checked_lengths(lengths, C, full, op);
  const int64_t* L = Lt.const_data_ptr<int64_t>();
  // `out` may be a strided view (the engine's gradient buffer): rows contiguous, the
  // clients' matrices apart
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == a.scalar_type() && out.dim() == 3 &&
                  out.size(0) == C && out.size(1) == M && out.size(2) == N,
              op, "out must be a CPU ", a.scalar_type(), " tensor of shape [", C, ", ", M, ", ", N, "], got ",
              out.scalar_type(), " ", out.sizes(), " on ", out.device());
  if (out.numel() == 0) return out;
  TORCH_CHECK((out.stride(2) == 1 || N == 1) && (out.stride(1) >= N || M == 1) &&
                  (out.stride(0) >= (M - 1) * out.stride(1) + N || C == 1),
              op, "out must have contiguous, non-overlapping rows and matrices, got strides ", out.strides());

  const bool fits_int =
      std::max({M, N, K, a.stride(1), a.stride(2), b.stride(1), b.stride(2), out.stride(1)}) < INT_MAX;
  if (use_blas && blas_for(a.scalar_type()) && fits_int) {
    const BlasOperand A = blas_operand(a), B = blas_operand(b);
    if (a.scalar_type() == at::kFloat) {
      blas_products<float>(A, B, out, L, dim);
    } else {
      blas_products<double>(A, B, out, L, dim);
    }
  } else {  // no BLAS here: one at::mm per client, on the same slices
    for (int64_t i = 0; i < C; ++i) {
      const Dims d = client_dims(dim, L[i], M, N, K);
      if (d.m == 0 || d.n == 0 || d.k == 0) continue;
      at::Tensor ai = a[i], bi = b[i], oi = out[i];
      if (dim == 1) {
        ai = ai.narrow(0, 0, L[i]);
        oi = oi.narrow(0, 0, L[i]);
      } else if (dim == 2) {
        ai = ai.narrow(1, 0, L[i]);
        bi = bi.narrow(0, 0, L[i]);
      } else {
        bi = bi.narrow(1, 0, L[i]);
        oi = oi.narrow(1, 0, L[i]);
      }
      oi.copy_(at::mm(ai, bi));
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "ragged_bmm_fill", [&] {
    fill_padding<scalar_t>(out, L, K, dim, zero_fill);
  });
  return out;
}

at::Tensor ragged_bmm_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& lengths, int64_t dim,
                          bool zero_fill, bool use_blas) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3, "fedopt_C: ragged_bmm: a and b must be 3-D [C, M, K] and [C, K, N], got ",
              a.sizes(), " and ", b.sizes());
  at::Tensor out = at::empty({a.size(0), a.size(1), b.size(2)}, a.options());
  return ragged_bmm_out_cpu(a, b, lengths, dim, zero_fill, use_blas, out);
}

}  // namespace
}  // namespace fedopt::cpu

// An addition to the namespace (no existing schema changes).  ragged_bmm(a [C, M, K],
// b [C, K, N], lengths [C] int64, dim, zero_fill, use_blas) -> [C, M, N]: see the top
// of this file; the .out overload writes into `out`, which may be a strided view with
// contiguous rows (the engine's gradient buffer).  use_blas=False forces the
// per-client at::mm loop (tests);
// ragged_bmm_blas(dtype): whether the BLAS path serves dtype.
TORCH_LIBRARY_FRAGMENT(fedopt_C, m) {
  m.def("ragged_bmm(Tensor a, Tensor b, Tensor lengths, int dim, bool zero_fill, bool use_blas=True) -> Tensor");
  m.def(
      "ragged_bmm.out(Tensor a, Tensor b, Tensor lengths, int dim, bool zero_fill, bool use_blas=True, *, "
      "Tensor(a!) out) -> Tensor(a!)");
  m.def("ragged_bmm_blas(ScalarType dtype) -> bool", [](c10::ScalarType t) { return fedopt::cpu::blas_for(t); });
}

TORCH_LIBRARY_IMPL(fedopt_C, CPU, m) {
  m.impl("ragged_bmm", &fedopt::cpu::ragged_bmm_cpu);
  m.impl("ragged_bmm.out", &fedopt::cpu::ragged_bmm_out_cpu);
}
