// AVX-512 build of the CPU kernels (torch's AVX512 level: F, BW, VL, DQ + FMA;
// Skylake-X, Zen 4 and later).  Selected at run time by kernels() (isa_default.cpp).
// The build itself is isa_avx.h, shared with isa_avx2.cpp.
#define FEDOPT_AVX512 1
#include "isa_avx.h"
