"""Issue 11, item 4: every default as its paper states it, one value across the server
classes, the simulator and the Flower strategies.

Each expected value below is written out with its source; the code's tables are what
is checked, never the oracle.  Aggregation results are checked against formulas
computed here from the round's raw updates (float64), not against the code's helpers.
"""

from __future__ import annotations

import inspect
import json
import math

import pytest
import torch
from torch import nn

from fedopt_kernels import server as S
from fedopt_kernels.fl import Simulation, SimulationConfig
from fedopt_kernels.fl.run.server_side import ServerSide

try:
    import flwr  # noqa: F401

    HAVE_FLWR = True
except ImportError:
    HAVE_FLWR = False

needs_flwr = pytest.mark.skipif(not HAVE_FLWR, reason="flwr is not installed: pip install fedopt_kernels[flower]")

# The aggregation weights each paper uses for the participating clients S.
PAPER_WEIGHTING = {
    "fedavg": "size",       # McMahan et al. 2017, Algorithm 1: w <- sum_k (n_k / n) w_k
    "fedprox": "size",      # Li et al. 2020, released code flearn/trainers/fedbase.py aggregate(): w = num samples
    "scaffold": "uniform",  # Karimireddy et al. 2020, Algorithm 1: (dx, dc) <- 1/|S| sum_{i in S}
    "fedavgm": "size",      # Hsu et al. 2019: momentum on FedAvg's (size-weighted) average
    "fedadam": "size",      # Reddi et al. 2021, released code optimization/shared/fed_avg_schedule.py:
    "fedyogi": "size",      # client_weight = num_examples (Algorithm 2 writes 1/|S| only for exposition)
    "fedadagrad": "size",   # idem
    "fedexp": "uniform",    # Jhunjhunwala et al. 2023, Algorithm 1: Delta = 1/|S| sum_i Delta_i
    "asnes": "uniform",     # [ASNES] eq. (2), Algorithm 1 line 13: nabla_t = 1/|S_t| sum_{n in S_t}
    "fedlaw": "size",       # [FedLAW] eq. (5), Algorithm 1 line 10: lambda_i = |D_i| / |D|
}

TINY = dict(dataset="digits", hidden=(16,), clients=8, per_round=4, rounds=1, local_steps=3, batch_size=16,
            lr=0.05, weight_decay=1e-3, seed=1, fedlaw_epochs=1)


pytestmark = pytest.mark.usefixtures("one_thread")


def fedexp_eta(D: torch.Tensor) -> float:
    """Jhunjhunwala et al. 2023 with uniform weights over the M = len(D) clients:
    eta_g = max(1, sum_i ||D_i||^2 / (2 M (||mean||^2 + eps))), eps = 1e-3."""
    mean = D.mean(0)
    return max(1.0, float((D * D).sum() / (2 * D.shape[0] * ((mean * mean).sum() + 1e-3))))


def asnes_gain_ratio(D: torch.Tensor) -> float:
    """[ASNES] eq. (3) over the S = len(D) participating clients, AdaScale's clamps:
    sigma2 >= 1e-6, nu2 >= 0 from the unclamped sigma2, r in [1, S]."""
    S = D.shape[0]
    mean = D.mean(0)
    Q = float((mean * mean).sum())
    sigma2 = float((D * D).sum()) / (S - 1) - S / (S - 1) * Q
    nu2 = Q - sigma2 / S
    sigma2, nu2 = max(sigma2, 1e-6), max(nu2, 0.0)
    return min(max((sigma2 + nu2) / (sigma2 / S + nu2), 1.0), S)


def _default(fn, name):
    return inspect.signature(fn).parameters[name].default


# --------------------------------------------------------------------------- the values themselves
def test_weighting_table_is_each_papers():
    assert S.ALGORITHM_WEIGHTING == PAPER_WEIGHTING
    for algo, rule in PAPER_WEIGHTING.items():
        assert S.resolve_weighting("auto", algo) == rule
        assert S.resolve_weighting("uniform", algo) == "uniform" and S.resolve_weighting("size", algo) == "size"
    assert SimulationConfig().weighting == "auto"
    with pytest.raises(ValueError, match="weighting"):
        S.resolve_weighting("by-loss", "fedavg")


def test_asnes_step_is_the_gain_ratio_everywhere():
    # [ASNES] eq. (3)-(4c): w <- w - eta_t v with eta_t = r itself, i.e. server lr 1;
    # beta = 0.9 (section 5.1, Fashion-MNIST)
    assert _default(S.ASNES.__init__, "lr") == 1.0 and _default(S.ASNES.__init__, "momentum") == 0.9
    assert S.ALGORITHMS["asnes"].defaults == dict(lr=1.0, momentum=0.9, smoothing=0.0)
    cfg = SimulationConfig(**{**TINY, "algo": "asnes"})
    model = nn.Linear(3, 2)
    side = ServerSide(cfg, model, torch.zeros(8))
    assert side.optimizer.param_groups[0]["lr"] == 1.0 and side.optimizer.param_groups[0]["momentum"] == 0.9


