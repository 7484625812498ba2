"""LEAF's federated datasets from a local path: FEMNIST (per writer) and Shakespeare
(per speaker), with their natural partition (``--dataset leaf-femnist:/path``,
``--dataset leaf-shakespeare:/path``).

LEAF (Caldas et al. 2018, https://github.com/TalwalkarLab/leaf) writes each split as
JSON files ``<root>/train/*.json`` and ``<root>/test/*.json``, each::

    {"users": ["f0000_14", ...], "num_samples": [n_0, ...],
     "user_data": {"f0000_14": {"x": [...], "y": [...]}, ...}}

* FEMNIST: ``x`` a list of 784 floats (a 28x28 image, row by row), ``y`` a class in
  ``0..61``; inputs ``[n, 1, 28, 28]`` float32, 62 classes.
* Shakespeare: ``x`` a string of 80 characters, ``y`` the next character; inputs are
  the characters' indices in LEAF's 80-letter alphabet (:data:`SHAKESPEARE_LETTERS`,
  LEAF's ``language_utils.ALL_LETTERS``; a character outside it maps to index 0, as
  ``str.find``'s -1 would break an embedding), stored as float32 (the simulator's
  inputs are floating point; indices below 2^24 are exact) -- ``[n, 80]``, 80
  classes.  :class:`CharGRU` (model ``chargru``) embeds them.

A client is a user of the train files (in file order, users in each file's order); its
samples are the train files' rows for it.  The test set is every user's test rows.

**Memory-mapped cache.**  Parsing JSON is slow (FEMNIST: ~4 GB of text).  The first
load converts it to ``.npy`` arrays under ``<root>/.fedopt_cache/`` (keyed by the
files' names, sizes and modification times: a changed file rebuilds it); later loads
map them (``np.load(mmap_mode="c")``), so a FEMNIST-size set opens in a fraction of a
second and a round pages in only its clients' rows.  ``cache=False`` parses every time
and holds the arrays in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, List, Tuple

import numpy as np
import torch
from torch import nn

from .federated_dataset import FederatedDataset

__all__ = ["load_leaf", "femnist", "shakespeare", "SHAKESPEARE_LETTERS", "CharGRU"]

SHAKESPEARE_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
_INDEX = {c: i for i, c in enumerate(SHAKESPEARE_LETTERS)}
KINDS = ("femnist", "shakespeare")
CACHE_VERSION = 1


def _files(root: str, split: str) -> List[str]:
    folder = os.path.join(root, split)
    if not os.path.isdir(folder):
        raise ValueError(f"LEAF data at {root!r} has no {split}/ folder (expected {folder}/*.json, as LEAF's "
                         "preprocess.sh writes them)")
    files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".json"))
    if not files:
        raise ValueError(f"no .json files in {folder}")
    return files


def _encode_text(strings) -> np.ndarray:
    out = np.zeros((len(strings), len(strings[0]) if strings else 0), dtype=np.float32)
    for i, s in enumerate(strings):
        if len(s) != out.shape[1]:
            raise ValueError(f"Shakespeare inputs must all have one length, got {out.shape[1]} and {len(s)}")
        out[i] = [_INDEX.get(c, 0) for c in s]
    return out


def _femnist_inputs(rows, path: str, user: str) -> np.ndarray:
    """A user's FEMNIST ``x``: ``[n, 1, 28, 28]`` float32, each row 784 numbers."""
    for j, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != 784:
            got = f"{len(row)} values" if isinstance(row, list) else repr(row)[:40]
            raise ValueError(f"{path}: user {user!r}, sample {j}: FEMNIST inputs must be 784 pixels each, got {got}")
    try:
        return np.asarray(rows, dtype=np.float32).reshape(len(rows), 1, 28, 28)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: user {user!r}: FEMNIST pixels must be numbers ({exc})") from None


def _shakespeare_inputs(rows, path: str, user: str) -> np.ndarray:
    bad = next((r for r in rows if not isinstance(r, str)), None)
    if bad is not None:
        raise ValueError(f"{path}: user {user!r}: Shakespeare inputs must be strings, got {repr(bad)[:40]}")
    try:
        return _encode_text(rows)
    except ValueError as exc:
        raise ValueError(f"{path}: user {user!r}: {exc}") from None


