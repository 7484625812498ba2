"""Data that follows the participants: the lean `synthetic` (same bits as the old
list-and-concatenate build), `synthetic-lazy` (each client made from its own seed
when sampled), index tables instead of tensors (CSRIndices), and partitions built
vectorised with the old loops' exact results."""

import numpy as np
import pytest
import torch

from fedopt_kernels.fl import Simulation, SimulationConfig
from fedopt_kernels.fl.run.config import ConfigError
from fedopt_kernels.fl.datasets.data import LazyFederatedDataset, synthetic, synthetic_lazy
from fedopt_kernels.fl.datasets.partition import CSRIndices, contiguous_partition, dirichlet_partition, iid_partition
from _asserts import bits



# ---------------------------------------------------------------- oracles: the previous implementations
def _old_synthetic(alpha, beta, num_clients, iid, seed, test_fraction, cap, dimension=60, num_classes=10):
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x5E]))
    sizes = rng.lognormal(4, 2, num_clients).astype(np.int64) + 50
    if cap is not None:
        sizes = np.minimum(sizes, max(int(cap), 2))
    mean_w = rng.normal(0, alpha, num_clients)
    big_b = rng.normal(0, beta, num_clients)
    cov_diag = np.power(np.arange(1, dimension + 1, dtype=np.float64), -1.2)
    if iid:
        w_global = rng.normal(0, 1, (dimension, num_classes))
        b_global = rng.normal(0, 1, num_classes)
    xs_tr, ys_tr, xs_te, ys_te = [], [], [], []
    for k in range(num_clients):
        v = np.ones(dimension) * big_b[k] if iid else rng.normal(big_b[k], 1, dimension)
        w = w_global if iid else rng.normal(mean_w[k], 1, (dimension, num_classes))
        b = b_global if iid else rng.normal(mean_w[k], 1, num_classes)
        xx = v + rng.standard_normal((int(sizes[k]), dimension)) * np.sqrt(cov_diag)
        yy = np.argmax(xx @ w + b, axis=1)
        n_test = min(max(int(round(sizes[k] * test_fraction)), 1), int(sizes[k]) - 1)
        xs_te.append(xx[:n_test]), ys_te.append(yy[:n_test]), xs_tr.append(xx[n_test:]), ys_tr.append(yy[n_test:])
    cat = lambda xs, dt: torch.tensor(np.concatenate(xs), dtype=dt)  # noqa: E731
    return cat(xs_tr, torch.float32), cat(ys_tr, torch.int64), cat(xs_te, torch.float32), cat(ys_te, torch.int64)


def _old_dirichlet(y, M, alpha, seed, min_size):
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0xA11]))
    n, classes, cap = len(y), np.unique(y), len(y) / M
    for _ in range(1000):
        buckets = [[] for _ in range(M)]
        for c in classes:
            idx_c = np.flatnonzero(y == c)
            rng.shuffle(idx_c)
            q = rng.dirichlet(np.full(M, float(alpha)))
            q = q * (np.array([len(b) for b in buckets]) < cap)
            total = q.sum()
            q = q / total if total > 0 else np.full(M, 1.0 / M)
            cuts = (np.cumsum(q) * len(idx_c)).astype(np.int64)[:-1]
            for b, part in zip(buckets, np.split(idx_c, cuts)):
                b.extend(part.tolist())
        if min(len(b) for b in buckets) >= min_size:
            break
    return [sorted(b) for b in buckets]


def _old_iid(n, M, seed):
    perm = np.random.default_rng(np.random.SeedSequence([int(seed), 0xA11])).permutation(n)
    return [np.sort(p).tolist() for p in np.array_split(perm, M)]



@pytest.mark.parametrize("kw", [
    dict(alpha=1.0, beta=1.0, num_clients=40, iid=False, seed=0, test_fraction=0.2, cap=None),
    dict(alpha=0.5, beta=0.0, num_clients=25, iid=True, seed=3, test_fraction=0.3, cap=70),
], ids=["noniid", "iid-capped"])
def test_lean_synthetic_has_the_oldbits(kw):
    want = _old_synthetic(**kw)
    got = synthetic(kw["alpha"], kw["beta"], num_clients=kw["num_clients"], iid=kw["iid"], seed=kw["seed"],
                    test_fraction=kw["test_fraction"], max_samples_per_client=kw["cap"])
    for w, g in zip(want, (got.x_train, got.y_train, got.x_test, got.y_test)):
        assert g.dtype == w.dtype and torch.equal(bits(g), bits(w))
    assert torch.equal(torch.cat(got.client_indices), torch.arange(got.num_train))


@pytest.mark.parametrize("alpha", [0.1, 0.3, 10.0])
@pytest.mark.parametrize("M", [3, 17, 60])
def test_vectorised_dirichlet_equals_the_loop(alpha, M):
    y = np.random.default_rng(7).integers(0, 10, 2000)
    y[:10] = np.arange(10)
    got = dirichlet_partition(y, M, alpha, seed=5, min_size=1)
    assert [ix.tolist() for ix in got.client_indices] == _old_dirichlet(y, M, alpha, 5, 1)


