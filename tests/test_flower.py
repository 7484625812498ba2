"""The Flower integration (fedopt_kernels.integrations.flower) against our own simulator.

* A REAL Flower run, offline: our own ``flower-superlink --simulation`` (Ray-backed
  simulation runtime) runs ``examples/flower_app`` through ``flwr run`` with 4 clients
  for 3 rounds; the final global model must equal, bit for bit, the one
  :class:`fedopt_kernels.fl.Simulation` (sequential engine) computes with the same
  clients, data, seeds and algorithms, and so must the per-round test accuracies.
* Every strategy (FedAvg, FedProx, SCAFFOLD, FedAvgM, FedAdam, FedYogi, FedAdagrad,
  FedExP, ASNES, FedLAW) driven by Flower's own ``Strategy.start`` loop with a
  ClientApp running in this process (a minimal ``Grid``), against the simulator,
  round by round: bitwise, except FedLAW (see ``test_strategy_matches_simulator``).
* ArrayRecord <-> flat tensor conversions, reply ordering, NaN clients, bad replies.

Skipped (with the reason) only on Python 3.10, where flwr 1.41 cannot be installed;
elsewhere a missing flwr fails them (it is part of the [test] extra).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from _flwr import HAVE_FLWR, needs_flwr
from torch import nn

# The local SuperLink (ports, proxies, health check) is the Flower-vs-simulator benchmark's
# too: one implementation (it needs no flwr to import).
from fedopt_kernels.benchmarks.flower_run import LOOPBACK, SuperLinkError, start_superlink
from fedopt_kernels.benchmarks.flower_run import healthy as _healthy
from fedopt_kernels.benchmarks.flower_run import loopback_env as _loopback_env

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "examples" / "flower_app"

# A small federation: 4 clients, all of them every round (Flower's fraction_train = 1.0).
SMALL = dict(clients=4, per_round=4, rounds=3, local_steps=5, hidden=(32,), engine="sequential", seed=3)


# --------------------------------------------------------------------------- always
def test_import_error_names_the_extra():
    code = ("import sys; sys.modules['flwr'] = None\n"
            "try:\n    import fedopt_kernels.integrations.flower\n"
            "except ImportError as e:\n    print('IMPORT-ERROR', e)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120).stdout
    assert "IMPORT-ERROR" in out and "pip install fedopt_kernels[flower]" in out, out


def test_info_reports_the_flower_integration(capsys):
    from fedopt_kernels.cli import main
    from fedopt_kernels.cli.info import collect

    row = collect()["integrations"]["flwr"]
    assert row["install"] == "pip install fedopt_kernels[flower]"
    if HAVE_FLWR:
        assert row["version"] == flwr.__version__ and row["error"] is None
    else:
        assert row["version"] is None and row["error"] == "not installed: pip install fedopt_kernels[flower]"
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "Flower integration" in out
    assert (flwr.__version__ if HAVE_FLWR else "pip install fedopt_kernels[flower]") in out


# --------------------------------------------------------------------------- helpers
if HAVE_FLWR:
    import flwr
    from flwr.serverapp import Grid as _Grid
else:  # the tests that use it are skipped
    _Grid = object


class LocalGrid(_Grid):
    """A Flower ``Grid`` that runs a ``ClientApp`` in this process, one node per
    partition (``node_config["partition-id"]``), each with its own persistent
    ``Context.state``.  Replies come back in REVERSE order (arrival order must not
    matter)."""

    def __init__(self, app, num_nodes: int, run_config=None):
        from flwr.app import Context, RecordDict
        from flwr.supercore.task_identity import TaskIdentity

        TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
        self.app = app
        self.nodes = [9001 + 13 * i for i in range(num_nodes)]
        self.contexts = {
            nid: Context(run_id=1, node_id=nid, node_config={"partition-id": i, "num-partitions": num_nodes},
                         state=RecordDict(), run_config=dict(run_config or {}))
            for i, nid in enumerate(self.nodes)}

    def set_run(self, run):
        self._run = run

    @property
    def run(self):
        return getattr(self, "_run", None)

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        from flwr.app import Message

        return Message(content=content, message_type=message_type, dst_node_id=dst_node_id, group_id=group_id)

    def get_node_ids(self):
        return list(self.nodes)

    def push_messages(self, messages):  # pragma: no cover - send_and_receive does it all
        raise NotImplementedError

    def pull_messages(self, message_ids):  # pragma: no cover
        raise NotImplementedError

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for m in messages:
            m.metadata.__dict__.update(_message_id=uuid.uuid4().hex, _src_node_id=0, _run_id=1)
            replies.append(self.app(m, self.contexts[m.metadata.dst_node_id]))
        return replies[::-1]


def _simulation(algo: str, model=None, **changes):
    from fedopt_kernels.fl import Simulation, SimulationConfig

    cfg = SimulationConfig(algo=algo, fedlaw_epochs=2, prox_mu=0.1, **{**SMALL, **changes})
    sim = Simulation(cfg, model=model)
    per_round = []
    sim.run(callback=lambda rec, s: rec["round"] > 0 and per_round.append(
        (s.x_global.clone(), {k: v.clone() for k, v in s.global_model.state_dict().items()})))
    return sim, per_round


def _flower_run(sim, algo: str, model_factory=None):
    """The same federation through Flower's Strategy.start with in-process clients;
    returns (strategy, per-round global state_dicts, Flower's Result)."""
    from flwr.clientapp import ClientApp

    from fedopt_kernels.fl import build_model
    from fedopt_kernels.fl.seeds import proxy_order_seed
    from fedopt_kernels.integrations import flower as fk

    cfg, ds, part = sim.config, sim.dataset, sim.partition

    def model_fn(context=None):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(fk.init_seed(cfg.seed))
            if model_factory is not None:
                return model_factory()
            return build_model(cfg.model, ds.input_shape, ds.num_classes, hidden=cfg.hidden)

    def data_fn(context):
        idx = part.client_indices[int(context.node_config["partition-id"])]
        return ds.x_train[idx], ds.y_train[idx]

    client = fk.FedNARClient(model_fn, data_fn, config=sim.local, seed=cfg.seed)
    app = ClientApp()
    app.train()(client.train)
    grid = LocalGrid(app, cfg.clients)
    model = model_fn()
    kw = dict(fraction_evaluate=0.0, min_available_nodes=cfg.clients, min_train_nodes=cfg.clients,
              max_weight_share=cfg.max_weight_share)
    if algo == "fedlaw":
        loader = sim.server.fedlaw.proxy_loader  # the simulator's proxy set, reseeded per round as it does

        def proxy(server_round):
            sim._proxy_gen.manual_seed(proxy_order_seed(cfg.seed, server_round))
            return loader

        kw.update(proxy_loader=proxy, loss_fn=nn.CrossEntropyLoss())
    # the simulator's server hyperparameters (the registry's defaults and the config's values)
    strategy = fk.make_strategy(algo, model, **sim.server.hyper, **kw)
    states = []

    def evaluate_fn(server_round, arrays):
        if server_round > 0:
            states.append({k: torch.from_numpy(a.numpy()) for k, a in arrays.items()})
        return None

    result = strategy.start(grid=grid, initial_arrays=fk.model_to_arrayrecord(model), num_rounds=cfg.rounds,
                            evaluate_fn=evaluate_fn)
    return strategy, states, result


ALGOS = ["fedavg", "fedprox", "scaffold", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "fedexp", "asnes", "fedlaw"]


# --------------------------------------------------------------------------- strategies vs simulator
@needs_flwr
@pytest.mark.parametrize("algo", ALGOS)
def test_strategy_matches_simulator(algo):
    """Flower's round loop + our strategy + FedNARClient == fedopt_kernels.fl.Simulation,
    every round, bit for bit.

    FedLAW: equal to 1e-6 (observed: ~1.5e-8), not bitwise.  The simulator rebuilds
    each client model from its update as ``x_global - (x_global - x_end)`` (two
    roundings) before learning gamma and lambda on the proxy set, whereas a Flower
    client sends ``x_end`` itself; everything else (proxy batches, Adam steps, the
    fused aggregation) is the same computation.
    """
    sim, sim_rounds = _simulation(algo)
    strategy, fl_rounds, result = _flower_run(sim, algo)
    assert len(fl_rounds) == len(sim_rounds) == sim.config.rounds
    for r, ((x_sim, sd_sim), sd_fl) in enumerate(zip(sim_rounds, fl_rounds), start=1):
        for k, v in sd_sim.items():
            if algo == "fedlaw":
                torch.testing.assert_close(sd_fl[k], v, rtol=0, atol=1e-6, msg=f"round {r}, {k}")
            else:
                assert torch.equal(sd_fl[k], v), f"round {r}: {k} differs by {(sd_fl[k] - v).abs().max()}"
    if algo != "fedlaw":
        assert torch.equal(strategy.x_global, sim.x_global)
    metrics = result.train_metrics_clientapp[sim.config.rounds]
    assert metrics["excluded_clients"] == 0 and metrics["server_skipped"] == 0
    for key in ("train_loss", "clip_frequency", "lr_sum"):
        assert key in metrics
    if algo == "asnes":
        rec = sim.results.records[-1]
        assert metrics["gain_ratio"] == pytest.approx(rec["gain_ratio"], rel=1e-6)
    if algo == "fedlaw":
        assert metrics["gamma"] == pytest.approx(sim.results.records[-1]["gamma"], rel=1e-5)
        assert len(metrics["lambda"]) == sim.config.clients
    else:
        assert metrics["update_norm"] == pytest.approx(sim.results.records[-1]["update_norm"], rel=1e-6)


class _BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 24), nn.BatchNorm1d(24), nn.ReLU(), nn.Linear(24, 10))

    def forward(self, x):
        return self.net(x)


