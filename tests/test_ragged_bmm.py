"""ops.ragged_bmm (csrc/cpu/ragged_bmm.cpp) and the engine's ragged products pass.

Oracle: each client's product computed alone in float64 from the sliced operands
(``_oracle``), and for the engine the same run with ``trainer.ragged = False`` (the
padded ``bmm``) within the batched engine's tolerance.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedopt_kernels.fl import Simulation, SimulationConfig
from fedopt_kernels.fl.engine.graph_passes import GRADIENT_BUFFER, RAGGED_LENGTHS
from fedopt_kernels.ops.ragged_bmm import ragged_bmm, ragged_bmm_uses_blas

pytestmark = pytest.mark.usefixtures("one_thread")

BLAS = ragged_bmm_uses_blas(torch.float32, "cpu")
RAW = torch.ops.fedopt_C.ragged_bmm if hasattr(torch.ops.fedopt_C, "ragged_bmm") else None


def _oracle(a, b, lengths, dim, zero_fill):
    a, b = a.double(), b.double()
    out = torch.zeros(a.shape[0], a.shape[1], b.shape[2], dtype=torch.float64)
    for i, n in enumerate(lengths.tolist()):
        if n == 0:
            continue
        if dim == 1:
            out[i, :n] = a[i, :n] @ b[i]
            out[i, n:] = 0 if zero_fill else out[i, :1]
        elif dim == 2:
            out[i] = a[i, :, :n] @ b[i, :n]
        else:
            out[i, :, :n] = a[i] @ b[i, :, :n]
            out[i, :, n:] = 0 if zero_fill else out[i, :, :1]
    return out


def _operands(C, M, K, N, dtype, layout, gen):
    """a [C, M, K] and b [C, K, N] as contiguous, transposed or expanded views."""
    if layout == "contiguous":
        a, b = torch.randn(C, M, K, generator=gen), torch.randn(C, K, N, generator=gen)
    elif layout == "transposed":  # what a traced graph passes: W^T and dY^T views
        a, b = torch.randn(C, K, M, generator=gen).transpose(1, 2), torch.randn(C, N, K, generator=gen).transpose(1, 2)
    else:  # one matrix for every client (batch stride 0), and a sliced, strided one
        a = torch.randn(1, M, K, generator=gen).expand(C, M, K)
        b = torch.randn(C, K, 2 * N + 1, generator=gen)[:, :, 1:2 * N + 1:2]
    return a.to(dtype), b.to(dtype)


def _lengths(C, full, gen):
    lengths = torch.randint(0, full + 1, (C,), generator=gen)
    if C >= 3:
        lengths[0], lengths[1], lengths[2] = 0, full, 1
    return lengths


TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12), torch.float16: (2e-3, 2e-3),
       torch.bfloat16: (1.6e-2, 1.6e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "expanded"])
@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("zero_fill", [True, False])
def test_ragged_bmm_equals_each_clients_product(dtype, layout, dim, zero_fill):
    gen = torch.Generator().manual_seed(dim * 10 + int(zero_fill))
    C, M, K, N = 7, 13, 11, 9  # odd sizes
    a, b = _operands(C, M, K, N, dtype, layout, gen)
    lengths = _lengths(C, (M, K, N)[dim - 1], gen)
    expected = _oracle(a, b, lengths, dim, zero_fill)
    out = ragged_bmm(a, b, lengths, dim, zero_fill=zero_fill)
    assert out.dtype == dtype and out.shape == (C, M, N) and out.is_contiguous()
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=atol * K)
    if RAW is not None and dtype in (torch.float32, torch.float64):  # the per-client mm loop, same values
        looped = RAW(a, b, lengths, dim, zero_fill, use_blas=False)
        torch.testing.assert_close(looped.double(), expected, rtol=rtol, atol=atol * K)
    # the padding is exactly zeros or exactly row/column 0
    for i, n in enumerate(lengths.tolist()):
        if dim == 1 and n:
            pad = out[i, n:]
            assert torch.equal(pad, torch.zeros_like(pad) if zero_fill else out[i, :1].expand_as(pad))
        if dim == 3 and n:
            pad = out[i, :, n:]
            assert torch.equal(pad, torch.zeros_like(pad) if zero_fill else out[i, :, :1].expand_as(pad))
        if n == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i]))


@pytest.mark.skipif(RAW is None, reason="needs the CPU extension")
@pytest.mark.parametrize("dim", [1, 2, 3])
def test_a_clients_bits_do_not_depend_on_who_shares_the_call(dim):
    """Client i's product is one single-threaded GEMM of its own shape: computed with 9
    other clients, with 3 others, beside a copy of itself or alone, on 1 or 2 threads,
    the same bits (the engine's promise that grouping never changes a client's
    arithmetic).  MKL's grouped GEMM failed this on 2 threads (it splits unequal
    groups' work among its threads)."""
    gen = torch.Generator().manual_seed(3)
    C, M, K, N = 10, 32, 200, 64
    a, b = _operands(C, M, K, N, torch.float32, "transposed", gen)
    lengths = _lengths(C, (M, K, N)[dim - 1], gen)
    together = ragged_bmm(a, b, lengths, dim, zero_fill=False)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for i in range(C):
            for rows in ([i], [i, i], [i, (i + 3) % C, (i + 5) % C, (i + 7) % C], list(range(i, C))):
                part = ragged_bmm(a[rows], b[rows], lengths[rows], dim, zero_fill=False)
                assert torch.equal(part[0], together[i]), (threads, i, rows)


