"""Issue 43: DiLoCo and Streaming DiLoCo over torch.distributed (gloo, 2 processes).

The oracle is python_ref/diloco.py: the same K workers simulated as plain loops in ONE
process (rank 0's, so the inner steps run on the same threads and code paths), with
the outer step written out by its formula.  Every case of the module runs in one
launch of 2 gloo processes (they are slow to start: one pays for all); each test then
checks its part of the ranks' results.

* DiLoCo, fp32, uniform and token-weighted, ``mode="ordered"``: every worker's
  parameters, the snapshot and the outer momentum equal the reference loop's bit for
  bit, over 2 syncs and a half round; ``"all_reduce"`` within a tolerance;
* a DDP-wrapped model (DDP inside each island) gives the same bits;
* a hand-computed two-sync case of the outer Nesterov step (float64);
* resume in the middle of an outer round: bit for bit the uninterrupted run;
* the codec seam with an fp16-cast codec defined here (oracle: the formula on the
  workers' parameters, with the outer gradients rounded through fp16);
* Streaming DiLoCo: the fragment schedule, and the overlapped exchange with the alpha
  merge against the reference, bit for bit;
* the quantized exchange (fp8, int4 through ops.compressed; blocks of 32 on a
  66-parameter model: a partial last block): DiLoCo and Streaming DiLoCo bit for bit the
  reference loops with the codec of python_ref/compression.py, resume with a quantized
  exchange in flight, and the bytes each worker sends, counted by hand;
* bad settings refused before anything changes (in this process, a 1-rank group).
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

import python_ref.diloco as R
from _asserts import assert_bitwise
from _diloco_case import H, STEPS, inner_step_fn, make_model, momentum_of, params_of, reference, reference_workers
from _gloo import launch

QUANT_CODECS = ("fp8", "int4")


_SINGLES = []


def singles():
    """One 1-rank group per rank, made once per process (a gloo group costs a rendezvous)."""
    if not _SINGLES:
        _SINGLES.extend(dist.new_group([r]) for r in range(dist.get_world_size()))
    return _SINGLES


def run_diloco(rank, steps, *, weighted, mode="ordered", ddp=False, codec=None, before_sync=None, **kw):
    from fedopt_kernels.distributed import DiLoCo

    model = make_model()
    net = model
    if ddp:  # each island a DDP group of its own (one rank here); DiLoCo across the islands
        net = nn.parallel.DistributedDataParallel(model, process_group=singles()[rank])
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    diloco = DiLoCo(net, opt, sync_every=H, mode=mode, codec=codec, **kw)
    step = inner_step_fn({rank: net}, {rank: opt})
    records = []
    if before_sync is not None:  # after the inner step that ends a round, before its sync
        opt.register_step_post_hook(lambda *_: before_sync(diloco) if (diloco.local_step + 1) % H == 0 else None)
    for t in range(1, steps + 1):
        n = step(rank, t)
        rec = diloco.step(tokens=n if weighted else None)
        if rec is not None:
            records.append(rec)
    return diloco, records


class Fp16Codec:
    """The trivial codec of the seam's test: fp32 -> fp16 -> fp32."""

    def encode(self, delta):
        return delta.to(torch.float16)

    def decode(self, payload):
        return payload.to(torch.float32)


def hand_case(rank):
    """Two syncs of a one-parameter float64 model, inner SGD(lr 1) on set gradients."""
    from fedopt_kernels.distributed import DiLoCo

    w = nn.Parameter(torch.ones(1, dtype=torch.float64))
    model = nn.Module()
    model.w = w
    opt = torch.optim.SGD([w], lr=1.0)
    diloco = DiLoCo(model, opt, sync_every=1)
    grads = [(0.5, 0.3), (0.25, 0.05)]
    out = []
    for g in grads:
        w.grad = torch.full((1,), g[rank], dtype=torch.float64)
        diloco.step()
        out.append((w.detach().clone(), diloco.outer_optimizer.state[w]["momentum_buffer"].clone()))
    return out


