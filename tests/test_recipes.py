"""Issue 30: the papers' recipes (fl/run/recipes.py), FedExP as its authors run it (S * eps,
eps decay, the mean of the last two iterates), FedLAW's momentum carried across rounds
and FedDecay's per-epoch rescaling of the parameter change.

Every recipe value is pinned to its source by the table below (the text of the paper
or of the authors' released code that gives it); the oracles of the training tests are
hand-computed on a one-parameter model whose gradient is ``2 w x^2``.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch
from torch import nn

from fedopt_kernels.fl import FederatedDataset, LocalConfig, LocalTrainer, Simulation, SimulationConfig
from fedopt_kernels.fl.run import recipes
from fedopt_kernels.fl.engine.client import RoundStats
from fedopt_kernels.fl.run.config import ConfigError

# (recipe, field, value, where the source string must point, the text at that place)
SOURCES = [
    ("fednar", "algo", "fedavg", "scripts/fedavg.sh:3", '--algorithm "fedavg"'),
    ("fednar", "nar", "co", "main.py:52-54", "if args_required.use_nar: args_required.l2_reg = args_required.weight_decay"),
    ("fednar", "local_steps", 20, "section 5", "20 steps of local training per round"),
    ("fednar", "batch_size", 50, "main.py:40", "parser.add_argument('--batch_size', default=50, type=int)"),
    ("fednar", "lr", 0.01, "section 5", "We set the local learning rate to 0.01 with a decay of 0.998"),
    ("fednar", "lr_decay", 0.998, "section 5", "We set the local learning rate to 0.01 with a decay of 0.998"),
    ("fednar", "weight_decay", 0.05, "scripts/fedavg.sh:11", "--weight_decay 0.05"),
    ("fednar", "max_norm", 10.0, "section 5", "cap the maximum norm at 10 for both gradient clipping and FedNAR"),
    ("fednar", "momentum", 0.0, "util_general.py:42", "torch.optim.SGD(net.parameters(), lr=self.lr, "
                                                      "weight_decay=self.weight_decay)"),
    ("fednar", "weighting", "size", "main.py:134-135", "p[i] = len(dataset_train[i]); p = p/np.sum(p)"),
    ("fednar", "server_lr", 1.0, "Figure 2 caption", "a global learning rate of 1.0"),
    ("fedlaw", "algo", "fedlaw", "main_fedlaw.py:15", "args.server_method = 'fedlaw'"),
    ("fedlaw", "nar", "none", "utils.py:121", "torch.optim.SGD(model.parameters(), lr=args.lr, "
                                              "momentum=args.momentum, weight_decay=args.local_wd_rate)"),
    ("fedlaw", "lr", 0.08, "args.py:69", "parser.add_argument('--lr', type=float, default=0.08"),
    ("fedlaw", "lr_decay", 0.99, "utils.py:147", "args.lr *= 0.99 #0.99"),
    ("fedlaw", "momentum", 0.9, "args.py:73", "parser.add_argument('--momentum', type=float, default=0.9"),
    ("fedlaw", "weight_decay", 5e-4, "args.py:71", "parser.add_argument('--local_wd_rate', type=float, default=5e-4"),
    ("fedlaw", "batch_size", 128, "args.py:12", "parser.add_argument('--batchsize', type=int, default=128"),
    ("fedlaw", "carry_momentum", True, "reparam_function.py:163",
     "self.flat_w.data = flat_w.detach().clone().requires_grad_(True)"),
    ("fedlaw", "weighting", "size", "main_fedlaw.py:30-33", "size_weights = [i/sum(sample_size) for i in sample_size]"),
    ("fedlaw", "fedlaw_learn", "both", "server_funct.py:65", "fedlaw optimization functions for optimize both gamma "
                                                            "and lambdas"),
    ("fedlaw", "fedlaw_epochs", 20, "args.py:49", "parser.add_argument('--server_epochs', type=int, default=20"),
    ("fedlaw", "fedlaw_lr", 0.005, "server_funct.py:69-72", "if args.dataset == 'cifar10': server_lr = 0.01 else: "
                                                           "server_lr = 0.005"),
    ("fedlaw", "proxy_source", "test", "D.2", "randomly selected from the testset"),
    ("fedexp", "algo", "fedexp", "main.py:18", "parser.add_argument('--algorithm', type=str, required=True)"),
    ("fedexp", "nar", "grad", "util_general.py:58-59", "torch.nn.utils.clip_grad_norm_(parameters=net.parameters(), "
                                                       "max_norm=self.max_norm)"),
    ("fedexp", "local_steps", 20, "main.py:77", '"cp":20,   ### number of local steps'),
    ("fedexp", "batch_size", 50, "main.py:76", '"bs":50,   ###batch size'),
    ("fedexp", "lr", 0.01, "main.py:102", "eta_l_fedexp = 0.01"),
    ("fedexp", "lr_decay", 0.998, "main.py:95", "decay=  0.998"),
    ("fedexp", "weight_decay", 1e-4, "main.py:98", "weight_decay = 0.0001"),
    ("fedexp", "max_norm", 10.0, "main.py:96-97", "max_norm = 10; use_gradient_clipping = True"),
    ("fedexp", "momentum", 0.0, "util_general.py:40", "torch.optim.SGD(net.parameters(), lr=self.lr, momentum = 0, "
                                                      "weight_decay=self.weight_decay)"),
    ("fedexp", "weighting", "size", "main.py:247-252", "p[i] = len(dataset_train[i]); p = p/np.sum(p)"),
    ("fedexp", "server_lr", 1.0, "main.py:236", "'fedexp': 'adaptive'"),
    ("fedexp", "fedexp_eps", 1e-3, "main.py:121", "epsilon_fedexp = 0.001"),
    ("fedexp", "fedexp_scale_eps", True, "main.py:404", "eta_g = (0.5*grad_norm_avg/(grad_avg_norm + S*epsilon)).cpu()"),
    ("fedexp", "fedexp_eps_decay", 0.998 ** 2, "main.py:308", "epsilon = decay*decay*epsilon"),
    ("fedexp", "eval_avg_last_two", True, "main.py:414-421", "w_vec_avg = (w_vec_estimate+w_vec_prev)/2"),
    ("feddecay", "algo", "fedavg", "section 3", "this modification generalizes the widely used FedAvg algorithm"),
    ("feddecay", "nar", "grad", "base_finetune.yaml", "optimizer: grad_clip: 5"),
    ("feddecay", "max_norm", 5.0, "base_finetune.yaml", "optimizer: grad_clip: 5"),
    ("feddecay", "momentum", 0.0, "base_finetune.yaml", "optimizer: momentum: 0"),
    ("feddecay", "weight_decay", 0.0, "base_finetune.yaml", "optimizer: weight_decay: 0"),
    ("feddecay", "batch_size", 32, "base_finetune.yaml", "data: batch_size: 32"),
    ("feddecay", "lr", 0.05, "sweep_decay_finetune.yaml", "lr: values: [0.05, 0.005, 0.5, 0.01, 0.1]"),
    ("feddecay", "lr_decay", 1.0, "base_finetune.yaml", "(no lr scheduler in the config)"),
    ("feddecay", "decay_beta", 0.8, "sweep_decay_finetune.yaml", "beta: values: [0.2, 0.4, 0.6, 0.8]"),
    ("feddecay", "decay_kind", "exponential", "trainer_decay.py:129-130",
     "if ctx.decay_scheme == 'exponential': scaling = ctx.beta ** ctx.step_iter"),
    ("feddecay", "decay_per", "epoch", "cfg_training.py:15", "cfg.trainer.model_on_batch_or_epoch = 'epoch'"),
    ("feddecay", "decay_scales_change", True, "trainer_decay.py:42-54",
     "on_epoch_start: _hook_save_model; on_epoch_end: _hook_decay_model"),
    ("feddecay", "weighting", "uniform", "section 2", "we exclusively consider aggregation with equally weighted users"),
    ("asnes", "algo", "asnes", "Algorithm 1", "ASNES"),
    ("asnes", "nar", "none", "section 1", "perform multiple local updates using stochastic gradient descent"),
    ("asnes", "momentum", 0.0, "Algorithm 1 line 9", "w_{n,k+1} = w_{n,k} - eta g_{n,k}"),
    ("asnes", "weight_decay", 0.0, "Algorithm 1 line 9", "w_{n,k+1} = w_{n,k} - eta g_{n,k}"),
    ("asnes", "weighting", "uniform", "Algorithm 1 line 13", "nabla_t := 1/|S| sum_{n in S} nabla_{n,t}"),
    ("asnes", "server_lr", 1.0, "eq. (3)-(4c)", "Server update the learning rate eta_t via (3)"),
    ("asnes", "server_momentum", 0.9, "section 5.1", "we set beta = 0.9 in the Fashion-MNIST experiment"),
]


@pytest.mark.parametrize("name,field,value,where,text", SOURCES, ids=[f"{r[0]}-{r[1]}" for r in SOURCES])
def test_each_recipe_value_is_its_sources(name, field, value, where, text):
    setting = {s.field: s for s in recipes.get(name).settings}[field]
    assert setting.value == value, (name, field, setting.value, text)
    assert type(setting.value) is type(value)
    assert where in setting.source, (setting.source, where)


def test_the_table_covers_every_recipe_value_and_every_recipe():
    pinned = {(r[0], r[1]) for r in SOURCES}
    listed = {(name, s.field) for name in recipes.names() for s in recipes.get(name).settings}
    assert listed == pinned
    assert recipes.names() == ("fednar", "fedlaw", "fedexp", "feddecay", "asnes")
    assert len(pinned) == len(SOURCES)  # no row twice


def test_recipe_config_applies_the_recipe_then_the_overrides():
    cfg = SimulationConfig.from_recipe("fedlaw", lr=0.05, rounds=3)
    assert (cfg.algo, cfg.momentum, cfg.weight_decay, cfg.carry_momentum) == ("fedlaw", 0.9, 5e-4, True)
    assert (cfg.lr, cfg.rounds, cfg.recipe) == (0.05, 3, "fedlaw")
    assert cfg.clients == SimulationConfig().clients  # the scale is not the recipe's
    resolved = recipes.get("fedlaw").resolved(cfg)
    assert resolved["settings"]["lr"] == {"value": 0.05, "recipe_value": 0.08, "source": "args.py:69 (--lr default "
                                          "0.08)", "overridden": True}
    assert resolved["settings"]["momentum"]["overridden"] is False
    with pytest.raises(ValueError, match="unknown recipe 'fedxyz'"):
        recipes.get("fedxyz")
    with pytest.raises(ConfigError, match="unknown recipe"):
        SimulationConfig(recipe="fedxyz").validate()


def _parse(argv):
    from fedopt_kernels.cli._options import add_simulation_options, build_settings

    parser = argparse.ArgumentParser()
    add_simulation_options(parser)
    return build_settings(parser.parse_args(argv))


def test_a_flag_given_on_the_command_line_overrides_the_recipe_the_others_do_not(tmp_path):
    cfg, _ = _parse(["--recipe", "fedexp", "--lr", "0.05"])
    assert cfg.lr == 0.05  # the flag
    assert (cfg.nar, cfg.batch_size, cfg.weight_decay, cfg.fedexp_scale_eps) == ("grad", 50, 1e-4, True)  # recipe
    assert cfg.fedexp_eps_decay == 0.998 ** 2
    cfg, _ = _parse(["--recipe", "fedexp", "--fedexp-scale-eps", "false"])
    assert cfg.fedexp_scale_eps is False
    # a TOML file sits above the recipe and below the flags
    toml = tmp_path / "run.toml"
    toml.write_text('recipe = "fedlaw"\nmomentum = 0.5\nlr = 0.2\n')
    cfg, _ = _parse(["--config", str(toml), "--lr", "0.03"])
    assert (cfg.recipe, cfg.momentum, cfg.lr, cfg.weight_decay) == ("fedlaw", 0.5, 0.03, 5e-4)
    from fedopt_kernels.cli._errors import CLIError

    with pytest.raises(CLIError, match="unknown recipe 'nope'"):
        _parse(["--recipe", "nope"])


def test_a_checkpoints_settings_are_not_overwritten_by_its_recorded_recipe():
    from fedopt_kernels.cli._options import add_simulation_options, build_settings

    parser = argparse.ArgumentParser()
    add_simulation_options(parser)
    base = SimulationConfig.from_recipe("fedlaw", lr=0.05).to_dict()
    cfg, _ = build_settings(parser.parse_args(["--rounds", "7"]), base=base)
    assert (cfg.lr, cfg.rounds, cfg.recipe) == (0.05, 7, "fedlaw")
    # resumed with the recipe named again (a --config file holding it): the checkpoint's values stay
    cfg, _ = build_settings(parser.parse_args(["--recipe", "fedlaw", "--rounds", "7"]), base=base)
    assert (cfg.lr, cfg.momentum, cfg.rounds) == (0.05, 0.9, 7)


def test_simulate_with_a_recipe_records_it_in_results_json(tmp_path):
    import json

    from fedopt_kernels.cli import main

    threads = torch.get_num_threads()
    try:
        code = main(["simulate", "--recipe", "fedexp", "--lr", "0.05", "--hidden", "8", "--clients", "4",
                     "--per-round", "2", "--rounds", "2", "--local-steps", "2", "--quiet", "--no-plots",
                     "--threads", "1", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    res = json.loads((tmp_path / "results.json").read_text())
    rec = res["meta"]["recipe"]
    assert rec["name"] == "fedexp" and "Divyansh03/FedExP" in rec["code"]
    assert rec["settings"]["lr"]["overridden"] is True and rec["settings"]["lr"]["value"] == 0.05
    scale = rec["settings"]["fedexp_scale_eps"]
    assert (scale["value"], scale["recipe_value"], scale["overridden"]) == (True, True, False)
    assert scale["source"].startswith("main.py:404")
    assert res["config"]["recipe"] == "fedexp"
    assert all("test_accuracy_avg2" in r for r in res["records"][1:])


# ---------------------------------------------------------------------------- FedExP
def test_fedexp_step_uses_m_eps_decayed_per_round_float64_oracle():
    """lr_scale of every round = max(1, sum p_i |D_i|^2 / (2 (|D|^2 + M eps_0 d^(t-1)))),
    recomputed in float64 from the round's updates."""
    eps0, decay = 0.05, 0.9  # large, so that eps decides eta_g
    cfg = SimulationConfig(algo="fedexp", hidden=(8,), clients=6, per_round=3, rounds=3, local_steps=3,
                           weighting="size", fedexp_eps=eps0, fedexp_scale_eps=True, fedexp_eps_decay=decay,
                           engine="sequential", seed=1)
    sim = Simulation(cfg)
    for r in (1, 2, 3):
        x_before = sim.x_global.detach().double().clone()
        rec = sim.run_round()
        C = len(rec["clients"])
        D = sim.updates[:C].double()
        p = sim.client_sizes[rec["clients"]].double()
        p = p / p.sum()
        mean_d = (p[:, None] * D).sum(0)
        ratio = (p * (D * D).sum(1)).sum() / (2 * ((mean_d * mean_d).sum() + C * eps0 * decay ** (r - 1)))
        eta = max(1.0, ratio.item())
        assert rec["lr_scale"] == pytest.approx(eta, rel=1e-5)
        assert torch.allclose(sim.x_global.double(), x_before - eta * mean_d, atol=1e-6)
        assert sim.server.optimizer.param_groups[0]["eps"] == pytest.approx(eps0 * decay ** (r - 1), rel=1e-12)


