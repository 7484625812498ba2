"""Flower's deployment mode, for real: a SuperLink and 3 SuperNodes as separate processes
on loopback (``flower-superlink``, ``flower-supernode --superlink 127.0.0.1:PORT
--node-config "partition-id=i num-partitions=3"``), then ``flwr run
examples/flower_app`` on them: the fused FedAvg server and FedNAR clients for 3 rounds.
The global model after every round (its test accuracy) and at the end must equal
``fedopt simulate`` on the same clients, data and seeds bit for bit (every client every
round, sequential engine): the strategy aggregates in partition-id order, so the order
in which the replies arrive cannot matter.

Secured as a site would deploy it (issue 45): TLS (the SuperLink's certificate signed by
a CA the test makes, ``fedopt_kernels/benchmarks/pki.py``; every SuperNode and ``flwr`` verify it) and
SuperNode authentication (``--enable-supernode-auth``: only nodes whose public keys
were registered with ``flwr supernode register`` may join).  The secure run gives the
same bits as the same run ``--insecure``, and both those of ``fedopt simulate``.  A
SuperNode whose key was not registered, one without the CA, and one facing a SuperLink
whose certificate has expired are each refused: they exit, with Flower's reason in
their log, and never train.

With faults (issue 16): one SuperNode is killed mid-round and one sends a malformed
reply; the run finishes its rounds with the rest, and its global model is bit for bit
that of ``fedopt``'s simulation without those clients in those rounds.

The deployments (secure, insecure, faulty) and the refusals run at the same time (one
module fixture, each on its own SuperLink and SuperNodes): the faulty one spends about a
minute waiting for the dead node's heartbeats to stop (Flower's fixed 30 s interval, 2
missed), which the other runs' work fills; each test then checks its own run.  Every process is started in its own session
and stopped (SIGTERM, then SIGKILL) when its run ends, pass or fail; only 127.0.0.1 is
used.  Skipped only on Python 3.10, where flwr 1.41 cannot be installed.
"""

from __future__ import annotations

import json
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import subprocess

import pytest
import torch
from _flwr import needs_flwr

from fedopt_kernels.benchmarks import flower_run as FR
from fedopt_kernels.benchmarks import pki
from fedopt_kernels.fl import Simulation, SimulationConfig

NODES = 3
WORKLOAD = dict(clients=NODES, per_round=NODES, rounds=3, local_steps=3, hidden=16, batch_size=32, lr=0.05,
                lr_decay=0.998, weight_decay=1e-3, max_norm=10.0, alpha=0.3, seed=0)


# The faults of the second deployment, by node: node 1's SuperNode is killed as its
# round-2 training starts, node 2 leaves a layer out of its round-3 reply.
FAULTS = {1: 'fault="die@2"', 2: 'fault="malformed@3"'}


@dataclass
class Deployment:
    """One deployment's run: its directory, the Flower result (or the exception that
    ended the run), which SuperNodes were still running when ``flwr run`` returned,
    whether every process had exited once stopped, and the run's seconds."""

    path: Path
    flower: object = None
    error: BaseException = None
    alive_after_run: list = field(default_factory=list)
    all_stopped: bool = False
    took: float = 0.0

    def result(self):
        if self.error is not None:
            raise self.error
        return self.flower


def _security(path: Path, *, expired: bool = False) -> FR.Security:
    """TLS with a certificate from a fresh test CA, and SuperNode authentication."""
    ca = pki.make_ca(path / "pki")
    cert, key = pki.make_server_cert(ca, path / "pki", expired=expired)
    return FR.Security(ca.cert, cert, key, node_auth=True)


def _start(path: Path, node_config=None, secure: bool = False):
    """A deployment SuperLink and its NODES SuperNodes (they take the environment the
    SuperLink was started in); ``secure``: TLS and SuperNode authentication, each node's
    public key registered before it starts."""
    path.mkdir(parents=True, exist_ok=True)
    link = FR.start_superlink(path, simulation=False, security=_security(path) if secure else None)
    try:
        keys = None
        if secure:
            pairs = pki.make_node_keys(path / "pki", NODES)
            for _, public in pairs:
                FR.register_supernode(link, public)
            keys = [private for private, _ in pairs]
        return link, FR.start_supernodes(link, NODES, path, node_config=node_config, private_keys=keys)
    except BaseException:
        link.stop()
        raise


