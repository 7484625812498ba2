// Baseline build of the CPU kernels (x86-64 SSE2, aarch64 NEON: at::vec's DEFAULT), and
// the run-time choice among the builds.
#include "isa_prologue.h"

#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#include "kernels.h"

#include <string>

#include <ATen/Version.h>

namespace fedopt::cpu {

const KernelTable* kernels_default() { return &DEFAULT::kTable; }

// Follows torch's own choice for its CPU kernels (cpuinfo, capped by the
// ATEN_CPU_CAPABILITY environment variable), made once per process.
const KernelTable& kernels() {
  static const KernelTable* const table = [] {
    const std::string cap = at::get_cpu_capability();
    const KernelTable* t = nullptr;
    if (cap == "AVX512") t = kernels_avx512();
    if (t == nullptr && (cap == "AVX512" || cap == "AVX2")) t = kernels_avx2();
    return t != nullptr ? t : kernels_default();
  }();
  return *table;
}

}  // namespace fedopt::cpu
