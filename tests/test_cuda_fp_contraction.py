"""The CUDA kernels' floating-point operations, read from their PTX: no GPU needed.

Issue 47: nvcc contracts ``a * b + c`` into an FMA by default (``-fmad=true``), and it
chooses per inlined copy.  In ``nar_update_kernel`` it fused FedNAR's
``scale * g + wd * x`` (grad / none modes) as ``fma(scale, g, rn(wd * x))`` in the
16-byte body and as ``fma(wd, x, rn(scale * g))`` in the scalar body, so a row's bits
depended on its alignment -- invisible without a GPU, since every CUDA case skips here.

This file compiles ``csrc/cuda/nar_step.cu`` and ``csrc/cuda/server_update.cu`` (the
kernels whose chunks run a 16-byte or a scalar body, with their math in
``fedopt/math.h``) to PTX for sm_90, with the extension's own nvcc flags plus
``-lineinfo``, and checks every kernel of them:

1. Nothing is left for ptxas to contract.  PTX ISA, ``mul`` / ``add``: only
   instructions *without* a rounding modifier may be fused by the code generator; so no
   f32 / f64 ``mul`` may lack one (an ``add`` cannot fuse without a ``mul``).
2. Every ``fma`` in the PTX is one the source asked for: the source line its ``.loc``
   names calls ``fma`` (``rn::fma``, ``__fmaf_rn``, ``__fma_rn``).  An FMA that nvcc
   contracted on its own points at a line with a ``*`` and a ``+`` instead.
3. The vector and the scalar bodies do the same floating-point operations.  The loops
   of a kernel (natural loops of its control-flow graph) are split into vector loops
   (a 16-byte global load or store) and scalar loops (element loads, at least one
   multiply); each FP instruction is summarised as its opcode and, per operand, where
   the value comes from (a load, a loop-invariant value, an immediate, or the opcodes
   that define it in the loop).  Both kinds of loop must give the same set of
   summaries.  With the issue's bug the vector loop has ``fma(U, mul, mul)`` and the
   scalar loop ``fma(L, U, mul)``.

All three checks fail on the code before the fix, and on today's math.h with only the
grad/none direction written as ``scale * g + p.weight_decay * x`` again (both tried);
they pass on the explicit one.

The checks read PTX, not SASS: with 1 and 2 holding, ptxas has no contraction left to
choose (PTX ISA: ``.rn`` arithmetic and ``fma.rn`` are kept as written), so what the
two bodies compute is settled in the PTX.  SASS would need cuobjdump or nvdisasm, which
the CUDA 13.0 toolkit of this project's machines does not include; the built extension
is not needed either (the source is compiled again).  Skips when no CUDA toolkit
(nvcc) is found.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import shutil
import subprocess

import pytest
import torch
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("nar_step", "server_update")
FP_ARITH = re.compile(r"^(add|sub|mul|fma|div|sqrt|neg|abs|min|max|rcp|rsqrt)(\.[a-z0-9]+)*\.f(32|64)$")
COMMUTATIVE = ("add", "mul", "fma", "min", "max")


def _find_nvcc() -> str | None:
    """The nvcc of the toolkit setup.py would build with (CUDA_HOME, CUDA_PATH, PATH,
    /usr/local/cuda, /usr/local/cuda-*)."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    on_path = shutil.which("nvcc")
    if on_path:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(on_path))))
    roots += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for root in roots:
        if root and os.path.isfile(os.path.join(root, "bin", "nvcc")) and os.path.isfile(
                os.path.join(root, "include", "cuda_runtime.h")):
            return os.path.join(root, "bin", "nvcc")
    return None


