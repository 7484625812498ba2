"""The kernel and simulation benchmarks (``fedopt bench``: :mod:`.suite`).

They come with the ``sim`` extra (``pip install fedopt_kernels[sim]``): the simulation
suites run the simulator, the tables are rich's.  Without it, importing this package
says so (:mod:`fedopt_kernels.extras`).
"""

from ..extras import require

require("sim", "fedopt_kernels.benchmarks (fedopt bench)")
