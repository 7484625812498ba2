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

// The decode-aggregate of one chunk [j0, j0 + len) of the columns, for all C clients, in
// ONE pass: v = s_b * q decoded in registers, per client lanes_i[t mod kLanes] += v^2, and
// acc[t] = acc[t] + w_i * v in client order (a client of weight 0 not added); then the
// chunk's lanes of acc^2 and out = gamma * acc.  The same operations, lane layout and order
// as a decode into a buffer, sum_squares of it and acc += w v (so the same bits), without
// the buffer round trip.  Written with GCC vector types of kLanes floats: each lane is one
// IEEE operation, so the DEFAULT build (four SSE registers per vector) and the AVX-512
// build (one zmm) give the same bits.
//
// Why tiles: the accumulator of kTileVecs vectors stays in registers while every client's
// codes of those columns are read (one 16-byte load, vpmovsxbd, vcvtdq2ps per 16 codes on
// AVX-512); acc is never loaded or stored, out is written once.  The previous form (acc in
// an L2-resident 64 Ki buffer, read and written once per client) and GCC 12's
// __builtin_convertvector of int8 lanes (scalarised: a movsbl/vpinsrd per code) made it
// instruction-bound at ~1x the fp32 floor.  fp8 decodes from its bits on AVX2 / AVX-512
// (fp8_bits_note), through its 256-entry table on DEFAULT.  The chunk starts at a block boundary and every block
// is a multiple of 32 values, so each 16-value vector lies in one block.
typedef float F32xL __attribute__((vector_size(4 * kLanes)));

#if FEDOPT_CK_ISA == 512
constexpr int64_t kTileVecs = 4;  // 4 zmm accumulators; 8 measured slower (int8 2.0-2.3x the floor against 3.1)
#elif FEDOPT_CK_ISA == 2
constexpr int64_t kTileVecs = 2;  // 4 ymm
#else
constexpr int64_t kTileVecs = 1;  // 4 xmm of SSE's 16
#endif
constexpr int64_t kTile = kTileVecs * kLanes;
// Each client's codes are prefetched this many columns ahead of its tile: C interleaved
// streams are more than the hardware prefetcher follows (measured on Zen 5, C = 20,
// AVX-512, one thread: int8 ~1.6x faster with it).  1024 columns against 512: int8 at
// 3.4-4.0x the fp32 floor against 3.1-3.2x in three paired runs, 2048 no better (loads
// 13-21: a hint, not a measurement of the idle machine).
constexpr int64_t kPrefetchColumns = 1024;

// fp8_bits_note: an e4m3fn code b (sign s, v = b & 0x7F) decodes exactly, without the
// table gather that made the tile loop slower than the fp32 floor (0.84x, Zen 5): v >= 8
// (a normal number) is the fp32 with bits (v << 20) + (120 << 23) (the exponent rebiased
// from 7 to 127); v < 8 (zero, subnormal) is v * 2^-9, exact in fp32 and computed from a
// normal number, so flush-to-zero / denormals-are-zero modes cannot touch it; v == 0x7F is
// NaN, taken from the table (c10's bits); then s << 31.  Every one of the 256 codes gives
// the table's bits (tests/test_compressed_cpu_isa.py).
// q (as floats) of the 16 codes of elements t .. t + 15 (t a multiple of 16).
template <int kKind>
inline F32xL decode16(const uint8_t* __restrict__ codes, int64_t t, const float* __restrict__ lut) {
#if FEDOPT_CK_ISA == 512
  if (kKind == 0) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + t));
    return (F32xL)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
  if (kKind == 1) {  // byte m -> lanes 2m (low nibble) and 2m + 1 (high), sign-extended by shifts
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + t / 2));
    const __m512i x = _mm512_cvtepi8_epi32(_mm_unpacklo_epi8(b, b));
    const __m512i up = _mm512_set_epi32(24, 28, 24, 28, 24, 28, 24, 28, 24, 28, 24, 28, 24, 28, 24, 28);
    return (F32xL)_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_sllv_epi32(x, up), 28));
  }
  if (kKind == 2) {  // e4m3fn from its bits (fp8_bits_note below): no gather, no table but for NaN
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + t)));
    const __m512i v = _mm512_and_si512(x, _mm512_set1_epi32(0x7F));
    const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(v, 20), _mm512_set1_epi32(120 << 23)));
    const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(0x1p-9f));
    __m512 mag = _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(v, _mm512_set1_epi32(8)), normal, subnormal);
    mag = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(v, _mm512_set1_epi32(0x7F)), mag, _mm512_set1_ps(lut[0x7F]));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
    return (F32xL)_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag), sign));
  }
