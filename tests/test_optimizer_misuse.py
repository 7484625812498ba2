"""Everyday misuses of FedNAR, its schedulers and the nar ops: each either works as
``torch.optim`` does or fails with a message naming the argument, and a failure
changes nothing (parameters, optimizer state, param groups, scheduler state)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import _fp64_oracle as fp64
from fedopt_kernels import ops
from fedopt_kernels.lr_scheduler import FedDecay, RoundAnnealing
from fedopt_kernels.optim import FedNAR


def snapshot(opt, sched=None):
    """Everything a failed call must leave as it was, deep-copied."""
    params = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
    state = {id(p): copy.deepcopy(s) for p, s in opt.state.items()}
    return params, groups, len(opt.param_groups), state, (copy.deepcopy(sched.state_dict()) if sched else None)


def assert_same(a, b):
    (pa, ga, na, sa, ca), (pb, gb, nb, sb, cb) = a, b
    assert na == nb
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert ga == gb
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        assert all(torch.equal(sa[k][n], sb[k][n]) for n in sa[k])
    assert ca == cb


def model_and_opt(**kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    decay = [model[0].weight, model[1].weight]
    no_decay = [model[0].bias, model[1].bias]
    opt = FedNAR([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=0.1, weight_decay=0.01,
                 max_norm=0.5, momentum=0.9, **kw)
    return model, opt


def backward(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(7, 6, generator=g)).square().sum().backward()


# --------------------------------------------------------------------------- item 7: nothing changes first
@pytest.mark.parametrize("bad", [dict(lr=-1.0), dict(max_norm=2.0), dict(mode="grad"), dict(momentum=1.0),
                                 dict(weight_decay=float("nan"))], ids=str)
def test_rejected_param_group_leaves_the_optimizer_as_it_was(bad):
    model, opt = model_and_opt()
    backward(model)
    opt.step()
    before = snapshot(opt)
    extra = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match=next(iter(bad))):
        opt.add_param_group({"params": [extra], **bad})
    assert_same(before, snapshot(opt))
    # The corrected group is accepted afterwards (the rejected one left no trace).
    opt.add_param_group({"params": [extra]})
    assert len(opt.param_groups) == 3


def test_step_with_a_sparse_gradient_in_the_second_group_updates_no_group():
    model, opt = model_and_opt()
    backward(model)
    opt.step()
    backward(model, seed=2)
    model[1].bias.grad = model[1].bias.grad.to_sparse()
    before = snapshot(opt)
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert_same(before, snapshot(opt))


def test_bad_state_dict_is_refused_and_changes_nothing():
    model, opt = model_and_opt()
    backward(model)
    opt.step()
    before = snapshot(opt)
    good = opt.state_dict()
    cases = [
        ({**good, "param_groups": good["param_groups"][:1]}, "param groups"),
        ({**good, "param_groups": [{**good["param_groups"][0], "lr": -0.5}, good["param_groups"][1]]}, "lr"),
        ({**good, "param_groups": [{**good["param_groups"][0], "max_norm": 3.0}, good["param_groups"][1]]},
         "max_norm must be the same"),
        ({**good, "param_groups": [{**good["param_groups"][0], "nesterov": True}, good["param_groups"][1]]},
         "nesterov=True"),
        ({**good, "clip_scope": "group"}, "clip_scope"),
    ]
    for sd, match in cases:
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(sd)
        assert_same(before, snapshot(opt))


@pytest.mark.parametrize("make", [
    lambda o: FedDecay(o, local_steps=0, beta=0.5),
    lambda o: FedDecay(o, local_steps=4, beta=1.5),
    lambda o: FedDecay(o, local_steps=4, beta=0.5, kind="cosine"),
    lambda o: FedDecay(o, local_steps=4, beta=0.5, per="epoch"),
    lambda o: FedDecay(o, local_steps=4, beta=0.5, per="step", steps_per_epoch=3),
    lambda o: RoundAnnealing(o, lr_decay=0.0),
    lambda o: RoundAnnealing(o, weight_decay_decay=1.5),
    lambda o: RoundAnnealing(o, last_epoch=3),
], ids=["steps0", "beta", "kind", "epoch_without_spe", "spe_with_step", "ra_lr_decay0", "ra_wd_decay", "ra_resume_without_initial"])
def test_rejected_scheduler_leaves_the_optimizer_as_it_was(make):
    model, opt = model_and_opt()
    before = snapshot(opt)
    with pytest.raises((ValueError, KeyError)):  # KeyError: a resume without initial_*, as torch's schedulers
        make(opt)
    assert_same(before, snapshot(opt))
    assert "initial_lr" not in opt.param_groups[0] and "lr_factors" not in opt.param_groups[0]


def test_bad_start_round_changes_no_scheduler_state():
    model, opt = model_and_opt()
    sched = FedDecay(opt, local_steps=4, beta=0.5)
    opt.step()
    sched.step()
    before = snapshot(opt, sched)
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="round_index"):
            sched.start_round(bad)
        assert_same(before, snapshot(opt, sched))


def test_feddecay_per_epoch_needs_steps_per_epoch():
    """Without it, a scheduler stepped per batch would silently decay every batch."""
    _, opt = model_and_opt()
    with pytest.raises(ValueError, match="steps_per_epoch"):
        FedDecay(opt, local_steps=3, beta=0.5, per="epoch")
    sched = FedDecay(opt, local_steps=6, beta=0.5, per="epoch", steps_per_epoch=2)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025, 0.025])  # 0.1 * 0.5 ** (t // 2)


# --------------------------------------------------------------------------- item 8: layouts users have
@pytest.mark.parametrize("param_layout,grad_layout", [(torch.channels_last, torch.contiguous_format),
                                                      (torch.contiguous_format, torch.channels_last)])
@pytest.mark.parametrize("mode", ["co", "grad"])
def test_gradient_in_another_memory_layout_than_its_parameter(param_layout, grad_layout, mode):
    """A channels_last conv weight with a contiguous gradient (and the reverse) steps as
    torch.optim.SGD accepts it: the same numbers as the fp64 oracle on the values."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 3, 3, 3, generator=g)
    grad = torch.randn(4, 3, 3, 3, generator=g)
    p = torch.nn.Parameter(w.clone().to(memory_format=param_layout))
    p.grad = grad.clone().to(memory_format=grad_layout)
    assert p.grad.stride() != p.stride()
    opt = FedNAR([p], lr=0.1, weight_decay=0.05, max_norm=1.0, mode=mode)
    opt.step()
    (want,), _, n, s, _ = fp64.nar_step([w], [grad], None, lr=0.1, weight_decay=0.05, max_norm=1.0, mode=mode)
    assert p.is_contiguous(memory_format=param_layout)  # the parameter keeps its layout
    assert s < 1.0
    torch.testing.assert_close(p.detach(), want)
    torch.testing.assert_close(float(opt.last_stats[0].norm), n, rtol=1e-5, atol=0)


