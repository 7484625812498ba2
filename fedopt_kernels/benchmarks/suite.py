"""The kernel benchmark suite behind ``fedopt bench`` (and ``python -m fedopt_kernels.benchmarks.suite``).

Prints tables of medians and ratios measured in the same run (kernels; whole simulated
rounds, :mod:`.simulation`; the batched engine on the device against the CPU), then one
summary line per kernel case (the fused op against torch's own way to do it).
``--json`` also writes the rows, the first of them a ``"benchmark": "meta"`` row (device,
torch, the HBM peak and its source, the measured copy bandwidth).  ``--quick`` uses
fewer repetitions, skips ``torch.compile`` and the longest simulated cases, and keeps
every column: the GPU check's budget.

Kernel columns: ``vs floor`` (floor time / time), ``vs torch`` (torch anchor's time /
time: ``torch.optim.SGD(fused) + clip_grad_norm_(foreach)``, ``Adam(fused=True)``,
``torch.stack(list).sum(0)``), ``time / fused``, ``of copy bw`` and ``of HBM peak``
(minimum traffic / time over the measured copy bandwidth / the peak; the peak is NaN off
CUDA), ``launches`` (GPU operations -- kernels, memsets, memcpys -- of one call, traced
with the profiler once every suite of the run is timed; NaN off CUDA; the JSON also has
``launch API calls``, the host calls that enqueued them, as a cross-check).

Suites: ``nar_step``, ``aggregate``, ``compressed`` (:mod:`.compressed`: the decode-aggregate
of compressed replies against the fp32 floor and against decode-then-aggregate), ``server``, ``simulation``, ``device_vs_cpu`` (the
same real run with the batched engine on ``--device`` and on the CPU) and ``startup`` (a
one-round ``fedopt simulate`` as whole processes, paired against ``import torch``:
:mod:`.startup`).  All run by
default: ``device_vs_cpu`` costs nothing on a CPU device (one row says it was skipped)
and on a GPU only a few CPU rounds.  ``scale`` (:mod:`.scale`: round time and peak
memory against the population and the clients per round, each case in a fresh process,
on the CPU; the sampling and partitions of 10^5 clients) runs only when named
(``--only scale``): it takes minutes (``--quick``: seconds).  ``diloco`` (:mod:`.diloco`:
DiLoCo, Streaming DiLoCo and DDP at equal tokens on a character-level GPT, 2 gloo worker
processes) also runs only when named: minutes (``--quick``: 30 steps); so does
``compressed_accuracy`` (:mod:`.compressed_accuracy`: test accuracy against rounds of each
codec with and without error feedback, digits and synthetic, and the bytes up per round
against fp32; ``--quick``: 5 rounds of digits).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Optional

import torch

from .aggregate import bench_aggregate
from .compressed import bench_compressed
from .nar_step import bench_nar_step
from .server_update import bench_server_update
from .shapes import numel, resnet18_shapes, small_cnn_shapes
from .startup import STARTUP_COLUMNS
from .timing import measured_copy_bandwidth, peak_bandwidth

SUITES = ("nar_step", "aggregate", "compressed", "server", "simulation", "device_vs_cpu", "startup")
EXTRA_SUITES = ("scale", "diloco", "compressed_accuracy")  # run only when named with --only
SCALE_COLUMNS = (("case", "case"), ("clients", "clients"), ("per_round", "per round"), ("chunk", "chunk"),
                 ("setup_s", "setup s"), ("first_round_s", "first round s"), ("round_s", "round s"),
                 ("peak_rss_mb", "peak RSS MB"))
SIM_COLUMNS = (("benchmark", "benchmark"), ("case", "case"), ("ms", "median ms / round"),
               ("vs hand loop", "x faster than hand loop"), ("time / batched", "time / batched"))
KERNEL_COLUMNS = (("benchmark", "benchmark"), ("case", "case"), ("ms", "median ms"), ("vs floor", "speed vs floor"),
                  ("vs torch", "speed vs torch"), ("time / fused", "time / fused"),
                  ("of copy bw", "of copy bandwidth"), ("of HBM peak", "of HBM peak"), ("launches", "launches"))
DILOCO_COLUMNS = (("case", "method"), ("params", "params"), ("tokens_per_worker", "tokens / worker"),
                  ("final_val_loss", "final val loss"), ("MB_sent_per_worker", "MB sent / worker"),
                  ("inner_step_ms", "inner step ms"), ("sync_s", "sync s"), ("wall_s", "wall s"))
COMPRESSED_COLUMNS = (("benchmark", "benchmark"), ("case", "case"), ("ms", "median ms"), ("vs floor", "speed vs floor"),
                      ("vs floor, 2 MiB pages", "vs floor in 2 MiB pages"),
                      ("params/s", "params/s"), ("bytes/reply", "bytes / reply"), ("vs fp32 bytes", "fp32 bytes / bytes"),
                      ("GB/s", "GB/s (read + written once)"))
ACCURACY_COLUMNS = (("case", "case"), ("rounds", "rounds"), ("acc@1", "acc round 1"), ("acc@5", "acc round 5"),
                    ("final_acc", "final acc"), ("bytes_up", "bytes up / round"),
                    ("x fewer bytes", "fp32 bytes / bytes"), ("wall_s", "wall s"))
DEVICE_COLUMNS = (("benchmark", "benchmark"), ("case", "case"), ("ms", "median ms / round"),
                  ("vs cpu", "x faster than the CPU"))


def run(*, only=SUITES, backend: Optional[str] = None, device: str = "cpu", quick: bool = False,
        threads: Optional[int] = None) -> list:
    """The rows of the suites in ``only``.  The launch counts of the kernel candidates (on
    CUDA) are taken last, once every suite is timed: the profiler must not perturb any
    timing of the run (``timing.count_launches``)."""
    repeats = 5 if quick else 15
    rows: list = []
    deferred: list = []  # launch counting, run at the end
    if "nar_step" in only:
        rows += bench_nar_step(resnet18_shapes(), label="ResNet-18 (62 tensors, 11.2M)", backend=backend,
                               device=device, repeats=repeats, include_compile=not quick, deferred=deferred)
        # 91K parameters fit in cache: time each call warm, as after a backward pass, and
        # also cold (every call after the other candidates' data).
        for warm in (True, False):
            rows += bench_nar_step(small_cnn_shapes(), label=f"small CNN (10 tensors, 91K, {'warm' if warm else 'cold'})",
                                   backend=backend, device=device, repeats=repeats * 4,
                                   include_compile=not quick and warm, warm_cache=warm, deferred=deferred)
    if "aggregate" in only:
        rows += bench_aggregate(20, numel(resnet18_shapes()), label="20 x ResNet-18 (11.2M)", backend=backend,
                                device=device, repeats=max(3, repeats // 2), deferred=deferred)
        # 100 x 91K fp32 is 36 MB, about a last-level cache: time it from memory and from cache.
        for cache in ("cold", "warm"):
            rows += bench_aggregate(100, numel(small_cnn_shapes()), label=f"100 x small CNN (91K, {cache})",
                                    backend=backend, device=device, repeats=repeats * 2, cache=cache,
                                    deferred=deferred)
    if "compressed" in only:  # issue 42: decode-aggregate of int8 / int4 / fp8 / top-k replies
        rows += bench_compressed(20, numel(resnet18_shapes()), label="20 x ResNet-18 (11.2M)", backend=backend,
                                 device=device, repeats=max(3, repeats // 2))
    if "server" in only:
        rows += bench_server_update(resnet18_shapes(), label="ResNet-18 (62 tensors, 11.2M)", backend=backend,
                                    device=device, repeats=max(3, repeats // 2), deferred=deferred)
        rows += bench_server_update(small_cnn_shapes(), label="small CNN (10 tensors, 91K)", backend=backend,
                                    device=device, repeats=repeats * 4, deferred=deferred)
    if "simulation" in only:
        from . import simulation

        rows += simulation.run(device=device, backend=backend, quick=quick)
    if "device_vs_cpu" in only:
        from . import simulation

        rows += simulation.run_device_vs_cpu(device=device, backend=backend, quick=quick)
    if "startup" in only:  # whole processes, before the launch counting
        from . import startup

        rows += startup.run(quick=quick)
    if "scale" in only:  # fresh processes, CPU, one thread each unless --threads
        from . import scale

        rows += scale.run(quick=quick, threads=threads or 1)
    if "diloco" in only:  # DiLoCo vs DDP on a char GPT, 2 gloo worker processes on this CPU (minutes)
        from . import diloco

        rows += diloco.run(steps=30 if quick else 300, eval_every=10 if quick else 50)
    if "compressed_accuracy" in only:  # accuracy against rounds of each codec, +- error feedback (minutes)
        from . import compressed_accuracy

        rows += (compressed_accuracy.run(rounds=5, datasets=("digits",), codecs=compressed_accuracy.SHORT) if quick
                 else compressed_accuracy.run(rounds=10, codecs=compressed_accuracy.SHORT))
    for count in deferred:
        count()
    return rows


def _thp_mode() -> Optional[str]:
    """The kernel's transparent-hugepage mode (``always``, ``madvise``, ``never``), None
    where it cannot be read."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else text.strip()


