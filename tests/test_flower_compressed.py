"""Compressed updates on Flower (issue 42 item 3): ``FusedStrategy(compress=Codec(...))``
with :class:`FedNARClient` in this process (``InProcessGrid``: every message through
Flower's protobuf and back) equals the simulator's compressed run (``--compress``, same
seed, data and clients) round by round, and a hand loop (ops encode / decode, float64
mean, FedAvg step); each malformed compressed reply is left out with its reason; the
round's metrics count the bytes of the arrays actually sent."""

from __future__ import annotations

import pytest
import torch
from _flwr import needs_flwr

from fedopt_kernels.compression import parse_codec
from fedopt_kernels.fl.seeds import compress_key
from fedopt_kernels.ops import compressed as C

pytestmark = needs_flwr

SMALL = dict(clients=4, per_round=4, rounds=2, local_steps=3, hidden=(16,), engine="sequential", seed=3,
             dataset="synthetic", max_samples_per_client=40, batch_size=16)
CASES = [dict(compress="int8", error_feedback=True), dict(compress="topk:0.05"), dict(compress="fp8")]


def _simulation(model=None, **changes):
    from fedopt_kernels.fl import Simulation, SimulationConfig

    sim = Simulation(SimulationConfig(**{**SMALL, **changes}), model=model)
    per_round = []
    sim.run(callback=lambda rec, s: rec["round"] > 0 and per_round.append(s.x_global.clone()))
    return sim, per_round


def _flower(sim, *, codec, error_feedback=False, tamper=None, model_factory=None, arrays_seen=None, **concerns):
    """The simulator's federation through Flower's ``Strategy.start`` with compressed
    replies; ``tamper(reply_message)`` may break a reply on its way back; ``arrays_seen``
    (a list) gets each round's global arrays.  Returns ``(strategy, per-round x_global,
    per-round metrics, the grid)``."""
    from flwr.clientapp import ClientApp

    from fedopt_kernels.fl import build_model
    from fedopt_kernels.integrations import flower as fk
    from fedopt_kernels.integrations.flower.inprocess import InProcessGrid

    cfg, ds, part = sim.config, sim.dataset, sim.partition

    def model_fn(context=None):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(fk.init_seed(cfg.seed))
            if model_factory is not None:
                return model_factory()
            return build_model(cfg.model, ds.input_shape, ds.num_classes, hidden=cfg.hidden)

    def data_fn(context):
        idx = part.client_indices[int(context.node_config["partition-id"])]
        return ds.x_train[idx], ds.y_train[idx]

    client = fk.FedNARClient(model_fn, data_fn, config=sim.local, seed=cfg.seed)
    app = ClientApp()

    @app.train()
    def train(msg, context):
        reply = client.train(msg, context)
        return tamper(reply) if tamper is not None else reply

    grid = InProcessGrid(app, cfg.clients)
    model = model_fn()
    strategy = fk.make_strategy(cfg.algo, model, **sim.server.hyper, fraction_evaluate=0.0,
                                min_available_nodes=cfg.clients, min_train_nodes=cfg.clients, compress=codec,
                                error_feedback=error_feedback, compress_seed=cfg.seed, **concerns)
    xs = []

    def evaluate_fn(server_round, arrays):
        if server_round > 0:
            xs.append(strategy.x_global.detach().clone())
            if arrays_seen is not None:
                arrays_seen.append({k: torch.from_numpy(v.numpy().copy()) for k, v in arrays.items()})
        return None

    result = strategy.start(grid=grid, initial_arrays=fk.model_to_arrayrecord(model), num_rounds=cfg.rounds,
                            evaluate_fn=evaluate_fn)
    metrics = [result.train_metrics_clientapp[r] for r in range(1, cfg.rounds + 1)]
    return strategy, xs, metrics, grid


