"""Training a round's clients: the simulator's local-training part (:class:`RoundTraining`),
between sampling the round and its server step.

Engines (:meth:`RoundTraining.train_clients`): ``"batched"`` trains the round's clients
as one ``[C, N]`` tensor under ``torch.func.vmap`` with the row-wise fused FedNAR step,
drawing exactly the sequential engine's batches; ``"sequential"`` is the oracle it is
tested against (same global model to fp32 rounding).  ``"auto"`` (the default) is
batched unless one client trains per round.  A model ``vmap`` cannot batch falls back
to sequential with an :class:`~fedopt_kernels.fl.engine.batched.EngineFallbackWarning`;
``results.meta["engine"]`` says which engine ran.

Each client that takes part writes ``D_i = x_global - x_end_i`` into its row of
:attr:`~RoundTraining.updates`; one that cannot (no samples, or its training raised) is
listed in ``round_bad`` instead (see the simulation module for how a round treats
them).  With ``memory_budget`` the round trains ``K`` clients at a time (:mod:`.chunked`):
each chunk folded into the round's running weighted sum (its buffer rows into the
running mean of :class:`~fedopt_kernels.server.weighting.BufferAverage`), or written to
its rows of the round's tables.  ``progress(round, done, total)`` reports the clients
done as they train.  The round's replies to the server (:meth:`RoundTraining.round_replies`)
are the clients' side of the exchange: client-side DP clipping, the attackers' updates,
and compressed updates encoded and screened (``--compress``).

The part owns its state: the local model and its trainer, the engine, the round's rows,
the per-client state (SCAFFOLD's ``c_i``, error feedback's residuals, carried momentum)
and its piece of the checkpoint (:meth:`RoundTraining.state_dict`).
"""

from __future__ import annotations

import logging
import warnings
from typing import Callable, List, Optional

import torch
from torch import nn

from ...server import RoundReplies
from ...server.weighting import BufferAverage
from ...utils import buffers_layout, buffers_to_vector
from ..engine.batched import BatchedTrainer, BatchedUnsupported, EngineFallbackWarning, unsupported_reason
from ..engine.chunked import FOLDABLE, RoundFold, chunk_clients
from ..engine.client import LocalConfig, LocalTrainer, RoundStats, ScaffoldState
from ..engine.client_state import ClientStateStore
from ..engine.compressed_updates import COMPRESSED_REASONS, ClientCompression
from .config import ConfigError, MemoryBudgetWarning, SimulationConfig
from .population import Population
from .server_side import BAD_CLIENT_REASONS
from ..seeds import batch_seed

__all__ = ["RoundTraining", "local_config"]

# the simulator's one logger (its warnings have always come from fedopt_kernels.fl.run.simulation)
_log = logging.getLogger("fedopt_kernels.fl.run.simulation")


def local_config(config: SimulationConfig) -> LocalConfig:
    """The clients' :class:`~fedopt_kernels.fl.engine.client.LocalConfig` of a run's
    settings: built in one place (today ``config.local_config()``, the flat settings'
    mapping; ``config.local`` once the settings are nested)."""
    return config.local_config()


