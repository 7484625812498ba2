"""A small program for ``compute-sanitizer``: the kernels' edge cases, each once.

``scripts/device-check.sh`` runs it under ``compute-sanitizer --tool memcheck`` (out of
bounds, misaligned accesses), ``racecheck`` (shared-memory races in the reductions)
and ``initcheck`` (reads of uninitialised device memory).  What the kernels' usual
tests do not stress, and a sanitizer can see:

* fp16/bf16/fp32/fp64 tensors that are views at element offset 1 of a buffer of
  exactly the size needed (a vectorised load that assumes 16-byte alignment, or reads
  past the last element, touches memory outside the allocation);
* C = 33 clients (more rows than a kernel's unrolled group of clients);
* N = 0 (empty launches), an empty tensor inside a list;
* the aggregation's second pass with ``skip`` true (no client excluded), with one
  client excluded, and with every client excluded;
* server updates that are views at odd offsets of one flat vector, every rule, skip
  false and true;
* ``nar_step_`` over many tensors (several chunk tables) and ``nar_step_groups_``.

Every result is also compared with the reference backend (python_ref) on the same
device, so the driver fails on a wrong answer too, not only on a sanitizer report.
Run it with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` (device-check.sh does): with torch's
caching allocator an over-read usually lands inside a larger cached block, where no
sanitizer can see it.

``--device cpu`` runs the same cases on the CPU backends (cpu, and triton in its
interpreter), so the driver itself is tested without a GPU
(tests/test_sanitizer_driver.py).  Exit status 0 when every case passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback


def _parse(argv):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda if available, else cpu")
    p.add_argument("--backends", default=None,
                   help="comma-separated (default: cuda,triton on cuda; cpu,triton on cpu)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("sanitizer_driver: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    default = ("cuda", "triton") if device.type == "cuda" else ("cpu", "triton")
    names = [n.strip() for n in args.backends.split(",")] if args.backends else list(default)
    if device.type == "cpu" and "triton" in names and os.environ.get("TRITON_INTERPRET") != "1":
        # triton.jit reads it when the kernels are defined, i.e. before any import of them
        os.environ["TRITON_INTERPRET"] = "1"
    size.update(SIZES[device.type])

    from fedopt_kernels import backends
    failures, passed = 0, 0
    for name in names:
        if name not in backends.BACKENDS:
            print(f"sanitizer_driver: unknown backend {name!r}", file=sys.stderr)
            return 2
        reason = backends.why_unavailable(name, device)
        if reason is not None:
            print(f"FAIL  {name}: not available on {device.type}: {reason}")
            failures += 1
            continue
        for case in CASES:
            t0 = time.perf_counter()
            try:
                case(name, device)
                if device.type == "cuda":
                    torch.cuda.synchronize()  # an asynchronous kernel error surfaces here, in its case
                passed += 1
                print(f"ok    {name:<7} {case.__name__} ({time.perf_counter() - t0:.1f} s)")
            except Exception:  # noqa: BLE001 - report every case, then fail
                failures += 1
                print(f"FAIL  {name:<7} {case.__name__}\n{traceback.format_exc()}")
    print(f"sanitizer_driver on {device.type}: {passed} cases passed, {failures} failed")
    return 1 if failures else 0


# ----------------------------------------------------------------------- cases

DTYPES = ("float16", "bfloat16", "float32", "float64")
# Sizes: on CUDA as large as a sanitizer run affords; on CPU (Triton in its
# interpreter, which runs every program instance in Python) small enough for a test.
SIZES = {"cuda": dict(tensors=600, long=4099), "cpu": dict(tensors=60, long=1031)}
size = SIZES["cuda"]
RTOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5, "float64": 1e-10}


def _torch():
    import torch

    return torch


def _dtype(name):
    return getattr(_torch(), name)


def _acc(name):
    return _dtype("float64" if name == "float64" else "float32")


def _misaligned(values, device):
    """``values`` as a view at element offset 1 of a buffer holding exactly one more."""
    torch = _torch()
    buf = torch.empty(values.numel() + 1, dtype=values.dtype, device=device)
    view = buf[1:].view(values.shape)
    view.copy_(values)
    return view


def _randn(shape, dtype, device, gen, scale=1.0):
    torch = _torch()
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(device)


def _close(actual, expected, dtype_name, what):
    tol = RTOL[dtype_name]
    _torch().testing.assert_close(actual.float() if dtype_name != "float64" else actual,
                                  expected.float() if dtype_name != "float64" else expected,
                                  rtol=tol, atol=tol, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _ops():
    from fedopt_kernels import ops

    return ops


def misaligned_nar_step(backend, device):
    """Every dtype, params/grads/buffers at offset 1, odd sizes and an empty tensor."""
    torch, ops = _torch(), _ops()
    gen = torch.Generator().manual_seed(0)
    for name in DTYPES:
        dt = _dtype(name)
        sizes = [1, 0, 3, 257, 1031, 4099]
        base = [_randn((n,), dt, device, gen) for n in sizes]
        grads = [_misaligned(_randn((n,), dt, device, gen), device) for n in sizes]
        bufs0 = [_randn((n,), dt, device, gen, 0.1) for n in sizes]
        params, bufs = [_misaligned(p, device) for p in base], [_misaligned(b, device) for b in bufs0]
        ref_p, ref_b = [p.clone() for p in base], [b.clone() for b in bufs0]
        kw = dict(lr=0.5, weight_decay=0.01, max_norm=1.0, momentum=0.9)
        st = ops.nar_step_(params, grads, momentum_buffers=bufs, backend=backend, **kw)
        rst = ops.nar_step_(ref_p, [g.clone() for g in grads], momentum_buffers=ref_b, backend="reference", **kw)
        for i, (a, b) in enumerate(zip(params + bufs, ref_p + ref_b)):
            _close(a, b, name, f"{name} tensor {i}")
        _close(st.norm, rst.norm, "float32" if name != "float64" else name, f"{name} norm")


def misaligned_batched(backend, device):
    """``[C, N]`` with storage offset 1 (every row misaligned), one NaN row, N = 0."""
    torch, ops = _torch(), _ops()
    gen = torch.Generator().manual_seed(1)
    for name in DTYPES:
        dt = _dtype(name)
        for C, N in ((3, 257), (33, 65), (3, 0)):
            X0, G0, B0 = (_randn((C, N), dt, device, gen) for _ in range(3))
            if N:
                G0[1, N // 2] = float("nan")
            X, G, B = (_misaligned(t, device) for t in (X0, G0, B0))
            lr = torch.linspace(0.1, 0.5, C, dtype=_acc(name), device=device)
            kw = dict(lr=lr, weight_decay=0.01, max_norm=1.0, momentum=0.9)
            st = ops.nar_step_batched_(X, G, momentum_buffers=B, backend=backend, **kw)
            Xr, Br = X0.clone(), B0.clone()
            rst = ops.nar_step_batched_(Xr, G0, momentum_buffers=Br, backend="reference", **kw)
            _close(X, Xr, name, f"{name} X [{C}, {N}]")
            _close(B, Br, name, f"{name} B [{C}, {N}]")
            assert torch.equal(st.skipped.cpu(), rst.skipped.cpu()), (st.skipped, rst.skipped)


def _agg_pair(backend, clients, ref_clients, weights, gamma, name, what):
    torch, ops = _torch(), _ops()
    out, st = ops.aggregate(clients, weights, gamma=gamma, backend=backend)
    rout, rst = ops.aggregate(ref_clients, weights, gamma=gamma, backend="reference")
    _close(out, rout, name, f"{what} out")
    for f in ("client_sq_norms", "sq_norm", "weights"):
        _close(getattr(st, f), getattr(rst, f), "float32" if name != "float64" else name, f"{what} {f}")
    assert torch.equal(st.excluded.cpu(), rst.excluded.cpu()) and bool(st.all_excluded) == bool(rst.all_excluded)
    return st


def aggregate_33_clients(backend, device):
    """C = 33 as a [C, N] tensor at offset 1 and as a list of misaligned rows."""
    torch = _torch()
    gen = torch.Generator().manual_seed(2)
    for name in DTYPES:
        dt = _dtype(name)
        X0 = _randn((33, size["long"]), dt, device, gen)
        w = torch.rand(33, generator=gen, dtype=torch.float64) + 0.05
        gamma = torch.tensor(0.9, dtype=_acc(name), device=device)
        _agg_pair(backend, _misaligned(X0, device), X0, w, gamma, name, f"{name} [33, N]")
        rows = [_misaligned(r, device) for r in X0.unbind(0)]
        _agg_pair(backend, rows, X0, w, 1.1, name, f"{name} 33 rows")


def aggregate_empty_and_excluded(backend, device):
    """N = 0; the second pass disabled (no client excluded), one excluded, all excluded."""
    torch = _torch()
    gen = torch.Generator().manual_seed(3)
    for name in DTYPES:
        dt = _dtype(name)
        w = torch.rand(5, generator=gen, dtype=torch.float64) + 0.05
        _agg_pair(backend, torch.zeros(5, 0, dtype=dt, device=device), torch.zeros(5, 0, dtype=dt, device=device), w,
                  0.9, name, f"{name} N=0")
        _agg_pair(backend, [torch.zeros(0, dtype=dt, device=device)] * 5, torch.zeros(5, 0, dtype=dt, device=device),
                  w, 0.9, name, f"{name} N=0 rows")
        X0 = _randn((5, 1031), dt, device, gen)
        st = _agg_pair(backend, _misaligned(X0, device), X0, w, 0.9, name, f"{name} none excluded")
        assert not bool(st.excluded.any())
        X0[3, 17] = float("nan")
        st = _agg_pair(backend, _misaligned(X0, device), X0, w, 0.9, name, f"{name} one excluded")
        assert st.excluded.cpu().tolist() == [False, False, False, True, False]
        X0[:, 5] = float("inf")
        st = _agg_pair(backend, _misaligned(X0, device), X0, w, 0.9, name, f"{name} all excluded")
        assert bool(st.all_excluded)


def client_dots_and_weighted_sum_33(backend, device):
    """The backward pass's ``client_dots`` over 33 misaligned clients."""
    torch, ops = _torch(), _ops()
    gen = torch.Generator().manual_seed(4)
    for name in DTYPES:
        dt, acc = _dtype(name), _acc(name)
        X0 = _randn((33, 1031), dt, device, gen)
        X = _misaligned(X0, device)
        g = _misaligned(_randn((1031,), acc, device, gen), device)
        tol = "float32" if name != "float64" else name
        _close(ops.client_dots(X, g, backend=backend), ops.client_dots(X0, g.clone(), backend="reference"), tol,
               f"{name} dots")
        grads = []
        for be, clients in ((backend, X), ("reference", X0)):
            w = torch.full((33,), 1 / 33, dtype=acc, device=device, requires_grad=True)
            gamma = torch.tensor(0.9, dtype=acc, device=device, requires_grad=True)
            out = ops.weighted_sum(clients, w, gamma, backend=be)
            out.backward(torch.ones(1031, dtype=dt, device=device))
            grads.append((w.grad, gamma.grad, out.detach()))
        _close(grads[0][2], grads[1][2], name, f"{name} weighted_sum")
        _close(grads[0][0], grads[1][0], tol, f"{name} d/dweights")
        _close(grads[0][1], grads[1][1], tol, f"{name} d/dgamma")