def _refusals(path: Path) -> dict:
    """SuperNodes a secure deployment must refuse, each against a live TLS SuperLink with
    SuperNode authentication: ``unregistered`` (a valid CA, a key never registered),
    ``no CA`` (a registered key, no root certificate: the system's CAs cannot verify the
    test CA), ``expired`` (a registered key and the right CA, a SuperLink whose
    certificate expired an hour ago).  Returns ``{name: (exit code or None if still
    running after 120 s, its log)}``; every process is stopped."""
    path.mkdir(parents=True, exist_ok=True)
    links, procs, out = [], {}, {}
    try:
        good = FR.start_superlink(path / "valid", simulation=False, security=_security(path / "valid"))
        links.append(good)
        expired = FR.start_superlink(path / "expired", simulation=False,
                                     security=_security(path / "expired", expired=True))
        links.append(expired)
        (key0, pub0), (key1, _) = pki.make_node_keys(path, 2)
        FR.register_supernode(good, pub0)
        cases = {"unregistered": (good, dict(private_key=key1)),
                 "no CA": (good, dict(private_key=key0, root_certificates=None)),
                 "expired": (expired, dict(private_key=key0))}
        for name, (link, kw) in cases.items():
            log = path / f"{name.replace(' ', '_')}.log"
            with open(log, "w") as fh:
                procs[name] = (subprocess.Popen(FR.supernode_command(link, "partition-id=0 num-partitions=3", **kw),
                                                stdout=fh, stderr=subprocess.STDOUT, env=link.env,
                                                start_new_session=True), log)
        deadline = time.monotonic() + 120
        for name, (proc, log) in procs.items():
            try:
                rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = None
            out[name] = (rc, log.read_text())
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                FR.stop_process(proc)
        for link in links:
            link.stop()
    return out


def _run(deployment: Deployment, link, nodes) -> Deployment:
    """``flwr run`` of the workload on the deployment, then every process stopped."""
    try:
        t0 = time.perf_counter()
        try:
            deployment.flower = FR.run_flower(link, deployment.path / "flower", deployment=True, timeout=600,
                                              **WORKLOAD)
        except BaseException as e:  # noqa: BLE001 - re-raised by the test of this deployment
            deployment.error = e
        deployment.took = time.perf_counter() - t0
        deployment.alive_after_run = [p.poll() is None for p in nodes]
    finally:
        for proc in nodes:
            FR.stop_process(proc)
        link.stop()
    deployment.all_stopped = all(p.poll() is not None for p in nodes + [link.proc])
    return deployment


@pytest.fixture(scope="module")
def deployments(tmp_path_factory):
    """Every deployment, run at once: ``{"plain": (secure), "insecure": ..., "faults":
    ..., "refusals": {name: (exit code, log)}}``."""
    root = tmp_path_factory.mktemp("deployments")
    # One torch thread in every process of the plain runs, as simulate's sequential engine
    # runs: MKL's strict mode (backends/mkl.py) gives a product's bits for a fixed thread
    # count, and Flower's processes would otherwise run torch's default
    # (docs/determinism.md).  The faulty run keeps the environment as it is.
    plain, insecure, faults = Deployment(root / "plain"), Deployment(root / "insecure"), Deployment(root / "faults")
    started = []
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("OMP_NUM_THREADS", "1")
            started.append((plain, *_start(plain.path, secure=True)))
            started.append((insecure, *_start(insecure.path)))
        started.append((faults, *_start(faults.path, node_config=FAULTS)))
    except BaseException:
        for _, link, nodes in started:
            for proc in nodes:
                FR.stop_process(proc)
            link.stop()
        raise
    with ThreadPoolExecutor(len(started) + 1) as pool:
        futures = [pool.submit(_run, *args) for args in started]
        refusals = pool.submit(_refusals, root / "refusals")
        for f in futures:
            f.result()
    return {"plain": plain, "insecure": insecure, "faults": faults, "refusals": refusals.result()}


def _final_model(run: Deployment) -> torch.Tensor:
    state = torch.load(run.path / "flower" / "final_model.pt", weights_only=True)
    return torch.cat([v.flatten() for v in state.values()])


@needs_flwr
@pytest.mark.slow
def test_superlink_and_supernodes_as_processes_equal_fedopt_simulate(deployments, tmp_path, monkeypatch):
    """The secure deployment (TLS, authenticated SuperNodes) equals the insecure one and
    ``fedopt simulate``, bit for bit."""
    run, plain = deployments["plain"], deployments["insecure"]
    flower, flower_insecure = run.result(), plain.result()
    assert run.flower.extra.get("security") == "tls+node-auth" and plain.flower.extra.get("security") == "insecure"
    assert all(run.alive_after_run) and all(plain.alive_after_run), "a SuperNode exited during the run"
    assert run.all_stopped and plain.all_stopped  # nothing left running
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # simulate at one thread, as the Flower processes ran
    fedopt = FR.run_fedopt(tmp_path / "fedopt", engine="sequential", **WORKLOAD)
    assert flower.sampled == [NODES] * WORKLOAD["rounds"] and fedopt.sampled == [NODES] * WORKLOAD["rounds"]
    assert len(flower.accuracy) == WORKLOAD["rounds"] + 1
    assert flower.accuracy == fedopt.accuracy == flower_insecure.accuracy
    x_flower = _final_model(run)
    x_fedopt = torch.load(tmp_path / "fedopt" / "checkpoint.pt", weights_only=True)["x_global"]
    assert torch.equal(x_flower, x_fedopt), (x_flower - x_fedopt).abs().max()
    assert torch.equal(x_flower, _final_model(plain))
    assert len(set(flower.accuracy)) > 1  # the model moved: a run that trained nothing would also be "equal"