def _placed(t, offset, transposed):
    """``t`` [C, R, S] copied into a buffer at ``offset`` elements from its 64-byte
    aligned start, stored as is or as the transpose view of its transpose."""
    src = t.transpose(1, 2).contiguous() if transposed else t.contiguous()
    view = torch.zeros(src.numel() + 64, dtype=t.dtype)[offset:offset + src.numel()].view_as(src)
    view.copy_(src)
    return view.transpose(1, 2) if transposed else view


@pytest.mark.skipif(RAW is None, reason="needs the CPU extension")
@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("shape", [(17, 64, 10), (17, 200, 64), (5, 9, 3), (32, 17, 200)])
def test_a_clients_bits_do_not_depend_on_where_its_operands_lie(dim, shape):
    """MKL's skinny-product kernels (under 4 rows or 12 columns) give bits that follow the
    operands' and the result's alignment; the engine's clients lie at offsets that change
    with their place in a group (a row of N elements).  ragged_bmm runs those products on
    aligned copies: the same bits wherever a, b and out lie (every offset of a 64-byte
    line, both storage orders), for every client length 0..M (small lengths are the
    skinny products of dims 1 and 3)."""
    gen = torch.Generator().manual_seed(11)
    M, K, N = shape
    full = (M, K, N)[dim - 1]
    C = full + 1
    a = torch.randn(C, M, K, generator=gen)
    b = torch.randn(C, K, N, generator=gen)
    lengths = torch.arange(C)  # every length once
    expected = ragged_bmm(a, b, lengths, dim)
    torch.testing.assert_close(expected.double(), _oracle(a, b, lengths, dim, True), rtol=1e-5, atol=1e-5 * K)
    for offset in range(1, 16):
        for transposed in (False, True):
            assert torch.equal(ragged_bmm(_placed(a, offset, transposed), b, lengths, dim), expected), (offset, "a")
            assert torch.equal(ragged_bmm(a, _placed(b, offset, transposed), lengths, dim), expected), (offset, "b")
        out = torch.zeros(C * M * N + 64)[offset:offset + C * M * N].view(C, M, N)
        assert torch.equal(ragged_bmm(a, b, lengths, dim, out=out), expected), (offset, "out")


