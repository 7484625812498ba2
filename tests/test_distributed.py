"""torch.distributed aggregation: 2 gloo processes on this machine vs the single-process path.

One launch of 2 processes (``torch.multiprocessing``, a file store in a temp dir, gloo
over loopback) runs every distributed scenario and saves what each rank got; the tests
then compare it with the library's public single-process path computed here:

* ``all_aggregate`` vs ``ops.aggregate`` on the union -- bitwise in ``mode="ordered"``
  (NaN/Inf clients on either rank, uneven and empty ranks, norm bounding, gamma,
  fp32/fp64/bf16/fp16, the cpu and reference backends); ``mode="all_reduce"``: the
  statistics bitwise, the sum within the documented bound;
* the device-decided path (what CUDA runs: exclusion and skip decided on the device,
  the second pass always run under a device flag), forced on the CPU here -- bitwise
  the host-decided results for ``all_aggregate`` and ``DistributedServerOptimizer``
  (a NaN client excluded, every client NaN: the round skipped), against the fp64
  oracle, and with a record of the passes that shows which path ran;
* ``DistributedServerOptimizer`` vs ``ServerOptimizer.step`` -- parameters, state and
  statistics bitwise over several rounds (a NaN client, an empty rank, a skipped round);
* ``DistributedSimulation`` vs ``Simulation`` -- global model, server state and the
  round records bitwise; and ``torchrun ... simulate --distributed`` vs ``fedopt
  simulate`` end to end.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import _fp64_oracle as fp64
import _gloo as gloo
from _asserts import acc_of, assert_bitwise, assert_tree_bitwise
from _server_cases import CASES

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available in this torch build")

WORLD = 2
LAUNCH_TIMEOUT_S = 300
ROOT = Path(__file__).resolve().parents[1]
F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16


# ============================================================================ cases
# Built identically here and in every worker (pure functions of their seeds).

AGG_CASES = {
    "nan_on_rank1_uneven": dict(seed=1, C=7, N=10_007, counts=(3, 4), nan=(5,), kw=dict(gamma=0.7)),
    "nan_on_rank0": dict(seed=11, C=6, N=4_096, counts=(4, 2), nan=(1,)),
    "rank0_empty_bounded_gamma_tensor": dict(seed=2, C=5, N=4_099, counts=(0, 5),
                                            kw=dict(gamma="tensor", max_client_norm=3.0)),
    "rank1_empty_propagate_inf": dict(seed=3, C=4, N=513, counts=(4, 0), inf=(1,), kw=dict(nonfinite="propagate")),
    "all_excluded": dict(seed=4, C=3, N=300, counts=(1, 2), nan=(0, 1, 2)),
    "zero_weights": dict(seed=9, C=5, N=640, counts=(2, 3), zero=(0, 1, 3)),
    "bf16": dict(seed=5, C=6, N=2_051, counts=(2, 4), dtype=BF16, nan=(3,)),
    "fp16_out_fp32": dict(seed=6, C=5, N=1_000, counts=(3, 2), dtype=F16, kw=dict(out="acc", gamma=1.5)),
    "fp64_bounded": dict(seed=7, C=5, N=1_001, counts=(2, 3), dtype=F64, kw=dict(max_client_norm=10.0)),
    "reference_backend": dict(seed=8, C=5, N=777, counts=(2, 3), nan=(0,), kw=dict(backend="reference")),
}
ALL_REDUCE_CASES = ("nan_on_rank1_uneven", "rank0_empty_bounded_gamma_tensor", "bf16", "fp64_bounded",
                    "zero_weights", "all_excluded")
# 3 ranks: the middle rank both receives and sends the running sum (here also empty, or alone with a NaN client)
COUNTS3 = {"nan_on_rank1_uneven": (2, 0, 5), "nan_on_rank0": (1, 1, 4), "bf16": (1, 3, 2),
           "fp64_bounded": (2, 2, 1), "rank0_empty_bounded_gamma_tensor": (0, 2, 3), "all_excluded": (1, 1, 1)}


def agg_data(case, world=2):
    c = AGG_CASES[case]
    dtype = c.get("dtype", F32)
    g = torch.Generator().manual_seed(c["seed"])
    C, N = c["C"], c["N"]
    scale = torch.logspace(-2, 2, C, dtype=F64)  # magnitudes that make rounding order matter
    X = (torch.randn(C, N, generator=g, dtype=F64) * scale[:, None]).to(dtype)
    for i in c.get("nan", ()):
        X[i, N // 3] = float("nan")
    for i in c.get("inf", ()):
        X[i, 5] = float("inf")
    w = (torch.rand(C, generator=g, dtype=F64) + 0.1).to(acc_of(dtype))
    for i in c.get("zero", ()):
        w[i] = 0.0
    kw = dict(c.get("kw", {}))
    if kw.get("gamma") == "tensor":
        kw["gamma"] = torch.tensor(0.625, dtype=acc_of(dtype))
    if kw.get("out") == "acc":
        kw["out"] = torch.empty(N, dtype=acc_of(dtype))
    return X, w, c["counts"] if world == 2 else COUNTS3[case], kw


def bounds(counts, rank):
    start = sum(counts[:rank])
    return start, start + counts[rank]


# case: the server optimizer of tests/_server_cases.py; opts: the round's options
SERVER_CASES = {
    "asnes_sizes": dict(case="ASNES", opts=dict(), weights="sizes"),
    "fedadam_uniform_bounded": dict(case="FedAdam", opts=dict(max_client_norm=1.0), weights=None),
    "fedexp_list": dict(case="FedExP", opts=dict(), weights="list"),
    "fedavgm_propagate": dict(case="FedAvgM", opts=dict(nonfinite="propagate"), weights="sizes", finite=True),
}
# per round: (counts per rank, NaN clients); round 3 leaves rank 0 empty, round 4 is all NaN (skipped)
SERVER_ROUNDS = [((2, 3), ()), ((4, 1), (4,)), ((0, 2), ()), ((1, 1), (0, 1)), ((3, 2), ())]
SHAPES = [(33, 7), (7,), (5, 3, 2)]


def server_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in SHAPES]


def server_round(case, r):
    counts, nan = SERVER_ROUNDS[r]
    if SERVER_CASES[case].get("finite"):
        nan = ()
    N = sum(math.prod(s) for s in SHAPES)
    g = torch.Generator().manual_seed(100 + r)
    C = sum(counts)
    U = torch.randn(C, N, generator=g) * torch.logspace(-1, 1, C)[:, None]
    for i in nan:
        U[i, 3] = float("nan")
    sizes = torch.randint(1, 50, (C,), generator=g).to(F64)
    kind = SERVER_CASES[case]["weights"]
    weights = None if kind is None else (sizes if kind == "sizes" else sizes.tolist())
    return U, weights, counts


def make_server_opt(case, params):
    c = SERVER_CASES[case]
    return CASES[c["case"]].make(params, **c["opts"])


SIM_BASE = dict(dataset="digits", hidden=(32,), clients=10, per_round=5, rounds=3, local_steps=5, batch_size=32,
                lr=0.05, weight_decay=1e-3, engine="sequential")
SIM_CASES = {
    "asnes": dict(algo="asnes"),
    "scaffold": dict(algo="scaffold"),
    "fedlaw": dict(algo="fedlaw", fedlaw_epochs=2),
    "fedavg_one_client_per_round": dict(algo="fedavg", per_round=1),  # rank 1 trains nobody
    "fedadam_batchnorm": dict(algo="fedadam", model="bn"),
    "fedexp_default_engine": dict(algo="fedexp", engine=None, weighting="uniform"),  # whatever the default is
}


def bn_model():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 24), nn.BatchNorm1d(24), nn.ReLU(), nn.Linear(24, 10))


def sim_args(case):
    from fedopt_kernels.fl import SimulationConfig

    kw = {**SIM_BASE, **SIM_CASES[case]}
    if kw["engine"] is None:
        del kw["engine"]
    model = None
    if kw.get("model") == "bn":
        kw.pop("model")
        model = bn_model
    return SimulationConfig(**kw), model


# ============================================================================ workers
def _scenario_aggregate(rank, world, passes=None):
    """``got[(mode, case)] = (out, stats)``; with ``passes`` (see _with_second_passes)
    also ``got[("passes", mode, case)]``, how that call's second pass ran."""
    from fedopt_kernels.distributed import all_aggregate

    got = {}
    for mode in ("ordered", "all_reduce"):
        for case in AGG_CASES if world == 2 else COUNTS3:
            if mode == "all_reduce" and case not in ALL_REDUCE_CASES:
                continue
            X, w, counts, kw = agg_data(case, world)
            a, b = bounds(counts, rank)
            local = X[a:b].contiguous()
            if mode == "ordered" and case == "nan_on_rank0":
                local = list(local.unbind(0))  # a list of vectors works as a [C_r, N] tensor does
            if passes is not None:
                passes.clear()
            out, st = all_aggregate(local, w[a:b], mode=mode, **kw)
            got[(mode, case)] = (out.clone(), st)
            if passes is not None:
                got[("passes", mode, case)] = list(passes)
    return got


