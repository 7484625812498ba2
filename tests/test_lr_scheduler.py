"""FedDecay and RoundAnnealing against their formulas ([FedDecay] eq. 7 / B.2, [FedNAR] section 5)."""

import io

import pytest
import torch

from fedopt_kernels.lr_scheduler import FedDecay, RoundAnnealing
from fedopt_kernels.optim import FedNAR


def _opt(lr=0.1, cls=torch.optim.SGD, **kw):
    p = torch.nn.Parameter(torch.zeros(3))
    return cls([p], lr=lr, **kw)


def _lrs(sched, opt, n):
    """The lr used by each of the next n optimizer steps."""
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("kind", ["exponential", "linear"])
def test_feddecay_per_step_matches_formula(kind):
    lr0, K, beta, rd = 0.1, 4, 0.6, 0.9
    opt = _opt(lr0)
    sched = FedDecay(opt, local_steps=K, beta=beta, kind=kind, round_decay=rd)
    got = _lrs(sched, opt, 3 * K)
    want = []
    for t in range(3 * K):
        j, k = divmod(t, K)
        b = beta ** k if kind == "exponential" else max(1 - k * (1 - beta), 0.0)
        want.append(lr0 * rd ** j * b)
    assert got == pytest.approx(want, rel=1e-12, abs=0)


def test_feddecay_linear_reaches_zero():
    opt = _opt(1.0)
    sched = FedDecay(opt, local_steps=6, beta=0.7, kind="linear")
    got = _lrs(sched, opt, 6)
    assert got == pytest.approx([1.0, 0.7, 0.4, 0.1, 0.0, 0.0], abs=1e-12)


