"""``fedopt selftest``: passes on a healthy install, names a faulty kernel (and a faulty
python_ref) with exit status 1 and a bug-report block, rejects bad arguments with 2.

The faults are injected by replacing one backend function with a wrapper that is
wrong by a known amount; every other row of the same run must still pass, so the
tests also show that a failure is attributed to the right op and backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import require_backend
from fedopt_kernels import backends, ops
from fedopt_kernels.cli import main
from fedopt_kernels.cli._selftest_report import BUG_REPORT_HEADER

ROOT = Path(__file__).resolve().parents[1]
PUBLIC_OPS = {"nar_step_", "nar_step_groups_", "nar_step_batched_", "aggregate", "client_dots", "weighted_sum",
              "server_update_"}
# On a machine with CUDA the suite runs compiled Triton kernels (conftest), and a
# --device cpu run in this process would switch it to Triton's interpreter for good:
# there, in-process runs leave Triton out (the subprocess test below covers it).
IN_PROCESS = ["--backends", "reference,cpu"] if torch.cuda.is_available() else []


def _cpu_backends():
    """What ``--device cpu`` must check here: reference and cpu always (a build without
    the CPU extension fails the suite), triton when its interpreter is on (conftest sets
    TRITON_INTERPRET=1 on a machine without a GPU)."""
    require_backend("cpu")
    names = ["reference", "cpu"]
    if backends.why_unavailable("triton", torch.device("cpu")) is None:
        names.append("triton")
    return names


def _selftest(capsys, tmp_path, *args):
    path = tmp_path / "selftest.json"
    rc = main(["selftest", "--device", "cpu", "--json", str(path), *args])
    out, err = capsys.readouterr()
    return rc, json.loads(path.read_text()), out, err


def _failing(doc):
    return {(r["op"], r["backend"]) for r in doc["results"] if r["status"] == "FAIL"}


def _selftest_with_lr_off(capsys, tmp_path, monkeypatch, backend):
    """The quick selftest of reference and cpu with ``backend``'s nar_step_ taking an lr
    1% too large."""
    require_backend("cpu")
    impl = backends.resolve(backend, torch.device("cpu"))
    real = impl.nar_step_

    def lr_off_by_one_percent(params, grads, bufs, lr, lr_tensor, *rest):  # either half of the lr pair
        return real(params, grads, bufs, lr * 1.01, None if lr_tensor is None else lr_tensor * 1.01, *rest)

    monkeypatch.setattr(impl, "nar_step_", lr_off_by_one_percent)
    return _selftest(capsys, tmp_path, "--backends", "reference,cpu", "--quick")


@pytest.fixture(scope="module")
def healthy_run(tmp_path_factory):
    """One full ``fedopt selftest --device cpu`` run (about 15 s here), shared."""
    path = tmp_path_factory.mktemp("selftest") / "selftest.json"
    rc = main(["selftest", "--device", "cpu", "--json", str(path), *IN_PROCESS])
    return rc, json.loads(path.read_text())


def test_every_op_on_every_cpu_backend_passes(healthy_run):
    rc, doc = healthy_run
    assert rc == 0 and doc["exit_status"] == 0
    results = doc["results"]
    bad = [(r["op"], r["backend"], r["case"], r["errors"]) for r in results if r["status"] == "FAIL"]
    assert not bad
    for name in _cpu_backends():
        rows = [r for r in results if r["backend"] == name]
        ops_seen = {r["op"] for r in rows if r["status"] == "PASS"}
        assert PUBLIC_OPS | {"torch.compile"} <= ops_seen, (name, PUBLIC_OPS - ops_seen)
        # every row compared something, and every rule of the ops layer has its row
        assert all(r["comparisons"] > 0 for r in rows if r["status"] == "PASS")
        rules = {r["case"].split(":")[0] for r in rows if r["op"] == "server_update_"}
        assert {f"rule {rule}" for rule in ops.RULES} <= rules
    # CUDA graphs cannot be checked without CUDA: reported, never passed
    graphs = [r for r in results if r["op"] == "cuda graph"]
    if "triton" in _cpu_backends():
        assert graphs and all(r["status"] == "SKIP" and r["reason"] == "n/a (no CUDA)" for r in graphs)
    if not IN_PROCESS:  # the cuda backend cannot run on CPU tensors: one SKIP row saying why
        cuda_rows = [r for r in results if r["backend"] == "cuda"]
        assert len(cuda_rows) == 1 and cuda_rows[0]["status"] == "SKIP" and "CUDA tensors" in cuda_rows[0]["reason"]
    env = doc["env"]
    assert env["torch"] == torch.__version__ and env["device"] == "cpu"
    assert env["extensions"]["cpu"]["built"] is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_op_on_every_cuda_backend_passes(tmp_path):
    """Where there is a GPU: the selftest's default device, every backend that runs
    there (reference on CUDA tensors, cuda, triton compiled), CUDA graphs included."""
    path = tmp_path / "selftest.json"
    rc = main(["selftest", "--device", "cuda", "--json", str(path)])
    doc = json.loads(path.read_text())
    assert rc == 0, [(r["op"], r["backend"], r["errors"]) for r in doc["results"] if r["status"] == "FAIL"]
    for name in ("reference", "cuda", "triton"):
        if backends.why_unavailable(name, torch.device("cuda")) is None:
            ops_seen = {r["op"] for r in doc["results"] if r["backend"] == name and r["status"] == "PASS"}
            assert PUBLIC_OPS | {"torch.compile"} <= ops_seen, (name, PUBLIC_OPS - ops_seen)
            if name != "reference":
                assert "cuda graph" in ops_seen
    assert doc["env"]["gpus"] and doc["env"]["gpus"][0]["capability"]


def test_the_rows_report_errors_within_their_tolerance(healthy_run):
    """The reported numbers are real: fp16 rows differ from the exact value by about an
    ulp (not 0: the fp64 formula is a different computation), within the tolerance."""
    _, doc = healthy_run
    row = next(r for r in doc["results"] if r["op"] == "nar_step_" and r["backend"] == "cpu"
               and r["case"].startswith("4 dtypes"))
    assert 0 < row["max_abs_err"] <= 2e-2 and row["tolerance"].startswith("rtol=")


def test_a_kernel_with_a_wrong_lr_fails_its_row_only(capsys, tmp_path, monkeypatch):
    rc, doc, out, _ = _selftest_with_lr_off(capsys, tmp_path, monkeypatch, "cpu")
    assert rc == 1 and doc["exit_status"] == 1
    assert _failing(doc) == {("nar_step_", "cpu")}
    row = next(r for r in doc["results"] if r["status"] == "FAIL")
    assert row["case"].startswith("4 dtypes")  # the NaN-skip row of the same op still passes
    assert any("vs fp64 formula" in e for e in row["errors"]) and any("vs python_ref" in e for e in row["errors"])
    report = out[out.index(BUG_REPORT_HEADER):]
    assert "FAIL  nar_step_  backend=cpu" in report and f"torch             {torch.__version__}" in report
    assert "aggregate" not in report  # only failing rows go into the report


def test_an_aggregation_that_drops_a_client_fails_aggregate_and_weighted_sum(capsys, tmp_path, monkeypatch):
    require_backend("cpu")
    cpu = backends.resolve("cpu", torch.device("cpu"))
    real = cpu.aggregate

    def drops_the_last_client(clients, weights, *rest):
        weights = weights.clone()
        weights[-1] = 0
        return real(clients, weights, *rest)

    monkeypatch.setattr(cpu, "aggregate", drops_the_last_client)
    rc, doc, out, _ = _selftest(capsys, tmp_path, "--backends", "reference,cpu", "--quick")
    assert rc == 1
    # weighted_sum's forward is the aggregation kernel; client_dots is not touched
    assert _failing(doc) == {("aggregate", "cpu"), ("weighted_sum", "cpu")}
    assert all(r["status"] == "PASS" for r in doc["results"] if r["backend"] == "reference")
    report = out[out.index(BUG_REPORT_HEADER):]
    assert "FAIL  aggregate  backend=cpu" in report and "FAIL  weighted_sum  backend=cpu" in report
    assert "out " in report  # the failing comparison is named


def test_a_codec_kernel_that_drops_a_client_or_rounds_wrong_fails_the_compressed_rows(capsys, tmp_path,
                                                                                       monkeypatch):
    """The codec rows compare real values: a CPU decode-aggregate that drops the last
    client and a CPU encode whose scales are 1% off each fail their own row, on the CPU
    backend only (the reference rows still pass)."""
    require_backend("cpu")
    from fedopt_kernels.backends import compressed as table

    agg, quant = table._BLOCK["cpu"], table._QUANTIZE["cpu"]

    def drops_the_last_client(codes, scales, kind, block, numel, weights, *rest):
        weights = weights.clone()
        weights[-1] = 0
        return agg(codes, scales, kind, block, numel, weights, *rest)

    def scales_off(*args):
        codes, scales = quant(*args)
        return codes, scales * 1.01

    monkeypatch.setitem(table._BLOCK, "cpu", drops_the_last_client)
    monkeypatch.setitem(table._QUANTIZE, "cpu", scales_off)
    rc, doc, _, _ = _selftest(capsys, tmp_path, "--backends", "reference,cpu", "--quick")
    assert rc == 1
    assert _failing(doc) == {("compressed decode_aggregate", "cpu"), ("compressed encode", "cpu")}
    errors = {r["op"]: r["errors"] for r in doc["results"] if r["status"] == "FAIL"}
    assert any(e.startswith("out int8") and "vs fp64 decode" in e for e in errors["compressed decode_aggregate"])
    assert any("vs python_ref" in e for e in errors["compressed encode"])
    assert any("vs max|x|/qmax" in e for e in errors["compressed encode"])


def test_a_wrong_python_ref_is_caught_by_the_fp64_formula(capsys, tmp_path, monkeypatch):
    """A python_ref bug fails the reference backend against the fp64 formula, and the
    correct kernels against python_ref only -- which says where the bug is."""
    rc, doc, _, _ = _selftest_with_lr_off(capsys, tmp_path, monkeypatch, "reference")
    assert rc == 1
    assert _failing(doc) == {("nar_step_", "reference"), ("nar_step_", "cpu")}
    errors = {r["backend"]: r["errors"] for r in doc["results"] if r["status"] == "FAIL"}
    assert errors["reference"] and all("vs fp64 formula" in e for e in errors["reference"])
    assert errors["cpu"] and all("vs python_ref" in e for e in errors["cpu"])


def test_an_exception_in_a_check_is_a_failed_row_and_the_run_goes_on(capsys, tmp_path, monkeypatch):
    require_backend("cpu")
    cpu = backends.resolve("cpu", torch.device("cpu"))

    def broken(*args):
        raise RuntimeError("kernel launch failed")

    monkeypatch.setattr(cpu, "client_dots", broken)
    rc, doc, out, _ = _selftest(capsys, tmp_path, "--backends", "cpu", "--quick")
    assert rc == 1
    # weighted_sum's backward calls client_dots too
    assert _failing(doc) == {("client_dots", "cpu"), ("weighted_sum", "cpu")}
    row = next(r for r in doc["results"] if r["op"] == "client_dots")
    assert row["errors"][0].startswith("RuntimeError: kernel launch failed")
    assert sum(r["status"] == "PASS" for r in doc["results"]) >= 10
    assert "RuntimeError: kernel launch failed" in out[out.index(BUG_REPORT_HEADER):]


@pytest.mark.slow
def test_python_m_selftest_on_cpu_exits_0(tmp_path):
    """A fresh process without TRITON_INTERPRET: the selftest sets it for --device cpu."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-m", "fedopt_kernels", "selftest", "--device", "cpu"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "0 failed" in p.stdout and BUG_REPORT_HEADER not in p.stdout
    if torch.version.cuda is not None:  # triton ships with CUDA builds of torch
        assert "set to 1 by fedopt selftest" in p.stdout
        assert [ln for ln in p.stdout.splitlines() if ln.startswith("nar_step_ ") and " triton " in ln
                and " PASS " in ln]


@pytest.mark.parametrize("argv, needle", [
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--backends", "numpy"], "--backends: unknown backend 'numpy'"),
    (["--backends", ","], "--backends: no backend named"),
    (["--device", "cpu", "--backends", "cuda"], "--backends cuda cannot run with --device cpu"),
    (["--json", "/nonexistent-dir/x.json"], "--json /nonexistent-dir/x.json: the directory"),
])
def test_bad_arguments_exit_2_naming_the_argument(capsys, argv, needle):
    rc = main(["selftest", *argv])
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert err.startswith("fedopt: error: ") and needle in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_exits_2(capsys):
    assert main(["selftest", "--device", "cuda"]) == 2
    assert "--device cuda: torch.cuda.is_available() is False" in capsys.readouterr().err
