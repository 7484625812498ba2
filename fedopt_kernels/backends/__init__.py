"""Kernel backends behind the public ops, and how one is chosen.

Every backend is a module exposing the same ten functions (and optionally more: the
``*_pieces`` forms and the ragged products, below), with the same contract (their
schemas: :mod:`.schemas`, which tests/test_op_signatures.py holds these lines to)
(the ops layer has validated every argument before they are called; ``mode`` is 0 co /
1 grad / 2 none).  A hyperparameter that may be a number or a tensor (``lr``,
``weight_decay``, ``gamma``) comes as the pair ``h, h_tensor`` of :mod:`.hyper`: a
float and None, or 0.0 and a tensor already in the acc dtype on the data's device --
split once by the ops layer, the same pairs as the ``fedopt::`` custom ops' and the
``fedopt_C`` ops' schemas:

``nar_step_(params, grads, momentum_buffers, lr, lr_tensor, weight_decay, weight_decay_tensor,
max_norm, mode, momentum, grad_scale, found_inf) -> (norm, scale, skipped)``
    One FedNAR step over the list of tensors taken as one vector; 0-d stats.
    ``momentum_buffers`` is an empty list when ``momentum == 0``.

``nar_sq_norm(params, grads, weight_decay, weight_decay_tensor, mode, grad_scale) -> sq``
    The first pass of ``nar_step_`` alone: the 0-d sum of squares of the clipped-on
    vector (``g / grad_scale + wd x`` in mode co, ``g / grad_scale`` otherwise), partials
    combined in the fixed order ``nar_step_`` uses.

``nar_apply_(params, grads, momentum_buffers, sq_norm, lr, lr_tensor, weight_decay,
weight_decay_tensor, max_norm, mode, momentum, grad_scale, found_inf) -> (norm, scale, skipped)``
    The second pass of ``nar_step_`` alone, with ``norm = sqrt(sq_norm)`` (a one-element
    tensor on the data's device): ``nar_apply_(..., nar_sq_norm(...))`` equals
    ``nar_step_`` bitwise.  Together they give one norm over several calls
    (``ops.nar_step_groups_``).

``nar_step_batched_(params, grads, momentum_buffers, lr, lr_tensor, weight_decay, weight_decay_tensor,
max_norm, mode, momentum, grad_scale, found_inf) -> (norm, scale, skipped)``
    Row-wise FedNAR on ``[C, N]`` tensors (``momentum_buffers`` is None without momentum); stats
    ``[C]``; ``lr_tensor``/``weight_decay_tensor`` may also be ``[C]`` tensors.

``aggregate(clients, weights, gamma, gamma_tensor, out, skip, noise_key=None, noise_std=0.0,
noise_std_tensor=None) -> (client_sq_norms, sq_norm)``
    ``out = gamma * sum_i weights[i] * clients[i]`` with the norms in the same pass;
    ``clients`` is a list of 1-D tensors or a 2-D tensor; ``gamma_tensor`` None or
    0-d; ``skip`` None or a 0-d bool tensor (true: ``out`` untouched, zero stats).
    With ``noise_key`` (an int in ``[0, 2^63)``), Gaussian noise in the same pass:
    ``out[j] = gamma * total[j] + std * n_j`` in the acc dtype, each op rounded once,
    ``n_j = normal(noise_key, j)`` of python_ref/gaussian_noise.py (the same fp32 bits on
    every backend), ``std`` = ``noise_std_tensor`` (one element on the data's device,
    read there) if given, else ``noise_std``; the norms are those of the sum without
    the noise.

``add_noise_(out, noise_key, noise_std, noise_std_tensor, skip=None) -> None``
    ``out[j] = out[j] + std * n_j`` in the acc dtype, rounded once to ``out``'s dtype
    (``skip`` as ``aggregate``'s):
    for an fp32/fp64 ``out``, ``aggregate`` with noise equals ``aggregate`` without it
    followed by ``add_noise_``, bit for bit (the distributed DP round adds the noise
    once, after the sum over the ranks).

``aggregate_pieces(pieces, pieces_per_client, subtract_from, weights, gamma, gamma_tensor, out,
skip, noise_key=None, noise_std=0.0, noise_std_tensor=None) -> (client_sq_norms, sq_norm)``
(optional: the ``cpu`` backend)
    ``aggregate`` over clients read in place from their pieces
    (:class:`~fedopt_kernels.ops.ClientPieces`: client ``i``'s vector is its
    ``pieces_per_client`` pieces of the flat list ``pieces`` concatenated, subtracted
    from ``subtract_from`` when given), bit for bit ``aggregate`` over the rows they
    would be copied into.  Without it the ops layer stacks the rows.

``client_dots_pieces(pieces, pieces_per_client, subtract_from, g) -> [C]`` (optional: ``cpu``)
    ``client_dots`` over clients read in place, as ``aggregate_pieces``.

One "do nothing" convention for every op: an optional one-element device tensor read by
the kernels (no host sync), nonzero = the op writes nothing -- ``found_inf`` of the
FedNAR ops (GradScaler's own flag), ``skip`` of ``aggregate`` and ``server_update_``.

``client_dots(clients, g) -> [C]``
    ``<clients[i], g>`` for every client in one pass.

``coordinate_select(clients, keep, count, mode, out, skip) -> nonfinite``
    Coordinate-wise order statistics of the kept clients in one pass over them (the
    robust aggregators' median, trimmed mean and Bulyan; oracle: python_ref/robust.py).
    ``clients`` a ``[C, N]`` tensor or a list of ``C`` 1-D tensors; ``keep`` ``[C]`` bool
    and ``count`` a one-element int64 tensor, both on the data's device; ``mode`` 0 (mean
    of the sorted values ``[k, m - k)``, ``k = min(count, (m - 1) // 2)``) or 1 (mean of
    the ``count`` values closest to the median); ``out`` ``[N]`` in the clients' or the
    acc dtype; ``skip`` None or a one-element bool tensor (true: nothing written, no
    flags).  Returns ``[C]`` bool: the kept clients holding a NaN/Inf.

``client_gram(clients, float64_products) -> [C, C] float64``
    ``G = X X^T`` in one pass, fixed blocks added in float64 in a fixed order (error
    bounds: :func:`fedopt_kernels.ops.robust_aggregate.client_gram`); ``clients`` as
    ``coordinate_select``'s, a list possibly ending with a row of another dtype.
    Krum, Bulyan, the geometric median and centered clipping read it; everything else
    they need is ``[C]``-sized work in the ops layer over ``aggregate``.

``coordinate_select_pieces(pieces, pieces_per_client, subtract_from, keep, count, mode, out, skip)``,
``client_gram_pieces(pieces, pieces_per_client, subtract_from, float64_products)`` (optional: ``cpu``)
    The same over clients read in place, as ``aggregate_pieces``.

``ragged_bmm(a, b, lengths, dim, zero_fill, use_blas=True)``, ``ragged_bmm_out(..., *, out)``
(``cpu`` and ``reference``); ``ragged_bmm_blas(dtype)``, ``ragged_bias_relu_(x, bias, lengths,
relu)``, ``ragged_relu_backward_(grad, output, lengths)`` (``cpu``)
    The batched engine's products over ragged batches (:mod:`fedopt_kernels.ops.ragged_bmm`);
    on ``cpu`` they are the C++ op overloads themselves, the targets of traced graphs' nodes.

``server_update_(params, updates, exp_avg, exp_avg_sq, rule, lr, lr_tensor, gamma, gamma_tensor,
beta1, beta2, tau, nesterov, skip) -> None``
    The elementwise step of a server optimizer (``rule`` 0 sgd / 1 momentum / 2 adagrad /
    3 adam / 4 yogi, see :func:`fedopt_kernels.ops.server_update_`) in one pass over
    lists of tensors; ``updates`` in the acc dtype; ``exp_avg``/``exp_avg_sq`` possibly
    empty lists; ``lr_tensor``/``gamma_tensor`` None or 0-d; ``skip`` None or a 0-d bool
    tensor (true: nothing written).

The ops layer reaches every one of these through one dispatcher,
:func:`fedopt_kernels.ops._dispatch.kernel`.

Choice: the ``backend=`` argument, else the ``FEDOPT_BACKEND`` environment variable,
else by device: CPU tensors use the C++ CPU extension; CUDA tensors use the C++ CUDA
extension, then Triton.  ``reference`` (python_ref) is always available.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Optional

import torch

from . import mkl as _mkl
from ._extensions import load as _load_extension

# MKL's strict reproducibility mode, before any product runs (fixed at MKL's first call)
_mkl.enable_strict()

BACKENDS = ("reference", "cpu", "triton", "cuda")
_DEFAULT_ORDER = {"cpu": ("cpu", "reference"), "cuda": ("cuda", "triton", "reference")}
ENV_VAR = "FEDOPT_BACKEND"

_MODULES = {
    "reference": "fedopt_kernels.backends.reference",
    "cpu": "fedopt_kernels.backends.cpu",
    "cuda": "fedopt_kernels.backends.cuda",
    "triton": "fedopt_kernels.backends.triton",
}


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run here; the message says why."""


