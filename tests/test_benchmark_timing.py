"""The interleaved timer the benchmarks share (fedopt_kernels/benchmarks/timing.py):
call counts per cache mode and the rejected flag combination.  No time is asserted."""

import pytest

from fedopt_kernels.benchmarks import aggregate, timing


def counting_candidates(log):
    return {name: (lambda name=name: log.append(name)) for name in ("a", "b", "c")}


@pytest.mark.parametrize("mode,calls_per_repeat", [({}, 1), (dict(warm_cache=True), 2), (dict(cold_cache=True), 1)])
def test_every_candidate_runs_round_robin(monkeypatch, mode, calls_per_repeat):
    monkeypatch.setattr(timing, "FLUSH_BYTES", 1 << 12)
    log = []
    times = timing.interleaved(counting_candidates(log), repeats=3, warmup=2, **mode)
    assert set(times) == {"a", "b", "c"} and all(t >= 0 for t in times.values())
    assert log[:6] == ["a", "a", "b", "b", "c", "c"]  # warmup, per candidate
    expected_round = [n for n in ("a", "b", "c") for _ in range(calls_per_repeat)]
    assert log[6:] == expected_round * 3  # then one round-robin round per repeat


def test_warm_and_cold_cache_are_exclusive():
    with pytest.raises(ValueError, match="exclusive"):
        timing.interleaved({}, warm_cache=True, cold_cache=True)


def test_bench_aggregate_rejects_unknown_cache_mode():
    with pytest.raises(ValueError, match="cache must be"):
        aggregate.bench_aggregate(2, 3, label="x", cache="hot")


def test_copy_bandwidth_counts_read_and_write_and_is_measured_once(monkeypatch):
    """copy_bandwidth = 2 * bytes / median copy time (one measurement per device);
    of_copy_bandwidth divides an op's traffic rate by it."""
    import torch

    monkeypatch.setattr(timing, "FLUSH_BYTES", 1 << 16)
    monkeypatch.setattr(timing, "_COPY_BW", {})
    calls = []
    monkeypatch.setattr(timing, "interleaved", lambda cands, **kw: calls.append(cands) or {"copy": 0.5})
    bw = timing.copy_bandwidth(torch.device("cpu"))
    assert bw == 2 * (1 << 16) / 0.5
    timing.copy_bandwidth(torch.device("cpu"))
    assert len(calls) == 1
    assert timing.of_copy_bandwidth(bw * 0.25, 0.5, torch.device("cpu")) == 0.5


def test_nar_step_bench_reports_copy_fraction_and_torch_clipped_sgd():
    from fedopt_kernels.benchmarks import nar_step

    rows = nar_step.bench_nar_step([(64, 3), (64,)], label="tiny", repeats=1, include_compile=False)
    cases = {r["case"]: r for r in rows}
    assert "torch SGD(fused) + clip_grad_norm_(foreach)" in cases  # torch >= 2.4 has fused SGD on the CPU
    assert all(r["of copy bw"] > 0 for r in rows)
