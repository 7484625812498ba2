"""Local training of one client on the flat parameter vector.

ONE local ``nn.Module`` serves every client of a simulation: its parameters are views
into one flat vector ``x`` (:func:`fedopt_kernels.utils.flatten_parameters_`) and its
gradients views into one flat ``grad`` buffer.  Per client the trainer

1. copies the global vector into ``x`` (the only copy of the model per client),
2. runs ``steps`` local steps: forward/backward on a mini-batch (gradients accumulate
   straight into the flat buffer), then adds FedProx's ``mu (x - x0)`` and SCAFFOLD's
   ``c - c_i`` to ``g`` -- BEFORE the step, so inside FedNAR's norm and clip
   (as the FedNAR authors' released code does) -- and takes one fused :class:`~fedopt_kernels.optim.FedNAR`
   step (mode ``co``, ``grad`` or ``none``),
3. writes ``D_i = x0 - x_end`` into the caller's row of the round's ``[C, N]`` tensor.

``x0`` is the global vector itself (it does not change during the round), so FedProx
and SCAFFOLD need no copy of it.  The learning rate of local step ``k`` in round ``t``
is ``lr * lr_decay^t * beta_k`` (FedNAR's per-round annealing times FedDecay's
within-round factor, :mod:`fedopt_kernels.lr_scheduler`), the weight decay
``wd * wd_decay^t``.  Statistics (loss, clipped steps, norms of clipped steps, skipped
steps) accumulate in device tensors and are read once per round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ... import defaults as D
from ...lr_scheduler import annealing_factor, within_round_factor
from ...optim import FedNAR
from ...server import scaffold_control_update_
from ...utils import buffers_layout, flatten_parameters_

__all__ = ["LocalConfig", "LocalTrainer", "ScaffoldState", "RoundStats", "NonFiniteClientWarning"]

#: why a client left out by :meth:`RoundStats.close_client` is left out (the records' ``nonfinite``)
NONFINITE_TRAINING = "non-finite loss or local step (NaN/Inf in its data, or its training diverged)"


class NonFiniteClientWarning(UserWarning):
    """A client trained to a non-finite loss or step and was left out of its round."""


def _setting(default, help_: str):
    """A field with its help text (``fedopt simulate``'s option is generated from it;
    ``{default}`` is filled in with the field's default)."""
    return field(default=default, metadata={"help": help_})


@dataclass
class LocalConfig:
    """Hyperparameters of local training (see the module docstring); the defaults are
    :data:`fedopt_kernels.defaults.LOCAL`, the simulator's.

    The simulator's settings hold one of these as their ``local`` part
    (:class:`~fedopt_kernels.fl.SimulationConfig`), under the same names; there
    ``prox_mu`` is FedProx's mu, applied only when the algorithm is FedProx, and
    ``scaffold`` follows from the algorithm (``SimulationConfig.local_config``)."""

    steps: int = _setting(D.LOCAL["steps"], "local steps per round, tau (default {default})")
    batch_size: int = _setting(D.LOCAL["batch_size"], "local mini-batch size (default {default})")
    lr: float = _setting(D.LOCAL["lr"], "local learning rate (default {default})")
    lr_decay: float = _setting(D.LOCAL["lr_decay"], "per-round decay of the local lr, as FedNAR's 0.998 "
                                                    "(default {default})")
    weight_decay: float = _setting(D.LOCAL["weight_decay"], "local weight decay, PyTorch-SGD sense (default {default})")
    wd_decay: float = _setting(D.LOCAL["wd_decay"], "extra per-round factor on the weight decay (default {default})")
    max_norm: float = _setting(D.LOCAL["max_norm"], "clip threshold of FedNAR / gradient clipping (default {default})")
    nar: str = _setting(D.LOCAL["nar"], "local step: co (FedNAR co-clipping), grad (gradient clipping), none "
                                        "(plain SGD) (default {default})")
    momentum: float = _setting(D.LOCAL["momentum"], "local heavy-ball momentum (default {default})")
    # no proximal term unless the run is FedProx (its mu: defaults.FEDPROX_MU)
    prox_mu: float = _setting(0.0, "FedProx's mu (default {default})")
    scaffold: bool = False
    decay_beta: float = _setting(D.LOCAL["decay_beta"], "FedDecay within-round decay beta in [0, 1]; 1 = off "
                                                        "(default {default})")
    decay_kind: str = _setting(D.LOCAL["decay_kind"], "FedDecay: exponential or linear (default {default})")
    decay_per: str = _setting(D.LOCAL["decay_per"], "FedDecay counts local steps or epochs: step or epoch "
                                                    "(default {default})")
    backend: Optional[str] = _setting(None, "kernel backend: reference, cpu, triton, cuda (default automatic)")
    # FedLAW's released code: each client's SGD momentum buffers carry over to its next round
    carry_momentum: bool = _setting(False, "each client keeps its local momentum buffers across its rounds, as "
                                           "FedLAW's code (sequential engine) (default false)")
    # FedDecay's released code (decay_per="epoch"): epoch j runs at the full lr, then its parameter
    # change is scaled by beta_j (trainer_decay.py:117-145), instead of running epoch j at lr * beta_j
    decay_scales_change: bool = _setting(False, "FedDecay with --decay-per epoch as its authors' code: each epoch "
                                                "at the full lr, its parameter change then scaled by beta^j "
                                                "(sequential engine) (default false: epoch j runs at lr * beta^j)")

    def lr_at(self, round_index: int, k: int) -> float:
        """The local lr of (0-based) decay index ``k`` in round ``round_index``."""
        return (self.lr * annealing_factor(round_index, self.lr_decay)
                * within_round_factor(k, self.decay_beta, self.decay_kind))

    def weight_decay_at(self, round_index: int) -> float:
        return self.weight_decay * annealing_factor(round_index, self.wd_decay)


class RoundStats:
    """Device-side sums over the local steps of a round (read once per round)."""

    def __init__(self, device, dtype=torch.float64):
        z = lambda: torch.zeros((), dtype=dtype, device=device)  # noqa: E731
        self.loss_sum, self.clipped, self.clipped_norm_sum, self.skipped = z(), z(), z(), z()
        self.steps = 0
        # steps of the clients left out for a non-finite loss or step (their sums are taken back)
        self.uncounted = z()
        #: ``(client, 0-dim bool tensor)`` per client trained: True when its training was non-finite
        self.nonfinite: list = []

    def add_step(self, loss: torch.Tensor, stats) -> None:
        self.loss_sum += loss.detach().to(self.loss_sum.dtype)
        if stats is not None:
            clipped = (stats.scale < 1) & ~stats.skipped
            self.clipped += clipped.to(self.clipped.dtype)
            self.clipped_norm_sum += torch.where(clipped, stats.norm.to(self.loss_sum.dtype),
                                                 torch.zeros_like(self.loss_sum))
            self.skipped += stats.skipped.to(self.skipped.dtype)
        self.steps += 1

    def mark(self) -> tuple:
        """The sums before a client trains, for :meth:`close_client`."""
        return (self.loss_sum.clone(), self.clipped.clone(), self.clipped_norm_sum.clone(), self.skipped.clone(),
                self.steps)

    def close_client(self, client, mark: tuple, update: torch.Tensor) -> None:
        """End client ``client``'s training (its steps added since :meth:`mark`): when a
        step was skipped as non-finite or its loss is not finite -- NaN/Inf in its data,
        or a diverged model -- its update becomes NaN, so the server step leaves it out
        as ``nonfinite`` (a client whose every step was skipped would otherwise send a
        zero update that is averaged in), and its steps are taken back out of the
        round's sums.  On the device: no host sync."""
        bad = (self.skipped != mark[3]) | ~torch.isfinite(self.loss_sum)
        for total, before in zip((self.loss_sum, self.clipped, self.clipped_norm_sum, self.skipped), mark[:4]):
            total.copy_(torch.where(bad, before, total))
        self.uncounted += bad.to(self.uncounted.dtype) * float(self.steps - mark[4])
        update.masked_fill_(bad, float("nan"))
        self.nonfinite.append((client, bad))

    def summary(self) -> dict:
        """Python numbers (one device sync for all of them); the steps of the clients
        left out as non-finite (:meth:`close_client`) do not count."""
        loss, clipped, norm_sum, skipped, uncounted = torch.stack(
            [self.loss_sum, self.clipped, self.clipped_norm_sum, self.skipped, self.uncounted]).tolist()
        steps = self.steps - int(uncounted)
        n = max(steps, 1)
        return {
            "train_loss": loss / n if steps else None,
            "clip_frequency": clipped / n if steps else None,
            "clipped_steps": int(clipped),
            "mean_clipped_norm": norm_sum / clipped if clipped > 0 else None,
            "skipped_steps": int(skipped),
            "local_steps_total": steps,
        }


class ScaffoldState:
    """SCAFFOLD's control variates: the server's ``c`` and the clients' ``c_i`` (all
    start at zero), as flat vectors; option II update (Karimireddy et al. Algorithm 1).

    The ``c_i`` live in a :class:`~fedopt_kernels.fl.engine.client_state.ClientStateStore`
    (name ``"c_i"``): a row only for a client that has taken part, zeros for the others,
    so the state grows with participation, not with ``num_clients`` (``store_dtype``
    keeps the rows compactly, ``spill_dir`` in memory-mapped files; see there).

    A round is a transaction: :meth:`client_update` only records each client's update
    and lr sum, :meth:`server_update` applies them all (``c_i`` and ``c``) at the end of
    the round -- after the server step, with the mask of clients its aggregation
    excluded -- through :func:`fedopt_kernels.server.scaffold_control_update_`, the
    update the Flower strategy runs too (a NaN/Inf update never reaches ``c`` or
    ``c_i``).  A round abandoned half way (Ctrl-C) leaves the state as it was.
    """

    def __init__(self, num_clients: int, numel: int, *, device, dtype=torch.float32,
                 store_dtype: Optional[torch.dtype] = None, spill_dir: Optional[str] = None, store=None):
        from .client_state import ClientStateStore

        self.num_clients = int(num_clients)
        self.c = torch.zeros(numel, device=device, dtype=dtype)
        # the simulation's store (shared with any other per-client state), or one of its own
        self.store = store if store is not None else ClientStateStore(dtype=store_dtype, spill_dir=spill_dir)
        self.store.register("c_i", numel, dtype=dtype, device=device)
        self._pending: dict = {}  # client -> (its update D_i, read at server_update; its lr sum)

    def control(self, client: int) -> torch.Tensor:
        """Client ``client``'s ``c_i`` (zeros if it never took part)."""
        return self.store.get("c_i", client)

    def set_control(self, client: int, value: torch.Tensor) -> None:
        self.store.put("c_i", client, value)

    def controls(self, clients) -> torch.Tensor:
        """``[len(clients), N]``: the clients' ``c_i``."""
        return self.store.gather("c_i", clients)

    @property
    def c_clients(self) -> torch.Tensor:
        """A dense ``[num_clients, N]`` copy of every ``c_i`` (population-sized: for
        inspecting small runs; the state itself is :attr:`store`)."""
        dense = torch.zeros(self.num_clients, self.c.numel(), device=self.c.device, dtype=self.c.dtype)
        for cid, row in self.store.items("c_i"):
            dense[cid].copy_(row)
        return dense

    def correction(self, client: int, out: torch.Tensor) -> torch.Tensor:
        """``c - c_i`` into ``out``."""
        if not self.store.has("c_i", client):  # c - 0 = c, bit for bit
            return out.copy_(self.c)
        return torch.sub(self.c, self.store.get("c_i", client), out=out)

    def client_update(self, client: int, update: torch.Tensor, lr_sum: float) -> None:
        """Record client ``client``'s ``D_i = x0 - x_end`` (a reference: it must stay
        unchanged until :meth:`server_update`) and ``lr_sum = K eta_l``; option II then
        gives ``c_i^+ - c_i = D_i / lr_sum - c``."""
        self._pending[client] = (update, float(lr_sum))

    def discard_round(self) -> None:
        self._pending.clear()
        self._staged, self._total = None, None

    # the client-state rule of the round (fedopt_kernels.server.ServerRound)
    def commit(self, replies, excluded: Optional[torch.Tensor]) -> None:
        """The round's update after its step: :meth:`server_update` for the clients of
        ``replies`` (its rows' order) without those the step ``excluded``."""
        self.server_update(excluded, clients=replies.clients)

    def discard(self) -> None:
        """A round that applied nothing: :meth:`discard_round`."""
        self.discard_round()

    def discard_pending(self) -> None:
        """Forget the updates recorded since the last :meth:`fold_chunk` (a chunk being
        retrained), keeping the chunks already folded."""
        self._pending.clear()

    _staged: Optional[dict] = None  # chunked rounds: client -> its c_i^+, committed by server_update
    _total: Optional[torch.Tensor] = None  # chunked rounds: sum dc_i so far, in the round's client order

    def fold_chunk(self, clients, excluded: torch.Tensor) -> None:
        """A chunked round (:mod:`~fedopt_kernels.fl.engine.chunked`): apply option II to the
        pending ``clients`` of a chunk now -- their updates are about to be overwritten --
        with ``excluded`` (``[k]`` bool, the aggregation's NaN/Inf mask for them).  The
        arithmetic of :func:`~fedopt_kernels.server.scaffold_control_update_`, term by
        term in the same order, so the round's ``c`` and ``c_i`` are the unchunked
        round's bits; staged until :meth:`server_update` commits the round."""
        if self._staged is None:
            self._staged, self._total = {}, torch.zeros_like(self.c)
        for i, cid in enumerate(clients):
            cid = int(cid)
            update, lr_sum = self._pending.pop(cid, (self.c, 0.0))
            row = self.store.get("c_i", cid).clone()  # staged: the stored row changes when the round commits
            if lr_sum > 0 and lr_sum != float("inf"):
                delta = update.to(self.c.dtype) / lr_sum - self.c
                ok = torch.isfinite(delta).all() & ~excluded[i].to(device=self.c.device, dtype=torch.bool)
                delta = torch.where(ok, delta, torch.zeros_like(delta))
                self._total += delta
                row.add_(delta)
            self._staged[cid] = row

    def server_update(self, excluded: Optional[torch.Tensor] = None, *, clients=None) -> None:
        """Apply the round: ``c_i <- c_i^+`` for its clients, then
        ``c <- c + (1/N) sum_{i in S} (c_i^+ - c_i)``, leaving out the clients
        ``excluded`` marks (``[C]`` bool in the order of ``clients``; default: the order
        of the :meth:`client_update` calls) and any whose change is not finite.  Every
        client that trained gets a row (its ``c_i`` unchanged if it did not count)."""
        if self._staged is not None:  # a chunked round: its clients were folded chunk by chunk
            for cid, row in self._staged.items():
                self.store.put("c_i", cid, row)
            self.c.add_(self._total, alpha=1.0 / self.num_clients)
            self._staged, self._total = None, None
            self._pending.clear()
            return
        if not self._pending:
            return
        order = list(self._pending) if clients is None else [int(cid) for cid in clients]
        updates, lr_sums, controls = [], [], []
        for cid in order:
            update, lr_sum = self._pending.get(cid, (self.c, 0.0))  # absent: lr sum 0, not counted
            updates.append(update)
            lr_sums.append(lr_sum)
            controls.append(self.store.get("c_i", cid))  # the stored row itself, or a copy to put back
        scaffold_control_update_(self.c, updates, lr_sums, num_clients=self.num_clients, excluded=excluded,
                                 client_controls=controls)
        for cid, row in zip(order, controls):
            if cid in self._pending:
                self.store.put("c_i", cid, row)
        self._pending.clear()

    def state_dict(self) -> dict:
        """``c`` and the rows of the clients that took part (sorted by client)."""
        rows = self.store.state_dict()["c_i"]
        return {"c": self.c, "clients": rows["clients"], "controls": rows["rows"]}

    def load_state_dict(self, state: dict) -> None:
        """From :meth:`state_dict`, or an older checkpoint's dense ``c_clients``."""
        if "c_clients" in state:
            if tuple(state["c_clients"].shape) != (self.num_clients, self.c.numel()):
                raise ValueError(f"the checkpoint's c_clients has shape {tuple(state['c_clients'].shape)}, this run "
                                 f"{(self.num_clients, self.c.numel())}")
            self.store.load_dense("c_i", state["c_clients"])
        else:
            self.store.load_state_dict({"c_i": {"clients": state["clients"], "rows": state["controls"]}})
        self.c.copy_(state["c"])
        self.discard_round()


class LocalTrainer:
    """Trains clients one after another on ONE flat-parameter copy of the model.

    Args:
        model: the local module (its parameters are moved into one flat vector; it
            must not be shared with anything else).
        loss_fn: ``loss_fn(outputs, labels) -> scalar`` (mean over the batch).
        x_train, y_train: the whole training set as tensors on the model's device;
            clients are index tensors into it.
        config: :class:`LocalConfig`.
    """

    def __init__(self, model: nn.Module, loss_fn, x_train: torch.Tensor, y_train: torch.Tensor,
                 config: LocalConfig):
        self.model = model
        self.loss_fn = loss_fn
        self.x_train, self.y_train = x_train, y_train
        self.config = config
        self.x = flatten_parameters_(model)
        self.params = [p for _, p in model.named_parameters()]
        self.grad = torch.zeros_like(self.x)
        offset = 0
        for p in self.params:  # gradients are views of one flat buffer: backward fills it in place
            p.grad = self.grad[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.buffers_layout = buffers_layout(model)
        self.buffers = [b for _, b in model.named_buffers() if b.is_floating_point()]
        self.optimizer = FedNAR([{"params": self.params}], lr=config.lr, weight_decay=config.weight_decay,
                                max_norm=config.max_norm, mode=config.nar, momentum=config.momentum,
                                backend=config.backend)
        needs_tmp = config.prox_mu != 0.0 or config.scaffold
        self._tmp = torch.empty_like(self.x) if needs_tmp else None
        self._corr = torch.empty_like(self.x) if config.scaffold else None
        # carry_momentum: client id -> its momentum buffers (a plain dict; a per-client state store may replace it)
        self.momentum_buffers: dict = {}
        self._epoch_start = torch.empty_like(self.x) if config.decay_scales_change else None

    @property
    def numel(self) -> int:
        return self.x.numel()

    def _batches(self, indices: torch.Tensor, generator: torch.Generator):
        """Endless mini-batches of ``indices``: a fresh permutation per local epoch."""
        n = indices.numel()
        bs = min(self.config.batch_size, n)
        while True:
            perm = indices[torch.randperm(n, generator=generator).to(indices.device)]
            for start in range(0, n - bs + 1, bs):  # drop the ragged tail of each epoch
                yield perm[start:start + bs]

    def steps_per_epoch(self, num_samples: int) -> int:
        return max(num_samples // min(self.config.batch_size, num_samples), 1)

    def train(self, x_global: torch.Tensor, indices: torch.Tensor, *, round_index: int, seed: int,
              out_update: torch.Tensor, stats: RoundStats, client: Optional[int] = None,
              scaffold: Optional[ScaffoldState] = None, global_buffers: Optional[torch.Tensor] = None,
              out_buffers: Optional[torch.Tensor] = None) -> float:
        """Train one client from ``x_global``; writes ``D_i = x_global - x_end`` into
        ``out_update`` (and the final floating buffers into ``out_buffers``).  Returns
        the sum of the local lrs used (SCAFFOLD's ``K eta_l``).

        ``seed`` fixes the client's batch order (and dropout): the simulator derives it
        from ``(seed, round, client)`` so every run sees the same batches.
        """
        cfg = self.config
        group = self.optimizer.param_groups[0]
        group["weight_decay"] = cfg.weight_decay_at(round_index)
        if cfg.carry_momentum and cfg.momentum != 0.0:  # the client's own buffers, kept across its rounds
            if client is None:
                raise ValueError("carry_momentum needs the client's id (client=) to keep its momentum")
            bufs = self.momentum_buffers.setdefault(client, [torch.zeros_like(p) for p in self.params])
            for p, buf in zip(self.params, bufs):
                self.optimizer.state[p]["momentum_buffer"] = buf
        else:
            for st in self.optimizer.state.values():  # local momentum restarts at zero per client
                buf = st.get("momentum_buffer")
                if buf is not None:
                    buf.zero_()
        with torch.no_grad():
            self.x.copy_(x_global)
            if global_buffers is not None and self.buffers:
                self.buffers_layout.copy_to(global_buffers, self.buffers)
        correction = scaffold.correction(client, self._corr) if scaffold is not None else None
        generator = torch.Generator().manual_seed(seed)
        batches = self._batches(indices, generator)
        per_epoch = self.steps_per_epoch(indices.numel())
        self.model.train()
        lr_sum = 0.0
        mark = stats.mark()
        devices = [self.x.device] if self.x.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)  # dropout & co. draw from the client's own stream
            for step in range(cfg.steps):
                k = step if cfg.decay_per == "step" else step // per_epoch
                scale = 1.0
                if cfg.decay_scales_change:  # the epoch at the full lr; its change scaled at its end
                    scale = within_round_factor(k, cfg.decay_beta, cfg.decay_kind)
                    k = 0
                    if step % per_epoch == 0:
                        self._epoch_start.copy_(self.x)
                lr = cfg.lr_at(round_index, k)
                group["lr"] = lr
                lr_sum += lr * scale
                idx = next(batches)
                self.grad.zero_()
                loss = self.loss_fn(self.model(self.x_train[idx]), self.y_train[idx])
                loss.backward()
                with torch.no_grad():
                    if cfg.prox_mu != 0.0:  # FedProx: g += mu (x - x0)
                        torch.sub(self.x, x_global, out=self._tmp)
                        self.grad.add_(self._tmp, alpha=cfg.prox_mu)
                    if correction is not None:  # SCAFFOLD: g += c - c_i
                        self.grad.add_(correction)
                self.optimizer.step()
                stats.add_step(loss, self.optimizer.last_stats[0])
                if scale != 1.0 and ((step + 1) % per_epoch == 0 or step + 1 == cfg.steps):
                    with torch.no_grad():  # x <- x_start + beta_j (x - x_start)
                        self.x.sub_(self._epoch_start).mul_(scale).add_(self._epoch_start)
        with torch.no_grad():
            torch.sub(x_global, self.x, out=out_update)
            stats.close_client(client, mark, out_update)  # a non-finite client: a NaN update, left out
            if out_buffers is not None and self.buffers:
                self.buffers_layout.flatten(self.buffers, out=out_buffers)
        if scaffold is not None:
            scaffold.client_update(client, out_update, lr_sum)
        return lr_sum
