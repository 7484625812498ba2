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
  float lanes[kFp8Lanes] = {};
  int64_t t = 0;
  // max is exact in any order; a NaN, once in a lane, stays there (a > NaN is false), so
  // the scale is NaN iff the block holds one.  |x| by clearing the sign bit, as
  // torch.abs does (a NaN's sign too).
  for (; t + kFp8Lanes <= len; t += kFp8Lanes)
    for (int64_t l = 0; l < kFp8Lanes; ++l) {
      const float a = fp8::bits_float(fp8::float_bits(x[t + l]) & 0x7FFFFFFFu);
      lanes[l] = a > lanes[l] || a != a ? a : lanes[l];
    }
  for (int64_t l = 0; t + l < len; ++l) {
    const float a = fp8::bits_float(fp8::float_bits(x[t + l]) & 0x7FFFFFFFu);
    lanes[l] = a > lanes[l] || a != a ? a : lanes[l];
  }
  float amax = lanes[0];
  for (int64_t l = 1; l < kFp8Lanes; ++l) amax = lanes[l] > amax || lanes[l] != lanes[l] ? lanes[l] : amax;
  // torch's amax returns the canonical quiet NaN whatever NaN the block holds (a bf16 NaN
  // widens to 0x7FFF0000): so does this, for the scale's bits to be python_ref's
  if (amax != amax) amax = fp8::bits_float(0x7FC00000u);
  const float s = amax / 448.0f;
  const float safe = s == 0.0f ? 1.0f : s;  // python_ref divides by 1 where s == 0 and then takes 0
  for (int64_t u = 0; u < len; ++u) {
    float v = s == 0.0f ? 0.0f : x[u] / safe;
    v = v > 448.0f ? 448.0f : (v < -448.0f ? -448.0f : v);  // a NaN passes through
    codes[u] = fp8::e4m3fn_bits(v);
  }
  return s;
}
