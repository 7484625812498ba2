"""DP-FedAvg in the fused Flower strategy against Flower's own server-side DP wrappers
(benchmarks/flower_dp.py): on the same replies, without noise both give the float64
oracle's new global model ``x + (1/m) sum_i min(1, C / ||u_i||) u_i`` to within their
summations' rounding; with noise, the std each adds; and the two places where Flower's
adaptive clipping departs from Andrew et al. (2021), which docs/privacy.md states."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _flwr import needs_flwr

pytestmark = needs_flwr

SHAPES = [(31, 17), (17,), (5, 3, 3)]  # 601 values: fast, and enough for a 3% std estimate
C = 6


def _setup(clip_quantile=0.5):
    from fedopt_kernels.benchmarks import flower_dp as B

    g, replies = B.equal_weight_replies(SHAPES, C, seed=3, scale=0.1)
    x0 = B.flat_arrays(g).double()
    U = torch.stack([B.flat_arrays(r.content["arrays"]).double() - x0 for r in replies])
    U[1] *= 3.0  # norms that differ enough for a clip between them
    U[4] *= 0.3
    for r, u in zip(replies, U):
        arrays = r.content["arrays"]
        offset = 0
        for key in list(arrays.keys()):
            a = arrays[key].numpy()
            arrays[key] = type(arrays[key])((x0[offset:offset + a.size] + u[offset:offset + a.size]).float()
                                            .numpy().reshape(a.shape))
            offset += a.size
    U = torch.stack([B.flat_arrays(r.content["arrays"]).double() - x0 for r in replies])  # as the replies hold them
    norms = U.norm(dim=1)
    clip = float(norms.quantile(clip_quantile))
    return B, g, replies, x0, U, norms, clip


def _oracle(x0, U, norms, clip):
    factors = torch.clamp(clip / norms, max=1.0)
    return x0 + (factors[:, None] * U).mean(0)


def test_the_benchmarks_oracle_is_the_formula():
    B, g, replies, x0, U, norms, clip = _setup()
    exact, bound = B.oracle(g, replies, clip)
    assert torch.allclose(exact, _oracle(x0, U, norms, clip), rtol=1e-14, atol=1e-14)
    assert torch.allclose(bound, (C + 4) * 2.0 ** -24 * (x0.abs() + U.abs().max(0).values), rtol=1e-14, atol=0)


@pytest.mark.parametrize("pair", ["fixed", "adaptive"])
def test_without_noise_both_sides_give_the_oracles_global_model(pair):
    B, g, replies, x0, U, norms, clip = _setup()
    assert 0 < int((norms > clip).sum()) < C  # some clipped, some not
    name, (factory, kw) = list(B.pairs(C, 0.0, clip, count_stddev=0.0).items())[0 if pair == "fixed" else 1]
    sides = B._Sides(SHAPES, g, replies, factory, kw, 0.0)
    want = _oracle(x0, U, norms, clip)
    flwr, ours = B.flat_arrays(sides.run_flwr()).double(), B.flat_arrays(sides.run_ours()).double()
    # in fp32 each side makes at most C + 4 roundings per coordinate (a client's update, its
    # clip, x + it, its weight; the C - 1 additions; the division) of values no larger than
    # |x| + max_i |u_i|: within (C + 4) u (|x| + max_i |u_i|), u = 2^-24
    tol = (C + 4) * 2.0 ** -24 * (x0.abs() + U.abs().max(0).values)
    for side, got in (("flwr", flwr), ("fused", ours)):
        err = (got - want).abs()
        assert bool((err <= tol).all()), f"{side}: {float((err / tol).max()):.2f} x the bound"
    assert not torch.allclose(want, _oracle(x0, U, norms, 10 * clip), atol=0, rtol=1e-6)  # the clip mattered


def test_the_noise_std_is_the_mechanisms_on_both_sides_for_a_fixed_clip():
    B, g, replies, x0, U, norms, clip = _setup()
    rows = B.agreement(SHAPES, C, 1.0, clip, seed=3, count_stddev=1.0)  # the benchmark's replies (scale 1e-2)
    fixed = rows[0]
    assert fixed["mechanism std"] == pytest.approx(1.0 * clip / C)
    assert fixed["fused noise std"] == pytest.approx(fixed["mechanism std"], rel=0.1)  # 601 draws: ~3% std
    assert fixed["flwr noise std"] == pytest.approx(fixed["mechanism std"], rel=0.1)
    assert fixed["flwr error / bound"] <= 1 and fixed["fused error / bound"] <= 1


def test_flowers_adaptive_clip_moves_against_andrew_et_al_and_scales_its_noise_by_the_next_clip():
    """Every update above the clip (b_i = 0 for all): Andrew et al.'s geometric update
    ``C exp(-eta (b_bar - gamma))`` RAISES the clip (ours: C e^{0.1}); Flower 1.41 counts
    the CLIPPED updates as b_bar and lowers it (C e^{-0.1}).  And Flower scales the
    round's noise by that next clip instead of the clip the round clipped with."""
    B, g, replies, x0, U, norms, _ = _setup()
    clip = float(norms.min()) / 2  # all clipped
    name, (factory, kw) = list(B.pairs(C, 0.0, clip, count_stddev=0.0).items())[1]
    sides = B._Sides(SHAPES, g, replies, factory, kw, 0.0)
    sides.run_flwr()
    sides.run_ours()
    assert sides.flwr.clipping_norm == pytest.approx(clip * math.exp(-0.2 * (1.0 - 0.5)), rel=1e-12)
    assert float(sides.dp.clip) == pytest.approx(clip * math.exp(-0.2 * (0.0 - 0.5)), rel=1e-12)
    # with noise (sigma_b 1 > z / 2): Flower's std follows its clip AFTER the round
    np.random.seed(0)
    rows = B.agreement(SHAPES, C, 1.0, clip, seed=3, count_stddev=1.0)
    adaptive = rows[1]
    assert adaptive["fused noise std"] == pytest.approx(adaptive["mechanism std"], rel=0.1)
    assert adaptive["flwr std / (z_Delta C_after / m)"] == pytest.approx(1.0, rel=0.1)
    assert adaptive["flwr clip after"] != pytest.approx(clip, rel=0.02)  # so the two scales differ
