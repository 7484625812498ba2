// CPU kernels of fedopt_C::block_decode_aggregate and fedopt_C::topk_decode_aggregate, and
// the client's fused encode fedopt_C::block_quantize (schemas: csrc/registration.cpp;
// oracle: python_ref/compression.py).
//
// The aggregation reads each reply's codes and scales in place: the columns [0, N) are
// cut into chunks (a multiple of the block, ~64 Ki columns: the accumulator stays in L2,
// and each client's codes are read as one long run),
// threads take consecutive chunks, and inside a chunk each client's codes are decoded in
// registers (v = s_b * q, one rounding), squared into the client's partial and added to
// the chunk's accumulator (acc = acc + w_i * v, client order), in one pass
// (compressed_kernels.h, decode_accumulate).  No dense copy of a reply is made.  A client of weight 0 is not added at all: the oracle adds
// +0.0, which leaves every accumulator as it is (the accumulator starts at +0.0 and a
// sum of finite or infinite values is -0.0 only if both terms are).  So out is bit for
// bit python_ref's gamma * sum_i w_i x^_i and ops.aggregate over the decoded rows.
//
// Per chunk one partial per client and one for ||acc||^2, added in chunk order: the
// results do not depend on the thread count, nor (one lane layout, no contraction) on
// the instruction set.  The inner loops (compressed_kernels.h) are compiled three
// times in this one translation unit, for the DEFAULT, AVX2 and AVX-512 levels torch
// itself runs (at::get_cpu_capability), the way isa_*.cpp build kernels.h.
#include "compressed_prologue.h"  // no contraction, <immintrin.h> before the target switches

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <fedopt/encode_outputs.h>  // check_block_encode_outputs
#include <fedopt/gaussian_noise.h>  // Philox4x32-10 (the codecs' stochastic rounding)

#include "philox_wide.h"  // its AVX-512 form

// FEDOPT_CK_ISA tells compressed_kernels.h which intrinsics its decode may use (GCC 12
// does not define __AVX512F__ under `#pragma GCC target`): 0 none, 2 AVX2, 512 AVX-512.

namespace fedopt::cpu::compressed {
namespace DEFAULT {
#define FEDOPT_CK_ISA 0
#include "compressed_kernels.h"
#undef FEDOPT_CK_ISA
}  // namespace DEFAULT
}  // namespace fedopt::cpu::compressed

#if FEDOPT_COMPRESSED_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace fedopt::cpu::compressed {
namespace AVX2 {
#define FEDOPT_CK_ISA 2
#include "compressed_kernels.h"
#undef FEDOPT_CK_ISA
}  // namespace AVX2
}  // namespace fedopt::cpu::compressed
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace fedopt::cpu::compressed {
namespace AVX512 {
#define FEDOPT_CK_ISA 512
#include "compressed_kernels.h"
#undef FEDOPT_CK_ISA
}  // namespace AVX512
}  // namespace fedopt::cpu::compressed
#pragma GCC pop_options
#endif

