"""``SimulationConfig``: every setting of a simulation, as nested parts.

One part per concern -- :class:`DataConfig`, the engine's own
:class:`~fedopt_kernels.fl.engine.client.LocalConfig`, :class:`ServerConfig`,
:class:`PrivacyConfig`, :class:`RobustnessConfig`, :class:`CompressionConfig`,
:class:`RunConfig` -- each validating its own fields; the rules that tie two parts
together live in :func:`check_across_parts`.  The flat names every entry point has
used (``local_steps``, ``server_lr``, ``dp_clip``...) are :data:`FLAT_NAMES`, one
table from which the constructor's keywords, the flat properties, :meth:`to_dict`
(the form checkpoints and ``results.json`` store) and the command-line flags
(``--local-steps``) all follow.

The command line, TOML config files and the Python API all build one of these; an
impossible setting raises :class:`ConfigError` (a ``ValueError``) with one line that
names the setting.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ... import defaults as D
from ...lr_scheduler import KINDS as DECAY_KINDS
from ...lr_scheduler import PER as DECAY_PER
from ...ops import MODES as NAR_MODES
from ...server.registry import WEIGHTINGS, resolve_weighting
from ...server.robust_aggregation.robust_aggregator import AGGREGATOR_PARAMS, AGGREGATORS
from ..datasets.attacks import ATTACKS
from ..datasets.corruption import CORRUPT_KINDS
from ..engine.client import LocalConfig
from .recipes import RECIPES
from ...server.differential_privacy.dp_settings import (DP_MODES, DP_REFUSED_ALGOS, check_dp_settings,  # noqa: F401
                                                       robust_with_dp_error)

__all__ = ["SimulationConfig", "ConfigError", "DataConfig", "LocalConfig", "ServerConfig", "PrivacyConfig",
           "RobustnessConfig", "CompressionConfig", "RunConfig", "PARTS", "FLAT_NAMES", "FLAG_OF", "check_across_parts",
           "ALGORITHMS", "PARTITIONS", "ENGINES", "WEIGHTINGS", "PROXY_SOURCES",
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


def _setting(default, help_: str, **more):
    """A field with its help text: ``fedopt simulate``'s option is generated from it
    (``{default}`` is filled in with the default; ``cli_type`` overrides the parser
    that the field's type implies)."""
    return field(default=default, metadata={"help": help_, **more})


class _Checks:
    """The range and kind checks of one part; every message names the setting by its
    flat name with dashes (the command-line flag without ``--``), as it always has."""

    def __init__(self, obj, part: str):
        self.obj, self.part = obj, part

    def flag(self, name: str) -> str:
        return FLAG_OF[(self.part, name)].replace("_", "-")

    def choice(self, name, options):
        value = getattr(self.obj, name)
        if value not in options:
            raise ConfigError(f"unknown {self.flag(name)} {value!r}; choose one of {', '.join(options)}")

    def integer(self, name, low, allow_none=False):
        value = getattr(self.obj, name)
        if value is None and allow_none:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{self.flag(name)} must be an integer, got {value!r}")
        if value < low:
            raise ConfigError(f"{self.flag(name)} must be >= {low}, got {value}")

    def real(self, name, low=-math.inf, high=math.inf, low_open=False, high_open=False, allow_none=False):
        value = getattr(self.obj, name)
        if value is None and allow_none:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{self.flag(name)} must be a number, got {value!r}")
        bad = not math.isfinite(value) and not (value == math.inf and high == math.inf)
        bad = bad or (value <= low if low_open else value < low) or (value >= high if high_open else value > high)
        if bad:
            lo = "" if low == -math.inf else (f"> {low:g}" if low_open else f">= {low:g}")
            hi = "" if high == math.inf else (f"< {high:g}" if high_open else f"<= {high:g}")
            rng = " and ".join(s for s in (lo, hi) if s)
            raise ConfigError(f"{self.flag(name)} must be {rng}, got {value}")

    def boolean(self, *names):
        for name in names:
            if not isinstance(getattr(self.obj, name), bool):
                raise ConfigError(f"{self.flag(name)} must be true or false, got {getattr(self.obj, name)!r}")


@dataclass
class DataConfig:
    """The federation's data: the dataset, its clients and their split, and the
    clients whose data are corrupted or who attack (for testing)."""

    dataset: str = _setting("digits", "digits, synthetic, synthetic-lazy (each client generated when sampled), "
                            "cifar10 (needs torchvision and the data on disk), leaf-femnist:PATH or "
                            "leaf-shakespeare:PATH (LEAF's files in PATH), a name registered with "
                            "fedopt_kernels.fl.register_dataset, or package.module:function (your own dataset: "
                            "docs/datasets.md) (default {default})")
    clients: int = _setting(20, "number of clients (default {default})")
    per_round: int = _setting(10, "clients sampled per round (default {default})")
    partition: str = _setting("auto", f"{', '.join(PARTITIONS)} (default auto: the dataset's own split, else "
                                      "dirichlet)")
    alpha: float = _setting(0.3, "Dirichlet concentration of the label partition, > 0 (default {default})")
    min_client_size: Optional[int] = _setting(None, "fewest samples a client may hold (default min(10, "
                                                    "n/(10*clients)), at least 1)", cli_type=int)
    synthetic_alpha: float = _setting(1.0, "Synthetic(alpha, beta): alpha (default {default})")
    synthetic_beta: float = _setting(1.0, "Synthetic(alpha, beta): beta (default {default})")
    synthetic_iid: bool = _setting(False, "Synthetic: IID variant (default false)")
    max_samples_per_client: Optional[int] = _setting(None, "Synthetic: cap on a client's samples (default none)",
                                                     cli_type=int)
    test_fraction: float = _setting(0.2, "held-out test fraction (default {default})")
    data_root: Optional[str] = _setting(None, "where cifar10 looks for its files (default $FEDOPT_DATA or "
                                              "~/.cache/fedopt/data)")
    holdout_clients: int = _setting(0, "clients never sampled for training; each evaluation also scores the global "
                                       "model on their data (holdout_accuracy), as [FedDecay] holds out 20%% of the "
                                       "users (default {default})")
    # corrupted clients (fl/datasets/corruption.py): a seeded fraction trains on damaged data
    corrupt_fraction: float = _setting(0.0, "fraction of the clients (rounded, chosen by --seed) whose training data "
                                            "are corrupted; recorded in results.json meta.corruption "
                                            "(default {default})")
    corrupt_kind: str = _setting("labels", f"{', '.join(CORRUPT_KINDS)}: labels = a fixed random derangement of the "
                                           "classes per client (every label wrong), swap = FedLAW's two classes "
                                           "exchanged, noise = additive Gaussian noise on the inputs "
                                           "(default {default})")
    corrupt_noise_std: float = _setting(1.0, "std of the input noise of --corrupt-kind noise (default {default})")
    # attacks for testing (fl/datasets/attacks.py)
    attack: str = _setting("none", f"attack for testing by --attack-fraction of the clients: "
                                   f"{', '.join(ATTACK_CHOICES)}; alie = Baruch et al. 2019; recorded in "
                                   "results.json (default {default})")
    attack_fraction: float = _setting(0.0, "fraction of the clients (rounded, chosen by --seed) that attack "
                                           "(default {default})")

    def validate(self) -> None:
        from ..datasets.data import dataset_names, unknown_dataset

        c = _Checks(self, "data")
        if not isinstance(self.dataset, str):
            c.choice("dataset", tuple(dataset_names()))
        elif unknown_dataset(self.dataset):  # package.module:function is resolved later
            raise ConfigError(unknown_dataset(self.dataset))
        c.choice("partition", PARTITIONS)
        c.choice("corrupt_kind", CORRUPT_KINDS)
        c.integer("clients", 1)
        c.integer("per_round", 1)
        if self.per_round > self.clients:
            raise ConfigError(f"per-round ({self.per_round}) cannot exceed clients ({self.clients})")
        c.integer("min_client_size", 1, allow_none=True)
        c.integer("max_samples_per_client", 2, allow_none=True)
        c.real("alpha", 0.0, low_open=True)
        c.real("synthetic_alpha", 0.0)
        c.real("synthetic_beta", 0.0)
        c.real("test_fraction", 0.0, 1.0, low_open=True, high_open=True)
        c.real("corrupt_fraction", 0.0, 1.0)
        c.real("corrupt_noise_std", 0.0, low_open=True)
        c.integer("holdout_clients", 0)
        if self.holdout_clients and self.per_round > self.clients - self.holdout_clients:
            raise ConfigError(f"per-round ({self.per_round}) cannot exceed the clients left for training "
                              f"({self.clients} - holdout-clients {self.holdout_clients})")
        if self.corrupt_fraction > 0 and math.floor(self.corrupt_fraction * self.clients + 0.5) == 0:
            raise ConfigError(f"corrupt-fraction {self.corrupt_fraction:g} of {self.clients} clients corrupts no "
                              f"client (the count is rounded); use at least {0.5 / self.clients:.3g}")
        if self.data_root is not None and not isinstance(self.data_root, str):
            raise ConfigError(f"data-root must be a directory path, got {self.data_root!r}")
        c.boolean("synthetic_iid")
        c.choice("attack", ATTACK_CHOICES)
        c.real("attack_fraction", 0.0, 1.0)
        if self.attack == "none" and self.attack_fraction > 0:
            raise ConfigError(f"attack-fraction {self.attack_fraction:g} needs an attack: set attack to one of "
                              f"{', '.join(ATTACK_CHOICES[1:])}")
        if self.attack != "none" and math.floor(self.attack_fraction * self.clients + 0.5) == 0:
            raise ConfigError(f"attack {self.attack} with attack-fraction {self.attack_fraction:g} of {self.clients} "
                              f"clients attacks no client (the count is rounded); use at least "
                              f"{0.5 / self.clients:.3g}")


def _validate_local(local: LocalConfig) -> None:
    """The local part's checks (the engine's :class:`LocalConfig` is the part itself)."""
    c = _Checks(local, "local")
    c.choice("nar", NAR_MODES)
    c.choice("decay_kind", DECAY_KINDS)
    c.choice("decay_per", DECAY_PER)
    c.integer("steps", 1)
    c.integer("batch_size", 1)
    c.real("lr", 0.0)
    c.real("lr_decay", 0.0, 1.0, low_open=True)
    c.real("weight_decay", 0.0)
    c.real("wd_decay", 0.0, 1.0, low_open=True)
    c.real("max_norm", 0.0, low_open=True)
    c.real("momentum", 0.0, 1.0, high_open=True)
    c.real("decay_beta", 0.0, 1.0)
    c.real("prox_mu", 0.0)
    c.boolean("carry_momentum", "decay_scales_change")
    if local.decay_scales_change and local.decay_per != "epoch":
        raise ConfigError("decay-scales-change scales each local epoch's parameter change, so it needs "
                          f"decay-per epoch, got decay-per {local.decay_per!r}")
    if local.backend is not None:
        from ...backends import BACKENDS

        if local.backend not in BACKENDS:
            raise ConfigError(f"unknown backend {local.backend!r}; choose one of {', '.join(BACKENDS)}")
    if local.scaffold is not False:
        raise ConfigError(f"local.scaffold follows from the algorithm (algo scaffold), got {local.scaffold!r}")


@dataclass
class ServerConfig:
    """The server: its algorithm and step, how it weights the round's clients, and the
    knobs of FedExP / FedLAW."""

    algo: str = _setting("fedavg", f"algorithm: {', '.join(ALGORITHMS)} (default {{default}})")
    lr: Optional[float] = _setting(None, "server learning rate (default: the algorithm's own)")
    momentum: Optional[float] = _setting(None, "FedAvgM / ASNES momentum (default 0.9), FedAdagrad's beta1 "
                                               "(default 0)")
    betas: Tuple[float, float] = _setting(D.ADAPTIVE["betas"], "FedAdam / FedYogi betas, e.g. 0.9,0.99 "
                                                               "(default {default})")
    tau: float = _setting(D.ADAPTIVE["tau"], "FedAdam / FedYogi / FedAdagrad tau (default {default})")
    weighting: str = _setting("auto", f"server weights of the clients: {', '.join(WEIGHTINGS)} (default auto: each "
                                      "algorithm's own -- uniform for scaffold, fedexp, asnes; data size for the "
                                      "others; also the weights of BatchNorm statistics)")
    max_weight_share: Optional[float] = _setting(None, "largest share of a round's total weight one client may get "
                                                       "under size weighting, in (0, 1] (default none: no cap)")
    on_bad_client: str = _setting("exclude", "a client without samples or whose training raises: exclude (left "
                                             "out, counted as excluded_<reason>; the round goes on) or raise (the "
                                             "run stops) (default {default})")
    fedexp_eps: float = _setting(D.FEDEXP_EPS, "FedExP's eps (default {default})")
    # FedExP's eps times the round's client count (authors' main.py:404)
    fedexp_scale_eps: bool = _setting(False, "FedExP: use M * eps, M the round's clients, as the authors' code "
                                             "(default false)")
    # FedExP's eps times this per round (authors': 0.998^2, main.py:308)
    fedexp_eps_decay: float = _setting(1.0, "FedExP: eps times this every round; the authors' code uses 0.998^2 "
                                            "(default {default}: no decay)")
    fedlaw_learn: str = _setting(D.FEDLAW["learn"], "FedLAW learns both, gamma or lambda (default {default})")
    fedlaw_epochs: int = _setting(D.FEDLAW["server_epochs"], "FedLAW server epochs per round (default {default})")
    fedlaw_lr: float = _setting(D.FEDLAW["lr"], "FedLAW's Adam lr (default {default})")
    proxy_size: int = _setting(D.FEDLAW["proxy_size"], "FedLAW's class-balanced proxy set size (default {default})")
    proxy_source: str = _setting(D.FEDLAW["proxy_source"], f"where FedLAW's proxy set comes from: "
                                 f"{', '.join(PROXY_SOURCES)} (default test: held out of the test set, accuracy "
                                 "measured on the rest, as [FedLAW] D.2)")

    def validate(self) -> None:
        c = _Checks(self, "server")
        c.choice("algo", ALGORITHMS)
        c.choice("weighting", WEIGHTINGS)
        c.choice("fedlaw_learn", FEDLAW_LEARN)
        c.choice("proxy_source", PROXY_SOURCES)
        c.choice("on_bad_client", BAD_CLIENT_POLICIES)
        c.integer("fedlaw_epochs", 1)
        c.integer("proxy_size", 1)
        c.real("lr", 0.0, allow_none=True)
        c.real("momentum", 0.0, 1.0, high_open=True, allow_none=True)
        c.real("tau", 0.0, low_open=True)
        c.real("fedexp_eps", 0.0)
        c.real("fedlaw_lr", 0.0, low_open=True)
        c.real("max_weight_share", 0.0, 1.0, low_open=True, allow_none=True)
        c.boolean("fedexp_scale_eps")
        c.real("fedexp_eps_decay", 0.0, 1.0, low_open=True)
        betas = self.betas
        if (not isinstance(betas, (list, tuple)) or len(betas) != 2
                or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)):
            raise ConfigError(f"server-betas must be two numbers in [0, 1), got {betas!r}")
        self.betas = (float(betas[0]), float(betas[1]))


