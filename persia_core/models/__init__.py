"""Dense networks on top of pooled embeddings: a DNN, DLRM, DCNv2 and DeepFM (``build_model`` picks one)."""

from persia_core.models.cross import DCNv2, DeepFM, build_model
from persia_core.models.dense import DLRM, DNN

__all__ = ["DNN", "DLRM", "DCNv2", "DeepFM", "build_model"]
