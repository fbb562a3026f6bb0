"""The dense network's optimizer, shared by the NN workers and the plain-PyTorch contestants."""

from __future__ import annotations

import torch
from torch import nn


def dense_optimizer(
    model: nn.Module, lr: float, weight_decay: float = 0.0, fused: bool = False, first_order_lr: float | None = None
) -> torch.optim.Optimizer:
    """Adam on every parameter of ``model`` at learning rate ``lr``; with ``weight_decay > 0``, AdamW's decoupled
    decay (Loshchilov & Hutter, ICLR 2019: ``w -= lr * weight_decay * w`` each step, outside the adaptive
    scaling) on the weight matrices and kernels (parameters of 2 or more dimensions), none on biases. Both keep
    the same state per parameter (``exp_avg``, ``exp_avg_sq``, ``step``), so a checkpoint of one loads into
    the other. ``first_order_lr``: the rate of the linear term of the dense features in the logit
    (``model.first_order_dense()``, where the model names one), in a group of its own without decay; None:
    ``lr`` for those too. ``fused``: torch's single-kernel implementation."""
    params = list(model.parameters())
    named = getattr(model, "first_order_dense", None)
    first = list(named()) if first_order_lr is not None and callable(named) else []
    if weight_decay <= 0 and not first:
        return torch.optim.Adam(params, lr=lr, fused=fused)
    first_ids = {id(p) for p in first}
    rest = [p for p in params if id(p) not in first_ids]
    decay = [p for p in rest if weight_decay > 0 and p.dim() >= 2]
    plain = [p for p in rest if not (weight_decay > 0 and p.dim() >= 2)]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": plain, "weight_decay": 0.0},
        {"params": first, "weight_decay": 0.0, "lr": first_order_lr},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, fused=fused)
