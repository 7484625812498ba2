"""FedBuff on Flower's Message API (integrations/flower/fedbuff.py) over a fake grid.

The fake grid answers node ``i`` after ``delays[i]`` pulls (a deterministic virtual
clock), so the arrival order is known; the model after the run is compared, bit for
bit, with a hand-written replay of the recorded replies through server/fedbuff.py's
staleness rule and the same server optimizer."""

import uuid
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from fedopt_kernels import server as srv
from fedopt_kernels.integrations.flower.fedbuff import FedBuffFlowerLoop
from fedopt_kernels.integrations.flower.records import (arrayrecord_to_vector, tensors_to_arrayrecord,
                                                         vector_to_named_tensors)
from fedopt_kernels.server.fedbuff import FedBuffBuffer, staleness_weight
from fedopt_kernels.utils.flat import FlatLayout


def _client_update(x: torch.Tensor, node: int) -> torch.Tensor:
    """A stand-in for local training: Delta = x_pulled - x_end, different per node."""
    return (0.25 * x + 0.01 * node).to(torch.float32)


class FakeGrid:
    """push/pull of flwr's Grid; node ``n`` replies after ``delays[n]`` pulls (None: never)."""

    def __init__(self, layout, delays, bad=()):
        self.layout, self.delays, self.bad = layout, delays, set(bad)
        self.pending = {}  # message id -> (pulls left, reply)
        self.pulls = 0

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content=content, message_type=message_type, dst_node_id=dst_node_id, group_id=group_id)

    def push_messages(self, messages):
        ids = []
        for m in messages:
            mid = uuid.uuid4().hex
            m.metadata.__dict__.update(_message_id=mid, _src_node_id=0)
            node = m.metadata.dst_node_id
            x = arrayrecord_to_vector(m.content["arrays"], self.layout)
            version = int(m.content["config"]["version"])
            if node in self.bad:  # a malformed reply: the update misses a parameter
                content = RecordDict({"update": ArrayRecord(), "config": ConfigRecord({"version": version})})
            else:
                upd = tensors_to_arrayrecord(vector_to_named_tensors(_client_update(x, node), self.layout))
                content = RecordDict({"update": upd, "config": ConfigRecord({"version": version})})
            reply = Message(content=content, reply_to=m)
            if self.delays[node] is not None:
                self.pending[mid] = (self.delays[node], reply)
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids):
        self.pulls += 1
        out = []
        for mid in message_ids:
            if mid in self.pending:
                left, reply = self.pending[mid]
                if left <= 1:
                    del self.pending[mid]
                    out.append(reply)
                else:
                    self.pending[mid] = (left - 1, reply)
        return out


@pytest.fixture(autouse=True)
def _task_identity():
    """Messages are built inside a ServerApp's run; a test stands in for that run."""
    from flwr.supercore.task_identity import TaskIdentity
    saved = TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = saved


def _setup(seed=0, K=2, staleness="polynomial"):
    torch.manual_seed(seed)
    named = [("w", torch.randn(3, 5)), ("b", torch.randn(7))]
    params = [torch.nn.Parameter(t.clone()) for _, t in named]
    layout = FlatLayout.from_named_tensors(named)
    buf = FedBuffBuffer(srv.FedAdam(params, lr=0.05), K, staleness=staleness)
    return named, params, layout, buf


def _replay(named, log, K, staleness):
    """Hand-written FedBuff: the recorded replies, in order, weighted by s(tau), mean of K,
    FedAdam step; the client update recomputed from the model version it was sent."""
    params = [torch.nn.Parameter(t.clone()) for _, t in named]
    opt = srv.FedAdam(params, lr=0.05)
    versions = [torch.cat([p.detach().reshape(-1) for p in params]).clone()]
    rows = []
    for node, version, tau in log:
        assert tau == len(versions) - 1 - version
        upd = _client_update(versions[version], node)
        rows.append(upd * staleness_weight(tau, staleness))
        if len(rows) == K:
            opt.step(torch.stack(rows))
            rows = []
            versions.append(torch.cat([p.detach().reshape(-1) for p in params]).clone())
    return torch.cat([p.detach().reshape(-1) for p in params])


@pytest.mark.parametrize("staleness", ["polynomial", "hinge"])
def test_fast_nodes_report_more_and_fresher_and_model_matches_replay(staleness):
    named, params, layout, buf = _setup(K=2, staleness=staleness)
    delays = {1: 1, 2: 2, 3: 7}
    loop = FedBuffFlowerLoop(buf, layout, concurrency=3, poll=0.0)
    loop.run(FakeGrid(layout, delays), [1, 2, 3], steps=6)
    assert buf.version == 6 and not loop.dropped
    count = {n: sum(1 for r in loop.log if r[0] == n) for n in delays}
    assert count[1] > count[2] > count[3] >= 1
    mean_tau = {n: sum(r[2] for r in loop.log if r[0] == n) / count[n] for n in delays}
    assert mean_tau[1] <= mean_tau[2] < mean_tau[3]
    assert max(r[2] for r in loop.log if r[0] == 3) >= 2  # the slow node trained on an old model
    got = torch.cat([p.detach().reshape(-1) for p in params])
    assert torch.equal(got, _replay(named, loop.log, 2, staleness))


