"""The dense (NN-worker) part of the model: everything but the embedding tables.

Both models take the pooled embeddings ``emb: float32[B, S, D]`` (S slots, pooled by sum; an empty slot is the
zero vector) and the dense features ``dense: float32[B, F]`` (standardized inside the model with the train-split
mean/std from the preprocess statistics, kept as buffers so a saved model carries them), and return logits
``float32[B]``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def mlp(sizes: list[int], last_activation: bool, dropout: float = 0.0) -> nn.Sequential:
    """Linear layers ``sizes[0] -> sizes[1] -> ...`` with ReLU between (and after the last if asked), each ReLU
    followed by inverted dropout of rate ``dropout`` in training mode (Srivastava et al., JMLR 2014). A ReLU and
    its dropout are one parameter-free module, so the state-dict keys do not depend on ``dropout``."""
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_activation:
            layers.append(nn.Sequential(nn.ReLU(), nn.Dropout(dropout)) if dropout else nn.ReLU())
    return nn.Sequential(*layers)


def last_linear(seq: nn.Sequential) -> nn.Linear:
    """The last layer of an ``mlp`` (its output layer)."""
    layer = seq[-1]
    assert isinstance(layer, nn.Linear)
    return layer


def bottom_mlp(num_dense: int, bottom: list[int]) -> tuple[nn.Module, int]:
    """The MLP of the (standardized) dense features, ReLU after its last layer, and its output width: the
    identity (the raw features) for ``bottom = []``, width 0 without dense features."""
    if not num_dense:
        return nn.Identity(), 0
    if not bottom:
        return nn.Identity(), num_dense
    return mlp([num_dense, *bottom], last_activation=True), bottom[-1]


class ModelBase(nn.Module):
    """The dense features' standardization (train-split mean and std, kept as buffers) that every model shares,
    and the wide part's linear term of them (``wide_dense``, added by ``add_wide_dense`` where a model has one)."""

    dense_mean: torch.Tensor  # buffers (register_buffer), typed for mypy
    dense_std: torch.Tensor
    wide_dense: nn.Linear | None

    def __init__(self, num_dense: int, dense_mean=None, dense_std=None):
        super().__init__()
        mean = torch.as_tensor(dense_mean if dense_mean is not None else [0.0] * num_dense, dtype=torch.float32)
        std = torch.as_tensor(dense_std if dense_std is not None else [1.0] * num_dense, dtype=torch.float32)
        self.register_buffer("dense_mean", mean)
        self.register_buffer("dense_std", std)
        self.wide_dense = None

    def normalize(self, dense: torch.Tensor) -> torch.Tensor:
        return (dense - self.dense_mean) / self.dense_std

    def add_wide_dense(self, logit: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
        """``logit: float32[B]`` plus the wide part's linear term of the standardized dense features ``z:
        float32[B, F]`` where the model has one (``with_wide_dense``; never without dense features, ``z`` None),
        else ``logit`` itself."""
        if self.wide_dense is None:
            return logit
        assert z is not None
        return logit + self.wide_dense(z).squeeze(1)

    def load_kernels(self) -> None:
        """Load the compiled kernels the training step runs (from numba's cache, or compile them), so that the
        first step does not wait for them. None here; a one-layer ``DNN`` on the CPU has some."""

    def first_order_dense(self) -> list[torch.Tensor]:
        """The weights of the linear term of the dense features in the logit (the wide part's, trained at
        ``trainer.wide_dense_lr``): ``wide_dense``'s where the model has one, else none. LR and DeepFM override
        this with their own linear term's."""
        return [] if self.wide_dense is None else [self.wide_dense.weight]

    def output_bias(self) -> torch.Tensor:
        """The bias of the logit (``float32[1]``): the last layer's. Every model overrides this; raises
        ``NotImplementedError`` naming a subclass that does not (``init_output_bias`` needs it)."""
        raise NotImplementedError(f"{type(self).__name__} does not name its logit's bias (output_bias)")


def with_wide_dense(model: ModelBase, num_dense: int) -> ModelBase:
    """Give ``model`` the wide part's linear term of its ``num_dense`` standardized dense features (Cheng et al.,
    "Wide & Deep Learning", DLRS 2016: the wide part is a linear model of the raw and crossed features), a
    ``float32[1, F]`` weight without bias starting at 0, so the model starts as it would without it. It is made
    without drawing from torch's random generator (``skip_init``), so every other weight and every later draw
    are those of the model without it. A model without dense features is returned as it is. Returns ``model``."""
    if num_dense:
        model.wide_dense = torch.nn.utils.skip_init(nn.Linear, num_dense, 1, bias=False)
        with torch.no_grad():
            model.wide_dense.weight.zero_()
    return model


def load_dense_weights(model: ModelBase, state: dict, source: str) -> None:
    """Load the dense weights ``state`` (a ``state_dict``) into ``model``; a model saved before it had the wide
    part's linear term of the dense features (``wide_dense.weight`` absent, or ``model.wide`` off then) loads
    with that term at 0, i.e. predicts as it did. Anything else missing or unexpected raises ``RuntimeError``
    naming ``source`` (the file the weights came from)."""
    state = dict(state)
    if model.wide_dense is not None and "wide_dense.weight" not in state:
        state["wide_dense.weight"] = torch.zeros_like(model.wide_dense.weight)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise RuntimeError(f"{source}: the dense weights do not fit this run's model: {e}") from e


def init_output_bias(model: ModelBase, base_rate: float) -> None:
    """Start the logit's bias at the log-odds of the train split's base rate ``base_rate`` (the fraction of
    positive labels), so that the first predictions are the base rate rather than 0.5: the loss does not spend
    its first steps (all of them, on a small sample) learning the mean. A rate of 0 or 1 leaves it alone."""
    if 0.0 < base_rate < 1.0:
        with torch.no_grad():
            model.output_bias().fill_(math.log(base_rate / (1.0 - base_rate)))


GRAD_INTO = "persia_grad_into"
"""The attribute of an ``emb`` input naming where the model may write d loss / d emb (``grad_into``)."""


def grad_into(emb: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Offer ``dst`` (``float32[B, S, D]``, contiguous, the memory of ``emb`` or other memory) as the place for the
    gradient with respect to ``emb`` (a leaf that requires grad): a model whose only use of ``emb`` is one linear
    layer (``DNN``) computes that gradient straight into ``dst``, and ``emb.grad`` is then ``dst`` itself (autograd
    takes a leaf's only gradient as it is), so that the NN worker's hand-over of the gradient costs no copy. A
    model that does not take the offer leaves ``emb.grad`` in memory of its own. Returns ``emb``."""
    setattr(emb, GRAD_INTO, dst)
    return emb


class _FirstLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose backward writes the input's gradient into ``dst`` where one is given.
    The weight's gradient is computed first: ``dst`` may be the memory of ``x`` itself. A layer of one output on
    the CPU in float32 (a one-layer model) runs the compiled row dots of ``embedding.kernels.linear`` both ways:
    a BLAS matrix-vector product reads ``x`` at a fraction of the memory's speed."""

    @staticmethod
    def forward(ctx, x, weight, bias, dst):
        ctx.save_for_backward(x, weight)
        ctx.dst = dst
        ctx.has_bias = bias is not None
        ctx.rows = _row_dots_apply(x, weight)
        if ctx.rows:
            out = torch.empty(x.shape[0], 1)
            b = np.float32(0.0 if bias is None else bias.detach().item())
            _kernels().row_dots(x.detach().numpy(), weight.detach()[0].numpy(), b, out.numpy()[:, 0])
            return out
        return F.linear(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        gb = gy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        dst = ctx.dst
        ctx.dst = None
        if ctx.rows and ctx.needs_input_grad[0] and ctx.needs_input_grad[1]:  # both gradients in one pass
            gw_rows = torch.empty_like(weight)
            gx_rows = torch.empty_like(x) if dst is None else dst.detach().view(x.shape)
            g = gy.detach().reshape(-1).contiguous().numpy()
            w = weight.detach()[0].numpy()
            _kernels().row_dots_backward(x.detach().numpy(), g, w, gw_rows.numpy()[0], gx_rows.numpy())
            return gx_rows, gw_rows, gb, None
        gw = gy.t().mm(x) if ctx.needs_input_grad[1] else None
        gx = None
        if ctx.needs_input_grad[0]:
            if dst is None:
                gx = gy.mm(weight)
            else:  # a fresh tensor on dst's memory, referenced only by what is returned: autograd keeps it as grad
                gx = torch.mm(gy, weight, out=dst.detach().view(x.shape))
        return gx, gw, gb, None


def _row_dots_apply(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``_FirstLinear`` runs the compiled row dots: one output, float32 on the CPU, both contiguous."""
    return (
        weight.shape[0] == 1
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.is_contiguous()
        and weight[0].is_contiguous()
    )


def _kernels():
    """``persia_core.embedding.kernels`` (imported on first use: numba and the compiled kernels load only where a
    one-output first layer trains, not in every process that imports the models)."""
    # lazy: numba and its kernels only where a one-output first layer trains
    from persia_core.embedding import kernels

    return kernels


def wide_logit(wide: torch.Tensor) -> torch.Tensor:
    """The wide (first-order) term of the logit, added to the dense model's: ``wide: float32[B, S, 1]`` (a sample's
    wide-table weights pooled per slot) -> ``float32[B]``, their sum."""
    return wide.sum(dim=(1, 2))


class LR(ModelBase):
    """Logistic regression's dense part: a linear term of the standardized dense features and the bias; the
    feature IDs' weights are the wide table's (``wide_logit``), and the pooled embeddings are not used.

    Args: num_dense F (the other arguments, as for every model, are ignored)."""

    def __init__(
        self, num_slots: int, dim: int, num_dense: int, hidden, bottom, dense_mean=None, dense_std=None, dropout=0.0
    ):
        super().__init__(num_dense, dense_mean, dense_std)
        self.linear = nn.Linear(num_dense, 1) if num_dense else None
        self.bias = None if num_dense else nn.Parameter(torch.zeros(1))

    def output_bias(self) -> torch.Tensor:
        if self.linear is not None:
            return self.linear.bias
        assert self.bias is not None
        return self.bias

    def first_order_dense(self) -> list[torch.Tensor]:
        return [] if self.linear is None else [self.linear.weight]

    def forward(self, emb: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        if self.linear is not None:
            return self.linear(self.normalize(dense)).squeeze(1)
        assert self.bias is not None
        return self.bias.expand(emb.shape[0])


class DNN(ModelBase):
    """concat(flatten(emb), bottom_mlp(dense)) -> MLP(hidden) -> logit (PERSIA's benchmark model shape).

    Args: num_slots S, dim D, num_dense F, hidden (top MLP sizes), bottom (dense MLP sizes; [] = raw dense),
    dropout (rate after each hidden layer of the top MLP, training mode only).
    """

    def __init__(
        self,
        num_slots: int,
        dim: int,
        num_dense: int,
        hidden: list[int],
        bottom: list[int],
        dense_mean=None,
        dense_std=None,
        dropout: float = 0.0,
    ):
        super().__init__(num_dense, dense_mean, dense_std)
        self.bottom, dense_out = bottom_mlp(num_dense, bottom)
        self.top = mlp([num_slots * dim + dense_out, *hidden, 1], last_activation=False, dropout=dropout)

    def output_bias(self) -> torch.Tensor:
        return last_linear(self.top).bias

    def load_kernels(self) -> None:
        first = self.top[0]
        assert isinstance(first, nn.Linear)
        weight = first.weight
        if first.out_features == 1 and weight.dtype == torch.float32 and weight.device.type == "cpu":
            x, w, gy = np.ones((1, 1), np.float32), np.ones(1, np.float32), np.ones(1, np.float32)
            _kernels().row_dots(x, w, np.float32(0.0), gy)
            _kernels().row_dots_backward(x, gy, w, w.copy(), x.copy())

    def forward(self, emb: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        # the top MLP's first layer on concat(flatten(emb), bottom(dense)), computed as the sum of its two column
        # blocks' products: the same function and weights, without copying the [B, S*D] embeddings into a concat
        # (nor its gradient out of one)
        first = self.top[0]
        assert isinstance(first, nn.Linear)
        n = emb.shape[1] * emb.shape[2]
        # this layer is the only use of emb: its gradient may go where the caller offered (grad_into)
        dst = getattr(emb, GRAD_INTO, None)
        if dst is None or not emb.requires_grad:
            y = F.linear(emb.flatten(1), first.weight[:, :n], first.bias)
        else:
            y = _FirstLinear.apply(emb.flatten(1), first.weight[:, :n], first.bias, dst)
        z = self.normalize(dense) if dense.shape[1] else None
        if z is not None:
            y = y + F.linear(self.bottom(z), first.weight[:, n:])
        for layer in list(self.top)[1:]:
            y = layer(y)
        return self.add_wide_dense(y.squeeze(1), z)


class DLRM(ModelBase):
    """DLRM (Naumov et al., arXiv:1906.00091, Sec. 2): bottom MLP maps dense features to dim D; the S+1 vectors
    interact by pairwise dot products (upper triangle, no diagonal); the top MLP takes [bottom out, dots]. ``dropout``:
    the rate after each hidden layer of the top MLP (training mode only)."""

    _iu_flat: torch.Tensor  # a buffer (register_buffer), typed for mypy

    def __init__(
        self,
        num_slots: int,
        dim: int,
        num_dense: int,
        hidden: list[int],
        bottom: list[int],
        dense_mean=None,
        dense_std=None,
        dropout: float = 0.0,
    ):
        super().__init__(num_dense, dense_mean, dense_std)
        if not num_dense:
            raise ValueError("DLRM needs dense features (model.kind: dlrm with an empty dense list)")
        self.bottom = mlp([num_dense, *bottom, dim], last_activation=True)
        n = num_slots + 1
        iu = torch.triu_indices(n, n, offset=1)
        # the upper triangle of each [n, n] dot-product matrix, as positions in its flattened n*n entries: a gather
        # by index_select, whose backward (index_add) is cheaper than that of two-index advanced indexing
        self.register_buffer("_iu_flat", iu[0] * n + iu[1], persistent=False)
        self.top = mlp([dim + n * (n - 1) // 2, *hidden, 1], last_activation=False, dropout=dropout)

    def output_bias(self) -> torch.Tensor:
        return last_linear(self.top).bias

    def forward(self, emb: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        z = self.normalize(dense)
        x = self.bottom(z)
        t = torch.cat([x.unsqueeze(1), emb], dim=1)  # [B, S+1, D]
        dots = torch.bmm(t, t.transpose(1, 2)).flatten(1).index_select(1, self._iu_flat)
        return self.add_wide_dense(self.top(torch.cat([x, dots], dim=1)).squeeze(1), z)