def streaming_case(rank, *, tau, alpha, weighted, steps=11, H_s=4, **kw):
    from fedopt_kernels.distributed import StreamingDiLoCo

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    s = StreamingDiLoCo(model, opt, fragments=[["0.weight", "0.bias"], ["2.weight", "2.bias"]], sync_every=H_s,
                        overlap=tau, alpha=alpha, **kw)
    step = inner_step_fn({rank: model}, {rank: opt})
    sent, sent_bytes = [], []
    for t in range(1, steps + 1):
        n = step(rank, t)
        rec = s.step(tokens=n if weighted else None)
        sent.append([r.fragment for r in rec.sent])
        sent_bytes += [(r.fragment, r.payload_bytes) for r in rec.sent]
    return {"params": params_of(s), "globals": [g.clone() for g in s.global_fragments], "sent": sent,
            "bytes": sent_bytes}


def streaming_resume(rank, *, tau=2, alpha=0.3, steps=11, H_s=4, stop=7, **kw):
    """The (tau 2, alpha 0.3, tokens) streaming run saved after step 7 -- fragment 1's
    exchange of step 6 still in flight -- and continued in fresh objects."""
    from fedopt_kernels.distributed import StreamingDiLoCo

    def make(seed):
        model = make_model(seed=seed)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        s = StreamingDiLoCo(model, opt, fragments=[["0.weight", "0.bias"], ["2.weight", "2.bias"]], sync_every=H_s,
                            overlap=tau, alpha=alpha, broadcast_initial=False, **kw)
        return model, opt, s

    model, opt, s = make(0)
    step = inner_step_fn({rank: model}, {rank: opt})
    for t in range(1, stop + 1):
        s.step(tokens=step(rank, t))
    saved = s.state_dict()
    in_flight = [x[:3] for x in saved["in_flight"]]
    model, opt, s = make(99)
    s.load_state_dict(saved)
    step = inner_step_fn({rank: model}, {rank: opt})
    for t in range(stop + 1, steps + 1):
        s.step(tokens=step(rank, t))
    return {"params": params_of(s), "globals": [g.clone() for g in s.global_fragments], "in_flight": in_flight}


def streaming_reference(*, tau, alpha, weighted, steps=11, H_s=4, world=2, **kw):
    models, inner = reference_workers(world)
    thetas, _ = R.streaming_diloco_loop([list(m.parameters()) for m in models], [[0, 1], [2, 3]], inner, H=H_s,
                                        steps=steps, tau=tau, alpha=alpha, weighted=weighted, **kw)
    return thetas, [[p.detach().clone() for p in m.parameters()] for m in models]


def island_case(rank, *, fsdp):
    """One island of both ranks (DDP, or FSDP2 sharding every parameter over them), DiLoCo
    across islands (a 1-rank group each: K = 1): the full parameters after the run."""
    from fedopt_kernels.distributed import DiLoCo

    model = make_model()
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        net = model
    else:
        net = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    d = DiLoCo(net, opt, sync_every=H, group=singles()[rank])
    step = inner_step_fn({rank: net}, {rank: opt})
    for t in range(1, STEPS + 1):
        step(rank, t)
        d.step()
    full = [p.full_tensor() if fsdp else p.detach().clone() for p in model.parameters()]
    return {"full": full, "local_numel": d.numel, "momentum": momentum_of(d)}


