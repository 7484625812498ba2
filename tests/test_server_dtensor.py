"""The server side refuses a ``DTensor`` by name, and writes nothing.

The server optimizers and ``ops.aggregate`` work on the full, unsharded state (see
docs/distributed.md).  Before they checked, a ``DTensor`` reached a kernel next to plain
tensors and failed inside torch ("got mixed torch.Tensor and DTensor") with no argument
named -- or, as a parameter, was accepted at construction and failed at the first step.
The DTensors here live on a 1-process gloo mesh on this machine (a file store, no
network).
"""

from __future__ import annotations

import copy
import datetime

import pytest
import torch
import torch.distributed as dist

from _server_cases import one_per_class, params_of
from fedopt_kernels import ops, server

N, C = 12, 3


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.fail("a default process group is already initialised in this process (a test left it behind)")
    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def dtensor(t, mesh, shard=True):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return distribute_tensor(t, mesh, [Shard(0) if shard else Replicate()])


def snapshot(opt):
    """Every parameter and state tensor, cloned, plus the param groups' values."""
    params = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    state = {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
             for i, s in enumerate(opt.state.values())}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return params, state, groups


def assert_same(before, after):
    (p0, s0, g0), (p1, s1, g1) = before, after
    assert len(p0) == len(p1) and all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert s0.keys() == s1.keys()
    for i in s0:
        assert s0[i].keys() == s1[i].keys()
        for k in s0[i]:
            a, b = s0[i][k], s1[i][k]
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, (i, k)
    assert g0 == g1


FULL = r"the full, unsharded state; pass {}\.full_tensor\(\) instead"


@pytest.mark.parametrize("shard", [True, False], ids=["Shard", "Replicate"])
def test_aggregate_refuses_a_dtensor_naming_the_client(mesh, shard):
    X = torch.randn(C, N, dtype=torch.float64)
    w = torch.full((C,), 1.0 / C, dtype=torch.float64)
    out = torch.full((N,), 7.0, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"clients is a DTensor .*" + FULL.format("clients")):
        ops.aggregate(dtensor(X, mesh, shard), w, out=out)
    rows = [X[0], dtensor(X[1], mesh, shard), X[2]]
    with pytest.raises(ValueError, match=r"clients\[1\] is a DTensor .*" + FULL.format(r"clients\[1\]")):
        ops.aggregate(rows, w, out=out)
    assert torch.equal(out, torch.full((N,), 7.0, dtype=torch.float64))  # nothing written
    # the same check guards the other ops over clients
    with pytest.raises(ValueError, match=r"clients\[1\] is a DTensor"):
        ops.weighted_sum(rows, w)
    with pytest.raises(ValueError, match=r"clients is a DTensor"):
        ops.client_dots(dtensor(X, mesh, shard), X[0].clone())
    # weights and out are refused the same way, before anything is written
    with pytest.raises(ValueError, match=r"weights is a DTensor .*" + FULL.format("weights")):
        ops.aggregate(X, dtensor(w, mesh, shard), out=out)
    with pytest.raises(ValueError, match=r"out is a DTensor .*" + FULL.format("out")):
        ops.aggregate(X, w, out=dtensor(out.clone(), mesh, shard))
    assert torch.equal(out, torch.full((N,), 7.0, dtype=torch.float64))
    # what the message says to do works, and equals the plain call
    got, _ = ops.aggregate([r.full_tensor() if hasattr(r, "full_tensor") else r for r in rows], w)
    want, _ = ops.aggregate(X, w)
    assert torch.equal(got, want)


def model_params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(4, 2, dtype=torch.float64)),
            torch.nn.Parameter(torch.randn(4, dtype=torch.float64))]


def test_server_optimizer_refuses_dtensor_parameters(mesh):
    params = model_params()
    with pytest.raises(ValueError, match=r"parameter 1 of the optimizer is a DTensor .*unsharded"):
        server.FedAdam([params[0], dtensor(params[1].detach(), mesh)], lr=0.1)
    opt = server.FedAvg(params, lr=1.0)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=r"parameter 2 of the optimizer is a DTensor"):
        opt.add_param_group({"params": [dtensor(torch.zeros(4, dtype=torch.float64), mesh)]})
    assert len(opt.param_groups) == 1  # the rejected group was not kept
    assert_same(before, snapshot(opt))


@pytest.mark.parametrize("case", params_of(one_per_class()))
def test_server_step_refuses_dtensor_updates_and_weights_changing_nothing(mesh, case):
    params = model_params()
    names = ["w", "b"]
    opt = case.make(list(zip(names, params)))
    torch.manual_seed(1)
    opt.step(torch.randn(C, N, dtype=torch.float64))  # a real round first: there is state to keep
    before = snapshot(opt)
    U = torch.randn(C, N, dtype=torch.float64)
    bad = {
        r"updates is a DTensor .*" + FULL.format("updates"): dict(updates=dtensor(U, mesh)),
        r"updates\[2\] is a DTensor .*" + FULL.format(r"updates\[2\]"):
            dict(updates=[U[0], U[1], dtensor(U[2].clone(), mesh)]),
        r"updates\[1\]\['b'\] is a DTensor": dict(updates=[{"w": U[i, :8].view(4, 2), "b": (
            dtensor(U[i, 8:].clone(), mesh) if i == 1 else U[i, 8:])} for i in range(C)]),
        r"weights is a DTensor .*" + FULL.format("weights"):
            dict(updates=U, weights=dtensor(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), mesh, False)),
    }
    for match, kwargs in bad.items():
        with pytest.raises(ValueError, match=match):
            opt.step(**kwargs)
        assert_same(before, snapshot(opt))
    # The advice works: the gathered update steps as the plain one does.
    twin = case.make(list(zip(names, [p.detach().clone() for p in params])))
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))  # load_state_dict would share the tensors
    opt.step(dtensor(U, mesh).full_tensor())
    twin.step(U)
    assert all(torch.equal(a, b) for a, b in zip(opt.param_groups[0]["params"], twin.param_groups[0]["params"]))
