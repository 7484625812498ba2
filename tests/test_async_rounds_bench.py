"""benchmarks.async_rounds on two short cases: the rows it reports come from the runs
(updates counted from the records, the target reached where the record says so)."""

from fedopt_kernels.benchmarks import async_rounds


def test_rows_count_the_updates_and_the_target_from_the_records():
    rows = async_rounds.run(rounds=2, clients=12, per_round=4, target=0.0, heterogeneity=("heavy",))
    sync, buff = rows
    assert (sync["mode"], buff["mode"]) == ("sync", "fedbuff")
    assert sync["client updates"] == 2 * 4 and buff["client updates"] == 4 * 2  # 2 rounds of 4; 4 steps of 2
    # a 0% target is reached at the first round: its virtual time and its updates
    assert sync["updates to 0%"] == 4 and buff["updates to 0%"] == 2
    assert 0 < sync["virtual s to 0%"] <= sync["virtual s"] and 0 < buff["virtual s to 0%"] <= buff["virtual s"]


def test_summary_is_the_mean_and_spread_over_seeds_of_the_runs():
    def row(seed, acc, t, ups):
        return {"dataset": "d", "algo": "fedavg", "heterogeneity": "heavy", "mode": "fedbuff", "grouping": "in_flight",
                "seed": seed, "target": 0.5, "final accuracy": acc, "virtual s to 50%": t, "updates to 50%": 10,
                "updates / wall s": ups, "virtual s": 9.0}

    (s,) = async_rounds.summary([row(0, 0.8, 2.0, 100.0), row(1, 0.6, None, 200.0), row(2, 0.7, 4.0, 300.0)])
    assert s["seeds"] == 3 and s["reached"] == 2
    assert abs(s["final accuracy"] - 0.7) < 1e-12 and abs(s["final accuracy +-"] - 0.1) < 1e-12
    assert s["virtual s to target"] == 3.0 and abs(s["virtual s to target +-"] - 2 ** 0.5) < 1e-12  # seeds that reached
    assert s["updates / wall s"] == 200.0 and s["updates / wall s +-"] == 100.0
