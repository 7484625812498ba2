"""The raw C++ ops (``torch.ops.fedopt_C.*``) refuse bad input themselves, on the CPU
and on CUDA, with a message naming the argument, and write nothing.

The public ops validate first, but the raw ops are reachable (``torch.ops``, a custom
op under torch.compile, a future caller) and are the last line of defence against an
out-of-bounds kernel.  One table of cases runs on every device that has the kernels:
here the CPU; on a GPU machine CUDA too (skipped here, saying so)."""

from __future__ import annotations

import pytest
import torch

from conftest import require_backend

def ops():
    require_backend("cpu")  # loads the extension (its absence fails)
    return torch.ops.fedopt_C


def nar(d, params, grads, bufs=(), mode=0, momentum=0.0):
    return ops().nar_step_(list(params), list(grads), list(bufs), 0.1, None, 0.01, None, 1.0, mode, momentum,
                           None, None)


def batched(d, X, G, B=None, momentum=0.0):
    return ops().nar_step_batched_(X, G, B, 0.1, None, 0.01, None, 1.0, 0, momentum, None, None)


def server(d, params, updates, rule=0, m=(), v=()):
    return ops().server_update_(list(params), list(updates), list(m), list(v), rule, 0.1, None, 1.0, None, 0.9,
                                0.99, 1e-3, False, None)


def agg(d, clients, weights, out):
    return ops().aggregate(list(clients), weights, 1.0, None, out, None)


def t(d, *shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype).to(d)


# (id, builds (call, tensors that must stay unchanged) for a device, regex both devices' messages match)
CASES = [
    ("nar_grads_count", lambda d: ((p := [t(d, 4), t(d, 3)]), lambda: nar(d, p, [t(d, 4)])), r"grads"),
    # (with no tensor at all the dispatcher refuses before any kernel: it names the list)
    ("nar_empty_params", lambda d: ([], lambda: nar(d, [], [])), r"params must|empty list of Tensors"),
    ("nar_bad_mode", lambda d: ((p := [t(d, 4)]), lambda: nar(d, p, [t(d, 4)], mode=5)),
     r"mode must be 0 \(co\), 1 \(grad\) or 2 \(none\), got 5"),
    ("nar_momentum_without_buffers", lambda d: ((p := [t(d, 4)]), lambda: nar(d, p, [t(d, 4)], momentum=0.9)),
     r"momentum"),
    ("nar_grad_dtype", lambda d: ((p := [t(d, 4)]), lambda: nar(d, p, [t(d, 4, dtype=torch.float64)])),
     r"grads(\[0\])? has dtype"),
    ("nar_grad_numel", lambda d: ((p := [t(d, 4)]), lambda: nar(d, p, [t(d, 5)])), r"grads"),
    ("nar_grad_layout", lambda d: ((p := [t(d, 3, 5)]), lambda: nar(d, p, [t(d, 5, 3).t()])), r"grads"),
    ("nar_buffer_dtype", lambda d: ((p := [t(d, 4)]), lambda: nar(d, p, [t(d, 4)], [t(d, 4, dtype=torch.float16)],
                                                                   momentum=0.9)), r"momentum_buffers"),
    ("nar_int_params", lambda d: ((p := [torch.ones(4, dtype=torch.int32, device=d)]),
                                  lambda: nar(d, p, [torch.ones(4, dtype=torch.int32, device=d)])),
     r"unsupported dtype"),
    ("batched_shape", lambda d: ((p := [t(d, 2, 5)]), lambda: batched(d, p[0], t(d, 2, 4))), r"grads"),
    ("batched_momentum_without_buffers", lambda d: ((p := [t(d, 2, 5)]),
                                                     lambda: batched(d, p[0], t(d, 2, 5), momentum=0.9)),
     r"momentum"),
    ("batched_not_contiguous", lambda d: ((p := [t(d, 5, 2)]), lambda: batched(d, p[0].t(), t(d, 2, 5))),
     r"contiguous"),
    ("server_bad_rule", lambda d: ((p := [t(d, 4)]), lambda: server(d, p, [t(d, 4)], rule=7)),
     r"rule must be 0 \(sgd\)"),
    ("server_updates_count", lambda d: ((p := [t(d, 4), t(d, 2)]), lambda: server(d, p, [t(d, 4)])), r"updates"),
    ("server_adam_without_state", lambda d: ((p := [t(d, 4)]), lambda: server(d, p, [t(d, 4)], rule=3)),
     r"exp_avg"),
    ("server_update_dtype", lambda d: ((p := [t(d, 4)]), lambda: server(d, p, [t(d, 4, dtype=torch.float16)])),
     r"updates(\[0\])? has dtype"),
    ("aggregate_weights_count", lambda d: ((o := [torch.zeros(6, device=d)]),
                                            lambda: agg(d, [t(d, 6), t(d, 6)], t(d, 3), o[0])), r"weights"),
    ("aggregate_no_clients", lambda d: ((o := [torch.zeros(6, device=d)]),
                                         lambda: agg(d, [], t(d, 0), o[0])), r"clients must hold"),
    ("aggregate_out_length", lambda d: ((o := [torch.zeros(5, device=d)]),
                                         lambda: agg(d, [t(d, 6), t(d, 6)], t(d, 2), o[0])), r"out"),
]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_raw_op_refuses_bad_input_and_writes_nothing(case, device):
    if device == "cuda":
        require_backend("cuda")  # skips here (no GPU), saying so; runs on a GPU machine
    _, build, match = case
    kept, call = build(torch.device(device))
    before = [x.clone() for x in kept]
    with pytest.raises(RuntimeError, match=match):
        call()
    assert all(torch.equal(a, b) for a, b in zip(kept, before))


def test_cuda_ops_refuse_tensors_on_two_devices():
    """params on the GPU with a CPU gradient: named, nothing written."""
    require_backend("cuda")
    p = [torch.randn(4, device="cuda")]
    before = p[0].clone()
    with pytest.raises(RuntimeError, match=r"grads\[0\] is on cpu"):
        nar("cuda", p, [torch.randn(4)])
    assert torch.equal(p[0], before)
