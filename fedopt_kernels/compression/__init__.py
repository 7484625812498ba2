"""Codecs of compressed client updates, as objects a round plugs in.

A :class:`Codec` encodes a client's update into a
:class:`~fedopt_kernels.ops.compressed.CompressedUpdate` (``encode(update, key, client)``)
and is the decode stage of the round's aggregation (``aggregate(replies, weights)``:
:func:`fedopt_kernels.ops.compressed.decode_aggregate`, every reply read in place), with
the validator that leaves a malformed reply out with its reason (``check``).  With
``rotation`` set, updates are rotated by the round's randomized Hadamard transform before
quantizing and the aggregate is rotated back once.  Error feedback, whose residuals live
in the run's :class:`~fedopt_kernels.fl.engine.client_state.ClientStateStore`, is
:class:`fedopt_kernels.fl.engine.error_feedback.ErrorFeedback`.

Layer: beside ``optim`` / ``server`` (it imports ``ops`` only).  The math:
python_ref/compression.py; the page: docs/compression.md.
"""

from .codecs import Codec, parse_codec

__all__ = ["Codec", "parse_codec"]