class RoundTraining:
    """The round's client training, chunking, folding and replies (see the module
    docstring): the local-training part of a
    :class:`~fedopt_kernels.fl.run.simulation.Simulation`.

    Built over the run's ``population`` and global ``model`` (whose parameters are views
    of ``x_global``), training on ``local_model`` (a copy of it); :meth:`setup` then
    joins it to the server part and the results' ``meta`` (the engine, the chunking and
    the compression are recorded there).
    """

    #: True in a part that spreads a round over ranks (the distributed simulator): a
    #: memory budget is then refused (:meth:`_allocate_rounds`)
    spreads_over_ranks = False

    def __init__(self, config: SimulationConfig, population: Population, model: nn.Module, local_model: nn.Module,
                 x_global: torch.Tensor, loss_fn: Callable):
        self.config, self.population, self.global_model, self.x_global = config, population, model, x_global
        self.device, self.numel, self.loss_fn = population.device, x_global.numel(), loss_fn
        self.local = local_config(config)
        self.trainer = LocalTrainer(local_model, loss_fn, population.train_x, population.train_y, self.local)
        # per-client state (fl/engine/client_state.py): rows only for clients that took part, one store for
        # every kind of it (SCAFFOLD's c_i registers "c_i"; other per-client state registers its own name)
        self.client_state = ClientStateStore(
            dtype=getattr(torch, config.client_state_dtype) if config.client_state_dtype else None,
            spill_dir=config.client_state_dir)
        self.scaffold = (ScaffoldState(config.clients, self.numel, device=self.device, dtype=x_global.dtype,
                                       store=self.client_state)
                         if self.local.scaffold else None)
        self._buffers_layout = buffers_layout(model)
        self._has_buffers = len(self._buffers_layout) > 0
        self.updates: Optional[torch.Tensor] = None  # the rows clients train into (_allocate_rounds)
        self.buffer_rows: Optional[torch.Tensor] = None  # the clients' buffer rows, beside updates
        self.batched: Optional[BatchedTrainer] = None
        self.round_bad: list = []  # (client, reason, detail) of the clients of the last call left out
        self.round_kept: List[int] = []  # ... and the ones that trained, in order (their rows of updates)
        self.round_nonfinite: list = []  # (client, flag) of the last round's clients: trained to NaN/Inf

    def setup(self, server, meta: dict) -> None:
        """Join the server part ``server`` (its weights fold chunked rounds, its
        privacy clips the clients' rows) and the results' ``meta``; then the clients'
        codec, the engine and the round's rows."""
        cfg = self.config
        self.server, self.meta = server, meta
        self.privacy, self.robust, self.attack = server.privacy, server.robust, self.population.attack
        # compressed updates (--compress): the clients' codec, error feedback's residuals in the store
        codec = cfg.codec()
        self.compression = (ClientCompression(codec, self.numel, cfg.seed, store=self.client_state,
                                              error_feedback=cfg.error_feedback, backend=cfg.backend,
                                              device=self.device) if codec is not None else None)
        self._setup_engine()
        self._allocate_rounds(distributed=self.spreads_over_ranks)

    # ------------------------------------------------------------------ engines
    def _setup_engine(self) -> None:
        """The client engine ``config.engine`` asks for (see :mod:`.batched`)."""
        cfg = self.config
        engine = cfg.engine
        if engine == "auto":
            engine = "batched" if cfg.per_round > 1 else "sequential"
        self.meta["engine"] = engine
        if engine != "batched":
            return
        if cfg.carry_momentum or cfg.decay_scales_change:  # per-client state / per-epoch rescaling: sequential only
            self._fall_back("carry_momentum and decay_scales_change run on the sequential engine")
            return
        reason = unsupported_reason(self.global_model)
        if reason is not None:
            self._fall_back(reason)
            return
        pop = self.population
        self.batched = BatchedTrainer(self.trainer.model, self.loss_fn, pop.train_x, pop.train_y,
                                      self.local, num_classes=self.population.dataset.num_classes,
                                      buffers=dict(self.global_model.named_buffers()),
                                      client_batch=cfg.client_batch, seed=cfg.seed,
                                      population_sizes=self.population.partition.sizes, round_clients=cfg.per_round)

    def _fall_back(self, reason: str) -> None:
        """Use the sequential engine from now on, with a one-line notice."""
        self.batched = None
        self.meta["engine"] = "sequential"
        self.meta["engine_fallback"] = reason
        warnings.warn(f"the batched engine cannot train this model ({reason}); using the sequential engine",
                      EngineFallbackWarning, stacklevel=5)

    def _train_clients_batched(self, round_number: int, clients: List[int]) -> RoundStats:
        stats = RoundStats(self.device)
        C = len(clients)
        if C == 0:
            return stats
        base = self._progress_base
        starts, rounds = self._client_starts(clients)
        self.batched.train_round(
            self.x_global, [self._client_rows(cid) for cid in clients], round_index=round_number - 1,
            seeds=[batch_seed(self.config.seed, r, cid) for cid, r in zip(clients, rounds or [round_number] * C)],
            starts=starts, round_indices=None if rounds is None else [r - 1 for r in rounds],
            out=self.updates[self._rows_at:self._rows_at + C], stats=stats, clients=clients, scaffold=self.scaffold,
            on_group=(None if self.progress is None else lambda done: self._report_progress(round_number, base + done)))
        if self._has_buffers:  # buffers the batched engine allows are not changed by training
            rows = self.buffer_rows[self._rows_at:self._rows_at + C]
            rows.copy_(buffers_to_vector(self.global_model).expand(C, -1))
        self.meta.setdefault("client_batch_used", self.batched.planner.last_group_size)
        if self.batched.trace_failure is not None:  # still correct, only slower: say why
            self.meta["batched_trace_failure"] = self.batched.trace_failure
        return stats

    def _screen_clients(self, clients: List[int]) -> List[tuple]:
        """``(client, "no_data", detail)`` for the round's clients without samples;
        ``on_bad_client="raise"``: raises before anything trains."""
        empty = [cid for cid in clients if self.population.client_indices[cid].numel() == 0]
        if empty and self.config.on_bad_client == "raise":
            raise ValueError(f"client(s) {empty} hold no samples and cannot train (on_bad_client='raise'; "
                             "'exclude' leaves them out of their rounds)")
        return [(cid, "no_data", "holds no samples") for cid in empty]

    def train_clients(self, round_number: int, clients: List[int], *, starts: Optional[torch.Tensor] = None,
                       round_numbers: Optional[List[int]] = None) -> RoundStats:
        """Train the round's ``clients``; the ones that take part write their rows
        ``[:len(self.round_kept)]`` of :attr:`updates` (and :attr:`buffer_rows`) in
        order, the others are listed in ``self.round_bad`` (``(client, reason,
        detail)``, in the order of ``clients``).

        ``starts`` (``[len(clients), N]``) and ``round_numbers``: each client trains from
        its own start row, seeded and annealed as its own round (FedBuff's clients on the
        versions they pulled, :mod:`.clocked`); ``D_i`` is then ``starts[i] - x_end_i``.
        Not with ``memory_budget`` or SCAFFOLD."""
        self._starts = None
        if starts is not None or round_numbers is not None:
            if starts is None or round_numbers is None or len(round_numbers) != len(clients) \
                    or starts.shape != (len(clients), self.numel):
                raise ValueError(f"starts ([{len(clients)}, {self.numel}]) and round_numbers ({len(clients)} ints) "
                                 "come together, one row and one round per client")
            if self._chunk is not None or self.scaffold is not None:
                raise ValueError("per-client starts are not supported with memory_budget or SCAFFOLD")
            self._starts = {cid: (starts[i], int(round_numbers[i])) for i, cid in enumerate(clients)}
        bad = self._screen_clients(clients)
        skip = {cid for cid, _, _ in bad}
        todo = [cid for cid in clients if cid not in skip]
        self.round_bad, self.round_kept = bad, todo
        self._progress_total = len(clients)
        self._report_progress(round_number, 0)
        if self._chunk is not None:
            stats = self._train_chunked(round_number, clients, todo, bad)
            self.round_nonfinite = stats.nonfinite
            return stats
        if self.population.lazy:
            self._round_data(todo)
        try:
            self._progress_base = len(bad)  # the clients screened out are done
            stats = self._train_round_clients(round_number, clients, todo, bad)
        finally:
            self._progress_base = 0
            self._starts = None  # the start rows are the caller's: hold none past the call
            if self.population.lazy:
                self._round_data(None)
        self._report_progress(round_number, len(clients))
        self.round_nonfinite = stats.nonfinite  # read by the record, only when clients were left out
        return stats

    def _report_progress(self, round_number: int, done: int) -> None:
        """``progress(round, done, clients in the round)``, when someone listens."""
        if self.progress is not None:
            self.progress(round_number, done, self._progress_total)

    # ------------------------------------------------------------------ chunked rounds (memory_budget)
    _chunk: Optional[int] = None  # clients trained at once (None: the whole round)
    _foldable = False  # chunks folded into a running sum (fl/engine/chunked.py), else kept in `updates`
    _fold: Optional[RoundFold] = None  # the running sum of the round being trained
    compression = None  # the clients' codec (fl/engine/compressed_updates.py; None: fp32 updates)
    _compressed_fold: Optional[tuple] = None  # a folded compressed round's replies so far, and those left out
    _buffer_fold: Optional[BufferAverage] = None  # ... and of its clients' floating buffers (BatchNorm statistics)
    _rows_at = 0  # the row of `updates` the clients being trained write first
    #: ``progress(round, clients_done, clients_in_round)`` as a round's clients train: at its
    #: start (0), after each client (sequential engine), group of clients (batched) and chunk
    #: (``memory_budget``), and at its end (``fedopt simulate`` shows it as a second progress
    #: bar once a round runs long); None: not called.  It only reads counts: no host sync.
    progress: Optional[Callable[[int, int, int], None]] = None
    _progress_total = 0  # the clients of the round being trained
    _progress_base = 0  # of them, the ones done before the piece being trained

    def _allocate_rounds(self, distributed: bool = False) -> None:
        """The rows a round's clients train into: ``[per_round, N]``, or with
        ``memory_budget`` chunks of ``K`` clients (:mod:`.chunked`): a ``[K, N]`` buffer
        folded into a running sum for the weighted-sum algorithms, else the round's
        ``[per_round, N]`` table (memory-mapped under ``client_state_dir`` when set)
        with the clients still trained ``K`` at a time.  ``distributed`` (a subclass that
        spreads the server step over ranks): a budget is refused."""
        cfg = self.config
        dtype = self.x_global.dtype
        rows = cfg.per_round
        budget = cfg.memory_budget_bytes
        if budget is not None and distributed:
            # the distributed simulator spreads a round over ranks, each aggregating its block at once: a
            # budget it silently ignored would promise a bound it does not keep
            raise ConfigError("memory-budget is not supported with --distributed: each rank trains and aggregates "
                              "its block of a round's clients at once (more ranks bound a rank's memory); drop "
                              "memory-budget or run without --distributed")
        if budget is not None:
            itemsize = self.x_global.element_size()
            per_client = self.numel * itemsize
            if self._has_buffers:  # its buffer row
                buffer_dtype = self._buffers_layout.dtype
                per_client += self._buffers_layout.numel * torch.empty((), dtype=buffer_dtype).element_size()
            if self.batched is not None:
                per_client += self.batched.planner.client_bytes(cfg.batch_size)
            fixed = 8 * self.numel * itemsize  # model, local copy, server state, the fold's two sums
            chunk = min(cfg.per_round, chunk_clients(budget, per_client, fixed))
            need = fixed + min(2, cfg.per_round) * per_client  # the smallest chunk: 2 clients
            if budget < need:  # the bound cannot be kept: say so, with the numbers, and go on
                self.meta["memory_budget_needed"] = need
                warnings.warn(MemoryBudgetWarning(
                    f"memory-budget {budget:,} bytes is below what the smallest chunk needs: {need:,} bytes (the "
                    f"model's buffers {fixed:,} + {min(2, cfg.per_round)} clients x {per_client:,}); the run trains "
                    f"{chunk} clients at a time, over the budget"), stacklevel=4)
            if chunk < cfg.per_round:
                self._chunk = chunk
                # DP clips every row, an attack reads the honest ones and a robust rule compares
                # them: all need the whole round's rows, which a running sum does not keep.  An
                # fp16/bf16 model does not fold: the running sum enters the fused kernel as one
                # more client, so it would be rounded to fp16 after every chunk where the
                # unchunked round keeps it in fp32 (RoundFold).  Floating buffers (BatchNorm
                # statistics) fold alongside (BufferAverage, the rule of the unchunked round).
                self._foldable = (cfg.algo in FOLDABLE and self.server.optimizer is not None
                                  and dtype in (torch.float32, torch.float64)
                                  and self.privacy is None and self.attack is None and self.robust is None)
                if self.batched is not None:
                    planner = self.batched.planner
                    planner.client_batch = min(planner.client_batch or chunk, chunk)
                if self._foldable:
                    rows = chunk
            self.meta["memory_budget"] = budget
            self.meta["round_chunk"] = self._chunk
            self.meta["round_fold"] = self._foldable
        if self._chunk is not None and not self._foldable and cfg.client_state_dir:
            import os

            os.makedirs(cfg.client_state_dir, exist_ok=True)
            path = os.path.join(cfg.client_state_dir, "round_updates.bin")
            self.updates = torch.from_file(path, shared=True, size=rows * self.numel, dtype=dtype).view(rows, -1)
        else:
            self.updates = torch.empty(rows, self.numel, device=self.device, dtype=dtype)
        if self._has_buffers:  # the buffer rows follow the update rows (a folded round's: one chunk)
            self.buffer_rows = torch.empty(rows, self._buffers_layout.numel, device=self.device,
                                           dtype=self._buffers_layout.dtype)

    def grow_rows(self, rows: int) -> None:
        """At least ``rows`` rows of :attr:`updates` (and :attr:`buffer_rows`): FedBuff
        trains every client in flight at once, ``concurrency`` of them, perhaps more
        than a round's."""
        if self._chunk is not None or self.updates.shape[0] >= rows:
            return
        self.updates = self.updates.new_empty(rows, self.updates.shape[1])
        if self._has_buffers:
            self.buffer_rows = self.buffer_rows.new_empty(rows, self.buffer_rows.shape[1])

    def _train_chunked(self, round_number: int, clients: List[int], todo: List[int], bad: list) -> RoundStats:
        """The round's ``todo`` clients trained ``_chunk`` at a time (see
        :meth:`_allocate_rounds`); each chunk folded into :attr:`_fold`, or written to
        its rows of :attr:`updates`."""
        stats = RoundStats(self.device)
        bad, kept = list(bad), []
        position = {cid: i for i, cid in enumerate(todo)}
        self._fold = self._buffer_fold = None
        self._compressed_fold = None
        if self._foldable and todo:
            checked = self.server.round.weights(self.population.client_sizes[todo])  # the round's weights, formed once
            weights = None if checked is None else checked.values
            if self.compression is not None:  # each chunk encoded as it trains: the small replies are kept
                self._compressed_fold = ([], [])  # (client, reply) screened in, (client, reason, detail) out
            else:
                self._fold = RoundFold(self.server.optimizer, checked, len(todo), self.numel, self.device,
                                       self.x_global.dtype)
            if self._has_buffers and self.server.averages_buffers:
                # the buffers with the same weights and the same exclusions as the updates
                self._buffer_fold = BufferAverage(weights, len(todo), self._buffers_layout.numel, self.device,
                                                  self._buffers_layout.dtype)
        try:
            for start in range(0, len(todo), self._chunk):
                part = todo[start:start + self._chunk]
                self.round_bad, self.round_kept = [], part
                self._progress_base = len(kept) + len(bad)
                self._rows_at = 0 if self._foldable else len(kept)
                if self.population.lazy:
                    self._round_data(part)
                part_stats = self._train_round_clients(round_number, part, part, [])
                _add_stats(stats, part_stats)
                got = list(self.round_kept)
                bad += self.round_bad
                if self._compressed_fold is not None:
                    self._fold_compressed(round_number, got, [position[cid] for cid in got])
                elif self._fold is not None:
                    where = [position[cid] for cid in got]
                    excluded = self._fold.add(self.updates[:len(got)], where)
                    if self._buffer_fold is not None:
                        self._buffer_fold.add(self.buffer_rows[:len(got)], where, excluded)
                    if self.scaffold is not None:
                        self.scaffold.fold_chunk(got, excluded)
                kept += got
                self._report_progress(round_number, len(kept) + len(bad))
        finally:
            self._rows_at = 0
            self._progress_base = 0
            if self.population.lazy:
                self._round_data(None)
        order = {cid: i for i, cid in enumerate(clients)}
        self.round_bad = sorted(bad, key=lambda b: order[b[0]])
        self.round_kept = kept
        return stats

    _starts: Optional[dict] = None  # client -> (start row, round number) of per-client starts (FedBuff)

    def _client_starts(self, clients: List[int]):
        """``(starts [C, N], round numbers)`` of ``clients`` under per-client starts, else
        ``(None, None)``."""
        if self._starts is None:
            return None, None
        return (torch.stack([self._starts[c][0] for c in clients]), [self._starts[c][1] for c in clients])

    def _fold_compressed(self, round_number: int, got: List[int], where: List[int]) -> None:
        """A folded round of compressed updates: the chunk's clients ``got`` (at
        ``where`` in the round) encode their rows now, before the next chunk overwrites
        them, and are screened as the unfolded round screens them
        (:meth:`ClientCompression.encode` / ``screen``); their buffers and SCAFFOLD's
        option II fold without the ones left out."""
        replies, left_out = self.compression.encode(self.updates[:len(got)], got, round_number)
        kept, malformed = self.compression.screen(replies)
        self._compressed_fold[0].extend(kept)
        self._compressed_fold[1].extend(left_out + malformed)
        out = {cid for cid, _, _ in left_out + malformed}
        excluded = torch.tensor([cid in out for cid in got], dtype=torch.bool, device=self.device)
        if self._buffer_fold is not None:
            self._buffer_fold.add(self.buffer_rows[:len(got)], where, excluded)
        if self.scaffold is not None:
            self.scaffold.fold_chunk(got, excluded)

    def _client_rows(self, cid: int) -> torch.Tensor:
        return self.population.client_rows(cid)

    def _round_data(self, clients: Optional[List[int]]) -> None:
        """Lazy datasets: the round's ``clients``' samples (:meth:`Population.round_data`;
        None: drop them), and the engines pointed at them."""
        x, y = self.population.round_data(clients)
        self.trainer.x_train, self.trainer.y_train = x, y
        if self.batched is not None:
            self.batched.x_train, self.batched.y_train = x, y

    def _train_round_clients(self, round_number: int, clients: List[int], todo: List[int], bad: list) -> RoundStats:
        if self.batched is not None:
            try:
                return self._train_clients_batched(round_number, todo)
            except BatchedUnsupported as exc:  # the first batched round failed: redo it sequentially
                if self.scaffold is not None:
                    self.scaffold.discard_pending()
                self._fall_back(str(exc))
            except Exception as exc:  # noqa: BLE001 - a group failed: find the client(s) one by one
                if self.config.on_bad_client == "raise":
                    raise
                if self.scaffold is not None:
                    self.scaffold.discard_pending()
                self.meta.setdefault("sequential_retrains", []).append(round_number)
                _log.warning("round %d: the batched engine raised (%s: %s); retraining the round client by client "
                             "to leave out the failing client(s)", round_number, type(exc).__name__, exc)
        stats = RoundStats(self.device)
        global_buffers = buffers_to_vector(self.global_model) if self._has_buffers else None
        exclude = self.config.on_bad_client == "exclude"
        kept, row = [], 0
        for i, cid in enumerate(todo):
            if i:
                self._report_progress(round_number, self._progress_base + i)
            saved = _snapshot(stats) if exclude else None
            start, rn = (self.x_global, round_number) if self._starts is None else self._starts[cid]
            try:
                self.trainer.train(
                    start, self._client_rows(cid), round_index=rn - 1,
                    seed=batch_seed(self.config.seed, rn, cid), out_update=self.updates[self._rows_at + row],
                    stats=stats, client=cid, scaffold=self.scaffold, global_buffers=global_buffers,
                    out_buffers=self.buffer_rows[self._rows_at + row] if self._has_buffers else None)
            except Exception as exc:  # noqa: BLE001 - on_bad_client="exclude": leave this client out
                if not exclude:
                    raise
                _restore(stats, saved)  # its partial steps do not count
                if self.scaffold is not None:
                    self.scaffold._pending.pop(cid, None)
                bad.append((cid, "error", f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"))
                continue
            kept.append(cid)
            row += 1
        order = {cid: i for i, cid in enumerate(clients)}
        self.round_bad = sorted(bad, key=lambda b: order[b[0]])
        self.round_kept = kept
        return stats

    # ------------------------------------------------------------------ the round's replies
    def round_replies(self, clients: List[int], round_number: int) -> tuple:
        """The round's replies for the server round, and the record's extras: the rows of
        the clients that took part (:attr:`round_kept`; ``clients``: the round's, in
        order), the ones left out before the step, their data sizes and buffer rows --
        or the folded round's running sums.  Before the round the simulated clients act:
        honest ones clip (``dp_mode="client"``), then the attackers replace their updates."""
        kept = self.round_kept
        buffer_fold, self._buffer_fold = self._buffer_fold, None  # a folded round's buffers
        common = dict(clients=kept, left_out=self.round_bad, reasons=BAD_CLIENT_REASONS, order=clients)
        if self.compression is not None:
            return self._compressed_replies(clients, round_number, buffer_fold)
        if not kept:  # no client left: the round is skipped, as when every update is NaN/Inf
            return RoundReplies(None, **common), {}
        if self._fold is not None:  # a folded chunked round: the running sums are the aggregation
            fold, self._fold = self._fold, None
            return RoundReplies(fold, buffers=buffer_fold, **common), {}
        rows = self.updates[:len(kept)]
        extra = {}
        if self.privacy is not None:
            self.privacy.clip_client_updates_(rows)
        if self.attack is not None:
            extra["attacked_clients"] = self.attack.apply_(rows, kept, round_number)
        if self.server.server.takes == "models":  # client models w_i = x - D_i, in place
            rows.neg_().add_(self.x_global)
        buffers = self.buffer_rows[:len(kept)] if self._has_buffers else None
        return RoundReplies(rows, sizes=self.population.client_sizes[kept], buffers=buffers, **common), extra

    def _compressed_replies(self, clients: List[int], round_number: int, buffer_fold) -> tuple:
        """:meth:`round_replies` of a round of compressed updates (fl/engine/compressed_updates.py):
        the attackers replace their updates, then every client encodes its own (with its
        error-feedback residual), and the replies are screened as they arrive -- an update
        holding NaN/Inf left out as ``nonfinite``, a malformed reply as ``malformed``.  The
        server decodes the rest inside its aggregation; the record gets the bytes up."""
        kept, r = self.round_kept, round_number
        extra = {}
        folded, self._compressed_fold = self._compressed_fold, None
        if folded is not None:  # a folded round: the chunks were encoded and screened as they trained
            good, out = folded
        else:
            rows = self.updates[:len(kept)]
            if self.privacy is not None:  # dp_mode server only (the config refuses client clipping)
                self.privacy.clip_client_updates_(rows)
            if self.attack is not None:
                extra["attacked_clients"] = self.attack.apply_(rows, kept, r)
            replies, nonfinite = self.compression.encode(rows, kept, r)
            good, malformed = self.compression.screen(replies)
            out = nonfinite + malformed
        extra.update(self.compression.record(good))
        position = {cid: i for i, cid in enumerate(kept)}
        rows_in = [position[cid] for cid, _ in good]
        common = dict(clients=[cid for cid, _ in good], left_out=list(self.round_bad) + out,
                      reasons=COMPRESSED_REASONS, order=clients)
        if not good:
            return RoundReplies(None, **common), extra
        buffers = buffer_fold
        if buffers is None and self._has_buffers:
            buffers = self.buffer_rows[:len(kept)][torch.tensor(rows_in, device=self.device)]
        sizes = self.population.client_sizes[[cid for cid, _ in good]]
        return RoundReplies(self.compression.round_replies(good, r), sizes=sizes, buffers=buffers, **common), extra

    def discard_round(self) -> None:
        """Forget what the clients of a round that will not commit left pending (SCAFFOLD's
        updates of ``c_i``)."""
        if self.scaffold is not None:
            self.scaffold.discard_round()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The clients' state, keyed as in the simulation's checkpoint: SCAFFOLD's
        control variates, each client's carried local momentum (``carry_momentum``) and
        its error-feedback residual (``--error-feedback``); copies, tensors and plain
        values only."""
        return {
            "scaffold": ({k: v.clone() for k, v in self.scaffold.state_dict().items()}
                         if self.scaffold is not None else None),
            # carry_momentum: each client's local momentum buffers (they carry into its next round)
            "local_momentum": ({int(c): [b.detach().clone() for b in bufs]
                                for c, bufs in self.trainer.momentum_buffers.items()}
                               if self.trainer.momentum_buffers else None),
            # --error-feedback: each client's residual (what its replies lost so far)
            "error_feedback": self.compression.state_dict() if self.compression is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a simulation checkpoint's client pieces (:meth:`state_dict`'s keys)."""
        if self.scaffold is not None:
            self.scaffold.load_state_dict(state["scaffold"])
        if state.get("local_momentum"):
            self.trainer.momentum_buffers = {int(c): [b.to(self.device).clone() for b in bufs]
                                             for c, bufs in state["local_momentum"].items()}
        if self.compression is not None:
            self.compression.load_state_dict(state.get("error_feedback"))


def _add_stats(total: RoundStats, part: RoundStats) -> None:
    """``part``'s sums into ``total`` (a chunked round's statistics)."""
    for a, b in ((total.loss_sum, part.loss_sum), (total.clipped, part.clipped),
                 (total.clipped_norm_sum, part.clipped_norm_sum), (total.skipped, part.skipped),
                 (total.uncounted, part.uncounted)):
        a += b
    total.steps += part.steps
    total.nonfinite += part.nonfinite


def _snapshot(stats: RoundStats) -> tuple:
    return (stats.loss_sum.clone(), stats.clipped.clone(), stats.clipped_norm_sum.clone(), stats.skipped.clone(),
            stats.steps)


def _restore(stats: RoundStats, saved: tuple) -> None:
    """Undo the steps added since :func:`_snapshot` (the same values: bitwise)."""
    for t, v in zip((stats.loss_sum, stats.clipped, stats.clipped_norm_sum, stats.skipped), saved[:4]):
        t.copy_(v)
    stats.steps = saved[4]
