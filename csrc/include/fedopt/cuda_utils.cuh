// Helpers shared by the CUDA kernels of fedopt_kernels (csrc/cuda/*.cu).
//
// Device side: 16-byte vector loads/stores with conversion to the accumulation type,
// and deterministic warp/block sums (fixed shuffle tree, warps combined in a fixed
// order: the result depends only on the values and the block size, never on timing).
// No torch here: the kernels (csrc/cuda/kernels/*.cuh) and tools/gpu_harness include
// this header without ATen.  The host-side argument checks of the ATen bindings are in
// fedopt/cuda_aten.h.
//
// Value decisions (clip scale, direction, skip) are NOT here: they live in math.h,
// shared with the CPU kernels, which spells every operation (rn::add, rn::mul, ...: no
// FMA contraction).  What is here is Unfused<T>, an acc type whose own operators do the
// same, for formulas written in a .cu file (aggregate.cu's noise epilogue).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "fedopt/math.h"

namespace fedopt {
namespace cuda {

// Every kernel of the extension runs blocks of this many threads (the block sums
// below assume blockDim.x == kThreads exactly).
constexpr int kThreads = 256;
constexpr int kWarpSize = 32;
constexpr int kWarps = kThreads / kWarpSize;

// The accumulation type of a data type: double for double, float for everything else
// (float, and the 16-bit types whatever their C++ type: c10::Half / c10::BFloat16 in
// the ATen bindings, __half / __nv_bfloat16 in tools/gpu_harness).  The same types as
// at::opmath_type, which fedopt/cuda_aten.h checks at compile time.
template <typename T>
using acc_type = std::conditional_t<std::is_same_v<T, double>, double, float>;

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
// kind: 0 absent, 1 float32, 2 float64 (see FoundInf in fedopt/cuda_aten.h).
__device__ __forceinline__ bool read_found_inf(const void* p, int kind) {
  if (p == nullptr) return false;
  if (kind == 2) return *static_cast<const double*>(p) != 0.0;
  return *static_cast<const float*>(p) != 0.0f;
}

}  // namespace cuda
}  // namespace fedopt
