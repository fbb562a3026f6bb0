"""``epochs: auto``: the validation slice scored after every epoch, early stopping, and the best epoch's model kept.

After the last step of each epoch every NN worker drains its pushes, scores its share of the validation slice
(``embedding_worker.rank_split``) with read-only lookups (no row is created or touched), and the ranks all-reduce
the summed logloss and the row count, so that all of them take the same decision. A better logloss (strictly lower)
makes that epoch the best: rank 0 has every parameter server dump its shard into ``<model>/best/`` (a consistent
cut: every rank has drained, and waits at a barrier until the dump is done) and every rank keeps a copy of the dense
weights. Once ``patience`` epochs in a row bring no better logloss, or at ``max_epochs``, training stops, and at
once when an epoch's logloss is worse than the best epoch's by more than ``patience_z`` standard errors of the
per-row difference over the slice (a paired test: a fall that no later epoch is likely to undo); when the last epoch
is not the best, the servers load the best shard files back and the dense weights and the dense optimizer's state
are restored, so that the Model artifact is the best epoch's model, embedding rows and optimizer state exactly. With
``trainer.train_on_validation`` (the default) that model then trains one pass over the validation slice
(``worker.train_validation_slice``): the slice is the latest data, the most telling of the days the Model will
serve; the epoch was chosen on it before that pass.
"""

from __future__ import annotations

import copy
import io as _io
import logging
import math
import shutil
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from persia_core import io
from persia_core.embedding.backend import EmbeddingBackend
from persia_core.embedding.layout import TableLayout
from persia_core.embedding.pooling import readonly_logits
from persia_core.model_store import shard_file_name

log = logging.getLogger("persia.validation")

BEST_DIR = "best"
"""Folder of the model folder where the best epoch's shard files and dense weights wait (removed at the end)."""
INITIAL_DIR = "initial"
"""Folder of the model folder where the servers' initial shard files wait for ``trainer.refit`` (removed once
loaded back)."""
SCORE_BATCH = 4096
"""Validation rows scored per forward pass."""


@dataclass
class EarlyStopping:
    """The state of ``epochs: auto``: each epoch's validation logloss, the best one so far and where it was."""

    patience: int
    patience_z: float = 0.0
    """Stop at once when an epoch's ``worse_z`` exceeds this (0: off, ``patience`` alone)."""
    history: list[dict] = field(default_factory=list)
    """Per epoch scored: ``{"epoch", "step", "logloss", "rows"}`` (epoch counted from 1, step: steps trained),
    and ``worse_z`` where it was measured (``paired_worse_z`` against the best epoch)."""
    best_logloss: float = float("inf")
    best_epoch: int = 0
    best_step: int = 0
    stopped: bool = False
    stop_reason: str = ""
    """Why training stopped (empty while it goes on), for the log."""
    shard_files: list[tuple[int, int]] = field(default_factory=list)
    """``(bytes, CRC-32C)`` of the best epoch's shard files (rank 0's state only: it loads them back)."""
    initial_files: list[tuple[int, int]] = field(default_factory=list)
    """``trainer.refit``: ``(bytes, CRC-32C)`` of the initial shard files (rank 0's state only)."""

    def update(self, epoch: int, step: int, logloss: float, rows: int, worse_z: float | None = None) -> bool:
        """Record epoch ``epoch`` (ending after ``step`` steps); returns whether it is the best so far. Sets
        ``stopped`` once ``patience`` epochs have passed without a better logloss, or when ``worse_z`` (standard
        errors by which this epoch is worse than the best, ``paired_worse_z``; None: not measured) exceeds
        ``patience_z`` > 0."""
        entry: dict = {"epoch": epoch, "step": step, "logloss": logloss, "rows": rows}
        if worse_z is not None:
            entry["worse_z"] = worse_z
        self.history.append(entry)
        better = logloss < self.best_logloss
        if better:
            self.best_logloss, self.best_epoch, self.best_step = logloss, epoch, step
        elif epoch - self.best_epoch >= self.patience:
            self.stopped, self.stop_reason = True, f"{self.patience} epochs without a better one"
        elif self.patience_z > 0 and worse_z is not None and worse_z > self.patience_z:
            self.stopped = True
            self.stop_reason = f"{worse_z:.1f} standard errors worse than the best (patience_z {self.patience_z:g})"
        return better

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EarlyStopping:
        d = dict(d)
        d["shard_files"] = [(int(a), int(b)) for a, b in d.get("shard_files", [])]
        d["initial_files"] = [(int(a), int(b)) for a, b in d.get("initial_files", [])]
        return cls(**d)