def test_silent_node_dropped_after_deadline_and_malformed_reply_screened():
    named, params, layout, buf = _setup(K=2)
    loop = FedBuffFlowerLoop(buf, layout, concurrency=4, deadline=0.05, poll=0.01)
    grid = FakeGrid(layout, {1: 3, 2: 4, 3: None, 4: 1}, bad={4})
    loop.run(grid, [1, 2, 3, 4], steps=10)  # ~0.2 s of polling: past the deadline
    assert buf.version == 10
    assert "no reply within" in loop.dropped[3]
    assert "malformed" in loop.dropped[4]
    assert {r[0] for r in loop.log} == {1, 2}
    got = torch.cat([p.detach().reshape(-1) for p in params])
    assert torch.equal(got, _replay(named, loop.log, 2, "polynomial"))


def test_bad_arguments_named():
    _, _, layout, buf = _setup()
    with pytest.raises(ValueError, match="concurrency"):
        FedBuffFlowerLoop(buf, layout, concurrency=0)
    with pytest.raises(ValueError, match="deadline"):
        FedBuffFlowerLoop(buf, layout, concurrency=1, deadline=0)


# --------------------------------------------------------------------------- deployment mode
APP = Path(__file__).resolve().parents[1] / "examples" / "flower_fedbuff_app"
DELAYS = {0: 0.0, 1: 1.0, 2: 6.0}  # partition -> seconds each node sleeps before replying (each message also costs a ClientApp start, seconds on a loaded machine)


@pytest.mark.slow
def test_deployment_superlink_and_three_supernodes_with_delays(tmp_path, monkeypatch):
    """A SuperLink and 3 SuperNodes on loopback (insecure), the example FedBuff app: the
    record matches the delays and the model equals the replay of the recorded replies."""
    import subprocess
    monkeypatch.syspath_prepend(str(APP))
    from fedbuff_app.task import client_update, initial_model
    from fedopt_kernels.benchmarks import flower_run as FR

    link = FR.start_superlink(tmp_path, simulation=False)
    nodes = []
    try:
        nodes = FR.start_supernodes(link, 3, tmp_path, node_config={i: f"delay={d}" for i, d in DELAYS.items()})
        out = tmp_path / "out"
        out.mkdir()
        cmd = [link.flwr, "run", str(APP), link.connection, "--stream", "--run-config",
               f"steps=6 buffer=2 deadline=120.0 save-path='{out}'"]  # a wait, not under test here (no node is
        # dropped: asserted below; the deadline's rule is the fake-grid test's): 30 s was missed once under load
        proc = subprocess.run(cmd, capture_output=True, text=True, env=link.env, cwd=tmp_path, timeout=240)
        assert (out / "run.pt").exists(), (proc.stdout + proc.stderr)[-3000:]
    finally:
        for p in nodes:
            FR.stop_process(p)
        link.stop()
    run = torch.load(out / "run.pt", weights_only=True)
    assert run["version"] == 6 and not run["dropped"]
    # replay: the recorded updates in order through the staleness rule and FedAdam; each
    # update also names its node's partition (client_update of the version it was sent)
    named = initial_model()
    params = [torch.nn.Parameter(t.clone()) for _, t in named]
    opt = srv.FedAdam(params, lr=0.05)
    versions = [torch.cat([p.detach().reshape(-1) for p in params]).clone()]
    rows, part_of = [], {}
    for (node, version, tau), upd in zip(run["log"], run["updates"]):
        assert tau == len(versions) - 1 - version
        matches = [q for q in DELAYS if torch.equal(upd, client_update(versions[version], q))]
        assert len(matches) == 1
        assert part_of.setdefault(node, matches[0]) == matches[0]
        rows.append(upd * staleness_weight(tau, "polynomial"))
        if len(rows) == 2:
            opt.step(torch.stack(rows))
            rows = []
            versions.append(torch.cat([p.detach().reshape(-1) for p in params]).clone())
    assert torch.equal(run["model"], torch.cat([p.detach().reshape(-1) for p in params]))
    count = {q: sum(1 for r in run["log"] if part_of[r[0]] == q) for q in DELAYS}
    tau = {q: sum(r[2] for r in run["log"] if part_of[r[0]] == q) / max(count[q], 1) for q in DELAYS}
    # Wall-clock arrivals: each message also costs its SuperNode a ClientApp start of a few
    # seconds on a loaded machine, which blurs the injected delays, so only the ends of the
    # order are asserted, and not strictly (the fake-grid tests above check the strict order
    # where the timing is controlled; the replay above is exact whatever the order).
    assert all(count[q] >= 1 for q in DELAYS) and count[0] >= count[2]
    assert tau[0] <= tau[2]
    print("recorded (partition, version, staleness):", [(part_of[n], v, t) for n, v, t in run["log"]])