def _hand_loop(sim, codec, error_feedback):
    """The oracle: the uncompressed simulator's client updates, encoded by hand (EF
    residual kept by hand), decoded, their size-weighted mean in float64, FedAvg's step."""
    from fedopt_kernels.fl import Simulation, SimulationConfig

    ref = Simulation(SimulationConfig(**{**SMALL}))
    N, resid, xs = ref.numel, {}, []
    for r in range(1, SMALL["rounds"] + 1):
        ref._train_clients(r, ref.sample_clients(r))
        kept, key = ref._round_kept, compress_key(SMALL["seed"], r)
        w = ref.client_sizes[kept].double() / ref.client_sizes[kept].double().sum()
        mean = torch.zeros(N, dtype=torch.float64)
        for wi, cid, row in zip(w, kept, ref.updates[:len(kept)]):
            a = resid.get(cid, torch.zeros(N)) + row
            reply = codec.encode(a, key, cid)
            d = C.decode(reply)
            if error_feedback:
                resid[cid] = a - d
            mean += wi * d.double()
        ref.x_global.sub_(mean.float())
        xs.append(ref.x_global.clone())
    return xs, resid


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_compressed_flower_round_equals_the_simulator_and_the_hand_loop(case):
    sim, sim_xs = _simulation(**case)
    codec, ef = sim.config.codec(), bool(case.get("error_feedback"))
    strategy, fl_xs, metrics, grid = _flower(sim, codec=codec, error_feedback=ef)
    for r, (a, b) in enumerate(zip(fl_xs, sim_xs), start=1):
        assert torch.equal(a, b), f"round {r}: differs by {(a - b).abs().max()}"
    hand, resid = _hand_loop(sim, codec, ef)
    for a, b in zip(fl_xs, hand):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    per_reply = codec.bytes_per_reply(sim.numel)
    for m, rec in zip(metrics, sim.results.records[1:]):
        assert m["bytes_up"] == rec["bytes_up"] == SMALL["clients"] * per_reply
        assert m["bytes_up_fp32"] == rec["bytes_up_fp32"] == SMALL["clients"] * 4 * sim.numel
        assert m["excluded_clients"] == 0 and m["update_norm"] == pytest.approx(rec["update_norm"], rel=1e-6)
    from fedopt_kernels.integrations.flower.compression import EF_STATE_KEY
    from fedopt_kernels.integrations.flower.records import array_view

    # what went over the wire (Flower's protobuf): the arrays' bytes plus a small overhead per message
    sent = sum(m["bytes_up"] for m in metrics)
    assert sent < grid.bytes_up < sent + 2000 * SMALL["clients"] * SMALL["rounds"]
    for ctx in grid.contexts.values():  # error feedback's residual lives in the node's Context.state
        cid = int(ctx.node_config["partition-id"])
        if ef:
            got = torch.from_numpy(array_view(ctx.state[EF_STATE_KEY]["residual"]).copy())
            assert torch.equal(got, sim.compression.ef.residual(cid))
            torch.testing.assert_close(got, resid[cid], rtol=1e-5, atol=1e-6)
        else:
            assert EF_STATE_KEY not in ctx.state


class _BNNet(torch.nn.Module):
    """An MLP with BatchNorm (floating running statistics, an integer step count)."""

    def __init__(self, features: int):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(features, 16), torch.nn.BatchNorm1d(16),
                                       torch.nn.ReLU(), torch.nn.Linear(16, 10))

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("compress", ["int8", "topk:0.05"])
def test_compressed_flower_replies_carry_the_batchnorm_buffers_as_the_simulator_does(compress):
    """A BatchNorm model: the replies carry the floating buffers uncompressed beside the
    codes, and every round's global model -- parameters AND running statistics -- equals
    the simulator's compressed run bit for bit; the integer buffer keeps the server's
    value; ``bytes_up`` counts the codes alone (the simulator's record)."""
    import math

    from fedopt_kernels.fl import Simulation, SimulationConfig

    probe = Simulation(SimulationConfig(**SMALL))
    features = math.prod(probe.dataset.input_shape)
    factory = lambda: _BNNet(features)  # noqa: E731
    sim_states = []
    sim = Simulation(SimulationConfig(**{**SMALL, "compress": compress, "error_feedback": compress == "int8"}),
                     model=factory)
    sim.run(callback=lambda rec, s: rec["round"] > 0 and sim_states.append(
        {k: v.clone() for k, v in s.global_model.state_dict().items()}))
    seen = []
    strategy, fl_xs, metrics, grid = _flower(sim, codec=sim.config.codec(), error_feedback=compress == "int8",
                                             model_factory=factory, arrays_seen=seen)
    assert len(seen) == len(sim_states) == SMALL["rounds"]
    for r, (got, want) in enumerate(zip(seen, sim_states), start=1):
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(got[k], v), f"round {r}: {k}"
    first = sim_states[0]["net.2.running_mean"]
    assert not torch.equal(first, torch.zeros_like(first))  # the clients' statistics reached the server
    assert seen[-1]["net.2.num_batches_tracked"].item() == 0
    per_reply = sim.config.codec().bytes_per_reply(sim.numel)
    for m, rec in zip(metrics, sim.results.records[1:]):
        assert m["bytes_up"] == rec["bytes_up"] == SMALL["clients"] * per_reply


def test_a_robust_rule_on_compressed_flower_replies_equals_the_simulator():
    """Under a robust rule the strategy's decoder hands the rule the decoded rows, as the
    simulator's does: the same model bit for bit, the rule's metrics alike."""
    sim, sim_xs = _simulation(compress="int8", aggregator="trimmed-mean", trim_beta=0.25)
    _, fl_xs, metrics, _ = _flower(sim, codec=sim.config.codec(), aggregator="trimmed-mean", trim_beta=0.25)
    for a, b in zip(fl_xs, sim_xs):
        assert torch.equal(a, b)
    for m, rec in zip(metrics, sim.results.records[1:]):
        assert m["bytes_up"] == rec["bytes_up"] and m["update_norm"] == pytest.approx(rec["update_norm"], rel=1e-6)


