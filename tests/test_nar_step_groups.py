"""One FedNAR clip norm over several param groups, dtypes and devices
(``ops.nar_step_groups_`` and ``FedNAR(clip_scope="optimizer")``).

Oracles, none of them the code under test:

* the authors' released recipe with a no-decay group: ``0.5 wd ||x_decayed||^2`` in the
  loss, ONE ``torch.nn.utils.clip_grad_norm_`` over all parameters, ``torch.optim.SGD``
  with per-group lr (and momentum);
* ``fp64_step``: the FedNAR step written out here in float64, line by
  line, for tensors of any dtype;
* for ``clip_scope="group"``: one independent FedNAR per group.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from fedopt_kernels import ops
from fedopt_kernels.optim import FedNAR

pytestmark = pytest.mark.usefixtures("no_mkldnn")  # CPU matmuls deterministic across the runs

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s epsilon


# ----------------------------------------------------------------------------- oracles
def fp64_step(groups, max_norm, mode="co", grad_scale=1.0):
    """New float64 params of every group: v_k = g_k + wd_k x_k, ONE norm, one scale."""
    xs = [[p.detach().double().reshape(-1) for p in g["params"]] for g in groups]
    gs = [[t.double().reshape(-1) / grad_scale for t in g["grads"]] for g in groups]
    sq = 0.0
    for k, g in enumerate(groups):
        for x, t in zip(xs[k], gs[k]):
            v = t + g["wd"] * x if mode == "co" else t
            sq += float((v * v).sum())
    n = math.sqrt(sq)
    s = 1.0 if mode == "none" else min(1.0, max_norm / (n + EPS))
    out = []
    for k, g in enumerate(groups):
        out.append([x - g["lr"] * (s * (t + g["wd"] * x) if mode == "co" else s * t + g["wd"] * x)
                    for x, t in zip(xs[k], gs[k])])
    return out, n, s


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 10))


def split_groups(model):
    """The standard training-loop split: weights decay, biases and norm layers do not."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return decay, no_decay


def batches(steps, batch=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield torch.randn(batch, 64, generator=g) * 2.0, torch.randint(0, 10, (batch,), generator=g)


def recipe(model, data, device, *, lrs, wd, max_norm, momentum=0.0):
    """The released recipe with a no-decay group (see the module docstring)."""
    model = model.to(device)
    decay, no_decay = split_groups(model)
    sgd = torch.optim.SGD([{"params": decay, "lr": lrs[0]}, {"params": no_decay, "lr": lrs[1]}],
                          lr=lrs[0], momentum=momentum)
    for xb, yb in data:
        sgd.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xb.to(device)), yb.to(device))
        loss = loss + 0.5 * wd * sum((p * p).sum() for p in decay)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        sgd.step()
    return model


def train_fednar(model, data, device, *, lrs, wd, max_norm, momentum=0.0, backend=None, clip_scope="optimizer"):
    model = model.to(device)
    decay, no_decay = split_groups(model)
    opt = FedNAR([{"params": decay, "lr": lrs[0], "weight_decay": wd},
                  {"params": no_decay, "lr": lrs[1], "weight_decay": 0.0}],
                 lr=lrs[0], max_norm=max_norm, momentum=momentum, backend=backend, clip_scope=clip_scope)
    scales = []
    for xb, yb in data:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb.to(device)), yb.to(device)).backward()
        opt.step()
        if clip_scope == "optimizer":
            assert opt.last_stats[0] is opt.last_stats[1]  # one shared norm
        scales.append(float(opt.last_stats[0].scale))
    return model, opt, scales


