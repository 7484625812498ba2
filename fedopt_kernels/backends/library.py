"""The ONE ``torch.library`` registration of fedopt's ops: the namespace ``fedopt_C``.

Every op's schema is written once, in :mod:`.schemas`.  The C++ extension defines the
ops with kernels of its own (csrc/registration.cpp: CPU and CUDA kernels picked by the
tensors' device); this module adds, in the same namespace, as torchao does:

* a **fake kernel** for every op that takes or returns a tensor -- output shapes, dtypes
  and devices from metadata alone -- so ``torch.compile``, ``make_fx`` and
  ``FakeTensorMode`` can trace each as one opaque node (the C++ ops' fakes are
  registered when the extension is loaded: :func:`register_cpp_fakes`);
* the **routed form** ``routed_<op>`` of every op of the backend contract (and of
  ``weighted_sum``, composed of two of them): the op on the backend named by its last,
  keyword-only argument, whatever that backend is (reference, cpu, triton, cuda).  A
  name of its own, not an overload of the C++ op: these are defined when this module
  is imported, the C++ ops when the extension is, and an overload packet
  (``torch.ops.fedopt_C.aggregate``) made in between would not see the later overload.
  Eager calls go straight from the ops layer to a backend function (no dispatcher round trip);
  under ``torch.compile`` the ops layer (:mod:`fedopt_kernels.ops._dispatch`, the one
  place that chooses) calls these instead: Dynamo records each as one node (no graph
  break), the fake gives its outputs, the schema's ``Tensor(a!)`` tells AOTAutograd what
  it writes, and hyperparameters that are tensors stay graph inputs (a new lr does not
  recompile).  ``routed_weighted_sum`` has an autograd formula (forward ``aggregate``,
  backward ``client_dots``, each one pass over the clients).
"""

from __future__ import annotations

import torch

from . import resolve, schemas
from .dtypes import acc_dtype

_LIB = torch.library.Library(schemas.NAMESPACE, "FRAGMENT")  # FRAGMENT: csrc/registration.cpp holds the DEF


def routed(op: str):
    """The op ``fedopt_C::routed_<op>`` (``op`` one of :data:`schemas.ROUTED`)."""
    return getattr(torch.ops.fedopt_C, f"routed_{op}").default


# ---------------------------------------------------------------- fake kernels

def _num_clients(clients) -> int:
    """C of a ``Tensor[] clients``: one ``[C, N]`` tensor, or C 1-D tensors."""
    return clients[0].shape[0] if len(clients) == 1 and clients[0].dim() == 2 else len(clients)


def _nar_stats(params, *_):
    acc, dev = acc_dtype(params[0].dtype), params[0].device
    return (params[0].new_empty((), dtype=acc, device=dev), params[0].new_empty((), dtype=acc, device=dev),
            params[0].new_empty((), dtype=torch.bool, device=dev))


def _nar_batched_stats(X, *_):
    acc, C = acc_dtype(X.dtype), X.shape[0]
    return X.new_empty((C,), dtype=acc), X.new_empty((C,), dtype=acc), X.new_empty((C,), dtype=torch.bool)


def _aggregate_stats(C, dtype, out):
    acc = acc_dtype(dtype)
    return out.new_empty((C,), dtype=acc), out.new_empty((), dtype=acc)


def _ragged_product(a, b, *_):
    return a.new_empty((a.shape[0], a.shape[1], b.shape[2]))


