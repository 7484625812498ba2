"""The Flower strategies with a robust aggregator (``aggregator=`` and the parameters by
``fedopt simulate``'s flag names): a round's global model against the float64 oracle
of the rule on the replies (python_ref/robust.py), the selected nodes in the metrics,
and the settings refused by name."""

from __future__ import annotations

import pytest
import torch
from _flwr import needs_flwr

import python_ref.robust as O

pytestmark = needs_flwr


def _round(strategy_cls, C, **kw):
    from test_flower import _net, _replies

    from fedopt_kernels.integrations import flower as fk

    replies = _replies(_net(), C, seed=4)
    x0 = torch.cat([p.detach().flatten() for p in _net().parameters()])
    rows = torch.stack([x0 - torch.cat([torch.from_numpy(a.numpy()).flatten()
                                        for a in r.content["arrays"].values()]) for r in replies])
    s = strategy_cls(_net(), fraction_evaluate=0.0, **kw)
    s.load_global_arrays(fk.model_to_arrayrecord(_net()))
    arrays, metrics = s.aggregate_train(1, replies)
    x1 = torch.cat([torch.from_numpy(a.numpy()).flatten() for a in arrays.values()])
    return x0, rows, x1, metrics, [int(r.metadata.src_node_id) for r in replies]


@pytest.mark.parametrize("read_in_place", [True, False])
def test_a_median_strategy_steps_by_the_median_of_the_replies(read_in_place):
    from fedopt_kernels.integrations import flower as fk

    x0, rows, x1, metrics, _ = _round(fk.FedAvg, 5, aggregator="median", read_in_place=read_in_place)
    # five replies: each coordinate's median is one of them, so lr 1 rounds once, as the oracle
    assert torch.equal(x1, (x0.double() - O.coordinate_median(rows)).float())
    assert metrics["excluded_clients"] == 0 and "robust_selected" not in metrics


def test_a_multi_krum_strategy_reports_the_nodes_it_selected():
    from fedopt_kernels.integrations import flower as fk

    x0, rows, x1, metrics, nodes = _round(fk.FedAdam, 7, aggregator="multi-krum", byzantine_f=2, krum_m=3, lr=0.1)
    want, chosen = O.multi_krum(rows, 2, 3, weights=[10.0 * (c + 1) for c in range(7)])
    assert sorted(metrics["robust_selected"]) == sorted(nodes[i] for i in chosen)  # the replies' order is Flower's
    from fedopt_kernels.server import FedAdam

    # the weighted Multi-Krum mean (num-examples weights), handed to FedAdam as its one update

    x = x0.clone()
    FedAdam([x], lr=0.1).step(want.float()[None])
    torch.testing.assert_close(x1, x, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make, match", [
    (lambda fk, net: fk.FedAvg(net, aggregator="median", trim_beta=0.2), "trim_beta applies to aggregator "
                                                                         "trimmed-mean"),
    (lambda fk, net: fk.FedAvg(net, aggregator="medoid"), "aggregator must be one of"),
    (lambda fk, net: fk.FedExP(net, aggregator="median"), "FedExP cannot aggregate with the robust rule"),
    (lambda fk, net: fk.FedAvg(net, aggregator="krum", byzantine_f=1, scaffold=True), "scaffold=True"),
    (lambda fk, net: fk.FedAvg(net, aggregator="krum"), "needs f"),
])
def test_robust_settings_the_strategy_refuses(make, match):
    from test_flower import _net

    from fedopt_kernels.integrations import flower as fk

    with pytest.raises((ValueError, TypeError), match=match):
        make(fk, _net())


