"""ASNES: gain ratio edge cases, the weighted generalisation, smoothing, against the oracle."""

import io

import pytest
import torch
from torch import nn

import python_ref.asnes as R
from fedopt_kernels.server import ASNES
from fedopt_kernels.utils import module_to_vector, vector_to_module

SIGMA2_MIN = 1e-6


def linear(N=4, dtype=torch.float64, value=0.0):
    m = nn.Linear(N, 1, bias=False).to(dtype)
    with torch.no_grad():
        m.weight.fill_(value)
    return m


def x_of(m):
    return module_to_vector(m)


def test_single_client_gives_r_one():
    m = linear()
    opt = ASNES(m.parameters(), lr=0.5, momentum=0.9)
    D = torch.tensor([[1.0, -2.0, 0.5, 3.0]], dtype=torch.float64)
    st = opt.step(D)
    assert st.gain_ratio.item() == 1.0 and st.lr_scale.item() == 1.0
    assert st.sigma2.item() == 0.0
    torch.testing.assert_close(st.nu2, torch.dot(D[0], D[0]))
    # eq. 4a-4c from u = 0: u = D, v = 0.9 u + D, x = -0.5 * 1.9 D.
    torch.testing.assert_close(x_of(m), -0.5 * 1.9 * D[0])


def test_one_client_carrying_all_weight_is_the_single_client_case():
    m = linear()
    opt = ASNES(m.parameters(), momentum=0.0)
    D = torch.tensor([[1.0, 2.0, 3.0, 4.0], [-5.0, 1.0, 0.0, 2.0]], dtype=torch.float64)
    st = opt.step(D, [3.0, 0.0])
    assert st.gain_ratio.item() == 1.0 and st.num_clients.item() == 1
    torch.testing.assert_close(x_of(m), -D[0])


def test_identical_updates_hit_the_variance_clamp():
    S = 4
    m = linear()
    opt = ASNES(m.parameters(), lr=1.0, momentum=0.0)
    D = torch.full((S, 4), 0.5, dtype=torch.float64)  # ||D_i||^2 = 1 exactly, ||D||^2 = 1
    st = opt.step(D)
    # sigma2 = S/(S-1) (1 - 1) = 0 -> clamped to 1e-6; nu2 = 1 - 0/S = 1 (unclamped sigma2).
    r = (SIGMA2_MIN + 1.0) / (SIGMA2_MIN / S + 1.0)
    assert st.sigma2.item() == SIGMA2_MIN
    assert st.nu2.item() == 1.0
    assert st.gain_ratio.item() == pytest.approx(r, rel=1e-15, abs=0)
    torch.testing.assert_close(x_of(m), -r * D[0])


def test_all_zero_updates_give_a_finite_r_and_leave_the_model():
    S = 5
    m = linear(value=0.25)
    before = x_of(m)
    opt = ASNES(m.parameters(), lr=1.0, momentum=0.9, smoothing=0.5)
    st = opt.step(torch.zeros(S, 4, dtype=torch.float64))
    # sigma2 clamps to 1e-6, nu2 to 0: r = 1e-6 / (1e-6 / S) = S, finite, and D = 0.
    assert torch.isfinite(st.gain_ratio) and st.gain_ratio.item() == pytest.approx(S, rel=1e-12)
    assert torch.equal(x_of(m), before)
    assert not st.skipped


def test_nu2_uses_the_unclamped_sigma2():
    # Two opposite updates: sigma2 = 2/(2-1) * (1 - 0) = 2 (no clamp); nu2 = 0 - 2/2 = -1 -> 0.
    m = linear(N=1)
    opt = ASNES(m.parameters(), momentum=0.0)
    st = opt.step(torch.tensor([[1.0], [-1.0]], dtype=torch.float64))
    assert st.sigma2.item() == pytest.approx(2.0) and st.nu2.item() == 0.0
    assert st.gain_ratio.item() == pytest.approx(2.0)  # = S: pure noise gives the largest gain


def test_uniform_weights_are_the_papers_formula():
    g = torch.Generator().manual_seed(0)
    S, N = 6, 50
    D = torch.randn(S, N, generator=g, dtype=torch.float64) + 0.3
    Dbar = D.mean(0)
    q, Q = (D * D).sum(1), torch.dot(Dbar, Dbar)
    sigma2 = q.sum() / (S - 1) - S / (S - 1) * Q  # eq. 3, literally
    nu2 = Q - sigma2 / S
    r = (sigma2 + nu2) / (sigma2 / S + nu2)
    assert sigma2 > SIGMA2_MIN and nu2 > 0
    opt = ASNES(linear(N).parameters(), momentum=0.0)
    st = opt.step(D)
    torch.testing.assert_close(st.sigma2, sigma2)
    torch.testing.assert_close(st.nu2, nu2)
    torch.testing.assert_close(st.gain_ratio, r)


def test_weighted_generalisation_duplicate_clients():
    # Weights (2, 1, 1) over updates (a, b, c) give the same D as uniform (a, a, b, c) ...
    g = torch.Generator().manual_seed(3)
    a, b, c = torch.randn(3, 8, generator=g, dtype=torch.float64)
    st_w = ASNES(linear(8).parameters(), momentum=0.0).step(torch.stack([a, b, c]), [2.0, 1.0, 1.0])
    p = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    D = p[0] * a + p[1] * b + p[2] * c
    mean_sq = p[0] * a.dot(a) + p[1] * b.dot(b) + p[2] * c.dot(c)
    sum_p_sq = (p * p).sum()
    sigma2 = (mean_sq - D.dot(D)) / (1 - sum_p_sq)  # Kish: S_eff = 1 / sum p^2 = 8/3
    nu2 = D.dot(D) - sigma2 * sum_p_sq
    S_eff = 1 / sum_p_sq
    torch.testing.assert_close(st_w.sigma2, sigma2.clamp(min=SIGMA2_MIN))
    torch.testing.assert_close(st_w.nu2, nu2.clamp(min=0))
    r = (st_w.sigma2 + st_w.nu2) / (st_w.sigma2 / S_eff + st_w.nu2)
    torch.testing.assert_close(st_w.gain_ratio, r.clamp(1, S_eff))


