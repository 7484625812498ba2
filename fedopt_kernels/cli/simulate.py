"""``fedopt simulate`` and ``fedopt compare``."""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import List, Optional

import torch

from ..fl.run.config import ALGORITHMS, ConfigError, SimulationConfig
from ..fl.run.interrupts import deferred_interrupts, exit_status, signal_name, stop_on_signals
from ..fl.run.results import Results, comparison_rows, plot_comparison, write_atomic
from ._errors import CLIError
from ._options import build_settings

CHECKPOINT = "checkpoint.pt"
AUTO_THREADS_MAX_PARAMS = 5_000_000
_NOTED: set = set()


# ---------------------------------------------------------------------------- helpers
def _with_notices(fn):
    """Run ``fn`` showing the simulator's engine fallback (``fedopt: note: ...``), a
    client left out for non-finite training and a memory budget no chunk fits
    (``fedopt: warning: ...``) as one line instead of a Python warning with its source
    line."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from ..fl import MemoryBudgetWarning, NonFiniteClientWarning
        from ..fl.engine.batched import EngineFallbackWarning

        previous = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, EngineFallbackWarning):
                print(f"fedopt: note: {message}", file=sys.stderr)
            elif issubclass(category, (NonFiniteClientWarning, MemoryBudgetWarning)):
                print(f"fedopt: warning: {message}", file=sys.stderr)
            else:
                previous(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        try:
            return fn(*args, **kwargs)
        finally:
            warnings.showwarning = previous

    return wrapper


def prepare_out_dir(path: str) -> Path:
    """Create ``path`` and prove it writable (one line on failure)."""
    p = Path(path).expanduser()
    try:
        p.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise CLIError(f"output directory {path} exists and is not a directory") from None
    except OSError as exc:
        raise CLIError(f"cannot create output directory {path}: {exc.strerror or exc}") from None
    if not p.is_dir():
        raise CLIError(f"output directory {path} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".fedopt-write-test-", dir=p)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise CLIError(f"output directory {path} is not writable: {exc.strerror or exc}") from None
    return p


def _apply_threads(threads: Optional[int], num_params: int, batched: bool = False) -> None:
    """``--threads``, else 1 thread for the sequential engine on models under 5M
    parameters (more threads only add overhead to its tiny ops); the batched engine
    keeps torch's default: its batched matmuls spread over the cores (and its results
    do not depend on the thread count)."""
    if threads is None:
        if num_params < AUTO_THREADS_MAX_PARAMS and not batched:
            torch.set_num_threads(1)
        elif torch.get_num_threads() > 1:
            note = busy_note(torch.get_num_threads())
            if note and not _NOTED:  # once per process (compare builds one simulation per run)
                _NOTED.add(note)
                print(f"fedopt: note: {note}", file=sys.stderr)
    else:
        torch.set_num_threads(threads)


def busy_note(threads: int, load: Optional[float] = None, cores: Optional[int] = None) -> Optional[str]:
    """A hint when other processes already keep this machine's cores busy: torch's
    threads then wait for each other (measured: a 5-round FedLAW CNN run took 38.5 s on 2
    threads against 7.8 s on 1, on 2 cores loaded by two other jobs)."""
    try:
        load = os.getloadavg()[0] if load is None else load
        cores = len(os.sched_getaffinity(0)) if cores is None else cores
    except (OSError, AttributeError):
        return None
    if load < max(cores - 0.5, 0.5):
        return None
    return (f"the machine is busy (load {load:.1f} on {cores} core(s)) and torch runs {threads} threads; on a busy "
            "machine --threads 1 is often several times faster")


def _fmt(v, pct=False, digits=4):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if pct:
        return f"{100 * v:.2f}%"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def _console(min_width: int = 0):
    """A rich console; when the output is not a terminal (a file, a pipe, CI) it gets
    ``min_width`` columns instead of rich's 80 so tables are not cut."""
    from rich.console import Console

    console = Console()
    if min_width and not console.is_terminal and console.width < min_width:
        console = Console(width=min_width)
    return console