def test_fedadagrad_beta1_is_zero_everywhere():
    # Reddi et al. 2021 Algorithm 2 has beta1 in [0, 1); for FedAdagrad the released code runs
    # tf.keras.optimizers.Adagrad (no first moment: google-research/federated
    # utils/optimizers/optimizer_utils.py), and Flower's FedAdagrad fixes beta_1 = 0.
    assert _default(S.FedAdagrad.__init__, "momentum") == 0.0
    assert S.ALGORITHMS["fedadagrad"].defaults["momentum"] == 0.0
    cfg = SimulationConfig(**{**TINY, "algo": "fedadagrad"})
    assert cfg.server_betas[0] == 0.9  # FedAdam's beta1 no longer leaks into FedAdagrad
    side = ServerSide(cfg, nn.Linear(3, 2), torch.zeros(8))
    assert side.optimizer.param_groups[0]["momentum"] == 0.0


def test_fedlaw_defaults_are_the_papers():
    # [FedLAW] D.6: server-side Adam with betas=(0.5, 0.999); D.2: 10 samples per class (100)
    # drawn from the TEST set, the rest used to test
    assert _default(S.FedLAW.__init__, "betas") == (0.5, 0.999)
    cfg = SimulationConfig()
    assert cfg.proxy_source == "test" and cfg.proxy_size == 100
    assert (cfg.fedlaw_epochs, cfg.fedlaw_lr) == (_default(S.FedLAW.__init__, "server_epochs"),
                                                  _default(S.FedLAW.__init__, "lr"))


def _hyper(opt):
    return {k: v for k, v in opt.param_groups[0].items() if k != "params"}


@needs_flwr
@pytest.mark.parametrize("algo", [a for a in PAPER_WEIGHTING if a != "fedlaw"])
def test_one_value_per_hyperparameter_across_class_simulator_and_flower(algo):
    """The simulator's server (default config), the Flower strategy (no arguments) and the
    class (no arguments) hold the same hyperparameters."""
    from fedopt_kernels.integrations import flower as fk

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    side = ServerSide(SimulationConfig(algo=algo), model, torch.zeros(8))
    strategy = fk.make_strategy(algo, nn.Linear(3, 2), fraction_evaluate=0.0)
    cls = type(side.optimizer)
    plain = cls(nn.Linear(3, 2).parameters())
    assert type(strategy.optimizer) is cls
    assert _hyper(side.optimizer) == _hyper(strategy.optimizer) == _hyper(plain), algo
    assert strategy.weighting == PAPER_WEIGHTING[algo] == side.weighting


@needs_flwr
def test_fedlaw_strategy_defaults_match_the_class():
    """The strategy hands FedLAW's options through by name (no default of its own to
    drift): a strategy built without them has the class's defaults."""
    from fedopt_kernels.integrations import flower as fk

    own = inspect.signature(fk.FedLAW.__init__).parameters
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    proxy = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))]
    server = fk.FedLAW(model, proxy, torch.nn.functional.cross_entropy).server
    for name in ("learn", "server_epochs", "lr", "betas", "swa", "lr_step", "train_mode"):
        assert name not in own, name
        assert getattr(server, name) == _default(S.FedLAW.__init__, name), name


# --------------------------------------------------------------------------- one source, every entry point
# Issue 33, item 2: the values written out here with their sources (the oracle), then
# every entry point compared with them -- the simulator's config, the CLI's resolved
# settings and help texts, the Flower client without run-config keys, the FedNAR class.
PAPER_LOCAL = dict(
    steps=20,            # [FedNAR] section 3, Figure 2: (alpha, tau) = (0.3, 20)
    batch_size=32,       # the simulator's mini-batch
    lr=0.05,             # the simulator's digits scale of [FedNAR]'s 0.01 (fedopt_kernels/defaults.py)
    lr_decay=0.998,      # [FedNAR] Figure 2: "a decay for the local learning rate of 0.998 per round"
    weight_decay=1e-3,   # [FedNAR] Table 2's WD = 1e-3; not 0 (co-clipping would be gradient clipping)
    wd_decay=1.0,        # u_t = l_t wd anneals with the lr already
    max_norm=10.0,       # [FedNAR] Figure 2: "gradient clipping of max norm 10 as per [FedExP]"
    nar="co", momentum=0.0, decay_beta=1.0, decay_kind="exponential", decay_per="step",
)
SIM_FIELD = {"steps": "local_steps"}  # LocalConfig name -> SimulationConfig name where they differ