namespace fedopt::cpu::compressed {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

constexpr int64_t kChunkColumns = int64_t(1) << 16;  // 256 KiB of accumulator: L2-resident; each client read as one 64 KiB+ run (prefetch-friendly)
constexpr int64_t kMinColumnsPerThread = int64_t(1) << 16;
// int8 and fp8 write out with streaming stores (compressed_kernels.h, stream_note) from
// this many values on (16 MiB of out, half this VM's L3): below it a model's out is likely
// still in cache when the server update reads it, and a streamed line would have to come
// back from memory.  Not int4: in paired runs (20 x 11.2M, Zen 5 VM, docs/benchmarks.md)
// it did not gain (two threads 6.6-6.9 ms against 6.2-7.0), where int8 did (two threads
// 13.4-16.0 ms against 15.8-18.8, one thread 22.3-22.8 against 23.1-23.9) and fp8 a
// little (two threads 19.8-21.4 against 22.1-22.3); its loop stays the plain-store one.
constexpr int64_t kStreamColumns = int64_t(1) << 22;

struct Loops {
  void (*scatter_axpy)(float, const float*, const int64_t*, int64_t, int64_t, float*);
  float (*sum_squares)(const float*, int64_t);
  void (*scale_into)(float, const float*, int64_t, float*);
  float (*quantize_block)(const float*, int64_t, float, bool, uint64_t, int64_t, uint32_t, uint32_t, int8_t*);
  void (*decode_chunk)(int, int64_t, const uint8_t* const*, const float* const*, const float*, int64_t, int64_t,
                       int64_t, const float*, float, bool, float*, float*, float*, float*);
  float (*add_lanes)(const float*);
};

#define FEDOPT_CK_LOOPS(NS) \
  Loops { &NS::scatter_axpy, &NS::sum_squares, &NS::scale_into, &NS::quantize_block, \
        &NS::decode_chunk, &NS::add_lanes }

const Loops& loops() {
  static const Loops chosen = [] {
#if FEDOPT_COMPRESSED_X86
    const std::string cap = at::get_cpu_capability();
    if (cap == "AVX512") return FEDOPT_CK_LOOPS(AVX512);
    if (cap == "AVX2") return FEDOPT_CK_LOOPS(AVX2);
#endif
    return FEDOPT_CK_LOOPS(DEFAULT);
  }();
  return chosen;
}

const float* fp8_table() {
  static const std::vector<float> lut = [] {
    std::vector<float> t(256);
    for (int b = 0; b < 256; ++b) t[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return lut.data();
}

void check_flat(const Tensor& t, at::ScalarType dtype, const char* op, const char* what, int64_t i) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 1 && t.is_contiguous(), op, ": ",
              what, "[", i, "] must be a contiguous 1-D CPU tensor of dtype ", dtype, ", got ", t.scalar_type(),
              " ", t.sizes(), " on ", t.device());
}

// The per-call inputs every kernel shares: weights as floats, gamma, skip.
struct Common {
  std::vector<float> w;
  float gamma = 1.0f;
  bool skip = false;
};

Common common(const Tensor& weights, int64_t C, double gamma, const OptTensor& gamma_tensor, const Tensor& out,
              int64_t N, const OptTensor& skip, const char* op) {
  TORCH_CHECK(weights.device().is_cpu() && weights.dim() == 1 && weights.size(0) == C, op,
              ": weights must be a [", C, "] CPU tensor, got ", weights.sizes(), " on ", weights.device());
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 1 && out.is_contiguous() &&
                  out.numel() == N,
              op, ": out must be a contiguous [", N, "] float32 CPU tensor, got ", out.scalar_type(), " ",
              out.sizes());
  Common c;
  const Tensor w = weights.to(at::kFloat).contiguous();
  c.w.assign(w.const_data_ptr<float>(), w.const_data_ptr<float>() + C);
  c.gamma = gamma_tensor.has_value() ? gamma_tensor->to(at::kFloat).item<float>() : static_cast<float>(gamma);
  c.skip = skip.has_value() && skip->reshape({-1})[0].item<double>() != 0.0;
  return c;
}

// Runs fn(chunk) for the chunks [0, nc) (of `cols` columns each) in parallel, each thread
// a consecutive range of at least kMinColumnsPerThread columns.
template <typename F>
void parallel_chunks(int64_t nc, int64_t cols, const F& fn) {
  const int64_t grain = std::max<int64_t>(1, kMinColumnsPerThread / std::max<int64_t>(cols, 1));
  at::parallel_for(0, nc, grain, [&](int64_t c0, int64_t c1) {
    std::vector<float> acc(cols), v(cols);
    for (int64_t c = c0; c < c1; ++c) fn(c, acc.data(), v.data());
  });
}