def print_summary(results: List[Results], title: str) -> None:
    from rich.table import Table

    table = Table(title=title)
    rows = comparison_rows(results)
    # columns a plain run does not need: the mean of the last two iterates (a recipe that evaluates
    # it, as FedExP's), and what the run is beyond its algorithm (DP epsilon, aggregator, attack)
    avg2 = any(s["final_accuracy_avg2"] is not None for s in rows)
    settings = any(s["settings"] for s in rows)
    columns = ["run", "rounds", "init acc", "final acc", "best acc"] + (["final avg2", "best avg2"] if avg2 else [])
    columns += ["test loss", "train loss", "clip freq", "time s"] + (["settings"] if settings else [])
    for col in columns:
        table.add_column(col, justify="left" if col in ("run", "settings") else "right",
                         no_wrap=col != "settings")
    for s in rows:
        cells = [s["label"] + (" (interrupted)" if s["interrupted"] else ""), str(s["rounds"]),
                 _fmt(s["initial_accuracy"], pct=True), _fmt(s["final_accuracy"], pct=True),
                 _fmt(s["best_accuracy"], pct=True)]
        if avg2:
            cells += [_fmt(s["final_accuracy_avg2"], pct=True), _fmt(s["best_accuracy_avg2"], pct=True)]
        cells += [_fmt(s["final_test_loss"], digits=3), _fmt(s["final_train_loss"], digits=3),
                  _fmt(s["mean_clip_frequency"], digits=2), "-" if s["wall_time"] is None else f"{s['wall_time']:.1f}"]
        if settings:
            cells.append(s["settings"] or "-")
        table.add_row(*cells)
    console = _console(min_width=160 if settings else 120)
    console.print(table)
    for s in comparison_rows(results):
        if s.get("note"):
            console.print(f"[yellow]note[/] ({s['label']}): {s['note']}", highlight=False)


class _Progress:
    """A rich progress bar over rounds showing the latest accuracy (or nothing); and,
    once a round runs long, a second bar of the clients trained within the round
    (:meth:`within_round`).

    ``clock`` and ``console`` are for tests (a fake clock, a console writing to a buffer)."""

    #: a round that has been training this long (seconds) gets the clients bar
    LONG_ROUND_S = 2.0

    def __init__(self, enabled: bool, *, clock=time.monotonic, console=None):
        self.enabled = enabled
        self.progress = None
        self._clock, self._console = clock, console
        self._clients_task = None
        self._round, self._round_start = None, 0.0

    def __enter__(self):
        if self.enabled:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                     transient=False, console=self._console)
            self.progress.__enter__()
        return self

    def add(self, label: str, total: int, done: int = 0):
        if self.progress is None:
            return None
        return self.progress.add_task(label, total=total, completed=done, status="")

    def update(self, task, record: dict):
        if self.progress is None or task is None:
            return
        acc = record.get("test_accuracy")
        status = f"round {record['round']}"
        if acc is not None:
            status += f"  acc {100 * acc:.2f}%"
        if record.get("train_loss") is not None:
            status += f"  loss {record['train_loss']:.3f}"
        self.progress.update(task, completed=record["round"], status=status)

    def within_round(self, round_number: int, done: int, total: int) -> None:
        """``Simulation.progress``: clients trained so far in the round.  The second bar
        appears once a round has trained for :attr:`LONG_ROUND_S` without finishing
        (with or without --memory-budget; short rounds never show it), then follows
        every round."""
        if self.progress is None:
            return
        now = self._clock()
        if round_number != self._round or done == 0:  # a round starts (the simulator reports 0 first)
            self._round, self._round_start = round_number, now
        task = self._clients_task
        if task is None:
            if done >= total or now - self._round_start < self.LONG_ROUND_S:
                return
            task = self._clients_task = self.progress.add_task("clients", total=total, completed=0, status="")
        self.progress.update(task, total=total, completed=done, status=f"round {round_number}")
    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.__exit__(*exc)
        return False


