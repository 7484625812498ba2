// The CUDA extension `fedopt_kernels._C_cuda`: registers the CUDA kernels of the
// `fedopt_C` ops (whose schemas csrc/registration.cpp defines in `fedopt_kernels._C`,
// which must be imported first; fedopt_kernels/backends/_extensions.py does), and a few
// diagnostic ops (leading underscore) that let tests see the host-side decisions of the
// CUDA launchers without a GPU: the chunk rows of fedopt/chunks.h, the aggregation's
// tiling rule, the finalize threshold and the device table cache's counters.
#include <Python.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "fedopt/chunks.h"
#include "fedopt/table_cache.h"
#include "ops.h"

extern "C" {
// Makes `import fedopt_kernels._C_cuda` load the library (and run the registration
// below) without pulling pybind11 into the build.
PyObject* PyInit__C_cuda(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C_cuda", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

namespace {

// fedopt::build_chunk_rows on host integers: `addresses` holds 4 per tensor (ptr0..ptr3),
// `esizes` the 4 arrays' element sizes.  Returns (blob, num_rows, chunk_size,
// max_group_rows); blob = the rows, then [num_groups, 2] partial ranges.
std::tuple<std::vector<int64_t>, int64_t, int64_t, int64_t> chunk_rows(std::vector<int64_t> addresses,
                                                                       std::vector<int64_t> numels,
                                                                       std::vector<int64_t> groups,
                                                                       std::vector<int64_t> esizes,
                                                                       int64_t num_groups) {
  const size_t T = numels.size();
  TORCH_CHECK(addresses.size() == 4 * T && groups.size() == T && esizes.size() == 4,
              "fedopt_C::_cuda_chunk_rows: 4 addresses and one group per tensor, 4 element sizes");
  std::vector<fedopt::ChunkTensor> tensors(T);
  for (size_t i = 0; i < T; ++i) {
    for (int k = 0; k < 4; ++k) tensors[i].ptr[k] = addresses[4 * i + k];
    tensors[i].numel = numels[i];
    tensors[i].group = groups[i];
  }
  const int64_t es[4] = {esizes[0], esizes[1], esizes[2], esizes[3]};
  fedopt::ChunkRows rows;
  try {
    rows = fedopt::build_chunk_rows(tensors, es, num_groups);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, "fedopt_C::_cuda_chunk_rows: ", e.what());
  }
  return {rows.blob, rows.num_rows, rows.chunk_size, rows.max_group_rows};
}

std::vector<int64_t> aggregate_tiling(int64_t n, int64_t esize) {
  TORCH_CHECK(esize == 2 || esize == 4 || esize == 8, "fedopt_C::_cuda_aggregate_tiling: esize must be 2, 4 or 8");
  const fedopt::cuda::AggTiling t = fedopt::cuda::aggregate_tiling(n, esize);
  return {t.threads, t.vectors, t.columns, t.tiles, t.blocks};
}

}  // namespace

TORCH_LIBRARY_IMPL(fedopt_C, CUDA, m) {
  m.impl("nar_step_", TORCH_FN(fedopt::cuda::nar_step_));
  m.impl("nar_step_batched_", TORCH_FN(fedopt::cuda::nar_step_batched_));
  m.impl("nar_sq_norm", TORCH_FN(fedopt::cuda::nar_sq_norm));
  m.impl("nar_apply_", TORCH_FN(fedopt::cuda::nar_apply_));
  m.impl("aggregate", TORCH_FN(fedopt::cuda::aggregate));
  m.impl("add_noise_", TORCH_FN(fedopt::cuda::add_noise_));
  m.impl("client_dots", TORCH_FN(fedopt::cuda::client_dots));
  m.impl("server_update_", TORCH_FN(fedopt::cuda::server_update_));
}

TORCH_LIBRARY_FRAGMENT(fedopt_C, m) {
  m.def("_cuda_chunk_rows(int[] addresses, int[] numels, int[] groups, int[] esizes, int num_groups) "
        "-> (int[], int, int, int)",
        &chunk_rows);
  m.def("_cuda_aggregate_tiling(int n, int esize) -> int[]", &aggregate_tiling);
  m.def("_cuda_max_redundant_partials() -> int", []() -> int64_t { return fedopt::cuda::max_redundant_partials(); });
  // {entries, captured entries, hits, misses, capacity}
  m.def("_cuda_table_cache_info() -> int[]", []() { return fedopt::cuda::table_cache_info(); });
  m.def("_cuda_table_cache_clear() -> ()", []() { fedopt::cuda::table_cache_clear(); });
}
