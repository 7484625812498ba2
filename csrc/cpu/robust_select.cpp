// CPU host side of the robust aggregators' ops (schemas and semantics:
// csrc/registration.cpp; oracle: python_ref/robust.py): fedopt_C::coordinate_select
// (the coordinate-wise median, beta-trimmed mean and Bulyan's closest-to-median mean in
// ONE pass over the kept clients) and fedopt_C::client_gram (the clients' Gram matrix
// in one pass), each also over clients read in place from pieces (the *_pieces ops:
// a Flower reply's per-layer arrays, subtracted from the global model as they are read).
// The kernels are in robust_kernels.h, one build per instruction set (kernels()).
//
// coordinate_select: the columns are cut into blocks of kSelectBlock, a thread owns
// whole blocks; every kept client holding a NaN/Inf is flagged (one flag byte per
// (block, client), OR-ed afterwards): the ops layer then reruns the pass without them
// (a second pass only when some client is non-finite).
//
// client_gram: the columns are cut into chunks of a fixed number of columns (from C
// and N, never from the thread count), one double [C, C] partial per chunk, added here
// in chunk order: deterministic and independent of the thread count.
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "clients_arg.h"
#include "ops_common.h"

namespace fedopt::cpu {
namespace {

using at::Tensor;
using at::TensorList;
using OptTensor = std::optional<Tensor>;

constexpr int64_t kSelectBlock = 4096;  // columns per task (a multiple of the kernel's lanes and stage)
// client_gram: columns per chunk for up to 64 clients; more clients, proportionally more
// columns (the partials stay below ~2 bytes per column).  A multiple of the kernel's block.
constexpr int64_t kGramChunk = int64_t(1) << 14;

Tensor coordinate_select_checked(const char* op, const Clients& cl, const PieceTable* pieces, const Tensor& keep,
                                 const Tensor& count, int64_t mode, const Tensor& out, const OptTensor& skip) {
  const int64_t C = cl.C, N = cl.N;
  const at::ScalarType dtype = cl.dtype;
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
  const int64_t count_v = *count.const_data_ptr<int64_t>();
  TORCH_CHECK(count_v >= 0, op, ": count must be >= 0, got ", count_v);
  const Tensor keep_c = keep.contiguous();
  const bool* kp = keep_c.const_data_ptr<bool>();
  std::vector<const void*> rows;
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < C; ++i) {
    if (kp[i]) {
      rows.push_back(pieces != nullptr ? nullptr : cl.rows[i]);
      ids.push_back(i);
    }
  }
  const int64_t m = static_cast<int64_t>(ids.size());
  const int64_t blocks = (N + kSelectBlock - 1) / kSelectBlock;
  std::vector<uint8_t> bad(blocks * m, 0);
  auto run = [&](auto acc_zero) {
    using acc_t = decltype(acc_zero);
    SelectArgs<acc_t> a;
    a.kind = scalar_kind(dtype);
    a.num_kept = m;
    a.rows = rows.data();
    a.ids = ids.data();
    a.pieces = pieces;
    a.N = N;
    a.block = kSelectBlock;
    a.count = count_v;
    a.mode = static_cast<int>(mode);
    a.out = out.data_ptr();
    a.out_is_acc = out.scalar_type() == acc && dtype != acc;
    a.bad = bad.data();
    const Kernels<acc_t>& k = kernels().get<acc_t>();
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) { k.select(a, b0, b1); });
  };
  if (acc == at::kDouble) {
    run(double(0));
  } else {
    run(float(0));
  }
  bool* fp = flags.data_ptr<bool>();
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t r = 0; r < m; ++r) fp[ids[r]] = fp[ids[r]] || bad[b * m + r];
  }
  return flags;
}

Tensor coordinate_select_cpu(TensorList clients, const Tensor& keep, const Tensor& count, int64_t mode,
                             const Tensor& out, const OptTensor& skip) {
  const char* op = "fedopt_C::coordinate_select";
  const Clients cl = unpack_clients(clients, op);
  return coordinate_select_checked(op, cl, nullptr, keep, count, mode, out, skip);
}

Tensor coordinate_select_pieces_cpu(TensorList pieces, int64_t pieces_per_client, const OptTensor& subtract_from,
                                    const Tensor& keep, const Tensor& count, int64_t mode, const Tensor& out,
                                    const OptTensor& skip) {
  const char* op = "fedopt_C::coordinate_select_pieces";
  const Pieces p = unpack_pieces(op, pieces, pieces_per_client, subtract_from);
  return coordinate_select_checked(op, p.cl, &p.table, keep, count, mode, out, skip);
}

Tensor client_gram_checked(const Clients& cl, const PieceTable* pieces, bool float64_products) {
  const int64_t K = cl.C, N = cl.N;
  const int64_t scale = std::max<int64_t>(1, (K * K + 4095) / 4096);
  const int64_t chunk = kGramChunk * scale;
  const int64_t nc = (N + chunk - 1) / chunk;
  std::vector<double> partials(std::max<int64_t>(nc, 1) * K * K, 0.0);
  auto run = [&](auto acc_zero) {
    using acc_t = decltype(acc_zero);
    GramArgs<acc_t> a;
    a.kind = scalar_kind(cl.dtype);
    a.num_rows = K;
    a.rows = cl.rows.data();
    a.pieces = pieces;
    a.N = N;
    a.chunk = chunk;
    a.float64_products = float64_products;
    a.partials = partials.data();
    const Kernels<acc_t>& k = kernels().get<acc_t>();
    at::parallel_for(0, nc, 1, [&](int64_t c0, int64_t c1) { k.gram(a, c0, c1); });
  };
  if (acc_type(cl.dtype) == at::kDouble) {
    run(double(0));
  } else {
    run(float(0));
  }
  Tensor G = at::empty({K, K}, at::TensorOptions().dtype(at::kDouble));
  double* g = G.data_ptr<double>();
  for (int64_t i = 0; i < K; ++i) {
    for (int64_t j = i; j < K; ++j) {
      double s = 0;
      for (int64_t c = 0; c < nc; ++c) s += partials[c * K * K + i * K + j];
      g[i * K + j] = s;
      g[j * K + i] = s;
    }
  }
  return G;
}

Tensor client_gram_cpu(TensorList clients, bool float64_products) {
  return client_gram_checked(unpack_clients(clients, "fedopt_C::client_gram"), nullptr, float64_products);
}

Tensor client_gram_pieces_cpu(TensorList pieces, int64_t pieces_per_client, const OptTensor& subtract_from,
                              bool float64_products) {
  const Pieces p = unpack_pieces("fedopt_C::client_gram_pieces", pieces, pieces_per_client, subtract_from);
  return client_gram_checked(p.cl, &p.table, float64_products);
}

}  // namespace
}  // namespace fedopt::cpu

TORCH_LIBRARY_IMPL(fedopt_C, CPU, m) {
  m.impl("coordinate_select", &fedopt::cpu::coordinate_select_cpu);
  m.impl("coordinate_select_pieces", &fedopt::cpu::coordinate_select_pieces_cpu);
  m.impl("client_gram", &fedopt::cpu::client_gram_cpu);
  m.impl("client_gram_pieces", &fedopt::cpu::client_gram_pieces_cpu);
}
