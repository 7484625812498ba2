"""``SimulationConfig``: every setting of a simulation, validated in one place.

The command line, TOML config files and the Python API all build one of these; an
impossible setting raises :class:`ConfigError` (a ``ValueError``) with one line that
names the setting.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from ... import defaults as D
from ...lr_scheduler import KINDS as DECAY_KINDS
from ...lr_scheduler import PER as DECAY_PER
from ...ops import MODES as NAR_MODES
from ...server.registry import WEIGHTINGS, resolve_weighting
from ...server.robust_aggregation.robust_aggregator import AGGREGATOR_PARAMS, AGGREGATORS
from ..datasets.attacks import ATTACKS
from ..datasets.corruption import CORRUPT_KINDS
from ...server.differential_privacy.dp_settings import (DP_MODES, DP_REFUSED_ALGOS, check_dp_settings,  # noqa: F401
                                                       robust_with_dp_error)

__all__ = ["SimulationConfig", "ConfigError", "ALGORITHMS", "PARTITIONS", "ENGINES", "WEIGHTINGS", "PROXY_SOURCES",
           "CORRUPT_KINDS", "BAD_CLIENT_POLICIES", "ATTACK_CHOICES", "DP_MODES", "AGGREGATORS"]

ALGORITHMS = ("fedavg", "fedprox", "scaffold", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "fedexp", "asnes",
              "fedlaw")
PARTITIONS = ("auto", "dirichlet", "iid", "natural")
ENGINES = ("auto", "batched", "sequential")
PROXY_SOURCES = ("test", "train")
FEDLAW_LEARN = ("both", "gamma", "lambda")
BAD_CLIENT_POLICIES = ("exclude", "raise")  # as the Flower strategies' on_bad_reply
ATTACK_CHOICES = ("none",) + ATTACKS  # fl/datasets/attacks.py
# the robust aggregation rules and their parameter fields (AGGREGATORS, AGGREGATOR_PARAMS) are the
# server's (server/robust_aggregation/robust_aggregator.py); the trimmed mean's default beta is in defaults.py
TRIM_BETA = D.TRIM_BETA
# server algorithms a robust rule cannot serve, with the reason
ROBUST_REFUSED_ALGOS = {
    "fedexp": "its step size is a function of sum_i p_i ||D_i||^2 and ||D||^2 that holds only for the weighted mean",
    "asnes": "its gain ratio estimates the variance of the weighted mean from the clients' norms",
    "fedlaw": "it learns its own aggregation weights from every client's model on a proxy set",
    "scaffold": "its control variates average every client's correction, poisoned ones included",
}
COMPRESS_ROTATION = 1024  # values per block of --compress-rotate's Hadamard transform
CLIENT_STATE_DTYPES = ("float32", "float64", "bfloat16", "float16")  # fl/engine/client_state.py's storage dtypes


class ConfigError(ValueError):
    """An impossible or unknown setting; the message is one line naming it."""


class MemoryBudgetWarning(UserWarning):
    """``memory_budget`` is below what the smallest chunk of a round needs: the run goes
    on, over the budget, and says by how much."""


@dataclass
class SimulationConfig:
    """Settings of one simulated federated training run (defaults: a quick digits run).

    Every default is :mod:`fedopt_kernels.defaults`'s (one value per hyperparameter
    for every entry point, each with its source).  They follow [FedNAR] section 5
    (Dirichlet alpha 0.3, 20 local steps, local lr decayed by 0.998 per round, max norm
    10) scaled to the 1437 training images of
    ``digits``: 20 clients, 10 per round.  ``server_lr=None`` picks the algorithm's own
    default (the class's, :attr:`fedopt_kernels.server.Algorithm.defaults`).

    ``weighting``: how the server weights the round's clients -- ``"auto"`` (default)
    each algorithm's own rule, as its paper states it
    (:data:`fedopt_kernels.server.ALGORITHM_WEIGHTING`: uniform ``1/|S|`` for
    scaffold, fedexp and asnes; data size for fedavg, fedprox, fedavgm, fedadam,
    fedyogi, fedadagrad and fedlaw; ``nar`` does not change it), ``"size"`` or
    ``"uniform"``.  Floating buffers (BatchNorm statistics) are averaged with the same
    weights, except under fedlaw (its model keeps the statistics of its proxy
    training).  The resolved rule is ``results.meta["weighting"]``.

    ``proxy_source``: where FedLAW's class-balanced proxy set of ``proxy_size``
    examples comes from -- ``"test"`` (default; [FedLAW] appendix D.2: drawn from the
    test set, the test accuracy then computed on the rest) or ``"train"`` (drawn from
    the pooled training data, the test set untouched).

    ``engine``: ``"batched"`` trains a round's clients as one batched computation
    (:mod:`fedopt_kernels.fl.engine.batched`; models it cannot batch fall back to sequential
    with a notice), ``"sequential"`` one client after another (the oracle), ``"auto"``
    batched unless only one client trains per round.  ``client_batch``: the most
    clients the batched engine trains at once (0: chosen from the free memory); the
    result does not depend on it.

    ``on_bad_client``: ``"exclude"`` (default) leaves a client that cannot take part
    out of its round -- no samples (``no_data``), its local training raised
    (``error``), a NaN/Inf update (``nonfinite``) -- counted per reason in the round's
    record (``excluded_clients``, ``excluded_<reason>``); the round goes on with the
    rest, and is skipped (``server_skipped``) only when none is left.  ``"raise"``: a
    client without samples or whose training raises fails the round, as before
    (NaN/Inf updates are still left out by the server step).  ``max_weight_share``:
    the largest share of a round's total weight one client may get under
    ``weighting="size"`` (None, the default: no cap;
    :func:`fedopt_kernels.server.weighting.cap_weight_shares`).

    What the papers' authors do around the step (all off by default; the recipes of
    :mod:`fedopt_kernels.fl.run.recipes` turn them on, ``recipe`` records which one the
    settings started from): ``fedexp_scale_eps`` (FedExP's ``M * eps``),
    ``fedexp_eps_decay`` (eps times this per round), ``eval_avg_last_two`` (each
    evaluation also scores the mean of the last two global models:
    ``test_accuracy_avg2``), ``carry_momentum`` (a client's local momentum buffers
    carry over to its next round, as FedLAW's code), ``decay_scales_change`` (FedDecay
    per epoch as its code: the epoch at the full lr, its parameter change scaled by
    ``beta^j``) -- the last two on the sequential engine.  ``holdout_clients``: that many
    clients (drawn by the seed) are never sampled, and each evaluation also scores the
    global model on their data (``holdout_accuracy``, [FedDecay] section 4).
    """

    # what runs
    algo: str = "fedavg"
    nar: str = D.LOCAL["nar"]
    dataset: str = "digits"
    model: str = "mlp"
    hidden: Tuple[int, ...] = (200, 200)
    # federation
    clients: int = 20
    per_round: int = 10
    rounds: int = 50
    partition: str = "auto"
    alpha: float = 0.3
    min_client_size: Optional[int] = None
    weighting: str = "auto"
    # local training
    local_steps: int = D.LOCAL["steps"]
    batch_size: int = D.LOCAL["batch_size"]
    lr: float = D.LOCAL["lr"]
    lr_decay: float = D.LOCAL["lr_decay"]
    weight_decay: float = D.LOCAL["weight_decay"]
    wd_decay: float = D.LOCAL["wd_decay"]
    max_norm: float = D.LOCAL["max_norm"]
    momentum: float = D.LOCAL["momentum"]
    decay_beta: float = D.LOCAL["decay_beta"]
    decay_kind: str = D.LOCAL["decay_kind"]
    decay_per: str = D.LOCAL["decay_per"]
    prox_mu: float = D.FEDPROX_MU
    # server
    server_lr: Optional[float] = None
    server_momentum: Optional[float] = None
    server_betas: Tuple[float, float] = D.ADAPTIVE["betas"]
    server_tau: float = D.ADAPTIVE["tau"]
    fedexp_eps: float = D.FEDEXP_EPS
    fedlaw_learn: str = D.FEDLAW["learn"]
    fedlaw_epochs: int = D.FEDLAW["server_epochs"]
    fedlaw_lr: float = D.FEDLAW["lr"]
    proxy_size: int = D.FEDLAW["proxy_size"]
    proxy_source: str = D.FEDLAW["proxy_source"]
    max_weight_share: Optional[float] = None
    on_bad_client: str = "exclude"
    # data options
    synthetic_alpha: float = 1.0
    synthetic_beta: float = 1.0
    synthetic_iid: bool = False
    max_samples_per_client: Optional[int] = None
    test_fraction: float = 0.2
    data_root: Optional[str] = None
    # running
    seed: int = 0
    eval_every: int = 1
    device: str = "cpu"
    backend: Optional[str] = None
    engine: str = "auto"
    client_batch: int = 0
    # corrupted clients (fl/datasets/corruption.py): a seeded fraction trains on damaged data
    corrupt_fraction: float = 0.0
    corrupt_kind: str = "labels"
    corrupt_noise_std: float = 1.0
    # differential privacy (server/differential_privacy/dp.py: DP-FedAvg; dp_target_quantile: adaptive clipping)
    # and attacks for testing (fl/datasets/attacks.py); validated by _validate_privacy_and_attacks
    dp_clip: Optional[float] = None
    dp_noise_multiplier: float = 0.0
    dp_target_quantile: Optional[float] = None
    dp_delta: Optional[float] = None
    dp_mode: str = "server"
    attack: str = "none"
    attack_fraction: float = 0.0
    # Byzantine-robust aggregation (server/robust_aggregation/robust_aggregator.py); a parameter left None takes the
    # rule's default (trim-beta 0.1, krum-m per-round - f, geomed 4 iterations / tol 1e-5, 1 cclip
    # iteration); validated by _validate_aggregator
    aggregator: str = "mean"
    trim_beta: Optional[float] = None
    byzantine_f: Optional[int] = None
    krum_m: Optional[int] = None
    geomed_iters: Optional[int] = None
    geomed_tol: Optional[float] = None
    cclip_tau: Optional[float] = None
    cclip_iters: Optional[int] = None
    norm_bound_radius: Optional[float] = None
    # the papers' procedures around the step (fl/run/recipes.py turns them on per paper)
    fedexp_scale_eps: bool = False  # FedExP's eps times the round's client count (authors' main.py:404)
    fedexp_eps_decay: float = 1.0  # FedExP's eps times this per round (authors': 0.998^2, main.py:308)
    eval_avg_last_two: bool = False  # also evaluate the mean of the last two global iterates (FedExP)
    carry_momentum: bool = False  # a client's local momentum carries to its next round (FedLAW's code)
    decay_scales_change: bool = False  # FedDecay per epoch: scale the epoch's change by beta^j (authors' code)
    recipe: Optional[str] = None  # the fl/run/recipes.py recipe these settings started from (recorded)
    holdout_clients: int = 0  # clients never sampled for training, evaluated on their data ([FedDecay] section 4)
    # per-client state (fl/engine/client_state.py: SCAFFOLD's c_i): kept only for clients that took part,
    # in a compact dtype (None: the model's, bit for bit) and/or spilled to memory-mapped files in a directory
    client_state_dtype: Optional[str] = None
    client_state_dir: Optional[str] = None
    # a round's memory bounded by a chunk (fl/engine/chunked.py): "4G", "512M" or bytes; None: the whole round at once
    memory_budget: Optional[Any] = None
    # compressed client updates (fl/engine/compressed_updates.py, docs/compression.md): the codec of every
    # reply ("none", "int8", "int4", "fp8", "topk:FRACTION"), the values per scale of the block codecs,
    # unbiased stochastic rounding (int8/int4), the per-round randomized Hadamard rotation (blocks of
    # COMPRESS_ROTATION values) and error feedback (each client's residual in the per-client state)
    compress: str = "none"
    compress_block: int = 256
    compress_stochastic: bool = False
    compress_rotate: bool = False
    error_feedback: bool = False

    # ------------------------------------------------------------------ conversion
    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d

    @classmethod
    def field_names(cls) -> List[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: Dict[str, Any], *, source: str = "config") -> "SimulationConfig":
        """Build and validate from a plain dict (unknown keys are an error)."""
        known = set(cls.field_names())
        aliases = {k.replace("-", "_"): v for k, v in values.items()}
        unknown = sorted(set(aliases) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown setting {unknown[0]!r} (known: {', '.join(sorted(known))})")
        cfg = cls(**aliases)
        cfg.validate()
        return cfg

    def replace(self, **changes) -> "SimulationConfig":
        cfg = dataclasses.replace(self, **changes)
        cfg.validate()
        return cfg

    # ------------------------------------------------------------------ validation
    def validate(self) -> "SimulationConfig":
        """Check every setting; raises :class:`ConfigError` naming the first bad one."""
        from ..datasets.data import dataset_names, unknown_dataset
        from ..engine.models import model_names

        def choice(name, options):
            value = getattr(self, name)
            if value not in options:
                raise ConfigError(f"unknown {name.replace('_', '-')} {value!r}; choose one of {', '.join(options)}")

        def integer(name, low, allow_none=False):
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name.replace('_', '-')} must be an integer, got {value!r}")
            if value < low:
                raise ConfigError(f"{name.replace('_', '-')} must be >= {low}, got {value}")

        def real(name, low=-math.inf, high=math.inf, low_open=False, high_open=False, allow_none=False):
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{name.replace('_', '-')} must be a number, got {value!r}")
            bad = not math.isfinite(value) and not (value == math.inf and high == math.inf)
            bad = bad or (value <= low if low_open else value < low) or (value >= high if high_open else value > high)
            if bad:
                lo = "" if low == -math.inf else (f"> {low:g}" if low_open else f">= {low:g}")
                hi = "" if high == math.inf else (f"< {high:g}" if high_open else f"<= {high:g}")
                rng = " and ".join(s for s in (lo, hi) if s)
                raise ConfigError(f"{name.replace('_', '-')} must be {rng}, got {value}")

        choice("algo", ALGORITHMS)
        choice("nar", NAR_MODES)
        if not isinstance(self.dataset, str):
            choice("dataset", tuple(dataset_names()))
        elif unknown_dataset(self.dataset):  # package.module:function is resolved later
            raise ConfigError(unknown_dataset(self.dataset))
        if not (isinstance(self.model, str) and ":" in self.model):
            choice("model", tuple(model_names()))
        choice("partition", PARTITIONS)
        choice("weighting", WEIGHTINGS)
        choice("decay_kind", DECAY_KINDS)
        choice("decay_per", DECAY_PER)
        choice("fedlaw_learn", FEDLAW_LEARN)
        choice("proxy_source", PROXY_SOURCES)
        choice("engine", ENGINES)
        choice("corrupt_kind", CORRUPT_KINDS)
        choice("on_bad_client", BAD_CLIENT_POLICIES)
        if self.memory_budget is not None:
            from ..engine.chunked import parse_bytes

            try:
                parse_bytes(self.memory_budget)
            except ValueError as exc:
                raise ConfigError(f"memory-budget: {exc}") from None
        if self.client_state_dtype is not None:
            choice("client_state_dtype", CLIENT_STATE_DTYPES)
        if self.client_state_dir is not None and (not isinstance(self.client_state_dir, str)
                                                  or not self.client_state_dir):
            raise ConfigError(f"client-state-dir must be a directory path, got {self.client_state_dir!r}")
        integer("client_batch", 0)
        integer("clients", 1)
        integer("per_round", 1)
        if self.per_round > self.clients:
            raise ConfigError(f"per-round ({self.per_round}) cannot exceed clients ({self.clients})")
        integer("rounds", 1)
        integer("local_steps", 1)
        integer("batch_size", 1)
        integer("seed", 0)
        integer("eval_every", 1)
        integer("fedlaw_epochs", 1)
        integer("proxy_size", 1)
        integer("min_client_size", 1, allow_none=True)
        integer("max_samples_per_client", 2, allow_none=True)
        real("alpha", 0.0, low_open=True)
        real("lr", 0.0)
        real("lr_decay", 0.0, 1.0, low_open=True)
        real("weight_decay", 0.0)
        real("wd_decay", 0.0, 1.0, low_open=True)
        real("max_norm", 0.0, low_open=True)
        real("momentum", 0.0, 1.0, high_open=True)
        real("decay_beta", 0.0, 1.0)
        real("prox_mu", 0.0)
        real("server_lr", 0.0, allow_none=True)
        real("server_momentum", 0.0, 1.0, high_open=True, allow_none=True)
        real("server_tau", 0.0, low_open=True)
        real("fedexp_eps", 0.0)
        real("fedlaw_lr", 0.0, low_open=True)
        real("synthetic_alpha", 0.0)
        real("synthetic_beta", 0.0)
        real("test_fraction", 0.0, 1.0, low_open=True, high_open=True)
        real("corrupt_fraction", 0.0, 1.0)
        real("corrupt_noise_std", 0.0, low_open=True)
        real("max_weight_share", 0.0, 1.0, low_open=True, allow_none=True)
        for name in ("fedexp_scale_eps", "eval_avg_last_two", "carry_momentum", "decay_scales_change"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name.replace('_', '-')} must be true or false, got {getattr(self, name)!r}")
        real("fedexp_eps_decay", 0.0, 1.0, low_open=True)
        integer("holdout_clients", 0)
        if self.holdout_clients and self.per_round > self.clients - self.holdout_clients:
            raise ConfigError(f"per-round ({self.per_round}) cannot exceed the clients left for training "
                              f"({self.clients} - holdout-clients {self.holdout_clients})")
        if self.decay_scales_change and self.decay_per != "epoch":
            raise ConfigError("decay-scales-change scales each local epoch's parameter change, so it needs "
                              f"decay-per epoch, got decay-per {self.decay_per!r}")
        if self.recipe is not None:
            from .recipes import RECIPES

            if self.recipe not in RECIPES:
                raise ConfigError(f"unknown recipe {self.recipe!r}; choose one of {', '.join(RECIPES)}")
        if self.corrupt_fraction > 0 and math.floor(self.corrupt_fraction * self.clients + 0.5) == 0:
            raise ConfigError(f"corrupt-fraction {self.corrupt_fraction:g} of {self.clients} clients corrupts no "
                              f"client (the count is rounded); use at least {0.5 / self.clients:.3g}")
        betas = self.server_betas
        if (not isinstance(betas, (list, tuple)) or len(betas) != 2
                or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)):
            raise ConfigError(f"server-betas must be two numbers in [0, 1), got {betas!r}")
        self.server_betas = (float(betas[0]), float(betas[1]))
        hidden = self.hidden
        if (not isinstance(hidden, (list, tuple))
                or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 1 for h in hidden)):
            raise ConfigError(f"hidden must be a list of positive layer widths, got {hidden!r}")
        self.hidden = tuple(hidden)
        if self.data_root is not None and not isinstance(self.data_root, str):
            raise ConfigError(f"data-root must be a directory path, got {self.data_root!r}")
        if not isinstance(self.synthetic_iid, bool):
            raise ConfigError(f"synthetic-iid must be true or false, got {self.synthetic_iid!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ConfigError(f"device must be a device name such as 'cpu' or 'cuda', got {self.device!r}")
        try:
            import torch

            dev = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"device {self.device!r} is not a valid torch device ({exc})") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device!r} was requested but CUDA is not available here")
        if self.backend is not None:
            from ...backends import BACKENDS

            if self.backend not in BACKENDS:
                raise ConfigError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        self._validate_privacy_and_attacks(choice, real)
        self._validate_aggregator(choice, integer, real)
        self._validate_compression()
        return self

    def _validate_compression(self) -> None:
        """The compression settings (one block: they move together)."""
        for name in ("compress_stochastic", "compress_rotate", "error_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name.replace('_', '-')} must be true or false, got {getattr(self, name)!r}")
        b = self.compress_block
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0 or b % 32:
            raise ConfigError(f"compress-block must be a positive multiple of 32, got {b!r}")
        if not isinstance(self.compress, str):
            raise ConfigError(f"compress must be a string (none, int8, int4, fp8, topk:FRACTION), got "
                              f"{self.compress!r}")
        if self.compress == "none":
            for name in ("compress_stochastic", "compress_rotate", "error_feedback"):
                if getattr(self, name):
                    raise ConfigError(f"{name.replace('_', '-')} needs --compress (int8, int4, fp8 or topk:FRACTION)")
            return
        try:
            self.codec()
        except ValueError as exc:
            raise ConfigError(f"compress {self.compress!r}: {exc}") from None
        if self.algo == "fedlaw":
            raise ConfigError("compress cannot be used with algo fedlaw: it learns from every client's whole model, "
                              "not from an update")
        if self.dp_clip is not None and self.dp_mode == "client":
            raise ConfigError("compress with dp-mode client: the server would sum decoded updates whose norms are "
                              "not the clipped ones; use dp-mode server, which clips the decoded update")

    def codec(self):
        """The :class:`~fedopt_kernels.compression.Codec` of :attr:`compress` (None for "none")."""
        if self.compress == "none":
            return None
        from ...compression import parse_codec

        return parse_codec(self.compress, block=self.compress_block, stochastic=self.compress_stochastic,
                           rotation=COMPRESS_ROTATION if self.compress_rotate else None)

    def _validate_aggregator(self, choice, integer, real) -> None:
        """The robust rule and its parameters: each parameter only with its rule, the
        rule's requirements on the round's size, and the settings it cannot serve."""
        choice("aggregator", AGGREGATORS)
        for name, (rules, _) in AGGREGATOR_PARAMS.items():
            if getattr(self, name) is not None and self.aggregator not in rules:
                raise ConfigError(f"{name.replace('_', '-')} applies to aggregator {' / '.join(rules)}, got "
                                  f"aggregator {self.aggregator}")
        real("trim_beta", 0.0, 0.5, high_open=True, allow_none=True)
        integer("byzantine_f", 0, allow_none=True)
        integer("krum_m", 1, allow_none=True)
        integer("geomed_iters", 1, allow_none=True)
        real("geomed_tol", 0.0, allow_none=True)
        real("cclip_tau", 0.0, low_open=True, allow_none=True)
        integer("cclip_iters", 1, allow_none=True)
        real("norm_bound_radius", 0.0, low_open=True, allow_none=True)
        rule = self.aggregator
        if rule == "mean":
            return
        need = {"krum": "byzantine-f", "multi-krum": "byzantine-f", "bulyan": "byzantine-f",
                "centered-clip": "cclip-tau", "norm-bound": "norm-bound-radius"}.get(rule)
        if need is not None and getattr(self, need.replace("-", "_")) is None:
            raise ConfigError(f"aggregator {rule} needs {need}")
        f, C = self.byzantine_f, self.per_round
        if rule in ("krum", "multi-krum") and C < 2 * f + 3:
            raise ConfigError(f"aggregator {rule} with byzantine-f {f} needs per-round >= 2 byzantine-f + 3 = "
                              f"{2 * f + 3} (Blanchard et al. 2017: n > 2f + 2), got per-round {C}")
        if rule == "bulyan" and C < 4 * f + 3:
            raise ConfigError(f"aggregator bulyan with byzantine-f {f} needs per-round >= 4 byzantine-f + 3 = "
                              f"{4 * f + 3} (El Mhamdi et al. 2018: n >= 4f + 3), got per-round {C}")
        if self.krum_m is not None and self.krum_m > C:
            raise ConfigError(f"krum-m {self.krum_m} selects more clients than per-round ({C})")
        if self.dp_clip is not None:
            raise ConfigError(robust_with_dp_error(rule))
        if self.algo in ROBUST_REFUSED_ALGOS:
            raise ConfigError(f"aggregator {rule} cannot be used with algo {self.algo}: {ROBUST_REFUSED_ALGOS[self.algo]}")

    @property
    def aggregator_params(self) -> Dict[str, Any]:
        """The parameters of :attr:`aggregator` set here, by the names
        :class:`~fedopt_kernels.server.RobustAggregator` takes."""
        out = {param: getattr(self, name) for name, (rules, param) in AGGREGATOR_PARAMS.items()
               if self.aggregator in rules and getattr(self, name) is not None}
        if self.aggregator == "trimmed-mean":
            out.setdefault("beta", TRIM_BETA)
        return out

    def _validate_privacy_and_attacks(self, choice, real) -> None:
        """The DP and attack settings: each alone, then every combination that
        would void the privacy guarantee, refused with the reason."""
        choice("attack", ATTACK_CHOICES)
        real("attack_fraction", 0.0, 1.0)
        if self.attack == "none" and self.attack_fraction > 0:
            raise ConfigError(f"attack-fraction {self.attack_fraction:g} needs an attack: set attack to one of "
                              f"{', '.join(ATTACK_CHOICES[1:])}")
        if self.attack != "none" and math.floor(self.attack_fraction * self.clients + 0.5) == 0:
            raise ConfigError(f"attack {self.attack} with attack-fraction {self.attack_fraction:g} of {self.clients} "
                              f"clients attacks no client (the count is rounded); use at least "
                              f"{0.5 / self.clients:.3g}")
        # the Flower strategies' dp_* arguments go through the same checks (server/differential_privacy/dp_settings.py)
        try:
            check_dp_settings(clip=self.dp_clip, noise_multiplier=self.dp_noise_multiplier,
                              target_quantile=self.dp_target_quantile, delta=self.dp_delta, mode=self.dp_mode,
                              algo=self.algo, weighting=self.weighting, resolved_weighting=self.resolved_weighting,
                              clients=self.clients, per_round=self.per_round)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    @property
    def memory_budget_bytes(self) -> Optional[int]:
        """:attr:`memory_budget` in bytes (None: no budget)."""
        if self.memory_budget is None:
            return None
        from ..engine.chunked import parse_bytes

        return parse_bytes(self.memory_budget)

    @property
    def needs_proxy(self) -> bool:
        return self.algo == "fedlaw"

    @property
    def resolved_weighting(self) -> str:
        """``"size"`` or ``"uniform"``: :attr:`weighting`, with ``"auto"`` resolved for
        :attr:`algo` (:func:`fedopt_kernels.server.resolve_weighting`)."""
        return resolve_weighting(self.weighting, self.algo)

    def local_config(self):
        """The clients' :class:`~fedopt_kernels.fl.engine.client.LocalConfig`: each field from
        the setting :data:`LOCAL_FIELDS` names, FedProx's ``mu`` and SCAFFOLD's
        correction from :attr:`algo`."""
        from ..engine.client import LocalConfig

        return LocalConfig(**{field: getattr(self, name) for field, name in LOCAL_FIELDS.items()},
                           prox_mu=self.prox_mu if self.algo == "fedprox" else 0.0, scaffold=self.algo == "scaffold")


# LocalConfig field -> the SimulationConfig setting that sets it, written once (the settings name
# whose step they are: --local-steps); prox_mu and scaffold follow from algo (local_config)
LOCAL_FIELDS = {
    "steps": "local_steps", "batch_size": "batch_size", "lr": "lr", "lr_decay": "lr_decay",
    "weight_decay": "weight_decay", "wd_decay": "wd_decay", "max_norm": "max_norm", "nar": "nar",
    "momentum": "momentum", "decay_beta": "decay_beta", "decay_kind": "decay_kind", "decay_per": "decay_per",
    "backend": "backend", "carry_momentum": "carry_momentum", "decay_scales_change": "decay_scales_change",
}