def _spread_replies(C: int):
    """Replies of the test net whose distances to the global model grow with the client
    (noise of std 0.02 (1 + c)), so that Krum's scores are far from ties."""
    from test_flower import _net, _replies

    replies = _replies(_net(), C, seed=6, scale=0.0)
    base = _net().state_dict()
    g = torch.Generator().manual_seed(8)
    from fedopt_kernels.integrations import flower as fk

    for c, m in enumerate(replies):
        sd = {k: v + 0.02 * (1 + c) * torch.randn(v.shape, generator=g) for k, v in base.items()}
        m.content["arrays"] = fk.tensors_to_arrayrecord(sd.items())
    return replies


@pytest.mark.parametrize("name", ["FedMedian", "FedTrimmedAvg", "Krum", "MultiKrum"])
def test_the_fused_rules_give_flowers_own_global_model(name):
    """Flower's FedMedian, FedTrimmedAvg(beta 0.2), Krum and MultiKrum (f 1, 4 selected)
    take the rule over the client models; the fused FedAvg (lr 1) takes it over the
    updates x - x_i and returns x - agg: the same model up to rounding."""
    import copy

    from flwr.serverapp import strategy as F

    from fedopt_kernels.integrations import flower as fk
    from test_flower import _net

    replies = _spread_replies(6)
    flwr_s, ours_kw = {
        "FedMedian": (F.FedMedian(fraction_evaluate=0.0), dict(aggregator="median")),
        "FedTrimmedAvg": (F.FedTrimmedAvg(beta=0.2, fraction_evaluate=0.0),
                          dict(aggregator="trimmed-mean", trim_beta=0.2)),
        "Krum": (F.Krum(num_malicious_nodes=1, fraction_evaluate=0.0), dict(aggregator="krum", byzantine_f=1)),
        "MultiKrum": (F.MultiKrum(num_malicious_nodes=1, num_nodes_to_select=4, fraction_evaluate=0.0),
                      dict(aggregator="multi-krum", byzantine_f=1, krum_m=4)),
    }[name]
    ours = fk.FedAvg(_net(), fraction_evaluate=0.0, **ours_kw)
    ours.load_global_arrays(fk.model_to_arrayrecord(_net()))
    got, _ = ours.aggregate_train(1, replies)
    want, _ = flwr_s.aggregate_train(1, copy.deepcopy(replies))  # Flower pops the arrays it reads
    flat = lambda a: torch.cat([torch.from_numpy(x.numpy()).flatten() for x in a.values()])  # noqa: E731
    torch.testing.assert_close(flat(got), flat(want), rtol=1e-5, atol=1e-6)


def test_the_wrapper_is_the_keyword_form_and_steps_by_the_median():
    """``RobustAggregation(strategy, rule, ...)`` composes the concern that ``aggregator=``
    names: the median oracle's step, the keyword form's bits."""
    from fedopt_kernels.integrations import flower as fk

    def wrapped(net, **kw):
        return fk.RobustAggregation(fk.FedAvg(net, **kw), "median")

    x0, rows, x1, metrics, _ = _round(wrapped, 5)
    assert torch.equal(x1, (x0.double() - O.coordinate_median(rows)).float())
    _, _, x1_kw, metrics_kw, _ = _round(fk.FedAvg, 5, aggregator="median")
    assert torch.equal(x1, x1_kw) and dict(metrics) == dict(metrics_kw)
    with pytest.raises(ValueError, match="needs a robust rule"):
        fk.RobustAggregation(fk.FedAvg(torch.nn.Linear(2, 2)), "mean")


def test_no_class_of_the_integration_is_a_god_object():
    """Issue 46: no class in integrations/ longer than 250 lines or with a constructor of
    more than 10 arguments (``**kwargs`` handed to Flower's ``FedAvg`` not counted)."""
    import ast
    import pathlib

    import fedopt_kernels.integrations as I

    for path in pathlib.Path(I.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno - node.lineno + 1 <= 250, (path.name, node.name)
                for f in node.body:
                    if isinstance(f, ast.FunctionDef) and f.name == "__init__":
                        n = len(f.args.args) - 1 + len(f.args.kwonlyargs)
                        assert n <= 10, (path.name, node.name, n)
