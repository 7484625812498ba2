// Operator schemas of the C++ backends (namespace `fedopt_C`) and the Python module
// stub of the CPU extension.
//
// The schemas are defined once, here, in the always-built CPU extension; csrc/cpu
// registers the CPU kernels and csrc/cuda (a separate, optional extension) registers
// the CUDA kernels for the same ops with TORCH_LIBRARY_IMPL.  The Python ops layer
// (fedopt_kernels/ops) validates every argument before calling these, so the kernels
// only TORCH_CHECK what would otherwise be memory-unsafe.
//
// Conventions shared by all ops:
//  * "acc" dtype = float64 for float64 data, float32 otherwise; every statistic is
//    returned in it and every sum is accumulated in it.
//  * A hyperparameter given both as a float and as an optional tensor uses the tensor
//    when present (0-d, or one value per group for the batched op; acc dtype, on the
//    data's device), so it can change without recompiling a torch.compile graph.
//  * Reductions are deterministic: fixed chunks, fixed-order combination (chunks.h).
#include <Python.h>
#include <torch/library.h>

extern "C" {
// Makes `import fedopt_kernels._C` load the library (and run the registrations below)
// without pulling pybind11 into the build.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(fedopt_C, m) {
  // FedNAR step over a list of tensors forming ONE group (one norm).  `mode`: 0 co,
  // 1 grad, 2 none (fedopt::NarMode).  `momentum_buffers` is empty iff momentum == 0.
  // `grad_scale` (0-d acc): grads are divided by it; `found_inf` (0-d float): a
  // non-zero value skips the step.  Returns (norm, scale, skipped) as 0-d tensors.
  m.def(
      "nar_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
      "float lr, Tensor? lr_tensor, float weight_decay, Tensor? weight_decay_tensor, "
      "float max_norm, int mode, float momentum, Tensor? grad_scale, Tensor? found_inf) "
      "-> (Tensor, Tensor, Tensor)");
  // Row-wise FedNAR on contiguous [C, N] tensors: each row is a group with its own
  // norm, scale and skip flag; a skipped row leaves the other rows stepping.
  // `lr_tensor` / `weight_decay_tensor` may be 0-d or [C].  Returns stats of shape [C].
  m.def(
      "nar_step_batched_(Tensor(a!) params, Tensor grads, Tensor(b!)? momentum_buffers, "
      "float lr, Tensor? lr_tensor, float weight_decay, Tensor? weight_decay_tensor, "
      "float max_norm, int mode, float momentum, Tensor? grad_scale, Tensor? found_inf) "
      "-> (Tensor, Tensor, Tensor)");
  // The two passes of nar_step_ as separate ops, for ONE norm shared by several calls
  // (param groups with their own lr / weight decay / momentum, tensors of several
  // dtypes or devices: fedopt_kernels.ops.nar_step_groups_).  nar_sq_norm returns the
  // 0-d acc sum of squares of the clipped-on vector of these tensors (partials
  // combined in chunk order); nar_apply_ is nar_step_'s update with norm =
  // sqrt(sq_norm), `sq_norm` a one-element tensor on the params' device (the sum of
  // every call's nar_sq_norm, combined by the caller in a fixed order).  A call whose
  // tensors are all of one group and one dtype gets bitwise nar_step_'s result from
  // nar_apply_(..., nar_sq_norm(...)).
  m.def(
      "nar_sq_norm(Tensor[] params, Tensor[] grads, float weight_decay, Tensor? weight_decay_tensor, "
      "int mode, Tensor? grad_scale) -> Tensor");
  m.def(
      "nar_apply_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, Tensor sq_norm, "
      "float lr, Tensor? lr_tensor, float weight_decay, Tensor? weight_decay_tensor, "
      "float max_norm, int mode, float momentum, Tensor? grad_scale, Tensor? found_inf) "
      "-> (Tensor, Tensor, Tensor)");
  // out = gamma * sum_i weights[i] * clients[i] and, in the same pass,
  // client_sq_norms[i] = ||clients[i]||^2 and sq_norm = ||sum_i weights[i] clients[i]||^2.
  // `clients`: C 1-D tensors of length N, or one contiguous 2-D [C, N] tensor.
  // `weights`: [C], acc dtype.  A client with weight exactly 0 adds exactly 0 to out
  // (never 0 * nan) but still gets its norm.  `out`: [N], clients' dtype or acc dtype.
  // `skip` (one element, the library's one "do nothing" convention, as found_inf and
  // server_update_'s skip): when nonzero, out is not touched and the stats are zeros.
  // DP noise (python_ref/gaussian_noise.py, include/fedopt/gaussian_noise.h): with
  // `noise_key` (in [0, 2^63)) out[j] = gamma * sum[j] + std * normal(noise_key, j), j
  // the index in out, computed in the acc dtype -- the product gamma * sum as without
  // noise, then std * n_j and the sum each rounded on its own (no FMA) -- and rounded
  // once to out's dtype; n_j is fp32 (widened exactly for a float64 acc).  std =
  // `noise_std_tensor` (one float32 / float64 element on out's device, converted to acc,
  // read by the kernels: no host sync on CUDA) if given, else `noise_std`.  The noise
  // bits are the same on every backend and CPU instruction set.  The returned norms are
  // those of the sum without noise; a skip adds no noise either.  noise_key None: no
  // noise, the same bits as before the noise existed.
  // Returns (client_sq_norms [C], sq_norm []).
  m.def(
      "aggregate(Tensor[] clients, Tensor weights, float gamma, Tensor? gamma_tensor, "
      "Tensor(a!) out, Tensor? skip, int? noise_key=None, float noise_std=0., "
      "Tensor? noise_std_tensor=None) -> (Tensor, Tensor)");
  // aggregate over clients read in place from pieces (CPU only: replies to a server
  // held in host memory, each a list of per-layer arrays): `pieces` holds client 0's
  // `pieces_per_client` pieces, then client 1's, ...; client i's vector is the
  // concatenation of its pieces (piece p of every client has the same numel), or, with
  // `subtract_from` ([N]), subtract_from minus that.  Same results, bit for bit, as
  // aggregate over the [C, N] rows those pieces would be copied into (with the same
  // noise when `noise_key` is given).
  m.def(
      "aggregate_pieces(Tensor[] pieces, int pieces_per_client, Tensor? subtract_from, Tensor weights, "
      "float gamma, Tensor? gamma_tensor, Tensor(a!) out, Tensor? skip, int? noise_key=None, "
      "float noise_std=0., Tensor? noise_std_tensor=None) -> (Tensor, Tensor)");
  // The DP noise alone, in place: out[j] = out[j] + std * normal(noise_key, j), computed
  // in the acc dtype (std * n_j rounded, then the sum) and rounded once to out's dtype;
  // `noise_key` and std as in aggregate.  `out`: a contiguous 1-D float16 / bfloat16 /
  // float32 / float64 tensor, any length.  For a float32 or float64 out, aggregate with
  // noise is bit for bit aggregate without noise followed by add_noise_ (same key, same
  // std); for float16 / bfloat16 the fused form rounds once, this one twice.  `skip` as
  // aggregate's: when nonzero, out is not touched (so a caller can pick, on the device,
  // between the noise of a second aggregate pass and this one: ops/dp_noise.py).
  m.def("add_noise_(Tensor(a!) out, int noise_key, float noise_std, Tensor? noise_std_tensor, "
        "Tensor? skip=None) -> ()");
  // [<clients[i], g> for each i] in one pass over the data (the backward of the
  // weighted sum).  `g`: [N], clients' dtype or acc dtype.  Returns [C] in acc dtype.
  m.def("client_dots(Tensor[] clients, Tensor g) -> Tensor");
  // client_dots over clients read in place from pieces (as aggregate_pieces; CPU only).
  m.def("client_dots_pieces(Tensor[] pieces, int pieces_per_client, Tensor? subtract_from, Tensor g) -> Tensor");
  // Coordinate-wise order statistics of the KEPT clients (keep[i] true; a [C] bool
  // tensor on the data's device), ONE pass over them: per column, the m kept values
  // sorted in the acc dtype, then mode 0 (trim): out = mean of sorted[k .. m-k) with
  // k = min(count, (m-1)/2) (the median is k = (m-1)/2, a beta-trimmed mean
  // k = floor(beta m)); mode 1 (closest, Bulyan): out = mean of the `count` values
  // closest to the median (the farther end dropped first, the upper one on a tie).
  // `count`: one-element int64 tensor on the data's device (read there: no sync).
  // m = 0 writes zeros.  `out`: [N], clients' dtype or acc dtype.  `skip` as aggregate's.
  // Returns [C] bool: kept clients holding a NaN/Inf (all false when skipped); the ops
  // layer reruns without them.  Oracle: python_ref/robust.py.
  m.def(
      "coordinate_select(Tensor[] clients, Tensor keep, Tensor count, int mode, Tensor(a!) out, "
      "Tensor? skip) -> Tensor");
  // Compressed updates decoded inside the aggregation (oracle: python_ref/compression.py).
  // out = gamma * sum_i weights[i] * x^_i with x^_i client i's decoded reply, read in
  // place (no dense copy), and in the same pass client_sq_norms[i] = ||x^_i||^2 and
  // sq_norm = ||sum_i weights[i] x^_i||^2; out, weights and the statistics are float32.
  // Block codecs: x^_j = scales[i][j / block] * q_j (fp32, one rounding), codes[i] int8
  // [N] (kind 0), uint8 [ceil(N/2)] two int4 nibbles per byte, low first (kind 1), or
  // uint8 fp8 e4m3fn bits [N] (kind 2); scales[i] float32 [ceil(N/block)]; block a
  // positive multiple of 32.  The sum runs over the clients in order, acc = acc +
  // weights[i] * x^_i: out is bit for bit `aggregate` over the decoded rows.  `skip` as
  // aggregate's.  Returns (client_sq_norms [C], sq_norm []).
  m.def(
      "block_decode_aggregate(Tensor[] codes, Tensor[] scales, int kind, int block, int numel, Tensor weights, "
      "float gamma, Tensor? gamma_tensor, Tensor(a!) out, Tensor? skip) -> (Tensor, Tensor)");
  // The client's encode, fused: x (a 1-D float CPU tensor, taken as float32) in blocks of
  // `block` values: scale s_b = max|x_b| / Q (Q = 127 for kind 0 int8, 7 for kind 1
  // int4), codes round(x / s_b) half to even, or with `stochastic` floor(t) + [u < t -
  // floor(t)] with u of Philox4x32-10(key, (j, client, 0x51)) (key in [0, 2^63)); clamped
  // to [-Q, Q], NaN codes 0.  Returns (codes int8 [N] or uint8 [ceil(N/2)], scales float32
  // [ceil(N/block)]): python_ref.compression.quantize's bits.  Kind 2 is fp8 (e4m3fn):
  // s_b = max|x_b| / 448, codes e4m3fn(clamp(x / s_b, +-448)) half to even (+0 where s_b
  // is 0), returned as uint8 bits [N] (stochastic must be false): python_ref's fp8_encode.
  m.def("block_quantize(Tensor x, int kind, int block, bool stochastic, int key, int client) -> (Tensor, Tensor)");
  // The same encode written into given buffers (codes and scales as block_quantize returns
  // them, contiguous, on x's device; checked before anything is written): a round's reply
  // arena hands them out (fedopt_kernels/compression/reply_arena.py).
  m.def("block_quantize_into(Tensor x, int kind, int block, bool stochastic, int key, int client, "
        "Tensor(a!) codes, Tensor(b!) scales) -> ()");
  // Top-k encode: the k largest |x_j| of x (1-D float, taken as float32), a tie to the
  // lower index, NaN above +Inf: (values float32 [k], indices int64 [k] ascending),
  // python_ref.compression.topk_encode's bits.  (CPU and CUDA; k in [0, N].)
  m.def("topk_encode(Tensor x, int k) -> (Tensor, Tensor)");
  // Top-k: client i sends values[i] (float32 [k_i]) at indices[i] (int64 [k_i], strictly
  // increasing in [0, numel), checked); x^_i is zero elsewhere.  As block_decode_aggregate.
  m.def(
      "topk_decode_aggregate(Tensor[] values, Tensor[] indices, int numel, Tensor weights, float gamma, "
      "Tensor? gamma_tensor, Tensor(a!) out, Tensor? skip) -> (Tensor, Tensor)");
  // coordinate_select over clients read in place from pieces (as aggregate_pieces; CPU only).
  m.def(
      "coordinate_select_pieces(Tensor[] pieces, int pieces_per_client, Tensor? subtract_from, Tensor keep, "
      "Tensor count, int mode, Tensor(a!) out, Tensor? skip) -> Tensor");
  // The clients' Gram matrix G_ij = <clients[i], clients[j]> in ONE pass (CPU only), as
  // a float64 [C, C] tensor (symmetric): each block of 256 columns summed in the acc
  // dtype (in double with float64_products), the blocks added in float64 in a fixed
  // order (deterministic, independent of threads).  Error bounds:
  // csrc/cpu/robust_kernels.h.  Krum, Multi-Krum, Bulyan, the geometric median and
  // centered clipping read it; nothing else does.
  m.def("client_gram(Tensor[] clients, bool float64_products) -> Tensor");
  // client_gram over clients read in place from pieces (as aggregate_pieces; CPU only).
  m.def(
      "client_gram_pieces(Tensor[] pieces, int pieces_per_client, Tensor? subtract_from, bool float64_products) "
      "-> Tensor");
  // The elementwise step of a server optimizer over a list of tensors, in ONE pass
  // (rules and formulas: fedopt::ServerRule in include/fedopt/math.h).  `updates[i]`
  // is the mean update for params[i] (same numel, contiguous, acc dtype); `exp_avg`
  // (m, or the momentum buffer b) and `exp_avg_sq` (v) are in the params' dtype:
  // empty lists where the rule has no such state (kSgd: both; kMomentum: exp_avg_sq).
  // `skip` (0-d bool): when true nothing is written (read on the device: no sync).
  m.def(
      "server_update_(Tensor(a!)[] params, Tensor[] updates, Tensor(b!)[] exp_avg, "
      "Tensor(c!)[] exp_avg_sq, int rule, float lr, Tensor? lr_tensor, float gamma, "
      "Tensor? gamma_tensor, float beta1, float beta2, float tau, bool nesterov, Tensor? skip) -> ()");
}
