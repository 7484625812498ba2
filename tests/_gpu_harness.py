"""Building and driving tools/gpu_harness (a plain CUDA program over the kernels' host
launchers, csrc/cuda/kernels/*.cuh) from the tests: tests/test_gpu_harness.py.

Build.  ``build()`` compiles the harness with nvcc (``FEDOPT_NVCC``, else the CUDA 13.0
toolkit's, else ``$CUDA_HOME/bin/nvcc``, else the first on PATH) with ``-cudart shared``,
so that it runs on whatever libcudart is loaded, and PTX only for each arch of
``FEDOPT_HARNESS_ARCHS`` (default ``90``: compute_90 PTX, which a GPU's driver compiles
at load and a PTX simulator executes; ``80 90`` gives both PTX, ``sm_90`` adds SASS),
uncompressed (``--no-compress``: the PTX text stays readable in the binary, for the test
and for a simulator that extracts it).  The binary is cached under
build/gpu_harness/<hash of the sources and the command>.

Run.  ``runtime_env()`` is the environment a case runs in: this process's, plus the
``KEY=VALUE`` lines of the file named by ``FEDOPT_CUDA_SIM_ENV`` (how a simulator says
which libcudart to load and where its configuration is); a case runs in its own
directory, into which the files of ``FEDOPT_CUDA_SIM_FILES`` (colon-separated; e.g. a
simulator's config files, which it reads from the working directory) are linked.
``FEDOPT_HARNESS_WRAPPER`` (e.g. ``compute-sanitizer --error-exitcode 9``) prefixes
every run.  ``probe()`` says whether that runtime has a device at all.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tools" / "gpu_harness" / "harness.cu"
# Everything the harness compiles (torch-free by construction: no ATen header here).
DEPENDS = [SOURCE, *sorted((ROOT / "csrc" / "cuda" / "kernels").glob("*")),
           *(ROOT / "csrc" / "include" / "fedopt" / n for n in
             ("chunks.h", "cuda_utils.cuh", "fp8_e4m3.h", "gaussian_noise.h", "math.h"))]

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


def find_nvcc() -> str | None:
    candidates = [os.environ.get("FEDOPT_NVCC", ""), "/usr/local/cuda-13.0/bin/nvcc"]
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
    candidates.append(shutil.which("nvcc") or "")
    return next((c for c in candidates if c and os.path.exists(c)), None)


def archs() -> list[str]:
    return os.environ.get("FEDOPT_HARNESS_ARCHS", "90").split()


def gencode_flags() -> list[str]:
    """``80 90`` -> PTX for compute_80 and compute_90; ``sm_90`` -> SASS for sm_90."""
    flags = []
    for a in archs():
        if a.startswith("sm_"):
            flags += ["-gencode", f"arch=compute_{a[3:]},code={a}"]
        else:
            flags += ["-gencode", f"arch=compute_{a},code=compute_{a}"]
    return flags


def build_command(nvcc: str, out: Path, family: str | None = None) -> list[str]:
    # The flags of the extension's nvcc build (setup.py; torch adds --expt-relaxed-constexpr).
    only = [f'-DFEDOPT_HARNESS_FAMILY="{family}"'] if family else []
    return [nvcc, *only, "-std=c++20", "-O3", "-lineinfo", "--expt-relaxed-constexpr", "-cudart", "shared",
            "--no-compress",
            f"-I{ROOT / 'csrc' / 'include'}", f"-I{ROOT / 'csrc' / 'cuda'}", *gencode_flags(),
            str(SOURCE), "-o", str(out)]


def split() -> bool:
    """``FEDOPT_HARNESS_SPLIT=1``: one binary per kernel family (for a simulator, which
    parses a program's whole PTX at every start: one family's is several times faster)."""
    return os.environ.get("FEDOPT_HARNESS_SPLIT", "0") == "1"


def build(family: str | None = None) -> Path:
    """The harness binary (of one ``family`` only, when given), built once per distinct
    source and command."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("no nvcc (FEDOPT_NVCC, /usr/local/cuda-13.0, CUDA_HOME, PATH)")
    h = hashlib.sha256()
    for p in DEPENDS:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    h.update(" ".join(build_command(nvcc, Path("X"), family)).encode())
    out_dir = ROOT / "build" / "gpu_harness" / h.hexdigest()[:16]
    binary = out_dir / "gpu_harness"
    if binary.exists():
        return binary
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "lock", "w") as lock:  # pytest-xdist workers: one builds, the others wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary.exists():
            tmp = out_dir / f"gpu_harness.tmp{os.getpid()}"
            r = subprocess.run(build_command(nvcc, tmp, family), capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"nvcc failed ({r.returncode}):\n{r.stderr[-4000:]}")
            os.replace(tmp, binary)
    return binary