def meta_row(device: str) -> dict:
    """What the numbers of a run depend on: device, torch, threads, the device's peak
    memory bandwidth and where it comes from (``timing.peak_bandwidth``), the copy
    bandwidth measured in this run (NaN when no kernel suite measured it), and the huge
    pages the CPU allocations get: torch's ``THP_MEM_ALLOC_ENABLE`` (2 MiB-aligned, madvised
    allocations from 2 MiB up) and the kernel's THP mode -- 20 streams of compressed codes
    read through 4 KiB pages run markedly slower than through 2 MiB ones
    (docs/benchmarks.md)."""
    dev = torch.device(device)
    peak, source = peak_bandwidth(dev)
    copy_bw = measured_copy_bandwidth(dev) or float("nan")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {"benchmark": "meta", "case": "device", "device": str(dev), "device name": name,
            "torch": torch.__version__, "cuda": torch.version.cuda, "threads": torch.get_num_threads(),
            "hbm peak B/s": peak if peak is not None else float("nan"), "hbm peak source": source,
            "copy bw B/s": copy_bw,
            "copy bw of HBM peak": copy_bw / peak if peak else float("nan"),
            "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE"), "thp mode": _thp_mode()}


def device_line(meta: dict) -> str:
    """The meta row in words: the HBM peak, its source, the measured copy bandwidth."""
    def rate(v):
        return "-" if math.isnan(v) else f"{v / 1e9:.4g} GB/s"

    line = (f"{meta['device name']}: HBM peak {rate(meta['hbm peak B/s'])} ({meta['hbm peak source']}); "
            f"measured copy bandwidth {rate(meta['copy bw B/s'])}")
    if meta.get("device") == "cpu" and "thp mode" in meta:
        line += (f"; THP_MEM_ALLOC_ENABLE={meta.get('THP_MEM_ALLOC_ENABLE') or 'unset'}, "
                 f"transparent hugepages {meta['thp mode'] or 'unknown'}")
    return line