@dataclass
class PrivacyConfig:
    """Differential privacy (server/differential_privacy/dp.py: DP-FedAvg; ``target_quantile``:
    adaptive clipping).  Its checks need the algorithm, the weighting and the round's
    size, so they run across parts (:func:`check_across_parts`), through the same
    ``check_dp_settings`` as the Flower strategies' ``dp_*`` arguments."""

    clip: Optional[float] = _setting(None, "DP-FedAvg: clip every client update to this norm, the initial clip with "
                                           "--dp-target-quantile (default none: no differential privacy)")
    noise_multiplier: float = _setting(0.0, "DP-FedAvg: Gaussian noise of std z * clip on the sum of clipped "
                                            "updates; 0 clips without noise, which is not private "
                                            "(default {default})")
    target_quantile: Optional[float] = _setting(None, "adaptive clipping (Andrew et al. 2021): the clip tracks this "
                                                      "quantile of the update norms, e.g. 0.5 (default none: fixed "
                                                      "clip)")
    delta: Optional[float] = _setting(None, "delta at which epsilon is written into results.json every round; "
                                            "needed with noise, below 1/clients (default none)")
    mode: str = _setting("server", f"who clips: {', '.join(DP_MODES)} (client: the clients clip, the server adds "
                                   "the noise) (default {default})")


