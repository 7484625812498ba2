"""The robust rules over clients read in place from pieces (a Flower reply's per-layer
arrays, each subtracted from the global model as it is read): on the CPU backend
``coordinate_select_pieces``, ``client_gram_pieces`` and ``aggregate_pieces`` read them
without a ``[C, N]`` copy, and every rule gives bit for bit its result on the rows those
pieces would be copied into (and through them the float64 oracle's, which
tests/test_robust_aggregate.py checks on rows).  Pieces of odd sizes across the
kernels' 32-lane, 256-column and 4096-column edges, empty pieces, ties, C = 1 and 2, NaN
clients, fp32/fp16/bf16/fp64; the server's aggregator reads them in place and reports
the same client norms.
"""

from __future__ import annotations

import pytest
import torch

import python_ref.robust as O
from fedopt_kernels.ops import ClientPieces
from fedopt_kernels.ops import robust_aggregate as R
from fedopt_kernels.server.robust_aggregation.robust import robust_aggregate

pytestmark = pytest.mark.usefixtures("cpu_extension")

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SIZES = [1, 15, 0, 241, 4099, 3, 700]  # crosses 32-lane, 256-column and 4096-column edges


def pieces(C, dtype, seed=0, sizes=SIZES, base=True, ties=False):
    g = torch.Generator().manual_seed(seed)
    models = []
    for i in range(C):
        client = []
        for n in sizes:
            t = torch.randn(n, generator=g, dtype=torch.float64) * (1 + i)
            if ties:
                t = torch.round(t)  # few distinct values: ties in every column
            client.append(t.to(dtype))
        models.append(client)
    b = torch.randn(sum(sizes), generator=g, dtype=torch.float64).to(dtype) if base else None
    return ClientPieces(models, subtract_from=b)


