"""Differential privacy and attacks in the simulator and on the command line: the
settings refused with their reason, what results.json records per round (epsilon
against an accountant built independently, the attackers against the round's sample),
labelflip's labels, and a resumed DP run drawing the same bits."""

from __future__ import annotations

import pytest
import torch

from fedopt_kernels.cli import build_parser
from fedopt_kernels.cli._errors import CLIError
from fedopt_kernels.cli._options import build_settings
from fedopt_kernels.fl import Simulation, SimulationConfig, sample_clients
from fedopt_kernels.fl.datasets.attacks import attacked_clients
from fedopt_kernels.fl.run.config import ConfigError

TINY = dict(dataset="digits", hidden=(16,), clients=8, per_round=4, rounds=2, local_steps=2, batch_size=16,
            lr=0.05, seed=1, engine="sequential")
DP = dict(weighting="uniform", dp_clip=0.5, dp_noise_multiplier=1.0, dp_delta=1e-3)


@pytest.mark.parametrize("settings, match", [
    (dict(dp_clip=1.0), "weighting auto \\(data-size weights for fedavg\\).*no bound.*use weighting uniform"),
    (dict(DP, algo="fedexp"), "algo fedexp.*does not privatise"),
    (dict(DP, algo="asnes"), "algo asnes"),
    (dict(DP, algo="scaffold"), "algo scaffold"),
    (dict(DP, algo="fedlaw"), "algo fedlaw"),
    (dict(DP, dp_delta=None), "dp-noise-multiplier 1 needs dp-delta"),
    (dict(DP, dp_noise_multiplier=0.0), "dp-delta asks for epsilon, but dp-noise-multiplier is 0"),
    (dict(DP, dp_delta=0.2), "below 1/clients"),
    (dict(dp_noise_multiplier=1.0), "dp-noise-multiplier needs dp-clip"),
    (dict(dp_target_quantile=0.5), "dp-target-quantile needs dp-clip"),
    (dict(DP, dp_target_quantile=0.5), "adaptive clipping's count no share"),  # per_round 4: sigma_b 0.2
    (dict(DP, dp_target_quantile=0.5, dp_noise_multiplier=0.0, dp_delta=None, dp_mode="client"), "dp-mode client"),
    (dict(DP, dp_clip=0.0), "dp-clip must be > 0"),
    (dict(DP, dp_target_quantile=1.0), "dp-target-quantile must be > 0 and < 1"),
    (dict(DP, dp_mode="both"), "unknown dp-mode"),
    (dict(attack="poison", attack_fraction=0.2), "unknown attack 'poison'"),
    (dict(attack_fraction=0.25), "attack-fraction 0.25 needs an attack"),
    (dict(attack="alie", attack_fraction=0.01), "attacks no client"),
    (dict(attack="alie", attack_fraction=1.5), "attack-fraction must be >= 0 and <= 1"),
])
def test_settings_that_void_the_guarantee_or_make_no_sense_are_refused(settings, match):
    with pytest.raises(ConfigError, match=match):
        SimulationConfig(**{**TINY, **settings}).validate()


def test_the_command_line_flags_reach_the_config_and_its_checks():
    args = build_parser().parse_args(["simulate", "--dp-clip", "0.5", "--dp-noise-multiplier", "1.2", "--dp-delta",
                                      "1e-4", "--weighting", "uniform", "--attack", "alie", "--attack-fraction",
                                      "0.2", "--dp-mode", "client"])
    vars(args).pop("distributed", None)
    cfg = build_settings(args)[0]
    assert (cfg.dp_clip, cfg.dp_noise_multiplier, cfg.dp_delta, cfg.dp_mode, cfg.attack, cfg.attack_fraction) == (
        0.5, 1.2, 1e-4, "client", "alie", 0.2)
    args = build_parser().parse_args(["simulate", "--dp-clip", "0.5"])
    vars(args).pop("distributed", None)
    with pytest.raises(CLIError, match="use weighting uniform"):
        build_settings(args)


def test_results_record_epsilon_and_the_attackers_of_every_round():
    from fedopt_kernels.server.differential_privacy.privacy_accountant import PrivacyAccountant

    pytest.importorskip("dp_accounting", reason="needs the privacy extra: pip install fedopt_kernels[privacy]")
    cfg = SimulationConfig(**{**TINY, **DP, "attack": "signflip", "attack_fraction": 0.25})
    res = Simulation(cfg).run()
    attackers = attacked_clients(cfg.seed, cfg.clients, 0.25)
    assert res.meta["attack"] == {"kind": "signflip", "fraction": 0.25, "clients": attackers}
    assert res.meta["dp"]["accountant"]["sampling"] == "fixed" and res.meta["dp"]["private"]
    acc = PrivacyAccountant(1.0, sampling="fixed", num_clients=8, clients_per_round=4, delta=1e-3)
    for rec in res.records[1:]:
        r = rec["round"]
        assert rec["attacked_clients"] == [c for c in sample_clients(cfg.seed, r, 8, 4) if c in attackers]
        assert rec["dp_epsilon"] == pytest.approx(acc.epsilon(r), rel=1e-12)
        assert rec["dp_clip"] == 0.5 and rec["dp_noise_std"] == pytest.approx(1.0 * 0.5 / 4, rel=1e-12)
    assert res.records[2]["dp_epsilon"] > res.records[1]["dp_epsilon"] > 0