def _tiny(x_train, x_test, y_test=(1,)):
    """A one-feature dataset whose single client holds every training example."""
    xt = torch.tensor(x_train, dtype=torch.float32)[:, None]
    return FederatedDataset(name="tiny", x_train=xt, y_train=torch.zeros(len(x_train), dtype=torch.int64),
                            x_test=torch.tensor(x_test, dtype=torch.float32)[:, None],
                            y_test=torch.tensor(y_test, dtype=torch.int64), num_classes=2,
                            client_indices=[torch.arange(len(x_train))])


def _one_weight(w0=1.0):
    m = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        m.weight.fill_(w0)
    return m


def _sq_loss(out, y):
    """(w x - y)^2: gradient 2 w x^2 on a target 0."""
    return ((out[:, 0] - y.to(out.dtype)) ** 2).mean()


def test_the_mean_of_the_last_two_iterates_hand_computed():
    """FedAvg with one client, one full-batch step of lr 0.1 on (w x)^2 with x = 1: w_r =
    0.8^r.  Test point x = 2, target 1: the last iterate's loss is (2 w_r - 1)^2, the
    mean of the last two (2 (w_{r-1} + w_r)/2 - 1)^2 (round 1: the last iterate alone,
    as the authors' main.py:418-421)."""
    cfg = SimulationConfig(algo="fedavg", nar="none", clients=1, per_round=1, rounds=3, local_steps=1, batch_size=2,
                           lr=0.1, lr_decay=1.0, weight_decay=0.0, partition="natural", eval_avg_last_two=True,
                           engine="sequential")
    sim = Simulation(cfg, dataset=_tiny([1.0, 1.0], [2.0]), model=_one_weight(), loss_fn=_sq_loss)
    res = sim.run()
    last = [(2 * w - 1) ** 2 for w in (0.8, 0.64, 0.512)]
    avg2 = [(1.6 - 1) ** 2, (2 * 0.72 - 1) ** 2, (2 * 0.576 - 1) ** 2]  # (0.8 + 0.64)/2, (0.64 + 0.512)/2
    assert [r["test_loss"] for r in res.records[1:]] == pytest.approx(last, abs=1e-6)
    assert [r["test_loss_avg2"] for r in res.records[1:]] == pytest.approx(avg2, abs=1e-6)
    assert sim.x_global.item() == pytest.approx(0.512, abs=1e-7)  # the evaluation left the model as it was