NVCC = _find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="no CUDA toolkit (nvcc) found: set CUDA_HOME to check the "
                                "CUDA kernels' PTX")


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    """{source name: PTX text}, compiled concurrently."""
    out = tmp_path_factory.mktemp("ptx")
    cuda_root = os.path.dirname(os.path.dirname(NVCC))
    includes = [os.path.join(ROOT, "csrc", "include"), *cpp_extension.include_paths(),
                os.path.join(cuda_root, "include")]
    flags = ["-ptx", "-lineinfo", "-arch=sm_90", "-O3", "-std=c++20", *cpp_extension.COMMON_NVCC_FLAGS,
             "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C_cuda",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *(f"-I{i}" for i in includes)]
    procs = {name: subprocess.Popen([NVCC, *flags, os.path.join(ROOT, "csrc", "cuda", f"{name}.cu"), "-o",
                                     str(out / f"{name}.ptx")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
             for name in SOURCES}
    texts = {}
    for name, proc in procs.items():
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"nvcc -ptx {name}.cu failed:\n{log[-4000:]}"
        texts[name] = (out / f"{name}.ptx").read_text()
    return texts


# ----------------------------------------------------------------------------- PTX reading

Instr = collections.namedtuple("Instr", "op dests srcs guarded loc")


def _split_operands(text):
    """Top-level comma split: braces ({a, b}) and brackets ([addr]) stay whole."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return parts + ([cur.strip()] if cur.strip() else [])


def _regs(operand):
    return re.findall(r"%[a-z]+[0-9]*", operand)


def parse_kernels(text):
    """{kernel name: [(label, [Instr])]}: each .entry's basic blocks as laid out (a
    block starts at a label; a branch ends the block it is in)."""
    files = dict(re.findall(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', text, re.M))
    kernels = {}
    for m in re.finditer(r"^(?:\.visible\s+)?\.entry\s+([^\s(]+)\((.*?)^}", text, re.M | re.S):
        blocks, label, instrs, loc, n = [], "entry", [], None, 0
        for raw in m.group(2)[m.group(2).index("\n{"):].splitlines():
            line = raw.split("//")[0].strip()
            if not line or line in ("{", "}"):
                continue
            if line.startswith(".loc"):
                f, ln = line.split()[1:3]
                loc = (files.get(f), int(ln))
                continue
            if line.startswith("."):
                continue
            if line.endswith(":"):
                blocks.append((label, instrs))
                label, instrs = line[:-1], []
                continue
            guarded = line.startswith("@")
            line = re.sub(r"^@!?%p\d+\s+", "", line.rstrip(";"))
            op, _, rest = line.partition(" ")
            ops = _split_operands(rest.strip())
            if op.startswith(("st.", "bra", "red.", "atom.")):
                dests, srcs = [], ops
            else:
                dests, srcs = (_regs(ops[0]) if ops else []), ops[1:]
            instrs.append(Instr(op, dests, srcs, guarded, loc))
            if op.startswith("bra"):  # the rest is a new block (fall-through)
                blocks.append((label, instrs))
                n += 1
                label, instrs = f"fallthrough{n}", []
        blocks.append((label, instrs))
        kernels[m.group(1)] = [b for b in blocks if b[1] or not b[0].startswith("fallthrough")]
    return kernels


def loops_of(blocks):
    """Natural loops (back edge u -> h with h dominating u), one block set per header,
    innermost first."""
    index = {label: i for i, (label, _) in enumerate(blocks)}
    n = len(blocks)
    succ = []
    for i, (_, instrs) in enumerate(blocks):
        s, last = set(), (instrs[-1] if instrs else None)
        if last is not None and last.op.startswith("bra"):
            s.add(index[last.srcs[-1]])
        ends = last is not None and (last.op.startswith(("ret", "exit")) or (last.op.startswith("bra")
                                                                              and not last.guarded))
        if not ends and i + 1 < n:
            s.add(i + 1)
        succ.append(s)
    pred = [set() for _ in range(n)]
    for u, ss in enumerate(succ):
        for v in ss:
            pred[v].add(u)
    dom = [set(range(n)) for _ in range(n)]
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for v in range(1, n):
            ps = [dom[p] for p in pred[v]]
            new = (set.intersection(*ps) if ps else set()) | {v}
            if new != dom[v]:
                dom[v], changed = new, True
    bodies = collections.defaultdict(set)
    for u in range(n):
        for h in succ[u]:
            if h in dom[u]:
                body, stack = {h, u}, [u]
                while stack:
                    for p in pred[stack.pop()]:
                        if p not in body:
                            body.add(p)
                            stack.append(p)
                bodies[h] |= body
    return sorted(bodies.values(), key=len)


def _is_16_byte_access(op):
    m = re.match(r"^(ld|st)\.global.*\.v(\d)\.[a-z]+(\d+)$", op)
    return m is not None and int(m.group(2)) * int(m.group(3)) == 128


def fp_summaries(blocks):
    """(vector summaries, scalar summaries, number of vector loops, of scalar loops)."""
    loops = loops_of(blocks)
    innermost = {}
    for k, body in enumerate(loops):  # innermost first: the first loop a block is in
        for b in body:
            innermost.setdefault(b, k)
    vec, sca, nvec, nsca = set(), set(), 0, 0
    for k, body in enumerate(loops):
        own = [ins for b in sorted(body) if innermost[b] == k for ins in blocks[b][1]]
        defs = collections.defaultdict(list)
        for b in body:
            for ins in blocks[b][1]:
                for d in ins.dests:
                    defs[d].append(ins)

        def describe(operand, seen=()):
            if not operand.startswith("%"):
                return operand  # an immediate
            if operand in seen:
                return "cycle"
            if operand not in defs:
                return "U"  # defined outside the loop: loop-invariant
            kinds = set()
            for ins in defs[operand]:
                if FP_ARITH.match(ins.op):
                    kinds.add(ins.op)
                elif ins.op.startswith("mov") and len(ins.srcs) == 1 and re.fullmatch(r"%[a-z]+\d+", ins.srcs[0]):
                    kinds.add(describe(ins.srcs[0], seen + (operand,)))
                elif ins.op.startswith("selp"):
                    kinds.add("selp")
                else:
                    kinds.add("L")  # a load, or a conversion / unpacking of one
            return "|".join(sorted(kinds))

        fp = [ins for ins in own if FP_ARITH.match(ins.op)]
        is_vec = any(_is_16_byte_access(ins.op) for ins in own)
        is_data = any(ins.op.startswith("ld.global") for ins in own) and any(
            ins.op.split(".")[0] in ("mul", "fma", "div") for ins in fp)
        if not (is_vec or is_data):
            continue  # a loop of sums (combine of partials) or of addresses
        out = vec if is_vec else sca
        nvec, nsca = nvec + is_vec, nsca + (not is_vec)
        for ins in fp:
            args = [describe(o) for o in ins.srcs]
            base = ins.op.split(".")[0]
            if base in COMMUTATIVE:
                args[:2] = sorted(args[:2])
            out.add(f"{ins.op}({', '.join(args)})")
    return vec, sca, nvec, nsca


def _demangled(name):
    return subprocess.run(["c++filt", name], capture_output=True, text=True).stdout.strip() if shutil.which(
        "c++filt") else name


@pytest.fixture(scope="module")
def kernels(ptx):
    """{source name: parse_kernels(its PTX)}, parsed once."""
    return {name: parse_kernels(text) for name, text in ptx.items()}


# ----------------------------------------------------------------------------- checks

@pytest.mark.parametrize("source", SOURCES)
def test_no_contraction_is_left_to_ptxas(kernels, source):
    """No f32/f64 multiply without a rounding modifier: ptxas may fuse only those."""
    assert kernels[source], f"no kernel in the PTX of {source}.cu"
    bad = [(_demangled(k), ins.op, ins.loc) for k, blocks in kernels[source].items() for _, instrs in blocks
           for ins in instrs if re.fullmatch(r"mul\.f(32|64)", ins.op)]
    assert not bad, f"{len(bad)} contractible multiplies (use rn::mul, math.h), e.g. {bad[:5]}"


@pytest.mark.parametrize("source", SOURCES)
def test_every_fma_is_asked_for_by_the_source(kernels, source):
    """An fma in the PTX comes from a source line that calls fma (rn::fma): nvcc fused
    nothing on its own."""
    lines = {}
    bad, count = [], 0
    for k, blocks in kernels[source].items():
        for _, instrs in blocks:
            for ins in instrs:
                if not re.fullmatch(r"fma\.rn\.f(32|64)", ins.op):
                    continue
                count += 1
                path, ln = ins.loc or (None, 0)
                if path not in lines:
                    lines[path] = open(path).read().splitlines() if path and os.path.exists(path) else []
                text = lines[path][ln - 1] if 0 < ln <= len(lines[path]) else ""
                if not re.search(r"\bfma\b|__fmaf?_rn", text):
                    bad.append(f"{_demangled(k)[:80]}: {os.path.basename(path or '?')}:{ln}: {text.strip()}")
    assert not bad, f"{len(bad)} of {count} fma not written as fma in the source:\n" + "\n".join(
        sorted(set(bad))[:10])


KERNELS = {"nar_step": ("nar_norm_kernel", "nar_update_kernel"), "server_update": ("server_update_kernel",)}


@pytest.mark.parametrize("source", SOURCES)
def test_vector_and_scalar_bodies_do_the_same_fp_operations(kernels, source):
    """In each kernel with a 16-byte and a scalar body, the two kinds of loop perform
    the same floating-point operations on operands of the same origins."""
    checked = collections.Counter()
    failures = []
    for name, blocks in kernels[source].items():
        family = next((f for f in KERNELS[source] if f in name), None)
        if family is None:
            continue
        vec, sca, nvec, nsca = fp_summaries(blocks)
        assert nvec and nsca and vec and sca, f"{_demangled(name)}: found {nvec} vector and {nsca} scalar loops"
        checked[family] += 1
        if vec != sca:
            failures.append(f"{_demangled(name)}\n  vector only: {sorted(vec - sca)}\n  scalar only: "
                            f"{sorted(sca - vec)}")
    # every instantiation: 4 dtypes (x 5 rules + nesterov for the server update)
    assert all(checked[f] >= 4 for f in KERNELS[source]), checked
    assert not failures, f"{len(failures)} kernels whose bodies differ:\n" + "\n".join(failures[:4])
