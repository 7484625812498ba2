"""Every backend of ``ops.aggregate`` (the reference one, i.e. python_ref, included)
against the fp64 oracle of tests/_fp64_oracle.py: the client counts of a real
round (1, 2, 20, 100), odd and large N, every dtype, the clients as ``[C, N]`` or as a
list, and the robustness contract (non-finite clients, norm bounding).

The backend contract's own cases (chunk tails, bitwise results, the skip flag) are in
test_contract_aggregate.py; what only one backend has (thread and ISA independence,
table layouts, launch rules) in test_cpu_kernels.py, test_triton_kernels.py and
test_cuda_extension.py.
"""

from __future__ import annotations

import pytest
import torch

import _fp64_oracle as fp64
from _fp64_oracle import acc_dtype as acc_of  # the accumulation dtype the op promises
from fedopt_kernels import backends, ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
CLIENTS = [1, 2, 20, 100]


def size_for(C, name):
    """An odd N that spans several of every backend's blocks and, on CPU, several
    stripes of column chunks; smaller where Triton runs in its (slow) interpreter and on
    the reference backend (python_ref: torch's own sums, no blocks or stripes to span)."""
    small = (name == "triton" and backends.triton_interpret_mode()) or name == "reference"
    if C == 100:
        return 4099 if small else 70001
    return 10007 if small else 140001


