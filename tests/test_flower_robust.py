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
