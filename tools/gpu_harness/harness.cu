// gpu_harness: runs one kernel of fedopt_kernels on whatever CUDA runtime is loaded (a
// GPU's, or a PTX simulator's libcudart put first on LD_LIBRARY_PATH), without torch.
//
//   gpu_harness CASE_DIR     run the case CASE_DIR/case.txt, write CASE_DIR/out_*.bin
//   gpu_harness --probe      print the device the runtime reports; exit 3 when none
//
// A case is a directory: case.txt holds one `key value...` per line (integers, floats
// written with 17 significant digits, names), and each input array NAME is the raw
// little-endian file in_NAME.bin.  The harness copies the inputs to the device, calls
// ONE host launcher of csrc/cuda/kernels/*.cuh (the same launchers the ATen bindings
// call) and copies the results back to out_NAME.bin.  Every device array is allocated
// with 64 guard bytes on each side filled with 0xA5; a guard found changed afterwards
// is reported as an error (an out-of-bounds write).  The case's writer
// (tests/_gpu_harness.py) computes the expected values with python_ref.
//
// Families (`kernel` key): nar, aggregate, client_dots, add_noise, server_update,
// coordinate_select, compressed (the codecs' decode-aggregate, fp32), quantize (the
// client's int8/int4 encode), encode_fp8, topk_encode (the client's top-k radix select), topk_scan (its tile
// offsets alone),
// and triton (a Triton kernel's AOT-compiled PTX, loaded with the
// driver API's cuModuleLoadData and launched with cuLaunchKernel, both asked of the
// runtime: no libcuda is linked, so a simulator's runtime is enough).
//
// Exit status: 0 ok, 1 a CUDA error or a changed guard, 2 a malformed case, 3 no
// device (or, for triton, no driver API): the message says which.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "fedopt/chunks.h"
#include "kernels/aggregate.cuh"
#include "kernels/compressed_aggregate.cuh"
#include "kernels/compressed_encode.cuh"
#include "kernels/nar_step.cuh"
#include "kernels/robust_select.cuh"
#include "kernels/server_update.cuh"
#include "kernels/topk_encode.cuh"

namespace {

using namespace fedopt;
using namespace fedopt::cuda;

// ------------------------------------------------------------------------- errors

struct CaseError : std::runtime_error {  // exit 2
  using std::runtime_error::runtime_error;
};
struct NoDevice : std::runtime_error {  // exit 3
  using std::runtime_error::runtime_error;
};
struct CudaFailure : std::runtime_error {  // exit 1
  using std::runtime_error::runtime_error;
};

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw CudaFailure(std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

// ------------------------------------------------------------------------- the case

class Case {
 public:
  explicit Case(std::string dir) : dir_(std::move(dir)) {
    std::ifstream in(dir_ + "/case.txt");
    if (!in) throw CaseError("cannot read " + dir_ + "/case.txt");
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream ls(line);
      std::string key;
      if (!(ls >> key) || key[0] == '#') continue;
      std::vector<std::string> vals;
      for (std::string v; ls >> v;) vals.push_back(v);
      if (key == "arg")
        args_.push_back(vals);
      else if (key == "array")
        arrays_.push_back(vals);
      else if (key == "reloc")
        relocs_.push_back(vals);
      else
        kv_[key] = vals;
    }
  }
  bool has(const std::string& k) const { return kv_.count(k) != 0; }
  const std::vector<std::string>& list(const std::string& k) const {
    auto it = kv_.find(k);
    if (it == kv_.end()) throw CaseError("case.txt lacks the key '" + k + "'");
    return it->second;
  }
  std::string str(const std::string& k) const {
    const auto& v = list(k);
    if (v.size() != 1) throw CaseError("key '" + k + "' must have one value");
    return v[0];
  }
  int64_t i64(const std::string& k) const { return parse_i64(str(k), k); }
  int64_t i64(const std::string& k, int64_t dflt) const { return has(k) ? i64(k) : dflt; }
  double f64(const std::string& k) const { return parse_f64(str(k), k); }
  double f64(const std::string& k, double dflt) const { return has(k) ? f64(k) : dflt; }
  std::vector<int64_t> i64s(const std::string& k) const {
    std::vector<int64_t> out;
    for (const auto& s : list(k)) out.push_back(parse_i64(s, k));
    return out;
  }
  const std::vector<std::vector<std::string>>& args() const { return args_; }
  const std::vector<std::vector<std::string>>& arrays() const { return arrays_; }
  const std::vector<std::vector<std::string>>& relocs() const { return relocs_; }
  const std::string& dir() const { return dir_; }

  bool has_input(const std::string& name) const {
    std::ifstream f(dir_ + "/in_" + name + ".bin", std::ios::binary);
    return static_cast<bool>(f);
  }
  std::vector<char> input(const std::string& name) const {
    std::ifstream f(dir_ + "/in_" + name + ".bin", std::ios::binary);
    if (!f) throw CaseError("missing input file in_" + name + ".bin");
    return std::vector<char>(std::istreambuf_iterator<char>(f), {});
  }
  void output(const std::string& name, const std::vector<char>& bytes) const {
    std::ofstream f(dir_ + "/out_" + name + ".bin", std::ios::binary);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!f) throw CaseError("cannot write out_" + name + ".bin");
  }

  static int64_t parse_i64(const std::string& s, const std::string& k) {
    char* end = nullptr;
    const long long v = std::strtoll(s.c_str(), &end, 0);
    if (end == s.c_str() || *end != '\0') throw CaseError("key '" + k + "': not an integer: " + s);
    return v;
  }
  static double parse_f64(const std::string& s, const std::string& k) {
    char* end = nullptr;
    const double v = std::strtod(s.c_str(), &end);  // decimal with 17 digits, or hex: exact
    if (end == s.c_str() || *end != '\0') throw CaseError("key '" + k + "': not a number: " + s);
    return v;
  }

 private:
  std::string dir_;
  std::map<std::string, std::vector<std::string>> kv_;
  std::vector<std::vector<std::string>> args_, arrays_, relocs_;
};

// ------------------------------------------------------------------------- device arrays

constexpr size_t kGuard = 64;
constexpr unsigned char kGuardByte = 0xA5;