def test_without_the_option_no_averaged_accuracy_is_recorded():
    cfg = SimulationConfig(algo="fedavg", nar="none", clients=1, per_round=1, rounds=2, local_steps=1, batch_size=2,
                           lr=0.1, partition="natural", engine="sequential")
    res = Simulation(cfg, dataset=_tiny([1.0, 1.0], [2.0]), model=_one_weight(), loss_fn=_sq_loss).run()
    assert not any("test_accuracy_avg2" in r for r in res.records)


# ---------------------------------------------------------------------------- local training
def _trainer(x_train, **local):
    model = _one_weight()
    xt = torch.tensor(x_train, dtype=torch.float32)[:, None]
    base = dict(batch_size=1, lr=0.1, lr_decay=1.0, weight_decay=0.0, nar="none", max_norm=1e9)
    base.update(local)
    return LocalTrainer(model, _sq_loss, xt, torch.zeros(len(x_train), dtype=torch.int64), LocalConfig(**base))


def _train(trainer, w_global, indices, round_index, client):
    x0 = torch.tensor([w_global])
    out = torch.empty(1)
    trainer.train(x0, torch.tensor(indices), round_index=round_index, seed=0, out_update=out,
                  stats=RoundStats(torch.device("cpu")), client=client)
    return w_global - out.item()  # x_end = x_global - D


