"""fedopt_kernels as a package: the build record, the torch pin, a real wheel.

* The compiled extensions are tied to the torch they were built against
  (``fedopt_kernels/_build_info.py``, written by setup.py).  Under another torch the
  extension is not imported (that failed with "undefined symbol" and fell back,
  silently, to the reference backend): the backend says why, naming both torch versions
  and what to install, and a RuntimeWarning says it once.  Faked here by replacing the
  record.
* Slow: ``python -m build`` on a copy of the checkout gives an sdist holding every
  C++/CUDA source and header and python_ref, and a wheel, built FROM that sdist, holding
  the compiled CPU extension, the build record, every Python package -- python_ref's
  files as ``fedopt_kernels/_python_ref`` (the reference backend runs them), no
  top-level ``python_ref`` -- and requiring ``torch==<the release built against>`` and
  numpy only (the rest is the ``sim`` extra).  Installed into a fresh venv that sees
  torch but not the editable install nor the sim extra (a lean install), and run from
  another directory: it imports from the venv, finds its extension and passes ``fedopt
  selftest --device cpu --backends cpu``; the simulator says what to install; with its
  record edited to another torch, ``fedopt info`` says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import types
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from fedopt_kernels import backends
from fedopt_kernels.backends import _extensions

REPO = Path(__file__).resolve().parents[1]
RELEASE = torch.__version__.split("+")[0]
VERSION = "0.1.0"
SIM_MODULES = ("sklearn", "matplotlib", "rich")  # what the sim extra installs


def zf_read(wheel: Path, name: str) -> bytes:
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(name)


def fake_build(version: str, cuda, *, abi=None, cuda_extension=True):
    info = types.ModuleType("fedopt_kernels._build_info")
    info.TORCH_VERSION, info.TORCH_CUDA, info.CUDA_EXTENSION = version, cuda, cuda_extension
    info.CXX11_ABI = bool(torch._C._GLIBCXX_USE_CXX11_ABI) if abi is None else abi
    return info


@pytest.fixture
def recorded(monkeypatch):
    """``recorded(info)``: the build record seen from now on, with the extension and
    backend caches emptied (restored after the test)."""
    def install(info):
        monkeypatch.setitem(sys.modules, "fedopt_kernels._build_info", info)
        monkeypatch.setattr(_extensions, "_loaded", {})
        monkeypatch.setattr(backends, "_names", {})
    return install


def test_a_mismatched_torch_is_named_warned_once_and_never_imported(recorded, monkeypatch):
    recorded(fake_build("2.0.1+cu118", "11.8"))
    imported = []
    real_import = getattr(_extensions, "_import", None)
    monkeypatch.setattr(_extensions, "_import", lambda name: imported.append(name) or real_import(name), raising=False)
    with pytest.warns(RuntimeWarning) as caught:
        reason = backends.why_unavailable("cpu", torch.device("cpu"))
        assert backends.why_unavailable("cpu", torch.device("cpu")) == reason  # cached: warned once
    assert len([w for w in caught if w.category is RuntimeWarning]) == 1
    expected = (f"fedopt_kernels was built for torch 2.0.1+cu118 (CUDA 11.8) but torch {torch.__version__} "
                f"({'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU-only'}) is installed: install the "
                "matching torch (pip install torch==2.0.1) or rebuild fedopt_kernels against the installed one")
    assert reason.startswith(expected), reason
    assert "pip install --no-build-isolation" in reason
    assert "the cpu backend is unavailable: " + expected in str(caught[0].message)
    assert "fedopt_kernels._C" not in imported  # the mismatched library is never loaded
    # Asking for the backend by name raises with the reason; the default moves on, and
    # `fedopt info` shows why.
    with pytest.raises(backends.BackendUnavailableError, match=r"built for torch 2\.0\.1\+cu118"):
        backends.resolve_name("cpu", "cpu")
    assert backends.default_backend(torch.device("cpu")) == "reference"
    from fedopt_kernels.cli import info

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # already warned: info adds no second warning
        env = info.collect()
    assert not env["extensions"]["cpu"]["built"] and env["extensions"]["cpu"]["error"] == reason
    row = next(r for r in env["backends"] if (r["backend"], r["device"]) == ("cpu", "cpu"))
    assert not row["available"] and row["reason"] == reason


def test_the_same_release_in_another_build_is_accepted(recorded):
    # torch==X.Y.Z accepts every local build of the release (+cpu, +cu130): so does the check.
    recorded(fake_build(RELEASE + "+somebuild", torch.version.cuda))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backends.why_unavailable("cpu", torch.device("cpu")) is None


def test_what_each_extension_needs_of_torch():
    here = torch.version.cuda
    same = fake_build(torch.__version__, here)
    assert _extensions.mismatch("_C", same) is None and _extensions.mismatch("_C_cuda", same) is None
    other_cuda = fake_build(torch.__version__, "11.8" if here != "11.8" else "12.1")
    assert _extensions.mismatch("_C", other_cuda) is None  # the CPU library does not link CUDA
    assert "(CUDA 11.8" in _extensions.mismatch("_C_cuda", other_cuda) or here == "11.8"
    abi = not bool(torch._C._GLIBCXX_USE_CXX11_ABI)
    msg = _extensions.mismatch("_C", fake_build(torch.__version__, here, abi=abi))
    assert msg is not None and ("new C++11 ABI" if abi else "old C++11 ABI") in msg


def test_a_cuda_extension_the_build_skipped_is_not_loaded(recorded, monkeypatch):
    # A _C_cuda file left from an earlier build must not be loaded next to a new _C.
    recorded(fake_build(torch.__version__, torch.version.cuda, cuda_extension=False))
    real_import = getattr(_extensions, "_import", None)
    monkeypatch.setattr(_extensions, "_import", lambda name: (
        pytest.fail("_C_cuda imported") if name.endswith("_C_cuda") else real_import(name)), raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not built is not worth a warning
        assert "was not built" in _extensions.load("_C_cuda")


def test_an_extension_that_fails_to_import_is_warned_about(recorded, monkeypatch):
    # Without a record (an older build), an unusable extension (undefined symbol) is no
    # longer a silent fallback either.
    monkeypatch.delitem(sys.modules, "fedopt_kernels._build_info", raising=False)
    monkeypatch.setattr(_extensions, "build_info", lambda: None, raising=False)
    monkeypatch.setattr(_extensions, "_loaded", {})

    def broken(name):
        raise ImportError(f"{name}.so: undefined symbol: _ZN3c104impl3fooEv")
    monkeypatch.setattr(_extensions, "_import", broken, raising=False)
    with pytest.warns(RuntimeWarning, match="the cpu backend is unavailable: .*undefined symbol"):
        assert "undefined symbol" in _extensions.load("_C")


def test_the_reference_backend_runs_the_checkouts_python_ref():
    """In a checkout python_ref stays the top-level oracle, and the reference backend runs
    those very modules (backends/oracle.py): an edit there -- a mutant -- is what it runs."""
    import python_ref.fednar

    from fedopt_kernels.backends import oracle, reference

    assert oracle.FROM_CHECKOUT and oracle.fednar is python_ref.fednar
    assert reference._nar is python_ref.fednar
    assert "fedopt_kernels._python_ref" not in sys.modules


# ---------------------------------------------------------------------------- the wheel

_NOT_SOURCES = (".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", "*.so", "*.o", "results",
                ".pytest_cache", ".benchmarks", "gpu-check-*", "_build_info.py")


def copy_checkout(dst: Path) -> None:
    """The checkout's files (tracked, and untracked but not ignored) without build
    outputs: ``python -m build`` in place would leave an egg-info directory in the
    checkout, which importlib.metadata would then see as a second distribution."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                                capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an unpacked archive)
        shutil.copytree(REPO, dst, ignore=shutil.ignore_patterns(*_NOT_SOURCES))
        return
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file() and not src.name.endswith((".so", ".o")) and src.name != "_build_info.py":
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def run(cmd, *, cwd, env, timeout, ok=True):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if ok and proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
                    f"--- stderr\n{proc.stderr[-6000:]}")
    return proc


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "FEDOPT_BACKEND", "TRITON_INTERPRET", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(extra)
    return env


