// Host helpers of the ATen bindings of the CUDA kernels (csrc/cuda/*.cu): the argument
// checks every CUDA op needs (flat-dense layout, alignment, hyperparameter tensors).
// The list forms' tables go through the device table cache (fedopt/table_cache.h).
// The kernels themselves (csrc/cuda/kernels/*.cuh) and their device helpers
// (fedopt/cuda_utils.cuh) include no torch.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fedopt/cuda_utils.cuh"

namespace fedopt {
namespace cuda {

// The kernels' accumulation type is at::opmath_type's for every dtype the ops take.
static_assert(std::is_same_v<acc_type<at::Half>, at::opmath_type<at::Half>> &&
                  std::is_same_v<acc_type<at::BFloat16>, at::opmath_type<at::BFloat16>> &&
                  std::is_same_v<acc_type<float>, at::opmath_type<float>> &&
                  std::is_same_v<acc_type<double>, at::opmath_type<double>>,
              "acc_type must be at::opmath_type");

inline bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

inline at::ScalarType acc_type_of(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// The data dtype check of every op, naming the argument whose dtype it is.
inline void check_supported_float(const char* op, const char* name, at::ScalarType t) {
  TORCH_CHECK(is_supported_float(t), op, ": ", name, " has unsupported dtype ", t,
              " (expected float16, bfloat16, float32 or float64)");
}

// The device and dtype of a list op's data, taken from its first tensor (`name`[0]),
// which must be a defined CUDA tensor of a supported float dtype.
struct FirstTensor {
  at::Device device;
  at::ScalarType dtype;
};

inline FirstTensor check_first_tensor(const char* op, const char* name, const at::Tensor& t0) {
  TORCH_CHECK(t0.defined() && t0.is_cuda(), op, ": ", name, " must be CUDA tensors, got ",
              t0.defined() ? t0.device().str() : std::string("an undefined tensor"));
  const FirstTensor first{t0.device(), t0.scalar_type()};
  check_supported_float(op, name, first.dtype);
  return first;
}

// True when the tensor's elements fill [data_ptr, data_ptr + numel) exactly once (some
// permutation of its dims is contiguous: contiguous, channels_last, ...).  Kernels read
// every tensor as that flat array, so anything else would read out of bounds.
inline bool is_flat_dense(const at::Tensor& t) {
  if (t.numel() <= 1) return true;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims with size != 1
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) != 1) dims.emplace_back(t.stride(d), t.size(d));
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (const auto& sd : dims) {
    if (sd.first != expected) return false;
    expected *= sd.second;
  }
  return true;
}

// Same shape and the same memory order (strides compared on dims of size != 1), so
// that flat element k of one tensor is flat element k of the other.
inline bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes()) return false;
  for (int64_t d = 0; d < a.dim(); ++d)
    if (a.size(d) != 1 && a.stride(d) != b.stride(d)) return false;
  return true;
}

// A hyperparameter tensor (lr, weight_decay, gamma, grad_scale) as the kernels read it:
// acc dtype, on `device`, `numel` 1 (read with stride 0) or `groups` (stride 1).
struct HyperTensor {
  at::Tensor tensor;  // keeps a converted copy alive until the launches are queued
  const void* ptr = nullptr;
  int64_t stride = 0;
};

inline HyperTensor hyper_tensor(const std::optional<at::Tensor>& t, const char* op, const char* name,
                                at::ScalarType acc, const at::Device& device, int64_t groups = -1) {
  HyperTensor h;
  if (!t.has_value() || !t->defined()) return h;
  TORCH_CHECK(t->device() == device, op, ": ", name, " is on ", t->device(), " but the data is on ", device);
  const int64_t n = t->numel();
  TORCH_CHECK(n == 1 || (groups >= 0 && t->dim() == 1 && n == groups), op, ": ", name,
              " must have one element", groups >= 0 ? " or one per row" : "", ", got shape ", t->sizes());
  TORCH_CHECK(t->is_floating_point(), op, ": ", name, " must be floating point, got ", t->scalar_type());
  h.tensor = t->to(acc).contiguous();  // no copy when already acc and contiguous
  h.ptr = h.tensor.data_ptr();
  h.stride = n == 1 ? 0 : 1;
  return h;
}

// found_inf as the kernels read it (see read_found_inf).  float32 and float64 flags are
// read in place; any other dtype is converted to float32 (exact for the 0/1 flags and
// for half/bfloat16 values, and it keeps non-zero values non-zero for integers).
struct FoundInf {
  at::Tensor tensor;
  const void* ptr = nullptr;
  int kind = 0;
};

inline FoundInf found_inf_flag(const std::optional<at::Tensor>& t, const char* op, const at::Device& device) {
  FoundInf f;
  if (!t.has_value() || !t->defined()) return f;
  TORCH_CHECK(t->device() == device, op, ": found_inf is on ", t->device(), " but the data is on ", device);
  TORCH_CHECK(t->numel() == 1, op, ": found_inf must have one element, got shape ", t->sizes());
  if (t->scalar_type() == at::kDouble) {
    f.tensor = *t;
    f.kind = 2;
  } else {
    f.tensor = t->scalar_type() == at::kFloat ? *t : t->to(at::kFloat);
    f.kind = 1;
  }
  f.ptr = f.tensor.data_ptr();
  return f;
}

// A 0-d flag the kernels read on the device (`skip`, `found_inf`): a bool on `device`, or
// null when absent.  Other dtypes are converted (non-zero -> true) on the device.
struct BoolFlag {
  at::Tensor tensor;  // keeps a converted copy alive until the launches are queued
  const bool* ptr = nullptr;
};

inline BoolFlag bool_flag(const std::optional<at::Tensor>& t, const char* op, const char* name,
                          const at::Device& device) {
  BoolFlag f;
  if (!t.has_value() || !t->defined()) return f;
  TORCH_CHECK(t->device() == device, op, ": ", name, " is on ", t->device(), " but the data is on ", device);
  TORCH_CHECK(t->numel() == 1, op, ": ", name, " must have one element, got shape ", t->sizes());
  f.tensor = t->scalar_type() == at::kBool ? *t : t->to(at::kBool);
  f.ptr = f.tensor.data_ptr<bool>();
  return f;
}

inline int64_t address_of(const at::Tensor& t) {
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()));
}

}  // namespace cuda
}  // namespace fedopt
