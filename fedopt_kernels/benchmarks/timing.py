"""Interleaved timing: the only fair comparison on a shared, noisy machine.

Every candidate runs once per repetition, in the same repetition, one after another,
so a burst of noise hits all of them alike; the summary is the median.  Wall-clock
numbers are never asserted anywhere: only ratios measured in the same run are reported.
"""

from __future__ import annotations

import re
import statistics
import time
import warnings
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

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


def measured_copy_bandwidth(device) -> Optional[float]:
    """:func:`copy_bandwidth` of ``device`` if this process has measured it, else None
    (nothing is measured)."""
    return _COPY_BW.get(str(torch.device(device)))


def of_copy_bandwidth(traffic_bytes: float, seconds: float, device: torch.device) -> float:
    """The fraction of the measured copy bandwidth a call moving ``traffic_bytes`` (the
    op's minimum traffic) in ``seconds`` reaches: 1.0 is the memory floor."""
    return traffic_bytes / seconds / copy_bandwidth(device)


# Vendor HBM peaks (bytes/s) by device name, for when torch reports no memory clock or
# bus width: the first key the name contains wins, so the more specific keys come first.
PEAK_BANDWIDTH_BY_NAME = (
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),  # SXM5, "NVIDIA H100 80GB HBM3"
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),  # the 40 GB parts
)

_PEAK_BW: Dict[str, Tuple[Optional[float], str]] = {}


def peak_bandwidth_from_properties(props) -> Tuple[Optional[float], str]:
    """``(bytes_per_s, source)`` of a device's memory from its CUDA properties: HBM and
    GDDR move data on both clock edges, so peak = 2 * ``memory_clock_rate`` (kHz) * 1e3 *
    ``memory_bus_width`` (bits) / 8 -- the formula of ``torch.cuda._device_limits`` --
    else the vendor figure of :data:`PEAK_BANDWIDTH_BY_NAME` for ``props.name``, else
    ``(None, why)``.  A figure outside 10 GB/s - 100 TB/s (a driver reporting 0 or a
    wrong unit) falls through to the table."""
    name = str(getattr(props, "name", ""))
    vendor = next(((key, peak) for key, peak in PEAK_BANDWIDTH_BY_NAME if key.lower() in name.lower()), None)
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    if clock_khz > 0 and bus_bits > 0:
        peak = 2.0 * clock_khz * 1e3 * bus_bits / 8
        if 1e10 < peak < 1e14:
            also = f"; vendor figure {vendor[1]:.4g}" if vendor else ""
            return peak, (f"2 x memory_clock_rate {clock_khz / 1e3:.0f} MHz x {bus_bits}-bit bus "
                          f"(torch.cuda.get_device_properties{also})")
    if vendor is not None:
        return vendor[1], f"vendor figure for {vendor[0]!r} (device name {name!r})"
    return None, f"unknown: no memory clock / bus width from torch, {name!r} not in the table"


