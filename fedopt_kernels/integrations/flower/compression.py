"""Compressed updates on Flower: the clients send codes, the strategy decodes them inside
its aggregation.

One place decides the codec: :class:`CompressionConcern` (``FusedStrategy(...,
compress=Codec("int8"))`` or the :class:`Compression` wrapper).  It writes the codec
and the round's key into every train message's ``ConfigRecord``
(:func:`codec_config`: ``codec`` as ``fedopt simulate --compress`` spells it,
``codec-block``, ``codec-stochastic``, ``codec-rotate``, ``codec-key`` =
:func:`~fedopt_kernels.fl.seeds.compress_key` ``(seed, round)``, ``error-feedback``).
A :class:`~.client.FedNARClient` that finds them encodes its update ``D_i = x_global -
x_i`` with that :class:`~fedopt_kernels.compression.Codec` (client id: its
``partition-id``) and replies with the compressed arrays instead of its model
(:func:`reply_to_arrayrecord`: ``codes`` -- fp8 codes travel as their uint8 bytes --
and ``scales`` or ``indices``), its reply's ``ConfigRecord`` naming the codec it used.
With error feedback the client keeps its residual ``e_i`` in its ``Context.state`` (an
``ArrayRecord`` under ``"fedopt-ef-residual"``, as SCAFFOLD's ``c_i`` is kept):
``a = e_i + D_i``, it sends ``C(a)`` and keeps ``a - decode(C(a))``, exactly as the
simulator's :class:`~fedopt_kernels.fl.engine.error_feedback.ErrorFeedback`.

On the server, :class:`CompressedReader` takes the strategy's reply reader's place:

* screening (:meth:`CompressedReader.check`): a reply whose arrays are not a valid
  reply of the round's codec for this model is left out as ``bad_arrays`` with the
  validator's reason (:meth:`Codec.check`: a wrong number of scales, a NaN/Inf scale,
  top-k indices out of range or repeated, a wrong length, another codec);
* the round's results are a :class:`~fedopt_kernels.server.compressed.CompressedReplies`
  over tensors that VIEW the replies' bytes (no copy); the round's decoder stage
  (:class:`~fedopt_kernels.server.compressed.CompressedDecoder`) aggregates them with
  the fused decode-aggregate -- no dense fp32 copy of a reply -- or, under a robust
  rule or DP-FedAvg, decodes them into rows as the simulator does;
* the round's metrics get ``bytes_up`` (the bytes of the arrays the aggregated replies
  carried) and ``bytes_up_fp32`` (the same replies as fp32 updates), the simulator's
  record names.

The clients' floating buffers (BatchNorm statistics) travel uncompressed beside the
codes, by name, as in a plain reply, and become the round's weighted mean of the
clients' (as the simulator's compressed round does); they are not counted in
``bytes_up`` (the simulator's record counts the codes alone).

Refused: FedLAW (it learns from the client models), SCAFFOLD (its control variates
read dense updates), client-side DP clipping (the server would clip the decoded update
again, as the simulator refuses ``--dp-mode client`` with ``--compress``).
"""

from __future__ import annotations

import warnings
from typing import List, Optional, Tuple

import torch
from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid

from ...compression import Codec, parse_codec
from ...fl.seeds import compress_key
from ...ops.compressed import CompressedUpdate
from ...server.compressed import CompressedDecoder, CompressedReplies
from .concern import Concern, ConcernWrapper
from .records import array_view, tensors_to_arrayrecord

__all__ = ["Compression", "CompressionConcern", "CompressedReader", "codec_config", "codec_from_config",
           "reply_to_arrayrecord", "EF_STATE_KEY"]

EF_STATE_KEY = "fedopt-ef-residual"  # a client's error-feedback residual in its Context.state
CODEC_KEY, BLOCK_KEY, STOCHASTIC_KEY, ROTATE_KEY, KEY_KEY, EF_KEY = (
    "codec", "codec-block", "codec-stochastic", "codec-rotate", "codec-key", "error-feedback")


def codec_spec(codec: Codec) -> str:
    """The codec as ``--compress`` spells it (``int8``, ``topk:0.05``)."""
    return f"topk:{codec.fraction!r}" if codec.name == "topk" else codec.name


