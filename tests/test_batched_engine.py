"""The batched client engine (fl/engine/batched.py) against the sequential engine (the oracle).

Tolerance.  Both engines draw the same clients and the same batches and add the same
FedProx/SCAFFOLD terms; what differs is the arithmetic inside the model: under
``vmap`` a client's matrix products become batched GEMMs (convolutions grouped ones),
the loss is a weighted sum instead of a mean, and with padding a GEMM's inner
dimension carries extra zero terms -- each a different fp32 reduction order.  Those
~1e-7 relative differences per step compound through training, so after a few rounds
the global models agree to about 1e-7 (MLP) or 1e-6 (CNN) relative here.  The
assertion is ``||x_batched - x_seq|| <= 1e-5 ||x_seq||`` and every element within
``atol=1e-5`` (+ ``rtol=1e-4``): 10-100x above the observed rounding, far below any
real error (a wrong batch, lr or correction moves the model by > 1e-2).

Grouped (``client_batch``) runs must be BITWISE equal to one group on CPU: a row's
arithmetic depends only on its client, and a lone client is computed beside a copy of
itself (a batch-1 GEMM would take another BLAS path).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from fedopt_kernels.fl import ALGORITHMS, Simulation, SimulationConfig
from fedopt_kernels.fl.engine import batched as B
from fedopt_kernels.fl.engine import round_plan as P
from fedopt_kernels.fl.engine.client import LocalConfig, LocalTrainer
from fedopt_kernels.fl.engine.graph_passes import GRADIENT_BUFFER

# 30 clients of digits with Dirichlet(0.3): several hold fewer than 32 samples, so the
# padded/masked batches are exercised in every test.
SMALL = dict(dataset="digits", hidden=(32,), clients=30, per_round=6, rounds=3, local_steps=8, batch_size=32,
             lr=0.05, weight_decay=1e-3, max_norm=1.0)
RTOL_NORM = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


def _sim(module=None, loss_fn=None, **kw):
    return Simulation(SimulationConfig(**{**SMALL, **kw}), model=module, loss_fn=loss_fn)


def _run(module=None, loss_fn=None, **kw):
    sim = _sim(module, loss_fn, **kw)
    sim.run()
    return sim


def assert_close_models(a, b, rtol_norm=RTOL_NORM):
    rel = float((a - b).norm() / a.norm())
    assert rel <= rtol_norm, rel
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def assert_same_records(seq, bat, *, exact_clips=True):
    for rs, rb in zip(seq.results.records[1:], bat.results.records[1:]):
        assert rs["clients"] == rb["clients"]
        assert rs["local_steps_total"] == rb["local_steps_total"]
        assert rb["train_loss"] == pytest.approx(rs["train_loss"], rel=1e-5)
        assert rb["test_accuracy"] == pytest.approx(rs["test_accuracy"], abs=2.5e-3)  # one test image at most
        if exact_clips:
            assert rb["clipped_steps"] == rs["clipped_steps"] and rb["skipped_steps"] == rs["skipped_steps"]


def test_small_clients_are_padded_in_these_tests():
    sim = _sim()
    assert min(sim.partition.sizes) < SMALL["batch_size"] < max(sim.partition.sizes)


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_engines_agree_for_every_algorithm(algo):
    kw = dict(algo=algo)
    if algo == "fedlaw":
        kw.update(fedlaw_epochs=3)
    seq = _run(engine="sequential", **kw)
    bat = _run(engine="batched", **kw)
    assert seq.results.meta["engine"] == "sequential" and bat.results.meta["engine"] == "batched"
    assert not torch.equal(seq.x_global, _sim(**kw).x_global)  # it trained
    assert_close_models(seq.x_global, bat.x_global)
    assert_same_records(seq, bat)
    if algo == "scaffold":
        assert_close_models(seq.scaffold.c_clients, bat.scaffold.c_clients, rtol_norm=1e-4)


@pytest.mark.parametrize("extra", [
    dict(nar="grad", momentum=0.9),
    dict(nar="none", decay_beta=0.7, decay_per="epoch", algo="scaffold"),  # per-row lrs (epochs differ by client)
    dict(decay_beta=0.8, decay_kind="linear", lr_decay=0.9, wd_decay=0.5, algo="fedprox", prox_mu=0.1),
    dict(batch_size=64, per_round=9),  # most clients padded
], ids=["grad-momentum", "feddecay-epochs-scaffold", "feddecay-linear-fedprox", "batch64"])
def test_engines_agree_for_local_options(extra):
    seq = _run(engine="sequential", **extra)
    bat = _run(engine="batched", **extra)
    assert_close_models(seq.x_global, bat.x_global)
    assert_same_records(seq, bat)


def test_engines_agree_for_the_cnn():
    kw = dict(model="cnn", rounds=2, local_steps=5, per_round=4)
    seq = _run(engine="sequential", **kw)
    bat = _run(engine="batched", **kw)
    assert bat.results.meta["engine"] == "batched"
    assert_close_models(seq.x_global, bat.x_global)
    assert_same_records(seq, bat, exact_clips=False)


@pytest.mark.parametrize("kw", [
    dict(algo="scaffold", momentum=0.5, per_round=7),
    dict(algo="fedprox", decay_per="epoch", decay_beta=0.5, per_round=7),
    dict(model="cnn", rounds=2, local_steps=4, per_round=5),
], ids=["mlp-scaffold", "mlp-fedprox-epochs", "cnn"])
@pytest.mark.parametrize("client_batch", [1, 2, 3])
def test_groups_are_bitwise_equal_to_one_group(kw, client_batch):
    one = _run(engine="batched", **kw)
    grouped = _run(engine="batched", client_batch=client_batch, **kw)
    assert one.results.meta["client_batch_used"] == kw["per_round"]
    assert grouped.results.meta["client_batch_used"] == client_batch
    assert torch.equal(one.x_global, grouped.x_global)
    strip = lambda recs: [{k: v for k, v in r.items() if k != "wall_time"} for r in recs]  # noqa: E731
    assert strip(one.results.records) == strip(grouped.results.records)
    if one.scaffold is not None:
        assert torch.equal(one.scaffold.c, grouped.scaffold.c)


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_a_clients_update_does_not_depend_on_its_place_in_the_round(model):
    """Client i's update is the same bits wherever the round puts it: first or last,
    beside other clients, in a group of another size, with the round's update rows
    anywhere in memory.  Its rows of the engine's buffers then lie at other offsets;
    MKL's skinny products (a classifier of 10 outputs, a client of 1-3 samples) follow
    their operands' alignment, which ragged_bmm neutralises (this test failed before it
    did; test_ragged_bmm's placement test is the kernel-level twin)."""
    sim = _sim(model=model, clients=100, per_round=7, local_steps=3)
    trainer = sim.batched
    sizes = sim.partition.sizes
    small = sorted(range(len(sizes)), key=lambda c: sizes[c])
    chosen = small[:4] + small[-3:]  # the smallest clients (1-3 samples here) and large ones
    assert min(sizes[c] for c in chosen) <= 3

    def updates(order, offset=0):  # the round's update rows `offset` elements into a buffer
        out = torch.empty(len(order) * sim.numel + offset)[offset:].view(len(order), sim.numel)
        trainer.train_round(sim.x_global, [sim.partition.client_indices[c] for c in order], round_index=0,
                            seeds=[1000 + c for c in order], out=out, stats=B.RoundStats(sim.device))
        return {c: out[j].clone() for j, c in enumerate(order)}

    reference = updates(chosen)
    for offset, order in enumerate((chosen, chosen[::-1], chosen[3:] + chosen[:3], chosen[1::2], chosen[::3],
                                    chosen[:2], chosen[:4], chosen[2:6])):
        got = updates(order, offset * 5)
        for c in order:
            assert torch.equal(got[c], reference[c]), (c, sizes[c], order, offset)


