"""One client's local training (FedNAR modes, FedProx, SCAFFOLD) against python_ref."""

import pytest
import torch
from torch.func import functional_call

from fedopt_kernels.fl import LocalConfig, LocalTrainer, ScaffoldState, digits
from fedopt_kernels.fl.engine.client import RoundStats
from fedopt_kernels.utils import parameters_layout
from python_ref import fedprox_scaffold as ref

DT = torch.float64


@pytest.fixture(scope="module")
def data():
    ds = digits(seed=0)
    return ds.x_train.to(DT), ds.y_train


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 10)).to(DT)


def _setup(data, **cfg):
    model = _model()
    reference = _model()  # same init; used functionally by the oracle
    x_train, y_train = data
    config = LocalConfig(**{"steps": 6, "batch_size": 16, "lr": 0.1, "max_norm": 1.0, **cfg})
    trainer = LocalTrainer(model, torch.nn.functional.cross_entropy, x_train, y_train, config)
    return trainer, reference, config


def _oracle_grad_fn(reference, data, batches):
    x_train, y_train = data
    layout = parameters_layout(reference)

    def grad_fn(k, x):
        x = x.detach().requires_grad_(True)
        idx = batches[k]
        out = functional_call(reference, layout.unflatten(x), (x_train[idx],))
        loss = torch.nn.functional.cross_entropy(out, y_train[idx])
        return torch.autograd.grad(loss, x)[0]

    return grad_fn


