"""The Flower strategies' ``dp_*`` arguments (``fedopt simulate``'s ``--dp-*`` names):
a strategy with them runs the simulator's DP-FedAvg round (its mechanism and
accountant, fl/run/privacy.py), bit for bit, with and without noise; the round's metrics
carry epsilon as dp-accounting computes it; settings that void the guarantee are
refused with the simulator's reasons, naming the argument."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from _flwr import needs_flwr

pytestmark = needs_flwr
dp_accounting = pytest.importorskip("dp_accounting",
                                    reason="needs the privacy extra: pip install fedopt_kernels[privacy]")

SHAPES = [(31, 17), (17,), (5, 3, 3)]
M = 6  # replies per round


def _replies(seed=3):
    """M replies whose update norms spread around their median (some clipped, some not)."""
    from fedopt_kernels.benchmarks import flower_dp as B

    g, replies = B.equal_weight_replies(SHAPES, M, seed=seed, scale=0.1)
    x0 = B.flat_arrays(g)
    for i, r in enumerate(replies):
        arrays, offset = r.content["arrays"], 0
        for key in list(arrays.keys()):
            a = torch.from_numpy(arrays[key].numpy())
            u = (a.flatten() - x0[offset:offset + a.numel()]) * (0.25 + 0.5 * i)
            arrays[key] = type(arrays[key])((x0[offset:offset + a.numel()] + u).reshape(a.shape).numpy())
            offset += a.numel()
    return B, g, replies


def _strategy(**dp):
    from fedopt_kernels.benchmarks.flower import ShapesModel
    from fedopt_kernels.integrations import flower as fk

    return fk.FedAvg(ShapesModel(SHAPES), lr=1.0, fraction_evaluate=0.0, weighting="uniform", **dp)


def _simulator_round(config_kw, x, client_models, rounds):
    """The simulator's DP round (fl/run/privacy.py's RoundPrivacy on a FedAvg server through
    the one ServerRound) on ``D_i = x - x_i``, ``rounds`` times; its x and records."""
    from fedopt_kernels import server as S
    from fedopt_kernels.fl import SimulationConfig
    from fedopt_kernels.fl.run.privacy import RoundPrivacy

    cfg = SimulationConfig(algo="fedavg", weighting="uniform", **config_kw).validate()
    p = torch.nn.Parameter(x.clone())
    opt = S.FedAvg([p], lr=1.0)
    privacy = RoundPrivacy(cfg, SimpleNamespace(optimizer=opt))
    rnd = S.ServerRound(opt, "uniform", None)
    records = []
    for _ in range(rounds):
        D = p.detach() - client_models
        rnd.step(D, None)
        records.append(privacy.record())
    return p.detach(), records


CASES = {  # (strategy dp_* arguments, the simulator's config for the same mechanism)
    "fixed clip, no noise": ({}, {}),
    "fixed clip, noise, every node": (dict(dp_noise_multiplier=1.1, dp_delta=1e-2),
                                      dict(dp_noise_multiplier=1.1, dp_delta=1e-2)),
    "fixed clip, noise, half the nodes": (dict(dp_noise_multiplier=0.8, dp_delta=1e-3, fraction_train=0.5, n=2 * M),
                                          dict(dp_noise_multiplier=0.8, dp_delta=1e-3, clients=2 * M)),
    "adaptive clip, no noise": (dict(dp_target_quantile=0.5), dict(dp_target_quantile=0.5)),
    "adaptive clip, noise": (dict(dp_target_quantile=0.3, dp_noise_multiplier=0.5, dp_delta=1e-2),
                             dict(dp_target_quantile=0.3, dp_noise_multiplier=0.5, dp_delta=1e-2)),
}


@pytest.mark.parametrize("read_in_place", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_a_strategy_with_dp_arguments_is_the_simulators_dp_round(case, read_in_place):
    """Three rounds on the same replies: the new global model bit for bit (noise 0 and
    noise > 0: the same seeded draws), and dp_clip / dp_noise_std /
    dp_unclipped_fraction / dp_epsilon in the round's metrics equal to the simulator's
    records."""
    B, g, replies = _replies()
    x0 = B.flat_arrays(g)
    models = torch.stack([B.flat_arrays(r.content["arrays"]) for r in replies])
    norms = (models.double() - x0.double()).norm(dim=1)
    clip = float(norms.median())
    ours, theirs = (dict(d) for d in CASES[case])
    n = ours.pop("n", M)
    ours.update(dp_clip=clip, dp_num_clients=n, dp_seed=5, read_in_place=read_in_place)
    theirs.update(dp_clip=clip, clients=theirs.pop("clients", M), per_round=M, seed=5)
    strategy = _strategy(**ours)
    assert strategy.dp_clients_per_round == M
    strategy.load_global_arrays(g)
    metrics = []
    for r in range(1, 4):
        _, agg = strategy.aggregate_train(r, replies)
        metrics.append(agg)
    x_sim, records = _simulator_round(theirs, x0, models, 3)
    assert torch.equal(strategy.x_global, x_sim)
    assert not torch.equal(x_sim, x0)
    for agg, rec in zip(metrics, records):
        assert set(rec) <= set(agg.keys())
        for key, value in rec.items():
            assert agg[key] == value, key
    if "noise" in case and "no noise" not in case:
        assert 0 < metrics[0]["dp_epsilon"] < metrics[1]["dp_epsilon"] < metrics[2]["dp_epsilon"]
        assert metrics[0]["dp_noise_std"] > 0
    else:
        assert "dp_epsilon" not in metrics[0].keys() and metrics[0]["dp_noise_std"] == 0
    # the clip of round 1 is the one given; adaptive: the next moved by exp(-0.2 (b_bar - gamma))
    assert metrics[0]["dp_clip"] == clip
    if "adaptive" in case:
        gamma = ours["dp_target_quantile"]
        b = metrics[0]["dp_unclipped_fraction"]
        assert metrics[1]["dp_clip"] == pytest.approx(clip * torch.exp(torch.tensor(-0.2 * (b - gamma),
                                                                                     dtype=torch.float64)).item(),
                                                      rel=1e-12)


def test_without_noise_the_dp_round_is_the_clipped_mean_in_float64():
    """The oracle of the noiseless round, independent of the simulator:
    ``x - (1/m) sum_i min(1, C / (||D_i|| + 1e-6)) D_i``, within fp32 rounding."""
    B, g, replies = _replies()
    x0 = B.flat_arrays(g).double()
    U = torch.stack([B.flat_arrays(r.content["arrays"]).double() for r in replies]) - x0
    clip = float(U.norm(dim=1).median())
    strategy = _strategy(dp_clip=clip, dp_num_clients=M)
    strategy.load_global_arrays(g)
    strategy.aggregate_train(1, replies)
    factors = torch.clamp(clip / (U.norm(dim=1) + 1e-6), max=1.0)
    want = x0 + (factors[:, None] * U).sum(0) / M
    tol = (M + 4) * 2.0 ** -24 * (x0.abs() + U.abs().max(0).values)
    assert bool(((strategy.x_global.double() - want).abs() <= tol).all())
    assert 0 < int((factors < 1).sum()) < M


@pytest.mark.parametrize("fraction_train,n", [(1.0, M), (0.5, 2 * M), (0.25, 4 * M)])
def test_epsilon_in_the_metrics_is_dp_accounting_called_directly(fraction_train, n):
    """Flower samples m of n nodes uniformly without replacement: dp-accounting's
    SampledWithoutReplacementDpEvent (replace-one: the sum moves by up to 2C, noise z C,
    so z / 2 per sensitivity); every node (m = n): GaussianDpEvent(z), add/remove-one."""
    from dp_accounting import NeighboringRelation, dp_event, rdp

    B, g, replies = _replies()
    z, delta = 0.9, 1e-3
    strategy = _strategy(dp_clip=1.0, dp_noise_multiplier=z, dp_delta=delta, dp_num_clients=n,
                         fraction_train=fraction_train)
    strategy.load_global_arrays(g)
    for T in range(1, 4):
        _, agg = strategy.aggregate_train(T, replies)
        if n == M:
            direct = rdp.RdpAccountant()
            direct.compose(dp_event.GaussianDpEvent(z), T)
        else:
            direct = rdp.RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
            direct.compose(dp_event.SampledWithoutReplacementDpEvent(n, M, dp_event.GaussianDpEvent(z / 2)), T)
        assert agg["dp_epsilon"] == pytest.approx(direct.get_epsilon(delta), rel=1e-12)
    assert strategy.state_dict()["privacy"]["rounds"] == 3


# --------------------------------------------------------------------------- refusals
def _refusal(make):
    with pytest.raises(ValueError) as info:
        make()
    return str(info.value)


REFUSALS = {  # strategy arguments -> the argument the message must name (and a reason)
    "noise without a clip": (dict(dp_noise_multiplier=1.0), r"^dp_noise_multiplier needs dp_clip"),
    "delta without a clip": (dict(dp_delta=1e-3), r"^dp_delta needs dp_clip"),
    "clip_lr without a clip": (dict(dp_clip_lr=0.1), r"^dp_clip_lr needs dp_clip"),
    "n without a clip": (dict(dp_num_clients=6), r"^dp_num_clients needs dp_clip"),
    "a clip without n": (dict(dp_clip=1.0), r"^dp_clip needs dp_num_clients"),
    "n not an integer": (dict(dp_clip=1.0, dp_num_clients=6.0), r"^dp_num_clients must be a positive integer"),
    "a negative clip": (dict(dp_clip=-1.0, dp_num_clients=6), r"^dp_clip must be > 0, got -1"),
    "a negative noise": (dict(dp_clip=1.0, dp_num_clients=6, dp_noise_multiplier=-1.0),
                         r"^dp_noise_multiplier must be >= 0"),
    "an unknown mode": (dict(dp_clip=1.0, dp_num_clients=6, dp_mode="both"), r"^unknown dp_mode 'both'"),
    "a negative seed": (dict(dp_clip=1.0, dp_num_clients=6, dp_seed=-1), r"^dp_seed must be an integer >= 0"),
    "more sampled than there are": (dict(dp_clip=1.0, dp_num_clients=3, min_train_nodes=5),
                                    r"min_train_nodes\) = 5, exceed dp_num_clients = 3"),
    "noise without delta": (dict(dp_clip=1.0, dp_num_clients=6, dp_noise_multiplier=1.0),
                            r"^dp_noise_multiplier 1 needs dp_delta.*below 1/dp_num_clients = 0\.167"),
    "delta without noise": (dict(dp_clip=1.0, dp_num_clients=6, dp_delta=1e-3),
                            r"^dp_delta asks for epsilon, but dp_noise_multiplier is 0"),
    "delta of 1/n": (dict(dp_clip=1.0, dp_num_clients=6, dp_noise_multiplier=1.0, dp_delta=0.2),
                     r"^dp_delta 0\.2 must be below 1/dp_num_clients = 0\.167"),
    "clip_lr without adaptive clipping": (dict(dp_clip=1.0, dp_num_clients=6, dp_clip_lr=0.1),
                                          r"^dp_clip_lr is a parameter of adaptive clipping: give dp_target_quantile"),
    "adaptive clipping in client mode": (dict(dp_clip=1.0, dp_num_clients=6, dp_target_quantile=0.5,
                                              dp_mode="client"),
                                         r"^dp_target_quantile \(adaptive clipping\).*dp_mode client"),
    "the count gets no noise": (dict(dp_clip=1.0, dp_num_clients=6, dp_target_quantile=0.5,
                                     dp_noise_multiplier=1.0, dp_delta=1e-3),
                                r"^dp_noise_multiplier 1 leaves adaptive clipping's count"
                                r".*nodes sampled per round / 20"),
    "the given count noise too small": (dict(dp_clip=1.0, dp_num_clients=6, dp_target_quantile=0.5,
                                             dp_noise_multiplier=1.0, dp_delta=1e-3, dp_clip_count_stddev=0.4),
                                        r"count's noise \(dp_clip_count_stddev = 0\.4\).*raise dp_clip_count_stddev"),
    "data-size weights": (dict(dp_clip=1.0, dp_num_clients=6, weighting="auto"),
                          r"^dp_clip with weighting auto \(data-size weights for fedavg\).*use weighting uniform"),
    "a robust rule": (dict(dp_clip=1.0, dp_num_clients=6, aggregator="median"),
                      r"^aggregator median cannot be combined with dp_clip"),
    "scaffold": (dict(dp_clip=1.0, dp_num_clients=6, scaffold=True),
                 r"^dp_clip cannot be used with algo scaffold: its control variates"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_settings_that_void_the_guarantee_are_refused_naming_the_argument(case):
    from fedopt_kernels.benchmarks.flower import ShapesModel
    from fedopt_kernels.integrations import flower as fk

    kw, pattern = REFUSALS[case]
    kw = {"weighting": "uniform", **kw}
    model = ShapesModel(SHAPES)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert re.search(pattern, _refusal(lambda: fk.FedAvg(model, fraction_evaluate=0.0, **kw))), case
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("algo", ["fedexp", "asnes"])
def test_server_steps_that_read_every_clients_norm_are_refused(algo):
    from fedopt_kernels.benchmarks.flower import ShapesModel
    from fedopt_kernels.integrations import flower as fk

    msg = _refusal(lambda: fk.make_strategy(algo, ShapesModel(SHAPES), dp_clip=1.0, dp_num_clients=6,
                                            weighting="uniform", fraction_evaluate=0.0))
    assert msg.startswith(f"dp_clip cannot be used with algo {algo}: its ")


CLI_VS_STRATEGY = [  # the same setting through fedopt simulate's config and a strategy
    (dict(dp_clip=1.0, dp_noise_multiplier=1.0), {}),
    (dict(dp_clip=1.0, dp_delta=1e-3), {}),
    (dict(dp_clip=1.0, dp_noise_multiplier=1.0, dp_delta=0.2), {}),
    (dict(dp_clip=1.0, dp_target_quantile=0.5, dp_mode="client"), {}),
    (dict(dp_clip=1.0, dp_noise_multiplier=1.0, dp_delta=1e-3, dp_target_quantile=0.5), {}),
    (dict(dp_clip=1.0, weighting="auto"), {}),
    (dict(dp_clip=1.0, aggregator="median"), {}),
    (dict(dp_clip=-2.0), {}),
]


@pytest.mark.parametrize("setting", range(len(CLI_VS_STRATEGY)))
def test_the_refusal_is_the_simulators_message_with_the_arguments_names(setting):
    """``fedopt simulate --dp-*`` and ``dp_*=`` refuse with one text: the simulator's,
    its flag names (and clients / per-round) replaced by the strategy's arguments."""
    from fedopt_kernels.benchmarks.flower import ShapesModel
    from fedopt_kernels.fl import SimulationConfig
    from fedopt_kernels.fl.run.dp_settings import CLI_NAMES, PYTHON_NAMES
    from fedopt_kernels.integrations import flower as fk

    kw, _ = CLI_VS_STRATEGY[setting]
    kw = {"weighting": "uniform", **kw}
    cli = _refusal(lambda: SimulationConfig(algo="fedavg", clients=6, per_round=6, **kw).validate())
    ours = _refusal(lambda: fk.FedAvg(ShapesModel(SHAPES), fraction_evaluate=0.0, dp_num_clients=6, **kw))
    for key in [k for k in CLI_NAMES if k.startswith("dp_")]:
        cli = re.sub(rf"(?<![\w-]){re.escape(CLI_NAMES[key])}(?![\w-])", PYTHON_NAMES[key], cli)
    cli = cli.replace("1/clients", "1/dp_num_clients").replace("per-round", PYTHON_NAMES["per_round"])
    assert ours == cli


