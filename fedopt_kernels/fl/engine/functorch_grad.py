"""``torch.func.grad(f, has_aux=True)`` without importing the compiler.

The batched engine differentiates each client's loss with ``vmap(grad(loss))``.  That
composition -- the gradient level *inside* the batching level -- is what fixes the
engine's bits: autograd records the per-client ops and vmap batches their backward
formulas (e.g. a linear layer's weight gradient is ``(g^T x)^T``, a layout choice of
the per-sample ``mm`` backward).  ``torch.autograd.grad`` of the summed per-client
losses records the batched ops instead (``x^T g``) and rounds differently (a few ulps
in most weight gradients), so it is no substitute.

``torch.func.grad`` itself, however, enters ``torch._dynamo.compiled_autograd._disable()``
around its ``torch.autograd.grad`` call: the attribute access imports ``torch._dynamo``
and, through it, ``torch._inductor`` -- about 0.75 s of a short run's start-up (AMD EPYC,
2 cores), for a run that compiles nothing.  :func:`grad_with_aux` is
``grad_and_value_impl`` of ``torch/_functorch/eager_transforms.py`` (identical in torch
2.11 and 2.14) with that one context replaced by what it does in C++: the autograd
compiler is unset around the call and restored after it (the module-level flags it
also sets belong to ``torch._dynamo``; when that is imported, the torch function
itself is used, so a compiled-autograd region sees its own bookkeeping).  The same
functorch primitives run in the same order: the same ops and the same bits
(``tests/test_functorch_grad.py`` compares them with ``torch.func.grad``).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch

__all__ = ["grad_with_aux"]


def grad_with_aux(func: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.func.grad(func, argnums=0, has_aux=True)``: ``func(*args)`` returns
    ``(scalar loss, aux)``; the wrapper returns ``(d loss / d args[0], aux)``, the
    gradient with ``args[0]``'s pytree structure.  Composes with ``torch.func.vmap``."""

    def wrapper(*args):
        if "torch._dynamo" in sys.modules:  # already paid for: torch's own transform
            from torch.func import grad

            return grad(func, has_aux=True)(*args)
        return _grad_and_aux(func, args)

    return wrapper


def _grad_and_aux(func, args):
    # torch._functorch.eager_transforms.grad_and_value_impl, argnums=0, has_aux=True, no kwargs
    from torch._functorch.eager_transforms import (_create_differentiable, _undo_create_differentiable,
                                                   _wrap_all_tensors, grad_increment_nesting)
    from torch.utils._pytree import tree_flatten, tree_map_, tree_unflatten

    with grad_increment_nesting() as level:
        with torch.enable_grad():
            args = _wrap_all_tensors(args, level)
            diff_args = args[0]
            tree_map_(lambda x: _create_differentiable(x, level=level), diff_args)
            output = func(*args)
            if not (isinstance(output, tuple) and len(output) == 2):
                raise RuntimeError("grad_with_aux(f)(*args): f must return a tuple (loss, aux)")
            output, aux = output
            if not isinstance(output, torch.Tensor) or output.dim() != 0:
                raise RuntimeError(f"grad_with_aux(f)(*args): f must return a scalar Tensor as its loss, "
                                   f"got {type(output).__name__} of {getattr(output, 'dim', lambda: '?')()} dims")
            flat_diff_args, spec = tree_flatten(diff_args)
            grads = _autograd_grad(output, flat_diff_args)
            grad_input = _undo_create_differentiable(tree_unflatten(list(grads), spec), level)
            _undo_create_differentiable(output, level)
            aux = _undo_create_differentiable(aux, level)
    return grad_input, aux


def _autograd_grad(output, inputs):
    # torch._functorch.eager_transforms._autograd_grad for one output, create_graph=True
    if not output.requires_grad:
        return tuple(torch.zeros_like(inp) for inp in inputs)
    set_compiler = torch._C._dynamo.compiled_autograd.set_autograd_compiler
    prior = set_compiler(None, False)  # compiled_autograd._disable(), its C++ half
    try:
        grads = torch.autograd.grad((output,), inputs, None, retain_graph=False, create_graph=True,
                                    allow_unused=True)
    finally:
        set_compiler(*prior)
    return tuple(torch.zeros_like(inp) if g is None else g for g, inp in zip(grads, inputs))
