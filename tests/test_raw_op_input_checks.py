"""Input checks of the raw C++ ops (``torch.ops.fedopt_C.*``) on the CPU and on CUDA.

The public ops validate first, but the raw ops stay reachable (``torch.ops``, a custom
op under torch.compile, a future caller) and are the last guard before a kernel reads
out of bounds.  Every case here calls one raw op with one bad argument and checks that
the kernel itself refuses it: a RuntimeError from ``fedopt_C`` whose message names the
argument (and what was wrong), with nothing written.

``CASES`` is one table for both devices: the same bad input, a pattern that matches the
CPU kernel's message (csrc/cpu) and the CUDA kernel's (csrc/cuda), which word things
differently.  It runs on the CPU here and on CUDA on a GPU machine (skipped here, saying
so).  ``CUDA_CASES`` are checks only the CUDA kernels have: tensors on two devices (a
CPU op never sees a CUDA tensor: the dispatcher picks the CUDA kernel when one is
present).  Both devices refuse data of an unsupported dtype naming the argument
(``params has unsupported dtype Int``) and hyperparameter tensors or weights of an
integer dtype (``lr_tensor must be floating point, got Int``).

A raw op with no tensor at all cannot be dispatched, so the empty-list cases pass one
tensor elsewhere (``lr_tensor``, ``out``, ``g``, ``updates``) to reach the kernel.
"""

from __future__ import annotations

import pytest
import torch

from conftest import require_backend

F32, F64, F16 = torch.float32, torch.float64, torch.float16


def ops():
    return torch.ops.fedopt_C


def t(d, *shape, dtype=F32):
    """A deterministic tensor of ``shape`` on ``d`` (values irrelevant, but fixed)."""
    g = torch.Generator().manual_seed(sum(shape) + 7 * len(shape))
    if not dtype.is_floating_point:
        return torch.ones(*shape, dtype=dtype, device=d)
    return torch.randn(*shape, generator=g).to(dtype).to(d)


def s(d, value=0.5, n=None, dtype=F32):
    """A hyperparameter tensor: 0-d, or ``n`` values."""
    return torch.full(() if n is None else (n,), value, dtype=dtype, device=d)


# The raw ops with their schemas' positional arguments (csrc/registration.cpp); every
# hyperparameter not under test is a valid float.
def nar(p, g, b=(), *, mode=0, momentum=0.0, lr_t=None, wd_t=None, gs=None, fi=None):
    return ops().nar_step_(list(p), list(g), list(b), 0.1, lr_t, 0.01, wd_t, 1.0, mode, momentum, gs, fi)


def sq_norm(p, g, *, mode=0, wd_t=None, gs=None):
    return ops().nar_sq_norm(list(p), list(g), 0.01, wd_t, mode, gs)


def apply(p, g, sq, b=(), *, mode=0, momentum=0.0):
    return ops().nar_apply_(list(p), list(g), list(b), sq, 0.1, None, 0.01, None, 1.0, mode, momentum, None, None)


def batched(X, G, B=None, *, mode=0, momentum=0.0, lr_t=None):
    return ops().nar_step_batched_(X, G, B, 0.1, lr_t, 0.01, None, 1.0, mode, momentum, None, None)


def agg(clients, w, out, *, gamma_t=None, skip=None):
    return ops().aggregate(list(clients), w, 1.0, gamma_t, out, skip)


def dots(clients, g):
    return ops().client_dots(list(clients), g)


def server(p, u, m=(), v=(), *, rule=0, lr_t=None, skip=None):
    return ops().server_update_(list(p), list(u), list(m), list(v), rule, 0.1, lr_t, 1.0, None, 0.9, 0.99, 1e-3,
                                False, skip)


CASES, CUDA_CASES = {}, {}


def case(match: str, arg: str, table=CASES):
    """Register ``fn(d) -> (call, tensors the call must leave unchanged)``: the call must
    raise a fedopt_C RuntimeError matching ``match`` that contains ``arg``."""
    def register(fn):
        table[fn.__name__] = (fn, match, arg)
        return fn
    return register