# --------------------------------------------------------------------------- configure_train
class _Grid:
    def __init__(self, nodes):
        self.nodes = list(nodes)

    def get_node_ids(self):
        return list(self.nodes)

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        from flwr.app import Message

        return Message(content=content, message_type=message_type, dst_node_id=dst_node_id, group_id=group_id)


def test_configure_train_refuses_a_federation_of_another_size():
    from flwr.app import ConfigRecord

    from fedopt_kernels.integrations import flower as fk

    B, g, _ = _replies()
    strategy = _strategy(dp_clip=1.0, dp_num_clients=6, min_train_nodes=1)
    assert len(strategy.configure_train(1, g, ConfigRecord(), _Grid(range(1, 7)))) == 6
    with pytest.raises(ValueError, match=r"accounted for 6 of dp_num_clients = 6 nodes sampled per round, but this "
                                         r"round sampled 7 of 7 connected nodes"):
        strategy.configure_train(2, g, ConfigRecord(), _Grid(range(1, 8)))
    # client mode: the clients get the current clip to clip to
    strategy = _strategy(dp_clip=0.75, dp_num_clients=6, dp_mode="client", min_train_nodes=1)
    messages = strategy.configure_train(1, g, ConfigRecord(), _Grid(range(1, 7)))
    assert [m.content["config"][fk.strategy.DP_CLIP_KEY] for m in messages] == [0.75] * 6
    assert strategy.privacy.aggregator.mode == "client"


