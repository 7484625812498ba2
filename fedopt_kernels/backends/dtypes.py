"""The kernels' dtype rules, shared by every backend and the layers above them."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the kernels: float64 for float64 data, else float32 (fp16
    and bf16 data are summed and stepped in float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
