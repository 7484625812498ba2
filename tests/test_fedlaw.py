"""FedLAW on a small real dataset (scikit-learn's digits, shipped with the package)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import python_ref.fedlaw as R
import sklearn.datasets as sklearn_datasets  # a hard dependency (pyproject): its absence fails
from fedopt_kernels.server import FedLAW
from fedopt_kernels.utils import module_to_vector, vector_to_module

N_CLIENTS = 4
CORRUPTED = N_CLIENTS - 1


def mlp(seed=0, bn=False):
    torch.manual_seed(seed)
    if bn:
        return nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def train(model, x, y, epochs, lr=0.1, batch=32):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(epochs):
        for b in range(0, len(y), batch):
            opt.zero_grad()
            F.cross_entropy(model(x[b:b + batch]), y[b:b + batch]).backward()
            opt.step()


@pytest.fixture(scope="module")
def digits():
    """A proxy set of 10 digits per class, and N_CLIENTS clients trained for 10 epochs
    from one common start on equal IID shares of the rest; the last client's labels are
    replaced by random ones."""
    X, y = sklearn_datasets.load_digits(return_X_y=True)
    X = torch.tensor(X, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(y), generator=g)
    X, y = X[perm], y[perm]
    proxy_idx = torch.cat([(y == c).nonzero().flatten()[:10] for c in range(10)])
    rest = torch.ones(len(y), dtype=torch.bool)
    rest[proxy_idx] = False
    Xp, yp = X[proxy_idx], y[proxy_idx]
    Xr, yr = X[rest], y[rest]
    order = torch.randperm(100, generator=g)
    proxy = [(Xp[order[i:i + 50]], yp[order[i:i + 50]]) for i in (0, 50)]

    start = module_to_vector(mlp())
    clients, sizes = [], []
    for i, idx in enumerate(torch.tensor_split(torch.arange(len(yr)), N_CLIENTS)):
        m = mlp()
        vector_to_module(start, m)
        xi, yi = Xr[idx], yr[idx]
        if i == CORRUPTED:
            yi = torch.randint(0, 10, yi.shape, generator=g)
        torch.manual_seed(100 + i)
        train(m, xi, yi, epochs=10)
        clients.append(module_to_vector(m))
        sizes.append(len(idx))
    return dict(start=start, clients=clients, sizes=sizes, proxy=proxy)


def fresh_model(d, bn=False):
    m = mlp(bn=bn)
    if not bn:
        vector_to_module(d["start"], m)
    return m


def data_size_weights(sizes):
    s = torch.tensor(sizes, dtype=torch.float32)
    return s / s.sum()


def test_learned_weights_beat_the_data_size_average_and_spot_the_corrupted_client(digits):
    model = fresh_model(digits)
    fedlaw = FedLAW(model, digits["proxy"], F.cross_entropy, learn="both", server_epochs=20)
    gamma, lam = fedlaw.step(digits["clients"], digits["sizes"])
    clients, proxy = digits["clients"], digits["proxy"]
    one = torch.tensor(1.0)
    loss_start = R.proxy_loss(model, clients, one, data_size_weights(digits["sizes"]), proxy, F.cross_entropy)
    loss_learned = R.proxy_loss(model, clients, gamma, lam, proxy, F.cross_entropy)
    assert loss_learned < loss_start
    assert lam[CORRUPTED] < lam[:CORRUPTED].min()
    assert gamma > 0 and torch.all(lam > 0)
    torch.testing.assert_close(lam.sum(), torch.tensor(1.0))
    # The model now holds gamma * sum_i lambda_i w_i.
    expected = gamma * sum(l * w for l, w in zip(lam, clients))
    torch.testing.assert_close(module_to_vector(model), expected, rtol=1e-5, atol=1e-6)
    # The loss of the model itself (not re-aggregated) agrees.
    with torch.no_grad():
        direct = torch.stack([F.cross_entropy(model(x), y) for x, y in proxy]).mean()
    torch.testing.assert_close(direct, loss_learned, rtol=1e-5, atol=1e-6)
    rnd = fedlaw.last_round
    assert rnd.losses.shape == (20,) and rnd.losses[-1] < rnd.losses[0]
    assert not rnd.skipped and not rnd.excluded.any()


@pytest.mark.parametrize("learn, swa", [("both", False), ("gamma", False), ("lambda", False), ("both", True),
                                        ("lambda", True)])
def test_matches_the_paper_literal_oracle(digits, learn, swa):
    kw = dict(learn=learn, server_epochs=8, swa=swa, swa_start=1, lr_step=(3, 0.5))
    model = fresh_model(digits)
    gamma, lam = FedLAW(model, digits["proxy"], F.cross_entropy, **kw).step(digits["clients"], digits["sizes"])
    ref_model = fresh_model(digits)
    g_ref, lam_ref = R.fedlaw(ref_model, digits["clients"], digits["sizes"], digits["proxy"], F.cross_entropy, **kw)
    torch.testing.assert_close(gamma, g_ref, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(lam, lam_ref, rtol=1e-4, atol=1e-6)
    if learn == "gamma":
        assert torch.equal(lam, data_size_weights(digits["sizes"]))  # lambda stays the data-size weights
        assert gamma != 1.0
    if learn == "lambda":
        assert gamma.item() == 1.0  # gamma stays 1
        assert not torch.equal(lam, data_size_weights(digits["sizes"]))


def test_variants_each_lower_the_proxy_loss(digits):
    clients, proxy, sizes = digits["clients"], digits["proxy"], digits["sizes"]
    start = R.proxy_loss(fresh_model(digits), clients, torch.tensor(1.0), data_size_weights(sizes), proxy,
                         F.cross_entropy)
    for learn in ("gamma", "lambda"):
        model = fresh_model(digits)
        gamma, lam = FedLAW(model, proxy, F.cross_entropy, learn=learn, server_epochs=10).step(clients, sizes)
        assert R.proxy_loss(model, clients, gamma, lam, proxy, F.cross_entropy) < start


def test_client_models_as_modules_tensor_or_list(digits):
    clients, sizes, proxy = digits["clients"], digits["sizes"], digits["proxy"]
    kw = dict(server_epochs=3)
    results = []
    for form in ("list", "tensor", "modules"):
        if form == "tensor":
            arg = torch.stack(clients)
        elif form == "modules":
            arg = []
            for c in clients:
                m = mlp()
                vector_to_module(c, m)
                arg.append(m)
        else:
            arg = clients
        model = fresh_model(digits)
        results.append(FedLAW(model, proxy, F.cross_entropy, **kw).step(arg, sizes))
    for g, lam in results[1:]:
        assert torch.equal(g, results[0][0]) and torch.equal(lam, results[0][1])


def test_nonfinite_and_empty_clients_are_left_out(digits):
    clients = [c.clone() for c in digits["clients"]]
    clients[1][7] = float("nan")
    sizes = list(digits["sizes"])
    sizes[2] = 0
    model = fresh_model(digits)
    fedlaw = FedLAW(model, digits["proxy"], F.cross_entropy, server_epochs=4)
    gamma, lam = fedlaw.step(clients, sizes)
    assert lam[1] == 0 and lam[2] == 0 and lam.sum().item() == pytest.approx(1.0)
    assert fedlaw.last_round.excluded.tolist() == [False, True, False, False]
    assert torch.isfinite(module_to_vector(model)).all()
    # Same as running on the usable clients alone.
    keep = [0, 3]
    model2 = fresh_model(digits)
    g2, lam2 = FedLAW(model2, digits["proxy"], F.cross_entropy, server_epochs=4).step(
        [clients[i] for i in keep], [sizes[i] for i in keep])
    torch.testing.assert_close(gamma, g2)
    torch.testing.assert_close(lam[keep], lam2)
    torch.testing.assert_close(module_to_vector(model), module_to_vector(model2))


def test_all_clients_unusable_leaves_the_model_unchanged(digits):
    model = fresh_model(digits)
    before = module_to_vector(model)
    bad = [torch.full_like(c, float("nan")) for c in digits["clients"]]
    fedlaw = FedLAW(model, digits["proxy"], F.cross_entropy, server_epochs=2)
    gamma, lam = fedlaw.step(bad, digits["sizes"])
    assert fedlaw.last_round.skipped and gamma.item() == 1.0 and torch.all(lam == 0)
    assert torch.equal(module_to_vector(model), before)


@pytest.mark.parametrize("train_mode", [True, False])
def test_batchnorm_buffers_are_not_aggregated_and_stay_sane(digits, train_mode):
    proxy = digits["proxy"]
    X = torch.cat([x for x, _ in proxy])
    model = mlp(bn=True)
    start = module_to_vector(model)
    clients = []
    for i in range(3):
        m = mlp(bn=True)
        vector_to_module(start, m)
        torch.manual_seed(i)
        noisy = X + 0.1 * torch.randn_like(X)
        train(m, noisy, torch.cat([y for _, y in proxy]), epochs=3)
        clients.append(module_to_vector(m))
    model.eval()  # the caller's mode must be restored
    bn = model[1]
    buffers_before = {n: b.clone() for n, b in model.named_buffers()}
    epochs = 3
    gamma, lam = FedLAW(model, proxy, F.cross_entropy, server_epochs=epochs, train_mode=train_mode).step(
        clients, [1, 1, 1])
    assert not model.training
    assert torch.isfinite(gamma) and torch.isfinite(lam).all()
    assert torch.isfinite(bn.running_mean).all() and (bn.running_var > 0).all() and torch.isfinite(bn.running_var).all()
    assert bn.num_batches_tracked.dtype == torch.int64
    if train_mode:
        # Updated in place by every proxy batch (the released code's behaviour), not averaged.
        assert bn.num_batches_tracked.item() == epochs * len(proxy)
        assert not torch.equal(bn.running_mean, buffers_before["1.running_mean"])
        with torch.no_grad():
            h = F.linear(X, model[0].weight, model[0].bias)
        # BN's running mean is the EMA (momentum 0.1, from 0) of the proxy batch means
        # of the aggregated model: after k batches about (1 - 0.9^k) of their mean.
        k = epochs * len(proxy)
        err = (bn.running_mean - (1 - 0.9 ** k) * h.mean(0)).abs().max()
        assert err < 0.1 * h.mean(0).abs().max() + 0.03
    else:
        for n, b in model.named_buffers():
            assert torch.equal(b, buffers_before[n]), n
    with torch.no_grad():
        assert torch.isfinite(model(X)).all()


def test_bad_arguments(digits):
    model, proxy = fresh_model(digits), digits["proxy"]
    with pytest.raises(ValueError, match="learn must be one of"):
        FedLAW(model, proxy, F.cross_entropy, learn="weights")
    with pytest.raises(ValueError, match="swa=True averages the logits"):
        FedLAW(model, proxy, F.cross_entropy, learn="gamma", swa=True)
    with pytest.raises(ValueError, match="server_epochs"):
        FedLAW(model, proxy, F.cross_entropy, server_epochs=0)
    with pytest.raises(ValueError, match="betas"):
        FedLAW(model, proxy, F.cross_entropy, betas=(0.5, 1.0))
    with pytest.raises(ValueError, match="lr"):
        FedLAW(model, proxy, F.cross_entropy, lr=0.0)
    with pytest.raises(TypeError, match="re-iterable"):
        FedLAW(model, iter(proxy), F.cross_entropy)
    with pytest.raises(TypeError, match="loss_fn"):
        FedLAW(model, proxy, None)
    fedlaw = FedLAW(model, proxy, F.cross_entropy, server_epochs=1)
    before = module_to_vector(model)
    clients, sizes = digits["clients"], digits["sizes"]
    with pytest.raises(ValueError, match="data_sizes has 3 entries but there are 4 clients"):
        fedlaw.step(clients, sizes[:3])
    with pytest.raises(ValueError, match="data_sizes must be >= 0"):
        fedlaw.step(clients, [1, -1, 1, 1])
    with pytest.raises(ValueError, match="data_sizes must not all be zero"):
        fedlaw.step(clients, [0, 0, 0, 0])
    with pytest.raises(ValueError, match=r"client_models\[2\] has 5 elements but the model has"):
        fedlaw.step([clients[0], clients[1], clients[2][:5], clients[3]], sizes)
    with pytest.raises(ValueError, match=r"client_models\[0\] has dtype torch.float64"):
        fedlaw.step([c.double() for c in clients], sizes)
    with pytest.raises(ValueError, match=r"client_models\[1\] does not have the global model's parameters"):
        fedlaw.step([mlp(), nn.Linear(64, 10)], [1, 1])
    with pytest.raises(ValueError, match="at least one client"):
        fedlaw.step([], [])
    assert torch.equal(module_to_vector(model), before)
