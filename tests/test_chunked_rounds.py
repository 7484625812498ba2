"""A round's memory bounded by a chunk (fl/engine/chunked.py): clients trained K at a time,
each chunk folded into the running weighted sum -- the unchunked round's bits for every
weighted-sum algorithm, a stated bound when clients are left out."""

import pytest
import torch

from fedopt_kernels.fl import Simulation, SimulationConfig
from fedopt_kernels.fl.engine.chunked import FOLDABLE, RoundFold, chunk_clients, parse_bytes
from fedopt_kernels.fl.run.config import ConfigError
from fedopt_kernels.ops import aggregate
from fedopt_kernels.server import FedAvg
from _asserts import bits




def _strip(records):
    return [{k: v for k, v in r.items() if k != "wall_time"} for r in records]


BASE = dict(dataset="synthetic-lazy", clients=200, per_round=9, rounds=2, local_steps=2, hidden=(16,),
            max_samples_per_client=50, seed=1)


def _tree_equal(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(bits(a), bits(b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_tree_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_tree_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("engine,budget", [("batched", "100K"), ("sequential", "42K")])
@pytest.mark.parametrize("algo", FOLDABLE)
def test_folded_round_equals_the_unchunked_round_bitwise(algo, engine, budget):
    kw = dict(BASE, algo=algo, engine=engine)
    whole = Simulation(SimulationConfig(**kw))
    whole.run()
    chunked = Simulation(SimulationConfig(**kw, memory_budget=budget))
    assert chunked._foldable and 2 <= chunked._chunk < 9
    assert chunked.updates.shape[0] == chunked._chunk  # the round's rows: one chunk, not per_round
    chunked.run()
    assert chunked.results.meta["round_chunk"] == chunked._chunk
    assert torch.equal(bits(chunked.x_global), bits(whole.x_global))
    assert _tree_equal(chunked.server.state_dict(), whole.server.state_dict())
    assert _strip(chunked.results.records) == _strip(whole.results.records)  # update norms, FedExP/ASNES stats
    if algo == "scaffold":
        assert _tree_equal(chunked.scaffold.state_dict(), whole.scaffold.state_dict())


@pytest.mark.parametrize("extra", [dict(dp_clip=0.5, dp_noise_multiplier=0.3, dp_delta=1e-3, weighting="uniform"),
                                   dict(attack="alie", attack_fraction=0.3),
                                   dict(aggregator="trimmed-mean", trim_beta=0.2)])
def test_dp_attacks_and_robust_rules_train_in_chunks_without_folding(extra):
    """DP clips every row, ALIE reads the honest rows and a robust rule ranks them: under
    a memory budget the round trains in chunks but keeps its rows, and equals the
    unchunked round bit for bit."""
    kw = dict(BASE, algo="fedavg", **extra)
    whole = Simulation(SimulationConfig(**kw))
    whole.run()
    chunked = Simulation(SimulationConfig(**kw, memory_budget="100K"))
    assert not chunked._foldable and 2 <= chunked._chunk < 9
    chunked.run()
    assert torch.equal(bits(chunked.x_global), bits(whole.x_global))
    assert _strip(chunked.results.records) == _strip(whole.results.records)  # epsilon, attacked clients


def test_fedlaw_trains_in_chunks_into_a_memory_mapped_table(tmp_path):
    kw = dict(BASE, algo="fedlaw", fedlaw_epochs=1, proxy_size=20)
    whole = Simulation(SimulationConfig(**kw))
    whole.run()
    chunked = Simulation(SimulationConfig(**kw, memory_budget="100K", client_state_dir=str(tmp_path)))
    assert not chunked._foldable and chunked._chunk < 9
    assert (tmp_path / "round_updates.bin").stat().st_size == 9 * chunked.numel * 4
    chunked.run()
    assert torch.equal(bits(chunked.x_global), bits(whole.x_global))
    assert _strip(chunked.results.records) == _strip(whole.results.records)


def test_chunked_scaffold_resumes_bitwise(tmp_path):
    kw = dict(BASE, algo="scaffold", rounds=4, memory_budget="100K")
    straight = Simulation(SimulationConfig(**kw))
    straight.run()
    first = Simulation(SimulationConfig(**kw))
    first.run(2)
    torch.save(first.state_dict(), tmp_path / "c.pt")
    resumed = Simulation(SimulationConfig(**kw))
    resumed.load_state_dict(torch.load(tmp_path / "c.pt", weights_only=True))
    resumed.run()
    assert torch.equal(bits(resumed.x_global), bits(straight.x_global))
    assert _tree_equal(resumed.scaffold.state_dict(), straight.scaffold.state_dict())


def _rows(C, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(C, N, generator=g) * torch.rand(C, 1, generator=g) * 3


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 10])
def test_fold_equals_aggregate_bitwise_for_any_chunking(chunk):
    C, N = 10, 1031
    rows = _rows(C, N)
    w = torch.rand(C, generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.1
    opt = FedAvg([torch.nn.Parameter(torch.zeros(N))], lr=1.0, backend="cpu")
    fold = RoundFold(opt, w, C, N, "cpu", torch.float32)
    for s in range(0, C, chunk):
        assert not fold.add(rows[s:s + chunk], range(s, min(s + chunk, C))).any()
    got = torch.empty(N)
    ra = fold.finish(got)
    p = (w / w.max() / (w / w.max()).sum()).float()  # normalize_weights' p
    want, st = aggregate(rows, p, backend="cpu")
    assert torch.equal(bits(got), bits(want))
    assert torch.equal(bits(ra.stats.client_sq_norms), bits(st.client_sq_norms))
    assert torch.equal(bits(ra.stats.sq_norm), bits(st.sq_norm))


def _bound(rows, p_eff):
    u = 2.0 ** -24
    C = rows.shape[0]
    terms = (p_eff.double()[:, None] * rows.double()).abs()
    terms[~torch.isfinite(terms)] = 0
    return (C + 2) * u * terms.sum(0)


@pytest.mark.parametrize("chunk", [2, 4])
def test_fold_with_a_nan_client_is_within_the_stated_bound(chunk):
    C, N = 9, 517
    rows = _rows(C, N, seed=5)
    rows[4, 7] = float("nan")
    rows[6, 0] = float("inf")
    w = torch.linspace(1, 3, C, dtype=torch.float64)
    opt = FedAvg([torch.nn.Parameter(torch.zeros(N))], lr=1.0, backend="cpu")
    fold = RoundFold(opt, w, C, N, "cpu", torch.float32)
    masks = []
    for s in range(0, C, chunk):
        masks.append(fold.add(rows[s:s + chunk], range(s, min(s + chunk, C))))
    assert torch.cat(masks).tolist() == [i in (4, 6) for i in range(C)]
    got = torch.empty(N)
    ra = fold.finish(got)
    p = (w / w.max() / (w / w.max()).sum()).float()
    want, st = aggregate(rows, p, backend="cpu")
    assert torch.isfinite(got).all()
    assert torch.equal(ra.stats.excluded, st.excluded)
    torch.testing.assert_close(ra.stats.weights, st.weights, rtol=1e-6, atol=0)
    err = (got.double() - want.double()).abs()
    assert (err <= _bound(rows, st.weights)).all(), float((err - _bound(rows, st.weights)).max())
    # an independent float64 oracle of the renormalised mean, to the same bound
    keep = torch.tensor([i not in (4, 6) for i in range(C)])
    oracle = (w[keep, None] * rows[keep].double()).sum(0) / w[keep].sum()
    assert ((got.double() - oracle).abs() <= _bound(rows, st.weights) + 1e-12).all()


def test_fold_leaves_out_a_client_without_a_row():
    """A client whose training failed has no row: the mean of the others, within the bound."""
    C, N = 6, 300
    rows = _rows(C, N, seed=9)
    w = torch.tensor([1.0, 2, 3, 4, 5, 6], dtype=torch.float64)
    opt = FedAvg([torch.nn.Parameter(torch.zeros(N))], lr=1.0, backend="cpu")
    fold = RoundFold(opt, w, C, N, "cpu", torch.float32)
    fold.add(rows[[0, 1]], [0, 1])
    fold.add(rows[[3]], [3])  # client 2 failed
    fold.add(rows[[4, 5]], [4, 5])
    got = torch.empty(N)
    ra = fold.finish(got)
    keep = [0, 1, 3, 4, 5]
    oracle = (w[keep, None] * rows[keep].double()).sum(0) / w[keep].sum()
    p = w[keep] / w[keep].sum()
    assert ((got.double() - oracle).abs() <= _bound(rows[keep], p) + 1e-12).all()
    assert ra.stats.client_sq_norms.shape == (5,) and torch.allclose(ra.p.double(), p, rtol=1e-6)


def test_budget_parsing_and_config_errors():
    assert parse_bytes("4G") == 4 << 30 and parse_bytes("512MB") == 512 << 20 and parse_bytes(1000) == 1000
    assert parse_bytes("1.5k") == 1536
    for bad in ("lots", "-1G", "4X", True, 0):
        with pytest.raises(ValueError, match="size such as|at least 1 byte"):
            parse_bytes(bad)
    with pytest.raises(ConfigError, match="memory-budget"):
        SimulationConfig(memory_budget="huge").validate()
    assert chunk_clients(10_000, 1_000, 2_000) == 8 and chunk_clients(10, 1_000) == 2


@pytest.mark.parametrize("nan", [False, True])
def test_device_decided_redo_equals_the_host_decision(nan):
    """On an accelerator the fold never reads a flag: the redo pass always runs, disabled
    on the device when no update was left out.  Taken on the CPU here: the same bits."""
    C, N = 7, 211
    rows = _rows(C, N, seed=11)
    if nan:
        rows[3, 5] = float("nan")
    w = torch.linspace(1, 2, C, dtype=torch.float64)
    outs = []
    for host in (True, False):
        opt = FedAvg([torch.nn.Parameter(torch.zeros(N))], lr=1.0, backend="cpu")
        fold = RoundFold(opt, w, C, N, "cpu", torch.float32)
        fold._host_decides = host
        for s in range(0, C, 3):
            fold.add(rows[s:s + 3], range(s, min(s + 3, C)))
        out = torch.empty(N)
        ra = fold.finish(out)
        outs.append((out, ra.stats.excluded))
    assert torch.equal(bits(outs[0][0]), bits(outs[1][0])) and torch.equal(outs[0][1], outs[1][1])
    assert bool(outs[0][1][3]) == nan


# ------------------------------------------------------------------ BatchNorm models fold too (issue 32 item 2)
from fedopt_kernels.server import ServerRound, average_buffers  # noqa: E402
from fedopt_kernels.server.weighting import BufferAverage  # noqa: E402
from fedopt_kernels.utils import buffers_to_vector  # noqa: E402

# clients of unequal sizes (a Dirichlet split), so that max_weight_share has shares to cap
BN_BASE = dict(dataset="synthetic", clients=30, per_round=9, rounds=2, local_steps=2, partition="dirichlet",
               weighting="size", engine="sequential", seed=1)


def _bn_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(60, 16), torch.nn.BatchNorm1d(16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 10))


def _poison(sim, update_of=None, buffers_of=None):
    """The clients' training as usual, then a NaN in ``update_of``'s update and an Inf
    in ``buffers_of``'s buffer row: written where the round reads them, chunked or not."""
    real = sim.trainer.train

    def train(*args, **kw):
        out = real(*args, **kw)
        if kw["client"] == update_of:
            kw["out_update"][3] = float("nan")
        if kw["client"] == buffers_of:
            kw["out_buffers"][1] = float("inf")
        return out

    sim.trainer.train = train


def _bn_pair(algo, cap, rounds=2, **poison):
    kw = dict(BN_BASE, algo=algo, max_weight_share=cap, rounds=rounds)
    whole = Simulation(SimulationConfig(**kw), model=_bn_mlp)
    chunked = Simulation(SimulationConfig(**kw, memory_budget="42K"), model=_bn_mlp)
    assert chunked._has_buffers and chunked._foldable and chunked.results.meta["round_fold"] is True
    assert chunked._chunk <= 3  # 9 clients: at least 3 chunks
    assert chunked.updates.shape[0] == chunked.buffer_rows.shape[0] == chunked._chunk  # rows of one chunk
    before = buffers_to_vector(whole.global_model).clone()
    for sim in (whole, chunked):
        _poison(sim, **poison)
        sim.run()
    return whole, chunked, before


@pytest.mark.parametrize("cap", [None, 0.12])
@pytest.mark.parametrize("algo", ["fedavg", "fedyogi", "scaffold"])
def test_batchnorm_model_folds_to_the_unchunked_round_bitwise(algo, cap):
    """The parameters AND the BatchNorm statistics of a folded round are the unchunked
    round's bits, with a ``max_weight_share`` that acts on both."""
    whole, chunked, before = _bn_pair(algo, cap)
    assert torch.equal(bits(chunked.x_global), bits(whole.x_global))
    buffers = buffers_to_vector(whole.global_model)
    assert not torch.equal(buffers, before)  # the statistics moved: the rounds averaged them
    assert torch.equal(bits(buffers_to_vector(chunked.global_model)), bits(buffers))
    assert _strip(chunked.results.records) == _strip(whole.results.records)
    if cap is not None:  # the cap really acts on round 2's weights (one client holds 478 of 1796 samples)
        sizes = whole.client_sizes[whole.sample_clients(2)]
        capped = whole.server.round.weights(sizes).values
        assert capped.max() == pytest.approx(cap) and (sizes / sizes.sum()).max() > 0.25


def test_batchnorm_fold_leaves_out_the_nonfinite_clients_like_the_unchunked_round():
    """One client's update NaN (the step excludes it, its buffers go with it), another's
    buffers Inf (its update kept): the buffers are the unchunked round's bits and match a
    float64 oracle; the parameters are within the fold's stated bound.  One round: once
    a client is left out the parameters differ by rounding, and so would the next
    round's statistics."""
    sampled = Simulation(SimulationConfig(**dict(BN_BASE, algo="fedavg")), model=_bn_mlp).sample_clients(1)
    nan_update, inf_buffers = sampled[4], sampled[7]
    whole, chunked, before = _bn_pair("fedavg", 0.12, rounds=1, update_of=nan_update, buffers_of=inf_buffers)
    for sim in (whole, chunked):
        rec = sim.results.records[1]
        assert rec["excluded_nonfinite"] == 1 and rec["left_out"] == [[nan_update, "nonfinite"]]
    got = buffers_to_vector(chunked.global_model)
    assert torch.isfinite(got).all() and not torch.equal(got, before)
    assert torch.equal(bits(got), bits(buffers_to_vector(whole.global_model)))
    # against the float64 formula: clients 4 and 7 out, the capped shares of the rest renormalised
    rows = whole.buffer_rows[:9].double()  # the unchunked round's rows (round order)
    assert not torch.isfinite(rows[7]).all()
    shares = whole.server.round.weights(whole.client_sizes[sampled]).values
    assert shares.max() == pytest.approx(0.12) and shares.max() < shares.min() * 10  # the cap acts in round 1
    keep = torch.tensor([i not in (4, 7) for i in range(9)])
    oracle = (shares[keep, None] * rows[keep]).sum(0) / shares[keep].sum()
    torch.testing.assert_close(got.double(), oracle, rtol=1e-6, atol=1e-6)
    # the parameters: the fold's documented bound on the mean update, |dx| <= (C + 2) u sum_i |D_i| (+ 1 ulp of x)
    D = whole.updates[:9].double()
    D[~torch.isfinite(D)] = 0
    bound = 11 * 2.0 ** -24 * D.abs().sum(0) + 2.0 ** -23 * whole.x_global.double().abs()
    assert ((chunked.x_global.double() - whole.x_global.double()).abs() <= bound).all()


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_buffer_average_in_chunks_is_average_buffers_bitwise(chunk):
    """The running form gives average_buffers' bits for any chunking, NaN rows, exclusions
    and weight-0 clients, and both match the float64 formula."""
    C, M = 7, 37
    g = torch.Generator().manual_seed(4)
    rows = torch.randn(C, M, generator=g) * 5 + 3
    rows[2, 4] = float("nan")
    w = torch.rand(C, generator=g, dtype=torch.float64) + 0.2
    w[5] = 0.0
    excluded = torch.zeros(C, dtype=torch.bool)
    excluded[0] = True
    current = torch.full((M,), -1.0)
    want = average_buffers(rows, w, current, excluded)
    avg = BufferAverage(w, C, M, "cpu", torch.float32)
    for s in range(0, C, chunk):
        avg.add(rows[s:s + chunk], list(range(s, min(s + chunk, C))), excluded[s:s + chunk])
    assert torch.equal(bits(avg.finish(current)), bits(want))
    keep = torch.tensor([1, 3, 4, 6])
    oracle = (w[keep, None] * rows[keep].double()).sum(0) / w[keep].sum()
    # the sum's rounding: |mean - oracle| <= (C + 3) u sum_i |w_i rows_i| / sum_i w_i (fp32, u = 2^-24)
    bound = (C + 3) * 2.0 ** -24 * (w[keep, None] * rows[keep].double()).abs().sum(0) / w[keep].sum()
    assert ((want.double() - oracle).abs() <= bound).all()
    # nobody kept: the current buffers
    none = BufferAverage(w, C, M, "cpu", torch.float32)
    none.add(rows, list(range(C)), torch.ones(C, dtype=torch.bool))
    assert torch.equal(none.finish(current), current)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_buffer_average_dtypes_accumulate_wide(dtype):
    """fp16/bf16 buffers sum in fp32 and come back in their dtype; float64 stays float64."""
    C, M = 40, 9
    g = torch.Generator().manual_seed(8)
    rows = (torch.rand(C, M, generator=g) * 4 + 1).to(dtype)
    got = average_buffers(rows, None, torch.zeros(M, dtype=dtype))
    assert got.dtype == dtype
    oracle = rows.double().mean(0)
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-14}[dtype]
    torch.testing.assert_close(got.double(), oracle, rtol=tol, atol=0)


def test_batchnorm_model_in_unfolded_chunks_keeps_every_clients_buffer_row():
    """A robust rule needs every row, so the round trains in chunks without folding: each
    chunk's buffer rows go to their own rows of the round's table, as its updates do
    (before, every chunk wrote the first rows and the statistics were those of the last
    chunk and of uninitialised rows)."""
    kw = dict(BN_BASE, algo="fedavg", aggregator="trimmed-mean", trim_beta=0.2)
    whole = Simulation(SimulationConfig(**kw), model=_bn_mlp)
    whole.run()
    chunked = Simulation(SimulationConfig(**kw, memory_budget="42K"), model=_bn_mlp)
    assert not chunked._foldable and chunked._chunk <= 3 and chunked.buffer_rows.shape[0] == 9
    chunked.run()
    assert torch.equal(bits(chunked.x_global), bits(whole.x_global))
    assert torch.equal(bits(buffers_to_vector(chunked.global_model)), bits(buffers_to_vector(whole.global_model)))