def _break(kind):
    """A reply message's compressed arrays broken one way (the first reply of node 1)."""
    from fedopt_kernels.integrations.flower.records import array_view, tensors_to_arrayrecord

    def tamper(msg):
        if int(msg.content["fedopt"]["partition-id"]) != 1:
            return msg
        rec = msg.content["arrays"]
        t = {k: torch.from_numpy(array_view(rec[k]).copy()) for k in rec.keys()}
        if kind == "scales_count":
            t["scales"] = t["scales"][:-1]
        elif kind == "nan_scale":
            t["scales"][0] = float("nan")
        elif kind == "inf_scale":
            t["scales"][-1] = float("inf")
        elif kind == "length":
            t["codes"] = t["codes"][:-1]
        elif kind == "index_range":
            t["indices"][-1] = 10**9
        elif kind == "index_repeated":
            t["indices"][1] = t["indices"][0]
        elif kind == "codec":
            msg.content["fedopt"]["codec"] = "int4"
        else:
            raise AssertionError(kind)
        msg.content["arrays"] = tensors_to_arrayrecord(t.items())
        return msg
    return tamper


REASONS = {"scales_count": "scales for", "nan_scale": "NaN/Inf scale", "inf_scale": "NaN/Inf scale",
           "length": "", "index_range": "out of range", "index_repeated": "repeated", "codec": "int4"}


def _reply_message(spec, numel=1000, seed=0):
    """A client's compressed reply message, as FedNARClient builds it."""
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

    from fedopt_kernels.integrations.flower.compression import reply_to_arrayrecord

    codec = parse_codec(spec, block=64)
    reply = codec.encode(torch.randn(numel, generator=torch.Generator().manual_seed(seed)), 5, 1)
    content = RecordDict({"arrays": reply_to_arrayrecord(reply), "metrics": MetricRecord({"num-examples": 3}),
                          "fedopt": ConfigRecord({"partition-id": 1, "server-round": 1, "codec": spec})})
    return codec, Message(content=content, dst_node_id=1, message_type="train")


