"""Compile ONE Triton kernel variant ahead of time for the harness (tools/gpu_harness's
triton family) and print its PTX and launch metadata as JSON.

Run in a subprocess with TRITON_INTERPRET unset (the test suite sets it, and under the
interpreter ``triton.jit`` gives an interpreted function that cannot be compiled):
``python tests/_triton_aot_case.py < spec.json``.  The spec: ``module`` and ``kernel``
(the jitted function), ``types`` (the non-constexpr arguments' Triton types, as
tests/_aot_compile.py writes them), ``constexprs`` (values; a Triton dtype as its name,
e.g. ``"fp32"``), ``aligned`` (pointer arguments the JIT would mark 16-byte divisible),
``warps``, ``options`` and ``arch`` (80, 90).  The output: ``ptx``, ``name``, ``shared``
(bytes), ``num_warps`` and ``params`` (the PTX entry's parameter types, in order: the
kernel's arguments, then the scratch pointers Triton appends).
"""

from __future__ import annotations

import importlib
import json
import re
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TL = {"fp16": tl.float16, "bf16": tl.bfloat16, "fp32": tl.float32, "fp64": tl.float64}


def entry_params(ptx: str, name: str) -> list[str]:
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    return re.findall(r"\.param\s+\.(\w+)", m.group(1)) if m else []


def main():
    spec = json.load(sys.stdin)
    fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    cx = {k: TL.get(v, v) if isinstance(v, str) else v for k, v in spec["constexprs"].items()}
    sig = {n: "constexpr" if n in cx else spec["types"][n] for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in spec.get("aligned", [])}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs),
                       target=GPUTarget("cuda", int(spec["arch"]), 32),
                       options=dict(spec.get("options", {}), num_warps=spec["warps"]))
    ptx = k.asm["ptx"]
    name = k.metadata.name
    json.dump(dict(ptx=ptx, name=name, shared=int(k.metadata.shared), num_warps=int(k.metadata.num_warps),
                   params=entry_params(ptx, name), args=[n for n in fn.arg_names if n not in cx],
                   triton=triton.__version__), sys.stdout)


if __name__ == "__main__":
    main()