def test_automatic_group_size_follows_the_free_memory(monkeypatch):
    sim = _sim(engine="batched")
    per_client = sim.batched.planner.client_bytes(32)
    assert per_client > 4 * 6 * sim.numel
    monkeypatch.setattr(P, "available_memory", lambda device: 2 * 3.5 * per_client)  # half of it: 3.5 clients
    assert sim.batched.planner.group_size(6, 32) == 3
    sim.run()
    assert sim.results.meta["client_batch_used"] == 3
    monkeypatch.undo()
    whole = _run(engine="batched")
    assert torch.equal(whole.x_global, sim.x_global)
    assert P.available_memory(torch.device("cpu")) > 0


def _bn_model():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))


class DataDependent(nn.Module):
    """Python control flow on tensor values: vmap cannot batch it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 10), nn.Linear(64, 10)

    def forward(self, x):
        x = x.flatten(1)
        return self.a(x) if float(x.sum()) > 0 else self.b(x)


@pytest.mark.parametrize("make, when", [(_bn_model, "BatchNorm1d"), (DataDependent, "first round")])
def test_unbatchable_models_fall_back_to_sequential(make, when):
    seq = _run(module=make, engine="sequential")
    with pytest.warns(B.EngineFallbackWarning, match="using the sequential engine") as record:
        bat = _run(module=make, engine="batched")
    assert len(record) == 1 and "\n" not in str(record[0].message)
    assert bat.results.meta["engine"] == "sequential"
    if when == "BatchNorm1d":
        assert "BatchNorm1d" in bat.results.meta["engine_fallback"]
    assert torch.equal(seq.x_global, bat.x_global)
    strip = lambda recs: [{k: v for k, v in r.items() if k != "wall_time"} for r in recs]  # noqa: E731
    assert strip(seq.results.records) == strip(bat.results.records)


def test_auto_engine():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _sim().results.meta["engine"] == "batched"
        assert SimulationConfig().engine == "auto"
        assert _sim(per_round=1).results.meta["engine"] == "sequential"
    with pytest.warns(B.EngineFallbackWarning):
        assert _sim(module=_bn_model).results.meta["engine"] == "sequential"


def test_masked_and_grouped_losses():
    """An NLL loss is masked per sample; a loss the engine cannot see into is called as
    given, the clients grouped by batch size."""
    def make():
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10), nn.LogSoftmax(-1))

    for loss_fn, mode in [(nn.NLLLoss(), "masked"), (lambda out, y: nn.functional.nll_loss(out, y), "plain")]:
        seq = _run(module=make, loss_fn=loss_fn, engine="sequential")
        bat = _sim(module=make, loss_fn=loss_fn, engine="batched")
        modes = {g.mode for g in bat.batched.planner.plan(bat.partition.sizes)}
        assert mode in modes and modes <= {mode, "plain"}
        bat.run()
        assert_close_models(seq.x_global, bat.x_global)
        assert_same_records(seq, bat)
        grouped = _run(module=make, loss_fn=loss_fn, engine="batched", client_batch=2)
        assert torch.equal(grouped.x_global, bat.x_global)


def test_label_smoothing_and_frozen_parameters():
    def make():
        m = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        m[1].bias.requires_grad_(False)
        return m

    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    seq = _run(module=make, loss_fn=loss_fn, engine="sequential")
    bat = _run(module=make, loss_fn=loss_fn, engine="batched")
    assert_close_models(seq.x_global, bat.x_global)
    assert_same_records(seq, bat)


@pytest.mark.parametrize("algo", ["fedavg", "fedprox", "scaffold"])
def test_traced_graphs_write_gradients_into_the_buffer_frozen_parameters_included(algo):
    """The traced graph writes each gradient into its part of the group's buffer G
    (graph_passes.gradients_into_buffer; the frozen parameters' parts are zeroed every
    step, as FedProx and SCAFFOLD add their terms to all of G): the same bits as the
    transforms run eagerly, whose gradients are concatenated into G every step."""
    def make():
        m = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        m[1].bias.requires_grad_(False)
        return m

    traced, eager = _sim(module=make, engine="batched", algo=algo), _sim(module=make, engine="batched", algo=algo)
    traced.batched.ragged = False
    eager.batched.trace = False
    traced.run()
    eager.run()
    graphs = list(traced.batched._traced.values())
    assert graphs and all(isinstance(getattr(gm, GRADIENT_BUFFER), torch.Tensor) for gm in graphs)
    assert torch.equal(traced.x_global, eager.x_global)


def test_client_batches_are_the_sequential_batches():
    x, y = torch.randn(100, 3), torch.randint(0, 2, (100,))
    for n, bs, steps in [(7, 32, 5), (32, 32, 3), (45, 32, 4), (100, 8, 30)]:
        cfg = LocalConfig(steps=steps, batch_size=bs)
        trainer = LocalTrainer(nn.Linear(3, 2), nn.CrossEntropyLoss(), x, y, cfg)
        indices = torch.randperm(100)[:n].sort().values
        gen = torch.Generator().manual_seed(1234)
        it = trainer._batches(indices, gen)
        expected = torch.stack([next(it) for _ in range(steps)])
        assert torch.equal(B.client_batches(indices, 1234, bs, steps), expected)


def test_random_layers_are_reproducible():
    def make():
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10))

    a = _run(module=make, engine="batched")
    b = _run(module=make, engine="batched")
    assert a.results.meta["engine"] == "batched"
    assert torch.equal(a.x_global, b.x_global)
    assert a.results.final["test_accuracy"] > a.results.initial["test_accuracy"]


def test_ctrl_c_during_batched_training_leaves_the_state_untouched(monkeypatch):
    full = _run(algo="scaffold", engine="batched", client_batch=2)
    sim = _sim(algo="scaffold", engine="batched", client_batch=2)
    sim.run(rounds=1)
    c_before, ci_before = sim.scaffold.c.clone(), sim.scaffold.c_clients.clone()
    x_before = sim.x_global.clone()
    real = sim.batched._train_group
    calls = {"n": 0}

    def group_then_ctrl_c(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:  # the second group of round 2: the first group's clients are recorded
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(sim.batched, "_train_group", group_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        sim.run()
    assert sim.round == 1 and sim.results.meta["engine"] == "batched"
    assert torch.equal(sim.x_global, x_before)
    assert torch.equal(sim.scaffold.c, c_before) and torch.equal(sim.scaffold.c_clients, ci_before)
    monkeypatch.setattr(sim.batched, "_train_group", real)
    sim.run()
    assert torch.equal(sim.x_global, full.x_global)


def test_resume_with_the_other_engine():
    sim = _run(engine="sequential", rounds=2)
    other = Simulation(SimulationConfig(**{**SMALL, "engine": "batched", "rounds": 3}))
    other.load_state_dict(sim.state_dict())
    other.run()
    ref = _run(engine="sequential", rounds=3)
    assert_close_models(ref.x_global, other.x_global)


def test_batch_bins():
    assert P.batch_bins([32] * 5) == [([0, 1, 2, 3, 4], 32)]
    assert P.batch_bins([3, 3, 5], penalty=0) == [([2], 5), ([0, 1], 3)]
    assert P.batch_bins([3, 3, 5], penalty=float("inf")) == [([0, 1, 2], 5)]
    # many small clients and a few large ones: two bins save most of the padding
    bs = [8] * 50 + [32] * 5
    assert P.batch_bins(bs) == [(list(range(50, 55)), 32), (list(range(50)), 8)]


def _several_levels(sim, call_cost_flops=2e6):
    """A cheaper batched call than the default's (a small model on 2 CPU cores trains as
    one level): the population's several padded lengths."""
    sim.batched.planner.call_cost_flops = call_cost_flops
    sim.batched.planner.set_population(sim.partition.sizes)
    assert len(sim.batched.planner._levels) > 1
    return sim


