"""A round survives broken and hostile clients (the fused Flower strategies).

Oracle: the same strategy, fresh, aggregating the GOOD replies alone.  For every kind
of bad reply and every strategy (FedAvg, FedAdam, FedExP, ASNES, SCAFFOLD, FedLAW) the
global model must be bit for bit that one, and the round's metrics must count the
reply under its reason.  Also: all bad fails clearly, ``on_bad_reply="raise"`` keeps
the old behaviour, duplicates and replies to another round, and the weight-share cap
(alone and with the server's norm bound) against a hand computation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _flwr import HAVE_FLWR, needs_flwr
from torch import nn

pytestmark = needs_flwr

if HAVE_FLWR:
    from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
    from flwr.serverapp.exception import AggregationError
    from flwr.supercore.task_identity import TaskIdentity

    from fedopt_kernels.integrations import flower as fk
    from fedopt_kernels.integrations.flower.screening import REASONS, cap_weight_shares


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _reply(model, c: int, *, node=None, size=None, round_=1, seed=0, scale=0.1):
    """Client ``c``'s well-formed reply to round ``round_`` (node ``1000 + c``)."""
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    g = torch.Generator().manual_seed(seed * 100 + c)
    sd = {k: v + scale * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    content = RecordDict({
        "arrays": fk.tensors_to_arrayrecord(sd.items()),
        "metrics": MetricRecord({"num-examples": 10 * (c + 1) if size is None else size, "train_loss": float(c),
                                 "lr_sum": 0.5}),
        "fedopt": ConfigRecord({"partition-id": c, "server-round": round_})})
    ins = Message(content=RecordDict(), message_type=MessageType.TRAIN,
                  dst_node_id=1000 + c if node is None else node)
    return Message(content=content, reply_to=ins)


def _proxy():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))]


def _strategy(algo: str, **kw):
    extra = dict(proxy_loader=_proxy(), loss_fn=nn.CrossEntropyLoss(), server_epochs=2) if algo == "fedlaw" else {}
    if algo == "scaffold":
        kw.setdefault("scaffold_num_clients", 4)  # M without a configure_train
    s = fk.make_strategy(algo, _net(), fraction_evaluate=0.0, **extra, **kw)
    s.load_global_arrays(fk.model_to_arrayrecord(_net()))
    return s


def _flat(arrays) -> torch.Tensor:
    return torch.cat([torch.from_numpy(np.array(a.numpy())).flatten() for a in arrays.values()])


def _set_array(msg, key, value):
    next(iter(msg.content.array_records.values()))[key] = Array(value)


def _corrupt(kind: str, msg):
    """Make ``msg`` bad in the way ``kind`` names; returns the reason it must be counted under."""
    arrays = next(iter(msg.content.array_records.values()))
    metrics = next(iter(msg.content.metric_records.values()))
    if kind == "wrong_shape":
        _set_array(msg, "2.weight", np.zeros((4, 5), dtype=np.float32))
    elif kind == "missing_layer":
        del arrays["2.bias"]
    elif kind == "unknown_key":
        _set_array(msg, "9.weight", np.zeros(3, dtype=np.float32))
    elif kind == "wrong_dtype":
        _set_array(msg, "0.bias", np.zeros(5, dtype=np.int32))
    elif kind in ("size_negative", "size_nan", "size_inf", "size_list", "size_missing"):
        value = {"size_negative": -5, "size_nan": float("nan"), "size_inf": float("inf"), "size_list": [1.0, 2.0]}
        if kind == "size_missing":
            del metrics["num-examples"]
        else:
            metrics["num-examples"] = value[kind]
        return "bad_size"
    elif kind == "two_array_records":
        msg.content["more"] = ArrayRecord(dict(arrays))
        return "malformed"
    elif kind == "nonfinite":
        bad = arrays["0.weight"].numpy().copy()
        bad[0, 0] = np.inf
        _set_array(msg, "0.weight", bad)
        return "nonfinite"
    else:
        raise AssertionError(kind)
    return "bad_arrays"


BAD_KINDS = ["wrong_shape", "missing_layer", "unknown_key", "wrong_dtype", "size_negative", "size_nan", "size_inf",
             "size_list", "size_missing", "two_array_records", "nonfinite"]
ALGOS = ["fedavg", "fedadam", "fedexp", "asnes", "scaffold", "fedlaw"]


def _check_counts(metrics, expected: dict):
    for reason in REASONS:
        assert metrics[f"excluded_{reason}"] == expected.get(reason, 0), (reason, dict(metrics))
    assert metrics["excluded_clients"] == sum(expected.values())


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("kind", BAD_KINDS)
def test_a_bad_reply_is_left_out_and_the_rest_aggregate_as_alone(algo, kind):
    net = _net()
    good = [_reply(net, c) for c in (0, 1, 3)]
    bad = _reply(net, 2)
    reason = _corrupt(kind, bad)
    alone, _ = _strategy(algo).aggregate_train(1, [_reply(net, c) for c in (0, 1, 3)])
    s = _strategy(algo)
    arrays, metrics = s.aggregate_train(1, good[:2] + [bad] + good[2:])
    if reason == "nonfinite" and algo != "fedlaw":
        # left out inside the fused aggregation: the weights of the others are renormalised
        # there, the same mean as without the client up to the order of the rounding
        torch.testing.assert_close(_flat(arrays), _flat(alone), rtol=1e-6, atol=1e-7)
    elif reason == "nonfinite":
        assert torch.isfinite(_flat(arrays)).all()
    else:
        assert torch.equal(_flat(arrays), _flat(alone))
    _check_counts(metrics, {reason: 1})