def test_carried_momentum_two_rounds_hand_computed():
    """SGD momentum 0.5, lr 0.1, 2 steps; client A has x = 1 (gradient 2w), client B x = 2
    (gradient 8w).  Round 1: A from 1: b = 2, w = 0.8; b = 2.6, w = 0.54.  B from 1:
    b = 8, w = 0.2; b = 5.6, w = -0.36.  Round 2, A from 0.54 with ITS buffer 2.6:
    b = 2.38, w = 0.302; b = 1.794, w = 0.1226 (from zero: 0.432, then 0.2916)."""
    t = _trainer([1.0, 2.0], steps=2, momentum=0.5, carry_momentum=True)
    assert _train(t, 1.0, [0], 0, client=0) == pytest.approx(0.54, abs=1e-6)
    assert _train(t, 1.0, [1], 0, client=1) == pytest.approx(-0.36, abs=1e-6)
    assert _train(t, 0.54, [0], 1, client=0) == pytest.approx(0.1226, abs=1e-6)
    assert t.momentum_buffers[0][0].item() == pytest.approx(1.794, abs=1e-6)
    plain = _trainer([1.0, 2.0], steps=2, momentum=0.5)
    assert _train(plain, 1.0, [0], 0, client=0) == pytest.approx(0.54, abs=1e-6)
    assert _train(plain, 1.0, [1], 0, client=1) == pytest.approx(-0.36, abs=1e-6)
    assert _train(plain, 0.54, [0], 1, client=0) == pytest.approx(0.2916, abs=1e-6)