def cuda_case(match, arg):
    return case(match, arg, CUDA_CASES)


# ------------------------------------------------------------------ nar_step_
@case(r"params must (not be empty|hold at least one tensor)", "params")
def nar_empty_params(d):
    return (lambda: nar([], [], lr_t=s(d))), []


@case(r"1 grads for 2 params|grads has 1 tensors but params has 2", "grads")
def nar_grads_count(d):
    p = [t(d, 4), t(d, 3)]
    return (lambda: nar(p, [t(d, 4)])), p


@case(r"0 momentum_buffers for 1 params|momentum = 0.9 needs one momentum buffer per param, got 0", "momentum")
def nar_momentum_without_buffers(d):
    p = [t(d, 4)]
    return (lambda: nar(p, [t(d, 4)], momentum=0.9)), p


@case(r"mode must be 0 \(co\), 1 \(grad\) or 2 \(none\), got 5", "mode")
def nar_bad_mode(d):
    p = [t(d, 4)]
    return (lambda: nar(p, [t(d, 4)], mode=5)), p


@case(r"grads(\[0\])? has dtype Double", "grads")
def nar_grad_dtype(d):
    p = [t(d, 4)]
    return (lambda: nar(p, [t(d, 4, dtype=F64)])), p


@case(r"params(\[1\])? has dtype Double", "params")
def nar_params_of_two_dtypes(d):
    p = [t(d, 4), t(d, 3, dtype=F64)]
    return (lambda: nar(p, [t(d, 4), t(d, 3, dtype=F64)])), p


@case(r"grads(\[0\])? (has 5 elements, expected 4|\(sizes \[5\], strides \[1\]\) does not match params\[0\])",
      "grads")
def nar_grad_numel(d):
    p = [t(d, 4)]
    return (lambda: nar(p, [t(d, 5)])), p


@case(r"grads(\[0\])? (must have the same strides as its param|\(sizes \[3, 5\], strides \[1, 3\]\) does not match)",
      "grads")
def nar_grad_other_strides(d):
    p = [t(d, 3, 5)]
    return (lambda: nar(p, [t(d, 5, 3).t()])), p


@case(r"grads(\[0\])? must be dense", "grads")
def nar_grad_with_gaps(d):
    p = [t(d, 4)]
    return (lambda: nar(p, [t(d, 8)[::2]])), p


@case(r"momentum_buffers(\[0\])? has dtype Half", "momentum_buffers")
def nar_buffer_dtype(d):
    p, b = [t(d, 4)], [t(d, 4, dtype=F16)]
    return (lambda: nar(p, [t(d, 4)], b, momentum=0.9)), p + b


@case(r"momentum_buffers(\[0\])? (must have the same strides as its param|does not match params\[0\])",
      "momentum_buffers")
def nar_buffer_other_strides(d):
    p, b = [t(d, 3, 5)], [t(d, 5, 3).t()]
    return (lambda: nar(p, [t(d, 3, 5)], b, momentum=0.9)), p + b


@case(r"params has unsupported dtype Int \(expected float16, bfloat16, float32 or float64\)", "params")
def nar_integer_params(d):
    p = [t(d, 4, dtype=torch.int32)]
    return (lambda: nar(p, [t(d, 4, dtype=torch.int32)])), p


@case(r"lr_tensor must be floating point, got Int", "lr_tensor")
def nar_integer_lr_tensor(d):
    p = [t(d, 4)]
    return (lambda: nar(p, [t(d, 4)], lr_t=s(d, 1, dtype=torch.int32))), p


@case(r"weight_decay_tensor must be floating point, got Long", "weight_decay_tensor")
def nar_integer_weight_decay_tensor(d):
    p = [t(d, 4)]
    return (lambda: nar(p, [t(d, 4)], wd_t=s(d, 0, dtype=torch.int64))), p


@case(r"grad_scale must be floating point, got Int", "grad_scale")
def nar_integer_grad_scale(d):
    p = [t(d, 4)]
    return (lambda: nar(p, [t(d, 4)], gs=s(d, 2, dtype=torch.int32))), p