def test_defaults_module_holds_the_papers_values():
    from fedopt_kernels import defaults

    assert dict(defaults.LOCAL) == PAPER_LOCAL
    assert defaults.FEDPROX_MU == 0.01
    assert dict(defaults.ADAPTIVE) == dict(betas=(0.9, 0.99), tau=1e-3)
    assert {a: dict(v) for a, v in defaults.SERVER.items()} == {
        "fedavg": dict(lr=1.0), "fedavgm": dict(lr=1.0, momentum=0.9), "fedadam": dict(lr=0.01),
        "fedyogi": dict(lr=0.01), "fedadagrad": dict(lr=0.1, momentum=0.0), "fedexp": dict(lr=1.0),
        "asnes": dict(lr=1.0, momentum=0.9)}


# The registry's defaults, read from each class, written out with their sources: lr and
# momentum as above; betas (0.9, 0.99) and tau 1e-3 [Reddi] section 5; FedExP's eps 1e-3
# [FedExP] section 5; FedLAW's [FedLAW] released code / D.6 (see test_fedlaw_defaults_are_the_papers).
PAPER_SERVER = {
    "fedavg": dict(lr=1.0, gamma=1.0), "fedprox": dict(lr=1.0, gamma=1.0), "scaffold": dict(lr=1.0, gamma=1.0),
    "fedavgm": dict(lr=1.0, momentum=0.9, nesterov=False),
    "fedadam": dict(lr=0.01, betas=(0.9, 0.99), tau=1e-3), "fedyogi": dict(lr=0.01, betas=(0.9, 0.99), tau=1e-3),
    "fedadagrad": dict(lr=0.1, momentum=0.0, tau=1e-3),
    "fedexp": dict(lr=1.0, eps=1e-3, scale_eps_by_clients=False),
    "asnes": dict(lr=1.0, momentum=0.9, smoothing=0.0),
    "fedlaw": dict(learn="both", server_epochs=20, lr=0.01, betas=(0.5, 0.999), swa=False, swa_start=5, swa_lr=0.05,
                   lr_step=(20, 0.5), train_mode=True),
}


def test_registry_defaults_are_read_from_each_class_and_are_the_papers():
    assert set(S.ALGORITHMS) == set(PAPER_SERVER) == set(PAPER_WEIGHTING)
    for name, algo in S.ALGORITHMS.items():
        assert algo.defaults == PAPER_SERVER[name], name
        assert algo.weighting == PAPER_WEIGHTING[name] and algo.source, name
    # a class whose default changes changes the registry: nothing else holds the value
    assert S.ALGORITHMS["fedprox"].cls is S.ALGORITHMS["scaffold"].cls is S.FedAvg


def test_simulator_builds_each_algorithm_from_the_registry_with_the_configs_values():
    cfg = SimulationConfig(**{**TINY, "algo": "fedadam", "server_lr": 0.3, "server_tau": 0.02,
                              "server_momentum": 0.5})  # fedadam has no momentum: ignored
    side = ServerSide(cfg, nn.Linear(3, 2), torch.zeros(8))
    assert type(side.server) is S.FedAdam
    assert side.hyper == dict(lr=0.3, betas=(0.9, 0.99), tau=0.02)
    assert _hyper(side.optimizer) == dict(lr=0.3, betas=(0.9, 0.99), tau=0.02)
    side = ServerSide(SimulationConfig(**{**TINY, "algo": "fedavgm", "server_momentum": 0.5}), nn.Linear(3, 2),
                      torch.zeros(8))
    assert _hyper(side.optimizer) == dict(lr=1.0, momentum=0.5, nesterov=False)


def _cli_settings(command, argv=()):
    from fedopt_kernels.cli import build_parser
    from fedopt_kernels.cli._options import build_settings

    args = build_parser().parse_args([command, *argv])
    vars(args).pop("distributed", None)  # a run option that run_simulate takes off first
    return build_settings(args)[0]


def _help_defaults(command):
    """``{dest: text}`` of every ``(default X)`` in ``fedopt <command> --help``."""
    import re

    from fedopt_kernels.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices[command]
    out = {}
    for action in sub._actions:
        m = re.search(r"\(default ([^):]+)\)\s*$", action.help or "")
        if m and action.dest in SimulationConfig.field_names():
            out[action.dest] = m.group(1)
    return out


def _same(text, value):
    if isinstance(value, bool):
        return text == str(value).lower()
    if isinstance(value, tuple):
        return [float(t) if isinstance(v, float) else int(t) for t, v in zip(text.split(","), value)] == list(value)
    if isinstance(value, float):
        return float(text) == value
    return text == str(value)


