"""Config section of the dense network (DNN or DLRM)."""

from __future__ import annotations

from dataclasses import dataclass, field

from persia_core.config.errors import config_error


@dataclass
class ModelConfig:
    """The dense network on top of the pooled embeddings ``float32[B, S, D]`` and dense features."""

    kind: str = "dnn"
    """``dnn``: concat(pooled embeddings, bottom(dense)) -> MLP. ``dlrm``: DLRM dot interaction (Naumov et al.
    2019): bottom MLP on dense features to dim D, pairwise dot products of the S+1 vectors, top MLP."""
    hidden: list[int] = field(default_factory=lambda: [256, 128])
    """Top MLP hidden sizes (the output layer of size 1 is added)."""
    bottom: list[int] = field(default_factory=lambda: [64])
    """Bottom MLP hidden sizes for the dense features (DLRM ends it at the embedding dim)."""

    def __post_init__(self) -> None:
        if self.kind not in ("dnn", "dlrm"):
            raise config_error("model.kind", f"must be 'dnn' or 'dlrm', got {self.kind!r}")
        if any(h < 1 for h in self.hidden + self.bottom):
            raise config_error("model.hidden/bottom", "layer sizes must be >= 1")
