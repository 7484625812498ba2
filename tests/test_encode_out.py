"""A block codec's encode into given buffers (ops.compressed.encode's ``out=``, the
kernels' ``block_quantize_into``): the plain encode's bits on every backend (odd sizes,
empty, fp32/fp16/bf16, stochastic rounding), the reply holding the buffers; bad buffers
refused by name before anything is written, in Python and in the C++ op; refused for
top-k."""

from __future__ import annotations

import pytest
import torch

from fedopt_kernels.compression.reply_arena import ReplyArena
from fedopt_kernels.ops import compressed as C
from _asserts import bits

N_CASES = [0, 1, 31, 1001, 4099]


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def _outputs(arena, codec, n, block):
    return tuple(arena.take(count, dtype) for dtype, count in C.block_reply_layout(codec, n, block))


@pytest.mark.parametrize("codec,block,stochastic", [("int8", 64, False), ("int8", 256, True), ("int4", 96, False),
                                                    ("int4", 128, True), ("fp8", 32, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_encode_into_the_arena_has_the_plain_encodes_bits(backend, codec, block, stochastic, dtype):
    backend, device = backend
    g = torch.Generator().manual_seed(5)
    for n in N_CASES:
        x = (torch.randn(n, generator=g) * 3).to(dtype)
        if n > 40:
            x[7], x[8], x[33] = 0.0, -0.0, 1e-30  # a zero and a subnormal-sized value inside blocks
        x = x.to(device)
        want = C.encode(x, codec, block=block, stochastic=stochastic, key=11, client=3, backend=backend)
        if device.type == "cpu":
            arena = ReplyArena()
            arena.start_round()
            out = _outputs(arena, codec, n, block)
        else:
            out = tuple(torch.empty(count, dtype=dtype, device=device)
                        for dtype, count in C.block_reply_layout(codec, n, block))
        got = C.encode(x, codec, block=block, stochastic=stochastic, key=11, client=3, backend=backend, out=out)
        assert got.codes is out[0] and got.scales is out[1]
        assert same(got.codes, want.codes) and same(got.scales, want.scales), (codec, n)
        assert (got.codec, got.numel, got.block) == (want.codec, want.numel, want.block)


def _bad_outputs(n=100, block=32):
    good_codes, good_scales = torch.zeros(n, dtype=torch.int8), torch.zeros(4)
    yield "codes", (good_codes.to(torch.uint8), good_scales)  # int4's dtype for an int8 reply
    yield "codes", (torch.zeros(n - 1, dtype=torch.int8), good_scales)
    yield "codes", (torch.zeros(2 * n, dtype=torch.int8)[::2], good_scales)  # not contiguous
    yield "codes", (torch.zeros(n, dtype=torch.int8, device="meta"), good_scales)
    yield "scales", (good_codes, torch.zeros(4, dtype=torch.float64))
    yield "scales", (good_codes, torch.zeros(3))
    yield "scales", (good_codes, torch.zeros(1, 4))


@pytest.mark.parametrize("case", list(range(7)))
def test_bad_outputs_are_refused_by_name_and_nothing_is_written(case):
    name, out = list(_bad_outputs())[case]
    before = [t.clone() if t.device.type != "meta" else None for t in out]
    with pytest.raises(ValueError, match=f"out's {name} must be a contiguous 1-D"):
        C.encode(torch.randn(100), "int8", block=32, out=out)
    for t, b in zip(out, before):
        if b is not None:
            assert torch.equal(t, b)


def test_out_is_refused_for_top_k_and_for_a_bad_pair():
    with pytest.raises(ValueError, match="out is for the block codecs"):
        C.encode(torch.randn(10), "topk", k=2, out=(torch.zeros(2), torch.zeros(2, dtype=torch.int64)))
    with pytest.raises(ValueError, match=r"out must be a \(codes, scales\) pair"):
        C.encode(torch.randn(10), "int8", block=32, out=torch.zeros(10, dtype=torch.int8))


def test_the_cpu_op_checks_its_outputs_before_writing():
    from conftest import require_backend

    require_backend("cpu")  # loads the extension (fails where it must exist and does not)
    codes, scales = torch.full((99,), 5, dtype=torch.int8), torch.full((4,), 2.0)
    with pytest.raises(RuntimeError, match="fedopt_C::block_quantize_into: codes must be a contiguous 1-D"):
        torch.ops.fedopt_C.block_quantize_into(torch.randn(100), 0, 32, False, 0, 0, codes, scales)
    with pytest.raises(RuntimeError, match="fedopt_C::block_quantize_into: scales must be a contiguous 1-D"):
        torch.ops.fedopt_C.block_quantize_into(torch.randn(128), 0, 32, False, 0, 0,
                                               torch.zeros(128, dtype=torch.int8), scales[:3])
    assert torch.equal(codes, torch.full((99,), 5, dtype=torch.int8)) and torch.equal(scales, torch.full((4,), 2.0))