@needs_flwr
def test_one_value_per_local_hyperparameter_at_every_entry_point():
    from flwr.app import Context, RecordDict

    from fedopt_kernels.fl import LocalConfig
    from fedopt_kernels.integrations import flower as fk
    from fedopt_kernels.optim import FedNAR

    sim_cfg = SimulationConfig()
    cli_cfgs = {c: _cli_settings(c) for c in ("simulate", "compare")}
    client = fk.FedNARClient(model_fn=lambda ctx: nn.Linear(2, 2), data_fn=lambda ctx: None)
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    flower_cfg = client._local_config(ctx)  # what a Flower client trains with when the run config is silent
    sim = Simulation(SimulationConfig(**{**TINY, "lr": sim_cfg.lr, "weight_decay": sim_cfg.weight_decay}))
    for name, want in PAPER_LOCAL.items():
        field = SIM_FIELD.get(name, name)
        assert getattr(sim_cfg, field) == want, ("SimulationConfig", name)
        for command, cfg in cli_cfgs.items():
            assert getattr(cfg, field) == want, (command, name)
        assert getattr(LocalConfig(), name) == want, ("LocalConfig", name)
        assert getattr(flower_cfg, name) == want, ("FedNARClient", name)
        assert getattr(fk.local_config_from_run_config({}), name) == want, ("run config", name)
        if name not in ("steps", "batch_size", "lr", "weight_decay"):  # TINY sets those
            assert getattr(sim.local, name) == want, ("Simulation.local", name)
    # the FedNAR class: lr is required (torch.optim's convention), the rest as above
    assert _default(FedNAR.__init__, "weight_decay") == PAPER_LOCAL["weight_decay"]
    assert _default(FedNAR.__init__, "max_norm") == PAPER_LOCAL["max_norm"]
    assert _default(FedNAR.__init__, "mode") == PAPER_LOCAL["nar"]
    assert _default(FedNAR.__init__, "momentum") == PAPER_LOCAL["momentum"]
    # FedProx's mu: the simulator's (applied under --algo fedprox only); a client's is 0 unless told
    assert sim_cfg.prox_mu == 0.01 and flower_cfg.prox_mu == 0.0 and sim.local.prox_mu == 0.0


def test_cli_help_states_the_defaults_the_run_uses():
    for command in ("simulate", "compare"):
        stated = _help_defaults(command)
        assert {"lr", "lr_decay", "weight_decay", "max_norm", "local_steps", "prox_mu", "server_betas",
                "fedlaw_epochs", "proxy_size"} <= set(stated), command
        resolved = _cli_settings(command)
        for dest, text in stated.items():
            if getattr(resolved, dest) is None:  # "the algorithm's own" (server_momentum): the class's
                continue
            assert _same(text, getattr(resolved, dest)), (command, dest, text, getattr(resolved, dest))


@needs_flwr
@pytest.mark.parametrize("algo", ["fedadam", "fedyogi"])
def test_adaptive_betas_and_tau_agree(algo):
    from fedopt_kernels.integrations import flower as fk

    side = ServerSide(SimulationConfig(algo=algo), nn.Linear(3, 2), torch.zeros(8))
    strategy = fk.make_strategy(algo, nn.Linear(3, 2), fraction_evaluate=0.0)
    plain = getattr(S, type(side.optimizer).__name__)(nn.Linear(3, 2).parameters())
    for opt in (side.optimizer, strategy.optimizer, plain):
        assert opt.param_groups[0]["betas"] == (0.9, 0.99) and opt.param_groups[0]["tau"] == 1e-3


# --------------------------------------------------------------------------- the simulator's weighting
@pytest.mark.parametrize("algo", list(PAPER_WEIGHTING))
def test_simulation_records_the_resolved_weighting_in_results_json(algo, tmp_path):
    sim = Simulation(SimulationConfig(**{**TINY, "algo": algo}))
    res = sim.run()
    json_path, _ = res.write(tmp_path)
    data = json.loads(json_path.read_text())
    assert data["meta"]["weighting"] == PAPER_WEIGHTING[algo]
    assert data["config"]["weighting"] == "auto"
    forced = Simulation(SimulationConfig(**{**TINY, "algo": algo, "weighting": "uniform", "rounds": 1}))
    assert forced.results.meta["weighting"] == "uniform"


def _one_round(algo, **changes):
    """``(sim, x_before, D [C, N] float64, sizes [C] float64)`` of round 1."""
    sim = Simulation(SimulationConfig(**{**TINY, "algo": algo, **changes}))
    x0 = sim.x_global.detach().clone().double()
    rec = sim.run_round()
    D = sim.updates[:len(rec["clients"])].detach().clone().double()
    sizes = torch.tensor([float(sim.partition.sizes[c]) for c in rec["clients"]], dtype=torch.float64)
    assert sizes.unique().numel() > 1, "the test needs clients of different sizes"
    return sim, x0, D, sizes, rec


