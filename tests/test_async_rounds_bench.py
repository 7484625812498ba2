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
