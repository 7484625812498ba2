// CUDA kernel of the server optimizer step `fedopt_C::server_update_` (schema:
// csrc/registration.cpp; formulas: fedopt/math.h server_update_*, shared with the CPU
// kernel; oracle: python_ref/server_optimizers.py).  FedAvg / FedExP (rule sgd),
// FedAvgM / ASNES (momentum, optionally Nesterov), FedAdagrad / FedAdam / FedYogi
// (adaptive) in ONE launch over all tensors of a call, in place.
//
// Traffic per element, in words: sgd 3 (read x, D; write x), momentum 5 (+ read/write
// b), adaptive 7 (+ read/write m and v).  D (the round's mean update) is in the acc
// dtype (fp32, fp64 for fp64 params); x, b = m and v are in the params' dtype.  The
// step is purely elementwise: nothing is reduced, so the result does not depend on the
// chunking or the launch shape and is deterministic.
//
// Work layout: the chunk rows of fedopt/chunks.h (the one layout and chunk rule of every
// multi-tensor launcher, shared with the Triton backend): one block per chunk, each row
// [x, D, m, v, len, 0, flags, 0] holding the ADDRESSES of the chunk's first x, D, m, v
// element (m, v 0 where the rule has no such state), so a block finds its data with one
// 64-byte read and no indirection through per-tensor arrays.  The rows come from the
// device table cache (fedopt/table_cache.h): uploaded once per distinct set of tensors
// (pinned host copy, non_blocking, no host sync), found again by content, so the list
// form is capturable into a CUDA graph after one warm-up call.  The chunking changes no
// result: the step is elementwise.
//
// Vectorisation: V = 16 / sizeof(param) elements per thread step (8 fp16/bf16, 4 fp32,
// 2 fp64), so x, m and v move in one 16-byte load/store each and D (acc, at least as
// wide) in one or two.  Decided PER CHUNK from the addresses themselves, because the
// updates are views into one flat [N] vector at arbitrary element offsets (only 4- or
// 8-byte aligned as soon as a tensor before them has a size that is not a multiple of
// 4 fp32 / 2 fp64 elements) while params and state normally come from the allocator:
//   * x, m, v and D 16-byte aligned: all vector loads/stores;
//   * x, m, v aligned, D not: x, m, v vectors, D with V scalar loads per step at the
//     same positions (the lanes of a warp touch the same sectors as the vector load
//     would, so DRAM traffic is unchanged; only the load instruction count grows);
//   * otherwise (views of a flat param buffer): scalar loads/stores throughout.
// The row's flags bit 0 (kChunkAligned16) says "all four"; the x/m/v-only case is
// tested on the row's addresses.  The branch is block-uniform and taken once per chunk,
// never inside the element loop.  Chunk starts are multiples of kMinChunk, itself a
// multiple of every V, so a chunk inherits its tensor's alignment; the < V elements at a
// chunk's end take the scalar loop.
//
// Arithmetic: the rule (and nesterov) are template parameters, so math.h's tests of
// them fold away and the element loop is straight-line code; 6 instantiations per
// dtype.  The formulas are evaluated with acc_t = Unfused<float|double>
// (cuda_utils.cuh): every operation separately rounded as the contract and the CPU
// kernels do, no FMA contraction; division and sqrt are IEEE round-to-nearest.  The
// stored values are rounded to the params' dtype by round-to-nearest-even conversions,
// as torch's .to() does.
//
// Device-side scalars: lr_tensor / gamma_tensor (0-d acc) and skip (0-d bool) are read
// inside the kernel, never with .item(): every block first reads skip and returns
// before writing anything when it is true (block-uniform), so a skipped step keeps
// every bit of params and state without a host sync.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>

#include <limits>
#include <vector>

#include "fedopt/chunks.h"
#include "fedopt/cuda_utils.cuh"
#include "fedopt/math.h"
#include "fedopt/table_cache.h"
#include "ops.h"

