// AVX-512 build of the CPU kernels (torch's AVX512 level: F, BW, VL, DQ + FMA;
// Skylake-X, Zen 4 and later).  Selected at run time by kernels() (isa_default.cpp).
#include "isa_prologue.h"

#if FEDOPT_X86_ISA
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
// GCC's C++ front end does not define the feature macros of `#pragma GCC target`;
// sleef.h (included by at::vec) declares its vector entry points only under them.
#ifndef __AVX__
#define __AVX__ 1
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#endif
#ifndef __FMA__
#define __FMA__ 1
#endif
#ifndef __F16C__
#define __F16C__ 1
#endif
#ifndef __AVX512F__
#define __AVX512F__ 1
#endif
#ifndef __AVX512BW__
#define __AVX512BW__ 1
#endif
#ifndef __AVX512VL__
#define __AVX512VL__ 1
#endif
#ifndef __AVX512DQ__
#define __AVX512DQ__ 1
#endif
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#include "kernels.h"
#pragma GCC pop_options

const fedopt::cpu::KernelTable* fedopt::cpu::kernels_avx512() { return &AVX512::kTable; }
#else
#include "kernel_api.h"
const fedopt::cpu::KernelTable* fedopt::cpu::kernels_avx512() { return nullptr; }
#endif
