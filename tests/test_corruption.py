"""Corrupted clients (--corrupt-fraction / --corrupt-kind): who is corrupted, how, and that nothing else is."""

import json

import pytest
import torch

from fedopt_kernels.cli import main
from fedopt_kernels.fl import ConfigError, Partition, Simulation, SimulationConfig, digits
from fedopt_kernels.fl.datasets.corruption import corrupted_clients, label_map

SMALL = dict(dataset="digits", hidden=(32,), clients=10, per_round=4, rounds=1, local_steps=5, batch_size=32)


pytestmark = pytest.mark.usefixtures("one_thread")


def _sim(**kw):
    return Simulation(SimulationConfig(**{**SMALL, **kw}))


def _split(sim):
    """(corrupted ids, clean ids) as the simulation recorded them."""
    bad = sim.results.meta["corruption"]["clients"]
    return bad, [c for c in range(sim.config.clients) if c not in bad]


# ------------------------------------------------------------------ how many, which
@pytest.mark.parametrize("clients, fraction, count", [
    (10, 0.2, 2), (10, 0.25, 3), (10, 0.05, 1), (20, 0.2, 4), (20, 0.5, 10), (8, 1.0, 8), (10, 0.0, 0),
])
def test_count_is_fraction_of_clients_rounded_half_up(clients, fraction, count):
    chosen = corrupted_clients(0, clients, fraction)
    assert len(chosen) == count and chosen == sorted(set(chosen)) and all(0 <= c < clients for c in chosen)


def test_choice_is_uniform_over_clients_and_nested_in_the_fraction():
    hits = torch.zeros(10)
    for seed in range(1000):
        small, large = corrupted_clients(seed, 10, 0.2), corrupted_clients(seed, 10, 0.5)
        assert set(small) <= set(large)  # a larger fraction adds clients, never swaps them
        hits[small] += 1
    # each client is chosen with probability 2/10: 200 of 1000 seeds, binomial std 12.6
    assert (hits - 200).abs().max() < 50, hits


def test_determined_by_the_seed_alone():
    a, b = _sim(corrupt_fraction=0.3, seed=3), _sim(corrupt_fraction=0.3, seed=3)
    assert _split(a)[0] == _split(b)[0] == corrupted_clients(3, 10, 0.3)
    assert torch.equal(a.train_y, b.train_y)
    noisy_a, noisy_b = _sim(corrupt_fraction=0.3, corrupt_kind="noise", seed=3), \
        _sim(corrupt_fraction=0.3, corrupt_kind="noise", seed=3)
    assert torch.equal(noisy_a.train_x, noisy_b.train_x)
    assert _split(noisy_a)[0] == _split(a)[0]  # the kind does not change who is corrupted
    other = [corrupted_clients(s, 10, 0.3) for s in range(4, 8)]
    assert any(o != _split(a)[0] for o in other)  # other seeds pick other clients


# ------------------------------------------------------------------ what changes
@pytest.mark.parametrize("kind", ["labels", "swap", "noise"])
def test_only_the_corrupted_clients_samples_change(kind):
    sim = _sim(corrupt_fraction=0.3, corrupt_kind=kind, seed=1)
    clean_ds = digits(seed=1)  # an independent copy of the uncorrupted data
    bad, good = _split(sim)
    assert len(bad) == 3
    ix = sim.partition.client_indices
    for c in good:
        assert torch.equal(sim.train_x[ix[c]], clean_ds.x_train[ix[c]])
        assert torch.equal(sim.train_y[ix[c]], clean_ds.y_train[ix[c]])
    changed_x = any(not torch.equal(sim.train_x[ix[c]], clean_ds.x_train[ix[c]]) for c in bad)
    changed_y = any(not torch.equal(sim.train_y[ix[c]], clean_ds.y_train[ix[c]]) for c in bad)
    assert (changed_x, changed_y) == ((True, False) if kind == "noise" else (False, True))
    # the server's data stay clean: the test set, and the training set the proxy is drawn from
    for name in ("x_train", "y_train", "x_test", "y_test"):
        assert torch.equal(getattr(sim.dataset, name), getattr(clean_ds, name)), name


