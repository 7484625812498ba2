"""FedBuff (issue 44): the staleness weights, the buffer around a server optimizer, its
checkpoint, and its timeline on the virtual clock -- each against hand-computed values."""

import math

import pytest
import torch

from fedopt_kernels import server as srv
from fedopt_kernels.fl.run.clock import Device, DeviceClock
from fedopt_kernels.fl.run.fedbuff_schedule import fedbuff_schedule
from fedopt_kernels.server.fedbuff import FedBuffBuffer, staleness_weight


def test_staleness_weights_by_hand():
    assert [staleness_weight(t, "constant") for t in (0, 3)] == [1.0, 1.0]
    assert staleness_weight(0, "polynomial") == 1.0
    assert staleness_weight(3, "polynomial", a=0.5) == 0.5  # (1 + 3)^-1/2
    assert staleness_weight(7, "polynomial", a=1.0) == 0.125
    assert staleness_weight(4, "hinge", a=0.5, b=4) == 1.0  # free up to b
    assert staleness_weight(6, "hinge", a=0.5, b=4) == 0.5  # 1 / (0.5 * 2 + 1)
    for bad, match in ((-1, "tau"), (1.5, "tau")):
        with pytest.raises(ValueError, match=match):
            staleness_weight(bad)
    with pytest.raises(ValueError, match="staleness must be one of"):
        staleness_weight(1, "exponential")


def _model(dtype=torch.float64):
    return [torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=dtype))]


U = [torch.tensor(v, dtype=torch.float64) for v in ([0.2, 0.4, -0.6], [0.1, -0.3, 0.5], [1.0, 1.0, 1.0],
                                                   [-0.4, 0.2, 0.0], [0.3, 0.3, -0.3])]


def test_a_fedbuff_sequence_with_staleness_by_hand():
    """K = 2, polynomial a = 0.5, FedAvgM (lr 0.5, momentum 0.9):
    arrivals (U0, v0), (U1, v0) -> step 1 ; (U2, v0: tau 1), (U3, v1: tau 0) -> step 2."""
    p = _model()
    buf = FedBuffBuffer(srv.FedAvgM(p, lr=0.5, momentum=0.9), 2, staleness="polynomial", a=0.5)
    assert buf.add(U[0], 0) is None and buf.version == 0
    assert buf.add(U[1], 0) is not None and buf.version == 1
    assert buf.add(U[2], 0) is None  # pulled version 0, arrives at version 1: tau = 1
    assert buf.staleness == [1]
    buf.add(U[3], 1)
    x = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    d1 = (U[0] + U[1]) / 2
    b = d1.clone()
    x = x - 0.5 * b
    d2 = (U[2] * 2 ** -0.5 + U[3]) / 2
    b = 0.9 * b + d2
    x = x - 0.5 * b
    torch.testing.assert_close(p[0].detach(), x, rtol=0, atol=1e-15)
    assert buf.version == 2 and buf.filled == 0


def test_resume_in_the_middle_of_a_buffer_is_bit_identical():
    def run(split=None):
        p = _model(torch.float32)
        buf = FedBuffBuffer(srv.FedAdam(p, lr=0.01), 3, staleness="hinge", a=0.5, b=0)
        seq = [(U[0], 0), (U[1], 0), (U[2], 0), (U[3], 0), (U[4], 1)]
        for i, (u, v) in enumerate(seq):
            if i == split:  # a checkpoint: the model (as the simulator saves x_global) and the buffer
                state, x = buf.state_dict(), p[0].detach().clone()
                p = _model(torch.float32)
                with torch.no_grad():
                    p[0].copy_(x)
                buf = FedBuffBuffer(srv.FedAdam(p, lr=0.01), 3, staleness="hinge", a=0.5, b=0)
                buf.load_state_dict(state)
            buf.add(u.float(), v)
        return p[0].detach(), buf.state_dict()

    whole, st = run()
    for split in (1, 3, 4):  # inside the first buffer, right after a step, inside the second
        resumed, st2 = run(split)
        assert torch.equal(whole, resumed)
        assert st2["filled"] == st["filled"] == 2 and torch.equal(st2["rows"], st["rows"])