# ------------------------------------------------------------------ the released recipe
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_two_groups_equal_the_released_recipe(backend, momentum):
    """20 steps, weights with decay and biases/LayerNorm without, different lrs."""
    name, device = backend
    kw = dict(lrs=(0.1, 0.03), wd=0.05, max_norm=0.5, momentum=momentum)
    base = make_model()
    fused, _, scales = train_fednar(copy.deepcopy(base), batches(20), device, backend=name, **kw)
    oracle = recipe(copy.deepcopy(base), batches(20), device, **kw)
    assert min(scales) < 1.0  # the clip is exercised
    for a, b in zip(fused.parameters(), oracle.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_recipe_distinguishes_one_norm_from_per_group_norms(backend):
    """The per-group norm (today's ``clip_scope="group"``) is NOT the recipe: this case
    must be able to tell the two apart, or the test above proves nothing."""
    name, device = backend
    kw = dict(lrs=(0.1, 0.03), wd=0.05, max_norm=0.5)
    base = make_model()
    per_group, _, _ = train_fednar(copy.deepcopy(base), batches(5), device, backend=name, clip_scope="group",
                                   **kw)
    oracle = recipe(copy.deepcopy(base), batches(5), device, **kw)
    diff = max(float((a - b).abs().max()) for a, b in zip(per_group.parameters(), oracle.parameters()))
    assert diff > 1e-3


def test_group_scope_equals_one_fednar_per_group(backend):
    name, device = backend
    torch.manual_seed(1)
    ws = [torch.randn(300, device=device), torch.randn(77, device=device)]
    grads = [torch.randn(300, device=device) * 4, torch.randn(77, device=device) * 0.01]
    a = [torch.nn.Parameter(w.clone()) for w in ws]
    for p, g in zip(a, grads):
        p.grad = g.clone()
    opt = FedNAR([{"params": [a[0]]}, {"params": [a[1]], "lr": 0.5, "max_norm": 100.0}], lr=0.1,
                 weight_decay=0.01, max_norm=1.0, backend=name, clip_scope="group")
    opt.step()
    for k, (lr, mn) in enumerate([(0.1, 1.0), (0.5, 100.0)]):
        b = torch.nn.Parameter(ws[k].clone())
        b.grad = grads[k].clone()
        alone = FedNAR([b], lr=lr, weight_decay=0.01, max_norm=mn, backend=name)
        alone.step()
        torch.testing.assert_close(a[k].detach(), b.detach(), rtol=0, atol=0)
        torch.testing.assert_close(opt.last_stats[k].norm, alone.last_stats[0].norm, rtol=0, atol=0)
    assert float(opt.last_stats[0].scale) < 1.0 and float(opt.last_stats[1].scale) == 1.0


# ------------------------------------------------------------ ops level, every formula
@pytest.mark.parametrize("mode", ["co", "grad", "none"])
@pytest.mark.parametrize("max_norm", [0.3, 50.0, math.inf])
def test_ops_groups_equal_fp64_oracle(backend, mode, max_norm):
    name, device = backend
    torch.manual_seed(2)
    sizes = [[1, 4097, 33], [0, 129], [2049]]  # odd sizes, an empty tensor, chunk edges
    hyper = [(0.1, 0.2), (0.05, 0.0), (0.3, 1.5)]
    groups, oracle_groups = [], []
    for shape_list, (lr, wd) in zip(sizes, hyper):
        ps = [torch.randn(n, device=device) for n in shape_list]
        gs = [torch.randn(n, device=device) * 0.2 for n in shape_list]
        groups.append(ops.NarGroup(ps, gs, lr, wd))
        oracle_groups.append(dict(params=[p.clone() for p in ps], grads=gs, lr=lr, wd=wd))
    expected, n, s = fp64_step(oracle_groups, max_norm, mode)
    st = ops.nar_step_groups_(groups, max_norm=max_norm, mode=mode, backend=name)
    if max_norm == 0.3 and mode != "none":
        assert s < 0.1  # clipped hard: a wrong scale or a wrong norm cannot hide
    for g, exp in zip(groups, expected):
        for p, e in zip(g.params, exp):
            torch.testing.assert_close(p.double().reshape(-1), e, rtol=2e-6, atol=2e-6)
    assert st.norm.dtype == torch.float32 and st.norm.device == device
    torch.testing.assert_close(st.norm.double(), torch.tensor(n, dtype=torch.float64, device=device), rtol=1e-6,
                               atol=0)
    torch.testing.assert_close(st.scale.double(), torch.tensor(s, dtype=torch.float64, device=device), rtol=1e-6,
                               atol=0)
    assert not bool(st.skipped)


def test_weight_decay_of_each_group_enters_the_shared_norm(backend):
    """Group 1's decay changes group 0's step (only through the shared norm)."""
    name, device = backend
    x0, g0 = torch.ones(50, device=device), torch.ones(50, device=device)
    x1, g1 = torch.full((20,), 3.0, device=device), torch.zeros(20, device=device)
    runs = []
    for wd1 in (0.0, 1.0):
        a0, a1 = x0.clone(), x1.clone()
        ops.nar_step_groups_([ops.NarGroup([a0], [g0], 0.1, 0.0), ops.NarGroup([a1], [g1], 0.1, wd1)],
                             max_norm=1.0, backend=name)
        runs.append(a0)
    # n^2 = 50 (+ 20 * 9 with wd1 = 1): s = 1 / (sqrt(50) + eps) resp. 1 / (sqrt(230) + eps)
    for a0, sq in zip(runs, (50.0, 230.0)):
        torch.testing.assert_close(a0, torch.full_like(a0, 1.0 - 0.1 / (math.sqrt(sq) + EPS)), rtol=1e-6, atol=0)


def test_two_phase_equals_single_op_with_hundreds_of_partials(backend):
    """301 partial sums (300 small tensors and a large one): nar_step_ combines them
    inside its update kernel, nar_sq_norm in the finalize kernel; on a GPU the two must
    reduce in one tree (the same num_warps) to agree bit for bit.  The Triton
    interpreter reduces in one order whatever the layout and is far too slow for 301
    programs per pass: there this case is the compiled kernels' (a GPU machine)."""
    name, device = backend
    from fedopt_kernels import backends as B

    if name == "triton" and B.triton_interpret_mode():
        pytest.skip("a check of the compiled Triton kernels' reduction layout (runs on a GPU)")
    impl = B.resolve(name, device)
    torch.manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        ps = [torch.randn(97, device=device).to(dtype) for _ in range(300)] + [torch.randn(70001, device=device)
                                                                                .to(dtype)]
        gs = [torch.randn_like(p) for p in ps]
        a, b = [p.clone() for p in ps], [p.clone() for p in ps]
        one = impl.nar_step_(a, gs, [], 0.1, None, 0.3, None, 2.0, 0, 0.0, None, None)
        sq = impl.nar_sq_norm(b, gs, 0.3, None, 0, None)
        two = impl.nar_apply_(b, gs, [], sq, 0.1, None, 0.3, None, 2.0, 0, 0.0, None, None)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), (name, dtype)
        assert all(torch.equal(s1, s2) for s1, s2 in zip(one, two)), (name, dtype)