def test_carried_momentum_in_a_simulation_falls_back_to_the_sequential_engine_and_carries():
    """Two rounds through the simulator (one client, FedAvg lr 1): the same 0.54, 0.1226."""
    cfg = SimulationConfig(algo="fedavg", nar="none", clients=1, per_round=1, rounds=2, local_steps=2, batch_size=1,
                           lr=0.1, lr_decay=1.0, weight_decay=0.0, momentum=0.5, carry_momentum=True,
                           partition="natural", engine="batched")
    with pytest.warns(Warning, match="carry_momentum"):
        sim = Simulation(cfg, dataset=_tiny([1.0], [2.0]), model=_one_weight(), loss_fn=_sq_loss)
    assert sim.results.meta["engine"] == "sequential"
    sim.run_round()
    assert sim.x_global.item() == pytest.approx(0.54, abs=1e-6)
    sim.run_round()
    assert sim.x_global.item() == pytest.approx(0.1226, abs=1e-6)


def test_carried_momentum_survives_a_checkpoint(tmp_path):
    """3 rounds straight == 2 rounds, state_dict through torch.save/load(weights_only), 1 more (bitwise)."""
    cfg = SimulationConfig(hidden=(8,), clients=4, per_round=2, rounds=3, local_steps=3, momentum=0.9,
                           carry_momentum=True, engine="sequential")
    straight = Simulation(cfg)
    straight.run()
    first = Simulation(cfg)
    first.run(2)
    assert first.trainer.momentum_buffers  # something to carry
    torch.save(first.state_dict(), tmp_path / "ck.pt")
    resumed = Simulation(cfg)
    resumed.load_state_dict(torch.load(tmp_path / "ck.pt", weights_only=True))
    resumed.run()
    assert torch.equal(resumed.x_global, straight.x_global)
    lost = Simulation(cfg)  # the same checkpoint without the buffers gives another model
    state = first.state_dict()
    state["local_momentum"] = None
    lost.load_state_dict(state)
    lost.run()
    assert not torch.equal(lost.x_global, straight.x_global)


