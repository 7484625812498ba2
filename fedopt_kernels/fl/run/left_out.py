"""The round record's and the log's account of the clients a simulated round left out.

A round's ``left_out`` (``(client, reason, detail)``, round order: the clients screened
out before training, those whose training raised, those the step left out as NaN/Inf)
goes into the record as ``[client, reason]`` pairs, with one warning per round naming
them (logger ``fedopt_kernels.fl.run.simulation``).  A client left out as NaN/Inf
because its own training went non-finite (:class:`~fedopt_kernels.fl.engine.client.RoundStats`
flags it) is said so, and warned about once (:class:`NonFiniteClientWarning`).
"""

from __future__ import annotations

import logging
import warnings
from typing import List

import torch

from ..engine.client import NONFINITE_TRAINING, NonFiniteClientWarning

__all__ = ["LeftOutLog"]

# the simulator's one logger (its warnings have always come from fedopt_kernels.fl.run.simulation)
_log = logging.getLogger("fedopt_kernels.fl.run.simulation")


class LeftOutLog:
    """Records and reports a run's left-out clients; ``enabled=False`` keeps the record
    but logs and warns nothing (the distributed simulator's ranks other than 0).  Its
    state: the clients already warned about (one warning per client and run)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.warned: set = set()

    def record(self, record: dict, left_out: list, nonfinite: list, round_kept: bool) -> None:
        """``left_out`` (``[client, reason]``, round order) into ``record`` when any
        client was, and one warning naming them; ``nonfinite``: the round's
        ``(client, flag)`` of training that went NaN/Inf; ``round_kept``: whether any
        client took part (else the round was skipped)."""
        left_out = self._explain_nonfinite(left_out, nonfinite)
        if not left_out:
            return
        record["left_out"] = [[cid, reason] for cid, reason, _ in left_out]
        if self.enabled:
            _log.warning("round %d left out %d of %d client(s)%s: %s", record["round"], len(left_out),
                         len(record["clients"]), "; round skipped" if not round_kept else "",
                         "; ".join(f"client {cid}: {reason} ({detail})" for cid, reason, detail in left_out))

    def _explain_nonfinite(self, left_out: list, flagged: list) -> list:
        """``left_out`` with the step's NaN/Inf exclusions of the clients that trained to a
        non-finite loss or step (RoundStats.close_client) said so, instead of "NaN/Inf
        update"; one :class:`NonFiniteClientWarning` names them.  The distributed
        simulator's rank 0 knows this of its own clients only."""
        if not any(reason == "nonfinite" for _, reason, _ in left_out):
            return left_out
        flagged = flagged or []
        flags = torch.stack([flag for _, flag in flagged]).tolist() if flagged else []  # one host read
        trained_bad = {cid for (cid, _), flag in zip(flagged, flags) if flag}
        self._warn([cid for cid, reason, _ in left_out if reason == "nonfinite" and cid in trained_bad])
        return [(cid, reason, NONFINITE_TRAINING if reason == "nonfinite" and cid in trained_bad else detail)
                for cid, reason, detail in left_out]

    def _warn(self, clients: List[int]) -> None:
        """One :class:`NonFiniteClientWarning` per client, the first round it trains to a
        non-finite loss or step (the per-round log line names it every round)."""
        new = [cid for cid in clients if cid not in self.warned]
        if new and self.enabled:
            self.warned.update(new)
            warnings.warn(NonFiniteClientWarning(
                f"client{'s' if len(new) > 1 else ''} {', '.join(map(str, new))}: {NONFINITE_TRAINING}; left out of "
                "every round where this happens (excluded_nonfinite in the records), not averaged in"), stacklevel=4)