def test_two_phase_ops_equal_nar_step_bitwise(backend):
    """A single part through ``nar_sq_norm`` + ``nar_apply_`` is ``nar_step_`` bit for bit
    (the contract of csrc/registration.cpp), momentum and grad_scale included."""
    name, device = backend
    from fedopt_kernels import backends as B

    impl = B.resolve(name, device)
    torch.manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        ps = [torch.randn(n, device=device).to(dtype) for n in (5000, 3, 70000)]
        gs = [torch.randn_like(p) for p in ps]
        bs = [torch.randn_like(p) for p in ps]
        a, b = [p.clone() for p in ps], [p.clone() for p in ps]
        ba, bb = [t.clone() for t in bs], [t.clone() for t in bs]
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        gsc = torch.tensor(4.0, dtype=acc, device=device)
        one = impl.nar_step_(a, gs, ba, 0.1, None, 0.3, None, 2.0, 0, 0.9, gsc, None)
        sq = impl.nar_sq_norm(b, gs, 0.3, None, 0, gsc)
        two = impl.nar_apply_(b, gs, bb, sq, 0.1, None, 0.3, None, 2.0, 0, 0.9, gsc, None)
        for x, y in zip(a + ba, b + bb):
            assert torch.equal(x, y), (name, dtype)
        for s1, s2 in zip(one, two):
            assert torch.equal(s1, s2), (name, dtype)
        # the norm is the correctly rounded sqrt of the sum (numpy's; torch.sqrt on CPU
        # is not always correctly rounded)
        assert torch.equal(torch.from_numpy(np.sqrt(sq.cpu().reshape(1).numpy())).reshape(()), one[0].cpu()), (name, dtype)


# --------------------------------------------------------------------- mixed dtypes
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16), (torch.float16, torch.float32, torch.bfloat16),
                                    (torch.float64, torch.float16)])
