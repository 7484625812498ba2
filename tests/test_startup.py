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

HEAVY = ("torch._dynamo", "sklearn", "matplotlib")


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
    assert _imported_after("from fedopt_kernels.fl import data\ndata.digits()") == []
    from sklearn.datasets import load_digits

    from fedopt_kernels.fl import data

    images, target = data._digits_arrays()
    bunch = load_digits()
    assert images.dtype == bunch.images.dtype and np.array_equal(images, bunch.images)
    assert target.dtype == bunch.target.dtype and np.array_equal(target, bunch.target)