def make_clients(C, N, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(C, N, generator=gen, dtype=torch.float64)
    X = X * torch.logspace(-1, 1, C, dtype=torch.float64).unsqueeze(1)  # clients of different scales
    w = torch.rand(C, generator=gen, dtype=torch.float64) + 0.05  # not normalised
    return X.to(dtype).to(device), w.to(acc_of(dtype)).to(device)


def assert_out_close(out, out_r, dtype, X, w, gamma=1.0):
    """``out`` within the error of an ``acc_of(dtype)`` sum of C terms of the fp64 result:
    ``|out - out_r| <= C u_acc gamma sum_i |w_i X_i| + one rounding of the stored value``
    (the textbook bound of recursive summation; the kernels' fixed-order sums meet it)."""
    C = X.shape[0] if isinstance(X, torch.Tensor) else len(X)
    u_acc = torch.finfo(acc_of(dtype)).eps / 2
    u_out = torch.finfo(dtype).eps / 2
    mass = float(gamma) * sum(abs(float(a)) * fp64.f64(x).abs() for a, x in zip(fp64.f64(w), X))
    got, want = out.cpu().double(), out_r.double()
    bound = C * u_acc * mass + 2 * u_out * want.abs() + torch.finfo(dtype).tiny
    excess = (got - want).abs() - bound
    assert float(excess.max()) <= 0, (
        f"{int((excess > 0).sum())} of {got.numel()} elements outside the summation bound; worst at "
        f"{int(excess.argmax())}: got {float(got[excess.argmax()])}, fp64 {float(want[excess.argmax()])}")


def assert_norms_close(a, b, dtype):
    rtol = 1e-11 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(a.cpu().double(), torch.as_tensor(b, dtype=torch.float64), rtol=rtol, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("C", CLIENTS)
@pytest.mark.parametrize("as_list", [False, True], ids=["2d", "list"])
def test_matches_reference(backend, C, dtype, as_list):
    name, device = backend
    N = size_for(C, name)
    X, w = make_clients(C, N, dtype, device, seed=C)
    clients = [r.clone() for r in X] if as_list else X
    gamma = torch.tensor(0.9, dtype=acc_of(dtype), device=device) if C % 2 else 0.9

    out, st = ops.aggregate(clients, w, gamma=gamma, backend=name)

    out_r, q_r, Q_r = fp64.aggregate(X, w, 0.9)
    assert out.dtype == dtype and out.shape == (N,) and out.device.type == device.type
    assert st.client_sq_norms.dtype == acc_of(dtype) and st.client_sq_norms.shape == (C,)
    assert_out_close(out, out_r, dtype, X, w, 0.9)
    assert_norms_close(st.client_sq_norms, q_r, dtype)
    assert_norms_close(st.sq_norm, Q_r, dtype)
    assert not st.excluded.any() and not bool(st.all_excluded)
    torch.testing.assert_close(st.weights, w, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_nonfinite_clients_are_excluded(backend, dtype):
    name, device = backend
    C, N = 20, 1025
    X, w = make_clients(C, N, dtype, device, seed=5)
    X[3, 17] = float("nan")
    X[7, N - 1] = float("inf")
    X[12, 0] = -float("inf")
    out, st = ops.aggregate(X, w, backend=name)

    bad = torch.zeros(C, dtype=torch.bool)
    bad[[3, 7, 12]] = True
    assert torch.equal(st.excluded.cpu(), bad)
    kept = torch.where(bad.to(device), torch.zeros_like(w), w)
    eff = kept * (w.sum() / kept.sum())  # the excluded weight is spread over the rest
    torch.testing.assert_close(st.weights, eff, rtol=1e-6, atol=0)
    X_clean = torch.where(bad.to(device).unsqueeze(1), torch.zeros_like(X), X)
    out_r, _, Q_r = fp64.aggregate(X_clean, eff)
    assert torch.isfinite(out).all()
    assert_out_close(out, out_r, dtype, X_clean, eff)
    assert_norms_close(st.sq_norm, Q_r, dtype)


def test_all_clients_nonfinite_give_zeros(backend):
    name, device = backend
    X, w = make_clients(4, 333, torch.float32, device, seed=6)
    X[:, 5] = float("nan")
    out, st = ops.aggregate(X, w, backend=name)
    assert bool(st.all_excluded) and st.excluded.all()
    assert torch.equal(out.cpu(), torch.zeros(333))
    assert float(st.sq_norm) == 0.0


def test_norm_bounding_hand_computed(backend):
    """Client i is the constant vector c_i * 1 (norm |c_i| sqrt(N)); with M = 6 and
    N = 9 the clients of norm 3, 9 and 15 are scaled by 1, 6/9 and 6/15."""
    name, device = backend
    N = 9
    X = torch.tensor([[1.0] * N, [-3.0] * N, [5.0] * N], device=device)
    w = torch.tensor([0.5, 0.25, 0.25], device=device)
    out, st = ops.aggregate(X, w, max_client_norm=6.0, backend=name)
    scale = torch.tensor([1.0, 6.0 / (9.0 + 1e-6), 6.0 / (15.0 + 1e-6)])
    expected = (0.5 * 1.0 * scale[0] + 0.25 * -3.0 * scale[1] + 0.25 * 5.0 * scale[2]).item()
    torch.testing.assert_close(out.cpu(), torch.full((N,), expected), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(st.weights.cpu(), w.cpu() * scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(st.client_sq_norms.cpu(), torch.tensor([9.0, 81.0, 225.0]))


def _bad_calls():
    X, w = torch.randn(3, 10), torch.ones(3)
    return [
        (lambda o: ops.aggregate(X, w[:2], out=o), r"weights must have shape \[3\]"),
        (lambda o: ops.aggregate(X, torch.tensor([1.0, -1.0, 1.0]), out=o),
         r"weights must be >= 0, got -1.0 at index 1"),
        (lambda o: ops.aggregate(X, torch.tensor([1.0, float("nan"), 1.0]), out=o), r"weights must be finite"),
        (lambda o: ops.aggregate(X, torch.zeros(3), out=o), r"weights must not all be zero"),
        (lambda o: ops.aggregate([X[0], X[1, :9]], w[:2], out=o), r"clients\[1\] has shape \(9,\)"),
        (lambda o: ops.aggregate([X[0], X[1].double()], w[:2], out=o), r"clients\[1\] has dtype torch.float64"),
        (lambda o: ops.aggregate(X, w, gamma=0.0, out=o), r"gamma must satisfy gamma > 0"),
        (lambda o: ops.aggregate(X, w, gamma=torch.tensor(-1.0), out=o), r"gamma must satisfy gamma > 0.0, got -1.0"),
        (lambda o: ops.aggregate(X, w, gamma=torch.tensor(float("inf")), out=o), r"gamma must be finite, got inf"),
        (lambda o: ops.aggregate(X, w, gamma=torch.ones(2), out=o), r"gamma as a tensor must have one element"),
        (lambda o: ops.aggregate(X, w, out=torch.empty(9)), r"out must be a contiguous \[10\] tensor"),
        (lambda o: ops.aggregate(X, w, out=torch.empty(10, dtype=torch.float16)),
         r"dtype torch.float32, got \(10,\) torch.float16"),
        (lambda o: ops.aggregate(X, w, out=X[1]), r"out shares memory with clients:"),
        (lambda o: ops.aggregate([X[0], X[2]], w[:2], out=X[2]), r"out shares memory with clients\[1\]"),
        (lambda o: ops.aggregate(X, w, nonfinite="drop", out=o), r"nonfinite must be one of"),
        (lambda o: ops.aggregate(X, w, max_client_norm=-1.0, out=o), r"max_client_norm must satisfy"),
        (lambda o: ops.aggregate(X, w, backend="tpu", out=o), r"backend must be one of"),
        (lambda o: ops.aggregate([], torch.ones(0), out=o), r"at least one client"),
        (lambda o: ops.aggregate(X.view(3, 2, 5), w, out=o), r"clients must be 2-D"),
        (lambda o: ops.aggregate(X.int(), w, out=o), r"clients must have a floating dtype"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_input_names_the_argument_and_writes_nothing(index):
    call, match = _bad_calls()[index]
    out = torch.full((10,), 7.0)
    with pytest.raises(ValueError, match=match):
        call(out)
    assert torch.equal(out, torch.full((10,), 7.0))
