"""The per-round record of a simulation, its files and its plots.

One :class:`Results` holds the configuration, a description of the partition and the
client schedule, and one dict per evaluated round (round 0 is the untrained model):

=====================  ===========================================================
``round``              1-based round (0: the initial model, before training)
``test_accuracy``      accuracy of the global model on the test set
``test_loss``          its mean cross-entropy
``train_loss``         mean local training loss over the round's local steps
``clip_frequency``     fraction of the round's local steps with scale < 1 (clipped)
``mean_clipped_norm``  mean norm (``||g + wd x||`` in mode co, ``||g||`` in grad)
                       over the clipped steps -- [FedNAR] Fig. 5
``clipped_steps``      their number; ``skipped_steps``: non-finite steps skipped
``local_lr``           the round's local lr (first local step)
``server_lr``          effective server lr (lr x FedExP's eta_g / ASNES's gain)
``lr_scale``           FedExP's eta_g / ASNES's gain ratio (1 otherwise)
``gain_ratio``         ASNES only, with ``sigma2`` and ``nu2``
``gamma``              FedLAW's learned shrinking factor (``lambda``: its weights)
``update_norm``        norm of the aggregated update D
``excluded_clients``   clients left out of the round, all reasons; per reason
                       ``excluded_no_data`` (no samples), ``excluded_error`` (its
                       training raised), ``excluded_nonfinite`` (NaN/Inf update,
                       or a non-finite loss or local step in its training);
                       ``left_out``: ``[client, reason]`` pairs, in rounds with any
``server_skipped``     no client was left: the model and server state did not change
``dp_epsilon``         with ``dp_clip`` and noise: epsilon at ``dp_delta`` after the
                       rounds so far (:mod:`fedopt_kernels.fl.run.privacy`); also
                       ``dp_clip`` (the clip the round used), ``dp_noise_std`` (the
                       noise's std in the mean update) and, adaptive,
                       ``dp_unclipped_fraction`` (the privatised fraction unclipped)
``attacked_clients``   with ``attack``: the attackers among the round's clients
                       (:mod:`fedopt_kernels.fl.datasets.attacks`; all of them in
                       ``meta["attack"]``)
``clients``            the round's sampled client ids
``wall_time``          seconds since the start of the run
=====================  ===========================================================

Files are written atomically (a temporary file renamed over the old one), so a run
stopped at any point leaves a readable ``results.json``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import tempfile
import textwrap
from pathlib import Path
from typing import List, Optional, Sequence

__all__ = ["Results", "CSV_COLUMNS", "write_atomic", "plot_comparison", "comparison_rows"]

CSV_COLUMNS = ["round", "test_accuracy", "test_loss", "train_loss", "clip_frequency", "mean_clipped_norm",
               "clipped_steps", "skipped_steps", "local_lr", "weight_decay", "server_lr", "lr_scale", "gain_ratio",
               "sigma2", "nu2", "gamma", "proxy_loss", "update_norm", "excluded_clients", "excluded_no_data",
               "excluded_error", "excluded_nonfinite", "dp_epsilon", "dp_clip", "wall_time", "clients"]


def write_atomic(path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same folder + rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual mode
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _out_dir(path) -> Path:
    """``path`` as a folder that exists: created with its parents if missing; a clear
    error if it cannot be."""
    p = Path(path).expanduser()
    try:
        p.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise NotADirectoryError(f"cannot write results into {str(path)!r}: it exists and is not a folder") from None
    except OSError as exc:
        raise OSError(exc.errno, f"cannot create the results folder {str(path)!r}: {exc.strerror or exc}") from None
    return p


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _clean(value):
    """JSON-safe: NaN/Inf become None (strict JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


class Results:
    """Per-round records of one run, plus its config and metadata."""

    def __init__(self, config: Optional[dict] = None, meta: Optional[dict] = None, partition: Optional[dict] = None,
                 records: Optional[List[dict]] = None, label: Optional[str] = None):
        self.config = dict(config or {})
        self.meta = dict(meta or {})
        self.partition = dict(partition or {})
        self.records: List[dict] = list(records or [])
        self.label = label or self.config.get("algo", "run")

    # ------------------------------------------------------------------ access
    def append(self, record: dict) -> None:
        self.records.append(_clean(dict(record)))

    @property
    def rounds_completed(self) -> int:
        return max((r["round"] for r in self.records), default=0)

    def column(self, key: str, *, trained_only: bool = False) -> tuple:
        """``(rounds, values)`` of the records that have ``key`` (None skipped)."""
        xs, ys = [], []
        for r in self.records:
            if trained_only and r["round"] == 0:
                continue
            v = r.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None:
                xs.append(r["round"])
                ys.append(float(v))
        return xs, ys

    @property
    def initial(self) -> Optional[dict]:
        return next((r for r in self.records if r["round"] == 0), None)

    @property
    def final(self) -> Optional[dict]:
        evaluated = [r for r in self.records if r.get("test_accuracy") is not None]
        return evaluated[-1] if evaluated else None

    def best_accuracy(self) -> Optional[float]:
        _, acc = self.column("test_accuracy", trained_only=True)
        return max(acc) if acc else None

    def summary(self) -> dict:
        """Key numbers of the run (for tables), with what the run is beyond its
        algorithm (:meth:`settings`): epsilon at delta, the aggregator, the attack and
        its fraction, and, for a recipe that evaluates the mean of the last two global
        iterates (FedExP's), that accuracy too (``*_avg2``)."""
        fin, ini = self.final or {}, self.initial or {}
        _, clip = self.column("clip_frequency", trained_only=True)
        _, avg2 = self.column("test_accuracy_avg2", trained_only=True)
        c = self.config
        eps = self.column("dp_epsilon", trained_only=True)[1]
        return {
            "label": self.label,
            "rounds": self.rounds_completed,
            "initial_accuracy": ini.get("test_accuracy"),
            "final_accuracy": fin.get("test_accuracy"),
            "best_accuracy": self.best_accuracy(),
            "final_accuracy_avg2": fin.get("test_accuracy_avg2"),
            "best_accuracy_avg2": max(avg2) if avg2 else None,
            "final_test_loss": fin.get("test_loss"),
            "final_train_loss": fin.get("train_loss"),
            "mean_clip_frequency": sum(clip) / len(clip) if clip else None,
            "wall_time": fin.get("wall_time"),
            "dp_epsilon": eps[-1] if eps else None,
            "dp_delta": c.get("dp_delta") if c.get("dp_clip") is not None else None,
            "aggregator": c.get("aggregator"),
            "attack": c.get("attack") if c.get("attack") not in (None, "none") else None,
            "attack_fraction": c.get("attack_fraction") if c.get("attack") not in (None, "none") else None,
            "recipe": c.get("recipe"),
            "settings": self.settings(),
            "interrupted": bool(self.meta.get("interrupted", False)),
            "note": self.collapse_note(),
        }

    def settings(self) -> str:
        """What the run is beyond its algorithm, in a few words ("" for a plain run):
        differential privacy with epsilon at delta, a robust aggregator, an attack and
        its fraction, corrupted clients, and a recipe with its evaluation rule -- the
        console summary, ``compare``'s table and the plot titles show it."""
        c = self.config
        parts = []
        if c.get("recipe"):
            parts.append(f"recipe {c['recipe']}" + (" (acc avg2: mean of the last two iterates)"
                                                    if c.get("eval_avg_last_two") else ""))
        if c.get("dp_clip") is not None:
            eps = self.column("dp_epsilon", trained_only=True)[1]
            if c.get("dp_noise_multiplier"):
                privacy = (f"eps {eps[-1]:.3g} at delta {c.get('dp_delta'):g}" if eps and c.get("dp_delta")
                           else "no delta: eps not computed")
                parts.append(f"DP {c.get('dp_mode', 'server')} clip {c['dp_clip']:g} z {c['dp_noise_multiplier']:g}, "
                             f"{privacy}")
            else:
                parts.append(f"DP clip {c['dp_clip']:g}, no noise (not private)")
        if c.get("aggregator") not in (None, "mean"):
            parts.append(f"aggregator {c['aggregator']}")
        if c.get("attack") not in (None, "none") and c.get("attack_fraction"):
            parts.append(f"attack {c['attack']} by {100 * c['attack_fraction']:g}% of clients")
        if c.get("corrupt_fraction"):
            parts.append(f"{100 * c['corrupt_fraction']:g}% of clients corrupted ({c.get('corrupt_kind')})")
        return "; ".join(parts)

    def collapse_note(self) -> Optional[str]:
        """A sentence when the run's global model stayed at chance while a learned
        shrinking factor ``gamma < 1`` (FedLAW) shrank it in every round; else None.

        At chance: every evaluated trained round's test accuracy within 10% of the way
        from chance (``1/num_classes``) to 100%; at least 3 such rounds."""
        k = (self.meta or {}).get("num_classes")
        _, acc = self.column("test_accuracy", trained_only=True)
        _, gamma = self.column("gamma", trained_only=True)
        if not k or len(acc) < 3 or not gamma:
            return None
        chance = 1.0 / k
        if max(acc) > chance + 0.1 * (1 - chance) or not all(g < 1 for g in gamma):
            return None
        return (f"the global model stayed at chance (best test accuracy {100 * max(acc):.1f}%, chance "
                f"{100 * chance:.1f}%) while gamma < 1 shrank it every round (mean gamma "
                f"{sum(gamma) / len(gamma):.3f}, "
                f"last {gamma[-1]:.3f}): FedLAW's global weight shrinking can collapse a model trained by plain local "
                "SGD; its released code trains clients with SGD momentum 0.9, weight decay 5e-4 and lr 0.08 decayed "
                "0.99 per round (try --momentum 0.9 --weight-decay 5e-4 --lr 0.08 --lr-decay 0.99), or learn lambda "
                "only (--fedlaw-learn lambda)")

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        return _clean({"label": self.label, "config": self.config, "meta": self.meta, "partition": self.partition,
                       "summary": self.summary(), "records": self.records})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, allow_nan=False)

    def write_json(self, path) -> Path:
        write_atomic(path, self.to_json())
        return Path(path)

    def to_csv(self) -> str:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(CSV_COLUMNS)
        for r in self.records:
            row = []
            for k in CSV_COLUMNS:
                v = r.get(k)
                if k == "clients" and v is not None:
                    v = ";".join(str(c) for c in v)
                row.append("" if v is None else (f"{v:.6g}" if isinstance(v, float) else v))
            w.writerow(row)
        return buf.getvalue()

    def write_csv(self, path) -> Path:
        write_atomic(path, self.to_csv())
        return Path(path)

    def write(self, out_dir, *, stem: str = "results") -> List[Path]:
        """``<stem>.json`` and ``<stem>.csv`` in ``out_dir`` (created, with its parents,
        if missing)."""
        out_dir = _out_dir(out_dir)
        return [self.write_json(out_dir / f"{stem}.json"), self.write_csv(out_dir / f"{stem}.csv")]

    @classmethod
    def from_dict(cls, d: dict) -> "Results":
        return cls(d.get("config"), d.get("meta"), d.get("partition"), d.get("records"), d.get("label"))

    @classmethod
    def read_json(cls, path) -> "Results":
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    # ------------------------------------------------------------------ plots
    def plot(self, out_dir, *, prefix: str = "") -> List[Path]:
        """Three PNGs: accuracy & loss, clipping (frequency & strength), server
        statistics (server lr / gain / gamma) per round.  Returns their paths."""
        plt = _pyplot()
        out_dir = _out_dir(out_dir)
        paths = []
        title = self._title()

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        x, y = self.column("test_accuracy")
        ax1.plot(x, [100 * v for v in y], marker="." if len(x) < 60 else None)
        ax1.set_xlabel("round"), ax1.set_ylabel("test accuracy (%)"), ax1.grid(alpha=0.3)
        for key, style in (("test_loss", "-"), ("train_loss", "--")):
            x, y = self.column(key)
            if x:
                ax2.plot(x, y, style, label=key.replace("_", " "))
        ax2.set_xlabel("round"), ax2.set_ylabel("loss"), ax2.grid(alpha=0.3), ax2.legend()
        fig.suptitle(textwrap.fill(title, 110))
        paths.append(_save(fig, out_dir / f"{prefix}accuracy_loss.png"))

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        x, y = self.column("clip_frequency", trained_only=True)
        ax1.plot(x, y)
        ax1.set_xlabel("round"), ax1.set_ylabel("fraction of local steps clipped"), ax1.grid(alpha=0.3)
        ax1.set_ylim(-0.02, 1.02)
        # a round without a clipped step has no mean: a gap in the line, not a segment across it
        gx, gy = self.clipped_norm_series()
        x = [r for r, v in zip(gx, gy) if not math.isnan(v)]
        ax2.plot(gx, gy, marker="." if len(gx) < 60 else None)
        ax2.set_xlabel("round"), ax2.set_ylabel("mean norm of clipped steps"), ax2.grid(alpha=0.3)
        if x and len(x) < len(gx):
            ax2.set_title(f"rounds without a clipped step are left blank ({len(gx) - len(x)} of {len(gx)})",
                          fontsize=8)
        if not x:
            ax2.set_xlim(ax1.get_xlim())
            ax2.set_yticks([])
            ax2.text(0.5, 0.5, "no step was clipped", ha="center", va="center", transform=ax2.transAxes)
        fig.suptitle(textwrap.fill(f"{title}: clipping frequency and strength (fednar Fig. 5)", 110))
        paths.append(_save(fig, out_dir / f"{prefix}clipping.png"))

        keys = [k for k in ("server_lr", "gain_ratio", "gamma", "update_norm") if self.column(k, trained_only=True)[0]]
        _, scale = self.column("lr_scale", trained_only=True)
        if "gain_ratio" not in keys and any(v != 1.0 for v in scale):  # FedExP's eta_g
            keys.insert(1, "lr_scale")
        # a statistic that never changes (FedAdam's server lr) is a number, not a panel: it goes in the title
        constant = {}
        for key in list(keys):
            _, y = self.column(key, trained_only=True)
            if len(set(y)) == 1:
                constant[key] = y[0]
                keys.remove(key)
        # at least the other plots' width: one panel (FedLAW's gamma) at 4.2 in cut its title
        fig, axes = plt.subplots(1, max(len(keys), 1), figsize=(max(4.2 * len(keys), 11), 3.6), squeeze=False)
        for ax, key in zip(axes[0], keys):
            x, y = self.column(key, trained_only=True)
            ax.plot(x, y)
            ax.set_xlabel("round"), ax.set_ylabel(key.replace("_", " ")), ax.grid(alpha=0.3)
        fixed = ", ".join(f"{k.replace('_', ' ')} {v:.4g}" for k, v in constant.items())
        if not keys:
            axes[0][0].set_axis_off()
            axes[0][0].text(0.5, 0.5, f"no server statistic changed over the rounds ({fixed})" if fixed
                            else "no server statistics", ha="center", va="center")
        fig.suptitle(textwrap.fill(f"{title}: server statistics" + (f" (constant: {fixed})" if fixed else ""), 110))
        paths.append(_save(fig, out_dir / f"{prefix}server.png"))
        return paths

    def clipped_norm_series(self) -> tuple:
        """``(rounds, mean norm of the clipped steps)`` over every trained round, NaN in
        a round where no step was clipped (a plot leaves it blank)."""
        x, y = self.column("mean_clipped_norm", trained_only=True)
        known = dict(zip(x, y))
        trained = [r["round"] for r in self.records if r["round"] > 0 and "clipped_steps" in r]
        rounds = sorted(set(trained) | set(x))
        return rounds, [known.get(r, math.nan) for r in rounds]

    def _title(self) -> str:
        c = self.config
        if not c:
            return self.label
        settings = self.settings()
        return (f"{self.label} (nar={c.get('nar')}) on {c.get('dataset')}, {c.get('clients')} clients, "
                f"{c.get('per_round')}/round, alpha={c.get('alpha')}" + (f"; {settings}" if settings else ""))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path, *, rect=None) -> Path:
    """``rect``: the part of the figure the axes may take (tight_layout's), the rest kept
    free, e.g. for a legend below them."""
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def comparison_rows(results: Sequence[Results]) -> List[dict]:
    return [r.summary() for r in results]


