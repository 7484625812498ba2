"""FedNAR under ``torch.amp.GradScaler``: unscaled inside the fused step, skipped on overflow.

GradScaler hands an optimizer that declares ``_step_supports_amp_scaling`` its scale and
inf flag as the ``grad_scale`` / ``found_inf`` attributes instead of unscaling the
gradients itself; the oracle here is the classic path: ``scaler.unscale_`` followed by
the python_ref step on the unscaled gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch

import python_ref.fednar as ref
from fedopt_kernels.optim import FedNAR

HYPER = dict(lr=0.1, weight_decay=0.01, max_norm=0.5)


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return model, torch.randn(64, 16), torch.randint(0, 4, (64,))


def scaled_backward(model, scaler, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()


def test_declares_amp_support():
    assert FedNAR._step_supports_amp_scaling is True


@pytest.mark.parametrize("mode", ["co", "grad"])
def test_gradscaler_step_equals_unscale_then_reference_step(backend, mode):
    name, device = backend
    if device.type != "cpu":
        pytest.skip("this test drives the CPU GradScaler")
    model, x, y = model_and_data()
    oracle = copy.deepcopy(model)
    opt = FedNAR(model.parameters(), mode=mode, backend=name, **HYPER)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    scaler_ref = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    for _ in range(5):
        opt.zero_grad()
        scaled_backward(model, scaler, x, y)
        scaler.step(opt)
        scaler.update()
        # The oracle: unscale in a separate pass, then the plain reference step.
        for p in oracle.parameters():
            p.grad = None
        scaled_backward(oracle, scaler_ref, x, y)
        grads = [p.grad.clone() for p in oracle.parameters()]
        inv = 1.0 / scaler_ref.get_scale()
        unscaled = [g * inv for g in grads]
        with torch.no_grad():
            st = ref.nar_step_(list(oracle.parameters()), unscaled, mode=mode, **HYPER)
        scaler_ref.update(scaler_ref.get_scale())  # keep the same scale as the fused run
        assert not bool(st.skipped)
        torch.testing.assert_close(opt.last_stats[0].norm, st.norm, rtol=1e-5, atol=1e-7)
    for a, b in zip(model.parameters(), oracle.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert scaler.get_scale() == 2.0 ** 12  # no overflow: the scale never dropped


def test_overflow_skips_without_touching_params_and_the_scale_backs_off(backend):
    name, device = backend
    if device.type != "cpu":
        pytest.skip("this test drives the CPU GradScaler")
    model, x, y = model_and_data(1)
    opt = FedNAR(model.parameters(), momentum=0.9, backend=name, **HYPER)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    opt.zero_grad()
    scaled_backward(model, scaler, x, y)
    scaler.step(opt)  # a normal step creates the momentum buffers
    scaler.update()
    before = [p.detach().clone() for p in model.parameters()]
    bufs = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    opt.zero_grad()
    scaled_backward(model, scaler, x, y)
    next(model.parameters()).grad[0, 0] = float("inf")  # an fp16-style overflow
    scaler.step(opt)
    scaler.update()
    assert bool(opt.last_stats[0].skipped)
    for p, b, p0, b0 in zip(model.parameters(), [opt.state[p]["momentum_buffer"] for p in model.parameters()],
                            before, bufs):
        assert torch.equal(p, p0) and torch.equal(b, b0)
    assert scaler.get_scale() == 2.0 ** 9  # backoff_factor 0.5
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")  # the scaler cleaned up
