"""Compressed updates (issue 42): the codecs against float64 oracles written here from
each codec's definition (DESIGN.md, "Compressed updates"), the fused decode-aggregate on
every backend, the validator, error feedback in the ClientStateStore."""

from __future__ import annotations

import math

import pytest
import torch

from fedopt_kernels import ops
from fedopt_kernels.compression import Codec, parse_codec
from fedopt_kernels.fl.engine.client_state import ClientStateStore
from fedopt_kernels.fl.engine.error_feedback import ErrorFeedback
from fedopt_kernels.ops import compressed as C
from python_ref import compression as P
from python_ref.gaussian_noise import philox4x32_10

LEVELS = {"int8": 127, "int4": 7}


# --------------------------------------------------------------------------------------
# float64 oracles, from the definitions


def f64_codes(reply: C.CompressedUpdate) -> torch.Tensor:
    """The integer (or fp8) code values of a block reply, read from its bytes here."""
    c = reply.codes
    if reply.codec == "int8":
        return c.to(torch.float64)
    if reply.codec == "int4":
        b = c.to(torch.int64)
        nib = torch.stack([b & 15, (b >> 4) & 15], dim=1).reshape(-1)[:reply.numel]
        return torch.where(nib >= 8, nib - 16, nib).to(torch.float64)
    bits = c.view(torch.uint8).to(torch.int64)  # e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits
    sign = torch.where(bits >> 7 == 1, -1.0, 1.0).to(torch.float64)
    e, m = (bits >> 3) & 15, (bits & 7).to(torch.float64)
    mag = torch.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * torch.pow(2.0, (e - 7).to(torch.float64)))
    return sign * mag


def f64_decode(reply: C.CompressedUpdate) -> torch.Tensor:
    if reply.codec == "topk":
        out = torch.zeros(reply.numel, dtype=torch.float64)
        out[reply.indices] = reply.codes.to(torch.float64)
        return out
    s = reply.scales.to(torch.float64).repeat_interleave(reply.block)[:reply.numel]
    return s * f64_codes(reply)


def f64_aggregate(replies, weights, gamma=1.0):
    rows = torch.stack([f64_decode(r) for r in replies]) if replies[0].numel else torch.zeros(len(replies), 0,
                                                                                              dtype=torch.float64)
    w = torch.as_tensor(weights, dtype=torch.float64)
    total = (w[:, None] * rows).sum(0)
    return gamma * total, (rows * rows).sum(1), (total * total).sum()


def updates(C_, N, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(N, generator=g) * (1 + i)).to(dtype) for i in range(C_)]


# --------------------------------------------------------------------------------------
# encoders against their definitions


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_deterministic_rounding_is_nearest_even_within_half_a_step(codec, dtype):
    x = updates(1, 1000 + 33, dtype)[0]
    x[5], x[700] = 0.0, 0.0
    r = C.encode(x, codec, block=64)
    x64 = x.to(torch.float64)
    Q = LEVELS[codec]
    # the scale: max |x| of the block / Q, one fp32 rounding
    blocks = torch.cat([x64, x64.new_zeros(-x64.numel() % 64)]).view(-1, 64)
    expect_s = (blocks.abs().amax(1) / Q).to(torch.float32)
    assert torch.equal(r.scales, expect_s)
    s = r.scales.to(torch.float64).repeat_interleave(64)[:x.numel()]
    err = (f64_decode(r) - x64).abs()
    # |x - s q| <= s / 2 (the code's rounding), plus fp32 roundings of x / s and s * q
    assert bool((err <= s * (0.5 + 2.0 ** -20)).all()), float((err / s).max())
    t = x64 / s
    frac = t - t.floor()
    clear = (frac - 0.5).abs() > 1e-4  # away from a tie, the nearest integer is unambiguous
    assert torch.equal(f64_codes(r)[clear], torch.round(t)[clear])
    assert float(f64_codes(r).abs().max()) <= Q


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # Triton interpreter: 0 / 0 of a zero block, discarded by its where
@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_fused_encode_gives_python_refs_bits(backend, codec, stochastic, dtype):
    """Every backend's encode (the C++ CPU kernel's, python_ref's elsewhere) against
    python_ref.compression.quantize, bit for bit: odd and empty sizes, zeros, a NaN, a
    block of the dtype's subnormals (bf16's reach Triton as bits: the interpreter's own
    bf16 conversion flushes them)."""
    name, device = backend
    tiny = torch.finfo(dtype).tiny if dtype != torch.float64 else torch.finfo(torch.float32).tiny
    for N in (0, 1, 31, 263):
        x = updates(1, N, dtype, seed=N)[0]
        if N > 200:
            x[64:96] = 0.0  # an all-zero block: scale 0, codes 0
            x[200] = float("nan")  # its block's scale is NaN (the server refuses it), codes 0
            sub = (torch.arange(1, 33, dtype=torch.float64) * (-1.0) ** torch.arange(32) * tiny / 40).to(dtype)
            assert bool((sub != 0).all() & (sub.abs() < tiny).all()) or dtype == torch.float64
            x[96:128] = sub  # subnormals (of fp32 for fp64 input)
        r = C.encode(x.to(device), codec, block=32, stochastic=stochastic, key=2 ** 62 + 5, client=9, backend=name)
        codes, scales = P.quantize(x, codec, 32, stochastic=stochastic, key=2 ** 62 + 5, client=9)
        assert torch.equal(r.codes.cpu(), codes), (name, N)
        assert torch.equal(r.scales.cpu().nan_to_num(7.0), scales.nan_to_num(7.0)), (name, N)