def body(rank, world):
    torch.manual_seed(0)
    out = {}
    for weighted in (False, True):
        d, recs = run_diloco(rank, STEPS, weighted=weighted)
        out[f"ordered_{weighted}"] = {"params": params_of(d), "snapshot": d.snapshot.clone(), "m": momentum_of(d),
                                      "bytes": [r.payload_bytes for r in recs], "steps": [r.step for r in recs]}
    d, _ = run_diloco(rank, STEPS, weighted=True, mode="all_reduce")
    out["all_reduce"] = {"params": params_of(d), "snapshot": d.snapshot.clone()}
    d, _ = run_diloco(rank, STEPS, weighted=True, ddp=True)
    out["ddp"] = {"params": params_of(d), "snapshot": d.snapshot.clone()}
    out["hand"] = hand_case(rank)
    out["island_ddp"] = island_case(rank, fsdp=False)
    out["island_fsdp"] = island_case(rank, fsdp=True)

    # resume in the middle of the second round: save after 4 steps, continue in a fresh object
    d, _ = run_diloco(rank, 4, weighted=True)
    saved = d.state_dict()
    from fedopt_kernels.distributed import DiLoCo
    model = make_model(seed=123)  # different init: everything must come from the state
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    fresh = DiLoCo(model, opt, sync_every=H)
    fresh.load_state_dict(saved)
    step = inner_step_fn({rank: model}, {rank: opt})
    for t in range(5, STEPS + 1):
        fresh.step(tokens=step(rank, t))
    out["resumed"] = {"params": params_of(fresh), "snapshot": fresh.snapshot.clone(), "m": momentum_of(fresh)}

    # the codec seam: the parameters just before the first sync, then the sync's result
    before = []
    d, recs = run_diloco(rank, H, weighted=False, codec=Fp16Codec(),
                         before_sync=lambda dl: before.append((dl.snapshot.clone(), [p.detach().clone()
                                                                                       for p in dl.params])))
    out["codec"] = {"before": before[0], "params": params_of(d), "m": momentum_of(d),
                    "bytes": recs[0].payload_bytes, "numel": d.numel}

    for tau, alpha, weighted in ((1, 0.5, False), (2, 0.3, True), (0, 0.0, False)):
        out[f"stream_{tau}_{alpha}_{weighted}"] = streaming_case(rank, tau=tau, alpha=alpha, weighted=weighted)

    out["stream_resumed"] = streaming_resume(rank)

    # the quantized exchange (blocks of 32 over 66 parameters: 3 blocks, the last one partial)
    for codec in QUANT_CODECS:
        d, recs = run_diloco(rank, STEPS, weighted=True, codec=codec, codec_block=32)
        out[f"q_{codec}"] = {"params": params_of(d), "snapshot": d.snapshot.clone(), "m": momentum_of(d),
                             "bytes": [r.payload_bytes for r in recs], "left_out": [r.left_out for r in recs]}
        out[f"qs_{codec}"] = streaming_case(rank, tau=2, alpha=0.3, weighted=True, codec=codec, codec_block=32)
    out["qs_resumed"] = streaming_resume(rank, codec="int4", codec_block=32)

    # rank 1's outer gradient holds a NaN at the first sync: its int4 reply (a NaN scale) is left out
    def poison(dl):
        out["q_nan_before"] = (dl.snapshot.clone(), [p.detach().clone() for p in dl.params])
        if rank == 1:
            with torch.no_grad():
                dl.params[0].view(-1)[40 % dl.params[0].numel()] = float("nan")

    d, recs = run_diloco(rank, H, weighted=True, codec="int4", codec_block=32, before_sync=poison)
    out["q_nan"] = {"snapshot": d.snapshot.clone(), "left_out": recs[0].left_out, "stats": recs[0].stats}

    if rank == 0:  # the oracle, in this process (same threads and code paths as the workers)
        out["ref"] = {w: reference(STEPS, w) for w in (False, True)}
        out["stream_ref"] = {k: streaming_reference(tau=k[0], alpha=k[1], weighted=k[2])
                             for k in ((1, 0.5, False), (2, 0.3, True), (0, 0.0, False))}
        out["q_ref"] = {c: reference(STEPS, True, codec=c, block=32) for c in QUANT_CODECS}
        out["qs_ref"] = {c: streaming_reference(tau=2, alpha=0.3, weighted=True, codec=c, block=32)
                         for c in QUANT_CODECS}
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("diloco"), 2, body)


@pytest.mark.parametrize("weighted", [False, True], ids=["uniform", "tokens"])
def test_diloco_is_bitwise_the_reference_loop(ranks, weighted):
    theta, m, workers = ranks[0]["ref"][weighted]
    n_params = [p.numel() for p in workers[0]]
    for r in range(2):
        got = ranks[r][f"ordered_{weighted}"]
        assert got["steps"] == [3, 6]
        assert_bitwise(got["snapshot"], theta, f"rank {r} snapshot")
        assert_bitwise(got["m"], m, f"rank {r} outer momentum")
        assert_bitwise(got["params"], workers[r], f"rank {r} parameters half a round after the 2nd sync")
        assert got["bytes"] == [4 * sum(n_params)] * 2
    # the weighting is not a no-op: the two runs differ
    assert not torch.equal(ranks[0]["ordered_True"]["snapshot"], ranks[0]["ordered_False"]["snapshot"])