def test_levels_weigh_a_call_against_the_rounds_arithmetic():
    """The cheaper a batched call against a round's arithmetic, the more padded lengths:
    one level when a call costs much, one per batch size when it costs nothing."""
    sim = _sim(engine="batched", clients=100, per_round=25, batch_size=32)
    bat = sim.batched.planner
    assert bat.sample_flops() >= 6 * sim.numel
    counts = []
    for cost in (1e12, 1e7, 1e6, 0.0):
        bat.call_cost_flops = cost
        counts.append(len(bat.levels(sim.partition.sizes)))
    assert counts[0] == 1 and counts == sorted(counts) and counts[-1] == len(set(min(32, n) for n in sim.partition.sizes))
    # more clients per round: more padded samples per call, so a level is worth more
    bat.call_cost_flops = 1e7
    few = len(bat.levels(sim.partition.sizes))
    bat.round_clients = 100
    assert len(bat.levels(sim.partition.sizes)) >= few


def test_many_small_clients_use_several_bins_and_agree():
    kw = dict(clients=100, per_round=25, rounds=2, local_steps=6, batch_size=32)
    seq = _run(engine="sequential", **kw)
    bat = _several_levels(_sim(engine="batched", **kw))
    sizes = [bat.partition.sizes[c] for c in bat.sample_clients(1)]
    assert len({g.batch for g in bat.batched.planner.plan(sizes)}) > 1
    bat.run()
    assert_close_models(seq.x_global, bat.x_global)
    assert_same_records(seq, bat)
    grouped = _several_levels(_sim(engine="batched", client_batch=4, **kw))
    grouped.run()
    assert torch.equal(grouped.x_global, bat.x_global)


