"""``fedopt info``: versions, devices, backends (and why one is unavailable), integrations."""

from __future__ import annotations

import importlib
import platform
import sys

import torch


def _version(module: str):
    try:
        m = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - report any import failure
        return None, f"{type(exc).__name__}: {exc}".split("\n")[0]
    version = getattr(m, "__version__", None)
    if version is None:
        try:
            from importlib.metadata import version as dist_version

            version = dist_version(module.split(".")[0])
        except Exception:  # noqa: BLE001 - not a distribution (e.g. torch.distributed)
            version = "installed"
    return version, None


def _distribution_version(name: str):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name), None
    except PackageNotFoundError:
        return None, "not installed"


def _ctypes_library(names):
    import ctypes

    errors = []
    for name in names:
        try:
            return ctypes.CDLL(name), None
        except OSError as exc:
            errors.append(str(exc))
    return None, "; ".join(errors)


def cuda_driver() -> dict:
    """The NVIDIA driver's release (NVML, as ``nvidia-smi`` prints it) and the CUDA
    version it supports (``cuDriverGetVersion``), read through ctypes: torch exposes
    neither, and neither needs a package.  Values are None with ``error`` saying why."""
    import ctypes

    result = {"version": None, "cuda": None, "error": None}
    errors = []
    windows = sys.platform.startswith("win")
    nvml, err = _ctypes_library(("nvml.dll",) if windows else ("libnvidia-ml.so.1",))
    if nvml is None:
        errors.append(f"NVML: {err}")
    elif nvml.nvmlInit_v2() != 0:
        errors.append("NVML: nvmlInit failed")
    else:
        buf = ctypes.create_string_buffer(96)
        if nvml.nvmlSystemGetDriverVersion(buf, ctypes.c_uint(96)) == 0:
            result["version"] = buf.value.decode()
        else:
            errors.append("NVML: nvmlSystemGetDriverVersion failed")
        nvml.nvmlShutdown()
    libcuda, err = _ctypes_library(("nvcuda.dll",) if windows else ("libcuda.so.1",))
    if libcuda is None:
        errors.append(f"libcuda: {err}")
    else:
        v = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(v)) == 0 and v.value:
            result["cuda"] = f"{v.value // 1000}.{v.value % 1000 // 10}"
        else:
            errors.append("libcuda: cuDriverGetVersion failed")
    result["error"] = "; ".join(errors) or None
    return result


def gpus() -> list:
    """Every visible CUDA device: name, compute capability, memory, SM count."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                    "memory_gib": round(p.total_memory / 2**30, 1), "multiprocessors": p.multi_processor_count})
    return out


def environment() -> dict:
    """Versions, devices, the compiled extensions and Triton: what a bug report needs
    first (``fedopt info`` and ``fedopt selftest`` both print it)."""
    from .. import __version__, backends

    cuda = torch.cuda.is_available()
    gpu_list = gpus()
    info = {
        "fedopt_kernels": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": cuda,
        "cuda_devices": [g["name"] for g in gpu_list],
        "gpus": gpu_list,
        "cuda_driver": cuda_driver() if cuda else None,
        "cpu_threads": torch.get_num_threads(),
        "mkl_cnr": backends.mkl.status(),
        "triton_interpret": backends.triton_interpret_mode(),
        "extensions": {name: {"built": backends.extension_error(name) is None,
                              "error": backends.extension_error(name)} for name in ("cpu", "cuda")},
    }
    info["triton"], info["triton_error"] = _version("triton")
    return info


def backend_rows() -> list:
    """For every backend and device type: available here, or why not."""
    from .. import backends

    rows = []
    for name in backends.BACKENDS:
        for dev in ("cpu", "cuda"):
            try:
                reason = backends.why_unavailable(name, torch.device(dev))
            except Exception as exc:  # noqa: BLE001
                reason = f"{type(exc).__name__}: {exc}"
            rows.append({"backend": name, "device": dev, "available": reason is None, "reason": reason})
    return rows


_READ_FROM_DISTRIBUTION = {"flwr": "flwr", "ray": "ray", "sklearn": "scikit-learn", "matplotlib": "matplotlib"}


def collect() -> dict:
    """Everything ``fedopt info`` prints, as plain data."""
    from .. import backends

    info = environment()
    info["backends"] = backend_rows()
    defaults = {}
    for dev in ("cpu", "cuda"):
        defaults[dev] = backends.default_backend(torch.device(dev))
    info["default_backend"] = defaults
    integrations = {}
    for mod, what in (("flwr", "Flower integration"), ("ray", "Flower's simulation runtime (flwr[simulation])"),
                      ("torch.distributed", "torch.distributed integration"),
                      ("sklearn", "digits dataset"), ("matplotlib", "plots"), ("rich", "tables and progress"),
                      ("torchvision", "your own image datasets")):
        if mod in _READ_FROM_DISTRIBUTION:
            # Read from the installed distributions: importing Flower or Ray takes seconds,
            # scikit-learn and matplotlib about as long as torch (fedopt info must be quick).
            version, err = _distribution_version(_READ_FROM_DISTRIBUTION[mod])
        else:
            version, err = _version(mod)
        if mod == "torch.distributed" and version is not None:
            version = "available" if torch.distributed.is_available() else None
            err = None if version else "torch was built without distributed support"
        integrations[mod] = {"for": what, "version": version, "error": err}
    from ..integrations import status as integration_status

    for name, st in integration_status().items():  # the framework integrations, with how to install them
        row = integrations[st["distribution"]]
        row["module"] = st["module"]
        row["install"] = st["install"]
        if st["version"] is None:
            row["error"] = f"not installed: {st['install']}"
        elif not st["supported"]:
            row["error"] = st["summary"]
    integrations["ray"]["install"] = "pip install flwr[simulation]"
    from ..extras import EXTRAS

    for _, module in EXTRAS["sim"]:  # the simulator's, the command line's tables
        integrations[module]["install"] = "pip install fedopt_kernels[sim]"
    info["integrations"] = integrations
    return info


def driver_text(driver: dict) -> str:
    if driver["version"] is None and driver["cuda"] is None:
        return f"unknown ({driver['error']})"
    return f"{driver['version'] or 'unknown'} (supports CUDA {driver['cuda'] or 'unknown'})"


def mkl_text(st: dict) -> str:
    """MKL's CNR mode as ``fedopt info`` prints it: the mode, who set it, why not strict."""
    if st["mode"] is None:
        return f"no MKL ({st['error']})"
    text = f"MKL_CBWR {st['mode']}"
    if st["set_by"]:
        text += f", by {st['set_by']}"
    if st["error"]:
        text += f" -- {st['error']}"
    vendor = {True: "Intel", False: "non-Intel", None: "unknown"}[st["intel_cpu"]]
    return text + f" (MKL's branch for this {vendor} CPU: {st['auto_branch']})"


