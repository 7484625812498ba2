"""Attacks for testing (fedopt_kernels.fl.datasets.attacks) on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from fedopt_kernels.fl.datasets.attacks import Attack, alie_z_max, attack_updates_, attacked_clients, flip_labels


def test_attackers_are_a_seeded_rounded_prefix():
    a = attacked_clients(0, 20, 0.3)
    assert len(a) == 6 and a == sorted(set(a)) and all(0 <= c < 20 for c in a)
    assert attacked_clients(0, 20, 0.3) == a  # the seed alone decides
    assert set(attacked_clients(0, 20, 0.1)) <= set(a)  # a smaller fraction: a subset
    assert attacked_clients(1, 20, 0.3) != a
    assert len(attacked_clients(0, 10, 0.25)) == 3 and attacked_clients(0, 10, 0.04) == []  # half up
    with pytest.raises(ValueError, match="fraction"):
        attacked_clients(0, 10, 1.5)


def test_signflip_and_scale_hand_computed():
    U = torch.tensor([[1.0, -2.0], [3.0, 4.0], [5.0, 6.0]])
    attack_updates_(U, [0, 2], "signflip")
    assert U.tolist() == [[-1.0, 2.0], [3.0, 4.0], [-5.0, -6.0]]
    attack_updates_(U, [1], "scale", scale=-2.5)
    assert U.tolist() == [[-1.0, 2.0], [-7.5, -10.0], [-5.0, -6.0]]


def test_gaussian_attack_is_seeded_and_has_the_stated_std():
    N = 100_000
    U = torch.ones(3, N)
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    attack_updates_(U, [0, 2], "gaussian", noise_std=0.5, generators=gens)
    assert torch.equal(U[1], torch.ones(N))  # honest row untouched
    assert torch.equal(U[0], 0.5 * torch.randn(N, generator=torch.Generator().manual_seed(1)))
    for row in (U[0], U[2]):  # 5 standard errors
        assert abs(float(row.double().mean())) <= 5 * 0.5 / math.sqrt(N)
        assert abs(float(row.double().std()) - 0.5) <= 5 * 0.5 / math.sqrt(2 * N)


@pytest.mark.parametrize("n, f, p", [
    # s = floor(n/2 + 1) - f by hand, z = Phi^-1((n - s) / n) from scipy's ndtri (an independent quantile)
    (10, 2, 0.6),    # s = 4
    (50, 12, 0.72),  # s = 14
    (4, 1, 0.5),     # s = 2: z = 0
    (20, 5, 0.7),    # s = 6
    (10, 7, 0.9),    # attackers a majority: s = -1 is taken as 1
])
def test_alie_z_max_from_the_normal_quantile(n, f, p):
    from scipy.special import ndtri

    assert alie_z_max(n, f) == pytest.approx(float(ndtri(p)), abs=1e-12)


def test_alie_hand_computed():
    # 4 clients, 1 attacker (row 3): s = 2, z = 0 -> the mean; then 10 clients, 2 attackers: z = Phi^-1(0.6)
    U = torch.tensor([[1.0, 0.0], [3.0, 2.0], [5.0, 4.0], [7.0, 10.0]])
    attack_updates_(U, [3], "alie")
    assert U.tolist() == [[1.0, 0.0], [3.0, 2.0], [5.0, 4.0], [4.0, 4.0]]
    U = torch.arange(10, dtype=torch.float64).unsqueeze(1).repeat(1, 2)  # column 0..9: mean 4.5, std sqrt(55/6)
    U[:, 1] = 1.0  # a constant column: std 0
    attack_updates_(U, [0, 9], "alie")
    want = 4.5 - 0.2533471031357997 * math.sqrt(55 / 6)
    assert U[0].tolist() == pytest.approx([want, 1.0], abs=1e-12) and U[9].tolist() == U[0].tolist()
    assert U[1:9, 0].tolist() == [float(i) for i in range(1, 9)]


def test_labelflip_flips_only_the_attackers_labels():
    y = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    parts = [torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4, 5, 6, 7])]
    out = flip_labels(y, parts, [0, 2], 4)
    assert out.tolist() == [3, 2, 2, 3, 3, 2, 1, 0] and y.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="shares training samples"):
        flip_labels(y, [torch.tensor([0, 1]), torch.tensor([1, 2])], [0], 4)


def test_attack_applies_to_the_rounds_attackers_only_and_records_them():
    att = Attack.build("signflip", 0.5, 4, seed=3)
    assert len(att.clients) == 2
    round_clients = [0, 1, 2, 3]
    U = torch.arange(8, dtype=torch.float32).reshape(4, 2) + 1
    ids = att.apply_(U, round_clients, 1)
    assert ids == att.clients
    for i, c in enumerate(round_clients):
        sign = -1 if c in att.clients else 1
        assert U[i].tolist() == [sign * (2 * i + 1), sign * (2 * i + 2)]
    assert att.to_dict() == {"kind": "signflip", "fraction": 0.5, "clients": att.clients}
    g = Attack.build("gaussian", 0.5, 4, seed=3, noise_std=2.0)
    a, b = torch.zeros(4, 5), torch.zeros(4, 5)
    g.apply_(a, round_clients, 7), g.apply_(b, round_clients, 7)
    assert torch.equal(a, b)  # seeded by (seed, round, client)
    lf = Attack.build("labelflip", 0.5, 4, seed=3)
    U2 = U.clone()
    assert lf.apply_(U2, round_clients, 1) == lf.clients and torch.equal(U2, U)  # the data, not the update


@pytest.mark.parametrize("call, match", [
    (lambda: attack_updates_(torch.ones(2, 2), [0], "labelflip"), "labelflip attacks the data"),
    (lambda: attack_updates_(torch.ones(2, 2), [2], "signflip"), "rows"),
    (lambda: attack_updates_(torch.ones(2, 2), [0], "gaussian"), "generator"),
    (lambda: attack_updates_(torch.ones(2), [0], "signflip"), "\\[C, N\\]"),
    (lambda: Attack.build("poison", 0.1, 10, 0), "unknown attack"),
    (lambda: alie_z_max(4, 5), "f must be"),
])
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()
