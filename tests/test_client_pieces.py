"""Clients read in place from their pieces (ops.ClientPieces, fedopt_C::aggregate_pieces).

Oracle: the same aggregation over the ``[C, N]`` rows the pieces would be copied into
(``ClientPieces.stack()``, i.e. ``subtract_from - cat(pieces)`` per client): on the CPU
backend the in-place kernel must give those results BIT FOR BIT -- every dtype, pieces
that straddle the kernel's 4 Ki-column chunks or are empty, one to nine clients (the
kernel's groups of four and its single clients), zero weights, the exclusion and
norm-bound pass; plus a hand-computed case, python_ref, the errors, the server
optimizers' named updates, the Flower strategies (in place vs copying, per strategy)
and the memory a Flower round adds (O(N) against O(C N)).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from _asserts import assert_bitwise
from _flwr import HAVE_FLWR
from torch import nn

from fedopt_kernels import ops
from fedopt_kernels.ops import ClientPieces

pytestmark = pytest.mark.usefixtures("cpu_extension")

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# piece sizes: a bias-like piece, pieces across and exactly on the 4096-column chunk
# boundaries, an empty piece, a one-element piece
SIZES = [(3, 5000, 7, 0, 4096, 1), (10,), (4096, 4096), (1, 8191, 2, 9000)]


def _pieces(C, sizes, dtype, *, base: bool, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pieces = [[torch.randn(n, generator=gen, dtype=torch.float64).to(dtype) for n in sizes] for _ in range(C)]
    # pieces of several shapes, as a model's layers are
    pieces = [[t.view(1, -1) if j % 2 else t for j, t in enumerate(client)] for client in pieces]
    sub = torch.randn(sum(sizes), generator=gen, dtype=torch.float64).to(dtype) if base else None
    return ClientPieces(pieces, subtract_from=sub)


def _both(cp, w, **kw):
    """(in place, over the copied rows), each ``(out, stats)`` on the cpu backend."""
    return ops.aggregate(cp, w, backend="cpu", **kw), ops.aggregate(cp.stack(), w, backend="cpu", **kw)


def _assert_same(a, b):
    (oa, sa), (ob, sb) = a, b
    assert_bitwise(oa, ob)
    for x, y in zip(sa, sb):
        assert_bitwise(x, y)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("base", [False, True], ids=["models", "updates"])
def test_in_place_equals_the_copied_rows_bit_for_bit(dtype, sizes, base):
    for C in (1, 3, 4, 5, 9):
        cp = _pieces(C, sizes, dtype, base=base, seed=C)
        w = torch.rand(C, generator=torch.Generator().manual_seed(C), dtype=torch.float64) + 0.1
        if C > 2:
            w[1] = 0.0  # a zero weight breaks a group of four
        _assert_same(*_both(cp, w))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("base", [False, True], ids=["models", "updates"])
def test_client_dots_and_weighted_sum_in_place_equal_the_copied_rows(dtype, base):
    """FedLAW's two passes read pieces in place too: ``client_dots`` and
    ``weighted_sum``'s forward and (fused) backward, bit for bit the copied rows'."""
    for C in (1, 5):
        cp = _pieces(C, SIZES[3], dtype, base=base, seed=10 + C)
        rows = cp.stack()
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        g = torch.randn(cp.numel, generator=torch.Generator().manual_seed(C), dtype=acc)
        assert_bitwise(ops.client_dots(cp, g, backend="cpu"), ops.client_dots(rows, g, backend="cpu"))
        grads, outs = [], []
        for clients in (cp, rows):
            lam = torch.full((C,), 0.3, dtype=acc, requires_grad=True)
            gamma = torch.ones((), dtype=acc, requires_grad=True)
            out = ops.weighted_sum(clients, lam, gamma, backend="cpu")
            (out.to(acc) * g).sum().backward()
            outs.append(out.detach())
            grads += [lam.grad, gamma.grad]
        assert_bitwise(outs[0], outs[1])
        assert_bitwise(grads[0], grads[2])
        assert_bitwise(grads[1], grads[3])


def test_stack_and_rows_are_the_copy():
    """The oracle itself: a row is ``subtract_from - cat(pieces)`` (one subtraction in the
    pieces' dtype, as a NumPy copy of a reply computes it)."""
    cp = _pieces(3, (5, 0, 7), torch.float16, base=True)
    for i in range(3):
        flat = torch.cat([t.reshape(-1) for t in cp.pieces[i]])
        expected = torch.from_numpy(cp.subtract_from.numpy() - flat.numpy())
        assert_bitwise(cp[i], expected)
        assert_bitwise(cp.stack()[i], expected)
    assert [r.shape for r in cp] == [torch.Size([12])] * 3 and len(cp) == 3


def test_hand_computed_case():
    """Two clients of two pieces, updates from a base: every value by hand."""
    base = torch.tensor([1.0, 2.0, 3.0])
    a = [torch.tensor([0.0, 2.0]), torch.tensor([1.0])]       # D_0 = [1, 0, 2]
    b = [torch.tensor([3.0, 2.0]), torch.tensor([3.0])]       # D_1 = [-2, 0, 0]
    out, st = ops.aggregate(ClientPieces([a, b], subtract_from=base), torch.tensor([0.25, 0.75]), backend="cpu")
    assert out.tolist() == [0.25 * 1 + 0.75 * -2, 0.0, 0.25 * 2]
    assert st.client_sq_norms.tolist() == [5.0, 4.0]
    assert st.sq_norm.item() == (-1.25) ** 2 + 0.5 ** 2


def test_against_python_ref():
    cp = _pieces(6, SIZES[0], torch.float32, base=True)
    w = torch.rand(6, generator=torch.Generator().manual_seed(1)) + 0.1
    out, st = ops.aggregate(cp, w, backend="cpu")
    ref, rst = ops.aggregate(cp, w, backend="reference")  # python_ref over the stacked rows
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(st.client_sq_norms, rst.client_sq_norms, rtol=1e-5, atol=0)
    torch.testing.assert_close(st.sq_norm, rst.sq_norm, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_exclusion_norm_bound_and_gamma_in_place(dtype):
    """The second pass (a client with NaN/Inf left out, every client norm-bounded) and a
    gamma tensor read the pieces again: still the copied rows' bits."""
    cp = _pieces(7, SIZES[3], dtype, base=True, seed=3)
    cp.pieces[2][1].view(-1)[17] = float("nan")
    cp.pieces[5][3].view(-1)[0] = float("inf")
    w = torch.rand(7, generator=torch.Generator().manual_seed(2)) + 0.1
    a, b = _both(cp, w, max_client_norm=5.0, gamma=torch.tensor(0.9))
    _assert_same(a, b)
    assert a[1].excluded.tolist() == [False, False, True, False, False, True, False]
    assert torch.isfinite(a[0]).all()


def test_bad_pieces_are_refused_by_name_and_nothing_is_written():
    good = [[torch.ones(3), torch.ones(2)], [torch.ones(3), torch.ones(2)]]
    cases = [
        (lambda: ClientPieces([]), ValueError, "at least one client"),
        (lambda: ClientPieces(torch.ones(2, 5)), TypeError, "sequence"),
        (lambda: ClientPieces([good[0], [torch.ones(3)]]), ValueError, r"pieces\[1\] has 1 pieces"),
        (lambda: ClientPieces([good[0], [torch.ones(2), torch.ones(3)]]), ValueError, r"pieces\[1\]\[0\] has 2 "),
        (lambda: ClientPieces([good[0], [torch.ones(3), torch.ones(2, dtype=torch.float64)]]), ValueError,
         "share one dtype"),
        (lambda: ClientPieces([good[0], [torch.ones(3), torch.ones(4)[::2]]]), ValueError, "contiguous"),
        (lambda: ClientPieces([good[0], [torch.ones(3), torch.ones(2, dtype=torch.int64)]]), ValueError,
         "floating dtype"),
        (lambda: ClientPieces(good, subtract_from=torch.ones(4)), ValueError, "subtract_from must be a contiguous"),
    ]
    for make, exc, match in cases:
        with pytest.raises(exc, match=match):
            make()
    base = torch.zeros(5)
    cp = ClientPieces(good, subtract_from=base)
    for out, match in ((base, "shares memory with a piece"), (good[1][0].new_empty(0), "out must be")):
        before = out.clone()
        with pytest.raises(ValueError, match=match):
            ops.aggregate(cp, torch.ones(2), out=out, backend="cpu")
        assert torch.equal(out, before)


def test_the_raw_op_refuses_what_would_be_memory_unsafe():
    """``fedopt_C::aggregate_pieces`` called directly (past the ops layer): every bad
    argument is a RuntimeError naming it, with ``out`` untouched."""
    raw = torch.ops.fedopt_C.aggregate_pieces
    a, b, w = torch.ones(3), torch.ones(2), torch.ones(2)
    cases = [
        (lambda out: raw([a, b, a], 2, None, w, 1.0, None, out, None), "pieces_per_client"),
        (lambda out: raw([a, b, a, torch.ones(3)], 2, None, w, 1.0, None, out, None), "piece 1 of client 1 has 3"),
        (lambda out: raw([a, b, a, torch.ones(4)[::2]], 2, None, w, 1.0, None, out, None), "pieces must be dense"),
        (lambda out: raw([a, b, a, b.double()], 2, None, w, 1.0, None, out, None), "pieces has dtype Double"),
        (lambda out: raw([a, b, a, b], 2, torch.ones(4), w, 1.0, None, out, None), "subtract_from must be a"),
        (lambda out: raw([a, b, a, b], 2, None, torch.ones(3), 1.0, None, out, None), "weights must be a CPU"),
        (lambda out: raw([a, b, a, b], 0, None, w, 1.0, None, out, None), "pieces_per_client"),
    ]
    for call, match in cases:
        out = torch.full((5,), 7.0)
        with pytest.raises(RuntimeError, match=match):
            call(out)
        assert torch.equal(out, torch.full((5,), 7.0))
    with pytest.raises(RuntimeError, match="out must have 5 elements"):
        raw([a, b, a, b], 2, None, w, 1.0, None, torch.zeros(4), None)
    dots = torch.ops.fedopt_C.client_dots_pieces
    with pytest.raises(RuntimeError, match="g must have 5 elements"):
        dots([a, b, a, b], 2, None, torch.zeros(4))
    with pytest.raises(RuntimeError, match="piece 1 of client 1 has 3"):
        dots([a, b, a, torch.ones(3)], 2, None, torch.zeros(5))


def test_backends_without_an_in_place_reader_get_the_stacked_rows(monkeypatch):
    calls = []
    real = ClientPieces.stack

    def counted(self):
        calls.append(1)
        return real(self)

    monkeypatch.setattr(ClientPieces, "stack", counted)
    cp = _pieces(3, (5, 6), torch.float32, base=True)
    nan = cp.pieces[1][0]
    nan[0] = float("nan")  # two passes: stacked once
    ops.aggregate(cp, torch.ones(3), backend="reference")
    assert len(calls) == 1
    ops.aggregate(cp, torch.ones(3), backend="cpu")
    assert len(calls) == 1  # read in place


def test_named_updates_are_read_in_place_by_the_server_optimizers():
    from fedopt_kernels.server import FedAdam

    def make():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3))
        return m, FedAdam(m.named_parameters(), lr=0.1)

    (m1, o1), (m2, o2) = make(), make()
    gen = torch.Generator().manual_seed(3)
    named = [{n: torch.randn(p.shape, generator=gen) for n, p in m1.named_parameters()} for _ in range(4)]
    rows, C = o1.check_updates(named)
    assert isinstance(rows, ClientPieces) and C == 4
    s1 = o1.step(named, [1.0, 2.0, 3.0, 4.0])
    s2 = o2.step(torch.stack([o2.flatten_update(u) for u in named]), [1.0, 2.0, 3.0, 4.0])
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert_bitwise(p, q)
    assert_bitwise(s1.client_sq_norms, s2.client_sq_norms)
    # an entry of another dtype is converted: the flattening copy, the same values
    mixed = [dict(u) for u in named]
    mixed[0]["0.bias"] = mixed[0]["0.bias"].double()
    rows, _ = o1.check_updates(mixed)
    assert isinstance(rows, list) and torch.equal(rows[0], o1.flatten_update(named[0]))