def server_update_odd_offsets(backend, device):
    """Every rule; updates as views at odd offsets of one flat vector; params and state
    misaligned too; skip false, then true (nothing may be written)."""
    torch, ops = _torch(), _ops()
    gen = torch.Generator().manual_seed(5)
    hyper = {"sgd": dict(lr=0.5, gamma=0.9), "momentum": dict(lr=0.5, beta1=0.9, nesterov=True),
             "adagrad": dict(lr=0.1, beta1=0.9, tau=1e-3), "adam": dict(lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3),
             "yogi": dict(lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3)}
    for rule in ops.RULES:
        for name in DTYPES:
            dt = _dtype(name)
            sizes = [1, 0, 3, 257, 4099]
            flat = _randn((1 + sum(sizes),), _acc(name), device, gen)
            updates, at = [], 1
            for n in sizes:
                updates.append(flat[at:at + n])
                at += n
            x0 = [_randn((n,), dt, device, gen) for n in sizes]
            m0 = [_randn((n,), dt, device, gen, 0.5) for n in sizes]
            v0 = [(_randn((n,), dt, device, gen) ** 2 + 0.05).to(dt) for n in sizes]
            for skip in (False, True):
                state = {"exp_avg": m0, "exp_avg_sq": v0} if rule in ("adagrad", "adam", "yogi") else \
                    ({"exp_avg": m0} if rule == "momentum" else {})
                got = {k: [_misaligned(t, device) for t in ts] for k, ts in {"params": x0, **state}.items()}
                ref = {k: [t.clone() for t in ts] for k, ts in {"params": x0, **state}.items()}
                flag = torch.tensor(skip, device=device)
                for be, tensors in ((backend, got), ("reference", ref)):
                    ops.server_update_(tensors["params"], updates, rule=rule, skip=flag, backend=be,
                                       **{k: v for k, v in tensors.items() if k != "params"}, **hyper[rule])
                for k in got:
                    for i, (a, b) in enumerate(zip(got[k], ref[k])):
                        if skip:
                            assert torch.equal(a.cpu(), b.cpu()), f"{rule} {name} {k}[{i}] written under skip"
                        _close(a, b, name, f"{rule} {name} {k}[{i}]")


