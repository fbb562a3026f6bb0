"""Config sections of the embedding: tables, their server-side optimizers, the parameter-server shards."""

from __future__ import annotations

from dataclasses import dataclass, field

from persia_core.config.errors import config_error
from persia_core.memory import bytes_per_row, min_budget_bytes

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl")
WIDE_TABLE = "wide"
"""The name of the wide table (``model.wide``): one 1-dim row per feature ID of every slot, the model's first-order
(logistic-regression) term. The name is reserved for it."""


@dataclass
class OptimizerConfig:
    """Server-side embedding optimizer (applied by the parameter server, per table).

    ``sgd``: w -= lr * g. ``adagrad``: element-wise, ``torch.optim.Adagrad`` semantics.
    ``rowwise_adagrad``: one accumulator per row, s += mean(g^2); w -= lr * g / (sqrt(s) + eps) (FBGEMM).
    ``adam``: ``torch.optim.Adam`` semantics with a per-row step count for bias correction.
    ``ftrl``: FTRL-Proximal per coordinate (McMahan et al., KDD 2013), the wide (logistic-regression) part's optimizer
    in Wide & Deep (Cheng et al., 2016): rate ``lr / (eps + sqrt(n))``, L1 ``l1`` (exact zeros) and L2 ``l2``.
    """

    name: str = "rowwise_adagrad"
    """One of ``OPTIMIZERS``: ``sgd``, ``adagrad``, ``rowwise_adagrad``, ``adam`` or ``ftrl``."""
    lr: float = 0.05
    """Learning rate of the embedding rows."""
    eps: float = 1e-8
    """adagrad / rowwise_adagrad / adam: added to the denominator's square root; ftrl: its beta."""
    initial_accumulator: float = 0.0
    """adagrad / rowwise_adagrad / ftrl: starting value of the accumulator of squared gradients."""
    beta1: float = 0.9
    """adam: decay of the first-moment estimate."""
    beta2: float = 0.999
    """adam: decay of the second-moment estimate."""
    weight_decay: float = 0.0
    """L2 penalty added to each gradient (``torch.optim`` semantics); 0 = none."""
    l1: float = 0.0
    """ftrl: L1 strength (lambda_1), in units of the step's mean-loss gradient; rows whose accumulated gradient
    stays within it are exactly 0."""
    l2: float = 0.0
    """ftrl: L2 strength (lambda_2) of the proximal solution, same units."""
    l2_per_epoch: float = 0.0
    """ftrl: an L2 strength that grows with the epochs trained: the proximal solution's L2 is ``max(l2, l2_per_epoch *
    e)`` after ``e`` epochs (fractional, by steps; the pass over the validation slice counted as one). FTRL adds its
    L2 once to a sum of gradients that grows with every step, so a fixed ``l2`` fades as epochs go on and the weights
    drift to the unregularized fit; one that grows with the steps makes the fixed point the L2-regularized optimum
    of the mean loss (regularized dual averaging, Xiao, JMLR 2010), that of scikit-learn's ``LogisticRegression`` at
    C = 1 / (l2_per_epoch * global batch). 0: off."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise config_error("optimizer.name", f"must be one of {OPTIMIZERS}, got {self.name!r}")
        if self.lr <= 0:
            raise config_error("optimizer.lr", "must be > 0")
        if self.eps <= 0:
            raise config_error("optimizer.eps", "must be > 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise config_error("optimizer.beta1/beta2", "must be in [0, 1)")
        if self.weight_decay < 0:
            raise config_error("optimizer.weight_decay", "must be >= 0")
        if self.l1 < 0 or self.l2 < 0:
            raise config_error("optimizer.l1/l2", "must be >= 0")
        if (self.l1 or self.l2) and self.name != "ftrl":
            raise config_error("optimizer.l1/l2", f"are FTRL's; optimizer {self.name!r} takes weight_decay")
        if self.l2_per_epoch < 0:
            raise config_error("optimizer.l2_per_epoch", "must be >= 0")
        if self.l2_per_epoch and self.name != "ftrl":
            raise config_error("optimizer.l2_per_epoch", f"is FTRL's; optimizer {self.name!r} has no l2")
        if self.initial_accumulator < 0:
            raise config_error("optimizer.initial_accumulator", "must be >= 0")


@dataclass
class TableConfig:
    """One embedding table: the rows of the slots that name it, with one dim and one optimizer."""

    name: str = "default"
    """Table name, unique; slots name it in ``slots[].table``."""
    dim: int = 16
    """Embedding dim D (floats per row)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Server-side optimizer of this table's rows."""
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
            raise config_error(f"embedding.tables[{self.name}].dim", "must be >= 1")
        if self.init_scale < 0:
            raise config_error(f"embedding.tables[{self.name}].init_scale", "must be >= 0")
        if not 0.0 < self.admit_probability <= 1.0:
            raise config_error(f"embedding.tables[{self.name}].admit_probability", "must be in (0, 1]")
        if not 0 <= self.admit_after_sightings <= 255:
            raise config_error(f"embedding.tables[{self.name}].admit_after_sightings", "must be in [0, 255]")
        if self.expire_after_steps < 0:
            raise config_error(f"embedding.tables[{self.name}].expire_after_steps", "must be >= 0")


