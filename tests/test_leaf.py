"""LEAF's JSON datasets (fl/datasets/leaf.py) from small files in LEAF's exact layout:
per-user partition, the memory-mapped conversion cache, Shakespeare's alphabet, and
its character model on the batched engine."""

import json
import os
import random
import warnings

import numpy as np
import pytest
import torch

from fedopt_kernels.fl import Simulation, SimulationConfig
from fedopt_kernels.fl.run.config import ConfigError
from fedopt_kernels.fl.datasets.leaf import SHAKESPEARE_LETTERS, CharGRU, load_leaf
from fedopt_kernels.fl.datasets.partition import CSRIndices
from fedopt_kernels.fl.run.simulation import load_config_dataset

# LEAF's language_utils.ALL_LETTERS, written out again as the oracle
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"


def _write(root, kind, *, files=2, users=4, length=80, seed=0):
    """LEAF's layout: <root>/{train,test}/*.json with users / num_samples / user_data."""
    rng = random.Random(seed)
    written = {"train": [], "test": []}
    for split in ("train", "test"):
        os.makedirs(root / split, exist_ok=True)
        for fi in range(files):
            names = [f"f{fi:04d}_{k:02d}" for k in range(users)]
            data, counts = {}, []
            for u in names:
                n = rng.randint(2, 7) if split == "train" else 2
                if kind == "femnist":
                    x = [[rng.random() for _ in range(784)] for _ in range(n)]
                    y = [rng.randrange(62) for _ in range(n)]
                else:
                    x = ["".join(rng.choice(LEAF_LETTERS) for _ in range(length)) for _ in range(n)]
                    y = [rng.choice(LEAF_LETTERS) for _ in range(n)]
                data[u] = {"x": x, "y": y}
                counts.append(n)
                written[split].append((u, x, y))
            with open(root / split / f"all_data_{fi}_niid_0_keep_0_{split}_9.json", "w") as f:
                json.dump({"users": names, "num_samples": counts, "user_data": data}, f)
    return written


