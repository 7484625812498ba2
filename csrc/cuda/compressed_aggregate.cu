// The ATen bindings of fedopt_C::block_decode_aggregate, fedopt_C::topk_decode_aggregate
// and the client's encode fedopt_C::block_quantize on CUDA: argument checks, the [C, L]
// stack of a list of replies' codes, the buffers, then the host launchers.  The kernels
// and their trade-offs: csrc/cuda/kernels/compressed_aggregate.cuh and
// csrc/cuda/kernels/compressed_encode.cuh.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include <fedopt/encode_outputs.h>

#include "kernels/compressed_aggregate.cuh"
#include "kernels/compressed_encode.cuh"

namespace fedopt::cuda {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

struct Common {
  Tensor w, skip, gamma;
  float gamma_value = 1.0f;
};

Common common(const Tensor& weights, int64_t C, double gamma, const OptTensor& gamma_tensor, const Tensor& out,
              int64_t N, const OptTensor& skip, const char* op) {
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == at::kFloat && out.dim() == 1 && out.is_contiguous() &&
                  out.numel() == N,
              op, ": out must be a contiguous [", N, "] float32 CUDA tensor, got ", out.scalar_type(), " ",
              out.sizes(), " on ", out.device());
  TORCH_CHECK(weights.device() == out.device() && weights.dim() == 1 && weights.size(0) == C, op,
              ": weights must be a [", C, "] tensor on ", out.device());
  Common c;
  c.w = weights.to(at::kFloat).contiguous();
  if (gamma_tensor.has_value()) {
    TORCH_CHECK(gamma_tensor->device() == out.device() && gamma_tensor->numel() == 1, op,
                ": gamma_tensor must be one element on ", out.device());
    c.gamma = gamma_tensor->to(at::kFloat).reshape({1}).contiguous();
  }
  c.gamma_value = static_cast<float>(gamma);
  if (skip.has_value()) {
    TORCH_CHECK(skip->device() == out.device() && skip->numel() == 1, op, ": skip must be one element on ",
                out.device());
    c.skip = skip->to(at::kBool).reshape({1}).contiguous();
  }
  return c;
}

const bool* skip_ptr(const Common& c) { return c.skip.defined() ? c.skip.const_data_ptr<bool>() : nullptr; }
const float* gamma_ptr(const Common& c) { return c.gamma.defined() ? c.gamma.const_data_ptr<float>() : nullptr; }

// The statistics' outputs: q [C] and total [] fp32.
std::tuple<Tensor, Tensor> stats(const Tensor& out, int64_t C) {
  return {at::empty({C}, out.options()), at::empty({}, out.options())};
}

}  // namespace

std::tuple<Tensor, Tensor> block_decode_aggregate(at::TensorList codes, at::TensorList scales, int64_t kind,
                                                  int64_t block, int64_t numel, const Tensor& weights, double gamma,
                                                  const OptTensor& gamma_tensor, const Tensor& out,
                                                  const OptTensor& skip) {
  const char* op = "fedopt_C::block_decode_aggregate";
  const int64_t C = static_cast<int64_t>(codes.size()), N = numel;
  TORCH_CHECK(C > 0 && static_cast<int64_t>(scales.size()) == C, op, ": one codes and one scales tensor per client");
  TORCH_CHECK(kind >= 0 && kind <= 2, op, ": kind must be 0, 1 or 2, got ", kind);
  TORCH_CHECK(block > 0 && block % 32 == 0, op, ": block must be a positive multiple of 32, got ", block);
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t L = kind == 1 ? (N + 1) / 2 : N, NB = (N + block - 1) / block;
  for (int64_t i = 0; i < C; ++i) {
    TORCH_CHECK(codes[i].device() == out.device() && codes[i].dim() == 1 && codes[i].numel() == L &&
                    codes[i].element_size() == 1,
                op, ": codes[", i, "] must be a 1-D one-byte tensor of ", L, " elements on ", out.device());
    TORCH_CHECK(scales[i].device() == out.device() && scales[i].scalar_type() == at::kFloat &&
                    scales[i].dim() == 1 && scales[i].numel() == NB,
                op, ": scales[", i, "] must be a 1-D float32 tensor of ", NB, " elements on ", out.device());
  }
  const Common c = common(weights, C, gamma, gamma_tensor, out, N, skip, op);
  std::vector<Tensor> cs, ss;
  for (int64_t i = 0; i < C; ++i) {
    cs.push_back(codes[i].view(at::kByte));
    ss.push_back(scales[i]);
  }
  const Tensor X = at::stack(cs).contiguous(), S = at::stack(ss).contiguous();
  Tensor part = at::zeros({(C + 1) * block_decode_parts(N)}, out.options());
  auto [q, total] = stats(out, C);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(out.device().index()).stream();
  C10_CUDA_CHECK(launch_block_decode_aggregate(X.const_data_ptr<uint8_t>(), S.const_data_ptr<float>(),
                                               c.w.const_data_ptr<float>(), out.data_ptr<float>(),
                                               part.data_ptr<float>(), q.data_ptr<float>(), total.data_ptr<float>(),
                                               skip_ptr(c), gamma_ptr(c), c.gamma_value, C, N, block,
                                               static_cast<int>(kind), stream));
  return {q, total};
}