// One device allocation: [guard | pad | data | guard].  `pad` bytes put the data at a
// chosen misalignment (a view at an element offset, as the contract suite's
// views_at_offset makes); the pad is guarded too.
class DevArray {
 public:
  DevArray(std::string name, size_t bytes, size_t pad = 0) : name_(std::move(name)), bytes_(bytes), pad_(pad) {
    total_ = kGuard + pad_ + bytes_ + kGuard;
    check(cudaMalloc(&base_, total_), ("cudaMalloc " + name_).c_str());
    std::vector<unsigned char> fill(total_, kGuardByte);
    check(cudaMemcpy(base_, fill.data(), total_, cudaMemcpyHostToDevice), ("guards of " + name_).c_str());
  }
  DevArray(const DevArray&) = delete;
  DevArray& operator=(const DevArray&) = delete;
  ~DevArray() { cudaFree(base_); }

  void* data() const { return static_cast<char*>(base_) + kGuard + pad_; }
  size_t bytes() const { return bytes_; }
  void upload(const std::vector<char>& host) {
    if (host.size() != bytes_)
      throw CaseError("in_" + name_ + ".bin has " + std::to_string(host.size()) + " bytes, expected " +
                      std::to_string(bytes_));
    if (bytes_) check(cudaMemcpy(data(), host.data(), bytes_, cudaMemcpyHostToDevice), ("upload " + name_).c_str());
  }
  std::vector<char> download() const {
    std::vector<char> host(bytes_);
    if (bytes_) check(cudaMemcpy(host.data(), data(), bytes_, cudaMemcpyDeviceToHost), ("download " + name_).c_str());
    return host;
  }
  // Throws when a byte outside [data, data + bytes) has changed.
  void check_guards() const {
    std::vector<unsigned char> all(total_);
    check(cudaMemcpy(all.data(), base_, total_, cudaMemcpyDeviceToHost), ("guards of " + name_).c_str());
    for (size_t i = 0; i < total_; ++i) {
      const bool inside = i >= kGuard + pad_ && i < kGuard + pad_ + bytes_;
      if (!inside && all[i] != kGuardByte)
        throw CudaFailure("out-of-bounds write: a guard byte of '" + name_ + "' changed at offset " +
                          std::to_string(static_cast<long long>(i) - static_cast<long long>(kGuard + pad_)));
    }
  }

 private:
  std::string name_;
  size_t bytes_, pad_, total_ = 0;
  void* base_ = nullptr;
};

// The arrays of one run, by name; every one is guard-checked at the end.
class Arrays {
 public:
  explicit Arrays(const Case& c) : case_(c) {}
  ~Arrays() {
    for (auto& kv : arrays_) delete kv.second;
  }
  // An array filled from in_NAME.bin (`bytes` expected, `pad` bytes of misalignment).
  DevArray& in(const std::string& name, size_t bytes, size_t pad = 0) {
    DevArray& a = make(name, bytes, pad);
    a.upload(case_.input(name));
    return a;
  }
  // An input that may be absent: null then.
  DevArray* optional_in(const std::string& name, size_t bytes) {
    return case_.has_input(name) ? &in(name, bytes) : nullptr;
  }
  // An output-only array (guard-filled data: a kernel that skips a write shows it).
  DevArray& make(const std::string& name, size_t bytes, size_t pad = 0) {
    if (arrays_.count(name)) throw CaseError("array '" + name + "' made twice");
    DevArray* a = new DevArray(name, bytes, pad);
    arrays_[name] = a;
    return *a;
  }
  void write_out(const std::string& name) const { case_.output(name, arrays_.at(name)->download()); }
  void check_guards() const {
    for (const auto& kv : arrays_) kv.second->check_guards();
  }

 private:
  const Case& case_;
  std::map<std::string, DevArray*> arrays_;
};

template <typename T>
T* ptr(DevArray& a) {
  return static_cast<T*>(a.data());
}
template <typename T>
T* ptr(DevArray* a) {
  return a != nullptr ? static_cast<T*>(a->data()) : nullptr;
}
int64_t addr(const DevArray& a) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.data())); }
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The element offset of a view (key `offset_NAME`, elements) as bytes of padding.
size_t pad_of(const Case& c, const std::string& name, size_t esize) {
  return static_cast<size_t>(c.i64("offset_" + name, 0)) * esize;
}

// ------------------------------------------------------------------------- families

