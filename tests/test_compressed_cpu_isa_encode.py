"""The C++ CPU encodes (``fedopt_C::block_quantize``: fp8, kind 2, csrc/cpu/compressed_encode.cpp;
int8 and int4, round to nearest and stochastic, csrc/cpu/compressed_kernels.h) BIT FOR
BIT the same under every instruction set they are built for (DEFAULT, AVX2, AVX-512: one
subprocess per ``ATEN_CPU_CAPABILITY``, tests/_cpu_isa.py), and equal to python_ref's
fp8_encode / quantize in each (``cases`` asserts it in the subprocess): blocks of 32, 96
and 256 against the 16-lane loops (whole vectors, a ragged tail, a tail block), every
e4m3fn code, zeros, subnormals, Inf and NaN (tests/test_compressed_encode.py's inputs;
a block holding a NaN takes int8/int4's scalar loop, the others the vectorised one)."""

from __future__ import annotations

import pytest
import torch

from _cpu_isa import LEVELS, assert_level_agrees_with_default
from fedopt_kernels.ops import compressed as C
from python_ref import compression as P
from test_compressed_encode import edge_input, every_code_input

DTYPES = [torch.float32, torch.bfloat16]

pytestmark = pytest.mark.usefixtures("cpu_extension")


def _exactly(x, dtype):
    """``x`` (fp32 values exact in ``dtype``) in ``dtype``; bf16 by its top 16 bits, since
    torch's conversion gives a NaN's sign differently under different instruction sets."""
    if dtype == torch.bfloat16:
        return (x.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    return x.to(dtype)


def _inputs(dtype):
    yield edge_input(1000 + 7, dtype), 96
    yield edge_input(263, dtype), 32
    yield _exactly(every_code_input(), dtype), 256
    g = torch.Generator().manual_seed(3)
    # exact in fp32 (torch.randn's bits differ between instruction sets)
    yield (torch.randint(-(2 ** 22), 2 ** 22, (65536 + 13,), generator=g).float() / 2 ** 21).to(dtype), 256


def cases(dtype):
    """The CPU kernel's codes and scales (their bits), each checked against python_ref here."""
    res = []
    for x, block in _inputs(dtype):
        r = C.encode(x, "fp8", block=block, backend="cpu")
        codes, scales = P.fp8_encode(x, block)
        assert torch.equal(r.codes.view(torch.uint8), codes.view(torch.uint8)), (dtype, block)
        assert torch.equal(r.scales.view(torch.int32), scales.view(torch.int32)), (dtype, block)
        res += [r.codes.view(torch.uint8), r.scales.view(torch.int32)]
    return res


def block_cases(dtype):
    """int8 and int4, round to nearest and stochastic: the CPU kernel's codes and scales
    (their bits), each checked against python_ref here (a NaN scale: any NaN)."""
    res = []
    for x, block in _inputs(dtype):
        for codec in ("int8", "int4"):
            for stochastic in (False, True):
                r = C.encode(x, codec, block=block, stochastic=stochastic, key=9, client=4, backend="cpu")
                codes, scales = P.quantize(x.float(), codec, block, stochastic=stochastic, key=9, client=4)
                what = (dtype, block, codec, stochastic)
                assert torch.equal(r.codes.view(torch.uint8), codes.view(torch.uint8)), what
                nan = torch.isnan(scales)
                assert torch.equal(torch.isnan(r.scales), nan), what
                assert torch.equal(r.scales[~nan].view(torch.int32), scales[~nan].view(torch.int32)), what
                res += [r.codes.view(torch.uint8), r.scales.view(torch.int32)]
    return res


def test_default_level_and_this_one_give_python_refs_bits():
    for dtype in DTYPES:
        assert len(cases(dtype)) == 8
        assert len(block_cases(dtype)) == 32


@pytest.mark.parametrize("level", [lv for lv in LEVELS if lv != "default"])
def test_every_instruction_set_gives_default_s_bits(level):
    assert_level_agrees_with_default("test_compressed_cpu_isa_encode", "cases", level)
    assert_level_agrees_with_default("test_compressed_cpu_isa_encode", "block_cases", level)
