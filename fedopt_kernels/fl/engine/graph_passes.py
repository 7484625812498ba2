"""Passes over the traced gradient graph of the batched engine.

:class:`~fedopt_kernels.fl.engine.batched.BatchedTrainer` traces a group's vmapped gradient
into an FX graph of plain ATen ops (:func:`~fedopt_kernels.fl.engine.aten_trace.trace_aten`, the
ops ``make_fx`` would record) and runs that graph in later rounds.
These passes rewrite such a graph in place before it first runs, each for speed only:
the values a client gets stay those of the eager transforms (each pass says how
closely: the same bits, or the same values up to a kernel's rounding).  A pass edits
``gm.graph`` only; the caller recompiles ``gm`` once after its passes (a recompile
costs ~10 ms of a new shape's trace, once per pass before).
"""

from __future__ import annotations

import torch

from ...ops.ragged_bmm import RaggedGraphOps, ragged_bmm_uses_blas, ragged_graph_ops

__all__ = ["drop_identity_ops", "channels_last_pools", "graph_signature", "sample_dims", "ragged_products",
           "fused_epilogues", "RAGGED_LENGTHS", "gradients_into_buffer", "GRADIENT_BUFFER"]


def drop_identity_ops(gm) -> int:
    """Remove the no-op nodes the tracer records from the torch.func transforms (views
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
    return rewritten


#: The attribute of a graph rewritten by :func:`ragged_products` that holds the group's
#: real batch lengths (an int64 CPU tensor ``[rows]``), set before each call.
RAGGED_LENGTHS = "ragged_lengths"


def _depends_on(graph, source) -> set:
    """The nodes of ``graph`` computed from ``source`` (itself included)."""
    seen, todo = {source}, [source]
    while todo:
        for user in todo.pop().users:
            if user not in seen:
                seen.add(user)
                todo.append(user)
    return seen


def _products(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.bmm.default]


def _operand_shapes(node):
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in node.args[:2]]
    return tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in vals)


def _ops(gm) -> tuple:
    return tuple(n.target for n in gm.graph.nodes if n.op == "call_function")


def graph_signature(gm) -> tuple:
    """What must match for two traces of one function to share :func:`sample_dims`:
    the sequence of ops and the shapes of every ``bmm``'s operands but for their first
    (clients') dimension -- graphs of one loss and padded length that differ only in
    their number of rows."""
    shapes = tuple(tuple(s[1:] if s is not None else None for s in _operand_shapes(n)) for n in _products(gm))
    return _ops(gm), shapes


def sample_dims(gm, longer, batch: int):
    """For each ``bmm`` of ``gm`` (traced with padded batch length ``batch``), in graph
    order, the dimension of ``a @ b`` that runs over the samples -- 1 (rows), 2
    (contraction), 3 (columns) -- or None: the one dimension that grows from ``batch``
    to ``batch + 1`` in ``longer``, the same function traced with ``batch + 1``.  None
    when the two traces do not line up node for node."""
    if _ops(gm) != _ops(longer):
        return None
    dims = []
    for node, other in zip(_products(gm), _products(longer)):
        sa, sb = _operand_shapes(node)
        oa, ob = _operand_shapes(other)
        if None in (sa, sb, oa, ob) or sa[0] != oa[0] or sb[0] != ob[0]:  # the clients' dimension
            dims.append(None)
            continue
        sizes, grown = (sa[1], sa[2], sb[2]), (oa[1], oa[2], ob[2])
        changed = [d for d in range(3) if sizes[d] != grown[d]]
        ok = len(changed) == 1 and sizes[changed[0]] == batch and grown[changed[0]] == batch + 1
        dims.append(changed[0] + 1 if ok else None)
    return dims


def ragged_products(gm, dims, batch: int) -> int:
    """Run the graph's batched matrix products on the clients' real samples only.

    ``gm`` is a group's gradient graph traced with padded batch length ``batch``;
    ``dims`` its products' sample dimensions (:func:`sample_dims`, found with a second
    trace at ``batch + 1``, or those of a graph of the same :func:`graph_signature`).
    A ``bmm`` that multiplies along the samples becomes
    :func:`~fedopt_kernels.ops.ragged_bmm.ragged_bmm` over each client's
    ``lengths[i]`` real samples (the graph attribute :data:`RAGGED_LENGTHS`, set by the
    caller before each run).  Which fill its padded rows get follows from the graph:

    * the gradient's nodes are those computed from the loss weights (the graph's last
      input: the soft targets or the per-sample weights, zero on padding).  Backprop is
      linear in them, so in every gradient tensor the padded samples' rows are exactly
      zero: such a product's padded rows are zeros, and a contraction over the samples
      (a weight gradient) may skip them;
    * every other tensor (the forward pass) holds, in a padded sample's rows, copies of
      the client's first sample (the engine pads with it): the product's padded rows
      are copies of its row 0.  A forward contraction over the samples would mix them
      (no per-sample model does that) and is left alone.

    So every value a real sample sees is the padded graph's, up to the rounding of a
    different GEMM; the padded rows stay finite copies, as before.  Applied only where
    the products run on BLAS (CPU float32/float64), where they are faster than the
    padded ``bmm``.  Returns the number of products rewritten (0 when ``dims`` does not
    fit the graph).
    """
    graph = gm.graph
    products = _products(gm)
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    if dims is None or len(dims) != len(products) or not inputs:
        return 0
    gradient = _depends_on(graph, inputs[-1])
    first = next(n for n in graph.nodes if n.op != "placeholder")
    lengths = None
    rewritten = 0
    for node, dim in zip(products, dims):
        a, b = node.args
        va, vb = a.meta.get("val"), b.meta.get("val")
        if dim is None or not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
            continue
        if va.device.type != "cpu" or not ragged_bmm_uses_blas(va.dtype, va.device):
            continue
        if (va.shape[1], va.shape[2], vb.shape[2])[dim - 1] != batch:
            continue
        if dim == 2:  # a sum over the samples: only where one factor is zero on padding
            if a not in gradient and b not in gradient:
                continue
            zero_fill = True
        else:
            zero_fill = (a if dim == 1 else b) in gradient
        if lengths is None:
            gm.register_buffer(RAGGED_LENGTHS, torch.zeros(va.shape[0], dtype=torch.int64), persistent=False)
            with graph.inserting_before(first):
                lengths = graph.get_attr(RAGGED_LENGTHS)
        with graph.inserting_before(node):
            ragged = graph.call_function(_ragged_ops().bmm, (a, b, lengths, dim, zero_fill))
        ragged.meta.update(node.meta)
        node.replace_all_uses_with(ragged)
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        graph.lint()
    return rewritten


_RAGGED_OPS = []


def _ragged_ops() -> RaggedGraphOps:
    """The CPU backend's ragged kernels (op overloads, the targets of their nodes); all
    None where its extension does not run (then no node has one as its target)."""
    if not _RAGGED_OPS:
        _RAGGED_OPS.append(ragged_graph_ops() or RaggedGraphOps(None, None, None, None))
    return _RAGGED_OPS[0]


def _ragged(node, dim: int, zero_fill=None) -> bool:
    """Whether ``node`` is a ragged product along sample dimension ``dim`` (and, unless
    None, with that ``zero_fill``)."""
    return (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and node.target is not None and node.target in (_ragged_ops().bmm, _ragged_ops().bmm_out)
            and node.args[3] == dim and (zero_fill is None or bool(node.args[4]) == zero_fill))


def _skips_padding(user, node) -> bool:
    """Whether ``user`` never reads the padded samples' rows of ``node`` (a ``[C, B, N]``
    activation, samples along dim 1) -- or, where it does, gets the same result
    whatever they hold: a ragged product with ``node`` as its samples operand, a
    transpose of it feeding only ragged contractions, the ReLU mask of a gradient whose
    padded rows are zeros."""
    aten = torch.ops.aten
    if _ragged(user, 1):
        return user.args[0] is node and user.args[1] is not node
    if _ragged(user, 2):
        return user.args[1] is node and user.args[0] is not node
    if user.target is aten.transpose.int and user.args[0] is node and sorted(user.args[1:3]) == [1, 2]:
        return all(_ragged(u, 2) and u.args[0] is user and u.args[1] is not user for u in user.users)
    if user.target is aten.threshold_backward.default and user.args[1] is node and user.args[0] is not node:
        g = user.args[0]
        return _ragged(g, 1, zero_fill=True) or g.target is _ragged_ops().relu_backward_
    return False


def _same_layout(node, source) -> bool:
    """Whether ``node``'s traced result has ``source``'s shape and strides: an op done in
    place on ``source`` instead keeps every later view valid (an elementwise op's result
    follows its inputs' layout, e.g. a transposed activation's)."""
    a, b = node.meta.get("val"), source.meta.get("val")
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.stride() == b.stride())


def fused_epilogues(gm) -> int:
    """Run a ragged layer's bias, ReLU and ReLU gradient on the clients' real rows only,
    in place on the products' results (``fedopt_C::ragged_bias_relu_`` and
    ``ragged_relu_backward_``, ``csrc/cpu/ragged_epilogues.cpp``).

    After :func:`ragged_products` a hidden layer is ``relu(ragged_bmm(x, W^T) + b)`` and
    its gradient ``threshold_backward(ragged_bmm(d, W), h, 0)``: three passes over all
    ``[C, B, N]`` rows, padding included, each into a fresh tensor -- for the MLP on
    digits 9% of a round, and 40% in a process whose heap gave those tensors cold pages
    (measured in one).  Rewritten:

    * ``relu(r + b)`` (and ``r + b`` alone) with ``r`` a forward ragged product used
      only there becomes ``ragged_bias_relu_(r, b)``: the real rows get the same IEEE
      additions and maxima (the same bits); the padded rows keep the product's copies
      of row 0, so only where every reader skips them (:func:`_skips_padding`);
    * ``threshold_backward(g, h, 0)`` with ``g`` a zero-filled ragged product used only
      there becomes ``ragged_relu_backward_(g, h)``: the same bits in every row (the
      padded rows of ``g`` are zeros, which is what the threshold gives there);

    each only where the replaced result had the product's strides (:func:`_same_layout`:
    an activation transposed by an earlier layer keeps the aten ops).

    Run after :func:`ragged_products` and :func:`drop_identity_ops` (the ops mutate).
    Returns the number of nodes fused."""
    aten = torch.ops.aten
    kernels = _ragged_ops()
    fused_fwd, fused_bwd = kernels.bias_relu_, kernels.relu_backward_
    graph = gm.graph
    fused = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.threshold_backward.default and node.args[2] == 0:
            g, h = node.args[0], node.args[1]
            if _ragged(g, 1, zero_fill=True) and g.target is kernels.bmm \
                    and len(g.users) == 1 and isinstance(h, torch.fx.Node) and _same_layout(node, g):
                with graph.inserting_before(node):
                    new = graph.call_function(fused_bwd, (g, h, g.args[2]))
                new.meta.update(node.meta)
                node.replace_all_uses_with(new)
                graph.erase_node(node)
                fused += 1
            continue
        relu = node.target is aten.relu.default
        add = node.args[0] if relu else node
        if not (isinstance(add, torch.fx.Node) and add.op == "call_function" and add.target is aten.add.Tensor
                and add.kwargs.get("alpha", 1) == 1 and (not relu or len(add.users) == 1)):
            continue
        r = next((a for a in add.args if _ragged(a, 1, zero_fill=False)
                  and a.target is kernels.bmm and len(a.users) == 1), None)
        b = next((a for a in add.args if a is not r), None) if r is not None else None
        vr = r.meta.get("val") if r is not None else None
        vb = b.meta.get("val") if isinstance(b, torch.fx.Node) else None
        if not (isinstance(vr, torch.Tensor) and isinstance(vb, torch.Tensor) and vb.dtype == vr.dtype
                and tuple(vb.shape) == (vr.shape[0], 1, vr.shape[2])):
            continue
        out = node if relu else add
        if not out.users or not _same_layout(out, r) or not all(_skips_padding(u, out) for u in out.users):
            continue
        with graph.inserting_before(out):
            new = graph.call_function(fused_fwd, (r, b, r.args[2], relu))
        new.meta.update(out.meta)
        out.replace_all_uses_with(new)
        graph.erase_node(out)
        if relu:
            graph.erase_node(add)
        fused += 1
    if fused:
        graph.lint()
    return fused


#: The attribute of a graph rewritten by :func:`gradients_into_buffer`: the group's flat
#: ``[rows, N]`` gradient buffer ``G``, set before each call.
GRADIENT_BUFFER = "gradient_buffer"

def gradients_into_buffer(gm, slots, numel: int) -> int:
    """Have the graph write its gradients straight into the group's flat buffer ``G``
    (the graph attribute :data:`GRADIENT_BUFFER`, set by the caller before each run),
    instead of returning fresh tensors that are then concatenated into it.

    ``slots``: ``(offset, numel, shape)`` of each trainable parameter, in the order of
    the graph's gradient outputs (the first outputs; the loss follows); ``numel``:
    ``N``.  A gradient made by a ragged product (through views only, the same element
    order) is computed into its part of ``G`` by ``ragged_bmm.out``: no fresh
    ``[rows, out, in]`` tensor per step, whose first writes to cold memory cost more
    than the product itself (a weight gradient of the MLP: 379 against 162 us), and no
    copy; any other gradient is copied into its part inside the graph.  The values are
    the same bits.  Run it last: the graph then mutates ``G``.  Returns the number of
    gradients computed in place (0 and the graph unchanged when its outputs do not
    match ``slots``)."""
    aten = torch.ops.aten
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    flat = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else None
    if flat is None or len(flat) < len(slots):
        return 0
    grads = flat[:len(slots)]
    vals = [g.meta.get("val") if isinstance(g, torch.fx.Node) else None for g in grads]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return 0
    rows = vals[0].shape[0]
    if any(tuple(v.shape) != (rows, *shape) or v.numel() != rows * k for v, (_, k, shape) in zip(vals, slots)):
        return 0
    kernels = _ragged_ops()
    ragged_out = kernels.bmm_out
    views = (aten.transpose.int, aten.view.default, aten._unsafe_view.default, aten.permute.default,
             aten.alias.default, aten.t.default)
    gm.register_buffer(GRADIENT_BUFFER, torch.zeros(rows, numel, dtype=vals[0].dtype), persistent=False)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        buffer = graph.get_attr(GRADIENT_BUFFER)
    in_place = 0
    for j, (grad, val, (offset, k, shape)) in enumerate(zip(grads, vals, slots)):
        producer = grad
        while producer.op == "call_function" and producer.target in views and len(producer.users) == 1:
            producer = producer.args[0]
        pval = producer.meta.get("val") if isinstance(producer, torch.fx.Node) else None
        direct = (producer.op == "call_function" and kernels.bmm is not None and producer.target is kernels.bmm
                  and len(producer.users) == 1 and isinstance(pval, torch.Tensor) and pval.is_contiguous()
                  and val.is_contiguous() and pval.numel() == val.numel())
        with graph.inserting_before(producer if direct else output):
            part = graph.call_function(aten.slice.Tensor, (buffer, 1, offset, offset + k))
            if direct:
                dst = graph.call_function(aten.view.default, (part, list(pval.shape)))
                node = graph.call_function(ragged_out, producer.args, {**producer.kwargs, "out": dst})
                node.meta.update(producer.meta)
                producer.replace_all_uses_with(node)
                graph.erase_node(producer)
                flat = [node if x is producer else x for x in flat]
                in_place += 1
            else:
                dst = graph.call_function(aten.view.default, (part, [rows, *shape]))
                flat[j] = graph.call_function(aten.copy_.default, (dst, grad))
    output.args = (type(output.args[0])(flat),)
    graph.lint()
    return in_place
