// Baseline build of the CPU kernels (x86-64 SSE2, aarch64 NEON: at::vec's DEFAULT), and
// the run-time choice among the builds.
//
// Why three builds of kernels.h.  An extension compiled with default flags gets
// at::vec's generic DEFAULT code; this file is that build, isa_avx2.cpp and
// isa_avx512.cpp compile the same kernels for torch's AVX2 and AVX512 levels (via
// `#pragma GCC target`, see isa_prologue.h for what that takes).  What each build buys
// (medians per ISA and dtype: docs/benchmarks.md, "CPU kernels"): fp32 is memory-bound in every build (the AVX builds gain ~20%); fp16/bf16 are not:
// without F16C the DEFAULT build converts halves one at a time in software, 20x
// slower.  AVX-512 over AVX2 gains 25% on bf16 and 20% on fp16 steps, so all three
// stay.  The cost: three compilations of the kernels (~15 s each) and the rules in
// isa_prologue.h.  (GCC target_clones was the alternative; it cannot switch at::vec's
// per-ISA classes, which are chosen by macros at preprocessing time.)
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