@pytest.mark.parametrize("algo", ["fedavg", "scaffold"])
def test_failed_nodes_duplicates_and_other_rounds(algo):
    net = _net()
    good = [_reply(net, c) for c in (0, 1, 2)]
    failed = Message(Error(code=0, reason="ClientApp crashed"), reply_to=Message(
        content=RecordDict(), message_type=MessageType.TRAIN, dst_node_id=1007))
    twice = _reply(net, 1, seed=5)  # node 1001 again, other values
    stale = _reply(net, 3, round_=0)
    alone, _ = _strategy(algo).aggregate_train(1, [_reply(net, c) for c in (0, 1, 2)])
    arrays, metrics = _strategy(algo).aggregate_train(1, [good[0], good[1], failed, twice, stale, good[2]])
    assert torch.equal(_flat(arrays), _flat(alone))  # the FIRST reply of node 1001 counted
    _check_counts(metrics, {"error_reply": 1, "duplicate_node": 1, "other_round": 1})


def test_scaffold_needs_a_positive_lr_sum():
    net = _net()
    bad = _reply(net, 2)
    next(iter(bad.content.metric_records.values()))["lr_sum"] = 0.0
    alone, _ = _strategy("scaffold").aggregate_train(1, [_reply(net, c) for c in (0, 1)])
    arrays, metrics = _strategy("scaffold").aggregate_train(1, [_reply(net, 0), bad, _reply(net, 1)])
    assert torch.equal(_flat(arrays), _flat(alone))
    _check_counts(metrics, {"bad_lr_sum": 1})
    # without scaffold lr_sum is not needed
    _, metrics = _strategy("fedavg").aggregate_train(1, [_reply(net, 0), bad, _reply(net, 1)])
    _check_counts(metrics, {})


def test_all_bad_fails_clearly_and_raise_keeps_the_old_behaviour():
    net = _net()
    replies = [_reply(net, c) for c in range(3)]
    for r in replies:
        _corrupt("size_nan", r)
    with pytest.raises(AggregationError, match="no usable reply among 3"):
        _strategy("fedavg").aggregate_train(1, replies)
    one_bad = [_reply(net, 0), _reply(net, 1)]
    _corrupt("missing_layer", one_bad[1])
    with pytest.raises(AggregationError, match=r"node 1001: bad_arrays .*'2.bias'"):
        _strategy("fedavg", on_bad_reply="raise").aggregate_train(1, one_bad)
    with pytest.raises(ValueError, match="on_bad_reply must be one of"):
        _strategy("fedavg", on_bad_reply="ignore")
    with pytest.raises(ValueError, match="max_weight_share must be None or a number in"):
        _strategy("fedavg", max_weight_share=1.5)


def test_cap_weight_shares_by_hand():
    w = torch.tensor([1e12, 10.0, 30.0, 0.0], dtype=torch.float64)
    p = cap_weight_shares(w, 0.5)
    # the claimant gets half, the others share the other half 1:3, the zero stays zero
    assert torch.allclose(p, torch.tensor([0.5, 0.125, 0.375, 0.0], dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.equal(cap_weight_shares(w, None), w / w.sum())
    # two large claimants: both capped, the rest keeps its proportions
    p = cap_weight_shares(torch.tensor([100.0, 100.0, 1.0, 3.0], dtype=torch.float64), 0.3)
    assert torch.allclose(p, torch.tensor([0.3, 0.3, 0.1, 0.3], dtype=torch.float64), atol=1e-15)
    # a cap below 1 / (clients with weight) cannot hold: equal shares
    assert torch.allclose(cap_weight_shares(torch.tensor([5.0, 1.0]), 0.1), torch.tensor([0.5, 0.5],
                                                                                       dtype=torch.float64))


def test_a_claimed_size_cannot_take_over_and_the_cap_composes_with_the_norm_bound():
    net = _net()
    replies = [_reply(net, c) for c in range(4)]
    replies[3] = _reply(net, 3, size=10 ** 12, scale=50.0)  # huge claim, huge update
    x0 = _flat(fk.model_to_arrayrecord(_net()))
    models = torch.stack([_flat(next(iter(r.content.array_records.values()))) for r in replies])
    D = x0 - models
    sizes = torch.tensor([10.0, 20.0, 30.0, 1e12], dtype=torch.float64)
    # no cap: the claimant IS the round
    arrays, _ = _strategy("fedavg").aggregate_train(1, replies)
    torch.testing.assert_close(_flat(arrays), models[3], rtol=0, atol=1e-5)
    # capped at a quarter: x0 - sum_i p_i D_i with the water-filled shares
    p = cap_weight_shares(sizes, 0.25)
    arrays, _ = _strategy("fedavg", max_weight_share=0.25).aggregate_train(1, replies)
    expected = x0 - (p.float()[:, None] * D).sum(0)
    torch.testing.assert_close(_flat(arrays), expected, rtol=1e-6, atol=1e-6)
    # and with the server's norm bound M: each update scaled by min(1, M / (||D_i|| + 1e-6))
    M = 0.5
    s = min(1.0, 1.0)
    scale = torch.clamp(M / (D.double().norm(dim=1) + 1e-6), max=s).float()
    arrays, _ = _strategy("fedavg", max_weight_share=0.25, max_client_norm=M).aggregate_train(1, replies)
    expected = x0 - (p.float()[:, None] * scale[:, None] * D).sum(0)
    torch.testing.assert_close(_flat(arrays), expected, rtol=1e-5, atol=1e-6)
    assert D[3].norm() > 10 * M  # the bound really acted on the claimant
