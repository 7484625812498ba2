"""The simulator with clients that cannot take part (issue 16): a client whose training
raises (``error``), one without samples (``no_data``), a NaN/Inf update (``nonfinite``),
every client of a round bad, ``on_bad_client="raise"``, and ``max_weight_share``.

The oracle of an exclusion is the same run in which the bad client is simply not in
that round (its ``sample_clients`` filtered): the global model, the server state and
every other number of the records must be bitwise the same.
"""

import json
import logging

import pytest
import torch

from conftest import assert_same_tree
from fedopt_kernels.fl import ConfigError, Simulation, SimulationConfig
from fedopt_kernels.fl.datasets.partition import Partition, iid_partition
from fedopt_kernels.fl.run.simulation import sample_clients
from fedopt_kernels.server.weighting import cap_weight_shares

SMALL = dict(dataset="digits", hidden=(32,), clients=10, per_round=4, rounds=3, local_steps=6, batch_size=32,
             lr=0.05, weight_decay=1e-3, max_norm=1.0)
EXCLUSION_KEYS = {"clients", "excluded_clients", "excluded_no_data", "excluded_error", "excluded_nonfinite",
                  "left_out", "wall_time"}

pytestmark = pytest.mark.usefixtures("one_thread")


def _sim(**kw):
    return Simulation(SimulationConfig(**{**SMALL, **kw}))


def _without(sim, round_number, clients):
    """The oracle: ``sim`` samples round ``round_number`` without ``clients``."""
    real = sim.sample_clients

    def sample(r):
        return [c for c in real(r) if not (r == round_number and c in clients)]

    sim.sample_clients = sample


def _fail_in_training(sim, client, round_number, after_steps=3):
    """``client``'s local training raises after ``after_steps`` steps in round
    ``round_number`` (its loss was computed and some statistics were added)."""
    state = {"current": None, "steps": 0}
    real_train, real_loss = sim.trainer.train, sim.trainer.loss_fn

    def train(*a, client=None, round_index=None, **k):
        state["current"], state["steps"] = (client, round_index), 0
        return real_train(*a, client=client, round_index=round_index, **k)

    def loss(out, y):
        if state["current"] == (client, round_number - 1):
            state["steps"] += 1
            if state["steps"] > after_steps:
                raise RuntimeError(f"client {client}'s data broke the model")
        return real_loss(out, y)

    sim.trainer.train, sim.trainer.loss_fn = train, loss


def _strip(record):
    return {k: v for k, v in record.items() if k not in EXCLUSION_KEYS}


def _assert_same_run(a, b):
    assert torch.equal(a.x_global, b.x_global)
    assert_same_tree(a.server.state_dict(), b.server.state_dict(), "state")
    if a.scaffold is not None:
        assert torch.equal(a.scaffold.c, b.scaffold.c) and torch.equal(a.scaffold.c_clients, b.scaffold.c_clients)
    assert [_strip(r) for r in a.results.records] == [_strip(r) for r in b.results.records]


@pytest.mark.parametrize("algo", ["fedadam", "fedexp", "scaffold", "fedlaw"])
def test_a_client_whose_training_raises_is_left_out_and_the_round_equals_the_round_without_it(algo, caplog):
    kw = dict(algo=algo, engine="sequential", fedlaw_epochs=2)
    a, b = _sim(**kw), _sim(**kw)
    bad = a.sample_clients(2)[1]
    _fail_in_training(a, bad, 2)
    _without(b, 2, [bad])
    with caplog.at_level(logging.WARNING, logger="fedopt_kernels.fl.run.simulation"):
        a.run()
    b.run()
    _assert_same_run(a, b)
    rec = a.results.records[2]
    assert rec["excluded_clients"] == rec["excluded_error"] == 1
    assert rec["excluded_no_data"] == rec["excluded_nonfinite"] == 0
    assert rec["left_out"] == [[bad, "error"]] and rec["clients"] == a.sample_clients(2)
    assert all(r["excluded_clients"] == 0 and "left_out" not in r for r in a.results.records[1::2])
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and f"client {bad}: error (RuntimeError: client {bad}'s data broke" in logged[0]


