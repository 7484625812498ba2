"""The virtual clock (issue 44): a hand-built trace, synchronous rounds with a deadline,
over-selection and mid-round dropouts, periodic availability -- against hand-computed
times."""

import math

import pytest

from fedopt_kernels.fl.run.clock import Device, DeviceClock, sync_round

TRACE = """client,compute_s_per_sample,comm_s,available_from,available_until
0,0.01,1,,
1,0.02,2,0,5
1,0.02,2,10,20
2,0.5,0.5,0,100
"""


@pytest.fixture
def clock(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(TRACE)
    return DeviceClock.from_trace(path)


def test_the_trace_by_hand(clock):
    assert len(clock) == 3
    # steps x batch = 50 samples
    assert clock.train_time(0, 10, 5) == pytest.approx(50 * 0.01 + 1)
    assert clock.train_time(1, 10, 5) == pytest.approx(50 * 0.02 + 2)
    assert clock.train_time(2, 10, 5) == pytest.approx(50 * 0.5 + 0.5)
    assert clock.available(1, 4.9) and not clock.available(1, 5.0) and clock.available(1, 10.0)
    assert clock.next_available(1, 6.0) == 10.0 and clock.next_available(1, 25.0) is None
    assert clock.finish(1, 1.0, 10, 5) == (pytest.approx(4.0), False)
    assert clock.finish(1, 4.0, 10, 5) == (pytest.approx(7.0), True)  # its window ends at 5


def test_sync_round_deadline_dropout_unavailable_and_over_selection(clock):
    r = sync_round(clock, [0, 1, 2], 0.0, 10, 5, deadline=10.0)
    assert r.kept == [0, 1] and r.excluded == {2: "deadline"} and r.duration == 10.0
    r = sync_round(clock, [0, 1, 2], 4.0, 10, 5)
    assert r.kept == [0, 2] and r.excluded == {1: "dropout"}
    assert r.duration == pytest.approx(25.5) and r.finish[2] == pytest.approx(29.5)
    r = sync_round(clock, [2, 1, 0], 6.0, 10, 5)
    assert r.kept == [2, 0] and r.excluded == {1: "unavailable"}  # kept in the order sampled
    r = sync_round(clock, [2, 1, 0], 0.0, 10, 5, keep=1)  # over-selected: the first to finish
    assert r.kept == [0] and r.excluded == {1: "over_selected", 2: "over_selected"}
    assert r.duration == pytest.approx(1.5)
    r = sync_round(clock, [0, 1], 4.0, 10, 5)  # c0 finishes at 5.5, after c1 went offline at 5
    assert r.kept == [0] and r.duration == pytest.approx(1.5)
    r = sync_round(clock, [1], 4.0, 10, 5)  # the server learns of the dropout when it goes offline
    assert r.kept == [] and r.duration == pytest.approx(1.0)


def test_periodic_windows_join_across_the_period():
    clock = DeviceClock([Device(0.0, 1.0, ((0.0, 2.0), (7.0, 10.0)), period=10.0)])
    assert clock.window_at(0, 8.0) == (7.0, 12.0)
    assert clock.window_at(0, 11.0) == (7.0, 12.0)
    assert clock.window_at(0, 5.0) is None
    assert clock.next_available(0, 5.0) == 7.0 and clock.next_available(0, 12.5) == 17.0
    assert clock.finish(0, 9.0, 1, 1) == (10.0, False)  # online until 12
    assert clock.finish(0, 11.5, 1, 1) == (12.5, True)


def test_distributions_are_seeded_and_their_spread_is_the_level():
    a = DeviceClock.from_distributions(200, seed=3, heterogeneity="heavy")
    b = DeviceClock.from_distributions(200, seed=3, heterogeneity="heavy")
    assert a.devices == b.devices
    flat = DeviceClock.from_distributions(50, seed=3, heterogeneity="none", compute_s_per_sample=0.002, comm_s=3.0)
    assert all(d.compute_s_per_sample == 0.002 and d.comm_s == 3.0 for d in flat.devices)
    logs = sorted(math.log(d.compute_s_per_sample / 1e-3) for d in a.devices)
    spread = logs[int(0.9 * len(logs))] - logs[len(logs) // 2]
    assert 1.5 < spread < 3.6  # sigma 2.0: the 90th percentile is 1.28 sigma above the median
    half = DeviceClock.from_distributions(100, seed=1, availability=0.25, period_s=100.0)
    online = sum(half.available(c, t) for c in range(100) for t in range(0, 1000, 7))
    assert 0.2 < online / (100 * len(range(0, 1000, 7))) < 0.3


def test_fedscale_fields_and_errors_that_name_the_place(tmp_path):
    p = tmp_path / "fedscale.csv"
    p.write_text("client,computation,communication\n0,20,800\n1,5,8000\n")
    with pytest.raises(ValueError, match="model_bytes"):
        DeviceClock.from_trace(p)
    clock = DeviceClock.from_trace(p, model_bytes=1_000_000)
    assert clock.devices[0].compute_s_per_sample == pytest.approx(0.02)
    assert clock.devices[0].comm_s == pytest.approx(2 * 8e6 / 1000 / 800)  # 20 s: 8 Mbit each way at 800 kbit/s
    bad = tmp_path / "bad.csv"
    bad.write_text("client,compute_s_per_sample,comm_s\n0,0.1,1\n1,fast,1\n")
    with pytest.raises(ValueError, match=r"bad.csv:3: column compute_s_per_sample: 'fast' is not a number"):
        DeviceClock.from_trace(bad)
    gap = tmp_path / "gap.csv"
    gap.write_text("client,compute_s_per_sample,comm_s\n0,0.1,1\n2,0.1,1\n")
    with pytest.raises(ValueError, match=r"no line for client\(s\) \[1\]"):
        DeviceClock.from_trace(gap)
