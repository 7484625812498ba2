"""The fused server steps under Flower's SecAgg+ (issue 45, items 2 and 4).

Flower's own ``SecAggPlusWorkflow`` and ``secaggplus_mod`` run the real protocol (key
agreement, Shamir shares, pairwise and private masks, quantization) in this process on
a Grid that serializes each message to Flower's protobuf and back, as the SuperLink
does (:class:`fedopt_kernels.integrations.flower.inprocess.InProcessGrid`).  The
oracle of each round is the same round without secure aggregation: each client's update
``D_i`` from the plain :class:`FedNARClient` on the same global model, data and seed,
and the float64 weighted mean ``sum_i p_i D_i``.  SecAgg+ changes the mean only by its
quantization (each value clipped to +-8 and rounded to 2^22 levels): the mean the
server step received is within ``C * step`` of the oracle's (``step = 16 / (2^22 - 1)``),
and the step applied to it is the fused server step.  A dropout after the key exchange,
a malformed masked vector and a replayed reply each leave the round with the other
clients' sum, recorded, never a wrong model or a hang.
"""

from __future__ import annotations

import pytest
import torch
from _flwr import needs_flwr

pytestmark = needs_flwr

N_NODES = 3
STEP = 16.0 / 2 ** 22  # SecAgg+'s quantization step at its default clipping (8) and quantization (2^22) ranges
MAX_WEIGHT = 26  # the largest client's sample count (_data): SecAgg+'s max_weight for "data" weighting


def _model(ctx=None):
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


_G = torch.Generator().manual_seed(0)
X, Y = torch.randn(60, 8, generator=_G), torch.randint(0, 3, (60,), generator=_G)
RUN_CONFIG = {"local-steps": 3, "batch-size": 8, "local-lr": 0.1, "seed": 3}


def _data(ctx):
    i = int(ctx.node_config["partition-id"])
    n = 10 + 8 * i  # unequal sizes: "data" weighting differs from uniform
    return X[i * 20:i * 20 + n], Y[i * 20:i * 20 + n]


def _grid(app, tamper=None):
    from fedopt_kernels.integrations.flower.inprocess import InProcessGrid

    return InProcessGrid(app, N_NODES, run_config=RUN_CONFIG, tamper=tamper)


def _run(optimizer_factory, rounds=2, *, weighting="uniform", tamper=None, dp=None, codec=None, **wf):
    from flwr.app import Context, RecordDict
    from flwr.server import LegacyContext, ServerConfig

    from fedopt_kernels.integrations.flower import secagg as S

    client = S.SecAggFedNARClient(_model, _data)
    model = _model()
    strategy = S.SecAggPlusFusedStrategy(model, optimizer_factory(model), weighting=weighting, dp=dp, codec=codec)
    if weighting == "data":
        wf.setdefault("max_weight", MAX_WEIGHT)
    grid = _grid(client.app(), tamper)
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    means, globals_ = [], [_flat(model)]
    orig = strategy.aggregate_fit

    def spy(server_round, results, failures):
        out = orig(server_round, results, failures)
        means.append(strategy.last_mean.clone())
        globals_.append(_flat(model))
        return out

    strategy.aggregate_fit = spy
    workflow = S.secaggplus_workflow(strategy, **wf)
    workflow(grid, LegacyContext(ctx, config=ServerConfig(num_rounds=rounds), strategy=strategy))
    return strategy, means, globals_, workflow.fit_workflow


