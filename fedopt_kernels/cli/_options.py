"""Simulation options of ``fedopt simulate`` / ``fedopt compare`` and the TOML form.

Precedence: the defaults of :class:`~fedopt_kernels.fl.SimulationConfig` <- a
checkpoint's settings (``--resume``) <- the TOML file (``--config``) <- flags given on
the command line.  A TOML file holds the same settings as the flags (underscores or
dashes), at the top level, plus the command-line-only keys ``out``, ``threads`` and,
for ``compare``, ``algos``::

    algo = "fedadam"
    nar = "co"
    dataset = "digits"
    clients = 20
    per-round = 10
    rounds = 60
    alpha = 0.3
    lr = 0.05
    weight-decay = 1e-3
    out = "results/fedadam"
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

from ..fl.run.config import (ALGORITHMS, CORRUPT_KINDS, ENGINES, PARTITIONS, PROXY_SOURCES, WEIGHTINGS, ConfigError,
                         SimulationConfig)
from ..fl.run.config import AGGREGATORS, ATTACK_CHOICES, DP_MODES
from ..fl.run.recipes import RECIPES
from ._errors import CLIError

RECIPE_NAMES = tuple(RECIPES)

CLI_ONLY_KEYS = ("out", "threads", "algos", "plots", "checkpoint_every")


def _int_list(text: str) -> Tuple[int, ...]:
    text = text.strip()
    if text in ("", "none", "-"):
        return ()
    return tuple(int(t) for t in text.split(","))


def _float_pair(text: str) -> Tuple[float, float]:
    parts = [float(t) for t in text.split(",")]
    if len(parts) != 2:
        raise ValueError("expected two comma-separated numbers")
    return parts[0], parts[1]


def _bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _optional_float(text: str):
    return None if text.strip().lower() in ("none", "default") else float(text)


_int_list.__name__ = "comma-separated int list"
_float_pair.__name__ = "pair of numbers"
_bool.__name__ = "boolean"
_optional_float.__name__ = "float"


def _optional_int(text: str):
    return None if text.strip().lower() in ("none", "default") else int(text)


_optional_int.__name__ = "int"

# (flag, type, help); the dest is the flag with dashes -> underscores
SIM_OPTIONS: List[tuple] = [
    ("--recipe", str, f"start from a paper's training recipe: {', '.join(RECIPE_NAMES)} "
                      "(fedopt_kernels.fl.run.recipes; each value's source is in results.json meta.recipe); flags and "
                      "--config settings override it"),
    ("--algo", str, f"algorithm: {', '.join(ALGORITHMS)} (default {{default}})"),
    ("--nar", str, "local step: co (FedNAR co-clipping), grad (gradient clipping), none (plain SGD) "
                   "(default {default})"),
    ("--dataset", str, "digits, synthetic, synthetic-lazy (each client generated when sampled), cifar10 (needs "
                       "torchvision and the data on disk), leaf-femnist:PATH or leaf-shakespeare:PATH (LEAF's files "
                       "in PATH), a name registered with fedopt_kernels.fl.register_dataset, or "
                       "package.module:function (your own dataset: docs/datasets.md) (default {default})"),
    ("--model", str, "mlp, cnn (FedLAW's SimpleCNN), logreg, a registered name, or package.module:function "
                     "called with (input_shape, num_classes) (default {default})"),
    ("--hidden", _int_list, "hidden widths of the MLP, comma-separated (default {default})"),
    ("--clients", int, "number of clients (default {default})"),
    ("--per-round", int, "clients sampled per round (default {default})"),
    ("--rounds", int, "communication rounds (default {default})"),
    ("--partition", str, f"{', '.join(PARTITIONS)} (default auto: the dataset's own split, else dirichlet)"),
    ("--alpha", float, "Dirichlet concentration of the label partition, > 0 (default {default})"),
    ("--min-client-size", int, "fewest samples a client may hold (default min(10, n/(10*clients)), at least 1)"),
    ("--weighting", str, f"server weights of the clients: {', '.join(WEIGHTINGS)} (default auto: each algorithm's "
                         "own -- uniform for scaffold, fedexp, asnes; data size for the others; also the weights "
                         "of BatchNorm statistics)"),
    ("--local-steps", int, "local steps per round, tau (default {default})"),
    ("--batch-size", int, "local mini-batch size (default {default})"),
    ("--lr", float, "local learning rate (default {default})"),
    ("--lr-decay", float, "per-round decay of the local lr, as FedNAR's 0.998 (default {default})"),
    ("--weight-decay", float, "local weight decay, PyTorch-SGD sense (default {default})"),
    ("--wd-decay", float, "extra per-round factor on the weight decay (default {default})"),
    ("--max-norm", float, "clip threshold of FedNAR / gradient clipping (default {default})"),
    ("--momentum", float, "local heavy-ball momentum (default {default})"),
    ("--decay-beta", float, "FedDecay within-round decay beta in [0, 1]; 1 = off (default {default})"),
    ("--decay-kind", str, "FedDecay: exponential or linear (default {default})"),
    ("--decay-per", str, "FedDecay counts local steps or epochs: step or epoch (default {default})"),
    ("--prox-mu", float, "FedProx's mu (default {default})"),
    ("--server-lr", _optional_float, "server learning rate (default: the algorithm's own)"),
    ("--server-momentum", _optional_float, "FedAvgM / ASNES momentum (default 0.9), FedAdagrad's beta1 (default 0)"),
    ("--server-betas", _float_pair, "FedAdam / FedYogi betas, e.g. 0.9,0.99 (default {default})"),
    ("--server-tau", float, "FedAdam / FedYogi / FedAdagrad tau (default {default})"),
    ("--fedexp-eps", float, "FedExP's eps (default {default})"),
    ("--fedexp-scale-eps", _bool, "FedExP: use M * eps, M the round's clients, as the authors' code (default false)"),
    ("--fedexp-eps-decay", float, "FedExP: eps times this every round; the authors' code uses 0.998^2 "
                                  "(default {default}: no decay)"),
    ("--eval-avg-last-two", _bool, "also evaluate the mean of the last two global models, recorded as "
                                   "test_accuracy_avg2 (FedExP's authors report it) (default false)"),
    ("--carry-momentum", _bool, "each client keeps its local momentum buffers across its rounds, as FedLAW's code "
                                "(sequential engine) (default false)"),
    ("--decay-scales-change", _bool, "FedDecay with --decay-per epoch as its authors' code: each epoch at the full "
                                     "lr, its parameter change then scaled by beta^j (sequential engine) "
                                     "(default false: epoch j runs at lr * beta^j)"),
    ("--holdout-clients", int, "clients never sampled for training; each evaluation also scores the global model "
                               "on their data (holdout_accuracy), as [FedDecay] holds out 20%% of the users "
                               "(default {default})"),
    ("--fedlaw-learn", str, "FedLAW learns both, gamma or lambda (default {default})"),
    ("--fedlaw-epochs", int, "FedLAW server epochs per round (default {default})"),
    ("--fedlaw-lr", float, "FedLAW's Adam lr (default {default})"),
    ("--max-weight-share", _optional_float, "largest share of a round's total weight one client may get under "
                                            "size weighting, in (0, 1] (default none: no cap)"),
    ("--on-bad-client", str, "a client without samples or whose training raises: exclude (left out, counted as "
                             "excluded_<reason>; the round goes on) or raise (the run stops) (default {default})"),
    ("--proxy-size", int, "FedLAW's class-balanced proxy set size (default {default})"),
    ("--proxy-source", str, f"where FedLAW's proxy set comes from: {', '.join(PROXY_SOURCES)} (default test: held "
                            "out of the test set, accuracy measured on the rest, as [FedLAW] D.2)"),
    ("--synthetic-alpha", float, "Synthetic(alpha, beta): alpha (default {default})"),
    ("--synthetic-beta", float, "Synthetic(alpha, beta): beta (default {default})"),
    ("--synthetic-iid", _bool, "Synthetic: IID variant (default false)"),
    ("--max-samples-per-client", int, "Synthetic: cap on a client's samples (default none)"),
    ("--test-fraction", float, "held-out test fraction (default {default})"),
    ("--data-root", str, "where cifar10 looks for its files (default $FEDOPT_DATA or ~/.cache/fedopt/data)"),
    ("--corrupt-fraction", float, "fraction of the clients (rounded, chosen by --seed) whose training data are "
                                  "corrupted; recorded in results.json meta.corruption (default {default})"),
    ("--corrupt-kind", str, f"{', '.join(CORRUPT_KINDS)}: labels = a fixed random derangement of the classes per "
                            "client (every label wrong), swap = FedLAW's two classes exchanged, noise = additive "
                            "Gaussian noise on the inputs (default {default})"),
    ("--corrupt-noise-std", float, "std of the input noise of --corrupt-kind noise (default {default})"),
    # differential privacy (server/differential_privacy/dp.py) and attacks for testing (fl/datasets/attacks.py)
    ("--dp-clip", _optional_float, "DP-FedAvg: clip every client update to this norm, the initial clip with "
                                   "--dp-target-quantile (default none: no differential privacy)"),
    ("--dp-noise-multiplier", float, "DP-FedAvg: Gaussian noise of std z * clip on the sum of clipped updates; "
                                     "0 clips without noise, which is not private (default {default})"),
    ("--dp-target-quantile", _optional_float, "adaptive clipping (Andrew et al. 2021): the clip tracks this "
                                              "quantile of the update norms, e.g. 0.5 (default none: fixed clip)"),
    ("--dp-delta", _optional_float, "delta at which epsilon is written into results.json every round; needed "
                                    "with noise, below 1/clients (default none)"),
    ("--dp-mode", str, f"who clips: {', '.join(DP_MODES)} (client: the clients clip, the server adds the noise) "
                       "(default {default})"),
    ("--attack", str, f"attack for testing by --attack-fraction of the clients: {', '.join(ATTACK_CHOICES)}; "
                      "alie = Baruch et al. 2019; recorded in results.json (default {default})"),
    ("--attack-fraction", float, "fraction of the clients (rounded, chosen by --seed) that attack "
                                 "(default {default})"),
    # Byzantine-robust aggregation (server/robust_aggregation/robust_aggregator.py; docs/robustness.md)
    ("--aggregator", str, f"how the server aggregates the round's updates: {', '.join(AGGREGATORS)}; mean is the "
                          "weighted mean, the others are robust rules (default {default})"),
    ("--trim-beta", _optional_float, "trimmed-mean: fraction of the values dropped at each end of every "
                                     "coordinate, in [0, 0.5) (default 0.1)"),
    ("--byzantine-f", _optional_int, "krum, multi-krum, bulyan: the number f of Byzantine clients tolerated per "
                                     "round; needs per-round >= 2f + 3 (bulyan: 4f + 3)"),
    ("--krum-m", _optional_int, "multi-krum: how many clients with the lowest Krum scores are averaged "
                                "(default per-round - f)"),
    ("--geomed-iters", _optional_int, "geomed: most smoothed Weiszfeld iterations (default 4, as RFA)"),
    ("--geomed-tol", _optional_float, "geomed: stop once the objective changes by at most tol times itself "
                                      "(default 1e-5)"),
    ("--cclip-tau", _optional_float, "centered-clip: the clipping radius tau around the previous aggregate"),
    ("--cclip-iters", _optional_int, "centered-clip: clipping iterations per round (default 1)"),
    ("--norm-bound-radius", _optional_float, "norm-bound: every update is scaled to at most this norm"),
    ("--seed", int, "seed of everything random (default {default})"),
    ("--eval-every", int, "evaluate every k rounds (default {default})"),
    ("--device", str, "cpu or cuda (default {default})"),
    ("--backend", str, "kernel backend: reference, cpu, triton, cuda (default automatic)"),
    ("--engine", str, f"client engine: {', '.join(ENGINES)}; batched trains a round's clients as one vmapped "
                      "computation, sequential one after another (default auto: batched unless --per-round 1)"),
    ("--client-batch", int, "most clients the batched engine trains at once, to bound memory; the result does not "
                            "depend on it (default 0: chosen from the free memory)"),
    ("--client-state-dtype", str, "storage dtype of per-client state (SCAFFOLD's c_i): float32, float64, bfloat16, "
                                  "float16 (default: the model's, bit for bit; a compact one rounds the stored "
                                  "values)"),
    ("--memory-budget", str, "bound a round's memory: its clients train in chunks that fit this size (4G, 512M, "
                             "bytes), each chunk folded into the running aggregate for the weighted-sum algorithms "
                             "(same result, bit for bit); default none: the whole round at once"),
    ("--client-state-dir", str, "keep per-client state in memory-mapped files in this directory instead of in "
                                "memory (default: in memory)"),
    # compressed client updates (fl/engine/compressed_updates.py; docs/compression.md)
    ("--compress", str, "codec of the clients' updates: none, int8, int4, fp8 (per-block scales) or topk:FRACTION "
                        "(the largest FRACTION of the values); the server decodes them inside its aggregation "
                        "(default {default})"),
    ("--compress-block", int, "values per scale of int8 / int4 / fp8, a multiple of 32 (default {default})"),
    ("--compress-stochastic", _bool, "int8 / int4: unbiased stochastic rounding instead of round-to-nearest "
                                     "(default false)"),
    ("--compress-rotate", _bool, "rotate every update by the round's randomized Hadamard transform (blocks of 1024) "
                                 "before encoding; the server rotates the aggregate back (default false)"),
    ("--error-feedback", _bool, "each client adds its residual (what its previous replies lost) to its update "
                                "before encoding, kept in the per-client state and checkpoints (default false)"),
]


def fill_default(flag: str, help_: str) -> str:
    """``help_`` with ``{default}`` replaced by :class:`SimulationConfig`'s default of
    ``flag`` (itself :mod:`fedopt_kernels.defaults`'s), so the help cannot drift from it."""
    if "{default}" not in help_:
        return help_
    value = _FIELD_DEFAULTS[flag[2:].replace("-", "_")]
    if isinstance(value, (tuple, list)):
        text = ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
    elif isinstance(value, float):
        text = f"{value:g}"
    else:
        text = str(value).lower() if isinstance(value, bool) else str(value)
    return help_.replace("{default}", text)


_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SimulationConfig)}


