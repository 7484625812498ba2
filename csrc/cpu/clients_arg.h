// The clients argument of the CPU ops over C client rows (aggregate, client_dots,
// coordinate_select, client_gram): C 1-D tensors or one [C, N] tensor as row pointers,
// or the clients as pieces read in place (the *_pieces ops), checked once here.
#pragma once

#include <optional>
#include <vector>

#include "ops_common.h"

namespace fedopt::cpu {

// `clients` as row pointers: C 1-D tensors of length N, or one contiguous [C, N].
struct Clients {
  at::ScalarType dtype;
  int64_t C = 0, N = 0;
  std::vector<const void*> rows;
};

inline Clients unpack_clients(at::TensorList clients, const char* op) {
  TORCH_CHECK(!clients.empty(), "fedopt_C: clients must hold one [C, N] tensor or C 1-D tensors");
  Clients r;
  r.dtype = clients[0].scalar_type();
  check_supported_float(op, "clients", r.dtype);
  if (clients.size() == 1 && clients[0].dim() == 2) {
    const at::Tensor& X = clients[0];
    check_flat(X, r.dtype, "clients");
    TORCH_CHECK(X.is_contiguous(), "fedopt_C: clients as a [C, N] tensor must be contiguous");
    r.C = X.size(0);
    r.N = X.size(1);
    const char* base = static_cast<const char*>(X.const_data_ptr());
    for (int64_t i = 0; i < r.C; ++i) r.rows.push_back(base + i * r.N * X.element_size());
  } else {
    r.C = static_cast<int64_t>(clients.size());
    r.N = clients[0].numel();
    for (const at::Tensor& t : clients) {
      TORCH_CHECK(t.dim() == 1, "fedopt_C: clients given as a list must be 1-D tensors, got ", t.sizes());
      check_flat(t, r.dtype, "clients");
      TORCH_CHECK(t.numel() == r.N, "fedopt_C: clients must all have ", r.N, " elements, got ", t.numel());
      r.rows.push_back(t.const_data_ptr());
    }
  }
  return r;
}

// Clients given as pieces, read in place (kernel_api.h, PieceTable): `pieces` lists
// client 0's pieces, then client 1's, ...; every client has `pieces_per_client` of
// them, piece p of every client having the same number of elements; `subtract_from`
// (optional, [N]) makes client i's row subtract_from - x_i.  `table` points into the
// struct's own vectors' buffers, which a move keeps and a copy would not: no copies.
struct Pieces {
  Clients cl;
  std::vector<int64_t> starts;
  std::vector<const void*> ptrs;
  PieceTable table;
  Pieces() = default;
  Pieces(const Pieces&) = delete;
  Pieces(Pieces&&) = default;
};

inline Pieces unpack_pieces(const char* op, at::TensorList pieces, int64_t pieces_per_client,
                            const std::optional<at::Tensor>& subtract_from) {
  const int64_t L = pieces_per_client;
  const int64_t total = static_cast<int64_t>(pieces.size());
  TORCH_CHECK(L >= 1 && total >= L && total % L == 0, op, ": pieces must hold pieces_per_client (", L,
              ") pieces for each of at least one client, got ", total, " pieces");
  Pieces r;
  Clients& cl = r.cl;
  cl.dtype = pieces[0].scalar_type();
  check_supported_float(op, "pieces", cl.dtype);
  cl.C = total / L;
  std::vector<int64_t>& starts = r.starts;
  starts.assign(L + 1, 0);
  for (int64_t p = 0; p < L; ++p) starts[p + 1] = starts[p] + pieces[p].numel();
  cl.N = starts[L];
  std::vector<const void*>& ptrs = r.ptrs;
  ptrs.resize(total);
  for (int64_t i = 0; i < cl.C; ++i) {
    for (int64_t p = 0; p < L; ++p) {
      const at::Tensor& t = pieces[i * L + p];
      check_flat(t, cl.dtype, "pieces");
      TORCH_CHECK(t.is_contiguous(), op, ": pieces must be contiguous (client ", i, ", piece ", p, ")");
      TORCH_CHECK(t.numel() == starts[p + 1] - starts[p], op, ": piece ", p, " of client ", i, " has ", t.numel(),
                  " elements, client 0's has ", starts[p + 1] - starts[p]);
      ptrs[i * L + p] = t.const_data_ptr();
    }
  }
  const void* base = nullptr;
  if (subtract_from.has_value()) {
    check_flat(*subtract_from, cl.dtype, "subtract_from");
    TORCH_CHECK(subtract_from->is_contiguous() && subtract_from->numel() == cl.N, op, ": subtract_from must be a "
                "contiguous tensor of ", cl.N, " elements, got ", subtract_from->numel());
    base = subtract_from->const_data_ptr();
  }
  r.table = PieceTable{L, starts.data(), ptrs.data(), base};
  return r;
}

}  // namespace fedopt::cpu
