"""The kernel and simulation benchmarks (``fedopt bench``: :mod:`.suite`)."""
