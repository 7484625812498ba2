// CPU kernels of fedopt_C::aggregate and fedopt_C::client_dots (schemas and semantics:
// csrc/registration.cpp; oracle: python_ref/aggregation.py).
//
// Both make ONE pass over the clients: the columns [0, N) are cut into chunks
// (chunks.h), threads take consecutive chunks, and inside a chunk every client is read
// once (kernels.h).  Per chunk the kernels leave one partial per client (and one for
// ||sum||^2), which are added here in chunk order: the results do not depend on the
// thread count.
#include <tuple>
#include <vector>

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "ops_common.h"

namespace fedopt::cpu {
namespace {

using at::Tensor;
using at::TensorList;
using OptTensor = std::optional<Tensor>;

// `clients` as row pointers: C 1-D tensors of length N, or one contiguous [C, N].
struct Clients {
  at::ScalarType dtype;
  int64_t C = 0, N = 0;
  std::vector<const void*> rows;
};

// Runs fn(c0, c1) over the column chunks [0, nc) of a [C, N] pass, in parallel: at most
// one range per thread, each of at least kMinElementsPerThread elements, with equal
// numbers of COLUMNS (to within a chunk).  at::parallel_for's equal numbers of chunks
// would leave a small model's ragged last chunk to one thread: with 16 Ki-column chunks
// a 90.5K-parameter model was split 49152 / 41354.  The partials are per chunk, so the
// split changes no result.
template <typename F>
void parallel_over_columns(int64_t C, int64_t N, int64_t nc, const F& fn) {
  const int64_t per_chunk = std::max<int64_t>(C, 1) * kAggChunk;
  const int64_t min_chunks = std::max<int64_t>(1, (kMinElementsPerThread + per_chunk - 1) / per_chunk);
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (nc + min_chunks - 1) / min_chunks));
  // First chunk of range t: the chunk nearest to column t * N / T.
  auto first = [&](int64_t t) {
    return t == T ? nc : std::min(nc, (t * N / T + kAggChunk / 2) / kAggChunk);
  };
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) fn(first(t), first(t + 1));
  });
}

Clients unpack_clients(TensorList clients, const char* op) {
  TORCH_CHECK(!clients.empty(), "fedopt_C: clients must hold one [C, N] tensor or C 1-D tensors");
  Clients r;
  r.dtype = clients[0].scalar_type();
  check_supported_float(op, "clients", r.dtype);
  if (clients.size() == 1 && clients[0].dim() == 2) {
    const Tensor& X = clients[0];
    check_flat(X, r.dtype, "clients");
    TORCH_CHECK(X.is_contiguous(), "fedopt_C: clients as a [C, N] tensor must be contiguous");
    r.C = X.size(0);
    r.N = X.size(1);
    const char* base = static_cast<const char*>(X.const_data_ptr());
    for (int64_t i = 0; i < r.C; ++i) r.rows.push_back(base + i * r.N * X.element_size());
  } else {
    r.C = static_cast<int64_t>(clients.size());
    r.N = clients[0].numel();
    for (const Tensor& t : clients) {
      TORCH_CHECK(t.dim() == 1, "fedopt_C: clients given as a list must be 1-D tensors, got ", t.sizes());
      check_flat(t, r.dtype, "clients");
      TORCH_CHECK(t.numel() == r.N, "fedopt_C: clients must all have ", r.N, " elements, got ", t.numel());
      r.rows.push_back(t.const_data_ptr());
    }
  }
  return r;
}

// A [N] tensor the kernels read or write: the clients' dtype or the acc dtype.
bool check_vector(const Tensor& t, const Clients& cl, const char* what) {
  const at::ScalarType acc = acc_type(cl.dtype);
  TORCH_CHECK(t.scalar_type() == cl.dtype || t.scalar_type() == acc, "fedopt_C: ", what, " must have dtype ",
              cl.dtype, " or ", acc, ", got ", t.scalar_type());
  check_flat(t, t.scalar_type(), what);
  TORCH_CHECK(t.numel() == cl.N, "fedopt_C: ", what, " must have ", cl.N, " elements, got ", t.numel());
  return t.scalar_type() == acc;
}

