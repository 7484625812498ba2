"""fl/engine/aten_trace.py: a function's ATen ops recorded into an FX graph without make_fx.

The oracle is ``make_fx`` itself: for the batched engine's vmapped gradients the
recorded graph has make_fx's op sequence, and both graphs and the eager transforms
give the same bits.  The rest: multi-output ops, constants, in-place and random ops,
empty tensors, bad arguments."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from fedopt_kernels.fl import Simulation, SimulationConfig
from fedopt_kernels.fl.engine.aten_trace import drop_values, trace_aten


def _ops(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _make_fx_ops(gm):
    """make_fx's ops, ``detach`` read as ``alias``: torch 2.14's make_fx records it so,
    2.11's as ``detach`` -- a view either way, no arithmetic -- and trace_aten records
    ``alias`` under both (drop_identity_ops then removes it)."""
    detach, alias = torch.ops.aten.detach.default, torch.ops.aten.alias.default
    return [alias if t is detach else t for t in _ops(gm)]


def _engine_args(bt, mode, c=3, B=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(c, bt.numel, generator=gen) * 0.1
    params = {n: X[:, o:o + k].view(c, *s) for n, o, k, s, t in bt._slots}
    ib = torch.randint(0, bt.x_train.shape[0], (c * B,), generator=gen)
    xb = bt.x_train.index_select(0, ib).view(c, B, *bt.x_train.shape[1:])
    yb = bt.y_train.index_select(0, ib)
    w = torch.full((c, B), 1.0 / B)
    w[0, 5:] = 0.0  # a padded client
    if mode == "soft":
        return params, {}, bt.buffers, xb, bt._soft_targets.index_select(0, yb).mul_(w.view(-1, 1)).view(c, B, -1)
    if mode == "masked":
        return params, {}, bt.buffers, xb, yb.view(c, B), w
    return params, {}, bt.buffers, xb, yb.view(c, B)


@pytest.mark.parametrize("model,loss,mode", [("mlp", None, "soft"), ("cnn", None, "soft"),
                                             ("mlp", nn.NLLLoss(), "masked"),
                                             ("logreg", lambda out, y: nn.functional.cross_entropy(out, y), "plain")],
                         ids=["mlp-soft", "cnn-soft", "mlp-masked", "logreg-plain"])
def test_engine_gradients_record_make_fxs_ops_and_bits(model, loss, mode):
    sim = Simulation(SimulationConfig(dataset="digits", hidden=(16,), clients=6, per_round=3, rounds=1,
                                      local_steps=1, engine="batched", model=model), loss_fn=loss)
    bt = sim.batched
    fn = bt._grad[mode]
    args = _engine_args(bt, mode)
    ours = trace_aten(fn, *args)
    ref = make_fx(lambda *a: fn(*a), tracing_mode="fake")(*args)
    assert _ops(ours) == _make_fx_ops(ref)
    fresh = _engine_args(bt, mode, seed=1)
    (g_ours, l_ours), (g_ref, l_ref), (g_eager, l_eager) = ours(*fresh), ref(*fresh), fn(*fresh)
    assert g_ours.keys() == g_eager.keys()
    for n in g_eager:
        assert torch.equal(g_ours[n], g_ref[n]) and torch.equal(g_ours[n], g_eager[n]), n
    assert torch.equal(l_ours, l_ref) and torch.equal(l_ours, l_eager)
    vals = [n.meta["val"] for n in ours.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.bmm.default]
    assert vals and all(isinstance(v, torch.Tensor) and v.dim() == 3 for v in vals)
    drop_values(ours)
    assert all("val" not in n.meta for n in ours.graph.nodes)


def test_multi_outputs_constants_inplace_random_and_empty_tensors():
    const = torch.tensor([0.5, -2.0, 3.0])

    def f(x, pair):
        values, indices = torch.sort(x * const, dim=-1)  # a tuple of outputs, a closed-over constant
        y = values.clone()
        y.add_(pair["b"]).relu_()  # in place
        noise = torch.rand_like(y)  # random: drawn again at every replay
        return {"y": y, "i": indices, "n": noise, "e": pair["empty"] * 2}

    def args(seed):
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(4, 3, generator=gen), {"b": torch.randn(3, generator=gen), "empty": torch.zeros(0, 5)}

    torch.manual_seed(7)
    gm = trace_aten(f, *args(0))
    targets = _ops(gm)
    assert torch.ops.aten.sort.default in targets and torch.ops.aten.add_.Tensor in targets
    assert sum(1 for n in gm.graph.nodes if n.op == "get_attr") == 1
    for seed in (1, 2):
        torch.manual_seed(seed)
        got = gm(*args(seed))
        torch.manual_seed(seed)
        want = f(*args(seed))
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert got["e"].shape == (0, 5)


def test_non_tensor_arguments_and_unrecorded_outputs_are_refused():
    with pytest.raises(TypeError, match="every leaf of the arguments must be a tensor, got float, int"):
        trace_aten(lambda x, a, b: x * a * b, torch.ones(2), 2.0, 3)
    made_before = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"outputs \[1\] of <lambda> were made by no recorded op"):
        trace_aten(lambda x: (x * 2, made_before), torch.ones(3))
    with pytest.raises(RuntimeError, match="returns a Python value.*data-dependent"):
        trace_aten(lambda x: x * 2 if x.sum().item() > 0 else x, torch.ones(3))
    gm = trace_aten(lambda x: (x, x + made_before), torch.ones(3))  # an input returned, a constant used
    out = gm(torch.full((3,), 2.0))
    assert torch.equal(out[0], torch.full((3,), 2.0)) and torch.equal(out[1], torch.full((3,), 3.0))