def test_labels_kind_maps_every_label_through_a_derangement():
    sim = _sim(corrupt_fraction=0.5, corrupt_kind="labels", seed=2)
    clean = digits(seed=2).y_train
    bad, _ = _split(sim)
    maps = sim.results.meta["corruption"]["label_maps"]
    for c in bad:
        m = maps[str(c)]
        assert sorted(m) == list(range(10)) and all(m[k] != k for k in range(10))  # a permutation, no fixed point
        ix = sim.partition.client_indices[c]
        y0, y1 = clean[ix], sim.train_y[ix]
        assert bool((y0 != y1).all())  # every label of a corrupted client is wrong
        for k in y0.unique().tolist():  # ... and consistently so: class k always becomes m[k]
            assert set(y1[y0 == k].tolist()) == {m[k]}
    assert len({tuple(maps[str(c)]) for c in bad}) > 1  # drawn per client


def test_swap_kind_exchanges_exactly_two_classes():
    sim = _sim(corrupt_fraction=0.5, corrupt_kind="swap", seed=4)
    clean = digits(seed=4).y_train
    for c in _split(sim)[0]:
        m = sim.results.meta["corruption"]["label_maps"][str(c)]
        moved = [k for k in range(10) if m[k] != k]
        assert len(moved) == 2
        a, b = moved
        assert m[a] == b and m[b] == a
        ix = sim.partition.client_indices[c]
        y0, y1 = clean[ix], sim.train_y[ix]
        expect = y0.clone()
        expect[y0 == a], expect[y0 == b] = b, a
        assert torch.equal(y1, expect)
    assert label_map(4, 0, 10, "swap") == label_map(4, 0, 10, "swap")


def test_noise_kind_adds_gaussian_noise_of_the_given_std():
    sim = _sim(corrupt_fraction=0.3, corrupt_kind="noise", corrupt_noise_std=0.5, seed=0)
    clean = digits(seed=0).x_train
    bad, _ = _split(sim)
    assert sim.results.meta["corruption"]["noise_std"] == 0.5
    ix = torch.cat([sim.partition.client_indices[c] for c in bad])
    diff = (sim.train_x[ix] - clean[ix]).flatten().double()
    n = diff.numel()
    assert n > 5000
    assert abs(diff.mean().item()) < 4 * 0.5 / n ** 0.5
    assert diff.std().item() == pytest.approx(0.5, rel=0.05)
    # Gaussian, not uniform: about 68.3% within one std
    assert (diff.abs() < 0.5).double().mean().item() == pytest.approx(0.6827, abs=0.03)


# ------------------------------------------------------------------ bad values
@pytest.mark.parametrize("kw, needle", [
    (dict(corrupt_fraction=1.5), "corrupt-fraction must be >= 0 and <= 1, got 1.5"),
    (dict(corrupt_fraction=-0.1), "corrupt-fraction must be >= 0 and <= 1"),
    (dict(corrupt_fraction="half"), "corrupt-fraction must be a number"),
    (dict(corrupt_fraction=0.04), "corrupt-fraction 0.04 of 10 clients corrupts no client"),
    (dict(corrupt_kind="flip"), "unknown corrupt-kind 'flip'; choose one of labels, swap, noise"),
    (dict(corrupt_noise_std=0.0), "corrupt-noise-std must be > 0"),
])
def test_bad_settings_name_the_setting(kw, needle):
    with pytest.raises(ConfigError) as exc:
        SimulationConfig(**{**SMALL, **kw}).validate()
    assert needle in str(exc.value)


