"""Passes over the traced gradient graph of the batched engine.

:class:`~fedopt_kernels.fl.batched.BatchedTrainer` traces a group's vmapped gradient
into an FX graph of plain ATen ops (``make_fx``) and runs that graph in later rounds.
These passes rewrite such a graph in place before it first runs, each for speed only:
the values a client gets stay those of the eager transforms (each pass says how
closely: the same bits, or the same values up to a kernel's rounding).
"""

from __future__ import annotations

import torch

__all__ = ["drop_identity_ops", "channels_last_pools"]


def drop_identity_ops(gm) -> int:
    """Remove the no-op nodes ``make_fx`` records from the torch.func transforms (views
    and expands to the shape and strides they already have, ``alias``, ``mul(x, 1)``):
    about 40% of a small model's graph, each a dispatch of a few microseconds per step,
    and no arithmetic -- the results are the same bits.  Skipped for a graph with an
    in-place op (a model with ``inplace=True`` layers), where ``mul(x, 1)``'s copy may
    be what keeps a mutation off its input.  Returns the number of nodes removed."""
    aten = torch.ops.aten
    graph = gm.graph
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    if any(getattr(getattr(n.target, "_schema", None), "is_mutable", False) for n in nodes):
        return 0
    removed = 0
    for node in nodes:
        src = node.args[0] if node.args else None
        if not isinstance(src, torch.fx.Node):
            continue
        if node.target in (aten.expand.default, aten.view.default, aten._unsafe_view.default, aten.alias.default):
            pass
        elif not (node.target is aten.mul.Scalar and node.args[1] == 1):
            continue
        a, b = node.meta.get("val"), src.meta.get("val")
        if (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and a.stride() == b.stride()):
            node.replace_all_uses_with(src)
            graph.erase_node(node)
            removed += 1
    if removed:
        graph.lint()
        gm.recompile()
    return removed


def channels_last_pools(gm) -> int:
    """Run the graph's CPU ``max_pool2d_with_indices`` on a channels-last copy of its
    input and give its outputs back contiguous.  torch's NCHW CPU kernel is slow on the
    small planes of a batched round -- about 1.2 ms for ``[128, 32, 8, 8]`` on 2 cores
    against 0.13 ms for the channels-last kernel plus the copy -- and the two return the
    same values and indices (ties and NaN included; checked in the tests), so the
    graph's results keep their bits.  Returns the number of pools rewritten."""
    aten = torch.ops.aten
    graph = gm.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.max_pool2d_with_indices.default:
            continue
        x = node.args[0]
        val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if not (isinstance(val, torch.Tensor) and val.dim() == 4 and val.device.type == "cpu"
                and val.is_contiguous() and not val.is_contiguous(memory_format=torch.channels_last)):
            continue
        with graph.inserting_before(node):
            cl = graph.call_function(aten.clone.default, (x,), {"memory_format": torch.channels_last})
        node.replace_input_with(x, cl)
        for user in list(node.users):  # the getitem nodes of (values, indices)
            with graph.inserting_after(user):
                back = graph.call_function(aten.clone.default, (user,), {"memory_format": torch.contiguous_format})
            user.replace_all_uses_with(back, delete_user_cb=lambda u, back=back: u is not back)
        rewritten += 1
    if rewritten:
        graph.lint()
        gm.recompile()
    return rewritten