def _build_simulation(config: SimulationConfig, *, distributed: bool = False, **kwargs):
    if distributed:
        from ..fl.run.distributed_simulation import DistributedSimulation as Simulation
    else:
        from ..fl.run.simulation import Simulation

    try:
        return Simulation(config, **kwargs)
    except ConfigError as exc:
        raise CLIError(str(exc)) from None


def _load_checkpoint(path: Path) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        hint = ""
        if (path.parent / "results.json").exists():
            hint = (" (results.json is there: the run was killed before it could save one -- SIGKILL, a crash or "
                    "the machine going down; --checkpoint-every K saves one every K rounds)")
        raise CLIError(f"--resume: no checkpoint at {path}{hint}") from None
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one message
        # a truncated or foreign file: say so in our words -- torch's own message advises
        # weights_only=False, which would run whatever code a pickle holds
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        first = first.split(" Re-running `torch.load`")[0].split(" In PyTorch 2.6")[0]
        raise CLIError(f"--resume: {path} is not a readable checkpoint (corrupt, truncated, or not written by "
                       f"fedopt: {type(exc).__name__}: {first[:160]}); its run cannot continue from it -- "
                       "start again without --resume or with another --out") from None
    run = state.get("sim") if isinstance(state, dict) and "async" in state else state  # a run on the virtual clock
    if not isinstance(run, dict) or "round" not in run or "config" not in run:
        raise CLIError(f"--resume: {path} is not a fedopt checkpoint (it holds no run state); start again without "
                       "--resume or with another --out")
    return state


def _resume_into(sim, state: dict, path: Path, *, done: Optional[int] = None) -> None:
    """Load ``state`` into ``sim`` (a Simulation, or a ClockedRun with its own state);
    refuse fewer rounds than the checkpoint has done (the run would be marked complete
    at the checkpoint's round and a later plain ``--resume`` would do nothing)."""
    done = int(state.get("round", 0)) if done is None else done
    config = sim.sim.config if hasattr(sim, "sim") else sim.config
    if config.run.rounds < done:
        raise CLIError(f"--resume: {path} has already run {done} rounds, more than --rounds {config.run.rounds}; "
                       f"give --rounds {done} or more to continue it (or a new --out for a shorter run)")
    try:
        sim.load_state_dict(state)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise CLIError(f"--resume: {exc}") from None


def _save_checkpoint(sim, out: Path) -> None:
    """``sim``: a Simulation, or a ClockedRun (its state holds the simulation's under
    ``"sim"`` and the clock settings under ``"async"``)."""
    tmp = out / f".{CHECKPOINT}.tmp"
    torch.save(sim.state_dict(), tmp)
    os.replace(tmp, out / CHECKPOINT)


# the flags of rounds on a virtual clock (fedopt_kernels.fl.run.clocked): not settings of the
# simulation itself, so they are taken off the arguments before build_settings
ASYNC_FLAGS = {"mode": "mode", "concurrency": "concurrency", "buffer": "buffer", "staleness": "staleness",
               "staleness_exponent": "staleness_a", "deadline": "deadline", "over_select": "over_select"}
CLOCK_FLAGS = {"device_trace": "device_trace", "heterogeneity": "heterogeneity", "availability": "availability"}