def test_dp_run_is_reproducible_and_a_resumed_run_draws_the_same_bits():
    pytest.importorskip("dp_accounting", reason="needs the privacy extra: pip install fedopt_kernels[privacy]")
    cfg = SimulationConfig(**{**TINY, **DP, "per_round": 8, "rounds": 3, "dp_noise_multiplier": 0.5,
                              "dp_target_quantile": 0.5, "attack": "gaussian", "attack_fraction": 0.25})
    whole = Simulation(cfg)
    whole.run()
    again = Simulation(cfg)
    again.run()
    assert torch.equal(whole.x_global, again.x_global)
    first = Simulation(cfg)
    first.run(2)
    state = first.state_dict()
    resumed = Simulation(cfg)
    resumed.load_state_dict(state)
    resumed.run()
    assert torch.equal(resumed.x_global, whole.x_global)
    assert resumed.results.records[-1]["dp_clip"] == whole.results.records[-1]["dp_clip"]
    assert whole.results.records[-1]["dp_clip"] != 0.5  # adaptive: the clip moved


def test_labelflip_attackers_train_on_flipped_labels():
    cfg = SimulationConfig(**{**TINY, "attack": "labelflip", "attack_fraction": 0.25, "rounds": 1})
    sim = Simulation(cfg)
    k = sim.dataset.num_classes
    attackers = set(sim.attack.clients)
    for c, ix in enumerate(sim.client_indices):
        want = (k - 1 - sim.dataset.y_train[ix]) if c in attackers else sim.dataset.y_train[ix]
        assert torch.equal(sim.train_y[ix], want)


def test_fedopt_simulate_writes_epsilon_and_the_attackers(tmp_path):
    import csv
    import json

    from fedopt_kernels.cli import main

    pytest.importorskip("dp_accounting", reason="needs the privacy extra: pip install fedopt_kernels[privacy]")
    out = tmp_path / "run"
    assert main(["simulate", "--rounds", "1", "--clients", "8", "--per-round", "4", "--local-steps", "2",
                 "--hidden", "16", "--quiet", "--no-plots", "--weighting", "uniform", "--dp-clip", "0.5",
                 "--dp-noise-multiplier", "1.0", "--dp-delta", "1e-3", "--attack", "scale", "--attack-fraction",
                 "0.25", "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    rec = data["records"][1]
    assert rec["dp_epsilon"] > 0 and rec["dp_clip"] == 0.5
    assert rec["attacked_clients"] == [c for c in rec["clients"] if c in data["meta"]["attack"]["clients"]]
    row = list(csv.DictReader((out / "results.csv").open()))[1]
    assert float(row["dp_epsilon"]) == pytest.approx(rec["dp_epsilon"], rel=1e-5)


@pytest.mark.parametrize("settings", [DP, dict(attack="signflip", attack_fraction=0.25)], ids=["dp", "attack"])
def test_distributed_simulation_on_one_rank_equals_the_simulator(tmp_path, settings):
    """DP and the per-client attacks run under --distributed (2-rank equality:
    tests/test_distributed_robust_dp.py); on one rank the run is the simulator's, bit for bit."""
    from _gloo import run_on_one_rank

    cfg = SimulationConfig(**{**TINY, **settings})
    whole_sim = Simulation(cfg)
    whole = whole_sim.run()
    sim, res = run_on_one_rank(tmp_path, cfg)
    assert torch.equal(sim.x_global, whole_sim.x_global)
    assert [r.get("dp_epsilon") for r in res.records] == [r.get("dp_epsilon") for r in whole.records]
    assert [r.get("attacked_clients") for r in res.records] == [r.get("attacked_clients") for r in whole.records]
    key = "dp_epsilon" if "dp_clip" in settings else "attacked_clients"
    assert any(r.get(key) for r in whole.records)  # the compared records hold what they are about


def test_distributed_simulation_refuses_alie(tmp_path):
    import torch.distributed as dist

    from fedopt_kernels.fl.run.distributed_simulation import DistributedSimulation

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="attack alie is not supported with --distributed"):
            DistributedSimulation(SimulationConfig(**{**TINY, "attack": "alie", "attack_fraction": 0.25}))
    finally:
        dist.destroy_process_group()