def _flat(model):
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def _plain_updates(x_global, server_round, nodes=range(N_NODES), clip=None):
    """Each client's update and sample count from the plain FedNARClient (no secure
    aggregation), on global model ``x_global`` in round ``server_round``: float64."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

    from fedopt_kernels.integrations.flower import FedNARClient

    client = FedNARClient(_model, _data)
    updates, sizes = [], []
    for i in nodes:
        model = _model()
        torch.nn.utils.vector_to_parameters(x_global.float(), model.parameters())
        ctx = Context(run_id=1, node_id=9001 + 13 * i, node_config={"partition-id": i, "num-partitions": N_NODES},
                      state=RecordDict(), run_config=RUN_CONFIG)
        config = {"server-round": server_round, **({"dp-clip": clip} if clip is not None else {})}
        msg = Message(content=RecordDict({"arrays": ArrayRecord(dict(model.state_dict())),
                                          "config": ConfigRecord(config)}),
                      dst_node_id=ctx.node_id, message_type="train")
        reply = client.train(msg, ctx)
        trained = torch.cat([torch.from_numpy(reply.content["arrays"][n].numpy()).reshape(-1).double()
                             for n, _ in model.named_parameters()])
        updates.append(x_global.float().double() - trained)
        sizes.append(int(reply.content["metrics"]["num-examples"]))
    return torch.stack(updates), torch.tensor(sizes, dtype=torch.float64)


@pytest.mark.parametrize("algo, weighting", [("FedAvg", "data"), ("FedAdam", "uniform"), ("FedExP", "uniform"),
                                             ("ASNES", "uniform")])
def test_secure_mean_is_the_plain_mean_up_to_quantization_and_the_step_is_fused(algo, weighting):
    from fedopt_kernels import server as srv

    kw = {"FedAvg": dict(lr=1.0), "FedAdam": dict(lr=0.01), "FedExP": dict(lr=1.0), "ASNES": dict(lr=1.0)}[algo]
    strategy, means, globals_, _ = _run(lambda m: getattr(srv, algo)(m.parameters(), **kw), weighting=weighting)
    assert len(means) == 2
    for r, (mean, x) in enumerate(zip(means, globals_), start=1):
        D, sizes = _plain_updates(x, r)
        w = sizes if weighting == "data" else torch.ones(N_NODES, dtype=torch.float64)
        p = w / w.sum()
        oracle = (p[:, None] * D).sum(0)
        err = (mean - oracle).abs().max().item()
        # each client's w_i / max_weight * D_i is rounded stochastically to a STEP
        bound = N_NODES * STEP * (MAX_WEIGHT if weighting == "data" else 1.0) / float(w.sum())
        assert err <= bound, (algo, r, err, bound)
        assert (mean - oracle).abs().max() > 0  # the quantization is there: a plain sum would be exact-ish
        if algo in ("FedExP", "ASNES"):  # the secure sum carried sum_i p_i ||D_i||^2 too
            got = strategy.history[r - 1]["mean_client_sq_norm"]
            want = float((p * D.square().sum(1)).sum())
            assert abs(got - want) <= 16 * N_NODES * STEP + 1e-6 * want, (got, want)
    # the step applied to the received mean is the fused step: replay round 1 on a fresh optimizer
    model = _model()
    opt = getattr(srv, algo)(model.parameters(), **kw)
    msq = torch.tensor(strategy.history[0].get("mean_client_sq_norm", float("nan")))
    w = [1.0] * N_NODES if weighting == "uniform" else _plain_updates(globals_[0], 1)[1].tolist()
    opt.step(None, w, aggregator=srv.SecureSumAggregator(means[0], mean_client_sq_norm=msq))
    assert torch.equal(_flat(model), globals_[1])
    # and that step is the plain round's up to the quantization of its input (FedAvg: exactly linear)
    if algo == "FedAvg":
        D, sizes = _plain_updates(globals_[0], 1)
        plain = _model()
        srv.FedAvg(plain.parameters(), lr=1.0).step(D.float(), sizes.tolist())
        assert (_flat(plain) - globals_[1]).abs().max() <= N_NODES * STEP * MAX_WEIGHT / float(sizes.sum()) + 1e-6


@pytest.mark.parametrize("make, needle", [
    (lambda m: __import__("fedopt_kernels.server", fromlist=["FedLAW"]).FedLAW(
        m, [(X[:4], Y[:4])], torch.nn.CrossEntropyLoss()), "FedLAW"),
    (lambda m: __import__("fedopt_kernels.server", fromlist=["FedAvg"]).FedAvg(m.parameters(), max_client_norm=1.0),
     "max_client_norm"),
    (lambda m: __import__("fedopt_kernels.server", fromlist=["FedAvg"]).FedAvg(
        m.parameters(), aggregator=__import__("fedopt_kernels.server", fromlist=["RobustAggregator"]).RobustAggregator(
            "median")), "robust"),
])
def test_combinations_that_need_individual_updates_are_refused_before_the_run(make, needle):
    from fedopt_kernels.integrations.flower import secagg as S

    model = _model()
    before = _flat(model)
    with pytest.raises(ValueError, match=needle):
        S.SecAggPlusFusedStrategy(model, make(model))
    assert torch.equal(_flat(model), before)


def _survivors_oracle(globals_, survivors):
    D, _ = _plain_updates(globals_[0], 1, nodes=survivors)
    return D.mean(0)


def _bad_round_case(tamper):
    from fedopt_kernels import server as srv

    strategy, means, globals_, wf = _run(lambda m: srv.FedAvg(m.parameters(), lr=1.0), rounds=1, tamper=tamper,
                                         num_shares=1.0, reconstruction_threshold=0.6)
    assert len(means) == 1 and strategy.history[0]["clients"] == N_NODES - 1, strategy.history
    oracle = _survivors_oracle(globals_, [0, 2])
    assert (means[0] - oracle).abs().max() <= N_NODES * STEP, (means[0] - oracle).abs().max()
    assert torch.equal(globals_[1], globals_[0] - means[0].double())  # FedAvg lr 1 took exactly that mean
    return wf


def test_a_node_that_drops_out_after_sharing_its_keys_costs_only_its_own_update():
    """Node 1 takes part in the setup and the key exchange, then sends nothing: SecAgg+
    reconstructs its masks from the others' shares; the round is the mean of nodes 0, 2."""
    from flwr.common.secure_aggregation.secaggplus_constants import Stage

    def drop(stage, node, reply, state):
        return None if (stage == Stage.COLLECT_MASKED_VECTORS and node == 1) else reply

    wf = _bad_round_case(drop)
    assert wf.rejected == []


