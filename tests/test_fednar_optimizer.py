"""``FedNAR`` as a torch.optim.Optimizer, against the authors' released recipe."""

from __future__ import annotations

import copy

import pytest
import torch
from sklearn.datasets import load_digits

import python_ref.fednar as ref
from fedopt_kernels.optim import FedNAR

pytestmark = pytest.mark.usefixtures("no_mkldnn")  # CPU matmuls deterministic across the runs


@pytest.fixture(scope="module")
def digits():
    x, y = load_digits(return_X_y=True)
    return torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y)


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def batches(digits, steps, batch=32, seed=0):
    x, y = digits
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(x), (batch,), generator=g)
        yield x[idx], y[idx]


def train_fednar(model, data, device, **kw):
    model = model.to(device)
    opt = FedNAR(model.parameters(), **kw)
    scales = []
    for xb, yb in data:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb.to(device)), yb.to(device)).backward()
        opt.step()
        scales.append(float(opt.last_stats[0].scale))
    return model, scales


def train_recipe(model, data, device, *, lr, weight_decay, max_norm, momentum=0.0, clip=True, wd_in_loss=True):
    """The authors' released recipe: 0.5 wd ||x||^2 in the loss, clip_grad_norm_, SGD."""
    model = model.to(device)
    sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum,
                          weight_decay=0.0 if wd_in_loss else weight_decay)
    for xb, yb in data:
        sgd.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xb.to(device)), yb.to(device))
        if wd_in_loss:
            loss = loss + 0.5 * weight_decay * sum((p * p).sum() for p in model.parameters())
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        sgd.step()
    return model


