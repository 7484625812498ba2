"""The simulator over ``torch.distributed`` ranks.

``torchrun --nproc_per_node=W -m fedopt_kernels simulate --distributed ...`` (or
:class:`DistributedSimulation` in a process group of your own) runs the SAME simulation
as one process, with each round's clients trained on W ranks at once:

* every rank builds the whole simulation from the same config and seed: the same data,
  partition, initial model and sampled clients (the seeds are functions of
  ``(seed, purpose, round, client)``, never of the rank);
* the round's sampled clients (sorted) are cut into W contiguous blocks, the first
  ``C mod W`` ranks taking one client more (:func:`rank_block`); rank r trains its
  block with the usual engine into its local ``[C_r, N]`` updates -- the same seeds,
  so the same batches and the same ``D_i`` as one process;
* the server step is :class:`~fedopt_kernels.distributed.DistributedServerOptimizer`:
  contiguous blocks keep the global client order (rank 0's block first) equal to the
  single-process order, so every rank applies the single-process step bit for bit;
* a robust rule (``--aggregator``) and DP-FedAvg (``--dp-clip``) run in their
  distributed forms (:func:`~fedopt_kernels.distributed.distributed_form`): the rule on
  rank 0 over the gathered rows, its result broadcast; DP with each rank clipping its
  own clients, one distributed sum and the noise drawn once -- both the
  single-process round bit for bit, so ``dp_epsilon`` and ``robust_selected`` are
  recorded alike (with ``--compress`` both run on every rank on the all-gathered
  replies: :meth:`DistributedRoundTraining._compressed_replies`).  Client-side clipping and the attacks other than ``alie`` are each
  client's own and run on its rank (the attackers are a function of the seed, so every
  rank records all of a round's); ``alie``'s attackers send statistics of every
  client's update, which no rank holds, and it is refused;
* what a round needs besides the mean update is gathered in the same order: BatchNorm
  style floating buffers (their weighted mean is then the single-process one),
  SCAFFOLD's client updates and lr sums (its control variates are updated after the
  server step, with the step's global mask of excluded clients), FedLAW's client models (FedLAW trains its
  aggregation weights on a proxy set over all client models, so its updates are
  all-gathered and every rank runs the single-process FedLAW step);
* rank 0 evaluates the global model and (in the CLI) writes results and checkpoints;
  the other ranks record ``None`` for the test metrics;
* clients that cannot take part (``on_bad_client="exclude"``: no samples, training
  raised) are left out on their rank; the number each rank left out travels with the
  round's statistics (no extra collective in a round without them), and only when
  some rank left one out are the ``(client, reason, detail)`` lists exchanged, so every
  rank records the same ``excluded_<reason>`` counts and ``left_out`` list and the
  good clients keep the single-process order (the round equals one process's round
  without those clients).  The round's weights (``max_weight_share`` included)
  are formed once, over all of its clients, by the round
  (:class:`~fedopt_kernels.server.ServerRound`, the same on every rank); each rank's
  step takes its share of them.  With ``on_bad_client="raise"`` a client that raises fails the round
  on EVERY rank (the others raise :class:`~fedopt_kernels.distributed.RankInputError`)
  instead of leaving them waiting in the next collective.

Agreement with one process: the global model, server state and server statistics are
bitwise identical (``mode="ordered"``, the default) -- the local training runs the same
code on the same data with the same seeds (use the same thread count: the CLI uses one
thread for models under 5M parameters; the batched engine's dropout masks depend on how
clients are grouped, so models with random layers agree only with the sequential
engine).  The round record's ``train_loss`` and
``mean_clipped_norm`` are float64 sums of float32 per-step values, added per rank and
then in rank order: exact, hence equal to one process's, while the per-step values of
a round span less than ~2^25 in magnitude (float64 holds 53 bits; float32 values 24).
"""

from __future__ import annotations

import os
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ...distributed import DistributedServerOptimizer, RankInputError, all_gather_replies, comm
from ...distributed.comm import Plan
from ..engine.client import RoundStats
from ...server import RoundReplies
from .config import ConfigError, SimulationConfig
from .server_side import BAD_CLIENT_REASONS
from .round_training import RoundTraining
from .simulation import Simulation

__all__ = ["DistributedSimulation", "DistributedRoundTraining", "rank_block", "init_from_env", "shutdown"]


