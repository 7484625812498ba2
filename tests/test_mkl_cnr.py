"""MKL's strict reproducibility mode (fedopt_kernels/backends/mkl.py): set at import,
left alone where the user chose, refused loudly where it is too late."""

import hashlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fedopt_kernels.backends import mkl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_mkl = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch was built without MKL")


def _skinny_products_at_every_offset():
    """Distinct bit patterns of a few skinny and wide products (MKL kernels whose bits follow
    alignment when CNR is off: 219 of 512 shapes on an AMD EPYC) with both operands and
    the result moved through every offset of a 64-byte line: one pattern each when strict."""
    patterns = []
    for m, n, k in [(1, 64, 200), (3, 200, 64), (2, 9, 300), (13, 5, 77), (17, 9, 200), (17, 64, 200)]:
        g = torch.Generator().manual_seed(m * n + k)
        a0, b0 = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        seen = set()
        for off in range(16):
            a = torch.zeros(m * k + 16)[off:off + m * k].view(m, k).copy_(a0)
            bt = torch.zeros(k * n + 16)[(off * 7) % 16:(off * 7) % 16 + k * n].view(n, k).copy_(b0.t())
            out = torch.zeros(m * n + 16)[(off * 3) % 16:(off * 3) % 16 + m * n].view(m, n)
            torch.mm(a, bt.t(), out=out)
            seen.add(hashlib.sha256(out.numpy().tobytes()).hexdigest())
            torch.testing.assert_close(out.double(), a0.double() @ b0.double(), rtol=1e-5, atol=1e-5 * k)
        patterns.append(len(seen))
    return patterns


@needs_mkl
def test_strict_mode_gives_one_bit_pattern_wherever_the_operands_lie():
    st = mkl.status()
    assert st["mode"] == "AUTO,STRICT" and st["strict"] and st["set_by"] == "fedopt_kernels", st
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # strict CNR holds for a fixed number of threads
    try:
        assert _skinny_products_at_every_offset() == [1] * 6
    finally:
        torch.set_num_threads(threads)


def _child(code: str, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", mkl.ENV_VAR)}
    e.update(env, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e, capture_output=True, text=True,
                          timeout=300)


_STATUS = """
    import warnings
    warnings.simplefilter("always")
    {before}
    import fedopt_kernels
    from fedopt_kernels.backends import mkl
    st = mkl.status()
    print(st["mode"], "|", st["set_by"], "|", st["error"])
"""


@needs_mkl
def test_the_users_choice_and_a_late_import():
    """MKL_CBWR set by the user wins (COMPATIBLE stays COMPATIBLE); FEDOPT_MKL_STRICT=0 leaves
    MKL's default (CNR off); MKL used before the import: the mode cannot change, and a
    RuntimeWarning says so and what to do."""
    user = _child(_STATUS.format(before=""), MKL_CBWR="COMPATIBLE")
    assert user.returncode == 0, user.stderr
    assert user.stdout.split(" | ")[:2] == ["COMPATIBLE", "MKL_CBWR=COMPATIBLE (set by the user)"]
    off = _child(_STATUS.format(before=""), FEDOPT_MKL_STRICT="0")
    assert off.returncode == 0, off.stderr
    assert off.stdout.startswith("OFF | FEDOPT_MKL_STRICT=0"), off.stdout
    late = _child(_STATUS.format(before="import torch; torch.randn(3, 4) @ torch.randn(4, 5)"))
    assert late.returncode == 0, late.stderr
    assert late.stdout.startswith("OFF | None | MKL had already run"), late.stdout
    assert "RuntimeWarning" in late.stderr and "MKL_CBWR=AUTO,STRICT" in late.stderr, late.stderr
    default = _child(_STATUS.format(before="import torch; torch.set_num_threads(1)"))
    assert default.stdout.startswith("AUTO,STRICT | fedopt_kernels | None"), (default.stdout, default.stderr)


def test_mode_names_follow_mkl_cbwr_h():
    assert mkl.mode_name(0x10002) == "AUTO,STRICT"
    assert mkl.mode_name(1) == "OFF"
    assert mkl.mode_name(mkl.AVX512_E1) == "AVX512_E1"
    assert mkl.mode_name(mkl.COMPATIBLE | mkl.STRICT) == "COMPATIBLE,STRICT"


@needs_mkl
def test_fedopt_info_reports_the_mode():
    from fedopt_kernels.cli import info

    st = info.environment()["mkl_cnr"]
    assert st["mode"] == "AUTO,STRICT" and st["set_by"] == "fedopt_kernels"
    assert info.mkl_text(st).startswith("MKL_CBWR AUTO,STRICT, by fedopt_kernels")
    assert info.mkl_text({"mode": None, "error": "torch was built without MKL"}) == \
        "no MKL (torch was built without MKL)"