FAKES = {
    "nar_step_": _nar_stats,
    "nar_apply_": _nar_stats,
    "nar_step_batched_": _nar_batched_stats,
    "nar_sq_norm": lambda params, *_: params[0].new_empty((), dtype=acc_dtype(params[0].dtype)),
    "aggregate": lambda clients, weights, gamma, gamma_tensor, out, *_: _aggregate_stats(
        _num_clients(clients), clients[0].dtype, out),
    "aggregate_pieces": lambda pieces, per, sub, weights, gamma, gamma_tensor, out, *_: _aggregate_stats(
        weights.shape[0], pieces[0].dtype if pieces else out.dtype, out),
    "add_noise_": lambda *_: None,
    "client_dots": lambda clients, g: g.new_empty((_num_clients(clients),), dtype=acc_dtype(clients[0].dtype)),
    "client_dots_pieces": lambda pieces, per, sub, g: g.new_empty(
        (len(pieces) // per if per else 0,), dtype=acc_dtype(pieces[0].dtype if pieces else g.dtype)),
    "server_update_": lambda *_: None,
    "coordinate_select": lambda clients, keep, count, mode, out, skip: keep.new_empty(keep.shape, dtype=torch.bool),
    "coordinate_select_pieces": lambda pieces, per, sub, keep, *_: keep.new_empty(keep.shape, dtype=torch.bool),
    "client_gram": lambda clients, exact: clients[0].new_empty((_num_clients(clients),) * 2, dtype=torch.float64),
    "client_gram_pieces": lambda pieces, per, sub, exact: pieces[0].new_empty(
        (len(pieces) // per,) * 2, dtype=torch.float64),
    "weighted_sum": lambda clients, weights, gamma: clients[0].new_empty((clients[0].shape[-1],)),
    "ragged_bmm": _ragged_product,
    "ragged_bmm.out": lambda *args, out, **_: out,
    "ragged_bias_relu_": lambda x, *_: x,
    "ragged_relu_backward_": lambda grad, *_: grad,
}


def _codec_stats(clients, *args):
    out = args[-2]  # (..., out, skip)
    return out.new_empty((len(clients),), dtype=torch.float32), out.new_empty((), dtype=torch.float32)


def _block_quantize(x, kind, block, *_):
    n = x.numel()
    codes = x.new_empty(((n + 1) // 2 if kind == 1 else n,), dtype=torch.int8 if kind == 0 else torch.uint8)
    return codes, x.new_empty((-(-n // block),), dtype=torch.float32)


def _block_quantize_into(*_):
    return None  # writes its codes and scales in place


def _topk_encode(x, k):
    # the C++ kernels' own argument checks (csrc/cpu/compressed_encode.cpp, csrc/cuda/topk_encode.cu),
    # so a traced or meta call refuses what an eager one would
    torch._check(x.dim() == 1 and x.is_floating_point(),
                 lambda: f"fedopt_C::topk_encode: x must be a 1-D floating-point tensor, got {x.dtype} {tuple(x.shape)}")
    torch._check(0 <= k <= x.numel(), lambda: f"fedopt_C::topk_encode: k must be in [0, {x.numel()}], got {k}")
    return x.new_empty((k,), dtype=torch.float32), x.new_empty((k,), dtype=torch.int64)


FAKES.update(block_decode_aggregate=_codec_stats, topk_decode_aggregate=_codec_stats, block_quantize=_block_quantize,
             block_quantize_into=_block_quantize_into, topk_encode=_topk_encode)
"""op -> its fake kernel (the contract's arguments; a routed op's ``backend`` aside)."""


def _qualname(op: str) -> str:
    return f"{schemas.NAMESPACE}::{op}"


_cpp_fakes_done = []


def register_cpp_fakes() -> None:
    """Register the fake kernel of every op the C++ extension defines (once; the
    backends ``cpu`` and ``cuda`` call it when they have loaded it)."""
    if _cpp_fakes_done:
        return
    for op in schemas.IN_CPP:
        if op in schemas.DIAGNOSTICS or op in schemas.HOST_QUERIES:
            continue  # integers and strings only: they run as they are under any mode
        torch.library.register_fake(_qualname(op), FAKES[op], lib=_LIB)
    _cpp_fakes_done.append(True)


# ------------------------------------------------------------------ routed ops

def _device_of(args) -> torch.device:
    """The device of the call: its first tensor's (the ops layer has checked they agree)."""
    for a in args:
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, torch.Tensor):
                return t.device
    return torch.device("cpu")


def _rows(clients):
    """The contract's clients from a ``Tensor[]``: the one ``[C, N]`` tensor, or the list."""
    return clients[0] if len(clients) == 1 and clients[0].dim() == 2 else list(clients)


def _routed_kernel(op: str):
    name = schemas.function_name(op)
    takes_clients = schemas.SCHEMAS[op].startswith(f"{op}(Tensor[] clients")

    def kernel(*args, backend: str):
        impl = resolve(backend, _device_of(args))
        if takes_clients:
            args = (_rows(args[0]), *args[1:])
        return getattr(impl, name)(*args)

    kernel.__name__ = f"{name}_on_backend"
    return kernel


def _weighted_sum(clients, weights, gamma, *, backend: str):
    """Forward: ``out = gamma * sum_i weights[i] clients[i]`` by the backend's ``aggregate``."""
    first = clients[0]
    out = torch.empty(first.shape[-1], dtype=first.dtype, device=first.device)
    resolve(backend, first.device).aggregate(_rows(clients), weights, 0.0, gamma, out, None)
    return out


def _weighted_sum_setup(ctx, inputs, keyword_only_inputs, output):
    clients, weights, gamma = inputs
    ctx.backend = keyword_only_inputs["backend"]
    ctx.num_clients = len(clients)
    ctx.save_for_backward(weights, gamma, *clients)


def _weighted_sum_backward(ctx, grad_out):
    """``dL/dw_i = gamma <G, X_i>``, ``dL/dgamma = sum_i w_i <G, X_i>`` (one pass)."""
    weights, gamma, *clients = ctx.saved_tensors
    dots = routed("client_dots")(clients, grad_out.contiguous().to(weights.dtype), backend=ctx.backend)
    grad_w = gamma * dots if ctx.needs_input_grad[1] else None
    grad_gamma = torch.dot(weights, dots) if ctx.needs_input_grad[2] else None
    return [None] * ctx.num_clients, grad_w, grad_gamma


def _codec_kernel(op: str):
    """``routed_<op>`` of a codec op: backends/compressed.py's function for the backend."""
    def kernel(*args, backend: str):
        from . import compressed

        resolve(backend, _device_of(args))
        return getattr(compressed, op)(backend)(*args)

    kernel.__name__ = f"{op}_on_backend"
    return kernel


def _define_routed() -> None:
    for op in schemas.CODECS:  # by the codec table (every backend), and their fakes
        _LIB.define(schemas.routed_schema(op))
        _LIB.impl(f"routed_{op}", _codec_kernel(op), "CompositeExplicitAutograd")
        torch.library.register_fake(_qualname(f"routed_{op}"), lambda *args, backend, _f=FAKES[op]: _f(*args),
                                    lib=_LIB)
    for op in schemas.ROUTED:
        _LIB.define(schemas.routed_schema(op))
        kernel = _weighted_sum if op == "weighted_sum" else _routed_kernel(op)
        _LIB.impl(f"routed_{op}", kernel, "CompositeExplicitAutograd")
        fake = FAKES[op]
        torch.library.register_fake(_qualname(f"routed_{op}"), lambda *args, backend, _f=fake: _f(*args), lib=_LIB)
    torch.library.register_autograd(_qualname("routed_weighted_sum"), _weighted_sum_backward,
                                    setup_context=_weighted_sum_setup, lib=_LIB)


_define_routed()