def plot_comparison(results: Sequence[Results], path) -> Path:
    """One figure: test accuracy, test loss and clip frequency per round of every run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    # what the runs are beyond their algorithms: in the title when they share it, else in each label
    settings = [res.settings() for res in results]
    common = settings[0] if settings and settings[0] and len(set(settings)) == 1 else ""
    for res, extra in zip(results, settings):
        label = textwrap.fill(res.label + (f" ({extra})" if extra and not common else ""), 60)
        x, y = res.column("test_accuracy")
        axes[0].plot(x, [100 * v for v in y], label=label)
        x, y = res.column("test_loss")
        axes[1].plot(x, y, label=label)
        x, y = res.column("clip_frequency", trained_only=True)
        axes[2].plot(x, y, label=label)
    for ax, name in zip(axes, ("test accuracy (%)", "test loss", "fraction of local steps clipped")):
        ax.set_xlabel("round"), ax.set_ylabel(name), ax.grid(alpha=0.3)
    # one legend below the panels, never over the curves (inside the accuracy panel it hid the early rounds)
    handles, labels = axes[0].get_legend_handles_labels()
    widest = max((len(line) for text in labels for line in text.split("\n")), default=0)
    ncol = max(1, min(len(labels), 4, int(fig.get_figwidth() // (0.08 * widest + 0.8))))  # ~0.08 in a character
    rows = sum(max(t.count("\n") + 1 for t in labels[i:i + ncol]) for i in range(0, len(labels), ncol))
    band = min(0.6, (0.3 + 0.2 * rows) / fig.get_figheight())  # inches of legend as a fraction of the figure
    if labels:
        fig.legend(handles, labels, loc="lower center", ncol=ncol, frameon=False, bbox_to_anchor=(0.5, 0.0))
    first = results[0].config if results else {}
    fig.suptitle(textwrap.fill(
        f"same partition and client sequence: {first.get('dataset')}, {first.get('clients')} clients, "
        f"{first.get('per_round')}/round, alpha={first.get('alpha')}, seed={first.get('seed')}"
        + (f"; {common}" if common else ""), 150))
    return _save(fig, Path(path), rect=(0, band if labels else 0, 1, 1))