// FedNAR: layout rows ([C, N]: nar_step_batched_) or list (tensors of `sizes` elements
// at element `offsets` of one flat buffer per array: nar_step_ / nar_sq_norm /
// nar_apply_).  phase step | norm | apply; `finalize` 1 forces the group-sum pass.
template <typename scalar_t>
void run_nar(const Case& c, Arrays& A, cudaStream_t stream) {
  using acc_t = acc_type<scalar_t>;
  const size_t es = sizeof(scalar_t), as = sizeof(acc_t);
  const std::string layout = c.str("layout"), phase_name = c.str("phase");
  const NarPhase phase = phase_name == "step" ? NarPhase::kStep
                         : phase_name == "norm" ? NarPhase::kNormOnly
                         : phase_name == "apply" ? NarPhase::kApply
                                                 : throw CaseError("phase must be step, norm or apply");
  const double momentum = c.f64("momentum", 0.0);
  const bool use_mom = momentum != 0.0;
  NarArgs<acc_t> a{};
  int64_t num_chunks = 0, num_groups = 0;
  DevArray* table = nullptr;
  const size_t total = static_cast<size_t>(c.i64("numel"));
  DevArray& x = A.in("x", total * es, pad_of(c, "x", es));
  DevArray& g = A.in("g", total * es, pad_of(c, "g", es));
  DevArray* b = use_mom ? &A.in("b", total * es, pad_of(c, "b", es)) : nullptr;
  if (layout == "rows") {
    const int64_t C = c.i64("C"), N = c.i64("N");
    if (static_cast<size_t>(C * N) != total) throw CaseError("numel must be C * N");
    const int64_t cs = chunk_size_for(N);
    const int64_t row_chunks = (N + cs - 1) / cs;
    num_chunks = C * row_chunks;
    num_groups = C;
    if (num_chunks > 0) {
      a.w.x_base = addr(x);
      a.w.g_base = addr(g);
      a.w.b_base = use_mom ? addr(*b) : 0;
    }
    a.w.row_len = N;
    a.w.row_chunks = row_chunks;
    a.w.chunk_size = cs;
  } else if (layout == "list") {
    const std::vector<int64_t> sizes = c.i64s("sizes"), offsets = c.i64s("offsets");
    if (sizes.size() != offsets.size()) throw CaseError("sizes and offsets differ in length");
    std::vector<ChunkTensor> tensors(sizes.size());
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (offsets[i] < 0 || static_cast<size_t>(offsets[i] + sizes[i]) > total)
        throw CaseError("tensor " + std::to_string(i) + " lies outside the buffers");
      tensors[i].numel = sizes[i];
      if (sizes[i] == 0) continue;
      tensors[i].ptr[0] = addr(x) + offsets[i] * static_cast<int64_t>(es);
      tensors[i].ptr[1] = addr(g) + offsets[i] * static_cast<int64_t>(es);
      tensors[i].ptr[2] = use_mom ? addr(*b) + offsets[i] * static_cast<int64_t>(es) : 0;
    }
    const int64_t e = static_cast<int64_t>(es);
    const ChunkRows rows = build_chunk_rows(tensors, {e, e, e, 0}, /*num_groups=*/1);
    num_chunks = rows.num_rows;
    num_groups = 1;
    if (num_chunks > 0) {
      table = &A.make("table", rows.blob.size() * sizeof(int64_t));
      std::vector<char> blob(reinterpret_cast<const char*>(rows.blob.data()),
                             reinterpret_cast<const char*>(rows.blob.data() + rows.blob.size()));
      table->upload(blob);
      a.w.rows = ptr<int64_t>(*table);
      a.w.ranges = ptr<int64_t>(*table) + rows.ranges_offset();
    }
  } else {
    throw CaseError("layout must be rows or list");
  }
  const size_t G = static_cast<size_t>(num_groups);
  DevArray* partials = phase == NarPhase::kApply ? nullptr : &A.make("partials", static_cast<size_t>(num_chunks) * as);
  DevArray* sums = c.i64("finalize", 0) ? &A.make("sums", G * as) : nullptr;
  DevArray& norm = A.make("norm", G * as);
  DevArray& scale = A.make("scale", G * as);
  DevArray& skipped = A.make("skipped", G);
  DevArray* lr_t = A.optional_in("lr", static_cast<size_t>(c.i64("lr_numel", 1)) * as);
  DevArray* wd_t = A.optional_in("wd", static_cast<size_t>(c.i64("wd_numel", 1)) * as);
  DevArray* gs_t = A.optional_in("grad_scale", as);
  const int found_kind = static_cast<int>(c.i64("found_kind", 0));
  DevArray* fi_t = found_kind ? &A.in("found_inf", found_kind == 2 ? 8 : 4) : nullptr;
  DevArray* sq_t = phase == NarPhase::kApply ? &A.in("sq", as) : nullptr;

  a.partials = ptr<acc_t>(partials);
  a.lr = static_cast<acc_t>(c.f64("lr"));
  a.weight_decay = static_cast<acc_t>(c.f64("weight_decay"));
  a.max_norm = static_cast<acc_t>(c.f64("max_norm"));
  a.momentum = static_cast<acc_t>(momentum);
  a.lr_ptr = ptr<const acc_t>(lr_t);
  a.lr_stride = c.i64("lr_numel", 1) == 1 ? 0 : 1;
  a.wd_ptr = ptr<const acc_t>(wd_t);
  a.wd_stride = c.i64("wd_numel", 1) == 1 ? 0 : 1;
  a.grad_scale = ptr<const acc_t>(gs_t);
  a.found_inf = fi_t != nullptr ? fi_t->data() : nullptr;
  a.found_kind = found_kind;
  a.mode = c.i64("mode");
  a.norm_out = ptr<acc_t>(norm);
  a.scale_out = ptr<acc_t>(scale);
  a.skipped_out = ptr<bool>(skipped);
  a.num_groups = num_groups;
  a.group_sq = ptr<const acc_t>(sq_t);
  if (num_groups > 0)
    check(launch_nar<scalar_t>(a, num_chunks, phase, sums != nullptr && phase == NarPhase::kStep, ptr<acc_t>(sums),
                               stream),
          "launch_nar");
  check(cudaStreamSynchronize(stream), "nar kernels");
  for (const char* name : {"x", "norm", "scale", "skipped"}) A.write_out(name);
  if (use_mom) A.write_out("b");
}

// The clients of aggregate / client_dots: layout 2d (one [C, N] buffer, at element
// offset_X) or list (C buffers, client i at element offset_X of its own; an address
// table when C > 1).
template <typename scalar_t>
struct ClientsOnDevice {
  const int64_t* ptrs = nullptr;
  int64_t base = 0, row_stride = 0;
  bool aligned = true;
};

template <typename scalar_t>
ClientsOnDevice<scalar_t> upload_clients(const Case& c, Arrays& A, int64_t C, int64_t N) {
  const size_t es = sizeof(scalar_t);
  ClientsOnDevice<scalar_t> out;
  const size_t pad = pad_of(c, "X", es);
  if (c.str("layout") == "2d") {
    DevArray& X = A.in("X", static_cast<size_t>(C * N) * es, pad);
    out.base = addr(X);
    out.row_stride = N;
    out.aligned = aligned16(X.data()) && (N * static_cast<int64_t>(es)) % 16 == 0;
    return out;
  }
  const std::vector<char> all = c.input("X");
  if (all.size() != static_cast<size_t>(C * N) * es) throw CaseError("in_X.bin has the wrong size");
  std::vector<int64_t> addresses(static_cast<size_t>(C));
  for (int64_t i = 0; i < C; ++i) {
    DevArray& xi = A.make("X" + std::to_string(i), static_cast<size_t>(N) * es, pad);
    xi.upload(std::vector<char>(all.begin() + i * N * es, all.begin() + (i + 1) * N * es));
    addresses[static_cast<size_t>(i)] = N > 0 ? addr(xi) : 0;
    if (N > 0) out.aligned = out.aligned && aligned16(xi.data());
  }
  if (C == 1) {
    out.base = addresses[0];
  } else if (N > 0) {
    DevArray& table = A.make("client_table", addresses.size() * sizeof(int64_t));
    table.upload(std::vector<char>(reinterpret_cast<const char*>(addresses.data()),
                                   reinterpret_cast<const char*>(addresses.data() + addresses.size())));
    out.ptrs = ptr<const int64_t>(table);
  }
  return out;
}

template <typename scalar_t>
RowsArgs<acc_type<scalar_t>> rows_args(const ClientsOnDevice<scalar_t>& cl, const AggTiling& t, int64_t C, int64_t N,
                                       const void* other) {
  RowsArgs<acc_type<scalar_t>> a{};
  a.ptrs = cl.ptrs;
  a.base = cl.base;
  a.row_stride = cl.row_stride;
  a.C = C;
  a.N = N;
  a.num_tiles = t.tiles;
  a.aligned = cl.aligned && aligned16(other);
  return a;
}

