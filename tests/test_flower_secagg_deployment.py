"""SecAgg+ through a real SuperLink (issue 45): Flower's deployment mode on loopback, TLS
and SuperNode authentication on, ``flwr run examples/flower_secagg_app``: FedAvg's fused
server step (:class:`~fedopt_kernels.integrations.flower.secagg.SecAggPlusFusedStrategy`)
under ``SecAggPlusWorkflow`` in the ServerApp (a ``LegacyContext`` and
``DefaultWorkflow(fit_workflow=...)``), ``secaggplus_mod`` on 3 SuperNodes' ClientApps,
2 rounds; node 1 dies in round 2 (below).  One deployment serves both tests: the suite
pays for one SuperLink, not two.

The oracle is independent of Flower: each round's plain FedNAR updates ``D_i`` of the
three clients on that round's global model (the same code path without secure
aggregation) and their float64 mean.  What SecAgg+ delivers equals it within the
quantization bound, not bit for bit: ``secaggplus_mod`` rounds each value
stochastically with NumPy's unseeded global generator
(``flwr/common/secure_aggregation/quantization.py``: ``np.random.rand``), so two
secure runs -- deployed or in process -- differ in the last steps of the 2^22-level
grid; the masks themselves cancel exactly.  The bound: 3 clients, each value off by
less than one step ``16 / 2^22``, so the mean is within ``3 step / 3``.  The round-1
mean of the deployment and the in-process run (``InProcessGrid``, the same protocol and
strategy) start from the same model and so lie within two bounds of each other.

Round 1 (all three nodes) is checked against the oracle and the in-process run.  In
round 2 node 1 is killed after SecAgg+'s key exchange (its ClientApp kills its SuperNode
when the round-2 masked vector is asked for, after setup and share_keys): a dropout.  The
stage waits ``timeout`` seconds (never forever), its neighbours' shares unmask the rest,
and round 2 is the mean of the two survivors within the bound.  Every process is stopped
whatever happens; only 127.0.0.1 is used.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _flwr import needs_flwr

from fedopt_kernels.benchmarks import flower_run as FR
from fedopt_kernels.benchmarks import pki

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "examples" / "flower_secagg_app"
NODES, ROUNDS = 3, 2
STEP = 16.0 / 2 ** 22  # SecAgg+'s quantization step at its default ranges (+-8, 2^22 levels)
TIMEOUT = 90.0  # seconds a SecAgg+ stage waits for replies: above a ClientApp start (torch import) on 2 loaded cores
RUN_CONFIG = f"num-server-rounds={ROUNDS} num-nodes={NODES} timeout={TIMEOUT} save-path='{{out}}'"

pytestmark = [needs_flwr, pytest.mark.slow]


def _deploy_and_run(path: Path, node_config=None) -> dict:
    """A TLS SuperLink with SuperNode authentication, NODES registered SuperNodes, one
    ``flwr run`` of the app; returns what the ServerApp saved and the run's facts."""
    path.mkdir(parents=True)
    ca = pki.make_ca(path / "pki")
    cert, key = pki.make_server_cert(ca, path / "pki")
    link = FR.start_superlink(path, simulation=False, security=FR.Security(ca.cert, cert, key, node_auth=True))
    nodes = []
    try:
        pairs = pki.make_node_keys(path / "pki", NODES)
        for _, public in pairs:
            FR.register_supernode(link, public)
        nodes = FR.start_supernodes(link, NODES, path, node_config=node_config,
                                    private_keys=[private for private, _ in pairs])
        out = path / "out"
        t0 = time.perf_counter()
        proc = subprocess.run([link.flwr, "run", str(APP), link.connection, "--stream", "--run-config",
                               RUN_CONFIG.format(out=out)], capture_output=True, text=True, env=link.env,
                              cwd=path, timeout=420)
        took = time.perf_counter() - t0
        log = proc.stdout + proc.stderr
        (path / "flwr_run.log").write_text(log)
        alive = [p.poll() is None for p in nodes]
    finally:
        for p in nodes:
            FR.stop_process(p)
        link.stop()
    stopped = all(p.poll() is not None for p in nodes + [link.proc])
    saved = torch.load(out / "secagg.pt", weights_only=False) if (out / "secagg.pt").exists() else None
    return dict(rc=proc.returncode, log=log, took=took, alive=alive, stopped=stopped, saved=saved)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return _deploy_and_run(tmp_path_factory.mktemp("secagg_deploy") / "run", {1: 'fault="die@2"'})


def _app():
    sys.path.insert(0, str(APP))
    try:
        from secagg_app import task
    finally:
        sys.path.remove(str(APP))
    return task


