// First include of the compressed codecs' translation units (compressed_aggregate.cpp,
// compressed_encode.cpp), which compile their loops three times (DEFAULT, AVX2, AVX-512)
// under `#pragma GCC target`, as isa_*.cpp do: the sibling of isa_prologue.h (whose at::vec
// headers these files do not need), for its points 1 and 3.
//
// 1. No floating-point contraction: python_ref's separately rounded operations, the same
//    bits under every ISA (SSE2 has no FMA).
// 3. No trapping floating point: GCC may evaluate both sides of a select in a vectorised
//    loop; no value changes.
// And (its point 2) what the inner loops use is included here, before any target switch:
// <immintrin.h> (GCC's intrinsics carry their own target attributes), on x86 with GCC,
// where FEDOPT_COMPRESSED_X86 is 1 and the AVX2 / AVX-512 builds exist.
#pragma once

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off", "no-trapping-math")
#endif

#include <cstdint>

#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#define FEDOPT_COMPRESSED_X86 1
#include <immintrin.h>
#else
#define FEDOPT_COMPRESSED_X86 0
#endif