@dataclass
class EmbeddingConfig:
    """Embedding tables and their parameter-server shards."""

    tables: list[TableConfig] = field(default_factory=lambda: [TableConfig()])
    """The embedding tables (at least one); each shard holds its share of every table."""
    num_shards: int = 2
    """Parameter-server shards (one process each); feature ID -> shard by ``shard_of`` (see ``hashing``)."""
    shard_memory_bytes: int = 1 << 30
    """Memory budget per shard in bytes (rows, optimizer state, keys, hash index, bookkeeping)."""
    storage: str = "fp32"
    """Storage precision of the weights: ``fp32``, ``fp16`` or ``bf16`` (optimizer state is always fp32; each
    update computes in fp32 and rounds to nearest-even)."""
    evict_at_capacity: bool = False
    """Whether the tables may hold fewer rows than the data's distinct IDs: at capacity a shard evicts its least
    recently looked-up rows (PERSIA's LRU), and the shard plan estimates each shard at its capacity. False: a plan
    whose estimate exceeds a shard's budget is refused before training."""

    def __post_init__(self) -> None:
        if not self.tables:
            raise config_error("embedding.tables", "at least one table is needed")
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise config_error("embedding.tables", f"table names must be unique, got {names}")
        if self.num_shards < 1:
            raise config_error("embedding.num_shards", "must be >= 1")
        if self.shard_memory_bytes < 1 << 16:
            raise config_error("embedding.shard_memory_bytes", "must be at least 65536 bytes")
        if self.storage not in ("fp32", "fp16", "bf16"):
            raise config_error("embedding.storage", f"must be fp32, fp16 or bf16, got {self.storage!r}")
        self._check_budget()

    def _check_budget(self) -> None:
        """A shard's budget (split over the tables by ``table_budgets``) must hold at least 1024 rows of every
        table, as the table's own accounting (``persia_core.memory.capacity_for_budget``) counts them; else
        ``ValueError`` naming ``embedding.shard_memory_bytes``, its value and the least budget that works."""
        budgets = self.table_budgets()
        least = {t.name: min_budget_bytes(t.optimizer.name, t.dim, self.storage) for t in self.tables}
        short = [t for t in self.tables if budgets[t.name] < least[t.name]]
        if not short:
            return
        worst = max(short, key=lambda t: least[t.name] / max(budgets[t.name], 1))
        per_table = budgets[worst.name]
        split = f" split over {len(self.tables)} tables ({per_table} bytes for it)" if len(self.tables) > 1 else ""
        need = -(-least[worst.name] * self.shard_memory_bytes // max(per_table, 1))
        raise config_error(
            "embedding.shard_memory_bytes",
            f"{self.shard_memory_bytes} bytes per shard{split} hold fewer than 1024 rows of table "
            f"{worst.name!r} (dim {worst.dim}, {worst.optimizer.name}, {self.storage}); give at least {need}",
        )

    def table_budgets(self) -> dict[str, int]:
        """Bytes of ``shard_memory_bytes`` per table (``table_budgets``)."""
        return table_budgets(self.tables, self.shard_memory_bytes, self.storage)

    def table(self, name: str) -> TableConfig:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(name)


def table_budgets(tables: list[TableConfig], shard_memory_bytes: int, storage: str = "fp32") -> dict[str, int]:
    """Each table's share of one shard's ``shard_memory_bytes`` (bytes): even over the tables, except the wide
    table (``WIDE_TABLE``), which holds a row for every feature ID of the others: its share is sized so that its
    capacity in rows about equals theirs together (shares in proportion to the bytes per row)."""
    wide = [t for t in tables if t.name == WIDE_TABLE]
    deep = [t for t in tables if t.name != WIDE_TABLE]
    if not wide or not deep:
        return {t.name: shard_memory_bytes // len(tables) for t in tables}
    w = wide[0]
    weight = bytes_per_row(w.optimizer.name, w.dim, storage=storage) * sum(
        1.0 / bytes_per_row(t.optimizer.name, t.dim, storage=storage) for t in deep
    )
    unit = shard_memory_bytes / (len(deep) + weight)
    out = {t.name: int(unit) for t in deep}
    out[w.name] = shard_memory_bytes - sum(out.values())
    return out
