"""Rounds on a virtual clock: synchronous rounds with a deadline and over-selection, and
FedBuff's asynchronous rounds, on the simulator's engines.

A :class:`ClockedRun` drives a :class:`~fedopt_kernels.fl.Simulation` whose clients are
devices of a :class:`~fedopt_kernels.fl.run.clock.DeviceClock` (:class:`ClockConfig`: drawn
from a heterogeneity level, or read from a trace).  Each record gains ``virtual_time``
(virtual seconds since the start) and ``round_virtual_s`` next to the wall time.

* ``mode="sync"``: every round samples ``ceil(over_select * per_round)`` clients
  (:func:`~fedopt_kernels.fl.run.population.sample_clients`, as a plain round), asks the
  clock which of them finish (:func:`~fedopt_kernels.fl.run.clock.sync_round`: a
  ``deadline``, the first ``per_round`` to finish when over-selecting, dropouts), and runs
  the simulator's round on those alone; the others are recorded as excluded with their
  reason (``excluded_deadline``, ``excluded_over_selected``, ``excluded_dropout``,
  ``excluded_unavailable``, counted in ``excluded_clients``).  With no clock option
  given, the run is the plain run, bit for bit.
* ``mode="fedbuff"``: FedBuff (Nguyen et al. 2022; :class:`~fedopt_kernels.server.fedbuff.
  FedBuffBuffer`).  Its timeline is computed first
  (:func:`~fedopt_kernels.fl.run.fedbuff_schedule.fedbuff_schedule`); then, by default
  (``grouping="version"``), at step ``k`` the clients that pulled version ``k`` train
  from it as ONE group of the batched engine (seeded and annealed as round ``k + 1``).
  ``grouping="in_flight"`` trains clients as late as the timeline allows, in groups
  whatever version they pulled: when a step needs an update not yet computed, every
  client in flight on a version that exists (``<= k`` at step ``k``) and that will
  arrive trains in ONE group, each row from the version its client pulled (kept until
  then: at most ``concurrency`` models) and seeded and annealed as round ``v + 1``; a
  step that needs nothing new trains nothing (its record then has no training
  statistics).  Its groups are larger (mean 6.5-9.2 clients against 5.0-5.1 with 10-20
  in flight and a buffer of 5), its bits the same (a row's arithmetic is its own
  client's, tested), but it trained 7-9% fewer client updates per CPU second
  (docs/async.md): hence not the default.  Updates wait until they arrive; every
  ``buffer`` arrivals the simulator's server round (robust rules, DP and the record included) steps on the
  buffered, staleness-scaled rows and the version advances.  ``rounds`` counts server
  steps.  One record per step, with the staleness of its updates.  Not for SCAFFOLD (its
  control variates assume one round's clients), FedLAW (it weighs each round's models)
  or a folded (chunked) round.

A client dispatched twice on the same version trains once: its data, model and seed are
those of the same round, so its two updates would be equal.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ...server.fedbuff import STALENESS, FedBuffBuffer
from ...server.round import RoundReplies
from .clock import HETEROGENEITY, DeviceClock, sync_round
from .fedbuff_schedule import fedbuff_schedule
from .population import sample_clients
from .server_side import BAD_CLIENT_REASONS

__all__ = ["ClockConfig", "AsyncConfig", "ClockedRun", "MODES", "CLOCK_REASONS"]

MODES = ("sync", "fedbuff")
GROUPINGS = ("version", "in_flight")
CLOCK_REASONS = ("unavailable", "dropout", "deadline", "over_selected")


@dataclass(frozen=True)
class ClockConfig:
    """The devices: a ``device_trace`` CSV (:meth:`DeviceClock.from_trace`), or drawn by
    ``heterogeneity`` ("none", "mild", "heavy") around ``compute_s_per_sample`` and
    ``comm_s``, online ``availability`` of every ``period_s``."""

    heterogeneity: str = "none"
    compute_s_per_sample: float = 1e-3
    comm_s: float = 1.0
    availability: float = 1.0
    period_s: float = 3600.0
    device_trace: Optional[str] = None

    def build(self, num_clients: int, seed: int) -> DeviceClock:
        if self.device_trace:
            return DeviceClock.from_trace(self.device_trace, num_clients=num_clients)
        return DeviceClock.from_distributions(num_clients, seed=seed, heterogeneity=self.heterogeneity,
                                              compute_s_per_sample=self.compute_s_per_sample, comm_s=self.comm_s,
                                              availability=self.availability, period_s=self.period_s)


@dataclass(frozen=True)
class AsyncConfig:
    """How rounds meet the clock (module docstring).  ``concurrency``, ``buffer``,
    ``staleness`` (+ ``staleness_a``, ``staleness_b``): FedBuff's; ``deadline`` (virtual
    seconds) and ``over_select`` (>= 1): a synchronous round's."""

    mode: str = "sync"
    concurrency: int = 10
    buffer: int = 5
    staleness: str = "polynomial"
    staleness_a: float = 0.5
    staleness_b: int = 4
    deadline: Optional[float] = None
    over_select: float = 1.0
    clock: ClockConfig = field(default_factory=ClockConfig)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.staleness not in STALENESS:
            raise ValueError(f"staleness must be one of {', '.join(STALENESS)}, got {self.staleness!r}")
        if self.clock.heterogeneity not in HETEROGENEITY:
            raise ValueError(f"heterogeneity must be one of {', '.join(HETEROGENEITY)}, got "
                             f"{self.clock.heterogeneity!r}")
        for name in ("concurrency", "buffer"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not (isinstance(self.over_select, (int, float)) and self.over_select >= 1.0):
            raise ValueError(f"over_select must be a number >= 1 (sample that many times per_round), got "
                             f"{self.over_select!r}")
        if self.deadline is not None and not (self.deadline > 0 and math.isfinite(self.deadline)):
            raise ValueError(f"deadline must be a finite number of virtual seconds > 0, got {self.deadline!r}")

    def to_dict(self) -> dict:
        return asdict(self)


class ClockedRun:
    """``ClockedRun(simulation, async_config)``: run ``simulation``'s rounds on the virtual
    clock (module docstring).  ``run(callback=None)`` returns its :class:`~.results.Results`;
    :meth:`state_dict` / :meth:`load_state_dict` resume between any two arrivals."""

    def __init__(self, sim, acfg: AsyncConfig, *, grouping: str = "version"):
        if not isinstance(acfg, AsyncConfig):
            raise TypeError(f"acfg must be an AsyncConfig, got {type(acfg).__name__}")
        if grouping not in GROUPINGS:
            raise ValueError(f"grouping must be one of {', '.join(GROUPINGS)}, got {grouping!r}")
        self.grouping = grouping
        cfg = sim.config
        self.sim, self.acfg = sim, acfg
        self.clock = acfg.clock.build(cfg.clients, cfg.seed)
        self.virtual_time = 0.0
        sim.results.meta["async"] = acfg.to_dict()
        if acfg.mode == "fedbuff":
            self._check_fedbuff()
            self.schedule = fedbuff_schedule(self.clock, concurrency=acfg.concurrency, buffer=acfg.buffer,
                                             server_steps=cfg.rounds, local_steps=cfg.local_steps,
                                             batch_size=cfg.batch_size, seed=cfg.seed, clients=sim.training_clients)
            self.buffer = FedBuffBuffer(sim.server.optimizer, acfg.buffer, staleness=acfg.staleness,
                                        a=acfg.staleness_a, b=acfg.staleness_b, step=self._server_round)
            self.pending: Dict[Tuple[int, int], torch.Tensor] = {}  # (client, version) -> its update
            self.failed: Dict[Tuple[int, int], Tuple[str, str]] = {}  # (client, version) -> why it sent nothing
            self.arrival = 0  # arrivals of the current step processed
            self.trained_version = -1  # grouping "version": the last version whose clients trained
            self.versions: Dict[int, torch.Tensor] = {}  # grouping "in_flight": past models clients still need
            if grouping == "in_flight":
                sim.training.grow_rows(acfg.concurrency)  # a group of everyone in flight trains at once
            self._dispatch_order: Dict[Tuple[int, int], int] = {}
            arriving = {(a.client, a.version) for s in self.schedule.steps for a in s}
            self._lost = {(c, v) for c, v, _ in self.schedule.dropped} - arriving  # never report
            for v in sorted(self.schedule.pulled):
                for c in self.schedule.pulled[v]:
                    self._dispatch_order.setdefault((c, v), len(self._dispatch_order))
            self._group_stats = None

    def _check_fedbuff(self) -> None:
        sim, cfg = self.sim, self.sim.config
        if sim.server.optimizer is None:
            raise ValueError(f"mode fedbuff needs a server optimizer; {cfg.algo} (FedLAW) weighs each round's models")
        if sim.scaffold is not None:
            raise ValueError("mode fedbuff: SCAFFOLD's control variates assume one synchronous round's clients")
        if cfg.memory_budget:
            raise ValueError("mode fedbuff: a folded (chunked) round is not supported; leave out memory_budget")
        if cfg.compress != "none":  # the buffer sums fp32 updates as they arrive
            raise ValueError("mode fedbuff: compressed updates (compress) are not supported; use mode sync")
        if self.acfg.concurrency > len(sim.training_clients):
            raise ValueError(f"concurrency ({self.acfg.concurrency}) exceeds the {len(sim.training_clients)} "
                             "training clients")

    # ------------------------------------------------------------------ run
    def run(self, callback: Optional[Callable] = None, *, stop_after: Optional[int] = None):
        """Run to ``config.rounds`` records (server steps).  ``stop_after``: return after that
        many arrivals (a test's stand-in for an interruption; :meth:`state_dict` then)."""
        sim = self.sim
        if sim.round == 0 and not sim.results.records:
            acc, loss = sim.evaluate()
            sim.results.append({"round": 0, "clients": [], "test_accuracy": acc, "test_loss": loss,
                                "wall_time": 0.0, "virtual_time": 0.0})
            if callback is not None:
                callback(sim.results.records[-1], sim)
        while sim.round < sim.config.rounds:
            if self.acfg.mode == "sync":
                record = self._sync_round()
            else:
                record, stop_after = self._fedbuff_step(stop_after)
                if record is None:
                    return sim.results
            if callback is not None:
                callback(record, sim)
        return sim.results

    def _sync_round(self) -> dict:
        sim, cfg, acfg = self.sim, self.sim.config, self.acfg
        r = sim.round + 1
        pool = sim.training_clients
        n = min(len(pool), math.ceil(acfg.over_select * cfg.per_round))
        sampled = [pool[i] for i in sample_clients(cfg.seed, r, len(pool), n)]
        keep = cfg.per_round if n > cfg.per_round else None
        sr = sync_round(self.clock, sampled, self.virtual_time, cfg.local_steps, cfg.batch_size,
                        deadline=acfg.deadline, keep=keep)
        record = sim.run_round(clients=sr.kept)
        self.virtual_time += sr.duration
        counts = {reason: 0 for reason in CLOCK_REASONS}
        for reason in sr.excluded.values():
            counts[reason] += 1
        record["sampled"] = sampled
        for reason, k in counts.items():
            record[f"excluded_{reason}"] = k
        record["excluded_clients"] = record.get("excluded_clients", 0) + sum(counts.values())
        record.update(virtual_time=self.virtual_time, round_virtual_s=sr.duration)
        return record

    # ------------------------------------------------------------------ FedBuff
    def _train_version(self, v: int) -> None:
        """Train every client that pulled version ``v`` (once each) from the current model."""
        sim = self.sim
        group = list(dict.fromkeys(self.schedule.pulled.get(v, [])))
        self.trained_version = v
        self._group_stats = None
        if not group:
            return
        rows = sim.training.updates.shape[0]  # a round's rows: the group trains in parts of that many
        parts = []
        for start in range(0, len(group), rows):
            part = group[start:start + rows]
            parts.append((len(part), sim.training.train_clients(v + 1, part).summary()))
            for i, c in enumerate(sim.training.round_kept):
                self.pending[(c, v)] = sim.training.updates[i].detach().clone()
            for c, reason, detail in sim.training.round_bad:
                self.failed[(c, v)] = (reason, detail)
        self._group_stats = _merge_summaries(parts)

    def _train_in_flight(self, k: int) -> None:
        """Step ``k``: if one of its arrivals is not trained yet, train every untrained
        client that will arrive and pulled a version ``<= k``, as one group (each from its
        version); then keep ``x_k`` if a client in flight on it trains later."""
        sim = self.sim
        arrived = {(a.client, a.version) for s in self.schedule.steps[:k] for a in s}
        untrained = lambda key: key not in self.pending and key not in self.failed and key not in arrived  # noqa
        ahead = [(a.client, a.version) for s in self.schedule.steps[k:] for a in s]
        if any(untrained((a.client, a.version)) for a in self.schedule.steps[k]):
            group = sorted({key for key in ahead if key[1] <= k and untrained(key)},
                           key=lambda key: (key[1], self._dispatch_order[key]))
            parts = []
            for part in _split(group, sim.training.updates.shape[0]):
                starts = torch.stack([sim.x_global if v == k else self.versions[v] for _, v in part])
                clients = [c for c, _ in part]
                parts.append((len(part), sim.training.train_clients(k + 1, clients, starts=starts,
                                                            round_numbers=[v + 1 for _, v in part]).summary()))
                version_of = dict(part)
                for i, c in enumerate(sim.training.round_kept):
                    self.pending[(c, version_of[c])] = sim.training.updates[i].detach().clone()
                for c, reason, detail in sim.training.round_bad:
                    self.failed[(c, version_of[c])] = (reason, detail)
            self._group_stats = _merge_summaries(parts)
        else:
            self._group_stats = None
        # every client in flight, also one arriving after the last step (a resumed run may go on)
        still = {key[1] for key in self._dispatch_order if key[1] <= k and key not in self._lost and untrained(key)}
        if k in still and k not in self.versions:
            self.versions[k] = sim.x_global.detach().clone()
        for v in [v for v in self.versions if v not in still]:
            del self.versions[v]

    def _server_round(self, rows: torch.Tensor, clients: List[int]):
        sim = self.sim
        replies = RoundReplies(rows, sizes=sim.client_sizes[clients], clients=clients, reasons=BAD_CLIENT_REASONS,
                               left_out=self._left_out)
        sim.server.schedule(sim.round + 1)
        return sim.server.round(replies)

    def _fedbuff_step(self, stop_after: Optional[int]):
        sim = self.sim
        k = sim.round  # the step about to be taken; the current version is k
        if self.grouping == "in_flight":
            if self.arrival == 0:
                self._train_in_flight(k)
        elif self.trained_version < k:
            self._train_version(k)
        arrivals = self.schedule.steps[k]
        if self.arrival == 0:
            self._left_out = []
        outcome = None
        while self.arrival < len(arrivals):
            if stop_after is not None:
                if stop_after == 0:
                    return None, 0
                stop_after -= 1
            a = arrivals[self.arrival]
            self.arrival += 1
            key = (a.client, a.version)
            if key in self.failed:
                reason, detail = self.failed[key]
                self._left_out.append((a.client, reason, detail))
                update = torch.full((self.buffer.N,), float("nan"), dtype=self.buffer.rows.dtype,
                                    device=self.buffer.rows.device)  # excluded by the round as nonfinite
            else:
                update = self.pending[key]
            outcome = self.buffer.add(update, a.version, client=a.client) or outcome
        t0 = self.virtual_time
        self.virtual_time = self.schedule.step_time[k]
        record = {"round": k + 1, "clients": [a.client for a in arrivals]}
        if self._group_stats is not None:
            record.update(self._group_stats)
        record["local_lr"] = sim.local.lr_at(k, 0)
        record.update(outcome.record())
        taus = [k - a.version for a in arrivals]
        record.update(staleness_mean=sum(taus) / len(taus), staleness_max=max(taus),
                      virtual_time=self.virtual_time, round_virtual_s=self.virtual_time - t0,
                      dropped_in_flight=sum(1 for _, v, t in self.schedule.dropped if t0 < t <= self.virtual_time))
        record["test_accuracy"], record["test_loss"] = sim.evaluate()
        sim.round = k + 1
        record["wall_time"] = sim._elapsed
        sim.results.append(record)
        self.arrival = 0
        # updates no later step needs (their version is done and they arrived)
        done = {(a.client, a.version) for a in arrivals}
        future = {(a.client, a.version) for s in self.schedule.steps[k + 1:] for a in s}
        for key in list(self.pending):
            if key in done and key not in future:
                del self.pending[key]
        return record, stop_after

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        out = {"sim": self.sim.state_dict(), "virtual_time": self.virtual_time, "async": self.acfg.to_dict()}
        if self.acfg.mode == "fedbuff":
            out.update(buffer=self.buffer.state_dict(), arrival=self.arrival, trained_version=self.trained_version,
                       versions=[(v, t.clone()) for v, t in self.versions.items()],
                       pending=[(c, v, t.clone()) for (c, v), t in self.pending.items()],
                       failed=[(c, v, r, d) for (c, v), (r, d) in self.failed.items()],
                       group_stats=self._group_stats, left_out=list(getattr(self, "_left_out", [])))
        return out

    def load_state_dict(self, state: dict) -> None:
        if state["async"] != self.acfg.to_dict():
            raise ValueError(f"the checkpoint's async settings {state['async']} differ from this run's "
                             f"{self.acfg.to_dict()}")
        self.sim.load_state_dict(state["sim"])
        self.virtual_time = state["virtual_time"]
        if self.acfg.mode == "fedbuff":
            self.buffer.load_state_dict(state["buffer"])
            self.arrival, self.trained_version = state["arrival"], state["trained_version"]
            self.pending = {(c, v): t for c, v, t in state["pending"]}
            self.failed = {(c, v): (r, d) for c, v, r, d in state["failed"]}
            # a checkpoint of per-version grouping holds no past model: none is needed
            self.versions = {v: t for v, t in state.get("versions", [])}
            self._group_stats, self._left_out = state["group_stats"], list(state["left_out"])


def _split(group: List[Tuple[int, int]], rows: int) -> List[List[Tuple[int, int]]]:
    """``(client, version)`` keys in parts of at most ``rows``, a client at most once per
    part (one that arrived and was dispatched again within one step holds two keys)."""
    parts: List[List[Tuple[int, int]]] = []
    for key in group:
        part = next((p for p in parts if len(p) < rows and all(c != key[0] for c, _ in p)), None)
        if part is None:
            parts.append([key])
        else:
            part.append(key)
    return parts


def _merge_summaries(parts) -> Optional[dict]:
    """One record of a group trained in parts: counts summed, the rest weighted by the
    part's clients (each part's ``summary()`` of :class:`~.client.RoundStats`)."""
    if not parts:
        return None
    if len(parts) == 1:
        return dict(parts[0][1])
    total = sum(n for n, _ in parts)
    out = {}
    for key in parts[0][1]:
        values = [(n, s.get(key)) for n, s in parts]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for _, v in values):
            if key.endswith("_steps"):
                out[key] = sum(v for _, v in values)
            else:
                out[key] = sum(n * v for n, v in values) / total
        else:
            out[key] = values[-1][1]
    return out
