"""FedLAW: learnable aggregation weights and global weight shrinking on a proxy set."""

from __future__ import annotations

import math
from typing import Callable, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.func import functional_call

from .. import defaults as D
from ..ops import ClientPieces, aggregate, weighted_sum
from ..ops.validation import acc_dtype, check_backend, check_real
from ..ops.aggregate import check_weight_values
from ..utils.flat import FlatLayout, parameters_layout
from .aggregation import CheckedWeights
from .round_stats import ServerRoundStats

LEARN = ("both", "gamma", "lambda")
ClientModels = Union[torch.Tensor, Sequence[torch.Tensor], Sequence[nn.Module], ClientPieces]


class FedLAWRound(NamedTuple):
    """What one :meth:`FedLAW.step` did (tensors on the model's device).

    * ``gamma`` (0-d) and ``weights`` (``[C]``, the learned lambda; 0 for clients left out).
    * ``excluded`` ``[C]`` bool: clients left out because their parameters hold NaN/Inf.
    * ``skipped``: bool, no client was usable and the model was left unchanged.
    * ``losses`` ``[epochs]``: mean proxy loss of each server epoch (during learning).
    """

    gamma: torch.Tensor
    weights: torch.Tensor
    excluded: torch.Tensor
    skipped: bool
    losses: torch.Tensor


def _check_models_not_updates(client_sq: torch.Tensor, global_sq: float) -> None:
    """Refuse client "models" that are in fact updates (``x_global - x_i``).

    FedLAW aggregates the clients' parameters themselves; given updates it would write
    ``gamma sum_i lambda_i D_i`` -- a vector of roughly an update's size -- into the
    model, silently shrinking it.  A client model starts the round at the global model
    and moves by one round of local steps, so its norm stays close to the global
    model's; an update's norm is a small fraction of it.  If EVERY usable client's norm
    is below half the global model's (and the global model is not zero), the inputs are
    refused.  (A round that really halves every client's norm -- local weight decay of
    ``lr * wd * K ~ 0.7`` -- is not a setting FedLAW is used in.)
    """
    if global_sq > 0 and client_sq.numel() and bool((client_sq < 0.25 * global_sq).all()):
        ratio = math.sqrt(float(client_sq.max()) / global_sq)
        raise ValueError(
            f"client_models look like updates, not models: every client's norm is at most {ratio:.3g} x the "
            f"global model's. FedLAW.step needs the clients' parameters w_i (e.g. x_global - update_i), "
            f"not their updates")