def test_all_reduce_mode_is_close_to_the_reference(ranks):
    theta, _, _ = ranks[0]["ref"][True]
    for r in range(2):
        torch.testing.assert_close(ranks[r]["all_reduce"]["snapshot"], theta, rtol=1e-5, atol=1e-6)
    assert_bitwise(ranks[0]["all_reduce"]["snapshot"], ranks[1]["all_reduce"]["snapshot"], "workers agree")


def test_ddp_wrapped_model_gives_the_same_bits(ranks):
    for r in range(2):
        assert_bitwise(ranks[r]["ddp"]["snapshot"], ranks[r]["ordered_True"]["snapshot"], f"rank {r} snapshot")
        assert_bitwise(ranks[r]["ddp"]["params"], ranks[r]["ordered_True"]["params"], f"rank {r} params")


def test_fsdp2_local_shards_step_as_the_ddp_island(ranks):
    """FSDP2 (fully_shard over both ranks): DiLoCo moves each rank's local shards; the
    full parameters equal those of the same island under DDP (the reduce-scatter's mean
    of 2 gradients and DDP's all-reduce mean round alike), on both ranks."""
    full_numel = sum(p.numel() for p in ranks[0]["island_ddp"]["full"])
    assert ranks[0]["island_fsdp"]["local_numel"] + ranks[1]["island_fsdp"]["local_numel"] == full_numel
    assert ranks[0]["island_fsdp"]["local_numel"] != ranks[1]["island_fsdp"]["local_numel"]  # uneven shards
    for r in range(2):
        assert_bitwise(ranks[r]["island_fsdp"]["full"], ranks[r]["island_ddp"]["full"], f"rank {r}")
    assert_bitwise(ranks[0]["island_ddp"]["full"], ranks[1]["island_ddp"]["full"], "one island: the ranks agree")


def test_outer_nesterov_two_syncs_hand_computed(ranks):
    # sync 1: Delta = mean(0.5, 0.3) = 0.4; m = 0.4; theta = 1 - 0.7 (0.9*0.4 + 0.4) = 0.468
    # sync 2: Delta = mean(0.25, 0.05) = 0.15; m = 0.9*0.4 + 0.15 = 0.51;
    #         theta = 0.468 - 0.7 (0.9*0.51 + 0.15) = 0.468 - 0.4263 = 0.0417
    expected = [(0.468, 0.4), (0.0417, 0.51)]
    for r in range(2):
        for (w, m), (ew, em) in zip(ranks[r]["hand"], expected):
            assert w.item() == pytest.approx(ew, abs=1e-14)
            assert m.item() == pytest.approx(em, abs=1e-14)


def test_resume_mid_round_is_bitwise_the_uninterrupted_run(ranks):
    for r in range(2):
        got, ref = ranks[r]["resumed"], ranks[r]["ordered_True"]
        assert_bitwise(got["snapshot"], ref["snapshot"], f"rank {r} snapshot")
        assert_bitwise(got["m"], ref["m"], f"rank {r} outer momentum")
        assert_bitwise(got["params"], ref["params"], f"rank {r} parameters")


def test_codec_seam_fp16_cast(ranks):
    snap = ranks[0]["codec"]["before"][0]
    deltas = [(snap - R.flat(ranks[r]["codec"]["before"][1])).half().float() for r in range(2)]
    D = R.mean_outer_gradient(deltas)
    theta, m = R.outer_nesterov(snap, D, torch.zeros_like(D), lr=0.7, momentum=0.9)
    for r in range(2):
        got = ranks[r]["codec"]
        assert_bitwise(got["m"], m, f"rank {r} momentum")
        assert_bitwise(R.flat(got["params"]), theta, f"rank {r} parameters")
        assert got["bytes"] == 2 * got["numel"]  # fp16 on the wire
    # the codec changed the result: fp32 exchange differs
    assert not torch.equal(ranks[0]["codec"]["m"], ranks[0]["ordered_False"]["m"])


