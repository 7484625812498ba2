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


@pytest.mark.parametrize("het, kw", [
    # per-row lrs and weight decays of rows at different rounds, FedProx against each row's own start
    ("heavy", dict(engine="batched", lr_decay=0.9, weight_decay=0.01, wd_decay=0.8, momentum=0.5, prox_mu=0.1)),
    ("none", dict(engine="batched", lr_decay=0.9, decay_per="epoch", decay_beta=0.5)),  # FedDecay per epoch
    ("mild", dict(engine="sequential", lr_decay=0.9)),
])
def test_clients_of_different_versions_train_as_one_group_with_their_own_bits(het, kw, monkeypatch):
    """Oracle: the per-version grouping (each group one version's clients, from the
    current model, as a plain round of that version).  Grouping everyone in flight --
    each row from the version its client pulled, annealed as that version's round --
    gives the same model bit for bit, and did put versions together."""
    from fedopt_kernels.fl.run.round_training import RoundTraining

    acfg = AsyncConfig(mode="fedbuff", concurrency=6, buffer=3, clock=ClockConfig(heterogeneity=het))
    mixed = []
    train = RoundTraining.train_clients

    def spy(self, round_number, clients, **kw):
        if kw.get("round_numbers"):
            mixed.append(len(set(kw["round_numbers"])))
        return train(self, round_number, clients, **kw)

    monkeypatch.setattr(RoundTraining, "train_clients", spy)
    models = {}
    for grouping in ("version", "in_flight"):
        sim = Simulation(_cfg(rounds=6, local_steps=3, **kw))
        run = ClockedRun(sim, acfg, grouping=grouping)
        run.run()
        models[grouping] = sim.x_global
        assert [r["staleness_mean"] for r in sim.results.records[1:]] == [
            sum(k - a.version for a in s) / len(s) for k, s in enumerate(run.schedule.steps)]
    assert torch.equal(models["in_flight"], models["version"])
    assert max(mixed) >= 2  # some group held clients of two versions
    # past models are kept for the clients still in flight after the last step alone
    sched = run.schedule
    arrived = {(a.client, a.version) for s in sched.steps for a in s}
    in_flight = {(c, v) for v, cs in sched.pulled.items() for c in cs} - arrived - {(c, v) for c, v, _ in sched.dropped}
    assert set(run.versions) == {v for _, v in in_flight if v < len(sched.steps)}


def test_resume_with_clients_of_a_past_version_still_untrained_is_bit_identical():
    acfg = AsyncConfig(mode="fedbuff", concurrency=6, buffer=2, clock=ClockConfig(heterogeneity="none"))
    whole = Simulation(_cfg(rounds=6, engine="batched"))
    ClockedRun(whole, acfg, grouping="in_flight").run()
    first = Simulation(_cfg(rounds=6, engine="batched"))
    r1 = ClockedRun(first, acfg, grouping="in_flight")
    stop = next(i for i in range(1, 12) if (r1.run(stop_after=1) or True) and r1.versions)
    assert r1.versions and stop  # a past model is held for clients that pulled it
    blob = io.BytesIO()
    torch.save(r1.state_dict(), blob)
    blob.seek(0)
    resumed = Simulation(_cfg(rounds=6, engine="batched"))
    r2 = ClockedRun(resumed, acfg, grouping="in_flight")
    r2.load_state_dict(torch.load(blob, weights_only=True))
    r2.run()
    assert torch.equal(resumed.x_global, whole.x_global)
    assert _strip(resumed.results.records) == _strip(whole.results.records)


def test_an_unknown_grouping_is_refused():
    with pytest.raises(ValueError, match="grouping"):
        ClockedRun(Simulation(_cfg()), AsyncConfig(mode="fedbuff", concurrency=5), grouping="round")