def test_round_half_to_even_on_exact_ties():
    # block max 7 -> s = 1 for int4: x / s are exact halves
    x = torch.tensor([7.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] + [0.0] * 24)
    r = C.encode(x, "int4", block=32)
    assert f64_codes(r)[:8].tolist() == [7, 0, 2, 2, 0, -2, -2, 4]


def test_fp8_error_bound_and_per_row_scale():
    x = updates(1, 2 * 256 + 17)[0]
    r = C.encode(x, "fp8", block=256)
    x64 = x.to(torch.float64)
    s = r.scales.to(torch.float64).repeat_interleave(256)[:x.numel()]
    blocks = torch.cat([x64, x64.new_zeros(-x64.numel() % 256)]).view(-1, 256)
    assert torch.equal(r.scales, (blocks.abs().amax(1) / 448).to(torch.float32))
    t = x64 / s
    # e4m3: 3 mantissa bits -> relative half-ulp 2^-4 for normals (|t| >= 2^-6), 2^-10 absolute below
    bound = s * torch.maximum(t.abs() * 2.0 ** -4, torch.full_like(t, 2.0 ** -10)) * (1 + 1e-6)
    assert bool(((f64_decode(r) - x64).abs() <= bound).all())
    assert float(f64_codes(r).abs().max()) == 448.0  # the block maximum maps to the largest code


def test_topk_keeps_the_largest_and_breaks_ties_to_the_lower_index():
    x = torch.tensor([1.0, -3.0, 3.0, 0.5, -3.0, 2.0, 3.0])
    r = C.encode(x, "topk", k=3)
    assert r.indices.tolist() == [1, 2, 4] and r.codes.tolist() == [-3.0, 3.0, -3.0]
    r = C.encode(x, "topk", fraction=0.5)  # ceil(3.5) = 4
    assert r.indices.tolist() == [1, 2, 4, 6]
    assert C.encode(torch.zeros(0), "topk", fraction=0.5).indices.numel() == 0