@dataclass
class RobustnessConfig:
    """Byzantine-robust aggregation (server/robust_aggregation/robust_aggregator.py); a
    parameter left None takes the rule's default (trim-beta 0.1, krum-m per-round - f,
    geomed 4 iterations / tol 1e-5, 1 cclip iteration)."""

    aggregator: str = _setting("mean", f"how the server aggregates the round's updates: {', '.join(AGGREGATORS)}; "
                                       "mean is the weighted mean, the others are robust rules (default {default})")
    trim_beta: Optional[float] = _setting(None, "trimmed-mean: fraction of the values dropped at each end of every "
                                                "coordinate, in [0, 0.5) (default 0.1)")
    byzantine_f: Optional[int] = _setting(None, "krum, multi-krum, bulyan: the number f of Byzantine clients "
                                                "tolerated per round; needs per-round >= 2f + 3 (bulyan: 4f + 3)")
    krum_m: Optional[int] = _setting(None, "multi-krum: how many clients with the lowest Krum scores are averaged "
                                           "(default per-round - f)")
    geomed_iters: Optional[int] = _setting(None, "geomed: most smoothed Weiszfeld iterations (default 4, as RFA)")
    geomed_tol: Optional[float] = _setting(None, "geomed: stop once the objective changes by at most tol times "
                                                 "itself (default 1e-5)")
    cclip_tau: Optional[float] = _setting(None, "centered-clip: the clipping radius tau around the previous "
                                                "aggregate")
    cclip_iters: Optional[int] = _setting(None, "centered-clip: clipping iterations per round (default 1)")
    norm_bound_radius: Optional[float] = _setting(None, "norm-bound: every update is scaled to at most this norm")

    def validate(self) -> None:
        """The rule, each parameter only with its rule, and the parameter a rule needs."""
        c = _Checks(self, "robustness")
        c.choice("aggregator", AGGREGATORS)
        for name, (rules, _) in AGGREGATOR_PARAMS.items():
            if getattr(self, name) is not None and self.aggregator not in rules:
                raise ConfigError(f"{c.flag(name)} applies to aggregator {' / '.join(rules)}, got "
                                  f"aggregator {self.aggregator}")
        c.real("trim_beta", 0.0, 0.5, high_open=True, allow_none=True)
        c.integer("byzantine_f", 0, allow_none=True)
        c.integer("krum_m", 1, allow_none=True)
        c.integer("geomed_iters", 1, allow_none=True)
        c.real("geomed_tol", 0.0, allow_none=True)
        c.real("cclip_tau", 0.0, low_open=True, allow_none=True)
        c.integer("cclip_iters", 1, allow_none=True)
        c.real("norm_bound_radius", 0.0, low_open=True, allow_none=True)
        need = {"krum": "byzantine_f", "multi-krum": "byzantine_f", "bulyan": "byzantine_f",
                "centered-clip": "cclip_tau", "norm-bound": "norm_bound_radius"}.get(self.aggregator)
        if need is not None and getattr(self, need) is None:
            raise ConfigError(f"aggregator {self.aggregator} needs {c.flag(need)}")

    @property
    def params(self) -> Dict[str, Any]:
        """The parameters of :attr:`aggregator` set here, by the names
        :class:`~fedopt_kernels.server.RobustAggregator` takes."""
        out = {param: getattr(self, name) for name, (rules, param) in AGGREGATOR_PARAMS.items()
               if self.aggregator in rules and getattr(self, name) is not None}
        if self.aggregator == "trimmed-mean":
            out.setdefault("beta", TRIM_BETA)
        return out