def test_simulation_benchmark_runs():
    from fedopt_kernels.benchmarks import simulation

    rows = simulation.bench_simulation("mlp", 4, label="smoke", repeats=1, warmup=0)
    assert [r["case"] for r in rows] == ["batched engine", "sequential engine", "hand-written loop",
                                        "hand-written loop, lean"]
    assert all(r["ms"] > 0 and r["vs hand loop"] > 0 for r in rows)
    assert rows[0]["time / batched"] == 1.0


def test_a_clients_update_does_not_depend_on_the_other_clients_of_its_round():
    """What lets a round be grouped for memory or split over ranks (fl/run/distributed_simulation.py)
    without changing a bit: padded lengths come from the whole population, a lone
    client is doubled."""
    from fedopt_kernels.fl.engine.client import RoundStats
    from fedopt_kernels.fl.seeds import batch_seed

    sim = _sim(engine="batched", clients=100, per_round=12, batch_size=16, momentum=0.9, algo="fedprox")
    clients = sim.sample_clients(1)

    def updates(subset):
        out = torch.empty(len(subset), sim.numel)
        sim.batched.train_round(sim.x_global, [sim.partition.client_indices[c] for c in subset], round_index=0,
                                seeds=[batch_seed(0, 1, c) for c in subset], out=out,
                                stats=RoundStats("cpu"), clients=subset)
        return out

    whole = updates(clients)
    for subset in (clients[:1], clients[3:8], clients[::3]):
        rows = [clients.index(c) for c in subset]
        assert torch.equal(updates(subset), whole[rows])