def test_stochastic_rounding_is_unbiased():
    """Per element, the rounded-up indicator is Bernoulli(frac) with frac = t - floor(t).
    Over M = 1000 independent streams (clients), Hoeffding: P(|mean - frac| >= eps) <=
    2 exp(-2 M eps^2); with eps = 0.0966 and 64 elements the union bound puts the false
    failure rate below 1e-6.  A biased rounding (nearest: mean 0 or 1) fails by >= 0.2."""
    M, n = 1000, 64
    g = torch.Generator().manual_seed(3)
    s = 1.0 / 127
    frac = 0.2 + 0.6 * torch.rand(n, generator=g, dtype=torch.float64)
    base = torch.randint(-100, 100, (n,), generator=g).to(torch.float64)
    x = ((base + frac) * s).to(torch.float32)
    x[0] = 127 * s  # the block maximum fixes s (its own fraction is 0)
    frac[0] = 0.0
    up = torch.zeros(n, dtype=torch.float64)
    for client in range(M):
        r = C.encode(x, "int8", block=64, stochastic=True, key=1234, client=client)
        t = x.to(torch.float64) / r.scales.to(torch.float64)
        up += (f64_codes(r) > t.floor()).to(torch.float64)
    t = x.to(torch.float64) / r.scales.to(torch.float64)
    real_frac = t - t.floor()
    eps = math.sqrt(math.log(2 * n / 1e-6) / (2 * M))
    assert eps < 0.0967
    assert float((up / M - real_frac).abs().max()) <= eps


def test_stochastic_rounding_depends_on_key_client_element_only():
    x = updates(1, 300)[0]
    a = C.encode(x, "int4", block=32, stochastic=True, key=7, client=3)
    b = C.encode(x, "int4", block=32, stochastic=True, key=7, client=3)
    c = C.encode(x, "int4", block=32, stochastic=True, key=7, client=4)
    assert torch.equal(a.codes, b.codes) and not torch.equal(a.codes, c.codes)
    # element j's draw does not depend on the vector's length
    d = C.encode(torch.cat([x, x[:1] * 0]), "int4", block=32, stochastic=True, key=7, client=3)
    assert torch.equal(C.decode(d)[:300], C.decode(a))


def test_hadamard_rotation_is_orthogonal_and_inverted_once_on_the_aggregate():
    x = updates(3, 1000)
    key = 99
    y = [C.hadamard_rotate(v, key, 256) for v in x]
    assert y[0].numel() == 1024
    for v, r in zip(x, y):
        assert math.isclose(float(r.norm()), float(v.norm()), rel_tol=1e-5)
    # a float64 H_R from Sylvester's construction, and the signs from their definition:
    # r_j = 1 - 2 (x0 & 1), x0 the first word of Philox4x32-10(key, (j, 0, 0, 0x52))
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < 256:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    j = torch.arange(1024, dtype=torch.int64)
    x0, _, _, _ = philox4x32_10(key, j & 0xFFFFFFFF, j >> 32, torch.zeros_like(j), torch.full_like(j, 0x52))
    r = (1 - 2 * (x0 & 1)).to(torch.float64).view(4, 256)
    xb = torch.cat([x[0].to(torch.float64), torch.zeros(24, dtype=torch.float64)]).view(4, 256)
    expect = ((H @ (r * xb).t()).t() / 16).reshape(-1)
    assert torch.allclose(y[0].to(torch.float64), expect, atol=1e-5)
    assert 0.4 < float((r > 0).double().mean()) < 0.6
    w = torch.tensor([0.2, 0.3, 0.5])
    agg = C.hadamard_unrotate(sum(wi * yi for wi, yi in zip(w, y)), key, 256, 1000)
    assert torch.allclose(agg, sum(wi * xi for wi, xi in zip(w, x)), atol=1e-5)


# --------------------------------------------------------------------------------------
# the fused decode-aggregate, every backend


def _replies(codec, C_, N, dtype=torch.float32, block=64, **kw):
    xs = updates(C_, N, dtype, seed=N)
    if codec == "topk":
        return [C.encode(x, "topk", fraction=0.3) for x in xs]
    return [C.encode(x, codec, block=block, key=5, client=i, **kw) for i, x in enumerate(xs)]