@case(r"lr_tensor must have one element, got (2|shape \[2\])", "lr_tensor")
def nar_lr_tensor_of_two(d):
    p = [t(d, 4)]
    return (lambda: nar(p, [t(d, 4)], lr_t=s(d, n=2))), p


@case(r"weight_decay_tensor must have one element, got (3|shape \[3\])", "weight_decay_tensor")
def nar_weight_decay_tensor_of_three(d):
    p = [t(d, 4)]
    return (lambda: nar(p, [t(d, 4)], wd_t=s(d, n=3))), p


@case(r"grad_scale must have one element, got (2|shape \[2\])", "grad_scale")
def nar_grad_scale_of_two(d):
    p = [t(d, 4)]
    return (lambda: nar(p, [t(d, 4)], gs=s(d, 2.0, n=2))), p


@case(r"found_inf must have one element, got (2|shape \[2\])", "found_inf")
def nar_found_inf_of_two(d):
    p = [t(d, 4)]
    return (lambda: nar(p, [t(d, 4)], fi=s(d, 0.0, n=2))), p


# ------------------------------------------------------------------ nar_sq_norm / nar_apply_
@case(r"nar_sq_norm.*(1 grads for 2 params|grads has 1 tensors but params has 2)", "grads")
def sq_norm_grads_count(d):
    p = [t(d, 4), t(d, 3)]
    return (lambda: sq_norm(p, [t(d, 4)])), p


@case(r"mode must be 0 \(co\), 1 \(grad\) or 2 \(none\), got -1", "mode")
def sq_norm_bad_mode(d):
    p = [t(d, 4)]
    return (lambda: sq_norm(p, [t(d, 4)], mode=-1)), p


@case(r"grad_scale must have one element", "grad_scale")
def sq_norm_grad_scale_of_two(d):
    p = [t(d, 4)]
    return (lambda: sq_norm(p, [t(d, 4)], gs=s(d, 2.0, n=2))), p


@case(r"sq_norm must be a one-element", "sq_norm")
def apply_sq_norm_of_two(d):
    p = [t(d, 4)]
    return (lambda: apply(p, [t(d, 4)], s(d, 1.0, n=2))), p


@case(r"grads(\[0\])? has dtype Half", "grads")
def apply_grad_dtype(d):
    p = [t(d, 4)]
    return (lambda: apply(p, [t(d, 4, dtype=F16)], s(d, 1.0))), p


@case(r"nar_apply_.*(0 momentum_buffers for 2 params|needs one momentum buffer per param, got 0)", "momentum")
def apply_momentum_without_buffers(d):
    p = [t(d, 4), t(d, 3)]
    return (lambda: apply(p, [t(d, 4), t(d, 3)], s(d, 1.0), momentum=0.5)), p


# ------------------------------------------------------------------ nar_step_batched_
@case(r"grads (has 8 elements, expected 10|must be a contiguous \[2, 5\] Float tensor)", "grads")
def batched_grads_shape(d):
    X = t(d, 2, 5)
    return (lambda: batched(X, t(d, 2, 4))), [X]


@case(r"grads (has dtype Double|must be a contiguous \[2, 5\] Float tensor .*got \[2, 5\] Double)", "grads")
def batched_grads_dtype(d):
    X = t(d, 2, 5)
    return (lambda: batched(X, t(d, 2, 5, dtype=F64))), [X]


@case(r"grads (must have the same strides as its param|must be a contiguous \[2, 5\] .*\(not contiguous\))", "grads")
def batched_grads_transposed(d):
    X = t(d, 2, 5)
    return (lambda: batched(X, t(d, 5, 2).t())), [X]


@case(r"params must be (a contiguous )?\[C, N\]", "params")
def batched_params_1d(d):
    X = t(d, 5)
    return (lambda: batched(X, t(d, 5))), [X]


