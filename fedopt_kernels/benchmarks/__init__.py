"""The kernel and simulation benchmarks (``fedopt bench``: :mod:`.suite`).

The lab is not part of the installed core: it comes with the ``bench`` extra (``pip
install fedopt_kernels[bench]``): the simulation suites run the simulator, the tables
are rich's.  Without it, importing this package says so (:mod:`fedopt_kernels.extras`).
"""

from ..extras import require

require("bench", "fedopt_kernels.benchmarks (fedopt bench)")
