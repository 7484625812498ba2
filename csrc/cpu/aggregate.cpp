// CPU kernels of fedopt_C::aggregate and fedopt_C::client_dots (schemas and semantics:
// csrc/registration.cpp; oracle: python_ref/aggregation.py).
//
// Both make ONE pass over the clients: the columns [0, N) are cut into chunks
// (chunks.h), threads take consecutive chunks, and inside a chunk every client is read
// once (kernels.h).  Per chunk the kernels leave one partial per client (and one for
// ||sum||^2), which are added here in chunk order: the results do not depend on the
// thread count.  With DP noise (noise_key given) the epilogue adds std * normal(key, j)
// to each out[j] in the same pass (client_rows_kernels.h, finish_total; oracle:
// python_ref/gaussian_noise.py).
#include <tuple>
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

// A [N] tensor the kernels read or write: the clients' dtype or the acc dtype.
bool check_vector(const Tensor& t, const Clients& cl, const char* what) {
  const at::ScalarType acc = acc_type(cl.dtype);
  TORCH_CHECK(t.scalar_type() == cl.dtype || t.scalar_type() == acc, "fedopt_C: ", what, " must have dtype ",
              cl.dtype, " or ", acc, ", got ", t.scalar_type());
  check_flat(t, t.scalar_type(), what);
  TORCH_CHECK(t.numel() == cl.N, "fedopt_C: ", what, " must have ", cl.N, " elements, got ", t.numel());
  return t.scalar_type() == acc;
}

// The DP noise of one call, resolved: off, or on with its key and std (noise_std_value).
template <typename acc_t>
struct Noise {
  bool on = false;
  uint64_t key = 0;
  acc_t std_dev = 0;
};

template <typename acc_t>
std::tuple<Tensor, Tensor> run_aggregate(const Clients& cl, const Tensor& weights, acc_t gamma, const Tensor& out,
                                         bool out_is_acc, const PieceTable* pieces, const Noise<acc_t>& noise) {
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
  args.noise = noise.on;
  args.noise_key = noise.key;
  args.noise_std = noise.std_dev;
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

template <typename acc_t>
Noise<acc_t> resolve_noise(std::optional<int64_t> key, double std_value, const OptTensor& std_tensor) {
  Noise<acc_t> n;
  if (!key.has_value()) return n;
  n.on = true;
  n.key = static_cast<uint64_t>(*key);
  n.std_dev = noise_std_value<acc_t>(std_value, std_tensor);
  return n;
}

// The checks and the skip convention both forms of aggregate share, then the pass.
std::tuple<Tensor, Tensor> aggregate_checked(const char* op, const Clients& cl, const Tensor& weights, double gamma,
                                             const OptTensor& gamma_tensor, const Tensor& out, const OptTensor& skip,
                                             const PieceTable* pieces, std::optional<int64_t> noise_key,
                                             double noise_std, const OptTensor& noise_std_tensor) {
  const at::ScalarType acc = acc_type(cl.dtype);
  TORCH_CHECK(weights.device().is_cpu() && weights.numel() == cl.C, op, ": weights must be a CPU tensor of ", cl.C,
              " elements, got ", weights.numel(), " on ", weights.device());
  check_hyper_dtype(weights, "weights");
  const bool out_is_acc = check_vector(out, cl, "out");
  check_noise(op, noise_key, noise_std_tensor);
  if (skip.has_value()) {
    TORCH_CHECK(skip->numel() == 1 && skip->device().is_cpu(), op, ": skip must be a one-element CPU tensor");
    if (skip->item<bool>()) {
      return {at::zeros({cl.C}, at::TensorOptions().dtype(acc)), at::zeros({}, at::TensorOptions().dtype(acc))};
    }
  }
  const double g = gamma_tensor.has_value() ? read_hyper_scalar(*gamma_tensor, "gamma_tensor") : gamma;
  if (acc == at::kDouble) {
    return run_aggregate<double>(cl, weights, g, out, out_is_acc, pieces,
                                 resolve_noise<double>(noise_key, noise_std, noise_std_tensor));
  }
  // Rounded like python_ref's torch.as_tensor(gamma, dtype=float32).
  return run_aggregate<float>(cl, weights, static_cast<float>(g), out, out_is_acc, pieces,
                              resolve_noise<float>(noise_key, noise_std, noise_std_tensor));
}

std::tuple<Tensor, Tensor> aggregate_cpu(TensorList clients, const Tensor& weights, double gamma,
                                         const OptTensor& gamma_tensor, const Tensor& out, const OptTensor& skip,
                                         std::optional<int64_t> noise_key, double noise_std,
                                         const OptTensor& noise_std_tensor) {
  const Clients cl = unpack_clients(clients, "fedopt_C::aggregate");
  return aggregate_checked("fedopt_C::aggregate", cl, weights, gamma, gamma_tensor, out, skip, nullptr, noise_key,
                           noise_std, noise_std_tensor);
}

std::tuple<Tensor, Tensor> aggregate_pieces_cpu(TensorList pieces, int64_t pieces_per_client,
                                                const OptTensor& subtract_from, const Tensor& weights, double gamma,
                                                const OptTensor& gamma_tensor, const Tensor& out,
                                                const OptTensor& skip, std::optional<int64_t> noise_key,
                                                double noise_std, const OptTensor& noise_std_tensor) {
  const char* op = "fedopt_C::aggregate_pieces";
  const Pieces p = unpack_pieces(op, pieces, pieces_per_client, subtract_from);
  return aggregate_checked(op, p.cl, weights, gamma, gamma_tensor, out, skip, &p.table, noise_key, noise_std,
                           noise_std_tensor);
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
