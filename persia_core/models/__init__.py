"""Dense networks on top of pooled embeddings: a DNN, DLRM, DCNv2, DeepFM and logistic regression (``build_model``
picks one; ``wide_logit`` is the wide table's term)."""

from persia_core.models.cross import DCNv2, DeepFM, build_model
from persia_core.models.dense import DLRM, DNN, LR, wide_logit

__all__ = ["DNN", "DLRM", "LR", "DCNv2", "DeepFM", "build_model", "wide_logit"]