def _with_second_passes(scenario, device_decisions):
    """Run ``scenario`` recording, per call, how the robust second pass ran: ``"host"``
    (decided on the host: skip None) or ``"device"`` (run with a device flag), one
    entry per pass.  ``device_decisions`` forces the path CUDA takes (exclusion and skip
    decided on the device, the second pass always run, skipped by a device flag) on
    the CPU, so that the GPU's path is tested here; the record shows it was taken."""
    from fedopt_kernels.distributed import aggregate as dist_agg

    def run(rank, world):
        passes, originals = [], {}

        def spy(cls):
            original = originals[cls] = cls.second_pass

            def second_pass(self, eff_local, skip):
                passes.append("host" if skip is None else "device")
                return original(self, eff_local, skip)
            cls.second_pass = second_pass

        spy(dist_agg._Ordered)
        spy(dist_agg._AllReduce)
        dist_agg._DEVICE_DECISIONS_ON_CPU = device_decisions
        try:
            got = scenario(rank, world, passes)
        finally:
            dist_agg._DEVICE_DECISIONS_ON_CPU = False
            for cls, original in originals.items():
                cls.second_pass = original
        return got
    return run


def _scenario_errors(rank, world):
    """A rank with bad input raises its error, the other a RankInputError; nobody hangs,
    and the group still works afterwards."""
    from fedopt_kernels.distributed import all_aggregate

    got = {}
    X, w, _, _ = agg_data("nan_on_rank0")
    bad = X[:2, :100].contiguous() if rank == 1 else X[:2].contiguous()  # rank 1: wrong N
    try:
        all_aggregate(bad, w[:2])
        got["wrong_N"] = None
    except Exception as exc:  # noqa: BLE001
        got["wrong_N"] = type(exc).__name__
    local = X[:1] if rank == 0 else X[:2, :]  # different counts are fine...
    weights = w[:1] if rank == 0 else torch.tensor([1.0, -1.0])  # ...a negative weight is not
    try:
        all_aggregate(local.contiguous(), weights)
        got["negative_weight"] = None
    except Exception as exc:  # noqa: BLE001
        got["negative_weight"] = type(exc).__name__
    try:
        all_aggregate(X[:1].contiguous(), torch.zeros(1))
        got["all_zero"] = None
    except Exception as exc:  # noqa: BLE001
        got["all_zero"] = type(exc).__name__
    out, _ = all_aggregate(X[rank:rank + 1].contiguous(), w[rank:rank + 1])
    got["after"] = out
    return got