def test_fragment_schedule():
    assert R.fragment_offsets(4, 2) == [0, 2]
    assert [R.syncs_at(t, 4, [0, 2]) for t in range(1, 9)] == [[], [1], [], [0], [], [1], [], [0]]
    from fedopt_kernels.distributed.streaming import fragment_schedule
    assert fragment_schedule(100, 4) == (0, 25, 50, 75)
    assert fragment_schedule(10, 3) == (0, 3, 6)


@pytest.mark.parametrize("case", [(1, 0.5, False), (2, 0.3, True), (0, 0.0, False)],
                         ids=["tau1-alpha.5", "tau2-alpha.3-tokens", "tau0-alpha0"])
def test_streaming_is_bitwise_the_reference_loop(ranks, case):
    thetas, workers = ranks[0]["stream_ref"][case]
    key = f"stream_{case[0]}_{case[1]}_{case[2]}"
    for r in range(2):
        got = ranks[r][key]
        # fragment 1 sends at t = 2, 6, 10; fragment 0 at t = 4, 8
        assert got["sent"] == [[], [1], [], [0], [], [1], [], [0], [], [1], []]
        assert_bitwise(got["globals"], thetas, f"rank {r} global fragments")
        assert_bitwise(got["params"], workers[r], f"rank {r} parameters")


def test_streaming_resume_with_an_exchange_in_flight(ranks):
    for r in range(2):
        got, ref = ranks[r]["stream_resumed"], ranks[r]["stream_2_0.3_True"]
        assert got["in_flight"] == [(1, 6, 8)]  # saved while fragment 1's exchange of step 6 was pending
        assert_bitwise(got["globals"], ref["globals"], f"rank {r} global fragments")
        assert_bitwise(got["params"], ref["params"], f"rank {r} parameters")


@pytest.mark.parametrize("codec", QUANT_CODECS)
def test_quantized_diloco_is_bitwise_the_reference_loop(ranks, codec):
    theta, m, workers = ranks[0]["q_ref"][codec]
    for r in range(2):
        got = ranks[r][f"q_{codec}"]
        assert_bitwise(got["snapshot"], theta, f"rank {r} snapshot")
        assert_bitwise(got["m"], m, f"rank {r} outer momentum")
        assert_bitwise(got["params"], workers[r], f"rank {r} parameters")
        # 66 values, 3 blocks of 32: codes (fp8 1 byte each, int4 two per byte) + 3 fp32 scales + (w, given) fp64
        assert got["bytes"] == [{"fp8": 66, "int4": 33}[codec] + 3 * 4 + 2 * 8] * 2
        assert got["left_out"] == [(), ()]
    # the codec is not a no-op: the fp32 exchange gives other bits
    assert not torch.equal(ranks[0][f"q_{codec}"]["snapshot"], ranks[0]["ordered_True"]["snapshot"])


@pytest.mark.parametrize("codec", QUANT_CODECS)
def test_quantized_streaming_is_bitwise_the_reference_loop(ranks, codec):
    thetas, workers = ranks[0]["qs_ref"][codec]
    for r in range(2):
        got = ranks[r][f"qs_{codec}"]
        assert_bitwise(got["globals"], thetas, f"rank {r} global fragments")
        assert_bitwise(got["params"], workers[r], f"rank {r} parameters")
        # fragment 0 = Linear(5, 7): 42 values (2 blocks), fragment 1 = Linear(7, 3): 24 values (1 block)
        per = {0: (42 if codec == "fp8" else 21) + 2 * 4 + 16, 1: (24 if codec == "fp8" else 12) + 4 + 16}
        assert got["bytes"] == [(f, per[f]) for f in (1, 0, 1, 0, 1)]
    assert not torch.equal(ranks[0][f"qs_{codec}"]["globals"][0], ranks[0]["stream_2_0.3_True"]["globals"][0])