template <typename scalar_t>
void run_aggregate(const Case& c, Arrays& A, cudaStream_t stream) {
  using acc_t = acc_type<scalar_t>;
  const size_t as = sizeof(acc_t);
  const int64_t C = c.i64("C"), N = c.i64("N");
  const bool out_acc = c.i64("out_acc", 0) != 0;
  const AggTiling t = aggregate_tiling(N, sizeof(scalar_t));
  const ClientsOnDevice<scalar_t> cl = upload_clients<scalar_t>(c, A, C, N);
  const size_t os = out_acc ? as : sizeof(scalar_t);
  DevArray& out = A.in("out", static_cast<size_t>(N) * os, pad_of(c, "out", os));
  DevArray& w = A.in("w", static_cast<size_t>(C) * as);
  DevArray* gamma_t = A.optional_in("gamma", as);
  DevArray* skip = A.optional_in("skip", 1);
  DevArray* std_t = A.optional_in("noise_std", as);
  DevArray& partials = A.make("partials", static_cast<size_t>((C + 1) * t.blocks) * as);
  DevArray& q = A.make("sq_norms", static_cast<size_t>(C) * as);
  DevArray& Q = A.make("sq_norm", as);
  RowsArgs<acc_t> a = rows_args<scalar_t>(cl, t, C, N, out.data());
  a.weights = ptr<const acc_t>(w);
  a.gamma = static_cast<acc_t>(c.f64("gamma"));
  a.gamma_ptr = ptr<const acc_t>(gamma_t);
  a.skip = ptr<const bool>(skip);
  a.out = out.data();
  a.partials = ptr<acc_t>(partials);
  const bool noise = c.has("noise_key");
  if (noise) {
    a.noise_key = static_cast<uint64_t>(c.i64("noise_key"));
    a.noise_std = static_cast<acc_t>(c.f64("noise_std"));
    a.noise_std_ptr = ptr<const acc_t>(std_t);
  }
  cudaError_t err;
  if (out_acc)
    err = noise ? launch_aggregate<scalar_t, acc_t, true>(a, t, ptr<acc_t>(q), ptr<acc_t>(Q), stream)
                : launch_aggregate<scalar_t, acc_t, false>(a, t, ptr<acc_t>(q), ptr<acc_t>(Q), stream);
  else
    err = noise ? launch_aggregate<scalar_t, scalar_t, true>(a, t, ptr<acc_t>(q), ptr<acc_t>(Q), stream)
                : launch_aggregate<scalar_t, scalar_t, false>(a, t, ptr<acc_t>(q), ptr<acc_t>(Q), stream);
  check(err, "launch_aggregate");
  check(cudaStreamSynchronize(stream), "aggregate kernels");
  for (const char* name : {"out", "sq_norms", "sq_norm"}) A.write_out(name);
}

template <typename scalar_t>
void run_client_dots(const Case& c, Arrays& A, cudaStream_t stream) {
  using acc_t = acc_type<scalar_t>;
  const size_t as = sizeof(acc_t);
  const int64_t C = c.i64("C"), N = c.i64("N");
  const bool g_acc = c.i64("g_acc", 0) != 0;
  const AggTiling t = aggregate_tiling(N, sizeof(scalar_t));
  const ClientsOnDevice<scalar_t> cl = upload_clients<scalar_t>(c, A, C, N);
  const size_t gs = g_acc ? as : sizeof(scalar_t);
  DevArray& g = A.in("g", static_cast<size_t>(N) * gs, pad_of(c, "g", gs));
  DevArray& partials = A.make("partials", static_cast<size_t>(C * t.blocks) * as);
  DevArray& dots = A.make("dots", static_cast<size_t>(C) * as);
  RowsArgs<acc_t> a = rows_args<scalar_t>(cl, t, C, N, g.data());
  a.g = g.data();
  a.partials = ptr<acc_t>(partials);
  check(g_acc ? launch_client_dots<scalar_t, acc_t>(a, t, ptr<acc_t>(dots), stream)
              : launch_client_dots<scalar_t, scalar_t>(a, t, ptr<acc_t>(dots), stream),
        "launch_client_dots");
  check(cudaStreamSynchronize(stream), "client_dots kernels");
  A.write_out("dots");
}

template <typename scalar_t>
void run_add_noise(const Case& c, Arrays& A, cudaStream_t stream) {
  using acc_t = acc_type<scalar_t>;
  const int64_t n = c.i64("N");
  DevArray& out = A.in("out", static_cast<size_t>(n) * sizeof(scalar_t), pad_of(c, "out", sizeof(scalar_t)));
  DevArray* std_t = A.optional_in("noise_std", sizeof(acc_t));
  DevArray* skip = A.optional_in("skip", 1);
  check(launch_add_noise<scalar_t>(ptr<scalar_t>(out), n, static_cast<uint64_t>(c.i64("noise_key")),
                                   static_cast<acc_t>(c.f64("noise_std")), ptr<const acc_t>(std_t),
                                   ptr<const bool>(skip), stream),
        "launch_add_noise");
  check(cudaStreamSynchronize(stream), "add_noise kernel");
  A.write_out("out");
}