#elif FEDOPT_CK_ISA == 2
  if (kKind == 0 || kKind == 1) {
    __m256i h0, h1;
    if (kKind == 0) {
      h0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + t)));
      h1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + t + 8)));
    } else {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + t / 2));
      const __m128i d = _mm_unpacklo_epi8(b, b);
      const __m256i up = _mm256_set_epi32(24, 28, 24, 28, 24, 28, 24, 28);
      h0 = _mm256_srai_epi32(_mm256_sllv_epi32(_mm256_cvtepi8_epi32(d), up), 28);
      h1 = _mm256_srai_epi32(_mm256_sllv_epi32(_mm256_cvtepi8_epi32(_mm_srli_si128(d, 8)), up), 28);
    }
    const __m256 f[2] = {_mm256_cvtepi32_ps(h0), _mm256_cvtepi32_ps(h1)};
    F32xL q;
    __builtin_memcpy(&q, f, sizeof(q));
    return q;
  }
  if (kKind == 2) {  // e4m3fn from its bits (fp8_bits_note below), 8 lanes at a time
    const __m256 nan = _mm256_set1_ps(lut[0x7F]);
    auto fp8x8 = [nan](const uint8_t* p) {
      const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
      const __m256i v = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));
      const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(v, 20), _mm256_set1_epi32(120 << 23)));
      const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(0x1p-9f));
      __m256 mag = _mm256_blendv_ps(normal, subnormal, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), v)));
      mag = _mm256_blendv_ps(mag, nan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(v, _mm256_set1_epi32(0x7F))));
      const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
      return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(mag), sign));
    };
    const __m256 f[2] = {fp8x8(codes + t), fp8x8(codes + t + 8)};
    F32xL q;
    __builtin_memcpy(&q, f, sizeof(q));
    return q;
  }
#endif
  float g[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) {
    if (kKind == 0) {
      g[l] = static_cast<float>(reinterpret_cast<const int8_t*>(codes)[t + l]);
    } else if (kKind == 1) {
      const int8_t byte = static_cast<int8_t>(codes[(t + l) / 2]);
      g[l] = static_cast<float>(l % 2 ? byte >> 4 : static_cast<int8_t>(byte << 4) >> 4);
    } else {
      g[l] = lut[codes[t + l]];
    }
  }
  F32xL q;
  __builtin_memcpy(&q, g, sizeof(q));
  return q;
}

// q of element j, one at a time (the chunk's ragged end).
template <int kKind>
inline float decode1(const uint8_t* codes, int64_t j, const float* lut) {
  if (kKind == 0) return static_cast<float>(reinterpret_cast<const int8_t*>(codes)[j]);
  if (kKind == 1) {
    const int8_t byte = static_cast<int8_t>(codes[j / 2]);
    return static_cast<float>(j % 2 ? byte >> 4 : static_cast<int8_t>(byte << 4) >> 4);
  }
  return lut[codes[j]];
}

// int4_table_note: on AVX-512 a 4-bit code is decoded by a lookup, not a convert and a
// multiply: the block's 16 values s * q (q = -8 .. 7, each one fp32 multiply, so the very
// bits of s * float(q)) are one zmm, and vpermps picks lane q's value by the low 4 bits of
// each dword.  The codes reach those bits with vpmovzxbq (byte m -> qword m) and one
// vpmuludq by 2^28 + 1 (byte m at bits 0 and 28 of qword m: dword 2m holds the low nibble,
// dword 2m + 1 the high one, in its low 4 bits): 3 instructions per 16 codes where the
// shift-and-convert took 7 (perf annotate, Zen 5).  The rest of the element's arithmetic
// (x^2, w x, the two adds) is unchanged.
#if FEDOPT_CK_ISA == 512
constexpr bool kInt4Table = true;
#else
constexpr bool kInt4Table = false;
#endif

// What x = s * q of a block needs per vector: s in every lane, or (int4_table_note) the
// block's table of s * q.
template <int kKind>
inline F32xL block_scale(float s) {
  // a broadcast, written out (0 + s would turn -0 into +0; a loop of lane stores went
  // through the stack and made the tile loop 2x slower)
  static_assert(kLanes == 16, "the broadcast below names 16 lanes");
  F32xL sv = {s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s};
  if (kKind == 1 && kInt4Table) {
    const F32xL q = {0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 7.0f, -8.0f, -7.0f, -6.0f, -5.0f, -4.0f, -3.0f, -2.0f, -1.0f};
    sv = sv * q;
  }
  return sv;
}