@pytest.mark.slow
def test_wheel_built_from_the_sdist_installs_elsewhere_and_passes_selftest(tmp_path):
    t0 = time.monotonic()
    src, dist, work = tmp_path / "src", tmp_path / "dist", tmp_path / "elsewhere"
    work.mkdir()
    copy_checkout(src)
    # The CPU extension only (the CUDA one is checked by the GPU suite); MAX_JOBS as the
    # Makefile's default; -g0 after Python's -g: no debug info, a third less compile time
    # (this test checks the packaging).  --no-isolation: compile against THIS torch, as
    # docs/install.md says.
    build_env = clean_env(FEDOPT_BUILD_CUDA="0", MAX_JOBS=os.environ.get("MAX_JOBS", "2"),
                          CFLAGS=(os.environ.get("CFLAGS", "") + " -g0").strip())
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, src], cwd=src, env=build_env,
        timeout=900)
    t_build = time.monotonic() - t0

    # The sdist compiles on its own: every source and header of csrc, setup.py, the packages.
    (sdist,) = dist.glob("fedopt_kernels-*.tar.gz")
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        in_sdist = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        pkg_info = tar.extractfile(f"{top}/PKG-INFO").read().decode()
    csrc = {p.relative_to(REPO).as_posix() for p in (REPO / "csrc").rglob("*") if p.is_file()}
    assert csrc and csrc <= in_sdist, sorted(csrc - in_sdist)
    assert {"setup.py", "pyproject.toml", "MANIFEST.in", "python_ref/__init__.py"} <= in_sdist
    assert not any(n.endswith((".so", "_build_info.py")) for n in in_sdist)
    assert "Requires-Dist: torch>=2.11" in pkg_info.splitlines()  # an sdist builds against any tested torch

    # The wheel: the extension, the record, every package, and torch pinned to this release.
    (wheel,) = dist.glob("fedopt_kernels-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = set(zf.namelist())
        metadata = zf.read(next(n for n in in_wheel if n.endswith(".dist-info/METADATA"))).decode()
        record = zf.read("fedopt_kernels/_build_info.py").decode()
    py = {p.relative_to(REPO).as_posix() for p in (REPO / "fedopt_kernels").rglob("*.py")
          if "__pycache__" not in p.parts and p.name != "_build_info.py"}
    py |= {"fedopt_kernels/_python_ref/" + p.name for p in (REPO / "python_ref").glob("*.py")}
    assert py <= in_wheel, sorted(py - in_wheel)
    # python_ref is installed under the package, not as a top-level module of that name
    assert {n.split("/")[0] for n in in_wheel} == {"fedopt_kernels", f"fedopt_kernels-{VERSION}.dist-info"}
    for p in (REPO / "python_ref").glob("*.py"):
        assert zf_read(wheel, "fedopt_kernels/_python_ref/" + p.name) == p.read_bytes()
    assert any(n.startswith("fedopt_kernels/_C.") and n.endswith((".so", ".pyd")) for n in in_wheel)
    assert not any(n.startswith("fedopt_kernels/_C_cuda.") for n in in_wheel)  # FEDOPT_BUILD_CUDA=0
    assert f"TORCH_VERSION = {torch.__version__!r}" in record and "CUDA_EXTENSION = False" in record
    requires = [line.split(": ", 1)[1] for line in metadata.splitlines() if line.startswith("Requires-Dist: ")]
    assert [r for r in requires if "extra ==" not in r] == [f"torch=={RELEASE}", "numpy>=1.24"]  # the lean core
    assert {'scikit-learn>=1.3; extra == "sim"', 'matplotlib>=3.7; extra == "sim"', 'rich>=13; extra == "sim"'} \
        <= set(requires)

    # A fresh venv that sees this torch (and numpy, ...) as a plain path: the .pth files of
    # that site-packages -- the editable install's finder among them -- are not run.
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=work, env=clean_env(), timeout=120)
    vpy = venv / "bin" / "python"
    site = run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=work,
               env=clean_env(), timeout=60).stdout.strip()
    here = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                          str(Path(torch.__file__).resolve().parents[1])])
    (Path(site) / "_deps_of_the_test.pth").write_text("".join(p + "\n" for p in here))
    # ... but not the sim extra's modules, which that site-packages holds too: a lean install.
    (Path(site) / "_no_sim_extra.pth").write_text(f"import sys; sys.modules.update(dict.fromkeys({SIM_MODULES!r}))\n")
    env = clean_env()
    pip = [sys.executable, "-m", "pip", "--python", vpy, "--disable-pip-version-check"]
    # The pin resolves against the torch installed there (dry run: pip touches nothing) ...
    run(pip + ["install", "--dry-run", "--no-index", wheel], cwd=work, env=env, timeout=300)
    # ... then the wheel goes into the venv alone (-I: pip leaves the other site-packages be).
    run(pip + ["install", "--no-index", "--no-deps", "-I", wheel], cwd=work, env=env, timeout=300)

    where = json.loads(run([vpy, "-c", "import json, fedopt_kernels, fedopt_kernels._build_info as b; "
                                       "from fedopt_kernels.backends import oracle as o; "
                                       "print(json.dumps([fedopt_kernels.__file__, o.fednar.__file__, b.__file__]))"],
                           cwd=work, env=env, timeout=120).stdout)
    for f in where:
        assert Path(f).resolve().is_relative_to(Path(site).resolve()), (f, site)
    assert Path(where[1]).parent.name == "_python_ref"
    proc = run([vpy, "-c", "import python_ref"], cwd=work, env=env, timeout=120, ok=False)
    assert proc.returncode == 1 and "No module named 'python_ref'" in proc.stderr
    proc = run([vpy, "-c", "import fedopt_kernels.fl"], cwd=work, env=env, timeout=120, ok=False)
    assert proc.returncode == 1 and "pip install fedopt_kernels[sim]" in proc.stderr, proc.stderr[-2000:]

    fedopt = venv / "bin" / "fedopt"
    info = json.loads(run([fedopt, "info", "--json"], cwd=work, env=env, timeout=120).stdout)
    assert info["extensions"]["cpu"] == {"built": True, "error": None}
    assert "was not built" in info["extensions"]["cuda"]["error"]
    assert info["default_backend"]["cpu"] == "cpu"

    # The installed extension's own rows: --backends cpu runs exactly the cpu rows of a full
    # selftest (its reference and interpreted-Triton rows, three quarters of its CPU time, ran
    # here unasserted; the suite checks those backends elsewhere).
    report = work / "selftest.json"
    run([vpy, "-m", "fedopt_kernels", "selftest", "--device", "cpu", "--backends", "cpu", "--json", report], cwd=work,
        env=env, timeout=600)
    rows = json.loads(report.read_text())["results"]
    assert rows and all(r["backend"] == "cpu" and r["status"] == "PASS" for r in rows), \
        [r for r in rows if r["status"] != "PASS" or r["backend"] != "cpu"][:3]

    # The same install under a record of another torch: refused, and said so.
    installed = Path(where[2])
    installed.write_text(installed.read_text().replace(repr(torch.__version__), repr("2.0.1+cu118")))
    proc = run([fedopt, "info"], cwd=work, env=clean_env(COLUMNS="400"), timeout=120)
    said = " ".join((proc.stdout + proc.stderr).split())
    assert "fedopt_kernels was built for torch 2.0.1+cu118" in said and "RuntimeWarning" in proc.stderr
    print(f"wheel test: build {t_build:.0f} s, all {time.monotonic() - t0:.0f} s")