def nar_step_many_tensors(backend, device):
    """Many tensors of mixed sizes (600 on CUDA: several chunk tables), and the same as
    two groups under one norm."""
    torch, ops = _torch(), _ops()
    gen = torch.Generator().manual_seed(6)
    cycle = [1, 2, 3, 5, 17, 31, 64, 127, 0, 1000, 4099]
    for name in ("float32", "float16"):
        dt = _dtype(name)
        sizes = [cycle[i % len(cycle)] for i in range(size["tensors"])]
        params = [_randn((n,), dt, device, gen) for n in sizes]
        grads = [_randn((n,), dt, device, gen) for n in sizes]
        ref = [p.clone() for p in params]
        st = ops.nar_step_(params, grads, lr=0.5, weight_decay=0.01, max_norm=1.0, backend=backend)
        rst = ops.nar_step_(ref, grads, lr=0.5, weight_decay=0.01, max_norm=1.0, backend="reference")
        for i, (a, b) in enumerate(zip(params, ref)):
            _close(a, b, name, f"{name} many tensors [{i}]")
        _close(st.norm, rst.norm, "float32", f"{name} many tensors norm")
        half = len(params) // 2
        out = []
        for be in (backend, "reference"):
            ps = [p.clone() for p in params]
            groups = [ops.NarGroup(ps[:half], grads[:half], lr=0.5, weight_decay=0.01),
                      ops.NarGroup(ps[half:], grads[half:], lr=0.2, weight_decay=0.0)]
            out.append((ps, ops.nar_step_groups_(groups, max_norm=1.0, backend=be)))
        for i, (a, b) in enumerate(zip(out[0][0], out[1][0])):
            _close(a, b, name, f"{name} groups [{i}]")


CASES = (misaligned_nar_step, misaligned_batched, aggregate_33_clients, aggregate_empty_and_excluded,
         client_dots_and_weighted_sum_33, server_update_odd_offsets, nar_step_many_tensors)

if __name__ == "__main__":
    sys.exit(main())
