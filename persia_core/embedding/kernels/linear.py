"""The NN worker's first layer on the pooled embeddings when it has one output (numba kernels).

A dense model reduced to one linear layer (``model.kind: dnn`` with ``hidden: []``) multiplies the flattened
embeddings ``x: float32[B, S*D]`` by one weight row. On the CPU that product is memory-bound: one read of ``x``
forward, one read and one write of ``x``'s size backward. torch hands ``[B, K] x [K]`` to a BLAS matrix-vector
product that reads ``x`` at a fraction of the memory's speed, and computes the weight and input gradients in two
passes. These kernels do the forward in one streaming pass and the backward in one pass that reads each row of
``x`` and then overwrites it with that row's gradient, so that ``gx`` may be ``x``'s own memory (the ready ring's
slot: ``models.dense.grad_into``).

Float32 throughout, as torch's; the forward's dot products are summed in an order of the compiler's choosing
(vectorized), the weight gradient's sums over rows in row order.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def row_dots(x, w, bias, out):
    """``out[i] = x[i] . w + bias`` for every row: ``x: float32[B, K]`` (C-contiguous), ``w: float32[K]``,
    ``bias: float32``, ``out: float32[B]``. Raises ``ValueError`` when the shapes disagree."""
    if w.shape[0] != x.shape[1] or out.shape[0] != x.shape[0]:
        raise ValueError("row_dots: w must hold K entries and out B entries for x of shape [B, K]")
    k_n = x.shape[1]
    for i in range(x.shape[0]):
        xi = x[i]
        s = np.float32(0.0)
        for k in range(k_n):
            s += xi[k] * w[k]
        out[i] = s + bias


@njit(nogil=True, cache=True)
def row_dots_backward(x, gy, w, gw, gx):
    """The gradients of ``y = x w`` given ``gy = d loss / d y``: ``gw[k] = sum_i gy[i] x[i, k]`` and
    ``gx[i] = gy[i] w``, in one pass over the rows. ``x, gx: float32[B, K]`` (``gx`` may be ``x`` itself: each row
    is read before it is written), ``gy: float32[B]``, ``w: float32[K]``, ``gw: float32[K]`` (overwritten). Raises
    ``ValueError`` when the shapes disagree."""
    b_n, k_n = x.shape
    if gy.shape[0] != b_n or w.shape[0] != k_n or gw.shape[0] != k_n or gx.shape[0] != b_n or gx.shape[1] != k_n:
        raise ValueError("row_dots_backward: gy must hold B entries, w and gw K, and gx be [B, K] as x")
    for k in range(k_n):
        gw[k] = 0.0
    for i in range(b_n):
        g = gy[i]
        xi = x[i]
        for k in range(k_n):
            gw[k] += g * xi[k]
        gi = gx[i]
        for k in range(k_n):
            gi[k] = g * w[k]