template <typename acc_t>
std::tuple<Tensor, Tensor> run_aggregate(const Clients& cl, const Tensor& weights, acc_t gamma, const Tensor& out,
                                         bool out_is_acc, const PieceTable* pieces = nullptr) {
  const int64_t C = cl.C;
  const ChunkTable table = build_chunk_table({cl.N}, {0}, 1, kAggChunk);
  const int64_t nc = static_cast<int64_t>(table.chunks.size());
  std::vector<acc_t> client_partials(nc * C), sum_partials(nc);
  const Tensor w = weights.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();

  AggregateArgs<acc_t> args;
  args.kind = scalar_kind(cl.dtype);
  args.out_is_acc = out_is_acc;
  args.num_clients = C;
  args.clients = cl.rows.data();
  args.pieces = pieces;
  args.weights = w.const_data_ptr<acc_t>();
  args.gamma = gamma;
  args.out = out.data_ptr();
  args.chunks = table.chunks.data();
  args.client_partials = client_partials.data();
  args.sum_partials = sum_partials.data();
  const Kernels<acc_t>& k = kernels().get<acc_t>();
  parallel_over_columns(C, cl.N, nc, [&](int64_t c0, int64_t c1) { k.aggregate(args, c0, c1); });

  const auto acc = at::TensorOptions().dtype(c10::CppTypeToScalarType<acc_t>::value);
  Tensor q = at::empty({C}, acc);
  Tensor Q = at::empty({}, acc);
  acc_t* qp = q.data_ptr<acc_t>();
  for (int64_t i = 0; i < C; ++i) {
    acc_t s = 0;
    for (int64_t c = 0; c < nc; ++c) s += client_partials[c * C + i];
    qp[i] = s;
  }
  acc_t s = 0;
  for (int64_t c = 0; c < nc; ++c) s += sum_partials[c];
  *Q.data_ptr<acc_t>() = s;
  return {q, Q};
}

// The checks and the skip convention both forms of aggregate share, then the pass.
std::tuple<Tensor, Tensor> aggregate_checked(const char* op, const Clients& cl, const Tensor& weights, double gamma,
                                             const OptTensor& gamma_tensor, const Tensor& out, const OptTensor& skip,
                                             const PieceTable* pieces) {
  const at::ScalarType acc = acc_type(cl.dtype);
  TORCH_CHECK(weights.device().is_cpu() && weights.numel() == cl.C, op, ": weights must be a CPU tensor of ", cl.C,
              " elements, got ", weights.numel(), " on ", weights.device());
  check_hyper_dtype(weights, "weights");
  const bool out_is_acc = check_vector(out, cl, "out");
  if (skip.has_value()) {
    TORCH_CHECK(skip->numel() == 1 && skip->device().is_cpu(), op, ": skip must be a one-element CPU tensor");
    if (skip->item<bool>()) {
      return {at::zeros({cl.C}, at::TensorOptions().dtype(acc)), at::zeros({}, at::TensorOptions().dtype(acc))};
    }
  }
  const double g = gamma_tensor.has_value() ? read_hyper_scalar(*gamma_tensor, "gamma_tensor") : gamma;
  if (acc == at::kDouble) return run_aggregate<double>(cl, weights, g, out, out_is_acc, pieces);
  // Rounded like python_ref's torch.as_tensor(gamma, dtype=float32).
  return run_aggregate<float>(cl, weights, static_cast<float>(g), out, out_is_acc, pieces);
}

std::tuple<Tensor, Tensor> aggregate_cpu(TensorList clients, const Tensor& weights, double gamma,
                                         const OptTensor& gamma_tensor, const Tensor& out, const OptTensor& skip) {
  const Clients cl = unpack_clients(clients, "fedopt_C::aggregate");
  return aggregate_checked("fedopt_C::aggregate", cl, weights, gamma, gamma_tensor, out, skip, nullptr);
}

// Clients given as pieces, read in place (kernel_api.h, PieceTable): `pieces` lists
// client 0's pieces, then client 1's, ...; every client has `pieces_per_client` of
// them, piece p of every client having the same number of elements; `subtract_from`
// (optional, [N]) makes client i's row subtract_from - x_i.  `table` points into the
// struct's own vectors' buffers, which a move keeps and a copy would not: no copies.
struct Pieces {
  Clients cl;
  std::vector<int64_t> starts;
  std::vector<const void*> ptrs;
  PieceTable table;
  Pieces() = default;
  Pieces(const Pieces&) = delete;
  Pieces(Pieces&&) = default;
};

