"""Run configs from YAML: shipped ones by name or files by path, and ``--set key=value`` overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from persia_core import io
from persia_core.config.run import RunConfig
from persia_core.config.trainer import AUTO_EPOCHS

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping with the same key twice (YAML says keys are unique; PyYAML would
    keep the last value silently, so a second ``batch_size:`` line would quietly win)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: merged keys may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    None, None, f"a key must be a scalar, got {key!r}", key_node.start_mark
                ) from None
            if duplicate:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def shipped_configs() -> list[str]:
    """Names of the run configs shipped with the package (``persia_core/configs/*.yaml``), sorted."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def is_config_name(name_or_path: str) -> bool:
    """Whether ``name_or_path`` is a shipped config's name (no ``/``, no ``.yaml``/``.yml``) rather than a path."""
    return not name_or_path.endswith((".yaml", ".yml")) and "/" not in name_or_path


def load_config(name_or_path: str, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Load a run config from a YAML file, or a shipped one by name (``movielens``, ``criteo``).

    Raises ``FileNotFoundError`` naming the path, ``ValueError`` naming the key for invalid content.
    """
    path = str(CONFIG_DIR / f"{name_or_path}.yaml") if is_config_name(name_or_path) else name_or_path
    if not io.exists(path):
        raise FileNotFoundError(f"run config {name_or_path!r} not found (shipped configs: {shipped_configs()})")
    try:
        text = io.read_text(path)
    except UnicodeDecodeError as e:
        raise ValueError(f"run config {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ValueError(f"run config {path}: not valid YAML: {e}") from e
    if data is None:
        raise ValueError(
            f"run config {path}: the file is empty (write one from a shipped config, e.g. persia_core/configs/"
            "criteo.yaml)"
        )
    if not isinstance(data, dict):
        raise ValueError(
            f"run config {path}: expected a mapping of sections (layout, slots, ...), got {type(data).__name__}"
        )
    try:
        cfg = RunConfig.from_dict(data)
    except ValueError as e:
        raise ValueError(f"run config {path}: {e}") from e
    return cfg.with_overrides(overrides) if overrides else cfg


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["split.max_rows=1000", "layout.max_tags=8"]`` -> ``{"split.max_rows": 1000, ...}`` (values as YAML).

    Raises ``ValueError`` for an item without ``=``.
    """
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects key=value, got {item!r}")
        try:
            out[key.strip()] = yaml.load(value, Loader=UniqueKeyLoader)
        except yaml.YAMLError as e:
            raise ValueError(f"--set {key.strip()}: not a valid YAML value: {e}") from e
    return out


def pipeline_overrides(
    num_parameter_servers: int, num_nn_workers: int, embedding_staleness: int, epochs: int, max_rows: int
) -> dict[str, int | str]:
    """The run-config overrides of the pipeline's (and ``make run``'s) cluster and trainer parameters: 0 keeps
    the config's value (-1 for ``embedding_staleness``); ``epochs`` -1 (``trainer.AUTO_EPOCHS``) is
    ``epochs: auto``."""
    given = {
        "embedding.num_shards": num_parameter_servers,
        "trainer.num_workers": num_nn_workers,
        "trainer.epochs": epochs,
        "split.max_rows": max_rows,
    }
    out: dict[str, int | str] = {k: v for k, v in given.items() if v > 0}
    if epochs == AUTO_EPOCHS:
        out["trainer.epochs"] = "auto"
    if embedding_staleness >= 0:
        out["trainer.embedding_staleness"] = embedding_staleness
    return out
