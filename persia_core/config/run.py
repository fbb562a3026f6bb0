"""The whole run config: one section per concern, checked against each other."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import yaml

from persia_core.config.build import build
from persia_core.config.errors import config_error
from persia_core.config.model import ModelConfig
from persia_core.config.overrides import apply_overrides
from persia_core.config.schema import LayoutConfig, SlotConfig, SplitConfig, check_feature_columns
from persia_core.config.tables import EmbeddingConfig
from persia_core.config.trainer import TrainerConfig


@dataclass
class RunConfig:
    """One run: data layout, split, slots, embedding, model and trainer settings."""

    layout: LayoutConfig = field(default_factory=LayoutConfig)
    """How the raw files are laid out."""
    split: SplitConfig = field(default_factory=SplitConfig)
    """Evaluation split, malformed-row budget and Parquet shards of the preprocess step."""
    slots: list[SlotConfig] = field(default_factory=list)
    """The ID features (at least one), each read from the layout's fields into one embedding table."""
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    """Embedding tables and parameter-server shards."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The dense network."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The hybrid training loop."""

    def __post_init__(self) -> None:
        if not self.slots:
            raise config_error("slots", "at least one slot is needed")
        names = [s.name for s in self.slots]
        if len(set(names)) != len(names):
            raise config_error("slots", f"slot names must be unique, got {names}")
        known = set(self.layout.id_fields())
        tables = {t.name for t in self.embedding.tables}
        for s in self.slots:
            check_feature_columns(f"slots[{s.name}]" + (".cross" if s.cross else ""), s.fields(), self.layout)
            bad = [f for f in s.fields() if f not in known]
            if bad:
                raise config_error(f"slots[{s.name}]", f"fields {bad} are not produced by the layout {sorted(known)}")
            if s.table not in tables:
                raise config_error(f"slots[{s.name}].table", f"no embedding table named {s.table!r}")

    @property
    def slot_names(self) -> list[str]:
        return [s.name for s in self.slots]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """Build and validate from a plain dict. Raises ``ValueError`` naming an unknown key or a wrong type."""
        return build(cls, data, "")

    def with_overrides(self, overrides: dict[str, Any]) -> RunConfig:
        """A copy with dotted-key overrides applied; validated again. An item of a list of named sections
        (``embedding.tables``, ``slots``) is reached by its name or its index: ``{"trainer.epochs": 1,
        "embedding.tables.default.dim": 32, "embedding.tables[0].optimizer.lr": 0.05, "slots.user.id_dropout":
        0.5}``. Raises ``ValueError`` naming the override and the unknown key or item."""
        return RunConfig.from_dict(apply_overrides(self.to_dict(), overrides))