def rank_block(num_clients: int, world_size: int, rank: int) -> Tuple[int, int]:
    """``(start, stop)``: rank ``rank``'s contiguous share of a round's ``num_clients``
    clients (the first ``num_clients % world_size`` ranks get one more; a rank may get
    none when there are fewer clients than ranks)."""
    base, extra = divmod(num_clients, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class DistributedSimulation(Simulation):
    """A :class:`~fedopt_kernels.fl.Simulation` whose rounds are spread over the ranks
    of ``group`` (None: the default group); see the module docstring.  Construct it on
    every rank with the same arguments, after ``torch.distributed.init_process_group``.

    ``mode``: the aggregation mode of the server step (``"ordered"``: bitwise the
    single-process run; ``"all_reduce"``: one all_reduce, within a tolerance).

    It is the simulator with two of its parts in their distributed forms: the local
    training (:class:`DistributedRoundTraining`: this rank's block of each round, the
    gathers) and the server's algorithm
    (:class:`~fedopt_kernels.distributed.DistributedServerOptimizer`); rank 0 evaluates.
    """

    def __init__(self, config: SimulationConfig, *, group=None, mode: str = "ordered", **kwargs):
        comm.check_initialized("DistributedSimulation")
        self.group = group
        self.rank = comm.group_rank(group)
        self.world_size = comm.group_size(group)
        self.mode = mode
        config.validate()
        if config.attack == "alie":  # the other attacks are each client's own, applied on its rank
            raise ConfigError("attack alie is not supported with --distributed: its attackers send the mean and std "
                              "of every client's update of the round, which no rank holds (the other attacks, "
                              "robust rules and DP are)")
        self._check_same_config(config)
        super().__init__(config, **kwargs)
        # the round's weights (capped once, over the round) stay its own; compressed replies are all-gathered to
        # every rank (_compressed_replies), where the optimizer's own step -- its rule, DP included -- runs as one process's
        if self.server.server.takes == "updates" and self.compression is None:
            self.server.server = DistributedServerOptimizer(self.server.server, group, mode=mode,
                                                            on_bad_client=config.on_bad_client)
        self._log_exclusions = self.rank == 0
        self.results.meta["distributed"] = {
            "world_size": self.world_size, "backend": str(dist.get_backend(group)), "mode": mode,
            "split": "contiguous blocks of the round's sorted clients"}

    def _training_part(self, local_model) -> "DistributedRoundTraining":
        return DistributedRoundTraining(self.config, self.population, self.global_model, local_model, self.x_global,
                                        self.loss_fn, group=self.group)

    def _check_same_config(self, config: SimulationConfig) -> None:
        configs: List[dict] = [None] * self.world_size  # type: ignore[list-item]
        dist.all_gather_object(configs, config.to_dict(), group=comm.object_group(self.group))
        for r, other in enumerate(configs):
            diff = sorted(k for k in set(other) | set(configs[0]) if other.get(k) != configs[0].get(k))
            if diff:
                raise ValueError(f"DistributedSimulation: rank {r} has a different config than rank 0 "
                                 f"({', '.join(diff)}); every rank must run the same settings")

    @torch.no_grad()
    def evaluate(self, batch_size: int = 2048) -> tuple:
        """Rank 0: ``(accuracy, loss)`` of the global model; other ranks ``(None, None)``
        (they hold the same model)."""
        if self.rank != 0:
            return None, None
        return super().evaluate(batch_size)


class DistributedRoundTraining(RoundTraining):
    """The local-training part over the ranks of ``group``: this rank trains its block
    of each round's clients, and what the round needs besides its rows (the clients left
    out, the buffer rows, SCAFFOLD's updates; FedLAW's client models) is gathered in the
    single-process order (see the module docstring)."""

    spreads_over_ranks = True  # a memory budget is refused

    def __init__(self, *args, group=None):
        super().__init__(*args)
        self.group = group
        self.rank = comm.group_rank(group)
        self.world_size = comm.group_size(group)

    def _plan(self, num_clients: int) -> Plan:
        counts = tuple(b - a for a, b in (rank_block(num_clients, self.world_size, r)
                                          for r in range(self.world_size)))
        return Plan(rank=self.rank, world=self.world_size, counts=counts, N=self.numel, extras=())

    def train_clients(self, round_number: int, clients: List[int]) -> RoundStats:
        plan = self._plan(len(clients))
        mine = clients[plan.start:plan.stop]
        error = None
        try:
            if mine:
                stats = super().train_clients(round_number, mine)
            else:
                stats, self.round_bad, self.round_kept = RoundStats(self.device), [], []
        except Exception as exc:  # noqa: BLE001 - on_bad_client="raise": every rank must stop, not wait
            error, stats = exc, RoundStats(self.device)
            self.round_bad, self.round_kept = [], []
        stats, bad_counts, failed = self._combine_stats(stats, plan, len(self.round_bad), error is not None)
        if failed:
            if error is not None:
                raise error
            raise RankInputError(f"round {round_number}: a client of rank {failed[0]} raised during its training "
                                 "(on_bad_client='raise'); every rank stops")
        if any(bad_counts):  # rare: only then the lists travel
            lists: List[list] = [None] * self.world_size  # type: ignore[list-item]
            dist.all_gather_object(lists, list(self.round_bad), group=comm.object_group(self.group))
            self.round_bad = [tuple(b) for part in lists for b in part]  # rank order = the round's order
            left = {cid for cid, _, _ in self.round_bad}
            self.round_kept = [cid for cid in clients if cid not in left]
        else:
            self.round_kept = list(clients)
        kept_counts = tuple(c - b for c, b in zip(plan.counts, bad_counts))
        self._kept_plan = kept_plan = Plan(rank=plan.rank, world=plan.world, counts=kept_counts, N=plan.N, extras=())
        if kept_plan.C == 0:
            return stats
        if self.scaffold is not None:
            self._gather_scaffold(self.round_kept, kept_plan)
        if self._has_buffers:
            rows = comm.gather_rows(self.buffer_rows[:kept_plan.stop - kept_plan.start], kept_plan, self.group)
            self.buffer_rows[:kept_plan.C].copy_(rows)
        return stats

    def _combine_stats(self, local: RoundStats, plan: Plan, num_bad: int = 0, failed: bool = False):
        """The round's statistics over every rank's steps (sums in rank order), how many
        clients each rank left out, and the ranks whose training raised."""
        row = torch.stack([local.loss_sum, local.clipped, local.clipped_norm_sum, local.skipped,  # steps: counted ones
                           float(local.steps) - local.uncounted.to(local.loss_sum.dtype),
                           torch.tensor(float(num_bad), dtype=local.loss_sum.dtype, device=self.device),
                           torch.tensor(float(failed), dtype=local.loss_sum.dtype, device=self.device)])
        one_each = Plan(plan.rank, plan.world, (1,) * plan.world, plan.N, ())
        rows = comm.gather_rows(row[None], one_each, self.group)
        total = rows[0]
        for r in range(1, plan.world):
            total = total + rows[r]
        out = RoundStats(self.device, dtype=local.loss_sum.dtype)
        out.loss_sum, out.clipped, out.clipped_norm_sum, out.skipped = (total[i].clone() for i in range(4))
        per_rank = rows[:, 4:].cpu().tolist()  # one read: steps, clients left out, failed
        out.steps = sum(int(steps) for steps, _, _ in per_rank)
        return out, [int(b) for _, b, _ in per_rank], [r for r, (_, _, f) in enumerate(per_rank) if f]

    def _gather_scaffold(self, clients: List[int], plan: Plan) -> None:
        """Every rank gets every client's pending update and lr sum, in the global
        (single-process) order, so ``ScaffoldState.server_update`` is the same everywhere."""
        sc = self.scaffold
        mine = clients[plan.start:plan.stop]
        local = torch.zeros(len(mine), self.numel, dtype=self.updates.dtype, device=self.updates.device)
        local_lr = torch.zeros(len(mine), 1, dtype=torch.float64, device=self.updates.device)  # exact Python floats
        for i, cid in enumerate(mine):
            pending = sc._pending.get(cid)
            if pending is not None:
                local[i] = pending[0]
                local_lr[i, 0] = pending[1]
        rows = comm.gather_rows(local, plan, self.group)
        lr_sums = comm.gather_rows(local_lr, plan, self.group)[:, 0].tolist()
        sc._pending = {cid: (rows[i], lr_sums[i]) for i, cid in enumerate(clients)}

    def round_replies(self, clients: List[int], round_number: int) -> tuple:
        """As one process's replies (:meth:`RoundTraining.round_replies`), but this rank's
        rows: the round's weights are formed over all of its clients (the same on every
        rank), and the step takes this rank's ``share`` of them; the buffer rows and
        SCAFFOLD's updates were gathered in :meth:`train_clients`."""
        plan = self._kept_plan  # this round's clients that took part, per rank
        kept = self.round_kept
        if self.compression is not None:  # every rank gets every reply: _compressed_replies
            return super().round_replies(clients, round_number)
        if not kept or self.server.server.takes == "models":  # FedLAW needs every client model on every rank
            if kept:
                rows = comm.gather_rows(self.updates[:plan.stop - plan.start], plan, self.group)
                self.updates[:len(kept)].copy_(rows)
            return super().round_replies(clients, round_number)
        self._buffer_fold = None
        rows = self.updates[:plan.stop - plan.start]
        # as one process's round: honest clients clip (dp_mode "client"), then the attackers replace their
        # updates -- each client on its own rank
        extra = {}
        if self.privacy is not None:
            self.privacy.clip_client_updates_(rows)
        if self.attack is not None:
            self.attack.apply_(rows, kept[plan.start:plan.stop], round_number)
            # the attackers are a function of the seed alone: every rank names all of the round's
            extra["attacked_clients"] = self.attack.round_attackers(kept)[1]
        buffers = self.buffer_rows[:len(kept)] if self._has_buffers else None
        return RoundReplies(rows, sizes=self.population.client_sizes[kept], buffers=buffers,
                            share=slice(plan.start, plan.stop), clients=kept, left_out=self.round_bad,
                            reasons=BAD_CLIENT_REASONS, order=clients), extra

    def _compressed_replies(self, clients: List[int], round_number: int, buffer_fold) -> tuple:
        """Each rank's clients are attacked, encoded and screened on their rank, then the
        replies are all-gathered in rank order (:func:`~fedopt_kernels.distributed.all_gather_replies`),
        and the single-process round is formed from them on every rank (the same replies,
        the same order: bit for bit)."""
        plan, kept, r = self._kept_plan, self.round_kept, round_number
        rows, mine = self.updates[:plan.stop - plan.start], kept[plan.start:plan.stop]
        if self.attack is not None:
            self.attack.apply_(rows, mine, r)
        replies, nonfinite = self.compression.encode(rows, mine, r)
        shared = self._share_residuals([cid for cid, _ in replies]) if self.compression.ef is not None else None
        good, malformed = self.compression.screen(replies)
        self._compressed_fold = all_gather_replies(good, nonfinite + malformed, self.compression.codec, self.numel,
                                                   self.group, device=self.device)
        out, extra = super()._compressed_replies(clients, round_number, buffer_fold)  # as a folded round's
        if self.attack is not None:
            extra["attacked_clients"] = self.attack.round_attackers(kept)[1]
        if shared is not None:
            extra["ef_bytes_between_ranks"] = shared
        return out, extra

    def _share_residuals(self, encoded: List[int]) -> int:
        """Error feedback: the residuals this rank's clients just left (``encoded``) on
        every rank, so that whichever rank trains a client next holds its residual, and
        every rank's store -- rank 0's checkpoint -- is one process's.  Dense fp32 rows
        (``N`` values per encoded client) travel between ranks: the price of a client that
        moves between ranks from round to round.  Returns those bytes (``4 N`` per encoded
        client of every rank, each row sent to the ``W - 1`` other ranks), the round
        record's ``ef_bytes_between_ranks``: server-side traffic, not in ``bytes_up``."""
        ef = self.compression.ef
        every: List[list] = [None] * self.world_size  # type: ignore[list-item]
        dist.all_gather_object(every, list(encoded), group=comm.object_group(self.group))
        counts = tuple(len(part) for part in every)
        if not sum(counts):
            return 0
        plan = Plan(rank=self.rank, world=self.world_size, counts=counts, N=self.numel, extras=())
        local = (torch.stack([ef.residual(c) for c in encoded]) if encoded
                 else torch.empty(0, self.numel, dtype=torch.float32, device=self.device))
        rows = comm.gather_rows(local, plan, self.group)
        for cid, row in zip([c for part in every for c in part], rows):
            ef.store.put(ef.name, cid, row)
        return 4 * self.numel * sum(counts)


# ---------------------------------------------------------------------------- launching
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_from_env(device: str = "cpu", *, backend: Optional[str] = None) -> Tuple[int, int]:
    """``init_process_group`` from torchrun's environment; returns ``(rank, world_size)``.

    CPU runs use gloo; CUDA runs use NCCL for CUDA tensors and gloo for CPU ones, each
    rank on GPU ``LOCAL_RANK`` (so pass ``device="cuda"``, not ``"cuda:N"``).  An already
    initialised process group is used as it is.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [k for k in _TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise RuntimeError(f"--distributed needs torchrun's environment ({', '.join(missing)} not set): launch with "
                           "torchrun --nproc_per_node=N -m fedopt_kernels simulate --distributed ...")
    dev = torch.device(device)
    if dev.type == "cuda":
        if dev.index is not None and int(os.environ["WORLD_SIZE"]) > 1:
            raise ValueError(f"device {device!r} would put every rank on one GPU; use device 'cuda' (rank r takes "
                             "GPU LOCAL_RANK)")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = backend or "cpu:gloo,cuda:nccl"
    else:
        backend = backend or "gloo"
    dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size()


def shutdown(*, barrier: bool = False) -> None:
    """Destroy the default process group if one is initialised.

    ``barrier=True`` (a normal end, every rank reaching this call) first waits for every
    rank: a rank that finished early (only rank 0 writes the results) must not tear its
    gloo connections down while a peer still holds its end -- gloo's transport threads
    then abort the early rank ("terminate called without an active exception", seen
    as a SIGABRT from torchrun).  After an error no barrier: a failed rank must not
    wait for peers that may never arrive.
    """
    if dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
