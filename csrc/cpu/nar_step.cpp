// CPU kernels of fedopt_C::nar_step_ and fedopt_C::nar_step_batched_ (schemas and
// semantics: csrc/registration.cpp; math: include/fedopt/math.h; oracle:
// python_ref/fednar.py).
//
// A step is two passes over the chunk table of all tensors (chunks.h), whatever the
// number of tensors, with no copy into a flat buffer:
//   1. norm pass (parallel): one sum of squares per chunk;
//   2. host: per group, the chunk sums in chunk order -> norm, clip scale, skip flag;
//   3. update pass (parallel, skipped groups untouched): x (and b) in place.
// nar_sq_norm and nar_apply_ are steps 1-2 and 2-3 as separate ops: a norm shared by
// several calls (param groups with their own lr/wd, dtypes, devices) is the sum of
// their nar_sq_norm results, which each call's nar_apply_ then takes as its norm^2.
// Traffic per element: mode co reads x, g then reads x, g and writes x (5 words: the
// least any two-pass step can move); modes grad/none skip x in the norm pass (4 words).
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "ops_common.h"

namespace fedopt::cpu {
namespace {

using at::Tensor;
using at::TensorList;
using OptTensor = std::optional<Tensor>;

// The tensors of one call, as the kernels see them.
struct NarTensors {
  at::ScalarType dtype;
  std::vector<int64_t> numels, group_of;
  int64_t num_groups = 0;
  std::vector<void*> x, b;
  std::vector<const void*> g;
};

struct NarHyper {
  double lr;
  const OptTensor& lr_tensor;
  double weight_decay;
  const OptTensor& weight_decay_tensor;
  double max_norm;
  int64_t mode;
  double momentum;
  const OptTensor& grad_scale;
  const OptTensor& found_inf;
};

// Which passes run_nar runs.  kNormOnly writes each group's sum of squares to norm_out
// and touches no tensor; kApply takes norm^2 of group 0 from sq_in instead of step 1.
enum class NarPhase { kStep, kNormOnly, kApply };

template <typename acc_t>
void run_nar(const NarTensors& t, const NarHyper& h, NarPhase phase, const acc_t* sq_in, acc_t* norm_out,
             acc_t* scale_out, bool* skip_out) {
  TORCH_CHECK(h.mode >= 0 && h.mode <= 2, "fedopt_C: mode must be 0 (co), 1 (grad) or 2 (none), got ", h.mode);
  const int64_t G = t.num_groups;
  const NarMode mode = static_cast<NarMode>(h.mode);
  const std::vector<acc_t> lr = read_hyper<acc_t>(h.lr, h.lr_tensor, G, "lr_tensor");
  const std::vector<acc_t> wd = read_hyper<acc_t>(h.weight_decay, h.weight_decay_tensor, G, "weight_decay_tensor");
  const acc_t inv_grad_scale =
      h.grad_scale.has_value() ? acc_t(1) / static_cast<acc_t>(read_hyper_scalar(*h.grad_scale, "grad_scale"))
                                : acc_t(1);
  const bool found_inf = h.found_inf.has_value() && read_scalar(*h.found_inf, "found_inf") != 0;

  std::vector<NarParams<acc_t>> params(G);
  for (int64_t i = 0; i < G; ++i) {
    params[i] = {lr[i], wd[i], static_cast<acc_t>(h.momentum), inv_grad_scale, mode};
  }
  const ChunkTable table = build_chunk_table(t.numels, t.group_of, G, kNarChunk);
  std::vector<acc_t> partials(table.chunks.size());
  std::vector<acc_t> scale(G);
  std::vector<uint8_t> skip(G);

  NarArgs<acc_t> args;
  args.kind = scalar_kind(t.dtype);
  args.mode = mode;
  args.momentum = h.momentum != 0;
  args.chunks = table.chunks.data();
  args.x = t.x.data();
  args.g = t.g.data();
  args.b = t.b.data();
  args.params = params.data();
  args.partials = partials.data();
  args.scale = scale.data();
  args.skip = skip.data();
  const Kernels<acc_t>& k = kernels().get<acc_t>();

  if (phase != NarPhase::kApply) {
    for_chunk_ranges(table.chunks, kMinElementsPerThread,
                     [&](int64_t c0, int64_t c1) { k.nar_norm(args, c0, c1); });
  }

  bool any_step = false;
  for (int64_t i = 0; i < G; ++i) {
    acc_t sum = 0;
    if (phase == NarPhase::kApply) {
      sum = sq_in[0];  // nar_apply_ has one group
    } else {
      for (int64_t c = table.group_begin[i]; c < table.group_begin[i + 1]; ++c) sum += partials[c];
    }
    if (phase == NarPhase::kNormOnly) {
      norm_out[i] = sum;
      continue;
    }
    const acc_t norm = std::sqrt(sum);
    scale[i] = nar_clip_scale(norm, static_cast<acc_t>(h.max_norm), mode);
    skip[i] = nar_skip(norm, found_inf);
    any_step = any_step || !skip[i];
    norm_out[i] = norm;
    scale_out[i] = scale[i];
    skip_out[i] = skip[i];
  }
  if (any_step) {
    for_chunk_ranges(table.chunks, kMinElementsPerThread, [&](int64_t c0, int64_t c1) { k.nar_update(args, c0, c1); });
  }
}

// Runs `phase` and returns (norm, scale, skipped); for kNormOnly `norm` holds the sums
// of squares and the other two are unset.  `sq_in`: a 0-d acc tensor (kApply only).
std::tuple<Tensor, Tensor, Tensor> run_nar_with_stats(const NarTensors& t, const NarHyper& h,
                                                      at::IntArrayRef stat_shape, NarPhase phase = NarPhase::kStep,
                                                      const OptTensor& sq_in = std::nullopt) {
  const at::ScalarType acc = acc_type(t.dtype);
  Tensor norm = at::empty(stat_shape, at::TensorOptions().dtype(acc));
  Tensor scale = at::empty(stat_shape, at::TensorOptions().dtype(acc));
  Tensor skipped = at::empty(stat_shape, at::TensorOptions().dtype(at::kBool));
  Tensor sq;
  if (phase == NarPhase::kApply) {
    TORCH_CHECK(sq_in.has_value() && sq_in->numel() == 1 && sq_in->device().is_cpu(),
                "fedopt_C::nar_apply_: sq_norm must be a one-element CPU tensor");
    sq = sq_in->to(acc).contiguous();
  }
  if (acc == at::kDouble) {
    run_nar<double>(t, h, phase, sq.defined() ? sq.const_data_ptr<double>() : nullptr, norm.data_ptr<double>(),
                    scale.data_ptr<double>(), skipped.data_ptr<bool>());
  } else {
    run_nar<float>(t, h, phase, sq.defined() ? sq.const_data_ptr<float>() : nullptr, norm.data_ptr<float>(),
                   scale.data_ptr<float>(), skipped.data_ptr<bool>());
  }
  return {norm, scale, skipped};
}

// The tensors of a list op (nar_step_, nar_sq_norm, nar_apply_): one group.
NarTensors list_tensors(TensorList params, TensorList grads, TensorList momentum_buffers, bool use_momentum,
                        const char* op) {
  const size_t T = params.size();
  TORCH_CHECK(T > 0, op, ": params must not be empty");
  TORCH_CHECK(grads.size() == T, op, ": ", grads.size(), " grads for ", T, " params");
  TORCH_CHECK(!use_momentum || momentum_buffers.size() == T, op, ": ", momentum_buffers.size(),
              " momentum_buffers for ", T, " params");
  NarTensors t;
  t.dtype = params[0].scalar_type();
  check_supported_float(op, "params", t.dtype);
  t.num_groups = 1;
  t.numels.reserve(T);
  t.group_of.assign(T, 0);
  t.x.reserve(T);
  t.g.reserve(T);
  for (size_t i = 0; i < T; ++i) {
    check_flat(params[i], t.dtype, "params");
    check_partner(grads[i], params[i], "grads");
    t.numels.push_back(params[i].numel());
    t.x.push_back(params[i].data_ptr());
    t.g.push_back(grads[i].const_data_ptr());
    if (use_momentum) push_state(t.b, momentum_buffers[i], params[i], "momentum_buffers");
  }
  return t;
}

std::tuple<Tensor, Tensor, Tensor> nar_step_cpu(TensorList params, TensorList grads, TensorList momentum_buffers,
                                                double lr, const OptTensor& lr_tensor, double weight_decay,
                                                const OptTensor& weight_decay_tensor, double max_norm, int64_t mode,
                                                double momentum, const OptTensor& grad_scale,
                                                const OptTensor& found_inf) {
  const NarTensors t = list_tensors(params, grads, momentum_buffers, momentum != 0, "fedopt_C::nar_step_");
  const NarHyper h{lr, lr_tensor, weight_decay, weight_decay_tensor, max_norm, mode, momentum, grad_scale, found_inf};
  return run_nar_with_stats(t, h, {});
}

Tensor nar_sq_norm_cpu(TensorList params, TensorList grads, double weight_decay,
                       const OptTensor& weight_decay_tensor, int64_t mode, const OptTensor& grad_scale) {
  const NarTensors t = list_tensors(params, grads, {}, false, "fedopt_C::nar_sq_norm");
  const OptTensor none;
  const NarHyper h{0.0, none, weight_decay, weight_decay_tensor, 1.0, mode, 0.0, grad_scale, none};
  return std::get<0>(run_nar_with_stats(t, h, {}, NarPhase::kNormOnly));
}

std::tuple<Tensor, Tensor, Tensor> nar_apply_cpu(TensorList params, TensorList grads, TensorList momentum_buffers,
                                                 const Tensor& sq_norm, double lr, const OptTensor& lr_tensor,
                                                 double weight_decay, const OptTensor& weight_decay_tensor,
                                                 double max_norm, int64_t mode, double momentum,
                                                 const OptTensor& grad_scale, const OptTensor& found_inf) {
  const NarTensors t = list_tensors(params, grads, momentum_buffers, momentum != 0, "fedopt_C::nar_apply_");
  const NarHyper h{lr, lr_tensor, weight_decay, weight_decay_tensor, max_norm, mode, momentum, grad_scale, found_inf};
  return run_nar_with_stats(t, h, {}, NarPhase::kApply, sq_norm);
}

std::tuple<Tensor, Tensor, Tensor> nar_step_batched_cpu(const Tensor& X, const Tensor& G, const OptTensor& B,
                                                        double lr, const OptTensor& lr_tensor, double weight_decay,
                                                        const OptTensor& weight_decay_tensor, double max_norm,
                                                        int64_t mode, double momentum, const OptTensor& grad_scale,
                                                        const OptTensor& found_inf) {
  TORCH_CHECK(X.dim() == 2, "fedopt_C::nar_step_batched_: params must be [C, N], got ", X.sizes());
  TORCH_CHECK(X.is_contiguous(), "fedopt_C::nar_step_batched_: params must be contiguous");
  check_supported_float("fedopt_C::nar_step_batched_", "params", X.scalar_type());
  check_flat(X, X.scalar_type(), "params");
  check_partner(G, X, "grads");
  TORCH_CHECK(G.sizes() == X.sizes(), "fedopt_C::nar_step_batched_: grads ", G.sizes(), " vs params ", X.sizes());
  const bool use_momentum = momentum != 0;
  if (use_momentum) {
    TORCH_CHECK(B.has_value(), "fedopt_C::nar_step_batched_: momentum_buffers is required when momentum != 0");
    check_partner(*B, X, "momentum_buffers");
    TORCH_CHECK(B->sizes() == X.sizes(), "fedopt_C::nar_step_batched_: momentum_buffers ", B->sizes(), " vs params ",
                X.sizes());
  }
  const int64_t C = X.size(0), N = X.size(1);
  const int64_t item = X.element_size();
  NarTensors t;
  t.dtype = X.scalar_type();
  t.num_groups = C;
  t.numels.assign(C, N);
  t.group_of.resize(C);
  for (int64_t i = 0; i < C; ++i) {  // row i is tensor i, group i
    t.group_of[i] = i;
    t.x.push_back(static_cast<char*>(X.data_ptr()) + i * N * item);
    t.g.push_back(static_cast<const char*>(G.const_data_ptr()) + i * N * item);
    if (use_momentum) t.b.push_back(static_cast<char*>(B->data_ptr()) + i * N * item);
  }
  const NarHyper h{lr, lr_tensor, weight_decay, weight_decay_tensor, max_norm, mode, momentum, grad_scale, found_inf};
  return run_nar_with_stats(t, h, {C});
}

}  // namespace
}  // namespace fedopt::cpu

TORCH_LIBRARY_IMPL(fedopt_C, CPU, m) {
  m.impl("nar_step_", &fedopt::cpu::nar_step_cpu);
  m.impl("nar_step_batched_", &fedopt::cpu::nar_step_batched_cpu);
  m.impl("nar_sq_norm", &fedopt::cpu::nar_sq_norm_cpu);
  m.impl("nar_apply_", &fedopt::cpu::nar_apply_cpu);
}

// An addition to the namespace (no existing schema changes): which build of the CPU
// kernels this process runs, "DEFAULT", "AVX2" or "AVX512" (chosen once, like torch's
// own CPU kernels; ATEN_CPU_CAPABILITY caps it).  For diagnostics and tests.
TORCH_LIBRARY_FRAGMENT(fedopt_C, m) {
  m.def("cpu_isa() -> str", []() -> std::string { return fedopt::cpu::kernels().isa; });
}
