"""One weighting rule for the floating buffers (BatchNorm statistics), issue 29 item 2.

The global buffers are the mean of the clients' under the round's weights -- the very
weights the parameters were averaged with, capped under ``max_weight_share`` -- with
the clients the step left out dropped.  The simulator (``fl.ServerSide``) and the Flower
strategies (``FusedStrategy.aggregate_train``) both go through
``ServerRound.buffers``; here they are held against a float64 hand formula on the same
replies with a cap that acts, and against each other to the bit.
"""

from __future__ import annotations

import pytest
import torch
from _asserts import assert_bitwise
from _flwr import HAVE_FLWR, needs_flwr
from torch import nn

from fedopt_kernels import server as S
from torch.nn.utils import parameters_to_vector

from fedopt_kernels.utils.flat import buffers_to_vector

if HAVE_FLWR:
    from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedopt_kernels.integrations import flower as fk

SIZES = [10.0, 20.0, 30.0, 40.0]
CAP = 0.3
# sizes 10:20:30:40 capped at 0.3 (water-filling by hand): 0.4 would go to the last
# client -> 0.3, the rest 0.7 split 1:2:3 gives the third 0.35 -> 0.3 too, and the first
# two share the 0.4 left 1:2.
SHARES = [0.4 / 3, 0.8 / 3, 0.3, 0.3]


def _bn_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3))


def _client_states(C=4, seed=3):
    """Each client's state: the global one moved a little, its running statistics
    distinct per client (variances kept positive)."""
    g = torch.Generator().manual_seed(seed)
    base = _bn_net().state_dict()
    out = []
    for _ in range(C):
        sd = {}
        for k, v in base.items():
            if not v.is_floating_point():
                sd[k] = v.clone()
            elif k.endswith("running_var"):
                sd[k] = v + torch.rand(v.shape, generator=g)
            else:
                sd[k] = v + torch.randn(v.shape, generator=g)
        out.append(sd)
    return out


def _oracle(states, shares):
    """float64: ``sum_i s_i b_i`` for every floating buffer."""
    keys = [k for k, v in states[0].items() if v.is_floating_point() and "running" in k]
    return {k: sum(s * st[k].double() for s, st in zip(shares, states)) for k in keys}


def _simulator_buffers(states, cap):
    """The simulator's server round on the clients' updates and buffer rows."""
    from fedopt_kernels.fl import SimulationConfig
    from fedopt_kernels.server import RoundReplies
    from fedopt_kernels.fl.run.server_side import ServerSide

    model = _bn_net()
    x = parameters_to_vector(model.parameters())
    config = SimulationConfig(algo="fedavg", weighting="size", max_weight_share=cap)
    side = ServerSide(config, model, x)
    clients = []
    for sd in states:
        m = _bn_net()
        m.load_state_dict(sd)
        clients.append(m)
    D = torch.stack([x - parameters_to_vector(m.parameters()) for m in clients])
    rows = torch.stack([buffers_to_vector(m) for m in clients])
    sizes = torch.tensor(SIZES, dtype=torch.float64)
    side.round(RoundReplies(D, sizes=sizes, buffers=rows))  # the round writes the model's buffers
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "running" in k and v.is_floating_point()}


def _flower_buffers(states, cap):
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    replies = []
    for c, sd in enumerate(states):
        content = RecordDict({"arrays": fk.tensors_to_arrayrecord(sd.items()),
                              "metrics": MetricRecord({"num-examples": int(SIZES[c]), "train_loss": 0.0}),
                              "fedopt": ConfigRecord({"partition-id": c})})
        ins = Message(content=RecordDict(), message_type=MessageType.TRAIN, dst_node_id=700 + c)
        replies.append(Message(content=content, reply_to=ins))
    s = fk.FedAvg(_bn_net(), fraction_evaluate=0.0, max_weight_share=cap)
    s.load_global_arrays(fk.model_to_arrayrecord(_bn_net()))
    s.aggregate_train(1, replies)
    return {k: v.detach().clone() for k, v in s.model.state_dict().items() if "running" in k and v.is_floating_point()}


def test_simulator_buffers_use_the_capped_round_weights(monkeypatch):
    import importlib

    R = importlib.import_module("fedopt_kernels.server.round")
    formed = []
    orig = R.round_weights
    monkeypatch.setattr(R, "round_weights", lambda *a, **k: formed.append(1) or orig(*a, **k))
    states = _client_states()
    got = _simulator_buffers(states, CAP)
    assert len(formed) == 1  # the step's weights, checked and capped once, reused for the buffers
    want = _oracle(states, SHARES)
    assert got.keys() == want.keys() and len(got) == 2
    for k in want:
        torch.testing.assert_close(got[k].double(), want[k], rtol=1e-6, atol=1e-6, msg=k)
    # the uncapped sizes would give another mean: the cap really acts on the buffers
    uncapped = _oracle(states, [s / sum(SIZES) for s in SIZES])
    assert not torch.allclose(got["1.running_mean"].double(), uncapped["1.running_mean"], rtol=1e-4, atol=1e-4)