class FedLAW:
    r"""FedLAW's server step (Li et al., ICML 2023: [FedLAW]).

    Each round the server receives the clients' full parameter vectors ``w_i`` and
    learns, on a small proxy dataset, ``gamma = exp(s)`` and ``lambda = softmax(x)`` of
    ``w_g = gamma * sum_i lambda_i w_i`` (eq. 3, 8), starting from the data-size weights
    and ``gamma = 1`` (Algorithm 1 line 10).  Every forward is
    ``torch.func.functional_call(model, views(weighted_sum(w, lambda, gamma)), (x,))``:
    the fused aggregation and, backward, the fused ``client_dots`` (all ``C`` inner
    products with ``dL/dw_g`` in one pass), with no module surgery and no gradient
    buffer for the clients.  The optimiser is Adam(lr, betas) over ``server_epochs``
    epochs of the proxy loader, with the released code's StepLR per epoch
    (``lr_step=(20, 0.5)``; None for a constant lr).  Finally ``gamma* sum_i lambda*_i w_i``
    is written into the model's parameters with the fused aggregation.

    Variants: ``learn="both"`` (FedLAW), ``"gamma"`` (adaptive GWS: lambda stays at the
    data-size weights), ``"lambda"`` (attentive LAW: gamma stays 1).  ``swa=True``: the
    released code's two-stage SWA variant -- the logits first, averaged over the epochs
    after ``swa_start`` (CosineAnnealingLR(T_max=100) before, SWALR(``swa_lr``) after),
    for ``ceil(E/2)`` epochs (all ``E`` with ``learn="lambda"``), then gamma with lambda
    fixed for ``floor(E/2)`` epochs.  ``swa`` with ``learn="gamma"`` is an error (there
    are no logits to average).  ``python_ref/fedlaw.py`` is the paper-literal oracle.

    Buffers (BatchNorm): never aggregated; the forward uses the model's own buffers.
    With ``train_mode=True`` (default, as the released code) the proxy passes run in
    train mode: BN normalises with batch statistics and its running statistics are
    updated in place by every proxy batch (they track the aggregated model on the proxy
    data; this is how the released code keeps the global model's BN statistics, and
    the simulator and the Flower strategy leave them so: they average the clients'
    buffers for every other algorithm, never for FedLAW).
    ``train_mode=False`` runs in eval mode: running statistics are read, never written.
    The model's own train/eval mode is restored afterwards.  (Dropout follows the mode.)

    Robustness: a client whose parameters hold NaN/Inf, or whose data size is 0, is
    left out (lambda_i = 0) before learning; if none is left the model is unchanged.
    Finding out which clients to leave out reads ``C`` flags on the host (one sync per
    round; the learning loop itself runs a host-driven data loader anyway).

    Args:
        model: the global model (its parameters receive the result).
        proxy_loader: re-iterable of ``(input, target)`` batches (a DataLoader or list).
        loss_fn: ``loss_fn(model_output, target) -> scalar``.
        learn: ``"both"``, ``"gamma"`` or ``"lambda"``.
        server_epochs: epochs over the proxy loader per round (20 in the code, 100 in
            the paper).
        lr, betas: Adam's (defaults 0.01, as the released code, and (0.5, 0.999),
            [FedLAW] appendix D.6).
        swa, swa_start, swa_lr: SWA variant (see above).
        lr_step: ``(step_size, gamma)`` of the per-epoch StepLR, or None.
        train_mode: see Buffers.
        backend: kernel backend of the aggregation (None: automatic).
    """

    takes = "models"  # a round hands it the client models w_i themselves (fedopt_kernels.server.round)
    keeps_buffers = True  # the global model keeps the BatchNorm statistics of the proxy training

    def __init__(self, model: nn.Module, proxy_loader: Iterable, loss_fn: Callable, *, learn: str = D.FEDLAW["learn"],
                 server_epochs: int = D.FEDLAW["server_epochs"], lr: float = D.FEDLAW["lr"],
                 betas: Tuple[float, float] = D.FEDLAW["betas"],
                 swa: bool = False, swa_start: int = 5, swa_lr: float = 0.05,
                 lr_step: Optional[Tuple[int, float]] = (20, 0.5), train_mode: bool = True,
                 backend: Optional[str] = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if learn not in LEARN:
            raise ValueError(f"learn must be one of {LEARN}, got {learn!r}")
        if isinstance(server_epochs, bool) or not isinstance(server_epochs, int) or server_epochs < 1:
            raise ValueError(f"server_epochs must be an int >= 1, got {server_epochs!r}")
        lr = check_real(lr, "lr", low=0, low_open=True)
        if (isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2
                or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        if swa and learn == "gamma":
            raise ValueError("swa=True averages the logits of lambda, which learn='gamma' does not learn")
        if swa and learn == "both" and server_epochs < 2:
            raise ValueError("swa=True with learn='both' needs server_epochs >= 2 (one stage each)")
        if not (isinstance(swa_start, int) and swa_start >= 0):
            raise ValueError(f"swa_start must be an int >= 0, got {swa_start!r}")
        swa_lr = check_real(swa_lr, "swa_lr", low=0, low_open=True)
        if lr_step is not None and (len(lr_step) != 2 or int(lr_step[0]) < 1 or not lr_step[1] > 0):
            raise ValueError(f"lr_step must be None or (step_size >= 1, gamma > 0), got {lr_step!r}")
        if not callable(loss_fn):
            raise TypeError("loss_fn must be callable: loss_fn(output, target) -> scalar")
        if iter(proxy_loader) is proxy_loader:
            raise TypeError("proxy_loader must be re-iterable (a DataLoader or a list of batches), not an "
                            "iterator: it is read once per server epoch")
        check_backend(backend)
        self.model, self.proxy_loader, self.loss_fn = model, proxy_loader, loss_fn
        self.learn, self.server_epochs, self.lr, self.betas = learn, server_epochs, float(lr), tuple(betas)
        self.swa, self.swa_start, self.swa_lr = bool(swa), swa_start, float(swa_lr)
        self.lr_step, self.train_mode, self.backend = lr_step, bool(train_mode), backend
        self.layout: FlatLayout = parameters_layout(model)
        self.last_round: Optional[FedLAWRound] = None

    # ------------------------------------------------------------------ inputs
    def _client_rows(self, client_models: ClientModels) -> Union[List[torch.Tensor], ClientPieces]:
        L = self.layout
        if isinstance(client_models, ClientPieces):  # each model as its per-layer tensors: read in place
            if (client_models.numel, client_models.dtype, client_models.device) != (L.numel, L.dtype, L.device):
                raise ValueError(f"client_models have {client_models.numel} {client_models.dtype} parameters on "
                                 f"{client_models.device}, the model {L.numel} {L.dtype} on {L.device}")
            return client_models
        if isinstance(client_models, torch.Tensor):
            if client_models.dim() != 2:
                raise ValueError(f"client_models as a tensor must be 2-D [C, N], got shape "
                                 f"{tuple(client_models.shape)}")
            rows = list(client_models.detach().unbind(0))  # views, no copy
            names = [f"client_models[{i}]" for i in range(len(rows))]
        elif isinstance(client_models, (list, tuple)):
            rows, names = [], []
            for i, c in enumerate(client_models):
                if isinstance(c, nn.Module):
                    layout = parameters_layout(c)
                    if layout != L:
                        raise ValueError(f"client_models[{i}] does not have the global model's parameters "
                                         f"(names, shapes, dtypes)")
                    c = layout.flatten([p for _, p in c.named_parameters()])
                    if c.device != L.device:
                        raise ValueError(f"client_models[{i}] is on {c.device} but the model is on {L.device}")
                elif not isinstance(c, torch.Tensor):
                    raise TypeError(f"client_models[{i}] must be a flat tensor or an nn.Module, "
                                    f"got {type(c).__name__}")
                rows.append(c.detach())
                names.append(f"client_models[{i}]")
        else:
            raise TypeError(f"client_models must be a [C, N] tensor or a list of flat vectors / modules, "
                            f"got {type(client_models).__name__}")
        if not rows:
            raise ValueError("client_models must hold at least one client")
        for r, name in zip(rows, names):
            L.check_vector(r, name)
            if not r.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        return rows

    def _sizes(self, data_sizes, C: int) -> torch.Tensor:
        if isinstance(data_sizes, CheckedWeights):  # checked where the round's weights entered
            if len(data_sizes) != C:
                raise ValueError(f"data_sizes has {len(data_sizes)} entries but there are {C} clients")
            return data_sizes.values
        if isinstance(data_sizes, torch.Tensor):
            if data_sizes.dim() != 1 or data_sizes.numel() != C:
                raise ValueError(f"data_sizes has shape {tuple(data_sizes.shape)} but there are {C} clients")
            sizes = data_sizes.detach().to("cpu", torch.float64)
        else:
            try:
                sizes = torch.tensor([float(n) for n in data_sizes], dtype=torch.float64)
            except (TypeError, ValueError):
                raise TypeError(f"data_sizes must be a sequence of numbers, got {data_sizes!r}") from None
            if sizes.numel() != C:
                raise ValueError(f"data_sizes has {sizes.numel()} entries but there are {C} clients")
        check_weight_values(sizes, "data_sizes")
        return sizes

    # ------------------------------------------------------------------ learning
    def _batches(self, device):
        for batch in self.proxy_loader:
            x, y = batch
            yield (x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x,
                   y.to(device, non_blocking=True) if isinstance(y, torch.Tensor) else y)

    def _run(self, rows, opt_params, gamma_fn, lam_fn, epochs: int, losses: list, schedule: str,
             logits: Optional[torch.Tensor] = None):
        """Adam on ``opt_params`` for ``epochs`` epochs; returns the SWA-averaged logits
        (``schedule == "swa"``) or None."""
        device = self.layout.device
        opt = torch.optim.Adam(opt_params, lr=self.lr, betas=self.betas)
        if schedule == "swa":
            cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
            swa_sched = torch.optim.swa_utils.SWALR(opt, swa_lr=self.swa_lr)
        elif self.lr_step is not None:
            step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=int(self.lr_step[0]), gamma=self.lr_step[1])
        avg, n_avg = None, 0
        for epoch in range(epochs):
            total, batches = torch.zeros((), device=device), 0
            for x, y in self._batches(device):
                opt.zero_grad(set_to_none=True)
                vec = weighted_sum(rows, lam_fn(), gamma_fn(), backend=self.backend)  # eq. 8
                out = functional_call(self.model, self.layout.unflatten(vec, cast=True), (x,))
                loss = self.loss_fn(out, y)
                loss.backward()
                opt.step()
                total, batches = total + loss.detach().to(total.dtype), batches + 1
            if batches == 0:
                raise ValueError("proxy_loader yielded no batch")
            losses.append(total / batches)
            if schedule == "swa":
                if epoch > self.swa_start:  # released code: average after swa_start, then SWALR
                    cur = logits.detach()
                    avg = cur.clone() if n_avg == 0 else avg + (cur - avg) / (n_avg + 1)
                    n_avg += 1
                    swa_sched.step()
                else:
                    cos.step()
            elif self.lr_step is not None:
                step_lr.step()
        return avg

    def _learn(self, rows, lam0: torch.Tensor, losses: list):
        """``(gamma, lambda)`` learned on the proxy set (detached, acc dtype)."""
        acc = lam0.dtype
        logits = torch.log(lam0).clone().requires_grad_(True)  # Algorithm 1 line 10
        s = torch.zeros((), dtype=acc, device=lam0.device, requires_grad=True)
        one = torch.ones((), dtype=acc, device=lam0.device)
        gamma_of_s = lambda: torch.exp(s)  # noqa: E731
        lam_of_logits = lambda: torch.softmax(logits, 0)  # noqa: E731
        E = self.server_epochs
        if not self.swa:
            if self.learn == "both":
                self._run(rows, [logits, s], gamma_of_s, lam_of_logits, E, losses, "step")
            elif self.learn == "gamma":
                self._run(rows, [s], gamma_of_s, lambda: lam0, E, losses, "step")
            else:
                self._run(rows, [logits], lambda: one, lam_of_logits, E, losses, "step")
            gamma = torch.exp(s.detach()) if self.learn != "lambda" else one
            lam = torch.softmax(logits.detach(), 0) if self.learn != "gamma" else lam0
            return gamma, lam
        e1 = E if self.learn == "lambda" else math.ceil(E / 2)
        avg = self._run(rows, [logits], lambda: one, lam_of_logits, e1, losses, "swa", logits=logits)
        lam = torch.softmax(avg if avg is not None else logits.detach(), 0)
        if self.learn == "lambda":
            return one, lam
        self._run(rows, [s], gamma_of_s, lambda: lam, E // 2, losses, "step")
        return torch.exp(s.detach()), lam

    # ------------------------------------------------------------------ step
    def step(self, client_models: ClientModels, data_sizes) -> Tuple[torch.Tensor, torch.Tensor]:
        """Learn ``(gamma, lambda)`` from this round's client models and write
        ``gamma * sum_i lambda_i w_i`` into the model.  Returns ``(gamma, lambda)``
        (0-d and ``[C]`` tensors; lambda is 0 for clients left out).

        ``client_models``: a ``[C, N]`` tensor, ``C`` flat vectors or modules, or
        :class:`~fedopt_kernels.ops.ClientPieces` (each model as its per-layer tensors,
        e.g. a Flower reply's arrays: every pass of the learning reads them in place)."""
        # Re-read every round: the model may have moved device since the last one.
        self.layout = parameters_layout(self.model)
        rows = self._client_rows(client_models)
        C = len(rows)
        sizes = self._sizes(data_sizes, C)
        L = self.layout
        device, acc = L.device, acc_dtype(L.dtype)
        params = [p for _, p in self.model.named_parameters()]

        # One fused pass for the clients' norms: which ones hold NaN/Inf.
        probe = torch.empty(L.numel, dtype=acc, device=device)
        lam_sizes = (sizes / sizes.sum()).to(device=device, dtype=acc)
        _, st = aggregate(rows, lam_sizes, out=probe, nonfinite="exclude", backend=self.backend)
        excluded = st.excluded
        # The round's one host sync: which clients are usable, and whether the "models"
        # are really models (see _check_models_not_updates).
        global_sq = sum((p.detach().to(acc).square().sum() for p in params), torch.zeros((), dtype=acc,
                                                                                           device=device))
        host = torch.cat([excluded.to(acc), st.client_sq_norms.to(acc), global_sq.view(1)]).cpu()
        excluded_host, client_sq, global_sq = host[:C].bool(), host[C:2 * C], float(host[2 * C])
        usable = (~excluded_host) & (sizes > 0)
        keep = usable.nonzero().flatten().tolist()
        _check_models_not_updates(client_sq[keep], global_sq)
        lam_full = torch.zeros(C, dtype=acc, device=device)
        if not keep:
            gamma = torch.ones((), dtype=acc, device=device)
            self.last_round = FedLAWRound(gamma, lam_full, excluded, True, torch.zeros(0, device=device))
            return gamma, lam_full

        rows_k = rows.select(keep) if isinstance(rows, ClientPieces) else [rows[i] for i in keep]
        sizes_k = sizes[keep]
        lam0 = (sizes_k / sizes_k.sum()).to(device=device, dtype=acc)
        losses: list = []
        was_training = self.model.training
        self.model.train(self.train_mode)
        try:
            with torch.enable_grad():
                gamma, lam = self._learn(rows_k, lam0, losses)
        finally:
            self.model.train(was_training)

        with torch.no_grad():
            out = torch.empty(L.numel, dtype=L.dtype, device=device)
            aggregate(rows_k, lam, gamma=gamma, out=out, nonfinite="propagate", backend=self.backend)
            L.copy_to(out, params)
        lam_full[torch.tensor(keep, device=device)] = lam
        self.last_round = FedLAWRound(gamma, lam_full, excluded, False, torch.stack(losses))
        return gamma, lam_full

    def round(self, client_models: ClientModels, weights=None) -> ServerRoundStats:
        """One round of :mod:`fedopt_kernels.server.round`: :meth:`step` with ``weights``
        as the data sizes lambda starts from (None: ``1/C``, uniform), and its statistics
        by their record names: ``gamma``, ``lambda``, ``proxy_loss`` (the last server
        epoch's; None when no client was usable), ``excluded_clients``,
        ``server_skipped``."""
        if weights is None:
            weights = [1.0] * _num_clients(client_models)
        gamma, lam = self.step(client_models, weights)
        rnd = self.last_round
        skipped = torch.tensor(rnd.skipped, device=gamma.device)
        metrics = {"gamma": gamma, "lambda": lam, "proxy_loss": rnd.losses[-1] if rnd.losses.numel() else None,
                   "excluded_clients": rnd.excluded.sum(), "server_skipped": skipped}
        return ServerRoundStats(excluded=rnd.excluded, skipped=skipped, metrics=metrics, stats=rnd)


def _num_clients(client_models: ClientModels) -> int:
    """``C``: how many client models a round hands :meth:`FedLAW.round`."""
    if isinstance(client_models, torch.Tensor):
        return client_models.shape[0] if client_models.dim() else 0
    try:
        return len(client_models)
    except TypeError:
        raise TypeError(f"client_models must be a [C, N] tensor or a list of flat vectors / modules, "
                        f"got {type(client_models).__name__}") from None