@dataclass
class CompressionConfig:
    """Compressed client updates (fl/engine/compressed_updates.py, docs/compression.md):
    the codec of every reply, the values per scale of the block codecs, unbiased
    stochastic rounding (int8/int4), the per-round randomized Hadamard rotation (blocks
    of :data:`COMPRESS_ROTATION` values) and error feedback (each client's residual in
    the per-client state)."""

    codec: str = _setting("none", "codec of the clients' updates: none, int8, int4, fp8 (per-block scales) or "
                                  "topk:FRACTION (the largest FRACTION of the values); the server decodes them inside "
                                  "its aggregation (default {default})")
    block: int = _setting(256, "values per scale of int8 / int4 / fp8, a multiple of 32 (default {default})")
    stochastic: bool = _setting(False, "int8 / int4: unbiased stochastic rounding instead of round-to-nearest "
                                       "(default false)")
    rotate: bool = _setting(False, "rotate every update by the round's randomized Hadamard transform (blocks of "
                                   "1024) before encoding; the server rotates the aggregate back (default false)")
    error_feedback: bool = _setting(False, "each client adds its residual (what its previous replies lost) to its "
                                           "update before encoding, kept in the per-client state and checkpoints "
                                           "(default false)")

    def validate(self) -> None:
        c = _Checks(self, "compression")
        c.boolean("stochastic", "rotate", "error_feedback")
        b = self.block
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0 or b % 32:
            raise ConfigError(f"compress-block must be a positive multiple of 32, got {b!r}")
        if not isinstance(self.codec, str):
            raise ConfigError(f"compress must be a string (none, int8, int4, fp8, topk:FRACTION), got "
                              f"{self.codec!r}")
        if self.codec == "none":
            for name in ("stochastic", "rotate", "error_feedback"):
                if getattr(self, name):
                    raise ConfigError(f"{c.flag(name)} needs --compress (int8, int4, fp8 or topk:FRACTION)")
            return
        try:
            self.build()
        except ValueError as exc:
            raise ConfigError(f"compress {self.codec!r}: {exc}") from None

    def build(self):
        """The :class:`~fedopt_kernels.compression.Codec` of :attr:`codec` (None for "none")."""
        if self.codec == "none":
            return None
        from ...compression import parse_codec

        return parse_codec(self.codec, block=self.block, stochastic=self.stochastic,
                           rotation=COMPRESS_ROTATION if self.rotate else None)