@case(r"params must be (a )?contiguous", "params")
def batched_params_not_contiguous(d):
    X = t(d, 5, 2).t()
    return (lambda: batched(X, t(d, 2, 5))), [X]


@case(r"momentum_buffers is required when momentum != 0|momentum = 0.9 needs momentum_buffers", "momentum_buffers")
def batched_momentum_without_buffers(d):
    X = t(d, 2, 5)
    return (lambda: batched(X, t(d, 2, 5), momentum=0.9)), [X]


@case(r"momentum_buffers (has dtype Half|must be a contiguous \[2, 5\] Float tensor .*got \[2, 5\] Half)",
      "momentum_buffers")
def batched_buffer_dtype(d):
    X, B = t(d, 2, 5), t(d, 2, 5, dtype=F16)
    return (lambda: batched(X, t(d, 2, 5), B, momentum=0.9)), [X, B]


@case(r"lr_tensor must have one element or one per row( \(2 rows\))?, got (3 elements|shape \[3\])", "lr_tensor")
def batched_lr_tensor_of_three_for_two_rows(d):
    X = t(d, 2, 5)
    return (lambda: batched(X, t(d, 2, 5), lr_t=s(d, n=3))), [X]


@case(r"mode must be 0 \(co\), 1 \(grad\) or 2 \(none\), got 3", "mode")
def batched_bad_mode(d):
    X = t(d, 2, 5)
    return (lambda: batched(X, t(d, 2, 5), mode=3)), [X]


@case(r"params has unsupported dtype Long", "params")
def batched_integer_params(d):
    X = t(d, 2, 5, dtype=torch.int64)
    return (lambda: batched(X, t(d, 2, 5, dtype=torch.int64))), [X]


@case(r"lr_tensor must be floating point, got Int", "lr_tensor")
def batched_integer_lr_tensor_per_row(d):
    X = t(d, 2, 5)
    return (lambda: batched(X, t(d, 2, 5), lr_t=s(d, 1, n=2, dtype=torch.int32))), [X]


# ------------------------------------------------------------------ aggregate / client_dots
@case(r"clients must hold", "clients")
def agg_no_clients(d):
    out = torch.zeros(6, device=d)
    return (lambda: agg([], t(d, 0), out)), [out]


@case(r"weights must (be a CPU tensor of 2 elements, got 3|hold 2 values)", "weights")
def agg_weights_count(d):
    out = torch.zeros(6, device=d)
    return (lambda: agg([t(d, 6), t(d, 6)], t(d, 3), out)), [out]


@case(r"out must (have 6 elements, got 5|be a contiguous \[6\] vector, got sizes \[5\])", "out")
def agg_out_length(d):
    out = torch.zeros(5, device=d)
    return (lambda: agg([t(d, 6), t(d, 6)], t(d, 2), out)), [out]


@case(r"out must have dtype Float or Float, got Half", "out")
def agg_out_dtype(d):
    out = torch.zeros(6, dtype=F16, device=d)
    return (lambda: agg([t(d, 6), t(d, 6)], t(d, 2), out)), [out]


@case(r"out must (be dense and non-overlapping|be a contiguous \[6\] vector, got sizes \[6\] strides \[2\])", "out")
def agg_out_with_gaps(d):
    base = torch.zeros(12, device=d)
    return (lambda: agg([t(d, 6), t(d, 6)], t(d, 2), base[::2])), [base]


@case(r"clients as a \[C, N\] tensor must be contiguous", "clients")
def agg_2d_clients_not_contiguous(d):
    out = torch.zeros(6, device=d)
    return (lambda: agg([t(d, 6, 2).t()], t(d, 2), out)), [out]


@case(r"clients(\[1\])? must (all have 6 elements, got 5|be a contiguous vector of length 6)", "clients")
def agg_clients_of_two_lengths(d):
    out = torch.zeros(6, device=d)
    return (lambda: agg([t(d, 6), t(d, 5)], t(d, 2), out)), [out]


