"""FedNAR under ``torch.amp.GradScaler``: unscaled inside the fused step, skipped on overflow.

GradScaler hands an optimizer that declares ``_step_supports_amp_scaling`` its scale and
inf flag as the ``grad_scale`` / ``found_inf`` attributes instead of unscaling the
gradients itself; the oracle here is the classic path: the unscaled gradients stepped by the fp64 oracle
(tests/_fp64_oracle.py).  Every backend runs with the GradScaler of its own device:
on a GPU machine the CUDA and compiled-Triton cases drive ``GradScaler("cuda")`` with
fp16 autocast; here they are skipped, saying so.
"""

from __future__ import annotations

import pytest
import torch

import _fp64_oracle as fp64
from fedopt_kernels.optim import FedNAR

HYPER = dict(lr=0.1, weight_decay=0.01, max_norm=0.5)


def model_and_data(device, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(device)
    return model, torch.randn(64, 16).to(device), torch.randint(0, 4, (64,)).to(device)


def scaled_backward(model, scaler, x, y):
    """fp16 autocast on CUDA (the case GradScaler exists for), bf16 on the CPU."""
    dtype = torch.float16 if x.device.type == "cuda" else torch.bfloat16
    with torch.autocast(x.device.type, dtype=dtype):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()


def test_declares_amp_support():
    assert FedNAR._step_supports_amp_scaling is True


@pytest.mark.parametrize("unscale_first", [False, True], ids=["fused_unscale", "scaler_unscale_"])
@pytest.mark.parametrize("mode", ["co", "grad"])
def test_gradscaler_step_equals_unscaled_oracle_step(backend, mode, unscale_first):
    """Five GradScaler steps against the fp64 oracle on the same gradients unscaled by
    hand; calling ``scaler.unscale_(opt)`` first (allowed, docs/compile.md) gives the same step."""
    name, device = backend
    model, x, y = model_and_data(device)
    opt = FedNAR(model.parameters(), mode=mode, backend=name, **HYPER)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 12)
    for _ in range(5):
        opt.zero_grad()
        scaled_backward(model, scaler, x, y)
        params = [p.detach().clone() for p in model.parameters()]
        unscaled = [p.grad.double() / scaler.get_scale() for p in model.parameters()]
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        want, _, n, _, skipped = fp64.nar_step(params, unscaled, None, mode=mode, **HYPER)
        assert not skipped and not bool(opt.last_stats[0].skipped)
        torch.testing.assert_close(float(opt.last_stats[0].norm), n, rtol=1e-5, atol=1e-7)
        for p, w in zip(model.parameters(), want):
            torch.testing.assert_close(p.detach().cpu(), w, rtol=1e-5, atol=1e-6)
    assert scaler.get_scale() == 2.0 ** 12  # no overflow: the scale never dropped


def test_overflow_skips_without_touching_params_and_the_scale_backs_off(backend):
    name, device = backend
    model, x, y = model_and_data(device, 1)
    opt = FedNAR(model.parameters(), momentum=0.9, backend=name, **HYPER)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 10)
    opt.zero_grad()
    scaled_backward(model, scaler, x, y)
    scaler.step(opt)  # a normal step creates the momentum buffers
    scaler.update()
    before = [p.detach().clone() for p in model.parameters()]
    bufs = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    opt.zero_grad()
    scaled_backward(model, scaler, x, y)
    next(model.parameters()).grad[0, 0] = float("inf")  # an fp16 overflow
    scaler.step(opt)
    scaler.update()
    assert bool(opt.last_stats[0].skipped)
    for p, b, p0, b0 in zip(model.parameters(), [opt.state[p]["momentum_buffer"] for p in model.parameters()],
                            before, bufs):
        assert torch.equal(p, p0) and torch.equal(b, b0)
    assert scaler.get_scale() == 2.0 ** 9  # backoff_factor 0.5
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")  # the scaler cleaned up


@pytest.mark.parametrize("mode", ["co", "grad"])
def test_gradscaler_run_with_an_overflow_step_follows_the_oracle(backend, mode):
    """Five GradScaler steps with momentum over two param groups (``clip_scope="group"``:
    each clipped on its own norm, in its own fused call, with its own lr), the third step with an inf gradient in the second group (as
    an fp16 overflow gives).  On CUDA this is ``GradScaler("cuda")`` over fp16 autocast
    driving the fused kernels; here bf16 on the CPU backends (the CUDA cases skip, saying
    so).

    Every finite step equals the fp64 oracle stepped per group on the gradients unscaled
    by hand (params AND momentum buffers).  On the overflow step BOTH groups keep their
    params and buffers bit-identical and report ``skipped``: the first group's own
    gradients are finite, so only the scaler's ``found_inf`` can skip it (GradScaler
    skips the whole optimizer step).  The scaler halves its scale, and the later steps
    are unscaled by the new one.  The oracle starts each step from the optimizer's
    actual state, so an error shows at the step that makes it."""
    name, device = backend
    model, x, y = model_and_data(device, 2)
    groups = [list(model[0].parameters()), list(model[2].parameters())]
    lrs = [HYPER["lr"], 0.05]
    hyper = {k: v for k, v in HYPER.items() if k != "lr"}
    opt = FedNAR([{"params": groups[0]}, {"params": groups[1], "lr": lrs[1]}], mode=mode, momentum=0.9,
                 backend=name, clip_scope="group", **HYPER)
    scale = 2.0 ** 12
    scaler = torch.amp.GradScaler(device.type, init_scale=scale)
    for step in range(5):
        opt.zero_grad()
        scaled_backward(model, scaler, x, y)
        overflow = step == 2
        if overflow:
            groups[1][0].grad[1, 3] = float("inf")
        x0 = [[p.detach().clone() for p in g] for g in groups]
        b0 = [[opt.state[p]["momentum_buffer"].clone() if p in opt.state else torch.zeros_like(p) for p in g]
              for g in groups]
        unscaled = [[p.grad.double() / scale for p in g] for g in groups]
        scaler.step(opt)
        scaler.update()
        for k, g in enumerate(groups):
            stats = opt.last_stats[k]
            bufs = [opt.state[p]["momentum_buffer"] for p in g]
            if overflow:
                assert bool(stats.skipped), f"group {k} stepped on the overflow step"
                for p, b, p0, bb0 in zip(g, bufs, x0[k], b0[k]):
                    assert torch.equal(p, p0) and torch.equal(b, bb0)
                continue
            want_x, want_b, n, _, skipped = fp64.nar_step(x0[k], unscaled[k], b0[k], mode=mode, momentum=0.9,
                                                          lr=lrs[k], **hyper)
            assert not skipped and not bool(stats.skipped)
            torch.testing.assert_close(float(stats.norm), n, rtol=1e-5, atol=1e-7)
            for p, b, wx, wb in zip(g, bufs, want_x, want_b):
                torch.testing.assert_close(p.detach().cpu(), wx, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(b.cpu(), wb, rtol=1e-5, atol=1e-6)
        if overflow:
            scale /= 2  # backoff_factor 0.5
        assert scaler.get_scale() == scale
    assert scale == 2.0 ** 11  # the run saw exactly one backoff
