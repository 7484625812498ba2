"""Byzantine-robust rules and DP-FedAvg over torch.distributed: 2 gloo processes on this
machine vs the single-process path computed here.

One launch of 2 processes runs every scenario; the tests compare what each rank got with
the library's public single-process path on the union of the ranks' clients (global
order: rank 0's first):

* ``DistributedServerOptimizer`` over an optimizer whose aggregator is a
  ``RobustAggregator`` (every rule, uneven and empty ranks, a NaN client, centered
  clipping's state across rounds) -- parameters, optimizer state, statistics, the
  rule's selection record and state bitwise on both ranks;
* a rule that fails only against the round's C (Krum with 2f + 2 >= C): rank 0 raises
  the op's error, rank 1 a RankInputError, the group still works after;
* ``DPAggregator`` (fixed clip with noise, adaptive clipping with noise, weights in
  [0, 1], client-side mode): ``mode="ordered"`` bitwise (parameters, the clip
  trajectory, the noise), ``mode="all_reduce"`` within all_aggregate's bound with the
  same clip trajectory;
* ``DistributedSimulation`` vs ``Simulation`` with robust rules, DP (epsilon recorded
  per round) and attacks: the global model and the round records equal.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import _gloo as gloo
from _asserts import assert_bitwise, assert_tree_bitwise

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available in this torch build")

WORLD = 2
SHAPES = [(41, 5), (9,), (3, 4, 2)]
N = sum(math.prod(s) for s in SHAPES)
# per round: (clients per rank, NaN clients); Bulyan with f = 1 needs C >= 7
ROUNDS = [((3, 4), ()), ((0, 7), (5,)), ((6, 2), (1,)), ((4, 4), ())]
RULES = {
    "median": dict(),
    "trimmed-mean": dict(beta=0.2),
    "krum": dict(f=1),
    "multi-krum": dict(f=1, m=3),
    "bulyan": dict(f=1),
    "geomed": dict(max_iter=6),
    "centered-clip": dict(tau=0.5, iterations=2),
    "norm-bound": dict(median_factor=1.0),
}
# (server optimizer, weights) per rule: the weighted rules get data sizes
OPTIMIZER = {"median": "FedAdam", "trimmed-mean": "FedAvgM", "krum": "FedAvg", "multi-krum": "FedYogi",
             "bulyan": "FedAvg", "geomed": "FedAdagrad", "centered-clip": "FedAvg", "norm-bound": "FedAdam"}
DP_CASES = {
    "fixed_noise": dict(mech=dict(clip=0.8, noise_multiplier=1.1, expected_clients=7), weights=None),
    "adaptive_noise": dict(mech=dict(clip=0.3, noise_multiplier=0.7, expected_clients=7, target_quantile=0.5,
                                     clip_count_stddev=1.0), weights=None),
    "weighted_clip_only": dict(mech=dict(clip=0.5, noise_multiplier=0.0, expected_clients=5), weights="unit"),
    "client_mode": dict(mech=dict(clip=0.6, noise_multiplier=0.9, expected_clients=7, mode="client"), weights=None),
}
DP_MODES = ("ordered", "all_reduce")


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in SHAPES]


def round_data(r, nan=True):
    counts, nans = ROUNDS[r]
    C = sum(counts)
    g = torch.Generator().manual_seed(200 + r)
    U = torch.randn(C, N, generator=g) * torch.logspace(-1, 0.5, C)[:, None]
    U[C // 2] = U[0] * 1.0  # a tie: two equal clients
    for i in nans if nan else ():
        U[i, 7] = float("nan")
    sizes = torch.randint(1, 40, (C,), generator=g).to(torch.float64)
    return U, sizes, counts


def bounds(counts, rank):
    start = sum(counts[:rank])
    return start, start + counts[rank]


def make_optimizer(name, params, aggregator, lr=None):
    from fedopt_kernels import server as S

    if lr is None:
        lr = 0.5 if name in ("FedAvg", "FedAvgM") else 0.05
    return getattr(S, name)(params, lr=lr, aggregator=aggregator)


def make_rule(rule):
    from fedopt_kernels.server.robust_aggregation.robust_aggregator import RobustAggregator

    return RobustAggregator(rule, **RULES[rule])


def make_dp(case):
    from fedopt_kernels.server.differential_privacy.dp import DPAggregator

    return DPAggregator(seed=3, **DP_CASES[case]["mech"])


def dp_weights(case, sizes):
    if DP_CASES[case]["weights"] is None:
        return None
    return (sizes / sizes.max()).tolist()  # in [0, 1]: the bound DP needs


def _views(row):
    """One flat update as views shaped like the parameters (contiguous: read in place)."""
    out, offset = [], 0
    for shape in SHAPES:
        n = math.prod(shape)
        out.append(row[offset:offset + n].view(shape))
        offset += n
    return out


def _snapshot(st, params, opt):
    return ({k: v for k, v in vars(st).items()}, [p.clone() for p in params], opt.state_dict())


# ============================================================================ workers
def _scenario_robust(rank, world):
    from fedopt_kernels.distributed import DistributedServerOptimizer

    got = {}
    for rule in RULES:
        params = make_params()
        agg = make_rule(rule)
        opt = DistributedServerOptimizer(make_optimizer(OPTIMIZER[rule], params, agg))
        rounds = []
        for r in range(len(ROUNDS)):
            U, sizes, counts = round_data(r)
            a, b = bounds(counts, rank)
            local = U[a:b].contiguous()
            if r == 2:
                local = list(local.unbind(0))  # a list of vectors works as a [C_r, N] tensor does
            elif r == 3 and a < b:  # named updates: ClientPieces, read in place (rank 0) or stacked to send
                local = [dict(zip(params, _views(row))) for row in local]
            st = opt.step(local, sizes[a:b] if agg.weighted else None)
            rounds.append(_snapshot(st, params, opt) + (agg.record(), agg.state_dict()))
        got[rule] = rounds
    return got


def _scenario_robust_errors(rank, world):
    from fedopt_kernels.distributed import DistributedServerOptimizer

    got = {}
    params = make_params()
    opt = DistributedServerOptimizer(make_optimizer("FedAvg", params, make_rule("krum")))
    U, _, _ = round_data(0)
    try:  # 2 + 2 clients: Krum with f = 1 needs C > 4
        opt.step(U[2 * rank:2 * rank + 2].contiguous())
        got["krum_small"] = None
    except Exception as exc:  # noqa: BLE001
        got["krum_small"] = (type(exc).__name__, str(exc))
    got["params_after_error"] = [p.clone() for p in params]
    st = opt.step(U[3 * rank:3 * rank + 3].contiguous())  # 6 clients: the group still works
    got["after"] = (vars(st), [p.clone() for p in params])
    from fedopt_kernels.server import FedExP

    try:  # refused by every rank before the exchange, as in one process
        DistributedServerOptimizer(FedExP(make_params(), aggregator=make_rule("median"))).step(U[:2].contiguous())
        got["fedexp"] = None
    except Exception as exc:  # noqa: BLE001
        got["fedexp"] = (type(exc).__name__, str(exc))
    from fedopt_kernels.fl.run.distributed_simulation import DistributedSimulation
    from fedopt_kernels.fl import SimulationConfig

    try:
        DistributedSimulation(SimulationConfig(**{**SIM_BASE, "attack": "alie", "attack_fraction": 0.3}))
        got["alie"] = None
    except Exception as exc:  # noqa: BLE001
        got["alie"] = (type(exc).__name__, str(exc))
    return got


def _scenario_dp(rank, world):
    from fedopt_kernels.distributed import DistributedServerOptimizer
    from fedopt_kernels.ops.dp_noise import clip_updates_

    got = {}
    for mode in DP_MODES:
        for case in DP_CASES:
            params = make_params()
            mech = make_dp(case)
            opt = DistributedServerOptimizer(make_optimizer("FedAdam", params, mech), mode=mode)
            rounds = []
            for r in range(len(ROUNDS)):
                U, sizes, counts = round_data(r)
                a, b = bounds(counts, rank)
                local = U[a:b].clone()
                if mech.mode == "client":
                    clip_updates_(local, mech.clip)
                st = opt.step(local, None if dp_weights(case, sizes) is None else dp_weights(case, sizes)[a:b])
                rounds.append(_snapshot(st, params, opt) + (mech.record(), mech.state_dict()))
            got[(mode, case)] = rounds
    for case in DP_CASES:  # all_reduce, one FedAvg(lr=1) round: p1 = p0 - D, for the bound on D
        params = make_params()
        mech = make_dp(case)
        opt = DistributedServerOptimizer(make_optimizer("FedAvg", params, mech, lr=1.0), mode="all_reduce")
        U, sizes, counts = round_data(0)
        a, b = bounds(counts, rank)
        local = U[a:b].clone()
        if mech.mode == "client":
            clip_updates_(local, mech.clip)
        opt.step(local, None if dp_weights(case, sizes) is None else dp_weights(case, sizes)[a:b])
        got[("all_reduce_fedavg", case)] = [p.clone() for p in params]
    return got


SIM_BASE = dict(dataset="digits", hidden=(24,), clients=10, per_round=7, rounds=3, local_steps=3, batch_size=32,
                lr=0.05, engine="sequential", seed=2)
SIM_CASES = {
    "krum_scale_attack": dict(aggregator="krum", byzantine_f=2, attack="scale", attack_fraction=0.2),
    "median_signflip": dict(aggregator="median", attack="signflip", attack_fraction=0.3),
    "centered_clip_fedadam": dict(algo="fedadam", aggregator="centered-clip", cclip_tau=0.5, cclip_iters=2),
    "dp_adaptive": dict(weighting="uniform", dp_clip=0.2, dp_noise_multiplier=0.5, dp_delta=1e-2,
                        dp_target_quantile=0.5),
    "dp_client_gaussian_attack": dict(weighting="uniform", dp_clip=0.3, dp_noise_multiplier=1.0, dp_delta=1e-2,
                                      dp_mode="client", attack="gaussian", attack_fraction=0.2),
}


def sim_config(case):
    from fedopt_kernels.fl import SimulationConfig

    return SimulationConfig(**{**SIM_BASE, **SIM_CASES[case]})


def _scenario_simulation(rank, world):
    from fedopt_kernels.fl.run.distributed_simulation import DistributedSimulation

    got = {}
    for case in SIM_CASES:
        sim = DistributedSimulation(sim_config(case))
        res = sim.run()
        got[case] = dict(x=sim.x_global.clone(), records=res.records, meta=res.meta)
    return got


SCENARIOS = {"robust": _scenario_robust, "robust_errors": _scenario_robust_errors, "dp": _scenario_dp,
             "simulation": _scenario_simulation}


def _run_scenarios(rank, world, names):
    return {name: SCENARIOS[name](rank, world) for name in names}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return gloo.launch(tmp_path_factory.mktemp("dist_robust_dp"), WORLD, _run_scenarios, tuple(SCENARIOS),
                       timeout_s=400)


# ============================================================================ single-process references
def single_robust(rule):
    params = make_params()
    agg = make_rule(rule)
    opt = make_optimizer(OPTIMIZER[rule], params, agg)
    rounds = []
    for r in range(len(ROUNDS)):
        U, sizes, _ = round_data(r)
        st = opt.step(U, sizes if agg.weighted else None)
        rounds.append(_snapshot(st, params, opt) + (agg.record(), agg.state_dict()))
    return rounds


def single_dp(case):
    from fedopt_kernels.ops.dp_noise import clip_updates_

    params = make_params()
    mech = make_dp(case)
    opt = make_optimizer("FedAdam", params, mech)
    rounds = []
    for r in range(len(ROUNDS)):
        U, sizes, _ = round_data(r)
        U = U.clone()
        if mech.mode == "client":
            clip_updates_(U, mech.clip)
        st = opt.step(U, dp_weights(case, sizes))
        rounds.append(_snapshot(st, params, opt) + (mech.record(), mech.state_dict()))
    return rounds


# ============================================================================ checks
@pytest.mark.parametrize("rule", list(RULES))
def test_robust_rule_over_ranks_is_bitwise_the_single_process_rule(ranks, rule):
    ref = single_robust(rule)
    for r, res in enumerate(ranks):
        assert_tree_bitwise(res["robust"][rule], ref, f"rank {r} {rule}")
    # the rounds really differ from the mean and from each other (the comparison has teeth)
    assert not torch.equal(ref[0][1][0], ref[1][1][0])
    if rule in ("krum", "multi-krum", "bulyan"):
        assert all(len(rd[3]["robust_selected"]) < sum(ROUNDS[i][0]) for i, rd in enumerate(ref))


def test_robust_rule_differs_from_the_mean_here():
    """The robust rounds are not the mean's (so a distributed step that fell back to the
    weighted mean would fail the bitwise tests above)."""
    from fedopt_kernels.server import FedAvg

    for rule in ("median", "krum"):
        params_rule, params_mean = make_params(), make_params()
        U, _, _ = round_data(0)
        make_optimizer("FedAvg", params_rule, make_rule(rule)).step(U)
        FedAvg(params_mean, lr=0.5).step(U)
        assert not torch.equal(params_rule[0], params_mean[0])


def test_a_rule_that_fails_on_rank_0_stops_every_rank(ranks):
    r0, r1 = (res["robust_errors"] for res in ranks)
    assert r0["krum_small"][0] == "ValueError" and "Krum needs C >= 2 f + 3" in r0["krum_small"][1], r0
    assert r1["krum_small"][0] == "RankInputError" and "rank 0 could not run the rule" in r1["krum_small"][1]
    for r in (r0, r1):  # nothing changed, and the next round runs on both
        assert_tree_bitwise(r["params_after_error"], make_params(), "params after the refused round")
        assert r["fedexp"][0] == "ValueError" and "FedExP cannot aggregate with the robust rule" in r["fedexp"][1]
    assert_tree_bitwise(r0["after"], r1["after"], "the round after the error, rank 0 vs rank 1")
    for r in (r0, r1):  # ALIE's attackers need every client's update: refused, with the reason
        assert r["alie"][0] == "ConfigError" and "no rank holds" in r["alie"][1]


@pytest.mark.parametrize("case", list(DP_CASES))
def test_dp_ordered_is_bitwise_the_single_process_mechanism(ranks, case):
    ref = single_dp(case)
    for r, res in enumerate(ranks):
        assert_tree_bitwise(res["dp"][("ordered", case)], ref, f"rank {r} {case}")
    records = [rd[3] for rd in ref]
    if DP_CASES[case]["mech"]["noise_multiplier"] > 0:
        assert all(rec["dp_noise_std"] > 0 for rec in records)
    if "target_quantile" in DP_CASES[case]["mech"]:  # the clip moved: the trajectory is compared
        assert len({rec["dp_clip"] for rec in records}) == len(records)


@pytest.mark.parametrize("case", list(DP_CASES))
def test_dp_all_reduce_is_within_the_bound_with_the_same_clip_trajectory(ranks, case):
    """Every rank the same; over four FedAdam rounds the clip trajectory, norms,
    exclusions and weights bitwise the single-process ones (per-client values, which
    all_reduce adds to exact zeros); and one FedAvg(lr=1) round (``p1 = p0 - D``) within
    the documented bound of the regrouped sum, ``2 (C + W) u sum_i |w_i s_i D_i| / m``,
    plus the roundings of adding the noise and of the step (``u`` each on ``|D|`` and
    ``|p1|``, counted twice: both sides round)."""
    from fedopt_kernels.ops.dp_noise import clip_updates_

    ref = single_dp(case)
    got0, got1 = (res["dp"][("all_reduce", case)] for res in ranks)
    assert_tree_bitwise(got0, got1, "rank 0 vs rank 1")
    for (st, _, _, record, state), (rst, _, _, rrecord, rstate) in zip(got0, ref):
        assert record["dp_clip"] == rrecord["dp_clip"] and state["rounds"] == rstate["rounds"]
        assert_bitwise(state["clip"], rstate["clip"], "clip")
        for field in ("client_sq_norms", "excluded", "weights"):
            assert_bitwise(st[field], rst[field], field)
    # the single-process FedAvg(lr=1) round and its bound
    params = make_params()
    mech = make_dp(case)
    opt = make_optimizer("FedAvg", params, mech, lr=1.0)
    U, sizes, counts = round_data(0)
    U = U.clone()
    if mech.mode == "client":
        clip_updates_(U, mech.clip)
    st = opt.step(U, dp_weights(case, sizes))
    u, W, C = 2.0 ** -24, WORLD, U.shape[0]
    terms = (st.weights.double()[:, None] * U.double()).abs().sum(0)  # sum_i |w_i s_i D_i| / m
    flat = lambda ps: torch.cat([q.flatten() for q in ps]).double()  # noqa: E731
    p0, p1 = flat(make_params()), flat(params)
    tol = 2 * (C + W) * u * terms + 2 * u * ((p1 - p0).abs() + p1.abs())
    for r, res in enumerate(ranks):
        err = (flat(res["dp"][("all_reduce_fedavg", case)]) - p1).abs()
        assert bool((err <= tol).all()), f"rank {r}: {float((err / tol).max()):.2f} x the bound"


def test_the_dp_noise_is_in_the_parameters(ranks):
    """With noise, the parameters differ from the noiseless mechanism's by about the
    noise's size: the noise was added (once, not once per rank)."""
    from fedopt_kernels.server.differential_privacy.dp import DPAggregator

    mech = DP_CASES["fixed_noise"]["mech"]
    params = make_params()
    opt = make_optimizer("FedAvg", params, DPAggregator(**{**mech, "noise_multiplier": 0.0}))
    U, _, counts = round_data(0)
    opt.step(U)
    noiseless = params[0].clone()
    params = make_params()
    opt = make_optimizer("FedAvg", params, DPAggregator(seed=3, **mech))
    opt.step(U)
    std = mech["noise_multiplier"] * mech["clip"] / mech["expected_clients"] * 0.5  # FedAvg lr 0.5
    diff = (params[0] - noiseless).flatten()
    assert 0.8 * std < diff.std() < 1.2 * std, (diff.std(), std)