def _plain_mean(x_global: torch.Tensor, server_round: int, nodes) -> torch.Tensor:
    """The float64 mean of the plain FedNAR updates of ``nodes`` on ``x_global``."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

    from flwr.supercore.task_identity import TaskIdentity

    from fedopt_kernels.integrations.flower import FedNARClient

    # a Message built in this process takes its run and source from it (as InProcessGrid sets)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    task = _app()
    run_config = {"local-steps": 3, "batch-size": 8, "local-lr": 0.1, "seed": 3}  # the app's defaults
    client = FedNARClient(lambda ctx: task.make_model(),
                          lambda ctx: task.client_data(int(ctx.node_config["partition-id"])))
    updates = []
    for i in nodes:
        model = task.make_model()
        torch.nn.utils.vector_to_parameters(x_global.float(), model.parameters())
        ctx = Context(run_id=1, node_id=100 + i, node_config={"partition-id": i, "num-partitions": NODES},
                      state=RecordDict(), run_config=run_config)
        msg = Message(content=RecordDict({"arrays": ArrayRecord(dict(model.state_dict())),
                                          "config": ConfigRecord({"server-round": server_round})}),
                      dst_node_id=ctx.node_id, message_type="train")
        reply = client.train(msg, ctx)
        trained = torch.cat([torch.from_numpy(reply.content["arrays"][n].numpy()).reshape(-1).double()
                             for n, _ in model.named_parameters()])
        updates.append(x_global.float().double() - trained)
    return torch.stack(updates).mean(0)


def _in_process_round1_mean() -> torch.Tensor:
    from flwr.app import Context, RecordDict
    from flwr.server import LegacyContext, ServerConfig

    from fedopt_kernels import server
    from fedopt_kernels.integrations.flower import secagg
    from fedopt_kernels.integrations.flower.inprocess import InProcessGrid

    task = _app()
    client = secagg.SecAggFedNARClient(lambda ctx: task.make_model(),
                                       lambda ctx: task.client_data(int(ctx.node_config["partition-id"])))
    model = task.make_model()
    strategy = secagg.SecAggPlusFusedStrategy(model, server.FedAvg(model.parameters(), lr=1.0),
                                              min_train_nodes=NODES)
    grid = InProcessGrid(client.app(), NODES, run_config={"local-steps": 3, "batch-size": 8, "local-lr": 0.1,
                                                          "seed": 3})
    workflow = secagg.secaggplus_workflow(strategy, num_shares=1.0, reconstruction_threshold=0.6)
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    workflow(grid, LegacyContext(ctx, config=ServerConfig(num_rounds=1), strategy=strategy))
    return strategy.last_mean


def _check_run(run):
    assert run["rc"] == 0 and run["saved"] is not None, f"rc={run['rc']}\n{run['log'][-4000:]}"
    assert "fedopt secagg run finished" in run["log"]
    assert run["stopped"], "a process was left running"
    return run["saved"]


def test_secagg_plus_through_a_tls_superlink_is_the_plain_mean_within_the_quantization_bound(run):
    saved = _check_run(run)
    assert len(saved["means"]) == ROUNDS and saved["history"][0]["clients"] == NODES
    assert len(saved["rejected"]) <= 1  # at most the round-2 dropout (the other test)
    bound = NODES * STEP / NODES  # each of the 3 clients' values off by < one step, divided by 3
    x, mean = saved["globals"][0], saved["means"][0]
    oracle = _plain_mean(x, 1, range(NODES))
    err = (mean - oracle).abs().max().item()
    assert err <= bound, (err, bound)
    assert oracle.abs().max() > 100 * bound  # the clients trained: a zero mean would also be "close"
    # FedAvg at lr 1: every new global model is x - mean, in the model's float32
    for r in range(1, ROUNDS + 1):
        x, mean = saved["globals"][r - 1], saved["means"][r - 1]
        want = (x.float() - mean.float()).double()
        assert torch.equal(saved["globals"][r], want), (r, (saved["globals"][r] - want).abs().max())
    # the deployment and the in-process run of the same protocol: the same round 1 up to two roundings
    in_process = _in_process_round1_mean()
    assert (saved["means"][0] - in_process).abs().max().item() <= 2 * bound


def test_a_node_killed_after_the_key_exchange_is_a_dropout_and_the_round_completes(run):
    saved = _check_run(run)
    assert run["alive"] == [True, False, True], run["alive"]  # node 1's SuperNode was killed in round 2
    assert [h["clients"] for h in saved["history"]] == [NODES, NODES - 1], saved["history"]
    # recorded: the SuperLink's answer in place of the dead node's masked vector
    assert len(saved["rejected"]) == 1 and saved["rejected"][0][1].startswith("the SuperLink answered"), \
        saved["rejected"]
    bound = STEP  # < one step per client, over the clients summed
    oracle = _plain_mean(saved["globals"][1], 2, (0, 2))
    err = (saved["means"][1] - oracle).abs().max().item()
    assert err <= bound, (err, bound)
    # the survivors' mean, not the three clients' (the dead node's update is absent, not zero)
    full = _plain_mean(saved["globals"][1], 2, range(NODES))
    assert (saved["means"][1] - full).abs().max().item() > 100 * bound
    # it waited for the silent node about one stage timeout, never hung
    assert run["took"] < 400, run["took"]
