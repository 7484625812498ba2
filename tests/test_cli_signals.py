"""Issue 33, item 1: SIGTERM and SIGHUP stop ``fedopt simulate`` as Ctrl-C does.

A real signal to a real process: ``python -m fedopt_kernels simulate`` runs in a child
whose SIGINT is ignored (as under CI, or a shell's background job -- the test must not
depend on Ctrl-C); once ``results.json`` shows a finished round the child gets SIGTERM
(or SIGHUP).  It must exit with 128 + the signal, leave ``checkpoint.pt``, say
``interrupted`` in results.json and on screen with the way to resume, and ``--resume``
must then end with exactly the model and records of a run never interrupted.

The model sleeps in its forward so that a round lasts ~0.3 s and the signal lands in
the middle of the run whatever the machine's load.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 6

SLOW_MODEL = '''
import time
import torch
from torch import nn


class Slow(nn.Module):
    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.fc = nn.Linear(int(torch.tensor(input_shape).prod()), num_classes)

    def forward(self, x):
        time.sleep(0.02)
        return self.fc(x.flatten(1))


def make(input_shape, num_classes):
    return Slow(input_shape, num_classes)
'''

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")


def _args(out: Path, *extra):
    return [sys.executable, "-m", "fedopt_kernels", "simulate", "--dataset", "digits", "--model", "slowmodel:make",
            "--clients", "6", "--per-round", "3", "--rounds", str(ROUNDS), "--local-steps", "3",
            "--engine", "sequential", "--algo", "scaffold", "--threads", "1", "--no-plots", "--quiet",
            "--out", str(out), *extra]


def _env(tmp_path: Path) -> dict:
    (tmp_path / "slowmodel.py").write_text(SLOW_MODEL)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _ignore_sigint():
    """The child as a CI runner or a background job starts it: SIGINT ignored; SIGTERM
    and SIGHUP at their defaults even if this test process runs under nohup."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _rounds_done(out: Path) -> int:
    try:
        return max(r["round"] for r in json.loads((out / "results.json").read_text())["records"])
    except (OSError, ValueError, KeyError):
        return -1


def _final(out: Path):
    data = json.loads((out / "results.json").read_text())
    records = [{k: v for k, v in r.items() if k != "wall_time"} for r in data["records"]]
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    return data, records, state


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    out = tmp / "run"
    done = subprocess.run(_args(out), env=_env(tmp), cwd=tmp, capture_output=True, text=True, timeout=600,
                          preexec_fn=_ignore_sigint)
    assert done.returncode == 0, done.stderr
    return _final(out)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signal_stops_the_run_with_a_checkpoint_and_resume_is_exact(sig, reference, tmp_path):
    env = _env(tmp_path)
    out = tmp_path / "run"
    child = subprocess.Popen(_args(out), env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, preexec_fn=_ignore_sigint)
    try:
        deadline = time.monotonic() + 300
        while _rounds_done(out) < 1:
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the run never finished a round"
            time.sleep(0.02)
        child.send_signal(sig)
        stdout, stderr = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    name = signal.Signals(sig).name
    assert child.returncode == 128 + sig, (child.returncode, stdout, stderr)
    assert (out / "checkpoint.pt").is_file()
    data = json.loads((out / "results.json").read_text())
    stopped_at = max(r["round"] for r in data["records"])
    assert 1 <= stopped_at < ROUNDS, "the signal must land mid-run"
    assert data["meta"]["interrupted"] is True and data["meta"]["interrupted_by"] == name
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["round"] == stopped_at  # the round in flight was abandoned, every finished one kept
    assert f"interrupted ({name}) after {stopped_at} of {ROUNDS} rounds" in " ".join(stdout.split())
    assert "--resume" in stdout
    # the records so far are the uninterrupted run's
    ref_data, ref_records, ref_state = reference
    assert [{k: v for k, v in r.items() if k != "wall_time"} for r in data["records"]] == ref_records[:stopped_at + 1]

    resumed = subprocess.run(_args(out, "--resume"), env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=600, preexec_fn=_ignore_sigint)
    assert resumed.returncode == 0, resumed.stderr
    got_data, got_records, got_state = _final(out)
    assert got_records == ref_records
    assert got_data["meta"]["interrupted"] is False and "interrupted_by" not in got_data["meta"]
    assert torch.equal(got_state["x_global"], ref_state["x_global"])  # bit for bit
    for key in ("c", "clients", "controls"):  # SCAFFOLD's control variates: the abandoned round left no trace
        assert torch.equal(got_state["scaffold"][key], ref_state["scaffold"][key]), key


