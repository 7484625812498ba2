"""The signature of every kernel op, written once: the schemas of the ``fedopt_C`` namespace.

Each op's schema is written here and only here as far as Python is concerned; the other
places that spell it out are checked against this table by
tests/test_op_signatures.py:

* the C++ definition (csrc/registration.cpp and the fragments of csrc/cpu), which must
  print exactly as written here once the extension is loaded;
* each backend's function of that name (the backend contract,
  :mod:`fedopt_kernels.backends`, the Triton wrappers included): the same parameter
  names, in the same order, with the same defaults -- a backend passes its arguments to
  the C++ op, or reads them, positionally;
* the op's routed form ``routed_<op>`` (:mod:`.library`), generated from it.

An op written ``name.overload`` is a second overload of ``name``; its backend function
is ``name_overload`` (``ragged_bmm.out`` -> ``ragged_bmm_out``).  ``Tensor(a!)`` marks an
argument the op writes in place (what ``torch.compile`` must know), ``-> ()`` an op that
returns nothing.
"""

from __future__ import annotations

NAMESPACE = "fedopt_C"

# Every backend has these (the contract); each is also routed: a Python-defined op
# ``routed_<op>`` takes the backend's name too, the form ``torch.compile`` records.
CONTRACT = {
    "nar_step_": "nar_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, float lr, "
                 "Tensor? lr_tensor, float weight_decay, Tensor? weight_decay_tensor, float max_norm, int mode, "
                 "float momentum, Tensor? grad_scale, Tensor? found_inf) -> (Tensor, Tensor, Tensor)",
    "nar_step_batched_": "nar_step_batched_(Tensor(a!) params, Tensor grads, Tensor(b!)? momentum_buffers, float lr, "
                         "Tensor? lr_tensor, float weight_decay, Tensor? weight_decay_tensor, float max_norm, "
                         "int mode, float momentum, Tensor? grad_scale, Tensor? found_inf) -> (Tensor, Tensor, Tensor)",
    "nar_sq_norm": "nar_sq_norm(Tensor[] params, Tensor[] grads, float weight_decay, Tensor? weight_decay_tensor, "
                   "int mode, Tensor? grad_scale) -> Tensor",
    "nar_apply_": "nar_apply_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, Tensor sq_norm, "
                  "float lr, Tensor? lr_tensor, float weight_decay, Tensor? weight_decay_tensor, float max_norm, "
                  "int mode, float momentum, Tensor? grad_scale, Tensor? found_inf) -> (Tensor, Tensor, Tensor)",
    "aggregate": "aggregate(Tensor[] clients, Tensor weights, float gamma, Tensor? gamma_tensor, Tensor(a!) out, "
                 "Tensor? skip, int? noise_key=None, float noise_std=0., Tensor? noise_std_tensor=None) "
                 "-> (Tensor, Tensor)",
    "add_noise_": "add_noise_(Tensor(a!) out, int noise_key, float noise_std, Tensor? noise_std_tensor, "
                  "Tensor? skip=None) -> ()",
    "client_dots": "client_dots(Tensor[] clients, Tensor g) -> Tensor",
    "server_update_": "server_update_(Tensor(a!)[] params, Tensor[] updates, Tensor(b!)[] exp_avg, "
                      "Tensor(c!)[] exp_avg_sq, int rule, float lr, Tensor? lr_tensor, float gamma, "
                      "Tensor? gamma_tensor, float beta1, float beta2, float tau, bool nesterov, Tensor? skip) -> ()",
    "coordinate_select": "coordinate_select(Tensor[] clients, Tensor keep, Tensor count, int mode, Tensor(a!) out, "
                         "Tensor? skip) -> Tensor",
    "client_gram": "client_gram(Tensor[] clients, bool float64_products) -> Tensor",
}

# Composed in Python from contract ops (no backend function of its own), routed too.
COMPOSED = {
    "weighted_sum": "weighted_sum(Tensor[] clients, Tensor weights, Tensor gamma) -> Tensor",
}