// q_i = sum over chunks (in order) of part[c][i]; Q likewise.
std::tuple<Tensor, Tensor> finish(const std::vector<float>& part, const std::vector<float>& total, int64_t nc,
                                  int64_t C) {
  Tensor q = at::zeros({C}, at::kFloat), Q = at::zeros({}, at::kFloat);
  float* qp = q.data_ptr<float>();
  float sum = 0.0f;
  for (int64_t c = 0; c < nc; ++c) {
    for (int64_t i = 0; i < C; ++i) qp[i] = qp[i] + part[c * C + i];
    sum = sum + total[c];
  }
  Q.fill_(sum);
  return {q, Q};
}

std::tuple<Tensor, Tensor> block_decode_aggregate_cpu(at::TensorList codes, at::TensorList scales, int64_t kind,
                                                      int64_t block, int64_t numel, const Tensor& weights,
                                                      double gamma, const OptTensor& gamma_tensor, const Tensor& out,
                                                      const OptTensor& skip) {
  const char* op = "fedopt_C::block_decode_aggregate";
  const int64_t C = static_cast<int64_t>(codes.size()), N = numel;
  TORCH_CHECK(kind >= 0 && kind <= 2, op, ": kind must be 0 (int8), 1 (int4) or 2 (fp8), got ", kind);
  TORCH_CHECK(block > 0 && block % 32 == 0, op, ": block must be a positive multiple of 32, got ", block);
  TORCH_CHECK(static_cast<int64_t>(scales.size()) == C, op, ": one scales tensor per client: ", C, " codes, ",
              scales.size(), " scales");
  const int64_t nb = (N + block - 1) / block, code_len = kind == 1 ? (N + 1) / 2 : N;
  std::vector<const uint8_t*> cp(C);
  std::vector<const float*> sp(C);
  for (int64_t i = 0; i < C; ++i) {
    check_flat(codes[i], kind == 0 ? at::kChar : at::kByte, op, "codes", i);
    TORCH_CHECK(codes[i].numel() == code_len, op, ": codes[", i, "] must have ", code_len, " elements, got ",
                codes[i].numel());
    check_flat(scales[i], at::kFloat, op, "scales", i);
    TORCH_CHECK(scales[i].numel() == nb, op, ": scales[", i, "] must have ", nb, " elements, got ",
                scales[i].numel());
    cp[i] = static_cast<const uint8_t*>(codes[i].const_data_ptr());
    sp[i] = scales[i].const_data_ptr<float>();
  }
  const Common cm = common(weights, C, gamma, gamma_tensor, out, N, skip, op);
  if (cm.skip) return {at::zeros({C}, at::kFloat), at::zeros({}, at::kFloat)};
  const int64_t cols = block * std::max<int64_t>(1, kChunkColumns / block);
  const int64_t nc = (N + cols - 1) / cols;
  std::vector<float> part(nc * C), total(nc);
  const Loops& L = loops();
  const float* lut = fp8_table();
  float* o = out.data_ptr<float>();
  const bool stream = kind != 1 && N >= kStreamColumns && reinterpret_cast<uintptr_t>(o) % 64 == 0;
  parallel_chunks(nc, cols, [&](int64_t c, float* acc, float*) {
    const int64_t j0 = c * cols, len = std::min(cols, N - j0);
    std::vector<float> lanes((C + 1) * DEFAULT::kLanes, 0.0f);  // each client's, then acc's
    float* tot = lanes.data() + C * DEFAULT::kLanes;
    L.decode_chunk(static_cast<int>(kind), C, cp.data(), sp.data(), cm.w.data(), block, j0, len, lut, cm.gamma,
                   stream, lanes.data(), tot, acc, o + j0);
    for (int64_t i = 0; i < C; ++i) part[c * C + i] = L.add_lanes(lanes.data() + i * DEFAULT::kLanes);
    total[c] = L.add_lanes(tot);
  });
  return finish(part, total, nc, C);
}

