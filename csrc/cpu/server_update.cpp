// CPU kernel of fedopt_C::server_update_ (schema: csrc/registration.cpp; math:
// include/fedopt/math.h, server_update_*; oracle: python_ref/server_optimizers.py).
//
// One pass over the chunk table of all tensors (chunks.h), in place, with no copy into
// a flat buffer.  Traffic per element: kSgd reads x, D and writes x (3 words);
// kMomentum also reads and writes b (5); the adaptive rules read and write m and v
// (7).  D is in the acc dtype, the rest in the params' dtype.
#include <vector>

#include <torch/library.h>

#include "ops_common.h"

namespace fedopt::cpu {
namespace {

using at::Tensor;
using at::TensorList;
using OptTensor = std::optional<Tensor>;

// The tensors of one call, as the kernels see them.
struct ServerTensors {
  at::ScalarType dtype;
  std::vector<int64_t> numels;
  std::vector<void*> x, m, v;
  std::vector<const void*> d;
};

// A tensor the kernels walk in the param's logical (row-major) order: the updates are
// views of a flat vector in that order, so any other layout would pair wrong elements.
void check_contiguous(const Tensor& t, const char* what) {
  TORCH_CHECK(t.is_contiguous(), "fedopt_C::server_update_: ", what, " must be contiguous, got strides ",
              t.strides(), " for shape ", t.sizes());
}

template <typename acc_t>
void run_server_update(const ServerTensors& t, ServerParams<acc_t> p) {
  const ChunkTable table = build_chunk_table(t.numels, std::vector<int64_t>(t.numels.size(), 0), 1, kNarChunk);
  std::vector<const acc_t*> d(t.d.size());
  for (size_t i = 0; i < d.size(); ++i) d[i] = static_cast<const acc_t*>(t.d[i]);
  ServerUpdateArgs<acc_t> args;
  args.kind = scalar_kind(t.dtype);
  args.chunks = table.chunks.data();
  args.x = t.x.data();
  args.d = d.data();
  args.m = t.m.data();
  args.v = t.v.data();
  args.params = p;
  const Kernels<acc_t>& k = kernels().get<acc_t>();
  for_chunk_ranges(table.chunks, kMinElementsPerThread, [&](int64_t c0, int64_t c1) { k.server_update(args, c0, c1); });
}

void server_update_cpu(TensorList params, TensorList updates, TensorList exp_avg, TensorList exp_avg_sq, int64_t rule,
                       double lr, const OptTensor& lr_tensor, double gamma, const OptTensor& gamma_tensor,
                       double beta1, double beta2, double tau, bool nesterov, const OptTensor& skip) {
  TORCH_CHECK(rule >= 0 && rule <= 4, "fedopt_C::server_update_: rule must be 0 (sgd), 1 (momentum), 2 (adagrad), "
              "3 (adam) or 4 (yogi), got ", rule);
  const size_t T = params.size();
  TORCH_CHECK(updates.size() == T, "fedopt_C::server_update_: ", updates.size(), " updates for ", T, " params");
  const bool has_m = rule != static_cast<int64_t>(ServerRule::kSgd);
  const bool has_v = has_m && rule != static_cast<int64_t>(ServerRule::kMomentum);
  TORCH_CHECK(!has_m || exp_avg.size() == T, "fedopt_C::server_update_: ", exp_avg.size(), " exp_avg for ", T,
              " params");
  TORCH_CHECK(!has_v || exp_avg_sq.size() == T, "fedopt_C::server_update_: ", exp_avg_sq.size(), " exp_avg_sq for ",
              T, " params");
  if (T == 0) return;
  ServerTensors t;
  t.dtype = params[0].scalar_type();
  check_supported_float("fedopt_C::server_update_", "params", t.dtype);
  const at::ScalarType acc = acc_type(t.dtype);
  for (size_t i = 0; i < T; ++i) {
    check_flat(params[i], t.dtype, "params");
    check_contiguous(params[i], "params");
    check_flat(updates[i], acc, "updates");
    check_contiguous(updates[i], "updates");
    TORCH_CHECK(updates[i].numel() == params[i].numel(), "fedopt_C::server_update_: updates has ",
                updates[i].numel(), " elements, expected ", params[i].numel());
    t.numels.push_back(params[i].numel());
    t.x.push_back(params[i].data_ptr());
    t.d.push_back(updates[i].const_data_ptr());
    if (has_m) push_state(t.m, exp_avg[i], params[i], "exp_avg");
    if (has_v) push_state(t.v, exp_avg_sq[i], params[i], "exp_avg_sq");
  }
  // CPU tensors: reading them is a plain memory read, not a device sync.  The
  // hyperparameters are checked even when the step is skipped (as on CUDA).
  const double lr_value = lr_tensor.has_value() ? read_hyper_scalar(*lr_tensor, "lr_tensor") : lr;
  const double gamma_value = gamma_tensor.has_value() ? read_hyper_scalar(*gamma_tensor, "gamma_tensor") : gamma;
  if (skip.has_value() && read_scalar(*skip, "skip") != 0) return;
  const ServerRule r = static_cast<ServerRule>(rule);
  // The hyperparameters are rounded once to acc, as torch rounds a Python float (or
  // converts an acc tensor, exactly) before a tensor op of the acc dtype.
  if (acc == at::kDouble) {
    run_server_update<double>(t, {lr_value, gamma_value, beta1, beta2, tau, nesterov, r});
  } else {
    run_server_update<float>(t, {static_cast<float>(lr_value), static_cast<float>(gamma_value),
                                 static_cast<float>(beta1), static_cast<float>(beta2), static_cast<float>(tau),
                                 nesterov, r});
  }
}

}  // namespace
}  // namespace fedopt::cpu

TORCH_LIBRARY_IMPL(fedopt_C, CPU, m) { m.impl("server_update_", &fedopt::cpu::server_update_cpu); }