# --------------------------------------------------------------------------- a whole run
@pytest.mark.parametrize("dp", [dict(dp_clip=0.5, dp_noise_multiplier=0.15, dp_delta=1e-3),
                                dict(dp_clip=0.5, dp_target_quantile=0.5, dp_noise_multiplier=0.15, dp_delta=1e-3)],
                         ids=["fixed", "adaptive"])
def test_a_flower_run_with_dp_arguments_is_the_simulators_run(dp, monkeypatch):
    """Flower's round loop, FedNARClient and a FedAvg strategy with ``dp_*`` against
    ``fedopt simulate``'s run with the same ``--dp-*`` (every client every round, as the
    simulator's sampling of all of them): every round's global model bit for bit, and
    every round's dp_* record equal to the metrics."""
    from test_flower import _flower_run, _simulation

    from fedopt_kernels.integrations import flower as fk

    sim, sim_rounds = _simulation("fedavg", weighting="uniform", **dp)
    make = fk.make_strategy
    monkeypatch.setattr(fk, "make_strategy", lambda algo, model, **kw: make(
        algo, model, **kw, weighting="uniform", dp_num_clients=sim.config.clients, dp_seed=sim.config.seed, **dp))
    strategy, fl_rounds, result = _flower_run(sim, "fedavg")
    assert len(fl_rounds) == len(sim_rounds) == sim.config.rounds
    for r, ((_, sd_sim), sd_fl) in enumerate(zip(sim_rounds, fl_rounds), start=1):
        for k, v in sd_sim.items():
            assert torch.equal(sd_fl[k], v), f"round {r}: {k}"
        rec = sim.results.records[r]
        metrics = result.train_metrics_clientapp[r]
        keys = [k for k in rec if k.startswith("dp_")]
        assert "dp_epsilon" in keys and ("dp_unclipped_fraction" in keys) == ("dp_target_quantile" in dp)
        for k in keys:
            assert metrics[k] == rec[k], (r, k)