@pytest.mark.parametrize("codec", ["int8", "int4", "fp8", "topk"])
@pytest.mark.parametrize("N", [0, 1, 33, 1000, 4099])
def test_decode_aggregate_against_float64_and_bitwise_the_dense_aggregate(backend, codec, N):
    name, device = backend
    replies = _replies(codec, 3, N)
    w = torch.tensor([0.5, 0.0, 0.25])
    out, st = C.decode_aggregate(replies, w, gamma=0.5, nonfinite="propagate", backend=name)
    e_out, e_q, e_Q = f64_aggregate(replies, w, 0.5)
    assert out.dtype == torch.float32 and out.shape == (N,)
    assert torch.allclose(out.to(torch.float64), e_out, rtol=1e-6, atol=1e-6)
    assert torch.allclose(st.client_sq_norms.to(torch.float64), e_q, rtol=1e-5, atol=1e-6)
    assert math.isclose(float(st.sq_norm), float((e_out / 0.5).pow(2).sum()), rel_tol=1e-5, abs_tol=1e-6)
    # bit for bit python_ref's aggregate over the decoded rows (the reference backend;
    # the cpu backend's dense aggregate too: same operations, same order)
    rows = torch.stack([C.decode(r) for r in replies]) if N else torch.zeros(3, 0)
    for dense_backend in ("reference", "cpu"):
        dense, _ = ops.aggregate(rows, w, gamma=0.5, nonfinite="propagate", backend=dense_backend)
        assert torch.equal(out.cpu(), dense), dense_backend


@pytest.mark.parametrize("codec", ["int8", "int4", "fp8", "topk"])
def test_every_backend_gives_the_same_bits(codec):
    replies = _replies(codec, 4, 5000 + 7, block=128)
    w = torch.tensor([0.1, 0.2, 0.3, 0.4])
    outs = {}
    for name in ("reference", "cpu", "triton"):
        outs[name], _ = C.decode_aggregate(replies, w, backend=name)
    assert torch.equal(outs["reference"], outs["cpu"]) and torch.equal(outs["reference"], outs["triton"])


def test_topk_ties_decided_the_same_on_every_backend():
    x = torch.tensor([2.0, -2.0, 1.0, 2.0, -2.0] * 10)
    r = C.encode(x, "topk", k=7)
    assert r.indices.tolist() == [0, 1, 3, 4, 5, 6, 8]
    outs = [C.decode_aggregate([r], [1.0], backend=b)[0] for b in ("reference", "cpu", "triton")]
    assert all(torch.equal(outs[0], o) for o in outs)
    assert outs[0].nonzero().flatten().tolist() == [0, 1, 3, 4, 5, 6, 8]


def test_skip_writes_nothing(backend):
    name, _ = backend
    replies = _replies("int4", 2, 100)
    out = torch.full((100,), 7.0)
    _, st = C.decode_aggregate(replies, [1.0, 1.0], out=out, nonfinite="propagate", backend=name)
    assert not torch.equal(out, torch.full((100,), 7.0))
    from fedopt_kernels.backends import compressed as table
    out2 = torch.full((100,), 7.0)
    q, Q = table.block_decode_aggregate(name)([r.codes for r in replies], [r.scales for r in replies], 1, 64, 100,
                                              torch.ones(2), 1.0, None, out2, torch.ones((), dtype=torch.bool))
    assert torch.equal(out2, torch.full((100,), 7.0)) and not bool(q.any()) and float(Q) == 0.0


def test_norm_bound_and_statistics_come_from_the_decoded_values():
    replies = _replies("int8", 3, 500)
    dec = [C.decode(r) for r in replies]
    out, st = C.decode_aggregate(replies, [1.0, 1.0, 1.0], max_client_norm=5.0, backend="cpu")
    f = torch.clamp(5.0 / (torch.stack([d.norm() for d in dec]) + 1e-6), max=1.0)
    assert torch.allclose(out, sum(fi * d for fi, d in zip(f, dec)), atol=1e-5)


# --------------------------------------------------------------------------------------
# the validator


def _bad(reply, **changes):
    fields = dict(codec=reply.codec, numel=reply.numel, codes=reply.codes, scales=reply.scales,
                  indices=reply.indices, block=reply.block)
    fields.update(changes)
    return C.CompressedUpdate(**fields)