def test_feddecay_per_epoch_scaled_change_two_rounds_hand_computed():
    """Two samples with x = 1 (batch 1: 2 steps per epoch), 4 steps = 2 epochs, beta 0.5,
    lr 0.1 decayed 0.5 per round.  Round 1 from 1: epoch 0 at lr 0.1: 0.8, 0.64; epoch 1
    at lr 0.1: 0.512, 0.4096, change -0.2304 scaled by 0.5: 0.5248.  Round 2 (lr 0.05)
    from 0.5248: 0.5248 * 0.9^2 = 0.425088, then 0.425088 * 0.81 = 0.34432128, the
    change scaled by 0.5: 0.38470464.  Running epoch 1 at lr * beta instead gives
    0.64 * 0.9^2 = 0.5184 in round 1: the two agree only to first order."""
    common = dict(steps=4, lr_decay=0.5, decay_beta=0.5, decay_per="epoch")
    t = _trainer([1.0, 1.0], decay_scales_change=True, **common)
    w1 = _train(t, 1.0, [0, 1], 0, client=0)
    assert w1 == pytest.approx(0.5248, abs=1e-6)
    assert _train(t, w1, [0, 1], 1, client=0) == pytest.approx(0.38470464, abs=1e-6)
    by_lr = _trainer([1.0, 1.0], **common)
    assert _train(by_lr, 1.0, [0, 1], 0, client=0) == pytest.approx(0.5184, abs=1e-6)