@dataclass
class RunConfig:
    """How the run goes: the model, the rounds, the seed, evaluation, the device and
    engine, memory, per-client state, and the recipe the settings started from."""

    model: str = _setting("mlp", "mlp, cnn (FedLAW's SimpleCNN), logreg, a registered name, or "
                                 "package.module:function called with (input_shape, num_classes) (default {default})")
    hidden: Tuple[int, ...] = _setting((200, 200), "hidden widths of the MLP, comma-separated (default {default})")
    rounds: int = _setting(50, "communication rounds (default {default})")
    seed: int = _setting(0, "seed of everything random (default {default})")
    eval_every: int = _setting(1, "evaluate every k rounds (default {default})")
    # also evaluate the mean of the last two global iterates (FedExP)
    eval_avg_last_two: bool = _setting(False, "also evaluate the mean of the last two global models, recorded as "
                                              "test_accuracy_avg2 (FedExP's authors report it) (default false)")
    device: str = _setting("cpu", "cpu or cuda (default {default})")
    engine: str = _setting("auto", f"client engine: {', '.join(ENGINES)}; batched trains a round's clients as one "
                                   "vmapped computation, sequential one after another (default auto: batched unless "
                                   "--per-round 1)")
    client_batch: int = _setting(0, "most clients the batched engine trains at once, to bound memory; the result does "
                                    "not depend on it (default 0: chosen from the free memory)")
    # the fl/run/recipes.py recipe these settings started from (recorded)
    recipe: Optional[str] = _setting(None, f"start from a paper's training recipe: {', '.join(RECIPES)} "
                                     "(fedopt_kernels.fl.run.recipes; each value's source is in results.json "
                                     "meta.recipe); flags and --config settings override it")
    # per-client state (fl/engine/client_state.py: SCAFFOLD's c_i): kept only for clients that took part,
    # in a compact dtype (None: the model's, bit for bit) and/or spilled to memory-mapped files in a directory
    client_state_dtype: Optional[str] = _setting(None, "storage dtype of per-client state (SCAFFOLD's c_i): float32, "
                                                       "float64, bfloat16, float16 (default: the model's, bit for "
                                                       "bit; a compact one rounds the stored values)")
    client_state_dir: Optional[str] = _setting(None, "keep per-client state in memory-mapped files in this directory "
                                                     "instead of in memory (default: in memory)")
    # a round's memory bounded by a chunk (fl/engine/chunked.py): "4G", "512M" or bytes; None: the whole round
    memory_budget: Optional[Any] = _setting(None, "bound a round's memory: its clients train in chunks that fit this "
                                                  "size (4G, 512M, bytes), each chunk folded into the running "
                                                  "aggregate for the weighted-sum algorithms (same result, bit for "
                                                  "bit); default none: the whole round at once", cli_type=str)

    def validate(self) -> None:
        from ..engine.models import model_names

        c = _Checks(self, "run")
        if not (isinstance(self.model, str) and ":" in self.model):
            c.choice("model", tuple(model_names()))
        c.choice("engine", ENGINES)
        if self.memory_budget is not None:
            from ..engine.chunked import parse_bytes

            try:
                parse_bytes(self.memory_budget)
            except ValueError as exc:
                raise ConfigError(f"memory-budget: {exc}") from None
        if self.client_state_dtype is not None:
            c.choice("client_state_dtype", CLIENT_STATE_DTYPES)
        if self.client_state_dir is not None and (not isinstance(self.client_state_dir, str)
                                                  or not self.client_state_dir):
            raise ConfigError(f"client-state-dir must be a directory path, got {self.client_state_dir!r}")
        c.integer("client_batch", 0)
        c.integer("rounds", 1)
        c.integer("seed", 0)
        c.integer("eval_every", 1)
        c.boolean("eval_avg_last_two")
        if self.recipe is not None and self.recipe not in RECIPES:
            raise ConfigError(f"unknown recipe {self.recipe!r}; choose one of {', '.join(RECIPES)}")
        hidden = self.hidden
        if (not isinstance(hidden, (list, tuple))
                or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 1 for h in hidden)):
            raise ConfigError(f"hidden must be a list of positive layer widths, got {hidden!r}")
        self.hidden = tuple(hidden)
        if not isinstance(self.device, str) or not self.device:
            raise ConfigError(f"device must be a device name such as 'cpu' or 'cuda', got {self.device!r}")
        try:
            import torch

            dev = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"device {self.device!r} is not a valid torch device ({exc})") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device!r} was requested but CUDA is not available here")


