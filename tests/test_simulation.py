"""The round loop end to end: every algorithm learns, runs are reproducible, checkpoints resume."""

import io
import math

import pytest
import torch

from fedopt_kernels.fl import (ALGORITHMS, ConfigError, FederatedDataset, Results, Simulation, SimulationConfig,
                               dirichlet_partition)

SMALL = dict(dataset="digits", hidden=(32,), clients=10, per_round=4, rounds=3, local_steps=8, batch_size=32,
             lr=0.05, weight_decay=1e-3)


pytestmark = pytest.mark.usefixtures("one_thread")


def _strip(records):
    return [{k: v for k, v in r.items() if k != "wall_time"} for r in records]


def _run(**kw):
    sim = Simulation(SimulationConfig(**{**SMALL, **kw}))
    return sim, sim.run()


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_every_algorithm_improves_over_the_untrained_model(algo):
    kw = dict(rounds=4, per_round=5, local_steps=10, hidden=(64,))
    if algo == "fedlaw":
        kw.update(fedlaw_epochs=5)
    sim, res = _run(algo=algo, **kw)
    assert res.rounds_completed == 4
    initial, final = res.initial["test_accuracy"], res.final["test_accuracy"]
    assert initial < 0.25
    assert final > initial + 0.3, (algo, initial, final)
    for r in res.records[1:]:
        assert math.isfinite(r["test_loss"]) and math.isfinite(r["train_loss"])
        assert len(r["clients"]) == 5
    if algo == "asnes":
        assert all(1.0 <= r["gain_ratio"] <= 5.0 + 1e-9 for r in res.records[1:])
    if algo == "fedexp":
        assert all(r["lr_scale"] >= 1.0 for r in res.records[1:])
    if algo == "fedlaw":
        assert all(r["gamma"] > 0 and len(r["lambda"]) == 5 and abs(sum(r["lambda"]) - 1) < 1e-5
                   for r in res.records[1:])


def test_same_seed_gives_identical_results():
    _, a = _run(algo="scaffold", nar="co", momentum=0.5)
    sim_b, b = _run(algo="scaffold", nar="co", momentum=0.5)
    assert _strip(a.records) == _strip(b.records)
    _, c = _run(algo="scaffold", nar="co", momentum=0.5, seed=1)
    assert _strip(a.records) != _strip(c.records)


def test_two_algorithms_see_the_same_clients_and_partition():
    sim_a, a = _run(algo="fedavg")
    sim_b, b = _run(algo="fedadam", nar="grad")
    assert [r["clients"] for r in a.records] == [r["clients"] for r in b.records]
    assert a.partition["sizes"] == b.partition["sizes"]
    assert a.initial == b.initial  # same initial model
    assert len({tuple(r["clients"]) for r in a.records[1:]}) > 1  # clients change across rounds


def test_clip_statistics_are_recorded():
    _, res = _run(algo="fedavg", nar="co", max_norm=0.5)
    for r in res.records[1:]:
        assert 0 < r["clip_frequency"] <= 1
        assert r["mean_clipped_norm"] > 0.5
        assert r["clipped_steps"] == round(r["clip_frequency"] * 4 * 8)
    _, res = _run(algo="fedavg", nar="none", max_norm=0.5)
    assert all(r["clip_frequency"] == 0 and r["mean_clipped_norm"] is None for r in res.records[1:])


def test_local_lr_annealing_is_recorded():
    _, res = _run(lr=0.1, lr_decay=0.5, wd_decay=0.5)
    assert [r["local_lr"] for r in res.records[1:]] == pytest.approx([0.1, 0.05, 0.025])
    assert [r["weight_decay"] for r in res.records[1:]] == pytest.approx([1e-3, 5e-4, 2.5e-4])


@pytest.mark.parametrize("algo", ["scaffold", "fedadam", "asnes"])
def test_checkpoint_resume_is_bit_identical(algo):
    sim_full, full = _run(algo=algo, rounds=4)
    sim = Simulation(SimulationConfig(**{**SMALL, "algo": algo, "rounds": 4}))
    sim.run(rounds=2)
    buf = io.BytesIO()
    torch.save(sim.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    resumed = Simulation(SimulationConfig(**{**SMALL, "algo": algo, "rounds": 4}))
    resumed.load_state_dict(state)
    assert resumed.round == 2
    res = resumed.run()
    assert _strip(res.records) == _strip(full.records)
    assert torch.equal(resumed.x_global, sim_full.x_global)


def test_checkpoint_refuses_other_settings():
    sim = Simulation(SimulationConfig(**SMALL))
    sim.run(rounds=1)
    other = Simulation(SimulationConfig(**{**SMALL, "alpha": 1.0}))
    with pytest.raises(ValueError, match="alpha"):
        other.load_state_dict(sim.state_dict())


def test_synthetic_dataset_and_cnn_and_iid():
    sim, res = _run(dataset="synthetic", clients=8, per_round=3, rounds=2, max_samples_per_client=200)
    assert res.partition["method"] == "natural" and res.partition["num_clients"] == 8
    assert res.final["test_accuracy"] > res.initial["test_accuracy"]
    sim, res = _run(model="cnn", rounds=1, per_round=2, local_steps=3, partition="iid")
    assert res.partition["method"] == "iid" and sim.results.meta["model"] == "SimpleCNN"


def test_user_dataset_model_and_partition():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 3, generator=g)
    x = torch.randn(300, 5, generator=g)
    y = (x @ w).argmax(1)
    ds = FederatedDataset("linear", x[:240], y[:240], x[240:], y[240:], 3)
    part = dirichlet_partition(ds.y_train, 6, 1.0, seed=0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    cfg = SimulationConfig(**{**SMALL, "clients": 6, "per_round": 3, "rounds": 5, "lr": 0.2})
    sim = Simulation(cfg, dataset=ds, model=model, partition=part)
    assert sim.global_model is model
    res = sim.run()
    assert res.final["test_accuracy"] > 0.7 and res.final["test_accuracy"] > res.initial["test_accuracy"]


def test_model_with_batchnorm_buffers_are_averaged():
    def make():
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32),
                                   torch.nn.ReLU(), torch.nn.Linear(32, 10))

    cfg = SimulationConfig(**{**SMALL, "rounds": 2})
    sim = Simulation(cfg, model=make)
    before = sim.global_model[2].running_mean.clone()
    res = sim.run()
    assert not torch.equal(before, sim.global_model[2].running_mean)
    assert res.final["test_accuracy"] > res.initial["test_accuracy"]