def runtime_env() -> dict:
    env = dict(os.environ)
    path = os.environ.get("FEDOPT_CUDA_SIM_ENV")
    if path:
        for line in Path(path).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#") and "=" in line:
                k, v = line.split("=", 1)
                env[k.strip()] = os.path.expandvars(v.strip())
    return env


def _prepare_dir(d: Path):
    for f in filter(None, os.environ.get("FEDOPT_CUDA_SIM_FILES", "").split(":")):
        link = d / os.path.basename(f)
        if not link.exists():
            link.symlink_to(os.path.abspath(f))


def _command(binary: Path, arg: str) -> list[str]:
    return [*shlex.split(os.environ.get("FEDOPT_HARNESS_WRAPPER", "")), str(binary), arg]


@functools.lru_cache(maxsize=None)
def probe(binary: Path, scratch: str) -> tuple[bool, str]:
    """(whether the loaded CUDA runtime has a device, what it said)."""
    d = Path(scratch)
    d.mkdir(parents=True, exist_ok=True)
    _prepare_dir(d)
    try:
        r = subprocess.run([str(binary), "--probe"], capture_output=True, text=True, env=runtime_env(), cwd=d,
                           timeout=300)
    except subprocess.TimeoutExpired:
        return False, "gpu_harness --probe timed out"
    # the harness's own line (a simulator prints much else around it)
    said = [l for l in (r.stdout + r.stderr).splitlines() if l.startswith(("device ", "gpu_harness"))]
    return r.returncode == 0, (said[-1] if said else f"exit {r.returncode}: {(r.stdout + r.stderr)[-500:]}")


class HarnessError(RuntimeError):
    pass


class Runner:
    """Writes cases under ``root`` and runs them; ``seconds`` adds up the runs' wall time."""

    def __init__(self, binary: Path, root: Path):
        self.binary, self.root = binary, root  # split(): binaries per family, built as needed
        self.count = 0
        self.seconds = 0.0

    def run(self, keys: dict, inputs: dict, outputs: dict, args: list | None = None, files: dict | None = None,
            arrays: list | None = None, relocs: list | None = None):
        """Runs one case.  ``keys``: case.txt entries (lists become space-separated);
        ``inputs``: name -> CPU tensor (written raw); ``outputs``: name -> (dtype, shape)
        to read back; ``arrays``, ``args`` and ``relocs``: the triton family's ``array``,
        ``arg`` and ``reloc`` lines; ``files``: name -> bytes put in the case directory.  Returns name ->
        tensor."""
        self.count += 1
        d = self.root / f"case{self.count:04d}"
        d.mkdir(parents=True)
        _prepare_dir(d)
        lines = []
        for k, v in keys.items():
            if isinstance(v, (list, tuple)):
                v = " ".join(_fmt(x) for x in v)
            lines.append(f"{k} {_fmt(v)}")
        for a in arrays or []:
            lines.append("array " + " ".join(_fmt(x) for x in a))
        for a in args or []:
            lines.append("arg " + " ".join(_fmt(x) for x in a))
        for a in relocs or []:
            lines.append("reloc " + " ".join(_fmt(x) for x in a))
        (d / "case.txt").write_text("\n".join(lines) + "\n")
        for name, t in inputs.items():
            t = t.detach().cpu().contiguous()
            (d / f"in_{name}.bin").write_bytes(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        for name, data in (files or {}).items():
            (d / name).write_bytes(data)
        t0 = time.perf_counter()
        binary = build(keys["kernel"]) if split() else self.binary
        r = subprocess.run(_command(binary, str(d)), capture_output=True, text=True, env=runtime_env(), cwd=d,
                           timeout=600)
        self.seconds += time.perf_counter() - t0
        if r.returncode != 0:
            raise HarnessError(f"gpu_harness {d} exited {r.returncode}: {(r.stdout + r.stderr)[-3000:]}")
        out = {}
        for name, (dtype, shape) in outputs.items():
            raw = (d / f"out_{name}.bin").read_bytes()
            t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            out[name] = t.view(dtype).reshape(shape).clone()
        return out


def _fmt(v) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, float):
        return float.hex(v)  # exact; strtod reads hex floats
    return str(v)
