// Streaming kernels of the CPU backend, compiled once per instruction set.
//
// Each isa_*.cpp defines CPU_CAPABILITY (DEFAULT, AVX2, AVX512) and the matching
// CPU_CAPABILITY_* macro, sets the compiler's target, and includes this file; it
// expands to the kernel table `fedopt::cpu::<CPU_CAPABILITY>::kTable` (kernel_api.h).
// All functions here have internal linkage, so the per-ISA copies can never be mixed
// up by the linker.
//
// Determinism.  Every sum is taken in a fixed logical layout that does not depend on
// the vector width: a chunk is read in blocks of kN = 128 bytes of acc_t (32 floats or
// 16 doubles) and element j of a block always goes to lane j; one 256-bit vector holds
// 8 of these lanes and one 512-bit vector 16, so the same kN lanes exist for every
// ISA.  At the end of a chunk the lanes are added in a fixed tree (reduce_lanes).  The
// ragged end of a chunk goes through a zero-filled block whose unused lanes are forced
// to +0 before they are summed.  The TUs are compiled without floating-point
// contraction (no FMA; isa_*.cpp), so the elementwise math is the separately rounded
// math of python_ref: every ISA gives bitwise the same results, and when the clip scale
// is exactly 1 the updated params match python_ref bit for bit.  One exception, NaN
// payloads: a NaN stored as bfloat16 is 0x7fc0 in the baseline build (c10's scalar
// conversion) and 0xffff in the AVX2/AVX-512 builds (at::vec's vector conversion);
// both are NaN (the cross-build test, tests/test_cpu_kernels.py, compares finite data).
//
// The kernels are written one family per header (vec_block.h: the shared block and
// dispatch; noise_kernels.h: the DP noise; nar_kernels.h, client_rows_kernels.h,
// server_update_kernels.h, robust_kernels.h); this file puts them together into the
// build's kernel table.
#pragma once

#ifndef CPU_CAPABILITY
#error "kernels.h is included by isa_*.cpp, which define CPU_CAPABILITY"
#endif

#include "kernel_api.h"
#include "vec_block.h"
#include "noise_kernels.h"
#include "nar_kernels.h"
#include "client_rows_kernels.h"
#include "server_update_kernels.h"
#include "robust_kernels.h"

namespace fedopt::cpu::CPU_CAPABILITY {

constexpr KernelTable kTable = {
    C10_STRINGIZE(CPU_CAPABILITY),
    {&nar_norm_pass<float>, &nar_update_pass<float>, &aggregate_pass<float>, &client_dots_pass<float>,
     &server_update_pass<float>, &gram_pass<float>,
     &select_pass<float>, &add_noise_pass<float>},
    {&nar_norm_pass<double>, &nar_update_pass<double>, &aggregate_pass<double>, &client_dots_pass<double>,
     &server_update_pass<double>, &gram_pass<double>,
     &select_pass<double>, &add_noise_pass<double>},
};

}  // namespace fedopt::cpu::CPU_CAPABILITY
