// Helpers shared by the CUDA kernels of fedopt_kernels (csrc/cuda/*.cu).
//
// Device side: 16-byte vector loads/stores with conversion to the accumulation type,
// and deterministic warp/block sums (fixed shuffle tree, warps combined in a fixed
// order: the result depends only on the values and the block size, never on timing).
// Host side: the argument checks every CUDA op needs (flat-dense layout, alignment,
// hyperparameter tensors).  The list forms' tables go through the device table cache
// (fedopt/table_cache.h).
//
// Value decisions (clip scale, direction, skip) are NOT here: they live in math.h,
// shared with the CPU kernels, which spells every operation (rn::add, rn::mul, ...: no
// FMA contraction).  What is here is Unfused<T>, an acc type whose own operators do the
// same, for formulas written in a .cu file (aggregate.cu's noise epilogue).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fedopt/math.h"

namespace fedopt {
namespace cuda {

// Every kernel of the extension runs blocks of this many threads (the block sums
// below assume blockDim.x == kThreads exactly).
constexpr int kThreads = 256;
constexpr int kWarpSize = 32;
constexpr int kWarps = kThreads / kWarpSize;

// ---------------------------------------------------------------------------------
// Device helpers
// ---------------------------------------------------------------------------------

template <typename T, int N>
struct alignas(sizeof(T) * N) AlignedVector {
  T val[N];
};

// Elements of T in one 16-byte vector (4 float, 8 half/bfloat16, 2 double).
template <typename T>
constexpr int vec16() {
  return static_cast<int>(16 / sizeof(T));
}

// The kernels rebuild data pointers from int64 addresses (tables, row bases), so the
// compiler cannot prove they point to global memory and would emit generic loads and
// stores (LD.E.128).  Every data access goes through global_ptr, which states it (the
// ops only accept CUDA tensors), so the SASS has LDG.E.128 / STG.E.128.  (__ldcg /
// __stwb would also be global but compile to "strong" cache-operator accesses.)
template <typename T>
__device__ __forceinline__ T* global_ptr(T* p) {
  __builtin_assume(__isGlobal(p));
  return p;
}

template <typename acc_t, typename T>
__device__ __forceinline__ acc_t load_one(const T* p) {
  return static_cast<acc_t>(*global_ptr(p));
}

template <typename T, typename acc_t>
__device__ __forceinline__ void store_one(T* p, acc_t v) {
  *global_ptr(p) = static_cast<T>(v);
}

// out[0..N) = p[0..N) converted to acc_t.  p must be 16-byte aligned and N * sizeof(T)
// a multiple of 16: N * sizeof(T) / 16 vector loads (ld.global.v4).
template <int N, typename T, typename acc_t>
__device__ __forceinline__ void load_vec(const T* p, acc_t* out) {
  constexpr int P = vec16<T>();
  static_assert(N % P == 0, "load_vec: N * sizeof(T) must be a multiple of 16 bytes");
#pragma unroll
  for (int k = 0; k < N / P; ++k) {
    const AlignedVector<T, P> v = *global_ptr(reinterpret_cast<const AlignedVector<T, P>*>(p + k * P));
#pragma unroll
    for (int j = 0; j < P; ++j) out[k * P + j] = static_cast<acc_t>(v.val[j]);
  }
}

// p[0..N) = in[0..N) converted to T; same alignment rules as load_vec.
template <int N, typename T, typename acc_t>
__device__ __forceinline__ void store_vec(T* p, const acc_t* in) {
  constexpr int P = vec16<T>();
  static_assert(N % P == 0, "store_vec: N * sizeof(T) must be a multiple of 16 bytes");
#pragma unroll
  for (int k = 0; k < N / P; ++k) {
    AlignedVector<T, P> v;
#pragma unroll
    for (int j = 0; j < P; ++j) v.val[j] = static_cast<T>(in[k * P + j]);
    *global_ptr(reinterpret_cast<AlignedVector<T, P>*>(p + k * P)) = v;
  }
}

// Sum over the warp; the result is valid in lane 0 only.  Fixed shuffle tree.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) v = rn::add(v, __shfl_down_sync(0xffffffffu, v, offset));
  return v;
}

// Sum over a block of `nwarps` whole warps (blockDim.x == 32 * nwarps); EVERY thread
// returns the same value (each thread adds the warp sums in the same order, 0, 1, ...,
// so all threads, and all blocks given the same inputs, get bitwise the same total).
// `smem` holds nwarps values; the trailing barrier makes it reusable at once.  The tree
// depends only on the values and nwarps: compile-time (block_sum_n) or launch-time
// (aggregate.cu's tiling rule); the same adds in the same order either way.
template <typename T>
__device__ __forceinline__ T block_sum_warps(T v, T* smem, int nwarps) {
  v = warp_sum(v);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  T total = smem[0];
  for (int w = 1; w < nwarps; ++w) total = rn::add(total, smem[w]);
  __syncthreads();
  return total;
}

// block_sum_warps over a block of kBlock threads (blockDim.x == kBlock, a multiple of 32).
template <int kBlock, typename T>
__device__ __forceinline__ T block_sum_n(T v, T* smem) {
  static_assert(kBlock % kWarpSize == 0 && kBlock >= kWarpSize, "whole warps");
  return block_sum_warps(v, smem, kBlock / kWarpSize);
}

// block_sum_n for the extension's usual blocks of kThreads; `smem` holds kWarps values.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* smem) {
  return block_sum_n<kThreads>(v, smem);
}

