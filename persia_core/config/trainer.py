"""Config section of the hybrid training loop: batches, staleness, workers, checkpoints, transport."""

from __future__ import annotations

from dataclasses import dataclass

from persia_core.config.errors import config_error


@dataclass
class TrainerConfig:
    """The hybrid training loop (PERSIA, Lian et al., KDD 2022, Sec. 4)."""

    batch_size: int = 512
    """Samples per NN worker per step."""
    epochs: int = 2
    """Passes over the train split."""
    embedding_staleness: int = 4
    """K: a worker may look rows up for up to K batches beyond its oldest gradient push not yet applied.
    K = 0 is fully synchronous training."""
    num_workers: int = 2
    """NN workers (torch DDP ranks, gloo on CPU)."""
    dense_lr: float = 1e-3
    """Adam learning rate of the dense network."""
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
                raise config_error(f"trainer.{name}", "must be >= 1")
        if self.embedding_workers < 0:
            raise config_error("trainer.embedding_workers", "must be >= 0 (0: automatic)")
        if self.embedding_staleness < 0:
            raise config_error("trainer.embedding_staleness", "must be >= 0")
        if self.seed < 0:
            raise config_error("trainer.seed", "must be >= 0")
        if self.dense_lr <= 0:
            raise config_error("trainer.dense_lr", "must be > 0")
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
