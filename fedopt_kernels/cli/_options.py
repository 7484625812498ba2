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
import typing
from pathlib import Path
from typing import Any, Dict, List, Tuple

from ..fl.run.config import FLAG_OF, PARTS, ConfigError, SimulationConfig
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

def _parser_of(hint, metadata) -> Any:
    """The argparse ``type`` of a setting: its metadata's ``cli_type``, else the one its
    annotation implies (an optional number also reads ``none`` / ``default``)."""
    if "cli_type" in metadata:
        return metadata["cli_type"]
    if hint in (bool, int, float, str):
        return {bool: _bool, int: int, float: float, str: str}[hint]
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union:  # Optional[X]
        inner = next(a for a in args if a is not type(None))
        return {float: _optional_float, int: _optional_int}.get(inner, str)
    if typing.get_origin(hint) is tuple:
        return _float_pair if args == (float, float) else _int_list
    raise TypeError(f"no command-line parser for a setting of type {hint!r}")


def _generate_options() -> Dict[str, List[tuple]]:
    """part -> ``[(flag, type, help, default)]``: every setting of every part of
    :class:`SimulationConfig` (:data:`~fedopt_kernels.fl.run.config.PARTS`), its flag the
    setting's flat name (:data:`~fedopt_kernels.fl.run.config.FLAG_OF`), its help text its
    field's metadata."""
    out = {}
    for part, (cls, make_default) in PARTS.items():
        hints = typing.get_type_hints(cls)
        defaults = make_default()
        rows = []
        for f in dataclasses.fields(cls):
            if (part, f.name) not in FLAG_OF:  # not a setting (LocalConfig.scaffold follows from algo)
                continue
            flag = "--" + FLAG_OF[(part, f.name)].replace("_", "-")
            rows.append((flag, _parser_of(hints[f.name], f.metadata), f.metadata["help"],
                         getattr(defaults, f.name)))
        out[part] = rows
    return out


#: part -> its options, generated from the config (one row per setting, grouped as ``--help`` shows them)
OPTIONS_BY_PART = _generate_options()
# (flag, type, help) of every setting; the dest is the flag with dashes -> underscores
SIM_OPTIONS: List[tuple] = [(flag, typ, help_) for rows in OPTIONS_BY_PART.values() for flag, typ, help_, _ in rows]
_FIELD_DEFAULTS = {flag[2:].replace("-", "_"): default for rows in OPTIONS_BY_PART.values()
                   for flag, _, _, default in rows}


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


#: the title of each part's group in ``--help``
GROUP_TITLES = {
    "data": "simulation settings: data (flags override --config)",
    "local": "simulation settings: local training",
    "server": "simulation settings: server",
    "privacy": "simulation settings: differential privacy",
    "robustness": "simulation settings: robust aggregation",
    "compression": "simulation settings: compressed updates",
    "run": "simulation settings: run",
}


def add_simulation_options(parser: argparse.ArgumentParser, *, compare: bool = False) -> None:
    """Every setting of :class:`SimulationConfig` as a flag, one argument group per part."""
    for part, rows in OPTIONS_BY_PART.items():
        group = parser.add_argument_group(GROUP_TITLES[part])
        for flag, typ, help_, _ in rows:
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


# the kind of value each parser reads, as docs/config.md's tables name it
_KINDS = {int: "integer", _optional_int: "integer or omitted", float: "number", _optional_float: "number or omitted",
          str: "string", _bool: "true / false", _int_list: "list of integers", _float_pair: "list of two numbers"}


def settings_tables() -> str:
    """docs/config.md's "Every setting": one markdown table per part of
    :class:`SimulationConfig` under its ``--help`` group's name, a row per setting (key,
    kind, the help text), generated from the same metadata as the flags
    (``tests/test_config_parts.py`` checks the page against it)."""
    out = []
    for part, rows in OPTIONS_BY_PART.items():
        title = GROUP_TITLES[part].split(": ", 1)[1].replace(" (flags override --config)", "")
        out += [f"### {title[0].upper()}{title[1:]} (`{part}`)", "", "| key | kind | meaning |", "|---|---|---|"]
        out += [f"| `{flag[2:]}` | {_KINDS[typ]} | {fill_default(flag, help_).replace('%%', '%')} |"
                for flag, typ, help_, _ in rows]
        out.append("")
    return "\n".join(out)