@needs_flwr
@pytest.mark.parametrize("cap", [None, 0.26])
def test_batchnorm_buffers_match_simulator(cap):
    """Floating buffers are the num-examples weighted mean of the clients' (as the
    simulator does), under the round's weights: with a weight cap that acts (the sizes
    394:261:372:411 capped at 0.26 cap three of the four clients) the capped shares, in
    both; integer buffers (num_batches_tracked) keep the server's."""
    sim, sim_rounds = _simulation("fedadam", model=_BNNet, max_weight_share=cap)
    if cap is not None:
        from fedopt_kernels.server import round_weights

        shares = round_weights("size", sim.client_sizes, cap).values
        assert int((shares == cap).sum()) == 3
    strategy, fl_rounds, _ = _flower_run(sim, "fedadam", model_factory=_BNNet)
    for (_, sd_sim), sd_fl in zip(sim_rounds, fl_rounds):
        assert sd_fl.keys() == sd_sim.keys()
        for k, v in sd_sim.items():
            assert torch.equal(sd_fl[k], v), k
    assert "net.2.running_mean" in fl_rounds[-1] and fl_rounds[-1]["net.2.num_batches_tracked"].item() == 0


# --------------------------------------------------------------------------- aggregate_train details
def _replies(model: nn.Module, C: int, seed: int = 0, scale: float = 0.1):
    from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedopt_kernels.integrations import flower as fk

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    g = torch.Generator().manual_seed(seed)
    out = []
    for c in range(C):
        sd = {k: v + scale * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
        content = RecordDict({"arrays": fk.tensors_to_arrayrecord(sd.items()),
                              "metrics": MetricRecord({"num-examples": 10 * (c + 1), "train_loss": float(c)}),
                              "fedopt": ConfigRecord({"partition-id": c})})
        ins = Message(content=RecordDict(), message_type=MessageType.TRAIN, dst_node_id=500 - c)
        out.append(Message(content=content, reply_to=ins))
    return out


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


@needs_flwr
def test_aggregate_train_is_fedavg_and_order_free():
    from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

    from fedopt_kernels.integrations import flower as fk

    replies = _replies(_net(), 5)
    results = []
    for order in (replies, replies[::-1], replies[2:] + replies[:2]):
        s = fk.FedAvg(_net(), fraction_evaluate=0.0)
        s.load_global_arrays(fk.model_to_arrayrecord(_net()))
        arrays, metrics = s.aggregate_train(1, order)
        results.append(torch.cat([torch.from_numpy(a.numpy()).flatten() for a in arrays.values()]))
        assert metrics["excluded_clients"] == 0 and metrics["server_lr"] == 1.0
    assert all(torch.equal(results[0], r) for r in results[1:])
    # plain FedAvg (lr = gamma = 1) is Flower's FedAvg up to rounding
    ref, _ = FlowerFedAvg(fraction_evaluate=0.0).aggregate_train(1, replies)
    ref = torch.cat([torch.from_numpy(a.numpy()).flatten() for a in ref.values()])
    torch.testing.assert_close(results[0], ref, rtol=1e-6, atol=1e-6)


@needs_flwr
def test_nonfinite_client_is_left_out():
    from flwr.app import Array

    from fedopt_kernels.integrations import flower as fk

    replies = _replies(_net(), 4)
    bad = next(iter(replies[1].content.array_records.values()))
    arr = bad["0.weight"].numpy().copy()
    arr[0, 0] = np.nan
    bad["0.weight"] = Array(arr)
    s = fk.FedAdam(_net(), fraction_evaluate=0.0)
    s.load_global_arrays(fk.model_to_arrayrecord(_net()))
    arrays, metrics = s.aggregate_train(1, replies)
    assert metrics["excluded_clients"] == 1 and metrics["server_skipped"] == 0
    assert all(np.isfinite(a.numpy()).all() for a in arrays.values())
    s2 = fk.FedAdam(_net(), fraction_evaluate=0.0)
    s2.load_global_arrays(fk.model_to_arrayrecord(_net()))
    arrays2, _ = s2.aggregate_train(1, [replies[i] for i in (0, 2, 3)])
    for k in arrays:
        np.testing.assert_array_equal(arrays[k].numpy(), arrays2[k].numpy())


@needs_flwr
def test_bad_reply_raises_aggregation_error_on_request():
    from flwr.app import Array
    from flwr.serverapp.exception import AggregationError

    from fedopt_kernels.integrations import flower as fk

    replies = _replies(_net(), 3)
    rec = next(iter(replies[2].content.array_records.values()))
    rec["2.weight"] = Array(np.zeros((4, 5), dtype=np.float32))
    s = fk.FedAvg(_net(), fraction_evaluate=0.0, on_bad_reply="raise")  # today's behaviour, on request
    s.load_global_arrays(fk.model_to_arrayrecord(_net()))
    with pytest.raises(AggregationError, match=r"bad_arrays.*'2.weight'.*shape \(4, 5\).*\(3, 5\)"):
        s.aggregate_train(1, replies)


# --------------------------------------------------------------------------- records
@needs_flwr
def test_records_roundtrip_and_checks():
    from flwr.app import Array, ArrayRecord

    from fedopt_kernels.integrations.flower import records as R
    from fedopt_kernels.utils import parameters_layout, module_to_vector

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
    ours, theirs = R.model_to_arrayrecord(model), ArrayRecord(model.state_dict())
    assert list(ours.keys()) == list(theirs.keys())
    for k in theirs:  # byte-identical to what Flower (np.save) writes
        assert ours[k].data == theirs[k].data and ours[k].dtype == theirs[k].dtype
        assert tuple(ours[k].shape) == tuple(theirs[k].shape)
    L = parameters_layout(model)
    x = module_to_vector(model)
    assert torch.equal(R.arrayrecord_to_vector(theirs, L), x)
    # key order does not matter; float64 and Fortran-ordered arrays are read correctly
    shuffled = ArrayRecord({k: Array(np.asfortranarray(v.numpy()).astype(np.float64)) if v.numpy().ndim > 1
                            else theirs[k] for k, v in reversed(list(theirs.items()))})
    assert torch.equal(R.arrayrecord_to_vector(shuffled, L), x)
    U = R.stack_arrayrecords([ours, theirs, shuffled], L, workers=2)
    assert all(torch.equal(U[i], x) for i in range(3))
    base = torch.randn_like(x)
    D = R.stack_arrayrecords([ours, theirs], L, subtract_from=base)
    assert torch.equal(D[0], torch.sub(base, x)) and torch.equal(D[1], base - x)
    # checks name the array
    missing = ArrayRecord({k: v for k, v in theirs.items() if k != "3.bias"})
    with pytest.raises(ValueError, match="3.bias"):
        R.arrayrecord_to_vector(missing, L)
    wrong = ArrayRecord(dict(theirs.items()))
    wrong["0.weight"] = Array(np.zeros((4, 3, 2, 2), dtype=np.float32))
    with pytest.raises(ValueError, match=r"'0.weight'.*shape"):
        R.stack_arrayrecords([theirs, wrong], L)
    ints = ArrayRecord(dict(theirs.items()))
    ints["3.bias"] = Array(np.zeros(10, dtype=np.int64))
    with pytest.raises(ValueError, match="dtype int64"):
        R.arrayrecord_to_vector(ints, L)
    # loading into a model, with its buffers; unknown keys are refused
    other = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
    R.load_arrayrecord_(other, theirs)
    for (k, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), k
    extra = ArrayRecord(dict(theirs.items()))
    extra["head.weight"] = Array(np.zeros(3, dtype=np.float32))
    with pytest.raises(ValueError, match="head.weight"):
        R.load_arrayrecord_(other, extra)


# --------------------------------------------------------------------------- a real Flower simulation
def test_health_check_reaches_loopback_through_a_proxy_setting(monkeypatch):
    """With every proxy variable pointing at a dead proxy, the health check still reaches
    a server on 127.0.0.1 and the subprocess environment exempts loopback."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # the discard port: nothing answers there
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert _healthy(server.server_address[1])
        with pytest.raises(OSError):  # the plain opener would have gone through the dead proxy
            urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/health", timeout=2)
    finally:
        server.shutdown()
        server.server_close()
    env = _loopback_env({"no_proxy": "example.org"})
    assert env["no_proxy"].split(",") == ["example.org", *LOOPBACK] and env["NO_PROXY"].split(",") == list(LOOPBACK)


@pytest.fixture
def superlink(tmp_path):
    """Our own local SuperLink in simulation mode (Ray runtime), offline
    (:func:`fedopt_kernels.benchmarks.flower_run.start_superlink`: a temporary FLWR_HOME
    with a connection named "test", no telemetry, no runtime dependency installation,
    loopback exempt from proxies, a fresh port if its port was taken).  Yields ``(env,
    flwr_executable)``; the SuperLink (and the SuperExec it spawned) is stopped afterwards."""
    try:
        link = start_superlink(tmp_path, connection="test")
    except SuperLinkError as e:
        pytest.fail(f"{e}\n(flwr is installed, so this test must run)")
    try:
        yield link.env, link.flwr
    finally:
        link.stop()


@needs_flwr
@pytest.mark.slow
def test_flower_simulation_matches_simulator(superlink, tmp_path):
    """``flwr run examples/flower_app`` (4 SuperNodes, 3 rounds) == Simulation, bitwise:
    SCAFFOLD (client control variates in Context.state, the server's c in the
    messages) and FedAdam."""
    from fedopt_kernels.fl import Simulation, SimulationConfig

    env, flwr_exe = superlink
    hidden, steps, seed, rounds, clients = 32, 5, 3, 3, 4
    for algo in ("scaffold", "fedadam"):
        out = tmp_path / f"out_{algo}"
        run_config = (f"algo='{algo}' num-server-rounds={rounds} local-steps={steps} hidden={hidden} seed={seed} "
                      f"save-path='{out}'")
        proc = subprocess.run(
            [flwr_exe, "run", str(APP), "test", "--stream", "--run-config", run_config,
             "--federation-config", f"num-supernodes={clients}"],
            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=400)
        log = proc.stdout + proc.stderr
        assert (out / "final_model.pt").exists(), f"the Flower run left no model (rc={proc.returncode}):\n{log[-4000:]}"
        assert "Strategy execution finished" in log

        cfg = SimulationConfig(algo=algo, clients=clients, per_round=clients, rounds=rounds, local_steps=steps,
                               hidden=(hidden, hidden), seed=seed, engine="sequential")
        sim = Simulation(cfg)
        res = sim.run()
        flower_state = torch.load(out / "final_model.pt", weights_only=True)
        for k, v in sim.global_model.state_dict().items():
            assert torch.equal(flower_state[k], v), f"{algo}: {k} differs by {(flower_state[k] - v).abs().max()}"
        history = json.loads((out / "history.json").read_text())
        assert [h["test_accuracy"] for h in history] == [r["test_accuracy"] for r in res.records]
        assert [h["round"] for h in history] == list(range(rounds + 1))


@needs_flwr
def test_client_evaluate_and_run_config():
    """FedNARClient.evaluate answers Flower's federated evaluation; hyperparameters come
    from the run config by default."""
    from flwr.clientapp import ClientApp

    from fedopt_kernels.fl import LocalConfig, digits, iid_partition
    from fedopt_kernels.integrations import flower as fk

    cfg = fk.local_config_from_run_config({"local-steps": 3, "local-lr": 0.1, "nar": "grad", "backend": "",
                                           "prox-mu": 0.01, "batch-size": 16})
    assert cfg == LocalConfig(steps=3, lr=0.1, nar="grad", backend=None, prox_mu=0.01, batch_size=16)
    ds = digits(seed=0)
    part = iid_partition(ds.num_train, 3, seed=0)

    def data_fn(context):
        idx = part.client_indices[int(context.node_config["partition-id"])]
        return ds.x_train[idx], ds.y_train[idx]

    client = fk.FedNARClient(lambda c: _Digits(), data_fn, eval_data_fn=lambda c: (ds.x_test, ds.y_test))
    app = ClientApp()
    app.train()(client.train)
    app.evaluate()(client.evaluate)
    grid = LocalGrid(app, 3, run_config={"local-steps": 4, "local-lr": 0.1, "seed": 1})
    torch.manual_seed(0)
    strategy = fk.FedAvg(_Digits(), min_available_nodes=3)
    result = strategy.start(grid=grid, initial_arrays=fk.model_to_arrayrecord(_Digits()), num_rounds=2)
    ev = result.evaluate_metrics_clientapp[2]
    assert 0.0 <= ev["eval_acc"] <= 1.0 and ev["eval_loss"] > 0
    # round 2 of the run config's lr with LocalConfig's (the simulator's) lr decay 0.998 per round
    assert result.train_metrics_clientapp[2]["lr_sum"] == pytest.approx(4 * 0.1 * 0.998, rel=1e-9)


class _Digits(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)