def test_validator_names_what_is_wrong():
    r = C.encode(updates(1, 100)[0], "int8", block=32)
    assert C.check_reply(r, 100) is None
    assert C.check_reply(_bad(r, scales=r.scales[:3].contiguous()), 100) == \
        "3 scales for 100 values in blocks of 32 (expected 4)"
    s = r.scales.clone()
    s[2] = float("nan")
    assert "NaN/Inf scale at block 2" in C.check_reply(_bad(r, scales=s), 100)
    s[2] = float("inf")
    assert "NaN/Inf scale" in C.check_reply(_bad(r, scales=s), 100)
    assert "model has 101" in C.check_reply(r, 101)
    assert "codes for 100 values" in C.check_reply(_bad(r, codes=r.codes[:99].contiguous()), 100)
    t = C.encode(updates(1, 100)[0], "topk", k=5)
    assert C.check_reply(t, 100) is None
    ix = t.indices.clone()
    ix[-1] = 100
    assert "out of range" in C.check_reply(_bad(t, indices=ix), 100)
    ix = t.indices.clone()
    ix[2] = ix[1]
    assert "repeated at position 2" in C.check_reply(_bad(t, indices=ix), 100)
    ix = t.indices.flip(0).contiguous()
    assert "not sorted" in C.check_reply(_bad(t, indices=ix), 100)
    codec = Codec("int4", block=64)
    assert "codec 'int8'" in codec.check(r, 100)
    with pytest.raises(ValueError, match=r"replies\[1\]: a NaN/Inf scale"):
        s[2] = float("nan")
        C.decode_aggregate([r, _bad(r, scales=s)], [1.0, 1.0])


def test_raw_cpu_op_refuses_memory_unsafe_indices():
    with pytest.raises(RuntimeError, match="strictly increasing"):
        torch.ops.fedopt_C.topk_decode_aggregate([torch.ones(2)], [torch.tensor([3, 10])], 5, torch.ones(1), 1.0,
                                                 None, torch.zeros(5), None)


# --------------------------------------------------------------------------------------
# error feedback in the ClientStateStore


def test_error_feedback_two_rounds_by_hand(tmp_path):
    """top-1 with residuals: round 1 sends D's largest, keeps the rest; round 2 adds it back."""
    for spill in (None, tmp_path / "spill"):
        store = ClientStateStore(spill_dir=spill)
        ef = ErrorFeedback(Codec("topk", fraction=0.25), store, 4)
        r1 = ef.encode(7, torch.tensor([0.5, -0.25, 0.125, 0.0625]))
        assert r1.indices.tolist() == [0] and r1.codes.tolist() == [0.5]
        assert ef.residual(7).tolist() == [0.0, -0.25, 0.125, 0.0625]
        r2 = ef.encode(7, torch.tensor([0.125, 0.125, 0.0, 0.25]))  # a = [0.125, -0.125, 0.125, 0.3125]
        assert r2.indices.tolist() == [3] and r2.codes.tolist() == [0.3125]
        assert ef.residual(7).tolist() == [0.125, -0.125, 0.125, 0.0]
        assert store.clients("ef_residual") == [7]  # a row only for the client that took part


def test_error_feedback_resumes_bit_for_bit(tmp_path):
    codec = Codec("int4", block=32)
    xs = updates(6, 200, seed=11)

    full = ClientStateStore()
    ef = ErrorFeedback(codec, full, 200)
    sent = [ef.encode(i % 3, xs[i]) for i in range(6)]
    part = ClientStateStore(spill_dir=tmp_path / "b")
    ef2 = ErrorFeedback(codec, part, 200)
    for i in range(3):
        ef2.encode(i % 3, xs[i])
    saved = part.state_dict()
    torch.save(saved, tmp_path / "ckpt.pt")
    resumed = ClientStateStore()
    ef3 = ErrorFeedback(codec, resumed, 200)
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True))
    again = [ef3.encode(i % 3, xs[i]) for i in range(3, 6)]
    for a, b in zip(sent[3:], again):
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    for c in range(3):
        assert torch.equal(ef.residual(c), ef3.residual(c))


