"""Progress within a round (issue 32): the simulator reports the clients trained so far
-- after each client (sequential engine), group (batched) and chunk (memory budget) --
without changing a bit of the run, and ``fedopt simulate`` shows it as a second bar once
a round runs long (never with --quiet)."""

import io
import re

import pytest
import torch

from fedopt_kernels.cli import main
from fedopt_kernels.cli.simulate import _Progress
from fedopt_kernels.fl import Simulation, SimulationConfig
from _asserts import bits

BASE = dict(dataset="synthetic-lazy", clients=200, per_round=9, rounds=2, local_steps=2, hidden=(16,),
            max_samples_per_client=50, seed=1)


def _run(**kw):
    sim = Simulation(SimulationConfig(**dict(BASE, **kw)))
    calls = []
    sim.progress = lambda r, done, total: calls.append((r, done, total))
    sim.run()
    return sim, calls


def _per_round(calls, r):
    assert all(total == 9 for rr, _, total in calls if rr == r)
    return [done for rr, done, _ in calls if rr == r]


@pytest.mark.parametrize("kw,chunk,want", [
    (dict(engine="sequential"), None, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]),  # each client (the last: the round's end)
    (dict(engine="batched", client_batch=4), None, [0, 4, 8, 9, 9]),  # each group of <= 4, then the end
    (dict(engine="sequential", memory_budget="42K"), 2, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]),  # chunk ends: clients' own
    # chunks of 2, each one group: reported by the group, then by the chunk
    (dict(engine="batched", memory_budget="100K", client_batch=2), 2, [0, 2, 2, 4, 4, 6, 6, 8, 8, 9, 9]),
], ids=["sequential", "batched", "chunked-sequential", "chunked-batched"])
def test_progress_counts_the_round_clients_and_changes_no_bit(kw, chunk, want):
    sim, calls = _run(**kw)
    assert sim._chunk == chunk
    quiet = Simulation(SimulationConfig(**dict(BASE, **kw)))
    quiet.run()
    assert torch.equal(bits(sim.x_global), bits(quiet.x_global))
    assert sorted({r for r, _, _ in calls}) == [1, 2]
    for r in (1, 2):
        assert _per_round(calls, r) == want


def test_progress_counts_clients_left_out():
    """A client whose training raises is done too (the count reaches the round's size)."""
    sim = Simulation(SimulationConfig(**dict(BASE, engine="sequential")))
    real = sim.trainer.train

    def flaky(*args, client=None, **kwargs):
        if client == sim.sample_clients(1)[3]:
            raise RuntimeError("broken client")
        return real(*args, client=client, **kwargs)

    sim.trainer.train = flaky
    calls = []
    sim.progress = lambda r, done, total: calls.append(done)
    sim.run_round()
    assert calls == list(range(10)) and sim.results.records[-1]["excluded_error"] == 1


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _bar(clock, enabled=True):
    out = io.StringIO()
    from rich.console import Console

    return _Progress(enabled, clock=clock, console=Console(file=out, width=120, force_terminal=False)), out


def test_clients_bar_appears_once_a_round_runs_long():
    clock = _Clock()
    bar, out = _bar(clock)
    with bar:
        bar.within_round(1, 0, 100)
        clock.t = bar.LONG_ROUND_S / 2
        bar.within_round(1, 40, 100)
        assert bar._clients_task is None  # a short while in: no second bar
        clock.t = bar.LONG_ROUND_S * 0.99
        bar.within_round(1, 100, 100)
        assert bar._clients_task is None  # the round ended before it was long
        bar.within_round(2, 0, 100)  # round 2 starts at 0.99 LONG_ROUND_S
        clock.t = bar.LONG_ROUND_S * 1.5
        bar.within_round(2, 30, 100)
        assert bar._clients_task is None  # round 2 has run 0.51 LONG_ROUND_S
        clock.t = bar.LONG_ROUND_S * 2
        bar.within_round(2, 60, 100)
        task = bar.progress.tasks[bar._clients_task]
        assert (task.description, task.completed, task.total) == ("clients", 60, 100)
        bar.within_round(3, 0, 50)  # from now on it follows every round
        task = bar.progress.tasks[bar._clients_task]
        assert (task.completed, task.total, task.fields["status"]) == (0, 50, "round 3")
    assert "clients" in out.getvalue()


def test_quiet_shows_no_bar():
    clock = _Clock()
    bar, out = _bar(clock, enabled=False)
    with bar:
        bar.within_round(1, 0, 100)
        clock.t = 1e9
        bar.within_round(1, 50, 100)
    assert bar.progress is None and out.getvalue() == ""


@pytest.mark.parametrize("quiet,long_round_s,shown", [(False, 0.0, True), (False, 1e9, False), (True, 0.0, False)],
                         ids=["long-rounds", "short-rounds", "quiet"])
def test_simulate_shows_the_clients_bar_without_a_budget(tmp_path, capsys, monkeypatch, quiet, long_round_s, shown):
    monkeypatch.setattr(_Progress, "LONG_ROUND_S", long_round_s)  # 0: every round is "long"
    argv = ["simulate", "--dataset", "synthetic-lazy", "--clients", "200", "--per-round", "9", "--rounds", "2",
            "--local-steps", "2", "--engine", "sequential", "--out", str(tmp_path / "o")]
    assert main(argv + (["--quiet"] if quiet else [])) == 0
    printed = capsys.readouterr().out
    assert bool(re.search(r"^\s*clients\s.*9/9\s+round 2", printed, re.M)) == shown  # the bar's last state
    assert bool(re.search(r"^\s*fedavg\s.*2/2", printed, re.M)) != quiet  # the rounds bar