@case(r"clients(\[1\])? (has dtype Double|must be a Float tensor)", "clients")
def agg_clients_of_two_dtypes(d):
    out = torch.zeros(6, device=d)
    return (lambda: agg([t(d, 6), t(d, 6, dtype=F64)], t(d, 2), out)), [out]


@case(r"clients(\[0\])? (given as a list must be 1-D|must be a contiguous vector of length 6, got sizes \[2, 3\])",
      "clients")
def agg_2d_tensor_in_a_list(d):
    out = torch.zeros(6, device=d)
    return (lambda: agg([t(d, 2, 3), t(d, 6)], t(d, 2), out)), [out]


@case(r"clients has unsupported dtype Int", "clients")
def agg_integer_clients(d):
    out = torch.zeros(6, dtype=torch.int32, device=d)
    return (lambda: agg([t(d, 2, 6, dtype=torch.int32)], t(d, 2), out)), [out]


@case(r"clients has unsupported dtype Short", "clients")
def agg_integer_client_list(d):
    out = torch.zeros(6, device=d)
    return (lambda: agg([t(d, 6, dtype=torch.int16), t(d, 6, dtype=torch.int16)], t(d, 2), out)), [out]


@case(r"weights must be floating point, got Int", "weights")
def agg_integer_weights(d):
    out = torch.zeros(6, device=d)
    return (lambda: agg([t(d, 6), t(d, 6)], t(d, 2, dtype=torch.int32), out)), [out]


@case(r"gamma_tensor must be floating point, got Long", "gamma_tensor")
def agg_integer_gamma_tensor(d):
    out = torch.zeros(6, device=d)
    return (lambda: agg([t(d, 6), t(d, 6)], t(d, 2), out, gamma_t=s(d, 1, dtype=torch.int64))), [out]


@case(r"skip must be a one-element", "skip")
def agg_skip_of_two(d):
    out = torch.zeros(6, device=d)
    return (lambda: agg([t(d, 6), t(d, 6)], t(d, 2), out, skip=torch.zeros(2, dtype=torch.bool, device=d))), [out]


@case(r"gamma_tensor must have one element, got (2|shape \[2\])", "gamma_tensor")
def agg_gamma_tensor_of_two(d):
    out = torch.zeros(6, device=d)
    return (lambda: agg([t(d, 6), t(d, 6)], t(d, 2), out, gamma_t=s(d, n=2))), [out]


@case(r"clients must hold", "clients")
def dots_no_clients(d):
    return (lambda: dots([], t(d, 6))), []


@case(r"g must (have 6 elements, got 5|be a contiguous \[6\] vector, got sizes \[5\])", "g")
def dots_g_length(d):
    X = t(d, 3, 6)
    return (lambda: dots([X], t(d, 5))), [X]


@case(r"g must have dtype Float or Float, got Half", "g")
def dots_g_dtype(d):
    X = t(d, 3, 6)
    return (lambda: dots([X], t(d, 6, dtype=F16))), [X]


@case(r"clients has unsupported dtype Int", "clients")
def dots_integer_clients(d):
    X = t(d, 3, 6, dtype=torch.int32)
    return (lambda: dots([X], t(d, 6))), [X]


# ------------------------------------------------------------------ server_update_
@case(r"rule must be 0 \(sgd\), 1 \(momentum\), 2 \(adagrad\), 3 \(adam\) or 4 \(yogi\), got 7", "rule")
def server_bad_rule(d):
    p = [t(d, 4)]
    return (lambda: server(p, [t(d, 4)], rule=7)), p


@case(r"1 updates for 2 params", "updates")
def server_updates_count(d):
    p = [t(d, 4), t(d, 3)]
    return (lambda: server(p, [t(d, 4)])), p


@case(r"1 updates for 0 params", "updates")
def server_empty_params(d):
    u = [t(d, 4)]
    return (lambda: server([], u)), u


@case(r"0 exp_avg for 1 params|rule 3 needs one exp_avg per param, got 0 for 1 params", "exp_avg")
def server_adam_without_exp_avg(d):
    p = [t(d, 4)]
    return (lambda: server(p, [t(d, 4)], rule=3)), p