# ----------------------------------------------------------------------------- Flower
flower = pytest.mark.skipif(not HAVE_FLWR and sys.version_info < (3, 11),
                            reason="flwr 1.41 needs Python >= 3.11")


@flower
@pytest.mark.parametrize("algo, kw", [("fedavg", {}), ("fedadam", {}), ("fedexp", {}), ("asnes", {}),
                                      ("scaffold", {}), ("fedlaw", {}),
                                      ("fedlaw", dict(scaffold=True, scaffold_num_clients=4))],
                         ids=["fedavg", "fedadam", "fedexp", "asnes", "scaffold", "fedlaw", "fedlaw-scaffold"])
def test_flower_rounds_in_place_equal_the_copying_path(algo, kw):
    """Two rounds of replies (one of them non-finite: the exclusion pass) read in place
    equal the copying path bit for bit: the global model, the server's metrics,
    SCAFFOLD's control variate (which reads D after the step has moved x_global) and
    FedLAW's learned weights (every pass of its learning reads the models in place)."""
    import test_flower_bad_replies as fb

    def run(in_place):
        s = fb._strategy(algo, read_in_place=in_place, **kw)
        out = []
        for rnd in (1, 2):
            replies = [fb._reply(s.model, c, round_=rnd, seed=rnd) for c in range(4)]
            if rnd == 2:
                fb._corrupt("nonfinite", replies[1])
            arrays, metrics = s.aggregate_train(rnd, replies)
            s.load_global_arrays(arrays)
            out.append((fb._flat(arrays), dict(metrics)))
        return out, (s.c if s.scaffold else None)

    (a, ca), (b, cb) = run(True), run(False)
    for (xa, ma), (xb, mb) in zip(a, b):
        assert_bitwise(xa, xb)
        assert ma == mb
    if algo == "scaffold":
        assert_bitwise(ca, cb)