// x = s * q of the 16 codes of elements t .. t + 15, with sv = block_scale(s).
template <int kKind>
inline F32xL scaled16(const uint8_t* __restrict__ codes, int64_t t, F32xL sv, const float* __restrict__ lut) {
#if FEDOPT_CK_ISA == 512
  if (kKind == 1) {  // int4_table_note
    const __m512i b = _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + t / 2)));
    const __m512i idx = _mm512_mul_epu32(b, _mm512_set1_epi64((int64_t(1) << 28) + 1));
    return (F32xL)_mm512_permutexvar_ps(idx, (__m512)sv);
  }
#endif
  return sv * decode16<kKind>(codes, t, lut);
}

// lanes += x^2 and (kAdd) a[v] = a[v] + w x for the kTileVecs vectors of one client's tile;
// sv[v]: the scale of vector v's block (kOneScale: sv[0] for all).
template <int kKind, bool kAdd, bool kOneScale>
inline void tile_client(const uint8_t* __restrict__ c, const F32xL* sv, int64_t t0, float w,
                        const float* __restrict__ lut, F32xL& lanes, F32xL* a) {
#pragma GCC unroll 8
  for (int64_t v = 0; v < kTileVecs; ++v) {
    const F32xL x = scaled16<kKind>(c, t0 + v * kLanes, sv[kOneScale ? 0 : v], lut);
    lanes = lanes + x * x;
    if (kAdd) a[v] = a[v] + w * x;
  }
}

// stream_note: out = gamma * acc of a tile, stored (stream) with non-temporal stores.  A
// plain store first reads the line it writes (write-allocate): for a model of N values
// that is 4N bytes read on top of the 4N written, ~30% of int8's traffic (C = 20: codes
// 20N, scales 20N/64, out 4N + 4N).  A streaming store writes the line without reading
// it and without keeping it in cache; the price is paid when out is read right after
// from cache (a model that fits the L2/L3: the server update that follows finds it in
// memory), so the caller streams only above kStreamColumns, and only int8 / fp8
// (compressed_aggregate.cpp).  Measured (20 x 11.2M int8, Zen 5 VM): two threads, where
// both int8 and the fp32 floor run at ~20 GB/s, 13.4-16.0 ms against 15.8-18.8; one thread
// 22.3-22.8 against 23.1-23.9.
// Same values stored either way: the bits do not depend on it.  AVX2 / AVX-512 only (the
// DEFAULT build is also the non-x86 one); `p` is 32- / 64-byte aligned when kStream is set
// (the caller checks out's address; a chunk starts at a multiple of 32 values).
template <bool kStream>
inline void store_out(float* __restrict__ p, F32xL o) {
#if FEDOPT_CK_ISA == 512
  if (kStream) {
    _mm512_stream_ps(p, (__m512)o);
    return;
  }
#elif FEDOPT_CK_ISA == 2
  if (kStream) {
    __m256 h[2];
    __builtin_memcpy(h, &o, sizeof(o));
    _mm256_stream_ps(p, h[0]);
    _mm256_stream_ps(p + 8, h[1]);
    return;
  }
#endif
  __builtin_memcpy(p, &o, sizeof(o));
}

