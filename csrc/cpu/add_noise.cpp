// CPU kernel of fedopt_C::add_noise_ (schema and semantics: csrc/registration.cpp;
// oracle: python_ref/gaussian_noise.py): out[j] += std * normal(key, j), in place, the
// separate form of the noise that aggregate adds in its epilogue.
//
// The vector is cut into fixed chunks of kNoiseChunk elements, spread over torch's
// threads; every element depends on (key, j) alone, so the bits depend neither on the
// thread count nor on the instruction set (noise_kernels.h).
#include <optional>

#include <torch/library.h>

#include "ops_common.h"

namespace fedopt::cpu {
namespace {

using at::Tensor;

// Elements per chunk: a whole number of blocks of either acc type, and large enough
// that the per-chunk cost (a dispatch on the dtype) vanishes.
constexpr int64_t kNoiseChunk = int64_t(1) << 16;

template <typename acc_t>
void run_add_noise(const Tensor& out, uint64_t key, acc_t std_dev) {
  const int64_t n = out.numel();
  NoiseArgs<acc_t> args;
  args.kind = scalar_kind(out.scalar_type());
  args.out = out.data_ptr();
  args.n = n;
  args.chunk = kNoiseChunk;
  args.key = key;
  args.std_dev = std_dev;
  const int64_t nc = (n + kNoiseChunk - 1) / kNoiseChunk;
  const Kernels<acc_t>& k = kernels().get<acc_t>();
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerThread / kNoiseChunk);
  at::parallel_for(0, nc, grain, [&](int64_t c0, int64_t c1) { k.add_noise(args, c0, c1); });
}

void add_noise_cpu(const Tensor& out, int64_t noise_key, double noise_std,
                   const std::optional<Tensor>& noise_std_tensor, const std::optional<Tensor>& skip) {
  const char* op = "fedopt_C::add_noise_";
  TORCH_CHECK(out.defined(), op, ": out must be a tensor");
  check_supported_float(op, "out", out.scalar_type());
  TORCH_CHECK(out.device().is_cpu(), op, ": out must be a CPU tensor, got ", out.device());
  TORCH_CHECK(out.dim() == 1 && out.is_contiguous(), op, ": out must be a contiguous 1-D tensor, got sizes ",
              out.sizes(), " strides ", out.strides());
  check_noise(op, noise_key, noise_std_tensor);
  if (skip.has_value() && skip->defined()) {
    TORCH_CHECK(skip->numel() == 1 && skip->device().is_cpu(), op, ": skip must be a one-element CPU tensor");
    if (skip->item<bool>()) return;
  }
  if (out.scalar_type() == at::kDouble) {
    run_add_noise<double>(out, static_cast<uint64_t>(noise_key), noise_std_value<double>(noise_std, noise_std_tensor));
  } else {
    run_add_noise<float>(out, static_cast<uint64_t>(noise_key), noise_std_value<float>(noise_std, noise_std_tensor));
  }
}

}  // namespace
}  // namespace fedopt::cpu

TORCH_LIBRARY_IMPL(fedopt_C, CPU, m) { m.impl("add_noise_", &fedopt::cpu::add_noise_cpu); }
