"""What secure aggregation costs: one server round with SecAgg+ against the plain round.

Both rounds run in this process on :class:`~fedopt_kernels.integrations.flower.inprocess.InProcessGrid`
(every message serialized to Flower's protobuf and back, the bytes counted), with
clients that reply with a fixed random update of ``P`` parameters (no training: the
round's own cost is what is measured):

* ``plain``: the Message-API fused strategy (``fk.FedAvg``): each reply is the client's
  float32 model, aggregated by one fused pass;
* ``secagg+``: Flower's SecAgg+ protocol (``SecAggPlusWorkflow`` + ``secaggplus_mod``, key
  agreement, Shamir shares of each client's keys among ``num_shares`` neighbours, masks
  from a PRG per neighbour, quantization) around the same fused server step
  (:class:`~fedopt_kernels.integrations.flower.secagg.SecAggPlusFusedStrategy`).

Reported per case: the round's wall time, the bytes sent to the nodes and back, and
their ratios to the plain round of the same run.  TLS is measured on a real deployment
(:mod:`.flower_run` with :class:`~.flower_run.Security`), not here: loopback TLS costs
the encryption of the same bytes.  ``python -m fedopt_kernels.benchmarks.secure_round
[--params P] [--nodes 5,10,20] [--shares K]``.  ``--deployed``: TLS and SecAgg+ together on
a real deployment, the four combinations (:func:`deployed_rounds`).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import List, Optional

import numpy as np
import torch

__all__ = ["run", "main"]


class _Flat(torch.nn.Module):
    def __init__(self, p: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(p))


def _update(partition: int, p: int) -> np.ndarray:
    rng = np.random.default_rng(1000 + partition)
    return (rng.standard_normal(p) * 1e-3).astype(np.float32)


def _plain_round(p: int, nodes: int) -> dict:
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
    from flwr.app import Message
    from flwr.clientapp import ClientApp

    from fedopt_kernels.integrations import flower as fk
    from fedopt_kernels.integrations.flower.inprocess import InProcessGrid

    app = ClientApp()

    @app.train()
    def train(msg, context):
        cid = int(context.node_config["partition-id"])
        x = msg.content["arrays"]["w"].numpy()
        reply = RecordDict({"arrays": ArrayRecord({"w": torch.from_numpy(x - _update(cid, p))}),
                            "metrics": MetricRecord({"num-examples": 1}),
                            "fedopt": ConfigRecord({"partition-id": cid,
                                                    "server-round": int(msg.content["config"]["server-round"])})})
        return Message(reply, reply_to=msg)

    model = _Flat(p)
    grid = InProcessGrid(app, nodes)
    strategy = fk.FedAvg(model, fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=nodes,
                         min_train_nodes=nodes)
    t0 = time.perf_counter()
    strategy.start(grid=grid, initial_arrays=fk.model_to_arrayrecord(model), num_rounds=1)
    return {"s": time.perf_counter() - t0, "bytes down": grid.bytes_down, "bytes up": grid.bytes_up,
            "x": model.w.detach().clone()}


def _secagg_round(p: int, nodes: int, shares: Optional[int]) -> dict:
    from flwr.app import Context, Message, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.client.mod import secaggplus_mod
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.compat.common import recorddict_compat as compat
    from flwr.server import LegacyContext, ServerConfig

    from fedopt_kernels import server
    from fedopt_kernels.integrations.flower import secagg
    from fedopt_kernels.integrations.flower.inprocess import InProcessGrid

    app = ClientApp(mods=[secaggplus_mod])

    @app.train()
    def train(msg, context):
        cid = int(context.node_config["partition-id"])
        compat.recorddict_to_fitins(msg.content, keep_input=True)
        fitres = FitRes(Status(Code.OK, "ok"), ndarrays_to_parameters([_update(cid, p)]), 1, {})
        return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)

    model = _Flat(p)
    strategy = secagg.SecAggPlusFusedStrategy(model, server.FedAvg(model.parameters(), lr=1.0),
                                              min_train_nodes=nodes)
    grid = InProcessGrid(app, nodes)
    k = nodes if shares is None else min(shares, nodes)
    workflow = secagg.secaggplus_workflow(strategy, num_shares=k, reconstruction_threshold=max(2, (2 * k) // 3))
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    t0 = time.perf_counter()
    workflow(grid, LegacyContext(ctx, config=ServerConfig(num_rounds=1), strategy=strategy))
    return {"s": time.perf_counter() - t0, "bytes down": grid.bytes_down, "bytes up": grid.bytes_up,
            "x": model.w.detach().clone(), "shares": k}


def run(*, params: int = 1_000_000, nodes=(5, 10, 20), shares: Optional[int] = None) -> List[dict]:
    """One plain and one SecAgg+ round per node count; rows with times, bytes, ratios and
    the largest difference between the two global models (SecAgg+'s quantization)."""
    import logging

    logging.getLogger("flwr").setLevel(logging.WARNING)
    rows = []
    for n in nodes:
        plain = _plain_round(params, n)
        sec = _secagg_round(params, n, shares)
        rows.append({"benchmark": "secure_round", "nodes": n, "params": params, "shares": sec["shares"],
                     "plain s": plain["s"], "secagg s": sec["s"], "time x": sec["s"] / plain["s"],
                     "plain MB up": plain["bytes up"] / 1e6, "secagg MB up": sec["bytes up"] / 1e6,
                     "bytes up x": sec["bytes up"] / plain["bytes up"],
                     "plain MB down": plain["bytes down"] / 1e6, "secagg MB down": sec["bytes down"] / 1e6,
                     "max |x_secagg - x_plain|": float((sec["x"] - plain["x"]).abs().max())})
    return rows


def digits_accuracy(algo: str = "fedavg", *, rounds: int = 20, clients: int = 5, seed: int = 0,
                    dp: Optional[dict] = None) -> dict:
    """Test accuracy after every round on digits, the plain run (``fedopt_kernels.fl.
    Simulation``, which the Message-API Flower strategy equals bit for bit,
    ``tests/test_flower.py``) against the same run under SecAgg+ (in process, the real
    protocol): every client every round, uniform weights, FedNAR clients with the
    simulator's defaults.  ``dp``: ``SecureDP`` settings for the secure run (the plain one
    has none)."""
    import logging

    from flwr.app import Context, RecordDict
    from flwr.server import LegacyContext, ServerConfig

    from fedopt_kernels import server
    from fedopt_kernels.fl import Simulation, SimulationConfig, build_model
    from fedopt_kernels.fl.seeds import init_seed
    from fedopt_kernels.integrations.flower import secagg
    from fedopt_kernels.integrations.flower.inprocess import InProcessGrid

    logging.getLogger("flwr").setLevel(logging.WARNING)
    cfg = SimulationConfig(dataset="digits", model="mlp", clients=clients, per_round=clients, rounds=rounds,
                           algo=algo, nar="co", seed=seed, eval_every=1, engine="sequential", weighting="uniform")
    plain = Simulation(cfg)
    plain.run()
    plain_acc = [r["test_accuracy"] for r in plain.results.records]

    sim = Simulation(cfg)  # its data, partition, model and evaluation
    ds, part = sim.dataset, sim.partition

    def model_fn(context=None):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed(cfg.seed))
            return build_model(cfg.model, ds.input_shape, ds.num_classes, hidden=cfg.hidden)

    def data_fn(context):
        idx = part.client_indices[int(context.node_config["partition-id"])]
        return ds.x_train[idx], ds.y_train[idx]

    client = secagg.SecAggFedNARClient(model_fn, data_fn, config=sim.local, seed=cfg.seed)
    model = model_fn()
    opt = server.algorithm(algo).cls([p for _, p in model.named_parameters()], **sim.server.hyper)
    accuracy = [sim.evaluate()[0]]

    def evaluate_fn(m, server_round):
        sim.x_global.copy_(torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
        acc, loss = sim.evaluate()[:2]
        accuracy.append(acc)
        return loss, {"test_accuracy": acc}

    strategy = secagg.SecAggPlusFusedStrategy(model, opt, min_train_nodes=clients, evaluate_fn=evaluate_fn,
                                              dp=secagg.SecureDP(**dp) if dp else None)
    workflow = secagg.secaggplus_workflow(strategy)
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    workflow(InProcessGrid(client.app(), clients), LegacyContext(ctx, config=ServerConfig(num_rounds=rounds),
                                                                  strategy=strategy))
    return {"algo": algo, "rounds": rounds, "clients": clients, "plain": plain_acc, "secagg": accuracy}


def tls_rounds(*, nodes: int = 5, hidden: int = 3400, rounds: int = 2, workdir=None) -> List[dict]:
    """A real deployment (SuperLink and ``nodes`` SuperNodes as processes on loopback,
    ``flwr run`` of the example app, the fused FedAvg and FedNAR clients) twice: insecure
    and with TLS + SuperNode authentication.  ``hidden=3400`` makes the MLP 11.8M
    parameters, a ResNet-18-sized reply (47 MB of float32).  Rows: the median round time
    of each, and the payload bytes of a round (the float32 model to every node and back;
    TLS adds its record framing, well under 1%).  The certificates and keys are a
    throwaway CA's (:mod:`.pki`), as in the tests."""
    import statistics
    import tempfile
    from pathlib import Path

    from . import flower_run as FR
    from .pki import make_security

    workload = dict(clients=nodes, per_round=nodes, rounds=rounds, local_steps=3, hidden=hidden, batch_size=32,
                    lr=0.05, lr_decay=0.998, weight_decay=1e-3, max_norm=10.0, alpha=0.3, seed=0)
    params = 64 * hidden + hidden + hidden * hidden + hidden + hidden * 10 + 10
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedopt-tls-") as tmp:
        for secure in (False, True):
            root = Path(tmp) / ("tls" if secure else "insecure")
            root.mkdir()
            security, keys = make_security(root / "pki", nodes) if secure else (None, None)
            link = FR.start_superlink(root, simulation=False, security=security)
            procs = []
            try:
                if secure:
                    for _, public in keys:
                        FR.register_supernode(link, public)
                procs = FR.start_supernodes(link, nodes, root, private_keys=[k for k, _ in keys] if secure else None)
                res = FR.run_flower(link, root / "flower", deployment=True, timeout=3600, **workload)
            finally:
                for proc in procs:
                    FR.stop_process(proc)
                link.stop()
            rows.append({"benchmark": "tls_round", "security": "tls+node-auth" if secure else "insecure",
                         "nodes": nodes, "params": params, "median round s": statistics.median(res.round_s),
                         "payload MB per round": 2 * 4 * params * nodes / 1e6,
                         "final accuracy": res.accuracy[-1]})
    return rows


SECAGG_APP = "examples/flower_secagg_app"


def deployed_rounds(*, nodes: int = 3, width: int = 974_126, rounds: int = 2, timeout: float = 600.0,
                    workdir=None) -> List[dict]:
    """The four combinations on a real deployment (a SuperLink and ``nodes`` SuperNodes as
    processes on loopback, ``flwr run examples/flower_secagg_app``, FedNAR clients and
    FedAvg's fused step): insecure or TLS + SuperNode authentication, each without and
    with SecAgg+ (the app's ``secure-aggregation``).  ``width=974126``: an MLP of 11.69M
    parameters, a ResNet-18-sized update.  Rows: each round's seconds (the ServerApp's
    clock, from the start of its workflow to the end of each round's step) and the
    final global model's distance to the insecure plain run's."""
    import subprocess
    import tempfile
    from pathlib import Path

    from . import flower_run as FR
    from .pki import make_security

    app = FR.REPO / SECAGG_APP
    rows, ref = [], None
    with tempfile.TemporaryDirectory(prefix="fedopt-secdeploy-", dir=workdir) as tmp:
        for tls in (False, True):
            for sec in (False, True):
                name = ("tls+node-auth" if tls else "insecure") + (" + secagg+" if sec else "")
                root = Path(tmp) / name.replace(" ", "").replace("+", "_")
                root.mkdir()
                security, keys = make_security(root / "pki", nodes) if tls else (None, None)
                link = FR.start_superlink(root, simulation=False, security=security)
                procs = []
                try:
                    if tls:
                        for _, public in keys:
                            FR.register_supernode(link, public)
                    procs = FR.start_supernodes(link, nodes, root, private_keys=[k for k, _ in keys] if tls else None)
                    config = (f"num-server-rounds={rounds} num-nodes={nodes} width={width} timeout={timeout} "
                              f"secure-aggregation={'true' if sec else 'false'} save-path='{root / 'out'}'")
                    proc = subprocess.run([link.flwr, "run", str(app), link.connection, "--stream", "--run-config",
                                           config], capture_output=True, text=True, env=link.env, cwd=root,
                                          timeout=3600)
                finally:
                    for p in procs:
                        FR.stop_process(p)
                    link.stop()
                saved_path = root / "out" / "secagg.pt"
                if proc.returncode != 0 or not saved_path.exists():
                    raise RuntimeError(f"{name}: the run failed (rc={proc.returncode}):\n"
                                       f"{(proc.stdout + proc.stderr)[-3000:]}")
                saved = torch.load(saved_path, weights_only=False)
                stamps = saved["stamps"]
                x = saved["globals"][-1]
                ref = x if ref is None else ref
                rows.append({"benchmark": "secure_deployment", "security": name, "nodes": nodes,
                             "params": 12 * width + 3,
                             "round s": [b - a for a, b in zip(stamps, stamps[1:])],
                             "clients per round": [h["clients"] for h in saved["history"]],
                             "max |x - x_insecure_plain|": float((x - ref).abs().max())})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=1_000_000, help="parameters per reply (ResNet-18: 11689512)")
    ap.add_argument("--nodes", default="5,10,20", help="comma-separated node counts")
    ap.add_argument("--shares", type=int, default=None, help="SecAgg+ neighbours per node (default: all)")
    ap.add_argument("--accuracy", default=None, help="instead: digits accuracy, plain vs SecAgg+, for these algos")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tls", action="store_true", help="instead: a deployment round, insecure vs TLS (--nodes: one count)")
    ap.add_argument("--hidden", type=int, default=3400, help="--tls: the MLP's width (3400: 11.8M parameters)")
    ap.add_argument("--deployed", action="store_true",
                    help="instead: a deployment round, insecure/TLS x plain/SecAgg+ (--nodes: one count; --width)")
    ap.add_argument("--width", type=int, default=974_126, help="--deployed: the MLP's width (974126: 11.69M params)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.deployed:
        rows = deployed_rounds(nodes=int(args.nodes.split(",")[0]), width=args.width, rounds=args.rounds)
        for r in rows:
            print(f"{r['security']}: {r['nodes']} nodes, {r['params']:,} params: rounds "
                  f"{', '.join(f'{t:.1f}' for t in r['round s'])} s; clients {r['clients per round']}; "
                  f"max |x - x_plain| {r['max |x - x_insecure_plain|']:.2e}")
    elif args.tls:
        rows = tls_rounds(nodes=int(args.nodes.split(",")[0]), hidden=args.hidden, rounds=2)
        for r in rows:
            print(f"{r['security']}: {r['nodes']} nodes, {r['params']:,} params: median round {r['median round s']:.2f} s, "
                  f"{r['payload MB per round']:.0f} MB of payload a round")
        print(f"TLS + node auth / insecure: {rows[1]['median round s'] / rows[0]['median round s']:.2f}x the round time")
    elif args.accuracy:
        rows = [digits_accuracy(a, rounds=args.rounds) for a in args.accuracy.split(",")]
        for r in rows:
            print(f"{r['algo']}: {r['clients']} clients, {r['rounds']} rounds: final accuracy plain "
                  f"{r['plain'][-1]:.4f}, SecAgg+ {r['secagg'][-1]:.4f}; max |difference| over rounds "
                  f"{max(abs(a - b) for a, b in zip(r['plain'], r['secagg'])):.4f}")
    else:
        rows = run(params=args.params, nodes=tuple(int(v) for v in args.nodes.split(",")), shares=args.shares)
        for r in rows:
            print(f"{r['nodes']:>3} nodes, {r['params']:,} params, {r['shares']} shares: plain {r['plain s']:.2f} s, "
                  f"SecAgg+ {r['secagg s']:.2f} s ({r['time x']:.1f}x); up {r['plain MB up']:.1f} MB -> "
                  f"{r['secagg MB up']:.1f} MB ({r['bytes up x']:.2f}x); down {r['plain MB down']:.1f} -> "
                  f"{r['secagg MB down']:.1f} MB; max |x diff| {r['max |x_secagg - x_plain|']:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
