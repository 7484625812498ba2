"""The fedopt command line: error paths (one line, no traceback), output files, TOML, Ctrl-C, resume."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedopt_kernels.cli import main
from fedopt_kernels.fl import Simulation

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--clients", "8", "--per-round", "3", "--local-steps", "5", "--hidden", "32", "--quiet"]


@pytest.fixture(autouse=True)
def restore_threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def _error(capsys, argv, code=2):
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == code, (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("fedopt: error: ")
    assert "Traceback" not in out + err
    return lines[0]


@pytest.mark.parametrize("argv, needle", [
    (["simulate", "--algo", "fedfoo"], "unknown algo 'fedfoo'"),
    (["simulate", "--dataset", "imagenet"], "unknown dataset 'imagenet'"),
    (["simulate", "--nar", "clip"], "unknown nar 'clip'"),
    (["simulate", "--clients", "5", "--per-round", "6"], "per-round (6) cannot exceed clients (5)"),
    (["simulate", "--alpha", "0"], "alpha must be > 0"),
    (["simulate", "--alpha", "-1"], "alpha must be > 0"),
    (["simulate", "--rounds", "0"], "rounds must be >= 1"),
    (["simulate", "--lr", "-0.1"], "lr must be >= 0"),
    (["simulate", "--rounds", "many"], "argument --rounds: invalid int value"),
    (["simulate", "--engine", "vectorised"], "unknown engine 'vectorised'"),
    (["simulate", "--client-batch", "-1"], "client-batch must be >= 0"),
    (["simulate", "--clients", "5000"], "cannot split"),
    (["simulate", "--no-such-flag"], "unrecognized arguments"),
    (["simulate", "--weighting", "loss"], "unknown weighting 'loss'; choose one of auto, size, uniform"),
    (["simulate", "--proxy-source", "val"], "unknown proxy-source 'val'; choose one of test, train"),
    (["simulate", "--algo", "fedlaw", "--proxy-size", "5000"], "proxy-size 5000 takes all"),
    (["compare", "--algos", "fedavg,fedbar"], "unknown algorithm 'fedbar'"),
    (["compare", "--algos", "fedavg:clip"], "unknown nar mode 'clip'"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, argv, needle):
    line = _error(capsys, argv + ["--out", str(tmp_path / "o")] if argv[0] in ("simulate", "compare") else argv)
    assert needle in line


def test_unwritable_output_directory(capsys, tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    line = _error(capsys, ["simulate", "--rounds", "1", "--out", str(blocker / "sub")] + FAST)
    assert "output directory" in line and str(blocker / "sub") in line
    line = _error(capsys, ["simulate", "--rounds", "1", "--out", str(blocker)] + FAST)
    assert "not a directory" in line


def test_malformed_and_bad_config_files(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("algo = 'fedavg'\nrounds = = 3\n")
    assert "not valid TOML" in _error(capsys, ["simulate", "--config", str(bad)])
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("algo = 'fedavg'\nlearning_rate = 0.1\n")
    line = _error(capsys, ["simulate", "--config", str(unknown)])
    assert "unknown setting 'learning_rate'" in line and str(unknown) in line
    wrong_type = tmp_path / "type.toml"
    wrong_type.write_text("rounds = 'ten'\n")
    assert "rounds must be an integer" in _error(capsys, ["simulate", "--config", str(wrong_type)])
    assert "does not exist" in _error(capsys, ["simulate", "--config", str(tmp_path / "missing.toml")])


def test_real_subprocess_error_has_no_traceback(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "fedopt_kernels", "simulate", "--algo", "nope", "--out",
                        str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "fedopt: error: unknown algo 'nope'; choose one of fedavg, fedprox, scaffold, fedavgm, fedadam, fedyogi, "
        "fedadagrad, fedexp, asnes, fedlaw"]
    assert "Traceback" not in p.stdout + p.stderr


def test_simulate_writes_readable_files(capsys, tmp_path):
    out = tmp_path / "run"
    rc = main(["simulate", "--algo", "asnes", "--nar", "co", "--rounds", "3", "--out", str(out)] + FAST)
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    assert [r["round"] for r in data["records"]] == [0, 1, 2, 3]
    assert data["config"]["algo"] == "asnes" and data["summary"]["rounds"] == 3
    assert data["records"][-1]["test_accuracy"] > data["records"][0]["test_accuracy"]
    assert all(r["gain_ratio"] >= 1 for r in data["records"][1:])
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == 4 and float(rows[-1]["test_accuracy"]) == pytest.approx(data["records"][-1]["test_accuracy"],
                                                                                rel=1e-5)
    for name in ("accuracy_loss.png", "clipping.png", "server.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["round"] == 3
    printed = capsys.readouterr().out
    assert f"{100 * data['records'][-1]['test_accuracy']:.2f}%" in printed and "asnes" in printed


def test_toml_config_with_flag_override(tmp_path):
    out = tmp_path / "toml-run"
    cfg = tmp_path / "run.toml"
    cfg.write_text(f"""