@pytest.mark.parametrize("argv, needle", [
    (["--corrupt-fraction", "2"], "corrupt-fraction must be >= 0 and <= 1, got 2"),
    (["--corrupt-kind", "flip"], "unknown corrupt-kind 'flip'"),
    (["--corrupt-noise-std", "-1"], "corrupt-noise-std must be > 0"),
])
def test_cli_rejects_bad_values_in_one_line(capsys, tmp_path, argv, needle):
    rc = main(["simulate", "--out", str(tmp_path / "x"), "--quiet"] + argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("fedopt: error: ") and needle in err[0], err


def test_overlapping_partition_is_refused():
    y = digits(seed=0).y_train
    n = y.numel()
    ix = [torch.arange(k, n, 4) for k in range(4)]
    bad = corrupted_clients(0, 4, 0.25)
    assert len(bad) == 1
    other = (bad[0] + 1) % 4  # a clean client that also holds 5 samples of the corrupted one
    ix[other] = torch.cat([ix[other], ix[bad[0]][:5]]).sort().values
    part = Partition(ix, "custom")
    with pytest.raises(ConfigError, match="shares training samples with a corrupted client"):
        Simulation(SimulationConfig(**{**SMALL, "clients": 4, "per_round": 2, "corrupt_fraction": 0.25}),
                   partition=part)


# ------------------------------------------------------------------ end to end
def test_simulate_with_corruption_records_the_corrupted_clients(tmp_path):
    common = ["--algo", "fedavg", "--clients", "10", "--per-round", "5", "--local-steps", "5", "--hidden", "32",
              "--rounds", "2", "--weighting", "size", "--seed", "1", "--quiet", "--no-plots"]
    assert main(["simulate", "--out", str(tmp_path / "bad"), "--corrupt-fraction", "0.3",
                 "--corrupt-kind", "labels"] + common) == 0
    assert main(["simulate", "--out", str(tmp_path / "clean")] + common) == 0
    bad = json.loads((tmp_path / "bad" / "results.json").read_text())
    clean = json.loads((tmp_path / "clean" / "results.json").read_text())
    rec = bad["meta"]["corruption"]
    assert rec["kind"] == "labels" and rec["fraction"] == 0.3
    assert rec["clients"] == corrupted_clients(1, 10, 0.3) and len(rec["clients"]) == 3
    assert sorted(rec["label_maps"]) == sorted(str(c) for c in rec["clients"])
    assert bad["config"]["corrupt_fraction"] == 0.3 and bad["config"]["corrupt_kind"] == "labels"
    assert "corruption" not in clean["meta"]
    # same clients and batches, different data: the corrupted clients trained on wrong labels
    assert [r["clients"] for r in bad["records"]] == [r["clients"] for r in clean["records"]]
    assert any(set(r["clients"]) & set(rec["clients"]) for r in bad["records"][1:])
    assert bad["records"][1]["train_loss"] > clean["records"][1]["train_loss"]


def test_both_engines_train_on_the_corrupted_data():
    kw = dict(corrupt_fraction=0.5, corrupt_kind="labels", rounds=2, seed=1)
    seq, bat, ref = _sim(engine="sequential", **kw), _sim(engine="batched", **kw), _sim(engine="batched", rounds=2,
                                                                                         seed=1)
    for s in (seq, bat, ref):
        s.run()
    assert bat.results.meta["engine"] == "batched"
    assert (bat.x_global - seq.x_global).norm() <= 1e-5 * seq.x_global.norm()
    assert (bat.x_global - ref.x_global).norm() > 1e-2 * ref.x_global.norm()  # corruption changed training


def test_resume_recomputes_the_same_corruption():
    kw = dict(corrupt_fraction=0.3, corrupt_kind="noise", corrupt_noise_std=0.7, rounds=3, seed=2)
    straight = _sim(**kw)
    straight.run()
    first = _sim(**kw)
    first.run(2)
    resumed = _sim(**kw)
    resumed.load_state_dict(first.state_dict())
    resumed.run()
    assert torch.equal(resumed.x_global, straight.x_global)
    assert resumed.results.meta["corruption"] == straight.results.meta["corruption"]
    with pytest.raises(ValueError, match="corrupt_fraction"):  # a checkpoint of other corruption is refused
        _sim(**{**kw, "corrupt_fraction": 0.5}).load_state_dict(first.state_dict())
