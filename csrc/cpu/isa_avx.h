// The body of isa_avx2.cpp and isa_avx512.cpp, the builds of kernels.h that need
// `#pragma GCC target` (isa_prologue.h).  Each of the two files defines FEDOPT_AVX512
// (0 or 1) and includes this once; the per-ISA pieces (target, CPU_CAPABILITY, entry
// point, GCC's missing feature macros) are chosen by it below, so that the two builds
// cannot drift apart in anything but those.  No #pragma once: one include per TU.
#ifndef FEDOPT_AVX512
#error "isa_avx.h is included by isa_avx2.cpp / isa_avx512.cpp, which define FEDOPT_AVX512"
#endif

#include "isa_prologue.h"

#if FEDOPT_X86_ISA
#pragma GCC push_options
#if FEDOPT_AVX512
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#else
#pragma GCC target("avx2,fma,f16c")
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#endif

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
#if FEDOPT_AVX512
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
#endif

#include "kernels.h"
#pragma GCC pop_options
#define FEDOPT_AVX_TABLE (&CPU_CAPABILITY::kTable)
#else
#include "kernel_api.h"
#define FEDOPT_AVX_TABLE nullptr  // not built here: kernels() uses the baseline build
#endif

#if FEDOPT_AVX512
const fedopt::cpu::KernelTable* fedopt::cpu::kernels_avx512() { return FEDOPT_AVX_TABLE; }
#else
const fedopt::cpu::KernelTable* fedopt::cpu::kernels_avx2() { return FEDOPT_AVX_TABLE; }
#endif