std::tuple<Tensor, Tensor> topk_decode_aggregate_cpu(at::TensorList values, at::TensorList indices, int64_t numel,
                                                     const Tensor& weights, double gamma,
                                                     const OptTensor& gamma_tensor, const Tensor& out,
                                                     const OptTensor& skip) {
  const char* op = "fedopt_C::topk_decode_aggregate";
  const int64_t C = static_cast<int64_t>(values.size()), N = numel;
  TORCH_CHECK(static_cast<int64_t>(indices.size()) == C, op, ": one indices tensor per client: ", C, " values, ",
              indices.size(), " indices");
  std::vector<const float*> vp(C);
  std::vector<const int64_t*> ip(C);
  std::vector<int64_t> k(C);
  for (int64_t i = 0; i < C; ++i) {
    check_flat(values[i], at::kFloat, op, "values", i);
    check_flat(indices[i], at::kLong, op, "indices", i);
    TORCH_CHECK(values[i].numel() == indices[i].numel(), op, ": values[", i, "] and indices[", i,
                "] must have the same length, got ", values[i].numel(), " and ", indices[i].numel());
    vp[i] = values[i].const_data_ptr<float>();
    ip[i] = indices[i].const_data_ptr<int64_t>();
    k[i] = values[i].numel();
    // memory safety of the scatter: strictly increasing, in [0, N)
    for (int64_t t = 0; t < k[i]; ++t) {
      TORCH_CHECK(ip[i][t] >= 0 && ip[i][t] < N && (t == 0 || ip[i][t] > ip[i][t - 1]), op, ": indices[", i,
                  "] must be strictly increasing in [0, ", N, "), got ", ip[i][t], " at position ", t);
    }
  }
  const Common cm = common(weights, C, gamma, gamma_tensor, out, N, skip, op);
  if (cm.skip) return {at::zeros({C}, at::kFloat), at::zeros({}, at::kFloat)};
  const int64_t cols = kChunkColumns, nc = (N + cols - 1) / cols;
  std::vector<float> part(nc * C), total(nc);
  const Loops& L = loops();
  float* o = out.data_ptr<float>();
  parallel_chunks(nc, cols, [&](int64_t c, float* acc, float*) {
    const int64_t j0 = c * cols, len = std::min(cols, N - j0);
    std::fill(acc, acc + len, 0.0f);
    for (int64_t i = 0; i < C; ++i) {
      const int64_t lo = std::lower_bound(ip[i], ip[i] + k[i], j0) - ip[i];
      const int64_t hi = std::lower_bound(ip[i] + lo, ip[i] + k[i], j0 + len) - ip[i];
      part[c * C + i] = L.sum_squares(vp[i] + lo, hi - lo);
      if (cm.w[i] != 0.0f) L.scatter_axpy(cm.w[i], vp[i] + lo, ip[i] + lo, hi - lo, j0, acc);
    }
    total[c] = L.sum_squares(acc, len);
    L.scale_into(cm.gamma, acc, len, o + j0);
  });
  return finish(part, total, nc, C);
}

}  // namespace
// block_quantize's kind 2, the fp8 encode: csrc/cpu/compressed_encode.cpp.
void fp8_block_encode_into_cpu(const Tensor& x, int64_t block, Tensor& codes, Tensor& scales);
namespace {

// python_ref/compression.py's STREAM_ROUNDING: the Philox counter's last word.
constexpr uint32_t kStreamRounding = 0x51;

void check_block_quantize_args(const char* op, const Tensor& x, int64_t kind, int64_t block, bool stochastic,
                               int64_t key, int64_t client) {
  TORCH_CHECK(kind == 0 || kind == 1 || kind == 2, op, ": kind must be 0 (int8), 1 (int4) or 2 (fp8), got ", kind);
  TORCH_CHECK(block > 0 && block % 32 == 0, op, ": block must be a positive multiple of 32, got ", block);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 1 && x.is_floating_point(), op,
              ": x must be a 1-D floating-point CPU tensor, got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(key >= 0, op, ": key must be in [0, 2^63), got ", key);
  TORCH_CHECK(kind != 2 || !stochastic, op, ": stochastic rounding is defined for int8 and int4, not fp8 (kind 2)");
  (void)client;  // any value: the low 32 bits are Philox's counter word (the Python layer checks the range)
}

// The encode into given outputs (checked by the callers): the one implementation of both ops.
void block_quantize_write(const Tensor& x, int64_t kind, int64_t block, bool stochastic, int64_t key, int64_t client,
                          Tensor& codes, Tensor& scales) {
  if (kind == 2) {  // fp8 (compressed_encode.cpp)
    fp8_block_encode_into_cpu(x, block, codes, scales);
    return;
  }
  const Tensor xf = x.to(at::kFloat).contiguous();  // fp16 / bf16 widen exactly; fp64 rounds once
  const int64_t N = xf.numel(), nb = (N + block - 1) / block;
  const float* xp = xf.const_data_ptr<float>();
  float* sp = scales.data_ptr<float>();
  uint8_t* cp = static_cast<uint8_t*>(codes.data_ptr());
  const float qmax = kind == 0 ? 127.0f : 7.0f;
  const Loops& L = loops();
  const int64_t grain = std::max<int64_t>(1, kMinColumnsPerThread / block);
  at::parallel_for(0, nb, grain, [&](int64_t b0, int64_t b1) {
    std::vector<int8_t> q(kind == 1 ? block : 0);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t j0 = b * block, len = std::min(block, N - j0);
      int8_t* dst = kind == 0 ? reinterpret_cast<int8_t*>(cp) + j0 : q.data();
      sp[b] = L.quantize_block(xp + j0, len, qmax, stochastic, static_cast<uint64_t>(key), j0,
                               static_cast<uint32_t>(client), kStreamRounding, dst);
      if (kind == 1) {  // two nibbles per byte, low first (j0 is even: blocks are multiples of 32)
        uint8_t* out = cp + j0 / 2;
        const int64_t pairs = len / 2;
        for (int64_t m = 0; m < pairs; ++m)  // no branch: vectorised (a conditional high nibble kept it scalar)
          out[m] = static_cast<uint8_t>((static_cast<uint8_t>(q[2 * m]) & 0xF) |
                                        ((static_cast<uint8_t>(q[2 * m + 1]) & 0xF) << 4));
        if (len % 2) out[pairs] = static_cast<uint8_t>(q[len - 1]) & 0xF;  // the vector's odd last value
      }
    }
  });
}

