"""The clients' Gram matrix of the robust rules (``ops.robust_aggregate.client_gram``)
on every backend against a float64 oracle, within the error bound each backend states:

* reference: float64 products of float64 blocks (``|error| <= gamma_n(2^-53) sum|x_ik x_jk|``);
* cpu (``fedopt_C::client_gram``): blocks of 256 columns summed in the acc dtype, the
  blocks in float64: ``(gamma_k(u_acc) + gamma_n(2^-53)) sum_k |x_ik x_jk|`` with
  ``k = GRAM_ACC_OPS`` (10 for fp32 acc, 13 for fp64) -- a sum of the whole row in fp32
  (or one sgemm over long blocks) is outside it at the sizes below;
* triton (interpreted: torch on the CPU) / cuda: batched products of 256-column blocks
  in the acc dtype, ``k = 256``.

Also: odd sizes across the CPU kernel's block (256) and chunk (16384) edges, C = 1 and
2, a NaN client confined to its own row and column, the ``extra`` row, clients read in
place from pieces (bit for bit the rows' result), the CPU kernel's bits independent of
the thread count and of the instruction set, and the Krum-family rules on that Gram.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _cpu_isa import assert_level_agrees_with_default
from fedopt_kernels import backends
from fedopt_kernels.ops import ClientPieces
from fedopt_kernels.ops import robust_aggregate as R

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
U64 = 2.0 ** -53


def gamma(n, u):
    return n * u / (1 - n * u)


def acc_of(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def rows(C, N, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(C, N, generator=g, dtype=torch.float64)
    if C > 1:
        X = X * torch.logspace(-1, 1, C, dtype=torch.float64)[:, None]
    return (X + 0.5).to(dtype)


def acc_ops(name, dtype):
    """Roundings in the acc dtype a term goes through, by backend (module docstring)."""
    if name == "cpu":
        return R.GRAM_ACC_OPS[acc_of(dtype)]
    return R.GRAM_BLOCK


def assert_within_bound(G, X, name, dtype, extra=None, float64_products=False):
    """``|G - X X^T| <= (gamma_k(u_acc) + gamma_n(u64)) |X| |X|^T``, the float64 oracle's
    own rounding (``gamma_N(u64)``, which matters for fp64 data) added.  With
    ``float64_products`` the blocks are summed in float64 (``k = 13`` of ``u64`` on the
    CPU, the reference's float64 blocks elsewhere)."""
    if float64_products:
        dtype = torch.float64
        name = name if name == "cpu" else "reference"
    X64 = X.double().cpu()
    if extra is not None:
        X64 = torch.cat([X64, extra.double().cpu()[None]])
    N = X64.shape[1]
    want = X64 @ X64.T
    mass = X64.abs() @ X64.abs().T
    u_acc = torch.finfo(acc_of(dtype)).eps / 2
    k = 0 if name == "reference" else acc_ops(name, dtype)
    bound = (gamma(k, u_acc) + gamma(N // 128 + 4, U64) + gamma(N + 2, U64)) * mass
    err = (G.cpu() - want).abs()
    assert G.dtype == torch.float64 and G.shape == want.shape
    assert torch.equal(G, G.T), "not symmetric"
    assert bool((err <= bound).all()), (
        f"{int((err > bound).sum())} entries outside the bound; worst ratio {float((err / bound).max()):.3g}")


def small(name):
    return name == "triton" and backends.triton_interpret_mode()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("C", [1, 2, 3, 20])
def test_gram_matches_the_float64_oracle_within_the_stated_bound(backend, dtype, C):
    name, device = backend
    sizes = [0, 1, 255, 256, 257, 4099] if small(name) else [0, 1, 255, 256, 257, 16384 + 3, 100003]
    for N in sizes:
        X = rows(C, N, dtype, seed=C * 31 + N).to(device)
        for exact in (False, True):
            G = R.client_gram(X, float64_products=exact, backend=name)
            assert G.device == X.device
            assert_within_bound(G, X, name, dtype, float64_products=exact)


def test_float64_products_are_a_float64_grams_accuracy(cpu_extension):
    """Clients close to each other and far from the origin: the distances from the fp32
    blocks lose digits (as their bound says), those from float64 products do not."""
    X = (rows(6, 50021, torch.float64, seed=4) * 1e-3 + 1.0).float()
    X64 = X.double()
    D_true = ((X64[:, None] - X64[None]) ** 2).sum(dim=2)  # from the differences: no cancellation

    def dist(G):
        d = torch.diagonal(G)
        return d[:, None] + d[None, :] - 2 * G

    off = ~torch.eye(6, dtype=torch.bool)
    rel_exact = ((dist(R.client_gram(X, float64_products=True, backend="cpu")) - D_true).abs() / D_true)[off]
    rel_fp32 = ((dist(R.client_gram(X, backend="cpu")) - D_true).abs() / D_true)[off]
    # float64 products: 2^-53 of ||x||^2 ~ 5e4 over distances ~ 0.1, summed over ~200 blocks
    assert float(rel_exact.max()) < 1e-7
    # fp32 blocks: 2^-24 in place of 2^-53, what their bound allows (Krum only compares the distances)
    assert float(rel_fp32.max()) > 1e-5


def test_cpu_gram_is_closer_than_one_fp32_sum_per_entry(cpu_extension):
    """The bound is not vacuous: at this size one fp32 sum over the row (what a blocked
    product with long blocks does) is outside it, the kernel is inside."""
    X = rows(4, 300007, torch.float32, seed=3)
    assert_within_bound(R.client_gram(X, backend="cpu"), X, "cpu", torch.float32)
    naive = torch.zeros(4, 4, dtype=torch.float64)
    for i in range(4):
        for j in range(4):  # one sequential fp32 sum (NumPy's cumsum accumulates in its dtype)
            naive[i, j] = float(np.cumsum((X[i] * X[j]).numpy(), dtype=np.float32)[-1])
    with pytest.raises(AssertionError, match="outside the bound"):
        assert_within_bound(naive, X, "cpu", torch.float32)


def test_gram_with_extra_row_and_its_dtype(backend):
    name, device = backend
    N = 301 if small(name) else 20011
    X = rows(5, N, torch.float32, seed=5).to(device)
    r = rows(1, N, torch.float32, seed=6)[0].to(device)
    Gx = R.client_gram(list(X.unbind(0)), extra=r, backend=name)
    assert Gx.shape == (6, 6)
    assert_within_bound(Gx, X, name, torch.float32, extra=r)
    # an extra of another dtype than the clients (the acc dtype of fp16 clients)
    Xh = X.half()
    Gh = R.client_gram(Xh, extra=r, backend=name)
    X64 = torch.cat([Xh.double().cpu(), r.double().cpu()[None]])
    torch.testing.assert_close(Gh.cpu(), X64 @ X64.T, rtol=gamma(256, 2.0 ** -24) + 1e-12, atol=1e-9)


def test_a_nonfinite_client_stays_in_its_row_and_column(backend):
    name, device = backend
    N = 513 if small(name) else 40000
    X = rows(6, N, torch.float32, seed=7)
    X[2, N // 3] = float("nan")
    X[4, 0] = float("inf")
    X = X.to(device)
    G = R.client_gram(X, backend=name).cpu()
    bad = torch.tensor([False, False, True, False, True, False])
    good = ~bad
    assert torch.isfinite(G[good][:, good]).all()
    assert torch.isnan(G[2]).all() and not torch.isfinite(G[4, 4])
    assert_within_bound(G[good][:, good].contiguous(), X[good], name, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_gram_reads_pieces_in_place_bit_for_bit(cpu_extension, dtype):
    """Pieces of odd sizes, across the kernel's 256-column blocks, subtracted from a base
    as they are read: the Gram of the rows those pieces would be copied into."""
    C, sizes = 5, [1, 255, 3, 4099, 17, 16384, 0, 700]
    g = torch.Generator().manual_seed(9)
    models = [[torch.randn(n, generator=g).to(dtype) for n in sizes] for _ in range(C)]
    base = torch.randn(sum(sizes), generator=g).to(dtype)
    P = ClientPieces(models, subtract_from=base)
    want = R.client_gram(P.stacked(), backend="cpu")
    assert torch.equal(R.client_gram(P, backend="cpu"), want)
    assert torch.equal(R.client_gram(ClientPieces(models), backend="cpu"),
                       R.client_gram(ClientPieces(models).stacked(), backend="cpu"))
    assert_within_bound(want, P.stacked(), "cpu", dtype)


def test_cpu_gram_does_not_depend_on_the_thread_count(cpu_extension, threads):
    X = rows(23, 3 * 16384 + 77, torch.float32, seed=12)
    got = []
    for t in (1, 2, 3):
        threads(t)
        got.append(R.client_gram(X, backend="cpu"))
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])


def test_many_clients_use_longer_chunks_and_stay_within_the_bound(cpu_extension):
    """Past 64 clients the kernel's chunks grow with C^2 (its partials stay small)."""
    X = rows(70, 40001, torch.float32, seed=13)
    assert_within_bound(R.client_gram(X, backend="cpu"), X, "cpu", torch.float32)


def _exact(shape, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-(2 ** 22), 2 ** 22, shape, generator=g, dtype=torch.int64).double() / 2 ** 21).to(dtype)


def isa_results(dtype):
    """The CPU kernels of the robust rules on data spanning several blocks and chunks:
    the Gram matrix (rows and pieces) and coordinate_select's three uses."""
    X = _exact((9, 2 * 16384 + 333), 14, dtype)
    base = _exact((X.shape[1],), 15, dtype)
    P = ClientPieces([[x[:1000], x[1000:1257], x[1257:]] for x in X.clone().unbind(0)], subtract_from=base)
    return [R.client_gram(X, backend="cpu"), R.client_gram(P, backend="cpu"),
            R.coordinate_median(X, backend="cpu")[0], R.trimmed_mean(P, 0.2, backend="cpu")[0],
            R.bulyan(X, 1, backend="cpu")[0]]


@pytest.mark.parametrize("level", ["avx2", "avx512"])
def test_cpu_robust_kernels_independent_of_instruction_set(level):
    """The DEFAULT (SSE2), AVX2 and AVX-512 builds of the Gram and selection kernels
    give the same bits (a fixed lane layout, no FMA)."""
    assert_level_agrees_with_default("test_robust_gram", "isa_results", level)


@pytest.mark.parametrize("C, f", [(3, 0), (7, 2), (20, 4)])
def test_krum_on_the_cpu_gram_picks_the_oracles_clients(cpu_extension, C, f):
    """Multi-Krum reading the fp32-block Gram matrix selects what the float64 one selects
    on clients Krum can tell apart (the honest ones spread, the attackers far)."""
    import python_ref.robust as O

    X = rows(C, 50021, torch.float64, seed=C)
    X[C - f:] *= -20.0
    X = X.float()
    for m in (1, C - f):
        _, st = R.multi_krum(X, f, m, backend="cpu")
        _, chosen = O.multi_krum(X, f, m)
        assert st.selected.nonzero().flatten().tolist() == chosen
        _, st_ref = R.multi_krum(X, f, m, backend="reference")
        assert torch.equal(st.selected, st_ref.selected)