// Server update: tensors of `sizes` elements at element `offsets` of flat x, m, v
// buffers (params' dtype) and at `d_offsets` of the flat acc-dtype d buffer.
template <typename scalar_t>
void run_server_update(const Case& c, Arrays& A, cudaStream_t stream) {
  using acc_t = acc_type<scalar_t>;
  const size_t es = sizeof(scalar_t), as = sizeof(acc_t);
  const int64_t rule = c.i64("rule");
  if (rule < 0 || rule > 4) throw CaseError("rule must be 0..4");
  const ServerRule r = static_cast<ServerRule>(rule);
  const bool has_m = r != ServerRule::kSgd, has_v = has_m && r != ServerRule::kMomentum;
  const size_t total = static_cast<size_t>(c.i64("numel")), dtotal = static_cast<size_t>(c.i64("d_numel"));
  const std::vector<int64_t> sizes = c.i64s("sizes"), offsets = c.i64s("offsets"), doffsets = c.i64s("d_offsets");
  DevArray& x = A.in("x", total * es);
  DevArray& d = A.in("d", dtotal * as);
  DevArray* m = has_m ? &A.in("m", total * es) : nullptr;
  DevArray* v = has_v ? &A.in("v", total * es) : nullptr;
  std::vector<ChunkTensor> tensors(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (static_cast<size_t>(offsets[i] + sizes[i]) > total || static_cast<size_t>(doffsets[i] + sizes[i]) > dtotal)
      throw CaseError("tensor " + std::to_string(i) + " lies outside the buffers");
    tensors[i].numel = sizes[i];
    if (sizes[i] == 0) continue;
    const int64_t e = static_cast<int64_t>(es);
    tensors[i].ptr[0] = addr(x) + offsets[i] * e;
    tensors[i].ptr[1] = addr(d) + doffsets[i] * static_cast<int64_t>(as);
    tensors[i].ptr[2] = has_m ? addr(*m) + offsets[i] * e : 0;
    tensors[i].ptr[3] = has_v ? addr(*v) + offsets[i] * e : 0;
  }
  const int64_t e = static_cast<int64_t>(es), ea = static_cast<int64_t>(as);
  const ChunkRows rows = build_chunk_rows(tensors, {e, ea, e, e}, /*num_groups=*/1);
  DevArray* lr_t = A.optional_in("lr", as);
  DevArray* gamma_t = A.optional_in("gamma", as);
  DevArray* skip = A.optional_in("skip", 1);
  if (rows.num_rows > 0) {
    DevArray& table = A.make("table", rows.blob.size() * sizeof(int64_t));
    table.upload(std::vector<char>(reinterpret_cast<const char*>(rows.blob.data()),
                                   reinterpret_cast<const char*>(rows.blob.data() + rows.blob.size())));
    ServerArgs<acc_t> a{};
    a.rows = ptr<const int64_t>(table);
    a.lr = static_cast<acc_t>(c.f64("lr"));
    a.gamma = static_cast<acc_t>(c.f64("gamma"));
    a.beta1 = static_cast<acc_t>(c.f64("beta1"));
    a.beta2 = static_cast<acc_t>(c.f64("beta2"));
    a.tau = static_cast<acc_t>(c.f64("tau"));
    a.lr_ptr = ptr<const acc_t>(lr_t);
    a.gamma_ptr = ptr<const acc_t>(gamma_t);
    a.skip = ptr<const bool>(skip);
    check(launch_server_update<scalar_t>(a, rows.num_rows, r, c.i64("nesterov", 0) != 0, stream),
          "launch_server_update");
  }
  check(cudaStreamSynchronize(stream), "server_update kernel");
  A.write_out("x");
  if (has_m) A.write_out("m");
  if (has_v) A.write_out("v");
}

template <typename scalar_t>
void run_coordinate_select(const Case& c, Arrays& A, cudaStream_t stream) {
  using acc_t = acc_type<scalar_t>;
  const int64_t C = c.i64("C"), N = c.i64("N");
  if (C > kMaxClients) throw CaseError("at most kMaxClients clients");
  const bool out_acc = c.i64("out_acc", 0) != 0;
  DevArray& X = A.in("X", static_cast<size_t>(C * N) * sizeof(scalar_t));
  DevArray& keep = A.in("keep", static_cast<size_t>(C));
  DevArray& count = A.in("count", sizeof(int64_t));
  DevArray* skip = A.optional_in("skip", 1);
  DevArray& out = A.in("out", static_cast<size_t>(N) * (out_acc ? sizeof(acc_t) : sizeof(scalar_t)));
  DevArray& bad = A.make("bad", static_cast<size_t>(C) * sizeof(int));
  check(cudaMemset(bad.data(), 0, bad.bytes()), "zero bad");
  const int mode = static_cast<int>(c.i64("mode"));
  cudaError_t err;
  if (out_acc)
    err = launch_coordinate_select<scalar_t>(ptr<const scalar_t>(X), ptr<const bool>(keep), ptr<const int64_t>(count),
                                             mode, C, N, ptr<acc_t>(out), ptr<int>(bad), ptr<const bool>(skip),
                                             stream);
  else
    err = launch_coordinate_select<scalar_t>(ptr<const scalar_t>(X), ptr<const bool>(keep), ptr<const int64_t>(count),
                                             mode, C, N, ptr<scalar_t>(out), ptr<int>(bad), ptr<const bool>(skip),
                                             stream);
  check(err, "launch_coordinate_select");
  check(cudaStreamSynchronize(stream), "coordinate_select kernel");
  A.write_out("out");
  A.write_out("bad");
}

// The codecs' fused decode-aggregate (fp32 only: dtype fp32).  codec block: codes
// [C, L] bytes (int8 kind 0 / int4 kind 1 / fp8 kind 2) and scales [C, NB]; codec topk:
// values and indices, the clients' kept values one after another, `ks` per client.
// w [C]; gamma a value, or the input gamma_t; skip optional.  Out: out [N], q [C], total.
void run_compressed(const Case& c, Arrays& A, cudaStream_t stream) {
  const int64_t C = c.i64("C"), N = c.i64("N");
  const std::string codec = c.str("codec");
  DevArray& w = A.in("w", static_cast<size_t>(C) * sizeof(float));
  DevArray* skip = A.optional_in("skip", 1);
  DevArray* gamma_t = A.optional_in("gamma_t", sizeof(float));
  const float gamma = static_cast<float>(c.f64("gamma", 1.0));
  DevArray& out = A.in("out", static_cast<size_t>(N) * sizeof(float));
  DevArray& q = A.make("q", static_cast<size_t>(C) * sizeof(float));
  DevArray& total = A.make("total", sizeof(float));
  cudaError_t err;
  if (codec == "block") {
    const int64_t block = c.i64("block");
    const int kind = static_cast<int>(c.i64("kind"));
    if (block <= 0 || kind < 0 || kind > 2) throw CaseError("block > 0 and kind 0, 1 or 2");
    const int64_t L = kind == 1 ? (N + 1) / 2 : N, NB = (N + block - 1) / block;
    DevArray& codes = A.in("codes", static_cast<size_t>(C * L));
    DevArray& scales = A.in("scales", static_cast<size_t>(C * NB) * sizeof(float));
    DevArray& part = A.make("part", static_cast<size_t>((C + 1) * block_decode_parts(N)) * sizeof(float));
    check(cudaMemset(part.data(), 0, part.bytes()), "zero part");
    err = launch_block_decode_aggregate(ptr<const uint8_t>(codes), ptr<const float>(scales), ptr<const float>(w),
                                        ptr<float>(out), ptr<float>(part), ptr<float>(q), ptr<float>(total),
                                        ptr<const bool>(skip), ptr<const float>(gamma_t), gamma, C, N, block, kind,
                                        stream);
  } else if (codec == "topk") {
    const std::vector<int64_t> ks = c.i64s("ks");
    if (static_cast<int64_t>(ks.size()) != C) throw CaseError("ks must give one k per client");
    int64_t K = 0, max_k = 0;
    for (int64_t k : ks) {
      if (k < 0) throw CaseError("ks must be >= 0");
      K += k;
      max_k = std::max(max_k, k);
    }
    DevArray& values = A.in("values", static_cast<size_t>(K) * sizeof(float));
    DevArray& indices = A.in("indices", static_cast<size_t>(K) * sizeof(int64_t));
    const int64_t nparts = topk_decode_parts(N, max_k);
    DevArray& acc = A.make("acc", static_cast<size_t>(N) * sizeof(float));
    DevArray& part = A.make("part", static_cast<size_t>((C + 1) * nparts) * sizeof(float));
    check(cudaMemset(acc.data(), 0, acc.bytes()), "zero acc");
    check(cudaMemset(part.data(), 0, part.bytes()), "zero part");
    std::vector<const float*> vals(C);
    std::vector<const int64_t*> idxs(C);
    for (int64_t i = 0, at = 0; i < C; at += ks[i], ++i) {
      vals[i] = ptr<const float>(values) + at;
      idxs[i] = ptr<const int64_t>(indices) + at;
    }
    err = launch_topk_decode_aggregate(vals.data(), idxs.data(), ks.data(), ptr<const float>(w), ptr<float>(acc),
                                       ptr<float>(out), ptr<float>(part), ptr<float>(q), ptr<float>(total),
                                       ptr<const bool>(skip), ptr<const float>(gamma_t), gamma, C, N, nparts, stream);
  } else {
    throw CaseError("codec must be block or topk");
  }
  check(err, "launch_*_decode_aggregate");
  check(cudaStreamSynchronize(stream), "decode_aggregate kernels");
  A.write_out("out");
  A.write_out("q");
  A.write_out("total");
}