def _size_mean(D, sizes):
    return (sizes / sizes.sum()) @ D


@pytest.mark.parametrize("algo", ["fedavg", "fedprox"])
def test_fedavg_family_weights_the_clients_by_data_size(algo):
    sim, x0, D, sizes, _ = _one_round(algo)
    want = x0 - _size_mean(D, sizes)  # server lr 1
    uniform = x0 - D.mean(0)
    assert (want - uniform).abs().max() > 1e-4  # the two rules really differ here
    torch.testing.assert_close(sim.x_global.double(), want, rtol=0, atol=2e-6)


def test_weighting_uniform_overrides_fedavg():
    sim, x0, D, sizes, _ = _one_round("fedavg", weighting="uniform")
    torch.testing.assert_close(sim.x_global.double(), x0 - D.mean(0), rtol=0, atol=2e-6)


def test_scaffold_averages_uniformly():
    sim, x0, D, sizes, _ = _one_round("scaffold")
    assert (_size_mean(D, sizes) - D.mean(0)).abs().max() > 1e-4
    torch.testing.assert_close(sim.x_global.double(), x0 - D.mean(0), rtol=0, atol=2e-6)


def test_fedexp_averages_uniformly():
    sim, x0, D, sizes, rec = _one_round("fedexp")
    eta = fedexp_eta(D)
    assert rec["lr_scale"] == pytest.approx(eta, rel=1e-5)
    torch.testing.assert_close(sim.x_global.double(), x0 - eta * D.mean(0), rtol=0, atol=5e-6)


def test_asnes_averages_uniformly_with_S_the_participating_clients_and_steps_r():
    sim, x0, D, sizes, rec = _one_round("asnes")
    S_t = D.shape[0]  # the clients of this round (not the federation's 8)
    assert S_t == 4 < sim.config.clients
    r = asnes_gain_ratio(D)  # S = the S_t rows of D
    assert rec["gain_ratio"] == pytest.approx(r, rel=1e-5)
    # eq. (4a)-(4c) from u = 0 with beta = 0.9 and eta_t = r: w <- w - r (0.9 D + D)
    torch.testing.assert_close(sim.x_global.double(), x0 - r * 1.9 * D.mean(0), rtol=0, atol=5e-6)


# --------------------------------------------------------------------------- buffers
class BNNet(nn.Module):
    """Linear - BatchNorm - ReLU - Linear: a model with buffers (digits' 8x8 images into
    10 classes by default)."""

    def __init__(self, inputs=64, hidden=12, classes=10):
        super().__init__()
        self.fc1 = nn.Linear(inputs, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x.flatten(1)))))


def _bn_round(algo, **changes):
    cfg = SimulationConfig(**{**TINY, "algo": algo, "engine": "sequential", "proxy_size": 60, **changes})
    sim = Simulation(cfg, model=BNNet)
    before = {k: v.clone() for k, v in sim.global_model.named_buffers()}
    rec = sim.run_round()
    C = len(rec["clients"])
    rows = sim.buffer_rows[:C].detach().clone().double()  # each client's final (running_mean, running_var)
    sizes = torch.tensor([float(sim.partition.sizes[c]) for c in rec["clients"]], dtype=torch.float64)
    return sim, before, rows, sizes, rec


def _global_buffers(sim):
    return torch.cat([sim.global_model.bn.running_mean, sim.global_model.bn.running_var]).double()


@pytest.mark.parametrize("algo, rule", [("fedavg", "size"), ("fedadam", "size"), ("asnes", "uniform")])
def test_buffers_are_weighted_like_the_parameters(algo, rule):
    sim, _, rows, sizes, _ = _bn_round(algo)
    p = sizes / sizes.sum() if rule == "size" else torch.full_like(sizes, 1 / sizes.numel())
    other = torch.full_like(sizes, 1 / sizes.numel()) if rule == "size" else sizes / sizes.sum()
    assert ((p - other) @ rows).abs().max() > 1e-4
    torch.testing.assert_close(_global_buffers(sim), p @ rows, rtol=0, atol=1e-6)


