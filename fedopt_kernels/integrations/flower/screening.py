"""Which train replies a fused strategy aggregates: one broken or hostile client must not
cost the round, nor take it over.

Every reply is checked on its own, before anything is aggregated; a reply that cannot
be aggregated is left out with a reason, and the round goes on with the rest:

==================  ===========================================================
``error_reply``     the node's ClientApp failed (Flower's error message)
``duplicate_node``  a second reply of a node in the round (the first one counts)
``other_round``     the reply says it answers another round (``server-round``)
``malformed``       not exactly one ArrayRecord and one MetricRecord
``bad_arrays``      a missing, unknown or misshapen array, or the wrong dtype;
                    a compressed reply that its codec's validator refuses
``bad_size``        ``num-examples`` (the ``weighted_by_key``) missing,
                    not a number, negative, NaN or infinite
``bad_lr_sum``      SCAFFOLD: ``lr_sum`` missing or not a positive finite number
==================  ===========================================================

Updates holding NaN/Inf pass here and are left out by the server optimizer's
``nonfinite="exclude"`` (counted as ``nonfinite``).  A size of 0 is a valid reply (its
update gets weight 0).  :func:`cap_weight_shares` (defined in
:mod:`fedopt_kernels.server.weighting`, shared with the simulator and the distributed
path) bounds what a claimed size can buy.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

from flwr.app import Message

from ...server.weighting import cap_weight_shares  # noqa: F401 - the one implementation, used from here
from ...utils.flat import FlatLayout
from .records import check_arrayrecord

REASONS = ("error_reply", "duplicate_node", "other_round", "malformed", "bad_arrays", "bad_size", "bad_lr_sum",
           "nonfinite")
ROUND_KEY = "server-round"  # a reply's ConfigRecord entry: the round it answers (FedNARClient sends it)
BAD_REPLY_POLICIES = ("exclude", "raise")


@dataclass
class Screened:
    """The replies to aggregate (``kept``, arrival order) and those left out:
    ``(node id, reason, detail)``."""

    kept: List[Message] = field(default_factory=list)
    excluded: List[Tuple[int, str, str]] = field(default_factory=list)

    def counts(self) -> Counter:
        return Counter(reason for _, reason, _ in self.excluded)


def _number(value) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _why_bad(msg: Message, server_round: int, layout: FlatLayout, allow_extra: Sequence[str], weighted_by_key: str,
             lr_sum_key: Optional[str], check: Optional[Callable] = None) -> Optional[Tuple[str, str]]:
    content = msg.content
    for rec in content.config_records.values():
        if ROUND_KEY in rec:
            answered = _number(rec[ROUND_KEY])
            if answered != float(server_round):
                return "other_round", f"answers round {rec[ROUND_KEY]!r}, not {server_round}"
    if len(content.array_records) != 1 or len(content.metric_records) != 1:
        return "malformed", (f"{len(content.array_records)} ArrayRecord(s) and {len(content.metric_records)} "
                             "MetricRecord(s), expected one of each")
    metrics = next(iter(content.metric_records.values()))
    size = _number(metrics[weighted_by_key]) if weighted_by_key in metrics else None
    if size is None or not math.isfinite(size) or size < 0:
        shown = metrics[weighted_by_key] if weighted_by_key in metrics else "missing"
        return "bad_size", f"'{weighted_by_key}' is {shown!r}: expected a finite number >= 0"
    if lr_sum_key is not None:
        lr_sum = _number(metrics[lr_sum_key]) if lr_sum_key in metrics else None
        if lr_sum is None or not math.isfinite(lr_sum) or lr_sum <= 0:
            shown = metrics[lr_sum_key] if lr_sum_key in metrics else "missing"
            return "bad_lr_sum", f"'{lr_sum_key}' is {shown!r}: expected a finite number > 0"
    record = next(iter(content.array_records.values()))
    if check is not None:  # the arrays are not the model's (compressed replies: .compression)
        why = check(msg, record)
        return None if why is None else ("bad_arrays", why)
    try:
        check_arrayrecord(record, layout, "its ArrayRecord", allow_extra=allow_extra)
    except (ValueError, TypeError) as exc:
        return "bad_arrays", str(exc)
    return None


def screen_train_replies(replies: Iterable[Message], *, server_round: int, layout: FlatLayout,
                         allow_extra: Sequence[str] = (), weighted_by_key: str = "num-examples",
                         lr_sum_key: Optional[str] = None, check: Optional[Callable] = None) -> Screened:
    """Split ``replies`` into the ones to aggregate and the ones left out (see the
    module docstring).  Reads only metadata, metrics and array headers: no copy.
    ``check(msg, record)``: why a reply's ArrayRecord cannot be aggregated, or None, in
    place of the model's layout check (compressed replies: their codec's validator)."""
    out = Screened()
    seen = set()
    for msg in replies:
        node = int(msg.metadata.src_node_id)
        if msg.has_error():
            out.excluded.append((node, "error_reply", str(msg.error.reason)))
            continue
        if node in seen:
            out.excluded.append((node, "duplicate_node", "a second reply in this round"))
            continue
        bad = _why_bad(msg, server_round, layout, allow_extra, weighted_by_key, lr_sum_key, check)
        if bad is not None and bad[0] == "other_round":
            out.excluded.append((node, *bad))  # not this round's: the node may still answer this one
            continue
        seen.add(node)
        if bad is not None:
            out.excluded.append((node, *bad))
        else:
            out.kept.append(msg)
    return out