def extensions_text(extensions: dict) -> str:
    return ", ".join(f"{name}: built" if e["built"] else f"{name}: not built ({e['error']})"
                     for name, e in extensions.items())


def run_info(args) -> int:
    from ._tables import print_tables

    info = collect()
    if getattr(args, "json", False):
        import json

        print(json.dumps(info, indent=1))
        return 0
    cuda = ", ".join(f"{g['name']} (sm_{g['capability'].replace('.', '')})" for g in info["gpus"]) \
        if info["cuda_available"] else "not available"
    about = [
        ["fedopt_kernels", info["fedopt_kernels"]],
        ["python", f"{info['python']} ({info['platform']})"],
        ["torch", f"{info['torch']} (CUDA build: {info['torch_cuda'] or 'no'})"],
        ["triton", info["triton"] or f"not available ({info['triton_error']})"],
        ["CUDA devices", cuda],
    ]
    if info["cuda_driver"] is not None:
        about.append(["CUDA driver", driver_text(info["cuda_driver"])])
    about += [
        ["extensions", extensions_text(info["extensions"])],
        ["CPU threads", str(info["cpu_threads"])],
        ["MKL reproducibility", mkl_text(info["mkl_cnr"])],
        ["TRITON_INTERPRET", "1 (Triton kernels run on CPU tensors)" if info["triton_interpret"] else "0"],
        ["default backend", f"cpu tensors: {info['default_backend']['cpu']}, "
                            f"cuda tensors: {info['default_backend']['cuda']}"],
    ]
    kernel_backends = [[r["backend"], r["device"], ("yes", "green") if r["available"] else ("no", "red"),
                        r["reason"] or ""] for r in info["backends"]]
    optional = []
    for mod, r in info["integrations"].items():
        if r["version"] and not r["error"]:
            status = (r["version"], "green")
        elif r["version"]:
            status = (r["error"], "yellow")
        elif r.get("install"):
            status = (f"not installed: {r['install']}", "yellow")
        elif r["error"] == "not installed":
            status = ("not installed", "yellow")
        else:
            status = (f"not importable ({r['error']})", "yellow")
        optional.append([mod, r["for"], status])
    print_tables([("fedopt_kernels", ("what", "value"), about, False),
                  ("kernel backends", ("backend", "device", "available", "why not"), kernel_backends, True),
                  ("optional integrations", ("module", "for", "status"), optional, True)])
    return 0