def test_batch_statistics_see_no_padding():
    """BatchNorm on batch statistics (no running stats: vmap can batch it) mixes the
    samples of a batch, so its clients are never padded."""
    def make():
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.BatchNorm1d(32, track_running_stats=False),
                             nn.ReLU(), nn.Linear(32, 10))

    seq = _run(module=make, engine="sequential")
    bat = _sim(module=make, engine="batched")
    assert {b for b, _ in bat.batched.planner._levels} == {min(32, n) for n in bat.partition.sizes}
    bat.run()
    assert bat.results.meta["engine"] == "batched"
    assert_close_models(seq.x_global, bat.x_global)


@pytest.mark.parametrize("kw", [dict(algo="scaffold", momentum=0.5, clients=12, per_round=12),
                                dict(model="cnn", rounds=3, local_steps=3, clients=8, per_round=8),
                                dict(clients=100, per_round=25, batch_size=16, client_batch=4)],
                         ids=["mlp-scaffold", "cnn", "many-small-grouped"])
def test_traced_steps_equal_the_torch_func_transforms(kw):
    """The vmapped gradient runs as a traced graph of ATen ops from the first round:
    the same bits as the transforms run eagerly (the ragged products, which change the
    rounding, are tested apart: test_ragged_products_*)."""
    traced = _sim(engine="batched", **kw)
    traced.batched.ragged = False
    eager = _sim(engine="batched", **kw)
    eager.batched.trace = False
    traced.run()
    eager.run()
    assert traced.batched._traced and not eager.batched._traced and traced.batched.trace_failure is None
    assert torch.equal(traced.x_global, eager.x_global)


