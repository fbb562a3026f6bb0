"""Typed run configuration: one YAML file, validated into one dataclass per concern.

A run config has six sections, each a dataclass::

    layout:    LayoutConfig     how raw files are laid out (MovieLens join, or a delimited file like Criteo's)
    split:     SplitConfig      evaluation split, malformed-row budget, number of Parquet shards
    slots:     [SlotConfig]     ID features: which field (or cross of fields) becomes which slot, and its table
    embedding: EmbeddingConfig  embedding tables (dim, optimizer, initializer) and parameter-server shards
    model:     ModelConfig      the dense network (DNN or DLRM)
    trainer:   TrainerConfig    batch size, epochs, staleness bound K, NN workers, dense optimizer, seed

Validation happens in each ``__post_init__`` and raises ``ValueError`` naming the offending field
(``trainer.batch_size``); unknown keys and wrong types in YAML raise ``ValueError`` naming the key path.
Style follows TorchRec's ``EmbeddingBagConfig`` (typed dataclasses, validated on construction).

This package's interface is the names below; its modules, by concern::

    schema.py     LayoutConfig, SplitConfig, SlotConfig
    tables.py     OptimizerConfig, TableConfig, EmbeddingConfig (and OPTIMIZERS)
    model.py      ModelConfig
    trainer.py    TrainerConfig
    run.py        RunConfig (the sections checked against each other, to/from dicts and YAML)
    loading.py    load_config, parse_overrides, shipped_configs, is_config_name (YAML files, ``--set``)
    overrides.py  dotted-key overrides of a config dict
    build.py      the generic builder of typed dataclasses from plain dicts
    errors.py     error messages naming the offending key

Importing it loads PyYAML and numpy (``persia_core.memory``), never torch, Beam, gRPC or numba.
"""

from persia_core.config.loading import CONFIG_DIR, is_config_name, load_config, parse_overrides, shipped_configs
from persia_core.config.model import ModelConfig
from persia_core.config.run import RunConfig
from persia_core.config.schema import LayoutConfig, SlotConfig, SplitConfig
from persia_core.config.tables import (
    OPTIMIZERS,
    WIDE_TABLE,
    EmbeddingConfig,
    OptimizerConfig,
    TableConfig,
    table_budgets,
)
from persia_core.config.trainer import TrainerConfig

__all__ = [
    "CONFIG_DIR",
    "OPTIMIZERS",
    "WIDE_TABLE",
    "EmbeddingConfig",
    "LayoutConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RunConfig",
    "SlotConfig",
    "SplitConfig",
    "TableConfig",
    "TrainerConfig",
    "is_config_name",
    "load_config",
    "parse_overrides",
    "shipped_configs",
    "table_budgets",
]
