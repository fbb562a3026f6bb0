"""Sparse optimizer steps on a table's rows (numba kernels): SGD, Adagrad, row-wise Adagrad, Adam, FTRL-Proximal.

Each updates ``weights: float32[R, D]`` and its optimizer state in place for ``rows: int32[N]`` (-1: skipped)
with ``grads: float32[N, D]``, one gradient row per distinct row (the caller sums repeated IDs first,
``kernels.grouping.segment_sum``). Weight decay ``wd`` is added to the gradient, as in torch.optim.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from persia_core.embedding.kernels.intrinsics import PR, prefetch


@njit(nogil=True, cache=True)
def apply_sgd(rows, grads, weights, lr, wd):
    n = rows.shape[0]
    for t in range(n):
        if t + PR < n and rows[t + PR] >= 0:
            prefetch(weights, rows[t + PR])
        r = rows[t]
        if r < 0:
            continue
        w = weights[r]
        for j in range(w.shape[0]):
            g = grads[t, j] + wd * w[j]
            w[j] = np.float32(w[j] - lr * g)


@njit(nogil=True, cache=True)
def apply_adagrad(rows, grads, weights, acc, lr, eps, wd):
    """torch.optim.Adagrad (lr_decay 0): s += g*g; w -= lr * g / (sqrt(s) + eps)."""
    n = rows.shape[0]
    for t in range(n):
        if t + PR < n and rows[t + PR] >= 0:
            prefetch(weights, rows[t + PR])
            prefetch(acc, rows[t + PR])
        r = rows[t]
        if r < 0:
            continue
        w = weights[r]
        s = acc[r]
        for j in range(w.shape[0]):
            g = np.float32(grads[t, j] + np.float32(wd) * w[j])
            s[j] = np.float32(s[j] + g * g)
            w[j] = np.float32(w[j] - np.float32(lr) * g / (np.float32(np.sqrt(s[j])) + np.float32(eps)))


@njit(nogil=True, cache=True)
def apply_rowwise_adagrad(rows, grads, weights, acc, lr, eps, wd):
    """Row-wise Adagrad (FBGEMM ``EXACT_ROWWISE_ADAGRAD``): s += mean_j(g_j^2);
    w -= lr * g / (sqrt(s) + eps)."""
    d = weights.shape[1]
    n = rows.shape[0]
    for t in range(n):
        if t + PR < n and rows[t + PR] >= 0:
            prefetch(weights, rows[t + PR])
            prefetch(acc, rows[t + PR])
        r = rows[t]
        if r < 0:
            continue
        w = weights[r]
        ss = 0.0
        for j in range(d):
            g = grads[t, j] + wd * w[j]
            ss += g * g
        s = np.float32(acc[r] + np.float32(ss / d))
        acc[r] = s
        den = np.sqrt(np.float64(s)) + eps
        for j in range(d):
            g = grads[t, j] + wd * w[j]
            w[j] = np.float32(w[j] - lr * g / den)


@njit(nogil=True, cache=True)
def apply_adam(rows, grads, weights, m, v, steps, lr, beta1, beta2, eps, wd):
    """torch.optim.Adam (no amsgrad) with a per-row step count for bias correction."""
    n = rows.shape[0]
    for t in range(n):
        if t + PR < n and rows[t + PR] >= 0:
            q = rows[t + PR]
            prefetch(weights, q)
            prefetch(m, q)
            prefetch(v, q)
            prefetch(steps, q)
        r = rows[t]
        if r < 0:
            continue
        steps[r] += 1
        k = steps[r]
        bc1 = 1.0 - beta1**k
        bc2 = 1.0 - beta2**k
        step_size = lr / bc1
        bc2_sqrt = np.sqrt(bc2)
        w = weights[r]
        mr = m[r]
        vr = v[r]
        for j in range(w.shape[0]):
            g = np.float32(grads[t, j] + np.float32(wd) * w[j])
            mr[j] = np.float32(mr[j] * np.float32(beta1) + g * np.float32(1.0 - beta1))
            vr[j] = np.float32(vr[j] * np.float32(beta2) + g * g * np.float32(1.0 - beta2))
            den = np.float32(np.float32(np.sqrt(vr[j])) / np.float32(bc2_sqrt)) + np.float32(eps)
            w[j] = np.float32(w[j] - np.float32(step_size) * (mr[j] / den))


@njit(nogil=True, cache=True)
def apply_ftrl(rows, grads, weights, n_acc, z, lr, beta, l1, l2, wd, fraction):
    """FTRL-Proximal, per coordinate (McMahan et al., KDD 2013, Algorithm 1), with ``n_acc`` and ``z`` of shape
    ``float32[R, D]``: g += wd * w; sigma = (sqrt(n + g^2 / fraction) - sqrt(n)) / lr; z += g - sigma * w;
    n += g^2 / fraction; w = 0 if |z| <= l1 else -(z - sign(z) * l1) / ((beta + sqrt(n)) / lr + l2).

    ``fraction`` in (0, 1] is the share of a step one push carries: M pushes of 1/M of a gradient add the
    step's gradient to ``z`` and its square to ``n``, as one synchronous update does."""
    n = rows.shape[0]
    inv_f = 1.0 / fraction
    for t in range(n):
        if t + PR < n and rows[t + PR] >= 0:
            q = rows[t + PR]
            prefetch(weights, q)
            prefetch(n_acc, q)
            prefetch(z, q)
        r = rows[t]
        if r < 0:
            continue
        w = weights[r]
        nr = n_acc[r]
        zr = z[r]
        for j in range(w.shape[0]):
            g = grads[t, j] + wd * w[j]
            n_old = np.float64(nr[j])
            n_new = n_old + g * g * inv_f
            sigma = (np.sqrt(n_new) - np.sqrt(n_old)) / lr
            zj = np.float64(zr[j]) + g - sigma * w[j]
            zr[j] = np.float32(zj)
            nr[j] = np.float32(n_new)
            if abs(zj) <= l1:
                w[j] = np.float32(0.0)
            else:
                sgn = 1.0 if zj > 0 else -1.0
                w[j] = np.float32(-(zj - sgn * l1) / ((beta + np.sqrt(n_new)) / lr + l2))
