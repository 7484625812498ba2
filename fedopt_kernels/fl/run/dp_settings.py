"""Moved to :mod:`fedopt_kernels.server.differential_privacy.dp_settings` (the server layer, where the
simulator's config and the Flower strategies both read it); this name stays for code
that imports it from here."""

from ...server.differential_privacy.dp_settings import (CLI_NAMES, DP_MODES, DP_REFUSED_ALGOS,  # noqa: F401
                                                       PYTHON_NAMES, check_dp_settings, robust_with_dp_error)

__all__ = ["DP_MODES", "DP_REFUSED_ALGOS", "CLI_NAMES", "PYTHON_NAMES", "check_dp_settings", "robust_with_dp_error"]