def add_async_options(p) -> None:
    g = p.add_argument_group("asynchronous rounds and slow devices (a virtual clock; docs/async.md)")
    s = argparse.SUPPRESS
    g.add_argument("--mode", choices=("sync", "fedbuff"), default=s,
                   help="sync: rounds (on the virtual clock when a clock flag is given); fedbuff: FedBuff's "
                        "buffered asynchronous aggregation, --rounds counting server steps (default sync)")
    g.add_argument("--concurrency", type=int, default=s, metavar="M", help="fedbuff: clients in flight (default 10)")
    g.add_argument("--buffer", type=int, default=s, metavar="K", help="fedbuff: updates per server step (default 5)")
    g.add_argument("--staleness", choices=("constant", "polynomial", "hinge"), default=s,
                   help="fedbuff: the staleness weight s(tau) (default polynomial, (1 + tau)^-a)")
    g.add_argument("--staleness-exponent", type=float, default=s, metavar="A",
                   help="fedbuff: a of (1 + tau)^-a, or the hinge's slope (default 0.5, FedBuff's)")
    g.add_argument("--deadline", type=float, default=s, metavar="SECONDS",
                   help="sync: clients finishing later than this many virtual seconds are dropped")
    g.add_argument("--over-select", type=float, default=s, metavar="F",
                   help="sync: sample F x per-round clients, keep the first per-round to finish")
    g.add_argument("--device-trace", default=s, metavar="PATH",
                   help="per-client device speeds and availability, a CSV (docs/async.md)")
    g.add_argument("--heterogeneity", choices=("none", "mild", "heavy"), default=s,
                   help="device speeds drawn around the medians with this spread (default none)")
    g.add_argument("--availability", type=float, default=s, metavar="FRACTION",
                   help="fraction of each hour a device is online (default 1: always)")


def _async_config(args, saved: Optional[dict] = None):
    """The AsyncConfig the flags ask for (taken off ``args``), or the checkpoint's
    (``saved``) with the flags over it; None when neither asks for one."""
    from ..fl.run.clocked import AsyncConfig, ClockConfig

    given = {ASYNC_FLAGS[k]: vars(args).pop(k) for k in list(ASYNC_FLAGS) if k in vars(args)}
    clock = {CLOCK_FLAGS[k]: vars(args).pop(k) for k in list(CLOCK_FLAGS) if k in vars(args)}
    if saved is None and not given and not clock:
        return None
    base = dict(saved or {})
    base_clock = dict(base.pop("clock", {}) or {})
    base.update(given)
    base_clock.update(clock)
    try:
        return AsyncConfig(**base, clock=ClockConfig(**base_clock))
    except (TypeError, ValueError) as exc:
        raise CLIError(str(exc)) from None


# ---------------------------------------------------------------------------- simulate
def add_simulate_parser(sub) -> None:
    from ._options import add_simulation_options

    p = sub.add_parser("simulate", help="run one federated simulation",
                       description="Run one simulated federated training run and write results.json/.csv and plots.")
    add_simulation_options(p)
    add_async_options(p)
    p.add_argument("--resume", action="store_true",
                   help=f"continue the run saved in <out>/{CHECKPOINT} (its settings, flags may change --rounds)")
    p.add_argument("--checkpoint-every", type=int, default=argparse.SUPPRESS, metavar="K",
                   help=f"also save <out>/{CHECKPOINT} every K rounds (it is always saved at the end and on Ctrl-C, "
                        "SIGTERM or SIGHUP)")
    p.add_argument("--distributed", action="store_true",
                   help="spread each round's clients over the ranks of a torchrun launch (torchrun "
                        "--nproc_per_node=N -m fedopt_kernels simulate --distributed ...); same results as one "
                        "process, rank 0 writes them")
    p.set_defaults(func=run_simulate)


@_with_notices
def run_simulate(args) -> int:
    # a run option, not a setting of the simulation (build_settings would reject it)
    if not vars(args).pop("distributed", False):
        return _run_simulate(args)
    from ..fl.run.distributed_simulation import shutdown

    try:
        code = _run_simulate(args, distributed=True)
    except BaseException:
        shutdown()
        raise
    # every rank gets here on a normal end (an interrupted run returns 130 at a point
    # that differs between ranks, so it does not wait for the others)
    shutdown(barrier=code == 0)
    return code