@pytest.mark.skipif(RAW is None, reason="needs the CPU extension")
@pytest.mark.parametrize("dim", [1, 2, 3])
def test_out_writes_into_a_strided_view_with_the_same_bits(dim):
    """ragged_bmm.out into the clients' rows of a wider buffer (the engine's gradient
    buffer G: each matrix a slice of a row of G) gives the bits of the plain op, and
    touches nothing else of the buffer."""
    gen = torch.Generator().manual_seed(5)
    C, M, K, N = 6, 13, 11, 9
    a, b = _operands(C, M, K, N, torch.float32, "transposed", gen)
    lengths = _lengths(C, (M, K, N)[dim - 1], gen)
    G = torch.full((C, 7 + M * N + 5), 3.25)
    view = G[:, 7:7 + M * N].view(C, M, N)
    for zero_fill in (True, False):
        got = ragged_bmm(a, b, lengths, dim, zero_fill=zero_fill, out=view)
        assert got.data_ptr() == view.data_ptr()
        assert torch.equal(view, ragged_bmm(a, b, lengths, dim, zero_fill=zero_fill))
        assert (G[:, :7] == 3.25).all() and (G[:, 7 + M * N:] == 3.25).all()
    with pytest.raises(ValueError, match="out must be"):
        ragged_bmm(a, b, lengths, dim, out=G[:, :M * N].view(C, N, M))
    with pytest.raises(ValueError, match="out must be"):
        ragged_bmm(a, b, lengths, dim, out=torch.empty(C, N, M).transpose(1, 2))


def test_empty_and_degenerate_shapes():
    for C, M, K, N in [(0, 4, 3, 2), (3, 0, 3, 2), (3, 4, 0, 2), (3, 4, 3, 0)]:
        for dim in (1, 2, 3):
            full = (M, K, N)[dim - 1]
            lengths = torch.full((C,), full, dtype=torch.int64)
            a, b = torch.randn(C, M, K), torch.randn(C, K, N)
            out = ragged_bmm(a, b, lengths, dim)
            assert out.shape == (C, M, N)
            assert torch.equal(out, torch.bmm(a, b))  # K = 0: zeros, as bmm


@pytest.mark.parametrize("call, match", [
    (lambda a, b, n: ragged_bmm(a[0], b, n, 1), "a must be a 3-D floating point tensor"),
    (lambda a, b, n: ragged_bmm(a, b.long(), n, 1), "b must be a 3-D floating point tensor"),
    (lambda a, b, n: ragged_bmm(a, b.double(), n, 1), "must share dtype and device"),
    (lambda a, b, n: ragged_bmm(a, b[:, :2], n, 1), "cannot be multiplied"),
    (lambda a, b, n: ragged_bmm(a, b, n, 0), "dim must be 1 .rows., 2 .contraction. or 3"),
    (lambda a, b, n: ragged_bmm(a, b, n.int(), 1), "lengths must be a CPU int64 tensor of shape \\[3\\]"),
    (lambda a, b, n: ragged_bmm(a, b, n[:2], 1), "lengths must be a CPU int64 tensor of shape \\[3\\]"),
    (lambda a, b, n: ragged_bmm(a, b, n + 5, 1), "lengths must lie in \\[0, 4\\]"),
    (lambda a, b, n: ragged_bmm(a, b, n - 5, 2), "lengths must lie in \\[0, 5\\]"),
])
def test_bad_input_names_the_argument(call, match):
    a, b, n = torch.randn(3, 4, 5), torch.randn(3, 5, 6), torch.tensor([1, 2, 3])
    with pytest.raises((TypeError, ValueError), match=match):
        call(a, b, n)


@pytest.mark.skipif(RAW is None, reason="needs the CPU extension")
def test_raw_op_checks_what_would_be_memory_unsafe():
    a, b = torch.randn(3, 4, 5), torch.randn(3, 5, 6)
    with pytest.raises(RuntimeError, match="outside \\[0, 4\\]"):
        RAW(a, b, torch.tensor([1, 9, 2]), 1, True)
    with pytest.raises(RuntimeError, match="lengths must be an int64 tensor of shape \\[3\\]"):
        RAW(a, b, torch.tensor([1, 2]), 1, True)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        RAW(a, b[:, :4], torch.tensor([1, 2, 3]), 1, True)


# ---------------------------------------------------------------- the engine's pass
SMALL = dict(dataset="digits", hidden=(32,), clients=30, per_round=6, rounds=3, local_steps=8, batch_size=32,
             lr=0.05, weight_decay=1e-3, max_norm=1.0)


def _pair(module=None, loss_fn=None, off="ragged", **kw):
    """The same batched run with the trainer's optimisation ``off`` on and off (default:
    the ragged products, against the padded bmm)."""
    cfg = SimulationConfig(**{**SMALL, **kw})
    on, without = Simulation(cfg, model=module, loss_fn=loss_fn), Simulation(cfg, model=module, loss_fn=loss_fn)
    setattr(without.batched, off, False)
    on.run()
    without.run()
    return on, without