def test_codec_object_round_trip_with_rotation():
    codec = parse_codec("int8", block=64, rotation=128)
    xs = updates(3, 300)
    key = 4
    replies = [codec.encode(x, key, i) for i, x in enumerate(xs)]
    assert all(codec.check(r, 300) is None for r in replies)
    out, st = codec.aggregate(replies, [1.0, 1.0, 1.0], 300, key, backend="cpu")
    assert out.shape == (300,)
    assert torch.allclose(out, sum(xs), atol=0.1)
    assert codec.bytes_per_reply(300) == replies[0].nbytes()
    t = parse_codec("topk:0.1")
    assert t.bytes_per_reply(300) == t.encode(xs[0]).nbytes()
    with pytest.raises(ValueError, match="topk:FRACTION"):
        parse_codec("topk:x")


@pytest.mark.parametrize("op", ["block", "topk"])
def test_custom_ops_compile_as_one_node_and_equal_eager(op):
    """torch.compile(fullgraph=True) traces each backend op of the decode-aggregate as
    one routed op, fedopt_C::routed_<op> (the fake kernels give its shapes), and gives eager's bits."""
    from torch._dynamo.testing import CompileCounterWithBackend

    replies = _replies("int4" if op == "block" else "topk", 3, 777)
    w = torch.tensor([0.2, 0.3, 0.5])
    if op == "block":
        a, b = [r.codes for r in replies], [r.scales for r in replies]

        def fn(w, out):
            return torch.ops.fedopt_C.routed_block_decode_aggregate(a, b, 1, 64, 777, w, 1.0, None, out, None,
                                                                    backend="cpu")
    else:
        a, b = [r.codes for r in replies], [r.indices for r in replies]

        def fn(w, out):
            return torch.ops.fedopt_C.routed_topk_decode_aggregate(a, b, 777, w, 1.0, None, out, None, backend="cpu")

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    out_c, out_e = torch.empty(777), torch.empty(777)
    q_c, Q_c = compiled(w, out_c)
    q_e, Q_e = fn(w, out_e)
    assert counter.frame_count == 1
    assert torch.equal(out_c, out_e) and torch.equal(q_c, q_e) and torch.equal(Q_c, Q_e)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the Triton interpreter's NumPy: the Inf is the point
def test_a_reply_that_decodes_to_inf_is_excluded_on_every_backend(backend):
    """A finite but huge scale passes the validator and decodes to Inf (3e38 * 127): the
    client's decoded norm is Inf, so it is left out and the others keep the total weight."""
    name, _ = backend
    replies = _replies("int8", 3, 300)
    s = replies[1].scales.clone()
    s[0] = 3e38
    bad = _bad(replies[1], scales=s)
    assert C.check_reply(bad, 300) is None
    out, st = C.decode_aggregate([replies[0], bad, replies[2]], [1.0, 1.0, 2.0], backend=name)
    assert st.excluded.tolist() == [False, True, False]
    d0, d2 = (C.decode(r).to(torch.float64) for r in (replies[0], replies[2]))
    expect = (d0 + 2 * d2) * (4 / 3)
    assert bool(torch.isfinite(out).all())
    assert torch.allclose(out.cpu().to(torch.float64), expect, rtol=1e-5, atol=1e-5)


def test_an_fp8_nan_code_is_left_out_by_the_exclusion(backend):
    name, _ = backend
    replies = _replies("fp8", 3, 200)
    codes = replies[2].codes.clone()
    codes.view(torch.uint8)[7] = 0x7F  # e4m3fn NaN
    bad = _bad(replies[2], codes=codes)
    out, st = C.decode_aggregate([replies[0], replies[1], bad], [1.0, 1.0, 1.0], backend=name)
    assert st.excluded.tolist() == [False, False, True]
    expect = (C.decode(replies[0]) + C.decode(replies[1])).to(torch.float64) * 1.5
    assert torch.allclose(out.cpu().to(torch.float64), expect, rtol=1e-5, atol=1e-5)


