"""Compressed updates where a round runs (issue 42): the simulator's ``--compress`` against a
hand-written loop (encode with ops.compressed, decode, float64 mean, FedAvg step), error
feedback over a resume, both engines and the folded round, ``none`` unchanged, the screening
of malformed replies by reason, and the server round's decode stage (fused, robust rows, DP)
against the same round on the decoded rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedopt_kernels.compression import Codec, parse_codec
from fedopt_kernels.fl import Simulation, SimulationConfig
from fedopt_kernels.fl.run.config import ConfigError
from fedopt_kernels.fl.seeds import compress_key
from fedopt_kernels.ops import compressed as C
from fedopt_kernels.server import FedAdam, FedAvg, FedExP, RobustAggregator, RoundReplies, ServerRound
from fedopt_kernels.server.compressed import CompressedDecoder, CompressedReplies
from fedopt_kernels.server.differential_privacy.privacy import RoundPrivacy
from _asserts import bits

BASE = dict(dataset="synthetic", clients=12, per_round=5, rounds=2, local_steps=2, hidden=(16,), seed=3,
            partition="dirichlet", weighting="size", max_samples_per_client=40, batch_size=16, eval_every=2)


def _strip(records):
    return [{k: v for k, v in r.items() if k != "wall_time"} for r in records]


def _hand_loop(kw, rounds):
    """The oracle: the simulator's client training (compress none), then by hand each
    client's EF residual added, ops.compressed.encode / decode (rotated with the round's
    key and back), the size-weighted mean in float64 and FedAvg's step x <- x - D."""
    codec = kw["compress"]
    ref = Simulation(SimulationConfig(**dict(kw, compress="none", error_feedback=False, compress_stochastic=False,
                                             compress_rotate=False)))
    N, resid, norms = ref.numel, {}, []
    for r in range(1, rounds + 1):
        clients = ref.sample_clients(r)
        ref._train_clients(r, clients)
        kept = ref._round_kept
        key = compress_key(kw["seed"], r)
        mean = torch.zeros(N, dtype=torch.float64)
        w = ref.client_sizes[kept] / ref.client_sizes[kept].sum()
        for wi, cid, row in zip(w, kept, ref.updates[:len(kept)]):
            a = resid.get(cid, torch.zeros(N)) + row
            x = C.hadamard_rotate(a, key, 1024) if kw.get("compress_rotate") else a
            if codec.startswith("topk"):
                reply = C.encode(x, "topk", fraction=float(codec.split(":")[1]))
            else:
                reply = C.encode(x, codec, block=kw.get("compress_block", 256),
                                 stochastic=kw.get("compress_stochastic", False), key=key, client=cid)
            d = C.decode(reply)
            if kw.get("compress_rotate"):
                d = C.hadamard_unrotate(d, key, 1024, N)
            if kw.get("error_feedback"):
                resid[cid] = a - d
            mean += wi * d.double()
        ref.x_global.sub_(mean.float())
        norms.append(mean.norm().item())
    return ref.x_global, resid, norms


