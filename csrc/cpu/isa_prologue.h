// First include of every isa_*.cpp (the per-instruction-set builds of kernels.h).
//
// 1. No floating-point contraction.  GCC fuses a * b + c into an FMA whenever the
//    target has one (x86 with FMA/AVX-512, every aarch64), even in ISO mode.  The
//    kernels keep python_ref's separately rounded operations instead, so that all ISAs
//    (SSE2 has no FMA) give bitwise identical results and an unclipped step matches
//    python_ref exactly.  The kernels are memory-bound: FMA would buy no speed.
// 2. Headers whose inline functions are shared with the rest of the library are
//    included here, before isa_avx.h (isa_avx2.cpp, isa_avx512.cpp) switches the
//    compiler's target: an out-of-line copy of, say, c10::Half's conversion compiled
//    for AVX2 could otherwise be the copy the linker keeps for every caller (a crash on
//    a CPU without AVX2).  The kernels themselves have internal linkage, and
//    at::vec's per-ISA code lives in its own inline namespace (at::vec::AVX2, ...), so
//    nothing else can collide.
//    tests/test_cpu_kernels.py checks the built library for VEX/EVEX instructions
//    outside those namespaces.
// 3. No trapping floating point, no errno from math functions (GCC's no-trapping-math,
//    no-math-errno).  Neither changes a value: the first lets GCC assume that no
//    floating-point exception traps (none is ever unmasked here), so that it may
//    evaluate both sides of a select and compare floats inside a vectorised loop; the
//    second only drops the errno write of, e.g., sqrt of a negative number (the result
//    is IEEE's NaN either way).  Without no-trapping-math GCC 12 does not vectorise the
//    lane loop of the Gaussian noise (noise_kernels.h) in the AVX2 and DEFAULT builds
//    ("control flow in loop": the selects of the polynomials' ranges stay branches);
//    with it the loop is vectorised 16 / 8 / 4 lanes wide (AVX-512 / AVX2 / SSE2; checked
//    with -fopt-info-vec).  GCC 12 ignores no-math-errno for builtins given this way (a
//    __builtin_sqrtf still has its errno branch), so the noise takes its square roots
//    with at::vec outside that loop; the option stays for compilers that honour it.
#pragma once

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off", "no-math-errno", "no-trapping-math")
#endif

// at::vec's headers are written for torch's own flags (-Wno-unknown-pragmas for its
// `#pragma unroll`, -Wno-psabi for vector-passing helpers, -Wno-maybe-uninitialized for
// GCC's AVX-512 intrinsics).  GCC < 13 ignores the first one as a pragma in C++ (GCC bug
// 53431), so a -Wall build with GCC 12 still lists ~24 "ignoring #pragma unroll"
// warnings per isa_*.cpp; -Wno-unknown-pragmas in setup.py would silence them.
#if defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wunknown-pragmas"
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/irange.h>

// Not math.h: its templates must be instantiated with the TU's target so that the
// at::vec operators they call can be inlined (kernels.h includes it, via kernel_api.h).
#include <fedopt/chunks.h>

// The AVX2 / AVX-512 builds need GCC's `#pragma GCC target` (x86-64 only).  Elsewhere
// (aarch64, clang, MSVC) only the baseline build exists, which at::vec still
// vectorizes for the architecture's baseline (SSE2, NEON).
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#define FEDOPT_X86_ISA 1
#else
#define FEDOPT_X86_ISA 0
#endif