def _init_distributed(config: SimulationConfig) -> int:
    from ..fl.run.distributed_simulation import init_from_env

    try:
        rank, _ = init_from_env(config.run.device)
    except (RuntimeError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    return rank


def _run_simulate(args, distributed: bool = False) -> int:
    base = None
    state = None
    saved_async = clocked_state = None
    if args.resume:
        out_guess = getattr(args, "out", None)
        if out_guess is None and args.config:
            from ._options import load_toml

            out_guess = load_toml(args.config).get("out")
        ckpt = Path(out_guess or "results") / CHECKPOINT
        state = _load_checkpoint(ckpt)
        if "async" in state:  # a run on the virtual clock: the simulation's state is under "sim"
            saved_async, clocked_state, state = state["async"], state, state["sim"]
        base = dict(state.get("config", {}))
        # a checkpoint from before proxy_source existed drew FedLAW's proxy from the training data
        base.setdefault("proxy_source", "train")
    acfg = _async_config(args, saved_async)
    if acfg is not None and distributed:
        raise CLIError("--distributed does not run rounds on a virtual clock (--mode and the clock flags)")
    config, opts = build_settings(args, base=base)
    checkpoint_every = getattr(args, "checkpoint_every", None) or opts.get("checkpoint_every") or 0
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 0:
        raise CLIError(f"checkpoint-every must be a non-negative integer, got {checkpoint_every!r}")
    rank = _init_distributed(config) if distributed else 0
    main = rank == 0  # in a distributed run only rank 0 prints and writes
    quiet = args.quiet or not main
    out = prepare_out_dir(opts["out"])
    sim = _build_simulation(config, distributed=distributed)
    runner = sim  # what runs the rounds and what a checkpoint saves
    if acfg is not None:
        from ..fl.run.clocked import ClockedRun

        try:
            runner = ClockedRun(sim, acfg)
        except ValueError as exc:
            raise CLIError(str(exc)) from None
    if state is not None:
        _resume_into(runner if clocked_state is not None and acfg is not None else sim,
                     clocked_state if clocked_state is not None and acfg is not None else state,
                     Path(opts["out"]) / CHECKPOINT, done=int(state.get("round", 0)))
    _apply_threads(opts["threads"], sim.numel, sim.batched is not None)
    console = _console(min_width=120)
    if not quiet:
        part = sim.partition.summary()
        console.print(f"[bold]fedopt simulate[/]: {config.server.algo} (nar={config.local.nar}) on {sim.dataset.name}: "
                      f"{config.data.clients} clients ({part['method']}, sizes {part['min']}-{part['max']}), "
                      f"{config.data.per_round}/round, {config.local.steps} local steps, {sim.numel:,} parameters, "
                      f"{sim.results.meta['engine']} engine, backend {sim.results.meta['backend']}, "
                      f"{torch.get_num_threads()} thread(s)")
    if distributed and not quiet:
        console.print(f"distributed over {sim.world_size} ranks: contiguous blocks of each round's clients")
    results = sim.results

    def save(record, s):
        if not main:
            return
        results.write(out)
        if checkpoint_every and record["round"] and record["round"] % checkpoint_every == 0:
            _save_checkpoint(runner, out)

    interrupted = None  # the KeyboardInterrupt / Interrupted that stopped the run
    with stop_on_signals():  # SIGTERM / SIGHUP stop the run as Ctrl-C does
        with _Progress(not quiet) as progress:
            task = progress.add(f"{config.server.algo}", config.run.rounds, sim.round)
            sim.progress = progress.within_round if not quiet else None  # clients trained within a round

            def callback(record, s):
                save(record, s)
                progress.update(task, record)

            try:
                runner.run(callback=callback)
            except KeyboardInterrupt as exc:
                interrupted = exc
        results.meta["interrupted"] = interrupted is not None
        if interrupted is not None:
            results.meta["interrupted_by"] = signal_name(interrupted)
        else:
            results.meta.pop("interrupted_by", None)
        if not main:
            return exit_status(interrupted) if interrupted is not None else 0
        with deferred_interrupts():  # a second signal waits until the results and the checkpoint are written
            files = results.write(out)
            _save_checkpoint(runner, out)
    files.append(out / CHECKPOINT)
    if opts["plots"] and results.records:
        files += results.plot(out)
    print_summary([results], f"{config.server.algo} (nar={config.local.nar}) on {sim.dataset.name}")
    console.print("wrote " + ", ".join(str(f) for f in files))
    if interrupted is not None:
        by = results.meta["interrupted_by"]
        console.print(f"[yellow]interrupted ({by}) after {sim.round} of {config.run.rounds} rounds[/]; the results so "
                      f"far and {CHECKPOINT} are in {out}; continue with: fedopt simulate --resume --out {out}"
                      + (f" --config {args.config}" if args.config else ""))
        return exit_status(interrupted)
    return 0


# ---------------------------------------------------------------------------- compare
def add_compare_parser(sub) -> None:
    from ._options import add_simulation_options

    p = sub.add_parser("compare", help="run several algorithms on the same partition and clients",
                       description="Run several algorithms on the same data partition, client sequence and batches; "
                                   "write one comparison plot and one table.")
    p.add_argument("--algos", default=argparse.SUPPRESS,
                   help="comma-separated runs, each ALGO or ALGO:NAR (e.g. fedavg:grad,fedavg:co,fedexp:co); "
                        "default fedavg,fedprox,scaffold,fedexp")
    add_simulation_options(p, compare=True)
    p.add_argument("--resume", action="store_true",
                   help=f"continue a comparison stopped in <out>: each run from its <out>/<run>/{CHECKPOINT} (a "
                        "finished run is not run again; give the same settings, --rounds may grow)")
    p.set_defaults(func=run_compare)


def parse_runs(text, default_nar: str) -> List[tuple]:
    if isinstance(text, (list, tuple)):
        items = [str(t) for t in text]
    else:
        items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise CLIError(f"--algos needs at least one algorithm (comma-separated ALGO or ALGO:NAR, e.g. "
                       f"fedavg,fedavg:grad), got {text!r}")
    runs = []
    from ..ops import MODES

    for item in items:
        algo, _, nar = item.partition(":")
        nar = nar or default_nar
        if algo not in ALGORITHMS:
            raise CLIError(f"unknown algorithm {algo!r} in --algos; choose from {', '.join(ALGORITHMS)}")
        if nar not in MODES:
            raise CLIError(f"unknown nar mode {nar!r} in --algos entry {item!r}; choose from {', '.join(MODES)}")
        runs.append((item, algo, nar))
    labels = [r[0] for r in runs]
    if len(set(labels)) != len(labels):
        raise CLIError(f"--algos lists a run twice: {', '.join(labels)}")
    return runs


@_with_notices
def run_compare(args) -> int:
    from ..fl.run.simulation import load_config_dataset, make_partition

    config, opts = build_settings(args)
    algos = opts.get("algos")
    if algos is None and config.run.recipe is not None:  # --recipe alone: its own algorithm and local step
        algos = config.server.algo
    if algos is None:  # not given; an empty --algos "" is an error, not the defaults
        algos = "fedavg,fedprox,scaffold,fedexp"
    runs = parse_runs(algos, config.local.nar)
    configs = []
    for label, algo, nar in runs:
        try:
            configs.append((label, config.replace(algo=algo, nar=nar)))
        except ConfigError as exc:
            raise CLIError(f"{label}: {exc}") from None
    out = prepare_out_dir(opts["out"])
    try:
        dataset = load_config_dataset(config)
        partition = make_partition(config, dataset)
    except ConfigError as exc:
        raise CLIError(str(exc)) from None
    console = _console(min_width=120)
    if not args.quiet:
        s = partition.summary()
        console.print(f"[bold]fedopt compare[/]: {', '.join(l for l, _ in configs)} on {dataset.name}: "
                      f"{config.data.clients} clients ({s['method']}, sizes {s['min']}-{s['max']}), "
                      f"{config.data.per_round}/round, {config.run.rounds} rounds, seed {config.run.seed} "
                      "(same partition, clients and batches for every run)")
    done: List[Results] = []
    interrupted = None
    # fedlaw's test-side proxy set is held out of every run's evaluation, so that all
    # runs are scored on the same examples ([FedLAW] appendix D.2: "the remaining data
    # in the testset ... for all compared methods")
    hold_out = any(cfg.needs_proxy for _, cfg in configs)

    def write_all(extra: Optional[Results] = None):
        allres = done + ([extra] if extra is not None else [])
        rows = comparison_rows(allres)
        import json

        write_atomic(out / "compare.json", json.dumps(
            {"config": config.to_dict(), "runs": [r.to_dict() for r in allres], "summary": rows}, indent=1))
        import csv
        import io

        buf = io.StringIO()
        keys = list(rows[0].keys()) if rows else ["label"]
        w = csv.DictWriter(buf, fieldnames=keys, lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else v) for k, v in r.items()})
        write_atomic(out / "compare.csv", buf.getvalue())
        return allres

    current = current_sim = None
    resumed = []
    with _Progress(not args.quiet) as progress:
        try:
            with stop_on_signals():  # SIGTERM / SIGHUP stop the comparison as Ctrl-C does
                for label, cfg in configs:
                    sim = _build_simulation(cfg, dataset=dataset, partition=partition, hold_out_proxy=hold_out)
                    _apply_threads(opts["threads"], sim.numel, sim.batched is not None)
                    run_dir = out / _safe(label)
                    run_dir.mkdir(exist_ok=True)
                    # each run keeps its own checkpoint, so --resume continues the comparison where it stopped
                    if getattr(args, "resume", False) and (run_dir / CHECKPOINT).exists():
                        _resume_into(sim, _load_checkpoint(run_dir / CHECKPOINT), run_dir / CHECKPOINT)
                        resumed.append(f"{label} at round {sim.round}")
                    sim.results.label = label
                    current, current_sim = sim.results, sim
                    task = progress.add(label, cfg.rounds, sim.round)
                    sim.progress = progress.within_round if not args.quiet else None  # clients within a round

                    def callback(record, s, task=task, run_dir=run_dir):
                        s.results.write(run_dir)
                        progress.update(task, record)

                    sim.run(callback=callback)
                    sim.results.meta["interrupted"] = False
                    sim.results.meta.pop("interrupted_by", None)
                    with deferred_interrupts():
                        sim.results.write(run_dir)
                        _save_checkpoint(sim, run_dir)
                    done.append(sim.results)
                    current = current_sim = None
        except KeyboardInterrupt as exc:
            interrupted = exc
    if current_sim is not None:  # the run that was stopped: its rounds so far, to resume from
        with deferred_interrupts():
            _save_checkpoint(current_sim, out / _safe(current.label))
    if current is not None:
        current.meta["interrupted"] = True
        current.meta["interrupted_by"] = signal_name(interrupted)
    if resumed and not args.quiet:
        console.print("resumed from their checkpoints: " + ", ".join(resumed))
    allres = write_all(current)
    files = [out / "compare.json", out / "compare.csv"]
    if opts["plots"] and allres:
        files.append(plot_comparison(allres, out / "compare.png"))
    print_summary(allres, f"compare on {config.data.dataset}: {config.data.clients} clients, "
                          f"{config.data.per_round}/round, alpha {config.data.alpha}, seed {config.run.seed}")
    console.print("wrote " + ", ".join(str(f) for f in files) + f" (and each run's results in {out}/<run>/)")
    if interrupted is not None:
        by = signal_name(interrupted)
        console.print(f"[yellow]interrupted ({by})[/]: {len(done)} of {len(configs)} runs finished; results so far "
                      f"in {out}; continue with: {_compare_resume_command(args, out)}")
        return exit_status(interrupted)
    return 0


def _compare_resume_command(args, out: Path) -> str:
    """The command that continues a stopped comparison: the same one with --resume."""
    argv = [a for a in sys.argv[1:] if a != "--resume"] if sys.argv[1:2] == ["compare"] else None
    if not argv:
        return f"fedopt compare --resume --out {out} (with the same settings)"
    import shlex

    return "fedopt " + " ".join(shlex.quote(a) for a in argv) + " --resume"


def _safe(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label)