def _local_default() -> LocalConfig:
    # the simulator's prox_mu is FedProx's mu, applied only under algo fedprox (local_config)
    return LocalConfig(prox_mu=D.FEDPROX_MU)


#: part name -> (its class, a factory of its defaults), in the order of ``--help``'s groups
PARTS = {
    "data": (DataConfig, DataConfig),
    "local": (LocalConfig, _local_default),
    "server": (ServerConfig, ServerConfig),
    "privacy": (PrivacyConfig, PrivacyConfig),
    "robustness": (RobustnessConfig, RobustnessConfig),
    "compression": (CompressionConfig, CompressionConfig),
    "run": (RunConfig, RunConfig),
}

#: The one table of names: every flat name a setting has had (the constructor's keyword,
#: ``to_dict``'s key, the command-line flag with dashes) -> ``(part, field)``.  Its order is
#: the flat form's (checkpoints and results.json keep it).
FLAT_NAMES: Dict[str, Tuple[str, str]] = {
    "algo": ("server", "algo"), "nar": ("local", "nar"), "dataset": ("data", "dataset"), "model": ("run", "model"),
    "hidden": ("run", "hidden"), "clients": ("data", "clients"), "per_round": ("data", "per_round"),
    "rounds": ("run", "rounds"), "partition": ("data", "partition"), "alpha": ("data", "alpha"),
    "min_client_size": ("data", "min_client_size"), "weighting": ("server", "weighting"),
    "local_steps": ("local", "steps"), "batch_size": ("local", "batch_size"), "lr": ("local", "lr"),
    "lr_decay": ("local", "lr_decay"), "weight_decay": ("local", "weight_decay"), "wd_decay": ("local", "wd_decay"),
    "max_norm": ("local", "max_norm"), "momentum": ("local", "momentum"), "decay_beta": ("local", "decay_beta"),
    "decay_kind": ("local", "decay_kind"), "decay_per": ("local", "decay_per"), "prox_mu": ("local", "prox_mu"),
    "server_lr": ("server", "lr"), "server_momentum": ("server", "momentum"), "server_betas": ("server", "betas"),
    "server_tau": ("server", "tau"), "fedexp_eps": ("server", "fedexp_eps"),
    "fedlaw_learn": ("server", "fedlaw_learn"), "fedlaw_epochs": ("server", "fedlaw_epochs"),
    "fedlaw_lr": ("server", "fedlaw_lr"), "proxy_size": ("server", "proxy_size"),
    "proxy_source": ("server", "proxy_source"), "max_weight_share": ("server", "max_weight_share"),
    "on_bad_client": ("server", "on_bad_client"), "synthetic_alpha": ("data", "synthetic_alpha"),
    "synthetic_beta": ("data", "synthetic_beta"), "synthetic_iid": ("data", "synthetic_iid"),
    "max_samples_per_client": ("data", "max_samples_per_client"), "test_fraction": ("data", "test_fraction"),
    "data_root": ("data", "data_root"), "seed": ("run", "seed"), "eval_every": ("run", "eval_every"),
    "device": ("run", "device"), "backend": ("local", "backend"), "engine": ("run", "engine"),
    "client_batch": ("run", "client_batch"), "corrupt_fraction": ("data", "corrupt_fraction"),
    "corrupt_kind": ("data", "corrupt_kind"), "corrupt_noise_std": ("data", "corrupt_noise_std"),
    "dp_clip": ("privacy", "clip"), "dp_noise_multiplier": ("privacy", "noise_multiplier"),
    "dp_target_quantile": ("privacy", "target_quantile"), "dp_delta": ("privacy", "delta"),
    "dp_mode": ("privacy", "mode"), "attack": ("data", "attack"), "attack_fraction": ("data", "attack_fraction"),
    "aggregator": ("robustness", "aggregator"), "trim_beta": ("robustness", "trim_beta"),
    "byzantine_f": ("robustness", "byzantine_f"), "krum_m": ("robustness", "krum_m"),
    "geomed_iters": ("robustness", "geomed_iters"), "geomed_tol": ("robustness", "geomed_tol"),
    "cclip_tau": ("robustness", "cclip_tau"), "cclip_iters": ("robustness", "cclip_iters"),
    "norm_bound_radius": ("robustness", "norm_bound_radius"),
    "fedexp_scale_eps": ("server", "fedexp_scale_eps"), "fedexp_eps_decay": ("server", "fedexp_eps_decay"),
    "eval_avg_last_two": ("run", "eval_avg_last_two"), "carry_momentum": ("local", "carry_momentum"),
    "decay_scales_change": ("local", "decay_scales_change"), "recipe": ("run", "recipe"),
    "holdout_clients": ("data", "holdout_clients"), "client_state_dtype": ("run", "client_state_dtype"),
    "client_state_dir": ("run", "client_state_dir"), "memory_budget": ("run", "memory_budget"),
    "compress": ("compression", "codec"), "compress_block": ("compression", "block"),
    "compress_stochastic": ("compression", "stochastic"), "compress_rotate": ("compression", "rotate"),
    "error_feedback": ("compression", "error_feedback"),
}
#: (part, field) -> its flat name (the flag's spelling)
FLAG_OF: Dict[Tuple[str, str], str] = {where: flat for flat, where in FLAT_NAMES.items()}


