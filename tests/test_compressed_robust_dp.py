"""Compressed updates end to end with the robust rules and DP-FedAvg (issue 42 item 3): a
simulated run with ``--compress`` and ``--aggregator trimmed-mean|median|krum`` or
``--dp-clip`` equals a hand-written loop -- the simulator's clients trained without
compression, each update encoded by hand with ops.compressed (error feedback kept by
hand), decoded in float64, then python_ref's robust rule, or the float64 clip, the mean
over ``m = per_round`` and python_ref's seeded Gaussian noise, and FedAvg's step
``x <- x - D``."""

from __future__ import annotations

import pytest
import torch

import python_ref.robust as O
from fedopt_kernels.fl import Simulation, SimulationConfig
from fedopt_kernels.fl.seeds import compress_key
from fedopt_kernels.ops import compressed as C
from fedopt_kernels.server.differential_privacy.dp import dp_noise_key
from python_ref import gaussian_noise as noise_ref

BASE = dict(dataset="synthetic", clients=12, per_round=5, rounds=2, local_steps=2, hidden=(16,), seed=5,
            partition="dirichlet", max_samples_per_client=40, batch_size=16, eval_every=2)
CLIP_EPS = 1e-6  # DP-FedAvg's factor min(1, C / (||d|| + eps)) (server/differential_privacy/dp.py)


def _decoded_rows(kw, ref, r, clients, resid):
    """Round ``r``'s decoded updates ``[C, N]`` in float64, encoded by hand from the
    uncompressed run's updates (error feedback's residuals in ``resid``)."""
    codec, key, N = kw["compress"], compress_key(kw["seed"], r), ref.numel
    rows = []
    for cid, row in zip(clients, ref.updates[:len(clients)]):
        a = resid.get(cid, torch.zeros(N)) + row
        if codec.startswith("topk"):
            reply = C.encode(a, "topk", fraction=float(codec.split(":")[1]))
        else:
            reply = C.encode(a, codec, block=kw.get("compress_block", 256), key=key, client=cid)
        d = C.decode(reply)
        if kw.get("error_feedback"):
            resid[cid] = a - d
        rows.append(d.double())
    return torch.stack(rows)


def _dp_mean(X, clip, z, m, seed, r):
    """DP-FedAvg's update in float64: ``(sum_i min(1, C / (||x_i|| + eps)) x_i) / m`` plus
    the round's noise ``z C / m * n`` (python_ref's Philox draw)."""
    factors = torch.clamp(clip / (X.norm(dim=1) + CLIP_EPS), max=1.0)
    noise = noise_ref.noise(dp_noise_key(seed, r), X.shape[1]).double()
    return (factors[:, None] * X).sum(0) / m + (z * clip / m) * noise


def _hand_loop(kw, rule):
    """The oracle run: ``rule(X_decoded, round)`` is the server's float64 update."""
    plain = dict(kw, compress="none", error_feedback=False)
    ref = Simulation(SimulationConfig(**{k: v for k, v in plain.items() if not k.startswith(("dp_", "aggregator",
                                                                                               "trim_", "byzantine"))}))
    resid, steps = {}, []
    for r in range(1, kw["rounds"] + 1):
        ref._train_clients(r, ref.sample_clients(r))
        kept = ref._round_kept
        X = _decoded_rows(kw, ref, r, kept, resid)
        D = rule(X, r)
        ref.x_global.copy_((ref.x_global.double() - D).float())
        steps.append(D)
    return ref.x_global, steps, resid


def _robust(name):
    if name == "trimmed-mean":
        return dict(aggregator="trimmed-mean", trim_beta=0.2), lambda X, r: O.trimmed_mean(X, 0.2)
    if name == "median":
        return dict(aggregator="median"), lambda X, r: O.coordinate_median(X)
    return dict(aggregator="krum", byzantine_f=1), lambda X, r: O.multi_krum(X, 1, 1)[0]


@pytest.mark.parametrize("codec, ef", [("int8", True), ("topk:0.05", False)])
@pytest.mark.parametrize("rule", ["trimmed-mean", "median", "krum"])
def test_robust_rule_on_compressed_updates_equals_the_hand_loop(rule, codec, ef):
    settings, oracle = _robust(rule)
    kw = dict(BASE, compress=codec, error_feedback=ef, **settings)
    sim = Simulation(SimulationConfig(**kw))
    sim.run()
    x, steps, resid = _hand_loop(kw, oracle)
    torch.testing.assert_close(sim.x_global, x, rtol=1e-5, atol=1e-6)
    recs = sim.results.records[1:]
    assert [r["update_norm"] for r in recs] == pytest.approx([float(D.norm()) for D in steps], rel=1e-5)
    codec_ = SimulationConfig(**kw).codec()
    for r in recs:  # the bytes sent are the codes', whatever the rule does with the decoded rows
        assert r["bytes_up"] == len(r["clients"]) * codec_.bytes_per_reply(sim.numel)
        assert r["bytes_up_fp32"] == 4 * sim.numel * len(r["clients"])
    if ef:
        assert resid and all(torch.allclose(sim.compression.ef.residual(c), e, rtol=1e-5, atol=1e-6)
                             for c, e in resid.items())


@pytest.mark.parametrize("codec, ef, z", [("int8", True, 0.8), ("int8", False, 0.0), ("topk:0.05", True, 0.8)])
def test_dp_clips_and_noises_the_decoded_update_as_the_hand_loop(codec, ef, z):
    """The server clips the DECODED update (what is summed), so the sensitivity is the
    uncompressed round's; the noise is the round's seeded draw.  The clip is set below the
    updates' norms so that it binds."""
    clip = 0.05
    kw = dict(BASE, compress=codec, error_feedback=ef, weighting="uniform", dp_clip=clip, dp_noise_multiplier=z,
              dp_delta=1e-3 if z else None)
    sim = Simulation(SimulationConfig(**kw))
    sim.run()
    clipped = []

    def rule(X, r):
        clipped.append(bool((X.norm(dim=1) > clip).any()))
        return _dp_mean(X, clip, z, kw["per_round"], kw["seed"], r)

    x, steps, _ = _hand_loop(kw, rule)
    assert any(clipped), "the clip never bound: the test would not see a wrong clip"
    torch.testing.assert_close(sim.x_global, x, rtol=1e-5, atol=1e-6)
    recs = sim.results.records[1:]
    assert [r["update_norm"] for r in recs] == pytest.approx([float(D.norm()) for D in steps], rel=1e-5)
    assert all(r["bytes_up"] == len(r["clients"]) * SimulationConfig(**kw).codec().bytes_per_reply(sim.numel)
               for r in recs)
