"""Rounds on the virtual clock (issue 44): synchronous rounds that equal the plain run
when the clock changes nothing, FedBuff against a hand-written loop over its timeline,
resume between two arrivals in the middle of a buffer, and settings refused."""

import io

import pytest
import torch

from fedopt_kernels.fl import Simulation, SimulationConfig
from fedopt_kernels.fl.run.clocked import AsyncConfig, ClockConfig, ClockedRun
from fedopt_kernels.server.fedbuff import staleness_weight

BASE = dict(dataset="digits", clients=10, per_round=4, rounds=3, local_steps=2, batch_size=8, algo="fedavg",
            weighting="uniform", seed=2, engine="sequential", hidden=(16, 16))


def _cfg(**kw):
    return SimulationConfig(**{**BASE, **kw})


def _strip(records):
    return [{k: v for k, v in r.items() if k not in ("wall_time", "virtual_time", "round_virtual_s", "sampled")
             and not k.startswith("excluded_")} for r in records]


def test_sync_rounds_without_deadline_or_over_selection_are_the_plain_run():
    plain = Simulation(_cfg())
    plain.run()
    sim = Simulation(_cfg())
    run = ClockedRun(sim, AsyncConfig(clock=ClockConfig(heterogeneity="heavy")))
    run.run()
    assert torch.equal(plain.x_global, sim.x_global)
    assert _strip(plain.results.records) == _strip(sim.results.records)
    assert sim.results.records[-1]["virtual_time"] > 0


def test_a_deadline_keeps_only_the_clients_that_made_it():
    sim = Simulation(_cfg())
    run = ClockedRun(sim, AsyncConfig(deadline=4.0, over_select=1.5,
                                      clock=ClockConfig(heterogeneity="heavy", comm_s=2.0)))
    run.run()
    for rec in sim.results.records[1:]:
        sampled, kept = rec["sampled"], rec["clients"]
        assert len(sampled) == 6 and set(kept) <= set(sampled) and len(kept) <= 4
        finished = [c for c in sampled if run.clock.train_time(c, 2, 8) <= 4.0]
        assert set(kept) <= set(finished)
        assert rec["excluded_deadline"] == len(sampled) - len(finished)
        assert rec["excluded_deadline"] + rec["excluded_over_selected"] == len(sampled) - len(kept)
        assert rec["round_virtual_s"] <= 4.0


def test_fedbuff_is_the_hand_written_loop_over_its_timeline():
    """Oracle: keep every global version; each arrival's update is trained by a second,
    plain simulator from the version it pulled (as round version + 1), scaled by
    (1 + tau)^-1/2; FedAvg (lr 1) steps on their mean."""
    acfg = AsyncConfig(mode="fedbuff", concurrency=5, buffer=3, clock=ClockConfig(heterogeneity="mild"))
    sim = Simulation(_cfg())
    run = ClockedRun(sim, acfg)
    run.run()
    ref = Simulation(_cfg())
    versions = [ref.x_global.clone()]
    for k, arrivals in enumerate(run.schedule.steps):
        rows = []
        for a in arrivals:
            ref.x_global.copy_(versions[a.version])
            ref._train_clients(a.version + 1, [a.client])
            rows.append(ref.updates[0].double() * staleness_weight(k - a.version, "polynomial", a=0.5))
        versions.append(versions[-1].double() - torch.stack(rows).mean(0))
        versions[-1] = versions[-1].float()
        torch.testing.assert_close(run.sim.results.records[k + 1]["staleness_mean"],
                                   sum(k - a.version for a in arrivals) / len(arrivals))
    torch.testing.assert_close(sim.x_global, versions[-1], rtol=0, atol=2e-6)
    assert any(k - a.version > 0 for k, s in enumerate(run.schedule.steps) for a in s)  # staleness happened


def test_resume_between_two_arrivals_inside_a_buffer_is_bit_identical():
    acfg = AsyncConfig(mode="fedbuff", concurrency=5, buffer=3, staleness="hinge", staleness_b=0,
                       clock=ClockConfig(heterogeneity="heavy"))
    whole = Simulation(_cfg())
    ClockedRun(whole, acfg).run()
    for stop in (1, 4):  # inside the first buffer, inside the second
        first = Simulation(_cfg())
        r1 = ClockedRun(first, acfg)
        r1.run(stop_after=stop)
        assert r1.buffer.filled == stop % 3
        blob = io.BytesIO()
        torch.save(r1.state_dict(), blob)
        blob.seek(0)
        resumed = Simulation(_cfg())
        r2 = ClockedRun(resumed, acfg)
        r2.load_state_dict(torch.load(blob, weights_only=True))
        r2.run()
        assert torch.equal(resumed.x_global, whole.x_global)
        assert _strip(resumed.results.records) == _strip(whole.results.records)


@pytest.mark.parametrize("kw, acfg, match", [
    (dict(algo="fedlaw", weighting="auto"), dict(mode="fedbuff"), "FedLAW"),
    (dict(algo="scaffold"), dict(mode="fedbuff"), "SCAFFOLD"),
    ({}, dict(mode="fedbuff", concurrency=20), "concurrency"),
])
def test_settings_fedbuff_cannot_run_are_refused_before_anything_runs(kw, acfg, match):
    sim = Simulation(_cfg(**kw))
    before = sim.x_global.clone()
    with pytest.raises(ValueError, match=match):
        ClockedRun(sim, AsyncConfig(**acfg))
    assert torch.equal(sim.x_global, before) and sim.round == 0


@pytest.mark.parametrize("kw, match", [(dict(mode="async"), "mode"), (dict(over_select=0.5), "over_select"),
                                       (dict(buffer=0), "buffer"), (dict(staleness="exp"), "staleness"),
                                       (dict(deadline=-1.0), "deadline")])
def test_bad_async_settings_name_the_setting(kw, match):
    with pytest.raises(ValueError, match=match):
        AsyncConfig(**kw)


def test_the_command_line_runs_fedbuff_and_resumes_it_bit_for_bit(tmp_path, capsys):
    from fedopt_kernels.cli import main

    flags = ["--mode", "fedbuff", "--concurrency", "5", "--buffer", "3", "--heterogeneity", "heavy",
             "--clients", "10", "--per-round", "4", "--local-steps", "2", "--batch-size", "8", "--hidden", "16,16",
             "--weighting", "uniform", "--seed", "2", "--no-plots", "--quiet"]
    assert main(["simulate", *flags, "--rounds", "3", "--out", str(tmp_path / "whole")]) == 0
    assert main(["simulate", *flags, "--rounds", "2", "--out", str(tmp_path / "part")]) == 0
    # the checkpoint carries the clock settings: --resume needs no clock flag again
    assert main(["simulate", "--resume", "--rounds", "3", "--quiet", "--no-plots", "--out", str(tmp_path / "part")]) == 0
    a = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=True)
    b = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=True)
    assert a["async"]["mode"] == "fedbuff" and torch.equal(a["sim"]["x_global"], b["sim"]["x_global"])
    import json

    rec = json.loads((tmp_path / "whole" / "results.json").read_text())["records"]
    assert [r["round"] for r in rec] == [0, 1, 2, 3] and all("staleness_mean" in r for r in rec[1:])
    assert main(["simulate", "--mode", "fedbuff", "--concurrency", "50", "--out", str(tmp_path / "bad")]) == 2
    assert "concurrency (50) exceeds" in capsys.readouterr().err