def test_batched_engine_retrains_a_failing_round_client_by_client():
    kw = dict(algo="fedavgm", engine="batched", client_batch=2)
    a, b = _sim(**kw), _sim(**kw)
    bad = a.sample_clients(2)[2]
    _fail_in_training(a, bad, 2, after_steps=0)
    real_group = a.batched._train_group

    def group(*args, **k):  # the batched engine fails in the group that holds the bad client
        g, clients, round_index = args[0], args[10], args[12]
        if round_index == 1 and bad in [clients[r] for r in g.rows[:g.real]]:
            raise RuntimeError("a group of clients failed")
        return real_group(*args, **k)

    a.batched._train_group = group
    a.run()
    # the oracle: round 2 without the bad client, trained by the sequential engine
    _without(b, 2, [bad])
    b.run(rounds=1)
    engine, b.batched = b.batched, None
    b.run(rounds=2)
    b.batched = engine
    b.run()
    _assert_same_run(a, b)
    assert a.results.meta["engine"] == "batched" and a.results.meta["sequential_retrains"] == [2]
    assert a.results.records[2]["left_out"] == [[bad, "error"]]


@pytest.mark.parametrize("engine", ["sequential", "batched"])
def test_a_client_without_samples_is_left_out(engine):
    base = iid_partition(1437, 10, seed=0)
    idx = [ix.clone() for ix in base.client_indices]
    empty = sample_clients(SMALL.get("seed", 0), 1, SMALL["clients"], SMALL["per_round"])[0]
    other = (empty + 1) % 10
    idx[other] = torch.cat([idx[other], idx[empty]]).sort().values
    idx[empty] = idx[empty][:0]
    part = Partition(idx, "custom")
    kw = dict(SMALL, engine=engine, algo="fedavg", partition="iid")
    a = Simulation(SimulationConfig(**kw), partition=part)
    b = Simulation(SimulationConfig(**kw), partition=part)
    _without(b, 1, [empty])
    a.run()
    b.run()
    _assert_same_run(a, b)
    assert a.results.records[1]["excluded_no_data"] == 1 and a.results.records[1]["left_out"] == [[empty, "no_data"]]
    # on_bad_client="raise": refused before anything trains, nothing changes
    c = Simulation(SimulationConfig(**{**kw, "on_bad_client": "raise"}), partition=part)
    x0 = c.x_global.clone()
    with pytest.raises(ValueError, match=rf"client\(s\) \[{empty}\] hold no samples"):
        c.run_round()
    assert c.round == 0 and torch.equal(c.x_global, x0) and len(c.results.records) == 0


def test_nonfinite_updates_are_counted_per_reason_beside_errors():
    a = _sim(algo="fedavg", engine="sequential")
    clients = a.sample_clients(1)
    _fail_in_training(a, clients[0], 1)
    real = a._train_clients

    def train_then_poison(round_number, cl):
        stats = real(round_number, cl)
        a.updates[1, 5] = float("inf")  # row 1 = the second client that took part
        return stats

    a._train_clients = train_then_poison
    rec = a.run_round()
    assert (rec["excluded_clients"], rec["excluded_error"], rec["excluded_nonfinite"]) == (2, 1, 1)
    assert rec["left_out"] == [[clients[0], "error"], [clients[2], "nonfinite"]]
    assert rec["server_skipped"] is False


def test_a_round_in_which_no_client_can_train_raises_and_commits_nothing():
    """Every client of round 2 raises: there is nothing to aggregate, so the round
    fails naming each client (as Flower's AggregationError), and the run stands at
    round 1 -- model, server state and records as they were."""
    a = _sim(algo="fedadam", engine="sequential", per_round=2)
    a.run_round()
    x1, state1 = a.x_global.clone(), {k: {n: t.clone() for n, t in v.items()}
                                      for k, v in a.server.optimizer.state.items()}
    records = [dict(r) for r in a.results.records]
    clients = a.sample_clients(2)
    for c in clients:
        _fail_in_training(a, c, 2)  # the second wrapper wraps the first: both clients fail
    with pytest.raises(RuntimeError, match=r"round 2: none of its 2 client\(s\) could train") as info:
        a.run_round()
    assert all(f"client {c}: error" in str(info.value) for c in clients)
    assert a.round == 1 and a.results.records == records and torch.equal(a.x_global, x1)
    for k, v in a.server.optimizer.state.items():
        assert all(torch.equal(t, state1[k][n]) for n, t in v.items())


