"""The library's one "do nothing" convention, on every backend (issue 12, "one
multi-tensor design"): every op that can be told to do nothing takes an optional
one-element tensor on the device, read by the kernels (no host sync), and nonzero means
the op writes nothing -- ``found_inf`` of the FedNAR ops (GradScaler's flag, float),
``skip`` of ``aggregate`` and ``server_update_`` (bool).  Zero means the op runs as
without the flag.  The backend contract (``fedopt_kernels.backends``) is called
directly, so each backend is held to it, not only the ops layer above.
"""

from __future__ import annotations

import pytest
import torch

from fedopt_kernels import backends


def _bits(ts):
    return [t.clone() for t in ts]


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _flags(dev, dtype):
    return torch.zeros((), dtype=dtype, device=dev), torch.ones((), dtype=dtype, device=dev)


def test_nar_step_found_inf(backend):
    name, dev = backend
    impl = backends.resolve(name, dev)
    torch.manual_seed(0)
    params = [torch.randn(300, device=dev), torch.randn(7, 3, device=dev)]
    grads = [torch.randn_like(p) for p in params]
    bufs = [torch.randn_like(p) for p in params]
    off, on = _flags(dev, torch.float32)
    before = _bits(params + bufs)
    _, _, skipped = impl.nar_step_(params, grads, bufs, 0.1, None, 0.01, None, 1.0, 0, 0.9, None, on)
    assert bool(skipped) and _equal(params + bufs, before)
    expected_p, expected_b = _bits(params), _bits(bufs)
    impl.nar_step_(expected_p, grads, expected_b, 0.1, None, 0.01, None, 1.0, 0, 0.9, None, None)
    _, _, skipped = impl.nar_step_(params, grads, bufs, 0.1, None, 0.01, None, 1.0, 0, 0.9, None, off)
    assert not bool(skipped) and _equal(params + bufs, expected_p + expected_b)


@pytest.mark.parametrize("form", ["2d", "list"])
def test_aggregate_skip(backend, form):
    name, dev = backend
    impl = backends.resolve(name, dev)
    torch.manual_seed(1)
    X = torch.randn(4, 2051, device=dev)
    clients = X if form == "2d" else list(X.unbind(0))
    w = torch.tensor([0.1, 0.2, 0.3, 0.4], device=dev)
    off, on = _flags(dev, torch.bool)
    out = torch.full((2051,), 7.0, device=dev)
    q, Q = impl.aggregate(clients, w, 1.0, None, out, on)
    assert torch.equal(out, torch.full((2051,), 7.0, device=dev))  # not touched
    assert torch.count_nonzero(q) == 0 and float(Q) == 0.0
    plain = torch.empty(2051, device=dev)
    q_plain, Q_plain = impl.aggregate(clients, w, 1.0, None, plain, None)
    q, Q = impl.aggregate(clients, w, 1.0, None, out, off)
    assert torch.equal(out, plain) and torch.equal(q, q_plain) and torch.equal(Q, Q_plain)
    # the oracle of the values themselves: python_ref's weighted sum
    torch.testing.assert_close(out, (w[:, None] * X).sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rule", [0, 1, 3])
def test_server_update_skip(backend, rule):
    name, dev = backend
    impl = backends.resolve(name, dev)
    torch.manual_seed(2)
    params = [torch.randn(513, device=dev), torch.randn(9, device=dev)]
    updates = [torch.randn_like(p) for p in params]
    m = [torch.randn_like(p) for p in params] if rule else []
    v = [torch.rand_like(p) for p in params] if rule == 3 else []
    off, on = _flags(dev, torch.bool)
    before = _bits(params + m + v)
    impl.server_update_(params, updates, m, v, rule, 0.1, None, 1.0, None, 0.9, 0.99, 1e-3, False, on)
    assert _equal(params + m + v, before)
    ep, em, ev = _bits(params), _bits(m), _bits(v)
    impl.server_update_(ep, updates, em, ev, rule, 0.1, None, 1.0, None, 0.9, 0.99, 1e-3, False, None)
    assert not _equal(ep, params)
    impl.server_update_(params, updates, m, v, rule, 0.1, None, 1.0, None, 0.9, 0.99, 1e-3, False, off)
    assert _equal(params + m + v, ep + em + ev)
