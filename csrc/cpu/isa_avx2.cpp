// AVX2 build of the CPU kernels (torch's AVX2 level: AVX2 + FMA + F16C; Haswell, Zen
// and later).  Selected at run time by kernels() (isa_default.cpp).  The build itself
// is isa_avx.h, shared with isa_avx512.cpp.
#define FEDOPT_AVX512 0
#include "isa_avx.h"
