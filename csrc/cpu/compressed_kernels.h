// Inner loops of the compressed decode-aggregate (compressed_aggregate.cpp), compiled
// once per instruction set: that file includes this header three times, inside
// namespaces DEFAULT, AVX2 and AVX512 under `#pragma GCC target`, as isa_*.cpp compile
// kernels.h (the namespace names are what tests/test_cpu_kernels.py looks for).  Plain
// loops the compiler vectorises; no includes here (everything is included before the
// target switches, see isa_prologue.h, 2; nor std:: templates, whose out-of-line copy
// could be compiled for the AVX target).  No contraction (the including file turns
// it off): every build gives the same bits.
//
// The lane layout of the sums is the one of kernels.h: element t of a run goes to lane
// t mod kLanes, and the lanes are added in a fixed tree, whatever the vector width.

constexpr int64_t kLanes = 16;

// v[t] = s_b * q[t] for the columns [0, len) of one chunk starting at a block boundary
// (block `block`, scales `s` of the chunk's first block on).  kind 0: int8 codes; 1:
// int4, two per byte (low nibble first; `codes` is the chunk's first byte, even
// column); 2: fp8 e4m3fn bytes, decoded through `lut`.
inline void decode_chunk(int kind, const uint8_t* codes, const float* s, int64_t block, int64_t len,
                         const float* lut, float* v) {
  for (int64_t b0 = 0; b0 < len; b0 += block) {
    const float sb = s[b0 / block];
    const int64_t e = b0 + block < len ? b0 + block : len;  // no std::min: see the top
    if (kind == 0) {
      const int8_t* q = reinterpret_cast<const int8_t*>(codes);
      for (int64_t t = b0; t < e; ++t) v[t] = sb * static_cast<float>(q[t]);
    } else if (kind == 1) {
      const int64_t pairs = (e - b0) / 2;  // b0 is even (blocks are multiples of 32)
      const uint8_t* q = codes + b0 / 2;
      float* o = v + b0;
      for (int64_t m = 0; m < pairs; ++m) {
        const int8_t byte = static_cast<int8_t>(q[m]);
        o[2 * m] = sb * static_cast<float>(static_cast<int8_t>(byte << 4) >> 4);
        o[2 * m + 1] = sb * static_cast<float>(byte >> 4);
      }
      if ((e - b0) % 2) o[2 * pairs] = sb * static_cast<float>(static_cast<int8_t>(static_cast<int8_t>(q[pairs]) << 4) >> 4);
    } else {
      for (int64_t t = b0; t < e; ++t) v[t] = sb * lut[codes[t]];
    }
  }
}

// acc[t] = acc[t] + w * v[t]
inline void axpy(float w, const float* v, int64_t len, float* acc) {
  for (int64_t t = 0; t < len; ++t) acc[t] = acc[t] + w * v[t];
}

// acc[idx[t] - c0] += w * val[t] for t in [0, k): the top-k values of one client that
// fall into a chunk (indices strictly increasing: no two writes to one column).
inline void scatter_axpy(float w, const float* val, const int64_t* idx, int64_t k, int64_t c0, float* acc) {
  for (int64_t t = 0; t < k; ++t) acc[idx[t] - c0] = acc[idx[t] - c0] + w * val[t];
}

// sum_t v[t]^2 in the fixed lane layout.
inline float sum_squares(const float* v, int64_t len) {
  float lanes[kLanes] = {};
  int64_t t = 0;
  for (; t + kLanes <= len; t += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] = lanes[l] + v[t + l] * v[t + l];
  for (int64_t l = 0; t + l < len; ++l) lanes[l] = lanes[l] + v[t + l] * v[t + l];
  for (int64_t h = kLanes / 2; h >= 1; h /= 2)
    for (int64_t l = 0; l < h; ++l) lanes[l] = lanes[l] + lanes[l + h];
  return lanes[0];
}

// out[t] = gamma * acc[t]
inline void scale_into(float gamma, const float* acc, int64_t len, float* out) {
  for (int64_t t = 0; t < len; ++t) out[t] = gamma * acc[t];
}