def _scenario_server(rank, world, passes=None):
    """``got[case] = (rounds, state_dict)``; with ``passes``, ``got[("passes", case)]``
    holds how each round's second pass ran."""
    from fedopt_kernels.distributed import DistributedServerOptimizer

    got = {}
    for case in SERVER_CASES:
        params = server_params()
        opt = DistributedServerOptimizer(make_server_opt(case, params))
        rounds, round_passes = [], []
        for r in range(len(SERVER_ROUNDS)):
            U, weights, counts = server_round(case, r)
            a, b = bounds(counts, rank)
            local_w = None if weights is None else weights[a:b]
            if passes is not None:
                passes.clear()
            st = opt.step(U[a:b].contiguous(), local_w)
            rounds.append(({k: v for k, v in vars(st).items()}, [p.clone() for p in params]))
            round_passes.append(None if passes is None else list(passes))
        got[case] = (rounds, opt.state_dict())
        if passes is not None:
            got[("passes", case)] = round_passes
    return got


def _named(U, params):
    """The rows of ``U`` as named updates ``{parameter: view}`` (contiguous views: read in place)."""
    out = []
    for row in U:
        entries, offset = {}, 0
        for p in params:
            entries[p] = row[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
        out.append(entries)
    return out


def _scenario_server_named(rank, world):
    """``got[(mode, case, form)] = rounds``: the same rounds with this rank's updates as a
    ``[C_r, N]`` tensor and as named updates (ops.ClientPieces, read in place), ordered
    and all_reduce."""
    from fedopt_kernels.distributed import DistributedServerOptimizer
    from fedopt_kernels.ops import ClientPieces

    rows_made = []  # every client row a ClientPieces materialised (none: read in place)
    real_row = ClientPieces.row
    ClientPieces.row = lambda self, i, **kw: rows_made.append(i) or real_row(self, i, **kw)
    got = {}
    for mode in ("ordered", "all_reduce"):
        for case in ("fedadam_uniform_bounded", "asnes_sizes"):
            for form in ("tensor", "named"):
                params = server_params()
                opt = DistributedServerOptimizer(make_server_opt(case, params), mode=mode)
                rounds = []
                for r in range(len(SERVER_ROUNDS)):
                    U, weights, counts = server_round(case, r)
                    a, b = bounds(counts, rank)
                    local = U[a:b].contiguous()
                    st = opt.step(local if form == "tensor" or a == b else _named(local, params),
                                  None if weights is None else weights[a:b])
                    rounds.append(({k: v for k, v in vars(st).items()}, [p.clone() for p in params]))
                got[(mode, case, form)] = rounds
    from fedopt_kernels.distributed import all_aggregate

    U, weights, counts = server_round("asnes_sizes", 1)  # a NaN client: the second pass
    a, b = bounds(counts, rank)
    local = U[a:b].contiguous()
    pieces = ClientPieces([[row[:7], row[7:]] for row in local])
    for mode in ("ordered", "all_reduce"):
        got[("all_aggregate", mode)] = [all_aggregate(x, weights[a:b], mode=mode) for x in (local, pieces)]
    ClientPieces.row = real_row
    got["rows_made"] = len(rows_made)
    return got


def _scenario_simulation(rank, world):
    from fedopt_kernels.fl.run.distributed_simulation import DistributedSimulation

    got = {}
    for case in SIM_CASES:
        config, model = sim_args(case)
        sim = DistributedSimulation(config, model=model)
        res = sim.run()
        got[case] = dict(x=sim.x_global.clone(), records=res.records, server=sim.server.state_dict(),
                         buffers=[b.clone() for b in sim.global_model.buffers()], meta=res.meta)
    return got


SCENARIOS = {"aggregate": _with_second_passes(_scenario_aggregate, False),
             "aggregate_device_decisions": _with_second_passes(_scenario_aggregate, True),
             "errors": _scenario_errors, "server": _with_second_passes(_scenario_server, False),
             "server_device_decisions": _with_second_passes(_scenario_server, True),
             "server_named": _scenario_server_named,
             "simulation": _scenario_simulation}


def _run_scenarios(rank, world, scenarios):
    results = {}
    for name in scenarios:
        t0 = time.perf_counter()
        results[name] = SCENARIOS[name](rank, world)
        results[f"{name}_seconds"] = time.perf_counter() - t0
    return results


def launch(tmp: Path, world: int, scenarios) -> list:
    """Run ``scenarios`` on ``world`` gloo processes; each rank's results, in rank order."""
    return gloo.launch(tmp, world, _run_scenarios, tuple(scenarios), timeout_s=LAUNCH_TIMEOUT_S)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every scenario on 2 gloo processes (one launch); ``[rank0_results, rank1_results]``."""
    return launch(tmp_path_factory.mktemp("dist2"), WORLD, list(SCENARIOS))


@pytest.fixture(scope="module")
def ranks3(tmp_path_factory):
    """The aggregation on 3 gloo processes (a middle rank relays the running sum)."""
    return launch(tmp_path_factory.mktemp("dist3"), 3, ["aggregate"])


# ============================================================================ checks
def single_aggregate(case):
    """The reference: the public single-process ``ops.aggregate`` on the union."""
    from fedopt_kernels.ops import aggregate

    X, w, _, kw = agg_data(case)
    out, st = aggregate(X, w, **kw)
    return out, st


def check_ordered(results, case, scenario="aggregate"):
    ref_out, ref = single_aggregate(case)
    for r, res in enumerate(results):
        out, st = res[scenario][("ordered", case)]
        assert_bitwise(out, ref_out, f"rank {r} out")
        for field in ref._fields:
            assert_bitwise(getattr(st, field), getattr(ref, field), f"rank {r} stats.{field}")


@pytest.mark.parametrize("case", list(AGG_CASES))
def test_all_aggregate_ordered_is_bitwise_the_single_process_aggregate(ranks, case):
    check_ordered(ranks, case)


@pytest.mark.parametrize("case", list(COUNTS3))
def test_all_aggregate_ordered_on_three_ranks(ranks3, case):
    check_ordered(ranks3, case)


def robust(case):
    kw = AGG_CASES[case].get("kw", {})
    return kw.get("nonfinite", "exclude") == "exclude" or kw.get("max_client_norm") is not None


@pytest.mark.parametrize("case", list(AGG_CASES))
def test_device_side_decisions_equal_the_host_path_bitwise(ranks, case):
    """The path CUDA takes (exclusion and skip decided on the device, the second pass
    always run, skipped by a device flag), taken here on the CPU: ordered is bitwise
    the single-process aggregate, and both modes are bitwise the host-decided results.
    The recorded passes show which path each run took: the host runs a second pass only
    when a weight changed; the device path runs one in every robust call."""
    check_ordered(ranks, case, "aggregate_device_decisions")
    ref_out, ref = single_aggregate(case)
    changed = bool((ref.weights != agg_data(case)[1]).any())
    for res in ranks:
        for mode in ("ordered", "all_reduce"):
            if (mode, case) not in res["aggregate"]:
                continue
            (out_h, st_h), (out_d, st_d) = res["aggregate"][(mode, case)], res["aggregate_device_decisions"][(mode, case)]
            assert_bitwise(out_d, out_h, f"{mode} out")
            for field in st_h._fields:
                assert_bitwise(getattr(st_d, field), getattr(st_h, field), f"{mode} stats.{field}")
            assert res["aggregate"][("passes", mode, case)] == (["host"] if robust(case) and changed else [])
            assert res["aggregate_device_decisions"][("passes", mode, case)] == (["device"] if robust(case) else [])


@pytest.mark.parametrize("case", ["nan_on_rank1_uneven", "nan_on_rank0", "all_excluded", "fp64_bounded",
                                  "zero_weights", "rank0_empty_bounded_gamma_tensor"])
def test_device_side_decisions_against_the_fp64_oracle(ranks, case):
    """What the device-decided path returns, against the fp64 oracle: NaN clients left
    out with their weight spread over the rest, norm bounding, gamma; with every client
    non-finite, nothing is summed (out exactly 0) and ``all_excluded`` says so."""
    X, w, _, kw = agg_data(case)
    q = torch.tensor([fp64.sq_norm([x]) for x in X], dtype=F64)
    eff, bad = fp64.robust_weights(w, q, max_client_norm=kw.get("max_client_norm"))
    clean = torch.where(bad[:, None], torch.zeros((), dtype=X.dtype), X)
    want, _, want_Q = fp64.aggregate(clean, eff, float(kw.get("gamma", 1.0)))
    rtol = 1e-12 if X.dtype == F64 else 2e-5
    for res in ranks:
        for mode in ("ordered", "all_reduce"):
            if (mode, case) not in res["aggregate_device_decisions"]:
                continue
            out, st = res["aggregate_device_decisions"][(mode, case)]
            assert st.excluded.tolist() == bad.tolist()
            assert bool(st.all_excluded) == bool(bad.all())
            torch.testing.assert_close(st.weights.double(), eff, rtol=rtol, atol=0)
            finite = ~bad
            torch.testing.assert_close(st.client_sq_norms.double()[finite], q[finite], rtol=rtol, atol=0)
            if bad.all():
                assert not out.any() and st.sq_norm.item() == 0.0
                continue
            torch.testing.assert_close(out.double(), want, rtol=rtol, atol=rtol * float(want.abs().max() + 1))
            assert math.isclose(st.sq_norm.item(), want_Q, rel_tol=1e-4)


@pytest.mark.parametrize("case", list(SERVER_CASES))
def test_server_with_device_side_decisions_is_bitwise_the_host_path(ranks, case):
    """``DistributedServerOptimizer`` over the rounds of SERVER_ROUNDS (a NaN client
    excluded in round 1, every client NaN in round 3: the round skipped) with the
    decisions on the device: parameters, state and statistics bitwise those of the
    host-decided run (itself bitwise the single-process step, tested above)."""
    for rank in range(WORLD):
        rounds_h, state_h = ranks[rank]["server"][case]
        rounds_d, state_d = ranks[rank]["server_device_decisions"][case]
        for r, ((st_h, ps_h), (st_d, ps_d)) in enumerate(zip(rounds_h, rounds_d)):
            assert_tree_bitwise(st_d, st_h, f"rank {rank} round {r} stats")
            assert_tree_bitwise(ps_d, ps_h, f"rank {rank} round {r} params")
        assert_tree_bitwise(state_d, state_h, f"rank {rank} state_dict")
        finite = SERVER_CASES[case].get("finite")
        opts = SERVER_CASES[case]["opts"]
        robust_case = opts.get("nonfinite", "exclude") == "exclude" or opts.get("max_client_norm") is not None
        skipped = [bool(st["skipped"]) for st, _ in rounds_h]
        excluded = [bool(st["excluded"].any()) for st, _ in rounds_h]
        assert skipped == [False, False, False, not finite, False]
        assert excluded == [False, not finite, False, not finite, False]
        # the device path ran (a second pass with a device flag every round it could
        # matter); the host ran one only where a weight changed
        assert ranks[rank]["server_device_decisions"][("passes", case)] == [["device"] if robust_case else []] * 5
        host = ranks[rank]["server"][("passes", case)]
        assert all(p == ["host"] for p, e in zip(host, excluded) if e)


def test_the_cases_exercise_what_they_claim():
    _, st = single_aggregate("nan_on_rank1_uneven")
    assert st.excluded.tolist() == [False] * 5 + [True, False]  # the excluded client lives on rank 1
    _, st = single_aggregate("all_excluded")
    assert bool(st.all_excluded)
    _, st = single_aggregate("rank0_empty_bounded_gamma_tensor")
    assert bool((st.weights < agg_data("rank0_empty_bounded_gamma_tensor")[1]).any())  # some client bounded


@pytest.mark.parametrize("case", ALL_REDUCE_CASES)
def test_all_aggregate_all_reduce_is_within_the_documented_bound(ranks, case):
    ref_out, ref = single_aggregate(case)
    X, w, counts, kw = agg_data(case)
    gamma = float(kw.get("gamma", 1.0))
    acc = acc_of(X.dtype)
    u = torch.finfo(acc).eps / 2
    C, W = X.shape[0], len(counts)
    Xa = torch.where(ref.weights[:, None] != 0, X.to(acc), torch.zeros((), dtype=acc))
    mag = (ref.weights[:, None].abs() * Xa.abs()).sum(0).double()
    bound = gamma * 2 * (C + W) * u * mag
    if X.dtype != acc:  # one more rounding to the data dtype
        bound = bound + ref_out.double().abs() * torch.finfo(X.dtype).eps
    outs = [ranks[r]["aggregate"][("all_reduce", case)][0] for r in range(WORLD)]
    assert_bitwise(outs[0], outs[1], "all_reduce: ranks agree")
    for r in range(WORLD):
        out, st = ranks[r]["aggregate"][("all_reduce", case)]
        err = (out.double() - ref_out.double()).abs()
        assert bool((err <= bound).all()), f"rank {r}: max error {err.max():.3g}, bound there {bound[err.argmax()]:.3g}"
        for field in ("client_sq_norms", "excluded", "weights", "all_excluded"):
            assert_bitwise(getattr(st, field), getattr(ref, field), f"rank {r} stats.{field}")
        assert math.isclose(st.sq_norm.item(), ref.sq_norm.item(), rel_tol=1e-4)


def test_inconsistent_inputs_raise_on_every_rank(ranks):
    from fedopt_kernels.ops import aggregate

    e0, e1 = ranks[0]["errors"], ranks[1]["errors"]
    assert (e0["wrong_N"], e1["wrong_N"]) == ("ValueError", "ValueError")  # the ranks disagree on N
    assert (e0["negative_weight"], e1["negative_weight"]) == ("RankInputError", "ValueError")
    assert (e0["all_zero"], e1["all_zero"]) == ("ValueError", "ValueError")
    X, w, _, _ = agg_data("nan_on_rank0")
    ref, _ = aggregate(X[:2], w[:2])
    for r in range(WORLD):
        assert_bitwise(ranks[r]["errors"]["after"], ref, f"rank {r}: the group works after the errors")


@pytest.mark.parametrize("case", list(SERVER_CASES))
def test_distributed_server_step_is_bitwise_the_single_process_step(ranks, case):
    params = server_params()
    opt = make_server_opt(case, params)
    ref_rounds = []
    for r in range(len(SERVER_ROUNDS)):
        U, weights, _ = server_round(case, r)
        st = opt.step(U, weights)
        ref_rounds.append(({k: v for k, v in vars(st).items()}, [p.clone() for p in params]))
    assert any(bool(s["skipped"]) for s, _ in ref_rounds) != bool(SERVER_CASES[case].get("finite"))
    for rank in range(WORLD):
        rounds, state = ranks[rank]["server"][case]
        for r, ((st, ps), (ref_st, ref_ps)) in enumerate(zip(rounds, ref_rounds)):
            assert_tree_bitwise(st, ref_st, f"rank {rank} round {r} stats")
            assert_tree_bitwise(ps, ref_ps, f"rank {rank} round {r} params")
        assert_tree_bitwise(state, opt.state_dict(), f"rank {rank} state_dict")


@pytest.mark.parametrize("mode", ["ordered", "all_reduce"])
def test_named_updates_are_read_in_place_with_the_tensors_bits(ranks, mode):
    """Named updates (per-parameter tensors, read in place as ops.ClientPieces: the
    running sum of the ordered mode joins them as a first client cut into the same
    pieces) give every rank the bits of the same step on [C_r, N] tensors -- NaN clients,
    an empty rank and a skipped round included."""
    for rank in range(WORLD):
        assert ranks[rank]["server_named"]["rows_made"] == 0  # read in place, never copied into rows
        for case in ("fedadam_uniform_bounded", "asnes_sizes"):
            named, tensor = (ranks[rank]["server_named"][(mode, case, form)] for form in ("named", "tensor"))
            for r, ((st, ps), (ref_st, ref_ps)) in enumerate(zip(named, tensor)):
                assert_tree_bitwise(st, ref_st, f"rank {rank} {case} round {r} stats")
                assert_tree_bitwise(ps, ref_ps, f"rank {rank} {case} round {r} params")
        (out_t, st_t), (out_p, st_p) = ranks[rank]["server_named"][("all_aggregate", mode)]
        assert_tree_bitwise([out_p, *st_p], [out_t, *st_t], f"rank {rank} all_aggregate of ClientPieces")


def _strip(records):
    return [{k: v for k, v in r.items() if k != "wall_time"} for r in records]


@pytest.mark.parametrize("case", list(SIM_CASES))
def test_distributed_simulation_is_bitwise_the_single_process_simulation(ranks, case):
    import warnings

    from fedopt_kernels.fl import Simulation

    config, model = sim_args(case)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the BatchNorm model's engine fallback notice
            sim = Simulation(config, model=model)
            res = sim.run()
    finally:
        torch.set_num_threads(old)
    for rank in range(WORLD):
        got = ranks[rank]["simulation"][case]
        assert_bitwise(got["x"], sim.x_global, f"rank {rank} global model")
        assert_tree_bitwise(got["buffers"], [b.clone() for b in sim.global_model.buffers()], f"rank {rank} buffers")
        assert_tree_bitwise(got["server"], sim.server.state_dict(), f"rank {rank} server state")
        assert got["meta"]["distributed"]["world_size"] == WORLD
    records = _strip(ranks[0]["simulation"][case]["records"])
    assert records == _strip(res.records)
    others = _strip(ranks[1]["simulation"][case]["records"])  # rank 1 does not evaluate
    assert [{k: v for k, v in r.items() if not k.startswith("test_")} for r in others] == \
        [{k: v for k, v in r.items() if not k.startswith("test_")} for r in records]


def test_without_a_process_group_it_says_what_to_do():
    from fedopt_kernels.distributed import all_aggregate

    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        all_aggregate(torch.ones(2, 3), torch.ones(2))


def test_a_group_of_one_is_the_single_process_path(tmp_path):
    """World size 1 in this process: both modes and the server wrapper are the single-process path."""
    from fedopt_kernels.distributed import DistributedServerOptimizer, all_aggregate

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for case in ("nan_on_rank1_uneven", "bf16", "fp64_bounded", "rank0_empty_bounded_gamma_tensor"):
            X, w, _, kw = agg_data(case)
            ref_out, ref = single_aggregate(case)
            for mode in ("ordered", "all_reduce"):
                kw2 = dict(kw, out=None if kw.get("out") is None else torch.empty_like(kw["out"]))
                out, st = all_aggregate(X, w, mode=mode, **kw2)
                assert_bitwise(out, ref_out, f"{case} {mode} out")
                assert_tree_bitwise(list(st), list(ref), f"{case} {mode} stats")
        for case in SERVER_CASES:
            pa, pb = server_params(), server_params()
            single, wrapped = make_server_opt(case, pa), DistributedServerOptimizer(make_server_opt(case, pb))
            for r in range(len(SERVER_ROUNDS)):
                U, weights, _ = server_round(case, r)
                assert_tree_bitwise(vars(wrapped.step(U, weights)), vars(single.step(U, weights)), f"{case} {r}")
            assert_tree_bitwise(pb, pa, f"{case} params")
            assert wrapped.param_groups is wrapped.optimizer.param_groups
    finally:
        dist.destroy_process_group()


def test_rank_block_splits_contiguously_and_evenly():
    from fedopt_kernels.fl.run.distributed_simulation import rank_block

    for n in range(0, 12):
        for world in range(1, 5):
            blocks = [rank_block(n, world, r) for r in range(world)]
            assert blocks[0][0] == 0 and blocks[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
            sizes = [b - a for a, b in blocks]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


# ============================================================================ torchrun
def _cli_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("FEDOPT_BACKEND", None)
    return env


@pytest.mark.slow
def test_torchrun_simulate_distributed_matches_fedopt_simulate(tmp_path):
    args = ["simulate", "--algo", "fedadam", "--dataset", "digits", "--hidden", "32", "--clients", "8",
            "--per-round", "5", "--rounds", "2", "--local-steps", "4", "--engine", "sequential", "--quiet",
            "--no-plots"]
    single = subprocess.run([sys.executable, "-m", "fedopt_kernels", *args, "--out", str(tmp_path / "one")],
                            env=_cli_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert single.returncode == 0, single.stderr
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "-m", "fedopt_kernels", *args, "--distributed", "--out", str(tmp_path / "two")],
                         env=_cli_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    one = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=True)
    two = torch.load(tmp_path / "two" / "checkpoint.pt", weights_only=True)
    assert_bitwise(two["x_global"], one["x_global"], "global model")
    assert_tree_bitwise(two["server"], one["server"], "server state")
    r1 = json.loads((tmp_path / "one" / "results.json").read_text())
    r2 = json.loads((tmp_path / "two" / "results.json").read_text())
    assert _strip(r2["records"]) == _strip(r1["records"])
    assert r2["meta"]["distributed"]["world_size"] == 2