def triton_interpret_mode() -> bool:
    """True when Triton kernels run in its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_EXTENSIONS = {"cpu": "_C", "cuda": "_C_cuda"}  # backend -> its compiled extension module


def extension_error(backend: str) -> Optional[str]:
    """None if the compiled extension behind backend ``"cpu"`` or ``"cuda"`` is built and
    imports here, else why not -- whether or not a device exists (``fedopt info`` and
    ``fedopt selftest`` report the build apart from the device)."""
    if backend not in _EXTENSIONS:
        raise ValueError(f"backend must be one of {tuple(_EXTENSIONS)} (the compiled ones), got {backend!r}")
    reason = _load_extension(_EXTENSIONS[backend])
    if reason is not None and backend == "cuda" and torch.version.cuda is None:
        reason = f"torch {torch.__version__} is a CPU-only build, so the CUDA extension was not built"
    return reason


def why_unavailable(name: str, device: Optional[torch.device] = None) -> Optional[str]:
    """None if backend ``name`` can run on ``device`` (any device if None), else why not."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {name!r}")
    dev = None if device is None else torch.device(device).type
    if name == "reference":
        return None
    if name == "cpu":
        if dev not in (None, "cpu"):
            return f"the cpu backend runs on CPU tensors, got {dev} tensors"
        return extension_error("cpu")
    if name == "cuda":
        if dev not in (None, "cuda"):
            return f"the cuda backend runs on CUDA tensors, got {dev} tensors"
        reason = extension_error("cuda")
        if reason is not None:
            return reason
        if not torch.cuda.is_available():
            return "the CUDA extension is built but no CUDA device is available"
        return None
    # triton
    try:
        importlib.import_module("triton")
    except ImportError as exc:
        return f"triton is not installed ({exc})"
    if dev == "cpu" and not triton_interpret_mode():
        return "Triton kernels need CUDA tensors; CPU tensors only run with TRITON_INTERPRET=1"
    if dev == "cuda" and triton_interpret_mode():
        return "TRITON_INTERPRET=1 is set, so Triton kernels can only run on CPU tensors"
    if dev is None and not (torch.cuda.is_available() or triton_interpret_mode()):
        return "no CUDA device, and TRITON_INTERPRET=1 is not set"
    return None


