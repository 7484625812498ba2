"""The per-client state store (fl/engine/client_state.py) and SCAFFOLD on it: rows only for
clients that took part, compact / spilled storage, checkpoints that resume bit for bit."""

import numpy as np
import pytest
import torch

from fedopt_kernels.fl import SimulationConfig, Simulation
from fedopt_kernels.fl.engine.client import ScaffoldState
from fedopt_kernels.fl.engine.client_state import ClientStateStore
from _asserts import bits



@pytest.mark.parametrize("spill", [False, True], ids=["memory", "spill"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["exact", "bf16"])
def test_store_rows_follow_writes(tmp_path, spill, dtype):
    store = ClientStateStore(dtype=dtype, spill_dir=str(tmp_path / "s") if spill else None)
    store.register("c_i", 5)
    store.register("mom", 3, dtype=torch.float64)
    assert store.nbytes() == 0 and store.clients("c_i") == []
    assert torch.equal(store.get("c_i", 99_999), torch.zeros(5))  # never written: zeros, no row
    assert store.clients("c_i") == []
    rng = np.random.default_rng(0)
    want = {}
    for cid in [40, 3, 17] + list(range(100, 130)):  # past the first slot capacity (16) of a spill file
        v = torch.tensor(rng.standard_normal(5), dtype=torch.float32)
        store.put("c_i", cid, v)
        want[cid] = v
    store.put("mom", 7, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    assert store.clients("c_i") == sorted(want) and store.clients("mom") == [7]
    itemsize = 4 if dtype is None else 2
    assert store.nbytes("c_i") == len(want) * 5 * itemsize
    for cid, v in want.items():
        got = store.get("c_i", cid)
        assert got.dtype == torch.float32
        expect = v if dtype is None else v.to(dtype).to(torch.float32)  # bf16: the stored rounding, exactly
        assert torch.equal(got, expect), cid
    assert store.get("mom", 7).dtype == torch.float64
    g = store.gather("c_i", [3, 5, 40])
    assert torch.equal(g[1], torch.zeros(5)) and torch.equal(g[0], store.get("c_i", 3))
    # the checkpoint form round-trips exactly, into a store of the same kind
    state = store.state_dict()
    assert state["c_i"]["clients"].tolist() == sorted(want)
    other = ClientStateStore(dtype=dtype, spill_dir=str(tmp_path / "t") if spill else None)
    other.register("c_i", 5)
    other.register("mom", 3, dtype=torch.float64)
    other.load_state_dict(state)
    for cid in want:
        assert torch.equal(bits(other.get("c_i", cid)), bits(store.get("c_i", cid)))
    if spill:
        assert (tmp_path / "s" / "c_i.bin").stat().st_size >= len(want) * 5 * itemsize


def test_store_rejects_bad_input():
    with pytest.raises(ValueError, match="dtype"):
        ClientStateStore(dtype=torch.int32)
    s = ClientStateStore()
    s.register("a", 4)
    with pytest.raises(ValueError, match="already registered"):
        s.register("a", 4)
    with pytest.raises(ValueError, match="4 elements"):
        s.put("a", 0, torch.zeros(5))
    assert s.clients("a") == []  # nothing was stored by the refused put
    with pytest.raises(KeyError, match="no per-client state 'b'"):
        s.get("b", 0)
    with pytest.raises(ValueError, match="name"):
        s.register("bad name", 2)
    s.put("a", 3, torch.ones(4))
    with pytest.raises(ValueError, match="'zz', which is not registered"):
        s.load_state_dict({"zz": {"clients": torch.tensor([1]), "rows": torch.zeros(1, 4)}})
    with pytest.raises(ValueError, match="rows of shape"):
        s.load_state_dict({"a": {"clients": torch.tensor([1, 2]), "rows": torch.zeros(1, 4)}})
    assert s.clients("a") == [3]  # a refused load changed nothing


def test_one_store_serves_several_owners():
    """SCAFFOLD's c_i and another per-client state (carried momentum, say) in one store:
    loading SCAFFOLD's checkpoint leaves the other name's rows alone."""
    store = ClientStateStore()
    sc = ScaffoldState(50, 3, device="cpu", store=store)
    store.register("momentum", 3)
    store.put("momentum", 9, torch.tensor([1.0, 2.0, 3.0]))
    sc.client_update(4, torch.ones(3), 0.5)
    sc.server_update(clients=[4])
    saved = {k: v.clone() for k, v in sc.state_dict().items()}
    assert saved["clients"].tolist() == [4]
    torch.testing.assert_close(sc.control(4), torch.full((3,), 2.0))  # D / lr_sum - c, c = 0
    sc.client_update(5, torch.ones(3), 1.0)
    sc.server_update(clients=[5])
    sc.load_state_dict(saved)
    assert store.clients("c_i") == [4] and store.clients("momentum") == [9]
    assert torch.equal(sc.c, saved["c"])


def test_scaffold_state_matches_the_dense_option_ii_formula():
    """c_i and c after two rounds against a float64 dense oracle of option II
    (c_i += D_i / lr_sum - c; c += (1/N) sum dc_i), only the participants holding rows."""
    N, M = 6, 1000
    sc = ScaffoldState(M, N, device="cpu")
    c_ref = torch.zeros(N, dtype=torch.float64)
    ci_ref = {}
    g = torch.Generator().manual_seed(1)
    for clients in ([5, 900, 17], [17, 42]):
        ups = {cid: torch.randn(N, generator=g) for cid in clients}
        for cid in clients:
            sc.client_update(cid, ups[cid], 0.5)
        sc.server_update(clients=clients)
        total = torch.zeros(N, dtype=torch.float64)
        for cid in clients:
            dc = ups[cid].double() / 0.5 - c_ref
            ci_ref[cid] = ci_ref.get(cid, torch.zeros(N, dtype=torch.float64)) + dc
            total += dc
        c_ref += total / M
    assert sc.store.clients("c_i") == [5, 17, 42, 900]
    torch.testing.assert_close(sc.c.double(), c_ref, rtol=1e-6, atol=1e-7)
    for cid, ref in ci_ref.items():
        torch.testing.assert_close(sc.control(cid).double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(sc.control(1), torch.zeros(N))
    out = torch.empty(N)
    assert torch.equal(sc.correction(1, out), sc.c)  # c - 0 for a client without a row
    # an older checkpoint's dense table loads into the same rows
    dense = sc.c_clients
    assert dense.shape == (M, N)
    other = ScaffoldState(M, N, device="cpu")
    other.load_state_dict({"c": sc.c, "c_clients": dense})
    assert other.store.clients("c_i") == [5, 17, 42, 900]
    assert all(torch.equal(other.control(c), sc.control(c)) for c in ci_ref)


FAST = dict(algo="scaffold", dataset="synthetic", clients=300, per_round=8, rounds=4, local_steps=3,
            hidden=(16,), max_samples_per_client=60, seed=3)


@pytest.mark.parametrize("engine", ["batched", "sequential"])
@pytest.mark.parametrize("spill", [False, True], ids=["memory", "spill"])
def test_scaffold_resume_is_bitwise(tmp_path, engine, spill):
    """4 rounds straight == 2 rounds, a checkpoint through torch.save/load, a new
    Simulation resumed from it, 2 more rounds: bit for bit (model, c, every c_i)."""
    kw = dict(FAST, engine=engine)
    if spill:
        kw["client_state_dir"] = str(tmp_path / "straight")
    straight = Simulation(SimulationConfig(**kw))
    straight.run()
    sd = straight.state_dict()
    assert sd["scaffold"]["clients"].numel() <= 4 * 8  # rows for participants only, not 300 clients
    assert sd["scaffold"]["controls"].shape == (sd["scaffold"]["clients"].numel(), straight.numel)
    participants = sorted({c for r in straight.results.records for c in r["clients"]})
    assert sd["scaffold"]["clients"].tolist() == participants

    if spill:
        kw["client_state_dir"] = str(tmp_path / "first")
    first = Simulation(SimulationConfig(**kw))
    first.run(2)
    torch.save(first.state_dict(), tmp_path / "ckpt.pt")
    if spill:
        kw["client_state_dir"] = str(tmp_path / "resumed")
    resumed = Simulation(SimulationConfig(**kw))
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True))
    resumed.run()
    rd = resumed.state_dict()
    assert torch.equal(bits(resumed.x_global), bits(straight.x_global))
    for key in ("c", "controls"):
        assert torch.equal(bits(rd["scaffold"][key]), bits(sd["scaffold"][key])), key
    assert torch.equal(rd["scaffold"]["clients"], sd["scaffold"]["clients"])
    strip = lambda recs: [{k: v for k, v in r.items() if k != "wall_time"} for r in recs]  # noqa: E731
    assert strip(resumed.results.records) == strip(straight.results.records)


def test_compact_client_state_is_stated_and_close():
    """bfloat16 c_i: half the bytes of the rows, a run that differs from the exact one
    only by the rows' rounding (bounded: the same model to 1e-2 relative)."""
    exact = Simulation(SimulationConfig(**FAST))
    exact.run()
    compact = Simulation(SimulationConfig(**FAST, client_state_dtype="bfloat16"))
    compact.run()
    assert compact.scaffold.store.nbytes() * 2 == exact.scaffold.store.nbytes()
    for cid in compact.scaffold.store.clients("c_i"):
        row = compact.scaffold.control(cid)
        assert torch.equal(row, row.to(torch.bfloat16).float())  # stored values are bf16-representable
    diff = (compact.x_global - exact.x_global).norm() / exact.x_global.norm()
    assert 0 < diff < 1e-2
