"""The C++ CPU decode-aggregate (``fedopt_C::block_decode_aggregate``) where the contract
suite's sizes do not reach: a whole chunk of columns and a partial one, a block (96) that the register
tile (16 / 32 / 64 columns) straddles and one (256) that holds whole tiles (one scale per tile),
a ragged end, a client of weight 0, every int4 and fp8 code, an output above the size from
which it is written with streaming stores (aligned, and 4 bytes off) -- against
independent oracles, and BIT FOR BIT the same under every instruction set it is built
for (DEFAULT, AVX2, AVX-512: one subprocess per ``ATEN_CPU_CAPABILITY``,
tests/_cpu_isa.py).

Oracles: ``out`` is python_ref's aggregate over the decoded rows (the reference backend),
bit for bit; the statistics are the kernel's documented order written here in numpy
float32: per chunk of ``block * (65536 // block)`` columns, value t of the chunk into lane
t mod 16 (a sequential add: ``np.add.accumulate``), the 16 lanes added in the fixed tree,
the chunks' partials added in order.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _cpu_isa import LEVELS, assert_level_agrees_with_default
from fedopt_kernels import ops
from fedopt_kernels.ops import compressed as C

DTYPES = [torch.float32]
CODECS = ("int8", "int4", "fp8")
N, BLOCK = 65472 + 16 * 40 + 7, 96  # a whole chunk of 65472 columns, then 647: 40 vectors and 7
W = [0.5, 0.0, 0.25, 1.0]

pytestmark = pytest.mark.usefixtures("cpu_extension")


def _replies(codec, block=BLOCK):
    g = torch.Generator().manual_seed(7)
    # exact in fp32 (torch.randn's bits differ between instruction sets)
    xs = torch.randint(-(2 ** 22), 2 ** 22, (len(W), N), generator=g).float() / 2 ** 21
    xs[2, 1056:1152] = 0.0  # a block of zeros (of 96; half of one of 256): scale 0
    return [C.encode(xs[i], codec, block=block, key=5, client=i) for i in range(len(W))]


def _every_fp8_code():
    """All 256 e4m3fn codes (zeros, subnormals, normals, both NaNs) in two blocks of 256,
    scales 1 and 2^-3: the AVX2 / AVX-512 loops decode fp8 from its bits, not the table."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(2).view(torch.float8_e4m3fn)
    return C.CompressedUpdate("fp8", 512, codes, scales=torch.tensor([1.0, 0.125]), block=256)


def _fp8_out_bits(backend):
    out, _ = C.decode_aggregate([_every_fp8_code()], torch.tensor([1.0]), gamma=1.0,
                                nonfinite="propagate", backend=backend)
    return out.view(torch.int32)


def _every_int4_code():
    """Every byte (so every pair of 4-bit codes, -8 included, which the encoder never
    writes) twice, in four blocks of 128 with scales 1, 2^-3, 0.3 (inexact products) and a
    subnormal one: the AVX-512 loop decodes int4 through a table of s * q per block."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(2)
    scales = torch.tensor([1.0, 0.125, 0.3, 1e-40])
    return C.CompressedUpdate("int4", 1024, codes, scales=scales, block=256)


def _int4_out_bits(backend):
    out, st = C.decode_aggregate([_every_int4_code()], torch.tensor([1.0]), gamma=1.0,
                                 nonfinite="propagate", backend=backend)
    return out.view(torch.int32), st.client_sq_norms


# From 2^22 values on, the kernel writes int8's and fp8's out with streaming stores when out
# is 64-byte aligned (compressed_kernels.h, stream_note): the same values, whichever store.
N_STREAM = (1 << 22) + 64 * 3 + 16 + 5  # whole chunks, then tiles, a vector and a ragged end


def _streamed(codec, offset=0):
    """out of 2 replies of N_STREAM values, written into a buffer at ``offset`` floats
    (0: aligned as torch allocates; 1: 4 bytes off, the plain stores)."""
    g = torch.Generator().manual_seed(11)
    xs = torch.randint(-(2 ** 22), 2 ** 22, (2, N_STREAM), generator=g).float() / 2 ** 21
    replies = [C.encode(xs[i], codec, block=256, key=5, client=i) for i in range(2)]
    out = torch.full((N_STREAM + offset,), float("nan"))[offset:]
    res, st = C.decode_aggregate(replies, torch.tensor([0.75, 0.5]), gamma=0.5, out=out,
                                 nonfinite="propagate", backend="cpu")
    assert res.data_ptr() == out.data_ptr()
    return replies, res, st


def cases(dtype):
    """Every codec's (out, client_sq_norms, sq_norm) on the CPU backend, and the bits of
    every fp8 code decoded."""
    res = [_fp8_out_bits("cpu"), *_int4_out_bits("cpu"), _streamed("int8")[1]]
    for codec in CODECS:
        for block in (BLOCK, 256):
            out, st = C.decode_aggregate(_replies(codec, block), torch.tensor(W, dtype=dtype), gamma=0.5,
                                         nonfinite="propagate", backend="cpu")
            res += [out, st.client_sq_norms, st.sq_norm]
    return res


def _lane_sum(v: np.ndarray) -> np.float32:
    """The kernel's sum of squares of one chunk: lanes t mod 16, then the fixed tree."""
    pad = np.zeros(-len(v) % 16, np.float32)
    sq = np.concatenate([v * v, pad]).reshape(-1, 16)
    lanes = np.add.accumulate(sq, axis=0, dtype=np.float32)[-1]
    h = 8
    while h >= 1:
        lanes = lanes[:h] + lanes[h:2 * h]
        h //= 2
    return lanes[0]