def test_feddecay_scaled_change_closes_a_partial_last_epoch():
    """3 steps with 2 per epoch: epoch 1 has one step (0.64 -> 0.512), scaled by 0.5: 0.576."""
    t = _trainer([1.0, 1.0], steps=3, decay_beta=0.5, decay_per="epoch", decay_scales_change=True)
    assert _train(t, 1.0, [0, 1], 0, client=0) == pytest.approx(0.576, abs=1e-6)


def test_option_errors_name_the_setting():
    with pytest.raises(ConfigError, match="decay-scales-change .* needs decay-per epoch"):
        SimulationConfig(decay_scales_change=True).validate()
    with pytest.raises(ConfigError, match="fedexp-eps-decay must be > 0"):
        SimulationConfig(fedexp_eps_decay=0.0).validate()
    with pytest.raises(ConfigError, match="carry-momentum must be true or false"):
        SimulationConfig(carry_momentum=1).validate()
    t = _trainer([1.0], steps=1, momentum=0.5, carry_momentum=True)
    with pytest.raises(ValueError, match="carry_momentum needs the client's id"):
        _train(t, 1.0, [0], 0, client=None)
    assert math.isfinite(t.x.item())


# ---------------------------------------------------------------------------- held-out clients
def test_held_out_clients_never_train_and_are_scored_on_their_data():
    cfg = SimulationConfig(hidden=(8,), clients=10, per_round=4, rounds=6, local_steps=2, holdout_clients=2,
                           engine="sequential", seed=3)
    sim = Simulation(cfg)
    held = sim.holdout_clients
    assert len(held) == 2 and held == sorted(held)
    res = sim.run()
    trained = {c for r in res.records for c in r["clients"]}
    assert not trained & set(held)
    assert len(trained) > 4  # the sample still moves over the other clients
    # the oracle: the final global model on the held-out clients' data, computed here
    idx = torch.cat([sim.partition.client_indices[c] for c in held])
    x, y = sim.dataset.x_train[idx], sim.dataset.y_train[idx]
    sim.global_model.eval()
    with torch.no_grad():
        out = sim.global_model(x)
    assert res.records[-1]["holdout_accuracy"] == pytest.approx((out.argmax(1) == y).double().mean().item(), abs=1e-12)
    assert res.records[-1]["holdout_loss"] == pytest.approx(nn.functional.cross_entropy(out, y).item(), rel=1e-5)
    assert "holdout_accuracy" in res.records[0]


def test_no_hold_out_samples_as_before():
    from fedopt_kernels.fl import sample_clients

    sim = Simulation(SimulationConfig(hidden=(8,), clients=10, per_round=4, rounds=1, engine="sequential"))
    assert sim.holdout_clients == []
    assert [sim.sample_clients(r) for r in (1, 2, 3)] == [sample_clients(0, r, 10, 4) for r in (1, 2, 3)]
    with pytest.raises(ConfigError, match="per-round .4. cannot exceed the clients left for training"):
        SimulationConfig(clients=10, per_round=4, holdout_clients=7).validate()