template <typename T>
__device__ __forceinline__ T device_sqrt(T v);
template <>
__device__ __forceinline__ float device_sqrt<float>(float v) {
  return sqrtf(v);  // IEEE round-to-nearest (no fast math in this build)
}
template <>
__device__ __forceinline__ double device_sqrt<double>(double v) {
  return sqrt(v);
}

// Unfused<T>: a float or double whose arithmetic is never contracted.  nvcc contracts
// a * b + c into one FMA (one rounding instead of two) by default, which is usually a
// free win but breaks a contract that says "each operation separately rounded": the
// server update must give the bits of the CPU kernel (and of the same operations done
// one correctly rounded op at a time, the tests' oracle).  (math.h's formulas do this
// themselves now, through rn::; server_update.cu still instantiates them with Unfused,
// which changes nothing: both are the same intrinsics.)  Instantiating a formula with
// acc_t = Unfused<float> (or <double>) maps every +, -, *, / to the __f*_rn / __d*_rn
// intrinsics, which the compiler never merges into an FMA (CUDA C Programming Guide,
// "Intrinsic Functions"); they compile to the same FADD/FMUL/DADD/DMUL instructions, so
// this costs nothing but the fusion.  sqrt_of is specialised below (__fsqrt_rn /
// __dsqrt_rn: IEEE round-to-nearest whatever -prec-sqrt says).  The host branches only
// exist so that math.h's __host__ __device__ templates instantiate in nvcc's host pass.
template <typename T>
struct Unfused {
  T v;
  Unfused() = default;
  __host__ __device__ __forceinline__ constexpr Unfused(T x) : v(x) {}  // NOLINT: implicit on purpose
};

namespace unfused_detail {
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float sqrt_rn(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double sqrt_rn(double a) { return __dsqrt_rn(a); }
#else
template <typename T> inline T add(T a, T b) { return a + b; }
template <typename T> inline T sub(T a, T b) { return a - b; }
template <typename T> inline T mul(T a, T b) { return a * b; }
template <typename T> inline T div(T a, T b) { return a / b; }
template <typename T> inline T sqrt_rn(T a) { return std::sqrt(a); }
#endif
}  // namespace unfused_detail

template <typename T>
__host__ __device__ __forceinline__ Unfused<T> operator+(Unfused<T> a, Unfused<T> b) {
  return unfused_detail::add(a.v, b.v);
}
template <typename T>
__host__ __device__ __forceinline__ Unfused<T> operator-(Unfused<T> a, Unfused<T> b) {
  return unfused_detail::sub(a.v, b.v);
}
template <typename T>
__host__ __device__ __forceinline__ Unfused<T> operator*(Unfused<T> a, Unfused<T> b) {
  return unfused_detail::mul(a.v, b.v);
}
template <typename T>
__host__ __device__ __forceinline__ Unfused<T> operator/(Unfused<T> a, Unfused<T> b) {
  return unfused_detail::div(a.v, b.v);
}
template <typename T>
__host__ __device__ __forceinline__ bool operator<(Unfused<T> a, Unfused<T> b) {
  return a.v < b.v;
}
template <typename T>
__host__ __device__ __forceinline__ bool operator>(Unfused<T> a, Unfused<T> b) {
  return a.v > b.v;
}

}  // namespace cuda

// math.h's sqrt_of for Unfused (its generic version calls sqrt / std::sqrt on acc_t).
template <>
FEDOPT_HD cuda::Unfused<float> sqrt_of(cuda::Unfused<float> a) {
  return cuda::unfused_detail::sqrt_rn(a.v);
}
template <>
FEDOPT_HD cuda::Unfused<double> sqrt_of(cuda::Unfused<double> a) {
  return cuda::unfused_detail::sqrt_rn(a.v);
}

namespace cuda {

// A GradScaler found_inf flag: non-zero (NaN included) means "skip".
// kind: 0 absent, 1 float32, 2 float64 (see FoundInf below).
__device__ __forceinline__ bool read_found_inf(const void* p, int kind) {
  if (p == nullptr) return false;
  if (kind == 2) return *static_cast<const double*>(p) != 0.0;
  return *static_cast<const float*>(p) != 0.0f;
}

// ---------------------------------------------------------------------------------
// Host helpers
// ---------------------------------------------------------------------------------

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
