"""Issue 41: what a new user hit, second pass -- each item checked against an oracle
written here (the same run without the bad client, values spelled out, the files the
docs name), each failing before its fix."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from fedopt_kernels.fl import NonFiniteClientWarning, Simulation, SimulationConfig

SMALL = dict(dataset="digits", hidden=(16,), clients=8, per_round=4, rounds=2, local_steps=3, batch_size=16,
             lr=0.05, max_norm=1.0)
EXCLUSION_KEYS = {"clients", "excluded_clients", "excluded_no_data", "excluded_error", "excluded_nonfinite",
                  "left_out", "wall_time"}
TINY = ["--dataset", "digits", "--hidden", "8", "--clients", "4", "--per-round", "2", "--local-steps", "1",
        "--quiet"]

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- item 1: bad data is never silent
def _poisoned(engine, algo, bad):
    """A simulation whose client ``bad`` holds a NaN feature in every sample."""
    sim = Simulation(SimulationConfig(**{**SMALL, "engine": engine, "algo": algo}))
    idx = sim.client_indices[bad]
    sim.train_x[idx, 0] = float("nan")
    return sim


def _without(sim, clients):
    real = sim.sample_clients
    sim.sample_clients = lambda r: [c for c in real(r) if c not in clients]


@pytest.mark.parametrize("engine", ["sequential", "batched"])
@pytest.mark.parametrize("algo", ["fedavg", "scaffold"])
def test_a_client_with_nonfinite_data_is_left_out_not_averaged_in_as_zero(engine, algo):
    probe = Simulation(SimulationConfig(**{**SMALL, "engine": engine}))
    bad = probe.sample_clients(1)[1]
    a = _poisoned(engine, algo, bad)
    b = Simulation(SimulationConfig(**{**SMALL, "engine": engine, "algo": algo}))  # the oracle: bad never sampled
    _without(b, {bad})
    with pytest.warns(NonFiniteClientWarning, match=rf"client {bad}: non-finite loss or local step") as caught:
        a.run()
    assert sum(issubclass(w.category, NonFiniteClientWarning) for w in caught) == 1  # once, not per round
    b.run()
    # the server step gives the NaN row weight 0 (a sum over 4 rows, not 3): equal to fp32 rounding
    torch.testing.assert_close(a.x_global, b.x_global, rtol=1e-6, atol=1e-7)
    if algo == "scaffold":
        torch.testing.assert_close(a.scaffold.c, b.scaffold.c, rtol=1e-5, atol=1e-7)
        assert not a.scaffold.store.has("c_i", bad) or torch.equal(a.scaffold.control(bad),
                                                                   torch.zeros_like(a.scaffold.c))
    for ra, rb in zip(a.results.records, b.results.records):
        strip = lambda r: {k: v for k, v in r.items() if k not in EXCLUSION_KEYS}  # noqa: E731
        # the round's local statistics are those of the clients that trained (the global model they
        # start from agrees to fp32 rounding after round 1)
        assert strip(ra).keys() == strip(rb).keys()
        for k in ("clipped_steps", "skipped_steps", "local_steps_total"):
            assert ra.get(k) == rb.get(k), k
        for k in ("train_loss", "clip_frequency", "test_accuracy", "test_loss"):
            assert (ra.get(k) is None) == (rb.get(k) is None), k
            if ra.get(k) is not None:
                assert ra[k] == pytest.approx(rb[k], rel=1e-5), k
        if bad in ra.get("clients", []):
            assert ra["excluded_nonfinite"] == 1 and [bad, "nonfinite"] in ra["left_out"]
            assert ra["train_loss"] is not None and math.isfinite(ra["train_loss"])
    assert any(bad in r.get("clients", []) for r in a.results.records)


def _leaf(root, users):
    """A LEAF FEMNIST folder: ``users`` {name: (x rows, y)} in train/ and test/."""
    data = {"users": list(users), "num_samples": [len(y) for _, y in users.values()],
            "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()}}
    for split in ("train", "test"):
        (root / split).mkdir(parents=True, exist_ok=True)
        (root / split / "a.json").write_text(json.dumps(data))
    return root


def test_cli_warns_once_naming_the_client_with_nonfinite_data(tmp_path, capsys):
    """A LEAF file with a NaN pixel in every sample of one user: a warning naming its
    client, the user left out of each round it is in, the round's loss finite."""
    from fedopt_kernels.cli import main

    users = {f"u{i}": ([[0.01 * ((i + j + k) % 7) for k in range(784)] for j in range(4)], [j % 3 for j in range(4)])
             for i in range(3)}
    for row in users["u1"][0]:
        row[5] = float("nan")
    root = _leaf(tmp_path / "leaf", users)
    code = main(["simulate", "--dataset", f"leaf-femnist:{root}", "--clients", "3", "--hidden", "8", "--per-round",
                 "3", "--rounds", "2", "--local-steps", "2", "--batch-size", "4", "--no-plots", "--quiet",
                 "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 0, err
    assert err.count("fedopt: warning: client 1: non-finite loss or local step") == 1
    recs = json.loads((tmp_path / "o" / "results.json").read_text())["records"]
    assert [r["excluded_nonfinite"] for r in recs[1:]] == [1, 1]
    assert [r["left_out"] for r in recs[1:]] == [[[1, "nonfinite"]]] * 2
    assert all(math.isfinite(r["train_loss"]) for r in recs[1:])


# --------------------------------------------------------------------------- item 4: LEAF errors name file and user
PIXELS = [0.5] * 784


@pytest.mark.parametrize("x, y, counts, message", [
    ([PIXELS, PIXELS[:700]], [1, 2], None, r"a\.json: user 'u1', sample 1: FEMNIST inputs must be 784 pixels each, "
                                           r"got 700 values"),
    ([PIXELS, PIXELS], [1, "a"], None, r"a\.json: user 'u1', sample 1: labels must be integers in \[0, 62\), got 'a'"),
    ([PIXELS, PIXELS], [1, 62], None, r"user 'u1', sample 1: labels must be integers in \[0, 62\), got 62"),
    ([PIXELS, PIXELS], [1, 2], 3, r"a\.json: user 'u1' has 2 samples but num_samples says 3"),
])
def test_malformed_leaf_files_name_the_file_and_the_user(tmp_path, x, y, counts, message):
    from fedopt_kernels.fl import load_leaf

    root = _leaf(tmp_path, {"u0": ([PIXELS], [0]), "u1": (x, y)})
    if counts is not None:
        for split in ("train", "test"):
            f = root / split / "a.json"
            data = json.loads(f.read_text())
            data["num_samples"][1] = counts
            f.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        load_leaf("femnist", str(root), cache=False)


# --------------------------------------------------------------------------- item 3: resume that cannot lose a run
def _strip_times(records):
    return [{k: v for k, v in r.items() if k != "wall_time"} for r in records]


def test_resume_with_fewer_rounds_than_done_is_refused_and_changes_nothing(tmp_path, capsys):
    from fedopt_kernels.cli import main

    out = tmp_path / "run"
    assert main(["simulate", *TINY, "--rounds", "3", "--no-plots", "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main(["simulate", "--resume", "--rounds", "2", "--quiet", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "has already run 3 rounds, more than --rounds 2; give --rounds 3 or more" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    meta = json.loads((out / "results.json").read_text())
    assert meta["config"]["rounds"] == 3 and meta["meta"]["interrupted"] is False


class _NotWeights:  # pickled by torch.save: weights_only=True refuses it
    pass


@pytest.mark.parametrize("content", ["garbage", "object"])
def test_a_corrupt_checkpoint_gets_a_message_of_its_own(tmp_path, capsys, content):
    from fedopt_kernels.cli import main

    out = tmp_path / "run"
    out.mkdir()
    if content == "garbage":
        (out / "checkpoint.pt").write_bytes(b"PK\x03\x04 this is not a checkpoint")
    else:
        torch.save({"round": _NotWeights()}, out / "checkpoint.pt")
    assert main(["simulate", "--resume", "--quiet", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--resume: {out / 'checkpoint.pt'} is not a readable checkpoint (corrupt, truncated, or not written" in err
    assert "weights_only" not in err and "Re-running" not in err and err.count("\n") == 1


def test_compare_checkpoints_each_run_and_resumes_where_it_stopped(tmp_path, monkeypatch, capsys):
    """A comparison stopped in its second run's round 2, then resumed: the same records
    (bit for bit) as one that ran through; the finished first run is not run again."""
    from fedopt_kernels.cli import main
    from fedopt_kernels.fl.run.simulation import Simulation as Sim

    args = ["compare", *TINY, "--algos", "fedavg,fedadam", "--rounds", "2", "--no-plots"]
    assert main([*args, "--out", str(tmp_path / "through")]) == 0
    real = Sim.run_round
    state = {"stopped": False, "rounds": []}

    def run_round(self):
        if self.config.algo == "fedadam" and self.round == 1 and not state["stopped"]:
            state["stopped"] = True
            raise KeyboardInterrupt
        state["rounds"].append((self.config.algo, self.round + 1))
        return real(self)

    monkeypatch.setattr(Sim, "run_round", run_round)
    stopped = tmp_path / "stopped"
    assert main([*args, "--out", str(stopped)]) == 130
    assert "1 of 2 runs finished" in capsys.readouterr().out
    assert (stopped / "fedavg" / "checkpoint.pt").is_file() and (stopped / "fedadam" / "checkpoint.pt").is_file()
    state["rounds"].clear()
    assert main([*args, "--resume", "--out", str(stopped)]) == 0
    assert state["rounds"] == [("fedadam", 2)]  # only what was missing
    a = json.loads((tmp_path / "through" / "compare.json").read_text())
    b = json.loads((stopped / "compare.json").read_text())
    assert [_strip_times(r["records"]) for r in a["runs"]] == [_strip_times(r["records"]) for r in b["runs"]]
    assert [r["meta"]["interrupted"] for r in b["runs"]] == [False, False]


# --------------------------------------------------------------------------- item 4: inputs named in every error
DATASET_FORMS = ["digits", "synthetic", "synthetic-lazy", "cifar10", "leaf-femnist:PATH", "leaf-shakespeare:PATH",
                 "package.module:function"]


def test_dataset_help_and_error_list_every_form(capsys):
    from fedopt_kernels.cli import main
    from fedopt_kernels.fl import dataset_names

    assert set(dataset_names()) <= set(DATASET_FORMS)
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    start = help_text.index("--dataset DATASET", help_text.index("simulation settings"))
    entry = help_text[start:help_text.index("--model MODEL", start)].replace("- ", "-")  # argparse breaks at "-"
    assert all(form in entry for form in DATASET_FORMS), entry
    assert main(["simulate", *TINY, "--dataset", "femnist", "--rounds", "1"]) == 2
    err = capsys.readouterr().err
    assert "unknown dataset 'femnist'; choose one of" in err and all(form in err for form in DATASET_FORMS), err
    assert main(["simulate", *TINY, "--dataset", "leaf-femnist", "--rounds", "1"]) == 2
    err = capsys.readouterr().err
    assert "dataset 'leaf-femnist' needs the folder of its LEAF data: leaf-femnist:PATH" in err, err


def test_aggregation_error_names_each_reply_and_why():
    pytest.importorskip("flwr")
    from flwr.serverapp.exception import AggregationError
    from test_flower_bad_replies import _corrupt, _net, _reply, _strategy

    replies = [_reply(_net(), c) for c in range(2)]
    _corrupt("size_nan", replies[0])
    _corrupt("missing_layer", replies[1])
    with pytest.raises(AggregationError) as info:
        _strategy("fedavg").aggregate_train(1, replies)
    assert str(info.value).startswith("round 1: no usable reply among 2: node 1000: bad_size (")
    assert "; node 1001: bad_arrays (" in str(info.value) and "'2.bias'" in str(info.value)


@pytest.mark.parametrize("key, value", [("fraction_train", 2.0), ("fraction_train", -0.1),
                                        ("fraction_evaluate", "0.5"), ("min_train_nodes", -1),
                                        ("min_available_nodes", 2.5)])
def test_strategy_arguments_are_checked_naming_the_key(key, value):
    pytest.importorskip("flwr")
    from fedopt_kernels.integrations import flower as fk

    model = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=rf"^{key} must be .*got {value!r}"):
        fk.FedAdam(model, **{key: value})
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert fk.FedAdam(torch.nn.Linear(3, 2), fraction_train=1.0, fraction_evaluate=0.0).fraction_train == 1.0


@pytest.mark.parametrize("key, value, words", [
    ("local-lr", "abc", "a number >= 0"), ("local-lr", -0.1, "a number >= 0"), ("local-steps", "2.5", "a positive"),
    ("batch-size", 0, "a positive integer"), ("max-norm", float("nan"), "a number > 0"),
    ("local-momentum", 1.0, r"a number in \[0, 1\)"), ("nar", "clip", "one of co, grad, none"),
])
def test_run_config_values_are_checked_naming_the_key(key, value, words):
    pytest.importorskip("flwr")
    from fedopt_kernels.integrations.flower import local_config_from_run_config

    with pytest.raises(ValueError, match=rf"^run config '{key}' must be {words}.*got {value!r}"):
        local_config_from_run_config({key: value})
    cfg = local_config_from_run_config({"local-lr": "0.1", "local-steps": "3", "nar": "grad"})
    assert (cfg.lr, cfg.steps, cfg.nar) == (0.1, 3, "grad") and isinstance(cfg.steps, int)


# --------------------------------------------------------------------------- item 2: what a run is, where users look
@pytest.fixture
def saved_figures(monkeypatch):
    """Every figure the results module saves: {file name: figure}, drawn."""
    from fedopt_kernels.fl.run import results as R

    figures = {}
    real = R._save
    plt = R._pyplot()
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda *a, **k: None)  # keep the figures (and their Agg canvas) to read

    def save(fig, path, **kw):
        out = real(fig, path, **kw)
        figures[path.name] = fig
        return out

    monkeypatch.setattr(R, "_save", save)
    yield figures
    for fig in figures.values():
        close(fig)


DP_ATTACK = ["--clients", "8", "--per-round", "4", "--weighting", "uniform", "--dp-clip", "1",
             "--dp-noise-multiplier", "1", "--dp-delta", "1e-3", "--attack", "signflip", "--attack-fraction", "0.25",
             "--aggregator", "mean"]


def test_epsilon_aggregator_and_attack_are_in_the_summary_the_compare_table_and_the_plot_titles(
        tmp_path, capsys, saved_figures):
    from fedopt_kernels.cli import main

    base = ["--dataset", "digits", "--hidden", "8", "--local-steps", "1", "--rounds", "2", "--quiet", *DP_ATTACK]
    assert main(["simulate", *base, "--out", str(tmp_path / "s")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    recs = json.loads((tmp_path / "s" / "results.json").read_text())["records"]
    eps = recs[-1]["dp_epsilon"]
    words = f"DP server clip 1 z 1, eps {eps:.3g} at delta 0.001; attack signflip by 25% of clients"
    assert words in out.replace("│ │", "").replace(" │ ", " ") or all(w in out for w in words.split()), out
    for name in ("accuracy_loss.png", "clipping.png", "server.png"):
        assert words in " ".join(saved_figures[name]._suptitle.get_text().split()), name
    assert main(["compare", *base, "--algos", "fedavg,fedavgm", "--aggregator", "median", "--out",
                 str(tmp_path / "c")]) == 2  # DP and a robust rule together are refused; mean it is
    capsys.readouterr()
    assert main(["compare", *base, "--algos", "fedavg,fedavgm", "--out", str(tmp_path / "c")]) == 0
    import csv

    rows = list(csv.DictReader((tmp_path / "c" / "compare.csv").open()))
    assert [r["label"] for r in rows] == ["fedavg", "fedavgm"]
    for r in rows:
        assert float(r["dp_epsilon"]) == pytest.approx(eps) and float(r["dp_delta"]) == 1e-3
        assert (r["aggregator"], r["attack"], float(r["attack_fraction"])) == ("mean", "signflip", 0.25)
        assert r["settings"] == words
    fig = saved_figures["compare.png"]  # the runs share their settings: once, in the title
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["fedavg", "fedavgm"]
    assert words in " ".join(fig._suptitle.get_text().split())


def test_a_recipe_that_evaluates_the_mean_of_two_iterates_shows_that_accuracy(tmp_path, capsys):
    from fedopt_kernels.cli import main

    assert main(["compare", "--recipe", "fedexp", *TINY, "--rounds", "2", "--no-plots",
                 "--out", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    import csv

    row = next(csv.DictReader((tmp_path / "c" / "compare.csv").open()))
    recs = json.loads((tmp_path / "c" / "compare.json").read_text())["runs"][0]["records"]
    assert float(row["final_accuracy_avg2"]) == recs[-1]["test_accuracy_avg2"]
    assert float(row["best_accuracy_avg2"]) == max(r["test_accuracy_avg2"] for r in recs if "test_accuracy_avg2" in r)
    assert "final avg2" in out and f"{100 * recs[-1]['test_accuracy_avg2']:.2f}%" in out
    assert "recipe fedexp (acc avg2: mean of the last two iterates)" in " ".join(row["settings"].split())


# --------------------------------------------------------------------------- item 6: plots a researcher would keep
def _run_records(server_lr, gamma):
    recs = [{"round": 0, "test_accuracy": 0.1, "test_loss": 2.3}]
    for r, (lr, g) in enumerate(zip(server_lr, gamma), start=1):
        recs.append({"round": r, "test_accuracy": 0.1 * r, "test_loss": 2.0 / r, "train_loss": 2.1 / r,
                     "clip_frequency": 0.5, "clipped_steps": 2, "mean_clipped_norm": 1.0, "server_lr": lr,
                     "gamma": g})
    return recs


def test_a_constant_server_statistic_gets_no_panel(tmp_path, saved_figures):
    from fedopt_kernels.fl import Results

    Results({"algo": "fedadam"}, {}, None, _run_records([0.01] * 4, [0.9, 0.8, 0.85, 0.7]), "r").plot(tmp_path)
    fig = saved_figures["server.png"]
    assert [ax.get_ylabel() for ax in fig.axes] == ["gamma"]
    assert fig.axes[0].lines[0].get_ydata().tolist() == [0.9, 0.8, 0.85, 0.7]
    assert "(constant: server lr 0.01)" in fig._suptitle.get_text()
    Results({"algo": "fedadam"}, {}, None, _run_records([0.01] * 3, [1.0] * 3), "r").plot(tmp_path)
    fig = saved_figures["server.png"]
    assert all(not ax.lines for ax in fig.axes)
    assert "constant: server lr 0.01, gamma 1)" in " ".join(fig._suptitle.get_text().split())


def test_the_compare_legend_covers_no_curve(tmp_path, saved_figures):
    from fedopt_kernels.fl import Results, plot_comparison

    runs = [Results({"dataset": "d", "aggregator": "median" if i % 2 else "mean", "attack": "signflip",
                     "attack_fraction": 0.1 * i}, {}, None, _run_records([1.0] * 6, [1.0] * 6),
                    f"a run with a long label {i}") for i in range(5)]
    plot_comparison(runs, tmp_path / "compare.png")
    fig = saved_figures["compare.png"]
    renderer = fig.canvas.get_renderer()
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes)
    box = fig.legends[0].get_window_extent(renderer)
    texts = [" ".join(t.get_text().split()) for t in fig.legends[0].get_texts()]
    assert texts[1] == "a run with a long label 1 (aggregator median; attack signflip by 10% of clients)"
    for ax in fig.axes:
        assert not box.overlaps(ax.get_window_extent(renderer)), ax.get_ylabel()
    fig_box = fig.bbox
    assert box.x0 >= fig_box.x0 and box.y0 >= fig_box.y0 and box.x1 <= fig_box.x1  # not cut off


# --------------------------------------------------------------------------- item 4: the --config format documented
def test_the_config_page_lists_every_setting_and_only_settings(tmp_path):
    import re
    from pathlib import Path

    from fedopt_kernels.cli._options import CLI_ONLY_KEYS, SIM_OPTIONS
    from fedopt_kernels.fl.run.config import SimulationConfig

    text = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    listed = {m.group(1).replace("-", "_") for m in re.finditer(r"^\| `([a-z0-9-]+)` \|", text, re.M)}
    fields = set(SimulationConfig.field_names())  # the flat names (the parts: tests/test_config_parts.py)
    settings = {flag[2:].replace("-", "_") for flag, _, _ in SIM_OPTIONS}
    assert settings <= listed and set(CLI_ONLY_KEYS) <= listed
    assert listed <= fields | set(CLI_ONLY_KEYS), listed - fields - set(CLI_ONLY_KEYS)
    # the page's example file is read as written, each value reaching the settings
    example = re.search(r"```toml\n(.*?)```", text, re.S).group(1)
    (tmp_path / "run.toml").write_text(example)
    import argparse

    from fedopt_kernels.cli._options import build_settings

    config, opts = build_settings(argparse.Namespace(config=str(tmp_path / "run.toml")))
    assert (config.algo, config.hidden, config.per_round, config.server_betas) == ("fedadam", (64,), 10, (0.9, 0.99))
    assert (opts["out"], opts["threads"]) == ("results/fedadam", 1)


def test_the_custom_dataset_page_is_in_the_site_and_names_the_contract():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    nav = (root / "mkdocs.yml").read_text()
    assert "config.md" in nav and "datasets.md" in nav
    text = (root / "docs" / "datasets.md").read_text()
    for words in ("function(seed=..., num_clients=...)", "x_train", "y_train", "int64", "num_classes",
                  "client_indices", "--dataset package.module:function"):
        assert words in text, words


# --------------------------------------------------------------------------- item 7: docs that say what the code does
def test_the_readme_names_every_extra():
    import re
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    install = (root / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z]+)`", install))
    assert set(extras) <= named, set(extras) - named


def test_the_gradscaler_statement_is_one():
    from pathlib import Path

    from fedopt_kernels.optim import FedNAR

    doc = " ".join(FedNAR.__doc__.split())
    compile_md = " ".join((Path(__file__).resolve().parents[1] / "docs" / "compile.md").read_text().split())
    assert "Do not call" not in doc
    assert "``scaler.unscale_(optimizer)`` before ``scaler.step`` is not needed but allowed" in doc
    assert "`scaler.unscale_(opt)` is not needed (FedNAR clips itself), but allowed" in compile_md


# ------------------------------------------------------------------- item 5: the Flower docs as a user lives them
def _flower_md() -> str:
    from pathlib import Path

    return (Path(__file__).resolve().parents[1] / "docs" / "flower.md").read_text()


def test_the_flower_docs_declare_every_run_config_key_the_client_reads(tmp_path):
    """The docs' [tool.flwr.app.config] declares every key FedNARClient reads, at the
    simulator's defaults; Flower's own config fusion (what `flwr run` does) takes a
    --run-config of a declared key and refuses an undeclared one."""
    pytest.importorskip("flwr")
    import re

    from flwr.common.config import get_fused_config_from_dir, parse_config_args

    from fedopt_kernels.fl.engine.client import LocalConfig
    from fedopt_kernels.integrations.flower import RUN_CONFIG_KEYS, local_config_from_run_config

    block = re.search(r"```toml\n# pyproject.toml of your app.*?\n(\[tool\.flwr\.app\.config\]\n.*?)```",
                      _flower_md(), re.S).group(1)
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "app"\nversion = "1.0.0"\n\n[tool.flwr.app]\npublisher = "me"\n\n'
        '[tool.flwr.app.components]\nserverapp = "a:app"\nclientapp = "b:app"\n\n' + block)
    declared = get_fused_config_from_dir(tmp_path, {})
    assert set(RUN_CONFIG_KEYS.values()) <= set(declared)
    assert local_config_from_run_config(declared) == LocalConfig()  # the defaults, as written
    fused = get_fused_config_from_dir(tmp_path, parse_config_args(["local-lr=0.1 local-steps=5"]))
    cfg = local_config_from_run_config(fused)
    assert (cfg.lr, cfg.steps, cfg.max_norm) == (0.1, 5, LocalConfig().max_norm)
    with pytest.raises(ValueError, match="not present"):  # what "Invalid run configuration" hides
        get_fused_config_from_dir(tmp_path, parse_config_args(["server-lr-typo=0.1"]))


def test_the_flower_deployment_uses_its_own_flower_home_and_stops_cleanly():
    """The deployment script of the docs: a FLWR_HOME of its own with a connection of its
    own name (not the `[superlink.local]` Flower writes into ~/.flwr), the connection
    `flwr run` names, and a trap that stops the script's whole process group."""
    import re
    import tomllib

    text = _flower_md()
    script = re.search(r"```bash\n#!/bin/bash\n# deploy\.sh.*?```", text, re.S).group(0)
    assert "trap 'kill 0' EXIT" in script
    assert 'export FLWR_HOME="$PWD/.flwr-deploy"' in script and "~/.flwr" not in script.split("TOML")[1]
    # unquoted heredoc: the shell writes the absolute path of the CA (Flower refuses a relative one)
    config = tomllib.loads(re.search(r"<<'?TOML'?\n(.*?)\nTOML\n", script, re.S).group(1))
    name = config["superlink"]["default"]
    assert name != "local" and config["superlink"][name]["address"] == "127.0.0.1:39091"
    assert config["superlink"][name]["root-certificates"] == "$PWD/certs/ca.crt"  # TLS: the way shown
    assert f"flwr run examples/flower_app {name} " in script
    assert "--port 39091" in script and "--superlink 127.0.0.1:39091" in script
    assert "[superlink.local]" not in script


# --------------------------------------------------------------------------- the table: a memory budget no chunk fits
def test_a_memory_budget_no_chunk_fits_is_said_with_the_numbers(capsys):
    from fedopt_kernels.cli import main

    argv = ["simulate", "--dataset", "synthetic-lazy", "--clients", "20000", "--per-round", "4", "--rounds", "1",
            "--local-steps", "1", "--memory-budget", "1M", "--no-plots", "--quiet", "--threads", "1", "--out"]
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        assert main([*argv, out]) == 0
        meta = json.loads((Path(out) / "results.json").read_text())["meta"]
    err = " ".join(capsys.readouterr().err.split())
    need = meta["memory_budget_needed"]
    assert need > 2 ** 20 and meta["round_chunk"] == 2
    assert (f"fedopt: warning: memory-budget 1,048,576 bytes is below what the smallest chunk needs: {need:,} bytes"
            in err), err
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a budget that fits: no word
        Simulation(SimulationConfig(dataset="digits", hidden=(8,), clients=8, per_round=4, memory_budget="64M"))


def test_a_flower_client_with_nonfinite_data_is_left_out_and_keeps_its_control_variate():
    """Item 1 on Flower: the FedNARClient's non-finite training sends a NaN model, which
    the strategy leaves out as ``nonfinite`` (not averaged in as a zero update); the
    round's train_loss is that of the other clients; its SCAFFOLD c_i stays zero."""
    pytest.importorskip("flwr")
    from flwr.clientapp import ClientApp
    from test_flower import LocalGrid

    from fedopt_kernels.fl import digits, iid_partition
    from fedopt_kernels.integrations import flower as fk

    ds = digits(seed=0)
    part = iid_partition(ds.num_train, 3, seed=0)

    def data_fn(context):
        pid = int(context.node_config["partition-id"])
        x = ds.x_train[part.client_indices[pid]].clone()
        if pid == 1:
            x[:, 0, 0, 0] = float("nan")
        return x, ds.y_train[part.client_indices[pid]]

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))

    client = fk.FedNARClient(lambda c: net(), data_fn)
    app = ClientApp()
    app.train()(client.train)
    grid = LocalGrid(app, 3, run_config={"local-steps": 2, "local-lr": 0.1})
    strategy = fk.FedAvg(net(), scaffold=True, fraction_evaluate=0.0, min_available_nodes=3, min_train_nodes=3)
    result = strategy.start(grid=grid, initial_arrays=fk.model_to_arrayrecord(net()), num_rounds=2)
    for r in (1, 2):
        m = result.train_metrics_clientapp[r]
        assert m["excluded_nonfinite"] == 1 and m["excluded_clients"] == 1, m
        assert math.isfinite(m["train_loss"])  # the clients that trained
    assert all(torch.isfinite(p).all() for p in strategy.model.parameters())
    state = grid.contexts[grid.nodes[1]].state
    from fedopt_kernels.integrations.flower.client import SCAFFOLD_STATE_KEY

    if SCAFFOLD_STATE_KEY in state:
        for arr in state[SCAFFOLD_STATE_KEY].values():
            assert np.array_equal(arr.numpy(), np.zeros_like(arr.numpy()))
