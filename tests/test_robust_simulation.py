"""Robust aggregation in the simulator and on the command line: the settings refused
by name with their reason, the flags reaching the config, a round's server step equal
to the float64 oracle of the rule on that round's updates, the selected clients in the
record, a resumed centered-clipping run, chunked rounds that do not fold, and what
results.json records."""

from __future__ import annotations

import pytest
import torch

import python_ref.robust as O
from fedopt_kernels.cli import build_parser
from fedopt_kernels.cli._options import build_settings
from fedopt_kernels.fl import Simulation, SimulationConfig
from fedopt_kernels.fl.run.config import ConfigError


TINY = dict(dataset="digits", hidden=(16,), clients=8, per_round=5, rounds=2, local_steps=2, batch_size=16,
            lr=0.05, seed=1, engine="sequential")


@pytest.mark.parametrize("settings, match", [
    (dict(aggregator="mediann"), "unknown aggregator 'mediann'"),
    (dict(aggregator="median", trim_beta=0.2), "trim-beta applies to aggregator trimmed-mean, got aggregator median"),
    (dict(byzantine_f=1), "byzantine-f applies to aggregator krum / multi-krum / bulyan"),
    (dict(aggregator="krum"), "aggregator krum needs byzantine-f"),
    (dict(aggregator="krum", byzantine_f=2), "needs per-round >= 2 byzantine-f \\+ 3 = 7.*got per-round 5"),
    (dict(aggregator="bulyan", byzantine_f=1), "needs per-round >= 4 byzantine-f \\+ 3 = 7"),
    (dict(aggregator="multi-krum", byzantine_f=1, krum_m=6), "krum-m 6 selects more clients than per-round"),
    (dict(aggregator="trimmed-mean", trim_beta=0.5), "trim-beta must be >= 0 and < 0.5"),
    (dict(aggregator="centered-clip"), "needs cclip-tau"),
    (dict(aggregator="centered-clip", cclip_tau=0.0), "cclip-tau must be > 0"),
    (dict(aggregator="norm-bound"), "needs norm-bound-radius"),
    (dict(aggregator="geomed", geomed_iters=0), "geomed-iters must be >= 1"),
    (dict(aggregator="median", weighting="uniform", dp_clip=1.0), "cannot be combined with dp-clip.*sensitivity"),
    (dict(aggregator="median", algo="fedexp"), "algo fedexp"),
    (dict(aggregator="median", algo="asnes"), "algo asnes"),
    (dict(aggregator="median", algo="fedlaw"), "algo fedlaw"),
    (dict(aggregator="median", algo="scaffold"), "algo scaffold"),
])
def test_bad_settings_are_refused_naming_the_flag(settings, match):
    with pytest.raises(ConfigError, match=match):
        SimulationConfig(**{**TINY, **settings}).validate()


def test_the_command_line_flags_reach_the_config():
    def cfg(*flags):
        args = build_parser().parse_args(["simulate", *flags])
        vars(args).pop("distributed", None)
        return build_settings(args)[0]

    c = cfg("--aggregator", "multi-krum", "--byzantine-f", "2", "--krum-m", "4")
    assert (c.aggregator, c.aggregator_params) == ("multi-krum", {"f": 2, "m": 4})
    c = cfg("--aggregator", "centered-clip", "--cclip-tau", "0.5", "--cclip-iters", "3")
    assert c.aggregator_params == {"tau": 0.5, "iterations": 3}
    c = cfg("--aggregator", "geomed", "--geomed-iters", "8", "--geomed-tol", "1e-6")
    assert c.aggregator_params == {"max_iter": 8, "tol": 1e-6}
    assert cfg("--aggregator", "trimmed-mean").aggregator_params == {"beta": 0.1}
    assert cfg("--aggregator", "norm-bound", "--norm-bound-radius", "2").aggregator_params == {"radius": 2.0}


def _capture_rounds(sim):
    """Wrap the round's server step to keep each round's updates and the model before it."""
    seen = []
    step = sim.server.round.step

    def spy(updates, weights):
        seen.append((updates.detach().clone(), sim.x_global.detach().clone()))
        return step(updates, weights)

    sim.server.round.step = spy
    return seen