def _labels(values, path: str, user: str, classes: int) -> np.ndarray:
    """A user's class labels: integers in ``[0, classes)`` (an integral float such as
    ``3.0`` is taken as ``3``)."""
    for j, v in enumerate(values):
        ok = (isinstance(v, int) or (isinstance(v, float) and v.is_integer())) and not isinstance(v, bool)
        if not ok or not 0 <= v < classes:
            raise ValueError(f"{path}: user {user!r}, sample {j}: labels must be integers in [0, {classes}), "
                             f"got {v!r}")
    return np.asarray(values, dtype=np.int64)


def _read_split(files: List[str], kind: str) -> Tuple[List[str], List[int], np.ndarray, np.ndarray]:
    """``(users, sizes, x, y)`` of a split's files (users in file order)."""
    users: List[str] = []
    sizes: List[int] = []
    xs, ys = [], []
    for path in files:
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} is not valid JSON: {exc}") from None
        for key in ("users", "user_data"):
            if key not in data:
                raise ValueError(f"{path} is not a LEAF file: it has no {key!r} (LEAF files hold 'users', "
                                 "'num_samples' and 'user_data')")
        counts = data.get("num_samples")
        if counts is not None and (not isinstance(counts, list) or len(counts) != len(data["users"])):
            raise ValueError(f"{path}: 'num_samples' must list one count per user ({len(data['users'])} users), "
                             f"got {counts if not isinstance(counts, list) else f'{len(counts)} counts'}")
        for i, u in enumerate(data["users"]):
            d = data["user_data"].get(u)
            if d is None or "x" not in d or "y" not in d:
                raise ValueError(f"{path}: user {u!r} has no user_data x and y")
            n = len(d["y"])
            if len(d["x"]) != n:
                raise ValueError(f"{path}: user {u!r} has {len(d['x'])} inputs but {n} labels")
            if counts is not None and counts[i] != n:
                raise ValueError(f"{path}: user {u!r} has {n} samples but num_samples says {counts[i]!r}")
            if n == 0:
                continue
            if kind == "femnist":
                xs.append(_femnist_inputs(d["x"], path, u))
                ys.append(_labels(d["y"], path, u, 62))
            else:
                xs.append(_shakespeare_inputs(d["x"], path, u))
                if not all(isinstance(c, str) and c for c in d["y"]):
                    bad = next(c for c in d["y"] if not (isinstance(c, str) and c))
                    raise ValueError(f"{path}: user {u!r}: Shakespeare labels must be characters, got {bad!r}")
                ys.append(np.asarray([_INDEX.get(c[:1], 0) for c in d["y"]], dtype=np.int64))
            users.append(u)
            sizes.append(n)
    if not xs:
        raise ValueError(f"the LEAF files {files[0]}... hold no samples")
    return users, sizes, np.concatenate(xs), np.concatenate(ys)