@pytest.mark.parametrize("kind", ["exponential", "linear"])
def test_feddecay_per_epoch(kind):
    lr0, K, spe, beta = 0.2, 6, 2, 0.5  # 3 local epochs of 2 steps per round
    opt = _opt(lr0)
    sched = FedDecay(opt, local_steps=K, beta=beta, kind=kind, per="epoch", steps_per_epoch=spe)
    got = _lrs(sched, opt, 2 * K)
    # [FedDecay] eq. 7: beta ** e; appendix B.2: max(1 - e (1 - beta), 0)
    f = [beta ** e if kind == "exponential" else max(1 - e * (1 - beta), 0.0) for e in range(3)]
    want = [lr0 * f[(t % K) // spe] for t in range(2 * K)]
    assert got == pytest.approx(want, rel=1e-12)
    if kind == "exponential":
        assert want[:6] == pytest.approx([0.2, 0.2, 0.1, 0.1, 0.05, 0.05])


def test_feddecay_per_epoch_stepped_once_per_epoch():
    opt = _opt(1.0)
    sched = FedDecay(opt, local_steps=3, beta=0.5, per="epoch", steps_per_epoch=1)  # 3 local epochs per round
    assert _lrs(sched, opt, 6) == pytest.approx([1, 0.5, 0.25, 1, 0.5, 0.25])


@pytest.mark.parametrize("kind", ["exponential", "linear"])
def test_feddecay_beta_zero_is_fedsgd_beta_one_is_fedavg(kind):
    opt = _opt(0.5)
    assert _lrs(FedDecay(opt, local_steps=4, beta=0.0, kind=kind), opt, 8) == [0.5, 0, 0, 0, 0.5, 0, 0, 0]
    opt = _opt(0.5)
    assert _lrs(FedDecay(opt, local_steps=4, beta=1.0, kind=kind), opt, 8) == [0.5] * 8


def test_feddecay_beta_zero_local_training_equals_one_sgd_step():
    """beta=0: K local steps move the model exactly like one gradient step (FedSGD)."""
    torch.manual_seed(0)
    x = torch.randn(40, 5)
    y = torch.randn(40)
    w0 = torch.randn(5)

    def loss(w, k):
        xb, yb = x[8 * k:8 * k + 8], y[8 * k:8 * k + 8]
        return ((xb @ w - yb) ** 2).mean()

    w = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([w], lr=0.1)
    sched = FedDecay(opt, local_steps=5, beta=0.0)
    for k in range(5):
        opt.zero_grad()
        loss(w, k).backward()
        opt.step()
        sched.step()
    w_ref = w0.clone().requires_grad_(True)
    g = torch.autograd.grad(loss(w_ref, 0), w_ref)[0]
    torch.testing.assert_close(w.detach(), w0 - 0.1 * g, rtol=0, atol=0)


def test_feddecay_state_dict_round_trip():
    opt = _opt(0.3)
    sched = FedDecay(opt, local_steps=5, beta=0.8, kind="linear", round_decay=0.95)
    _lrs(sched, opt, 7)
    buf = io.BytesIO()
    torch.save(sched.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    opt2 = _opt(0.3)
    sched2 = FedDecay(opt2, local_steps=1, beta=1.0)  # different settings, all restored from the state
    sched2.load_state_dict(state)
    opt2.param_groups[0]["lr"] = opt.param_groups[0]["lr"]
    assert (sched2.local_steps, sched2.beta, sched2.kind, sched2.round_decay) == (5, 0.8, "linear", 0.95)
    assert _lrs(sched2, opt2, 9) == pytest.approx(_lrs(sched, opt, 9), rel=0, abs=0)


def test_feddecay_start_round_and_with_fednar():
    p = torch.nn.Parameter(torch.ones(4))
    opt = FedNAR([p], lr=0.2, weight_decay=0.01, max_norm=10.0)
    sched = FedDecay(opt, local_steps=3, beta=0.5, round_decay=0.9)
    sched.start_round(2)
    assert sched.position() == (2, 0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2 * 0.81)
    p.grad = torch.ones(4)
    lrs = _lrs(sched, opt, 3)
    assert lrs == pytest.approx([0.2 * 0.81, 0.2 * 0.81 * 0.5, 0.2 * 0.81 * 0.25])
    assert sched.get_last_lr()[0] == pytest.approx(0.2 * 0.9 ** 3)  # first step of round 3


@pytest.mark.parametrize("kwargs, match", [
    (dict(local_steps=0, beta=0.5), "local_steps"),
    (dict(local_steps=3, beta=1.5), "beta"),
    (dict(local_steps=3, beta=-0.1), "beta"),
    (dict(local_steps=3, beta=0.5, kind="cosine"), "kind"),
    (dict(local_steps=3, beta=0.5, per="round"), "per"),
    (dict(local_steps=3, beta=0.5, steps_per_epoch=2), "steps_per_epoch"),
    (dict(local_steps=3, beta=0.5, per="epoch", steps_per_epoch=0), "steps_per_epoch"),
    (dict(local_steps=3, beta=0.5, round_decay=0.0), "round_decay"),
])
def test_feddecay_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FedDecay(_opt(), **kwargs)


def test_round_annealing_lr_and_weight_decay():
    p = torch.nn.Parameter(torch.ones(4))
    opt = FedNAR([p], lr=0.01, weight_decay=1e-3, max_norm=10.0)
    sched = RoundAnnealing(opt, lr_decay=0.998, weight_decay_decay=0.9)
    p.grad = torch.zeros(4)
    for t in range(6):
        g = opt.param_groups[0]
        assert g["lr"] == pytest.approx(0.01 * 0.998 ** t, rel=1e-12)
        assert g["weight_decay"] == pytest.approx(1e-3 * 0.9 ** t, rel=1e-12)
        opt.step()
        sched.step()
    assert sched.get_last_weight_decay() == [pytest.approx(1e-3 * 0.9 ** 6)]


def test_round_annealing_default_is_fednar_paper_and_round_trips():
    opt = _opt(0.01, weight_decay=5e-4)
    sched = RoundAnnealing(opt)
    assert sched.lr_decay == 0.998 and sched.weight_decay_decay == 1.0
    _lrs(sched, opt, 10)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * 0.998 ** 10)
    assert opt.param_groups[0]["weight_decay"] == 5e-4  # no extra factor by default
    state = sched.state_dict()
    opt2 = _opt(0.01, weight_decay=5e-4)
    sched2 = RoundAnnealing(opt2, lr_decay=0.5)
    sched2.load_state_dict(state)
    opt2.param_groups[0]["lr"] = opt.param_groups[0]["lr"]
    assert _lrs(sched2, opt2, 5) == pytest.approx(_lrs(sched, opt, 5), rel=0, abs=0)


def test_round_annealing_rejects_bad_decay():
    with pytest.raises(ValueError, match="lr_decay"):
        RoundAnnealing(_opt(), lr_decay=1.5)
    with pytest.raises(ValueError):
        RoundAnnealing(_opt(), weight_decay_decay=0.0)


@pytest.mark.parametrize("order", ["feddecay_first", "annealing_first"])
@pytest.mark.parametrize("beta", [0.6, 0.0])
def test_feddecay_and_round_annealing_on_one_optimizer_multiply(order, beta):
    """Issue 11: the two schedulers chain like torch.optim.lr_scheduler schedulers.  In
    round j, local step k the lr is lr_0 * 0.998^j ([FedNAR] section 5) * beta^k
    ([FedDecay] eq. 7) -- neither overwrites the other, whichever is built first,
    also with beta = 0 (a factor of 0 inside the round, 1 again at the next round)."""
    lr0, K, R, decay = 0.05, 4, 4, 0.998
    p = torch.nn.Parameter(torch.ones(3))
    opt = FedNAR([p], lr=lr0, weight_decay=1e-3, max_norm=10.0)
    if order == "feddecay_first":
        within = FedDecay(opt, local_steps=K, beta=beta)
        rounds = RoundAnnealing(opt, lr_decay=decay)
    else:
        rounds = RoundAnnealing(opt, lr_decay=decay)
        within = FedDecay(opt, local_steps=K, beta=beta)
    p.grad = torch.zeros(3)
    seen = []
    for j in range(R):
        for k in range(K):
            want = lr0 * decay ** j * (beta ** k if k else 1.0)
            assert opt.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12, abs=1e-300), (j, k)
            seen.append(opt.param_groups[0]["lr"])
            opt.step()
            within.step()
        rounds.step()
    assert len(set(seen)) > 2  # both factors really vary

    # resuming both from their state_dicts (and the optimizer's) continues the product
    opt_state, w_state, r_state = opt.state_dict(), within.state_dict(), rounds.state_dict()
    q = torch.nn.Parameter(torch.ones(3))
    opt2 = FedNAR([q], lr=lr0, weight_decay=1e-3, max_norm=10.0)
    w2, r2 = FedDecay(opt2, local_steps=K, beta=beta), RoundAnnealing(opt2, lr_decay=decay)
    opt2.load_state_dict(opt_state)
    w2.load_state_dict(w_state)
    r2.load_state_dict(r_state)
    assert opt2.param_groups[0]["lr"] == pytest.approx(lr0 * decay ** R, rel=1e-12)
    q.grad = torch.zeros(3)
    opt2.step()
    w2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(lr0 * decay ** R * beta, rel=1e-12, abs=1e-300)
