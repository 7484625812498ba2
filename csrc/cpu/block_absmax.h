// max |x_t| of one block for the CPU encodes (int8/int4: compressed_kernels.h, fp8:
// compressed_encode_kernels.h), included inside each ISA level's namespace (no include
// guard on purpose, as those headers).
//
// Returns max |x_t| if the block holds no NaN, else NaN (the callers then take their
// own rule: int8/int4 their scalar loop, which puts that NaN's bits into the scale; fp8
// the canonical NaN, as torch's amax).  Lane-wise in GCC vector types: each lane keeps
// `a > m ? a : m` (vmaxps's own semantics) and a NaN lane is flagged apart -- a NaN-aware
// conditional reduction in one scalar loop kept GCC from vectorising (~2 ns a value).
// The lanes' maxima combine in any order: a max of non-NaN values never holds -0 (m
// starts at +0 and only grows strictly), so the value is that of any scalar order.
inline float block_absmax_or_nan(const float* x, int64_t len) {
  constexpr int64_t kAbsmaxLanes = 16;  // one zmm of fp32 (two ymm, four xmm)
  typedef float F32xA __attribute__((vector_size(4 * kAbsmaxLanes)));
  typedef int32_t I32xA __attribute__((vector_size(4 * kAbsmaxLanes)));
  F32xA m = {};
  I32xA nan = {};
  int64_t t = 0;
  for (; t + kAbsmaxLanes <= len; t += kAbsmaxLanes) {
    F32xA v;
    __builtin_memcpy(&v, x + t, sizeof(v));
    const F32xA a = v < 0.0f ? -v : v;
    m = a > m ? a : m;
    nan |= a != a;
  }
  float amax = 0.0f;
  bool any_nan = false;
  for (int64_t l = 0; l < kAbsmaxLanes; ++l) {
    amax = m[l] > amax ? m[l] : amax;
    any_nan = any_nan || nan[l] != 0;
  }
  for (; t < len; ++t) {
    const float a = x[t] < 0.0f ? -x[t] : x[t];
    amax = a > amax ? a : amax;
    any_nan = any_nan || a != a;
  }
  return any_nan ? __builtin_nanf("") : amax;
}
