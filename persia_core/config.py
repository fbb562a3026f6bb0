"""Typed run configuration: one YAML file, validated into one dataclass per concern.

A run config has six sections, each a dataclass below::

    layout:    LayoutConfig     how raw files are laid out (MovieLens join, or a delimited file like Criteo's)
    split:     SplitConfig      evaluation split, malformed-row budget, number of Parquet shards
    slots:     [SlotConfig]     ID features: which field (or cross of fields) becomes which slot, and its table
    embedding: EmbeddingConfig  embedding tables (dim, optimizer, initializer) and parameter-server shards
    model:     ModelConfig      the dense network (DNN or DLRM)
    trainer:   TrainerConfig    batch size, epochs, staleness bound K, NN workers, dense optimizer, seed

Validation happens in each ``__post_init__`` and raises ``ValueError`` naming the offending field
(``trainer.batch_size``); unknown keys and wrong types in YAML raise ``ValueError`` naming the key path.
Style follows TorchRec's ``EmbeddingBagConfig`` (typed dataclasses, validated on construction).
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from persia_core.memory import min_budget_bytes

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def _fail(path: str, msg: str) -> ValueError:
    return ValueError(f"config field '{path}': {msg}")


@dataclass
class LayoutConfig:
    """How the raw input is laid out. The layout is data, not code.

    ``kind="movielens"``: the GroupLens files ``ratings.csv``, ``movies.csv`` and ``tags.csv`` in one folder,
    joined on movieId. Fields produced per rating: ``userId``, ``movieId``, ``genres`` (multi-hot),
    ``tags`` (multi-hot, tags applied to the movie by anyone strictly before the rating's timestamp),
    ``year`` (release year parsed from the title; missing for some titles), and the dense fields
    ``hour``, ``weekday``, ``movie_age`` (years between release and rating). Label: ``rating >= label_threshold``.
    With ``history_length > 0`` also the user's history (``history``, ``liked_history``, ``user_prior_ratings``,
    ``user_prior_like_rate``; see ``history_length``).

    ``kind="delimited"``: one or more text files, one example per line, fields separated by ``delimiter``
    (Criteo's Display Advertising layout: tab, ``label, I1..I13, C1..C26``, empty = missing).
    """

    kind: str = "movielens"
    """``movielens`` or ``delimited``."""
    ratings_file: str = "ratings.csv"
    """movielens: file name of the ratings inside the data folder."""
    movies_file: str = "movies.csv"
    """movielens: file name of the movie titles and genres."""
    tags_file: str = "tags.csv"
    """movielens: file name of the tag applications."""
    label_threshold: float = 4.0
    """movielens: label = 1 where rating >= this many stars."""
    max_tags: int = 32
    """movielens: at most this many distinct tags per rating (the most recently applied ones)."""
    history_length: int = 0
    """movielens: when > 0, each rating also gets the user's history fields below, computed only from that
    user's ratings with a timestamp strictly earlier than this rating's (ratings at the same second never see
    each other; only ratings that become rows count, not dead letters). ID fields ``history`` (the movieIds of
    the most recent ``history_length`` earlier ratings, newest first; empty for a user's first ratings) and
    ``liked_history`` (the same over earlier ratings >= ``label_threshold``); dense fields, after
    ``movie_age``: ``user_prior_ratings`` = log1p(earlier ratings) and ``user_prior_like_rate`` =
    (earlier likes + 1) / (earlier ratings + 2). 0: none of these fields."""
    delimiter: str = "\t"
    """delimited: field separator."""
    has_header: bool = False
    """delimited: whether the first line of each file is a header to skip."""
    columns: list[str] = field(default_factory=list)
    """delimited: the names of the fields, in file order; a line with another field count is malformed."""
    label_column: str = "label"
    """delimited: the field holding the 0/1 label."""
    dense_columns: list[str] = field(default_factory=list)
    """delimited: numeric fields used as dense features (empty = missing = 0)."""
    dense_transform: str = "log1p"
    """delimited: ``log1p`` (log(1 + max(x, 0)), Criteo's usual transform) or ``none``."""
    timestamp_column: str = ""
    """delimited: a Unix-seconds field to split by time; empty: split by row order (files in name order)."""
    file_pattern: str = "*"
    """delimited: glob of the files to read when the data path is a folder."""

    def __post_init__(self) -> None:
        if self.kind not in ("movielens", "delimited"):
            raise _fail("layout.kind", f"must be 'movielens' or 'delimited', got {self.kind!r}")
        if self.kind == "delimited":
            if not self.columns:
                raise _fail("layout.columns", "a delimited layout needs its column names")
            if len(set(self.columns)) != len(self.columns):
                raise _fail("layout.columns", "column names must be unique")
            for name, cols in (("label_column", [self.label_column]), ("dense_columns", self.dense_columns)):
                missing = [c for c in cols if c not in self.columns]
                if missing:
                    raise _fail(f"layout.{name}", f"{missing} not in layout.columns")
            if self.timestamp_column and self.timestamp_column not in self.columns:
                raise _fail("layout.timestamp_column", f"{self.timestamp_column!r} not in layout.columns")
            if self.dense_transform not in ("log1p", "none"):
                raise _fail("layout.dense_transform", "must be 'log1p' or 'none'")
        if self.max_tags < 0:
            raise _fail("layout.max_tags", "must be >= 0")
        if self.history_length < 0:
            raise _fail("layout.history_length", "must be >= 0")
        if self.history_length and self.kind != "movielens":
            raise _fail("layout.history_length", "user history is only produced by the movielens layout")

    def dense_fields(self) -> list[str]:
        """Names of the dense features this layout produces, in order."""
        if self.kind == "movielens":
            history = ["user_prior_ratings", "user_prior_like_rate"] if self.history_length else []
            return ["hour", "weekday", "movie_age", *history]
        return list(self.dense_columns)

    def id_fields(self) -> list[str]:
        """Names of the categorical fields this layout produces (usable as slot sources)."""
        if self.kind == "movielens":
            history = ["history", "liked_history"] if self.history_length else []
            return ["userId", "movieId", "genres", "tags", "year", *history]
        skip = {self.label_column, self.timestamp_column, *self.dense_columns}
        return [c for c in self.columns if c not in skip]


@dataclass
class SplitConfig:
    """Evaluation split, malformed-row budget and output sharding of the preprocess step."""

    eval_fraction: float = 0.2
    """The last this share of rows (by timestamp, or by row order without one) is the evaluation split."""
    max_malformed_fraction: float = 0.01
    """Fail the preprocess step when more than this share of rows is malformed."""
    num_train_shards: int = 4
    """Parquet files written for the train split (NN worker r reads files r, r+M, ...)."""
    num_eval_shards: int = 1
    """Parquet files written for the evaluation split."""
    max_rows: int = 0
    """Read at most this many examples (0 = all): for smoke runs on a tiny subset."""

    def __post_init__(self) -> None:
        if not 0.0 < self.eval_fraction < 1.0:
            raise _fail("split.eval_fraction", "must be in (0, 1)")
        if not 0.0 <= self.max_malformed_fraction <= 1.0:
            raise _fail("split.max_malformed_fraction", "must be in [0, 1]")
        for name in ("num_train_shards", "num_eval_shards"):
            if getattr(self, name) < 1:
                raise _fail(f"split.{name}", "must be >= 1")
        if self.max_rows < 0:
            raise _fail("split.max_rows", "must be >= 0")


@dataclass
class SlotConfig:
    """One ID feature (slot). Its values become feature IDs ``xxh3_64(slot name, value)`` (see ``hashing``).

    Either ``source`` (one field of the layout) or ``cross`` (two or more fields: one ID per combination of
    their values, e.g. user x genre) must be given.
    """

    name: str
    """Slot name, unique; part of every feature ID's hash, so renaming a slot renames its IDs."""
    source: str = ""
    """Layout field whose values are this slot's IDs."""
    cross: list[str] = field(default_factory=list)
    """Layout fields crossed into this slot."""
    table: str = "default"
    """Embedding table (``embedding.tables[].name``) that holds this slot's rows."""
    id_dropout: float = 0.0
    """Training only: probability that a row's IDs of this slot are dropped to the default (zero) row,
    so the model learns to use it for IDs never seen in training."""

    def __post_init__(self) -> None:
        if not self.name:
            raise _fail("slots[].name", "must not be empty")
        if bool(self.source) == bool(self.cross):
            raise _fail(f"slots[{self.name}]", "give exactly one of 'source' or 'cross'")
        if self.cross and len(self.cross) < 2:
            raise _fail(f"slots[{self.name}].cross", "a cross needs at least two fields")
        if not 0.0 <= self.id_dropout < 1.0:
            raise _fail(f"slots[{self.name}].id_dropout", "must be in [0, 1)")

    def fields(self) -> list[str]:
        """The layout fields this slot reads."""
        return [self.source] if self.source else list(self.cross)


OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")


@dataclass
class OptimizerConfig:
    """Server-side embedding optimizer (applied by the parameter server, per table).

    ``sgd``: w -= lr * g. ``adagrad``: element-wise, ``torch.optim.Adagrad`` semantics.
    ``rowwise_adagrad``: one accumulator per row, s += mean(g^2); w -= lr * g / (sqrt(s) + eps) (FBGEMM).
    ``adam``: ``torch.optim.Adam`` semantics with a per-row step count for bias correction.
    """

    name: str = "rowwise_adagrad"
    lr: float = 0.05
    eps: float = 1e-8
    initial_accumulator: float = 0.0
    """adagrad / rowwise_adagrad: starting value of the accumulator."""
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise _fail("optimizer.name", f"must be one of {OPTIMIZERS}, got {self.name!r}")
        if self.lr <= 0:
            raise _fail("optimizer.lr", "must be > 0")
        if self.eps <= 0:
            raise _fail("optimizer.eps", "must be > 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise _fail("optimizer.beta1/beta2", "must be in [0, 1)")
        if self.weight_decay < 0:
            raise _fail("optimizer.weight_decay", "must be >= 0")
        if self.initial_accumulator < 0:
            raise _fail("optimizer.initial_accumulator", "must be >= 0")


@dataclass
class TableConfig:
    """One embedding table: the rows of the slots that name it, with one dim and one optimizer."""

    name: str = "default"
    dim: int = 16
    """Embedding dim D (floats per row)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    init_scale: float = 0.01
    """Rows start uniform in [-init_scale, init_scale], drawn from a generator seeded by the feature ID
    (the same ID gets the same initial row on any shard, process or run)."""
    admit_probability: float = 1.0
    """Feature admission: an unseen ID gets a row with this probability per sighting (PERSIA's
    ``admit_probability``); until then it reads the default (zero) row."""
    admit_after_sightings: int = 0
    """Feature admission: an unseen ID gets a row only from its N-th sighting on (0 = at once; at most 255)."""
    expire_after_steps: int = 0
    """Expiry: rows a shard has not looked up for this many lookup batches are removed (0 = never)."""

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise _fail(f"embedding.tables[{self.name}].dim", "must be >= 1")
        if self.init_scale < 0:
            raise _fail(f"embedding.tables[{self.name}].init_scale", "must be >= 0")
        if not 0.0 < self.admit_probability <= 1.0:
            raise _fail(f"embedding.tables[{self.name}].admit_probability", "must be in (0, 1]")
        if not 0 <= self.admit_after_sightings <= 255:
            raise _fail(f"embedding.tables[{self.name}].admit_after_sightings", "must be in [0, 255]")
        if self.expire_after_steps < 0:
            raise _fail(f"embedding.tables[{self.name}].expire_after_steps", "must be >= 0")


@dataclass
class EmbeddingConfig:
    """Embedding tables and their parameter-server shards."""

    tables: list[TableConfig] = field(default_factory=lambda: [TableConfig()])
    num_shards: int = 2
    """Parameter-server shards (one process each); feature ID -> shard by ``shard_of`` (see ``hashing``)."""
    shard_memory_bytes: int = 1 << 30
    """Memory budget per shard in bytes (rows, optimizer state, keys, hash index, bookkeeping)."""
    storage: str = "fp32"
    """Storage precision of the weights: ``fp32``, ``fp16`` or ``bf16`` (optimizer state is always fp32; each
    update computes in fp32 and rounds to nearest-even)."""

    def __post_init__(self) -> None:
        if not self.tables:
            raise _fail("embedding.tables", "at least one table is needed")
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise _fail("embedding.tables", f"table names must be unique, got {names}")
        if self.num_shards < 1:
            raise _fail("embedding.num_shards", "must be >= 1")
        if self.shard_memory_bytes < 1 << 16:
            raise _fail("embedding.shard_memory_bytes", "must be at least 65536 bytes")
        if self.storage not in ("fp32", "fp16", "bf16"):
            raise _fail("embedding.storage", f"must be fp32, fp16 or bf16, got {self.storage!r}")
        self._check_budget()

    def _check_budget(self) -> None:
        """A shard's budget (split evenly over the tables) must hold at least 1024 rows of every table, as the
        table's own accounting (``persia_core.memory.capacity_for_budget``) counts them; else
        ``ValueError`` naming ``embedding.shard_memory_bytes``, its value and the least budget that works."""
        per_table = self.shard_memory_bytes // len(self.tables)
        least = {t.name: min_budget_bytes(t.optimizer.name, t.dim, self.storage) for t in self.tables}
        worst = max(self.tables, key=lambda t: least[t.name])
        if per_table >= least[worst.name]:
            return
        split = f" split over {len(self.tables)} tables ({per_table} bytes each)" if len(self.tables) > 1 else ""
        raise _fail(
            "embedding.shard_memory_bytes",
            f"{self.shard_memory_bytes} bytes per shard{split} hold fewer than 1024 rows of table "
            f"{worst.name!r} (dim {worst.dim}, {worst.optimizer.name}, {self.storage}); give at least "
            f"{least[worst.name] * len(self.tables)}",
        )

    def table(self, name: str) -> TableConfig:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(name)


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
            raise _fail("model.kind", f"must be 'dnn' or 'dlrm', got {self.kind!r}")
        if any(h < 1 for h in self.hidden + self.bottom):
            raise _fail("model.hidden/bottom", "layer sizes must be >= 1")


@dataclass
class TrainerConfig:
    """The hybrid training loop (PERSIA, Lian et al., KDD 2022, Sec. 4)."""

    batch_size: int = 512
    """Samples per NN worker per step."""
    epochs: int = 2
    embedding_staleness: int = 4
    """K: a worker may look rows up for up to K batches beyond its oldest gradient push not yet applied.
    K = 0 is fully synchronous training."""
    num_workers: int = 2
    """NN workers (torch DDP ranks, gloo on CPU)."""
    dense_lr: float = 1e-3
    """Adam learning rate of the dense network."""
    seed: int = 0
    shuffle: bool = True
    """Shuffle each worker's rows every epoch (seeded by seed, epoch, rank); false: file order."""
    threads_per_worker: int = 1
    """torch intra-op threads per NN worker."""
    prefetch_threads: int = 1
    """Batches an NN worker prepares concurrently (dedup, lookups, host-to-device staging), and so at most how
    many batches its lookups run ahead of training (never more than ``embedding_staleness``). One hides the
    parameter servers on a CPU; a GPU, whose steps are shorter than a batch's preparation, needs more."""
    rpc_timeout_s: float = 20.0
    """Deadline of each attempt of a parameter-server call (seconds); a call with its retries takes at most twice
    this, so a server that stops answering fails the job within 40 s at the default."""
    network_delay_s: float = 0.0
    """Injected cost per parameter-server call (seconds of round trip), to measure the regime of servers across
    a data-centre network on one machine; 0 = off."""
    network_bandwidth_bytes_per_s: float = 0.0
    """Injected bandwidth cap of parameter-server calls (bytes/s); 0 = off."""
    shared_memory: bool = True
    """NN workers pass the arrays of their calls to parameter servers on the same host (loopback address)
    through shared memory instead of gRPC messages (``persia_core.ps.shm``); off whenever a network cost is
    injected. False: always in messages."""
    device: str = "auto"
    """Where the dense network runs: ``cpu``, ``cuda`` or ``auto`` (cuda when available)."""
    checkpoint_every_steps: int = 0
    """Checkpoint the whole training state every this many steps (0 = off)."""
    checkpoint_every_s: float = 0.0
    """Checkpoint every this many seconds of training (0 = off)."""
    checkpoint_keep: int = 2
    """Complete checkpoints kept (older ones are deleted)."""
    checkpoint_at_end: bool = False
    """Also checkpoint at the end of training (the Model artifact holds the final state either way)."""
    checkpoint_dir: str = ""
    """Where checkpoints go (empty: ``<model>/checkpoints``); a restarted run resumes from the newest complete one."""
    delta_every_s: float = 0.0
    """Incremental export: every this many seconds each server writes the rows updated since its last export
    (PERSIA's incremental update for online serving); 0 = off."""
    fp16_transfer: bool = False
    """GPU path: move embeddings and their gradients across PCIe as fp16 (a summed gradient that overflows
    fp16 is caught and that step's push is sent in fp32, never as inf)."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "epochs", "num_workers", "threads_per_worker", "prefetch_threads"):
            if getattr(self, name) < 1:
                raise _fail(f"trainer.{name}", "must be >= 1")
        if self.embedding_staleness < 0:
            raise _fail("trainer.embedding_staleness", "must be >= 0")
        if self.seed < 0:
            raise _fail("trainer.seed", "must be >= 0")
        if self.dense_lr <= 0:
            raise _fail("trainer.dense_lr", "must be > 0")
        if not 0 < self.rpc_timeout_s <= 86400:  # gRPC refuses deadlines far beyond a day outright
            raise _fail("trainer.rpc_timeout_s", "must be in (0, 86400] seconds")
        if self.network_delay_s < 0 or self.network_bandwidth_bytes_per_s < 0:
            raise _fail("trainer.network_delay_s/network_bandwidth_bytes_per_s", "must be >= 0")
        for name in ("checkpoint_every_steps", "checkpoint_every_s", "delta_every_s"):
            if getattr(self, name) < 0:
                raise _fail(f"trainer.{name}", "must be >= 0")
        if self.checkpoint_keep < 1:
            raise _fail("trainer.checkpoint_keep", "must be >= 1")
        if self.device not in ("auto", "cpu", "cuda"):
            raise _fail("trainer.device", f"must be auto, cpu or cuda, got {self.device!r}")


@dataclass
class RunConfig:
    """One run: data layout, split, slots, embedding, model and trainer settings."""

    layout: LayoutConfig = field(default_factory=LayoutConfig)
    split: SplitConfig = field(default_factory=SplitConfig)
    slots: list[SlotConfig] = field(default_factory=list)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def __post_init__(self) -> None:
        if not self.slots:
            raise _fail("slots", "at least one slot is needed")
        names = [s.name for s in self.slots]
        if len(set(names)) != len(names):
            raise _fail("slots", f"slot names must be unique, got {names}")
        known = set(self.layout.id_fields())
        tables = {t.name for t in self.embedding.tables}
        for s in self.slots:
            bad = [f for f in s.fields() if f not in known]
            if bad:
                raise _fail(f"slots[{s.name}]", f"fields {bad} are not produced by the layout {sorted(known)}")
            if s.table not in tables:
                raise _fail(f"slots[{s.name}].table", f"no embedding table named {s.table!r}")

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
        return _build(cls, data, "")

    def with_overrides(self, overrides: dict[str, Any]) -> RunConfig:
        """A copy with dotted-key overrides applied; validated again. An item of a list of named sections
        (``embedding.tables``, ``slots``) is reached by its name or its index: ``{"trainer.epochs": 1,
        "embedding.tables.default.dim": 32, "embedding.tables[0].optimizer.lr": 0.05, "slots.user.id_dropout":
        0.5}``. Raises ``ValueError`` naming the override and the unknown key or item."""
        d = self.to_dict()
        for key, value in overrides.items():
            node = d
            parts = re.sub(r"\[([^\]]*)\]", r".\1", key).split(".")
            for p in parts[:-1]:
                node = _override_child(node, p, key)
            if not isinstance(node, dict) or parts[-1] not in node:
                raise ValueError(f"config override '{key}': unknown key '{parts[-1]}'{_known(node, parts[-1])}")
            node[parts[-1]] = value
        return RunConfig.from_dict(d)


def _known(node: Any, part: str) -> str:
    """`` (did you mean ...? known: [...])`` for an unknown key ``part`` of section ``node``; "" for a non-section."""
    if not isinstance(node, dict):
        return ""
    import difflib

    close = difflib.get_close_matches(part, list(node), n=1, cutoff=0.6)
    return (f" (did you mean '{close[0]}'? " if close else " (") + f"known: {sorted(node)})"


def _override_child(node: Any, part: str, key: str) -> Any:
    """``node[part]`` of a dict, or the item named (or indexed) ``part`` of a list of sections."""
    if isinstance(node, dict):
        if part not in node:
            raise ValueError(f"config override '{key}': unknown key '{part}'{_known(node, part)}")
        return node[part]
    if isinstance(node, list):
        for item in node:
            if isinstance(item, dict) and item.get("name") == part:
                return item
        if part.isdigit() and int(part) < len(node):
            return node[int(part)]
        names = [item.get("name") for item in node if isinstance(item, dict)]
        raise ValueError(
            f"config override '{key}': no item '{part}' (by name: {names}; by index: 0 to {len(node) - 1})"
        )
    raise ValueError(f"config override '{key}': unknown key '{part}'")


_FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
"""A number in exponent notation without a dot (``1e-3``), which YAML 1.1 leaves a string."""


def _build(tp: Any, value: Any, path: str) -> Any:
    """Convert ``value`` into type ``tp`` (dataclass, list[...], or a scalar), naming ``path`` on error."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"config key '{path or '<root>'}': expected a mapping, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        unknown = [k for k in value if k not in names]
        if unknown:
            where = f"{path}." if path else ""
            raise ValueError(
                f"config key '{where}{unknown[0]}': unknown key{_known(dict.fromkeys(names), str(unknown[0]))}"
            )
        kwargs = {k: _build(hints[k], v, f"{path}.{k}" if path else k) for k, v in value.items()}
        try:
            return tp(**kwargs)
        except ValueError as e:
            if path and f"'{path}" not in str(e):  # a nested section's own check: say where it sits
                raise ValueError(f"{e} (in '{path}')") from None
            raise
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ValueError(f"config key '{path}': expected a list, got {type(value).__name__}")
        out = []
        for i, v in enumerate(value):
            item_path = f"{path}[{v.get('name', i)}]" if isinstance(v, dict) else f"{path}[{i}]"
            out.append(_build(item_tp, v, item_path))
        return out
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"config key '{path}': expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise ValueError(f"config key '{path}': expected an integer, got {value!r}")
        if not -(2**63) <= value < 2**63:
            raise ValueError(f"config key '{path}': {value} does not fit in a 64-bit integer")
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"config key '{path}': expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"config key '{path}': expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"config key '{path}': expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp} at {path}")


class _UniqueKeyLoader(yaml.SafeLoader):
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
    from persia_core import io

    path = str(CONFIG_DIR / f"{name_or_path}.yaml") if is_config_name(name_or_path) else name_or_path
    if not io.exists(path):
        raise FileNotFoundError(f"run config {name_or_path!r} not found (shipped configs: {shipped_configs()})")
    text = io.read_text(path)
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ValueError(f"run config {path}: not valid YAML: {e}") from e
    try:
        cfg = RunConfig.from_dict(data or {})
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
            out[key.strip()] = yaml.load(value, Loader=_UniqueKeyLoader)
        except yaml.YAMLError as e:
            raise ValueError(f"--set {key.strip()}: not a valid YAML value: {e}") from e
    return out