def check_across_parts(cfg: "SimulationConfig") -> None:
    """The rules that tie two parts together, each message naming both settings."""
    try:  # the Flower strategies' dp_* arguments go through the same checks
        p = cfg.privacy
        check_dp_settings(clip=p.clip, noise_multiplier=p.noise_multiplier, target_quantile=p.target_quantile,
                          delta=p.delta, mode=p.mode, algo=cfg.server.algo, weighting=cfg.server.weighting,
                          resolved_weighting=cfg.resolved_weighting, clients=cfg.data.clients,
                          per_round=cfg.data.per_round)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    rule, f, C = cfg.robustness.aggregator, cfg.robustness.byzantine_f, cfg.data.per_round
    if rule != "mean":
        if rule in ("krum", "multi-krum") and C < 2 * f + 3:
            raise ConfigError(f"aggregator {rule} with byzantine-f {f} needs per-round >= 2 byzantine-f + 3 = "
                              f"{2 * f + 3} (Blanchard et al. 2017: n > 2f + 2), got per-round {C}")
        if rule == "bulyan" and C < 4 * f + 3:
            raise ConfigError(f"aggregator bulyan with byzantine-f {f} needs per-round >= 4 byzantine-f + 3 = "
                              f"{4 * f + 3} (El Mhamdi et al. 2018: n >= 4f + 3), got per-round {C}")
        if cfg.robustness.krum_m is not None and cfg.robustness.krum_m > C:
            raise ConfigError(f"krum-m {cfg.robustness.krum_m} selects more clients than per-round ({C})")
        if cfg.privacy.clip is not None:
            raise ConfigError(robust_with_dp_error(rule))
        if cfg.server.algo in ROBUST_REFUSED_ALGOS:
            raise ConfigError(f"aggregator {rule} cannot be used with algo {cfg.server.algo}: "
                              f"{ROBUST_REFUSED_ALGOS[cfg.server.algo]}")
    if cfg.compression.codec != "none":
        if cfg.server.algo == "fedlaw":
            raise ConfigError("compress cannot be used with algo fedlaw: it learns from every client's whole model, "
                              "not from an update")
        if cfg.privacy.clip is not None and cfg.privacy.mode == "client":
            raise ConfigError("compress with dp-mode client: the server would sum decoded updates whose norms are "
                              "not the clipped ones; use dp-mode server, which clips the decoded update")


