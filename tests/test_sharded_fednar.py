"""FedNAR on sharded (FSDP2) and replicated (DDP) client models: 2 gloo processes on CPU.

Each rank trains on its own batch; FSDP2 reduce-scatters the mean gradient into each
rank's shard, DDP all-reduces it.  Either way the step must be the single-process
FedNAR step on the mean loss of both batches: the clip norm is the WHOLE model's (each
rank's partial sum of squares all-reduced, ops/_dtensor.py), the update local to each
shard.  The oracle is the same FedNAR run in one process on the unsharded model; the
sums of squares are added in another order (per shard, then across ranks), so the
comparison is to fp32 rounding.  The model's last layer has one output, so its bias
(one element) leaves rank 1 an EMPTY shard, and 5 rows on 2 ranks make uneven ones.
"""

from __future__ import annotations

import _gloo as gloo
import pytest
import torch
import torch.distributed as dist
from torch import nn

from fedopt_kernels.optim import FedNAR

WORLD = 2
STEPS = 3
TIMEOUT_S = 240
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1))


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 7, generator=g), torch.randn(6, 1, generator=g)


def make_fednar(model: nn.Module, split: bool, hyper: dict) -> FedNAR:
    """One group, or (``split``) weights and biases apart, the biases with their own lr
    and no decay, one norm over both."""
    if not split:
        return FedNAR(model.parameters(), **hyper)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return FedNAR([dict(params=weights), dict(params=biases, lr=hyper["lr"] / 2, weight_decay=0.0)],
                  clip_scope="optimizer", **hyper)


CASES = {  # name: (FedNAR keyword arguments, split groups with one norm over both)
    "co": (dict(lr=0.1, weight_decay=0.01, max_norm=0.3, mode="co"), False),
    "co_momentum": (dict(lr=0.1, weight_decay=0.01, max_norm=0.3, mode="co", momentum=0.9), False),
    "grad_two_groups_one_norm": (dict(lr=0.1, weight_decay=0.01, max_norm=0.3, mode="grad"), True),
}


def reference(case: str):
    """Single process: FedNAR on the unsharded model, the mean loss of both ranks' batches."""
    hyper, split = CASES[case]
    model = make_model()
    opt = make_fednar(model, split, hyper)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(nn.functional.mse_loss(model(x), y) for x, y in (batch(step, r) for r in range(WORLD))) / WORLD
        loss.backward()
        opt.step()
        norms.append(opt.clip_stats()[0].norm.clone())
    return [p.detach().clone() for p in model.parameters()], norms


def _train(rank: int, case: str, wrap):
    hyper, split = CASES[case]
    model = wrap(make_model())
    opt = make_fednar(model, split, hyper)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, rank)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        norms.append(opt.clip_stats()[0].norm.clone())
    return model, norms


def _scenario_fsdp(rank: int, case: str):
    from torch.distributed.fsdp import fully_shard

    def wrap(model):
        fully_shard(model)
        return model

    model, norms = _train(rank, case, wrap)
    types = {type(p).__name__ for p in model.parameters()}
    local = [p.to_local().numel() for p in model.parameters()]
    return {"params": [p.full_tensor().detach().clone() for p in model.parameters()], "norms": norms,
            "types": types, "local_numel": local}


def _scenario_ddp(rank: int, case: str):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, norms = _train(rank, case, lambda m: DDP(m))
    return {"params": [p.detach().clone() for p in model.module.parameters()], "norms": norms}


def _scenario_errors(rank: int):
    """What a misuse gets: each message, and whether the parameter kept its bits."""
    from torch.distributed.tensor import DeviceMesh, Partial, Shard, distribute_tensor

    from fedopt_kernels import ops

    mesh = DeviceMesh("cpu", list(range(WORLD)))
    x = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
    before = x.to_local().clone()
    out = {}
    tries = {
        "partial": [torch.distributed.tensor.DTensor.from_local(torch.ones(4, 3), mesh, [Partial()])],
        "plain_grad": [torch.ones(4, 3)],
        "other_placement": [distribute_tensor(torch.ones(4, 3), mesh, [Shard(1)])],
    }
    for name, grads in tries.items():
        try:
            ops.nar_step_([x], grads, lr=0.1, max_norm=1.0)
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    out["unchanged"] = torch.equal(x.to_local(), before)
    return out


def _run_cases(rank: int, world: int):
    results = {}
    for case in CASES:
        results[("fsdp", case)] = _scenario_fsdp(rank, case)
        results[("ddp", case)] = _scenario_ddp(rank, case)
    results["errors"] = _scenario_errors(rank)
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return gloo.launch(tmp_path_factory.mktemp("sharded"), WORLD, _run_cases, timeout_s=TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["fsdp", "ddp"])
@pytest.mark.parametrize("case", list(CASES))
def test_equals_single_process_fednar(ranks, wrapper, case):
    ref_params, ref_norms = reference(case)
    assert min(n.item() for n in ref_norms) > CASES[case][0]["max_norm"]  # the clip is exercised
    for r in range(WORLD):
        got = ranks[r][(wrapper, case)]
        for step, (a, b) in enumerate(zip(got["norms"], ref_norms)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=0, msg=f"rank {r} step {step} norm")
        for i, (a, b) in enumerate(zip(got["params"], ref_params)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"rank {r} param {i}")
    # every rank derived the same norm from the same all-reduced bits
    for a, b in zip(ranks[0][(wrapper, case)]["norms"], ranks[1][(wrapper, case)]["norms"]):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_fsdp_really_shards_unevenly_with_an_empty_shard(ranks):
    got = [ranks[r][("fsdp", "co")] for r in range(WORLD)]
    assert got[0]["types"] == {"DTensor"}
    numel = [p.numel() for p in make_model().parameters()]
    assert [a + b for a, b in zip(got[0]["local_numel"], got[1]["local_numel"])] == numel
    assert got[1]["local_numel"][-1] == 0  # the last bias, one element, lives on rank 0 alone
    assert got[0]["local_numel"][0] != got[1]["local_numel"][0]  # 5 rows on 2 ranks


@pytest.mark.slow
def test_misused_dtensors_get_a_clear_error_and_change_nothing(ranks):
    got = ranks[0]["errors"]
    assert "Partial placement" in got["partial"] and "grads[0]" in got["partial"]
    assert "grads[0] must be a DTensor sharded like params[0]" in got["plain_grad"]
    assert "grads[0] has placements" in got["other_placement"]
    assert got["unchanged"]
