"""benchmarks.compressed_accuracy on two tiny cells: its bytes come from the records (the
codec's reply size times the round's clients), its accuracy from the run's evaluations;
the suite registers it as a named-only row family of ``fedopt bench``."""

from fedopt_kernels.benchmarks import compressed_accuracy as bench
from fedopt_kernels.benchmarks import suite
from fedopt_kernels.compression import parse_codec


def test_rows_come_from_the_runs(monkeypatch):
    monkeypatch.setattr(bench, "BASE", dict(algo="fedavg", clients=6, per_round=3, local_steps=2))
    monkeypatch.setitem(bench.DATASETS, "synthetic", dict(dataset="synthetic", max_samples_per_client=30,
                                                           hidden=(8,)))
    rows = bench.run(rounds=1, datasets=("synthetic",), codecs=("fp32", "top-k 1% + EF"))
    fp32, topk = rows
    n = fp32["params"]
    assert fp32["bytes_up"] == fp32["bytes_up_fp32"] == 3 * 4 * n and fp32["x fewer bytes"] == 1
    assert topk["bytes_up"] == 3 * parse_codec("topk:0.01").bytes_per_reply(n)
    assert topk["x fewer bytes"] == topk["bytes_up_fp32"] / topk["bytes_up"]
    assert 0 <= topk["acc@1"] <= 1 and topk["acc@1"] == topk["final_acc"]
    text = bench.table(rows)
    assert "| top-k 1% + EF |" in text and f"{100 * topk['acc@1']:.1f}" in text
    assert "compressed_accuracy" in suite.EXTRA_SUITES and "compressed_accuracy" not in suite.SUITES
