// Helpers shared by the CPU ops (nar_step.cpp, aggregate.cpp, add_noise.cpp,
// server_update.cpp, the ragged ops): tensor checks that guard memory safety,
// hyperparameter reads, and the split of a chunk table among threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "kernel_api.h"

namespace fedopt::cpu {

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// The data dtype check of every op, naming the argument whose dtype it is (the same
// words as the CUDA kernels' check_supported_float).
inline void check_supported_float(const char* op, const char* what, at::ScalarType t) {
  TORCH_CHECK(is_supported_float(t), op, ": ", what, " has unsupported dtype ", t,
              " (expected float16, bfloat16, float32 or float64)");
}

// Call after check_supported_float.
inline ScalarKind scalar_kind(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ScalarKind::kFloat;
    case at::kDouble: return ScalarKind::kDouble;
    case at::kHalf: return ScalarKind::kHalf;
    case at::kBFloat16: return ScalarKind::kBFloat16;
    default: TORCH_CHECK(false, "fedopt_C: unsupported dtype ", t, " (float16/bfloat16/float32/float64)");
  }
}

// A hyperparameter tensor must be floating point, as on CUDA (an integer lr would
// otherwise be accepted here and refused there).
inline void check_hyper_dtype(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_floating_point(), "fedopt_C: ", what, " must be floating point, got ", t.scalar_type());
}

// The clients' lengths of the ragged ops (ragged_bmm.cpp, ragged_epilogues.cpp): an int64
// tensor [C] (on the CPU: the callers check that) whose entries lie in [0, full], as
// they index rows.  Returns it contiguous, to be read as a host array.
inline at::Tensor checked_lengths(const at::Tensor& lengths, int64_t C, int64_t full, const char* op) {
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.dim() == 1 && lengths.size(0) == C, op,
              "lengths must be an int64 tensor of shape [", C, "], got ", lengths.scalar_type(), " ",
              lengths.sizes());
  at::Tensor contiguous = lengths.contiguous();
  const int64_t* l = contiguous.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < C; ++i) {
    TORCH_CHECK(l[i] >= 0 && l[i] <= full, op, "lengths[", i, "] = ", l[i], " is outside [0, ", full, "]");
  }
  return contiguous;
}

// float64 data accumulates in float64, everything else in float32.
inline at::ScalarType acc_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// The kernels read a tensor as the flat array [data_ptr, data_ptr + numel): it must be
// a CPU tensor of `dtype` whose elements fill that range exactly once.
inline void check_flat(const at::Tensor& t, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), "fedopt_C: ", what, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, "fedopt_C: ", what, " has dtype ", t.scalar_type(), ", expected ", dtype);
  TORCH_CHECK(t.layout() == at::kStrided && t.is_non_overlapping_and_dense(),
              "fedopt_C: ", what, " must be dense and non-overlapping");
}

// `t` is read element for element alongside `ref`: same numel and the same memory
// layout (a grad laid out differently from its param would pair the wrong elements).
inline void check_partner(const at::Tensor& t, const at::Tensor& ref, const char* what) {
  check_flat(t, ref.scalar_type(), what);
  TORCH_CHECK(t.numel() == ref.numel(), "fedopt_C: ", what, " has ", t.numel(), " elements, expected ", ref.numel());
  TORCH_CHECK(t.numel() <= 1 || t.strides() == ref.strides(), "fedopt_C: ", what,
              " must have the same strides as its param, got ", t.strides(), " and ", ref.strides());
}

// An optional state tensor of a list op (momentum_buffers, exp_avg, exp_avg_sq), read
// and written alongside its param: checked as its partner, then its pointer appended
// to the op's list for the kernels.
inline void push_state(std::vector<void*>& ptrs, const at::Tensor& t, const at::Tensor& param, const char* what) {
  check_partner(t, param, what);
  ptrs.push_back(t.data_ptr());
}

