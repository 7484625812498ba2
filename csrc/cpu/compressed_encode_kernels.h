// The client's fp8 encode, one block at a time (included once per ISA level by
// compressed_encode.cpp, inside that level's namespace; no include guard on purpose).
// Oracle: python_ref/compression.py fp8_encode.

constexpr int64_t kFp8Lanes = 16;  // one zmm of fp32; the amax below is per lane, then folded

// Codes (float8_e4m3fn bits) of the `len` values x[0, len) of one block: the scale
// s = max|x| / 448 (returned; the quiet NaN when the block holds a NaN, +Inf when it holds an Inf
// and no NaN), t = x / s (+0 when s == 0), clamped to [-448, 448] with a NaN kept (the
// NaN code 0x7F / 0xFF, with the sign of the NaN the division gave, as torch's division
// gives it on this CPU), then rounded to e4m3fn half to even (fp8_e4m3.h).
inline float fp8_encode_block(const float* x, int64_t len, uint8_t* codes) {
  // max |x| lane-wise in GCC vector types (|x| by clearing the sign bit, as torch.abs
  // does, a NaN's sign too): each lane keeps `a > m ? a : m`, a NaN lane is flagged apart
  // (a conditional reduction with the NaN inside it kept the loop scalar: ~2 ns a value).
  // max is exact in any order, so the lanes combine in any order.
  typedef float F32xV __attribute__((vector_size(4 * kFp8Lanes)));
  typedef uint32_t U32xV __attribute__((vector_size(4 * kFp8Lanes)));
  typedef int32_t I32xV __attribute__((vector_size(4 * kFp8Lanes)));
  F32xV m = {};
  I32xV nan = {};
  int64_t t = 0;
  for (; t + kFp8Lanes <= len; t += kFp8Lanes) {
    U32xV u;
    __builtin_memcpy(&u, x + t, sizeof(u));
    u &= 0x7FFFFFFFu;
    F32xV a;
    __builtin_memcpy(&a, &u, sizeof(a));
    m = a > m ? a : m;
    nan |= a != a;
  }
  float amax = 0.0f;
  bool any_nan = false;
  for (int64_t l = 0; l < kFp8Lanes; ++l) {
    amax = m[l] > amax ? m[l] : amax;
    any_nan = any_nan || nan[l] != 0;
  }
  for (; t < len; ++t) {
    const float a = fp8::bits_float(fp8::float_bits(x[t]) & 0x7FFFFFFFu);
    amax = a > amax ? a : amax;
    any_nan = any_nan || a != a;
  }
  // torch's amax returns the canonical quiet NaN whatever NaN the block holds (a bf16 NaN
  // widens to 0x7FFF0000): so does this, for the scale's bits to be python_ref's
  if (any_nan) amax = fp8::bits_float(0x7FC00000u);
  const float s = amax / 448.0f;
  if (s == 0.0f) {  // python_ref divides by 1 where s == 0 and then takes +0: code 0
    for (int64_t u = 0; u < len; ++u) codes[u] = 0;
    return s;
  }
  for (int64_t u = 0; u < len; ++u) {  // no branch: vectorised
    float v = x[u] / s;
    v = v > 448.0f ? 448.0f : (v < -448.0f ? -448.0f : v);  // a NaN passes through
    codes[u] = fp8::e4m3fn_bits(v);
  }
  return s;
}