def test_quantized_exchange_leaves_a_non_finite_worker_out(ranks):
    snap, params = ranks[0]["q_nan_before"]
    D = R.quantized_mean([snap - R.flat(params)], None, "int4", 32)  # rank 0's outer gradient alone
    theta, _ = R.outer_nesterov(snap, D, torch.zeros_like(snap), lr=0.7, momentum=0.9)
    for r in range(2):
        got = ranks[r]["q_nan"]
        assert len(got["left_out"]) == 1 and got["left_out"][0][0] == 1
        assert "NaN/Inf scale" in got["left_out"][0][1]
        assert not bool(got["stats"].skipped)
        assert_bitwise(got["snapshot"], theta, f"rank {r} snapshot: rank 0's outer gradient alone")


def test_quantized_streaming_resume_with_an_exchange_in_flight(ranks):
    for r in range(2):
        got, ref = ranks[r]["qs_resumed"], ranks[r]["qs_int4"]
        assert got["in_flight"] == [(1, 6, 8)]
        assert_bitwise(got["globals"], ref["globals"], f"rank {r} global fragments")
        assert_bitwise(got["params"], ref["params"], f"rank {r} parameters")


# ---------------------------------------------------------------------- bad settings
@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _snapshot_all(model, *opts):
    return [p.detach().clone() for p in model.parameters()], [repr(o.state_dict()) for o in opts]


@pytest.mark.parametrize("kw, exc, match", [
    (dict(sync_every=0), ValueError, "sync_every must be >= 1"),
    (dict(sync_every=-3), ValueError, "sync_every must be >= 1"),
    (dict(sync_every=2.0), TypeError, "sync_every must be an int"),
    (dict(sync_every=True), TypeError, "sync_every must be an int"),
    (dict(mode="sum"), ValueError, "mode must be one of"),
    (dict(codec=object()), TypeError, "codec must be None"),
    (dict(codec="int3"), ValueError, "codec must be None .fp32. or one of"),
    (dict(codec="fp8", codec_block=48), ValueError, "codec_block must be a positive multiple of 32"),
])
def test_bad_settings_are_refused(one_rank, kw, exc, match):
    from fedopt_kernels.distributed import DiLoCo

    model = make_model()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(exc, match=match):
        DiLoCo(model, opt, **kw)


def test_outer_optimizer_must_match_the_model(one_rank):
    from fedopt_kernels.distributed import DiLoCo
    from fedopt_kernels.server import FedAvgM

    model, other = make_model(), make_model(seed=1)
    inner = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="exactly the model's parameters"):
        DiLoCo(model, inner, FedAvgM(other.parameters()))
    with pytest.raises(ValueError, match="exactly the model's parameters"):
        DiLoCo(model, inner, FedAvgM(list(model.parameters())[:2]))
    with pytest.raises(TypeError, match="ServerOptimizer"):
        DiLoCo(model, inner, torch.optim.SGD(model.parameters(), lr=0.7))
    outer = FedAvgM(model.parameters(), nesterov=True)
    p0 = next(model.parameters())
    outer.state[p0]["momentum_buffer"] = torch.zeros(3)  # a state from another model
    before = _snapshot_all(model, inner)
    with pytest.raises(ValueError, match="state does not belong to this model"):
        DiLoCo(model, inner, outer)
    assert_bitwise(_snapshot_all(model, inner)[0], before[0], "parameters unchanged")