def test_results_files_round_trip(tmp_path):
    _, res = _run(algo="fedexp", rounds=2)
    json_path, csv_path = res.write(tmp_path)
    back = Results.read_json(json_path)
    assert back.records == res.records and back.config["algo"] == "fedexp"
    assert back.summary()["final_accuracy"] == res.final["test_accuracy"]
    lines = csv_path.read_text().splitlines()
    assert len(lines) == 1 + 3 and lines[0].startswith("round,test_accuracy")
    pngs = res.plot(tmp_path)
    assert [p.name for p in pngs] == ["accuracy_loss.png", "clipping.png", "server.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


@pytest.mark.parametrize("change, match", [
    (dict(per_round=11), "per-round"),
    (dict(alpha=0.0), "alpha"),
    (dict(rounds=0), "rounds"),
    (dict(lr=-0.1), "lr"),
    (dict(algo="fedfoo"), "algo"),
    (dict(dataset="mnist"), "dataset"),
    (dict(engine="vectorised"), "engine"),
    (dict(client_batch=-1), "client-batch"),
    (dict(nar="clip"), "nar"),
])
def test_config_errors(change, match):
    with pytest.raises(ConfigError, match=match):
        SimulationConfig(**{**SMALL, **change}).validate()


def test_ctrl_c_during_the_commit_is_deferred_to_the_end_of_the_round(monkeypatch, sigint_raises):
    import os
    import signal

    _, full = _run(algo="fedadam", rounds=4)
    sim = Simulation(SimulationConfig(**{**SMALL, "algo": "fedadam", "rounds": 4}))
    real = Simulation.evaluate

    def evaluate_with_ctrl_c(self, *a, **k):
        if self.round == 1:  # round 2 is committing: a Ctrl-C arrives during its evaluation
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, *a, **k)

    monkeypatch.setattr(Simulation, "evaluate", evaluate_with_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        sim.run()
    assert sim.round == 2 and sim.results.records[-1]["round"] == 2  # the round completed first
    monkeypatch.setattr(Simulation, "evaluate", real)
    res = sim.run()
    assert _strip(res.records) == _strip(full.records)


def test_ctrl_c_during_client_training_leaves_the_state_untouched(monkeypatch):
    # the sequential engine's trainer is interrupted here; tests/test_batched_engine.py
    # interrupts the batched one
    _, full = _run(algo="scaffold", rounds=3, engine="sequential")
    sim = Simulation(SimulationConfig(**{**SMALL, "algo": "scaffold", "rounds": 3, "engine": "sequential"}))
    sim.run(rounds=1)
    c_before, ci_before = sim.scaffold.c.clone(), sim.scaffold.c_clients.clone()
    real = sim.trainer.train
    calls = {"n": 0}

    def train_then_ctrl_c(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(sim.trainer, "train", train_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        sim.run()
    assert sim.round == 1
    assert torch.equal(sim.scaffold.c, c_before) and torch.equal(sim.scaffold.c_clients, ci_before)
    monkeypatch.setattr(sim.trainer, "train", real)
    assert _strip(sim.run().records) == _strip(full.records)


def test_the_clients_local_config_is_every_local_setting_of_the_run():
    """``SimulationConfig.local_config`` (issue 46 item 4): every LocalConfig field comes
    from the setting LOCAL_FIELDS names (none forgotten), FedProx's mu and SCAFFOLD's
    correction from the algorithm -- the values the simulator used to copy by hand."""
    import dataclasses

    from fedopt_kernels.fl.engine.client import LocalConfig
    from fedopt_kernels.fl.run.config import LOCAL_FIELDS

    assert set(LOCAL_FIELDS) | {"prox_mu", "scaffold"} == {f.name for f in dataclasses.fields(LocalConfig)}
    cfg = SimulationConfig(algo="fedprox", local_steps=7, batch_size=9, lr=0.3, lr_decay=0.9, weight_decay=0.02,
                           wd_decay=0.5, max_norm=3.0, nar="grad", momentum=0.4, prox_mu=0.25, decay_beta=0.8,
                           decay_kind="exponential", decay_per="epoch", backend="reference", carry_momentum=True,
                           decay_scales_change=True)
    assert cfg.local_config() == LocalConfig(
        steps=7, batch_size=9, lr=0.3, lr_decay=0.9, weight_decay=0.02, wd_decay=0.5, max_norm=3.0, nar="grad",
        momentum=0.4, prox_mu=0.25, scaffold=False, decay_beta=0.8, decay_kind="exponential", decay_per="epoch",
        backend="reference", carry_momentum=True, decay_scales_change=True)
    other = dataclasses.replace(cfg, algo="scaffold").local_config()
    assert other.prox_mu == 0.0 and other.scaffold is True
