"""The dense network's optimizer, shared by the NN workers and the plain-PyTorch contestants."""

from __future__ import annotations

import torch
from torch.optim import optimizer as torch_optimizer

from persia_core.models.dense import ModelBase


def dense_optimizer(
    model: ModelBase, lr: float, weight_decay: float = 0.0, fused: bool = False, first_order_lr: float | None = None
) -> torch.optim.Optimizer:
    """Adam on every parameter of ``model`` at learning rate ``lr``; with ``weight_decay > 0``, AdamW's decoupled
    decay (Loshchilov & Hutter, ICLR 2019: ``w -= lr * weight_decay * w`` each step, outside the adaptive
    scaling) on the weight matrices and kernels (parameters of 2 or more dimensions), none on biases. Both keep
    the same state per parameter (``exp_avg``, ``exp_avg_sq``, ``step``), so a checkpoint of one loads into
    the other. ``first_order_lr``: the rate of the linear term of the dense features in the logit
    (``model.first_order_dense()``), in a group of its own without decay; None: ``lr`` for those too.
    ``fused``: torch's single-kernel implementation."""
    params = list(model.parameters())
    first = model.first_order_dense() if first_order_lr is not None else []
    if weight_decay <= 0 and not first:
        return torch.optim.Adam(params, lr=lr, fused=fused)
    first_ids = {id(p) for p in first}
    rest = [p for p in params if id(p) not in first_ids]
    decayed = [weight_decay > 0 and p.dim() >= 2 for p in rest]
    groups = [
        {"params": [p for p, d in zip(rest, decayed, strict=True) if d], "weight_decay": weight_decay},
        {"params": [p for p, d in zip(rest, decayed, strict=True) if not d], "weight_decay": 0.0},
        {"params": first, "weight_decay": 0.0, "lr": first_order_lr},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, fused=fused)


def decay_dense_lr(opt: torch.optim.Optimizer, model: ModelBase, factor: float) -> None:
    """Multiply the learning rate of every group of ``opt`` (``dense_optimizer``'s on ``model``) by ``factor``,
    but the group of the linear term of the dense features (``model.first_order_dense()``), never decayed."""
    first = {id(p) for p in model.first_order_dense()}
    for group in opt.param_groups:
        if not first or not all(id(p) in first for p in group["params"]):
            group["lr"] *= factor


def fused_step(opt: torch.optim.Optimizer) -> None:
    """``opt.step()`` for ``dense_optimizer(fused=True)``'s Adam or AdamW: the same update, bit for bit, as one
    call per group of torch's fused kernel (``torch._fused_adam_`` / ``_fused_adamw_``, what ``step`` calls),
    without ``step``'s per-call Python (hooks, profiler ranges, state checks, regrouping by device), which costs
    an NN worker more than the kernel for a small dense network. Parameters without a gradient are skipped, as by
    ``step``. Anything the kernel call does not cover goes through ``opt.step()``: the first step (which creates
    the state), amsgrad, a non-fused, differentiable or capturable optimizer, step hooks, a gradient scaler's
    state."""
    groups = []
    for group in opt.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        states: list[dict] = [opt.state.get(p) or {} for p in params]
        if (
            not isinstance(opt, torch.optim.Adam)
            or not group.get("fused")
            or group["amsgrad"]
            or group["differentiable"]
            or group["capturable"]
            or any("step" not in s for s in states)
            or any(p.grad.is_sparse or p.grad.dtype != p.dtype for p in params)
        ):
            opt.step()
            return
        groups.append((group, params, states))
    if (
        opt._optimizer_step_pre_hooks
        or opt._optimizer_step_post_hooks
        or torch_optimizer._global_optimizer_pre_hooks
        or torch_optimizer._global_optimizer_post_hooks
        or getattr(opt, "grad_scale", None) is not None
    ):
        opt.step()
        return
    for group, params, states in groups:
        if not params:
            continue
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1)
        beta1, beta2 = group["betas"]
        kernel = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
        kernel(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            steps,
            amsgrad=False,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            grad_scale=None,
            found_inf=None,
        )