def codec_config(codec: Codec, key: int, error_feedback: bool) -> dict:
    """The train ``ConfigRecord`` entries that tell a client how to encode (module docstring)."""
    return {CODEC_KEY: codec_spec(codec), BLOCK_KEY: int(codec.block), STOCHASTIC_KEY: bool(codec.stochastic),
            ROTATE_KEY: int(codec.rotation or 0), KEY_KEY: int(key), EF_KEY: bool(error_feedback)}


def codec_from_config(config) -> Optional[Tuple[Codec, int, bool]]:
    """``(codec, key, error_feedback)`` from a train ``ConfigRecord`` (None: no codec)."""
    if CODEC_KEY not in config:
        return None
    codec = parse_codec(str(config[CODEC_KEY]), block=int(config[BLOCK_KEY]),
                        stochastic=bool(config[STOCHASTIC_KEY]), rotation=int(config[ROTATE_KEY]) or None)
    return codec, int(config[KEY_KEY]), bool(config[EF_KEY])


def reply_to_arrayrecord(reply: CompressedUpdate, buffers=()) -> ArrayRecord:
    """The arrays a compressed reply travels as (fp8 codes as their uint8 bytes), then
    ``buffers`` (``(name, tensor)``: the model's floating buffers, uncompressed)."""
    codes = reply.codes.view(torch.uint8) if reply.codes.dtype == torch.float8_e4m3fn else reply.codes
    second = ("indices", reply.indices) if reply.codec == "topk" else ("scales", reply.scales)
    return tensors_to_arrayrecord([("codes", codes), second, *buffers])


def _reply_from_arrayrecord(record: ArrayRecord, name: str, codec: Codec, numel: int,
                            buffer_names=frozenset()) -> CompressedUpdate:
    """A :class:`CompressedUpdate` whose tensors view ``record``'s bytes (read-only views:
    the aggregation only reads them); ``ValueError`` when the arrays are not there, or
    when others than the model's floating buffers (``buffer_names``) come with them."""
    second = "indices" if name == "topk" else "scales"
    if not {"codes", second} <= set(record.keys()) or set(record.keys()) - {"codes", second} - set(buffer_names):
        raise ValueError(f"a {name} reply holds the arrays ['codes', '{second}'] (and the model's floating "
                         f"buffers), got {sorted(record.keys())}")
    views = {}
    for k in ("codes", second):
        v = array_view(record[k])
        if v.ndim != 1:
            raise ValueError(f"'{k}' must be a 1-D array, got shape {tuple(v.shape)}")
        with warnings.catch_warnings():  # a reply's bytes are read-only; the codes are only ever read
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            views[k] = torch.from_numpy(v)
    codes = views["codes"]
    if name == "fp8":
        if codes.dtype != torch.uint8:
            raise ValueError(f"fp8 codes travel as uint8 bytes, got {codes.dtype}")
        codes = codes.view(torch.float8_e4m3fn)
    if name == "topk":
        return CompressedUpdate("topk", numel, codes, indices=views["indices"])
    return CompressedUpdate(name, numel, codes, scales=views["scales"], block=codec.block)