CASES = [dict(compress="int8", error_feedback=True),
         dict(compress="topk:0.05", error_feedback=True),
         dict(compress="int4", compress_stochastic=True, compress_rotate=True, compress_block=64),
         dict(compress="fp8", engine="sequential")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_compressed_run_equals_the_hand_written_loop(case):
    kw = dict(BASE, **case)
    sim = Simulation(SimulationConfig(**kw))
    sim.run()
    x, resid, norms = _hand_loop(kw, 2)
    torch.testing.assert_close(sim.x_global, x, rtol=1e-5, atol=1e-6)
    recs = sim.results.records[1:]
    # the round's statistics are the decoded values': ||D|| of the decoded mean
    assert [r["update_norm"] for r in recs] == pytest.approx(norms, rel=1e-5)
    codec = SimulationConfig(**kw).codec()
    for r in recs:
        assert r["bytes_up"] == len(r["clients"]) * codec.bytes_per_reply(sim.numel)
        assert r["bytes_up_fp32"] == 4 * sim.numel * len(r["clients"])
        assert r["excluded_malformed"] == 0 and r["excluded_clients"] == 0
    for cid, e in resid.items():
        torch.testing.assert_close(sim.compression.ef.residual(cid), e, rtol=1e-5, atol=1e-6)
    if not kw.get("error_feedback"):
        assert sim.compression.ef is None and "ef_residual" not in sim.client_state.names


def test_none_leaves_the_run_as_it_was():
    """``compress none`` takes no new path: no decoder, no codec, no new record key, and
    the run equals the one built without the new fields set at all."""
    plain = Simulation(SimulationConfig(**BASE))
    assert plain.compression is None and plain.server.round.decoder is None
    plain.run()
    explicit = Simulation(SimulationConfig(**BASE, compress="none", compress_block=64))
    explicit.run()
    assert torch.equal(bits(plain.x_global), bits(explicit.x_global))
    assert _strip(plain.results.records) == _strip(explicit.results.records)
    assert not any(k.startswith("bytes_up") or k == "excluded_malformed" for r in plain.results.records for k in r)


def test_error_feedback_resumes_bit_for_bit(tmp_path):
    kw = dict(BASE, rounds=3, compress="int4", error_feedback=True, compress_rotate=True)
    whole = Simulation(SimulationConfig(**kw))
    whole.run()
    first = Simulation(SimulationConfig(**kw))
    first.run(1)
    torch.save(first.state_dict(), tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert state["error_feedback"]["clients"].numel() > 0
    resumed = Simulation(SimulationConfig(**kw))
    resumed.load_state_dict(state)
    resumed.run()
    assert torch.equal(bits(resumed.x_global), bits(whole.x_global))
    assert _strip(resumed.results.records) == _strip(whole.results.records)
    a, b = whole.client_state.state_dict()["ef_residual"], resumed.client_state.state_dict()["ef_residual"]
    assert torch.equal(a["clients"], b["clients"]) and torch.equal(bits(a["rows"]), bits(b["rows"]))
    # a checkpoint of a run without error feedback does not resume one that keeps residuals
    plain = Simulation(SimulationConfig(**dict(kw, error_feedback=False)))
    with pytest.raises(ValueError, match="error_feedback"):
        plain.load_state_dict(state)
    # nor does a checkpoint made before --compress existed resume a compressed run
    old = Simulation(SimulationConfig(**dict(kw, compress="none", error_feedback=False, compress_rotate=False)))
    old_state = old.state_dict()
    for key in ("compress", "compress_block", "compress_stochastic", "compress_rotate", "error_feedback"):
        del old_state["config"][key]
    with pytest.raises(ValueError, match="before the setting existed"):
        resumed.load_state_dict(old_state)
    old.load_state_dict(old_state)  # an fp32 run still resumes it


def test_folded_compressed_round_equals_the_unchunked_round():
    """The folded round encodes each chunk as it trains and keeps the small replies: the
    same replies, so the same round (the engines' chunked bits: test_chunked_rounds)."""
    kw = dict(BASE, per_round=7, compress="int8", error_feedback=True)
    whole = Simulation(SimulationConfig(**kw))
    whole.run()
    chunked = Simulation(SimulationConfig(**kw, memory_budget="60K"))
    assert chunked._foldable and 2 <= chunked._chunk < 7
    chunked.run()
    assert torch.equal(bits(chunked.x_global), bits(whole.x_global))
    assert _strip(chunked.results.records) == _strip(whole.results.records)


# ---------------------------------------------------------------------------- screening
def _corrupt(kind):
    """A reply broken one way, from a valid one."""
    def block(reply):
        if kind == "scales_count":
            return dataclasses.replace(reply, scales=reply.scales[:-1].contiguous())
        if kind == "nan_scale":
            s = reply.scales.clone()
            s[0] = float("nan")
            return dataclasses.replace(reply, scales=s)
        if kind == "inf_scale":
            s = reply.scales.clone()
            s[-1] = float("inf")
            return dataclasses.replace(reply, scales=s)
        if kind == "length":
            return dataclasses.replace(reply, numel=reply.numel + 1)
        raise AssertionError(kind)

    def topk(reply):
        ix = reply.indices.clone()
        if kind == "index_range":
            ix[-1] = reply.numel
        elif kind == "index_repeated":
            ix[1] = ix[0]
        else:
            raise AssertionError(kind)
        return dataclasses.replace(reply, indices=ix)
    return topk if kind.startswith("index") else block


REASONS = {"scales_count": "scales for", "nan_scale": "NaN/Inf scale", "inf_scale": "NaN/Inf scale",
           "length": "describes", "index_range": "out of range", "index_repeated": "repeated"}


@pytest.mark.parametrize("kind", sorted(REASONS))
def test_a_malformed_reply_is_left_out_with_its_reason(kind):
    codec = "topk:0.05" if kind.startswith("index") else "int8"
    sim = Simulation(SimulationConfig(**dict(BASE, rounds=1, compress=codec)))
    real_encode, real_screen = sim.compression.encode, sim.compression.screen
    seen = {}

    def encode(rows, clients, r):
        replies, left = real_encode(rows, clients, r)
        cid, reply = replies[1]
        seen["cid"], seen["good"] = cid, [(c, p) for c, p in replies if c != cid]
        replies[1] = (cid, _corrupt(kind)(reply))
        return replies, left

    def screen(replies):
        seen["screened"] = real_screen(replies)
        return seen["screened"]

    sim.compression.encode, sim.compression.screen = encode, screen
    x0 = sim.x_global.clone()
    rec = sim.run_round()
    assert rec["excluded_malformed"] == 1 and rec["excluded_clients"] == 1
    assert rec["left_out"] == [[seen["cid"], "malformed"]]
    [(cid, reason, detail)] = seen["screened"][1]
    assert cid == seen["cid"] and reason == "malformed" and REASONS[kind] in detail
    # the round equals the round of the others: their decoded, size-weighted mean
    good = seen["good"]
    w = sim.client_sizes[[c for c, _ in good]]
    mean = sum((wi / w.sum()) * C.decode(p).double() for wi, (_, p) in zip(w, good))
    torch.testing.assert_close(sim.x_global, x0 - mean.float(), rtol=1e-5, atol=1e-6)
    assert rec["bytes_up"] == sum(p.nbytes() for _, p in good)


def test_a_nonfinite_update_is_left_out_and_keeps_its_residual():
    sim = Simulation(SimulationConfig(**dict(BASE, rounds=1, compress="int8", error_feedback=True)))
    real = sim.compression.encode
    bad = {}

    def encode(rows, clients, r):
        bad["cid"] = clients[2]
        rows[2, 5] = float("inf")
        return real(rows, clients, r)

    sim.compression.encode = encode
    rec = sim.run_round()
    assert rec["excluded_nonfinite"] == 1 and rec["left_out"] == [[bad["cid"], "nonfinite"]]
    assert not sim.client_state.has("ef_residual", bad["cid"])
    assert all(sim.client_state.has("ef_residual", c) for c in rec["clients"] if c != bad["cid"])
    assert torch.isfinite(sim.x_global).all()


def test_config_refusals_name_the_setting():
    for bad, match in [(dict(compress="int9"), "compress 'int9'"), (dict(compress="topk"), "topk:FRACTION"),
                       (dict(compress="topk:1.5"), "fraction"), (dict(compress="fp8", compress_stochastic=True),
                                                                 "stochastic"),
                       (dict(compress="int8", compress_block=48), "compress-block"),
                       (dict(error_feedback=True), "error-feedback needs --compress"),
                       (dict(compress="int8", algo="fedlaw"), "fedlaw"),
                       (dict(compress="int8", dp_clip=1.0, dp_mode="client", weighting="uniform"), "dp-mode client")]:
        with pytest.raises(ConfigError, match=match):
            SimulationConfig(**dict(BASE, **bad)).validate()


# ---------------------------------------------------------------------------- the server round's decode stage
N = 1000


def _replies(codec: Codec, C_=5, key=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(C_, N, generator=g) * torch.linspace(0.1, 2.0, C_).unsqueeze(1)
    return CompressedReplies([codec.encode(r, key, i) for i, r in enumerate(rows)], codec, N, key)


def _round(server_cls, replies, *, decoder, weighting="size", **kw):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(N))
    opt = server_cls([p], **({"lr": 0.5} if server_cls is not FedExP else {}))
    out = ServerRound(opt, weighting, decoder=decoder, **kw)(RoundReplies(replies, sizes=torch.arange(1.0, 6.0)))
    return p.detach().clone(), out.record()


@pytest.mark.parametrize("server_cls", [FedAvg, FedAdam, FedExP])
@pytest.mark.parametrize("spec", ["int8", "int4", "fp8", "topk:0.1"])
def test_fused_decode_round_equals_the_round_on_decoded_rows(spec, server_cls):
    """The fused decode-aggregate's step (FedExP's step size from the decoded norms
    included) is the step on the decoded rows, bit for bit (ops/compressed.py's promise)."""
    codec = parse_codec(spec, block=128)
    rep = _replies(codec)
    rows = torch.stack([C.decode(r) for r in rep.replies])
    x_fused, rec_fused = _round(server_cls, rep, decoder=CompressedDecoder())
    x_rows, rec_rows = _round(server_cls, rows, decoder=None)
    if spec == "fp8":  # the fused fp8 pass is not bitwise decode()+aggregate (a few ulp apart, seen here)
        torch.testing.assert_close(x_fused, x_rows, rtol=1e-5, atol=1e-6)
        assert rec_fused == pytest.approx(rec_rows, rel=1e-5)
        return
    assert torch.equal(bits(x_fused), bits(x_rows))
    assert rec_fused == rec_rows


def _trimmed():
    return RobustAggregator("trimmed-mean", beta=0.2)


def _dp():
    return RoundPrivacy(clip=0.5, noise_multiplier=0.7, seed=3, clients=20, per_round=5, delta=1e-3)


def test_robust_rule_and_dp_get_the_decoded_rows():
    """A robust rule reads the decoded rows; DP clips the decoded update and adds its
    noise to their sum: the rounds equal those on the decoded rows (rotation undone)."""
    codec = parse_codec("int8", block=64, rotation=256)
    rep = _replies(codec)
    rows = torch.stack([codec.decode(r, N, rep.key) for r in rep.replies])
    for kw in (dict(aggregator=_trimmed()), dict(privacy=_dp())):
        w = "uniform" if "privacy" in kw else "size"  # DP-FedAvg weighs its clients uniformly
        got = _round(FedAvg, rep, decoder=CompressedDecoder(rows=True), weighting=w, **kw)
        kw2 = {k: (_trimmed() if k == "aggregator" else _dp()) for k in kw}  # fresh, same settings
        want = _round(FedAvg, rows, decoder=None, weighting=w, **kw2)
        assert torch.equal(bits(got[0]), bits(want[0]))
        assert got[1] == want[1]


def test_cli_compressed_run_and_resume(tmp_path):
    """``fedopt simulate --compress ... --error-feedback true``: the flags reach the run, the
    record has its bytes, and ``--resume`` (more rounds) continues to the uninterrupted run."""
    import json

    from fedopt_kernels.cli import main

    flags = ["--dataset", "synthetic", "--clients", "8", "--per-round", "3", "--local-steps", "2", "--hidden", "8",
             "--max-samples-per-client", "30", "--compress", "topk:0.1", "--error-feedback", "true",
             "--compress-rotate", "true", "--quiet", "--no-plots"]
    part, full = tmp_path / "part", tmp_path / "full"
    assert main(["simulate", "--rounds", "1", "--out", str(part)] + flags) == 0
    assert main(["simulate", "--resume", "--rounds", "2", "--out", str(part), "--quiet", "--no-plots"]) == 0
    assert main(["simulate", "--rounds", "2", "--out", str(full)] + flags) == 0
    a, b = (json.loads((d / "results.json").read_text()) for d in (part, full))
    assert a["config"]["compress"] == "topk:0.1" and a["config"]["error_feedback"] is True
    assert _strip(a["records"]) == _strip(b["records"])
    rec = b["records"][-1]
    assert rec["bytes_up"] == 3 * parse_codec("topk:0.1", rotation=1024).bytes_per_reply(b["meta"]["num_parameters"])
    assert rec["bytes_up_fp32"] == 3 * 4 * b["meta"]["num_parameters"]
