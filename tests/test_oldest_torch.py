"""The oldest torch the package declares is the oldest it builds and tests against.

setup.py declares ``torch>=2.11`` (TORCH_ANY): 2.11 is the torch of the GPU machines
this project is checked on (offline, with their own torch 2.11 + triton 3.6), so a bug
that only 2.11 has costs a whole lease.  This slow tier builds the package against
``torch==2.11.0`` in its own virtual environment and runs there:

* ``scripts/device-check.sh`` as a dry run: without a GPU every GPU step is SKIP, the
  CPU parts (environment, the build of both C++ extensions -- the CUDA one for sm_90,
  compile-only -- and ``fedopt info``) pass, and the script exits 0 within its budget;
* the backend contract suites (the compiled and Triton backends against python_ref;
  Triton in triton 3.6's interpreter; the DP noise's bits included) and the
  interpreter fixes they need there (tests/test_triton_interpreter_compat.py).  The reference backend's cases are left
  out here: that backend is python_ref behind the contract's argument form
  (backends/reference.py), and python_ref itself runs under torch 2.11 as the oracle
  of every other case; the selftest below runs the reference backend's own rows;
* ``fedopt selftest --device cpu``;
* ``tests/test_triton_aot.py``: every Triton kernel compiled ahead of time for sm_80
  and sm_90 by triton 3.6, with no spills.

The environment (``.venv-torch2.11``, ignored by git) is kept between runs as ``.venv``
is; the package is built in place in a copy of the working tree under it
(``.venv-torch2.11/src``), synced file by file, so an unchanged tree rebuilds nothing.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
OLDEST = "2.11.0"
VENV = ROOT / f".venv-torch{OLDEST.rsplit('.', 1)[0]}"
SRC = VENV / "src"
PY = VENV / "bin" / "python"
STAMP = VENV / ".fedopt-oldest-torch"
# The GPU machines' own stack: the torch under test and its triton, numpy, scikit-learn,
# rich, matplotlib, pytest and pytest-xdist -- and, to build, setuptools (torch's own
# dependency on Python >= 3.12) and wheel.  No ninja: they have none, and the build must
# then compile in parallel by itself (setup.py parallel_compile).
PACKAGES = ["setuptools>=64,<82", "wheel", "numpy", "scikit-learn", "rich", "matplotlib", "pytest>=8",
            "pytest-xdist>=3.5"]
# torch 2.11.0's own requirements (its METADATA) but its CUDA runtime wheels: those are
# taken from the outer environment (see _share_cuda_runtime).
TORCH = [f"torch=={OLDEST}", "triton==3.6.0"]
TORCH_REQUIRES = ["filelock", "typing-extensions>=4.10.0", "sympy>=1.13.3", "networkx>=2.5.1", "jinja2",
                  "fsspec>=0.8.5", "cuda-bindings>=13.0.3,<14"]
GPU_STEPS = ["selftest", "pytest-gpu", "sanitizer-memcheck", "gpu-harness", "bench", "bench-triton"]
# What the set-up needs on the disk at most (downloads and unpacked, measured: 2.2 GB
# after, ~3 GB at its peak); checked first, so that a full disk fails with this message
# instead of pip's OSError half-way through.
DISK_NEEDED = 4 << 30


def _env(**extra) -> dict:
    """This process's environment without what the outer pytest put in it."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "TRITON_INTERPRET", "FEDOPT_BACKEND", "VIRTUAL_ENV"))}
    env["PYTHONPATH"] = str(SRC)
    env["PATH"] = f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def _site_packages(python) -> Path:
    res = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True, timeout=60)
    return Path(res.stdout.strip())


def _share_cuda_runtime() -> None:
    """Point the new environment's ``nvidia`` package folder at the outer environment's.

    torch 2.11.0 on PyPI requires the CUDA 13.0 runtime as wheels (cuDNN, cuBLAS, NCCL,
    cuSPARSELt, NVSHMEM, ...: 2.7 GB unpacked, ~1.8 GB to download) and finds them through
    the RUNPATH ``$ORIGIN/../../nvidia/...`` of its libraries.  The outer environment's
    torch 2.14.1+cu130 brings the same libraries, a few minor releases newer under the
    same sonames (cuDNN 9, cuBLAS 13, NCCL 2, ...), which the CUDA 13 ABI keeps
    compatible.  On this machine they are only loaded, never called (there is no GPU),
    and the C++ extensions link against CUDA_HOME, not against these wheels; what this
    tier checks -- that the package builds, imports and runs on torch 2.11 and triton
    3.6 -- is the same with either copy, and the set-up needs 4.5 GB less disk (a CI
    run once ran out of it installing the second copy)."""
    shared = _site_packages(sys.executable) / "nvidia"
    assert shared.is_dir(), (f"{shared}: the outer environment has no CUDA runtime wheels to share (a CPU build "
                             f"of torch?); make test runs in .venv, which `make setup` fills with torch 2.14.1+cu130")
    link = _site_packages(PY) / "nvidia"
    if link.is_symlink() or not link.exists():
        link.unlink(missing_ok=True)
        link.symlink_to(shared, target_is_directory=True)


