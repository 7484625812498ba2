"""python_ref/gaussian_noise.py -- the definition every backend's DP noise is tested
against bit for bit -- against oracles of its own: Random123's published Philox
vectors, float64 ``log``/``cos``, float64 Box-Muller over the same integers, and the
normal distribution itself."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from python_ref import gaussian_noise as G


@pytest.mark.parametrize("key, counter, want", [
    # Random123 1.14, kat_vectors: "philox4x32 10 <ctr0..3> <key0 key1> <out0..3>"
    (0, (0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((1 << 64) - 1, (0xFFFFFFFF,) * 4, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (0x299F31D0A4093822, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_matches_the_published_known_answers(key, counter, want):
    words = G.philox4x32_10(key, *(torch.tensor([c], dtype=torch.int64) for c in counter))
    assert tuple(int(w) for w in words) == want


def test_uniforms_are_exact_open_and_symmetric():
    x = torch.tensor([0, 256, 512, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF], dtype=torch.int64)
    u = G.uniform_open(x)
    assert u.dtype == torch.float32
    assert u.tolist() == [2 ** -24, 2 ** -24, 3 * 2 ** -24, 0.5 - 2 ** -24, 0.5 + 2 ** -24, 1 - 2 ** -24]


def _all_uniforms():
    return ((torch.arange(1 << 23, dtype=torch.int64) << 1) | 1).to(torch.float32) * 2 ** -24


def test_log_within_two_ulp_of_float64_on_every_input():
    u = _all_uniforms()  # every value uniform_open can produce
    ours = G._log(u).double()
    ref = torch.log(u.double())
    spacing = torch.from_numpy(np.spacing(ref.abs().float().numpy())).double()
    assert float(((ours - ref).abs() / spacing).max()) <= 2.0


def test_cos_2pi_within_1e7_of_float64_on_every_input():
    v = _all_uniforms()
    err = (G._cos_2pi(v).double() - torch.cos(2 * math.pi * v.double())).abs()
    assert float(err.max()) <= 1e-7


def test_normals_are_box_muller_of_the_same_integers():
    key, n = 0x0123456789ABCDEF, 1 << 20
    j = torch.arange(n, dtype=torch.int64) + (1 << 32) - 100  # across the counter's high word
    x0, x1, _, _ = G.philox4x32_10(key, j & 0xFFFFFFFF, j >> 32, torch.zeros_like(j), torch.zeros_like(j))
    ua, ub = G.uniform_open(x0).double(), G.uniform_open(x1).double()
    want = torch.sqrt(-2 * torch.log(ua)) * torch.cos(2 * math.pi * ub)
    got = G.normal(key, j)
    assert got.dtype == torch.float32
    assert float((got.double() - want).abs().max()) <= 1e-6
    assert float(got.abs().max()) <= math.sqrt(-2 * math.log(2 ** -24))  # the 24-bit sampler's bound


def test_normals_are_standard_normal():
    """4M draws: Kolmogorov-Smirnov distance (p > 1e-6 gives D < 1.27e-3 for n = 4M),
    the first four moments within 5 standard errors."""
    n = 1 << 22
    x = G.noise(7, n).double()
    xs, _ = torch.sort(x)
    cdf = 0.5 * torch.erfc(-xs / math.sqrt(2))
    i = torch.arange(1, n + 1, dtype=torch.float64)
    D = float(torch.maximum(i / n - cdf, cdf - (i - 1) / n).max())
    assert D < math.sqrt(-math.log(1e-6 / 2) / (2 * n))
    assert abs(float(x.mean())) <= 5 / math.sqrt(n)
    assert abs(float(x.var()) - 1) <= 5 * math.sqrt(2 / n)
    assert abs(float((x ** 3).mean())) <= 5 * math.sqrt(15 / n)
    assert abs(float((x ** 4).mean()) - 3) <= 5 * math.sqrt(96 / n)


def test_noise_depends_on_the_key_and_index_only():
    a = G.noise(11, 5000, chunk=1000)
    b = G.noise(11, 5000)
    assert torch.equal(a, b)
    assert torch.equal(G.noise(11, 100, start=4900), a[4900:])
    assert not torch.equal(G.noise(12, 5000), a)
    with pytest.raises(ValueError, match="key"):
        G.normal(-1, torch.arange(3))