def test_checked_skips_the_value_checks_but_never_writes_outside_out(backend):
    """With checked=True (the round ran check_reply already) an index out of range is not
    looked for by the ops layer; nothing is written outside out: the CPU op and python_ref
    refuse it, the GPU kernels leave it out."""
    name, _ = backend
    t = C.encode(updates(1, 100)[0], "topk", k=5)
    ix = t.indices.clone()
    ix[-1] = 1000
    bad = _bad(t, indices=ix)
    with pytest.raises(ValueError, match="out of range"):
        C.decode_aggregate([bad], [1.0], backend=name)
    if name in ("cpu", "reference"):
        with pytest.raises((RuntimeError, IndexError)):
            C.decode_aggregate([bad], [1.0], backend=name, checked=True)
    else:
        out, _ = C.decode_aggregate([bad], [1.0], backend=name, checked=True, nonfinite="propagate")
        expect = torch.zeros(100)
        expect[t.indices[:-1]] = t.codes[:-1]
        assert torch.equal(out.cpu(), expect)


def test_bench_rows_report_bytes_and_ratios_from_the_same_run():
    from fedopt_kernels.benchmarks.compressed import FLOOR, FLOOR_HUGE, bench_compressed

    rows = {r["case"]: r for r in bench_compressed(3, 1000, label="tiny", repeats=1)}
    assert rows[FLOOR]["vs floor"] == 1.0 and rows[FLOOR]["bytes/reply"] == 4000
    # int8: 1000 codes + 4 scales of 4 bytes; int4: 500 + 16; top-k 1%: 10 x (4 + 8)
    assert rows["fused int8"]["bytes/reply"] == 1016 and rows["fused int4"]["bytes/reply"] == 516
    assert rows["fused topk 1%"]["bytes/reply"] == 120
    assert "fused topk 1%, replies one by one" not in rows  # top-k's replies stay out of the arena
    for name in ("int8", "int4", "fp8", "topk 1%"):
        block = name != "topk 1%"
        if block:
            assert rows[f"fused {name}, replies one by one"]["bytes/reply"] == rows[f"fused {name}"]["bytes/reply"]
        assert rows[f"encode {name}"]["GB/s"] == pytest.approx(
            3 * (4000 + rows[f"fused {name}"]["bytes/reply"]) / (rows[f"encode {name}"]["ms"] / 1e3) / 1e9)
        for case in (f"fused {name}", f"encode {name}", f"decode then aggregate {name}", f"check_reply {name}",
                     *([f"fused {name}, replies one by one"] if block else [])):
            r = rows[case]
            assert r["vs floor"] == pytest.approx(rows[FLOOR]["ms"] / r["ms"])
            assert r["vs floor, 2 MiB pages"] == pytest.approx(rows[FLOOR_HUGE]["ms"] / r["ms"])
            assert r["params/s"] == pytest.approx(3 * 1000 / (r["ms"] / 1e3))
    # GB/s: every reply read once and out's 4000 bytes written once, over the time; only
    # the floor and the fused rows (the others move what eager torch allocates)
    assert rows[FLOOR]["GB/s"] == pytest.approx((3 * 4000 + 4000) / (rows[FLOOR]["ms"] / 1e3) / 1e9)
    assert rows[FLOOR_HUGE]["GB/s"] == pytest.approx((3 * 4000 + 4000) / (rows[FLOOR_HUGE]["ms"] / 1e3) / 1e9)
    assert rows["fused int4"]["GB/s"] == pytest.approx((3 * 516 + 4000) / (rows["fused int4"]["ms"] / 1e3) / 1e9)
    assert all(math.isnan(rows[f"{c} int8"]["GB/s"]) for c in ("check_reply", "decode then aggregate"))


def test_the_cuda_extension_registers_the_compressed_kernels():
    """Where torch has CUDA the extension is built (CI), and it registers the CUDA kernels of the decode-aggregates and the encodes
    (no GPU needed to check the registration; running them needs one)."""
    if torch.version.cuda is None:
        pytest.skip(f"torch {torch.__version__} is a CPU-only build, so the CUDA extension is not built")
    import fedopt_kernels._C  # noqa: F401  (the schemas)
    import fedopt_kernels._C_cuda  # noqa: F401

    for op in ("block_decode_aggregate", "topk_decode_aggregate", "block_quantize", "block_quantize_into",
               "topk_encode"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fedopt_C::{op}", "CUDA"), op