def summary_lines(rows: list) -> list:
    """One line per kernel case that has a torch anchor: the fused op's speed against it,
    its fraction of the HBM peak and its launches where measured, e.g. "nar_step ...:
    fused is 3.1x torch SGD(fused) + clip_grad_norm_(foreach) (0.42 ms vs 1.3 ms)"; and
    one per device-vs-CPU comparison (or the reason it was skipped)."""
    lines = []
    from .startup import summary_line as startup_line

    if any(r.get("benchmark") == "startup" for r in rows):
        lines.append(startup_line(rows))
    for r in rows:
        if r.get("benchmark") == "startup":
            continue
        if r.get("benchmark") == "scale":
            lines += _scale_lines(r)
            continue
        if "vs cpu" in r:
            lines += _device_vs_cpu_line(r)
            continue
        if r.get("case") != "fused" or "torch anchor" not in r:
            continue
        anchor = next((a for a in rows if a["benchmark"] == r["benchmark"] and a["case"] == r["torch anchor"]), None)
        if anchor is None:
            lines.append(f"{r['benchmark']}: no torch anchor ({r['torch anchor']}) in this torch")
            continue
        line = (f"{r['benchmark']}: fused is {r['vs torch']:.3g}x {r['torch anchor']} "
                f"({r['ms']:.3g} ms vs {anchor['ms']:.3g} ms)")
        hbm = r.get("of HBM peak", float("nan"))
        if not math.isnan(hbm):
            line += f", {hbm:.0%} of HBM peak (anchor {anchor['of HBM peak']:.0%})"
        launches = r.get("launches", float("nan"))
        if not math.isnan(launches):
            line += f", {launches:.0f} launches (anchor {anchor['launches']:.0f})"
            calls = r.get("launch API calls", launches)
            if calls != launches:  # the tracer lost GPU records, or a call enqueued several
                line += f" -- but {calls:.0f} launch calls on the host"
        lines.append(line)
    return lines