def available_backends(device: Optional[torch.device] = None) -> list:
    """Names of the backends that can run on ``device`` here."""
    return [b for b in BACKENDS if why_unavailable(b, device) is None]


def default_backend(device: torch.device) -> str:
    """The backend used when neither ``backend=`` nor ``FEDOPT_BACKEND`` chooses one."""
    for name in _DEFAULT_ORDER.get(torch.device(device).type, ("reference",)):
        if why_unavailable(name, device) is None:
            return name
    return "reference"


_names: dict = {}
_modules: dict = {}


def _compile_constant(fn):
    """``torch.compiler.assume_constant_result`` without its cost: that function imports
    ``torch._dynamo`` (~1.5 s, paid by every ``fedopt`` command) only to set this flag.
    tests/test_fednar_optimizer.py compiles a step with fullgraph=True, which fails if
    Dynamo stops honouring it."""
    fn._dynamo_marked_constant = True
    return fn


@_compile_constant
def resolve_name(backend: Optional[str], device_type: str) -> str:
    """Name of the backend to run on ``device_type`` ("cpu", "cuda"); raises if the
    requested one cannot run there.  A constant for ``torch.compile`` (the choice depends
    only on the arguments and the environment, never on tensor values)."""
    name = backend if backend is not None else os.environ.get(ENV_VAR) or None
    key = (name, device_type)
    if key in _names:
        return _names[key]
    device = torch.device(device_type)
    if name is None:
        name = default_backend(device)
    elif name not in BACKENDS:
        source = "backend" if backend is not None else f"the {ENV_VAR} environment variable"
        raise ValueError(f"{source} must be one of {BACKENDS} or None, got {name!r}")
    reason = why_unavailable(name, device)
    if reason is not None:
        raise BackendUnavailableError(f"backend {name!r} is not available: {reason}")
    _names[key] = name
    return name


def resolve(backend: Optional[str], device: torch.device) -> ModuleType:
    """The backend module to run on ``device``; raises if it cannot run there."""
    name = resolve_name(backend, torch.device(device).type)
    module = _modules.get(name)
    if module is None:
        module = _modules[name] = importlib.import_module(_MODULES[name])
    return module