def _products(sim):
    nodes = [n for gm in sim.batched._traced.values() for n in gm.graph.nodes if n.op == "call_function"]
    ops = (torch.ops.fedopt_C.ragged_bmm.default, torch.ops.fedopt_C.ragged_bmm.out)
    ragged = [n for n in nodes if n.target in ops]
    return ragged, [n for n in nodes if n.target is torch.ops.aten.bmm.default]


def _assert_close(a, b):
    assert float((a - b).norm() / b.norm()) <= 1e-5
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not BLAS, reason="the BLAS path (CPU extension, torch with a BLAS) is unavailable")
def test_ragged_products_replace_every_bmm_of_a_padded_mlp():
    """A 2-layer MLP's step has 5 products: 2 forward (padded rows = copies of row 0),
    1 input gradient (zeros) and 2 weight gradients (contractions over the samples);
    all become ragged, and the run equals the padded one within the engine's
    tolerance."""
    ragged, padded = _pair(algo="scaffold", momentum=0.5, per_round=7)
    nodes, left = _products(ragged)
    assert not left and ragged.batched.trace_failure is None
    per_graph = len(ragged.batched._traced)
    assert len(nodes) == 5 * per_graph
    fills = sorted((n.args[3], n.args[4]) for n in nodes[:5])
    assert fills == [(1, False), (1, False), (1, True), (2, True), (2, True)]
    # the two weight gradients are computed straight into the gradient buffer
    assert sorted(n.args[3] for n in nodes[:5] if n.target is torch.ops.fedopt_C.ragged_bmm.out) == [2, 2]
    assert all(hasattr(gm, RAGGED_LENGTHS) and hasattr(gm, GRADIENT_BUFFER) for gm in ragged.batched._traced.values())
    assert _products(padded)[0] == []
    _assert_close(ragged.x_global, padded.x_global)
    _assert_close(ragged.scaffold.c, padded.scaffold.c)


@pytest.mark.skipif(not BLAS, reason="the BLAS path (CPU extension, torch with a BLAS) is unavailable")
@pytest.mark.parametrize("case", ["masked-nll", "dropout", "cnn"])
def test_ragged_products_in_other_models_and_losses(case):
    """Per-sample losses (masked mode: the weights are the graph's last input), random
    layers (padded rows of other masks: still finite copies), and a CNN's classifier."""
    if case == "masked-nll":
        def make():
            return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10), nn.LogSoftmax(-1))
        ragged, padded = _pair(module=make, loss_fn=nn.NLLLoss())
        assert {k[0] for k in ragged.batched._traced} == {"masked"}
    elif case == "dropout":
        def make():
            return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10))
        ragged, padded = _pair(module=make, clients=12, per_round=12)
    else:
        ragged, padded = _pair(model="cnn", rounds=3, local_steps=2, clients=8, per_round=8)
    nodes, left = _products(ragged)
    assert nodes and not left
    _assert_close(ragged.x_global, padded.x_global)


@pytest.mark.skipif(not BLAS, reason="the BLAS path (CPU extension, torch with a BLAS) is unavailable")
def test_a_forward_contraction_over_the_samples_is_left_alone():
    """A product that sums over a batch's samples outside the gradient (a model that
    mixes its samples) would count the padding: it stays a bmm."""
    class Gram(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 10)

        def forward(self, x):
            h = self.lin(x.flatten(1))
            g = h.T @ h  # [10, 10]: a sum over the samples
            return h + g.sum() * 0

    cfg = SimulationConfig(**SMALL)
    sim = Simulation(cfg, model=Gram)
    sim.run()
    nodes, left = _products(sim)
    assert nodes and left, "the forward Gram product must stay a padded bmm"


class _Forgetful(dict):
    """A cache that keeps nothing: every graph finds its own sample dimensions."""

    def __setitem__(self, key, value):
        pass