std::tuple<Tensor, Tensor> topk_decode_aggregate(at::TensorList values, at::TensorList indices, int64_t numel,
                                                 const Tensor& weights, double gamma, const OptTensor& gamma_tensor,
                                                 const Tensor& out, const OptTensor& skip) {
  const char* op = "fedopt_C::topk_decode_aggregate";
  const int64_t C = static_cast<int64_t>(values.size()), N = numel;
  TORCH_CHECK(C > 0 && static_cast<int64_t>(indices.size()) == C, op, ": one values and one indices tensor per client");
  const c10::cuda::CUDAGuard guard(out.device());
  int64_t max_k = 0;
  std::vector<const float*> vals(C);
  std::vector<const int64_t*> idxs(C);
  std::vector<int64_t> ks(C);
  for (int64_t i = 0; i < C; ++i) {
    TORCH_CHECK(values[i].device() == out.device() && values[i].scalar_type() == at::kFloat && values[i].dim() == 1 &&
                    values[i].is_contiguous(),
                op, ": values[", i, "] must be a contiguous 1-D float32 tensor on ", out.device());
    TORCH_CHECK(indices[i].device() == out.device() && indices[i].scalar_type() == at::kLong &&
                    indices[i].dim() == 1 && indices[i].is_contiguous() && indices[i].numel() == values[i].numel(),
                op, ": indices[", i, "] must be a contiguous 1-D int64 tensor as long as values[", i, "]");
    // The indices' range and order are the ops layer's check (ops.compressed.check_reply,
    // on the host copy a reply arrives in): reading them here would synchronise.
    vals[i] = values[i].const_data_ptr<float>();
    idxs[i] = indices[i].const_data_ptr<int64_t>();
    ks[i] = values[i].numel();
    max_k = std::max(max_k, ks[i]);
  }
  const Common c = common(weights, C, gamma, gamma_tensor, out, N, skip, op);
  const int64_t nparts = topk_decode_parts(N, max_k);
  Tensor part = at::zeros({(C + 1) * nparts}, out.options());
  Tensor acc = at::zeros({N}, out.options());
  auto [q, total] = stats(out, C);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(out.device().index()).stream();
  C10_CUDA_CHECK(launch_topk_decode_aggregate(vals.data(), idxs.data(), ks.data(), c.w.const_data_ptr<float>(),
                                              acc.data_ptr<float>(), out.data_ptr<float>(), part.data_ptr<float>(),
                                              q.data_ptr<float>(), total.data_ptr<float>(), skip_ptr(c), gamma_ptr(c),
                                              c.gamma_value, C, N, nparts, stream));
  return {q, total};
}

void check_block_quantize_args(const char* op, const Tensor& x, int64_t kind, int64_t block, bool stochastic,
                               int64_t key, int64_t client) {
  TORCH_CHECK(kind == 0 || kind == 1 || kind == 2, op, ": kind must be 0 (int8), 1 (int4) or 2 (fp8), got ", kind);
  TORCH_CHECK(kind != 2 || !stochastic, op, ": stochastic rounding is defined for int8 and int4, not fp8 (kind 2)");
  TORCH_CHECK(block > 0 && block % 32 == 0, op, ": block must be a positive multiple of 32, got ", block);
  TORCH_CHECK(x.is_cuda() && x.dim() == 1 && x.is_floating_point(), op,
              ": x must be a 1-D floating-point CUDA tensor, got ", x.scalar_type(), " ", x.sizes(), " on ",
              x.device());
  TORCH_CHECK(key >= 0, op, ": key must be in [0, 2^63), got ", key);
  TORCH_CHECK(client >= 0 && client <= 0xFFFFFFFFLL, op, ": client must be in [0, 2^32), got ", client);
}

// The encode into given outputs (checked by the callers): the one implementation of both ops.
void block_quantize_write(const Tensor& x, int64_t kind, int64_t block, bool stochastic, int64_t key, int64_t client,
                          Tensor& codes, Tensor& scales) {
  const c10::cuda::CUDAGuard guard(x.device());
  const Tensor xf = x.to(at::kFloat).contiguous();  // fp16 / bf16 widen exactly; fp64 rounds once
  const int64_t N = xf.numel();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  if (kind == 2) {
    C10_CUDA_CHECK(launch_fp8_encode(xf.const_data_ptr<float>(), codes.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                                     N, block, stream));
    return;
  }
  C10_CUDA_CHECK(launch_block_quantize<float>(xf.const_data_ptr<float>(), static_cast<uint8_t*>(codes.data_ptr()),
                                              scales.data_ptr<float>(), N, block, kind == 1, stochastic,
                                              static_cast<uint64_t>(key), static_cast<uint32_t>(client), stream));
}

std::tuple<Tensor, Tensor> block_quantize(const Tensor& x, int64_t kind, int64_t block, bool stochastic, int64_t key,
                                          int64_t client) {
  check_block_quantize_args("fedopt_C::block_quantize", x, kind, block, stochastic, key, client);
  auto [codes, scales] = fedopt::empty_block_encode_outputs(x, kind, block);
  block_quantize_write(x, kind, block, stochastic, key, client, codes, scales);
  return {codes, scales};
}

void block_quantize_into(const Tensor& x, int64_t kind, int64_t block, bool stochastic, int64_t key, int64_t client,
                         Tensor codes, Tensor scales) {
  const char* op = "fedopt_C::block_quantize_into";
  check_block_quantize_args(op, x, kind, block, stochastic, key, client);
  fedopt::check_block_encode_outputs(op, x, kind, block, codes, scales);
  block_quantize_write(x, kind, block, stochastic, key, client, codes, scales);
}

}  // namespace fedopt::cuda

TORCH_LIBRARY_IMPL(fedopt_C, CUDA, m) {
  m.impl("block_decode_aggregate", TORCH_FN(fedopt::cuda::block_decode_aggregate));
  m.impl("topk_decode_aggregate", TORCH_FN(fedopt::cuda::topk_decode_aggregate));
  m.impl("block_quantize", TORCH_FN(fedopt::cuda::block_quantize));
  m.impl("block_quantize_into", TORCH_FN(fedopt::cuda::block_quantize_into));
}
