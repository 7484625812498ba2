"""Each op's signature is written once (fedopt_kernels/backends/schemas.py); every other
place that spells it out is checked against that table here (issue 46, item 3):

* the C++ definition (csrc/registration.cpp, csrc/cpu/*.cpp, csrc/cuda/module.cpp), as
  the loaded extension prints it;
* every backend's function of the op (the backend contract, the Triton wrappers
  included): parameter names, order, keyword-only parameters and defaults;
* the contract as fedopt_kernels/backends/__init__.py's docstring writes it;
* the routed ops ``routed_<op>`` that ``torch.compile`` records (generated from it);
* the namespace itself: one (``fedopt_C``), holding the table's ops and nothing else,
  each op that takes or returns a tensor with a fake kernel that agrees with the real
  one (``torch.library.opcheck``).
"""

from __future__ import annotations

import importlib
import inspect
import re

import pytest
import torch

from fedopt_kernels import backends
from fedopt_kernels.backends import library, schemas

NS = schemas.NAMESPACE


def _needs_extension(name: str):
    reason = backends.extension_error(name)
    if reason is not None:
        pytest.skip(f"the {name} extension does not load here: {reason}")


def _overload(op: str):
    base, _, overload = op.partition(".")
    return getattr(getattr(torch.ops.fedopt_C, base), overload or "default")


def _parsed(op: str):
    return torch._C.parse_schema(f"{NS}::{schemas.SCHEMAS[op]}")


def _ops_in_namespace(ns: str):
    return sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith(ns + "::"))


@pytest.mark.parametrize("op", [op for op in schemas.IN_CPP if op not in schemas.DIAGNOSTICS])
def test_the_cpu_extension_defines_each_op_as_the_table_writes_it(op):
    _needs_extension("cpu")
    backends.resolve("cpu", "cpu")
    assert str(_overload(op)._schema) == f"{NS}::{schemas.SCHEMAS[op]}"


@pytest.mark.parametrize("op", list(schemas.DIAGNOSTICS))
def test_the_cuda_extension_defines_its_diagnostics_as_the_table_writes_them(op):
    _needs_extension("cuda")
    assert str(_overload(op)._schema) == f"{NS}::{schemas.SCHEMAS[op]}"