def _batches(trainer, indices, seed, n):
    """The first ``n`` mini-batches the client draws, from the documented rule alone (not
    the trainer's own generator): a CPU generator seeded with ``seed``, a fresh
    ``randperm`` of the client's indices per local epoch, consecutive batches of
    ``batch_size`` (at most the client's size), the ragged tail of each epoch dropped."""
    gen = torch.Generator().manual_seed(seed)
    size = indices.numel()
    bs = min(trainer.config.batch_size, size)
    out = []
    while len(out) < n:
        order = indices[torch.randperm(size, generator=gen)]
        out += [order[i * bs:(i + 1) * bs] for i in range(size // bs)]
    return out[:n]


def _run(trainer, x0, indices, seed, round_index=0, **kw):
    out = torch.empty_like(x0)
    stats = RoundStats(x0.device)
    lr_sum = trainer.train(x0, indices, round_index=round_index, seed=seed, out_update=out, stats=stats, **kw)
    return out, stats, lr_sum


@pytest.mark.parametrize("nar", ["co", "grad", "none"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fednar_client_matches_python_ref(data, nar, momentum):
    trainer, reference, cfg = _setup(data, nar=nar, weight_decay=0.05, momentum=momentum, lr_decay=0.9,
                                     decay_beta=0.7, decay_kind="linear")
    indices = torch.arange(0, 200, 3)
    x0 = torch.randn(trainer.numel, dtype=DT, generator=torch.Generator().manual_seed(1)) * 0.3
    seed, rnd = 123, 3
    batches = _batches(trainer, indices, seed, cfg.steps)
    update, stats, lr_sum = _run(trainer, x0, indices, seed, round_index=rnd)
    lrs = [0.1 * 0.9 ** rnd * max(1 - k * 0.3, 0.0) for k in range(cfg.steps)]
    x_ref, st_ref = ref.local_train(x0, _oracle_grad_fn(reference, data, batches), lrs, weight_decay=0.05,
                                    max_norm=1.0, mode=nar, momentum=momentum)
    torch.testing.assert_close(update, x0 - x_ref, rtol=1e-9, atol=1e-12)
    assert lr_sum == pytest.approx(sum(lrs))
    s = stats.summary()
    clipped = [bool(t.scale < 1) for t in st_ref]
    assert s["clipped_steps"] == sum(clipped)
    if nar != "none":
        assert s["clipped_steps"] > 0  # max_norm=1 is active here
        want = sum(float(t.norm) for t, c in zip(st_ref, clipped) if c) / sum(clipped)
        assert s["mean_clipped_norm"] == pytest.approx(want, rel=1e-9)
    assert s["clip_frequency"] == pytest.approx(sum(clipped) / cfg.steps)


@pytest.mark.parametrize("nar", ["co", "grad"])
def test_fedprox_client_matches_python_ref(data, nar):
    mu = 0.5
    trainer, reference, cfg = _setup(data, nar=nar, weight_decay=0.01, prox_mu=mu, steps=8)
    indices = torch.arange(100, 400, 2)
    x0 = torch.randn(trainer.numel, dtype=DT, generator=torch.Generator().manual_seed(2)) * 0.3
    batches = _batches(trainer, indices, 5, cfg.steps)
    update, _, _ = _run(trainer, x0, indices, 5)
    x_ref, _ = ref.local_train(x0, _oracle_grad_fn(reference, data, batches), [0.1] * cfg.steps, weight_decay=0.01,
                               max_norm=1.0, mode=nar, mu=mu)
    torch.testing.assert_close(update, x0 - x_ref, rtol=1e-9, atol=1e-12)
    # the proximal term really acts: without it the result differs
    x_plain, _ = ref.local_train(x0, _oracle_grad_fn(reference, data, batches), [0.1] * cfg.steps,
                                 weight_decay=0.01, max_norm=1.0, mode=nar)
    assert (x_plain - x_ref).abs().max() > 1e-4


def test_scaffold_client_and_control_variates_match_python_ref(data):
    trainer, reference, cfg = _setup(data, nar="co", weight_decay=0.01, scaffold=True, steps=7, lr_decay=0.95)
    M = 5
    sc = ScaffoldState(M, trainer.numel, device="cpu", dtype=DT)
    g = torch.Generator().manual_seed(3)
    sc.c.copy_(torch.randn(trainer.numel, generator=g, dtype=DT) * 0.05)
    sc.c_clients.copy_(torch.randn(M, trainer.numel, generator=g, dtype=DT) * 0.05)
    c_old, ci_old = sc.c.clone(), sc.c_clients.clone()
    x0 = torch.randn(trainer.numel, dtype=DT, generator=g) * 0.3
    rnd = 2
    lrs = [0.1 * 0.95 ** rnd] * cfg.steps
    deltas = []
    for client, indices in ((1, torch.arange(0, 300, 4)), (3, torch.arange(1, 300, 5))):
        batches = _batches(trainer, indices, 10 + client, cfg.steps)
        update, _, lr_sum = _run(trainer, x0, indices, 10 + client, round_index=rnd, client=client, scaffold=sc)
        x_ref, _ = ref.local_train(x0, _oracle_grad_fn(reference, data, batches), lrs, weight_decay=0.01,
                                   max_norm=1.0, mode="co", c=c_old, c_i=ci_old[client])
        torch.testing.assert_close(update, x0 - x_ref, rtol=1e-9, atol=1e-12)
        ci_ref = ref.scaffold_control_variate(ci_old[client], c_old, x0, x_ref, sum(lrs))
        deltas.append((client, ci_ref))
        assert lr_sum == pytest.approx(sum(lrs))
    # nothing changes before the end of the round (an abandoned round leaves no trace)
    assert torch.equal(sc.c, c_old) and torch.equal(sc.c_clients, ci_old)
    sc.server_update()
    for client, ci_ref in deltas:
        torch.testing.assert_close(sc.c_clients[client], ci_ref, rtol=1e-9, atol=1e-12)
    want_c = ref.scaffold_server_control(c_old, [ci - ci_old[i] for i, ci in deltas], M)
    torch.testing.assert_close(sc.c, want_c, rtol=1e-9, atol=1e-12)
    untouched = [0, 2, 4]
    assert torch.equal(sc.c_clients[untouched], ci_old[untouched])


def test_trainer_keeps_one_flat_copy(data):
    trainer, _, _ = _setup(data)
    x_ptr, g_ptr = trainer.x.data_ptr(), trainer.grad.data_ptr()
    x0 = torch.zeros(trainer.numel, dtype=DT)
    _run(trainer, x0, torch.arange(50), 0)
    _run(trainer, x0, torch.arange(50, 90), 1)
    end_x = x_ptr + trainer.numel * trainer.x.element_size()
    end_g = g_ptr + trainer.numel * trainer.grad.element_size()
    for p in trainer.model.parameters():  # parameters and gradients are still views of the flat buffers
        assert x_ptr <= p.data_ptr() < end_x
        assert g_ptr <= p.grad.data_ptr() < end_g


def test_each_client_starts_from_the_global_vector(data):
    """Training client B after client A gives the same update as training B alone."""
    trainer, _, _ = _setup(data, momentum=0.9)
    x0 = torch.randn(trainer.numel, dtype=DT, generator=torch.Generator().manual_seed(4)) * 0.3
    _run(trainer, x0, torch.arange(0, 100), 7)
    after_a, _, _ = _run(trainer, x0, torch.arange(100, 200), 8)
    fresh, _, _ = _setup(data, momentum=0.9)
    alone, _, _ = _run(fresh, x0, torch.arange(100, 200), 8)
    torch.testing.assert_close(after_a, alone, rtol=0, atol=0)