def test_a_restored_strategy_goes_on_as_an_uninterrupted_one():
    """state_dict carries the rounds and the clip: round 3 after a restore draws round
    3's noise and reports 3 rounds' epsilon, as the run that never stopped."""
    B, g, replies = _replies()
    dp = dict(dp_clip=0.3, dp_target_quantile=0.5, dp_noise_multiplier=0.5, dp_delta=1e-2, dp_num_clients=M)
    whole = _strategy(**dp)
    whole.load_global_arrays(g)
    for r in (1, 2):
        whole.aggregate_train(r, replies)
    state = whole.state_dict()
    _, want = whole.aggregate_train(3, replies)
    resumed = _strategy(**dp)
    resumed.load_state_dict(state)
    _, got = resumed.aggregate_train(3, replies)
    assert torch.equal(resumed.x_global, whole.x_global)
    assert got["dp_epsilon"] == want["dp_epsilon"] and got["dp_clip"] == want["dp_clip"] != 0.3
    fresh = _strategy(**dp)  # without the state: round 1's clip, noise and epsilon
    fresh.load_state_dict({**state, "privacy": None})
    _, first = fresh.aggregate_train(3, replies)
    assert first["dp_clip"] == 0.3 and first["dp_epsilon"] < want["dp_epsilon"]