// A hyperparameter given as a float or as a floating-point CPU tensor of one value or
// `n` values (one per group: the rows of nar_step_batched_; read here: on the CPU that
// is a plain memory read, not a device sync), in acc_t.
template <typename acc_t>
std::vector<acc_t> read_hyper(double value, const std::optional<at::Tensor>& tensor, int64_t n, const char* what) {
  if (!tensor.has_value()) return std::vector<acc_t>(std::max<int64_t>(n, 1), static_cast<acc_t>(value));
  const at::Tensor& t = *tensor;
  TORCH_CHECK(t.device().is_cpu(), "fedopt_C: ", what, " must be a CPU tensor, got ", t.device());
  check_hyper_dtype(t, what);
  if (n <= 1) {
    TORCH_CHECK(t.numel() == 1, "fedopt_C: ", what, " must have one element, got ", t.numel());
  } else {
    TORCH_CHECK(t.numel() == 1 || t.numel() == n, "fedopt_C: ", what, " must have one element or one per row (", n,
                " rows), got ", t.numel(), " elements");
  }
  // The conversion rounds like python_ref's `.to(acc dtype)`.
  const at::Tensor c = t.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();
  const acc_t* p = c.data_ptr<acc_t>();
  if (t.numel() == 1) return std::vector<acc_t>(std::max<int64_t>(n, 1), p[0]);
  return std::vector<acc_t>(p, p + n);
}

// Reads a one-element CPU tensor as double (flags: found_inf, skip).
inline double read_scalar(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), "fedopt_C: ", what, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.numel() == 1, "fedopt_C: ", what, " must have one element, got ", t.numel());
  return t.item<double>();
}

// read_scalar for a hyperparameter (grad_scale, lr_tensor, gamma_tensor): floating point.
inline double read_hyper_scalar(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), "fedopt_C: ", what, " must be a CPU tensor, got ", t.device());
  check_hyper_dtype(t, what);
  return read_scalar(t, what);
}

// The DP noise arguments of aggregate, aggregate_pieces and add_noise_ (schemas:
// registration.cpp), checked before anything is written: a key in [0, 2^63) (the
// schema's int is signed; the ops layer never passes a negative one), and the std as a
// float or a one-element float32 / float64 CPU tensor.
inline void check_noise(const char* op, std::optional<int64_t> key, const std::optional<at::Tensor>& std_tensor) {
  if (key.has_value()) TORCH_CHECK(*key >= 0, op, ": noise_key must be in [0, 2^63), got ", *key);
  if (!std_tensor.has_value()) return;
  const at::Tensor& t = *std_tensor;
  TORCH_CHECK(t.device().is_cpu(), op, ": noise_std_tensor must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.numel() == 1, op, ": noise_std_tensor must have one element, got ", t.numel());
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, op,
              ": noise_std_tensor must be float32 or float64, got ", t.scalar_type());
}

// The noise std in acc_t: the tensor's value when given (converted as `.to(acc dtype)`
// converts it), else the float rounded to acc_t.  Call after check_noise.
template <typename acc_t>
acc_t noise_std_value(double value, const std::optional<at::Tensor>& tensor) {
  return read_hyper<acc_t>(value, tensor, 1, "noise_std_tensor")[0];
}

// Runs fn(c0, c1) on consecutive chunk ranges, one per thread, balanced by element
// count (a table mixes 64-element and 64Ki-element chunks).  The ranges depend on the
// thread count; the results do not (one partial per chunk).  For the same table the
// same thread gets the same chunks in every call, which the update pass relies on to
// find its data in that core's cache.
template <typename F>
void for_chunk_ranges(const std::vector<Chunk>& chunks, int64_t grain, const F& fn) {
  const int64_t n = static_cast<int64_t>(chunks.size());
  if (n == 0) return;
  std::vector<int64_t> offset(n + 1, 0);  // first element of each chunk in the whole table
  for (int64_t c = 0; c < n; ++c) offset[c + 1] = offset[c] + chunks[c].len;
  at::parallel_for(0, offset[n], grain, [&](int64_t begin, int64_t end) {
    // Chunk c belongs to the range holding its first element.
    const int64_t c0 = std::lower_bound(offset.begin(), offset.begin() + n, begin) - offset.begin();
    const int64_t c1 = std::lower_bound(offset.begin(), offset.begin() + n, end) - offset.begin();
    if (c0 < c1) fn(c0, c1);
  });
}

}  // namespace fedopt::cpu