// The client's int8 / int4 encode: x [N] of the case's dtype; keys block, int4,
// stochastic, key, client.  Out: codes (N or (N + 1) / 2 bytes), scales [ceil(N / block)].
template <typename scalar_t>
void run_quantize(const Case& c, Arrays& A, cudaStream_t stream) {
  const int64_t N = c.i64("N"), block = c.i64("block");
  if (block <= 0 || block % 32 != 0) throw CaseError("block must be a positive multiple of 32");
  const bool int4 = c.i64("int4") != 0;
  DevArray& x = A.in("x", static_cast<size_t>(N) * sizeof(scalar_t));
  DevArray& codes = A.make("codes", static_cast<size_t>(int4 ? (N + 1) / 2 : N));
  DevArray& scales = A.make("scales", static_cast<size_t>((N + block - 1) / block) * sizeof(float));
  check(launch_block_quantize<scalar_t>(ptr<const scalar_t>(x), ptr<uint8_t>(codes), ptr<float>(scales), N, block,
                                        int4, c.i64("stochastic") != 0, static_cast<uint64_t>(c.i64("key")),
                                        static_cast<uint32_t>(c.i64("client")), stream),
        "launch_block_quantize");
  check(cudaStreamSynchronize(stream), "block_quantize kernel");
  A.write_out("codes");
  A.write_out("scales");
}

// The client's fp8 (e4m3fn) encode, block_quantize's kind 2: x [N] fp32 (the op widens
// any other dtype first); key block.  Out: codes [N] (e4m3fn bits), scales [ceil(N / block)].
void run_encode_fp8(const Case& c, Arrays& A, cudaStream_t stream) {
  const int64_t N = c.i64("N"), block = c.i64("block");
  if (block <= 0 || block % 32 != 0) throw CaseError("block must be a positive multiple of 32");
  DevArray& x = A.in("x", static_cast<size_t>(N) * sizeof(float));
  DevArray& codes = A.make("codes", static_cast<size_t>(N));
  DevArray& scales = A.make("scales", static_cast<size_t>((N + block - 1) / block) * sizeof(float));
  check(launch_fp8_encode(ptr<const float>(x), ptr<uint8_t>(codes), ptr<float>(scales), N, block, stream),
        "launch_fp8_encode");
  check(cudaStreamSynchronize(stream), "fp8_encode kernel");
  A.write_out("codes");
  A.write_out("scales");
}

// The client's top-k encode: x [N] of the case's dtype (read in it, widened to fp32 by
// the kernels); key k, optional index64 (1: the 64-bit index digits whatever N).
// Out: values float32 [k], indices int64 [k] (ascending).
template <typename scalar_t>
void run_topk_encode(const Case& c, Arrays& A, cudaStream_t stream) {
  const int64_t N = c.i64("N"), k = c.i64("k");
  if (N < 0 || k < 0 || k > N) throw CaseError("need 0 <= k <= N");
  DevArray& x = A.in("x", static_cast<size_t>(N) * sizeof(scalar_t));
  DevArray& values = A.make("values", static_cast<size_t>(k) * sizeof(float));
  DevArray& indices = A.make("indices", static_cast<size_t>(k) * sizeof(int64_t));
  DevArray& workspace = A.make("workspace", topk_workspace_bytes(N));
  if (c.i64("index64", 0) != 0) {  // the 64-bit index digits (N > 2^32 on a GPU) on a small N
    if (k <= 0 || k >= N) throw CaseError("index64 needs 0 < k < N");
    check(launch_topk_select<scalar_t, true>(ptr<const scalar_t>(x), N, k, ptr<float>(values),
                                             ptr<int64_t>(indices), workspace.data(), stream),
          "launch_topk_select<index64>");
  } else {
    check(launch_topk_encode<scalar_t>(ptr<const scalar_t>(x), N, k, ptr<float>(values), ptr<int64_t>(indices),
                                       workspace.data(), stream),
          "launch_topk_encode");
  }
  check(cudaStreamSynchronize(stream), "topk_encode kernels");
  A.write_out("values");
  A.write_out("indices");
}

// The top-k compaction's tile-offset scan alone (topk_scan_kernel), on more tiles than
// one step of its block covers (a selection needs N > 8M elements for that: too slow to
// simulate whole): counts uint64 [tiles] in, their exclusive prefix sums out (in place).
void run_topk_scan(const Case& c, Arrays& A, cudaStream_t stream) {
  const int64_t tiles = c.i64("tiles");
  if (tiles < 0) throw CaseError("tiles must be >= 0");
  DevArray& counts = A.in("counts", static_cast<size_t>(tiles) * sizeof(unsigned long long));
  topk_scan_kernel<<<1, kTopkThreads, 0, stream>>>(ptr<unsigned long long>(counts), tiles);
  check(cudaGetLastError(), "topk_scan_kernel launch");
  check(cudaStreamSynchronize(stream), "topk_scan_kernel");
  A.write_out("counts");
}

