"""What the multi-process scripts compare with one process: global values of DTensors, and the
largest relative gradient error over a model's parameters (checked directly: AdamW's losses
barely see a gradient off by a constant factor)."""

from typing import Iterable

import torch


def full(t: torch.Tensor) -> torch.Tensor:
    """The global value of a DTensor (a collective: every rank calls it); a tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def grad_rel(params: Iterable[torch.nn.Parameter], ref_params: Iterable[torch.nn.Parameter]
             ) -> float:
    """max over parameter pairs of max|g - g_ref| / max|g_ref| (gradients gathered whole)."""
    return max(((full(p.grad) - q.grad).abs().max() / q.grad.abs().max()).item()
               for p, q in zip(params, ref_params, strict=True))
