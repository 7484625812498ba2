"""A round's client weights are checked once and normalised once, on every path (issue 46).

Counted in one real round per path: the calls of the weight checks -- by value
(``ops.aggregate.check_weight_values``) and by form (``ops.aggregate.as_weight_tensor``,
``server.aggregation.check_weight_tensor``) -- and of the server's one normaliser
(``server.aggregation.normalize_weights``).  The counter sees every call, whatever name a
module imported the function under (a profile hook on the functions' code objects).
Target: at most one check by value and one by form (two in all), exactly one
normalisation.  ``cap_weight_shares`` (the shares under ``max_weight_share``) is the
weighting rule that forms the weights, counted apart and at most once.

The guards for direct users stay: an op, a robust rule, DP or the server step called
with a raw tensor still refuse negative, NaN and all-zero weights, writing nothing.
"""

from __future__ import annotations

import collections
import importlib
import sys

import pytest
import torch

from fedopt_kernels.ops.checked_weights import CheckedWeights

_OPS = importlib.import_module("fedopt_kernels.ops.aggregate")  # the module (ops.aggregate is the function)
_AGG = importlib.import_module("fedopt_kernels.server.aggregation")
_WEIGHTING = importlib.import_module("fedopt_kernels.server.weighting")
_COUNTED = {
    _OPS.check_weight_values.__code__: "values",
    _OPS.as_weight_tensor.__code__: "form",
    _AGG.check_weight_tensor.__code__: "form",
    _AGG.normalize_weights.__code__: "normalise",
    _WEIGHTING.cap_weight_shares.__code__: "cap",
}

BASE = dict(dataset="digits", clients=6, per_round=3, rounds=1, local_steps=1, hidden=(8,), seed=3)


def _count(fn) -> collections.Counter:
    """The calls of the counted functions while ``fn()`` runs (this thread)."""
    calls = collections.Counter()

    def hook(frame, event, arg):
        if event == "call" and frame.f_code in _COUNTED:
            calls[_COUNTED[frame.f_code]] += 1

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def _assert_once(calls, *, weighted=True, capped=False, normalised=1):
    if weighted:
        assert calls["values"] == 1, calls
    else:  # uniform weights (None): nothing to check by value
        assert calls["values"] == 0, calls
    assert calls["form"] <= 1 and calls["values"] + calls["form"] <= 2, calls
    assert calls["normalise"] == normalised, calls
    assert calls["cap"] == (1 if capped else 0), calls


def _sim(**over):
    from fedopt_kernels.fl import Simulation, SimulationConfig

    cfg = SimulationConfig(**{**BASE, **over})
    cfg.validate()
    return Simulation(cfg)


SIMULATOR = {
    "batched": ({}, {}),
    "sequential": (dict(engine="sequential"), {}),
    "max_weight_share": (dict(max_weight_share=0.4), dict(capped=True)),
    "trimmed_mean_size_weights": (dict(aggregator="trimmed-mean", per_round=5, weighting="size"), {}),
    "geomed_weighted_rule": (dict(aggregator="geomed", per_round=4, weighting="size"), {}),
    # DP-FedAvg divides by the expected number of clients m (the clipped sum's scale 1/m),
    # never by the weights' total: there is nothing to normalise
    "dp_uniform": (dict(dp_clip=1.0, dp_noise_multiplier=0.0, weighting="uniform"),
                   dict(weighted=False, normalised=0)),
    "folded_memory_budget": (dict(memory_budget="40K"), {}),
    "compressed_int8": (dict(compress="int8"), {}),
}


@pytest.mark.parametrize("name", list(SIMULATOR))
def test_the_simulator_checks_the_weights_once_and_normalises_them_once(name):
    over, expect = SIMULATOR[name]
    sim = _sim(**over)
    x0 = sim.x_global.clone()
    calls = _count(lambda: sim.run(1))
    _assert_once(calls, **expect)
    assert not torch.equal(sim.x_global, x0)  # a round was stepped


def test_fedbuff_checks_each_steps_weights_once_and_normalises_them_once():
    """Asynchronous rounds (FedBuff on the virtual clock): each server step on a full
    buffer is one round of the server's round, data-size weights included."""
    from fedopt_kernels.fl.run.clocked import AsyncConfig, ClockConfig, ClockedRun

    sim = _sim(rounds=2, weighting="size")
    run = ClockedRun(sim, AsyncConfig(mode="fedbuff", concurrency=4, buffer=2, clock=ClockConfig(heterogeneity="mild")))
    calls = _count(run.run)
    steps = len(run.schedule.steps)
    assert steps == 2
    assert calls == collections.Counter(values=steps, form=steps, normalise=steps), calls

def _flower_round(make):
    pytest.importorskip("flwr", reason="the Flower strategies need flwr (the flower extra)")
    from test_flower import _net, _replies

    from fedopt_kernels.integrations import flower as fk

    replies = _replies(_net(), 5, seed=4)
    strategy = make(fk, _net())
    strategy.load_global_arrays(fk.model_to_arrayrecord(_net()))
    before = torch.cat([p.detach().flatten() for p in _net().parameters()])
    out = {}
    calls = _count(lambda: out.update(arrays=strategy.aggregate_train(1, replies)[0]))
    after = torch.cat([torch.from_numpy(a.numpy()).flatten() for a in out["arrays"].values()])
    assert not torch.equal(after, before)
    return calls


