"""Bad clients on the torch.distributed path (issue 16), 2 gloo processes on loopback.

* ``all_aggregate(on_bad_client="exclude")``: a negative / NaN / infinite weight on
  either rank (a rank whose every client is bad included) is left out on every rank;
  the result is ``ops.aggregate`` over the good clients alone (bitwise in ``"ordered"``
  mode, within tolerance in ``"all_reduce"``), the statistics name every client, and
  both ranks list the same ``left_out``;
* ``DistributedServerOptimizer``: the same for a step (default ``"exclude"``; a weight
  that is not even a number included), against ``ServerOptimizer.step`` over the good
  clients alone, over several rounds; ``max_weight_share`` against the single-process
  step with :func:`cap_weight_shares` weights; ``"raise"`` and "no usable client" raise
  on every rank and change nothing;
* ``DistributedSimulation`` with a client whose training raises (rank 1), one without
  samples (rank 0) and ``max_weight_share``: bitwise the single-process simulation
  with the same clients (which tests/test_bad_clients_simulation.py checks against the
  run without them); with ``on_bad_client="raise"`` every rank raises, nobody hangs.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import _gloo as gloo
from conftest import assert_same_tree

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available in this torch build")

WORLD = 2
NAN, INF = float("nan"), float("inf")

# all_aggregate cases: per-client weights (global order), counts per rank, NaN rows, options
AGG = {
    "bad_on_both_ranks": dict(w=[0.3, NAN, 0.5, -1.0, 0.2, INF], counts=(3, 3)),
    "rank0_all_bad_nan_row_bounded": dict(w=[NAN, -2.0, 0.4, 0.6, 0.1], counts=(2, 3), nan_rows=(3,),
                                          kw=dict(max_client_norm=1.5, gamma=0.5)),
    "fp64_zero_and_bad": dict(w=[0.0, 0.7, -INF, 0.9], counts=(1, 3), dtype=torch.float64),
}
N_AGG = 1031


def agg_case(name):
    c = AGG[name]
    dtype = c.get("dtype", torch.float32)
    g = torch.Generator().manual_seed(7)
    C = len(c["w"])
    X = (torch.randn(C, N_AGG, generator=g, dtype=torch.float64) * torch.logspace(-1, 1, C, dtype=torch.float64)[:,
                                                                                                          None])
    X = X.to(dtype)
    for i in c.get("nan_rows", ()):
        X[i, 17] = NAN
    w = torch.tensor(c["w"], dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    return X, w, c["counts"], dict(c.get("kw", {}))


def good_of(w):
    return [i for i, v in enumerate(w.tolist()) if math.isfinite(v) and v >= 0]


def bounds(counts, rank):
    start = sum(counts[:rank])
    return start, start + counts[rank]


# server rounds: updates and per-client weights (global order, a list: the string is
# a client that sent no number), counts per rank
SHAPES = [(17, 5), (5,), (3, 4)]
N_SRV = sum(math.prod(s) for s in SHAPES)
SERVER_ROUNDS = [
    dict(w=[10.0, NAN, "twelve", 30.0, -3.0, 20.0], counts=(3, 3)),
    dict(w=[None, 5.0, 8.0, INF, 1.0], counts=(1, 4)),  # rank 0: its only client is bad
    dict(w=[4.0, 6.0, 9.0, 2.0], counts=(2, 2)),  # nothing bad: the plain step
]
CAP_ROUNDS = [dict(w=[10.0, 20.0, 1e12, 30.0, 15.0], counts=(2, 3)),
              dict(w=[1e12, -1.0, 40.0, 20.0, 10.0], counts=(2, 3))]
CAP = 0.3


def server_params():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(*s, generator=g) for s in SHAPES]


def server_updates(r, C):
    g = torch.Generator().manual_seed(50 + r)
    U = torch.randn(C, N_SRV, generator=g) * torch.logspace(-1, 0.5, C)[:, None]
    return U


def _number_or_none(v):
    return v if isinstance(v, float) else None


def good_weights(ws):
    vals = [_number_or_none(v) for v in ws]
    return [i for i, v in enumerate(vals) if v is not None and math.isfinite(v) and v >= 0]


SIM = dict(dataset="digits", hidden=(32,), clients=10, per_round=5, rounds=3, local_steps=5, batch_size=32,
           lr=0.05, weight_decay=1e-3, engine="sequential")


def sim_partition():
    """digits split iid over 10 clients, the first client sampled in round 1 left without
    samples (it lands on rank 0)."""
    from fedopt_kernels.fl.datasets.partition import Partition, iid_partition
    from fedopt_kernels.fl.run.simulation import sample_clients

    idx = [ix.clone() for ix in iid_partition(1437, 10, seed=0).client_indices]
    empty = sample_clients(0, 1, SIM["clients"], SIM["per_round"])[0]
    other = (empty + 1) % 10
    idx[other] = torch.cat([idx[other], idx[empty]]).sort().values
    idx[empty] = idx[empty][:0]
    return Partition(idx, "custom"), empty


def failing_client():
    """The last client of round 2 (rank 1's block)."""
    from fedopt_kernels.fl.run.simulation import sample_clients

    return sample_clients(0, 2, SIM["clients"], SIM["per_round"])[-1]


def make_failing(sim, failing, round_number):
    real = sim.trainer.train

    def train(*a, client=None, round_index=None, **k):
        if (client, round_index) == (failing, round_number - 1):
            raise RuntimeError(f"client {client} failed")
        return real(*a, client=client, round_index=round_index, **k)

    sim.trainer.train = train


def sim_run(config_kw, *, distributed, empty_client=True):
    from fedopt_kernels.fl import Simulation, SimulationConfig
    from fedopt_kernels.fl.run.distributed_simulation import DistributedSimulation

    part = sim_partition()[0] if empty_client else None
    cls = DistributedSimulation if distributed else Simulation
    sim = cls(SimulationConfig(**{**SIM, **config_kw}), partition=part)
    make_failing(sim, failing_client(), 2)
    sim.run()
    return sim


SIM_CASES = {"fedadam_cap": dict(algo="fedadam", max_weight_share=0.25),
             "scaffold": dict(algo="scaffold"),
             "fedexp": dict(algo="fedexp")}


# ============================================================================ workers
def _scenario(rank, world):
    from fedopt_kernels import server as S
    from fedopt_kernels.distributed import DistributedServerOptimizer, all_aggregate

    got = {}
    for name in AGG:
        X, w, counts, kw = agg_case(name)
        a, b = bounds(counts, rank)
        for mode in ("ordered", "all_reduce"):
            out, st = all_aggregate(X[a:b].contiguous(), w[a:b], mode=mode, on_bad_client="exclude", **kw)
            got[("agg", name, mode)] = (out, list(st), st.left_out)
    try:  # every weight bad: refused on every rank
        all_aggregate(torch.ones(2, 5), torch.tensor([NAN, -1.0]), on_bad_client="exclude")
        got["agg_all_bad"] = None
    except ValueError as exc:
        got["agg_all_bad"] = str(exc)

    params = server_params()
    opt = DistributedServerOptimizer(S.FedExP(params, lr=1.0))
    rounds = []
    for r, spec in enumerate(SERVER_ROUNDS):
        U = server_updates(r, len(spec["w"]))
        a, b = bounds(spec["counts"], rank)
        st = opt.step(U[a:b].contiguous(), spec["w"][a:b])
        rounds.append((vars(st), [p.clone() for p in params], opt.last_left_out))
    got["server"] = (rounds, opt.state_dict())

    params = server_params()
    opt = DistributedServerOptimizer(S.FedAdam(params, lr=0.05), max_weight_share=CAP)
    rounds = []
    for r, spec in enumerate(CAP_ROUNDS):
        U = server_updates(10 + r, len(spec["w"]))
        a, b = bounds(spec["counts"], rank)
        st = opt.step(U[a:b].contiguous(), torch.tensor(spec["w"][a:b], dtype=torch.float64))
        rounds.append((vars(st), [p.clone() for p in params], opt.last_left_out))
    got["cap"] = (rounds, opt.state_dict())

    params = server_params()
    before = [p.clone() for p in params]
    errors = {}
    for policy, weights in (("raise", [[1.0, 2.0], [-1.0, 3.0]]), ("exclude", [[NAN, -1.0], [INF, None]])):
        opt = DistributedServerOptimizer(S.FedAvg(params, lr=1.0), on_bad_client=policy)
        try:
            opt.step(torch.ones(2, N_SRV), weights[rank])
            errors[policy] = None
        except ValueError as exc:
            errors[policy] = f"{type(exc).__name__}: {exc}"
    got["errors"] = (errors, all(torch.equal(p, q) for p, q in zip(params, before)))

    for name, kw in SIM_CASES.items():
        sim = sim_run(kw, distributed=True)
        got[("sim", name)] = dict(x=sim.x_global.clone(), records=sim.results.records, server=sim.server.state_dict(),
                                  scaffold=None if sim.scaffold is None else sim.scaffold.state_dict())
    try:
        sim_run(dict(algo="fedavg", on_bad_client="raise", rounds=2), distributed=True, empty_client=False)
        got["sim_raise"] = None
    except Exception as exc:  # noqa: BLE001 - the type is what is checked
        got["sim_raise"] = type(exc).__name__
    out, _ = all_aggregate(torch.ones(1, 4) * (rank + 1), torch.ones(1))  # the group still works
    got["after"] = out
    return got


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return gloo.launch(tmp_path_factory.mktemp("bad2"), WORLD, _scenario, timeout_s=300)


# ============================================================================ checks
def assert_same(a, b, what):
    """Equal, NaN in the same places counting as equal (the cases feed NaN and Inf)."""
    assert_same_tree(a, b, what, nan_equal=True)


def check_expanded(per_client, ref_per_client, good, C, what):
    """``[C]`` statistics of all clients vs the good-only reference: the good entries
    bitwise, the others excluded (True), weight 0, norm NaN."""
    q, excluded, weights = per_client
    rq, rex, rw = ref_per_client
    assert_same(q[good], rq, f"{what} client_sq_norms")
    assert_same(excluded[good], rex, f"{what} excluded")
    assert_same(weights[good], rw, f"{what} weights")
    bad = [i for i in range(C) if i not in good]
    assert bool(torch.isnan(q[bad]).all()) and bool(excluded[bad].all()) and bool((weights[bad] == 0).all()), what


@pytest.mark.parametrize("name", list(AGG))
def test_all_aggregate_leaves_bad_weights_out_on_every_rank(ranks, name):
    from fedopt_kernels.ops import aggregate

    X, w, counts, kw = agg_case(name)
    good = good_of(w)
    ref_out, ref = aggregate(X[good], w[good], **kw)
    bad_idx = [i for i in range(len(w)) if i not in good]
    for r in range(WORLD):
        for mode in ("ordered", "all_reduce"):
            out, st, left_out = ranks[r][("agg", name, mode)]
            q, sq, excluded, weights, all_excluded = st
            if mode == "ordered":
                assert_same(out, ref_out, f"rank {r} {mode} out")
                assert_same(sq, ref.sq_norm, f"rank {r} sq_norm")
            else:
                torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
            check_expanded((q, excluded, weights), (ref.client_sq_norms, ref.excluded, ref.weights), good, len(w),
                           f"rank {r} {mode}")
            assert bool(all_excluded) == bool(ref.all_excluded)
            assert [i for i, _, _ in left_out] == bad_idx and all(reason == "bad_weight" for _, reason, _ in left_out)
    assert ranks[0][("agg", name, "ordered")][2] == ranks[1][("agg", name, "ordered")][2]
    for i, _, detail in ranks[0][("agg", name, "ordered")][2]:  # the detail names where the client is
        rank = 0 if i < counts[0] else 1
        assert detail.endswith(f"(rank {rank}, local client {i - sum(counts[:rank])})") and "weight" in detail


def test_all_aggregate_with_no_usable_weight_fails_on_every_rank(ranks):
    for r in range(WORLD):
        assert "no client of any rank has a usable weight (4 left out" in ranks[r]["agg_all_bad"]
        assert torch.equal(ranks[r]["after"], torch.full((4,), 3.0))


def test_server_step_over_bad_weights_is_the_step_over_the_good_clients_alone(ranks):
    from fedopt_kernels import server as S

    params = server_params()
    opt = S.FedExP(params, lr=1.0)
    for r, spec in enumerate(SERVER_ROUNDS):
        U = server_updates(r, len(spec["w"]))
        good = good_weights(spec["w"])
        ref = opt.step(U[good].contiguous(), [spec["w"][i] for i in good])
        for rank in range(WORLD):
            rounds, _ = ranks[rank]["server"]
            st, ps, left_out = rounds[r]
            assert_same(ps, params, f"rank {rank} round {r} params")
            for field in ("update_sq_norm", "skipped", "num_clients", "mean_client_sq_norm", "lr_scale"):
                assert_same(st[field], getattr(ref, field), f"rank {rank} round {r} {field}")
            check_expanded((st["client_sq_norms"], st["excluded"], st["weights"]),
                           (ref.client_sq_norms, ref.excluded, ref.weights), good, len(spec["w"]), f"round {r}")
            assert [i for i, _, _ in left_out] == [i for i in range(len(spec["w"])) if i not in good]
        assert ranks[0]["server"][0][r][2] == ranks[1]["server"][0][r][2]
    for rank in range(WORLD):
        assert_same(ranks[rank]["server"][1], opt.state_dict(), f"rank {rank} state")
    details = " ".join(d for _, _, d in ranks[0]["server"][0][0][2])
    assert "weight nan" in details and "weight 'twelve'" in details and "weight -3.0" in details


def test_max_weight_share_across_ranks_is_the_single_process_cap(ranks):
    from fedopt_kernels import server as S
    from fedopt_kernels.server.weighting import cap_weight_shares

    params = server_params()
    opt = S.FedAdam(params, lr=0.05)
    for r, spec in enumerate(CAP_ROUNDS):
        U = server_updates(10 + r, len(spec["w"]))
        good = good_weights(spec["w"])
        shares = cap_weight_shares(torch.tensor([spec["w"][i] for i in good], dtype=torch.float64), CAP)
        assert shares.max() <= CAP + 1e-15
        ref = opt.step(U[good].contiguous(), shares)
        for rank in range(WORLD):
            st, ps, _ = ranks[rank]["cap"][0][r]
            assert_same(ps, params, f"rank {rank} round {r} params")
            assert_same(st["weights"][good], ref.weights, f"rank {rank} round {r} weights")
            assert float(st["weights"].max()) <= CAP + 1e-6
    for rank in range(WORLD):
        assert_same(ranks[rank]["cap"][1], opt.state_dict(), f"rank {rank} state")


def test_raise_and_no_usable_client_fail_on_every_rank_and_change_nothing(ranks):
    for rank in range(WORLD):
        errors, unchanged = ranks[rank]["errors"]
        assert unchanged
        assert errors["raise"].startswith("ValueError: weights must be >= 0, got -1.0 at index 2")
        assert "no client of any rank has a usable weight (4 left out" in errors["exclude"]


@pytest.mark.parametrize("name", list(SIM_CASES))
def test_distributed_simulation_with_bad_clients_is_the_single_process_simulation(ranks, name):
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sim = sim_run(SIM_CASES[name], distributed=False)
    finally:
        torch.set_num_threads(old)
    _, empty = sim_partition()
    recs = sim.results.records
    assert recs[1]["left_out"] == [[empty, "no_data"]] and [failing_client(), "error"] in recs[2]["left_out"]
    for rank in range(WORLD):
        got = ranks[rank][("sim", name)]
        assert_same(got["x"], sim.x_global, f"rank {rank} model")
        assert_same(got["server"], sim.server.state_dict(), f"rank {rank} server")
        if sim.scaffold is not None:
            assert_same(got["scaffold"], sim.scaffold.state_dict(), f"rank {rank} scaffold")
        strip = (lambda r: {k: v for k, v in r.items() if k != "wall_time"}) if rank == 0 else (
            lambda r: {k: v for k, v in r.items() if k != "wall_time" and not k.startswith("test_")})
        assert [strip(r) for r in got["records"]] == [strip(r) for r in recs], f"rank {rank} records"


def test_distributed_simulation_raise_stops_every_rank(ranks):
    assert ranks[0]["sim_raise"] == "RankInputError"  # rank 1's client failed
    assert ranks[1]["sim_raise"] == "RuntimeError"