@needs_flwr
@pytest.mark.slow
@pytest.mark.parametrize("case, reason", [
    ("unregistered", "Failed to activate SuperNode"),
    ("no CA", "CERTIFICATE_VERIFY_FAILED"),
    ("expired", "certificate has expired"),
])
def test_a_secure_superlink_refuses_unknown_nodes_and_nodes_refuse_an_untrusted_superlink(deployments, case, reason):
    """A SuperNode whose key was never registered is refused by the SuperLink; one without
    the CA, or facing a SuperLink whose certificate has expired, refuses the connection.
    Each exits with an error (never a hang) and Flower's reason is in its log."""
    rc, log = deployments["refusals"][case]
    assert rc is not None, f"{case}: the SuperNode was still running after 120 s"
    assert rc != 0, f"{case}: exit code {rc}\n{log[-2000:]}"
    assert reason in log, log[-2000:]


def _simulation_without(workload, absent):
    """``fedopt``'s simulation of the workload (the sequential engine, as the test
    above), leaving ``absent[r]`` (client ids) out of round ``r``: the oracle of a run
    that lost those clients' replies.  Returns the accuracy after rounds 0..R and the
    final global vector."""
    w = workload
    cfg = SimulationConfig(dataset="digits", model="mlp", hidden=(w["hidden"], w["hidden"]), clients=w["clients"],
                           per_round=w["per_round"], rounds=w["rounds"], partition="dirichlet", alpha=w["alpha"],
                           weighting="auto", local_steps=w["local_steps"], batch_size=w["batch_size"], lr=w["lr"],
                           lr_decay=w["lr_decay"], weight_decay=w["weight_decay"], max_norm=w["max_norm"],
                           seed=w["seed"], eval_every=1, engine="sequential", algo="fedavg", nar="co")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sim = Simulation(cfg)
    sampled = sim.sample_clients
    sim.sample_clients = lambda r: [c for c in sampled(r) if c not in absent.get(r, ())]
    accuracy = [sim.evaluate()[0]]
    for _ in range(w["rounds"]):
        sim.run_round()
        accuracy.append(sim.evaluate()[0])
    return accuracy, sim.x_global.clone()


@needs_flwr
@pytest.mark.slow
def test_a_killed_supernode_and_a_malformed_reply_cost_only_their_own_updates(deployments):
    """Node 1's SuperNode is killed as its round-2 training starts (the example app's
    ``fault="die@2"``: the process exits without a reply; the SuperLink answers for it
    once its heartbeats stop) and node 2 leaves a layer out of its round-3 reply
    (``fault="malformed@3"``).  The run completes all its rounds; round 2 aggregates
    nodes 0 and 2, round 3 node 0 alone (node 1 is gone, node 2's reply is left out),
    each counted under its reason; every round's accuracy and the final model equal the
    simulation without those clients in those rounds, bit for bit."""
    run = deployments["faults"]
    flower, took = run.result(), run.took
    assert not run.alive_after_run[1], "node 1 should have been killed in round 2"
    assert run.alive_after_run[0] and run.alive_after_run[2], "only node 1 should have died"
    assert run.all_stopped  # nothing left running
    history = {h["round"]: h for h in json.loads((run.path / "flower" / "history.json").read_text())}
    assert sorted(history) == list(range(WORKLOAD["rounds"] + 1)), f"rounds run: {sorted(history)} ({took:.0f} s)"
    assert history[1].get("excluded_clients", 0) == 0
    assert history[2]["excluded_clients"] == 1 and history[2]["excluded_error_reply"] == 1, history[2]
    assert history[3]["excluded_clients"] == 1 and history[3]["excluded_bad_arrays"] == 1, history[3]
    accuracy, x_oracle = _simulation_without(WORKLOAD, {2: (1,), 3: (1, 2)})
    assert flower.accuracy == accuracy
    state = torch.load(run.path / "flower" / "final_model.pt", weights_only=True)
    x_flower = torch.cat([v.flatten() for v in state.values()])
    assert torch.equal(x_flower, x_oracle), (x_flower - x_oracle).abs().max()
    # the faults changed the result: the run with every client ends elsewhere
    full, _ = _simulation_without(WORKLOAD, {})
    assert full[-1] != accuracy[-1] or full[2] != accuracy[2]
