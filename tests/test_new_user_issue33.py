"""Issue 33: what a new user hit -- items 3, 4, 6, 7 and 8, each checked against values
written out here (the oracle), each failing before its fix."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from fedopt_kernels.fl import FederatedDataset, Results, Simulation, SimulationConfig

TINY = ["--dataset", "digits", "--hidden", "8", "--clients", "4", "--per-round", "2", "--rounds", "1",
        "--local-steps", "1", "--no-plots", "--quiet"]


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------------------- item 3
def test_results_json_records_the_threads_of_the_run(tmp_path, restore_threads):
    from fedopt_kernels.cli import main

    torch.set_num_threads(2)  # what the process had before --threads
    assert main(["simulate", *TINY, "--threads", "1", "--out", str(tmp_path / "a")]) == 0
    assert json.loads((tmp_path / "a" / "results.json").read_text())["meta"]["threads"] == 1
    torch.set_num_threads(1)
    assert main(["simulate", *TINY, "--threads", "2", "--out", str(tmp_path / "b")]) == 0
    assert json.loads((tmp_path / "b" / "results.json").read_text())["meta"]["threads"] == 2


# --------------------------------------------------------------------------- item 4
def test_results_write_and_plot_create_the_folder(tmp_path):
    res = Results({"dataset": "d"}, {"num_classes": 10}, None,
                  [{"round": 0, "test_accuracy": 0.1, "test_loss": 2.3},
                   {"round": 1, "test_accuracy": 0.5, "test_loss": 1.0, "train_loss": 1.2, "clip_frequency": 0.5,
                    "clipped_steps": 3, "mean_clipped_norm": 4.0}], "run")
    out = tmp_path / "fresh" / "results"
    paths = res.write(out)
    assert [p.name for p in paths] == ["results.json", "results.csv"] and all(p.is_file() for p in paths)
    assert json.loads(paths[0].read_text())["records"][1]["test_accuracy"] == 0.5
    assert all(p.is_file() for p in res.plot(tmp_path / "plots" / "here"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="exists and is not a folder"):
        res.write(tmp_path / "file")


# --------------------------------------------------------------------------- item 6
def _records(norms):
    recs = [{"round": 0, "test_accuracy": 0.1, "test_loss": 2.3}]
    for r, n in enumerate(norms, start=1):
        recs.append({"round": r, "test_accuracy": 0.2, "clipped_steps": 0 if n is None else 2,
                     "clip_frequency": 0.0 if n is None else 0.1, "mean_clipped_norm": n})
    return recs


def test_clipped_norm_has_gaps_where_nothing_was_clipped():
    res = Results({}, {}, None, _records([3.0, None, None, 5.0]), "r")
    rounds, norms = res.clipped_norm_series()
    assert rounds == [1, 2, 3, 4]
    assert norms[0] == 3.0 and norms[3] == 5.0 and math.isnan(norms[1]) and math.isnan(norms[2])


def test_clipping_plot_line_breaks_at_unclipped_rounds(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    drawn = {}
    real_close = plt.close

    def keep(fig=None):
        if fig is not None and hasattr(fig, "axes") and len(fig.axes) == 2:
            ax = fig.axes[1]
            if ax.get_ylabel() == "mean norm of clipped steps":
                drawn["line"] = ax.lines[0].get_xydata().tolist()
        return real_close(fig)

    monkeypatch.setattr(plt, "close", keep)
    Results({}, {}, None, _records([3.0, None, 5.0]), "r").plot(tmp_path)
    xy = drawn["line"]
    assert [p[0] for p in xy] == [1, 2, 3] and xy[0][1] == 3.0 and math.isnan(xy[1][1]) and xy[2][1] == 5.0


def test_server_plot_of_one_panel_is_as_wide_as_the_others(tmp_path):
    from PIL import Image

    recs = [{"round": 0, "test_accuracy": 0.1}] + [{"round": r, "gamma": 0.87, "test_accuracy": 0.1}
                                                    for r in range(1, 4)]
    res = Results({"nar": "co", "dataset": "digits", "clients": 20, "per_round": 10, "alpha": 0.3}, {}, None, recs,
                  "fedlaw")
    paths = {p.name: p for p in res.plot(tmp_path)}
    server, acc = Image.open(paths["server.png"]).size, Image.open(paths["accuracy_loss.png"]).size
    assert server[0] >= acc[0] > 1000  # 462 px before: the title did not fit


def test_busy_machine_note():
    from fedopt_kernels.cli.simulate import busy_note

    assert busy_note(2, load=3.6, cores=2).startswith("the machine is busy (load 3.6 on 2 core(s))")
    assert "--threads 1" in busy_note(2, load=3.6, cores=2)
    assert busy_note(2, load=0.3, cores=2) is None


# --------------------------------------------------------------------------- item 7
def test_compare_refuses_an_empty_algos(tmp_path, capsys):
    from fedopt_kernels.cli import main

    code = main(["compare", *TINY, "--algos", "", "--out", str(tmp_path / "c")])
    assert code == 2
    assert "--algos needs at least one algorithm" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()  # nothing ran, nothing written


class _Pairs(torch.utils.data.Dataset):
    def __init__(self, labels):
        self.labels = labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return torch.full((3,), float(i)), self.labels[i]


def test_from_datasets_refuses_labels_that_are_not_class_indices():
    ok = FederatedDataset.from_datasets(_Pairs([0, 1.0, torch.tensor(2), 1]), _Pairs([0, 1]))
    assert ok.y_train.tolist() == [0, 1, 2, 1] and ok.num_classes == 3
    with pytest.raises(ValueError, match=r"train\[1\] has label 1\.7; labels must be integer class indices"):
        FederatedDataset.from_datasets(_Pairs([0, 1.7, 2]), _Pairs([0, 1]))
    with pytest.raises(ValueError, match=r"test\[0\] has label 'cat'; labels must be integer class indices"):
        FederatedDataset.from_datasets(_Pairs([0, 1]), _Pairs(["cat", 1]))
    with pytest.raises(ValueError, match=r"train\[0\] has label -1"):
        FederatedDataset.from_datasets(_Pairs([-1, 1]), _Pairs([0, 1]))
    with pytest.raises(ValueError, match="num_classes=2 but a label is 2"):
        FederatedDataset.from_datasets(_Pairs([0, 2]), _Pairs([0, 1]), num_classes=2)


def test_register_model_refuses_what_is_not_callable():
    from fedopt_kernels.fl import model_names, register_dataset, register_model

    with pytest.raises(TypeError, match=r"register_model\('x', \.\.\.\): the factory must be callable.*int 3"):
        register_model("x", 3)
    with pytest.raises(TypeError, match="register_dataset"):
        register_dataset("x", "digits")
    assert "x" not in model_names()


@pytest.mark.parametrize("betas", [(0.9,), (0.9, 0.99, 0.999), 0.9, "ab"])
def test_adaptive_servers_refuse_betas_that_are_not_a_pair(betas):
    from fedopt_kernels.server import FedAdam, FedYogi

    for cls in (FedAdam, FedYogi):
        with pytest.raises(ValueError, match=r"betas must be a pair \(beta1, beta2\)"):
            cls(nn.Linear(2, 2).parameters(), betas=betas)


@pytest.mark.parametrize("betas", [(0.5,), 0.5, "ab", (0.5, "x")])
def test_fedlaw_refuses_betas_that_are_not_a_pair(betas):
    from fedopt_kernels.server import FedLAW

    with pytest.raises(ValueError, match=r"betas must be two numbers in \[0, 1\)"):
        FedLAW(nn.Linear(2, 2), [(torch.randn(4, 2), torch.tensor([0, 1, 0, 1]))], nn.CrossEntropyLoss(), betas=betas)


def test_a_model_with_the_wrong_number_of_outputs_is_refused():
    from fedopt_kernels.fl import ConfigError

    cfg = SimulationConfig(dataset="digits", clients=4, per_round=2, rounds=1, local_steps=1)
    with pytest.raises(ConfigError, match="the model gives 5 outputs per example but dataset 'digits' has 10"):
        Simulation(cfg, model=lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 5)))
    Simulation(cfg, model=lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 10)))  # fine
    # a loss of the user's own: their outputs, their business
    Simulation(cfg, model=lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 5)),
               loss_fn=lambda out, y: out.pow(2).mean())


def test_package_module_function_is_found_in_the_current_directory(tmp_path, monkeypatch):
    import sys

    from fedopt_kernels.fl.engine.models import build_model

    pkg = tmp_path / "mypkg33"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text("from torch import nn\n\ndef tiny(input_shape, num_classes):\n"
                                 "    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    model = build_model("mypkg33.nets:tiny", (8, 8), 10)
    assert model[1].out_features == 10
    monkeypatch.delitem(sys.modules, "mypkg33.nets")
    monkeypatch.delitem(sys.modules, "mypkg33")
    with pytest.raises(ValueError, match="cannot import module 'nopkg33.nets'.*current directory"):
        build_model("nopkg33.nets:tiny", (8, 8), 10)


# --------------------------------------------------------------------------- item 8
def _fedlaw_records(accs, gammas):
    recs = [{"round": 0, "test_accuracy": 0.1}]
    for r, (a, g) in enumerate(zip(accs, gammas), start=1):
        recs.append({"round": r, "test_accuracy": a, "gamma": g})
    return Results({"algo": "fedlaw"}, {"num_classes": 10}, None, recs, "fedlaw")


def test_a_collapse_under_gamma_is_named_in_the_summary():
    collapsed = _fedlaw_records([0.1004, 0.0965, 0.1004, 0.1042, 0.1004], [0.8798, 0.8783, 0.8728, 0.8708, 0.8700])
    note = collapsed.summary()["note"]
    assert note.startswith("the global model stayed at chance (best test accuracy 10.4%, chance 10.0%) while "
                           "gamma < 1 shrank it every round (mean gamma 0.874, last 0.870)")
    assert "--momentum 0.9" in note
    assert _fedlaw_records([0.1, 0.3, 0.6], [0.9, 0.9, 0.9]).summary()["note"] is None  # it learns
    assert _fedlaw_records([0.1, 0.1, 0.1], [0.9, 1.0, 0.9]).summary()["note"] is None  # gamma not < 1 throughout
    assert _fedlaw_records([0.1, 0.1], [0.9, 0.9]).summary()["note"] is None  # too few rounds to say


def test_the_collapse_note_reaches_the_screen(capsys):
    from fedopt_kernels.cli.simulate import print_summary

    print_summary([_fedlaw_records([0.1] * 3, [0.87] * 3)], "t")
    assert "note (fedlaw): the global model stayed at chance" in " ".join(capsys.readouterr().out.split())


# --------------------------------------------------------------------------- found on the way
def test_resume_without_checkpoint_says_why_when_results_are_there(tmp_path, capsys):
    from fedopt_kernels.cli import main

    (tmp_path / "results.json").write_text("{}")
    assert main(["simulate", "--resume", "--out", str(tmp_path)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"--resume: no checkpoint at {tmp_path / 'checkpoint.pt'} (results.json is there" in err
    assert "--checkpoint-every K" in err


@pytest.mark.parametrize("algo", ["fedadam", "asnes"])
def test_a_state_dict_kept_in_memory_does_not_follow_the_run(algo):
    """Simulation.state_dict() handed out the server optimizer's live state (Adam's
    moments, ASNES's momentum): a state kept in memory changed with the next round, and
    a simulation loaded from it then stepped from the wrong moments (3e-3 apart after
    one FedAdam round)."""
    import copy

    cfg = SimulationConfig(algo=algo, dataset="digits", hidden=(8,), clients=6, per_round=3, rounds=3,
                           local_steps=2, seed=0)
    a = Simulation(cfg)
    a.run_round()
    state = a.state_dict()
    frozen = copy.deepcopy(state)
    a.run_round()

    def tensors(v):
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, dict):
            for x in v.values():
                yield from tensors(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                yield from tensors(x)

    kept, then = list(tensors(state["server"])), list(tensors(frozen["server"]))
    assert kept and len(kept) == len(then)
    assert all(torch.equal(k, t) for k, t in zip(kept, then))
    b = Simulation(cfg)
    b.load_state_dict(state)
    b.run_round()
    assert torch.equal(a.x_global, b.x_global)
