"""What ``fedopt bench`` reports beyond medians (fedopt_kernels/benchmarks): the HBM peak
and the fraction of it a kernel reaches, the speed against torch's own way to do each
op, GPU launches per call, and the batched engine on the device against the CPU.  All
on CPU: the peak formula on fake device properties, the ratios on fake times, the
CUDA-only figures as NaN / skipped here.  No time is asserted."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from fedopt_kernels.benchmarks import aggregate, simulation, suite, timing


def test_peak_from_memory_clock_and_bus_width():
    """H100 SXM: 2619 MHz memory clock (torch reports kHz), 5120-bit bus, two transfers
    per clock: 2 * 2.619e9 * 5120 / 8 = 3.352e12 B/s."""
    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", memory_clock_rate=2_619_000, memory_bus_width=5120)
    peak, source = timing.peak_bandwidth_from_properties(props)
    assert peak == pytest.approx(3.35232e12, rel=1e-12)
    assert "2619 MHz" in source and "5120-bit" in source


@pytest.mark.parametrize("name,expected", [
    ("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H100 PCIe", 2.0e12), ("NVIDIA H200", 4.8e12),
    ("NVIDIA A100-SXM4-80GB", 2.039e12), ("NVIDIA A100-SXM4-40GB", 1.555e12)])
def test_peak_falls_back_to_the_name_table(name, expected):
    """No clock or bus width from torch (missing, or 0 as some drivers report): the vendor
    figure by name, the most specific key first (H100 PCIe is not an H100 SXM)."""
    for props in (SimpleNamespace(name=name), SimpleNamespace(name=name, memory_clock_rate=0, memory_bus_width=5120)):
        peak, source = timing.peak_bandwidth_from_properties(props)
        assert peak == expected and "vendor figure" in source


def test_peak_unknown_device_and_cpu_say_why():
    peak, source = timing.peak_bandwidth_from_properties(SimpleNamespace(name="Some GPU"))
    assert peak is None and "Some GPU" in source
    peak, source = timing.peak_bandwidth(torch.device("cpu"))
    assert peak is None and "cpu" in source
    assert math.isnan(timing.of_hbm_peak(1e9, 1e-3, torch.device("cpu")))


def test_ratio_rows_hbm_fraction_and_vs_torch(monkeypatch):
    """Hand-computed: 1 GB of minimum traffic in 0.5 ms on a 4 TB/s device is 2 TB/s, half
    the peak; the torch anchor takes 1.5 ms, so the fused op is 3x it."""
    monkeypatch.setattr(timing, "peak_bandwidth", lambda device: (4e12, "test"))
    monkeypatch.setattr(timing, "of_copy_bandwidth", lambda traffic, seconds, device: 0.25)
    times = {"fused": 0.5e-3, "floor": 0.25e-3, "torch op": 1.5e-3, "one-off": 7.0}
    rows = timing.ratio_rows("b", times, base="floor", fused="fused", traffic_bytes=1e9, device=torch.device("cuda"),
                             not_timed=("one-off",), torch_anchor="torch op")
    by = {r["case"]: r for r in rows}
    assert by["fused"]["of HBM peak"] == pytest.approx(0.5)
    assert by["torch op"]["of HBM peak"] == pytest.approx(1e9 / 1.5e-3 / 4e12)
    assert by["fused"]["vs torch"] == pytest.approx(3.0)
    assert by["floor"]["vs torch"] == pytest.approx(6.0) and by["torch op"]["vs torch"] == 1.0
    assert math.isnan(by["one-off"]["vs torch"]) and math.isnan(by["one-off"]["of HBM peak"])
    assert all(r["torch anchor"] == "torch op" for r in rows)


def test_ratio_rows_without_the_anchor_in_this_torch():
    """An anchor this torch lacks (no fused SGD) gives NaN, not a KeyError."""
    rows = timing.ratio_rows("b", {"fused": 1.0, "floor": 1.0}, base="floor", fused="fused", torch_anchor="absent")
    assert all(math.isnan(r["vs torch"]) for r in rows)


def test_launch_counting_is_none_off_cuda_and_calls_nothing():
    calls = []
    assert timing.count_launches(lambda: calls.append(1), torch.device("cpu")) is None
    assert timing.launch_counts({"a": lambda: calls.append(1)}, torch.device("cpu")) == {}
    rows = [{"case": "a"}]
    deferred = []
    assert timing.defer_launch_columns(rows, {"a": lambda: calls.append(1)}, torch.device("cpu"), deferred) is rows
    assert calls == [] and deferred == []  # nothing profiled, nothing kept
    assert math.isnan(rows[0]["launches"]) and math.isnan(rows[0]["launch API calls"])


def test_launch_columns_wait_for_the_deferred_count(monkeypatch):
    """On CUDA the suite counts launches once every timing is done: the columns are NaN
    until the deferred function runs, then hold the counts; without a ``deferred`` list
    the count is taken at once.  (The profiler itself is faked: no GPU here.)"""
    seen = []

    def fake_counts(candidates, device):
        seen.append(sorted(candidates))
        return {"fused": timing.LaunchCount(2, 2), "torch op": timing.LaunchCount(9, 8)}

    monkeypatch.setattr(timing, "launch_counts", fake_counts)
    candidates = {"fused": lambda: None, "torch op": lambda: None, "floor": lambda: None}
    rows = [{"case": name} for name in candidates]
    deferred = []
    timing.defer_launch_columns(rows, candidates, torch.device("cuda"), deferred)
    assert len(deferred) == 1 and seen == [] and all(math.isnan(r["launches"]) for r in rows)
    deferred[0]()
    by = {r["case"]: r for r in rows}
    assert by["fused"]["launches"] == 2.0 and by["torch op"]["launches"] == 9.0
    assert by["torch op"]["launch API calls"] == 8.0 and math.isnan(by["floor"]["launches"])
    now = [{"case": "fused"}]
    timing.defer_launch_columns(now, candidates, torch.device("cuda"), None)
    assert now[0]["launches"] == 2.0 and len(seen) == 2


def test_aggregate_has_the_stack_sum_anchor_and_it_sums_the_list():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(5, 37, generator=g)
    w = torch.full((5,), 0.2)
    candidates = aggregate.aggregate_candidates(X, w, torch.empty(37))
    assert aggregate.TORCH_ANCHOR == "floor: torch.stack(list).sum(0)" and aggregate.TORCH_ANCHOR in candidates
    rows = list(X.unbind(0))
    torch.testing.assert_close(candidates[aggregate.TORCH_ANCHOR](), torch.stack(rows).sum(0), rtol=0, atol=0)
    torch.testing.assert_close(candidates[aggregate.FLOOR](), X.sum(0), rtol=0, atol=0)


def test_aggregate_bench_rows_on_cpu():
    rows = aggregate.bench_aggregate(3, 64, label="tiny", repeats=1, cache="warm")
    by = {r["case"]: r for r in rows}
    assert by[aggregate.TORCH_ANCHOR]["vs torch"] == 1.0 and by["fused"]["vs torch"] > 0
    assert all(math.isnan(r["of HBM peak"]) and math.isnan(r["launches"]) for r in rows)  # CPU: no peak, no count


def test_device_vs_cpu_is_skipped_on_cpu():
    rows = simulation.run_device_vs_cpu(device="cpu")
    assert len(rows) == 1 and rows[0]["case"].startswith("skipped") and math.isnan(rows[0]["vs cpu"])


def test_only_device_vs_cpu_on_cpu_says_skipped(capsys):
    assert "device_vs_cpu" in suite.SUITES
    assert suite.main(["--device", "cpu", "--quick", "--only", "device_vs_cpu"]) == 0
    out = capsys.readouterr().out
    assert "skipped" in out and "device vs CPU" in out


def test_quick_aggregate_end_to_end_json_has_the_new_columns(tmp_path, monkeypatch, capsys):
    """``fedopt bench --device cpu --quick --only aggregate --json F``: a meta row first
    (device, peak and its source), then rows with the new columns (NaN on CPU where the
    figure is CUDA's)."""
    from fedopt_kernels.cli import main

    monkeypatch.setattr(timing, "FLUSH_BYTES", 1 << 22)  # cold-cache flush and copy bandwidth, small
    monkeypatch.setattr(timing, "_COPY_BW", {})
    monkeypatch.setattr(suite, "numel", lambda shapes: 4096)  # small clients: this tests the report, not the speed
    out = tmp_path / "bench.json"
    assert main(["bench", "--device", "cpu", "--quick", "--only", "aggregate", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert isinstance(data, list)
    meta, rows = data[0], data[1:]
    assert meta["benchmark"] == "meta" and meta["device"] == "cpu" and "hbm peak source" in meta
    assert math.isnan(meta["hbm peak B/s"]) and meta["copy bw B/s"] > 0
    assert rows and all(r["benchmark"].startswith("aggregate") for r in rows)
    for r in rows:
        assert {"vs torch", "of HBM peak", "launches", "of copy bw", "torch anchor"} <= set(r)
        assert math.isnan(r["of HBM peak"]) and math.isnan(r["launches"])
    assert {r["case"] for r in rows} >= {"fused", aggregate.TORCH_ANCHOR}
    printed = capsys.readouterr().out
    assert "x floor: torch.stack(list).sum(0)" in printed  # the summary line per case


def test_device_operations_count_kernels_memsets_and_memcpys_only():
    """What ``count_launches`` counts in a profiler trace: GPU-side kernels, memsets and
    memcpys; not CPU ops, not the GPU-timeline copy of a ``record_function`` range (an
    optimizer's ``step``), not synchronisation records."""
    from torch.autograd import DeviceType

    def ev(name, device_type=DeviceType.CUDA, is_user_annotation=False):
        return SimpleNamespace(name=name, device_type=device_type, is_user_annotation=is_user_annotation)

    events = [ev("aten::add_", DeviceType.CPU), ev("cudaLaunchKernel", DeviceType.CPU),
              ev("void at::native::vectorized_elementwise_kernel<4>(...)"), ev("nar_norm_kernel"),
              ev("Memset (Device)"), ev("Memcpy DtoH (Device -> Pinned)"),
              ev("Optimizer.step#SGD.step", is_user_annotation=True), ev("Context Sync"), ev("Stream Wait Event")]
    assert timing.device_operations(events) == 4
    host = [ev("cudaLaunchKernel", DeviceType.CPU), ev("cudaLaunchKernelExC_v11060", DeviceType.CPU),
            ev("cuLaunchKernel", DeviceType.CPU), ev("cudaMemsetAsync", DeviceType.CPU),
            ev("cudaMemcpyAsync", DeviceType.CPU), ev("cudaDeviceSynchronize", DeviceType.CPU),
            ev("cudaStreamIsCapturing", DeviceType.CPU), ev("aten::add_", DeviceType.CPU), ev("nar_norm_kernel")]
    assert timing.launch_api_calls(host) == 5


def test_device_vs_cpu_measurement_runs_and_both_sides_run_the_same_rounds():
    """The GPU-only comparison's code path, run here CPU against CPU (tiny: the MLP, 2 of
    10 clients, one timed round): two rows, the same model after the same rounds."""
    rows = simulation._time_device_and_cpu("mlp", 10, 2, name="t", device=torch.device("cpu"), backend=None,
                                           rounds=1, warmup=1)
    assert [r["benchmark"] for r in rows] == ["t", "t"]
    assert rows[0]["ms"] > 0 and rows[1]["vs cpu"] == 1.0
    assert rows[0]["vs cpu"] == pytest.approx(rows[1]["ms"] / rows[0]["ms"])
    assert rows[0]["max |device - cpu| x"] <= 1e-5


def test_peak_of_a_cuda_device_is_looked_up_once_and_reported_in_the_meta_row(monkeypatch):
    """The CUDA path with the device faked: H200's 3201 MHz x 6144-bit bus is
    2 * 3.201e9 * 768 = 4.9167e12 B/s; the meta row puts a measured copy bandwidth of 90%
    of it beside it."""
    calls = []
    props = SimpleNamespace(name="NVIDIA H200", memory_clock_rate=3_201_000, memory_bus_width=6144)
    monkeypatch.setattr(timing, "_PEAK_BW", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: calls.append(index) or props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: props.name)
    peak, _ = timing.peak_bandwidth(torch.device("cuda:0"))
    timing.peak_bandwidth("cuda:0")
    assert peak == pytest.approx(4.916736e12) and calls == [0]
    monkeypatch.setattr(timing, "_COPY_BW", {"cuda:0": 0.9 * peak})
    meta = suite.meta_row("cuda:0")
    assert meta["hbm peak B/s"] == peak and meta["copy bw of HBM peak"] == pytest.approx(0.9)
    assert meta["device name"] == "NVIDIA H200" and "3201 MHz" in meta["hbm peak source"]
    assert "4917 GB/s" in suite.device_line(meta)


def test_summary_line_per_fused_case():
    """Hand-computed from rows as ratio_rows and the launch columns write them."""
    common = {"benchmark": "nar_step X", "torch anchor": "torch op"}
    rows = [dict(common, case="fused", ms=0.5, **{"vs torch": 3.0, "of HBM peak": 0.5, "launches": 2.0}),
            dict(common, case="torch op", ms=1.5, **{"vs torch": 1.0, "of HBM peak": 1 / 6, "launches": 9.0}),
            dict(common, case="floor", ms=0.25, **{"vs torch": 6.0, "of HBM peak": 1.0, "launches": 2.0}),
            {"benchmark": "simulation", "case": "fused", "ms": 1.0, "vs hand loop": 2.0}]
    assert suite.summary_lines(rows) == [
        "nar_step X: fused is 3x torch op (0.5 ms vs 1.5 ms), 50% of HBM peak (anchor 17%), 2 launches (anchor 9)"]
    rows[0]["launch API calls"] = 3.0  # the two counts of one trace disagree: said
    assert suite.summary_lines(rows)[0].endswith("2 launches (anchor 9) -- but 3 launch calls on the host")
    cpu = [dict(r, **{"of HBM peak": float("nan"), "launches": float("nan")}) for r in rows[:2]]
    assert suite.summary_lines(cpu) == ["nar_step X: fused is 3x torch op (0.5 ms vs 1.5 ms)"]


def test_device_vs_cpu_summary_lines():
    rows = [{"benchmark": "sim d", "case": "batched engine on cuda", "ms": 10.0, "vs cpu": 8.0,
             "max |device - cpu| x": 1e-6},
            {"benchmark": "sim d", "case": "batched engine on cpu", "ms": 80.0, "vs cpu": 1.0}]
    assert suite.summary_lines(rows) == [
        "sim d: batched engine on cuda: 10 ms/round, 8x the CPU engine (max |device - cpu| x 1e-06)"]
    assert suite.summary_lines(simulation.run_device_vs_cpu(device="cpu"))[0].endswith(
        "skipped: --device is cpu, no device to compare with the CPU")


def test_highlights_of_a_bench_json(tmp_path, capsys):
    """``python -m fedopt_kernels.benchmarks.highlights F --label bench`` (scripts/device-check.sh):
    the meta row in words, then the summary lines, each labelled; a bad file exits 1."""
    from fedopt_kernels.benchmarks import highlights

    nan = float("nan")
    meta = {"benchmark": "meta", "case": "device", "device name": "NVIDIA H100 80GB HBM3", "hbm peak B/s": 3.35232e12,
            "hbm peak source": "src", "copy bw B/s": 2.9e12}
    common = {"benchmark": "aggregate X", "torch anchor": "torch op", "of HBM peak": nan, "launches": nan}
    rows = [meta, dict(common, case="fused", ms=1.0, **{"vs torch": 2.0}),
            dict(common, case="torch op", ms=2.0, **{"vs torch": 1.0})]
    f = tmp_path / "bench.json"
    f.write_text(json.dumps(rows))
    assert highlights.main([str(f), "--label", "bench"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "bench: NVIDIA H100 80GB HBM3: HBM peak 3352 GB/s (src); measured copy bandwidth 2900 GB/s",
        "bench: aggregate X: fused is 2x torch op (1 ms vs 2 ms)"]
    f.write_text("{}")
    assert highlights.main([str(f)]) == 1


def test_cpu_meta_row_names_the_huge_pages_the_allocations_get(monkeypatch, tmp_path):
    """THP_MEM_ALLOC_ENABLE (torch's 2 MiB-aligned, madvised allocations) and the kernel's
    THP mode move the compressed decode-aggregate by ~1.3x on the dev VM: the run says
    which it had, in the meta row and in its line."""
    monkeypatch.setattr(timing, "_COPY_BW", {})
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    sysfs = tmp_path / "enabled"
    sysfs.write_text("always [madvise] never\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(
        sysfs if p == "/sys/kernel/mm/transparent_hugepage/enabled" else p, *a, **k))
    meta = suite.meta_row("cpu")
    assert meta["THP_MEM_ALLOC_ENABLE"] == "1" and meta["thp mode"] == "madvise"
    assert suite.device_line(meta).endswith("; THP_MEM_ALLOC_ENABLE=1, transparent hugepages madvise")
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    sysfs.unlink()  # no sysfs (not Linux): unknown, not an error
    meta = suite.meta_row("cpu")
    assert meta["THP_MEM_ALLOC_ENABLE"] is None and meta["thp mode"] is None
    assert suite.device_line(meta).endswith("; THP_MEM_ALLOC_ENABLE=unset, transparent hugepages unknown")