# A backend may have these (the C++ CPU backend has all; the reference backend the
# ragged products).  Never routed: the ops layer calls them eagerly only (clients read
# in place are refused under torch.compile; the ragged products live in the batched
# engine's own traced graphs).
OPTIONAL = {
    "aggregate_pieces": "aggregate_pieces(Tensor[] pieces, int pieces_per_client, Tensor? subtract_from, "
                        "Tensor weights, float gamma, Tensor? gamma_tensor, Tensor(a!) out, Tensor? skip, "
                        "int? noise_key=None, float noise_std=0., Tensor? noise_std_tensor=None) -> (Tensor, Tensor)",
    "client_dots_pieces": "client_dots_pieces(Tensor[] pieces, int pieces_per_client, Tensor? subtract_from, "
                          "Tensor g) -> Tensor",
    "coordinate_select_pieces": "coordinate_select_pieces(Tensor[] pieces, int pieces_per_client, "
                                "Tensor? subtract_from, Tensor keep, Tensor count, int mode, Tensor(a!) out, "
                                "Tensor? skip) -> Tensor",
    "client_gram_pieces": "client_gram_pieces(Tensor[] pieces, int pieces_per_client, Tensor? subtract_from, "
                          "bool float64_products) -> Tensor",
    "ragged_bmm": "ragged_bmm(Tensor a, Tensor b, Tensor lengths, int dim, bool zero_fill, bool use_blas=True) "
                  "-> Tensor",
    "ragged_bmm.out": "ragged_bmm.out(Tensor a, Tensor b, Tensor lengths, int dim, bool zero_fill, "
                      "bool use_blas=True, *, Tensor(a!) out) -> Tensor(a!)",
    "ragged_bias_relu_": "ragged_bias_relu_(Tensor(a!) x, Tensor bias, Tensor lengths, bool relu) -> Tensor(a!)",
    "ragged_relu_backward_": "ragged_relu_backward_(Tensor(a!) grad, Tensor output, Tensor lengths) -> Tensor(a!)",
    # host queries: no tensor in or out, so no fake kernel (they run as they are under any mode)
    "ragged_bmm_blas": "ragged_bmm_blas(ScalarType dtype) -> bool",
    "cpu_isa": "cpu_isa() -> str",
}

# The CUDA extension's diagnostics (csrc/cuda/module.cpp): host-side decisions of its
# launchers, on integers only -- for tests, never called by a backend.
DIAGNOSTICS = {
    "_cuda_chunk_rows": "_cuda_chunk_rows(int[] addresses, int[] numels, int[] groups, int[] esizes, int num_groups) "
                        "-> (int[], int, int, int)",
    "_cuda_aggregate_tiling": "_cuda_aggregate_tiling(int n, int esize) -> int[]",
    "_cuda_max_redundant_partials": "_cuda_max_redundant_partials() -> int",
    "_cuda_table_cache_info": "_cuda_table_cache_info() -> int[]",
    "_cuda_table_cache_clear": "_cuda_table_cache_clear() -> ()",
}

# The compressed replies' ops (csrc/cpu/compressed_aggregate.cpp, csrc/cuda/compressed_aggregate.cu;
# every backend's function: backends/compressed.py's table, by the backend's name).  Each
# is routed too, by that table (``routed_<op>``, :func:`.library.routed`).
CODECS = {
    "block_decode_aggregate": "block_decode_aggregate(Tensor[] codes, Tensor[] scales, int kind, int block, "
                              "int numel, Tensor weights, float gamma, Tensor? gamma_tensor, Tensor(a!) out, "
                              "Tensor? skip) -> (Tensor, Tensor)",
    "block_quantize": "block_quantize(Tensor x, int kind, int block, bool stochastic, int key, int client) "
                      "-> (Tensor, Tensor)",
    "block_quantize_into": "block_quantize_into(Tensor x, int kind, int block, bool stochastic, int key, int client, "
                           "Tensor(a!) codes, Tensor(b!) scales) -> ()",
    "topk_decode_aggregate": "topk_decode_aggregate(Tensor[] values, Tensor[] indices, int numel, Tensor weights, "
                             "float gamma, Tensor? gamma_tensor, Tensor(a!) out, Tensor? skip) -> (Tensor, Tensor)",
    "topk_encode": "topk_encode(Tensor x, int k) -> (Tensor, Tensor)",
}

HOST_QUERIES = ("ragged_bmm_blas", "cpu_isa")
ROUTED = (*CONTRACT, *COMPOSED)
SCHEMAS = {**CONTRACT, **COMPOSED, **OPTIONAL, **DIAGNOSTICS, **CODECS}
IN_CPP = (*CONTRACT, *OPTIONAL, *DIAGNOSTICS, *CODECS)  # defined by the C++ extensions (COMPOSED is Python's alone)


def function_name(op: str) -> str:
    """The backend function of ``op``: ``ragged_bmm.out`` -> ``ragged_bmm_out``."""
    return op.replace(".", "_")


# Argument names a routed op spells otherwise: torch's auto_functionalized (how
# torch.compile traces an op that writes its inputs) passes the op's arguments by name
# next to a `mode` of its own, so a mutating op with an argument named `mode` fails to
# trace ("got multiple values for argument 'mode'").
ROUTED_RENAMES = {"mode": "kernel_mode"}


def routed_schema(op: str) -> str:
    """The schema of ``routed_<op>``: ``op``'s, its ints as ``SymInt`` (a Python int that
    ``torch.compile`` made dynamic, such as a new noise key each round, must not
    recompile), the names of :data:`ROUTED_RENAMES` replaced, plus the backend's name
    (keyword only: it follows defaults)."""
    head, _, ret = SCHEMAS[op].partition(") -> ")
    name, _, args = head.partition("(")
    parts = []
    for a in args.split(", "):
        kind, _, arg = a.rpartition(" ")
        arg_name, eq, default = arg.partition("=")
        kind = "SymInt" + kind[3:] if kind.startswith("int") else kind
        parts.append(f"{kind} {ROUTED_RENAMES.get(arg_name, arg_name)}{eq}{default}")
    return f"routed_{name}({', '.join(parts)}, *, str backend) -> {ret}"
