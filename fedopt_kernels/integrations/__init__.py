"""Integrations with federated-learning frameworks (each an optional extra).

==========  ====================================  ==========================================
name        module                                install
==========  ====================================  ==========================================
flower      ``fedopt_kernels.integrations.flower``  ``pip install fedopt_kernels[flower]``
==========  ====================================  ==========================================

Importing this package imports no framework; :func:`status` reports, without importing
them either, which integrations are installed (``fedopt info`` prints it).
"""

from __future__ import annotations

from typing import Dict, Optional

__all__ = ["INTEGRATIONS", "status", "installed_version", "parse_version"]

# name -> (distribution, supported versions "min,<max", module, install hint)
INTEGRATIONS: Dict[str, dict] = {
    "flower": {
        "distribution": "flwr",
        "min": (1, 41),
        "below": (1, 42),
        "module": "fedopt_kernels.integrations.flower",
        "install": "pip install fedopt_kernels[flower]",
        "requirement": "flwr>=1.41,<1.42",
    },
}


def parse_version(version: str):
    """``"1.41.0"`` as ``(1, 41, 0)`` (each of the first three parts read by its digits
    alone), for comparing with an integration's supported range."""
    parts = []
    for p in version.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def installed_version(distribution: str) -> Optional[str]:
    """The installed version of ``distribution`` (without importing it), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def status() -> Dict[str, dict]:
    """For each integration: ``version`` (None if not installed), ``supported`` (the
    installed version is in the tested range), the ``install`` command and a one-line
    ``summary``."""
    out = {}
    for name, spec in INTEGRATIONS.items():
        version = installed_version(spec["distribution"])
        supported = version is not None and spec["min"] <= parse_version(version)[:2] < spec["below"]
        if version is None:
            summary = f"not installed: {spec['install']}"
        elif supported:
            summary = f"{spec['distribution']} {version}"
        else:
            summary = (f"{spec['distribution']} {version} installed, but {spec['requirement']} is the tested range: "
                       f"{spec['install']}")
        out[name] = {"distribution": spec["distribution"], "version": version, "supported": supported,
                     "module": spec["module"], "install": spec["install"], "summary": summary}
    return out