# --------------------------------------------------------------------------- the client's side of dp_mode="client"
@needs_flwr
@pytest.mark.parametrize("clip", [1e-3, 1e3])
def test_the_client_clips_its_update_to_the_clip_the_strategy_sent(clip):
    """FedNARClient reads the train ConfigRecord's "dp-clip" (dp_mode="client") and sends
    the model of the clipped update x0 - s D, s = min(1, C(1 - 1e-5) / (||D|| + 1e-6))
    (float64 oracle); without the key, or with a clip the update is under, its model is
    the unclipped one, bit for bit."""
    from flwr.app import ConfigRecord, Context, Message, RecordDict
    from flwr.app import MessageType
    from flwr.supercore.task_identity import TaskIdentity
    from torch import nn

    from fedopt_kernels.fl import LocalConfig
    from fedopt_kernels.integrations import flower as fk
    from fedopt_kernels.ops.dp_noise import CLIENT_CLIP_MARGIN

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g)

    def model_fn(context):
        torch.manual_seed(1)
        return nn.Linear(6, 3)

    client = fk.FedNARClient(model_fn, lambda c: (x, y), config=LocalConfig(steps=3, lr=0.5, nar="none"), seed=0)

    def train(config):
        x0 = fk.model_to_arrayrecord(model_fn(None))
        content = RecordDict({"arrays": x0, "config": ConfigRecord(config)})
        TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0  # as a ServerApp sets them
        msg = Message(content=content, message_type=MessageType.TRAIN, dst_node_id=1)
        msg.metadata.__dict__.update(_message_id="m", _src_node_id=0, _run_id=1)  # as a Grid sends it
        ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
        reply = client.train(msg, ctx)
        return torch.cat([torch.from_numpy(a.numpy()).reshape(-1) for a in reply.content["arrays"].values()])

    x0 = torch.cat([p.detach().reshape(-1) for p in model_fn(None).parameters()])
    plain = train({"server-round": 1})
    got = train({"server-round": 1, fk.strategy.DP_CLIP_KEY: clip})
    D = (x0 - plain).double()
    s = min(1.0, clip * (1 - CLIENT_CLIP_MARGIN) / (D.norm().item() + 1e-6))
    if s == 1.0:
        assert torch.equal(got, plain)
    else:
        torch.testing.assert_close(got.double(), x0.double() - s * D, rtol=0, atol=1e-6)
        assert (x0 - got).double().norm() <= clip * (1 + 1e-6)