def _assert_same_model(fused, recipe):
    """The fused run's parameters equal the recipe's to fp32 rounding over the run."""
    for a, b in zip(fused.parameters(), recipe.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_co_mode_equals_authors_recipe(backend, digits, momentum):
    name, device = backend
    kw = dict(lr=0.1, weight_decay=0.05, max_norm=0.5)
    base = make_model()
    fused, scales = train_fednar(copy.deepcopy(base), batches(digits, 20), device, mode="co", momentum=momentum,
                                 backend=name, **kw)
    recipe = train_recipe(copy.deepcopy(base), batches(digits, 20), device, momentum=momentum, **kw)
    assert min(scales) < 1.0  # the clip is really exercised
    _assert_same_model(fused, recipe)


def test_grad_mode_equals_clip_grad_norm_and_sgd(backend, digits):
    name, device = backend
    base = make_model(1)
    fused, scales = train_fednar(copy.deepcopy(base), batches(digits, 20, seed=1), device, lr=0.1,
                                 weight_decay=0.0, max_norm=0.5, mode="grad", backend=name)
    recipe = train_recipe(copy.deepcopy(base), batches(digits, 20, seed=1), device, lr=0.1, weight_decay=0.0,
                          max_norm=0.5, wd_in_loss=False)
    assert min(scales) < 1.0
    _assert_same_model(fused, recipe)
    # With weight decay, mode grad is clip_grad_norm_ followed by SGD(weight_decay=wd).
    fused, _ = train_fednar(copy.deepcopy(base), batches(digits, 20, seed=1), device, lr=0.1, weight_decay=0.05,
                            max_norm=0.5, mode="grad", backend=name)
    recipe = train_recipe(copy.deepcopy(base), batches(digits, 20, seed=1), device, lr=0.1, weight_decay=0.05,
                          max_norm=0.5, wd_in_loss=False)
    _assert_same_model(fused, recipe)


def test_none_mode_equals_sgd_with_weight_decay(backend, digits):
    name, device = backend
    base = make_model(2)
    fused, scales = train_fednar(copy.deepcopy(base), batches(digits, 10, seed=2), device, lr=0.1,
                                 weight_decay=0.01, max_norm=1e-3, mode="none", momentum=0.5, backend=name)
    recipe = train_recipe(copy.deepcopy(base), batches(digits, 10, seed=2), device, lr=0.1, weight_decay=0.01,
                          max_norm=1e-3, momentum=0.5, clip=False, wd_in_loss=False)
    assert set(scales) == {1.0}
    _assert_same_model(fused, recipe)


def test_group_clip_scope_gives_each_param_group_its_own_norm():
    torch.manual_seed(0)
    w1, w2 = torch.nn.Parameter(torch.randn(10)), torch.nn.Parameter(torch.randn(20))
    w1.grad, w2.grad = torch.randn(10) * 5, torch.randn(20) * 0.01
    x1, x2 = w1.detach().clone(), w2.detach().clone()
    opt = FedNAR([{"params": [w1]}, {"params": [w2], "lr": 0.5, "max_norm": 100.0}], lr=0.1,
                 weight_decay=0.01, max_norm=1.0, clip_scope="group")
    opt.step()
    s1 = ref.nar_step_([x1], [w1.grad], lr=0.1, weight_decay=0.01, max_norm=1.0)
    s2 = ref.nar_step_([x2], [w2.grad], lr=0.5, weight_decay=0.01, max_norm=100.0)
    torch.testing.assert_close(w1.detach(), x1)
    torch.testing.assert_close(w2.detach(), x2)
    torch.testing.assert_close(opt.last_stats[0].norm, s1.norm)
    torch.testing.assert_close(opt.last_stats[1].norm, s2.norm)
    assert float(opt.last_stats[0].scale) < 1.0 and float(opt.last_stats[1].scale) == 1.0


def test_params_without_grad_are_left_alone():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    a.grad = torch.ones(3)
    opt = FedNAR([a, b], lr=0.1, momentum=0.9)
    opt.step()
    assert torch.equal(b.detach(), torch.ones(3)) and b not in opt.state
    assert "momentum_buffer" in opt.state[a]
    opt2 = FedNAR([b], lr=0.1)
    opt2.step()
    assert opt2.last_stats == [None]


def test_state_dict_round_trip_continues_identically(digits):
    base = make_model(3)
    data = list(batches(digits, 10, seed=3))

    def run(model, opt, chunk):
        for xb, yb in chunk:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()

    m1 = copy.deepcopy(base)
    o1 = FedNAR(m1.parameters(), lr=0.1, weight_decay=0.01, max_norm=0.5, momentum=0.9)
    run(m1, o1, data)

    m2 = copy.deepcopy(base)
    o2 = FedNAR(m2.parameters(), lr=0.1, weight_decay=0.01, max_norm=0.5, momentum=0.9)
    run(m2, o2, data[:5])
    saved_model, saved_opt = copy.deepcopy(m2.state_dict()), copy.deepcopy(o2.state_dict())
    m3 = make_model(99)
    m3.load_state_dict(saved_model)
    o3 = FedNAR(m3.parameters(), lr=1.0)
    o3.load_state_dict(saved_opt)
    assert o3.param_groups[0]["momentum"] == 0.9 and o3.param_groups[0]["lr"] == 0.1
    run(m3, o3, data[5:])
    for a, b in zip(m1.parameters(), m3.parameters()):
        assert torch.equal(a, b)


def test_closure_and_zero_grad(digits):
    model = make_model(4)
    opt = FedNAR(model.parameters(), lr=0.1)
    xb, yb = next(batches(digits, 1))

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    loss = opt.step(closure)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(
        torch.func.functional_call(model, dict(zip([n for n, _ in model.named_parameters()], before)), (xb,)), yb))
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_loss_decreases_on_digits(digits):
    model = make_model(5)
    opt = FedNAR(model.parameters(), lr=0.1, weight_decay=1e-3, max_norm=10.0)
    x, y = digits
    with torch.no_grad():
        start = float(torch.nn.functional.cross_entropy(model(x), y))
    for xb, yb in batches(digits, 200, seed=5):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    with torch.no_grad():
        end = float(torch.nn.functional.cross_entropy(model(x), y))
    assert end < 0.5 * start


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_torch_compile_step_fullgraph_without_recompiles(momentum):
    """``opt.step`` compiles in one graph (fullgraph=True raises on any break) and a new
    lr / weight decay, held in 0-d tensors, does not recompile.  With momentum the
    buffers are created by the first step, which (as for torch.optim.SGD) gives exactly
    one recompile after it, and none afterwards."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model, eager_model = make_model(6), make_model(6)
    lr, wd = torch.tensor(0.1), torch.tensor(0.01)
    opt = FedNAR(model.parameters(), lr=lr, weight_decay=wd, max_norm=1.0, momentum=momentum)
    eager_opt = FedNAR(eager_model.parameters(), lr=0.1, weight_decay=0.01, max_norm=1.0, momentum=momentum)
    counter = CompileCounterWithBackend("aot_eager")
    compiled_step = torch.compile(opt.step, backend=counter, fullgraph=True)
    xb, yb = torch.randn(8, 64), torch.randint(0, 10, (8,))
    for step, (new_lr, new_wd) in enumerate([(0.1, 0.01), (0.05, 0.02), (0.02, 0.0), (0.3, 0.1), (0.01, 0.05)]):
        lr.fill_(new_lr)
        wd.fill_(new_wd)
        eager_opt.param_groups[0]["lr"], eager_opt.param_groups[0]["weight_decay"] = new_lr, new_wd
        for m, o in ((model, opt), (eager_model, eager_opt)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(xb * (step + 1)), yb).backward()
        compiled_step()
        eager_opt.step()
        for a, b in zip(model.parameters(), eager_model.parameters()):
            torch.testing.assert_close(a, b)
    assert counter.frame_count == (1 if momentum == 0.0 else 2)


def test_whole_training_step_compiles_fullgraph():
    """Forward + backward + ``FedNAR.step()`` in ONE compiled graph (Dynamo traces the
    backward with ``trace_autograd_ops``; ``zero_grad`` stays outside, as PyTorch marks
    ``Optimizer.zero_grad`` untraceable), no recompiles over 5 lr values, same values as
    eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model, eager_model = make_model(7), make_model(7)
    lr = torch.tensor(0.1)
    opt = FedNAR(model.parameters(), lr=lr, weight_decay=torch.tensor(0.01), max_norm=1.0)
    eager_opt = FedNAR(eager_model.parameters(), lr=0.1, weight_decay=0.01, max_norm=1.0)

    def train_step(m, o, xb, yb):
        loss = torch.nn.functional.cross_entropy(m(xb), yb)
        loss.backward()
        o.step()
        return loss.detach()

    counter = CompileCounterWithBackend("aot_eager")
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        compiled = torch.compile(train_step, backend=counter, fullgraph=True)
        xb, yb = torch.randn(8, 64), torch.randint(0, 10, (8,))
        for value in (0.1, 0.05, 0.02, 0.3, 0.01):
            lr.fill_(value)
            eager_opt.param_groups[0]["lr"] = value
            opt.zero_grad()
            eager_opt.zero_grad()
            loss = compiled(model, opt, xb, yb)
            eager_loss = train_step(eager_model, eager_opt, xb, yb)
            torch.testing.assert_close(loss, eager_loss)
            for a, b in zip(model.parameters(), eager_model.parameters()):
                torch.testing.assert_close(a, b)
    assert counter.frame_count == 1