def _assert_batched_trains_as_sequential(kw):
    """The run of ``kw`` trains on the batched engine (no fallback, no warning) to the
    sequential engine's model."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no engine fallback
        bat = Simulation(SimulationConfig(**kw, engine="batched"))
        bat.run()
    seq = Simulation(SimulationConfig(**kw, engine="sequential"))
    seq.run()
    assert bat.results.meta["engine"] == "batched" and "engine_fallback" not in bat.results.meta
    torch.testing.assert_close(bat.x_global, seq.x_global, rtol=1e-5, atol=1e-6)


def test_femnist_per_writer_partition_and_cache(tmp_path):
    written = _write(tmp_path, "femnist")
    ds = load_leaf("femnist", str(tmp_path))
    assert ds.num_classes == 62 and ds.input_shape == (1, 28, 28)
    assert isinstance(ds.client_indices, CSRIndices) and len(ds.client_indices) == 8
    for cid, (u, x, y) in enumerate(written["train"]):
        rows = ds.client_indices[cid]
        assert len(rows) == len(y)
        want = torch.tensor(np.asarray(x, dtype=np.float32).reshape(-1, 1, 28, 28))
        assert torch.equal(ds.x_train[rows], want) and ds.y_train[rows].tolist() == y
    test_y = [v for _, _, y in written["test"] for v in y]
    assert ds.y_test.tolist() == test_y
    cache = list((tmp_path / ".fedopt_cache").iterdir())
    assert len(cache) == 1 and (cache[0] / "x_train.npy").exists()
    again = load_leaf("femnist", str(tmp_path))  # from the memory-mapped cache: the same values
    assert torch.equal(again.x_train, ds.x_train) and torch.equal(again.y_test, ds.y_test)
    assert isinstance(np.load(cache[0] / "x_train.npy", mmap_mode="c"), np.memmap)
    # a changed file is a new cache entry, not stale data
    path = sorted((tmp_path / "train").iterdir())[0]
    data = json.loads(path.read_text())
    first = data["users"][0]
    data["user_data"][first]["y"][0] = (data["user_data"][first]["y"][0] + 1) % 62
    path.write_text(json.dumps(data))
    changed = load_leaf("femnist", str(tmp_path))
    assert changed.y_train[0].item() == data["user_data"][first]["y"][0]
    assert len(list((tmp_path / ".fedopt_cache").iterdir())) == 2
    assert torch.equal(load_leaf("femnist", str(tmp_path), cache=False).x_train, changed.x_train)


def test_shakespeare_uses_leafs_alphabet(tmp_path):
    written = _write(tmp_path, "shakespeare", files=1, users=3)
    ds = load_leaf("shakespeare", str(tmp_path))
    assert SHAKESPEARE_LETTERS == LEAF_LETTERS and ds.num_classes == 80 and ds.input_shape == (80,)
    for cid, (u, x, y) in enumerate(written["train"]):
        rows = ds.client_indices[cid]
        assert ds.x_train[rows].tolist() == [[float(LEAF_LETTERS.find(c)) for c in s] for s in x]
        assert ds.y_train[rows].tolist() == [LEAF_LETTERS.find(c) for c in y]


def test_leaf_errors_name_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        load_leaf("femnist", str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no train/ folder"):
        load_leaf("femnist", str(tmp_path))
    with pytest.raises(ValueError, match="unknown LEAF dataset 'celeba'"):
        load_leaf("celeba", str(tmp_path))
    (tmp_path / "train").mkdir()
    (tmp_path / "test").mkdir()
    (tmp_path / "train" / "a.json").write_text(json.dumps({"rows": []}))
    (tmp_path / "test" / "a.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="not a LEAF file: it has no 'users'"):
        load_leaf("femnist", str(tmp_path))
    bad = {"users": ["u"], "num_samples": [1], "user_data": {"u": {"x": [[0.0] * 10], "y": [1]}}}
    (tmp_path / "train" / "a.json").write_text(json.dumps(bad))
    (tmp_path / "test" / "a.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="784 pixels"):
        load_leaf("femnist", str(tmp_path))
    cfg = SimulationConfig(dataset=f"leaf-femnist:{tmp_path / 'missing'}", clients=2, per_round=1)
    with pytest.raises(ConfigError, match="not a directory"):
        load_config_dataset(cfg)


def test_femnist_trains_on_the_batched_engine(tmp_path):
    _write(tmp_path, "femnist", files=1, users=4)
    kw = dict(dataset=f"leaf-femnist:{tmp_path}", model="logreg", clients=4, per_round=3, rounds=2, local_steps=2,
              batch_size=4)
    _assert_batched_trains_as_sequential(kw)


def test_chargru_is_a_gru_and_trains_batched(tmp_path):
    """CharGRU's unrolled cell equals torch's nn.GRU with the same weights, and a short
    Shakespeare run trains on the batched engine (no fallback) to the sequential
    engine's model."""
    torch.manual_seed(0)
    m = CharGRU(hidden=16)
    ref = torch.nn.GRU(8, 16, batch_first=True)
    with torch.no_grad():
        ref.weight_ih_l0.copy_(m.ih.weight)
        ref.bias_ih_l0.copy_(m.ih.bias)
        ref.weight_hh_l0.copy_(m.hh.weight)
        ref.bias_hh_l0.copy_(m.hh.bias)
    x = torch.randint(0, 80, (3, 11)).float()
    _, h = ref(m.embed(x.long()))
    torch.testing.assert_close(m(x), m.out(h[0]), rtol=1e-5, atol=1e-6)

    _write(tmp_path, "shakespeare", files=1, users=4, length=12)  # LEAF's layout, short lines: a quick run
    kw = dict(dataset=f"leaf-shakespeare:{tmp_path}", model="chargru", clients=4, per_round=3, rounds=1,
              local_steps=2, batch_size=4)
    _assert_batched_trains_as_sequential(kw)
