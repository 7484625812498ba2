"""Interleaved timing: the only fair comparison on a shared, noisy machine.

Every candidate runs once per repetition, in the same repetition, one after another,
so a burst of noise hits all of them alike; the summary is the median.  Wall-clock
numbers are never asserted anywhere: only ratios measured in the same run are reported.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Written before every timed call of a cold-cache run: larger than the last-level cache
# of the machines this runs on (a Zen 5 CCD has 32 MiB of L3, an H100 50 MiB of L2).
FLUSH_BYTES = 256 << 20


def interleaved(candidates: Dict[str, Callable[[], object]], *, repeats: int = 15, warmup: int = 2,
                device: torch.device = torch.device("cpu"), warm_cache: bool = False,
                cold_cache: bool = False) -> Dict[str, float]:
    """Median seconds per call of each candidate, timed round-robin.

    ``warm_cache``: precede every timed call by one untimed call of the same candidate,
    so data that fits in cache is resident when timing starts -- as a small model's
    params and grads are right after the backward pass of a training step.
    ``cold_cache``: write a buffer larger than the caches before every timed call, so
    every candidate starts from memory whatever ran before it.  With neither, each call
    starts with the caches holding the previous candidate's data, which favours some
    candidates over others when the data fits in the last-level cache.
    """
    if warm_cache and cold_cache:
        raise ValueError("warm_cache and cold_cache are exclusive")
    flush = torch.empty(FLUSH_BYTES // 4, device=device) if cold_cache else None
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    samples: Dict[str, list] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            if warm_cache:
                fn()
            if flush is not None:
                flush.fill_(1.0)
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


_COPY_BW: Dict[str, float] = {}


def copy_bandwidth(device: torch.device, repeats: int = 9) -> float:
    """Bytes per second of ``dst.copy_(src)`` on ``device`` (read + write counted), over
    buffers of ``FLUSH_BYTES`` each -- larger than the last-level cache, so this is the
    memory's streaming bandwidth, the floor of every memory-bound step.  Measured once
    per device and process."""
    device = torch.device(device)
    key = str(device)
    if key not in _COPY_BW:
        src = torch.empty(FLUSH_BYTES // 4, device=device).fill_(1.0)
        dst = torch.empty_like(src)
        seconds = interleaved({"copy": lambda: dst.copy_(src)}, repeats=repeats, device=device)["copy"]
        _COPY_BW[key] = 2 * src.numel() * src.element_size() / seconds
    return _COPY_BW[key]


def of_copy_bandwidth(traffic_bytes: float, seconds: float, device: torch.device) -> float:
    """The fraction of the measured copy bandwidth a call moving ``traffic_bytes`` (the
    op's minimum traffic) in ``seconds`` reaches: 1.0 is the memory floor."""
    return traffic_bytes / seconds / copy_bandwidth(device)


def ratio_rows(benchmark: str, times: Dict[str, float], *, base: str, fused: str, base_column: str = "vs floor",
               fused_column: str = "time / fused", traffic_bytes: Optional[float] = None,
               device: Optional[torch.device] = None, not_timed: Sequence[str] = ()) -> List[dict]:
    """One row per candidate of ``times`` (seconds): ``{"benchmark", "case", "ms",
    base_column: times[base] / seconds, fused_column: seconds / times[fused]}``, and
    ``"of copy bw"`` (:func:`of_copy_bandwidth` of ``traffic_bytes``, the op's minimum
    traffic) when given.  A case in ``not_timed`` (a one-off cost such as a recompile,
    not a call of the op) gets NaN for the ratios that compare it with the op."""
    rows = []
    for name, seconds in times.items():
        timed = name not in not_timed
        row = {"benchmark": benchmark, "case": name, "ms": seconds * 1e3,
               base_column: times[base] / seconds if timed else float("nan"),
               fused_column: seconds / times[fused]}
        if traffic_bytes is not None:
            row["of copy bw"] = of_copy_bandwidth(traffic_bytes, seconds, device) if timed else float("nan")
        rows.append(row)
    return rows