@pytest.mark.skipif(not BLAS, reason="the BLAS path (CPU extension, torch with a BLAS) is unavailable")
def test_sample_dimensions_are_found_once_per_padded_length(monkeypatch):
    """Graphs of one loss and padded length but different row counts share their
    products' sample dimensions: one second trace per (mode, batch), not per shape,
    and the same bits as every graph tracing its own."""
    from fedopt_kernels.fl.engine import batched as B

    kw = dict(clients=100, per_round=25, rounds=6, local_steps=3)
    calls = []
    real = B.sample_dims
    monkeypatch.setattr(B, "sample_dims", lambda *a: calls.append(a[2]) or real(*a))
    def several_levels(sim):  # a cheap batched call: the population's several padded lengths
        sim.batched.planner.call_cost_flops = 2e6
        sim.batched.planner.set_population(sim.partition.sizes)
        return sim

    shared = several_levels(Simulation(SimulationConfig(**{**SMALL, **kw})))
    shared.run()
    traced = shared.batched.trace_counts
    per_length = {(mode, batch) for mode, _, batch in traced}
    assert len(traced) > len(per_length)  # several row counts at one padded length
    assert sorted(calls) == sorted(batch for _, batch in per_length)
    own = several_levels(Simulation(SimulationConfig(**{**SMALL, **kw})))
    own.batched._sample_dims = _Forgetful()
    own.run()
    assert len(calls) == len(per_length) + len(own.batched.trace_counts)
    assert torch.equal(shared.x_global, own.x_global)


# ---------------------------------------------------------------- fused epilogues
EPI = torch.ops.fedopt_C.ragged_bias_relu_ if RAW is not None and hasattr(torch.ops.fedopt_C, "ragged_bias_relu_") \
    else None


def _special(t, gen):
    """``t`` with zeros of both signs, NaN and infinities at random places."""
    flat = t.view(-1)
    picks = torch.randperm(flat.numel(), generator=gen)[:12]
    flat[picks] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-40, -1e-40, 0.0, -0.0,
                                3.0, -3.0, float("nan")], dtype=t.dtype)
    return t


def _same(a, b):
    """Bitwise equal, NaN included."""
    return torch.equal(a.view(torch.int64 if a.dtype == torch.float64 else torch.int32),
                       b.view(torch.int64 if b.dtype == torch.float64 else torch.int32))


@pytest.mark.skipif(EPI is None, reason="needs the CPU extension")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("bias_form", ["broadcast", "2d", "strided"])
def test_ragged_bias_relu_is_the_aten_ops_on_the_real_rows(dtype, relu, bias_form):
    """x[i, :L_i] = relu(x + b) (aten's add then relu: -0.0 and NaN pass through, the same
    bits) in place; the padded rows keep what they held; lengths 0 and full."""
    gen = torch.Generator().manual_seed(21)
    C, M, N = 5, 7, 13
    x = _special(torch.randn(C, M, N, generator=gen).to(dtype), gen)
    wide = _special(torch.randn(C, N + 9, generator=gen).to(dtype), gen)
    bias = {"broadcast": wide[:, 3:3 + N].contiguous().view(C, 1, N), "2d": wide[:, 3:3 + N].contiguous(),
            "strided": wide[:, 3:3 + N].unsqueeze(1)}[bias_form]  # the last: rows of a wider buffer
    lengths = torch.tensor([0, M, 1, 3, M - 1])
    expected = x + bias.reshape(C, 1, N)
    if relu:
        expected = torch.relu(expected)
    y = x.clone()
    assert EPI(y, bias, lengths, relu).data_ptr() == y.data_ptr()
    for i, n in enumerate(lengths.tolist()):
        assert _same(y[i, :n], expected[i, :n]), i
        assert _same(y[i, n:], x[i, n:]), i


@pytest.mark.skipif(EPI is None, reason="needs the CPU extension")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ragged_relu_backward_is_threshold_backward_on_the_real_rows(dtype):
    """grad[i, :L_i] = threshold_backward(grad, h, 0) in place (h = 0, -0.0, NaN
    included); the padded rows keep what they held."""
    gen = torch.Generator().manual_seed(22)
    C, M, N = 4, 6, 9
    grad = _special(torch.randn(C, M, N, generator=gen).to(dtype), gen)
    h = _special(torch.randn(C, M, N, generator=gen).to(dtype), gen)
    lengths = torch.tensor([M, 0, 2, 5])
    expected = torch.ops.aten.threshold_backward(grad, h, 0)
    g = grad.clone()
    torch.ops.fedopt_C.ragged_relu_backward_(g, h, lengths)
    for i, n in enumerate(lengths.tolist()):
        assert _same(g[i, :n], expected[i, :n]) and _same(g[i, n:], grad[i, n:]), i