@needs_flwr
@pytest.mark.parametrize("cap", [CAP, None])
def test_simulator_and_flower_average_the_buffers_alike(cap):
    states = _client_states()
    sim, flower = _simulator_buffers(states, cap), _flower_buffers(states, cap)
    shares = SHARES if cap is not None else [s / sum(SIZES) for s in SIZES]
    want = _oracle(states, shares)
    for k in want:
        torch.testing.assert_close(flower[k].double(), want[k], rtol=1e-6, atol=1e-6, msg=k)
        assert_bitwise(sim[k], flower[k], k)


def test_the_buffers_leave_out_the_excluded_and_nonfinite_clients():
    # FedAvg round, client 1's update NaN (excluded by the step), client 2's buffers Inf
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    round_ = S.ServerRound(S.FedAvg(model.parameters()), "size", 0.5)
    D = torch.randn(4, 8, dtype=torch.float64) * 0.1
    D[1, 0] = float("nan")
    w = round_.weights(torch.tensor([1.0, 1.0, 2.0, 8.0], dtype=torch.float64))
    st = round_.step(D, w)
    rows = torch.arange(12, dtype=torch.float32).view(4, 3)
    rows[2, 1] = float("inf")
    got = round_.buffers(rows, w, torch.zeros(3), st.excluded)
    # shares 1:1:2:8 capped at 0.5 -> [0.125, 0.125, 0.25, 0.5]; kept: clients 0 and 3 -> 1/5, 4/5
    want = (0.125 * rows[0].double() + 0.5 * rows[3].double()) / 0.625
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    # nobody left: the current buffers stay
    none = round_.buffers(rows, w, torch.full((3,), 7.0), torch.ones(4, dtype=torch.bool))
    assert none.tolist() == [7.0, 7.0, 7.0]
    # raw sizes are refused: they would bypass the round's rule (its cap, or uniform weighting)
    with pytest.raises(TypeError, match=r"weights must be the round's weights \(ServerRound.weights\(sizes\)"):
        round_.buffers(rows, torch.tensor([1.0, 1.0, 2.0, 8.0]), torch.zeros(3), None)


class _RankShareServer:
    """A server that, like the distributed one, steps on one rank's rows of the round
    (``weights_are_a_share``) and reports the whole round's statistics."""

    takes = "updates"
    keeps_buffers = False
    weights_are_a_share = True

    def __init__(self, C):
        self.C, self.seen = C, []

    def round(self, results, weights):
        self.seen.append((results.shape[0], weights))
        no = torch.zeros(self.C, dtype=torch.bool)
        return S.ServerRoundStats(excluded=no, skipped=torch.tensor(False), metrics={}, stats=None)


def test_a_rank_steps_on_its_share_of_the_round_weights_and_the_buffers_get_them_all():
    """The distributed simulator's round: the weights are formed (checked, capped) once
    over the whole round, this rank's step takes its rows of them, and the buffers of
    all the round's clients get the capped shares."""
    model = _bn_net()
    server = _RankShareServer(len(SIZES))
    round_ = S.ServerRound(server, "size", CAP, model=model)
    states = _client_states()
    rows = torch.stack([torch.cat([sd["1.running_mean"], sd["1.running_var"]]) for sd in states])
    round_(S.RoundReplies(torch.zeros(2, 3), sizes=torch.tensor(SIZES, dtype=torch.float64), buffers=rows,
                          share=slice(1, 3)))
    (n, w), = server.seen
    assert n == 2 and isinstance(w, S.aggregation.CheckedWeights)
    torch.testing.assert_close(w.values, torch.tensor(SHARES[1:3], dtype=torch.float64), rtol=1e-15, atol=0)
    want = _oracle(states, SHARES)
    bn = model[1]
    torch.testing.assert_close(bn.running_mean.double(), want["1.running_mean"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bn.running_var.double(), want["1.running_var"], rtol=1e-6, atol=1e-6)
    # a share is refused for a server whose step does not spread over ranks
    plain = S.ServerRound(S.FedAvg(_bn_net().parameters()), "size", CAP)
    with pytest.raises(ValueError, match="share"):
        plain(S.RoundReplies(torch.zeros(2, 63), sizes=torch.tensor(SIZES, dtype=torch.float64), share=slice(1, 3)))
