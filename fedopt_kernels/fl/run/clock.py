"""A virtual clock of device speed and availability, for rounds as slow devices see them.

Real cross-device populations are heterogeneous: a phone computes ten times slower than
another, uploads over a slow link, and is online only in some windows.  Each client
here is a :class:`Device`:

* ``compute_s_per_sample``: seconds of local compute per training sample, so a client's
  training time follows its work, ``steps * batch * compute_s_per_sample``;
* ``comm_s``: seconds to download the model and upload its update;
* ``windows``: when it is online, ``((from, until), ...)`` in seconds of virtual time
  (default: always); with ``period``, the windows (within ``[0, period]``) repeat every
  ``period`` seconds.

A :class:`DeviceClock` holds one per client, drawn from stated distributions
(:meth:`DeviceClock.from_distributions`: log-normal speeds around a median, the spread
set by a heterogeneity level) or read from a per-client trace
(:meth:`DeviceClock.from_trace`, a CSV documented there; FedScale's trace fields are
accepted).  Nothing here touches a model: the simulator asks the clock when each client
would finish (:meth:`DeviceClock.finish`), and :func:`sync_round` applies a synchronous
round's real-world rules -- a deadline, over-selection (sample more, keep the first
``K`` to finish), clients that go offline mid-round -- recording each exclusion with its
reason, as the round already records bad replies.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["Device", "DeviceClock", "SyncRound", "sync_round", "HETEROGENEITY", "TRACE_COLUMNS"]

INF = math.inf
TRACE_COLUMNS = ("client", "compute_s_per_sample", "comm_s", "available_from", "available_until")
# (sigma of log compute speed, sigma of log comm time): none / mild / heavy.  "heavy" puts
# the 90th-percentile device about 13x slower than the median (exp(1.28 * 2.0)), the spread
# of FedScale's measured device trace (Lai et al., ICML 2022, Fig. 2: about two orders of
# magnitude between the fastest and slowest devices).
HETEROGENEITY = {"none": (0.0, 0.0), "mild": (0.5, 0.5), "heavy": (2.0, 1.0)}


@dataclass(frozen=True)
class Device:
    compute_s_per_sample: float
    comm_s: float
    windows: Tuple[Tuple[float, float], ...] = ((0.0, INF),)
    period: Optional[float] = None

    def __post_init__(self):
        if self.period is not None and not (math.isfinite(self.period) and self.period > 0
                                            and all(0 <= lo and hi <= self.period for lo, hi in self.windows)):
            raise ValueError(f"period must be a finite number > 0 holding every window, got {self.period!r} for "
                             f"{self.windows!r}")
        for name in ("compute_s_per_sample", "comm_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        last = -INF
        for w in self.windows:
            if len(w) != 2 or not w[0] < w[1] or w[0] < last:
                raise ValueError(f"windows must be increasing, non-overlapping (from, until) pairs with from < until, "
                                 f"got {self.windows!r}")
            last = w[1]


@dataclass
class SyncRound:
    """What a synchronous round kept: ``kept`` (clients whose updates count, in the order
    they were sampled), ``finish`` (each kept client's finishing time), ``excluded``
    (``{client: reason}``: ``"unavailable"`` offline when the round started, ``"dropout"``
    went offline before finishing, ``"deadline"`` finished after it, ``"over_selected"``
    finished after the first ``keep``), and ``duration`` (virtual seconds from the
    round's start until the server could aggregate)."""

    kept: List[int]
    finish: Dict[int, float]
    excluded: Dict[int, str] = field(default_factory=dict)
    duration: float = 0.0


class DeviceClock:
    """The devices of a population, one :class:`Device` per client (see the module)."""

    def __init__(self, devices: Sequence[Device]):
        if not devices or not all(isinstance(d, Device) for d in devices):
            raise ValueError("devices must be a non-empty sequence of Device")
        self.devices = list(devices)

    def __len__(self) -> int:
        return len(self.devices)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_distributions(cls, num_clients: int, *, seed: int, heterogeneity: str = "mild",
                           compute_s_per_sample: float = 1e-3, comm_s: float = 1.0,
                           availability: float = 1.0, period_s: float = 3600.0) -> "DeviceClock":
        """``num_clients`` devices drawn with ``numpy``'s generator seeded by ``seed``:
        compute speed and communication time log-normal around the medians
        ``compute_s_per_sample`` and ``comm_s`` with the spreads of ``heterogeneity``
        (:data:`HETEROGENEITY`: "none", "mild", "heavy"); each device online for a
        fraction ``availability`` of every ``period_s`` (a daily-cycle stand-in), at a
        random phase.  The same arguments give the same devices."""
        if heterogeneity not in HETEROGENEITY:
            raise ValueError(f"heterogeneity must be one of {', '.join(HETEROGENEITY)}, got {heterogeneity!r}")
        if not 0.0 < availability <= 1.0:
            raise ValueError(f"availability must be in (0, 1], got {availability!r}")
        if not isinstance(num_clients, int) or num_clients < 1:
            raise ValueError(f"num_clients must be an int >= 1, got {num_clients!r}")
        s_speed, s_comm = HETEROGENEITY[heterogeneity]
        rng = np.random.default_rng([int(seed), 0xC10C])
        speed = compute_s_per_sample * np.exp(s_speed * rng.standard_normal(num_clients))
        comm = comm_s * np.exp(s_comm * rng.standard_normal(num_clients))
        phase = rng.uniform(0.0, period_s, num_clients)
        devices = []
        for i in range(num_clients):
            if availability >= 1.0:
                devices.append(Device(float(speed[i]), float(comm[i])))
                continue
            # online from phase for a * P, every P: within [0, P] one window, or two when it wraps
            on, lo = availability * period_s, float(phase[i])
            hi = lo + on
            windows = ((lo, hi),) if hi <= period_s else ((0.0, hi - period_s), (lo, period_s))
            devices.append(Device(float(speed[i]), float(comm[i]), windows, period=float(period_s)))
        return cls(devices)

    @classmethod
    def from_trace(cls, path, *, num_clients: Optional[int] = None, model_bytes: Optional[int] = None
                   ) -> "DeviceClock":
        """Devices from a CSV with a header row.  Columns:

        * ``client`` (0-based id); ``compute_s_per_sample``; ``comm_s``;
        * optional ``available_from``, ``available_until`` (seconds; a client may have
          several rows, one per window; empty: always);
        * or, instead of ``compute_s_per_sample`` / ``comm_s``, FedScale's device-trace
          fields ``computation`` (ms per sample) and ``communication`` (kbit/s), the time
          of a round trip then ``2 * model_bytes * 8 / 1000 / communication``.

        Every client ``0 .. num_clients - 1`` (default: the largest id + 1) must appear.
        Errors name the file, the line and the column."""
        path = Path(path)
        rows: Dict[int, dict] = {}
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            cols = set(reader.fieldnames or ())
            fedscale = {"computation", "communication"} <= cols
            if "client" not in cols or not (fedscale or {"compute_s_per_sample", "comm_s"} <= cols):
                raise ValueError(f"{path}: the header must name client, compute_s_per_sample and comm_s (or "
                                 f"FedScale's computation and communication), got {sorted(cols)}")
            if fedscale and not model_bytes:
                raise ValueError(f"{path}: FedScale's communication (kbit/s) needs model_bytes to give a time")
            for line, row in enumerate(reader, start=2):
                def num(col, required=True):
                    text = (row.get(col) or "").strip()
                    if not text:
                        if required:
                            raise ValueError(f"{path}:{line}: column {col} is empty")
                        return None
                    try:
                        v = float(text)
                    except ValueError:
                        raise ValueError(f"{path}:{line}: column {col}: {text!r} is not a number") from None
                    if not math.isfinite(v) or v < 0:
                        raise ValueError(f"{path}:{line}: column {col}: {text!r} must be a finite number >= 0")
                    return v

                client = num("client")
                if client != int(client):
                    raise ValueError(f"{path}:{line}: column client: {row['client']!r} is not an integer")
                if fedscale:
                    compute = num("computation") / 1000.0
                    kbps = num("communication")
                    if kbps == 0:
                        raise ValueError(f"{path}:{line}: column communication must be > 0")
                    comm = 2 * model_bytes * 8 / 1000.0 / kbps
                else:
                    compute, comm = num("compute_s_per_sample"), num("comm_s")
                lo, hi = num("available_from", False), num("available_until", False)
                entry = rows.setdefault(int(client), {"compute": compute, "comm": comm, "windows": []})
                if (entry["compute"], entry["comm"]) != (compute, comm):
                    raise ValueError(f"{path}:{line}: client {int(client)} has another speed than on an earlier line")
                if lo is not None or hi is not None:
                    entry["windows"].append((lo or 0.0, INF if hi is None else hi))
        n = num_clients if num_clients is not None else (max(rows) + 1 if rows else 0)
        missing = [c for c in range(n) if c not in rows]
        if missing or not rows:
            raise ValueError(f"{path}: no line for client(s) {missing[:10]} of 0..{n - 1}")
        devices = []
        for c in range(n):
            e = rows[c]
            windows = tuple(sorted(e["windows"])) or ((0.0, INF),)
            try:
                devices.append(Device(e["compute"], e["comm"], windows))
            except ValueError as exc:
                raise ValueError(f"{path}: client {c}: {exc}") from None
        return cls(devices)

    # ------------------------------------------------------------------ queries
    def train_time(self, client: int, steps: int, batch: int) -> float:
        """Virtual seconds of one client's round: its compute for ``steps * batch`` samples
        plus its communication."""
        d = self.devices[client]
        return steps * batch * d.compute_s_per_sample + d.comm_s

    def window_at(self, client: int, t: float) -> Optional[Tuple[float, float]]:
        """The online window holding time ``t`` (absolute times; a periodic device's
        windows joined across the period boundary), or None when offline."""
        d = self.devices[client]
        if d.period is None:
            for w in d.windows:
                if w[0] <= t < w[1]:
                    return w
            return None
        base = math.floor(t / d.period) * d.period
        for lo, hi in d.windows:
            if lo <= t - base < hi:
                lo, hi = base + lo, base + hi
                if hi == base + d.period and d.windows[0][0] == 0.0:  # continues into the next period
                    hi = base + d.period + d.windows[0][1]
                if lo == base and d.windows[-1][1] == d.period:  # began in the previous period
                    lo = base - d.period + d.windows[-1][0]
                return (lo, hi)
        return None

    def available(self, client: int, t: float) -> bool:
        return self.window_at(client, t) is not None

    def next_available(self, client: int, t: float) -> Optional[float]:
        """The first time ``>= t`` the client is online (None: never again)."""
        d = self.devices[client]
        if d.period is None:
            for lo, hi in d.windows:
                if t < hi:
                    return max(t, lo)
            return None
        base = math.floor(t / d.period) * d.period
        for k in (0, 1):
            for lo, hi in d.windows:
                if t < base + k * d.period + hi:
                    return max(t, base + k * d.period + lo)
        return None

    def finish(self, client: int, start: float, steps: int, batch: int) -> Tuple[float, bool]:
        """``(end, dropped)``: when the client started at ``start`` would finish, and
        whether it goes offline first (its window ends before ``end``: it never reports)."""
        end = start + self.train_time(client, steps, batch)
        w = self.window_at(client, start)
        return end, (w is None or end > w[1])


def sync_round(clock: DeviceClock, clients: Sequence[int], start: float, steps: int, batch: int, *,
               deadline: Optional[float] = None, keep: Optional[int] = None) -> SyncRound:
    """A synchronous round on the virtual clock: every client in ``clients`` (the sampled
    ones, over-selected if ``keep`` is smaller) starts at ``start``.  Those offline at the
    start, those that go offline before finishing, those finishing after ``start +
    deadline``, and (``keep``) those after the first ``keep`` to finish are excluded, each
    with its reason; ties in finishing time go to the client sampled first.  The round
    closes when the ``keep``-th client finishes; otherwise when every client has either
    finished or gone offline (the server learns of a dropout when it goes offline, as a
    heartbeat would tell it), but no later than the deadline -- at the deadline if a
    client missed it."""
    if deadline is not None and not (deadline > 0 and math.isfinite(deadline)):
        raise ValueError(f"deadline must be a finite number of seconds > 0, got {deadline!r}")
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    out = SyncRound(kept=[], finish={})
    finishers, lost_at = [], []  # lost_at: when the server learns a dropout is gone (it goes offline)
    for order, c in enumerate(clients):
        if not clock.available(c, start):
            out.excluded[c] = "unavailable"
            continue
        end, dropped = clock.finish(c, start, steps, batch)
        if dropped:
            out.excluded[c] = "dropout"
            lost_at.append(clock.window_at(c, start)[1])
        elif deadline is not None and end > start + deadline:
            out.excluded[c] = "deadline"
        else:
            finishers.append((end, order, c))
    finishers.sort()
    if keep is not None and len(finishers) >= keep:
        for end, _, c in finishers[keep:]:
            out.excluded[c] = "over_selected"
        finishers = finishers[:keep]
        close = finishers[-1][0]  # the keep-th arrival closes the round
    else:
        close = max([end for end, _, _ in finishers] + lost_at, default=start)
        if deadline is not None and (close > start + deadline or "deadline" in out.excluded.values()):
            close = start + deadline  # the server waited for the deadline
    kept = {c for _, _, c in finishers}
    out.kept = [c for c in clients if c in kept]
    out.finish = {c: end for end, _, c in finishers}
    out.duration = close - start
    return out