std::tuple<Tensor, Tensor> block_quantize_cpu(const Tensor& x, int64_t kind, int64_t block, bool stochastic,
                                              int64_t key, int64_t client) {
  check_block_quantize_args("fedopt_C::block_quantize", x, kind, block, stochastic, key, client);
  auto [codes, scales] = fedopt::empty_block_encode_outputs(x, kind, block);
  block_quantize_write(x, kind, block, stochastic, key, client, codes, scales);
  return {codes, scales};
}

void block_quantize_into_cpu(const Tensor& x, int64_t kind, int64_t block, bool stochastic, int64_t key,
                             int64_t client, Tensor codes, Tensor scales) {
  const char* op = "fedopt_C::block_quantize_into";
  check_block_quantize_args(op, x, kind, block, stochastic, key, client);
  check_block_encode_outputs(op, x, kind, block, codes, scales);
  block_quantize_write(x, kind, block, stochastic, key, client, codes, scales);
}

}  // namespace
}  // namespace fedopt::cpu::compressed

TORCH_LIBRARY_IMPL(fedopt_C, CPU, m) {
  m.impl("block_quantize", &fedopt::cpu::compressed::block_quantize_cpu);
  m.impl("block_quantize_into", &fedopt::cpu::compressed::block_quantize_into_cpu);
  m.impl("block_decode_aggregate", &fedopt::cpu::compressed::block_decode_aggregate_cpu);
  m.impl("topk_decode_aggregate", &fedopt::cpu::compressed::topk_decode_aggregate_cpu);
}
