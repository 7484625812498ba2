"""The Triton backend's own wrappers with every kernel launch compiled for the device
and run by tools/gpu_harness (tests/test_gpu_harness.py's table-driven Triton cases).

``on_harness(run, arch, tensors)`` is a context manager: inside it, each kernel the
wrappers of ``fedopt_kernels.backends.triton`` (and the Triton codec wrappers of
``fedopt_kernels.backends.compressed``, which import their kernels from its submodules)
launch (``kernel[grid](*args, **kw)``) is instead

1. compiled ahead of time for ``arch`` (tests/_triton_aot_case.py, in a subprocess
   without the interpreter), with the signature the JIT would give it: a tensor is a
   pointer to its dtype, 16-byte divisible where its address is; a scalar takes its
   annotation (every scalar parameter of these kernels has one); the keyword
   constexprs and ``enable_fp_fusion`` as passed;
2. launched by the harness's triton family: every tensor storage the launch can reach
   -- its tensor arguments and ``tensors`` (what a table points into: the parameters
   of ``nar_step_``, the clients of a list) -- becomes a device array at the same
   address mod 16; an integer argument that is a host address inside one of them
   becomes ``arg addr`` (``x_base``); a tensor argument that holds such addresses (the
   chunk and client tables, built by ``_tables.py`` from host addresses exactly as for
   a GPU) gets one ``reloc`` per address word, so the harness writes the DEVICE
   addresses into it before it uploads it;
3. every array that is not a table is copied back into its host storage, so the
   wrapper's next launch (the update after the norm, the row sums after the
   aggregation) reads what the compiled kernel wrote, as it would on a GPU.

The wrappers' host logic (tables, chunk rule, launch configuration, dummies, the
``bad.any`` of coordinate_select) is the backend's own; only the kernels run elsewhere.
The table cache (``_tables``) is cleared on entry and exit: inside, its entries' host
copies are what the harness relocates.  Not replayed: the JIT's specialisation of
integer arguments equal to 1 or divisible by 16 (these kernels mark theirs
``do_not_specialize`` or pass constexprs, so it changes nothing here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import json
import os

import torch

import _gpu_harness as H

TRITON_PTR = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.float64: "*fp64",
              torch.bool: "*i1", torch.int8: "*i8", torch.int16: "*i16", torch.uint8: "*u8", torch.int32: "*i32", torch.int64: "*i64"}
SCALAR = {"tl.int64": ("i64", "i64"), "tl.int32": ("i32", "i32"), "tl.float64": ("fp64", "f64"),
          "tl.float32": ("fp32", "f32")}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


class _Storage:
    """One host storage as one device array."""

    def __init__(self, name: str, t: torch.Tensor):
        st = t.untyped_storage()
        self.name, self.base, self.nbytes = name, st.data_ptr(), st.nbytes()
        self.bytes = torch.empty(0, dtype=torch.uint8).set_(st)  # a uint8 view of all of it

    def holds(self, address: int) -> bool:
        return self.base <= address < self.base + self.nbytes


def _compile(aot, spec: dict) -> dict:
    """``aot(spec)`` (the subprocess compile of tests/_triton_aot_case.py), cached on disk
    under build/gpu_harness/triton_aot by the spec, the backend's Triton sources and the
    Triton version: the sm_80 and sm_90 runs, and a rerun, compile each variant once."""
    import triton

    h = hashlib.sha256(json.dumps(spec, sort_keys=True).encode() + triton.__version__.encode())
    for p in sorted((H.ROOT / "fedopt_kernels" / "backends" / "triton").glob("*.py")):
        h.update(p.read_bytes())
    path = H.ROOT / "build" / "gpu_harness" / "triton_aot" / f"{h.hexdigest()[:24]}.json"
    if path.exists():
        return json.loads(path.read_text())
    compiled = aot(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(compiled))
    os.replace(tmp, path)
    return compiled


class _Launcher:
    def __init__(self, kernel, grid, ctx):
        self.kernel, self.grid, self.ctx = kernel, grid, ctx

    def __call__(self, *args, **kw):
        fn = self.kernel.fn
        params = inspect.signature(fn).parameters
        names = list(params)
        constexprs = {k: v for k, v in kw.items() if k not in LAUNCH_OPTIONS}
        given = dict(zip([n for n in names if n not in constexprs], args))
        assert len(given) == len(args), (fn.__name__, len(args))
        # every storage the launch can reach, one array each (by storage address)
        storages: dict = {}

        def storage_of(t):
            key = t.untyped_storage().data_ptr()
            if key not in storages:
                storages[key] = _Storage(f"s{len(storages)}", t)
            return storages[key]

        for t in [*self.ctx.tensors, *(a for a in args if isinstance(a, torch.Tensor))]:
            if t.untyped_storage().nbytes():
                storage_of(t)

        def find(address: int):
            return next((s for s in storages.values() if s.holds(address)), None) if address else None

        types, aligned, lines, relocs, tables = {}, [], [], {}, set()
        for n, a in given.items():
            if isinstance(a, torch.Tensor):
                types[n] = TRITON_PTR[a.dtype]
                if a.data_ptr() % 16 == 0:
                    aligned.append(n)
                s = find(a.data_ptr())
                lines.append(["ptr", s.name, a.data_ptr() - s.base] if s else ["null"])
                if a.dtype == torch.int64 and s is not None:  # a table: its address words
                    assert a.is_contiguous(), n
                    words = a.contiguous().reshape(-1).tolist()
                    first = (a.data_ptr() - s.base) // 8
                    for i, w in enumerate(words):
                        target = find(w)
                        if target is not None and target is not s:  # (a table passed twice: once)
                            relocs[(s.name, first + i)] = (s, first + i, target)
                            tables.add(s.name)
                        # a host address of a storage not given (sizes and flags are small)
                        assert target is not None or not 1 << 32 <= w < 1 << 56, \
                            f"{fn.__name__}: {n} holds an address outside the given tensors"
            else:
                ann = str(params[n].annotation).replace("'", "")
                ty, arg = SCALAR[ann]  # KeyError: a scalar parameter without an annotation
                types[n] = ty
                if arg == "i64" and find(int(a)) is not None:
                    s = find(int(a))
                    lines.append(["addr", s.name, int(a) - s.base])
                else:
                    lines.append([arg, float(a) if arg.startswith("f") else int(a)])
        cx = {k: (v.name if hasattr(v, "name") and not isinstance(v, (bool, int, float)) else v)
              for k, v in constexprs.items()}
        options = {k: kw[k] for k in ("enable_fp_fusion",) if k in kw}
        spec = dict(module=fn.__module__, kernel=fn.__name__, types=types, constexprs=cx, aligned=aligned,
                    warps=kw.get("num_warps", 4), options=options, arch=self.ctx.arch)
        compiled = _compile(self.ctx.aot, spec)
        extra = len(compiled["params"]) - len(lines)
        assert extra >= 0, (compiled["params"], lines)
        grid = list(self.grid) + [1] * (3 - len(self.grid))
        keys = dict(kernel="triton", module="kernel.ptx", name=compiled["name"], grid=grid,
                    block=32 * compiled["num_warps"], shared=compiled["shared"])
        # a table's file holds, at each address word, the offset into its target
        inputs = {}
        for s in storages.values():
            raw = s.bytes.clone()
            if s.name in tables:
                words = raw.view(torch.int64)
                for tab, i, target in relocs.values():
                    if tab is s:
                        words[i] -= target.base
            inputs[s.name] = raw
        arrays = [[s.name, s.nbytes, s.base % 16, "out"] for s in storages.values()]
        outputs = {s.name: (torch.uint8, (s.nbytes,)) for s in storages.values() if s.name not in tables}
        relocs_lines = [[tab.name, i, target.name] for tab, i, target in relocs.values()]
        got = self.ctx.run.run(keys, inputs, outputs, args=lines + [["null"]] * extra,
                               files={"kernel.ptx": compiled["ptx"].encode()}, arrays=arrays, relocs=relocs_lines)
        for s in storages.values():
            if s.name in got:
                s.bytes.copy_(got[s.name])
        self.ctx.log.append((fn.__name__, tuple(grid), len(relocs)))


class _Kernel:
    def __init__(self, kernel, ctx):
        self.kernel, self.ctx = kernel, ctx

    def __getitem__(self, grid):
        return _Launcher(self.kernel, tuple(grid), self.ctx)


@dataclasses.dataclass
class _Context:
    run: object
    arch: int
    tensors: list
    aot: object
    log: list


@contextlib.contextmanager
def on_harness(run, arch: int, aot, tensors=()):
    """Inside: the triton backend's kernels run compiled for sm_``arch`` on the harness
    ``run`` (a tests/_gpu_harness.Runner), compiled by ``aot(spec)``.  Yields the list of
    launches made: ``(kernel, grid, number of relocated table words)``."""
    import sys

    import fedopt_kernels.backends.triton as TB
    import fedopt_kernels.backends.triton.compressed  # noqa: F401  (the codec wrappers import from it)
    from fedopt_kernels.backends.triton import _tables

    ctx = _Context(run, arch, list(tensors), aot, [])
    # the package's names and its submodules' (the codec wrappers of backends/compressed.py
    # import their kernels from triton.compressed and triton.aggregate at each call)
    modules = [TB, *(m for k, m in list(sys.modules.items()) if k.startswith(TB.__name__ + ".") and m is not None)]
    saved = {(m, n): getattr(m, n) for m in modules for n in dir(m)
             if n.endswith("_kernel") and hasattr(getattr(m, n), "fn")}
    _tables.clear_cache()
    try:
        for (m, n), k in saved.items():
            setattr(m, n, _Kernel(k, ctx))
        yield ctx.log
    finally:
        for (m, n), k in saved.items():
            setattr(m, n, k)
        _tables.clear_cache()
