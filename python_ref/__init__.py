"""Pure-PyTorch, paper-literal formulas of every method of fedopt_kernels (the oracle).

No performance tricks: each module states one paper's math plainly, with the paper's
equation numbers, and the fused kernels are tested against it.
"""