def test_a_malformed_masked_vector_is_screened_out_as_a_dropout():
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

    def malformed(stage, node, reply, state):
        if stage == Stage.COLLECT_MASKED_VECTORS and node == 1:
            masked = reply.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]
            reply.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS] = masked[:-1]  # a layer short
        return reply

    wf = _bad_round_case(malformed)
    assert len(wf.rejected) == 1 and "masked vector of shapes" in wf.rejected[0][1]


def test_a_replayed_reply_is_never_summed():
    """Node 1's masked-vector reply of round 1 is replayed in round 2 instead of its new
    one: it answers a message this round never sent, so it is screened out and round 2
    is the mean of nodes 0 and 2 (a summed replay would leave a mask in the sum)."""
    from flwr.common.secure_aggregation.secaggplus_constants import Stage

    from fedopt_kernels import server as srv

    def replay(stage, node, reply, state):
        if stage == Stage.COLLECT_MASKED_VECTORS and node == 1:
            state.setdefault("old", reply)
            return state["old"]
        return reply

    strategy, means, globals_, wf = _run(lambda m: srv.FedAvg(m.parameters(), lr=1.0), rounds=2, tamper=replay,
                                         num_shares=1.0, reconstruction_threshold=0.6)
    assert [h["clients"] for h in strategy.history] == [3, 2]
    assert len(wf.rejected) == 1 and "replayed" in wf.rejected[0][1]
    D, _ = _plain_updates(globals_[1], 2, nodes=[0, 2])
    assert (means[1] - D.mean(0)).abs().max() <= N_NODES * STEP


def test_central_dp_noise_is_added_to_the_unmasked_sum_of_clipped_updates():
    """DP-FedAvg under SecAgg+: the clients clip (to a hair under C), the server adds its
    keyed noise to the unmasked sum and divides by the expected clients.  Oracle: the
    plain clipped updates, summed in float64, plus the same keyed noise (the project's
    counter-based generator), over m."""
    from fedopt_kernels import server as srv
    from fedopt_kernels.integrations.flower import secagg as S
    from fedopt_kernels.ops.dp_noise import gaussian_noise_
    from fedopt_kernels.server.differential_privacy.dp import dp_noise_key

    dp = S.SecureDP(clip=0.05, noise_multiplier=0.5, expected_clients=4.0, seed=11)
    strategy, means, globals_, _ = _run(lambda m: srv.FedAvg(m.parameters(), lr=1.0), rounds=1, dp=dp)
    D, _ = _plain_updates(globals_[0], 1, clip=0.05 * (1 - 1e-5))
    assert float(D.norm(dim=1).max()) <= 0.05  # the clients clipped
    noise = gaussian_noise_(torch.zeros(D.shape[1]), 0.5 * 0.05, dp_noise_key(11, 1)).double()
    oracle = (D.sum(0) + noise) / 4.0
    # the noise goes into an fp32 sum: its rounding, plus the quantization of each client's values
    err = (means[0] - oracle).abs().max().item()
    assert err <= N_NODES * STEP / 4.0 * N_NODES + 1e-7, err
    assert strategy.history[0]["dp_noise_std"] == 0.5 * 0.05
    with pytest.raises(ValueError, match="FedExP"):
        S.SecAggPlusFusedStrategy(_model(), srv.FedExP(_model().parameters()), dp=dp)
    with pytest.raises(ValueError, match="uniform"):
        S.SecAggPlusFusedStrategy(_model(), srv.FedAvg(_model().parameters()), weighting="data", dp=dp)


