"""The decode stage of a round of compressed replies (:class:`ServerRound`'s ``decoder`` slot).

A round whose clients send compressed updates hands :class:`~.round.ServerRound` a
:class:`CompressedReplies` as its ``results``: the clients' replies
(:class:`~fedopt_kernels.ops.compressed.CompressedUpdate`, screened by the caller), the
round's codec (a :class:`~fedopt_kernels.compression.Codec`, or anything with its
``aggregate`` and ``decode``), the model's length and the round's key (the Hadamard
rotation's and stochastic rounding's).  :class:`CompressedDecoder` decodes them:

* the plain weighted mean (no robust rule, no DP): into :class:`DecodeAggregate`, an
  :class:`~.aggregation.Aggregator` that runs the fused decode-aggregate
  (:func:`~fedopt_kernels.ops.compressed.decode_aggregate`) -- every reply's codes read
  in place, no dense fp32 copy of a reply -- with the optimizer's ``nonfinite`` and
  ``max_client_norm`` rules; the statistics the step reads (``||D_i||^2``,
  ``||D||^2``: FedExP's and ASNES's step, the records) are those of the DECODED updates.
  The aggregate is bit for bit :func:`~fedopt_kernels.ops.aggregate` of the decoded
  rows on the same backend (ops/compressed.py), so the step is that of the decoded
  round.  With the Hadamard rotation the clients' norms (and ``max_client_norm``) are
  those of the decoded ROTATED vectors, padded to the rotation's blocks: the padding's
  share of the quantization noise is in them (rounding apart, equal to the unrotated
  norms when the model's length is a multiple of the block); ``||D||^2`` is taken again
  from the update the step applies (one more pass);
* a robust rule or DP-FedAvg (``rows=True``): into the decoded ``[C, N]`` fp32 rows,
  which the rule reads as it reads uncompressed updates.  That costs what the fused path
  saves: one dense fp32 row per reply (``4 C N`` bytes) and a decode pass over each;
  the robust rules need it anyway (medians, distances and sorts read every coordinate
  of every client), and DP clips the decoded update -- the vector that is summed -- so
  the sensitivity bound is that of the uncompressed round (docs/privacy.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..ops.aggregate import aggregate_runner
from .aggregation import CheckedWeights, RoundAggregate, normalize_weights

__all__ = ["CompressedReplies", "CompressedDecoder", "DecodeAggregate"]


@dataclass
class CompressedReplies:
    """One round's compressed replies, in the round's order (each already screened with
    ``codec.check``): ``codec`` encoded them for a model of ``numel`` values in the
    round of ``key``."""

    replies: Sequence[Any]
    codec: Any
    numel: int
    key: int = 0

    def __len__(self) -> int:
        return len(self.replies)

    def nbytes(self) -> int:
        """Bytes the replies carried (codes + scales + indices)."""
        return sum(r.nbytes() for r in self.replies)

    def record(self) -> dict:
        """The round's bytes up (the simulator's record names): ``bytes_up``, what the
        replies carried, and ``bytes_up_fp32``, the same replies as fp32 updates."""
        return {"bytes_up": self.nbytes(), "bytes_up_fp32": 4 * self.numel * len(self.replies)}


class DecodeAggregate:
    """An :class:`~.aggregation.Aggregator` over compressed replies: the weighted mean of
    the decoded updates by the fused decode-aggregate, written into the step's ``out``
    (the updates it is called with are the :class:`CompressedReplies` themselves)."""

    def __init__(self, replies: CompressedReplies):
        self.replies = replies

    def __call__(self, optimizer, updates, weights, out: torch.Tensor) -> RoundAggregate:
        rep = self.replies
        C = len(rep)
        if out.dtype != torch.float32:
            raise ValueError(f"compressed replies decode into fp32; the server's parameters accumulate in {out.dtype}")
        if out.numel() != rep.numel:
            raise ValueError(f"the replies describe {rep.numel} values but the server has {out.numel()} parameters")
        p, valid = normalize_weights(weights, C, out.device, out.dtype)
        w = CheckedWeights(p)  # checked by normalize_weights (device weights: not read): the op trusts them
        kwargs = dict(nonfinite=optimizer.nonfinite, max_client_norm=optimizer.max_client_norm,
                      backend=optimizer.backend, checked=True)
        if getattr(rep.codec, "rotation", None) is None:  # straight into the step's buffer
            _, stats = rep.codec.aggregate(list(rep.replies), w, rep.numel, rep.key, out=out, **kwargs)
        else:  # the rotated aggregate is padded to the rotation's blocks: rotated back once, then copied
            mean, stats = rep.codec.aggregate(list(rep.replies), w, rep.numel, rep.key, **kwargs)
            out.copy_(mean)
            # ||D||^2 of the update the step applies: the padding's share of the quantization
            # noise, which the rotation back drops, is not in it (one more pass over N values)
            run = aggregate_runner(optimizer.backend, out.device)
            one = torch.ones(1, dtype=out.dtype, device=out.device)
            sq, _ = run([out], one, 1.0, torch.empty_like(out), None)
            stats = stats._replace(sq_norm=sq[0])
        return RoundAggregate.of(p, stats, valid, optimizer.max_client_norm)

    def __repr__(self) -> str:
        return f"DecodeAggregate({len(self.replies)} replies)"


class CompressedDecoder:
    """:class:`~.round.ServerRound`'s ``decoder``: :class:`CompressedReplies` become a
    :class:`DecodeAggregate` (the fused path), or with ``rows`` (a robust rule, DP) the
    decoded ``[C, N]`` fp32 rows; other results pass through unchanged."""

    def __init__(self, *, rows: bool = False):
        self.rows = bool(rows)

    def __call__(self, results):
        if not isinstance(results, CompressedReplies):
            return results
        if not self.rows:
            return DecodeAggregate(results)
        if not len(results):
            return torch.zeros(0, results.numel, dtype=torch.float32)
        return torch.stack([results.codec.decode(r, results.numel, results.key) for r in results.replies])
