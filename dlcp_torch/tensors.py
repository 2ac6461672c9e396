"""Tensors as numpy arrays and back, without a copy, bfloat16 included.

numpy has no bfloat16 of its own and ``Tensor.numpy()`` refuses one; ml_dtypes' ``bfloat16``
(what :mod:`dlcp.hostagent.wire` carries) has the same bits, so a bfloat16 tensor is seen through an
int16 view. Everything in :mod:`dlcp_torch` that hands a tensor to DLCP goes through here.
"""

from __future__ import annotations

import numpy as np
import torch

from dlcp.hostagent import wire

BFLOAT16 = wire.NUMPY_DTYPES[wire.Dtype.BFLOAT16]


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """The numpy array sharing ``t``'s memory (a CPU tensor; bfloat16 as ml_dtypes' bfloat16)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.numpy()


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """The tensor sharing ``a``'s memory (ml_dtypes' bfloat16 as torch.bfloat16)."""
    if a.dtype == BFLOAT16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch element type of a numpy one (ml_dtypes' bfloat16 as torch.bfloat16)."""
    return torch.bfloat16 if dtype == BFLOAT16 else torch.from_numpy(np.empty(0, dtype)).dtype


__all__ = ["BFLOAT16", "as_numpy", "from_numpy", "torch_dtype"]
