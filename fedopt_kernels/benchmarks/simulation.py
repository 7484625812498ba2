"""Benchmark of a whole simulated round: batched engine vs sequential engine vs a plain loop.

FedNAR's recipe on ``digits`` (Dirichlet(0.3) split): every client of the round runs 20
local steps of batch 32 (lr 0.05, weight decay 1e-3, max norm 10, mode co), then the
server averages.  Candidates, timed interleaved in the same run (``timing.interleaved``),
milliseconds per round (medians):

* ``batched engine``: :meth:`Simulation.run_round` with ``engine="batched"`` -- all
  clients as one ``[C, N]`` computation (:mod:`fedopt_kernels.fl.batched`);
* ``sequential engine``: the same with ``engine="sequential"`` (one client after
  another, fused FedNAR step);
* ``hand-written loop``: what an FL paper's code does (the FedNAR authors' recipe):
  for each client load the global weights into a model, then per step ``zero_grad``,
  forward, ``loss + 0.5 wd ||x||^2``, ``backward``, ``clip_grad_norm_``, an SGD step;
  finally the data-size weighted average of the clients' models.

No evaluation is timed (``eval_every`` is past the benchmark).  ``vs hand loop`` is the
hand-written loop's time over the candidate's (higher is faster).
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from .timing import interleaved

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
    """The plain PyTorch round of an FL paper's code (see the module docstring), on the
    same data, partition and initial model as the simulation ``sim``."""

    def __init__(self, sim):
        import copy

        cfg = sim.config
        self.model = copy.deepcopy(sim.global_model)
        self.params = list(self.model.parameters())
        self.global_params = [p.detach().clone() for p in self.params]
        self.x, self.y = sim.dataset.x_train, sim.dataset.y_train
        self.clients = [ix.to(sim.device) for ix in sim.partition.client_indices]
        sizes = [ix.numel() for ix in self.clients]
        self.weights = [n / sum(sizes) for n in sizes]
        self.steps, self.batch = cfg.local_steps, cfg.batch_size
        self.lr, self.wd, self.max_norm = cfg.lr, cfg.weight_decay, cfg.max_norm
        self.generator = torch.Generator().manual_seed(cfg.seed)

    def round(self) -> None:
        model, params = self.model, self.params
        new = [torch.zeros_like(p) for p in params]
        model.train()
        for idx, weight in zip(self.clients, self.weights):
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
    candidates["hand-written loop"] = HandWrittenLoop(batched).round
    times = interleaved(candidates, repeats=repeats, warmup=warmup, device=device)
    hand, fast = times["hand-written loop"], times["batched engine"]
    rows = []
    for name, seconds in times.items():
        rows.append({
            "benchmark": f"simulation {label}",
            "case": name,
            "ms": seconds * 1e3,
            "vs hand loop": hand / seconds,
            "time / batched": seconds / fast,
        })
    return rows


def run(*, device="cpu", backend: Optional[str] = None, quick: bool = False) -> List[Dict]:
    """The suite's cases: MLP and SimpleCNN, 20 clients per round; then 100."""
    repeats = 3 if quick else 7
    rows: List[Dict] = []
    for model, name in (("mlp", "MLP 200-200"), ("cnn", "SimpleCNN")):
        rows += bench_simulation(model, 20, label=f"{name}, 20 clients x 20 steps", device=device, backend=backend,
                                 repeats=repeats)
    for model, name in (("mlp", "MLP 200-200"), ("cnn", "SimpleCNN")):
        rows += bench_simulation(model, 100, label=f"{name}, 100 clients x 20 steps", device=device, backend=backend,
                                 repeats=max(3, repeats // 2))
    return rows