def test_r_is_within_one_and_S_on_random_data():
    g = torch.Generator().manual_seed(7)
    for trial in range(40):
        S = int(torch.randint(2, 12, (1,), generator=g))
        N = 30
        scale = 10 ** float(torch.empty(1).uniform_(-4, 2, generator=g))
        common = torch.randn(N, generator=g) * float(torch.rand(1, generator=g)) * 3
        D = (common + torch.randn(S, N, generator=g)) * scale
        w = torch.rand(S, generator=g) + 0.05 if trial % 2 else None
        opt = ASNES(linear(N, torch.float32).parameters(), smoothing=0.3 * (trial % 3))
        for _ in range(2):
            st = opt.step(D, w)
            r = st.gain_ratio.item()
            S_eff = S if w is None else float(w.sum() ** 2 / (w * w).sum())
            assert 1.0 <= r <= S_eff * (1 + 1e-6), (trial, r, S_eff)


@pytest.mark.parametrize("smoothing", [0.0, 0.6])
def test_matches_oracle_with_a_dynamic_number_of_clients(smoothing):
    g = torch.Generator().manual_seed(11)
    N = 40
    m = linear(N)
    opt = ASNES(m.parameters(), lr=0.3, momentum=0.85, smoothing=smoothing)
    oracle = R.ASNESReference(x_of(m), lr=0.3, momentum=0.85, smoothing=smoothing)
    for t in range(8):
        S = [5, 2, 9, 1, 3, 7, 4, 6][t]  # includes an S = 1 round
        D = torch.randn(N, generator=g, dtype=torch.float64) * 0.5 + torch.randn(S, N, generator=g,
                                                                              dtype=torch.float64)
        w = torch.randint(1, 50, (S,), generator=g).to(torch.float64)
        st = opt.step(D if t % 2 else list(D.unbind(0)), w)
        r, sigma2, nu2 = oracle.step(list(D.unbind(0)), w / w.sum())
        assert st.gain_ratio.item() == pytest.approx(r, rel=1e-10)
        if sigma2 is not None:
            assert st.sigma2.item() == pytest.approx(sigma2, rel=1e-10)
            assert st.nu2.item() == pytest.approx(nu2, rel=1e-10, abs=1e-12)
        torch.testing.assert_close(x_of(m), oracle.x, rtol=1e-10, atol=1e-12)


def test_smoothing_is_bias_corrected_by_hand():
    m = linear(N=1)
    opt = ASNES(m.parameters(), momentum=0.0, smoothing=0.5)
    # Round 1, updates (1, -1): sigma2 = 2 (1 - 0) = 2, nu2 = 0 - 2/2 -> 0.
    # Round 2, updates (4, 0): D = 2, sigma2 = 2 (8 - 4) = 8, nu2 = 4 - 8/2 = 0.
    st1 = opt.step(torch.tensor([[1.0], [-1.0]], dtype=torch.float64))
    assert st1.sigma2.item() == pytest.approx(2.0)  # b = 0.5 * 2, c = 0.5: debiased 2
    st2 = opt.step(torch.tensor([[4.0], [0.0]], dtype=torch.float64))
    # b = 0.5 * 1 + 0.5 * 8 = 4.5, c = 0.5 * 0.5 + 0.5 = 0.75: 6.
    assert st2.sigma2.item() == pytest.approx(6.0)
    assert st2.nu2.item() == pytest.approx(0.0)


def test_state_dict_round_trip_keeps_the_smoothed_estimates():
    g = torch.Generator().manual_seed(5)
    N = 12
    rounds = [torch.randn(int(S), N, generator=g, dtype=torch.float64) + 0.2 for S in (3, 5, 2, 4, 6, 3)]
    m = linear(N)
    opt = ASNES(m.parameters(), lr=0.4, momentum=0.9, smoothing=0.8)
    for D in rounds[:3]:
        opt.step(D)
    buf = io.BytesIO()
    torch.save((opt.state_dict(), x_of(m)), buf)
    buf.seek(0)
    sd, x = torch.load(buf)
    m2 = linear(N, value=1.0)
    vector_to_module(x, m2)
    opt2 = ASNES(m2.parameters())
    opt2.load_state_dict(sd)
    for D in rounds[3:]:
        s1, s2 = opt.step(D), opt2.step(D)
        assert torch.equal(s1.gain_ratio, s2.gain_ratio) and torch.equal(s1.sigma2, s2.sigma2)
    assert torch.equal(x_of(m), x_of(m2))


def test_nan_client_is_excluded_and_S_counts_the_rest():
    m = linear(N=1)
    opt = ASNES(m.parameters(), momentum=0.0)
    st = opt.step(torch.tensor([[1.0], [float("nan")], [-1.0]], dtype=torch.float64))
    assert st.excluded.tolist() == [False, True, False]
    assert st.num_clients.item() == 2
    assert st.sigma2.item() == pytest.approx(2.0) and st.gain_ratio.item() == pytest.approx(2.0)
    assert torch.isfinite(x_of(m)).all()
