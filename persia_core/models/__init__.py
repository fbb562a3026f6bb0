"""Dense networks on top of pooled embeddings: a DNN, DLRM, DCNv2, DeepFM and logistic regression (``build_model``
picks one; ``wide_logit`` is the wide table's term) and their optimizer (``dense_optimizer``)."""

from persia_core.models.cross import DCNv2, DeepFM, build_model
from persia_core.models.dense import DLRM, DNN, LR, load_dense_weights, wide_logit, with_wide_dense
from persia_core.models.optim import decay_dense_lr, dense_optimizer, fused_step

__all__ = [
    "DNN",
    "DLRM",
    "LR",
    "DCNv2",
    "DeepFM",
    "build_model",
    "decay_dense_lr",
    "dense_optimizer",
    "fused_step",
    "load_dense_weights",
    "wide_logit",
    "with_wide_dense",
]