def peak_bandwidth(device) -> Tuple[Optional[float], str]:
    """``(bytes_per_s, source)`` of ``device``'s memory peak (:func:`peak_bandwidth_from_properties`
    of CUDA devices; ``(None, why)`` elsewhere).  Looked up once per device and process."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, f"no HBM peak for a {device.type} device"
    key = str(device)
    if key not in _PEAK_BW:
        index = device.index if device.index is not None else torch.cuda.current_device()
        _PEAK_BW[key] = peak_bandwidth_from_properties(torch.cuda.get_device_properties(index))
    return _PEAK_BW[key]


def of_hbm_peak(traffic_bytes: float, seconds: float, device) -> float:
    """The fraction of the device's peak memory bandwidth (:func:`peak_bandwidth`) a call
    moving ``traffic_bytes`` in ``seconds`` reaches; NaN where there is no peak (CPU)."""
    peak, _ = peak_bandwidth(device)
    return traffic_bytes / seconds / peak if peak else float("nan")


# Device-side records that are not work the call enqueued (kineto's synchronisation
# records, present when its CUDA_SYNC tracing is on): the profiled call's own sync.
_NOT_A_LAUNCH = re.compile(r"^(Context|Stream|Event|Device) (Sync|Wait)|^cuda\w*Synchronize")
# Host-side CUDA runtime / driver calls that enqueue work (kineto names some with a
# version suffix, e.g. cudaLaunchKernelExC_v11060; Triton launches with cuLaunchKernel).
_LAUNCH_API = re.compile(r"^cu(da)?(LaunchKernel|LaunchCooperativeKernel|Memcpy|Memset|GraphLaunch)")


class LaunchCount(NamedTuple):
    """What one call put on the GPU, two ways from the same trace: ``device_ops``, the
    GPU-side records (:func:`device_operations`), and ``api_calls``, the host-side calls
    that enqueue work (:func:`launch_api_calls`).  Equal unless the tracer lost records
    (CUPTI before CUDA 13.1 can drop kernel records at the start of a session) or a call
    enqueues several operations (a CUDA graph)."""
    device_ops: int
    api_calls: int


def device_operations(events) -> int:
    """How many of the profiler's ``events`` (``FunctionEvent``s of ``prof.events()``) are
    operations on the GPU: kernels, memsets, memcpys -- ``DeviceType.CUDA`` events, less
    the GPU-timeline copies of ``record_function`` ranges (``is_user_annotation``, e.g.
    ``Optimizer.step#SGD.step``) and synchronisation records."""
    from torch.autograd import DeviceType

    return sum(1 for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
               and not _NOT_A_LAUNCH.search(e.name))


def launch_api_calls(events) -> int:
    """How many of the profiler's ``events`` are host-side CUDA calls that put work on
    the GPU (kernel launches, async memcpy / memset, graph launches)."""
    from torch.autograd import DeviceType

    return sum(1 for e in events if e.device_type == DeviceType.CPU and _LAUNCH_API.search(e.name))


def count_launches(fn: Callable[[], object], device) -> Optional[LaunchCount]:
    """What one call of ``fn`` puts on the GPU (:class:`LaunchCount`: kernels, memsets and
    memcpys -- a memset or memcpy is enqueued like a kernel and costs a launch too),
    traced by ``torch.profiler`` (CUPTI) around ONE call after one untimed call (lazy
    initialisation, recompiles), the device synchronized before and after.  None on a
    non-CUDA device or when the profiler fails (a warning says why).  Count after every
    timing of the process: the profiler's start-up, post-processing and CUPTI (which
    torch does not tear down) would perturb timed calls -- :func:`defer_launch_columns`."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        events = prof.events()
        return LaunchCount(device_operations(events), launch_api_calls(events))
    except Exception as exc:  # a profiler that cannot start must not lose the timings
        warnings.warn(f"launch count unavailable: {type(exc).__name__}: {exc}", RuntimeWarning)
        return None


def launch_counts(candidates: Dict[str, Callable[[], object]], device, *,
                  skip: Sequence[str] = ()) -> Dict[str, Optional[LaunchCount]]:
    """:func:`count_launches` of each candidate (one profiled call each), ``{}`` off CUDA
    (nothing is profiled); candidates in ``skip`` are left out."""
    if torch.device(device).type != "cuda":
        return {}
    return {name: count_launches(fn, device) for name, fn in candidates.items() if name not in skip}


def set_launch_columns(rows: List[dict], counts: Dict[str, Optional[LaunchCount]]) -> List[dict]:
    """Writes ``"launches"`` (GPU operations of one call) and ``"launch API calls"`` (the
    host calls that enqueued them) into each row of ``rows`` from ``counts`` (by
    ``case``); NaN where not counted (CPU, a profiler failure, a one-off case)."""
    nan = float("nan")
    for row in rows:
        count = counts.get(row["case"])
        row["launches"] = float(count.device_ops) if count is not None else nan
        row["launch API calls"] = float(count.api_calls) if count is not None else nan
    return rows


def defer_launch_columns(rows: List[dict], candidates: Dict[str, Callable[[], object]], device,
                         deferred: Optional[list]) -> List[dict]:
    """The launch columns of a benchmark's ``rows``: NaN now, and, on CUDA, counted by
    ``deferred`` -- a list to which this appends a no-argument function that counts the
    ``candidates`` and fills the columns in (the suite runs them once every benchmark is
    timed: :func:`count_launches` says why) -- or right now when ``deferred`` is None (a
    benchmark run on its own).  Off CUDA nothing is kept or counted."""
    set_launch_columns(rows, {})
    if torch.device(device).type != "cuda":
        return rows

    def count():
        set_launch_columns(rows, launch_counts(candidates, device))

    if deferred is None:
        count()
    else:
        deferred.append(count)
    return rows


def ratio_rows(benchmark: str, times: Dict[str, float], *, base: str, fused: str, base_column: str = "vs floor",
               fused_column: str = "time / fused", traffic_bytes: Optional[float] = None,
               device: Optional[torch.device] = None, not_timed: Sequence[str] = (),
               torch_anchor: Optional[str] = None) -> List[dict]:
    """One row per candidate of ``times`` (seconds): ``{"benchmark", "case", "ms",
    base_column: times[base] / seconds, fused_column: seconds / times[fused]}``, and, when
    ``traffic_bytes`` (the op's minimum traffic) is given, ``"of copy bw"``
    (:func:`of_copy_bandwidth`) and ``"of HBM peak"`` (:func:`of_hbm_peak`, NaN off CUDA).
    ``torch_anchor``: the candidate that is PyTorch's own way to do the op; adds
    ``"vs torch"`` = its time / the candidate's (higher is faster; NaN for every row when
    this torch has no such candidate) and ``"torch anchor"`` (its name).  (The launch
    columns come from :func:`defer_launch_columns`.)  A case in ``not_timed`` (a one-off cost such as a recompile, not a call of the op) gets
    NaN for the ratios that compare it with the op."""
    nan = float("nan")
    rows = []
    for name, seconds in times.items():
        timed = name not in not_timed
        row = {"benchmark": benchmark, "case": name, "ms": seconds * 1e3,
               base_column: times[base] / seconds if timed else nan,
               fused_column: seconds / times[fused]}
        if torch_anchor is not None:
            row["vs torch"] = times[torch_anchor] / seconds if timed and torch_anchor in times else nan
            row["torch anchor"] = torch_anchor
        if traffic_bytes is not None:
            row["of copy bw"] = of_copy_bandwidth(traffic_bytes, seconds, device) if timed else nan
            row["of HBM peak"] = of_hbm_peak(traffic_bytes, seconds, device) if timed else nan
        rows.append(row)
    return rows
