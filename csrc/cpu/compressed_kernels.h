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

// One client's chunk in ONE pass: v = s_b * q decoded in registers, lanes[t mod kLanes] +=
// v^2 and (w != 0) acc[t] = acc[t] + w * v; the same operations, lane layout and order as
// a decode into a buffer, sum_squares of it and acc += w v (so the same bits), without the
// buffer round trip.  Written with GCC vector types of kLanes floats: each lane is one
// IEEE operation, so the DEFAULT build (four SSE registers per vector) and the AVX-512
// build (one zmm) give the same bits.  (The plain loops were left scalar by GCC's SLP
// vectoriser: 1.8 ns per value.)  The chunk starts at a block boundary and every block
// but the chunk's last is whole (a multiple of 32 values): only the chunk's end is ragged.
typedef float F32xL __attribute__((vector_size(4 * kLanes)));
typedef int32_t I32xL __attribute__((vector_size(4 * kLanes)));
typedef int8_t I8xL __attribute__((vector_size(kLanes)));
typedef int8_t I8xH __attribute__((vector_size(kLanes / 2)));

template <int kKind, bool kAdd>
inline void decode_accumulate_kind(const uint8_t* __restrict__ codes, const float* __restrict__ s, int64_t block,
                                   int64_t len, const float* __restrict__ lut, float w, float* __restrict__ acc,
                                   float* __restrict__ lanes_out) {
  F32xL lanes;
  __builtin_memcpy(&lanes, lanes_out, sizeof(lanes));
  for (int64_t b0 = 0; b0 < len; b0 += block) {
    const float sb = s[b0 / block];
    const int64_t e = b0 + block < len ? b0 + block : len;
    int64_t t = b0;
    for (; t + kLanes <= e; t += kLanes) {
      F32xL q;
      if (kKind == 0) {
        I8xL c;
        __builtin_memcpy(&c, codes + t, sizeof(c));
        q = __builtin_convertvector(__builtin_convertvector(c, I32xL), F32xL);
      } else if (kKind == 1) {
        I8xH b;
        __builtin_memcpy(&b, codes + t / 2, sizeof(b));
        const I8xH lo = (b << 4) >> 4, hi = b >> 4;  // arithmetic shifts: signed nibbles
        const I8xL c = __builtin_shufflevector(lo, hi, 0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
        q = __builtin_convertvector(__builtin_convertvector(c, I32xL), F32xL);
      } else {
        float g[kLanes];
        for (int64_t l = 0; l < kLanes; ++l) g[l] = lut[codes[t + l]];
        __builtin_memcpy(&q, g, sizeof(q));
      }
      const F32xL v = sb * q;
      lanes = lanes + v * v;
      if (kAdd) {
        F32xL a;
        __builtin_memcpy(&a, acc + t, sizeof(a));
        a = a + w * v;
        __builtin_memcpy(acc + t, &a, sizeof(a));
      }
    }
    for (int64_t l = 0; t + l < e; ++l) {  // the chunk's ragged end: lanes 0, 1, ... as sum_squares
      const int64_t j = t + l;
      float q;
      if (kKind == 0) {
        q = static_cast<float>(reinterpret_cast<const int8_t*>(codes)[j]);
      } else if (kKind == 1) {
        const int8_t byte = static_cast<int8_t>(codes[j / 2]);
        q = static_cast<float>(j % 2 ? byte >> 4 : static_cast<int8_t>(byte << 4) >> 4);
      } else {
        q = lut[codes[j]];
      }
      const float v = sb * q;
      lanes[l] = lanes[l] + v * v;
      if (kAdd) acc[j] = acc[j] + w * v;
    }
  }
  __builtin_memcpy(lanes_out, &lanes, sizeof(lanes));
}

// Returns the chunk's sum of v^2 (the lanes added in sum_squares' fixed tree).
inline float decode_accumulate(int kind, const uint8_t* codes, const float* s, int64_t block, int64_t len,
                               const float* lut, float w, float* acc) {
  float lanes[kLanes] = {};
  const bool add = w != 0.0f;
  if (kind == 0) {
    add ? decode_accumulate_kind<0, true>(codes, s, block, len, lut, w, acc, lanes)
        : decode_accumulate_kind<0, false>(codes, s, block, len, lut, w, acc, lanes);
  } else if (kind == 1) {
    add ? decode_accumulate_kind<1, true>(codes, s, block, len, lut, w, acc, lanes)
        : decode_accumulate_kind<1, false>(codes, s, block, len, lut, w, acc, lanes);
  } else {
    add ? decode_accumulate_kind<2, true>(codes, s, block, len, lut, w, acc, lanes)
        : decode_accumulate_kind<2, false>(codes, s, block, len, lut, w, acc, lanes);
  }
  for (int64_t h = kLanes / 2; h >= 1; h /= 2)
    for (int64_t l = 0; l < h; ++l) lanes[l] = lanes[l] + lanes[l + h];
  return lanes[0];
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

// ---------------------------------------------------------------------------------------
// The client's encode (block quantization to int8 / int4), one block at a time.

// x0 of Philox4x32-10 under `key` at counter (j lo, j hi, c2, c3): python_ref's
// philox4x32_10 step for step (gaussian_noise.h has the (j, 0, 0) form of the noise).
inline uint32_t philox_x0(uint64_t key, uint64_t j, uint32_t c2, uint32_t c3) {
  uint32_t c0 = static_cast<uint32_t>(j), c1 = static_cast<uint32_t>(j >> 32);
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
#pragma GCC unroll 10
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(p1);
    c3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c0;
}

// Codes of the `len` values x[0, len) of one block starting at element j0: the block's
// scale s = max|x| / qmax (returned), t = x / s (0 when s == 0), q = round half to even
// (the default rounding mode's nearbyint) or, stochastic, floor(t) + [u < t - floor(t)]
// with u = (x0 >> 8) 2^-24 of (key, j, client, stream); NaN to 0, clamped to [-qmax, qmax];
// into q[].
inline float quantize_block(const float* x, int64_t len, float qmax, bool stochastic, uint64_t key, int64_t j0,
                            uint32_t client, uint32_t stream, int8_t* q) {
  float amax = 0.0f;
  for (int64_t t = 0; t < len; ++t) {
    const float a = x[t] < 0.0f ? -x[t] : x[t];
    amax = a > amax || a != a ? a : amax;  // a NaN propagates into the scale (the validator's to refuse)
  }
  const float s = amax / qmax;
  for (int64_t t = 0; t < len; ++t) {
    const float v = s == 0.0f ? 0.0f : x[t] / s;
    float r;
    if (stochastic) {
      const float f = __builtin_floorf(v);
      const float u = static_cast<float>(static_cast<int32_t>(philox_x0(key, static_cast<uint64_t>(j0 + t), client, stream) >> 8)) * 0x1p-24f;
      r = f + (u < v - f ? 1.0f : 0.0f);
    } else {
      r = __builtin_nearbyintf(v);
    }
    r = r == r ? r : 0.0f;  // NaN (a NaN value, or a NaN scale) codes 0, as python_ref
    r = r > qmax ? qmax : (r < -qmax ? -qmax : r);
    q[t] = static_cast<int8_t>(r);
  }
  return s;
}