// ------------------------------------------------------------------------- Triton (driver API)

// The few driver entry points the triton family needs, asked of the runtime
// (cudaGetDriverEntryPointByVersion): the harness links only the shared libcudart, so
// the same binary runs on a GPU and on a simulator that provides a runtime but no
// libcuda.
struct Driver {
  using CUresult = int;
  using CUmodule = void*;
  using CUfunction = void*;
  CUresult (*ModuleLoadData)(CUmodule*, const void*) = nullptr;
  CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*FuncSetAttribute)(CUfunction, int, int) = nullptr;
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                           void**, void**) = nullptr;
  CUresult (*ModuleUnload)(CUmodule) = nullptr;

  Driver() {
    load(ModuleLoadData, "cuModuleLoadData", true);
    load(ModuleGetFunction, "cuModuleGetFunction", true);
    load(LaunchKernel, "cuLaunchKernel", true);
    load(FuncSetAttribute, "cuFuncSetAttribute", false);  // only for > 48 KiB of shared memory
    load(ModuleUnload, "cuModuleUnload", false);
  }
  template <typename F>
  static void load(F& f, const char* name, bool required) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t err = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found);
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || p == nullptr) {
      cudaGetLastError();  // a missing optional entry point leaves no sticky error behind
      if (required) throw NoDevice(std::string("the runtime gives no driver entry point ") + name);
      return;
    }
    f = reinterpret_cast<F>(p);
  }
  static void ok(CUresult r, const std::string& what) {
    if (r != 0) throw CudaFailure(what + ": CUresult " + std::to_string(r));
  }
};

// Device addresses in a table (the table-driven Triton kernels read per-tensor pointer
// and size tables, backends/_chunks.py's rows and _tables.py's client table): each
// `reloc TABLE WORD TARGET` line adds the device address of array TARGET to the int64
// word WORD of array TABLE, whose file holds the byte offset into TARGET there; the
// patched table is then uploaded again.  The writer builds the table with the same
// code as the backend, from host addresses, and says which words are addresses.
void relocate_tables(const Case& c, const std::map<std::string, DevArray*>& arrays) {
  std::map<std::string, std::vector<char>> tables;
  for (const auto& r : c.relocs()) {
    if (r.size() != 3 || !arrays.count(r[0]) || !arrays.count(r[2]))
      throw CaseError("reloc TABLE WORD TARGET: both arrays declared");
    auto it = tables.find(r[0]);
    if (it == tables.end()) it = tables.emplace(r[0], c.input(r[0])).first;
    std::vector<char>& host = it->second;
    const int64_t word = Case::parse_i64(r[1], "reloc");
    if (word < 0 || static_cast<size_t>(word + 1) * 8 > host.size()) throw CaseError("reloc word outside " + r[0]);
    int64_t v = 0;
    std::memcpy(&v, host.data() + word * 8, 8);
    v += addr(*arrays.at(r[2]));
    std::memcpy(host.data() + word * 8, &v, 8);
  }
  for (auto& [name, host] : tables) arrays.at(name)->upload(host);
}

// `module FILE` (PTX text, relative to the case), `name`, `grid gx gy gz`, `block
// threads`, `shared bytes`; `array NAME BYTES [PAD [out]]` lines declare the device
// arrays (in_NAME.bin, at PAD bytes of misalignment; `out` writes them back), then one
// `arg` line per kernel parameter in order: `arg ptr NAME` (the array's address as a
// pointer), `arg addr NAME` (the same address as an i64: kernels that rebuild pointers
// from integers), either with an optional byte OFFSET into the array (a view), `arg i32
// V`, `arg i64 V`, `arg f32 V`, `arg f64 V`, `arg null` (a null pointer: Triton's
// scratch parameters when the kernel needs no scratch); `reloc` lines: above.
void run_triton(const Case& c, Arrays& A) {
  check(cudaFree(nullptr), "creating the runtime's context");  // the primary context, current
  const Driver drv;
  std::ifstream f(c.dir() + "/" + c.str("module"), std::ios::binary);
  if (!f) throw CaseError("cannot read the module " + c.str("module"));
  std::string image((std::istreambuf_iterator<char>(f)), {});
  image.push_back('\0');  // PTX is read as a C string
  Driver::CUmodule mod = nullptr;
  Driver::ok(drv.ModuleLoadData(&mod, image.data()), "cuModuleLoadData");
  Driver::CUfunction fn = nullptr;
  Driver::ok(drv.ModuleGetFunction(&fn, mod, c.str("name").c_str()), "cuModuleGetFunction " + c.str("name"));
  const int shared = static_cast<int>(c.i64("shared", 0));
  if (shared > 48 * 1024) {  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
    if (drv.FuncSetAttribute == nullptr) throw NoDevice("no cuFuncSetAttribute for > 48 KiB of shared memory");
    Driver::ok(drv.FuncSetAttribute(fn, 8, shared), "cuFuncSetAttribute");
  }

  std::map<std::string, DevArray*> arrays;
  std::vector<std::string> outs;
  for (const auto& a : c.arrays()) {
    if (a.size() < 2) throw CaseError("array NAME BYTES [PAD [out]]");
    const size_t pad = a.size() > 2 ? static_cast<size_t>(Case::parse_i64(a[2], "array")) : 0;
    arrays[a[0]] = &A.in(a[0], static_cast<size_t>(Case::parse_i64(a[1], "array")), pad);
    if (a.size() > 3 && a[3] == "out") outs.push_back(a[0]);
  }
  auto array = [&](const std::vector<std::string>& a) -> DevArray& {
    if (a.size() < 2 || a.size() > 3 || !arrays.count(a[1]))
      throw CaseError("arg " + a[0] + " names no declared array");
    return *arrays[a[1]];
  };
  relocate_tables(c, arrays);
  // Parameter storage: one 8-byte slot per argument (the driver copies the size each
  // parameter has from the slot's start).
  const auto& args = c.args();
  std::vector<uint64_t> slots(args.size(), 0);
  std::vector<void*> params(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& a = args[i];
    if (a.empty()) throw CaseError("empty arg line");
    const std::string& kind = a[0];
    void* slot = &slots[i];
    if (kind == "ptr" || kind == "addr") {  // [OFFSET]: bytes into the array (a view)
      const uint64_t p = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(array(a).data())) +
                         (a.size() > 2 ? static_cast<uint64_t>(Case::parse_i64(a[2], "arg")) : 0);
      std::memcpy(slot, &p, 8);
    } else if (kind == "null") {
    } else if (kind == "i32") {
      const int32_t v = static_cast<int32_t>(Case::parse_i64(a.at(1), "arg"));
      std::memcpy(slot, &v, 4);
    } else if (kind == "i64") {
      const int64_t v = Case::parse_i64(a.at(1), "arg");
      std::memcpy(slot, &v, 8);
    } else if (kind == "f32") {
      const float v = static_cast<float>(Case::parse_f64(a.at(1), "arg"));
      std::memcpy(slot, &v, 4);
    } else if (kind == "f64") {
      const double v = Case::parse_f64(a.at(1), "arg");
      std::memcpy(slot, &v, 8);
    } else {
      throw CaseError("unknown arg kind " + kind);
    }
    params[i] = slot;
  }
  const std::vector<int64_t> grid = c.i64s("grid");
  if (grid.size() != 3) throw CaseError("grid gx gy gz");
  Driver::ok(drv.LaunchKernel(fn, static_cast<unsigned>(grid[0]), static_cast<unsigned>(grid[1]),
                              static_cast<unsigned>(grid[2]), static_cast<unsigned>(c.i64("block")), 1, 1,
                              static_cast<unsigned>(shared), /*stream=*/nullptr, params.data(), nullptr),
             "cuLaunchKernel " + c.str("name"));
  check(cudaDeviceSynchronize(), "triton kernel");
  for (const auto& name : outs) A.write_out(name);
  if (drv.ModuleUnload != nullptr) drv.ModuleUnload(mod);
}

