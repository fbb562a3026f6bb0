"""Config section of the hybrid training loop: batches, staleness, workers, checkpoints, transport."""

from __future__ import annotations

import math
from dataclasses import dataclass

from persia_core.config.errors import config_error


def check_delta_period(every_s: float) -> None:
    """Raise ``ValueError`` unless ``every_s`` (``delta_every_s``, from a config, a flag or a pipeline parameter) is
    a finite number of seconds >= 0."""
    if not math.isfinite(every_s) or every_s < 0:
        raise ValueError(f"delta_every_s must be a number of seconds >= 0 (0: no deltas), got {every_s}")


AUTO_EPOCHS = -1
"""The pipeline's and ``make run``'s ``epochs`` parameter value that means ``trainer.epochs: auto``."""


@dataclass
class TrainerConfig:
    """The hybrid training loop (PERSIA, Lian et al., KDD 2022, Sec. 4)."""

    batch_size: int = 512
    """Samples per NN worker per step."""
    epochs: int | str = 2
    """Passes over the train split, or ``auto``: up to ``max_epochs``, scoring the validation slice after each
    and stopping once its logloss has not improved for ``patience`` epochs; the model of the best epoch is kept,
    its embedding rows and optimizer state restored exactly (``persia_core.train.validation``)."""
    max_epochs: int = 10
    """``epochs: auto``: the most epochs trained."""
    patience: int = 2
    """``epochs: auto``: epochs without a better validation logloss before training stops."""
    patience_z: float = 3.0
    """``epochs: auto``: stop before ``patience`` runs out when an epoch's validation logloss is worse than the best
    epoch's by more than this many standard errors of the per-row difference over the slice (a paired t
    statistic, ``persia_core.train.validation.paired_worse_z``): a fall that later epochs are unlikely to undo,
    whose wait would only cost epochs on a large slice; a noisy bump on a small slice stays within it. Measured
    from the first best epoch a run scores (after a resume, from the next one). 0: off."""
    validation_fraction: float = 0.1
    """``epochs: auto``: the last fraction of the train split by timestamp (by row order where the data has none),
    held back from training and scored with read-only lookups after every epoch."""
    refit: bool = False
    """``epochs: auto``: once the validation slice has chosen the number of epochs, train the model again from its
    initial state (the init shards and the seeded or warm-started dense weights) on the whole train split,
    validation slice included, for that many epochs; that model is the Model artifact. As the LR reference is
    fitted again with the C its validation slice chose; about the cost of the chosen epochs once more. False (the
    default; the shipped ``criteo`` config turns it on): keep the best epoch's model (then
    ``train_on_validation``, whose pass over the latest rows comes last)."""
    train_on_validation: bool = True
    """``epochs: auto`` without ``refit``: once the best epoch is kept, train one pass over the validation slice
    (the latest rows of the train split), so that the Model has learnt from them too; its validation figures are
    the kept epoch's, measured before this pass."""
    embedding_staleness: int = 4
    """K: a worker may look rows up for up to K batches beyond its oldest gradient push not yet applied.
    K = 0 is fully synchronous training."""
    fresh_lookups: bool = True
    """With K >= 2: an embedding worker looks a batch's rows up only once the pushes of every step before the one
    in training are applied (staleness 1), as long as waiting for them still leaves the lookup ready before the
    NN worker needs it (judged from the NN worker's pace, the lookups' time and the pushes' latency); otherwise it
    looks up at once, within K. False: look up as soon as K and a free ready slot allow (staleness 2 or more)."""
    num_workers: int = 2
    """NN workers (torch DDP ranks, gloo on CPU)."""
    dense_lr: float = 1e-3
    """Adam learning rate of the dense network."""
    wide_dense_lr: float = 1e-2
    """Adam learning rate of the linear term of the dense features in the logit with ``model.wide`` (the wide
    part's; LR's and DeepFM's own linear term; never decayed): a linear weight must move far in few steps on a
    small sample, which the deep part's rate would not let it."""
    dense_lr_decay: float = 1.0
    """At the end of every epoch the dense network's Adam learning rate is multiplied by this: epoch e trains at
    ``dense_lr * dense_lr_decay ** (e - 1)`` (with ``model.wide``, the linear term's ``wide_dense_lr`` is not
    decayed), so that later epochs refine the dense network rather than fit it to the rows' noise. 1: constant."""
    embedding_lr_decay: float = 1.0
    """At the end of every epoch the learning rate of every embedding table but the wide one is multiplied by
    this: epoch e's pushes step at ``lr * embedding_lr_decay ** (e - 1)`` (the one pass over the validation slice
    after kept epoch k at ``** k``), so that a row seen again in a later epoch is refined rather than fitted to
    the same rows' noise (the one-epoch overfitting of deep CTR models: Zhang et al., CIKM 2022). The wide table,
    like the dense features' linear term, is not decayed. 1: constant."""
    dense_weight_decay: float = 0.0
    """Decoupled weight decay of the dense network's weight matrices (AdamW, Loshchilov & Hutter 2019; biases
    are not decayed): each step multiplies them by ``1 - dense_lr * dense_weight_decay``. 0: plain Adam."""
    seed: int = 0
    """Seed of the dense initialization, shuffling, ID dropout and the rows' initial values."""
    shuffle: bool = True
    """Shuffle each worker's rows every epoch (seeded by seed, epoch, rank); false: file order."""
    threads_per_worker: int = 1
    """torch intra-op threads per NN worker."""
    embedding_workers: int = 0
    """Embedding workers per NN worker (PERSIA's role: ID dropout, dedup, lookups, pooling and its backward,
    pushes; processes of their own against the parameter servers). 0: automatic, the host's cores less one per
    NN worker, shared among its NN workers (1 to 8)."""
    prefetch_threads: int = 1
    """Batches each embedding worker prepares ahead of the one in training (its ready slots beyond that one), and
    so how far its lookups may run ahead of training (never more than ``embedding_staleness``)."""
    rpc_timeout_s: float = 20.0
    """Deadline of each attempt of a parameter-server call (seconds); a call with its retries takes at most twice
    this, so a server that stops answering fails the job within 40 s at the default."""
    network_delay_s: float = 0.0
    """Injected cost per parameter-server call (seconds of round trip), to measure the regime of servers across
    a data-centre network on one machine; 0 = off."""
    network_bandwidth_bytes_per_s: float = 0.0
    """Injected bandwidth cap of parameter-server calls (bytes/s); 0 = off."""
    shared_memory: bool = True
    """Embedding workers and NN workers pass the arrays of their calls to parameter servers on the same host
    (loopback address) through shared memory instead of gRPC messages (``persia_core.ps.shm``), and make the
    calls over the servers' local channel (``persia_core.ps.local_channel``) instead of gRPC; off whenever a
    network cost is injected. False: always gRPC messages."""
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
        if isinstance(self.epochs, str) and self.epochs != "auto":
            raise config_error("trainer.epochs", f"must be an integer >= 1 or 'auto', got {self.epochs!r}")
        for name in ("batch_size", "num_workers", "threads_per_worker", "prefetch_threads", "max_epochs", "patience"):
            if getattr(self, name) < 1:
                raise config_error(f"trainer.{name}", "must be >= 1")
        if not self.auto_epochs and int(self.epochs) < 1:
            raise config_error("trainer.epochs", "must be >= 1 (or 'auto')")
        if not (math.isfinite(self.patience_z) and self.patience_z >= 0):
            raise config_error("trainer.patience_z", f"must be a number >= 0 (0: off), got {self.patience_z}")
        if not 0 < self.validation_fraction <= 0.5:
            raise config_error("trainer.validation_fraction", "must be in (0, 0.5]")
        if self.embedding_workers < 0:
            raise config_error("trainer.embedding_workers", "must be >= 0 (0: automatic)")
        if self.embedding_staleness < 0:
            raise config_error("trainer.embedding_staleness", "must be >= 0")
        if self.seed < 0:
            raise config_error("trainer.seed", "must be >= 0")
        if self.dense_lr <= 0:
            raise config_error("trainer.dense_lr", "must be > 0")
        if self.wide_dense_lr <= 0:
            raise config_error("trainer.wide_dense_lr", "must be > 0")
        if not 0 < self.dense_lr_decay <= 1:
            raise config_error("trainer.dense_lr_decay", f"must be in (0, 1], got {self.dense_lr_decay!r}")
        if not 0 < self.embedding_lr_decay <= 1:
            raise config_error("trainer.embedding_lr_decay", f"must be in (0, 1], got {self.embedding_lr_decay!r}")
        if not 0 <= self.dense_weight_decay * self.dense_lr < 1:
            raise config_error(
                "trainer.dense_weight_decay",
                "must be >= 0 with dense_lr * dense_weight_decay < 1 (the per-step shrink)",
            )
        if not 0 < self.rpc_timeout_s <= 86400:  # gRPC refuses deadlines far beyond a day outright
            raise config_error("trainer.rpc_timeout_s", "must be in (0, 86400] seconds")
        if self.network_delay_s < 0 or self.network_bandwidth_bytes_per_s < 0:
            raise config_error("trainer.network_delay_s/network_bandwidth_bytes_per_s", "must be >= 0")
        for name in ("checkpoint_every_steps", "checkpoint_every_s", "delta_every_s"):
            if getattr(self, name) < 0:
                raise config_error(f"trainer.{name}", "must be >= 0")
        if self.checkpoint_keep < 1:
            raise config_error("trainer.checkpoint_keep", "must be >= 1")
        if self.device not in ("auto", "cpu", "cuda"):
            raise config_error("trainer.device", f"must be auto, cpu or cuda, got {self.device!r}")

    @property
    def auto_epochs(self) -> bool:
        """Whether ``epochs`` is ``auto`` (validation-driven)."""
        return self.epochs == "auto"

    @property
    def scheduled_epochs(self) -> int:
        """The epochs the batch schedule holds: ``max_epochs`` with ``epochs: auto``, else ``epochs``."""
        return self.max_epochs if self.auto_epochs else int(self.epochs)