def _cache_key(files: List[str], kind: str) -> str:
    h = hashlib.sha256(f"{CACHE_VERSION}:{kind}".encode())
    for path in files:
        st = os.stat(path)
        h.update(f"{os.path.basename(os.path.dirname(path))}/{os.path.basename(path)}:{st.st_size}:"
                 f"{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


def _arrays(root: str, kind: str, cache: bool) -> Dict[str, np.ndarray]:
    train_files, test_files = _files(root, "train"), _files(root, "test")
    key = _cache_key(train_files + test_files, kind)
    folder = os.path.join(root, ".fedopt_cache", f"{kind}-{key}")
    names = ("x_train", "y_train", "x_test", "y_test", "sizes")
    if cache and all(os.path.exists(os.path.join(folder, f"{n}.npy")) for n in names):
        # copy-on-write maps: writable for torch, nothing read until a round asks for it
        return {n: np.load(os.path.join(folder, f"{n}.npy"), mmap_mode="c") for n in names}
    users, sizes, x_tr, y_tr = _read_split(train_files, kind)
    _, _, x_te, y_te = _read_split(test_files, kind)
    arrays = {"x_train": x_tr, "y_train": y_tr, "x_test": x_te, "y_test": y_te,
              "sizes": np.asarray(sizes, dtype=np.int64)}
    if cache:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError:  # a read-only data folder: parse every time, in memory
            return arrays
        for n, a in arrays.items():
            tmp = os.path.join(folder, f"{n}.tmp.npy")
            np.save(tmp, a)
            os.replace(tmp, os.path.join(folder, f"{n}.npy"))  # a reader never sees half a file
        with open(os.path.join(folder, "users.json"), "w") as f:
            json.dump(users, f)
        return {n: np.load(os.path.join(folder, f"{n}.npy"), mmap_mode="c") for n in names}
    return arrays


def load_leaf(kind: str, root: str, *, cache: bool = True) -> FederatedDataset:
    """LEAF's ``kind`` (``femnist`` or ``shakespeare``) from ``root`` (the folder with
    ``train/`` and ``test/``), split by user (see the module docstring)."""
    from .partition import CSRIndices

    if kind not in KINDS:
        raise ValueError(f"unknown LEAF dataset {kind!r}; choose one of {', '.join(KINDS)}")
    root = os.path.expanduser(root)
    if not os.path.isdir(root):
        raise ValueError(f"LEAF {kind}: {root!r} is not a directory (give the folder holding train/ and test/)")
    a = _arrays(root, kind, cache)
    classes = 62 if kind == "femnist" else len(SHAKESPEARE_LETTERS)
    top = int(max(a["y_train"].max(), a["y_test"].max()))
    if top >= classes or min(int(a["y_train"].min()), int(a["y_test"].min())) < 0:
        raise ValueError(f"LEAF {kind}: labels must lie in [0, {classes}), got up to {top}")
    offsets = np.concatenate([[0], np.cumsum(a["sizes"])])
    return FederatedDataset(f"leaf-{kind}", torch.from_numpy(a["x_train"]), torch.from_numpy(a["y_train"]),
                            torch.from_numpy(a["x_test"]), torch.from_numpy(a["y_test"]), classes,
                            CSRIndices(offsets), info={"source": "LEAF", "root": root, "users": len(a["sizes"])})


def femnist(root: str, **options) -> FederatedDataset:
    return load_leaf("femnist", root, **options)


def shakespeare(root: str, **options) -> FederatedDataset:
    return load_leaf("shakespeare", root, **options)


class CharGRU(nn.Module):
    """A small next-character model for Shakespeare: embedding (8), one GRU layer
    written out step by step (so ``torch.func.vmap`` batches it: the batched engine
    trains it, where ``nn.GRU``'s fused kernel has no batching rule), and a linear
    read-out of the last hidden state.  Inputs: ``[batch, length]`` character indices
    (float or int)."""

    def __init__(self, vocab: int = len(SHAKESPEARE_LETTERS), num_classes: int = len(SHAKESPEARE_LETTERS),
                 embed: int = 8, hidden: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.ih = nn.Linear(embed, 3 * hidden)
        self.hh = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, num_classes)
        self.hidden = hidden

    def forward(self, x):
        e = self.embed(x.long())  # [batch, length, embed]
        gi = self.ih(e)  # the input projections of every step at once
        h = e.new_zeros(e.shape[0], self.hidden)
        for t in range(e.shape[1]):
            r_i, z_i, n_i = gi[:, t].chunk(3, dim=-1)
            r_h, z_h, n_h = self.hh(h).chunk(3, dim=-1)
            r = torch.sigmoid(r_i + r_h)
            z = torch.sigmoid(z_i + z_h)
            n = torch.tanh(n_i + r * n_h)
            h = (1 - z) * n + z * h
        return self.out(h)


def _chargru(input_shape, num_classes, hidden=(64,), **_):
    width = hidden[0] if isinstance(hidden, (list, tuple)) and hidden else 64
    return CharGRU(num_classes=num_classes, hidden=int(width))


def _register() -> None:
    from ..engine.models import model_names, register_model

    if "chargru" not in model_names():
        register_model("chargru", _chargru)


_register()