RULES = {
    "median": lambda X: R.coordinate_median(X, backend="cpu"),
    "trimmed": lambda X: R.trimmed_mean(X, 0.2, backend="cpu"),
    "trimmed-acc-out": lambda X: R.trimmed_mean(X, 0.1, backend="cpu", out=torch.empty(
        X.numel if isinstance(X, ClientPieces) else X.shape[1], dtype=R.V.acc_dtype(X.dtype))),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("C", [1, 2, 5, 20])
@pytest.mark.parametrize("ties", [False, True])
def test_coordinate_rules_read_pieces_bit_for_bit(dtype, C, ties):
    P = pieces(C, dtype, seed=C, ties=ties)
    rows = P.stacked()
    for name, fn in RULES.items():
        got, st = fn(P)
        want, st_rows = fn(rows)
        assert torch.equal(got, want), name
        assert torch.equal(st.excluded, st_rows.excluded) and torch.equal(st.selected, st_rows.selected)
    # and the oracle, on the rows the pieces stand for
    want = O.coordinate_median(rows)
    got = R.coordinate_median(P, backend="cpu")[0].double()
    assert float((got - want).abs().max()) <= 2 * torch.finfo(dtype).eps * float(want.abs().max()) + 1e-30


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_nonfinite_pieces_are_left_out_as_rows_are(dtype):
    P = pieces(7, dtype, seed=3)
    P.pieces[2][4][100] = float("nan")  # in the 4099-element piece
    P.pieces[5][0][0] = float("inf")
    rows = P.stacked()
    for fn in (RULES["median"], RULES["trimmed"], lambda X: R.bulyan(X, 1, backend="cpu"),
               lambda X: R.multi_krum(X, 2, 3, backend="cpu")):
        got, st = fn(P)
        want, st_rows = fn(rows)
        assert torch.equal(got, want)
        assert st.excluded.tolist() == [False, False, True, False, False, True, False]
        assert torch.equal(st.excluded, st_rows.excluded)
        assert torch.isfinite(got).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_gram_rule_reads_pieces_bit_for_bit(dtype):
    P = pieces(11, dtype, seed=4)
    rows = P.stacked()
    w = torch.rand(11, generator=torch.Generator().manual_seed(1)) + 0.1
    for fn in (lambda X: R.krum(X, 2, backend="cpu"), lambda X: R.multi_krum(X, 2, 6, weights=w, backend="cpu"),
               lambda X: R.bulyan(X, 2, backend="cpu"), lambda X: R.geometric_median(X, w, backend="cpu"),
               lambda X: R.centered_clip(X, 1.0, iterations=2, backend="cpu"),
               lambda X: R.norm_bounded_mean(X, w, median_factor=1.0, backend="cpu")):
        got, st = fn(P)
        want, st_rows = fn(rows)
        assert torch.equal(got, want)
        assert torch.equal(st.selected, st_rows.selected)
        assert torch.equal(st.client_sq_norms, st_rows.client_sq_norms)


def test_centered_clip_with_a_reference_stacks_the_pieces():
    P = pieces(6, torch.float32, seed=5)
    ref = torch.randn(P.numel, generator=torch.Generator().manual_seed(2))
    got, _ = R.centered_clip(P, 0.5, reference=ref, backend="cpu")
    want, _ = R.centered_clip(P.stacked(), 0.5, reference=ref, backend="cpu")
    assert torch.equal(got, want)


def test_gram_rules_report_the_client_norms_of_their_gram_matrix():
    P = pieces(9, torch.float32, seed=6)
    X64 = P.stacked().double()
    for rule, p in (("krum", {"f": 2}), ("multi-krum", {"f": 2, "m": 4}), ("bulyan", {"f": 1}), ("geomed", {}),
                    ("centered-clip", {"tau": 1.0}), ("norm-bound", {"radius": 1.0})):
        res = robust_aggregate(P, rule, backend="cpu", **p)
        torch.testing.assert_close(res.client_sq_norms.double(), (X64 * X64).sum(dim=1), rtol=1e-6, atol=0)
    assert robust_aggregate(P, "median", backend="cpu").client_sq_norms is None


@pytest.mark.parametrize("rule, params", [("median", {}), ("trimmed-mean", {"beta": 0.2}), ("krum", {"f": 1}),
                                          ("multi-krum", {"f": 1, "m": 3})])
def test_the_server_aggregator_reads_pieces_in_place(rule, params):
    """A server optimizer's robust round over ClientPieces: the step of the stacked rows,
    the same client norms (to rounding: the Gram diagonal / the aggregation kernel's
    norms against torch's), and no [C, N] buffer kept."""
    from fedopt_kernels.server import FedAvg, RobustAggregator

    P = pieces(6, torch.float32, seed=7)
    rows = P.stacked()
    results = []
    for U in (P, rows):
        p = torch.nn.Parameter(torch.zeros(P.numel))
        agg = RobustAggregator(rule, **params)
        opt = FedAvg([p], lr=1.0, aggregator=agg, backend="cpu")
        st = opt.step(U, [1.0] * 6)
        results.append((p.detach().clone(), st, agg))
    (p_pieces, st_pieces, agg_pieces), (p_rows, st_rows, _) = results
    assert torch.equal(p_pieces, p_rows)
    assert agg_pieces._rows is None, "the pieces were stacked"
    want = (rows.double() ** 2).sum(dim=1)
    torch.testing.assert_close(st_pieces.client_sq_norms.double(), want, rtol=1e-5, atol=0)
    torch.testing.assert_close(st_rows.client_sq_norms.double(), want, rtol=1e-5, atol=0)


def test_pieces_op_checks_its_arguments():
    P = pieces(3, torch.float32, seed=8)
    keep = torch.ones(3, dtype=torch.bool)
    count = torch.tensor([1])
    out = torch.empty(P.numel)
    with pytest.raises(RuntimeError, match="pieces_per_client"):
        torch.ops.fedopt_C.coordinate_select_pieces(P.flat()[:-1], P.num_pieces, P.subtract_from, keep, count, 0,
                                                    out, None)
    with pytest.raises(RuntimeError, match="subtract_from must be a contiguous tensor"):
        torch.ops.fedopt_C.coordinate_select_pieces(P.flat(), P.num_pieces, P.subtract_from[:-1], keep, count, 0,
                                                    out, None)
    with pytest.raises(RuntimeError, match="keep must be a CPU bool tensor of 3"):
        torch.ops.fedopt_C.coordinate_select_pieces(P.flat(), P.num_pieces, None, keep[:2], count, 0, out, None)
    with pytest.raises(RuntimeError, match="pieces_per_client"):
        torch.ops.fedopt_C.client_gram_pieces(P.flat()[:-1], P.num_pieces, None)