// The chunk [j0, j0 + len) of C clients (codes[i], scales[i]: the whole reply); lanes
// [C][kLanes] (zero on entry) take each client's v^2, tot_lanes (zero on entry) acc^2;
// acc: scratch of len floats; out: the chunk's output.
template <int kKind, bool kOneScale, bool kStream>
inline void decode_chunk_kind(int64_t C, const uint8_t* const* codes, const float* const* scales, const float* w,
                              int64_t block, int64_t j0, int64_t len, const float* __restrict__ lut, float gamma,
                              float* __restrict__ lanes, float* __restrict__ tot_lanes, float* __restrict__ acc,
                              float* __restrict__ out) {
  F32xL tot;
  __builtin_memcpy(&tot, tot_lanes, sizeof(tot));
  const int64_t nt = len / kTile;
  for (int64_t k = 0; k < nt; ++k) {
    const int64_t t0 = j0 + k * kTile;
    const int64_t pf = t0 + kPrefetchColumns < j0 + len ? t0 + kPrefetchColumns : j0 + len - 1;  // in bounds
    F32xL a[kTileVecs];
    for (int64_t v = 0; v < kTileVecs; ++v) a[v] = F32xL{} ;
    for (int64_t i = 0; i < C; ++i) {
      __builtin_prefetch(codes[i] + (kKind == 1 ? pf / 2 : pf));
      F32xL sv[kOneScale ? 1 : kTileVecs];
      for (int64_t v = 0; v < (kOneScale ? 1 : kTileVecs); ++v)
        sv[v] = block_scale<kKind>(scales[i][(t0 + v * kLanes) / block]);
      F32xL ln;
      __builtin_memcpy(&ln, lanes + i * kLanes, sizeof(ln));
      if (w[i] != 0.0f) {
        tile_client<kKind, true, kOneScale>(codes[i], sv, t0, w[i], lut, ln, a);
      } else {
        tile_client<kKind, false, kOneScale>(codes[i], sv, t0, w[i], lut, ln, a);
      }
      __builtin_memcpy(lanes + i * kLanes, &ln, sizeof(ln));
    }
    for (int64_t v = 0; v < kTileVecs; ++v) {
      tot = tot + a[v] * a[v];
      const F32xL o = gamma * a[v];
      store_out<kStream>(out + k * kTile + v * kLanes, o);
    }
  }
#if FEDOPT_CK_ISA != 0
  if (kStream) _mm_sfence();  // the streamed lines are globally visible before the chunk returns
#endif
  // The rest (< kTile columns): whole vectors, then the ragged end one value at a time
  // (lanes 0, 1, ..., as sum_squares), through the scratch accumulator.
  const int64_t r0 = nt * kTile, rv = r0 + (len - r0) / kLanes * kLanes;
  for (int64_t t = r0; t < len; ++t) acc[t] = 0.0f;
  for (int64_t i = 0; i < C; ++i) {
    float* li = lanes + i * kLanes;
    F32xL ln;
    __builtin_memcpy(&ln, li, sizeof(ln));
    for (int64_t t = r0; t < rv; t += kLanes) {
      const F32xL x = scales[i][(j0 + t) / block] * decode16<kKind>(codes[i], j0 + t, lut);
      ln = ln + x * x;
      if (w[i] != 0.0f) {
        F32xL a;
        __builtin_memcpy(&a, acc + t, sizeof(a));
        a = a + w[i] * x;
        __builtin_memcpy(acc + t, &a, sizeof(a));
      }
    }
    __builtin_memcpy(li, &ln, sizeof(ln));
    for (int64_t t = rv; t < len; ++t) {
      const float x = scales[i][(j0 + t) / block] * decode1<kKind>(codes[i], j0 + t, lut);
      li[t - rv] = li[t - rv] + x * x;
      if (w[i] != 0.0f) acc[t] = acc[t] + w[i] * x;
    }
  }
  for (int64_t t = r0; t < rv; t += kLanes) {
    F32xL a;
    __builtin_memcpy(&a, acc + t, sizeof(a));
    tot = tot + a * a;
    const F32xL o = gamma * a;
    __builtin_memcpy(out + t, &o, sizeof(o));
  }
  __builtin_memcpy(tot_lanes, &tot, sizeof(tot));
  for (int64_t t = rv; t < len; ++t) {
    tot_lanes[t - rv] = tot_lanes[t - rv] + acc[t] * acc[t];
    out[t] = gamma * acc[t];
  }
}

inline void decode_chunk(int kind, int64_t C, const uint8_t* const* codes, const float* const* scales,
                         const float* w, int64_t block, int64_t j0, int64_t len, const float* lut, float gamma,
                         bool stream, float* lanes, float* tot_lanes, float* acc, float* out) {
  // Every tile in one block (the chunk starts at a block boundary): one scale per client
  // and tile, fetched once.
  // int4 never streams (kStreamColumns' note): its loop is the one without the option.
  const bool one = block % kTile == 0;
#define FEDOPT_CK_CHUNK(K, S)                                                                                       \
  (one ? decode_chunk_kind<K, true, S>(C, codes, scales, w, block, j0, len, lut, gamma, lanes, tot_lanes, acc, out) \
       : decode_chunk_kind<K, false, S>(C, codes, scales, w, block, j0, len, lut, gamma, lanes, tot_lanes, acc, out))
  if (kind == 0) {
    stream ? FEDOPT_CK_CHUNK(0, true) : FEDOPT_CK_CHUNK(0, false);
  } else if (kind == 1) {
    FEDOPT_CK_CHUNK(1, false);
  } else {
    stream ? FEDOPT_CK_CHUNK(2, true) : FEDOPT_CK_CHUNK(2, false);
  }
#undef FEDOPT_CK_CHUNK
}

