r"""The quantized outer-gradient exchange of DiLoCo and Streaming DiLoCo.

Each worker encodes its outer gradient ``Delta_k`` (fp32) with a block codec of
:mod:`fedopt_kernels.ops.compressed` (``"fp8"``: e4m3 codes and one fp32 scale per
block, as torchft's FP8 all-reduce; ``"int4"``: the Streaming DiLoCo paper's 4-bit
values, two per byte; ``"int8"``), the workers all-gather the codes, the scales and
their token weights (fixed sizes: every size depends only on ``N`` and the block), and
every worker forms the same mean with the fused decode-aggregate::

    Delta = sum_k p_k decode(C(Delta_k))      p_k = w_k / sum_j w_j  (1/K without tokens)

reading the K workers' codes in place in rank order (bit for bit the same on every
worker and for any timing; python_ref/compression.py's ``decode_aggregate`` is the
oracle).  A worker whose reply is not valid (a NaN/Inf scale: its outer gradient held
a NaN/Inf; :func:`~fedopt_kernels.ops.compressed.check_reply`) or whose codes decode
to NaN/Inf is left out of the mean, its weight dropped, and named in the record with
the reason; when every worker is left out, the outer step is skipped (the outer
optimizer's non-finite rule, ``record.stats.skipped``).  Checking the replies and
naming the left-out workers read the scales and a ``[K]`` flag on the host: on a GPU,
one wait for the device per outer step.

Why all-gather and not all-reduce: codes on per-worker scales cannot be summed on the
wire (torchft's FP8 all-reduce dequantizes and re-quantizes at every hop instead); a
gather moves ``K`` payloads to each worker, which at 2-4 islands is the same order of
bytes as a ring all-reduce of fp32 (``2 (K-1)/K`` times fp32), at a quarter (fp8) or
an eighth (int4) of the size.  The encode reads the outer gradient from one fp32
vector formed from the snapshot first (one extra pass over ``N``; a fused
subtract-and-encode kernel would save it).  The collectives are ``dist.all_gather``
over the worker group: gloo for CPU tensors; NCCL takes the same calls on CUDA tensors
(the fp8 codes travel as their bytes, ``uint8``, which every backend carries).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ..ops import compressed as C
from ..server import normalize_weights
from . import comm

__all__ = ["EXCHANGE_CODECS", "check_exchange_codec", "GatheredCodes", "start_exchange"]

EXCHANGE_CODECS = ("int8", "int4", "fp8")


def check_exchange_codec(codec, block) -> None:
    """``codec`` one of :data:`EXCHANGE_CODECS`, ``block`` a positive multiple of 32."""
    if codec not in EXCHANGE_CODECS:
        raise ValueError(f"codec must be None (fp32) or one of {EXCHANGE_CODECS}, got {codec!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0 or block % 32:
        raise ValueError(f"codec_block must be a positive multiple of 32 (values per scale), got {block!r}")


class GatheredCodes:
    """Every worker's codes, scales and weight for one exchange (maybe still in flight).

    ``codes[r]`` / ``scales[r]``: rank r's (codes as bytes); ``weights``: float64
    ``[K, 2]``, rank r's ``(w_r, tokens given)``.  :meth:`wait` completes the
    collectives; :meth:`mean` the decode-aggregate; :meth:`state` / :meth:`from_state`
    a checkpoint of a finished exchange."""

    def __init__(self, codec: str, block: int, numel: int, codes: List[torch.Tensor], scales: List[torch.Tensor],
                 weights: List[torch.Tensor], works=()):
        self.codec, self.block, self.numel = codec, block, numel
        self.codes, self.scales, self.weights, self._works = codes, scales, weights, list(works)

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []

    @property
    def payload_bytes(self) -> int:
        """What one worker put on the wire: its codes, scales and weight."""
        return sum(t[0].numel() * t[0].element_size() for t in (self.codes, self.scales, self.weights))

    def mean(self) -> Tuple[torch.Tensor, Tuple[Tuple[int, str], ...]]:
        """``(Delta fp32 [N], left_out)``: the token-weighted mean of the decoded outer
        gradients, and the workers left out of it (``(rank, reason)``)."""
        self.wait()
        w = torch.stack(self.weights).to(torch.float64)  # [K, 2]
        given = w[:, 1].tolist()  # host values (gathered on the host, already waited)
        if len(set(given)) > 1:
            raise ValueError("DiLoCo: some workers give tokens and some do not: "
                             + ", ".join(f"rank {r}: {'tokens' if g else 'none'}" for r, g in enumerate(given)))
        dtype = torch.float8_e4m3fn if self.codec == "fp8" else self.codes[0].dtype
        replies = [C.CompressedUpdate(self.codec, self.numel, c.view(dtype), scales=s, block=self.block)
                   for c, s in zip(self.codes, self.scales)]
        reasons = [C.check_reply(r, self.numel, codec=self.codec, block=self.block) for r in replies]
        left = [(r, f"its reply is refused: {why}") for r, why in enumerate(reasons) if why is not None]
        kept = [r for r, why in enumerate(reasons) if why is None]
        if not kept:  # a non-finite outer gradient: the outer optimizer skips the step
            return torch.full((self.numel,), float("nan"), device=self.codes[0].device), tuple(left)
        p, _ = normalize_weights(None if not given[0] else w[kept, 0], len(kept), self.codes[0].device,
                                 torch.float32)
        out, stats = C.decode_aggregate([replies[r] for r in kept], p, nonfinite="exclude", checked=True)
        excluded = stats.excluded.tolist()
        left += [(kept[i], "its outer gradient decodes to NaN/Inf: left out of the mean")
                 for i, x in enumerate(excluded) if x]
        if all(excluded):
            out = torch.full_like(out, float("nan"))
        return out, tuple(sorted(left))

    def state(self) -> dict:
        self.wait()
        return {"codec": self.codec, "block": self.block, "numel": self.numel,
                "codes": [c.clone() for c in self.codes], "scales": [s.clone() for s in self.scales],
                "weights": [w.clone() for w in self.weights]}

    @classmethod
    def from_state(cls, st: dict) -> "GatheredCodes":
        return cls(st["codec"], st["block"], st["numel"], [c.clone() for c in st["codes"]],
                   [s.clone() for s in st["scales"]], [w.clone() for w in st["weights"]])


def start_exchange(delta: torch.Tensor, weight: Optional[float], *, codec: str, block: int, group,
                   async_op: bool) -> GatheredCodes:
    """Encode ``delta`` (fp32 ``[N]``) and start the all-gathers of codes, scales and
    ``(weight, given)`` over ``group`` (``async_op``: return at once; :meth:`GatheredCodes.wait`)."""
    reply = C.encode(delta, codec, block=block)
    codes = reply.codes.view(torch.uint8) if codec == "fp8" else reply.codes
    # the weights are host numbers: they travel on the host (the group itself, or a gloo
    # twin of an NCCL group), so that reading them never waits for the device
    wt = torch.tensor([1.0 if weight is None else float(weight), 0.0 if weight is None else 1.0],
                      dtype=torch.float64)
    world = comm.group_size(group)
    out = ([torch.empty_like(codes) for _ in range(world)], [torch.empty_like(reply.scales) for _ in range(world)],
           [torch.empty_like(wt) for _ in range(world)])
    works = [dist.all_gather(parts, t, group=g, async_op=async_op)
             for parts, t, g in zip(out, (codes, reply.scales, wt), (group, group, comm.object_group(group)))]
    return GatheredCodes(codec, block, delta.numel(), *out, works=[w for w in works if w is not None])