@pytest.fixture
def task_identity(monkeypatch):
    """Flower's process-wide run / task / node ids, which building a Message reads (set
    as a grid sets them, restored after)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_task_id", 1), ("_node_id", 0)):
        monkeypatch.setattr(TaskIdentity, name, value)


@pytest.mark.parametrize("kind", sorted(REASONS))
def test_each_malformed_compressed_reply_is_screened_with_its_reason(kind, task_identity):
    """Screening (:func:`screen_train_replies` with the compressed reader's check), each
    reason alone on a reply that passes unbroken."""
    from fedopt_kernels.integrations.flower.compression import CompressedReader, CompressionConcern
    from fedopt_kernels.integrations.flower.screening import screen_train_replies
    from fedopt_kernels.utils.flat import parameters_layout

    spec = "topk:0.05" if kind.startswith("index") else "int8"
    model = torch.nn.Linear(999, 1)  # 1000 values
    layout = parameters_layout(model)
    codec, good = _reply_message(spec)
    _, msg = _reply_message(spec, seed=1)
    reader = CompressedReader(None, CompressionConcern(codec), layout.numel)
    ok = screen_train_replies([good], server_round=1, layout=layout, check=reader.check)
    assert len(ok.kept) == 1 and not ok.excluded
    msg.metadata.__dict__.update(_src_node_id=7)
    out = screen_train_replies([_break(kind)(msg)], server_round=1, layout=layout, check=reader.check)
    [(node, reason, detail)] = out.excluded
    assert not out.kept and node == 7 and reason == "bad_arrays" and REASONS[kind] in detail, detail


@pytest.mark.parametrize("spec, kind", [("int8", "nan_scale"), ("topk:0.05", "index_repeated")])
def test_a_malformed_compressed_reply_is_left_out_of_the_round(spec, kind, caplog):
    """The round goes on with the others: their decoded, size-weighted mean."""
    from fedopt_kernels.fl import Simulation, SimulationConfig

    sim = Simulation(SimulationConfig(**{**SMALL, "rounds": 1, "compress": spec}))
    codec = sim.config.codec()
    strategy, xs, [m], _ = _flower(sim, codec=codec, tamper=_break(kind))
    assert m["excluded_clients"] == 1 and m["excluded_bad_arrays"] == 1
    assert "bad_arrays" in caplog.text and REASONS[kind] in caplog.text
    # the three others, by hand
    ref = Simulation(SimulationConfig(**{**SMALL, "rounds": 1}))
    ref._train_clients(1, ref.sample_clients(1))
    key = compress_key(SMALL["seed"], 1)
    kept = [c for c in ref._round_kept if c != 1]
    rows = {c: row for c, row in zip(ref._round_kept, ref.updates)}
    w = ref.client_sizes[kept].double() / ref.client_sizes[kept].double().sum()
    mean = sum(wi * C.decode(codec.encode(rows[c], key, c)).double() for wi, c in zip(w, kept))
    torch.testing.assert_close(xs[0], ref.x_global - mean.float(), rtol=1e-5, atol=1e-6)
    assert m["bytes_up"] == 3 * codec.bytes_per_reply(sim.numel) and m["bytes_up_fp32"] == 3 * 4 * sim.numel


def test_compression_is_refused_where_it_cannot_apply():
    from fedopt_kernels.integrations import flower as fk

    with pytest.raises(ValueError, match="need compress"):
        fk.FedAvg(torch.nn.Linear(3, 2), error_feedback=True)
    with pytest.raises(ValueError, match="scaffold"):
        fk.FedAvg(torch.nn.Linear(3, 2), scaffold=True, compress=parse_codec("int8"))
    with pytest.raises(TypeError, match="Codec"):
        fk.FedAvg(torch.nn.Linear(3, 2), compress="int8")
    with pytest.raises(ValueError, match="unbiased"):
        fk.FedAvg(torch.nn.Linear(3, 2), compress=parse_codec("int8", stochastic=True), error_feedback=True)


def test_a_nonfinite_update_keeps_the_residual_and_its_reply_is_screened_out(task_identity):
    """FedNARClient's encode: a NaN update leaves the node's residual as it was, and the
    reply it sends (a NaN/Inf scale) is left out as ``bad_arrays``."""
    from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

    from fedopt_kernels.integrations import flower as fk
    from fedopt_kernels.integrations.flower.compression import (EF_STATE_KEY, CompressedReader, CompressionConcern,
                                                                codec_spec)
    from fedopt_kernels.integrations.flower.records import array_view
    from fedopt_kernels.integrations.flower.screening import screen_train_replies
    from fedopt_kernels.utils.flat import parameters_layout

    codec = parse_codec("int8", block=64)
    client = fk.FedNARClient(lambda c: torch.nn.Linear(3, 2), lambda c: None)
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    good = torch.randn(8)
    client._encode(good, (codec, 5, True), 0, None, ctx)
    before = array_view(ctx.state[EF_STATE_KEY]["residual"]).copy()
    assert torch.equal(torch.from_numpy(before), good - codec.decode(codec.encode(good, 5, 0), 8, 5))
    bad = good.clone()
    bad[3] = float("nan")
    arrays = client._encode(bad, (codec, 5, True), 0, None, ctx)
    assert (array_view(ctx.state[EF_STATE_KEY]["residual"]) == before).all()
    msg = Message(content=RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 3}),
                                      "fedopt": ConfigRecord({"server-round": 1, "codec": codec_spec(codec)})}),
                  dst_node_id=1, message_type="train")
    msg.metadata.__dict__.update(_src_node_id=4)
    layout = parameters_layout(torch.nn.Linear(3, 2))
    reader = CompressedReader(None, CompressionConcern(codec), layout.numel)
    out = screen_train_replies([msg], server_round=1, layout=layout, check=reader.check)
    [(node, reason, detail)] = out.excluded
    assert node == 4 and reason == "bad_arrays" and "NaN/Inf scale" in detail


def test_the_wrapper_builds_the_keywords_concern():
    """``Compression(strategy, codec, ...)`` attaches the same concern as ``compress=``: the
    compressed reader, the round's decoder, the settings it sends."""
    from fedopt_kernels.integrations import flower as fk
    from fedopt_kernels.integrations.flower.compression import (CompressedReader, CompressionConcern,
                                                                codec_config, codec_from_config)

    codec = parse_codec("topk:0.1", rotation=64)
    wrapped = fk.Compression(fk.FedAdam(torch.nn.Linear(3, 2), lr=0.1), codec, error_feedback=True, seed=7)
    kw = fk.FedAdam(torch.nn.Linear(3, 2), lr=0.1, compress=codec, error_feedback=True, compress_seed=7)
    for s in (wrapped, kw):
        [concern] = [c for c in s.concerns if isinstance(c, CompressionConcern)]
        assert isinstance(s.reader, CompressedReader) and s.round.decoder is concern.decoder
        assert (concern.codec, concern.error_feedback, concern.seed) == (codec, True, 7)
    # what the clients read back is the codec the strategy decided
    assert codec_from_config(codec_config(codec, 123, True)) == (codec, 123, True)