def test_the_secure_round_benchmark_counts_bytes_and_agrees_with_the_plain_round():
    """benchmarks.secure_round on a tiny case: the plain round (Message-API fused
    strategy) and the SecAgg+ round end at the same model up to the quantization, and the
    masked replies are int64 (8 bytes a value against float32's 4)."""
    from fedopt_kernels.benchmarks import secure_round

    (row,) = secure_round.run(params=5000, nodes=(3,))
    assert row["max |x_secagg - x_plain|"] <= STEP
    assert row["plain MB up"] > 3 * 5000 * 4 / 1e6  # three float32 replies went up
    assert row["secagg MB up"] > 3 * 5000 * 8 / 1e6  # three int64 masked vectors (and the key exchange)
    assert 1.9 < row["bytes up x"] < 2.5


# ------------------------------------------------------------------ compression (item 3)
@pytest.mark.parametrize("codec", [dict(name="int8", block=32), dict(name="int4", block=32),
                                   dict(name="fp8", block=32), dict(name="topk", fraction=0.25)], ids=str)
def test_a_codec_before_masking_gives_decode_aggregate_of_the_codes_within_the_quantization_bound(codec):
    """Each client sends decode(encode(D_i)) through SecAgg+: the unmasked mean is
    ``decode_aggregate`` of the clients' codes (computed here from the plain updates)
    within SecAgg+'s bound, and differs from the uncompressed mean by the codec's error."""
    from fedopt_kernels import server as srv
    from fedopt_kernels.ops import compressed

    from fedopt_kernels.compression import Codec

    _, means, globals_, _ = _run(lambda m: srv.FedAvg(m.parameters(), lr=1.0), rounds=1, codec=Codec(**codec))
    D, _ = _plain_updates(globals_[0], 1)
    kw = dict(fraction=codec["fraction"]) if codec["name"] == "topk" else dict(block=codec["block"])
    codes = [compressed.encode(d.float(), codec["name"], **kw) for d in D]
    oracle, _ = compressed.decode_aggregate(codes, [1.0 / N_NODES] * N_NODES, backend="reference")
    # the float64 oracle of the same codes: decode each in float64, average
    oracle64 = torch.stack([compressed.decode(c).double() for c in codes]).mean(0)
    err = (means[0] - oracle64).abs().max().item()
    bound = STEP  # each client's value off by < one step; uniform weights
    assert err <= bound, (codec, err, bound)
    assert (oracle.double() - oracle64).abs().max().item() <= 1e-6 * oracle64.abs().max().item()
    # the codec was applied: the plain mean is further away than the quantization bound
    assert (means[0] - D.mean(0)).abs().max().item() > 10 * bound


def test_combinations_that_cannot_compress_under_secure_aggregation_are_refused_before_the_run():
    from fedopt_kernels import server as srv
    from fedopt_kernels.compression import Codec
    from fedopt_kernels.integrations.flower import secagg as S

    model = _model()
    opt = lambda: srv.FedAvg(model.parameters(), lr=1.0)  # noqa: E731
    dp = S.SecureDP(clip=1.0, noise_multiplier=1.0, expected_clients=3)
    with pytest.raises(ValueError, match="sensitivity would no longer be dp.clip"):
        S.SecAggPlusFusedStrategy(model, opt(), dp=dp, codec=Codec("int8"))
    with pytest.raises(TypeError, match="codec must be None or a fedopt_kernels.compression.Codec"):
        S.SecAggPlusFusedStrategy(model, opt(), codec="int8")
    with pytest.raises(ValueError, match="rounds to nearest without a rotation"):
        S.SecAggPlusFusedStrategy(model, opt(), codec=Codec("int8", stochastic=True))
    with pytest.raises(ValueError, match="rounds to nearest without a rotation"):
        S.SecAggPlusFusedStrategy(model, opt(), codec=Codec("int4", rotation=1024))
    # the codec's own settings are checked where it is made
    with pytest.raises(ValueError, match="block must be a positive multiple of 32"):
        Codec("int8", block=48)