def summed_over_ranks(values: list[float], world: int, device: torch.device) -> list[float]:
    """``values`` summed element-wise over the ranks in float64 (all-reduced on ``device`` under NCCL, on the CPU
    under gloo; as given when ``world`` is 1): every rank calls it with as many values."""
    sums = torch.tensor(values, dtype=torch.float64)
    if world > 1:
        sums = sums.to(device) if dist.get_backend() == "nccl" else sums
        dist.all_reduce(sums)
        sums = sums.cpu()
    return sums.tolist()


@torch.no_grad()
def validation_loss(
    model: torch.nn.Module,
    backend: EmbeddingBackend,
    layouts: list[TableLayout],
    wide: TableLayout | None,
    examples,
    device: torch.device,
    world: int,
) -> tuple[float, int, np.ndarray]:
    """``(mean logloss, rows, row_losses)`` of the validation slice: the mean over all ranks of this rank's
    ``examples`` (``ParquetExamples``) scored with ``backend.lookup_readonly`` (unseen IDs read the zero row),
    summed and all-reduced when ``world > 1``, and this rank's per-row loglosses (``float32[len(examples)]``, in
    the rows' order). The model is put back in training mode. Raises ``ValueError`` when no rank has a row."""
    was_training = model.training
    model.eval()
    row_losses = np.empty(len(examples), dtype=np.float32)
    for start in range(0, len(examples), SCORE_BATCH):
        end = min(start + SCORE_BATCH, len(examples))
        batch = examples.batch(np.arange(start, end))
        logits = readonly_logits(model, backend, layouts, wide, batch, device)
        labels = torch.from_numpy(batch.labels).to(device)
        losses = F.binary_cross_entropy_with_logits(logits.float(), labels, reduction="none")
        row_losses[start:end] = losses.cpu().numpy()
    model.train(was_training)
    total = float(row_losses.sum(dtype=np.float64))
    loss, rows = summed_over_ranks([total, float(len(examples))], world, device)
    if rows < 1:
        raise ValueError("epochs: auto: the validation slice holds no rows")
    return loss / rows, int(rows), row_losses


Z_CAP = 1e6
"""``paired_worse_z``'s bound when every row's difference is the same (a zero standard error)."""


def paired_worse_z(now: np.ndarray, best: np.ndarray, world: int, device: torch.device) -> float:
    """By how many standard errors an epoch's validation logloss is above the best epoch's: the mean of the
    per-row differences ``now - best`` over every rank's rows, divided by its standard error ``s / sqrt(n)``
    (``s``: the differences' sample standard deviation; a paired t statistic). ``now``, ``best``: ``float32[rows
    of this rank]`` (``validation_loss``'s ``row_losses``), the same rows in the same order; the sums are
    all-reduced when ``world > 1``. Negative when the epoch is better; bounded by ``+-Z_CAP`` (reached when
    every difference is the same nonzero number), 0 when they are all 0 or there are fewer than 2 rows. Raises
    ``ValueError`` when the shapes differ."""
    if now.shape != best.shape:
        raise ValueError(f"paired_worse_z: {now.shape[0]} rows against the best epoch's {best.shape[0]}")
    d = now.astype(np.float64) - best.astype(np.float64)
    total, squares, n = summed_over_ranks([float(d.sum()), float(np.square(d).sum()), float(len(d))], world, device)
    if n < 2:
        return 0.0
    mean = total / n
    var = max(squares - n * mean * mean, 0.0) / (n - 1)
    se = math.sqrt(var / n)
    if se == 0.0:
        return 0.0 if mean == 0 else math.copysign(Z_CAP, mean)
    return max(-Z_CAP, min(Z_CAP, mean / se))


def best_paths(model_dir: str, num_shards: int, folder: str = BEST_DIR) -> list[str]:
    """The shard files' paths ``<model_dir>/<folder>/shard-SSSSS...``: ``best/``, the best epoch's (the default),
    or ``initial/``, where a refit starts from."""
    return [io.join(model_dir, folder, shard_file_name(s)) for s in range(num_shards)]


def best_dense_path(model_dir: str) -> str:
    return io.join(model_dir, BEST_DIR, "dense.pt")