def test_a_median_round_moves_the_model_by_minus_the_median_of_its_updates():
    sim = Simulation(SimulationConfig(**TINY, aggregator="median", attack="signflip", attack_fraction=0.25))
    seen = _capture_rounds(sim)
    res = sim.run()
    x_after = [r[1] for r in seen[1:]] + [sim.x_global]
    for (rows, x_before), x_new in zip(seen, x_after):
        assert rows.shape[0] == 5  # an odd count: the median is one of the values, the step rounds once
        assert torch.equal(x_new, (x_before.double() - O.coordinate_median(rows)).to(x_new.dtype))
    assert res.meta["aggregator"] == {"rule": "median", "weighted": False}
    assert res.config["aggregator"] == "median"
    assert all("robust_selected" not in r for r in res.records)  # median selects no client


def test_a_krum_run_records_the_client_it_selected():
    sim = Simulation(SimulationConfig(**{**TINY, "per_round": 7, "aggregator": "krum", "byzantine_f": 2,
                                         "attack": "scale", "attack_fraction": 0.25}))
    seen = _capture_rounds(sim)
    res = sim.run()
    for rec, (rows, _) in zip(res.records[1:], seen):
        _, chosen = O.multi_krum(rows, 2, 1)
        assert rec["robust_selected"] == [rec["clients"][i] for i in chosen]
        assert rec["robust_bound_met"] is True
        assert not set(rec["robust_selected"]) & set(rec["attacked_clients"])  # scaled updates are far apart
    assert res.meta["aggregator"] == {"rule": "krum", "f": 2, "weighted": False}


def test_a_resumed_centered_clipping_run_continues_from_its_reference():
    cfg = SimulationConfig(**{**TINY, "rounds": 3, "aggregator": "centered-clip", "cclip_tau": 0.05})
    whole = Simulation(cfg)
    whole.run()
    first = Simulation(cfg)
    first.run(2)
    state = first.state_dict()
    assert state["robust"]["rounds"] == 2 and state["robust"]["reference"] is not None
    resumed = Simulation(cfg)
    resumed.load_state_dict(state)
    resumed.run()
    assert torch.equal(resumed.x_global, whole.x_global)
    fresh = Simulation(cfg)  # without the reference the third round starts from zeros: another model
    fresh.load_state_dict({**state, "robust": None})
    fresh.run()
    assert not torch.equal(fresh.x_global, whole.x_global)


def test_distributed_simulation_on_one_rank_runs_the_rule(tmp_path):
    """A robust rule runs under --distributed (2-rank equality: tests/test_distributed_robust_dp.py);
    on one rank the run is the simulator's, bit for bit, selection records included."""
    from _gloo import run_on_one_rank

    cfg = SimulationConfig(**{**TINY, "aggregator": "multi-krum", "byzantine_f": 1, "krum_m": 2})
    whole_sim = Simulation(cfg)
    whole = whole_sim.run()
    sim, res = run_on_one_rank(tmp_path, cfg)
    assert torch.equal(sim.x_global, whole_sim.x_global)
    assert [r.get("robust_selected") for r in res.records] == [r.get("robust_selected") for r in whole.records]
    assert any(r.get("robust_selected") for r in whole.records)


def test_fedopt_simulate_writes_the_aggregator_and_the_selected_clients(tmp_path):
    import csv
    import json

    from fedopt_kernels.cli import main

    out = tmp_path / "run"
    assert main(["simulate", "--rounds", "2", "--clients", "8", "--per-round", "5", "--local-steps", "2",
                 "--hidden", "16", "--quiet", "--no-plots", "--aggregator", "multi-krum", "--byzantine-f", "1",
                 "--krum-m", "2", "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["aggregator"] == {"rule": "multi-krum", "f": 1, "m": 2, "weighted": True}
    for rec in data["records"][1:]:
        assert len(rec["robust_selected"]) == 2 and set(rec["robust_selected"]) <= set(rec["clients"])
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == 3
