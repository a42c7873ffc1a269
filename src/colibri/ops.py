"""Kernels the model math calls. Weights may be plain tensors or quantized objects with their own matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ w.T + b. x: [T, in], w: [out, in] (a tensor, or any object with `.linear(x, b)`) -> [T, out]."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, b)
    return w.linear(x, b)