algo = "fedprox"
prox-mu = 0.1
nar = "grad"
clients = 8
per_round = 3
rounds = 5
local-steps = 5
hidden = [16]
seed = 3
out = "{out.as_posix()}"
""")
    assert main(["simulate", "--config", str(cfg), "--rounds", "2", "--quiet", "--no-plots"]) == 0
    data = json.loads((out / "results.json").read_text())
    c = data["config"]
    assert (c["algo"], c["nar"], c["prox_mu"], c["seed"], c["hidden"]) == ("fedprox", "grad", 0.1, 3, [16])
    assert c["rounds"] == 2 and data["summary"]["rounds"] == 2  # the flag overrides the file
    assert not (out / "accuracy_loss.png").exists()


def test_ctrl_c_leaves_readable_results_and_resume_continues(tmp_path, monkeypatch, capsys):
    out = tmp_path / "interrupted"
    real = Simulation.run_round

    def interrupt_after_two(self):
        if self.round == 2:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(Simulation, "run_round", interrupt_after_two)
    rc = main(["simulate", "--algo", "scaffold", "--rounds", "5", "--out", str(out)] + FAST)
    assert rc == 130
    data = json.loads((out / "results.json").read_text())
    assert [r["round"] for r in data["records"]] == [0, 1, 2]
    assert data["meta"]["interrupted"] is True and data["summary"]["interrupted"] is True
    assert (out / "accuracy_loss.png").exists()
    printed = " ".join(capsys.readouterr().out.split())
    assert "interrupted (SIGINT) after 2 of 5 rounds" in printed and "--resume" in printed
    assert data["meta"]["interrupted_by"] == "SIGINT"

    monkeypatch.setattr(Simulation, "run_round", real)
    assert main(["simulate", "--resume", "--out", str(out), "--quiet", "--no-plots"]) == 0
    resumed = json.loads((out / "results.json").read_text())
    assert [r["round"] for r in resumed["records"]] == [0, 1, 2, 3, 4, 5]
    full = tmp_path / "full"
    assert main(["simulate", "--algo", "scaffold", "--rounds", "5", "--out", str(full), "--no-plots"] + FAST) == 0
    uninterrupted = json.loads((full / "results.json").read_text())
    strip = lambda recs: [{k: v for k, v in r.items() if k != "wall_time"} for r in recs]  # noqa: E731
    assert strip(resumed["records"]) == strip(uninterrupted["records"])


def test_resume_without_checkpoint_is_one_line(capsys, tmp_path):
    assert "no checkpoint" in _error(capsys, ["simulate", "--resume", "--out", str(tmp_path)])


def test_compare_same_clients_one_plot_one_table(tmp_path, capsys):
    out = tmp_path / "cmp"
    rc = main(["compare", "--algos", "fedavg:grad,fedavg:co,fedexp", "--rounds", "2", "--out", str(out)] + FAST)
    assert rc == 0
    data = json.loads((out / "compare.json").read_text())
    assert [r["label"] for r in data["runs"]] == ["fedavg:grad", "fedavg:co", "fedexp"]
    clients = [[r["clients"] for r in run["records"]] for run in data["runs"]]
    assert clients[0] == clients[1] == clients[2]
    assert len({json.dumps(run["partition"]["sizes"]) for run in data["runs"]}) == 1
    assert [run["config"]["nar"] for run in data["runs"]] == ["grad", "co", "co"]
    rows = list(csv.DictReader((out / "compare.csv").open()))
    assert [r["label"] for r in rows] == ["fedavg:grad", "fedavg:co", "fedexp"]
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "fedavg_co" / "results.json").exists()
    printed = capsys.readouterr().out
    assert all(f"{100 * s['final_accuracy']:.2f}%" in printed for s in data["summary"])


def test_weighting_and_proxy_flags_reach_results_json(tmp_path):
    out = tmp_path / "w"
    assert main(["simulate", "--algo", "fedavg", "--weighting", "uniform", "--rounds", "1", "--out", str(out)]
                + FAST) == 0
    assert json.loads((out / "results.json").read_text())["meta"]["weighting"] == "uniform"
    out = tmp_path / "p"
    assert main(["simulate", "--algo", "fedlaw", "--proxy-source", "train", "--fedlaw-epochs", "1", "--rounds", "1",
                 "--out", str(out)] + FAST) == 0
    meta = json.loads((out / "results.json").read_text())["meta"]
    assert meta["weighting"] == "size" and meta["proxy"]["source"] == "train" and not meta["proxy"]["held_out_of_test"]


def test_compare_with_fedlaw_scores_every_run_on_the_same_test_examples(tmp_path):
    """[FedLAW] D.2: the proxy set is taken from the test set and "the remaining data in
    the testset" tests all compared methods."""
    out = tmp_path / "cmp"
    rc = main(["compare", "--algos", "fedavg,fedlaw,asnes", "--fedlaw-epochs", "1", "--rounds", "1", "--out", str(out)]
              + FAST)
    assert rc == 0
    runs = json.loads((out / "compare.json").read_text())["runs"]
    assert [r["meta"]["weighting"] for r in runs] == ["size", "size", "uniform"]
    assert len({r["meta"]["num_test"] for r in runs}) == 1
    assert all(r["meta"]["proxy"]["held_out_of_test"] for r in runs)
    assert runs[0]["meta"]["num_test"] == 359 - 100  # digits' test split less the proxy set