// The fixed tree of sum_squares over kLanes lanes.
inline float add_lanes(const float* in) {
  float lanes[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) lanes[l] = in[l];
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

// x0 of Philox4x32-10 under `key` at counter (j lo, j hi, c2, c3): gaussian_noise.h's
// rounds (included before the target switches), inlined into this build.
__attribute__((always_inline)) inline uint32_t philox_x0(uint64_t key, uint64_t j, uint32_t c2, uint32_t c3) {
  uint32_t x0, x1;
  noise::philox4x32_10(key, j, c2, c3, x0, x1);
  return x0;
}

// philox_x0 as this build vectorises it best (the same bits): AVX-512 holds the words in
// 64-bit lanes (philox_wide.h's philox4x32_10_wide, as the DP noise kernel does);
// AVX2 and SSE2, without a 64-bit lane multiply, keep the header's form.
__attribute__((always_inline)) inline uint32_t philox_x0_lanes(uint64_t key, uint64_t j, uint32_t word2,
                                                               uint32_t word3) {
#if FEDOPT_CK_ISA == 512
  uint32_t x0, x1;
  noise::philox4x32_10_wide(key, j, word2, word3, x0, x1);
  return x0;
#else
  return philox_x0(key, j, word2, word3);
#endif
}

#include "block_absmax.h"  // block_absmax_or_nan (shared with the fp8 encode)

// Codes of the `len` values x[0, len) of one block starting at element j0: the block's
// scale s = max|x| / qmax (returned), t = x / s (0 when s == 0), q = round half to even
// (the default rounding mode's nearbyint) or, stochastic, floor(t) + [u < t - floor(t)]
// with u = (x0 >> 8) 2^-24 of (key, j, client, stream); NaN to 0, clamped to [-qmax, qmax];
// into q[].
//
// A block with no NaN runs loops the compiler vectorises: block_absmax.h's lane-wise absmax, then
// the codes in a plain loop with no branch (vdivps, vrndscaleps, the clamp, a narrowing
// store; the same IEEE operations per element, so the same codes on every ISA) -- with
// stochastic rounding, each run of 64 uniforms first, in a loop of Philox alone.  The
// scalar loop below, which the compiler left scalar (a conditional reduction and the
// stochastic branch inside one loop: ~2 ns a value, an int8 encode of 11.2M values in
// 22 ms on Zen 5; stochastic ~9 ns), keeps a block that holds a NaN (the NaN's bits go
// into the scale).
inline float quantize_block(const float* x, int64_t len, float qmax, bool stochastic, uint64_t key, int64_t j0,
                            uint32_t client, uint32_t stream, int8_t* q) {
  const float amax_v = block_absmax_or_nan(x, len);
  if (amax_v == amax_v) {
    const float s = amax_v / qmax;
    if (s == 0.0f) {  // every value +-0: t = 0, and floor(0) + [u < 0] = 0 too
      for (int64_t t = 0; t < len; ++t) q[t] = 0;
      return s;
    }
    if (!stochastic) {
      for (int64_t t = 0; t < len; ++t) {
        float r = __builtin_nearbyintf(x[t] / s);  // |x / s| <= qmax (+ an ulp), or NaN for x = +-Inf = amax
        r = r == r ? r : 0.0f;
        r = r > qmax ? qmax : (r < -qmax ? -qmax : r);
        q[t] = static_cast<int8_t>(r);
      }
      return s;
    }
    // stochastic: the uniforms of a run of values first (a loop of Philox alone, which the
    // compiler vectorises), then the codes from them
    constexpr int64_t kRun = 64;
    for (int64_t c = 0; c < len; c += kRun) {
      const int64_t n = len - c < kRun ? len - c : kRun;
      float u[kRun];
      for (int64_t l = 0; l < n; ++l)
        u[l] = static_cast<float>(static_cast<int32_t>(
                   philox_x0_lanes(key, static_cast<uint64_t>(j0 + c + l), client, stream) >> 8)) * 0x1p-24f;
      for (int64_t l = 0; l < n; ++l) {
        const float v = x[c + l] / s;
        const float f = __builtin_floorf(v);
        float r = f + (u[l] < v - f ? 1.0f : 0.0f);
        r = r == r ? r : 0.0f;
        r = r > qmax ? qmax : (r < -qmax ? -qmax : r);
        q[c + l] = static_cast<int8_t>(r);
      }
    }
    return s;
  }
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