def add_simulation_options(parser: argparse.ArgumentParser, *, compare: bool = False) -> None:
    group = parser.add_argument_group("simulation settings (flags override --config)")
    for flag, typ, help_ in SIM_OPTIONS:
        if compare and flag == "--algo":
            continue
        group.add_argument(flag, type=typ, default=argparse.SUPPRESS, help=fill_default(flag, help_))
    run = parser.add_argument_group("running")
    run.add_argument("--config", default=None, metavar="FILE.toml", help="read settings from a TOML file")
    run.add_argument("--out", default=argparse.SUPPRESS, metavar="DIR", help="output directory (default results)")
    run.add_argument("--threads", type=int, default=argparse.SUPPRESS,
                     help="torch CPU threads (default: 1 for the sequential engine on models under 5M parameters, "
                          "where more threads only add overhead, else torch's default; on a machine other jobs keep "
                          "busy, 1 can be several times faster: a note says so when the load is high)")
    run.add_argument("--no-plots", dest="plots", action="store_false", default=argparse.SUPPRESS,
                     help="do not draw the PNG plots")
    run.add_argument("--quiet", action="store_true", help="no progress bar")


def load_toml(path: str) -> Dict[str, Any]:
    try:
        import tomllib  # Python >= 3.11
    except ImportError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise CLIError("reading a TOML config file needs Python >= 3.11 or the 'tomli' package") from None
    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise CLIError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise CLIError(f"config file {path} is a directory") from None
    except OSError as exc:
        raise CLIError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise CLIError(f"config file {path} is not valid TOML: {exc}") from None
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            raise CLIError(f"config file {path}: tables such as [{key}] are not supported; "
                           "put the settings at the top level")
        out[key.replace("-", "_")] = value
    return out


