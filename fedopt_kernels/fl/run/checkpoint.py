"""A simulated run's checkpoint: its version, which settings may change on a resume, and
the check that a checkpoint belongs to a run.

:meth:`~fedopt_kernels.fl.run.simulation.Simulation.state_dict` gathers the pieces its
parts own under keys that never change (a checkpoint of an older tree resumes): the
coordinator's ``version``, ``config``, ``round``, ``elapsed``, ``x_global``,
``buffers`` and ``results``; the server part's ``server``, ``dp`` and ``robust``; the
local-training part's ``scaffold``, ``local_momentum`` and ``error_feedback``.
"""

from __future__ import annotations

import torch

from .config import SimulationConfig

__all__ = ["STATE_VERSION", "RESUMABLE", "check_resumable", "detached_copy"]

STATE_VERSION = 1
#: the settings a resumed run may change
RESUMABLE = ("rounds", "eval_every", "device", "backend", "engine", "client_batch", "on_bad_client",
             "client_state_dir", "memory_budget")
# the values of settings added after checkpoints existed: a checkpoint without them ran with these
_NEWER_DEFAULTS = dict(compress="none", compress_block=256, compress_stochastic=False, compress_rotate=False,
                       error_feedback=False)


def check_resumable(state: dict, config: SimulationConfig) -> None:
    """Raise ``ValueError`` unless checkpoint ``state`` is of this :data:`STATE_VERSION`
    and was made with ``config``'s settings (those of :data:`RESUMABLE` may differ)."""
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"checkpoint version {state.get('version')!r} is not {STATE_VERSION}")
    mine = config.to_dict()
    for key, value in state["config"].items():
        if key not in RESUMABLE and mine.get(key) != value:
            raise ValueError(f"the checkpoint was made with {key}={value!r}, this run has {mine.get(key)!r}")
    for key, default in _NEWER_DEFAULTS.items():  # a checkpoint older than --compress ran without it
        if key not in state["config"] and mine[key] != default:
            raise ValueError(f"the checkpoint was made with {key}={default!r} (before the setting existed), "
                             f"this run has {mine[key]!r}")


def detached_copy(value):
    """``value`` with every tensor in it (nested dicts, lists, tuples) cloned: a state
    dict that later rounds do not change under its holder."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: detached_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(detached_copy(v) for v in value)
    return value