def _chunked(v: np.ndarray, block: int) -> np.float32:
    cols = block * (65536 // block)
    total = np.float32(0)
    for j0 in range(0, len(v), cols):
        total = np.float32(total + _lane_sum(v[j0:j0 + cols]))
    return total


@pytest.mark.parametrize("block", [BLOCK, 256])
@pytest.mark.parametrize("codec", CODECS)
def test_chunks_against_the_dense_aggregate_and_the_lane_order(codec, block):
    replies = _replies(codec, block)
    w = torch.tensor(W)
    out, st = C.decode_aggregate(replies, w, gamma=0.5, nonfinite="propagate", backend="cpu")
    rows = torch.stack([C.decode(r) for r in replies])
    dense, _ = ops.aggregate(rows, w, gamma=0.5, nonfinite="propagate", backend="reference")
    assert torch.equal(out, dense)
    acc = np.zeros(N, np.float32)
    for wi, row in zip(W, rows.numpy()):
        if wi != 0.0:
            acc = acc + np.float32(wi) * row
    expect_q = [_chunked(row, block) for row in rows.numpy()]
    assert st.client_sq_norms.tolist() == [float(q) for q in expect_q]
    assert float(st.sq_norm) == float(_chunked(acc, block))
    assert np.array_equal(out.numpy(), np.float32(0.5) * acc)


def test_every_fp8_code_decodes_to_python_ref_s_bits():
    got = _fp8_out_bits("cpu")
    assert torch.equal(got, _fp8_out_bits("reference"))
    # and to the codes' own float values (c10's conversion), NaN for 0x7F / 0xFF; a sum that
    # starts at 0 turns the code -0.0 into +0.0
    codes = _every_fp8_code().codes
    expect = torch.cat([codes[:256].float(), codes[256:].float() * 0.125]) + 0.0
    assert torch.equal(got, expect.view(torch.int32))


def test_every_int4_code_decodes_to_python_ref_s_bits():
    got, q = _int4_out_bits("cpu")
    ref, _ = _int4_out_bits("reference")
    assert torch.equal(got, ref)
    # and to the definition: byte m holds code 2m in its low nibble, 2m + 1 in its high one,
    # each a signed 4-bit integer, times its block's scale (a sum from 0 makes -0.0 +0.0)
    b = torch.arange(256).repeat(2)
    q4 = torch.stack([b & 15, b >> 4], dim=1).reshape(-1)
    q4 = torch.where(q4 >= 8, q4 - 16, q4).float()
    expect = q4 * _every_int4_code().scales.repeat_interleave(256) + 0.0
    assert torch.equal(got, expect.view(torch.int32))
    assert q.tolist() == [float(_chunked(expect.numpy(), 256))]


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("codec", ["int8", "fp8", "int4"])  # int4: plain stores at any size
def test_streamed_out_is_the_dense_aggregate(codec, offset):
    replies, out, st = _streamed(codec, offset)
    rows = torch.stack([C.decode(r) for r in replies])
    dense, _ = ops.aggregate(rows, torch.tensor([0.75, 0.5]), gamma=0.5, nonfinite="propagate", backend="reference")
    assert torch.equal(out, dense)
    assert st.client_sq_norms.tolist() == [float(_chunked(row, 256)) for row in rows.numpy()]


@pytest.mark.parametrize("level", [lv for lv in LEVELS if lv != "default"])
def test_every_instruction_set_gives_default_s_bits(level):
    assert_level_agrees_with_default("test_compressed_cpu_isa", "cases", level)