class CompressedReader:
    """The strategy's reply reader for compressed replies (module docstring); what it
    does not do is the wrapped :class:`~.replies.ReplyReader`'s."""

    def __init__(self, reader, concern: "CompressionConcern", numel: int):
        self.reader, self.concern, self.numel = reader, concern, int(numel)

    def __getattr__(self, name):
        if name in ("reader", "concern", "numel"):
            raise AttributeError(name)
        return getattr(self.reader, name)

    def _reply(self, record: ArrayRecord) -> CompressedUpdate:
        codec = self.concern.codec
        layout = getattr(self.reader, "buffers_layout", None)  # (a reader-less screen: no buffers)
        buffer_names = {slot.name for slot in layout.slots} if layout is not None else set()
        return _reply_from_arrayrecord(record, codec.name, codec, codec.wire_numel(self.numel), buffer_names)

    def check(self, msg: Message, record: ArrayRecord) -> Optional[str]:
        """Why ``msg``'s compressed ``record`` cannot be aggregated, or None."""
        codec = self.concern.codec
        for rec in msg.content.config_records.values():
            if CODEC_KEY in rec and str(rec[CODEC_KEY]) != codec_spec(codec):
                return f"codec {rec[CODEC_KEY]!r} does not match the round's {codec_spec(codec)!r}"
        try:
            reply = self._reply(record)
        except (ValueError, TypeError, KeyError) as exc:
            return str(exc)
        return codec.check(reply, self.numel)

    def results(self, records: List[ArrayRecord], names: List[str], updates: bool) -> CompressedReplies:
        """The screened replies as the round's results (views of their bytes)."""
        return CompressedReplies([self._reply(r) for r in records], self.concern.codec, self.numel, self.concern.key)

    def buffers(self, records: List[ArrayRecord]) -> Optional[torch.Tensor]:
        """The clients' floating buffers, sent uncompressed beside the codes (the plain
        reader's; None when a reply lacks them: the server keeps its own)."""
        return self.reader.buffers(records) if self.reader is not None else None


class _RoundDecoder:
    """The round's decoder: rows under a robust rule or DP (decided when the round runs,
    whichever concern came first), else the fused decode-aggregate."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.last: Optional[CompressedReplies] = None

    def __call__(self, results):
        rnd = self.strategy.round
        self.last = results if isinstance(results, CompressedReplies) else None
        return CompressedDecoder(rows=rnd.aggregator is not None or rnd.privacy is not None)(results)

    def record(self) -> dict:
        """The round's bytes up (the round adds it to its record)."""
        return {} if self.last is None else self.last.record()


class CompressionConcern(Concern):
    """Compressed updates as a concern of a fused strategy (module docstring).

    Args:
        codec: the round's :class:`~fedopt_kernels.compression.Codec`.
        error_feedback: the clients keep their residuals (biased codecs).
        seed: the seed of the rounds' keys (:func:`~fedopt_kernels.fl.seeds.compress_key`).
    """

    order = 3
    state_key = "compression"

    def __init__(self, codec: Codec, error_feedback: bool = False, seed: int = 0):
        if not isinstance(codec, Codec):
            raise TypeError(f"compress must be a fedopt_kernels.compression.Codec, got {type(codec).__name__}")
        if error_feedback and not codec.biased:
            raise ValueError("error_feedback is for the biased codecs; stochastic rounding is unbiased")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"compress_seed must be an integer >= 0, got {seed!r}")
        self.codec, self.error_feedback, self.seed = codec, bool(error_feedback), seed
        self.key = 0

    def bind(self, strategy) -> None:
        if strategy.optimizer is None:
            raise ValueError("compressed updates need a server optimizer that takes the clients' updates; FedLAW "
                             "learns from the client models")
        if strategy.scaffold:
            raise ValueError("compressed updates cannot be used with scaffold=True: the control variates read "
                             "the dense updates")
        if strategy.privacy is not None and strategy.privacy.mode == "client":
            raise ValueError("compressed updates cannot be used with dp_mode='client': the server clips the "
                             "decoded update (use dp_mode='server')")
        if not isinstance(strategy.reader, CompressedReader):
            strategy.reader = CompressedReader(strategy.reader, self, strategy.layout.numel)
        self.decoder = _RoundDecoder(strategy)

    def round_parts(self) -> dict:
        return {"decoder": self.decoder}

    def configure(self, strategy, messages: List[Message], grid: Grid) -> None:
        if not messages:
            return
        server_round = int(messages[0].content[strategy.configrecord_key]["server-round"])
        self.key = compress_key(self.seed, server_round)
        entries = codec_config(self.codec, self.key, self.error_feedback)
        for msg in messages:
            config = msg.content[strategy.configrecord_key]
            for k, v in entries.items():
                config[k] = v

    def describe(self):
        return "compressed updates", f"{self.codec} error_feedback={self.error_feedback}"


class Compression(ConcernWrapper):
    """Compressed updates around a fused strategy (module docstring)."""

    def __init__(self, strategy, codec: Codec, *, error_feedback: bool = False, seed: int = 0):
        super().__init__(strategy, CompressionConcern(codec, error_feedback, seed))
