// Interface between the CPU ops (nar_step.cpp, aggregate.cpp, server_update.cpp:
// tensors, threads, stats) and the streaming kernels (kernels.h, compiled once per
// instruction set).
//
// Nothing here includes torch: the kernels see raw pointers, a chunk table and the
// hyperparameters already resolved on the host.  A kernel entry processes the chunks
// [c0, c1) of its table; the ops split the chunks among threads (at::parallel_for) and
// combine the per-chunk partial sums in chunk order, so every result is independent of
// the thread count and of the instruction set (see kernels.h, "Determinism").
#pragma once

#include <cstdint>

#include <fedopt/chunks.h>
#include <fedopt/math.h>

namespace fedopt::cpu {

// Element counts of the chunks (chunks.h).  Fixed constants, never derived from the
// thread count: changing one changes the rounding of the sums (still deterministic).
// 64 Ki elements (256 KiB of fp32 per stream) keep the per-chunk overhead (a table
// entry, one partial, one horizontal sum) below 0.1% while a ResNet-18 still has ~200
// chunks to balance over the threads.  The aggregation cuts [C, N] by columns into 4 Ki
// column chunks: fine enough to split a 100K-parameter model evenly over the threads
// (aggregate.cpp), while the per-chunk cost (one partial per client) stays below 1%.
constexpr int64_t kNarChunk = int64_t(1) << 16;
constexpr int64_t kAggChunk = int64_t(1) << 12;
// Fewest elements a thread is given.  Waking a second thread costs microseconds on an
// idle machine and up to milliseconds on a busy VM, while a thread streams ~1M
// elements per millisecond: below this the ops run on the calling thread.  (Measured:
// a 91K-parameter FedNAR step took 17 us on one thread and 285 us on two busy cores.)
constexpr int64_t kMinElementsPerThread = int64_t(1) << 18;

// Element type of the data (the accumulation type is float, or double for kDouble).
enum class ScalarKind : int { kFloat, kDouble, kHalf, kBFloat16 };

// Both passes of a FedNAR step over the chunks of `chunks` (one group per norm).
template <typename acc_t>
struct NarArgs {
  ScalarKind kind;
  NarMode mode;                     // also params[g].mode, hoisted for dispatch
  bool momentum;                    // momentum != 0: `b` is read and written
  const Chunk* chunks;
  void* const* x;                   // per tensor: params
  const void* const* g;             // per tensor: grads
  void* const* b;                   // per tensor: momentum buffers (momentum only)
  const NarParams<acc_t>* params;   // per group
  acc_t* partials;                  // norm pass output: sum of squares per chunk
  const acc_t* scale;               // update pass input: clip scale per group
  const uint8_t* skip;              // update pass input: 1 = leave the group untouched
};

// Clients read in place from pieces (aggregate_pieces): client i's row is the
// concatenation of its `num_pieces` pieces, piece p covering the columns [starts[p],
// starts[p + 1]) from ptrs[i * num_pieces + p] -- the per-layer arrays of a reply, say
// -- and, with `base`, the row is base - that (one subtraction in the clients' type,
// as a [C, N] copy of base - x_i would hold).  The kernels stage a chunk of such a row
// into a buffer of kAggChunk elements (L1/L2-resident) and walk it as they walk a row,
// so every chunk sees exactly the values of the copied row: the same bits.
struct PieceTable {
  int64_t num_pieces;
  const int64_t* starts;            // [num_pieces + 1], starts[0] = 0, starts[num_pieces] = N
  const void* const* ptrs;          // [C * num_pieces]
  const void* base;                 // [N] in the clients' type, or nullptr
};

// out = gamma * sum_i w_i X_i over column chunks, with per-chunk partials of
// ||X_i||^2 and ||sum_i w_i X_i||^2.
template <typename acc_t>
struct AggregateArgs {
  ScalarKind kind;                  // clients' element type
  bool out_is_acc;                  // out holds acc_t (else the clients' type)
  int64_t num_clients;
  const void* const* clients;       // per client: the first element of its row (unused with pieces)
  const PieceTable* pieces = nullptr;  // the clients as pieces instead of rows
  const acc_t* weights;             // [C]
  acc_t gamma;
  void* out;                        // [N]
  const Chunk* chunks;              // column ranges of [0, N)
  acc_t* client_partials;           // [num_chunks][C]
  acc_t* sum_partials;              // [num_chunks]
  // The DP noise, when `noise`: out[j] = gamma * total[j] + std * normal(noise_key, j)
  // (include/fedopt/gaussian_noise.h), each product and the sum rounded to acc_t, then
  // once to out's type; the partials stay those of the sum without noise.
  bool noise = false;
  uint64_t noise_key = 0;
  acc_t noise_std = 0;
};

// add_noise_: out[j] = out[j] + std * normal(key, j) over chunks of `chunk` elements
// (chunk c covers [c * chunk, min(n, (c + 1) * chunk)); a multiple of the block).
template <typename acc_t>
struct NoiseArgs {
  ScalarKind kind;                  // out's element type
  void* out;                        // [n]
  int64_t n;
  int64_t chunk;
  uint64_t key;
  acc_t std_dev;
};

// <X_i, g> for every client over column chunks.
template <typename acc_t>
struct DotsArgs {
  ScalarKind kind;                  // clients' element type
  bool g_is_acc;                    // g holds acc_t (else the clients' type)
  int64_t num_clients;
  const void* const* clients;
  const PieceTable* pieces = nullptr;  // the clients as pieces instead of rows
  const void* g;
  const Chunk* chunks;
  acc_t* partials;                  // [num_chunks][C]
};

// One server-optimizer step (math.h's server_update_*) over the chunks of `chunks`.
// The updates are in acc_t whatever the params' type; `m` and `v` are read and written
// only by the rules that have them (kMomentum: m; kAdagrad, kAdam, kYogi: m and v).
template <typename acc_t>
struct ServerUpdateArgs {
  ScalarKind kind;                  // params' (and m's, v's) element type
  const Chunk* chunks;
  void* const* x;                   // per tensor: params
  const acc_t* const* d;            // per tensor: updates
  void* const* m;                   // per tensor: exp_avg (the momentum buffer b for kMomentum)
  void* const* v;                   // per tensor: exp_avg_sq
  ServerParams<acc_t> params;       // rule and nesterov included
};

// The Gram matrix of K rows (robust_kernels.h): chunk c covers the columns
// [c * chunk, min(N, (c + 1) * chunk)) and writes its partial G (the upper triangle,
// row-major [K][K], in double) to partials + c * K * K.
template <typename acc_t>
struct GramArgs {
  ScalarKind kind;                  // rows' element type
  int64_t num_rows;                 // K
  const void* const* rows;          // per row: its first element (unused with pieces)
  const PieceTable* pieces = nullptr;  // the rows as pieces instead
  int64_t N;
  int64_t chunk;                    // columns per chunk, a multiple of the kernel's block
  bool float64_products;            // products and block sums in double (else in acc_t)
  double* partials;                 // [num_chunks][K][K]
};

// coordinate_select over blocks of columns (robust_kernels.h): the m kept clients'
// order statistics per column.  `ids[r]` is the r-th kept client (its row, or its
// pieces in `pieces`); block b covers the columns [b * block, min(N, (b + 1) * block))
// and flags bad[b * m + r] = 1 when kept client r holds a NaN/Inf there.
template <typename acc_t>
struct SelectArgs {
  ScalarKind kind;                  // clients' element type
  int64_t num_kept;                 // m
  const void* const* rows;          // per kept client: its first element (unused with pieces)
  const int64_t* ids;               // per kept client: its client index (for pieces)
  const PieceTable* pieces = nullptr;
  int64_t N;
  int64_t block;                    // columns per block
  int64_t count;
  int mode;                         // 0 trim, 1 closest to the median
  void* out;                        // [N]
  bool out_is_acc;                  // out holds acc_t (else the clients' type)
  uint8_t* bad;                     // [num_blocks][m]
};

template <typename acc_t>
struct Kernels {
  void (*nar_norm)(const NarArgs<acc_t>&, int64_t c0, int64_t c1);
  // Processes its chunks from last to first (see kernels.h, "Cache reuse").
  void (*nar_update)(const NarArgs<acc_t>&, int64_t c0, int64_t c1);
  void (*aggregate)(const AggregateArgs<acc_t>&, int64_t c0, int64_t c1);
  void (*client_dots)(const DotsArgs<acc_t>&, int64_t c0, int64_t c1);
  void (*server_update)(const ServerUpdateArgs<acc_t>&, int64_t c0, int64_t c1);
  void (*gram)(const GramArgs<acc_t>&, int64_t c0, int64_t c1);
  void (*select)(const SelectArgs<acc_t>&, int64_t b0, int64_t b1);
  void (*add_noise)(const NoiseArgs<acc_t>&, int64_t c0, int64_t c1);
};

struct KernelTable {
  const char* isa;  // "DEFAULT", "AVX2", "AVX512"
  Kernels<float> f32;
  Kernels<double> f64;

  template <typename acc_t>
  const Kernels<acc_t>& get() const {
    if constexpr (sizeof(acc_t) == sizeof(double)) {
      return f64;
    } else {
      return f32;
    }
  }
};

// One table per instruction set compiled in (isa_*.cpp); the AVX ones are nullptr on
// other architectures or compilers.
const KernelTable* kernels_default();
const KernelTable* kernels_avx2();
const KernelTable* kernels_avx512();

// The table to use: the instruction set torch itself dispatches its CPU kernels to
// (at::get_cpu_capability(), which honours ATEN_CPU_CAPABILITY), chosen once.
const KernelTable& kernels();

}  // namespace fedopt::cpu