FLOWER = {
    "fedavg": (lambda fk, net: fk.FedAvg(net, fraction_evaluate=0.0), {}),
    "max_weight_share": (lambda fk, net: fk.FedAdam(net, fraction_evaluate=0.0, max_weight_share=0.4),
                         dict(capped=True)),
    "geomed": (lambda fk, net: fk.FedAvg(net, fraction_evaluate=0.0, aggregator="geomed"), {}),
    "dp": (lambda fk, net: fk.DifferentialPrivacy(fk.FedAvg(net, fraction_evaluate=0.0, weighting="uniform"),
                                                  clip=1.0, num_clients=5, noise_multiplier=0.5, delta=1e-5),
           dict(weighted=False, normalised=0)),  # DP-FedAvg divides by m, as in the simulator
}


@pytest.mark.parametrize("name", list(FLOWER))
def test_the_flower_strategy_checks_the_weights_once_and_normalises_them_once(name):
    make, expect = FLOWER[name]
    _assert_once(_flower_round(make), **expect)


@pytest.mark.parametrize("over, expect", [(dict(max_weight_share=0.4), dict(capped=True)),
                                          (dict(aggregator="geomed", per_round=4), {})],
                         ids=["mean_max_weight_share", "geomed"])
def test_the_distributed_union_is_not_checked_again(tmp_path, over, expect):
    """A group of one gloo process in this one: the round's weights go through the
    ranks' exchange and the union (``DistributedAggregator``) as on many ranks."""
    import torch.distributed as dist

    from fedopt_kernels.fl import SimulationConfig
    from fedopt_kernels.fl.run.distributed_simulation import DistributedSimulation

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sim = DistributedSimulation(SimulationConfig(**{**BASE, **over}))
        plain = _sim(**over)
        calls = _count(lambda: sim.run(1))
        plain.run(1)
    finally:
        dist.destroy_process_group()
    _assert_once(calls, **expect)
    assert torch.equal(sim.x_global, plain.x_global)  # the trusted union changes no bit


# ---------------------------------------------------------------- the guards direct users keep
BAD = [([1.0, -1.0, 2.0], "must be >= 0"), ([1.0, float("nan"), 2.0], "must be finite"),
       ([0.0, 0.0, 0.0], "must not all be zero")]


def _rows():
    return torch.linspace(-1.0, 1.0, 3 * 7).reshape(3, 7)


@pytest.mark.parametrize("bad, match", BAD)
@pytest.mark.parametrize("rule", ["geometric_median", "multi_krum", "norm_bounded_mean"])
def test_a_robust_op_called_with_raw_weights_still_refuses_bad_ones(rule, bad, match):
    from fedopt_kernels.ops import robust_aggregate as R

    kw = {"multi_krum": dict(f=0), "norm_bounded_mean": dict(radius=1.0)}.get(rule, {})
    out = torch.full((7,), 9.0)
    with pytest.raises(ValueError, match=match):
        getattr(R, rule)(_rows(), weights=torch.tensor(bad), out=out, backend="reference", **kw)
    assert (out == 9.0).all()  # nothing written


def test_checked_weights_skip_only_the_value_check_of_an_op():
    """The wrapper is trusted by value (a hand-made one with a negative entry is not
    read), never by form: a wrong length is still refused.  Same bits as the raw tensor."""
    from fedopt_kernels.ops import robust_aggregate as R

    w = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    a, sa = R.geometric_median(_rows(), weights=w, backend="reference")
    b, sb = R.geometric_median(_rows(), weights=CheckedWeights(w), backend="reference")
    assert torch.equal(a, b) and torch.equal(sa.weights, sb.weights)
    with pytest.raises(ValueError, match="weights must have shape"):
        R.geometric_median(_rows(), weights=CheckedWeights(w[:2]), backend="reference")
    # hand-computed: every client sends the same row, so the geometric median is that row
    same = torch.ones(3, 7)
    m, _ = R.geometric_median(same, weights=CheckedWeights(w), backend="reference")
    torch.testing.assert_close(m.double(), torch.ones(7, dtype=torch.float64))


@pytest.mark.parametrize("bad, match", BAD)
@pytest.mark.parametrize("dp", [False, True], ids=["mean", "dp"])
def test_the_server_step_and_dp_still_refuse_bad_raw_weights(bad, match, dp):
    """A user's ``step(updates, weights)`` with a raw tensor: refused by value, nothing
    written, DP's noise and clip state untouched (its own message names the [0, 1]
    bound for a negative or NaN weight)."""
    from fedopt_kernels.server import FedAvg
    from fedopt_kernels.server.differential_privacy.dp import DPAggregator

    p = torch.nn.Parameter(torch.zeros(7))
    agg = DPAggregator(clip=1.0, noise_multiplier=0.5, expected_clients=3) if dp else None
    opt = FedAvg([p], aggregator=agg) if dp else FedAvg([p])
    state = repr(agg.state_dict()) if dp else None
    with pytest.raises(ValueError, match=("must lie in \\[0, 1\\]" if dp and "zero" not in match else match)):
        opt.step(_rows(), torch.tensor(bad))
    assert (p.detach() == 0).all()  # nothing written
    if dp:
        assert repr(agg.state_dict()) == state