def test_state_dict_of_an_older_version_fills_missing_hyperparameters():
    model, opt = model_and_opt()
    backward(model)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())  # (a state_dict holds the live buffers, as torch's do)
    for group in sd["param_groups"]:
        for key in ("max_norm", "mode", "backend"):
            del group[key]
    del sd["clip_scope"]
    model2, opt2 = model_and_opt()
    opt2.load_state_dict(sd)
    for mine in opt2.param_groups:
        assert mine["max_norm"] == 0.5 and mine["mode"] == "co" and mine["backend"] is None
    # ... and then steps as the original does.
    model2.load_state_dict(model.state_dict())
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        backward(m, seed=5)
        o.step()
    for a, b in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(a, b)


def test_state_dict_of_torch_sgd_loads_and_steps():
    """SGD's groups have no max_norm/mode/backend: this optimizer's values are kept; SGD's
    momentum buffers are FedNAR's (the same heavy-ball rule)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    sgd = torch.optim.SGD([p], lr=0.2, momentum=0.5)
    p.grad = torch.randn(5)
    sgd.step()
    q = torch.nn.Parameter(p.detach().clone())
    opt = FedNAR([q], lr=0.1, max_norm=3.0)
    opt.load_state_dict(sgd.state_dict())
    group = opt.param_groups[0]
    assert group["lr"] == 0.2 and group["momentum"] == 0.5 and group["max_norm"] == 3.0 and group["mode"] == "co"
    torch.testing.assert_close(opt.state[q]["momentum_buffer"], sgd.state[p]["momentum_buffer"])
    q.grad = torch.randn(5)
    opt.step()  # no KeyError
    with pytest.raises(ValueError, match="nesterov=True"):
        FedNAR([q], lr=0.1).load_state_dict(torch.optim.SGD([p], lr=0.1, momentum=0.5, nesterov=True).state_dict())


@pytest.mark.parametrize("which", ["params", "momentum_buffers", "grads"])
def test_nar_ops_refuse_tensors_autograd_would_record(which):
    """As torch's in-place ops refuse a leaf that requires grad; nothing is modified and
    under no_grad (where FedNAR calls them) the same tensors are fine."""
    x = torch.randn(5, requires_grad=which == "params")
    g = torch.randn(5, requires_grad=which == "grads")
    b = torch.randn(5, requires_grad=which == "momentum_buffers")
    before = [x.detach().clone(), b.detach().clone()]
    with pytest.raises(RuntimeError, match=rf"{which}\[0\] requires grad"):
        ops.nar_step_([x], [g], lr=0.1, momentum=0.9, momentum_buffers=[b])
    with pytest.raises(RuntimeError, match=rf"{which}\[0\] requires grad"):
        ops.nar_step_groups_([ops.NarGroup([x], [g], 0.1, 0.0, 0.9, [b])])
    assert torch.equal(x.detach(), before[0]) and torch.equal(b.detach(), before[1])
    name = {"params": "X", "grads": "G", "momentum_buffers": "momentum_buffers"}[which]
    with pytest.raises(RuntimeError, match=rf"{name} requires grad"):
        ops.nar_step_batched_(x.view(1, 5), g.view(1, 5), lr=0.1, momentum=0.9, momentum_buffers=b.view(1, 5))
    with torch.no_grad():
        st = ops.nar_step_([x], [g], lr=0.1, momentum=0.9, momentum_buffers=[b])
    assert st.norm.grad_fn is None and st.scale.grad_fn is None


# --------------------------------------------------------------------------- item 10: torch.compile
def test_compiled_step_with_a_changing_float_lr_equals_eager_and_still_checks_it():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(10))
    q = torch.nn.Parameter(p.detach().clone())
    opt = FedNAR([p], lr=0.1, weight_decay=0.1, max_norm=0.5, backend="cpu")
    eager = FedNAR([q], lr=0.1, weight_decay=0.1, max_norm=0.5, backend="cpu")
    step = torch.compile(lambda: opt.step(), fullgraph=True, backend="eager")
    for lr in (0.1, 0.2, 0.3):
        opt.param_groups[0]["lr"] = eager.param_groups[0]["lr"] = lr
        g = torch.randn(10)
        p.grad, q.grad = g.clone(), g.clone()
        step()
        eager.step()
        assert torch.equal(p, q)
    opt.param_groups[0]["lr"] = -1.0
    before = p.detach().clone()
    with pytest.raises(Exception, match=r"lr must be finite and satisfy lr >= 0\.0"):
        step()
    assert torch.equal(p.detach(), before)


def test_scheduler_with_a_tensor_lr_under_compile_as_the_readme_shows():
    """The pattern of docs/compile.md: a tensor lr that FedDecay fills in place, the scheduler
    stepped outside a compiled (not fullgraph) step; two compilations in all, and the
    same parameters as eager FedNAR with the hand-computed lrs 0.1 * 0.5 ** (t % 4)."""
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    twin = copy.deepcopy(model)
    opt = FedNAR(model.parameters(), lr=torch.tensor(0.1), weight_decay=1e-3, max_norm=1.0)
    sched = FedDecay(opt, local_steps=4, beta=0.5)
    eager = FedNAR(twin.parameters(), lr=0.1, weight_decay=1e-3, max_norm=1.0)
    counter = CompileCounter()

    @torch.compile(backend=counter)
    def step():
        opt.step()

    for t in range(8):
        x = torch.randn(16, 8)
        model(x).square().mean().backward()
        twin(x).square().mean().backward()
        step()
        eager.param_groups[0]["lr"] = 0.1 * 0.5 ** (t % 4)
        eager.step()
        opt.zero_grad()
        eager.zero_grad()
        sched.step()
        for a, b in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.1 * 0.5 ** (8 % 4))
    assert counter.frame_count == 2


def test_scale_and_norm_are_never_tracked_by_autograd():
    model, opt = model_and_opt()
    backward(model)
    opt.step()
    st = opt.last_stats[0]
    assert not st.norm.requires_grad and not st.scale.requires_grad
    assert math.isfinite(float(st.norm))