def test_bad_state_dict_changes_nothing(one_rank):
    from fedopt_kernels.distributed import DiLoCo

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    d = DiLoCo(model, opt, sync_every=2)
    step = inner_step_fn({0: model}, {0: opt})
    for t in range(1, 4):
        d.step(tokens=step(0, t))
    good = d.state_dict()
    params, snap, opt_state = params_of(d), d.snapshot.clone(), repr(opt.state_dict())
    outer_state = repr(d.outer_optimizer.state_dict())

    def bad(mutate):
        s = {**good, "outer": {**good["outer"], "state": dict(good["outer"]["state"])}}
        mutate(s)
        return s

    cases = [
        (bad(lambda s: s.update(sync_every=3)), "saved with sync_every=3"),
        (bad(lambda s: s.update(snapshot=s["snapshot"][:-1])), "snapshot"),
        (bad(lambda s: s["outer"]["state"].update({0: {"momentum_buffer": torch.zeros(2)}})), "does not belong"),
        (bad(lambda s: s.pop("inner")), "lacks"),
    ]
    for state, match in cases:
        with pytest.raises(ValueError, match=match):
            d.load_state_dict(state)
        assert_bitwise(params_of(d), params, "params unchanged")
        assert_bitwise(d.snapshot, snap, "snapshot unchanged")
        assert repr(opt.state_dict()) == opt_state and repr(d.outer_optimizer.state_dict()) == outer_state
    with pytest.raises(ValueError, match="tokens missing"):
        d.step()  # tokens were given on this round's earlier step
    assert d.local_step == 3