// ------------------------------------------------------------------------- main

// Which families this binary holds (FEDOPT_HARNESS_FAMILY, one family's name, set by
// tests/_gpu_harness.py when FEDOPT_HARNESS_SPLIT=1): a simulator parses the whole PTX
// of a program at every start, so one family per binary makes each start several times
// cheaper.  Without it, every family.
#ifdef FEDOPT_HARNESS_FAMILY
#define FEDOPT_HARNESS_HAS(f) (std::string_view(FEDOPT_HARNESS_FAMILY) == f)
#else
#define FEDOPT_HARNESS_HAS(f) true
#endif

template <typename scalar_t>
void run_family(const std::string& kernel, const Case& c, Arrays& A, cudaStream_t stream) {
  if constexpr (FEDOPT_HARNESS_HAS("nar"))
    if (kernel == "nar") return run_nar<scalar_t>(c, A, stream);
  if constexpr (FEDOPT_HARNESS_HAS("aggregate"))
    if (kernel == "aggregate") return run_aggregate<scalar_t>(c, A, stream);
  if constexpr (FEDOPT_HARNESS_HAS("client_dots"))
    if (kernel == "client_dots") return run_client_dots<scalar_t>(c, A, stream);
  if constexpr (FEDOPT_HARNESS_HAS("add_noise"))
    if (kernel == "add_noise") return run_add_noise<scalar_t>(c, A, stream);
  if constexpr (FEDOPT_HARNESS_HAS("server_update"))
    if (kernel == "server_update") return run_server_update<scalar_t>(c, A, stream);
  if constexpr (FEDOPT_HARNESS_HAS("coordinate_select"))
    if (kernel == "coordinate_select") return run_coordinate_select<scalar_t>(c, A, stream);
  if constexpr (FEDOPT_HARNESS_HAS("compressed") && std::is_same_v<scalar_t, float>)
    if (kernel == "compressed") return run_compressed(c, A, stream);
  if constexpr (FEDOPT_HARNESS_HAS("quantize"))
    if (kernel == "quantize") return run_quantize<scalar_t>(c, A, stream);
  if constexpr (FEDOPT_HARNESS_HAS("encode_fp8") && std::is_same_v<scalar_t, float>)
    if (kernel == "encode_fp8") return run_encode_fp8(c, A, stream);
  if constexpr (FEDOPT_HARNESS_HAS("topk_encode"))
    if (kernel == "topk_encode") return run_topk_encode<scalar_t>(c, A, stream);
  if constexpr (FEDOPT_HARNESS_HAS("topk_scan") && std::is_same_v<scalar_t, float>)
    if (kernel == "topk_scan") return run_topk_scan(c, A, stream);
  throw CaseError("kernel family '" + kernel + "' is not built into this binary");
}

void need_device() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess || n == 0)
    throw NoDevice(std::string("the CUDA runtime reports no device: ") +
                   (err != cudaSuccess ? cudaGetErrorString(err) : "0 devices"));
}

int run(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: gpu_harness CASE_DIR | --probe\n");
    return 2;
  }
  need_device();
  if (std::string(argv[1]) == "--probe") {
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    int rt = 0;
    cudaRuntimeGetVersion(&rt);
    std::printf("device %s sm_%d%d runtime %d\n", prop.name, prop.major, prop.minor, rt);
    return 0;
  }
  const Case c(argv[1]);
  const std::string kernel = c.str("kernel");
  cudaStream_t stream = nullptr;
  check(cudaStreamCreate(&stream), "cudaStreamCreate");
  const auto t0 = std::chrono::steady_clock::now();
  {
    Arrays A(c);
    if (kernel == "triton") {
      if constexpr (!FEDOPT_HARNESS_HAS("triton")) throw CaseError("the triton family is not built into this binary");
      run_triton(c, A);
    } else {
      const std::string dtype = c.str("dtype");
      if (dtype == "fp32")
        run_family<float>(kernel, c, A, stream);
      else if (dtype == "fp64")
        run_family<double>(kernel, c, A, stream);
      else if (dtype == "fp16")
        run_family<__half>(kernel, c, A, stream);
      else if (dtype == "bf16")
        run_family<__nv_bfloat16>(kernel, c, A, stream);
      else
        throw CaseError("dtype must be fp16, bf16, fp32 or fp64");
    }
    A.check_guards();
  }
  check(cudaStreamDestroy(stream), "cudaStreamDestroy");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("ok %s %.3f s\n", kernel.c_str(), s);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const CaseError& e) {
    std::fprintf(stderr, "gpu_harness: bad case: %s\n", e.what());
    return 2;
  } catch (const NoDevice& e) {
    std::fprintf(stderr, "gpu_harness: cannot run here: %s\n", e.what());
    return 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_harness: %s\n", e.what());
    return 1;
  }
}