Pieces unpack_pieces(const char* op, TensorList pieces, int64_t pieces_per_client, const OptTensor& subtract_from) {
  const int64_t L = pieces_per_client;
  const int64_t total = static_cast<int64_t>(pieces.size());
  TORCH_CHECK(L >= 1 && total >= L && total % L == 0, op, ": pieces must hold pieces_per_client (", L,
              ") pieces for each of at least one client, got ", total, " pieces");
  Pieces r;
  Clients& cl = r.cl;
  cl.dtype = pieces[0].scalar_type();
  check_supported_float(op, "pieces", cl.dtype);
  cl.C = total / L;
  std::vector<int64_t>& starts = r.starts;
  starts.assign(L + 1, 0);
  for (int64_t p = 0; p < L; ++p) starts[p + 1] = starts[p] + pieces[p].numel();
  cl.N = starts[L];
  std::vector<const void*>& ptrs = r.ptrs;
  ptrs.resize(total);
  for (int64_t i = 0; i < cl.C; ++i) {
    for (int64_t p = 0; p < L; ++p) {
      const Tensor& t = pieces[i * L + p];
      check_flat(t, cl.dtype, "pieces");
      TORCH_CHECK(t.is_contiguous(), op, ": pieces must be contiguous (client ", i, ", piece ", p, ")");
      TORCH_CHECK(t.numel() == starts[p + 1] - starts[p], op, ": piece ", p, " of client ", i, " has ", t.numel(),
                  " elements, client 0's has ", starts[p + 1] - starts[p]);
      ptrs[i * L + p] = t.const_data_ptr();
    }
  }
  const void* base = nullptr;
  if (subtract_from.has_value()) {
    check_flat(*subtract_from, cl.dtype, "subtract_from");
    TORCH_CHECK(subtract_from->is_contiguous() && subtract_from->numel() == cl.N, op, ": subtract_from must be a "
                "contiguous tensor of ", cl.N, " elements, got ", subtract_from->numel());
    base = subtract_from->const_data_ptr();
  }
  r.table = PieceTable{L, starts.data(), ptrs.data(), base};
  return r;
}

std::tuple<Tensor, Tensor> aggregate_pieces_cpu(TensorList pieces, int64_t pieces_per_client,
                                                const OptTensor& subtract_from, const Tensor& weights, double gamma,
                                                const OptTensor& gamma_tensor, const Tensor& out,
                                                const OptTensor& skip) {
  const char* op = "fedopt_C::aggregate_pieces";
  const Pieces p = unpack_pieces(op, pieces, pieces_per_client, subtract_from);
  return aggregate_checked(op, p.cl, weights, gamma, gamma_tensor, out, skip, &p.table);
}

template <typename acc_t>
Tensor run_client_dots(const Clients& cl, const Tensor& g, bool g_is_acc, const PieceTable* pieces = nullptr) {
  const int64_t C = cl.C;
  const ChunkTable table = build_chunk_table({cl.N}, {0}, 1, kAggChunk);
  const int64_t nc = static_cast<int64_t>(table.chunks.size());
  std::vector<acc_t> partials(nc * C);

  DotsArgs<acc_t> args;
  args.kind = scalar_kind(cl.dtype);
  args.g_is_acc = g_is_acc;
  args.num_clients = C;
  args.clients = cl.rows.data();
  args.pieces = pieces;
  args.g = g.const_data_ptr();
  args.chunks = table.chunks.data();
  args.partials = partials.data();
  const Kernels<acc_t>& k = kernels().get<acc_t>();
  parallel_over_columns(C, cl.N, nc, [&](int64_t c0, int64_t c1) { k.client_dots(args, c0, c1); });

  Tensor d = at::empty({C}, at::TensorOptions().dtype(c10::CppTypeToScalarType<acc_t>::value));
  acc_t* dp = d.data_ptr<acc_t>();
  for (int64_t i = 0; i < C; ++i) {
    acc_t s = 0;
    for (int64_t c = 0; c < nc; ++c) s += partials[c * C + i];
    dp[i] = s;
  }
  return d;
}

Tensor client_dots_cpu(TensorList clients, const Tensor& g) {
  const Clients cl = unpack_clients(clients, "fedopt_C::client_dots");
  const bool g_is_acc = check_vector(g, cl, "g");
  if (acc_type(cl.dtype) == at::kDouble) return run_client_dots<double>(cl, g, g_is_acc);
  return run_client_dots<float>(cl, g, g_is_acc);
}

// client_dots over clients given as pieces (see unpack_pieces).
Tensor client_dots_pieces_cpu(TensorList pieces, int64_t pieces_per_client, const OptTensor& subtract_from,
                              const Tensor& g) {
  const Pieces p = unpack_pieces("fedopt_C::client_dots_pieces", pieces, pieces_per_client, subtract_from);
  const bool g_is_acc = check_vector(g, p.cl, "g");
  if (acc_type(p.cl.dtype) == at::kDouble) return run_client_dots<double>(p.cl, g, g_is_acc, &p.table);
  return run_client_dots<float>(p.cl, g, g_is_acc, &p.table);
}

}  // namespace
}  // namespace fedopt::cpu

TORCH_LIBRARY_IMPL(fedopt_C, CPU, m) {
  m.impl("aggregate", &fedopt::cpu::aggregate_cpu);
  m.impl("aggregate_pieces", &fedopt::cpu::aggregate_pieces_cpu);
  m.impl("client_dots", &fedopt::cpu::client_dots_cpu);
  m.impl("client_dots_pieces", &fedopt::cpu::client_dots_pieces_cpu);
}
