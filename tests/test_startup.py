"""Start-up cost of the command line (issue 13, item 3): what is imported, not how long
it takes (no wall-clock threshold in a test).

* ``fedopt --help`` and ``fedopt info`` import neither torch's compiler stack nor
  scikit-learn nor matplotlib;
* the digits dataset is read from the CSV scikit-learn ships without importing
  scikit-learn, and equals ``sklearn.datasets.load_digits`` exactly.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np

HEAVY = ("torch._dynamo", "torch._inductor", "sklearn", "matplotlib")


def _imported_after(code: str) -> list:
    probe = (f"import sys\n{code}\n"
             f"print('IMPORTED:' + ','.join(m for m in {HEAVY!r} if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("IMPORTED:")][-1]
    return [m for m in line[len("IMPORTED:"):].split(",") if m]


def test_help_imports_nothing_heavy():
    code = ("from fedopt_kernels.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "try:\n    main(['simulate', '--help'])\nexcept SystemExit:\n    pass")
    assert _imported_after(code) == []


def test_info_reads_versions_without_importing_sklearn_or_matplotlib():
    code = ("import contextlib, io\nfrom fedopt_kernels.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n    main(['info', '--json'])\n"
            "import json\ninfo = json.loads(out.getvalue())\n"
            "assert info['integrations']['sklearn']['version'] and info['integrations']['matplotlib']['version']")
    assert _imported_after(code) == []


def test_digits_without_importing_sklearn_equal_load_digits():
    assert _imported_after("from fedopt_kernels.fl.datasets import data\ndata.digits()") == []
    from sklearn.datasets import load_digits

    from fedopt_kernels.fl.datasets import data

    images, target = data._digits_arrays()
    bunch = load_digits()
    assert images.dtype == bunch.images.dtype and np.array_equal(images, bunch.images)
    assert target.dtype == bunch.target.dtype and np.array_equal(target, bunch.target)


def test_a_sequential_run_with_a_checkpoint_imports_no_compiler(tmp_path):
    """Optimizer construction, state_dict (the checkpoint) and zero_grad of FedNAR and
    the server optimizers do not import torch._dynamo (torch.optim's bookkeeping
    methods do, through torch._disable_dynamo); no plots, no scikit-learn."""
    code = ("import contextlib, io\nfrom fedopt_kernels.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    main(['simulate', '--rounds', '1', '--engine', 'sequential', '--algo', 'fedadam', '--quiet',"
            f" '--no-plots', '--out', {str(tmp_path)!r}])\n"
            f"import os\nassert os.path.exists(os.path.join({str(tmp_path)!r}, 'checkpoint.pt'))")
    assert _imported_after(code) == []


def test_a_short_batched_run_imports_no_compiler(tmp_path):
    """Issue 48: the batched engine differentiates (fl/engine/functorch_grad.py) and traces
    (fl/engine/aten_trace.py) its clients' gradients without torch._dynamo or torch._inductor,
    which torch.func.grad and make_fx import (~0.75 s of a short run).  The run must
    really be batched and traced, or this would prove nothing."""
    code = ("import contextlib, io\nfrom fedopt_kernels.cli import main\nfrom fedopt_kernels.fl import Simulation\n"
            "sims = []\ninit = Simulation.__init__\n"
            "def keep(self, *a, **k):\n    init(self, *a, **k)\n    sims.append(self)\n"
            "Simulation.__init__ = keep\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    main(['simulate', '--rounds', '1', '--clients', '5', '--per-round', '2', '--engine', 'batched',"
            f" '--quiet', '--no-plots', '--out', {str(tmp_path)!r}])\n"
            "(sim,) = sims\nassert sim.results.meta['engine'] == 'batched', sim.results.meta\n"
            "assert sim.batched._traced and sim.batched.trace_failure is None, sim.batched.trace_failure")
    assert _imported_after(code) == []


def test_eager_optimizer_methods_are_torch_optims_own():
    """EagerOptimizer calls the functions torch.optim wraps: the same state_dict, and
    zero_grad / load_state_dict / add_param_group act as torch.optim.SGD's do."""
    import torch

    from fedopt_kernels.optim import FedNAR
    from fedopt_kernels.optim.eager_base import EagerOptimizer

    for name in ("add_param_group", "state_dict", "load_state_dict", "zero_grad"):
        assert getattr(EagerOptimizer, name) is not getattr(torch.optim.Optimizer, name)
    w = torch.nn.Parameter(torch.ones(3))
    v = torch.nn.Parameter(torch.ones(2))
    opt = FedNAR([w], lr=0.1, momentum=0.9, weight_decay=0.0)  # the buffer is then g itself
    opt.add_param_group({"params": [v], "lr": 0.2})
    (w.sum() + 2 * v.sum()).backward()
    opt.step()
    state = opt.state_dict()
    assert [g["lr"] for g in state["param_groups"]] == [0.1, 0.2] and state["param_groups"][1]["params"] == [1]
    assert torch.equal(state["state"][0]["momentum_buffer"], torch.ones(3))
    opt.zero_grad()
    assert w.grad is None and v.grad is None
    other = FedNAR([torch.nn.Parameter(torch.ones(3))], lr=0.5, momentum=0.9)
    other.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "lr": 0.7})
    other.load_state_dict(state)
    assert [g["lr"] for g in other.param_groups] == [0.1, 0.2]
    assert torch.equal(other.state[other.param_groups[0]["params"][0]]["momentum_buffer"], torch.ones(3))
