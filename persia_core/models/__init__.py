"""Dense networks on top of pooled embeddings: a DNN and DLRM."""

from persia_core.models.dense import DLRM, DNN, build_model

__all__ = ["DNN", "DLRM", "build_model"]