@pytest.mark.parametrize("fragments, match", [
    ([["0.weight", "0.bias"]], "not in any fragment"),
    ([["0.weight", "0.bias", "2.weight"], ["2.weight", "2.bias"]], "in two fragments"),
    ([["0.weight", "0.bias", "nope"], ["2.weight", "2.bias"]], "not a parameter"),
    (0, "at least 1"),
    (5, "at most"),
])
def test_fragments_must_cover_the_model(one_rank, fragments, match):
    from fedopt_kernels.distributed import StreamingDiLoCo

    model = make_model()
    opt = torch.optim.AdamW(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        StreamingDiLoCo(model, opt, fragments=fragments, sync_every=4)
    assert_bitwise([p.detach() for p in model.parameters()], before, "parameters unchanged")


@pytest.mark.parametrize("kw, match", [
    (dict(overlap=4), "overlap must be"),
    (dict(overlap=-1), "overlap must be"),
    (dict(alpha=1.5), "alpha"),
    (dict(offsets=[0, 4]), "offsets"),
    (dict(offsets=[0]), "offsets"),
    (dict(codec="topk"), "codec must be None .fp32. or one of"),
    (dict(codec="int4", codec_block=0), "codec_block must be a positive multiple of 32"),
])
def test_streaming_bad_settings(one_rank, kw, match):
    from fedopt_kernels.distributed import StreamingDiLoCo

    model = make_model()
    with pytest.raises(ValueError, match=match):
        StreamingDiLoCo(model, torch.optim.AdamW(model.parameters()), fragments=2, sync_every=4, **kw)


# ---------------------------------------------------------------------- torchft's Manager (duck-typed)
class FakeManager:
    """A torchft ``Manager`` stand-in: its all-reduce adds one peer's packed buffer
    ``[w Delta_peer, w]`` (or nothing, as a healing peer adds zeros), and
    ``should_commit`` answers as told."""

    def __init__(self, peer_buf, commit=True):
        self.peer_buf, self.commit, self.calls = peer_buf, commit, []

    def start_quorum(self):
        self.calls.append("quorum")

    def allreduce(self, tensor, reduce_op=None):
        assert reduce_op == dist.ReduceOp.SUM
        tensor.add_(self.peer_buf)
        self.calls.append("allreduce")
        return type("Done", (), {"wait": lambda self: None})()

    def should_commit(self):
        self.calls.append("commit")
        return self.commit

    def num_participants(self):
        return 2


@pytest.mark.parametrize("commit", [True, False])
def test_torchft_manager_seam(commit):
    from fedopt_kernels.distributed import DiLoCo

    torch.manual_seed(3)
    w = nn.Parameter(torch.randn(5))
    model = nn.Module()
    model.w = w
    opt = torch.optim.SGD([w], lr=1.0)
    peer_delta = torch.randn(5)
    mgr = FakeManager(torch.cat([3.0 * peer_delta, torch.tensor([3.0])]), commit=commit)
    d = DiLoCo(model, opt, sync_every=1, manager=mgr)  # no torch.distributed group needed
    theta0 = w.detach().clone()
    w.grad = torch.randn(5)
    mine = w.grad.clone()  # SGD lr 1: Delta_mine = theta0 - (theta0 - g)
    rec = d.step(tokens=5)
    assert mgr.calls == ["quorum", "allreduce", "commit"]
    assert rec.committed is commit and rec.participants == 2
    if commit:
        Dm = (5 * (theta0 - (theta0 - mine)) + 3 * peer_delta) / 8
        theta, m = R.outer_nesterov(theta0, Dm, torch.zeros(5), lr=0.7, momentum=0.9)
        torch.testing.assert_close(w.detach(), theta, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(d.outer_optimizer.state[w]["momentum_buffer"], m, rtol=1e-6, atol=1e-6)
        assert d.outer_round == 1
    else:  # a peer failed: the round is discarded, the worker restarts from the snapshot
        assert_bitwise(w.detach(), theta0, "parameters reset to the snapshot")
        assert_bitwise(d.snapshot, theta0, "snapshot unchanged")
        assert rec.stats is None and d.outer_round == 0 and "did not commit" in rec.left_out[0][1]
        assert "momentum_buffer" not in d.outer_optimizer.state[w]


def test_fragments_by_count_cover_the_model_in_order():
    from fedopt_kernels.distributed.streaming import split_fragments

    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 7), nn.Linear(7, 2), nn.Linear(2, 40))
    sizes = [p.numel() for p in model.parameters()]  # 35 7 49 7 14 2 80 40
    for P in range(1, len(sizes) + 1):
        frags = split_fragments(model, P)
        assert len(frags) == P and all(frags)
        assert [i for f in frags for i in f] == list(range(len(sizes)))  # consecutive runs, every one once
    # two fragments: a parameter goes where its middle falls (half of 234 is 117): the 6th
    # (2 elements, middle at 113) in the first, the 7th (80, middle at 154) in the second: 114 | 120
    assert split_fragments(model, 2) == [[0, 1, 2, 3, 4, 5], [6, 7]]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_one_worker_matches_the_reference_in_every_dtype(one_rank, dtype):
    """One worker (a 1-rank group): fp64 bit for bit; fp16 / bf16 within their rounding
    (the outer gradient is rounded once to the parameters' dtype as it is read, the step
    accumulates in fp32 and the parameters are stored rounded)."""
    from fedopt_kernels.distributed import DiLoCo

    model = make_model(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    d = DiLoCo(model, opt, sync_every=2)
    step = inner_step_fn({0: model}, {0: opt})
    ref_model = make_model(dtype)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    ref_step = inner_step_fn({0: ref_model}, {0: ref_opt})

    def inner(k, t):
        n = ref_step(k, t)
        ref_opt.step()
        return n

    for t in range(1, 7):
        step(0, t)
        d.step()
    theta, m = R.diloco_loop([list(ref_model.parameters())], inner, H=2, steps=6)
    if dtype == torch.float64:
        assert_bitwise(d.snapshot, theta, "snapshot")
        assert_bitwise(momentum_of(d), m, "outer momentum")
    else:
        tol = dict(rtol=0, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=0, atol=3e-3)
        torch.testing.assert_close(d.snapshot.float(), theta, **tol)
        assert d.snapshot.dtype == dtype


def test_streaming_bad_state_dict_changes_nothing(one_rank):
    from fedopt_kernels.distributed import StreamingDiLoCo

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    s = StreamingDiLoCo(model, opt, fragments=2, sync_every=4, overlap=1)
    step = inner_step_fn({0: model}, {0: opt})
    for t in range(1, 4):
        s.step(tokens=step(0, t))
    good = s.state_dict()
    params, globs = params_of(s), [g.clone() for g in s.global_fragments]
    for bad, match in (({**good, "alpha": 0.9}, "alpha=0.9"),
                       ({**good, "global_fragments": good["global_fragments"][:1]}, "global fragments"),
                       ({**good, "outer": [{**good["outer"][0], "state": {0: {"momentum_buffer": torch.zeros(1)}}},
                                           good["outer"][1]]}, "does not belong")):
        with pytest.raises(ValueError, match=match):
            s.load_state_dict(bad)
        assert_bitwise(params_of(s), params, "parameters unchanged")
        assert_bitwise(s.global_fragments, globs, "global fragments unchanged")
