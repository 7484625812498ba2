"""The differentiable aggregation ``weighted_sum`` on every backend (CUDA and compiled
Triton on a GPU machine, skipped with the reason here): values and gradients against the
fp64 oracle (tests/_fp64_oracle.py), gradcheck, clients constant."""

import pytest
import torch

import _fp64_oracle as fp64
from fedopt_kernels.ops import weighted_sum


def make(C=4, N=37, dtype=torch.float64, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(C, N, generator=g, dtype=dtype)
    w = torch.rand(C, generator=g, dtype=dtype) + 0.1
    return X.to(device), w.to(device)


@pytest.mark.parametrize("as_list", [False, True])
def test_forward_matches_oracle(backend, as_list):
    name, device = backend
    X, w = make(dtype=torch.float32, device=device)
    clients = list(X.unbind(0)) if as_list else X
    out = weighted_sum(clients, w, 0.7, backend=name)
    expected, _, _ = fp64.aggregate(X, w, 0.7)
    assert out.dtype == torch.float32 and out.device.type == device.type
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("as_list", [False, True])
def test_gradcheck_float64(backend, as_list):
    name, device = backend
    backend = name
    X, w = make(device=device)
    clients = [x.clone() for x in X.unbind(0)] if as_list else X.clone()
    w = w.requires_grad_(True)
    gamma = torch.tensor(0.8, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, g: weighted_sum(clients, a, g, backend=backend), (w, gamma))


def test_gradients_match_the_chain_rule(backend):
    name, device = backend
    X, w = make(device=device)
    w = w.requires_grad_(True)
    gamma = torch.tensor(1.3, dtype=torch.float64, device=device, requires_grad=True)
    G = torch.randn(X.shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(device)
    (weighted_sum(X, w, gamma, backend=name) * G).sum().backward()
    gw, gg = fp64.weighted_sum_grads(X, w.detach(), gamma.detach(), G)
    torch.testing.assert_close(w.grad.cpu(), gw)
    torch.testing.assert_close(float(gamma.grad), gg)
    # Against plain autograd through an explicit sum as well.
    w2 = w.detach().clone().requires_grad_(True)
    g2 = gamma.detach().clone().requires_grad_(True)
    ((g2 * (w2[:, None] * X).sum(0)) * G).sum().backward()
    torch.testing.assert_close(w.grad, w2.grad)
    torch.testing.assert_close(gamma.grad, g2.grad)


@pytest.mark.parametrize("as_list", [False, True])
def test_clients_are_constants(as_list):
    X, w = make()
    X = X.requires_grad_(True)
    clients = list(X.unbind(0)) if as_list else X
    w = w.requires_grad_(True)
    out = weighted_sum(clients, w, 1.0)
    out.sum().backward()
    assert X.grad is None  # no gradient buffer for the clients
    assert w.grad is not None


def test_gamma_as_number_only_weights_get_grad():
    X, w = make()
    w = w.requires_grad_(True)
    out = weighted_sum(X, w, 2.0)
    out.sum().backward()
    torch.testing.assert_close(w.grad, 2.0 * X.sum(1))


def test_bad_input():
    X, w = make()
    with pytest.raises(ValueError, match="weights"):
        weighted_sum(X, w[:3], 1.0)
    with pytest.raises(ValueError, match="gamma"):
        weighted_sum(X, w, 0.0)
    with pytest.raises(ValueError, match=r"clients\[1\]"):
        weighted_sum([X[0], X[1, :5].clone()], w[:2], 1.0)


def test_float_gamma_keeps_fp64_precision(backend):
    """gamma = 0.1 (not exact in fp32) on fp64 clients: the result is gamma in fp64 times
    the sum, not 0.1 rounded to fp32 (0.10000000149...), which is 1.5e-8 relatively off."""
    name, device = backend
    X, w = make(device=device)
    out = weighted_sum(X, w, 0.1, backend=name)
    want, _, _ = fp64.aggregate(X, w, 0.1)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-13, atol=1e-15)
