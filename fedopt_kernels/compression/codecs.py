"""The :class:`Codec` object: one codec's encode, validator and fused decode-aggregate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..ops import compressed as C

__all__ = ["Codec", "parse_codec"]


@dataclass(frozen=True)
class Codec:
    """A codec of client updates.

    Args:
        name: ``"int8"``, ``"int4"``, ``"fp8"`` or ``"topk"``.
        block: values per scale of the block codecs (a positive multiple of 32).
        stochastic: unbiased stochastic rounding (int8 / int4), else round to nearest even.
        fraction: the fraction of values top-k keeps (``ceil(fraction N)``).
        rotation: None, or the block (a power of two) of a randomized Hadamard rotation
            applied before encoding; the key of :meth:`encode` / :meth:`aggregate` is the
            round's, the same for every client.
    """

    name: str
    block: int = 256
    stochastic: bool = False
    fraction: float = 0.01
    rotation: Optional[int] = None

    def __post_init__(self):
        if self.name not in C.CODECS:
            raise ValueError(f"codec name must be one of {C.CODECS}, got {self.name!r}")
        if self.name != "topk" and (isinstance(self.block, bool) or not isinstance(self.block, int)
                                    or self.block <= 0 or self.block % 32):
            raise ValueError(f"block must be a positive multiple of 32, got {self.block!r}")
        if self.stochastic and self.name not in ("int8", "int4"):
            raise ValueError(f"stochastic rounding is defined for int8 and int4, not {self.name}")
        if self.name == "topk" and not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction!r}")
        if self.rotation is not None and (isinstance(self.rotation, bool) or not isinstance(self.rotation, int)
                                          or self.rotation < 1 or self.rotation & (self.rotation - 1)):
            raise ValueError(f"rotation must be None or a power of two, got {self.rotation!r}")

    @property
    def biased(self) -> bool:
        """Whether the codec is biased (error feedback applies): all but stochastic rounding."""
        return not self.stochastic

    def wire_numel(self, numel: int) -> int:
        """Length of the vector the codes describe (padded to the rotation's blocks)."""
        if self.rotation is None:
            return numel
        return -(-numel // self.rotation) * self.rotation

    def encode(self, update: torch.Tensor, key: int = 0, client: int = 0, *,
               backend: Optional[str] = None, out=None) -> C.CompressedUpdate:
        """The reply of client ``client`` for ``update`` in the round of ``key`` (in ``[0, 2^63)``);
        ``out``: a block codec's ``(codes, scales)`` to write it into
        (:func:`~fedopt_kernels.ops.compressed.encode`, of :meth:`wire_numel` values)."""
        x = update.reshape(-1)
        if self.rotation is not None:
            x = C.hadamard_rotate(x, key, self.rotation)
        if self.name == "topk":
            return C.encode(x, "topk", fraction=self.fraction, out=out)
        return C.encode(x, self.name, block=self.block, stochastic=self.stochastic, key=key, client=client,
                        backend=backend, out=out)

    def decode(self, reply: C.CompressedUpdate, numel: int, key: int = 0) -> torch.Tensor:
        """The dense fp32 update a reply stands for (rotated back)."""
        x = C.decode(reply)
        return x if self.rotation is None else C.hadamard_unrotate(x, key, self.rotation, numel)

    def check(self, reply, numel: int) -> Optional[str]:
        """Why ``reply`` must be left out of a round on a model of ``numel`` values, or None."""
        return C.check_reply(reply, self.wire_numel(numel), codec=self.name,
                             block=None if self.name == "topk" else self.block)

    def aggregate(self, replies: Sequence[C.CompressedUpdate], weights, numel: int, key: int = 0, **kwargs):
        """``(out, AggregateStats)`` of ``sum_i w_i decode(reply_i)``: the fused decode-aggregate
        (``kwargs``: gamma, nonfinite, max_client_norm, backend, checked), rotated back once.  The
        statistics are those of the decoded ROTATED updates, padded to the rotation's blocks.
        The rotation is orthogonal, but the padding's coordinates carry quantization noise
        too, which rotating back drops: with a model whose length is not a multiple of the
        rotation's block the clients' norms (and ``max_client_norm``'s test) include that
        noise and ``||D||^2`` exceeds that of the returned mean.  A round that needs the
        applied update's norm takes it again from ``out`` (server/compressed.py does)."""
        out, stats = C.decode_aggregate(list(replies), weights, **kwargs)
        if self.rotation is not None:
            out = C.hadamard_unrotate(out, key, self.rotation, numel)
        return out, stats

    def bytes_per_reply(self, numel: int) -> int:
        """Bytes of one reply for a model of ``numel`` values."""
        n = self.wire_numel(numel)
        if self.name == "topk":
            return C.topk_count(n, self.fraction) * (4 + 8)  # fp32 value + int64 index
        codes = (n + 1) // 2 if self.name == "int4" else n
        return codes + 4 * C.num_scales(n, self.block)


def parse_codec(spec: str, *, block: int = 256, stochastic: bool = False, rotation: Optional[int] = None) -> Codec:
    """A codec from the command line's spelling: ``int8``, ``int4``, ``fp8``, ``topk:FRACTION``."""
    name, _, arg = spec.partition(":")
    if name == "topk":
        try:
            fraction = float(arg)
        except ValueError:
            raise ValueError(f"top-k is spelled topk:FRACTION (e.g. topk:0.01), got {spec!r}") from None
        return Codec("topk", fraction=fraction, rotation=rotation)
    if arg:
        raise ValueError(f"codec {name!r} takes no argument, got {spec!r}")
    return Codec(name, block=block, stochastic=stochastic, rotation=rotation)
