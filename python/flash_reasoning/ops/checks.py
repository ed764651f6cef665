"""Argument checks shared by the public ops: each names the argument, what was expected and
what was given."""
from __future__ import annotations

import torch


def check_tensor(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device,
                 owner: str) -> None:
    """``t`` has ``dtype``, lives on ``device`` (``owner`` says whose device that is) and is
    contiguous."""
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} ({owner}'s device)")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
