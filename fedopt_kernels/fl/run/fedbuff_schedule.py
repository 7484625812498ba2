"""FedBuff's timeline on the virtual clock: who trains on which version, and when each
update arrives -- decided before any training.

FedBuff (Nguyen et al., AISTATS 2022) keeps ``concurrency`` clients in flight; each pulls
the current model version, trains, and reports when it finishes; every ``buffer``
arrivals the server steps and the version advances.  When each client finishes depends
on its device (:class:`~fedopt_kernels.fl.run.clock.DeviceClock`), not on the model's values,
so the whole timeline can be computed first (:func:`fedbuff_schedule`) and the training
done after, in groups: every client that pulled version ``v`` trains from the same model,
so the batched engine trains them as ONE group while ``v`` is the current version.  The
updates of clients still in flight wait (at most ``concurrency`` rows) until their
arrival fills a buffer.

The timeline: at time 0 the server dispatches ``concurrency`` clients, each drawn
uniformly (a seeded generator) among the clients online and not in flight.  At each
arrival (ties: the earlier dispatch first) the update enters the buffer; the ``buffer``-th
arrival triggers the server step (the version advances) and then a new client is
dispatched on the new version.  A client that goes offline before finishing never
arrives: its slot is freed when it goes offline (a heartbeat would tell the server), and a
replacement is dispatched then.  When no client is online, the next dispatch waits until
one is.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from .clock import DeviceClock

__all__ = ["Arrival", "FedBuffSchedule", "fedbuff_schedule"]


@dataclass(frozen=True)
class Arrival:
    client: int
    version: int  # the model version it pulled
    start: float
    end: float  # when it arrived at the server


@dataclass
class FedBuffSchedule:
    """``steps[k]``: the arrivals that fill buffer ``k`` (their server step makes version
    ``k + 1``), in arrival order; ``pulled[v]``: the clients that trained on version ``v``,
    in dispatch order (the groups to train); ``step_time[k]``: when step ``k`` happened;
    ``dropped``: ``(client, version, went offline at)`` of clients that never reported."""

    steps: List[List[Arrival]] = field(default_factory=list)
    pulled: Dict[int, List[int]] = field(default_factory=dict)
    step_time: List[float] = field(default_factory=list)
    dropped: List[Tuple[int, int, float]] = field(default_factory=list)

    def staleness(self) -> List[List[int]]:
        """``tau = k - version`` of every arrival of every step ``k``."""
        return [[k - a.version for a in arrivals] for k, arrivals in enumerate(self.steps)]


def fedbuff_schedule(clock: DeviceClock, *, concurrency: int, buffer: int, server_steps: int, local_steps: int,
                     batch_size: int, seed: int, clients: Optional[List[int]] = None) -> FedBuffSchedule:
    """The timeline of ``server_steps`` FedBuff steps (module docstring).  ``clients``:
    the population to draw from (default: every client of ``clock``)."""
    for name, v in (("concurrency", concurrency), ("buffer", buffer), ("server_steps", server_steps),
                    ("local_steps", local_steps), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    population = list(range(len(clock))) if clients is None else list(clients)
    if concurrency > len(population):
        raise ValueError(f"concurrency ({concurrency}) exceeds the {len(population)} clients")
    rng = np.random.default_rng([int(seed), 0xFEDB])
    out = FedBuffSchedule()
    in_flight = set()
    events: List[tuple] = []  # (time, dispatch number, kind, client, version, start)
    counter = 0
    version, filled = 0, []

    def dispatch(t: float) -> None:
        nonlocal counter
        while True:
            online = [c for c in population if c not in in_flight and clock.available(c, t)]
            if online:
                break
            nxt = [clock.next_available(c, t) for c in population if c not in in_flight]
            nxt = [x for x in nxt if x is not None and x > t]
            if not nxt:
                raise RuntimeError(f"at virtual time {t:g} no client will ever be online again to fill the buffer")
            t = min(nxt)
        c = online[int(rng.integers(len(online)))]
        in_flight.add(c)
        out.pulled.setdefault(version, []).append(c)
        end, dropped = clock.finish(c, t, local_steps, batch_size)
        when = clock.window_at(c, t)[1] if dropped else end
        heapq.heappush(events, (when, counter, "lost" if dropped else "arrive", c, version, t))
        counter += 1

    for _ in range(concurrency):
        dispatch(0.0)
    while len(out.steps) < server_steps:
        t, _, kind, c, v, start = heapq.heappop(events)
        in_flight.discard(c)
        if kind == "lost":
            out.dropped.append((c, v, t))
        else:
            filled.append(Arrival(c, v, start, t))
            if len(filled) == buffer:
                out.steps.append(filled)
                out.step_time.append(t)
                filled = []
                version += 1
        if len(out.steps) < server_steps:
            dispatch(t)
    return out