def _ensure_venv() -> None:
    want = "\n".join([*TORCH, *TORCH_REQUIRES, *PACKAGES, "nvidia -> outer environment"])
    if PY.exists() and STAMP.exists() and STAMP.read_text() == want:
        _share_cuda_runtime()  # the outer environment may have been made again
        return
    free = shutil.disk_usage(ROOT).free
    assert free >= DISK_NEEDED, (f"{ROOT}: {free / 2**30:.1f} GiB free; setting up {VENV.name} "
                                 f"(torch {OLDEST}) needs {DISK_NEEDED / 2**30:.0f} GiB")
    if not PY.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True, timeout=300)
    # --no-compile: pip would byte-compile every module of torch, triton, sympy, ... (26 of
    # the set-up's 42 s here, measured); Python compiles, and caches, the few hundred that
    # the runs below import, on first import.
    pip = [str(PY), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-cache-dir",
           "--no-compile"]
    for args in ([*pip, "--no-deps", *TORCH], [*pip, *TORCH_REQUIRES, *PACKAGES]):
        res = subprocess.run(args, capture_output=True, text=True, timeout=1800)
        assert res.returncode == 0, f"{' '.join(args[3:])} into {VENV}:\n{res.stdout[-3000:]}{res.stderr[-3000:]}"
    _share_cuda_runtime()
    STAMP.write_text(want)


def _source_files() -> list:
    """The working tree as git sees it: tracked files and untracked ones not ignored."""
    res = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True, timeout=60)
    return sorted({p for p in res.stdout.decode().split("\0") if p and (ROOT / p).is_file()})


def _sync_tree() -> None:
    """Copy the working tree into SRC, only files whose bytes changed, and remove files
    copied earlier that the tree no longer has.  The build there runs without ninja (as
    on the GPU machines), and distutils rebuilds an extension only when one of its
    sources is newer than it -- not when a header is -- so any change to the C++ side
    removes the built extensions: the next build compiles them whole."""
    manifest = SRC / ".synced-files"
    before = set(manifest.read_text().split("\n")) - {""} if manifest.exists() else set()
    files = _source_files()
    changed = []
    for rel in files:
        src, dst = ROOT / rel, SRC / rel
        if not dst.exists() or not filecmp.cmp(src, dst, shallow=False):
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)  # a new mtime: newer than anything built from it
            shutil.copymode(src, dst)
            changed.append(rel)
    gone = before - set(files)
    for rel in gone:
        (SRC / rel).unlink(missing_ok=True)
    if any(rel.startswith("csrc/") or rel == "setup.py" for rel in [*changed, *gone]):
        for built in (SRC / "fedopt_kernels").glob("_C*.so"):
            built.unlink()
    manifest.write_text("\n".join(files))


def _hide_ninja(tmp: Path) -> str:
    """A PATH entry whose ``ninja`` fails: torch then finds no ninja, as on the GPU
    machines (this one may have a system ninja), and the build takes setup.py's
    parallel distutils path."""
    shim = tmp / "no-ninja"
    shim.mkdir(exist_ok=True)
    (shim / "ninja").write_text("#!/bin/sh\nexit 127\n")
    (shim / "ninja").chmod(0o755)
    return str(shim)


@pytest.fixture(scope="module")
def oldest(tmp_path_factory):
    """Set up (or reuse) the torch-2.11 environment and source copy, then run the
    device check there, which builds both extensions in place; returns its results."""
    _ensure_venv()
    SRC.mkdir(parents=True, exist_ok=True)
    _sync_tree()
    out = tmp_path_factory.mktemp("device-check")
    # 2 cores build what 16 build on a GPU machine: a longer deadline, the same steps.
    # -g0 after Python's -g (as tests/test_wheel.py builds): no debug info in the C++
    # objects, GCC's code and diagnostics are the same without it (this checks that the
    # extensions compile and link against 2.11), and the C++ compiles take less time.
    env = _env(PYTHON=str(PY), DEVICE_CHECK_CUDA_ARCH="9.0", DEVICE_CHECK_BUDGET="2400",
               DEVICE_CHECK_BUILD_TIMEOUT="2100", CFLAGS=(os.environ.get("CFLAGS", "") + " -g0").strip())
    env["PATH"] = _hide_ninja(tmp_path_factory.mktemp("path")) + os.pathsep + env["PATH"]
    res = subprocess.run(["bash", "scripts/device-check.sh", str(out)], cwd=SRC, env=env, capture_output=True,
                         text=True, timeout=2700)
    return dict(rc=res.returncode, stdout=res.stdout, stderr=res.stderr, out=out)