def test_raise_keeps_the_old_behaviour_and_commits_nothing():
    a = _sim(algo="scaffold", engine="sequential", on_bad_client="raise")
    a.run_round()
    x1, c1, ci1 = a.x_global.clone(), a.scaffold.c.clone(), a.scaffold.c_clients.clone()
    _fail_in_training(a, a.sample_clients(2)[1], 2)
    with pytest.raises(RuntimeError, match="broke the model"):
        a.run_round()
    assert a.round == 1 and len(a.results.records) == 1
    assert torch.equal(a.x_global, x1) and torch.equal(a.scaffold.c, c1) and torch.equal(a.scaffold.c_clients, ci1)
    b = _sim(algo="fedavg", engine="batched", on_bad_client="raise")
    b.run_round()
    b.batched._train_group = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("group failed"))
    with pytest.raises(RuntimeError, match="group failed"):
        b.run_round()
    assert b.round == 1


def test_max_weight_share_caps_what_a_large_client_can_buy():
    cap = 0.26
    a = _sim(algo="fedavg", engine="sequential", max_weight_share=cap)
    x0 = a.x_global.detach().clone().double()
    rec = a.run_round()
    clients = rec["clients"]
    sizes = a.client_sizes[clients]
    D = a.updates[:len(clients)].double()
    # the water-filling by hand: capped clients hold `cap`, the others keep their proportions
    shares = sizes / sizes.sum()
    assert shares.max() > cap  # the cap acts in this round
    p = shares.clone()
    capped = torch.zeros(len(p), dtype=torch.bool)
    while (p > cap + 1e-12).any():
        capped |= p > cap + 1e-12
        free = torch.where(capped, 0.0, sizes)
        p = torch.where(capped, cap, free / free.sum() * (1 - cap * int(capped.sum())))
    torch.testing.assert_close(cap_weight_shares(sizes, cap), p, rtol=0, atol=1e-15)
    expected = x0 - (p[:, None] * D).sum(0)  # FedAvg, server lr 1
    torch.testing.assert_close(a.x_global.double(), expected, rtol=1e-6, atol=1e-7)
    uncapped = _sim(algo="fedavg", engine="sequential")
    uncapped.run_round()
    assert not torch.allclose(uncapped.x_global, a.x_global)
    # uniform weighting: the cap has nothing to cap
    u1, u2 = _sim(algo="fedexp", max_weight_share=cap), _sim(algo="fedexp")
    u1.run_round(), u2.run_round()
    assert torch.equal(u1.x_global, u2.x_global)


def test_settings_are_checked_and_reach_the_files(tmp_path):
    from fedopt_kernels.cli import main

    with pytest.raises(ConfigError, match="max-weight-share"):
        SimulationConfig(max_weight_share=1.5).validate()
    with pytest.raises(ConfigError, match="max-weight-share"):
        SimulationConfig(max_weight_share=0).validate()
    with pytest.raises(ConfigError, match="on-bad-client"):
        SimulationConfig(on_bad_client="ignore").validate()
    out = tmp_path / "run"
    assert main(["simulate", "--rounds", "1", "--clients", "8", "--per-round", "3", "--local-steps", "3",
                 "--hidden", "16", "--quiet", "--max-weight-share", "0.4", "--on-bad-client", "raise",
                 "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["config"]["max_weight_share"] == 0.4 and data["config"]["on_bad_client"] == "raise"
    assert data["records"][1]["excluded_clients"] == 0 and data["records"][1]["excluded_error"] == 0
    header = (out / "results.csv").read_text().splitlines()[0].split(",")
    assert {"excluded_clients", "excluded_no_data", "excluded_error", "excluded_nonfinite"} <= set(header)