def test_compare_interrupted_keeps_finished_runs(tmp_path, monkeypatch):
    out = tmp_path / "cmp"
    real = Simulation.run_round
    calls = {"n": 0}

    def interrupt_in_second_run(self):
        calls["n"] += 1
        if calls["n"] == 4:  # run 1 does rounds 1-2, run 2 stops after its round 1
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(Simulation, "run_round", interrupt_in_second_run)
    assert main(["compare", "--algos", "fedavg,fedadam", "--rounds", "2", "--out", str(out)] + FAST) == 130
    data = json.loads((out / "compare.json").read_text())
    assert [s["rounds"] for s in data["summary"]] == [2, 1]
    assert [s["interrupted"] for s in data["summary"]] == [False, True]


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "reference" in out and "torch" in out and "flwr" in out
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    ref = [r for r in info["backends"] if r["backend"] == "reference"]
    assert all(r["available"] for r in ref)
    assert all(r["reason"] for r in info["backends"] if not r["available"])


def test_bench_runs_the_suite(monkeypatch, capsys):
    from fedopt_kernels.benchmarks import suite

    seen = {}

    def fake_run(**kw):
        seen.update(kw)
        return [{"benchmark": "nar_step", "case": "fused", "ms": 1.5, "vs floor": 0.9, "time / fused": 1.0}]

    monkeypatch.setattr(suite, "run", fake_run)
    assert main(["bench", "--quick", "--only", "nar_step", "--device", "cpu"]) == 0
    assert seen["quick"] is True and seen["only"] == ("nar_step",)
    assert "fused" in capsys.readouterr().out


def test_help_and_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--help"])
    assert exc.value.code == 0
    assert "--per-round" in capsys.readouterr().out
    assert main([]) == 2


def test_user_dataset_and_model_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_fl_plugin.py").write_text('''
import torch
from fedopt_kernels.fl import FederatedDataset

def make_data(seed, num_clients):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(6, 3, generator=g)
    x = torch.randn(400, 6, generator=g)
    y = (x @ w).argmax(1)
    return FederatedDataset("blobs", x[:300], y[:300], x[300:], y[300:], 3)

def make_model(input_shape, num_classes):
    return torch.nn.Sequential(torch.nn.Linear(input_shape[0], 8), torch.nn.ReLU(), torch.nn.Linear(8, num_classes))
''')
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "plugin-run"
    rc = main(["simulate", "--dataset", "my_fl_plugin:make_data", "--model", "my_fl_plugin:make_model",
               "--clients", "5", "--per-round", "2", "--rounds", "3", "--lr", "0.2", "--alpha", "1",
               "--quiet", "--no-plots", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["dataset"] == "blobs" and data["meta"]["num_parameters"] == 6 * 8 + 8 + 8 * 3 + 3
    assert data["records"][-1]["test_accuracy"] > data["records"][0]["test_accuracy"]


def test_missing_plugin_and_cifar10_without_torchvision_are_one_line(capsys, tmp_path):
    assert "cannot import module 'no_such_module'" in _error(
        capsys, ["simulate", "--dataset", "no_such_module:f", "--out", str(tmp_path)])
    assert "has no 'nope'" in _error(capsys, ["simulate", "--model", "json:nope", "--out", str(tmp_path)])
    try:
        import torchvision  # noqa: F401
    except ImportError:
        assert "needs torchvision" in _error(capsys, ["simulate", "--dataset", "cifar10", "--out", str(tmp_path)])
