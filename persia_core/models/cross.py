"""Feature-crossing dense models: DCNv2 and DeepFM, on the pooled embeddings ``emb: float32[B, S, D]`` and the
dense features ``dense: float32[B, F]`` (standardized inside, as in ``dense``); they return logits ``float32[B]``.
"""

from __future__ import annotations

import torch
from torch import nn

from persia_core.config import ModelConfig
from persia_core.models.dense import (
    DLRM,
    DNN,
    LR,
    ModelBase,
    bottom_mlp,
    init_output_bias,
    last_linear,
    mlp,
    with_wide_dense,
)


class CrossLayer(nn.Module):
    """One DCNv2 cross layer (Wang et al., "DCN V2", WWW 2021, Eq. 1): ``x_{l+1} = x0 * (W x_l + b) + x_l``.

    ``W`` is full rank (``float32[d, d]``) with ``rank = 0``, else the low-rank product ``U V`` (``U:
    float32[d, rank]``, ``V: float32[rank, d]``, the paper's Eq. 2 with one expert, as in MLPerf's DLRM-DCNv2).
    Shapes: ``x0, xl: float32[B, d]`` -> ``float32[B, d]``."""

    def __init__(self, d: int, rank: int = 0):
        super().__init__()
        if rank:
            self.v = nn.Linear(d, rank, bias=False)
            self.u = nn.Linear(rank, d)
        else:
            self.w = nn.Linear(d, d)
        self.rank = rank

    def forward(self, x0: torch.Tensor, xl: torch.Tensor) -> torch.Tensor:
        return x0 * (self.u(self.v(xl)) if self.rank else self.w(xl)) + xl


class DCNv2(ModelBase):
    """DCNv2 (Wang et al., WWW 2021, Sec. 3): ``x0 = concat(flatten(emb), bottom(dense))``, ``cross_layers``
    cross layers on it, and the MLP ``hidden``: stacked (the MLP on the cross output) or parallel (the MLP on
    ``x0``, its output concatenated with the cross output), then one linear layer to the logit.

    Args: num_slots S, dim D, num_dense F, hidden (MLP sizes), bottom (dense MLP sizes, its last layer ReLU; [] =
    raw standardized dense features), cross_layers, cross_rank (0: full rank), structure (``stacked`` or
    ``parallel``), dropout (rate after each hidden layer of the MLP, training mode only)."""

    def __init__(
        self,
        num_slots: int,
        dim: int,
        num_dense: int,
        hidden: list[int],
        bottom: list[int],
        dense_mean=None,
        dense_std=None,
        cross_layers: int = 3,
        cross_rank: int = 0,
        structure: str = "stacked",
        dropout: float = 0.0,
    ):
        super().__init__(num_dense, dense_mean, dense_std)
        if structure not in ("stacked", "parallel"):
            raise ValueError(f"DCNv2 structure must be 'stacked' or 'parallel', got {structure!r}")
        self.bottom, dense_out = bottom_mlp(num_dense, bottom)
        d = num_slots * dim + dense_out
        self.cross = nn.ModuleList(CrossLayer(d, cross_rank) for _ in range(cross_layers))
        self.structure = structure
        self.deep = mlp([d, *hidden], last_activation=True, dropout=dropout) if hidden else nn.Identity()
        deep_out = hidden[-1] if hidden else d
        self.head = nn.Linear(deep_out + d if structure == "parallel" else deep_out, 1)

    def output_bias(self) -> torch.Tensor:
        return self.head.bias

    def forward(self, emb: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        x0 = emb.flatten(1)
        z = self.normalize(dense) if dense.shape[1] else None
        if z is not None:
            x0 = torch.cat([x0, self.bottom(z)], dim=1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        if self.structure == "stacked":
            out = self.head(self.deep(x)).squeeze(1)
        else:
            out = self.head(torch.cat([x, self.deep(x0)], dim=1)).squeeze(1)
        return self.add_wide_dense(out, z)


class DeepFM(ModelBase):
    """DeepFM (Guo et al., IJCAI 2017, Sec. 2): the logit is the sum of an FM's second-order term over the S
    embeddings, ``0.5 * sum_d ((sum_s e_sd)^2 - sum_s e_sd^2)`` (Rendle 2010, Eq. 5: all pairwise dot products),
    a linear term of the dense features, and an MLP on ``concat(flatten(emb), bottom(dense))``, whose output
    layer carries the bias. The FM's first-order term over feature IDs is a wide table's (a 1-dim embedding per
    ID), not part of this module.

    Args: num_slots S, dim D, num_dense F, hidden (MLP sizes), bottom (dense MLP sizes; [] = raw dense), dropout
    (rate after each hidden layer of the MLP, training mode only)."""

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
        self.deep = mlp([num_slots * dim + dense_out, *hidden, 1], last_activation=False, dropout=dropout)
        self.linear = nn.Linear(num_dense, 1, bias=False) if num_dense else None

    def output_bias(self) -> torch.Tensor:
        return last_linear(self.deep).bias

    def first_order_dense(self) -> list[torch.Tensor]:
        return [] if self.linear is None else [self.linear.weight]

    def forward(self, emb: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        s = emb.sum(dim=1)
        fm = 0.5 * (s * s - (emb * emb).sum(dim=1)).sum(dim=1)
        x = emb.flatten(1)
        out = fm
        if dense.shape[1]:
            z = self.normalize(dense)
            x = torch.cat([x, self.bottom(z)], dim=1)
            assert self.linear is not None
            out = out + self.linear(z).squeeze(1)
        return out + self.deep(x).squeeze(1)


def build_model(
    config: ModelConfig, num_slots: int, dim: int, num_dense: int, dense_mean=None, dense_std=None, base_rate=None
) -> ModelBase:
    """The dense model named by ``config.kind`` (``dnn``, ``dlrm``, ``dcnv2``, ``deepfm``, ``lr``; with
    ``model.wide``, the wide table's term is added to its logits by the caller, ``dense.wide_logit``, and a DNN,
    DLRM or DCNv2 gets a linear term of the dense features, ``dense.with_wide_dense``), its logit's bias at the
    log-odds of ``base_rate`` (the train split's fraction of positives) when given and ``config.bias_init`` is
    ``base_rate``. Raises ``ValueError`` for an unusable combination (``ModelConfig.check_fits``)."""
    config.check_fits(num_slots, dim, num_dense)
    args = (num_slots, dim, num_dense, list(config.hidden), list(config.bottom), dense_mean, dense_std)
    model: ModelBase
    if config.kind == "dcnv2":
        model = DCNv2(*args, config.cross_layers, config.cross_rank, config.structure, dropout=config.dropout)
    else:
        cls = {"dnn": DNN, "dlrm": DLRM, "deepfm": DeepFM, "lr": LR}[config.kind]
        model = cls(*args, dropout=config.dropout)
    if config.wide and config.kind in ("dnn", "dlrm", "dcnv2"):  # LR and DeepFM have their linear term already
        with_wide_dense(model, num_dense)
    if base_rate is not None and config.bias_init == "base_rate":
        init_output_bias(model, base_rate)
    return model