namespace fedopt {
namespace cuda {
namespace {

template <typename acc_t>
struct ServerArgs {
  const int64_t* rows;  // [gridDim.x, kChunkRowWords] (fedopt/chunks.h)
  acc_t lr, gamma, beta1, beta2, tau;
  const acc_t* lr_ptr;     // when set: lr = *lr_ptr (read on the device)
  const acc_t* gamma_ptr;  // when set: gamma = *gamma_ptr
  const bool* skip;        // when set and true: nothing is written
};

template <ServerRule R>
constexpr bool kHasM = R != ServerRule::kSgd;
template <ServerRule R>
constexpr bool kHasV = R != ServerRule::kSgd && R != ServerRule::kMomentum;

// One element through math.h.  m and v are only touched by the rules that have them
// (they are not even loaded otherwise).
template <ServerRule R, typename acc_t>
__device__ __forceinline__ void server_step(acc_t& x, acc_t d, acc_t& m, acc_t& v,
                                            const ServerParams<Unfused<acc_t>>& p) {
  Unfused<acc_t> xu(x);
  if constexpr (R == ServerRule::kSgd) {
    server_update_sgd(xu, Unfused<acc_t>(d), p);
  } else if constexpr (R == ServerRule::kMomentum) {
    Unfused<acc_t> bu(m);
    server_update_momentum(xu, Unfused<acc_t>(d), bu, p);
    m = bu.v;
  } else {
    Unfused<acc_t> mu(m), vu(v);
    server_update_adaptive(xu, Unfused<acc_t>(d), mu, vu, p);
    m = mu.v;
    v = vu.v;
  }
  x = xu.v;
}

// The vectorised part of a chunk (x, m, v 16-byte aligned; D too when kVecD): thread t
// takes the V-element steps t, t + 256, ...  Returns the number of elements done.
template <ServerRule R, bool kVecD, typename scalar_t, typename acc_t>
__device__ __forceinline__ int64_t server_chunk_vec(scalar_t* __restrict__ x, const acc_t* __restrict__ d,
                                                    scalar_t* __restrict__ m, scalar_t* __restrict__ v,
                                                    int64_t len, const ServerParams<Unfused<acc_t>>& p) {
  constexpr int V = vec16<scalar_t>();
  const int64_t nvec = len / V;
  for (int64_t i = threadIdx.x; i < nvec; i += kThreads) {
    const int64_t e = i * V;
    acc_t xv[V], dv[V], mv[V], vv[V];
    load_vec<V>(x + e, xv);
    if constexpr (kVecD) {
      load_vec<V>(d + e, dv);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) dv[j] = load_one<acc_t>(d + e + j);
    }
    if constexpr (kHasM<R>) load_vec<V>(m + e, mv);
    if constexpr (kHasV<R>) load_vec<V>(v + e, vv);
#pragma unroll
    for (int j = 0; j < V; ++j) server_step<R>(xv[j], dv[j], mv[j], vv[j], p);
    store_vec<V>(x + e, xv);
    if constexpr (kHasM<R>) store_vec<V>(m + e, mv);
    if constexpr (kHasV<R>) store_vec<V>(v + e, vv);
  }
  return nvec * V;
}

template <typename scalar_t, ServerRule R, bool kNesterov>
__global__ void __launch_bounds__(kThreads) server_update_kernel(const ServerArgs<at::opmath_type<scalar_t>> a) {
  using acc_t = at::opmath_type<scalar_t>;
  // First, before anything else is read: a skipped step writes nothing (block-uniform).
  if (a.skip != nullptr && *global_ptr(a.skip)) return;
  const int64_t* row = global_ptr(a.rows + static_cast<int64_t>(blockIdx.x) * kChunkRowWords);
  const int64_t cx = row[kRowPtr0 + 0], cd = row[kRowPtr0 + 1], cm = row[kRowPtr0 + 2], cv = row[kRowPtr0 + 3];
  const int64_t len = row[kRowLen];
  const bool all_aligned = (row[kRowFlags] & kChunkAligned16) != 0;

  ServerParams<Unfused<acc_t>> p;
  p.lr = a.lr_ptr != nullptr ? *global_ptr(a.lr_ptr) : a.lr;
  p.gamma = (R == ServerRule::kSgd && a.gamma_ptr != nullptr) ? *global_ptr(a.gamma_ptr) : a.gamma;
  p.beta1 = a.beta1;
  p.beta2 = a.beta2;
  p.tau = a.tau;
  p.nesterov = kNesterov;  // compile-time constants: math.h's branches on them fold away
  p.rule = R;

  scalar_t* __restrict__ x = reinterpret_cast<scalar_t*>(cx);
  const acc_t* __restrict__ d = reinterpret_cast<const acc_t*>(cd);
  scalar_t* __restrict__ m = kHasM<R> ? reinterpret_cast<scalar_t*>(cm) : nullptr;
  scalar_t* __restrict__ v = kHasV<R> ? reinterpret_cast<scalar_t*>(cv) : nullptr;

  int64_t done = 0;
  const int64_t state_addr = cx | (kHasM<R> ? cm : 0) | (kHasV<R> ? cv : 0);
  if (all_aligned) {
    done = server_chunk_vec<R, true>(x, d, m, v, len, p);
  } else if ((state_addr & (kAlignBytes - 1)) == 0) {
    done = server_chunk_vec<R, false>(x, d, m, v, len, p);
  }
  for (int64_t e = done + threadIdx.x; e < len; e += kThreads) {
    acc_t xe = load_one<acc_t>(x + e), me, ve;
    if constexpr (kHasM<R>) me = load_one<acc_t>(m + e);
    if constexpr (kHasV<R>) ve = load_one<acc_t>(v + e);
    server_step<R>(xe, load_one<acc_t>(d + e), me, ve, p);
    store_one(x + e, xe);
    if constexpr (kHasM<R>) store_one(m + e, me);
    if constexpr (kHasV<R>) store_one(v + e, ve);
  }
}

template <typename scalar_t, ServerRule R, bool kNesterov>
void launch(const ServerArgs<at::opmath_type<scalar_t>>& a, int64_t num_chunks, cudaStream_t stream) {
  server_update_kernel<scalar_t, R, kNesterov>
      <<<dim3(static_cast<unsigned int>(num_chunks)), kThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void server_update_(at::TensorList params, at::TensorList updates, at::TensorList exp_avg,
                    at::TensorList exp_avg_sq, int64_t rule, double lr, const std::optional<at::Tensor>& lr_tensor,
                    double gamma, const std::optional<at::Tensor>& gamma_tensor, double beta1, double beta2,
                    double tau, bool nesterov, const std::optional<at::Tensor>& skip) {
  const char* op = "fedopt_C::server_update_ (CUDA)";
  // Only what would be memory-unsafe is checked here (the ops layer validates values).
  TORCH_CHECK(rule >= 0 && rule <= 4, op,
              ": rule must be 0 (sgd), 1 (momentum), 2 (adagrad), 3 (adam) or 4 (yogi), got ", rule);
  const ServerRule r = static_cast<ServerRule>(rule);
  const bool has_m = r != ServerRule::kSgd;
  const bool has_v = has_m && r != ServerRule::kMomentum;
  const size_t T = params.size();
  TORCH_CHECK(updates.size() == T, op, ": ", updates.size(), " updates for ", T, " params");
  TORCH_CHECK(!has_m || exp_avg.size() == T, op, ": rule ", rule, " needs one exp_avg per param, got ",
              exp_avg.size(), " for ", T, " params");
  TORCH_CHECK(!has_v || exp_avg_sq.size() == T, op, ": rule ", rule, " needs one exp_avg_sq per param, got ",
              exp_avg_sq.size(), " for ", T, " params");
  if (T == 0) return;

  const FirstTensor first = check_first_tensor(op, "params", params[0]);
  const at::Device device = first.device;
  const at::ScalarType dtype = first.dtype;
  const at::ScalarType acc = acc_type_of(dtype);
  const c10::cuda::CUDAGuard guard(device);

  // Every tensor is read as the flat array [data_ptr, data_ptr + numel) in the
  // params' logical order (D is a flat vector in that order): contiguous, same numel.
  auto check = [&](const at::Tensor& t, const char* name, size_t i, at::ScalarType want, int64_t numel) {
    TORCH_CHECK(t.defined(), op, ": ", name, "[", i, "] is undefined");
    TORCH_CHECK(t.device() == device, op, ": ", name, "[", i, "] is on ", t.device(), " but params[0] is on ",
                device);
    TORCH_CHECK(t.scalar_type() == want, op, ": ", name, "[", i, "] has dtype ", t.scalar_type(), ", expected ",
                want);
    TORCH_CHECK(t.is_contiguous(), op, ": ", name, "[", i, "] must be contiguous, got sizes ", t.sizes(),
                " strides ", t.strides());
    TORCH_CHECK(t.numel() == numel, op, ": ", name, "[", i, "] has ", t.numel(), " elements but params[", i,
                "] has ", numel);
  };
  for (size_t i = 0; i < T; ++i) {
    const int64_t n = params[i].defined() ? params[i].numel() : 0;
    check(params[i], "params", i, dtype, n);
    check(updates[i], "updates", i, acc, n);
    if (has_m) check(exp_avg[i], "exp_avg", i, dtype, n);
    if (has_v) check(exp_avg_sq[i], "exp_avg_sq", i, dtype, n);
  }
  // The chunk rows (fedopt/chunks.h): x, D, m, v; no groups.
  std::vector<ChunkTensor> tensors(T);
  for (size_t i = 0; i < T; ++i) {
    ChunkTensor& t = tensors[i];
    t.numel = params[i].numel();
    if (t.numel == 0) continue;  // no row, and no data_ptr() of an empty tensor is ever used
    t.ptr[0] = address_of(params[i]);
    t.ptr[1] = address_of(updates[i]);
    t.ptr[2] = has_m ? address_of(exp_avg[i]) : 0;
    t.ptr[3] = has_v ? address_of(exp_avg_sq[i]) : 0;
  }
  const int64_t esize = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t dsize = static_cast<int64_t>(c10::elementSize(acc));
  const ChunkRows rows = build_chunk_rows(tensors, {esize, dsize, esize, esize}, /*num_groups=*/1);
  const int64_t num_chunks = rows.num_rows;
  if (num_chunks == 0) return;  // all tensors empty: launch (and convert, upload) nothing
  TORCH_CHECK(num_chunks <= std::numeric_limits<int32_t>::max(), op, ": too many chunks (", num_chunks, ")");
  const HyperTensor lr_h = hyper_tensor(lr_tensor, op, "lr_tensor", acc, device);
  const HyperTensor gamma_h = hyper_tensor(gamma_tensor, op, "gamma_tensor", acc, device);
  const BoolFlag skip_f = bool_flag(skip, op, "skip", device);
  const at::Tensor table = device_table(rows.blob, device, op);  // alive until the launch is queued
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "fedopt_server_update_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    ServerArgs<acc_t> a;
    a.rows = table.data_ptr<int64_t>();
    // Rounded once to acc, as the CPU kernel and torch (a Python float in an acc op) do.
    a.lr = static_cast<acc_t>(lr);
    a.gamma = static_cast<acc_t>(gamma);
    a.beta1 = static_cast<acc_t>(beta1);
    a.beta2 = static_cast<acc_t>(beta2);
    a.tau = static_cast<acc_t>(tau);
    a.lr_ptr = static_cast<const acc_t*>(lr_h.ptr);
    a.gamma_ptr = static_cast<const acc_t*>(gamma_h.ptr);
    a.skip = skip_f.ptr;
    switch (r) {
      case ServerRule::kSgd: launch<scalar_t, ServerRule::kSgd, false>(a, num_chunks, stream); break;
      case ServerRule::kMomentum:
        if (nesterov) {
          launch<scalar_t, ServerRule::kMomentum, true>(a, num_chunks, stream);
        } else {
          launch<scalar_t, ServerRule::kMomentum, false>(a, num_chunks, stream);
        }
        break;
      case ServerRule::kAdagrad: launch<scalar_t, ServerRule::kAdagrad, false>(a, num_chunks, stream); break;
      case ServerRule::kAdam: launch<scalar_t, ServerRule::kAdam, false>(a, num_chunks, stream); break;
      case ServerRule::kYogi: launch<scalar_t, ServerRule::kYogi, false>(a, num_chunks, stream); break;
    }
  });
}

}  // namespace cuda
}  // namespace fedopt
