// The client's fp8 encode, one block at a time (included once per ISA level by
// compressed_encode.cpp, inside that level's namespace; no include guard on purpose).
// Oracle: python_ref/compression.py fp8_encode.

#include "block_absmax.h"  // block_absmax_or_nan (shared with the int8/int4 encode)

// Codes (float8_e4m3fn bits) of the `len` values x[0, len) of one block: the scale
// s = max|x| / 448 (returned; the quiet NaN when the block holds a NaN, +Inf when it holds an Inf
// and no NaN), t = x / s (+0 when s == 0), clamped to [-448, 448] with a NaN kept (the
// NaN code 0x7F / 0xFF, with the sign of the NaN the division gave, as torch's division
// gives it on this CPU), then rounded to e4m3fn half to even (fp8_e4m3.h).
inline float fp8_encode_block(const float* x, int64_t len, uint8_t* codes) {
  // torch's amax returns the canonical quiet NaN whatever NaN the block holds (a bf16 NaN
  // widens to 0x7FFF0000): so does this, for the scale's bits to be python_ref's
  float amax = block_absmax_or_nan(x, len);
  if (amax != amax) amax = fp8::bits_float(0x7FC00000u);
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
