"""Benchmark of a whole simulated round: batched engine vs sequential engine vs a plain loop.

FedNAR's recipe on ``digits`` (Dirichlet(0.3) split): every client of the round runs 20
local steps of batch 32 (lr 0.05, weight decay 1e-3, max norm 10, mode co), then the
server averages.  Candidates, timed interleaved in the same run (``timing.interleaved``),
milliseconds per round (medians):

* ``batched engine``: :meth:`Simulation.run_round` with ``engine="batched"`` -- all
  clients as one ``[C, N]`` computation (:mod:`fedopt_kernels.fl.engine.batched`);
* ``sequential engine``: the same with ``engine="sequential"`` (one client after
  another, fused FedNAR step);
* ``hand-written loop``: what an FL paper's code does -- the FedNAR authors' released
  loop (:class:`HandWrittenLoop`, style ``"authors"``): for each client a copy of the
  global model, then per step ``zero_grad``, forward, ``loss + 0.5 wd ||x||^2``,
  ``backward``, ``clip_grad_norm_``, an SGD step; finally the data-size weighted mean;
* ``hand-written loop, lean``: the same recipe with its framework overhead removed
  (no ``DataLoader``, no model copies, no ``.item()``): the fastest plain loop.

No evaluation is timed (``eval_every`` is past the benchmark).  ``vs hand loop`` is the
authors'-style loop's time over the candidate's (higher is faster).

Two figures per setting: the *repeated round* above (every client of a small
federation trains every round: the friendliest case, the same shapes every time), and a
*real run* (:func:`bench_real_run`): ``clients`` clients of which ``per_round`` are
sampled anew every round, consecutive rounds of one run with the default engine, each
timed beside the authors' loop over the same sampled clients (30 rounds: the median
of rounds 2-30, and their mean with the traces of new group shapes included); the
first round and one evaluation of the test set are reported on their own rows.

A third figure, on a GPU only (:func:`bench_device_vs_cpu`, suite ``device_vs_cpu``): the
same real run with the batched engine on the GPU and on the CPU, rounds interleaved;
``vs cpu`` is the CPU's ms/round over the device's.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from .timing import interleaved, ratio_rows

RECIPE = dict(local_steps=20, batch_size=32, lr=0.05, weight_decay=1e-3, max_norm=10.0, nar="co", algo="fedavg",
              alpha=0.3)
NEVER = 10 ** 9


def _simulation(model: str, clients: int, engine: str, device: str, backend: Optional[str], client_batch: int = 0):
    from ..fl import Simulation, SimulationConfig

    cfg = SimulationConfig(dataset="digits", model=model, clients=clients, per_round=clients, rounds=NEVER,
                           eval_every=NEVER, engine=engine, device=device, backend=backend,
                           client_batch=client_batch, **RECIPE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Simulation(cfg)


class HandWrittenLoop:
    """The plain PyTorch round of an FL paper's code, on the same data, partition and
    initial model as the simulation ``sim``, in one of two styles:

    * ``"authors"``: the FedNAR authors' released loop (``util_general.LocalUpdate``):
      per client a deep copy of the global model, a shuffling ``DataLoader`` over the
      client's samples, ``SGD``; per step ``zero_grad``, forward, ``loss + 0.5 wd
      ||parameters_to_vector(net)||^2``, ``backward``, ``clip_grad_norm_`` (its norm
      compared with ``max_norm``), ``step``, ``loss.item()``; the client's update
      ``parameters_to_vector`` of the difference; the server adds the data-size
      weighted mean update.
    * ``"lean"``: the same steps without the framework overhead a careful researcher
      would remove: one model whose weights are copied in per client, batches by
      tensor indexing, the penalty as a sum over the parameters, no ``.item()``.
    """

    def __init__(self, sim, style: str = "authors"):
        import copy

        if style not in ("authors", "lean"):
            raise ValueError(f"style must be 'authors' or 'lean', got {style!r}")
        cfg = sim.config
        self.style = style
        self.model = copy.deepcopy(sim.global_model)
        self.params = list(self.model.parameters())
        self.global_params = [p.detach().clone() for p in self.params]
        self.x, self.y = sim.dataset.x_train, sim.dataset.y_train
        self.clients = [ix.to(sim.device) for ix in sim.partition.client_indices]
        sizes = [ix.numel() for ix in self.clients]
        self.weights = [n / sum(sizes) for n in sizes]
        self.steps, self.batch = cfg.local.steps, cfg.local.batch_size
        self.lr, self.wd, self.max_norm = cfg.lr, cfg.weight_decay, cfg.max_norm
        self.generator = torch.Generator().manual_seed(cfg.seed)

    def round(self, clients: Optional[List[int]] = None) -> None:
        """One round over ``clients`` (indices into the partition; default: every client),
        weighted by data size among them."""
        if clients is None:
            idx, weights = self.clients, self.weights
        else:
            idx = [self.clients[c] for c in clients]
            total = sum(ix.numel() for ix in idx)
            weights = [ix.numel() / total for ix in idx]
        (self._authors_round if self.style == "authors" else self._lean_round)(idx, weights)

    def _authors_round(self, clients, weights) -> None:
        import copy

        from torch.nn.utils import parameters_to_vector, vector_to_parameters
        from torch.utils.data import DataLoader, TensorDataset

        with torch.no_grad():
            for p, g in zip(self.params, self.global_params):
                p.copy_(g)
        net_glob = self.model
        w_init = parameters_to_vector(net_glob.parameters())
        update = torch.zeros_like(w_init)
        for idx, weight in zip(clients, weights):
            net = copy.deepcopy(net_glob)
            net.train()
            loader = DataLoader(TensorDataset(self.x[idx], self.y[idx]), batch_size=self.batch, shuffle=True,
                                generator=self.generator)
            optimizer = torch.optim.SGD(net.parameters(), lr=self.lr)
            prev_net = copy.deepcopy(net)
            batch_loss, norms, step_count = [], [], 0
            while step_count < self.steps:
                for images, labels in loader:
                    net.zero_grad()
                    loss = F.cross_entropy(net(images), labels)
                    loss = loss + 0.5 * self.wd * torch.norm(parameters_to_vector(net.parameters())) ** 2
                    loss.backward()
                    total_norm = torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=self.max_norm)
                    if total_norm >= self.max_norm:
                        norms.append(total_norm)
                    optimizer.step()
                    batch_loss.append(loss.item())
                    step_count += 1
                    if step_count >= self.steps:
                        break
            with torch.no_grad():
                delta = parameters_to_vector(net.parameters()) - parameters_to_vector(prev_net.parameters())
                update += weight * delta
        with torch.no_grad():
            vector_to_parameters(w_init + update, net_glob.parameters())
            for g, p in zip(self.global_params, self.params):
                g.copy_(p)

    def _lean_round(self, clients, weights) -> None:
        model, params = self.model, self.params
        new = [torch.zeros_like(p) for p in params]
        model.train()
        for idx, weight in zip(clients, weights):
            with torch.no_grad():
                for p, g in zip(params, self.global_params):
                    p.copy_(g)
            opt = torch.optim.SGD(params, lr=self.lr)
            n = idx.numel()
            bs = min(self.batch, n)
            perm, pos = idx[torch.randperm(n, generator=self.generator).to(idx.device)], 0
            for _ in range(self.steps):
                if pos + bs > n:
                    perm, pos = idx[torch.randperm(n, generator=self.generator).to(idx.device)], 0
                b = perm[pos:pos + bs]
                pos += bs
                opt.zero_grad()
                out = model(self.x[b])
                loss = F.cross_entropy(out, self.y[b]) + 0.5 * self.wd * sum((p * p).sum() for p in params)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, self.max_norm)
                opt.step()
            with torch.no_grad():
                for a, p in zip(new, params):
                    a.add_(p, alpha=weight)
        with torch.no_grad():
            for g, a in zip(self.global_params, new):
                g.copy_(a)


def bench_simulation(model: str, clients: int, *, label: str, device="cpu", backend: Optional[str] = None,
                     repeats: int = 7, warmup: int = 1, include_sequential: bool = True) -> List[Dict]:
    """Rows of ms per round for ``clients`` clients per round of ``model`` on digits."""
    device = torch.device(device)
    batched = _simulation(model, clients, "batched", str(device), backend)
    if batched.batched is None:
        raise RuntimeError(f"the batched engine cannot run model {model!r}: {batched.results.meta.get('engine_fallback')}")
    candidates = {"batched engine": batched.run_round}
    if include_sequential:
        candidates["sequential engine"] = _simulation(model, clients, "sequential", str(device), backend).run_round
    candidates["hand-written loop"] = HandWrittenLoop(batched, "authors").round
    candidates["hand-written loop, lean"] = HandWrittenLoop(batched, "lean").round
    times = interleaved(candidates, repeats=repeats, warmup=warmup, device=device)
    return ratio_rows(f"simulation {label}", times, base="hand-written loop", fused="batched engine",
                      base_column="vs hand loop", fused_column="time / batched")


def _real_simulation(model: str, clients: int, per_round: int, device: str, backend: Optional[str],
                     engine: str = "auto"):
    from ..fl import Simulation, SimulationConfig

    cfg = SimulationConfig(dataset="digits", model=model, clients=clients, per_round=per_round, rounds=NEVER,
                           eval_every=NEVER, device=device, backend=backend, engine=engine, **RECIPE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Simulation(cfg)


def bench_real_run(model: str, clients: int, per_round: int, *, label: str, device="cpu",
                   backend: Optional[str] = None, rounds: int = 10) -> List[Dict]:
    """ms per round of ``rounds`` consecutive rounds of one run (``per_round`` of
    ``clients`` clients sampled anew each round, the default engine), each round timed
    beside the authors' loop over the round's clients (alternating): the median and the
    mean of rounds 2.. (the mean with the traces of group shapes first met there), the
    first round (tracing the shapes it meets, and in a fresh process paying torch.func's
    one-time imports) and one test-set evaluation on rows of their own."""
    import statistics
    import time

    from .timing import _sync

    device = torch.device(device)
    sim = _real_simulation(model, clients, per_round, str(device), backend)
    hand = HandWrittenLoop(sim, "authors")
    engine, loop = [], []
    for r in range(rounds + 1):
        chosen = sim.sample_clients(sim.round + 1)
        _sync(device)
        start = time.perf_counter()
        sim.run_round()
        _sync(device)
        engine.append(time.perf_counter() - start)
        start = time.perf_counter()
        hand.round(chosen)
        _sync(device)
        loop.append(time.perf_counter() - start)
    start = time.perf_counter()
    sim.evaluate()
    _sync(device)
    evaluation = time.perf_counter() - start
    first, steady, hand_t = engine[0], statistics.median(engine[1:]), statistics.median(loop[1:])
    mean, hand_mean = statistics.fmean(engine[1:]), statistics.fmean(loop[1:])
    name = f"simulation real run {label}"
    meta = sim.results.meta
    traces = sum(sim.batched.trace_counts.values()) if sim.batched is not None else 0
    engine_name = f"{meta.get('engine', sim.config.engine)} engine (client_batch {meta.get('client_batch_used', '-')})"
    return [
        {"benchmark": name, "case": f"{engine_name}, rounds 2-{rounds + 1}, median", "ms": steady * 1e3,
         "vs hand loop": hand_t / steady, "time / batched": 1.0},
        {"benchmark": name, "case": "hand-written loop, same clients, median", "ms": hand_t * 1e3,
         "vs hand loop": 1.0, "time / batched": hand_t / steady},
        {"benchmark": name, "case": f"engine, rounds 2-{rounds + 1}, mean ({traces} shapes traced)",
         "ms": mean * 1e3, "vs hand loop": hand_mean / mean, "time / batched": mean / steady},
        {"benchmark": name, "case": "first round (the process's first torch.func call, its traces)",
         "ms": first * 1e3,
         "vs hand loop": loop[0] / first, "time / batched": first / steady},
        {"benchmark": name, "case": "evaluation (test set, apart)", "ms": evaluation * 1e3,
         "vs hand loop": float("nan"), "time / batched": evaluation / steady},
    ]


def bench_device_vs_cpu(model: str, clients: int, per_round: int, *, label: str, device="cuda",
                        backend: Optional[str] = None, rounds: int = 3, warmup: int = 1) -> List[Dict]:
    """ms per round of the batched engine on ``device`` and on the CPU, the same real run
    (``per_round`` of ``clients`` clients sampled anew each round; the same seed, so the
    same clients, data and initial model on both): ``warmup`` untimed rounds (the traces
    of the first shapes), then ``rounds`` rounds, each timed on the device then on the CPU
    (interleaved); the medians.  ``vs cpu``: CPU time / device time (higher: the device is
    faster).  The device row also has ``max |device - cpu| x`` after the last round (both
    ran the same rounds; nonzero from float rounding, e.g. TF32 convolutions).  The CPU
    side uses the default backend and torch's CPU threads.  On a CPU ``device`` nothing
    runs: one row says the comparison was skipped and why."""
    device = torch.device(device)
    name = f"simulation device vs cpu {label}"
    if device.type == "cpu":
        nan = float("nan")
        return [{"benchmark": name, "case": "skipped: --device is cpu, no device to compare with the CPU",
                 "ms": nan, "vs cpu": nan}]
    return _time_device_and_cpu(model, clients, per_round, name=name, device=device, backend=backend, rounds=rounds,
                                warmup=warmup)


def _time_device_and_cpu(model: str, clients: int, per_round: int, *, name: str, device: torch.device,
                         backend: Optional[str], rounds: int, warmup: int) -> List[Dict]:
    """The measurement of :func:`bench_device_vs_cpu` (whatever ``device`` is: the tests
    run it on the CPU against the CPU)."""
    import statistics
    import time

    from .timing import _sync

    sims = {"device": _real_simulation(model, clients, per_round, str(device), backend, engine="batched"),
            "cpu": _real_simulation(model, clients, per_round, "cpu", None, engine="batched")}
    for sim in sims.values():
        if sim.batched is None:
            raise RuntimeError(f"the batched engine cannot run model {model!r}: "
                               f"{sim.results.meta.get('engine_fallback')}")
    times: Dict[str, list] = {key: [] for key in sims}
    for r in range(warmup + rounds):
        for key, sim in sims.items():
            _sync(sim.device)
            start = time.perf_counter()
            sim.run_round()
            _sync(sim.device)
            if r >= warmup:
                times[key].append(time.perf_counter() - start)
    on_device, on_cpu = statistics.median(times["device"]), statistics.median(times["cpu"])
    diff = (sims["device"].x_global.detach().cpu() - sims["cpu"].x_global.detach()).abs().max().item()

    def engine(key):
        meta = sims[key].results.meta
        where = str(device) if key == "device" else f"cpu, {torch.get_num_threads()} threads"
        return f"batched engine on {where} (client_batch {meta.get('client_batch_used', '-')})"

    span = f"rounds {warmup + 1}-{warmup + rounds}, median"
    return [
        {"benchmark": name, "case": f"{engine('device')}, {span}", "ms": on_device * 1e3, "vs cpu": on_cpu / on_device,
         "max |device - cpu| x": diff},
        {"benchmark": name, "case": f"{engine('cpu')}, {span}", "ms": on_cpu * 1e3, "vs cpu": 1.0},
    ]


def run_device_vs_cpu(*, device="cuda", backend: Optional[str] = None, quick: bool = False) -> List[Dict]:
    """The ``device_vs_cpu`` suite: :func:`bench_device_vs_cpu` for the MLP and the small
    CNN, 20 of 100 clients per round (one skipped row on a CPU device)."""
    if torch.device(device).type == "cpu":
        return bench_device_vs_cpu("mlp", 100, 20, label="MLP 200-200 and SimpleCNN, 20 of 100 clients",
                                   device=device)
    rows: List[Dict] = []
    for model, name in (("mlp", "MLP 200-200"), ("cnn", "SimpleCNN")):
        rows += bench_device_vs_cpu(model, 100, 20, label=f"{name}, 20 of 100 clients", device=device,
                                    backend=backend, rounds=2 if quick else 5)
    return rows


def run(*, device="cpu", backend: Optional[str] = None, quick: bool = False) -> List[Dict]:
    """The suite's cases: real runs (new clients each round) and repeated rounds, MLP and
    SimpleCNN, 20 and 100 clients per round.  ``quick`` (the device check's budget): real
    runs of 3 rounds (the first, then 2 timed), and the repeated round with 20 clients
    only -- 100 clients per round stay measured by the real run of 100 of 200."""
    repeats = 3 if quick else 7
    rows: List[Dict] = []
    for model, name in (("mlp", "MLP 200-200"), ("cnn", "SimpleCNN")):
        for clients, per_round in ((100, 20), (200, 100)):
            rows += bench_real_run(model, clients, per_round, label=f"{name}, {per_round} of {clients} clients",
                                   device=device, backend=backend, rounds=2 if quick else 29)
    for model, name in (("mlp", "MLP 200-200"), ("cnn", "SimpleCNN")):
        rows += bench_simulation(model, 20, label=f"{name}, 20 clients x 20 steps", device=device, backend=backend,
                                 repeats=repeats)
    if not quick:
        for model, name in (("mlp", "MLP 200-200"), ("cnn", "SimpleCNN")):
            rows += bench_simulation(model, 100, label=f"{name}, 100 clients x 20 steps", device=device,
                                     backend=backend, repeats=max(3, repeats // 2))
    return rows