def test_handlers_are_restored_after_an_in_process_run(tmp_path):
    """The library leaves no handler behind: fedopt's main() run in this process
    restores SIGTERM's and SIGHUP's handlers (and SIGINT's)."""
    from fedopt_kernels.cli import main

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    threads = torch.get_num_threads()
    try:
        code = main(["simulate", "--dataset", "digits", "--hidden", "8", "--clients", "4", "--per-round", "2",
                     "--rounds", "1", "--local-steps", "1", "--no-plots", "--quiet", "--threads", "1",
                     "--out", str(tmp_path / "run")])
    finally:
        torch.set_num_threads(threads)  # --threads sets the process's; later tests' bits may depend on it
    assert code == 0
    assert {s: signal.getsignal(s) for s in before} == before


def test_stop_on_signals_raises_interrupted_and_restores():
    from fedopt_kernels.fl.run.interrupts import Interrupted, exit_status, stop_on_signals

    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as info:
        with stop_on_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler runs at the next bytecode; never reached
    assert info.value.signum == signal.SIGTERM and exit_status(info.value) == 143
    assert isinstance(info.value, KeyboardInterrupt)
    assert signal.getsignal(signal.SIGTERM) == previous


def test_a_signal_during_the_commit_waits_for_it():
    """deferred_interrupts holds SIGTERM back until the block ends, then delivers it."""
    from fedopt_kernels.fl.run.interrupts import Interrupted, deferred_interrupts, stop_on_signals

    finished = []
    with pytest.raises(Interrupted):
        with stop_on_signals():
            with deferred_interrupts():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                finished.append(True)
    assert finished == [True]


def test_a_signal_started_ignored_stays_ignored():
    """nohup starts a process with SIGHUP ignored: stop_on_signals leaves it so."""
    from fedopt_kernels.fl.run.interrupts import stop_on_signals

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with stop_on_signals():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL)
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_sigterm_stops_compare_with_the_runs_so_far(tmp_path):
    """fedopt compare: SIGTERM during the second run leaves compare.json with the first
    run finished and the second marked interrupted, exit status 143."""
    env = _env(tmp_path)
    out = tmp_path / "cmp"
    args = [sys.executable, "-m", "fedopt_kernels", "compare", "--dataset", "digits", "--model", "slowmodel:make",
            "--clients", "6", "--per-round", "3", "--rounds", "3", "--local-steps", "3", "--engine", "sequential",
            "--algos", "fedavg,fedprox", "--threads", "1", "--no-plots", "--quiet", "--out", str(out)]
    child = subprocess.Popen(args, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=_ignore_sigint)
    try:
        deadline = time.monotonic() + 300
        while _rounds_done(out / "fedprox") < 1:
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the second run never finished a round"
            time.sleep(0.02)
        child.send_signal(signal.SIGTERM)
        stdout, stderr = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 143, (stdout, stderr)
    runs = json.loads((out / "compare.json").read_text())["runs"]
    assert [r["label"] for r in runs] == ["fedavg", "fedprox"]
    assert runs[0]["meta"].get("interrupted", False) is False
    assert runs[1]["meta"]["interrupted"] is True and runs[1]["meta"]["interrupted_by"] == "SIGTERM"
    assert max(r["round"] for r in runs[1]["records"]) < 3
    assert "interrupted (SIGTERM): 1 of 2 runs finished" in " ".join(stdout.split())
