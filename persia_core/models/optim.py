"""The dense network's optimizer, shared by the NN workers and the plain-PyTorch contestants."""

from __future__ import annotations

import torch
from torch import nn


def dense_optimizer(
    model: nn.Module, lr: float, weight_decay: float = 0.0, fused: bool = False
) -> torch.optim.Optimizer:
    """Adam on every parameter of ``model`` at learning rate ``lr``; with ``weight_decay > 0``, AdamW's decoupled
    decay (Loshchilov & Hutter, ICLR 2019: ``w -= lr * weight_decay * w`` each step, outside the adaptive
    scaling) on the weight matrices and kernels (parameters of 2 or more dimensions), none on biases. Both keep
    the same state per parameter (``exp_avg``, ``exp_avg_sq``, ``step``), so a checkpoint of one loads into
    the other. ``fused``: torch's single-kernel implementation."""
    if weight_decay <= 0:
        return torch.optim.Adam(model.parameters(), lr=lr, fused=fused)
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, fused=fused)