def test_one_namespace_holds_the_tables_ops_and_nothing_else():
    _needs_extension("cpu")
    _needs_extension("cuda")
    backends.resolve("cpu", "cpu")
    registered = _ops_in_namespace(NS)
    expected = sorted([op for op in schemas.SCHEMAS if op in schemas.IN_CPP]
                      + [f"routed_{op}" for op in (*schemas.ROUTED, *schemas.CODECS)])
    assert registered == expected
    others = {n.split("::", 1)[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("fedopt")}
    assert others == {NS}


@pytest.mark.parametrize("op", schemas.ROUTED)
def test_each_routed_op_is_the_tables_schema_with_the_backends_name(op):
    routed = str(library.routed(op)._schema)
    assert routed == f"{NS}::{schemas.routed_schema(op)}"
    # and, independently of routed_schema: the table's arguments, then `*, str backend`
    table, got = _parsed(op), library.routed(op)._schema
    rename = {v: k for k, v in schemas.ROUTED_RENAMES.items()}
    assert [rename.get(a.name, a.name) for a in got.arguments] == [a.name for a in table.arguments] + ["backend"]
    assert [str(a.default_value) for a in got.arguments[:-1]] == [str(a.default_value) for a in table.arguments]
    assert [str(r.type) for r in got.returns] == [str(r.type) for r in table.returns]
    assert got.arguments[-1].kwarg_only and str(got.arguments[-1].type) == "str"


def _backend_module(name: str):
    if name in ("cpu", "cuda"):
        _needs_extension(name)
    if name == "triton":
        pytest.importorskip("triton")
    return importlib.import_module(f"fedopt_kernels.backends.{name}")


def _check_function(fn, op: str):
    """``fn``'s parameters against the table's schema of ``op``."""
    if isinstance(fn, torch._ops.OpOverload):  # the C++ op itself (the ragged products)
        assert fn is _overload(op)
        return
    params = list(inspect.signature(fn).parameters.values())
    args = _parsed(op).arguments
    assert [p.name for p in params] == [a.name for a in args], op
    for p, a in zip(params, args):
        assert (p.kind is inspect.Parameter.KEYWORD_ONLY) == a.kwarg_only, (op, p.name)
        if a.has_default_value():
            assert p.default is not inspect.Parameter.empty and p.default == a.default_value, (op, p.name)
        else:
            assert p.default is inspect.Parameter.empty, (op, p.name)


@pytest.mark.parametrize("name", backends.BACKENDS)
def test_every_backend_function_has_the_tables_signature(name):
    module = _backend_module(name)
    for op in schemas.CONTRACT:
        fn = getattr(module, schemas.function_name(op), None)
        assert fn is not None, f"backend {name} lacks {op}"
        _check_function(fn, op)
    optional = [op for op in schemas.OPTIONAL if hasattr(module, schemas.function_name(op))]
    for op in optional:
        _check_function(getattr(module, schemas.function_name(op)), op)
    if name == "cpu":  # the C++ CPU backend has every optional op
        assert optional == list(schemas.OPTIONAL)


@pytest.mark.parametrize("op", [op for op in (*schemas.CONTRACT, *schemas.OPTIONAL) if op in backends.__doc__])
def test_the_contracts_docstring_writes_each_signature_as_the_table(op):
    match = re.search(r"``" + re.escape(op) + r"\(([^)]*)\)", backends.__doc__)
    assert match, f"backends/__init__.py does not write {op}'s signature"
    written = [a.strip().split("=")[0] for a in " ".join(match.group(1).split()).split(",")]
    assert written == [a.name for a in _parsed(op).arguments]


def test_the_contracts_docstring_writes_every_contract_op():
    assert all(f"``{op}(" in backends.__doc__ for op in schemas.CONTRACT)


def test_a_drifted_signature_is_caught():
    """The check itself: a backend function with one parameter renamed fails it."""
    def drifted(clients, wrong_name):
        return None
    with pytest.raises(AssertionError):
        _check_function(drifted, "client_gram")


# ------------------------------------------------------------------ fake kernels

def _samples(gen):
    """op -> arguments of a small real call (CPU tensors, odd sizes)."""
    r = lambda *s, dtype=torch.float32: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    C, N = 3, 37
    X = r(C, N)
    P = [r(5), r(4)]
    G = [r(5) * 1e-2, r(4) * 1e-2]
    pieces = [t.clone() for i in range(C) for t in (X[i, :20], X[i, 20:])]
    w = torch.rand(C, generator=gen)
    keep, count = torch.ones(C, dtype=torch.bool), torch.tensor([1])
    a, b, lengths = r(C, 6, 5), r(C, 5, 4), torch.tensor([6, 0, 2])
    return {
        "nar_step_": ([t.clone() for t in P], G, [], 0.1, None, 0.01, None, 1.0, 0, 0.0, None, None),
        "nar_step_batched_": (X.clone(), X * 1e-2, None, 0.1, None, 0.01, None, 1.0, 0, 0.0, None, None),
        "nar_sq_norm": (P, G, 0.01, None, 0, None),
        "nar_apply_": ([t.clone() for t in P], G, [], torch.tensor(2.0), 0.1, None, 0.01, None, 1.0, 0, 0.0, None,
                       None),
        "aggregate": ([X], w, 1.0, None, torch.empty(N), None, 7, 0.5, None),
        "aggregate_pieces": (pieces, 2, None, w, 1.0, None, torch.empty(N), None),
        "add_noise_": (torch.zeros(N), 7, 0.5, None),
        "client_dots": (list(X), r(N)),
        "client_dots_pieces": (pieces, 2, None, r(N)),
        "server_update_": ([t.clone() for t in P], [g.clone() for g in G], [torch.zeros(5), torch.zeros(4)],
                           [torch.zeros(5), torch.zeros(4)], 3, 0.1, None, 1.0, None, 0.9, 0.99, 1e-3, False, None),
        "coordinate_select": ([X], keep, count, 0, torch.empty(N), None),
        "coordinate_select_pieces": (pieces, 2, None, keep, count, 1, torch.empty(N), None),
        "client_gram": ([X], False),
        "client_gram_pieces": (pieces, 2, None, True),
        "ragged_bmm": (a, b, lengths, 1, False),
        "ragged_bmm.out": (a, b, lengths, 1, True),
        "ragged_bias_relu_": (r(C, 6, 4), r(C, 4), lengths, True),
        "ragged_relu_backward_": (r(C, 6, 4), r(C, 6, 4), lengths),
        "weighted_sum": ([X], w, torch.tensor(1.0)),
        # compressed replies: int8 codes with one scale per 32 values; top-k at sorted indices
        "block_decode_aggregate": ([torch.randint(-127, 128, (N,), generator=gen, dtype=torch.int8) for _ in range(C)],
                                   [torch.rand(2, generator=gen) for _ in range(C)], 0, 32, N, w, 1.0, None,
                                   torch.empty(N), None),
        "block_quantize": (r(N), 0, 32, False, 7, 0),
        "block_quantize_into": (r(N), 1, 32, True, 7, 3, torch.empty((N + 1) // 2, dtype=torch.uint8),
                                torch.empty(-(-N // 32))),
        "topk_encode": (r(N), 5),
        "topk_decode_aggregate": ([r(4) for _ in range(C)], [torch.tensor([1, 5, 9, 36]) for _ in range(C)], N, w, 1.0,
                                  None, torch.empty(N), None),
    }


def _on(args, device):
    return torch.utils._pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, args)


def _needs_device(device: str):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")


FAKED = [op for op in schemas.IN_CPP if op not in schemas.DIAGNOSTICS and op not in schemas.HOST_QUERIES]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("op", FAKED)
def test_each_cpp_op_has_a_fake_kernel_that_agrees_with_it(op, device):
    _needs_extension("cpu")
    backends.resolve("cpu", "cpu")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"{NS}::{op}", "Meta"), op
    if device == "cuda":
        _needs_device(device)
        _needs_extension("cuda")
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"{NS}::{op}", "CUDA"):
            pytest.skip(f"{op} has no CUDA kernel (a CPU-only op)")
    args = _on(_samples(torch.Generator().manual_seed(0))[op], device)
    kwargs = {"out": torch.empty(3, 6, 4)} if op == "ragged_bmm.out" else {}
    torch.library.opcheck(_overload(op), args, kwargs, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("backend", backends.BACKENDS)
@pytest.mark.parametrize("op", schemas.ROUTED)
def test_each_routed_op_has_a_fake_kernel_that_agrees_with_it(op, backend):
    device = "cuda" if backend == "cuda" else "cpu"
    _needs_device(device)
    reason = backends.why_unavailable(backend, torch.device(device))
    if reason is not None:
        pytest.skip(f"backend {backend!r} cannot run here: {reason}")
    args = _on(_samples(torch.Generator().manual_seed(0))[op], device)
    torch.library.opcheck(library.routed(op), args, {"backend": backend},
                          test_utils=("test_schema", "test_faketensor"))
