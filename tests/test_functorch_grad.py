"""fl/engine/functorch_grad.py: ``torch.func.grad(f, has_aux=True)`` without importing
torch._dynamo -- the same bits as torch's transform (the oracle), under ``vmap`` as the
batched engine uses it, for the layers and losses of the engine's models.  That it
imports no compiler is tested with a whole run (test_startup.py).  The tests call the
transform's own path (``_grad_and_aux``): ``grad_with_aux`` hands over to torch's once
torch._dynamo is imported, as it may be in this process."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from fedopt_kernels.fl.engine import functorch_grad as FG
MODELS = {
    "mlp": lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 33), nn.ReLU(), nn.Linear(33, 10)),
    "cnn": lambda: nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                                 nn.Linear(64, 10)),
    "tanh-logsoftmax": lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 7), nn.Tanh(), nn.Linear(7, 10),
                                             nn.LogSoftmax(-1)),
}


def _problem(name, dtype, clients=3, batch=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    model = MODELS[name]().to(dtype)
    params = {n: torch.randn(clients, *p.shape, generator=gen, dtype=torch.float64).to(dtype) * 0.3
              for n, p in model.named_parameters()}
    x = torch.randn(clients, batch, 1, 8, 8, generator=gen, dtype=torch.float64).to(dtype)
    y = torch.randint(0, 10, (clients, batch), generator=gen)
    return model, params, x, y


def _loss(model):
    def loss(params, x, y):
        out = functional_call(model, params, (x,))
        value = nn.functional.cross_entropy(out.float(), y) if out.dtype != torch.float64 else \
            nn.functional.cross_entropy(out, y)
        return value, value.detach()
    return loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_vmapped_gradient_has_torch_func_grads_bits(name, dtype):
    model, params, x, y = _problem(name, dtype)
    loss = _loss(model)
    ours, ours_aux = vmap(lambda *a: FG._grad_and_aux(loss, a))(params, x, y)
    ref, ref_aux = vmap(grad(loss, has_aux=True))(params, x, y)
    assert ours.keys() == ref.keys()
    for n in ref:
        assert ours[n].dtype == ref[n].dtype and torch.equal(ours[n], ref[n]), n
    assert torch.equal(ours_aux, ref_aux)
    # and the values are the gradient: float64 autograd of each client alone
    if dtype == torch.float64:
        for i in range(x.shape[0]):
            p = {n: t[i].detach().clone().requires_grad_() for n, t in params.items()}
            value = nn.functional.cross_entropy(functional_call(model, p, (x[i],)), y[i])
            g = torch.autograd.grad(value, list(p.values()))
            for (n, _), gi in zip(p.items(), g):
                torch.testing.assert_close(ours[n][i], gi, rtol=1e-12, atol=1e-14)


def test_an_output_that_does_not_depend_on_the_inputs_has_zero_gradient_and_empty_parameters_work():
    def f(p, x):
        value = (x * 2.0).sum()
        return value, value

    p, x = {"w": torch.randn(4, 3), "empty": torch.randn(4, 0)}, torch.randn(4, 7)
    g, aux = vmap(lambda *a: FG._grad_and_aux(f, a))(p, x)
    ref, ref_aux = vmap(grad(f, has_aux=True))(p, x)
    assert torch.equal(g["w"], torch.zeros(4, 3)) and torch.equal(g["w"], ref["w"])
    assert g["empty"].shape == ref["empty"].shape == (4, 0)
    assert torch.equal(aux, ref_aux) and torch.equal(aux, (x * 2.0).sum(1))


def test_bad_functions_are_refused_with_the_reason():
    with pytest.raises(RuntimeError, match="tuple"):
        FG._grad_and_aux(lambda p: p.sum(), (torch.ones(2),))
    with pytest.raises(RuntimeError, match="scalar"):
        FG._grad_and_aux(lambda p: (p * 2, None), (torch.ones(2),))