@pytest.mark.skipif(EPI is None, reason="needs the CPU extension")
@pytest.mark.parametrize("call, match", [
    (lambda x, b, n: EPI(x.half(), b, n, True), "x must be a 3-D CPU float32/float64"),
    (lambda x, b, n: EPI(x.transpose(1, 2), b[:, :4].unsqueeze(1), n, True), "x must have contiguous rows"),
    (lambda x, b, n: EPI(x, b[:, :4], n, True), "bias must be a CPU Float tensor of shape \\[3, 1, 5\\]"),
    (lambda x, b, n: EPI(x, b.double(), n, True), "bias must be a CPU Float"),
    (lambda x, b, n: EPI(x, b, n[:2], True), "lengths must be an int64 tensor of shape \\[3\\]"),
    (lambda x, b, n: EPI(x, b, n + 4, True), "lengths\\[0\\] = 5 is outside \\[0, 4\\]"),
    (lambda x, b, n: torch.ops.fedopt_C.ragged_relu_backward_(x, x[:, :3], n), "output must have grad's shape"),
    (lambda x, b, n: torch.ops.fedopt_C.ragged_relu_backward_(x, x.double(), n), "output must"),
])
def test_bad_epilogue_input_names_the_argument_and_changes_nothing(call, match):
    x, b, n = torch.randn(3, 4, 5), torch.randn(3, 5), torch.tensor([1, 2, 3])
    before = x.clone()
    with pytest.raises(RuntimeError, match=match):
        call(x, b, n)
    assert torch.equal(x, before)


def _targets(sim):
    return [n.target for gm in sim.batched._traced.values() for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.skipif(EPI is None or not BLAS, reason="needs the CPU extension's BLAS path")
@pytest.mark.parametrize("kw", [dict(hidden=(32, 24), algo="scaffold", momentum=0.5, per_round=7),
                                dict(model="cnn", rounds=2, local_steps=2, clients=8, per_round=8)],
                         ids=["mlp", "cnn"])
def test_fused_epilogues_give_the_same_bits(kw):
    """The fused bias+ReLU and ReLU gradient are the same IEEE operations on the real
    rows, and the padded rows they leave are read by nobody: the run is bitwise the
    unfused one.  In a 2-hidden-layer MLP every hidden layer is fused, forward and
    backward (the output layer feeds the loss, which reads the padding: left alone)."""
    fused, plain = _pair(off="fuse", **kw)
    assert torch.equal(fused.x_global, plain.x_global)
    ops = _targets(fused)
    n_fwd = ops.count(torch.ops.fedopt_C.ragged_bias_relu_.default)
    n_bwd = ops.count(torch.ops.fedopt_C.ragged_relu_backward_.default)
    graphs = len(fused.batched._traced)
    if "model" not in kw:
        assert (n_fwd, n_bwd) == (2 * graphs, 2 * graphs)
        assert torch.ops.aten.relu.default not in ops and torch.ops.aten.threshold_backward.default not in ops
    else:  # the classifier's hidden layer (after the convolutions' features)
        assert (n_fwd, n_bwd) == (graphs, graphs)
    assert torch.ops.fedopt_C.ragged_bias_relu_.default not in _targets(plain)


@pytest.mark.skipif(EPI is None or not BLAS, reason="needs the CPU extension's BLAS path")
def test_an_activation_read_elsewhere_is_not_fused():
    """A hidden activation that another op reads (here a per-sample sum feeding the
    output) would see the padded rows the fused op leaves: that layer keeps the aten
    ops, and the run still equals the unfused one."""
    class Side(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(64, 32), nn.Linear(32, 10)

        def forward(self, x):
            h = torch.relu(self.a(x.flatten(1)))
            return self.b(h) + h.sum(-1, keepdim=True) * 1e-3

    fused, plain = _pair(module=Side, off="fuse")
    ops = _targets(fused)
    assert torch.ops.fedopt_C.ragged_bias_relu_.default not in ops and torch.ops.aten.relu.default in ops
    assert torch.equal(fused.x_global, plain.x_global)