def _scale_lines(r: dict) -> list:
    """The scale suite's sampling row in words, and any case that failed."""
    if "error" in r:
        return [f"scale: {r['case']} ({r.get('clients')} clients, {r.get('per_round')} per round) failed: "
                f"{' '.join(r['error'])}"]
    if r["case"] != "sampling":
        return []
    line = (f"scale: {r['clients']:,} clients: population {r['dataset_s']:.3g} s, natural partition "
            f"{r['partition_s'] * 1e3:.3g} ms, sampling a round {r['sample_s'] * 1e3:.3g} ms")
    for key in r:
        if key.startswith("dirichlet_") and key.endswith("_s"):
            n = key[len("dirichlet_"):-2]
            line += (f"; {int(n):,} samples: Dirichlet(0.3) {r[key]:.3g} s (min {r[f'dirichlet_{n}_min']}), "
                     f"IID {r[f'iid_{n}_s']:.3g} s")
    return [line]


def _device_vs_cpu_line(r: dict) -> list:
    if r["case"].startswith("skipped"):
        return [f"{r['benchmark']}: {r['case']}"]
    if "max |device - cpu| x" not in r:  # the CPU's own row: said by the device's
        return []
    return [f"{r['benchmark']}: {r['case']}: {r['ms']:.3g} ms/round, {r['vs cpu']:.3g}x the CPU engine "
            f"(max |device - cpu| x {r['max |device - cpu| x']:.2g})"]


def format_rows(rows: list, keys=tuple(k for k, _ in KERNEL_COLUMNS)) -> list:
    def fmt(v):
        if v is None:  # e.g. the scale rows' chunk of a round trained whole
            return "-"
        if isinstance(v, float):
            return "-" if math.isnan(v) else f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    return [[fmt(r.get(k, float("nan"))) for k in keys] for r in rows]


def print_table(rows: list, title: str = "fedopt_kernels benchmarks") -> None:
    """One table for the kernel rows, one for the simulated rounds, one for the device
    against the CPU (each with its own columns)."""
    scale = [r for r in rows if r.get("benchmark") == "scale" and r.get("case") != "sampling" and "error" not in r]
    started = [r for r in rows if r.get("benchmark") == "startup"]
    diloco = [r for r in rows if r.get("benchmark") == "diloco"]
    accuracy = [r for r in rows if r.get("benchmark") == "compressed_accuracy"]
    rows = [r for r in rows if r.get("benchmark") not in ("meta", "scale", "startup", "diloco", "compressed_accuracy")]
    rounds = [r for r in rows if "vs hand loop" in r]
    versus = [r for r in rows if "vs cpu" in r]
    compressed = [r for r in rows if "bytes/reply" in r]
    kernels = [r for r in rows if "vs hand loop" not in r and "vs cpu" not in r and "bytes/reply" not in r]
    for part, columns, name in ((kernels, KERNEL_COLUMNS, title),
                                (compressed, COMPRESSED_COLUMNS, f"{title}: compressed replies (issue 42)"),
                                (rounds, SIM_COLUMNS, f"{title}: simulated rounds"),
                                (versus, DEVICE_COLUMNS, f"{title}: batched engine, device vs CPU"),
                                (scale, SCALE_COLUMNS, "cross-device scale (fresh process per case, CPU)"),
                                (started, STARTUP_COLUMNS, "start-up of a one-round simulate (whole processes)"),
                                (diloco, DILOCO_COLUMNS, "DiLoCo vs DDP, char GPT, equal tokens (gloo, CPU)"),
                                (accuracy, ACCURACY_COLUMNS, "compressed updates: accuracy and bytes up (FedAvg)")):
        if part or (not rows and not scale and not started and not diloco and not accuracy
                    and columns is KERNEL_COLUMNS):
            _print_one(part, columns, name)


def _print_one(rows: list, columns, title: str) -> None:
    keys = tuple(k for k, _ in columns)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text fallback
        print(title)
        for r in format_rows(rows, keys):
            print(" | ".join(r))
        return
    table = Table(title=title)
    for key, col in columns:
        table.add_column(col, justify="left" if key in ("benchmark", "case") else "right")
    for r in format_rows(rows, keys):
        table.add_row(*r)
    Console(width=190).print(table)


def build_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("--only", choices=SUITES + EXTRA_SUITES, action="append",
                        help="run only this suite (repeatable); scale, diloco and compressed_accuracy run only "
                             "when named")
    parser.add_argument("--backend", default=None, help="kernel backend of the fused candidates")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, no torch.compile")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads for every candidate (default: torch's own choice)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_from_args(args)


def run_from_args(args) -> int:
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    rows = run(only=tuple(args.only or SUITES), backend=args.backend, device=args.device, quick=args.quick,
               threads=getattr(args, "threads", None))
    print_table(rows, title=f"fedopt_kernels benchmarks on {args.device} ({torch.get_num_threads()} threads)")
    meta = meta_row(args.device)
    print(device_line(meta))
    for line in summary_lines(rows):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([meta] + rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
