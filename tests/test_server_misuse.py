"""Everyday misuses of the server side: each works as documented or fails with a
message naming the argument, and a failure changes nothing."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import _fp64_oracle as fp64
from _server_cases import one_per_class, params_of
from fedopt_kernels import ops
from fedopt_kernels.server import FedAdam, FedAvg, FedLAW


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def reordered_groups(model):
    """Biases first, then weights: the optimizer's order is not the model's."""
    named = dict(model.named_parameters())
    biases = [n for n in named if n.endswith("bias")]
    weights = [n for n in named if n.endswith("weight")]
    return [{"params": [named[n] for n in biases], "param_names": biases},
            {"params": [named[n] for n in weights], "param_names": weights}]


def named_updates(model, C, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()} for _ in range(C)]


def snapshot(opt):
    params = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
    state = {id(p): {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
             for p, s in opt.state.items()}
    return params, groups, state


def assert_same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and len(a[0]) == len(b[0])
    assert a[1] == b[1]
    assert a[2].keys() == b[2].keys()
    for k in a[2]:
        for n in a[2][k]:
            x, y = a[2][k][n], b[2][k][n]
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


# --------------------------------------------------------------------------- named updates
def test_named_updates_follow_the_optimizers_order_not_the_models():
    """Groups in another order than the model: named updates land on the right
    parameters (hand-checked: FedAvg lr 1 adds the mean of -D to each parameter)."""
    model = net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = FedAvg(reordered_groups(model), lr=1.0)
    ups = named_updates(model, 3)
    opt.step(ups, [1.0, 1.0, 2.0])
    for n, p in model.named_parameters():
        mean = (ups[0][n] + ups[1][n] + 2 * ups[2][n]) / 4
        torch.testing.assert_close(p.detach(), before[n] - mean)


def test_flatten_update_equals_named_step_and_keys_by_parameter_too():
    model = net()
    opt = FedAvg(reordered_groups(model), lr=1.0)
    ups = named_updates(model, 2)
    flat = torch.stack([opt.flatten_update(u) for u in ups])
    by_param = [{p: u[n] for n, p in model.named_parameters()} for u in ups]
    assert torch.equal(torch.stack([opt.flatten_update(u) for u in by_param]), flat)
    # The flat layout is the optimizer's: the biases first.
    assert torch.equal(flat[0, :3], ups[0]["0.bias"]) and torch.equal(flat[0, 3:5], ups[0]["1.bias"])


@pytest.mark.parametrize("change,match", [
    (lambda u: u.pop("1.bias"), r"no entry for '1.bias'"),
    (lambda u: u.update({"2.weight": torch.zeros(1)}), r"'2.weight' that is not a parameter"),
    (lambda u: u.update({"0.weight": torch.zeros(4, 3)}), r"'0.weight' must be a tensor of shape \(3, 4\)"),
])
def test_bad_named_update_is_refused_and_changes_nothing(change, match):
    model = net()
    opt = FedAdam(reordered_groups(model), lr=0.1)
    opt.step(named_updates(model, 2))
    before = snapshot(opt)
    ups = named_updates(model, 2, seed=1)
    change(ups[1])
    with pytest.raises(ValueError, match=match):
        opt.step(ups)
    assert_same(before, snapshot(opt))


def test_names_need_a_named_optimizer():
    model = net()
    opt = FedAvg(model.parameters())
    with pytest.raises(ValueError, match="named_parameters"):
        opt.flatten_update(named_updates(model, 1)[0])


# --------------------------------------------------------------------------- nothing changes first
@pytest.mark.parametrize("case", params_of(one_per_class()))
def test_every_server_optimizer_refuses_bad_input_before_writing(case):
    model = net()
    opt = case.make(model.parameters())
    N = opt.numel
    opt.step(torch.randn(3, N), [1, 2, 3])
    before = snapshot(opt)
    bad_calls = [
        (lambda: opt.step(torch.randn(3, N + 1)), "length"),
        (lambda: opt.step(torch.randn(3, N), [1.0, -1.0, 1.0]), ">= 0"),
        (lambda: opt.step(torch.randn(3, N), [1.0, float("nan"), 1.0]), "finite"),
        (lambda: opt.step(torch.randn(3, N), [1.0, 1.0]), "3 clients"),
        (lambda: opt.step(torch.randn(3, N).double()), "dtype"),
        (lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]}),
         "one dtype"),
        (lambda: opt.load_state_dict({**opt.state_dict(), "param_groups": []}), "param groups"),
        (lambda: opt.load_state_dict({**opt.state_dict(), "param_groups": [
            {**opt.state_dict()["param_groups"][0], "lr": -1.0}]}), "lr=-1.0"),
    ]
    for call, match in bad_calls:
        with pytest.raises((ValueError, TypeError), match=match):
            call()
        assert_same(before, snapshot(opt))
    assert len(opt.param_groups) == 1


def test_state_dict_of_an_older_version_keeps_this_optimizers_values():
    model = net()
    opt = FedAdam(model.parameters(), lr=0.1, tau=1e-3)
    opt.step(torch.randn(2, opt.numel))
    sd = copy.deepcopy(opt.state_dict())
    del sd["param_groups"][0]["tau"]
    other = FedAdam(net().parameters(), lr=0.2, tau=1e-2)
    other.load_state_dict(sd)
    assert other.param_groups[0]["lr"] == 0.1 and other.param_groups[0]["tau"] == 1e-2


# --------------------------------------------------------------------------- FedLAW
def test_fedlaw_refuses_updates_given_as_client_models():
    model = net()
    proxy = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]
    law = FedLAW(model, proxy, torch.nn.functional.cross_entropy, server_epochs=1)
    x = torch.cat([p.detach().flatten() for p in model.parameters()])
    g = torch.Generator().manual_seed(0)
    updates = torch.stack([0.05 * torch.randn(x.numel(), generator=g) for _ in range(3)])
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="look like updates"):
        law.step(updates, [10, 20, 30])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    # The client models themselves (x - update) are accepted, with any weight form.
    gamma, lam = law.step(x - updates, np.array([10, 20, 30]))
    assert lam.shape == (3,) and float(lam.sum()) == pytest.approx(1.0, rel=1e-5)


# --------------------------------------------------------------------------- weights in every form
WEIGHT_FORMS = {
    "list_int": [1, 2, 3], "list_float": [1.0, 2.0, 3.0], "tuple": (1, 2, 3), "numpy_int": np.array([1, 2, 3]),
    "tensor_int": torch.tensor([1, 2, 3]), "tensor_float64": torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64),
}


@pytest.mark.parametrize("form", list(WEIGHT_FORMS))
def test_weights_accept_the_same_forms_everywhere(form):
    w = WEIGHT_FORMS[form]
    X = torch.randn(3, 11, generator=torch.Generator().manual_seed(2))
    want, _, _ = fp64.aggregate(X, torch.tensor([1.0, 2.0, 3.0]), 1.0)
    out, _ = ops.aggregate(X, w)
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ops.weighted_sum(X, w, 1.0).double(), want, rtol=1e-6, atol=1e-6)
    p = torch.nn.Parameter(torch.zeros(11))
    FedAvg([p], lr=1.0).step(X, w)  # FedAvg normalises: x <- x - sum_i (w_i / sum w) X_i
    torch.testing.assert_close(p.detach().double(), -want / 6.0, rtol=1e-6, atol=1e-6)


def test_bool_weights_are_refused_by_name():
    with pytest.raises(TypeError, match="weights must hold real numbers"):
        ops.aggregate(torch.randn(2, 3), torch.tensor([True, False]))


def test_module_to_vector_takes_a_module_and_the_old_names_warn():
    from fedopt_kernels import utils

    model = net()
    want = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.equal(utils.module_to_vector(model), want)
    with pytest.raises(TypeError, match=r"torch\.nn\.utils\.parameters_to_vector"):
        utils.module_to_vector(model.parameters())
    with pytest.warns(DeprecationWarning, match="module_to_vector"):
        assert torch.equal(utils.parameters_to_vector(model), want)
    with pytest.raises(TypeError, match=r"vector_to_parameters"):
        utils.vector_to_module(want, list(model.parameters()))


def test_state_dict_with_a_scheduler_attached_round_trips():
    """Schedulers add entries (initial_lr, FedDecay's lr_factors dict) to the groups:
    the checks of load_state_dict accept them, and a string where a number belongs is
    refused."""
    from fedopt_kernels.lr_scheduler import RoundAnnealing

    model = net()
    opt = FedAdam(model.parameters(), lr=0.1)
    sched = RoundAnnealing(opt, lr_decay=0.9)
    opt.step(torch.randn(2, opt.numel))
    sched.step()
    sd = copy.deepcopy(opt.state_dict())
    other = FedAdam(net().parameters(), lr=0.1)
    RoundAnnealing(other, lr_decay=0.9)
    other.load_state_dict(sd)
    assert other.param_groups[0]["lr"] == pytest.approx(0.09)
    bad = copy.deepcopy(sd)
    bad["param_groups"][0]["lr"] = "0.1"
    with pytest.raises(ValueError, match="lr='0.1'"):
        other.load_state_dict(bad)