def test_bad_arrivals_and_settings_are_refused_and_change_nothing():
    p = _model()
    buf = FedBuffBuffer(srv.FedAvg(p), 2)
    with pytest.raises(ValueError, match=r"version must be an int in \[0, 0\]"):
        buf.add(U[0], 1)
    with pytest.raises(ValueError, match=r"flat \[3\]"):
        buf.add(torch.zeros(4, dtype=torch.float64), 0)
    with pytest.raises(ValueError, match="float64"):
        buf.add(torch.zeros(3), 0)
    assert buf.filled == 0 and torch.equal(p[0].detach(), _model()[0].detach())
    with pytest.raises(ValueError, match="buffer_size"):
        FedBuffBuffer(srv.FedAvg(_model()), 0)
    other = FedBuffBuffer(srv.FedAvg(_model()), 3)
    with pytest.raises(ValueError, match="settings"):
        other.load_state_dict(buf.state_dict())


def test_max_staleness_leaves_old_updates_out():
    p = _model()
    buf = FedBuffBuffer(srv.FedAvg(p, lr=1.0), 1, staleness="constant", max_staleness=1)
    buf.add(U[0], 0)
    buf.add(U[1], 1)
    assert buf.version == 2
    before = p[0].detach().clone()
    assert buf.add(U[2], 0) is None and buf.dropped_stale == 1  # tau 2 > 1
    assert torch.equal(p[0].detach(), before)


# ---------------------------------------------------------------------------- the timeline
def _three_devices():
    # no compute cost, round trips of 1, 2 and 3 s, always online
    return DeviceClock([Device(0.0, 1.0), Device(0.0, 2.0), Device(0.0, 3.0)])


def test_the_timeline_by_hand():
    """3 clients, all in flight (concurrency 3), buffer 2.  t=1: c0 arrives (v0) and is
    sent again on v0; t=2: c1 (v0) fills step 0 -> v1, c1 sent on v1; t=2: c0's second
    update (v0); c0 sent on v1 (ends 3); t=3: c2 (v0) -- dispatched before c0's third trip,
    so first -- fills step 1 with staleness [1, 1]."""
    s = fedbuff_schedule(_three_devices(), concurrency=3, buffer=2, server_steps=2, local_steps=1, batch_size=1,
                         seed=0)
    assert [[(a.client, a.version, a.end) for a in step] for step in s.steps] == [
        [(0, 0, 1.0), (1, 0, 2.0)], [(0, 0, 2.0), (2, 0, 3.0)]]
    assert s.step_time == [2.0, 3.0]
    assert s.staleness() == [[0, 0], [1, 1]]
    assert sorted(s.pulled[0]) == [0, 0, 1, 2] and sorted(s.pulled[1]) == [0, 1]
    assert s.dropped == []


def test_the_timeline_is_determined_by_its_seed_and_drops_offline_clients():
    clock = DeviceClock.from_distributions(40, seed=5, heterogeneity="heavy", availability=0.5, period_s=50.0,
                                           compute_s_per_sample=0.01, comm_s=1.0)
    kw = dict(concurrency=8, buffer=4, server_steps=12, local_steps=5, batch_size=4)
    a, b = fedbuff_schedule(clock, seed=1, **kw), fedbuff_schedule(clock, seed=1, **kw)
    assert a == b
    c = fedbuff_schedule(clock, seed=2, **kw)
    assert c.pulled != a.pulled
    assert len(a.steps) == 12 and all(len(s) == 4 for s in a.steps)
    assert a.step_time == sorted(a.step_time)
    for k, step in enumerate(a.steps):
        for arr in step:
            assert arr.version <= k and clock.available(arr.client, arr.start)
            assert arr.end == pytest.approx(arr.start + clock.train_time(arr.client, 5, 4))
    assert a.dropped  # half-time availability with slow devices: some go offline mid-training
    for c_, v, t in a.dropped:
        assert not clock.available(c_, t)
