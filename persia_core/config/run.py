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
from persia_core.config.tables import WIDE_TABLE, EmbeddingConfig, OptimizerConfig, TableConfig
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
            if s.table == WIDE_TABLE:
                raise config_error(
                    f"slots[{s.name}].table", f"{WIDE_TABLE!r} is the wide table of model.wide; name another table"
                )
        self._add_wide_table()

    def _add_wide_table(self) -> None:
        """With ``model.wide``: add the wide table (dim 1, rows starting at 0, the first table's optimizer
        settings, element-wise where that is row-wise) unless it is declared; a declared one must have dim 1.
        Without it, a table named ``wide`` is refused."""
        wide = next((t for t in self.embedding.tables if t.name == WIDE_TABLE), None)
        if not self.model.wide:
            if wide is not None:
                raise config_error(f"embedding.tables[{WIDE_TABLE}]", "the name is reserved for model.wide: true")
            return
        if wide is not None:
            if wide.dim != 1:
                raise config_error(f"embedding.tables[{WIDE_TABLE}].dim", f"the wide table has dim 1, got {wide.dim}")
            return
        first = self.embedding.tables[0].optimizer
        name = "adagrad" if first.name == "rowwise_adagrad" else first.name
        optimizer = OptimizerConfig(**{**dataclasses.asdict(first), "name": name})
        self.embedding.tables.append(TableConfig(name=WIDE_TABLE, dim=1, optimizer=optimizer, init_scale=0.0))
        self.embedding._check_budget()
        self._implied_wide = True  # not a field: to_dict writes the table, with_overrides derives it again

    def table_slots(self, table: str) -> list[str]:
        """The slots whose feature IDs ``table`` holds, in config order: those naming it; the wide table's: every
        slot."""
        if table == WIDE_TABLE and self.model.wide:
            return self.slot_names
        return [s.name for s in self.slots if s.table == table]

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
        0.5}``. An implied wide table (``model.wide`` without one declared) is derived again after the overrides,
        so it follows the first table's and goes with ``model.wide: false``, unless an override addresses it.
        Raises ``ValueError`` naming the override and the unknown key or item."""
        d = self.to_dict()
        tables = d["embedding"]["tables"]
        if getattr(self, "_implied_wide", False):
            at = next(i for i, t in enumerate(tables) if t["name"] == WIDE_TABLE)
            names = (f"embedding.tables.{WIDE_TABLE}", f"embedding.tables[{WIDE_TABLE}]", f"embedding.tables[{at}]")
            if not any(k == "embedding.tables" or k.startswith(names) for k in overrides):
                del tables[at]
        return RunConfig.from_dict(apply_overrides(d, overrides))