def test_mixed_dtypes_one_norm_against_fp64(backend, dtypes):
    """One model mixing dtypes (e.g. an fp32 head on a bf16 body) in one group and
    across groups: one norm over everything, against the float64 oracle."""
    name, device = backend
    torch.manual_seed(4)
    ps = [torch.randn(n, device=device).to(dt) for n, dt in zip((3001, 517, 64), dtypes)]
    gs = [(torch.randn(p.shape, device=device) * 0.5).to(p.dtype) for p in ps]
    oracle, n, s = fp64_step([dict(params=ps, grads=gs, lr=0.2, wd=0.5)], max_norm=1.0)
    work = [p.clone() for p in ps]
    st = ops.nar_step_(work, gs, lr=0.2, weight_decay=0.5, max_norm=1.0, backend=name)
    assert s < 0.2
    stat = torch.float64 if torch.float64 in dtypes else torch.float32
    assert st.norm.dtype == stat
    torch.testing.assert_close(st.norm.double(), torch.tensor(n, dtype=torch.float64, device=device), rtol=2e-6,
                               atol=0)
    for p, e in zip(work, oracle[0]):
        # the result is the fp64 value rounded once to p's dtype (within one ulp)
        tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 2e-6, torch.float64: 1e-7}[p.dtype]
        torch.testing.assert_close(p.double(), e.view(p.shape), rtol=tol, atol=tol)
    # the same tensors split into two groups with another lr: still one norm
    work2 = [p.clone() for p in ps]
    ops.nar_step_groups_([ops.NarGroup(work2[:1], gs[:1], 0.2, 0.5), ops.NarGroup(work2[1:], gs[1:], 0.4, 0.5)],
                         max_norm=1.0, backend=name)
    oracle2, _, _ = fp64_step([dict(params=ps[:1], grads=gs[:1], lr=0.2, wd=0.5),
                               dict(params=ps[1:], grads=gs[1:], lr=0.4, wd=0.5)], max_norm=1.0)
    for p, e in zip(work2, oracle2[0] + oracle2[1]):
        tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 2e-6, torch.float64: 1e-7}[p.dtype]
        torch.testing.assert_close(p.double(), e.view(p.shape), rtol=tol, atol=tol)