@dataclass(init=False)
class SimulationConfig:
    """Settings of one simulated federated training run (defaults: a quick digits run), as
    nested parts: ``cfg.local.steps``; the flat names stay (``cfg.local_steps``,
    ``SimulationConfig(local_steps=3)``, :meth:`to_dict`), one table of them
    (:data:`FLAT_NAMES`).

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
    data: DataConfig
    local: LocalConfig
    server: ServerConfig
    privacy: PrivacyConfig
    robustness: RobustnessConfig
    compression: CompressionConfig
    run: RunConfig

    def __init__(self, data=None, local=None, server=None, privacy=None, robustness=None, compression=None,
                 run=None, **flat):
        """The parts (each copied, so that two configs never share one), or their
        defaults, then ``flat`` settings by their flat names (:data:`FLAT_NAMES`)."""
        given = dict(data=data, local=local, server=server, privacy=privacy, robustness=robustness,
                     compression=compression, run=run)
        for name, (cls, default) in PARTS.items():
            part = given[name]
            if part is not None and not isinstance(part, cls):
                raise TypeError(f"SimulationConfig: {name} must be a {cls.__name__}, got {type(part).__name__}")
            setattr(self, name, default() if part is None else dataclasses.replace(part))
        for name, value in flat.items():
            if name not in FLAT_NAMES:
                raise TypeError(f"SimulationConfig.__init__() got an unexpected keyword argument {name!r}")
            setattr(self, name, value)

    # ------------------------------------------------------------------ conversion
    def to_dict(self) -> Dict[str, Any]:
        """The flat form (the keys of :data:`FLAT_NAMES`, in its order; tuples as lists):
        what checkpoints, ``results.json`` and ``--config`` files hold."""
        d = {}
        for name in FLAT_NAMES:
            v = copy.deepcopy(getattr(self, name))
            d[name] = list(v) if isinstance(v, tuple) else v
        return d

    @classmethod
    def field_names(cls) -> List[str]:
        """The flat names of every setting."""
        return list(FLAT_NAMES)

    @classmethod
    def from_dict(cls, values: Dict[str, Any], *, source: str = "config") -> "SimulationConfig":
        """Build and validate from a plain dict of flat names (dashes or underscores) and/or
        parts given as dicts of their fields (``{"local": {"steps": 3}}``); unknown keys are
        an error."""
        known = set(FLAT_NAMES)
        flat, parts = {}, {}
        for key, value in values.items():
            key = key.replace("-", "_")
            if key in PARTS and isinstance(value, dict):
                parts[key] = value
            else:
                flat[key] = value
        unknown = sorted(set(flat) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown setting {unknown[0]!r} (known: {', '.join(sorted(known))})")
        cfg = cls(**flat)
        for name, fields in parts.items():
            part_cls = PARTS[name][0]
            names = {f.name for f in dataclasses.fields(part_cls)}
            for key, value in fields.items():
                key = key.replace("-", "_")
                if key not in names or (name, key) not in FLAG_OF:
                    raise ConfigError(f"{source}: unknown setting {name}.{key} (known: "
                                      f"{', '.join(sorted(f for p, f in FLAG_OF if p == name))})")
                setattr(getattr(cfg, name), key, value)
        cfg.validate()
        return cfg

    def replace(self, **changes) -> "SimulationConfig":
        cfg = dataclasses.replace(self, **changes)
        cfg.validate()
        return cfg

    # ------------------------------------------------------------------ validation
    def validate(self) -> "SimulationConfig":
        """Check every setting, part by part, then the rules across parts
        (:func:`check_across_parts`); raises :class:`ConfigError` naming the first bad one."""
        self.server.validate()
        _validate_local(self.local)
        self.data.validate()
        self.run.validate()
        self.robustness.validate()
        self.compression.validate()
        check_across_parts(self)
        return self

    def codec(self):
        """The :class:`~fedopt_kernels.compression.Codec` of :attr:`compress` (None for "none")."""
        return self.compression.build()

    @property
    def aggregator_params(self) -> Dict[str, Any]:
        """The parameters of :attr:`aggregator` set here, by the names
        :class:`~fedopt_kernels.server.RobustAggregator` takes."""
        return self.robustness.params

    @property
    def memory_budget_bytes(self) -> Optional[int]:
        """:attr:`memory_budget` in bytes (None: no budget)."""
        if self.run.memory_budget is None:
            return None
        from ..engine.chunked import parse_bytes

        return parse_bytes(self.run.memory_budget)

    @property
    def needs_proxy(self) -> bool:
        return self.server.algo == "fedlaw"

    @property
    def resolved_weighting(self) -> str:
        """``"size"`` or ``"uniform"``: :attr:`weighting`, with ``"auto"`` resolved for
        :attr:`algo` (:func:`fedopt_kernels.server.resolve_weighting`)."""
        return resolve_weighting(self.server.weighting, self.server.algo)

    def local_config(self) -> LocalConfig:
        """The clients' :class:`~fedopt_kernels.fl.engine.client.LocalConfig`: the local
        part, with FedProx's ``mu`` only under fedprox and SCAFFOLD's correction from
        :attr:`algo`."""
        algo = self.server.algo
        return dataclasses.replace(self.local, prox_mu=self.local.prox_mu if algo == "fedprox" else 0.0,
                                   scaffold=algo == "scaffold")

    @classmethod
    def from_recipe(cls, name: str, **overrides) -> "SimulationConfig":
        """A validated config: the simulator's defaults, then recipe ``name``
        (:mod:`fedopt_kernels.fl.run.recipes`), then ``overrides`` (flat names)."""
        from .recipes import get

        values = get(name).values()
        values.update(overrides)
        values["recipe"] = name
        return cls.from_dict(values, source=f"recipe {name}")


def _flat_property(flat: str, part: str, name: str) -> property:
    def get(self):
        return getattr(getattr(self, part), name)

    def set_(self, value):
        setattr(getattr(self, part), name, value)

    return property(get, set_, doc=f"``{part}.{name}`` (its flat name)")


for _flat, (_part, _name) in FLAT_NAMES.items():
    setattr(SimulationConfig, _flat, _flat_property(_flat, _part, _name))
del _flat, _part, _name

# LocalConfig field -> the flat setting that sets it (the local part's rows of FLAT_NAMES);
# scaffold follows from algo (local_config)
LOCAL_FIELDS = {name: flat for flat, (part, name) in FLAT_NAMES.items() if part == "local"}