# environment caps for running the docs' commands as written but short (tests/test_docs_commands.py,
# docs/development.md); a real run leaves them unset
CAPS = {"FEDOPT_MAX_ROUNDS": "rounds", "FEDOPT_MAX_LOCAL_STEPS": "local_steps"}


def _apply_caps(config: SimulationConfig) -> SimulationConfig:
    """``$FEDOPT_MAX_ROUNDS`` / ``$FEDOPT_MAX_LOCAL_STEPS``, when set: at most that many
    rounds / local steps, each cap said in a note on stderr."""
    for env, field in CAPS.items():
        text = os.environ.get(env)
        if not text:
            continue
        try:
            cap = int(text)
            if cap < 1:
                raise ValueError
        except ValueError:
            raise CLIError(f"{env} must be a positive integer, got {text!r}") from None
        value = getattr(config, field)
        if value > cap:
            print(f"fedopt: note: {env}={cap} caps {field.replace('_', '-')} {value} to {cap}", file=sys.stderr)
            config = config.replace(**{field: cap})
    return config


def build_settings(args: argparse.Namespace, *, base: Dict[str, Any] = None) -> Tuple[SimulationConfig, dict]:
    """``(config, cli_only)`` from defaults <- recipe <- base <- TOML <- explicit flags.

    The recipe (``--recipe`` or a TOML ``recipe`` key) sits under everything else: only
    the flags actually given on the command line (argparse leaves the others out of
    ``args``) and the TOML's keys override it.  A checkpoint's settings (``base``, on
    ``--resume``) already hold the values the run resolved, recipe and overrides
    included, so they stay above the recipe."""
    values: Dict[str, Any] = {}
    cli_only: Dict[str, Any] = {"out": "results", "threads": None, "plots": True, "algos": None}
    source = "command line"
    toml: Dict[str, Any] = {}
    if getattr(args, "config", None):
        source = f"config file {args.config}"
        for key, value in load_toml(args.config).items():
            if key in CLI_ONLY_KEYS:
                cli_only[key] = value
            else:
                toml[key] = value
    explicit = {k: v for k, v in vars(args).items() if k not in ("config", "command", "quiet", "func", "resume")}
    recipe = explicit.get("recipe", toml.get("recipe"))
    if recipe is not None:
        from ..fl.run.recipes import get as get_recipe

        try:
            values.update(get_recipe(recipe).values())
        except ValueError as exc:
            raise CLIError(str(exc)) from None
    values.update(base or {})
    values.update(toml)
    for key, value in explicit.items():
        if key in CLI_ONLY_KEYS:
            cli_only[key] = value
        else:
            values[key] = value
    for key in ("hidden", "server_betas"):
        if isinstance(values.get(key), list):
            values[key] = tuple(values[key])
    try:
        config = SimulationConfig.from_dict(values, source=source)
    except ConfigError as exc:
        raise CLIError(str(exc)) from None
    except TypeError as exc:  # a TOML value of the wrong kind reaching the dataclass
        raise CLIError(f"{source}: {exc}") from None
    config = _apply_caps(config)
    threads = cli_only["threads"]
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise CLIError(f"threads must be a positive integer, got {threads!r}")
    if not isinstance(cli_only["out"], str) or not cli_only["out"]:
        raise CLIError(f"out must be a directory path, got {cli_only['out']!r}")
    return config, cli_only