@case(r"0 exp_avg_sq for 1 params|rule 4 needs one exp_avg_sq per param, got 0 for 1 params", "exp_avg_sq")
def server_yogi_without_exp_avg_sq(d):
    p, m = [t(d, 4)], [t(d, 4)]
    return (lambda: server(p, [t(d, 4)], m, rule=4)), p + m


@case(r"updates(\[0\])? has dtype Half, expected Float", "updates")
def server_updates_dtype(d):
    p = [t(d, 4)]
    return (lambda: server(p, [t(d, 4, dtype=F16)])), p


@case(r"params(\[1\])? has dtype Double, expected Float", "params")
def server_params_of_two_dtypes(d):
    p = [t(d, 4), t(d, 3, dtype=F64)]
    return (lambda: server(p, [t(d, 4), t(d, 3)])), p


@case(r"updates(\[0\])? has 3 elements", "updates")
def server_updates_numel(d):
    p = [t(d, 4)]
    return (lambda: server(p, [t(d, 3)])), p


@case(r"params(\[0\])? must be contiguous", "params")
def server_params_not_contiguous(d):
    p = [t(d, 5, 3).t()]
    return (lambda: server(p, [t(d, 15)])), p


@case(r"updates(\[0\])? must be contiguous", "updates")
def server_updates_not_contiguous(d):
    p = [t(d, 3, 5)]
    return (lambda: server(p, [t(d, 5, 3).t()])), p


@case(r"exp_avg(\[0\])? has dtype Half, expected Float", "exp_avg")
def server_exp_avg_dtype(d):
    p, m = [t(d, 4)], [t(d, 4, dtype=F16)]
    return (lambda: server(p, [t(d, 4)], m, rule=1)), p + m


@case(r"exp_avg_sq(\[0\])? has 5 elements", "exp_avg_sq")
def server_exp_avg_sq_numel(d):
    p, m, v = [t(d, 4)], [t(d, 4)], [t(d, 5)]
    return (lambda: server(p, [t(d, 4)], m, v, rule=3)), p + m + v


@case(r"skip must have one element, got (2|shape \[2\])", "skip")
def server_skip_of_two(d):
    p = [t(d, 4)]
    return (lambda: server(p, [t(d, 4)], skip=torch.zeros(2, dtype=torch.bool, device=d))), p


@case(r"lr_tensor must have one element, got (2|shape \[2\])", "lr_tensor")
def server_lr_tensor_of_two(d):
    p = [t(d, 4)]
    return (lambda: server(p, [t(d, 4)], lr_t=s(d, n=2))), p


@case(r"params has unsupported dtype Int", "params")
def server_integer_params(d):
    p = [t(d, 4, dtype=torch.int32)]
    return (lambda: server(p, [t(d, 4)])), p


# Refused even when the step is skipped (the CPU kernel used to return before reading it).
@case(r"lr_tensor must be floating point, got Int", "lr_tensor")
def server_integer_lr_tensor(d):
    p = [t(d, 4)]
    return (lambda: server(p, [t(d, 4)], lr_t=s(d, 1, dtype=torch.int32),
                           skip=torch.ones((), dtype=torch.bool, device=d))), p


# ------------------------------------------------------------------ CUDA only
CPU = torch.device("cpu")


@cuda_case(r"params must be CUDA tensors, got cpu", "params")
def nar_params_on_the_cpu(d):
    p = [t(CPU, 4)]
    return (lambda: nar(p, [t(d, 4)])), p


@cuda_case(r"grads\[0\] is on cpu but params\[0\] is on cuda", "grads")
def nar_grad_on_the_cpu(d):
    p = [t(d, 4)]
    return (lambda: nar(p, [t(CPU, 4)])), p


@cuda_case(r"params\[1\] is on cpu but params\[0\] is on cuda", "params")
def nar_second_param_on_the_cpu(d):
    p = [t(d, 4), t(CPU, 3)]
    return (lambda: nar(p, [t(d, 4), t(CPU, 3)])), p


