r"""``StreamingDiLoCo``: DiLoCo by fragments, the exchange overlapped with training.

Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512) splits the parameters into
``P`` fragments and syncs each on its own schedule, so that the bytes on the wire at
any step are one fragment's, and hides the exchange behind ``tau`` inner steps:

* fragment ``p`` sends its outer gradient ``Delta_k,p = theta_p - theta_k,p`` after the
  inner steps ``t`` with ``t mod H == offset_p`` (staggered: ``offset_p = p H / P``,
  :func:`fragment_schedule`; the offsets are a parameter);
* the exchange is ONE asynchronous ``all_reduce`` of ``[w_k Delta_k,p, w_k]`` (``w_k``
  the tokens worker k took since the fragment's previous send, or 1), started at once
  (``dist.all_reduce(..., async_op=True)``); training goes on;
* after inner step ``t + tau`` the handle is waited on, ``Delta_p = sum_k w_k Delta_k,p /
  sum_k w_k``, the fragment's outer optimizer moves its global copy ``theta_p`` (the
  default: Nesterov SGD, lr 0.7, momentum 0.9, as DiLoCo), and every worker merges it
  into the parameters it kept training meanwhile, as the paper does::

      theta_k,p <- alpha theta_k,p + (1 - alpha) theta_p       (alpha 0.5 by default)

With ``tau = 0`` and ``alpha = 0`` a fragment is plain DiLoCo.  Every worker computes
the same global copies bit for bit (the all-reduce hands every rank the same sum).
The oracle is ``python_ref/diloco.py``'s ``streaming_diloco_loop``.

Trade-offs: the all-reduce sums in the group's order (gloo, NCCL), not the ordered
mode of :class:`~fedopt_kernels.distributed.DiLoCo` (which needs a gather: no
overlap); the global copies cost one copy of the parameters, the in-flight buffer one
fragment in fp32.

Quantized exchange (``codec="int4"``, the paper's 4-bit values; ``"fp8"`` as torchft;
``"int8"``): the fragment's outer gradient is encoded by
:mod:`fedopt_kernels.ops.compressed`'s block codec and its codes, scales and token
weight are all-gathered asynchronously instead of the all-reduce
(:mod:`~fedopt_kernels.distributed.quantized_exchange`); at the merge the fused
decode-aggregate forms ``Delta_p = sum_k p_k decode(C(Delta_k,p))`` (``p_k = w_k /
sum_j w_j``) in rank order -- the same bits on every worker, whatever the timing.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from .. import defaults as D
from ..server import FedAvgM, ServerOptimizer, ServerStats
from . import comm
from .diloco import check_outer, check_state_entry, check_sync_every, model_parameters
from .quantized_exchange import GatheredCodes, check_exchange_codec, start_exchange

__all__ = ["StreamingDiLoCo", "StreamRecord", "fragment_schedule", "split_fragments"]


def fragment_schedule(H: int, P: int) -> Tuple[int, ...]:
    """The staggered offsets: fragment ``p`` syncs at the steps ``t`` with
    ``t mod H == p H // P`` (DESIGN.md, "DiLoCo")."""
    return tuple((p * H) // P for p in range(P))


def split_fragments(model: nn.Module, fragments) -> List[List[int]]:
    """The fragments as lists of indices into ``list(model.parameters())``.

    ``fragments`` is an int ``P`` (the parameters in model order cut into ``P``
    consecutive runs of about equal size -- the paper's fragments are runs of
    transformer blocks) or a list of lists of parameter names (``named_parameters()``)
    or parameters.  Every parameter must be in exactly one fragment."""
    params = model_parameters(model)
    if isinstance(fragments, bool):
        raise TypeError("fragments must be an int or a list of lists of parameter names")
    if isinstance(fragments, int):
        if fragments < 1:
            raise ValueError(f"fragments must be at least 1, got {fragments}")
        if fragments > len(params):
            raise ValueError(f"fragments must be at most the number of parameters ({len(params)}), got {fragments}")
        total = sum(p.numel() for p in params)
        out, cum, prev = [[] for _ in range(fragments)], 0, 0
        for i, p in enumerate(params):
            f = min(int((cum + p.numel() / 2) * fragments // total), fragments - 1)  # where its middle falls
            f = max(f, prev, fragments - (len(params) - i))  # monotone; enough parameters left for the rest
            f = 0 if i == 0 else min(f, prev + 1)  # no fragment skipped (none empty)
            out[f].append(i)
            cum, prev = cum + p.numel(), f
        return out
    if not isinstance(fragments, Sequence) or not fragments:
        raise ValueError("fragments must be an int >= 1 or a non-empty list of lists of parameter names")
    by_name = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    by_id = {id(p): i for i, p in enumerate(params)}
    owner = {}
    out = []
    for f, frag in enumerate(fragments):
        idx = []
        for entry in frag:
            i = by_name.get(entry) if isinstance(entry, str) else by_id.get(id(entry))
            if i is None:
                raise ValueError(f"fragment {f}: {entry if isinstance(entry, str) else 'a tensor'} is not a parameter "
                                 f"of the model (names: {list(by_name)[:6]}...)")
            if i in owner:
                raise ValueError(f"parameter {i} is in two fragments ({owner[i]} and {f})")
            owner[i] = f
            idx.append(i)
        if not idx:
            raise ValueError(f"fragment {f} is empty")
        out.append(idx)
    left = [n for n, i in by_name.items() if i not in owner]
    if left:
        raise ValueError(f"the fragments must cover the model: {left[:5]} {'...' if len(left) > 5 else ''}"
                         f"not in any fragment")
    return out


@dataclass(frozen=True)
class FragmentSend:
    fragment: int
    step: int
    payload_bytes: int  # this worker's all-reduce buffer


@dataclass(frozen=True)
class FragmentApplied:
    fragment: int
    sent_at: int
    stats: ServerStats
    left_out: Tuple[Tuple[int, str], ...] = ()  # quantized exchange: (rank, reason) of workers left out


@dataclass(frozen=True)
class StreamRecord:
    """What one inner step did besides the inner step: the fragments whose exchange it
    started (``sent``) and those whose outer step it applied and merged (``applied``)."""

    step: int
    sent: Tuple[FragmentSend, ...]
    applied: Tuple[FragmentApplied, ...]


class _Done:
    """The handle of an exchange restored from a checkpoint (its sum is already there)."""

    @staticmethod
    def wait():
        return True


class _InFlight:
    __slots__ = ("fragment", "sent_at", "apply_at", "buf", "work")

    def __init__(self, fragment, sent_at, apply_at, buf, work):
        self.fragment, self.sent_at, self.apply_at, self.buf, self.work = fragment, sent_at, apply_at, buf, work


def _default_outer(params) -> ServerOptimizer:
    return FedAvgM(params, lr=D.DILOCO["outer_lr"], momentum=D.DILOCO["outer_momentum"], nesterov=True)


class StreamingDiLoCo:
    """Streaming DiLoCo's training loop (see the module docstring).

    Args:
        model, inner_optimizer: as :class:`~fedopt_kernels.distributed.DiLoCo`.
        outer_optimizer: a factory ``params -> ServerOptimizer``, called once per
            fragment on that fragment's global copies; None: Nesterov SGD (0.7, 0.9).
        fragments: an int ``P`` or lists of parameter names (:func:`split_fragments`).
        sync_every: ``H`` (default :data:`~fedopt_kernels.defaults.DILOCO`'s 500).
        offsets: one step offset in ``[0, H)`` per fragment (default staggered,
            :func:`fragment_schedule`).
        overlap: ``tau``, inner steps between a send and its merge, ``0 <= tau < H``.
        alpha: the merge's weight of the local parameters, in ``[0, 1]``.
        group: the workers' process group.
        codec: None (fp32 all-reduce) or ``"int4"`` / ``"fp8"`` / ``"int8"`` (the
            quantized exchange, module docstring); ``codec_block`` values per scale.

    Everything is checked before anything changes.
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: Optional[Callable[[List[torch.Tensor]], ServerOptimizer]] = None, *,
                 fragments: Union[int, Sequence] = 2, sync_every: int = D.DILOCO["sync_every"],
                 offsets: Optional[Sequence[int]] = None, overlap: int = D.STREAMING_DILOCO["overlap"],
                 alpha: float = D.STREAMING_DILOCO["alpha"], group=None, broadcast_initial: bool = True,
                 codec: Optional[str] = None, codec_block: int = 256):
        H = check_sync_every(sync_every)
        if not isinstance(inner_optimizer, torch.optim.Optimizer) or isinstance(inner_optimizer, ServerOptimizer):
            raise TypeError(f"inner_optimizer must be a torch.optim.Optimizer, got {type(inner_optimizer).__name__}")
        params = model_parameters(model)
        frags = split_fragments(model, fragments)
        P = len(frags)
        offsets = fragment_schedule(H, P) if offsets is None else tuple(offsets)
        if len(offsets) != P or any(isinstance(o, bool) or not isinstance(o, int) or not 0 <= o < H
                                    for o in offsets):
            raise ValueError(f"offsets must be {P} ints in [0, {H}) (one per fragment), got {list(offsets)}")
        if isinstance(overlap, bool) or not isinstance(overlap, int) or not 0 <= overlap < H:
            raise ValueError(f"overlap must be an int in [0, sync_every={H}) (a fragment's exchange is merged "
                             f"before its next send), got {overlap!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be a number in [0, 1] (the local parameters' weight in the merge), "
                             f"got {alpha!r}")
        if codec is not None:
            check_exchange_codec(codec, codec_block)
        if outer_optimizer is not None and not callable(outer_optimizer):
            raise TypeError("outer_optimizer must be a factory: params -> ServerOptimizer (one per fragment)")
        if len({p.dtype for p in params}) > 1:
            raise ValueError("the model's parameters must share one dtype")
        comm.check_initialized("StreamingDiLoCo")
        if broadcast_initial:
            with torch.no_grad():
                for p in params:
                    comm.broadcast(p.data, 0, group)
        factory = outer_optimizer or _default_outer
        self.model, self.inner_optimizer, self.group = model, inner_optimizer, group
        self.sync_every, self.offsets, self.overlap, self.alpha = H, offsets, overlap, float(alpha)
        self.codec, self.codec_block = codec, codec_block
        self.params = params  # the model's, in model order
        self.fragments = [[params[i] for i in f] for f in frags]
        self.global_fragments = [torch.cat([p.detach().reshape(-1) for p in f]) for f in self.fragments]
        self._global_views = [_views(g, f) for g, f in zip(self.global_fragments, self.fragments)]
        self.outer_optimizers = []
        for f, views in enumerate(self._global_views):
            opt = factory(views)
            check_outer(opt, views, f"outer_optimizer(fragment {f})")
            self.outer_optimizers.append(opt)
        self.local_step = 0
        self._tokens: List[Optional[float]] = [None] * P
        self._tokens_given: Optional[bool] = None
        self._in_flight: List[_InFlight] = []

    def step(self, closure=None, *, tokens=None) -> StreamRecord:
        """One inner step, then the sends and merges due after it (collective: every
        worker calls it at every step).  ``tokens`` as :meth:`DiLoCo.step`."""
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, (int, float))
                                   or not math.isfinite(tokens) or tokens < 0):
            raise ValueError(f"tokens must be a finite number >= 0, got {tokens!r}")
        if self.local_step and (tokens is None) != (self._tokens_given is False):
            raise ValueError("tokens must be given on every step or on none")
        self._tokens_given = tokens is not None
        self.inner_optimizer.step(closure)
        self.local_step += 1
        t = self.local_step
        if tokens is not None:
            self._tokens = [(w or 0.0) + float(tokens) for w in self._tokens]
        sent = tuple(self._send(f, t) for f, o in enumerate(self.offsets) if t % self.sync_every == o)
        due = [x for x in self._in_flight if x.apply_at <= t]
        self._in_flight = [x for x in self._in_flight if x.apply_at > t]
        applied = tuple(self._apply(x) for x in due)
        return StreamRecord(step=t, sent=sent, applied=applied)

    @torch.no_grad()
    def _send(self, f: int, t: int) -> FragmentSend:
        glob, local = self._global_views[f], self.fragments[f]
        acc = torch.float64 if glob[0].dtype == torch.float64 else torch.float32
        n = self.global_fragments[f].numel()
        buf = torch.empty(n + 1, dtype=acc, device=self.global_fragments[f].device)
        for g, p, d in zip(glob, local, _views(buf[:n], local)):
            if p.dtype == acc:
                torch.sub(g, p, out=d)  # the outer gradient, one pass per tensor
            else:
                d.copy_(g)
                d.sub_(p)
        w = self._tokens[f]
        self._tokens[f] = None
        if self.codec is not None:  # the codes of Delta_k,p itself; its weight travels beside them
            codes = start_exchange(buf[:n].to(torch.float32), w, codec=self.codec, block=self.codec_block,
                                   group=self.group, async_op=True)
            self._in_flight.append(_InFlight(f, t, t + self.overlap, codes, codes))
            return FragmentSend(fragment=f, step=t, payload_bytes=codes.payload_bytes)
        if w is not None:
            buf[:n].mul_(w)
        buf[n].fill_(1.0 if w is None else w)
        work = dist.all_reduce(buf, group=self.group, async_op=True)
        self._in_flight.append(_InFlight(f, t, t + self.overlap, buf, work))
        return FragmentSend(fragment=f, step=t, payload_bytes=buf.numel() * buf.element_size())

    @torch.no_grad()
    def _apply(self, x: _InFlight) -> FragmentApplied:
        x.work.wait()
        left_out = ()
        if isinstance(x.buf, GatheredCodes):
            D, left_out = x.buf.mean()
            D = D.to(self.global_fragments[x.fragment].dtype)
        else:
            n = x.buf.numel() - 1
            D = (x.buf[:n] / x.buf[n]).to(self.global_fragments[x.fragment].dtype)
        stats = self.outer_optimizers[x.fragment].step(D[None])
        local, glob = self.fragments[x.fragment], self._global_views[x.fragment]
        theirs = torch._foreach_mul(glob, 1.0 - self.alpha)
        torch._foreach_mul_(local, self.alpha)
        torch._foreach_add_(local, theirs)
        return FragmentApplied(fragment=x.fragment, sent_at=x.sent_at, stats=stats, left_out=left_out)

    def state_dict(self) -> dict:
        """Everything to continue bit for bit, in the middle of a round too: the
        parameters, the global fragments, the outer and inner states, the counters, and
        the exchanges in flight (waited for here: their sums are saved, to be merged at
        their step after a restore)."""
        for x in self._in_flight:
            x.work.wait()
        return {
            "sync_every": self.sync_every, "offsets": self.offsets, "overlap": self.overlap, "alpha": self.alpha,
            "local_step": self.local_step, "tokens": list(self._tokens), "tokens_given": self._tokens_given,
            "params": [p.detach().clone() for p in self.params],
            "global_fragments": [g.clone() for g in self.global_fragments],
            "codec": self.codec, "codec_block": self.codec_block,
            "in_flight": [(x.fragment, x.sent_at, x.apply_at,
                           x.buf.state() if isinstance(x.buf, GatheredCodes) else x.buf.clone())
                          for x in self._in_flight],
            "inner": copy.deepcopy(self.inner_optimizer.state_dict()),
            "outer": [copy.deepcopy(o.state_dict()) for o in self.outer_optimizers],
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output; checked before anything changes."""
        for key in ("sync_every", "offsets", "overlap", "alpha"):
            if key not in state:
                raise ValueError(f"StreamingDiLoCo state_dict lacks {key!r}")
            if state[key] != getattr(self, key):
                raise ValueError(f"the state was saved with {key}={state[key]!r} but this StreamingDiLoCo has "
                                 f"{getattr(self, key)!r}")
        for key in ("codec", "codec_block"):  # absent in states saved before the quantized exchange: fp32
            saved = state.get(key, None if key == "codec" else self.codec_block)
            if saved != getattr(self, key):
                raise ValueError(f"the state was saved with {key}={saved!r} but this StreamingDiLoCo has "
                                 f"{getattr(self, key)!r}")
        saved, globs = state["params"], state["global_fragments"]
        if len(saved) != len(self.params) or any(a.shape != b.shape or a.dtype != b.dtype
                                                  for a, b in zip(saved, self.params)):
            raise ValueError("the state's parameters do not have this model's shapes and dtypes")
        if len(globs) != len(self.global_fragments) or any(a.shape != b.shape or a.dtype != b.dtype
                                                            for a, b in zip(globs, self.global_fragments)):
            raise ValueError("the state's global fragments do not match this model's fragments")
        if len(state["outer"]) != len(self.outer_optimizers):
            raise ValueError(f"the state has {len(state['outer'])} outer optimizers, this one "
                             f"{len(self.outer_optimizers)} fragments")
        for f, (views, outer) in enumerate(zip(self._global_views, state["outer"])):
            for j, p in enumerate(views):
                check_state_entry(outer.get("state", {}).get(j, {}), p, f"the state's outer optimizer {f} entry {j}")
        inner_before = copy.deepcopy(self.inner_optimizer.state_dict())
        outer_before = [copy.deepcopy(o.state_dict()) for o in self.outer_optimizers]
        try:
            self.inner_optimizer.load_state_dict(state["inner"])
            for o, st in zip(self.outer_optimizers, state["outer"]):
                o.load_state_dict(st)
        except Exception:
            self.inner_optimizer.load_state_dict(inner_before)
            for o, st in zip(self.outer_optimizers, outer_before):
                o.load_state_dict(st)
            raise
        torch._foreach_copy_(self.params, list(saved))
        torch._foreach_copy_(self.global_fragments, list(globs))
        self.local_step, self._tokens_given = state["local_step"], state["tokens_given"]
        self._tokens = list(state["tokens"])
        self._in_flight = [_InFlight(f, sent, at,
                                     GatheredCodes.from_state(buf) if isinstance(buf, dict) else buf.clone(), _Done())
                           for f, sent, at, buf in state["in_flight"]]

    def finish(self) -> Tuple[FragmentApplied, ...]:
        """Wait for every exchange still in flight and apply it now (end of training)."""
        due, self._in_flight = self._in_flight, []
        return tuple(self._apply(x) for x in due)


def _views(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    out, offset = [], 0
    for p in like:
        out.append(flat[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    return out
