"""Differential privacy: the clipped sum (every backend) against a float64 oracle, the
noise's statistics and bits, DP-FedAvg through a server optimizer, adaptive clipping
against a hand-computed trajectory (Andrew et al. 2021, Algorithm 1), and the settings
that would void the guarantee.  The accountant: test_dp_accounting.py."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fedopt_kernels.ops import aggregate
from fedopt_kernels.ops.dp_noise import (CLIENT_CLIP_MARGIN, CLIP_EPS, clip_updates_, clipped_sum,
                                        gaussian_noise_)
from fedopt_kernels.server import ASNES, FedAdam, FedAvg, FedExP
from fedopt_kernels.server.differential_privacy.dp import DPAggregator, dp_noise_key, effective_noise_multiplier
from python_ref import gaussian_noise as noise_ref
from _asserts import assert_bitwise

REPO = Path(__file__).resolve().parents[1]
ACC = {torch.float32: torch.float32, torch.float16: torch.float32, torch.bfloat16: torch.float32,
       torch.float64: torch.float64}


def oracle_clipped_sum(X, clip, w=None, scale=1.0):
    """float64: ``scale * sum_i w_i min(1, C / (||X_i|| + 1e-6)) X_i`` over finite rows
    (the others weight 0, nobody rescaled), with the factors and unclipped bits."""
    X = X.detach().cpu().double()
    C = X.shape[0]
    w = torch.ones(C, dtype=torch.float64) if w is None else torch.as_tensor(w, dtype=torch.float64)
    finite = torch.isfinite(X).all(dim=1)
    norms = torch.where(finite, X.nan_to_num(0.0).norm(dim=1), torch.zeros(C, dtype=torch.float64))
    factors = torch.where(finite, torch.clamp(clip / (norms + CLIP_EPS), max=1.0), torch.ones(C, dtype=torch.float64))
    eff = torch.where(finite, w * factors, torch.zeros(C, dtype=torch.float64))
    out = scale * (eff.unsqueeze(1) * X.nan_to_num(0.0)).sum(0)
    return out, factors, eff, finite & (norms <= clip), norms


def assert_sum_close(out, want, X, eff, scale, dtype):
    """Within the error of an fp32 (fp64) sum of ``C`` terms, each factor itself a few
    roundings off: ``(C + 8) u_acc scale sum_i |eff_i X_i| + 2 u_out |want|``."""
    C = X.shape[0]
    u_acc = torch.finfo(ACC[dtype]).eps / 2
    u_out = torch.finfo(dtype).eps / 2
    mass = scale * (eff.unsqueeze(1) * X.detach().cpu().double().nan_to_num(0.0).abs()).sum(0)
    bound = (C + 8) * u_acc * mass + 2 * u_out * want.abs() + torch.finfo(dtype).tiny
    excess = (out.detach().cpu().double() - want).abs() - bound
    assert excess.numel() == 0 or float(excess.max()) <= 0, f"{int((excess > 0).sum())} elements outside the bound"


def clients(C, N, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(C, N, generator=g, dtype=torch.float64) * torch.logspace(-1, 1, C, dtype=torch.float64)[:, None]
    return X.to(dtype).to(device)


# ---------------------------------------------------------------- clipped sum, every backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("C, N", [(1, 1), (2, 7), (5, 1001), (20, 4099)])
def test_clipped_sum_matches_the_float64_oracle(backend, dtype, C, N):
    name, device = backend
    X = clients(C, N, dtype, device)
    norms = X.double().norm(dim=1).cpu().sort().values
    # some clients clipped, some not, none at a tie (the clients' scales differ by 10^(2/C))
    clip = float(norms[0] / 2) if C == 1 else float((norms[C // 2 - 1] + norms[C // 2]) / 2)
    w = torch.linspace(0.3, 1.0, C, dtype=torch.float64)
    out, st = clipped_sum(X, clip, weights=w, scale=1 / C, backend=name)
    want, factors, eff, unclipped, _ = oracle_clipped_sum(X, clip, w, 1 / C)
    assert out.dtype == dtype and out.shape == (N,)
    assert_sum_close(out, want, X, eff, 1 / C, dtype)
    assert st.unclipped.cpu().tolist() == unclipped.tolist()
    torch.testing.assert_close(st.factors.cpu().double(), factors, rtol=1e-5, atol=0)
    assert not st.excluded.any()


def test_clipped_sum_leaves_nonfinite_clients_out_without_rescaling_the_others(backend):
    name, device = backend
    X = clients(4, 513, torch.float32, device)
    X[1, 7] = float("nan")
    X[3, 0] = float("inf")
    out, st = clipped_sum(X, 1.0, scale=0.25, backend=name)
    want, _, eff, unclipped, _ = oracle_clipped_sum(X, 1.0, None, 0.25)
    assert st.excluded.cpu().tolist() == [False, True, False, True]
    assert st.weights.cpu().tolist()[1] == 0 and st.weights.cpu().tolist()[3] == 0
    # the two finite clients keep weight (1 x their clip factor): the sum is NOT the mean of two
    assert_sum_close(out, want, X, eff, 0.25, torch.float32)
    assert st.unclipped.cpu().tolist() == unclipped.tolist() == [bool(unclipped[0]), False, bool(unclipped[2]), False]


def test_clipped_sum_hand_computed():
    # rows of norm 3 and 0.5 along orthogonal axes, clip 1: (3 -> 3 / (3 + 1e-6)) and 0.5 kept
    X = torch.tensor([[3.0, 0.0], [0.0, 0.5]])
    out, st = clipped_sum(X, 1.0, backend="reference")
    assert out.tolist() == pytest.approx([3 / (3 + 1e-6), 0.5], rel=1e-7)
    assert st.unclipped.tolist() == [False, True]
    out, _ = clipped_sum(X, torch.tensor(1.0), weights=[0.5, 1.0], scale=0.5, backend="cpu")  # clip as a tensor
    assert out.tolist() == pytest.approx([0.25 * 3 / (3 + 1e-6), 0.25], rel=1e-7)


def test_clipped_sum_of_empty_vectors():
    out, st = clipped_sum(torch.empty(3, 0), 1.0, backend="cpu")
    assert out.shape == (0,) and st.unclipped.tolist() == [True, True, True]


@pytest.mark.parametrize("call, match", [
    (lambda X: clipped_sum(X, 0.0), "clip"),
    (lambda X: clipped_sum(X, float("nan")), "clip"),
    (lambda X: clipped_sum(X, torch.ones(2)), "clip"),
    (lambda X: clipped_sum(X, 1.0, scale=0), "scale"),
    (lambda X: clipped_sum(X, 1.0, weights=[1.0, -1.0, 1.0]), "weights"),
    (lambda X: clipped_sum(X, 1.0, weights=[1.0]), "weights"),
    (lambda X: clipped_sum(X, 1.0, out=X[0]), "out"),
    (lambda X: clipped_sum(X, 1.0, backend="nope"), "backend"),
])
def test_clipped_sum_refuses_bad_arguments_by_name_and_writes_nothing(call, match):
    X = clients(3, 11, torch.float32, "cpu")
    before = X.clone()
    with pytest.raises((ValueError, TypeError), match=match):
        call(X)
    assert torch.equal(X, before)


def test_client_side_clip_matches_the_oracle_and_leaves_the_server_one_pass(backend):
    name, device = backend
    X = clients(6, 301, torch.float32, device)
    radius = 2.0 * (1 - CLIENT_CLIP_MARGIN)
    _, factors, _, _, norms = oracle_clipped_sum(X, radius)
    Y = X.clone()
    bits = clip_updates_(Y, 2.0)
    assert bits.cpu().tolist() == (norms <= 2.0).tolist()
    torch.testing.assert_close(Y.cpu().double(), X.cpu().double() * factors[:, None], rtol=2e-6, atol=0)
    one = X[0].clone()
    assert bool(clip_updates_(one, 2.0)) == bool(norms[0] <= 2.0)  # one [N] update
    assert torch.equal(one, Y[0])
    # the server's bound at C changes no weight: its output is the first pass's, bit for bit
    out, st = clipped_sum(Y, 2.0, scale=1 / 6, backend=name)
    plain, _ = aggregate(Y, torch.ones(6, device=device), gamma=1 / 6, backend=name)
    assert torch.equal(st.factors, torch.ones(6, device=device)) and torch.equal(out, plain)


def test_client_side_clip_of_half_precision_updates():
    X = clients(3, 257, torch.float16, "cpu")
    Y = X.clone()
    clip_updates_(Y, 0.5)
    want = X.double() * torch.clamp(0.5 * (1 - CLIENT_CLIP_MARGIN) / (X.float().norm(dim=1).double() + CLIP_EPS),
                                    max=1.0)[:, None]
    torch.testing.assert_close(Y.double(), want, rtol=2 ** -10, atol=0)  # scaled in fp32, rounded once


# ---------------------------------------------------------------- noise
def test_noise_statistics_within_five_standard_errors():
    """Mean, std and tails of 3M draws of one key (deterministic), the correlation of
    neighbouring counters and of two keys: for a correct N(0, std^2) sampler with
    independent elements each lies within 5 standard errors with probability > 1 - 1e-6."""
    n, std = 3_000_001, 0.37
    x = gaussian_noise_(torch.zeros(n), std, 1234).double()
    assert abs(float(x.mean())) <= 5 * std / math.sqrt(n)
    assert abs(float(x.std()) - std) <= 5 * std / math.sqrt(2 * n)
    assert abs(float(torch.corrcoef(torch.stack([x[:-1], x[1:]]))[0, 1])) <= 5 / math.sqrt(n)
    y = gaussian_noise_(torch.zeros(n), std, 1235).double()
    assert abs(float(torch.corrcoef(torch.stack([x, y]))[0, 1])) <= 5 / math.sqrt(n)
    # the tails of a Gaussian: |x| > 3 std has probability 0.0027; 5 standard errors of a binomial
    p = 2 * 0.5 * math.erfc(3 / math.sqrt(2))
    assert abs(float((x.abs() > 3 * std).double().mean()) - p) <= 5 * math.sqrt(p * (1 - p) / n)


def test_noise_is_the_reference_definition_bit_for_bit():
    key = (1 << 63) - 12345
    got = gaussian_noise_(torch.zeros(4099), 1.0, key)
    assert_bitwise(got, noise_ref.noise(key, 4099))  # 0 + 1 * n is n exactly


def test_noise_same_key_same_bits_and_std_as_a_tensor():
    a, b, c = torch.ones(1001), torch.ones(1001), torch.ones(1001)
    gaussian_noise_(a, 0.5, 7)
    gaussian_noise_(b, torch.tensor(0.5), 7)
    gaussian_noise_(c, 0.5, 8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    half = torch.ones(1001, dtype=torch.float16)  # fp16 data: fp32 arithmetic, one rounding
    gaussian_noise_(half, 0.5, 7)
    assert torch.equal(half, a.to(torch.float16))


def test_cpu_noise_bits_do_not_depend_on_the_number_of_threads():
    threads = torch.get_num_threads()
    n = (1 << 21) + 3
    draws = []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            draws.append(gaussian_noise_(torch.zeros(n), 1.0, 5))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[0], draws[2])


@pytest.mark.parametrize("bad, match", [
    (dict(key=-1), "noise_key"), (dict(key=1 << 63), "noise_key"), (dict(key=True), "noise_key"),
    (dict(key=1.0), "noise_key"), (dict(std=-1.0), "noise_std"), (dict(std=float("nan")), "noise_std"),
    (dict(std=torch.ones(2)), "noise_std"), (dict(std=torch.ones((), dtype=torch.int64)), "noise_std"),
])
def test_noise_refuses_a_bad_key_or_std_and_changes_nothing(bad, match):
    out = torch.ones(5)
    with pytest.raises((ValueError, TypeError), match=match):
        gaussian_noise_(out, bad.get("std", 1.0), bad.get("key", 3))
    assert torch.equal(out, torch.ones(5))


@pytest.mark.parametrize("adaptive", [False, True])
def test_the_fused_noise_is_the_clipped_sum_then_the_noise(adaptive):
    """clipped_sum with the noise inside its pass == clipped_sum, then gaussian_noise_ (fp32
    out: bit for bit), with the statistics of the sum without noise; also when the second
    pass runs (a clipped client) and when it does not."""
    X = clients(5, 3001, torch.float32, "cpu")
    for clip in (100.0, 1.0):  # nothing clipped / some clipped
        std = torch.tensor(0.3) if adaptive else 0.3
        fused, st = clipped_sum(X, clip, scale=0.25, noise_key=99, noise_std=std)
        plain, st0 = clipped_sum(X, clip, scale=0.25)
        assert_bitwise(fused, gaussian_noise_(plain.clone(), std, 99))
        for f in st._fields:
            assert_bitwise(getattr(st, f), getattr(st0, f))
        assert not torch.equal(fused, plain)


# ---------------------------------------------------------------- DP-FedAvg through a server optimizer
def dp_step(X, agg, *, optimizer=FedAvg, **kw):
    p = torch.nn.Parameter(torch.zeros(X.shape[1], dtype=X.dtype))
    opt = optimizer([p], lr=1.0, aggregator=agg, **kw)
    stats = opt.step(X)
    return -p.detach(), stats  # FedAvg with lr 1: x <- x - D


def test_dp_fedavg_is_the_clipped_sum_plus_the_seeded_noise_over_m():
    X = clients(5, 2003, torch.float32, "cpu")
    z, clip, m, seed = 1.3, 2.0, 8.0, 11
    D, stats = dp_step(X, DPAggregator(clip=clip, noise_multiplier=z, expected_clients=m, seed=seed))
    want, *_ = oracle_clipped_sum(X, clip, None, 1 / m)
    noise = gaussian_noise_(torch.zeros(2003), 1.0, dp_noise_key(seed, 1))
    torch.testing.assert_close(D.double(), want + (z * clip / m) * noise.double(), rtol=1e-5, atol=1e-6)
    assert float(stats.update_sq_norm) == pytest.approx(float(D.double().square().sum()), rel=1e-5)
    assert not bool(stats.skipped) and int(stats.num_clients) == 5


def test_dp_noise_std_of_the_mean_is_z_clip_over_m():
    # all-zero updates: D is the noise alone, std z C / m per coordinate (5 standard errors)
    N, z, clip, m = 200_000, 0.8, 3.0, 10.0
    D, _ = dp_step(torch.zeros(4, N), DPAggregator(clip=clip, noise_multiplier=z, expected_clients=m, seed=3))
    std = z * clip / m
    assert abs(float(D.double().mean())) <= 5 * std / math.sqrt(N)
    assert abs(float(D.double().std()) - std) <= 5 * std / math.sqrt(2 * N)


def test_dp_same_seed_same_bits_other_seed_other_bits():
    X = clients(4, 777, torch.float32, "cpu")
    runs = [dp_step(X, DPAggregator(clip=1.0, noise_multiplier=1.0, expected_clients=4, seed=s))[0]
            for s in (5, 5, 6)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


def test_dp_nonfinite_client_weight_zero_others_unscaled():
    X = clients(4, 101, torch.float32, "cpu")
    X[2, 3] = float("nan")
    D, stats = dp_step(X, DPAggregator(clip=0.5, noise_multiplier=0.0, expected_clients=4))
    want, *_ = oracle_clipped_sum(X, 0.5, None, 0.25)
    torch.testing.assert_close(D.double(), want, rtol=1e-5, atol=1e-7)
    assert stats.excluded.tolist() == [False, False, True, False] and int(stats.num_clients) == 3


def test_every_client_excluded_skips_without_noise_and_applies_the_noise_with_it():
    X = torch.full((2, 9), float("nan"))
    D, stats = dp_step(X, DPAggregator(clip=1.0, noise_multiplier=0.0, expected_clients=2))
    assert bool(stats.skipped) and torch.equal(D, torch.zeros(9))
    D, stats = dp_step(X, DPAggregator(clip=1.0, noise_multiplier=1.0, expected_clients=2, seed=1))
    noise = gaussian_noise_(torch.zeros(9), 1.0, dp_noise_key(1, 1))
    assert not bool(stats.skipped)
    torch.testing.assert_close(D, 0.5 * noise, rtol=1e-6, atol=0)


def test_dp_with_fedadam_is_post_processing_and_client_mode_bounds_an_unclipped_client():
    X = clients(3, 64, torch.float32, "cpu")
    D, _ = dp_step(X, DPAggregator(clip=1.0, noise_multiplier=0.5, expected_clients=3, seed=2),
                   optimizer=FedAdam)
    assert torch.isfinite(D).all()
    Y = X.clone()
    clip_updates_(Y[:2], 1.0)  # the third client did not clip: the server's bound still does
    a, stats = dp_step(Y, DPAggregator(clip=1.0, noise_multiplier=0.0, expected_clients=3, mode="client"))
    want, factors, *_ = oracle_clipped_sum(Y, 1.0, None, 1 / 3)
    assert factors[:2].tolist() == [1.0, 1.0] and float(factors[2]) < 1  # the server clipped the third alone
    torch.testing.assert_close(a.double(), want, rtol=1e-5, atol=1e-7)


def test_adaptive_clip_trajectory_hand_computed_without_noise():
    """Andrew et al. 2021, Algorithm 1 with z = 0, sigma_b = 0: rows of norms 1, 2, 3, 4
    (orthogonal), C0 = 2.5, gamma = 0.75, eta_C = 0.2, m = 4.  Rounds 1-4 leave two
    of four unclipped (b_bar = 0.5): C <- C exp(-0.2 (0.5 - 0.75)) = C e^0.05; after
    four rounds C = 2.5 e^0.2 = 3.0535 > 3, three are unclipped (b_bar = 0.75 = gamma)
    and C stays."""
    X = torch.diag(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    agg = DPAggregator(clip=2.5, noise_multiplier=0.0, expected_clients=4, target_quantile=0.75, clip_lr=0.2,
                       clip_count_stddev=0.0)
    p = torch.nn.Parameter(torch.zeros(4))
    opt = FedAvg([p], lr=1.0, aggregator=agg)
    clips, fractions = [], []
    for r in range(6):
        before = p.detach().clone()
        opt.step(X)
        rec = agg.record()
        clips.append(rec["dp_clip"])
        fractions.append(rec["dp_unclipped_fraction"])
        C = rec["dp_clip"]
        want = torch.tensor([min(n, C * n / (n + 1e-6)) for n in (1.0, 2.0, 3.0, 4.0)]) / 4
        torch.testing.assert_close(before - p.detach(), want, rtol=1e-6, atol=0)
    hand = [2.5, 2.5 * math.exp(0.05), 2.5 * math.exp(0.10), 2.5 * math.exp(0.15), 2.5 * math.exp(0.20),
            2.5 * math.exp(0.20)]
    assert clips == pytest.approx(hand, rel=1e-12)
    assert fractions == pytest.approx([0.5, 0.5, 0.5, 0.5, 0.75, 0.75], abs=1e-15)
    assert float(agg.clip) == pytest.approx(2.5 * math.exp(0.2), rel=1e-12)


def test_adaptive_noise_splits_the_budget_as_andrew_et_al():
    # z_Delta = (z^-2 - (2 sigma_b)^-2)^-1/2: z = 1, sigma_b = 1 -> (1 - 1/4)^-1/2
    assert effective_noise_multiplier(1.0, 1.0) == pytest.approx((0.75) ** -0.5, rel=1e-15)
    agg = DPAggregator(clip=2.0, noise_multiplier=1.0, expected_clients=5, target_quantile=0.5,
                       clip_count_stddev=1.0)
    dp_step(clients(5, 33, torch.float32, "cpu"), agg)
    assert agg.record()["dp_noise_std"] == pytest.approx(0.75 ** -0.5 * 2.0 / 5, rel=1e-12)
    with pytest.raises(ValueError, match="clip_count_stddev must exceed noise_multiplier / 2"):
        DPAggregator(clip=1.0, noise_multiplier=1.0, expected_clients=10, target_quantile=0.5)  # m / 20 = 0.5


def test_resumed_aggregator_draws_what_an_uninterrupted_one_would():
    X = clients(4, 257, torch.float32, "cpu")
    kw = dict(clip=1.0, noise_multiplier=1.0, expected_clients=4, target_quantile=0.5, clip_count_stddev=2.0, seed=9)
    whole = DPAggregator(**kw)
    p = torch.nn.Parameter(torch.zeros(257))
    opt = FedAvg([p], lr=1.0, aggregator=whole)
    opt.step(X)
    state = whole.state_dict()
    opt.step(X)
    resumed = DPAggregator(**kw)
    resumed.load_state_dict(state)
    q = torch.nn.Parameter(torch.zeros(257))
    FedAvg([q], lr=1.0, aggregator=resumed).step(X)
    assert torch.equal(resumed.clip, whole.clip)
    assert resumed.record() == whole.record()


@pytest.mark.parametrize("optimizer", [FedExP, ASNES])
def test_dp_refuses_a_step_that_reads_client_norms(optimizer):
    p = torch.nn.Parameter(torch.zeros(5))
    opt = optimizer([p], aggregator=DPAggregator(clip=1.0, noise_multiplier=1.0, expected_clients=2))
    with pytest.raises(ValueError, match="does not privatise"):
        opt.step(torch.ones(2, 5))
    assert torch.equal(p.detach(), torch.zeros(5))


@pytest.mark.parametrize("weights, match", [
    ([1.0, 2.0], "weights must lie in \\[0, 1\\] under differential privacy.*data sizes"),
    ([1.0, float("nan")], "weights must lie in \\[0, 1\\]"),
    ([1.0], "weights"),
])
def test_dp_refuses_unbounded_weights_before_anything_changes(weights, match):
    p = torch.nn.Parameter(torch.zeros(3))
    agg = DPAggregator(clip=1.0, noise_multiplier=1.0, expected_clients=2)
    with pytest.raises(ValueError, match=match):
        FedAvg([p], lr=1.0, aggregator=agg).step(torch.ones(2, 3), weights)
    assert torch.equal(p.detach(), torch.zeros(3)) and agg.rounds == 0


def test_dp_bounded_weights_enter_the_sum_unnormalised():
    X = clients(3, 50, torch.float32, "cpu")
    p = torch.nn.Parameter(torch.zeros(50))
    FedAvg([p], lr=1.0, aggregator=DPAggregator(clip=0.5, noise_multiplier=0.0, expected_clients=2)).step(
        X, [0.2, 1.0, 0.5])
    want, *_ = oracle_clipped_sum(X, 0.5, [0.2, 1.0, 0.5], 0.5)
    torch.testing.assert_close(-p.detach().double(), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kw, match", [
    (dict(clip=0.0, noise_multiplier=1.0, expected_clients=2), "clip"),
    (dict(clip=1.0, noise_multiplier=-1.0, expected_clients=2), "noise_multiplier"),
    (dict(clip=1.0, noise_multiplier=1.0, expected_clients=0), "expected_clients"),
    (dict(clip=1.0, noise_multiplier=1.0, expected_clients=2, mode="x"), "mode"),
    (dict(clip=1.0, noise_multiplier=0.0, expected_clients=2, target_quantile=1.0), "target_quantile"),
    (dict(clip=1.0, noise_multiplier=0.0, expected_clients=2, target_quantile=0.5, mode="client"), "client"),
    (dict(clip=1.0, noise_multiplier=0.0, expected_clients=2, clip_count_stddev=1.0), "target_quantile"),
])
def test_dp_aggregator_refuses_bad_settings_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        DPAggregator(**kw)


def test_dp_refuses_weights_that_are_not_real_numbers():
    agg = DPAggregator(clip=1.0, noise_multiplier=0.0, expected_clients=2)
    with pytest.raises(TypeError, match="weights must be real numbers"):
        FedAvg([torch.nn.Parameter(torch.zeros(3))], aggregator=agg).step(torch.ones(2, 3), torch.tensor([True, True]))


def test_client_side_clip_of_a_long_update_respects_the_bound():
    """11.2M elements: torch's fp32 CPU norm is ~4e-4 off there, which used to leave a
    clipped update above C; the float64 norm keeps it under C (1 - 1e-5) + rounding."""
    x = torch.randn(1, 11_200_000, generator=torch.Generator().manual_seed(0))
    clip = 100.0
    clip_updates_(x, clip)
    assert float(x.double().norm()) <= clip * (1 - CLIENT_CLIP_MARGIN) * (1 + 1e-6)


def test_without_the_privacy_extra_the_accountant_says_what_to_install():
    code = textwrap.dedent("""
        import sys
        sys.modules["dp_accounting"] = None
        from fedopt_kernels.server.differential_privacy.dp import DPAggregator  # the mechanism needs no extra
        from fedopt_kernels.server.differential_privacy.privacy_accountant import PrivacyAccountant
        from fedopt_kernels.extras import MissingExtraError
        try:
            PrivacyAccountant(1.0, sampling="poisson", num_clients=10, clients_per_round=5, delta=1e-5)
        except MissingExtraError as exc:
            print(exc)
        """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("privacy accounting (fedopt_kernels.server.differential_privacy.privacy_accountant) "
                                   "needs dp-accounting, "
                                   "which is not installed: pip install fedopt_kernels[privacy]")
