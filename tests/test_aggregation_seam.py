"""The aggregation seam of the server optimizers (issue 14 item 1): a ``ServerOptimizer``
takes an aggregator -- :class:`LocalAggregator` by default, a
:class:`DistributedAggregator` for the clients of every rank, or one of the user's --
and applies whatever mean update and round description it returns."""

from __future__ import annotations

import pytest
import torch
import _gloo as gloo
from _server_cases import CASES

from fedopt_kernels import server as S
from fedopt_kernels.ops import aggregate
from fedopt_kernels.server.aggregation import RoundAggregate, normalize_weights

FEDADAM = CASES["FedAdam"]  # the table's FedAdam: every term of its formula matters


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))


def _updates(C, N, seed=1):
    return torch.randn(C, N, generator=torch.Generator().manual_seed(seed))


def _state(opt):
    return [p.detach().clone() for g in opt.param_groups for p in g["params"]]


def test_the_default_aggregator_is_this_process_and_equals_passing_it():
    a, b = _model(), _model()
    oa, ob = FEDADAM.make(a.parameters()), FEDADAM.make(b.parameters())
    assert isinstance(oa.aggregator, S.LocalAggregator)
    N = sum(p.numel() for p in a.parameters())
    X = _updates(4, N)
    for _ in range(3):
        sa = oa.step(X, [1.0, 2.0, 3.0, 4.0])
        sb = ob.step(X, [1.0, 2.0, 3.0, 4.0], aggregator=S.LocalAggregator())
        assert torch.equal(sa.update_sq_norm, sb.update_sq_norm)
    assert all(torch.equal(x, y) for x, y in zip(_state(oa), _state(ob)))


class TrimmedMean:
    """A user's aggregator: the coordinate-wise mean of the clients whose norm is not the
    largest (a toy robust rule), through the public pieces only."""

    def __init__(self):
        self.calls = 0

    def __call__(self, opt, updates, weights, out):
        self.calls += 1
        rows, C = opt.check_updates(updates)
        q = (rows.double() ** 2).sum(1)
        keep = torch.ones(C, dtype=torch.bool)
        keep[int(q.argmax())] = False
        w = keep.to(out.dtype)
        p, valid = normalize_weights(w, C, out.device, out.dtype)
        _, stats = aggregate(rows, p, out=out, nonfinite=opt.nonfinite, backend=opt.backend)
        return RoundAggregate.of(p, stats, valid, opt.max_client_norm)


def test_a_users_aggregator_decides_the_mean_update_the_step_applies():
    model = _model()
    agg = TrimmedMean()
    opt = S.FedAvg(model.parameters(), lr=1.0, aggregator=agg)
    x0 = torch.cat([p.detach().flatten() for p in model.parameters()])
    X = _updates(5, x0.numel(), seed=3)
    X[2] *= 100.0  # the outlier the rule drops
    st = opt.step(X)
    x1 = torch.cat([p.detach().flatten() for p in model.parameters()])
    expected = x0 - X[[0, 1, 3, 4]].double().mean(0).float()  # FedAvg, lr 1: x - D
    torch.testing.assert_close(x1, expected, rtol=1e-6, atol=1e-6)
    assert agg.calls == 1 and int(st.num_clients) == 4
    assert st.weights[2] == 0 and torch.isclose(st.weights.sum(), torch.tensor(1.0))


def test_an_aggregator_that_is_not_callable_is_refused_by_name():
    with pytest.raises(TypeError, match="aggregator must be callable"):
        S.FedAvg(_model().parameters(), aggregator="local")


def test_norm_bounded_statistics_come_from_the_one_bound_rule():
    """With max_client_norm the round's sum_i p_i ||s_i D_i||^2 uses the bound factors the
    aggregation applied: hand-computed for updates of norms 5 and 1 under a bound of 2."""
    model = torch.nn.Linear(2, 1, bias=False)
    opt = S.FedAvg(model.parameters(), max_client_norm=2.0)
    X = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    st = opt.step(X)
    s = 2.0 / (5.0 + 1e-6)
    torch.testing.assert_close(st.mean_client_sq_norm, torch.tensor(0.5 * (s * s * 25.0) + 0.5 * 1.0),
                               rtol=1e-6, atol=0)


# ------------------------------------------------------------------ distributed
def _two_ranks(rank, world):
    from fedopt_kernels.distributed import DistributedAggregator, DistributedServerOptimizer

    N = sum(p.numel() for p in _model().parameters())
    X = _updates(5, N, seed=4)
    w = [3.0, 1.0, 2.0, 5.0, 4.0]
    mine = slice(0, 2) if rank == 0 else slice(2, 5)
    a, b = _model(), _model()
    direct = FEDADAM.make(a.parameters(), aggregator=DistributedAggregator())
    wrapped = DistributedServerOptimizer(FEDADAM.make(b.parameters()))
    out = {}
    for r in range(3):
        sa = direct.step(X[mine] * (r + 1), w[mine])
        sb = wrapped.step(X[mine] * (r + 1), w[mine])
        out[f"stats{r}"] = (sa.update_sq_norm, sb.update_sq_norm, sa.weights, sb.weights)
    out["direct"], out["wrapped"] = _state(direct), _state(wrapped.optimizer)
    return out


def test_distributed_aggregator_in_the_constructor_equals_the_wrapper_and_one_process(tmp_path):
    res = gloo.launch(tmp_path, 2, _two_ranks)
    single = _model()
    one = FEDADAM.make(single.parameters())
    N = sum(p.numel() for p in single.parameters())
    X = _updates(5, N, seed=4)
    for r in range(3):
        st = one.step(X * (r + 1), [3.0, 1.0, 2.0, 5.0, 4.0])
        for rank in res:
            qa, qb, wa, wb = rank[f"stats{r}"]
            assert torch.equal(qa, st.update_sq_norm) and torch.equal(qb, st.update_sq_norm)
            assert torch.equal(wa, st.weights) and torch.equal(wb, st.weights)
    for rank in res:
        assert all(torch.equal(x, y) for x, y in zip(rank["direct"], _state(one)))
        assert all(torch.equal(x, y) for x, y in zip(rank["wrapped"], _state(one)))