@pytest.mark.parametrize("case", list(SIM_CASES))
def test_distributed_simulation_with_robust_dp_and_attacks_equals_one_process(ranks, case):
    from fedopt_kernels.fl import Simulation

    sim = Simulation(sim_config(case))
    res = sim.run()
    for r, got in enumerate(ranks):
        got = got["simulation"][case]
        assert_bitwise(got["x"], sim.x_global, f"rank {r} global model")
        assert len(got["records"]) == len(res.records) == SIM_BASE["rounds"] + 1  # round 0: the initial model
        for mine, theirs in zip(got["records"], res.records):
            mine, theirs = dict(mine), dict(theirs)
            for rec in (mine, theirs):
                rec.pop("wall_time", None)
                if r != 0:
                    for k in ("test_accuracy", "test_loss"):
                        rec.pop(k, None)
            assert mine == theirs, f"rank {r}: {mine} vs {theirs}"
    trained = res.records[1:]
    keys = set(trained[-1])
    if "dp" in case:
        assert "dp_epsilon" in keys and trained[-1]["dp_epsilon"] > trained[0]["dp_epsilon"] > 0
    if "attack" in case:
        assert any(rec["attacked_clients"] for rec in trained)
    if case.startswith("krum"):
        assert "robust_selected" in keys