def test_fedlaw_keeps_the_buffers_of_its_proxy_training():
    """One server epoch over a proxy set of one batch: FedLAW's only forward is the model
    sum_i lambda0_i w_i (lambda0 = data sizes, gamma = 1) in train mode on the proxy
    batch, so BN's running statistics move once from the pre-round ones (momentum 0.1)."""
    sim, before, rows, sizes, rec = _bn_round("fedlaw")
    C = len(rec["clients"])
    W = sim.updates[:C].detach().double()  # FedLAW turned the updates into the client models w_i
    w = (sizes / sizes.sum()) @ W
    names = [n for n, _ in sim.global_model.named_parameters()]
    shapes = [p.shape for _, p in sim.global_model.named_parameters()]
    params, o = {}, 0
    for n, s in zip(names, shapes):
        k = math.prod(s)
        params[n] = w[o:o + k].view(s)
        o += k
    x = torch.cat([xb for xb, _ in sim.server.fedlaw.proxy_loader]).double()
    assert x.shape[0] == 60  # one batch of 128 at most
    h = x.flatten(1) @ params["fc1.weight"].T + params["fc1.bias"]
    mean, var = h.mean(0), h.var(0, unbiased=True)
    want = torch.cat([0.9 * before["bn.running_mean"].double() + 0.1 * mean,
                      0.9 * before["bn.running_var"].double() + 0.1 * var])
    got = _global_buffers(sim)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (got - (sizes / sizes.sum()) @ rows).abs().max() > 1e-3  # not a client average


# --------------------------------------------------------------------------- FedLAW's proxy set
def test_fedlaw_proxy_is_held_out_of_the_test_set():
    sim = Simulation(SimulationConfig(**{**TINY, "algo": "fedlaw"}))
    ds = sim.dataset
    proxy, rest = sim.proxy_indices, sim.eval_indices
    # [FedLAW] D.2: class-balanced, 10 per class for 100 samples, from the test set
    assert proxy.numel() == 100 and torch.bincount(ds.y_test[proxy].cpu(), minlength=10).tolist() == [10] * 10
    assert not set(proxy.tolist()) & set(rest.tolist())
    assert sorted(proxy.tolist() + rest.tolist()) == list(range(ds.num_test))
    # the loader serves exactly those test examples
    xs = torch.cat([xb for xb, _ in sim.server.fedlaw.proxy_loader])
    proxy_rows = {tuple(r.tolist()) for r in xs.flatten(1)}
    assert proxy_rows == {tuple(r.tolist()) for r in ds.x_test[proxy].flatten(1)}
    # ... none of which any client trains on
    train_rows = {tuple(r.tolist()) for ix in sim.partition.client_indices for r in ds.x_train[ix].flatten(1)}
    assert not proxy_rows & train_rows
    # evaluation: the remaining test examples only
    assert sim.results.meta["num_test"] == ds.num_test - 100
    assert sim.results.meta["proxy"] == {"source": "test", "size": 100, "held_out_of_test": True}
    acc, loss = sim.evaluate()
    with torch.no_grad():
        out = sim.global_model(ds.x_test[rest])
        want_acc = (out.argmax(1) == ds.y_test[rest]).double().mean().item()
        want_loss = nn.functional.cross_entropy(out.double(), ds.y_test[rest]).item()
    assert acc == pytest.approx(want_acc, abs=1e-12) and loss == pytest.approx(want_loss, rel=1e-5)


def test_fedlaw_train_side_proxy_stays_an_option():
    sim = Simulation(SimulationConfig(**{**TINY, "algo": "fedlaw", "proxy_source": "train"}))
    assert sim.eval_indices is None and sim.results.meta["num_test"] == sim.dataset.num_test
    xs = torch.cat([xb for xb, _ in sim.server.fedlaw.proxy_loader])
    assert xs.shape[0] == 100
    train_rows = {tuple(r.tolist()) for r in sim.dataset.x_train.flatten(1)}
    assert all(tuple(r.tolist()) in train_rows for r in xs.flatten(1))


def test_proxy_settings_are_checked():
    from fedopt_kernels.fl import ConfigError

    with pytest.raises(ConfigError, match="proxy-source"):
        SimulationConfig(proxy_source="validation").validate()
    with pytest.raises(ConfigError, match="proxy-size"):
        Simulation(SimulationConfig(**{**TINY, "algo": "fedlaw", "proxy_size": 5000}))