@dataclass(frozen=True)
class BestCut:
    """Where the best epoch's model waits (``<model_dir>/best/``: ``num_shards`` shard files and the dense state)
    and which rank this is of ``world`` (rank 0 writes and loads it)."""

    model_dir: str
    num_shards: int
    rank: int
    world: int


def save_best(
    cut: BestCut, model: torch.nn.Module, optimizer: torch.optim.Optimizer, backend: EmbeddingBackend
) -> tuple[dict, list[tuple[int, int]]]:
    """The consistent cut of the best epoch (every rank has drained its pushes): rank 0 has the servers dump their
    shards under ``best/`` and writes the dense weights and the dense optimizer's state there (the same on every
    rank: DDP averages the gradients); the ranks wait for it at a barrier. Returns this rank's copy of both
    (``{"model", "optimizer"}``) and, on rank 0 (the one that loads them back), the shard files' ``(bytes,
    CRC-32C)``; ``[]`` elsewhere."""
    if cut.world > 1:
        dist.barrier()
    files: list[tuple[int, int]] = []
    state = {
        "model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(optimizer.state_dict()),  # its tensors cloned: later steps update them in place
    }
    if cut.rank == 0:
        files = [(int(a), int(b)) for a, b in backend.dump(best_paths(cut.model_dir, cut.num_shards))]
        buf = _io.BytesIO()
        torch.save(state, buf)
        io.write_bytes(best_dense_path(cut.model_dir), buf.getvalue())
    if cut.world > 1:
        dist.barrier()
    return state, files


def restore_best(
    cut: BestCut,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    backend: EmbeddingBackend,
    stopping: EarlyStopping,
    state: dict | None,
) -> None:
    """Put the best epoch's model back: rank 0 has the servers load its shard files (checked against their
    recorded size and CRC-32C); every rank loads its dense weights and dense optimizer state (``state`` from
    ``save_best``, or the file where a resumed run has no copy), so that training can go on from there."""
    if cut.world > 1:
        dist.barrier()
    if cut.rank == 0:
        backend.load(best_paths(cut.model_dir, cut.num_shards), stopping.shard_files)
    if state is None:
        state = torch.load(_io.BytesIO(io.read_bytes(best_dense_path(cut.model_dir))), weights_only=True)
    if "model" not in state:  # best/ of a run before the optimizer's state was kept: the weights alone
        state = {"model": state}
    model.load_state_dict(state["model"])
    if "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    if cut.world > 1:
        dist.barrier()
    log.info(
        "epochs: auto: kept epoch %d (step %d, validation logloss %.6f)",
        stopping.best_epoch,
        stopping.best_step,
        stopping.best_logloss,
    )


def save_initial(cut: BestCut, backend: EmbeddingBackend) -> list[tuple[int, int]]:
    """``trainer.refit``: before the first lookup of any rank, rank 0 has the servers dump their shards (the init
    shards' state) under ``initial/``; every rank waits for it at a barrier. Returns the files' ``(bytes,
    CRC-32C)`` on rank 0, ``[]`` elsewhere."""
    files: list[tuple[int, int]] = []
    if cut.rank == 0:
        files = [(int(a), int(b)) for a, b in backend.dump(best_paths(cut.model_dir, cut.num_shards, INITIAL_DIR))]
    if cut.world > 1:
        dist.barrier()
    return files


def load_initial(cut: BestCut, backend: EmbeddingBackend, files: list[tuple[int, int]]) -> None:
    """``trainer.refit``: put the servers back at their initial state (every rank has drained its pushes and no
    embedding worker runs): rank 0 has them load the ``save_initial`` files (checked against ``files``, their
    size and CRC-32C), then removes ``initial/``; the ranks wait for it at barriers."""
    if cut.world > 1:
        dist.barrier()
    if cut.rank == 0:
        backend.load(best_paths(cut.model_dir, cut.num_shards, INITIAL_DIR), files)
        remove_best(cut.model_dir, INITIAL_DIR)
    if cut.world > 1:
        dist.barrier()


def remove_best(model_dir: str, folder: str = BEST_DIR) -> None:
    """Remove ``<model_dir>/<folder>/`` (``best/`` or ``initial/``; rank 0, once nothing reads it)."""
    path = io.join(model_dir, folder)
    if not io.isdir(path):
        return
    if io.is_remote(path):
        for rel in io.walk_files(path):
            io.remove(io.join(path, rel))
    else:
        shutil.rmtree(path)
