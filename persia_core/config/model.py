"""Config section of the dense network (DNN, DLRM, DCNv2 or DeepFM)."""

from __future__ import annotations

from dataclasses import dataclass, field

from persia_core.config.errors import config_error


@dataclass
class ModelConfig:
    """The dense network on top of the pooled embeddings ``float32[B, S, D]`` and dense features."""

    kind: str = "dnn"
    """``dnn``: concat(pooled embeddings, bottom(dense)) -> MLP. ``dlrm``: DLRM dot interaction (Naumov et al.
    2019): bottom MLP on dense features to dim D, pairwise dot products of the S+1 vectors, top MLP. ``dcnv2``:
    DCNv2 (Wang et al. 2021): ``cross_layers`` cross layers on concat(pooled embeddings, bottom(dense)) and the
    MLP ``hidden``, stacked or parallel (``structure``). ``deepfm``: DeepFM (Guo et al. 2017): an FM's pairwise
    interactions of the pooled embeddings plus the MLP ``hidden`` on their concat with bottom(dense). ``lr``:
    logistic regression: a linear term of the (standardized) dense features and the wide term (``wide`` must be
    on); the embeddings are not used."""
    hidden: list[int] = field(default_factory=lambda: [256, 128])
    """Top MLP hidden sizes (the output layer of size 1 is added)."""
    bottom: list[int] = field(default_factory=lambda: [64])
    """Bottom MLP hidden sizes for the dense features (DLRM ends it at the embedding dim)."""

    cross_layers: int = 3
    """dcnv2: the number of cross layers."""
    cross_rank: int = 0
    """dcnv2: 0 for full-rank cross layers (``W: [d, d]``), else the rank r of ``W = U V`` (``U: [d, r]``)."""
    structure: str = "stacked"
    """dcnv2: ``stacked`` (the MLP on the cross layers' output) or ``parallel`` (beside them, outputs
    concatenated)."""

    dropout: float = 0.0
    """Dropout rate after each hidden layer of the top (DNN, DLRM, DeepFM) or deep (DCNv2) MLP, in training only
    (Srivastava et al., JMLR 2014); not in the bottom MLP, the cross layers or ``lr``. 0: off."""

    bias_init: str = "base_rate"
    """The logit's bias at the start of a run: ``base_rate``, the log-odds of the train split's fraction of
    positives (the first predictions are the base rate, not 0.5), or ``zero``."""

    wide: bool = False
    """A first-order (wide) term for every model: the wide table (``embedding.tables`` ``wide``, added with dim 1,
    rows starting at 0 and the first table's optimizer settings, unless declared) holds one weight per feature ID
    of every slot, and the sum of a sample's weights is added to the logit (Cheng et al., "Wide & Deep", 2016;
    DeepFM's first-order term). A DNN, DLRM or DCNv2 with dense features also gets a linear term of them (starting
    at 0, trained at ``trainer.wide_dense_lr``), as LR and DeepFM have."""

    def __post_init__(self) -> None:
        kinds = ("dnn", "dlrm", "dcnv2", "deepfm", "lr")
        if self.kind not in kinds:
            raise config_error("model.kind", f"must be one of {', '.join(map(repr, kinds))}, got {self.kind!r}")
        if self.cross_layers < 0:
            raise config_error("model.cross_layers", "must be >= 0")
        if self.cross_rank < 0:
            raise config_error("model.cross_rank", "must be >= 0 (0: full rank)")
        if self.structure not in ("stacked", "parallel"):
            raise config_error("model.structure", f"must be 'stacked' or 'parallel', got {self.structure!r}")
        if any(h < 1 for h in self.hidden + self.bottom):
            raise config_error("model.hidden/bottom", "layer sizes must be >= 1")
        if self.bias_init not in ("base_rate", "zero"):
            raise config_error("model.bias_init", f"must be 'base_rate' or 'zero', got {self.bias_init!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise config_error("model.dropout", f"must be in [0, 1), got {self.dropout!r}")
        if self.kind == "lr" and not self.wide:
            raise config_error("model.wide", "model.kind lr is the wide term and a linear dense term: set wide: true")

    def check_fits(self, num_slots: int, dim: int, num_dense: int) -> None:
        """Raise ``ValueError`` naming the field when this model cannot be built for ``num_slots`` slots of dim
        ``dim`` and ``num_dense`` dense features (the data's): DLRM without dense features, or a DCNv2
        ``cross_rank`` not below its cross layers' width (``U V`` would then cost more than a full-rank ``W``)."""
        if self.kind == "dlrm" and not num_dense:
            raise config_error("model.kind", "dlrm needs dense features (the data has none); use dnn, dcnv2 or deepfm")
        if self.kind == "dcnv2" and self.cross_rank:
            width = num_slots * dim + ((self.bottom[-1] if self.bottom else num_dense) if num_dense else 0)
            if self.cross_rank >= width:
                raise config_error(
                    "model.cross_rank",
                    f"{self.cross_rank} is not below the cross layers' width {width} (slots x dim + the dense "
                    "part): a low-rank W = U V that wide costs more than full rank; use 0 (full rank) or less",
                )