# --------------------------------------------------------------------------- SCAFFOLD and NaN clients
def test_scaffold_nan_client_never_reaches_the_control_variates_in_the_simulator():
    cfg = SimulationConfig(**{**TINY, "algo": "scaffold", "rounds": 2})
    sim = Simulation(cfg)
    sim.run_round()  # a normal round first: c and some c_i are non-zero
    c_old, ci_old = sim.scaffold.c.clone().double(), sim.scaffold.c_clients.clone().double()
    assert c_old.abs().max() > 0
    real = sim._train_clients
    bad = 1

    def train_then_poison(round_number, clients):
        stats = real(round_number, clients)
        sim.updates[bad, 3] = float("nan")
        return stats

    sim._train_clients = train_then_poison
    rec = sim.run_round()
    assert rec["excluded_clients"] == 1
    clients = rec["clients"]
    D = sim.updates[:len(clients)].detach().double()
    lr_sum = cfg.lr * cfg.lr_decay ** 1 * cfg.local_steps  # round 2: lr_0 * 0.998, K steps, no FedDecay
    want_c, want_ci = c_old.clone(), ci_old.clone()
    for row, cid in enumerate(clients):
        if row == bad:
            continue
        delta = D[row] / lr_sum - c_old  # option II: c_i^+ - c_i
        want_ci[cid] += delta
        want_c += delta / cfg.clients
    assert torch.isfinite(sim.scaffold.c).all() and torch.isfinite(sim.scaffold.c_clients).all()
    torch.testing.assert_close(sim.scaffold.c.double(), want_c, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(sim.scaffold.c_clients.double(), want_ci, rtol=1e-5, atol=1e-7)
    assert torch.equal(sim.scaffold.c_clients[clients[bad]].double(), ci_old[clients[bad]])


def _flower_replies(model, C, *, nan_client=None, sizes=None, lr_sums=None, seed=0):
    from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedopt_kernels.integrations import flower as fk

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    g = torch.Generator().manual_seed(seed)
    out, states = [], []
    for c in range(C):
        sd = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
        if c == nan_client:
            first = next(iter(sd))
            sd[first] = sd[first].clone()
            sd[first].view(-1)[0] = float("nan")
        states.append(sd)
        metrics = {"num-examples": int(sizes[c]) if sizes is not None else 10 * (c + 1)}
        if lr_sums is not None:
            metrics["lr_sum"] = float(lr_sums[c])
        content = RecordDict({"arrays": fk.tensors_to_arrayrecord(sd.items()), "metrics": MetricRecord(metrics),
                              "fedopt": ConfigRecord({"partition-id": c})})
        ins = Message(content=RecordDict(), message_type=MessageType.TRAIN, dst_node_id=700 - c)
        out.append(Message(content=content, reply_to=ins))
    return out, states


def _flat(sd, model):
    return torch.cat([sd[n].detach().double().flatten() for n, _ in model.named_parameters()])


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


@needs_flwr
def test_scaffold_nan_client_never_reaches_the_control_variate_in_the_strategy():
    from fedopt_kernels.integrations import flower as fk

    M, C = 10, 4
    lr_sums = [0.5, 0.4, 0.3, 0.2]
    replies, states = _flower_replies(_net(), C, nan_client=2, lr_sums=lr_sums)
    s = fk.make_strategy("scaffold", _net(), scaffold_num_clients=M, fraction_evaluate=0.0)
    s.load_global_arrays(fk.model_to_arrayrecord(_net()))
    c0 = torch.linspace(-0.01, 0.02, s.c.numel(), dtype=s.c.dtype)
    s.c.copy_(c0)
    x = s.x_global.detach().clone().double()
    _, metrics = s.aggregate_train(1, replies)
    assert metrics["excluded_clients"] == 1
    want = c0.double().clone()
    for i in range(C):
        if i == 2:
            continue
        want += ((x - _flat(states[i], _net())) / lr_sums[i] - c0.double()) / M  # option II, D_i = x - y_i
    assert torch.isfinite(s.c).all()
    torch.testing.assert_close(s.c.double(), want, rtol=1e-5, atol=1e-7)


@needs_flwr
def test_strategy_needs_the_federation_size_for_scaffold():
    from flwr.serverapp.exception import AggregationError

    from fedopt_kernels.integrations import flower as fk

    replies, _ = _flower_replies(_net(), 2, lr_sums=[0.1, 0.1])
    s = fk.make_strategy("scaffold", _net(), fraction_evaluate=0.0)
    s.load_global_arrays(fk.model_to_arrayrecord(_net()))
    x = s.x_global.clone()
    with pytest.raises(AggregationError, match="scaffold_num_clients"):
        s.aggregate_train(1, replies)
    assert torch.equal(s.x_global, x)  # refused before anything changed


# --------------------------------------------------------------------------- Flower: the same auto rule
def _fedlaw_kwargs():
    x = torch.randn(8, 6)
    return dict(proxy_loader=[(x, torch.randint(0, 3, (8,)))], loss_fn=nn.CrossEntropyLoss(), server_epochs=1)


@needs_flwr
@pytest.mark.parametrize("algo", list(PAPER_WEIGHTING))
def test_flower_strategies_resolve_auto_as_the_simulator(algo):
    from fedopt_kernels.integrations import flower as fk

    kw = _fedlaw_kwargs() if algo == "fedlaw" else {}
    assert fk.make_strategy(algo, _net(), fraction_evaluate=0.0, **kw).weighting == PAPER_WEIGHTING[algo]
    for forced in ("size", "uniform"):
        kw = _fedlaw_kwargs() if algo == "fedlaw" else {}
        assert fk.make_strategy(algo, _net(), weighting=forced, fraction_evaluate=0.0, **kw).weighting == forced
    with pytest.raises(ValueError, match="weighting"):
        fk.make_strategy("fedavg", _net(), weighting="loss")


@needs_flwr
@pytest.mark.parametrize("algo", ["fedavg", "scaffold", "fedexp", "asnes"])
def test_flower_aggregation_weights_follow_the_rule(algo):
    from fedopt_kernels.integrations import flower as fk

    C = 4
    sizes = [5, 40, 12, 90]
    replies, states = _flower_replies(_net(), C, sizes=sizes, lr_sums=[0.1] * C)
    s = fk.make_strategy(algo, _net(), fraction_evaluate=0.0, scaffold_num_clients=8)
    s.load_global_arrays(fk.model_to_arrayrecord(_net()))
    x = s.x_global.detach().clone().double()
    D = torch.stack([x - _flat(st, _net()) for st in states])
    n = torch.tensor(sizes, dtype=torch.float64)
    size_mean, uniform_mean = (n / n.sum()) @ D, D.mean(0)
    assert (size_mean - uniform_mean).abs().max() > 1e-3
    _, metrics = s.aggregate_train(1, replies)
    if algo == "fedavg":
        want = x - size_mean
    elif algo == "scaffold":
        want = x - uniform_mean
    elif algo == "fedexp":
        want = x - fedexp_eta(D) * uniform_mean
    else:  # asnes: gain ratio from eq. (3) with S = 4 participating clients, step r (0.9 + 1) mean
        r = asnes_gain_ratio(D)
        assert metrics["gain_ratio"] == pytest.approx(r, rel=1e-5)
        want = x - r * 1.9 * uniform_mean
    torch.testing.assert_close(s.x_global.double(), want, rtol=0, atol=5e-6)


def _bn_net():
    torch.manual_seed(0)
    return BNNet(inputs=6, hidden=5, classes=3)


@needs_flwr
@pytest.mark.parametrize("algo, rule", [("fedavg", "size"), ("fedexp", "uniform")])
def test_flower_buffers_are_weighted_like_the_parameters(algo, rule):
    from fedopt_kernels.integrations import flower as fk

    sizes = [5, 40, 12, 90]
    replies, states = _flower_replies(_bn_net(), 4, sizes=sizes)
    s = fk.make_strategy(algo, _bn_net(), fraction_evaluate=0.0)
    s.load_global_arrays(fk.model_to_arrayrecord(_bn_net()))
    s.aggregate_train(1, replies)
    n = torch.tensor(sizes, dtype=torch.float64)
    p = n / n.sum() if rule == "size" else torch.full((4,), 0.25, dtype=torch.float64)
    for name in ("bn.running_mean", "bn.running_var"):
        rows = torch.stack([st[name].double() for st in states])
        torch.testing.assert_close(getattr(s.model.bn, name.split(".")[1]).double(), p @ rows, rtol=0, atol=1e-6)
    assert s.model.bn.num_batches_tracked.item() == 0  # integer buffers keep the server's


@needs_flwr
def test_flower_fedlaw_keeps_the_buffers_of_its_proxy_training():
    from fedopt_kernels.integrations import flower as fk

    sizes = [5, 40, 12]
    replies, states = _flower_replies(_bn_net(), 3, sizes=sizes)
    g = torch.Generator().manual_seed(5)
    xp = torch.randn(16, 6, generator=g)
    loader = [(xp, torch.randint(0, 3, (16,), generator=g))]
    s = fk.make_strategy("fedlaw", _bn_net(), proxy_loader=loader, loss_fn=nn.CrossEntropyLoss(), server_epochs=1,
                         fraction_evaluate=0.0)
    s.load_global_arrays(fk.model_to_arrayrecord(_bn_net()))
    before = {k: v.clone().double() for k, v in s.model.named_buffers()}
    s.aggregate_train(1, replies)
    # the one proxy forward: fc1 of sum_i (n_i / n) w_i, in train mode, BN momentum 0.1
    n = torch.tensor(sizes, dtype=torch.float64)
    lam = n / n.sum()
    W1 = sum(l * st["fc1.weight"].double() for l, st in zip(lam, states))
    b1 = sum(l * st["fc1.bias"].double() for l, st in zip(lam, states))
    h = xp.double() @ W1.T + b1
    torch.testing.assert_close(s.model.bn.running_mean.double(),
                               0.9 * before["bn.running_mean"] + 0.1 * h.mean(0), rtol=0, atol=1e-6)
    torch.testing.assert_close(s.model.bn.running_var.double(),
                               0.9 * before["bn.running_var"] + 0.1 * h.var(0, unbiased=True), rtol=0, atol=1e-6)
    client_mean = lam @ torch.stack([st["bn.running_mean"].double() for st in states])
    assert (s.model.bn.running_mean.double() - client_mean).abs().max() > 1e-3