@cuda_case(r"momentum_buffers\[0\] is on cpu but params\[0\] is on cuda", "momentum_buffers")
def nar_buffer_on_the_cpu(d):
    p, b = [t(d, 4)], [t(CPU, 4)]
    return (lambda: nar(p, [t(d, 4)], b, momentum=0.9)), p + b


@cuda_case(r"lr_tensor is on cpu but the data is on cuda", "lr_tensor")
def nar_lr_tensor_on_the_cpu(d):
    p = [t(d, 4)]
    return (lambda: nar(p, [t(d, 4)], lr_t=s(CPU))), p


@cuda_case(r"weight_decay_tensor is on cpu but the data is on cuda", "weight_decay_tensor")
def nar_weight_decay_tensor_on_the_cpu(d):
    p = [t(d, 4)]
    return (lambda: nar(p, [t(d, 4)], wd_t=s(CPU))), p


@cuda_case(r"grad_scale is on cpu but the data is on cuda", "grad_scale")
def nar_grad_scale_on_the_cpu(d):
    p = [t(d, 4)]
    return (lambda: nar(p, [t(d, 4)], gs=s(CPU, 2.0))), p


@cuda_case(r"found_inf is on cpu but the data is on cuda", "found_inf")
def nar_found_inf_on_the_cpu(d):
    p = [t(d, 4)]
    return (lambda: nar(p, [t(d, 4)], fi=s(CPU, 0.0))), p


@cuda_case(r"sq_norm is on cpu but the data is on cuda", "sq_norm")
def apply_sq_norm_on_the_cpu(d):
    p = [t(d, 4)]
    return (lambda: apply(p, [t(d, 4)], s(CPU, 1.0))), p


@cuda_case(r"grads must be a contiguous \[2, 5\] Float tensor on cuda:\d+, got \[2, 5\] Float on cpu", "grads")
def batched_grads_on_the_cpu(d):
    X = t(d, 2, 5)
    return (lambda: batched(X, t(CPU, 2, 5))), [X]


@cuda_case(r"momentum_buffers must be a contiguous \[2, 5\] Float tensor on cuda:\d+, got \[2, 5\] Float on cpu",
           "momentum_buffers")
def batched_buffers_on_the_cpu(d):
    X, B = t(d, 2, 5), t(CPU, 2, 5)
    return (lambda: batched(X, t(d, 2, 5), B, momentum=0.9)), [X, B]


@cuda_case(r"clients must be CUDA tensors", "clients")
def agg_clients_on_the_cpu(d):
    out = torch.zeros(6, device=d)
    return (lambda: agg([t(CPU, 6), t(CPU, 6)], t(d, 2), out)), [out]


@cuda_case(r"clients\[1\] must be a Float tensor on cuda", "clients")
def agg_second_client_on_the_cpu(d):
    out = torch.zeros(6, device=d)
    return (lambda: agg([t(d, 6), t(CPU, 6)], t(d, 2), out)), [out]


@cuda_case(r"out must be on cuda", "out")
def agg_out_on_the_cpu(d):
    out = torch.zeros(6)
    return (lambda: agg([t(d, 6), t(d, 6)], t(d, 2), out)), [out]


@cuda_case(r"weights must hold 2 values on cuda", "weights")
def agg_weights_on_the_cpu(d):
    out = torch.zeros(6, device=d)
    return (lambda: agg([t(d, 6), t(d, 6)], t(CPU, 2), out)), [out]


@cuda_case(r"gamma_tensor is on cpu but the data is on cuda", "gamma_tensor")
def agg_gamma_tensor_on_the_cpu(d):
    out = torch.zeros(6, device=d)
    return (lambda: agg([t(d, 6), t(d, 6)], t(d, 2), out, gamma_t=s(CPU))), [out]


@cuda_case(r"skip must be a one-element tensor on cuda", "skip")
def agg_skip_on_the_cpu(d):
    out = torch.zeros(6, device=d)
    return (lambda: agg([t(d, 6), t(d, 6)], t(d, 2), out, skip=torch.zeros((), dtype=torch.bool))), [out]