@flower
def test_flower_replies_of_another_dtype_are_copied():
    import test_flower_bad_replies as fb
    from fedopt_kernels.integrations.flower.records import arrayrecords_as_pieces

    s = fb._strategy("fedavg")
    replies = [fb._reply(s.model, c) for c in range(3)]
    records = [next(iter(r.content.array_records.values())) for r in replies]
    assert isinstance(arrayrecords_as_pieces(records, s.layout), ClientPieces)
    fb._set_array(replies[2], "0.bias", np.asarray(records[2]["0.bias"].numpy(), dtype=np.float64))
    assert arrayrecords_as_pieces(records, s.layout) is None  # converted by the copying path instead
    ref = fb._strategy("fedavg", read_in_place=False)
    assert_bitwise(fb._flat(s.aggregate_train(1, replies)[0]), fb._flat(ref.aggregate_train(1, replies)[0]))


_MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np, torch
    from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity
    from fedopt_kernels.integrations import flower as fk
    torch.manual_seed(0)
    C, width = 16, 1024
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])  # N = 4.2M
    s = fk.FedAvg(model, fraction_evaluate=0.0, read_in_place=sys.argv[1] == "1")
    s.load_global_arrays(fk.model_to_arrayrecord(model))
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    replies = []
    for c in range(C):
        rec = fk.tensors_to_arrayrecord((k, v + 0.01 * c) for k, v in model.state_dict().items())
        content = RecordDict({"arrays": rec, "metrics": MetricRecord({"num-examples": 10}),
                              "fedopt": ConfigRecord({"partition-id": c, "server-round": 1})})
        ins = Message(content=RecordDict(), message_type=MessageType.TRAIN, dst_node_id=1000 + c)
        replies.append(Message(content=content, reply_to=ins))
    N = s.layout.numel

    def peak():  # this process's peak resident memory (VmHWM: ru_maxrss would keep the parent's across exec)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

    before = peak()
    s.aggregate_train(1, replies)
    print(json.dumps({"extra": peak() - before, "N": N, "C": C}))
""")


@flower
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak resident memory from /proc")
def test_a_flower_round_in_place_adds_o_n_memory():
    """The peak resident memory a round of 16 replies of a 4.2M-parameter model adds:
    in place, a few vectors of N (the mean update, x_global's snapshot, the new global
    record); copying, at least the [C, N] rows (the test can see the difference)."""
    extra = {}
    for in_place in ("1", "0"):
        proc = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, in_place], capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        extra[in_place] = json.loads(proc.stdout.strip().splitlines()[-1])
    N, C = extra["1"]["N"], extra["1"]["C"]
    rows_bytes = 4 * C * N
    assert extra["0"]["extra"] >= 0.9 * rows_bytes, extra
    assert extra["1"]["extra"] <= 8 * 4 * N, extra  # O(N): at most 8 vectors of N, against C = 16 rows
