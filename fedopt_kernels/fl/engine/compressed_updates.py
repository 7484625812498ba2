"""The clients' side of a simulated round of compressed updates (``--compress``).

After local training each client of the round encodes its update ``D_i`` with the run's
:class:`~fedopt_kernels.compression.Codec` (``config.codec()``), in the round of key
:func:`~fedopt_kernels.fl.seeds.compress_key` ``(seed, round)`` -- the Hadamard
rotation's signs, shared by the round's clients, and, with the client's id, its
stochastic rounding's uniforms -- so a resumed run, either engine and a folded round
encode the same bits.  With ``error_feedback`` the client encodes ``e_i + D_i`` and keeps
what the reply lost (:class:`~fedopt_kernels.fl.engine.error_feedback.ErrorFeedback`: the
residual rows live in the run's :class:`~fedopt_kernels.fl.engine.client_state.ClientStateStore`
under ``"ef_residual"``, grow with participation, spill and checkpoint with it).

Screening, before anything is encoded or a residual changes: an update holding NaN/Inf
is left out as ``nonfinite`` (its residual kept: the client did not take part), as the
uncompressed round's step leaves it out; then every reply is checked as the server checks
one that arrives (:meth:`Codec.check`), a malformed one left out as ``malformed`` with its
reason.  The server decodes the rest inside its aggregation
(:mod:`fedopt_kernels.server.compressed`).

On the CPU a block codec's replies are encoded straight into one
:class:`~fedopt_kernels.compression.reply_arena.ReplyArena` per run, recycled round after
round: the decode-aggregate reads int8 replies there 1.1-1.4x faster than replies the
encode allocated one by one (that module; docs/benchmarks.md).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from ...compression import Codec
from ...compression.reply_arena import ReplyArena
from ...ops.compressed import CompressedUpdate, block_reply_layout
from ...server.compressed import CompressedReplies
from ..seeds import compress_key
from .client_state import ClientStateStore
from .error_feedback import ErrorFeedback

__all__ = ["ClientCompression", "COMPRESSED_REASONS"]

# why a client of a compressed round is left out, in the record's order (fl/run/server_side.py's, with
# a malformed reply before the step's own NaN/Inf)
COMPRESSED_REASONS = ("no_data", "error", "malformed", "nonfinite")


class ClientCompression:
    """The run's codec on the clients' side (module docstring).

    Args:
        codec: the run's :class:`~fedopt_kernels.compression.Codec`.
        numel: the model's number of values.
        seed: the run's seed (the rounds' keys).
        store: the run's per-client state (error feedback's residuals).
        error_feedback: keep each client's residual.
        backend: the kernels' backend (None: automatic).
        device: where the updates are; on the CPU the replies go into a
            :class:`~fedopt_kernels.compression.reply_arena.ReplyArena`.
    """

    def __init__(self, codec: Codec, numel: int, seed: int, *, store: Optional[ClientStateStore] = None,
                 error_feedback: bool = False, backend: Optional[str] = None, device="cpu"):
        self.codec, self.numel, self.seed, self.backend = codec, int(numel), int(seed), backend
        self.ef = ErrorFeedback(codec, store, self.numel, device=device) if error_feedback else None
        # the round's block-codec replies are written into one recycled host mapping (top-k's keep their own)
        self.arena = ReplyArena() if torch.device(device).type == "cpu" and codec.name != "topk" else None
        self._arena_round = None  # the round whose replies the arena holds

    def _reply_outputs(self):
        """``(codes, scales)`` in the arena for one block-codec reply (None without the arena)."""
        if self.arena is None:
            return None
        return tuple(self.arena.take(count, dtype) for dtype, count in self._layout())

    def _layout(self):
        return block_reply_layout(self.codec.name, self.codec.wire_numel(self.numel), self.codec.block)

    def key(self, round_number: int) -> int:
        return compress_key(self.seed, round_number)

    def encode(self, rows: torch.Tensor, clients: Sequence[int], round_number: int
               ) -> Tuple[List[Tuple[int, CompressedUpdate]], List[Tuple[int, str, str]]]:
        """The replies ``(client, reply)`` of ``clients`` for their updates ``rows``
        (``[C, N]``, round order), and those left out ``(client, reason, detail)``."""
        key = self.key(round_number)
        if self.arena is not None and round_number != self._arena_round:  # a folded round encodes chunk by chunk
            one = sum(count * dtype.itemsize for dtype, count in self._layout()) + 128  # + the alignment
            self.arena.start_round(reserve=len(clients) * one)
            self._arena_round = round_number
        finite = torch.isfinite(rows).all(dim=1).tolist() if rows.numel() else [True] * len(clients)
        replies, left_out = [], []
        for cid, row, ok in zip(clients, rows, finite):
            cid = int(cid)
            if not ok:
                left_out.append((cid, "nonfinite", "NaN/Inf update"))
                continue
            out = self._reply_outputs()
            reply = (self.ef.encode(cid, row, key, backend=self.backend, out=out) if self.ef is not None
                     else self.codec.encode(row, key, cid, backend=self.backend, out=out))
            replies.append((cid, reply))
        return replies, left_out

    def screen(self, replies: Sequence[Tuple[int, CompressedUpdate]]
               ) -> Tuple[List[Tuple[int, CompressedUpdate]], List[Tuple[int, str, str]]]:
        """``replies`` split into those the server aggregates and those it leaves out as
        ``malformed``, with the validator's reason (:meth:`Codec.check`)."""
        good, bad = [], []
        for cid, reply in replies:
            why = self.codec.check(reply, self.numel)
            if why is None:
                good.append((cid, reply))
            else:
                bad.append((cid, "malformed", why))
        return good, bad

    def round_replies(self, replies: Sequence[Tuple[int, CompressedUpdate]], round_number: int) -> CompressedReplies:
        """The server round's results for screened ``replies``."""
        return CompressedReplies([r for _, r in replies], self.codec, self.numel, self.key(round_number))

    def record(self, replies: Sequence[Tuple[int, CompressedUpdate]]) -> dict:
        """The round's bytes up: ``bytes_up`` (codes + scales + indices of the replies
        the server aggregated, screened ``replies``) and ``bytes_up_fp32`` (the same
        clients' updates as fp32)."""
        return {"bytes_up": sum(r.nbytes() for _, r in replies), "bytes_up_fp32": 4 * self.numel * len(replies)}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Optional[dict]:
        """Error feedback's residual rows (None without it)."""
        if self.ef is None:
            return None
        return self.ef.store.state_dict()[self.ef.name]

    def load_state_dict(self, state: Optional[dict]) -> None:
        if self.ef is None:
            return
        if state is None:
            raise ValueError("the checkpoint has no error-feedback residuals, but this run keeps them")
        self.ef.store.load_state_dict({self.ef.name: state})