def test_random_layers_traced_and_eager_agree():
    def make():
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10))

    # the padded products, as in test_traced_steps_equal_the_torch_func_transforms: the
    # ragged ones round differently (their skinny products run on aligned copies)
    traced = _sim(module=make, engine="batched", clients=12, per_round=12)
    traced.batched.ragged = False
    traced.run()
    eager = _sim(module=make, engine="batched", clients=12, per_round=12)
    eager.batched.trace = False
    eager.run()
    assert traced.batched._traced
    assert torch.equal(traced.x_global, eager.x_global)


def test_real_run_benchmark_times_consecutive_rounds_with_new_clients():
    """The real-run figure: consecutive rounds of one run, new clients each round (the
    sampled sets differ), the hand loop over the same clients, first round and the
    evaluation apart."""
    from fedopt_kernels.benchmarks import simulation

    sim = simulation._real_simulation("mlp", 12, 4, "cpu", None)
    assert sim.sample_clients(1) != sim.sample_clients(2)
    rows = simulation.bench_real_run("mlp", 12, 4, label="smoke", rounds=2)
    cases = [r["case"] for r in rows]
    assert cases[0].endswith("rounds 2-3, median") and cases[1] == "hand-written loop, same clients, median"
    assert cases[2].startswith("engine, rounds 2-3, mean (") and cases[3:] == [
        "first round (the process's first torch.func call, its traces)", "evaluation (test set, apart)"]
    assert all(r["ms"] > 0 for r in rows)
    # the hand loop trains only the chosen clients: one client with weight 1 moves the
    # model exactly as that client's own data-size weight of 1 says
    hand = simulation.HandWrittenLoop(sim, "lean")
    start = [g.clone() for g in hand.global_params]
    hand.round([3])
    moved = [g.clone() for g in hand.global_params]
    assert any(not torch.equal(a, b) for a, b in zip(start, moved))
    for g, s in zip(hand.global_params, start):
        g.copy_(s)
    hand.generator.manual_seed(0)
    hand.round([3])
    again = [g.clone() for g in hand.global_params]
    hand2 = simulation.HandWrittenLoop(sim, "lean")
    hand2.generator.manual_seed(0)
    for g, s in zip(hand2.global_params, start):
        g.copy_(s)
    hand2._lean_round([hand2.clients[3]], [1.0])
    assert all(torch.equal(a, b) for a, b in zip(again, hand2.global_params))


def test_padded_count_ladder():
    """Group rows: 2, 3, 4, 6, 8, 12, 16, 24, ... (hand-listed), never past a level's
    limit when the limit holds the group, never below 2."""
    expect = {1: 2, 2: 2, 3: 3, 4: 4, 5: 6, 6: 6, 7: 8, 8: 8, 9: 12, 12: 12, 13: 16, 17: 24, 25: 32, 33: 48, 49: 64}
    assert {n: P.padded_count(n) for n in expect} == expect
    assert P.padded_count(17, limit=20) == 20 and P.padded_count(5, limit=5) == 5
    assert P.padded_count(1, limit=1) == 2
    assert P.padded_count(9, limit=8) == 12  # a limit that cannot hold the group is ignored
    with pytest.raises(ValueError, match="at least one client"):
        P.padded_count(0)


def _shapes_of_rounds(sim, rounds):
    """The groups (mode, rows, real, batch) of each round, as the engine planned them."""
    seen, plan = [], sim.batched.planner.plan

    def recording(sizes):
        groups = plan(sizes)
        seen.append([(g.mode, len(g.rows), g.real, g.batch) for g in groups])
        return groups

    sim.batched.planner.plan = recording
    sim.run(rounds)
    return seen


