"""``--distributed --compress`` (issue 42 item 3): 2 gloo processes, each rank encoding its
own clients' updates, the replies all-gathered in rank order and decoded inside the fused
aggregation on every rank, equal the single-process compressed run bit for bit (global
model and every round record, ``bytes_up`` included), for int8, int4 with stochastic
rounding and the rotation (FedAdam), top-k with an attack, and int8 with the median and
with DP-FedAvg (noise), int8 with error feedback over 3 rounds (every rank's residuals
equal one process's); the record's bytes against the codec's own count.  A distributed
compressed run stopped after 2 rounds and resumed from rank 0's checkpoint on every rank
equals the uninterrupted run: model, records and every client's residual."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

import _gloo as gloo
from _asserts import assert_bitwise

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available in this torch build")

WORLD = 2
BASE = dict(dataset="synthetic", clients=9, per_round=5, rounds=2, local_steps=2, hidden=(16,), seed=4,
            partition="dirichlet", max_samples_per_client=40, batch_size=16, engine="sequential")
CASES = {  # fp8 takes int4's path (codes as uint8 bytes, one array of scales); it passed too when run by hand
    "int8_error_feedback": dict(compress="int8", error_feedback=True, rounds=3),
    "int4_stochastic_rotated_fedadam": dict(compress="int4", compress_stochastic=True, compress_rotate=True,
                                            compress_block=64, algo="fedadam"),
    "topk_attack": dict(compress="topk:0.05", attack="signflip", attack_fraction=0.2),
    "int8_median": dict(compress="int8", aggregator="median"),
    "int8_dp": dict(compress="int8", weighting="uniform", dp_clip=0.05, dp_noise_multiplier=0.8, dp_delta=1e-3),
}


RESUMED = ["int8_error_feedback"]  # 3 rounds: stopped after 2 and resumed


def config(case):
    from fedopt_kernels.fl import SimulationConfig

    return SimulationConfig(**{**BASE, **CASES[case]})


def _scenario(rank, world):
    from fedopt_kernels.fl.run.distributed_simulation import DistributedSimulation

    got = {}
    for case in CASES:
        sim = DistributedSimulation(config(case))
        res = sim.run()
        got[case] = dict(x=sim.x_global.clone(), records=res.records, state=sim.client_state.state_dict())
    for case in RESUMED:  # 2 rounds, rank 0's checkpoint (as `fedopt simulate` writes it) on every rank, then the rest
        first = DistributedSimulation(config(case))
        first.run(2)
        buf = io.BytesIO()
        torch.save(first.state_dict(), buf)
        shared = [buf.getvalue()]
        dist.broadcast_object_list(shared, src=0)
        resumed = DistributedSimulation(config(case))
        resumed.load_state_dict(torch.load(io.BytesIO(shared[0]), weights_only=True))
        res = resumed.run()
        got[case + "_resumed"] = dict(x=resumed.x_global.clone(), records=res.records,
                                      state=resumed.client_state.state_dict(), server=resumed.state_dict()["server"])
    return got


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return gloo.launch(tmp_path_factory.mktemp("dist_compressed"), WORLD, _scenario, timeout_s=400)


@pytest.mark.parametrize("case", list(CASES))
def test_distributed_compressed_run_equals_one_process_bit_for_bit(ranks, case, one_thread):
    """(one thread here, as each rank: the training's bits depend on the thread count)"""
    from fedopt_kernels.fl import Simulation

    sim = Simulation(config(case))
    res = sim.run()
    per_reply = config(case).codec().bytes_per_reply(sim.numel)
    for r, got in enumerate(ranks):
        got = got[case]
        assert_bitwise(got["x"], sim.x_global, f"rank {r} global model")
        assert len(got["records"]) == len(res.records) == config(case).rounds + 1
        for mine, theirs in zip(got["records"][1:], res.records[1:]):
            mine, theirs = dict(mine), dict(theirs)
            # error feedback's residual rows between ranks: 4 N bytes per encoded client (no
            # client of these cases is left out), a record key one process does not have
            shared = mine.pop("ef_bytes_between_ranks", None)
            assert shared == (4 * sim.numel * len(mine["clients"]) if "error_feedback" in case else None), case
            for rec in (mine, theirs):
                rec.pop("wall_time", None)
                if r != 0:
                    rec.pop("test_accuracy", None), rec.pop("test_loss", None)
            assert mine == theirs, f"rank {r}: {mine} vs {theirs}"
            # the bytes the replies carried: the codec's count per reply, against fp32
            assert mine["bytes_up"] == len(mine["clients"]) * per_reply
            assert mine["bytes_up_fp32"] == len(mine["clients"]) * 4 * sim.numel
    assert all(rec["update_norm"] > 0 for rec in res.records[1:])  # the rounds moved the model
    if "error_feedback" in case:  # every rank holds every residual, as one process does
        want = sim.client_state.state_dict()["ef_residual"]
        for r, got in enumerate(ranks):
            mine = got[case]["state"]["ef_residual"]
            assert torch.equal(mine["clients"], want["clients"]) and want["clients"].numel() > 0
            assert_bitwise(mine["rows"], want["rows"], f"rank {r} residuals")




@pytest.mark.parametrize("case", RESUMED)
def test_a_resumed_distributed_compressed_run_equals_the_whole_run(ranks, case):
    def strip(records, rank):
        out = []
        for rec in records:
            rec = dict(rec)
            rec.pop("wall_time", None)
            if rank != 0:  # only rank 0 evaluates (a resumed rank holds rank 0's earlier records)
                rec.pop("test_accuracy", None), rec.pop("test_loss", None)
            out.append(rec)
        return out

    for r, got in enumerate(ranks):
        whole, resumed = got[case], got[case + "_resumed"]
        assert_bitwise(resumed["x"], whole["x"], f"rank {r} global model")
        assert len(resumed["records"]) == config(case).rounds + 1
        assert strip(resumed["records"], r) == strip(whole["records"], r), f"rank {r}"
        a, b = resumed["state"]["ef_residual"], whole["state"]["ef_residual"]
        assert torch.equal(a["clients"], b["clients"]) and b["clients"].numel() > 0
        assert_bitwise(a["rows"], b["rows"], f"rank {r} residuals")