@cuda_case(r"g must be on cuda", "g")
def dots_g_on_the_cpu(d):
    X = t(d, 3, 6)
    return (lambda: dots([X], t(CPU, 6))), [X]


@cuda_case(r"params must be CUDA tensors, got cpu", "params")
def server_params_on_the_cpu(d):
    p = [t(CPU, 4)]
    return (lambda: server(p, [t(d, 4)])), p


@cuda_case(r"updates\[0\] is on cpu but params\[0\] is on cuda", "updates")
def server_updates_on_the_cpu(d):
    p = [t(d, 4)]
    return (lambda: server(p, [t(CPU, 4)])), p


@cuda_case(r"exp_avg\[0\] is on cpu but params\[0\] is on cuda", "exp_avg")
def server_exp_avg_on_the_cpu(d):
    p, m = [t(d, 4)], [t(CPU, 4)]
    return (lambda: server(p, [t(d, 4)], m, rule=1)), p + m


@cuda_case(r"skip is on cpu but the data is on cuda", "skip")
def server_skip_on_the_cpu(d):
    p = [t(d, 4)]
    return (lambda: server(p, [t(d, 4)], skip=torch.zeros((), dtype=torch.bool))), p


@cuda_case(r"lr_tensor is on cpu but the data is on cuda", "lr_tensor")
def server_lr_tensor_on_the_cpu(d):
    p = [t(d, 4)]
    return (lambda: server(p, [t(d, 4)], lr_t=s(CPU))), p


# ------------------------------------------------------------------ the tests
def check_refused(build, match, arg, device):
    call, kept = build(device)
    before = [k.clone() for k in kept]
    with pytest.raises(RuntimeError, match=match) as info:
        call()
    message = str(info.value)
    assert "fedopt_C" in message, f"not the kernel's own check: {message}"
    assert arg in message, f"the message does not name {arg!r}: {message}"
    assert "1 or 1 " not in message, f"the message does not read sensibly: {message}"
    for k, b in zip(kept, before):
        assert torch.equal(k, b), "a refused call wrote to its tensors"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", list(CASES))
def test_raw_op_refuses_bad_input_naming_the_argument(name, device):
    """Same bad input on both devices: the CPU kernels here, the CUDA ones on a GPU."""
    check_refused(*CASES[name], require_backend(device))


@pytest.mark.parametrize("name", list(CUDA_CASES))
def test_raw_cuda_op_refuses_tensors_on_another_device(name):
    check_refused(*CUDA_CASES[name], require_backend("cuda"))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_same_calls_with_good_input_run(device):
    """The control: the helpers above, with every argument valid, run on each device, so
    each refusal above is due to its one bad argument and not to a malformed call."""
    d = require_backend(device)
    p, b = [t(d, 4), t(d, 3, 5)], [t(d, 4), t(d, 3, 5)]
    g = [t(d, 4), t(d, 3, 5)]
    nar(p, g, b, momentum=0.9, lr_t=s(d), wd_t=s(d), gs=s(d, 2.0), fi=s(d, 0.0))
    sq = sq_norm(p, g, wd_t=s(d), gs=s(d, 2.0))
    apply(p, g, sq, b, momentum=0.9)
    X = t(d, 2, 5)
    batched(X, t(d, 2, 5), t(d, 2, 5), momentum=0.9, lr_t=s(d, n=2))
    out = torch.zeros(6, device=d)
    agg([t(d, 6), t(d, 6)], t(d, 2), out, gamma_t=s(d), skip=torch.zeros((), dtype=torch.bool, device=d))
    dots([t(d, 3, 6)], t(d, 6))
    server(p, [t(d, 4), t(d, 15)], [t(d, 4), t(d, 3, 5)], [t(d, 4).abs(), t(d, 3, 5).abs()], rule=3, lr_t=s(d),
           skip=torch.zeros((), dtype=torch.bool, device=d))
    if d.type == "cuda":
        torch.cuda.synchronize()