@pytest.mark.parametrize("n,M", [(100, 7), (1000, 1000), (12345, 321)])
def test_vectorised_iid_equals_the_loop(n, M):
    assert [ix.tolist() for ix in iid_partition(n, M, seed=9).client_indices] == _old_iid(n, M, 9)


def test_csr_indices_are_index_tables():
    p = contiguous_partition([3, 1, 5])
    ix = p.client_indices
    assert isinstance(ix, CSRIndices) and len(ix) == 3 and p.sizes == [3, 1, 5]
    assert ix[2].tolist() == [4, 5, 6, 7, 8] and ix[-1].tolist() == [4, 5, 6, 7, 8]
    assert [t.tolist() for t in ix] == [[0, 1, 2], [3], [4, 5, 6, 7, 8]]
    flat = CSRIndices(np.array([0, 2, 3]), np.array([9, 4, 7]))
    assert flat[0].tolist() == [9, 4] and flat[1].tolist() == [7]
    with pytest.raises(IndexError, match="out of range"):
        ix[3]
    with pytest.raises(ValueError, match="at least one sample"):
        contiguous_partition([2, 0])
    big = contiguous_partition(np.full(100_000, 50))  # 10^5 clients: offsets only
    assert big.num_clients == 100_000 and big.client_indices.offsets.nbytes == 8 * 100_001


def _client_oracle(seed, k, size, n_test, u, b_mean, dimension=60, num_classes=10):
    """Client k of synthetic-lazy, from its documented seed (non-IID)."""
    r = np.random.default_rng(np.random.SeedSequence([seed, 0x5E, 1, k]))
    v = r.normal(b_mean, 1, dimension)
    w = r.normal(u, 1, (dimension, num_classes))
    b = r.normal(u, 1, num_classes)
    xx = v + r.standard_normal((size, dimension)) * np.sqrt(np.arange(1, dimension + 1, dtype=np.float64) ** -1.2)
    return torch.tensor(xx[n_test:], dtype=torch.float32), torch.tensor(np.argmax(xx @ w + b, 1)[n_test:])


def test_synthetic_lazy_clients_come_from_their_own_seed():
    M = 100_000
    ds = synthetic_lazy(1.0, 1.0, num_clients=M, seed=4, max_samples_per_client=200, test_clients=20)
    assert isinstance(ds, LazyFederatedDataset) and ds.num_clients == M
    r = np.random.default_rng(np.random.SeedSequence([4, 0x5E, 0]))
    sizes = np.minimum(r.lognormal(4, 2, M).astype(np.int64) + 50, 200)
    u, bb = r.normal(0, 1.0, M), r.normal(0, 1.0, M)
    n_test = np.minimum(np.maximum(np.round(sizes * 0.2).astype(np.int64), 1), sizes - 1)
    assert np.array_equal(ds.client_sizes, sizes - n_test)
    for k in (0, 77_777, M - 1):
        x, y = ds.client_data(k)
        wx, wy = _client_oracle(4, k, int(sizes[k]), int(n_test[k]), u[k], bb[k])
        assert torch.equal(bits(x), bits(wx)) and torch.equal(y, wy)
        x2, _ = ds.client_data(k)
        assert torch.equal(x, x2)  # the same on every call
    assert ds.num_test == int(sum(n_test[k] for k in np.sort(r.choice(M, 20, replace=False))))


@pytest.mark.parametrize("algo,engine", [("scaffold", "batched"), ("fedavg", "sequential"), ("fedadam", "batched")])
def test_lazy_rounds_equal_the_materialised_dataset_bitwise(algo, engine):
    kw = dict(algo=algo, dataset="synthetic-lazy", clients=150, per_round=6, rounds=2, local_steps=3, hidden=(16,),
              max_samples_per_client=60, engine=engine, seed=2)
    lazy = Simulation(SimulationConfig(**kw))
    assert isinstance(lazy.partition.client_indices, CSRIndices)
    lazy.run()
    full = synthetic_lazy(num_clients=150, seed=2, max_samples_per_client=60).materialise()
    eager = Simulation(SimulationConfig(**kw), dataset=full)
    eager.run()
    assert torch.equal(bits(lazy.x_global), bits(eager.x_global))
    strip = lambda recs: [{k: v for k, v in r.items() if k != "wall_time"} for r in recs]  # noqa: E731
    assert strip(lazy.results.records) == strip(eager.results.records)
    assert lazy.train_x.shape[0] == 1  # the round's rows are dropped after it


def test_lazy_dataset_refuses_what_needs_the_whole_training_set():
    base = dict(dataset="synthetic-lazy", clients=30, per_round=3, rounds=1, hidden=(8,), max_samples_per_client=40)
    with pytest.raises(ConfigError, match="partition 'natural'"):
        Simulation(SimulationConfig(**base, partition="dirichlet"))
    with pytest.raises(ConfigError, match="corrupt-fraction"):
        Simulation(SimulationConfig(**base, corrupt_fraction=0.5))
    with pytest.raises(ConfigError, match="proxy-source train"):
        Simulation(SimulationConfig(**base, algo="fedlaw", proxy_source="train"))