def _run(args, timeout=1500):
    return subprocess.run([str(PY), *args], cwd=SRC, env=_env(), capture_output=True, text=True, timeout=timeout)


def test_the_environment_is_the_oldest_torch(oldest):
    res = _run(["-c", "import torch, triton; print(torch.__version__, triton.__version__)"])
    assert res.returncode == 0, res.stderr
    torch_version, triton_version = res.stdout.split()
    assert torch_version.split("+")[0] == OLDEST
    assert triton_version.startswith("3.6"), triton_version  # what torch 2.11 brings, as on the GPU machines


def test_the_device_check_dry_run_passes_with_every_gpu_step_skipped(oldest):
    out = oldest["out"]
    summary = (out / "summary.txt").read_text()
    assert oldest["rc"] == 0, summary + oldest["stderr"][-2000:]
    rows = {}
    for line in summary.splitlines()[2:]:
        if not line.strip():
            break
        name, status = line.split()[:2]
        rows[name] = status
    assert rows == {"env": "ok", "build": "ok", "info": "ok", **{s: "SKIP(no" for s in GPU_STEPS}}, summary
    assert "SKIP(no CUDA)" in summary and "0 failed" in summary
    assert summary in oldest["stdout"]  # printed at the end too (a lease returns the output's tail)
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and "summary.txt" in files and "logs.tar.gz" in files, files
    with tarfile.open(out / "logs.tar.gz") as tar:
        logs = sorted(m.name for m in tar.getmembers() if m.isfile())
        build_log = tar.extractfile("logs/build.txt").read().decode()
        env_log = tar.extractfile("logs/env.txt").read().decode()
    assert logs == sorted(f"logs/{s}.txt" for s in ("env", "build", "info")), logs
    assert "ninja: none" in env_log  # the build ran as it will on a GPU machine without ninja
    assert "could not find ninja" in build_log, build_log[-3000:]
    info = json.loads((out / "info.json").read_text())
    assert info["torch"].split("+")[0] == OLDEST and info["triton_interpret"] is False
    # both extensions were built against this torch (the CUDA one compiled for sm_90)
    built = (SRC / "fedopt_kernels" / "_build_info.py").read_text()
    assert f"TORCH_VERSION = '{OLDEST}" in built and "CUDA_EXTENSION = True" in built, built


def test_backend_contract_suites_pass(oldest):
    res = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "--backends=cpu,triton,cuda",
                "tests/test_contract_aggregate.py", "tests/test_contract_nar_step.py",
                "tests/test_contract_server_update.py", "tests/test_contract_noise.py",
                "tests/test_triton_interpreter_compat.py"])
    tail = res.stdout[-4000:] + res.stderr[-2000:]
    assert res.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail, tail


def test_selftest_on_cpu_passes(oldest, tmp_path):
    report = tmp_path / "selftest.json"
    res = _run(["-m", "fedopt_kernels", "selftest", "--device", "cpu", "--json", str(report)])
    assert res.returncode == 0, res.stdout[-6000:]
    rows = json.loads(report.read_text())["results"]
    status = [r["status"] for r in rows]
    assert "FAIL" not in status and status.count("PASS") >= 40, status
    # the Triton rows ran (in triton 3.6's interpreter) and the compile rows too; the
    # reference backend's rows too (its contract cases are not run here)
    assert any(r["backend"] == "triton" and r["status"] == "PASS" for r in rows)
    assert any(r["backend"] == "reference" and r["status"] == "PASS" for r in rows)
    assert any(r["op"] == "torch.compile" and r["status"] == "PASS" for r in rows)


def test_triton_kernels_compile_ahead_of_time_without_spills(oldest):
    res = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_triton_aot.py"])
    tail = res.stdout[-4000:] + res.stderr[-2000:]
    assert res.returncode == 0, tail
    # every test of the file ran and passed (none skipped): as many as it defines
    tests = len(re.findall(r"^def test_", (ROOT / "tests" / "test_triton_aot.py").read_text(), re.M))
    assert re.search(rf"\b{tests} passed", tail) and "skipped" not in tail, (tests, tail)