def test_fednar_accepts_a_mixed_dtype_model(backend):
    name, device = backend
    torch.manual_seed(5)
    model = make_model().to(device)
    model[3].to(torch.bfloat16)  # a bf16 head on an fp32 body
    x = torch.randn(16, 64, device=device)
    y = torch.randint(0, 10, (16,), device=device)
    before = [p.detach().clone() for p in model.parameters()]
    opt = FedNAR(model.parameters(), lr=0.1, weight_decay=0.1, max_norm=0.2, backend=name)
    out = model[3](model[2](model[1](model[0](x))).to(torch.bfloat16))
    torch.nn.functional.cross_entropy(out.float(), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    oracle, n, s = fp64_step([dict(params=before, grads=grads, lr=0.1, wd=0.1)], max_norm=0.2)
    assert s < 1.0
    for p, e in zip(model.parameters(), oracle[0]):
        tol = 8e-3 if p.dtype == torch.bfloat16 else 2e-6
        torch.testing.assert_close(p.detach().double(), e.view(p.shape), rtol=tol, atol=tol)


# -------------------------------------------------------------------------- skipping
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_in_one_group_skips_every_group(backend, bad):
    name, device = backend
    torch.manual_seed(6)
    ps = [torch.randn(100, device=device), torch.randn(50, device=device).to(torch.bfloat16),
          torch.randn(30, device=device)]
    gs = [torch.randn_like(p) for p in ps]
    gs[2][7] = bad
    bufs = [torch.randn_like(p) for p in ps]
    work, wbufs = [p.clone() for p in ps], [b.clone() for b in bufs]
    st = ops.nar_step_groups_(
        [ops.NarGroup(work[:2], gs[:2], 0.1, 0.01, 0.9, wbufs[:2]), ops.NarGroup(work[2:], gs[2:], 0.2, 0.0, 0.5,
                                                                                 wbufs[2:])],
        max_norm=1.0, backend=name)
    assert bool(st.skipped)
    for x, y in zip(work + wbufs, ps + bufs):
        assert torch.equal(x, y)  # bit-identical


def test_found_inf_skips_every_group_and_grad_scale_unscales(backend):
    name, device = backend
    torch.manual_seed(7)
    ps = [torch.randn(100, device=device), torch.randn(40, device=device)]
    gs = [torch.randn_like(p) * 1024.0 for p in ps]
    work = [p.clone() for p in ps]
    st = ops.nar_step_groups_([ops.NarGroup(work[:1], gs[:1], 0.1, 0.2), ops.NarGroup(work[1:], gs[1:], 0.3)],
                              max_norm=1.0, grad_scale=torch.tensor(1024.0, device=device),
                              found_inf=torch.tensor(1.0, device=device), backend=name)
    assert bool(st.skipped) and all(torch.equal(a, b) for a, b in zip(work, ps))
    st = ops.nar_step_groups_([ops.NarGroup(work[:1], gs[:1], 0.1, 0.2), ops.NarGroup(work[1:], gs[1:], 0.3)],
                              max_norm=1.0, grad_scale=torch.tensor(1024.0, device=device),
                              found_inf=torch.tensor(0.0, device=device), backend=name)
    oracle, n, s = fp64_step([dict(params=ps[:1], grads=gs[:1], lr=0.1, wd=0.2),
                              dict(params=ps[1:], grads=gs[1:], lr=0.3, wd=0.0)], max_norm=1.0, grad_scale=1024.0)
    assert not bool(st.skipped) and s < 1.0
    for p, e in zip(work, oracle[0] + oracle[1]):
        torch.testing.assert_close(p.double(), e, rtol=2e-6, atol=2e-6)


def test_gradscaler_drives_two_groups(backend):
    """torch.amp.GradScaler hands FedNAR its scale: two groups, one norm of the
    UNSCALED gradients, equal to the recipe on the unscaled gradients."""
    name, device = backend
    if device.type != "cpu":
        pytest.skip("this test drives the CPU GradScaler")
    torch.manual_seed(8)
    model = make_model()
    oracle = copy.deepcopy(model)
    decay, no_decay = split_groups(model)
    opt = FedNAR([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "lr": 0.03}], lr=0.1,
                 max_norm=0.5, backend=name)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    od, on = split_groups(oracle)
    sgd = torch.optim.SGD([{"params": od, "lr": 0.1}, {"params": on, "lr": 0.03}], lr=0.1)
    for xb, yb in batches(5):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.cross_entropy(model(xb), yb)).backward()
        scaler.step(opt)
        scaler.update()
        sgd.zero_grad()
        loss = torch.nn.functional.cross_entropy(oracle(xb), yb) + 0.5 * 0.05 * sum((p * p).sum() for p in od)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(oracle.parameters(), 0.5)
        sgd.step()
    for a, b in zip(model.parameters(), oracle.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------- compile, resume
def test_compile_fullgraph_two_groups_tensor_lr(backend):
    """Two groups, lr and weight decay as 0-d tensors changing every step: one graph
    (fullgraph), no recompile, equal to eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    name, device = backend
    torch._dynamo.reset()
    model, eager_model = make_model(9).to(device), make_model(9).to(device)
    lrs = (torch.tensor(0.1, device=device), torch.tensor(0.03, device=device))
    d, n = split_groups(model)
    ed, en = split_groups(eager_model)
    opt = FedNAR([{"params": d, "lr": lrs[0], "weight_decay": torch.tensor(0.05, device=device)},
                  {"params": n, "lr": lrs[1], "weight_decay": torch.tensor(0.0, device=device)}], lr=0.1,
                 max_norm=0.5, backend=name)
    eager = FedNAR([{"params": ed, "lr": 0.1, "weight_decay": 0.05}, {"params": en, "lr": 0.03, "weight_decay": 0.0}],
                   lr=0.1, max_norm=0.5, backend=name)
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(opt.step, backend=counter, fullgraph=True)
    for k, (xb, yb) in enumerate(batches(5, seed=3)):
        xb, yb = xb.to(device), yb.to(device)
        lrs[0].fill_(0.1 / (k + 1))
        lrs[1].fill_(0.03 * (k + 1))
        eager.param_groups[0]["lr"], eager.param_groups[1]["lr"] = 0.1 / (k + 1), 0.03 * (k + 1)
        for m, o in ((model, opt), (eager_model, eager)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(xb), yb).backward()
        step()
        eager.step()
        for a, b in zip(model.parameters(), eager_model.parameters()):
            torch.testing.assert_close(a, b)
    assert counter.frame_count == 1


def test_state_dict_resume_two_groups_bitwise():
    kw = dict(lrs=(0.1, 0.03), wd=0.05, max_norm=0.5, momentum=0.9)
    base = make_model(10)
    straight, _, _ = train_fednar(copy.deepcopy(base), batches(6, seed=4), "cpu", **kw)
    data = list(batches(6, seed=4))
    first, opt, _ = train_fednar(copy.deepcopy(base), data[:3], "cpu", **kw)
    saved_model, saved_opt = copy.deepcopy(first.state_dict()), copy.deepcopy(opt.state_dict())
    assert saved_opt["clip_scope"] == "optimizer"
    resumed = make_model(11)
    resumed.load_state_dict(saved_model)
    d, n = split_groups(resumed)
    opt2 = FedNAR([{"params": d, "lr": 0.1, "weight_decay": 0.05}, {"params": n, "lr": 0.03, "weight_decay": 0.0}],
                  lr=0.1, max_norm=0.5, momentum=0.9)
    opt2.load_state_dict(saved_opt)
    for xb, yb in data[3:]:
        opt2.zero_grad()
        torch.nn.functional.cross_entropy(resumed(xb), yb).backward()
        opt2.step()
    for a, b in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(a, b)
    other = FedNAR(resumed.parameters(), lr=0.1, clip_scope="group")
    with pytest.raises(ValueError, match="clip_scope"):
        other.load_state_dict(saved_opt)


def test_deterministic_bitwise(backend):
    name, device = backend
    torch.manual_seed(12)
    ps = [torch.randn(n, device=device) for n in (70001, 5, 9000)]
    gs = [torch.randn_like(p) for p in ps]
    results = []
    for _ in range(2):
        work = [p.clone() for p in ps]
        st = ops.nar_step_groups_([ops.NarGroup(work[:2], gs[:2], 0.1, 0.1), ops.NarGroup(work[2:], gs[2:], 0.2)],
                                  max_norm=1.0, backend=name)
        results.append((work, st))
    for x, y in zip(results[0][0], results[1][0]):
        assert torch.equal(x, y)
    assert torch.equal(results[0][1].norm, results[1][1].norm)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_groups_on_two_cuda_devices():
    torch.manual_seed(13)
    ps = [torch.randn(1000, device="cuda:0"), torch.randn(300, device="cuda:1")]
    gs = [torch.randn_like(p) for p in ps]
    oracle, n, s = fp64_step([dict(params=[p.cpu() for p in ps], grads=[g.cpu() for g in gs], lr=0.1, wd=0.1)],
                             max_norm=1.0)
    work = [p.clone() for p in ps]
    st = ops.nar_step_(work, gs, lr=0.1, weight_decay=0.1, max_norm=1.0)
    assert st.norm.device == torch.device("cuda:0")
    for p, e in zip(work, oracle[0]):
        torch.testing.assert_close(p.cpu().double(), e, rtol=2e-6, atol=2e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("home", ["cpu", "cuda"])
def test_groups_on_cpu_and_cuda(home):
    """One norm over a CPU part and a CUDA part, either first (the home of the norm),
    with GradScaler's CUDA scale and flag and a CUDA lr read by the CPU part: every
    copy that lands on the CPU is complete before the CPU kernel reads it (a
    non-blocking device-to-host copy would hand it memory still being filled)."""
    torch.manual_seed(14)
    devices = ["cpu", "cuda"] if home == "cpu" else ["cuda", "cpu"]
    sizes = [300_001, 70_001]  # big enough that an unfinished copy would be visible
    ps = [torch.randn(n, device=d) for n, d in zip(sizes, devices)]
    gs = [torch.randn_like(p) * 4.0 for p in ps]
    scale = torch.full((), 4.0, device="cuda")
    oracle, n, s = fp64_step([dict(params=[ps[0].cpu()], grads=[gs[0].cpu()], lr=0.05, wd=0.1),
                              dict(params=[ps[1].cpu()], grads=[gs[1].cpu()], lr=0.02, wd=0.0)],
                             max_norm=1.0, grad_scale=4.0)
    for _ in range(3):  # a queued copy is lost only sometimes: repeat
        work = [p.clone() for p in ps]
        torch.cuda.synchronize()
        torch.cuda._sleep(10_000_000)  # keep the stream busy, so an early read sees unfinished copies
        st = ops.nar_step_groups_([ops.NarGroup([work[0]], [gs[0]], lr=torch.tensor(0.05, device="cuda"),
                                                weight_decay=0.1),
                                   ops.NarGroup([work[1]], [gs[1]], lr=0.02, weight_decay=0.0)],
                                  max_norm=1.0, grad_scale=scale, found_inf=torch.zeros((), device="cuda"))
        assert st.norm.device.type == home
        assert math.isclose(float(st.norm), n, rel_tol=1e-5) and math.isclose(float(st.scale), s, rel_tol=1e-5)
        for p, e in zip(work, [oracle[0][0], oracle[1][0]]):
            torch.testing.assert_close(p.cpu().double(), e, rtol=2e-6, atol=2e-6)


# ----------------------------------------------------------------------- bad input
def test_bad_groups_name_the_argument_and_modify_nothing():
    ps = [torch.ones(4), torch.ones(3)]
    gs = [torch.ones(4), torch.ones(3)]
    work = [p.clone() for p in ps]
    cases = [
        ([ops.NarGroup(work[:1], gs[:1], 0.1), ops.NarGroup(work[1:], [torch.ones(5)], 0.1)],
         r"groups\[1\]\.grads\[0\] has shape"),
        ([ops.NarGroup(work[:1], gs[:1], 0.1), ops.NarGroup(work[1:], gs[1:], -1.0)], r"groups\[1\]\.lr"),
        ([ops.NarGroup(work[:1], gs[:1], 0.1), ops.NarGroup(work[1:], gs[1:], 0.1, momentum=0.9)],
         r"groups\[1\]\.momentum_buffers is required"),
        ([ops.NarGroup(work[:1], gs[:1], 0.1), dict(params=work[1:], grads=gs[1:])], r"groups\[1\] is missing"),
        ([ops.NarGroup(work[:1], gs[:1], torch.ones(2))], r"groups\[0\]\.lr as a tensor"),
        ([], "at least one tensor"),
        ([ops.NarGroup(work[:1], gs[:1], 0.1), ops.NarGroup([torch.ones(3, device="meta")],
                                                            [torch.ones(3, device="meta")], 0.1)],
         r"groups\[1\]\.params\[0\] is on meta"),
    ]
    for groups, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            ops.nar_step_groups_(groups, max_norm=1.0)
        assert all(torch.equal(a, b) for a, b in zip(work, ps))
    with pytest.raises(ValueError, match="max_norm"):
        ops.nar_step_groups_([ops.NarGroup(work, gs, 0.1)], max_norm=0.0)
    with pytest.raises(ValueError, match="mode"):
        ops.nar_step_groups_([ops.NarGroup(work, gs, 0.1)], mode="clip")


def test_optimizer_scope_needs_one_max_norm_mode_backend():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    for key, value in (("max_norm", 3.0), ("mode", "grad"), ("backend", "reference")):
        with pytest.raises(ValueError, match=f"{key} must be the same in every group"):
            FedNAR([{"params": [a]}, {"params": [b], key: value}], lr=0.1)
        FedNAR([{"params": [a]}, {"params": [b], key: value}], lr=0.1, clip_scope="group")  # fine per group
    opt = FedNAR([a], lr=0.1)
    with pytest.raises(ValueError, match="max_norm must be the same"):
        opt.add_param_group({"params": [b], "max_norm": 1.0})
    assert len(opt.param_groups) == 1 and len(opt.last_stats) == 1  # the rejected group is not kept
    with pytest.raises(ValueError, match="clip_scope must be one of"):
        FedNAR([a], lr=0.1, clip_scope="model")


def test_a_part_without_elements_takes_the_shared_norm(backend):
    """A group whose tensors are all empty runs both passes with no chunk: it adds 0 to
    the norm and steps nothing, the other group steps with the shared norm; with a NaN
    in the other group both report the skip."""
    name, device = backend
    torch.manual_seed(14)
    x, g = torch.randn(300, device=device), torch.randn(300, device=device)
    work, empty = x.clone(), torch.empty(0, device=device).to(torch.bfloat16)
    st = ops.nar_step_groups_([ops.NarGroup([work], [g], 0.1, 0.2), ops.NarGroup([empty], [empty.clone()], 0.3)],
                              max_norm=1.0, backend=name)
    oracle, n, s = fp64_step([dict(params=[x], grads=[g], lr=0.1, wd=0.2)], max_norm=1.0)
    torch.testing.assert_close(work.double(), oracle[0][0], rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(st.norm.double(), torch.tensor(n, dtype=torch.float64, device=device), rtol=1e-6,
                               atol=0)
    g[3] = math.nan
    work = x.clone()
    st = ops.nar_step_groups_([ops.NarGroup([empty], [empty.clone()], 0.3), ops.NarGroup([work], [g], 0.1, 0.2)],
                              max_norm=1.0, backend=name)
    assert bool(st.skipped) and torch.equal(work, x)