def test_real_run_shapes_come_from_a_fixed_set_and_are_traced_once():
    """New clients every round: group rows follow the ladder, so a 12-round run meets a
    few shapes, each traced once (at its first sighting, the first round included),
    never once per round."""
    sim = _several_levels(_sim(engine="batched", clients=100, per_round=25, rounds=12, local_steps=3))
    rounds = _shapes_of_rounds(sim, 12)
    assert len({frozenset(s) for s in rounds}) > 1  # the rounds' compositions differ
    limits = set(sim.batched.planner._level_limit.values())
    sightings = {}
    for groups in rounds:
        for mode, rows, real, batch in groups:
            assert rows == P.padded_count(real) or rows in limits, (rows, real)
            sightings[(mode, rows, batch)] = sightings.get((mode, rows, batch), 0) + 1
    assert any(rows > real for groups in rounds for _, rows, real, _ in groups)  # padding happened
    assert sum(sightings.values()) > len(sightings)  # shapes come back
    traced = sim.batched.trace_counts
    assert traced and set(traced.values()) == {1}
    # traced = exactly the shapes met, each at its first sighting
    assert set(traced) == {(mode, rows, batch) for groups in rounds for mode, rows, _, batch in groups}
    assert sum(traced.values()) < 12


def test_real_run_batched_equals_sequential_with_new_clients():
    """Several rounds, new clients each round, padded groups: the batched engine's global
    model is the sequential engine's (the module's tolerance), and so are the records."""
    kw = dict(clients=100, per_round=25, rounds=6, local_steps=4, momentum=0.5)
    seq = _run(engine="sequential", **kw)
    bat = _several_levels(_sim(engine="batched", **kw))
    rounds = _shapes_of_rounds(bat, 6)
    assert any(rows > real for groups in rounds for _, rows, real, _ in groups)
    assert len({tuple(r["clients"]) for r in bat.results.records[1:]}) == 6
    assert_close_models(seq.x_global, bat.x_global)
    assert_same_records(seq, bat)


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_forward_flops_equal_torchs_flop_counter(model):
    from torch.utils.flop_counter import FlopCounterMode

    from fedopt_kernels.fl.engine._flops import forward_flops

    sim = _sim(engine="batched", model=model, hidden=(48, 24))
    net, x = sim.trainer.model, sim.train_x[:3]
    with FlopCounterMode(display=False) as counter:
        net(x)
    assert forward_flops(net, x) == counter.get_total_flops() > 0
    assert sim.batched.planner.sample_flops() == max(3 * forward_flops(net, x[:1]), 6 * sim.numel)


def test_cpu_max_pools_run_channels_last_with_the_same_bits():
    """The traced graph's pools take a channels-last copy (torch's NCHW CPU kernel is
    slow on small planes): the two kernels give the same values and indices, ties after
    ReLU and NaN included, and a traced CNN round equals the transforms run eagerly."""
    pool = torch.ops.aten.max_pool2d_with_indices.default
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, 8, 8, generator=gen).relu().round()  # many ties (zeros, equal integers)
    x[0, 0, 0, 0] = x[3, 2, 5, 1] = float("nan")
    for kernel, stride, pad in (([2, 2], [2, 2], [0, 0]), ([3, 3], [1, 1], [1, 1]), ([3, 3], [2, 2], [1, 1])):
        a, ia = pool(x, kernel, stride, pad, [1, 1], False)
        b, ib = pool(x.contiguous(memory_format=torch.channels_last), kernel, stride, pad, [1, 1], False)
        assert torch.equal(ia, ib) and torch.equal(a.nan_to_num(-7.0), b.nan_to_num(-7.0))
    kw = dict(model="cnn", rounds=3, local_steps=2, clients=8, per_round=8)
    traced, eager = _sim(engine="batched", **kw), _sim(engine="batched", **kw)
    traced.batched.ragged = False  # the padded products: the ragged ones round differently
    eager.batched.trace = False
    traced.run()
    eager.run()
    graphs = list(traced.batched._traced.values())
    assert graphs
    for gm in graphs:
        pools = [n for n in gm.graph.nodes if n.target is torch.ops.aten.max_pool2d_with_indices.default]
        assert len(pools) == 2
        assert all(p.args[0].kwargs.get("memory_format") is torch.channels_last for p in pools)
    assert torch.equal(traced.x_global, eager.x_global)
