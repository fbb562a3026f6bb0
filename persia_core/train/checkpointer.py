"""Checkpoints from inside the NN workers' loop: the consistent cut (``Checkpointer``), the dense model and RNG
states as checkpoint files, and a rank's saved state read back on resume (the format: ``persia_core.checkpoints``).

A consistent cut (``Checkpointer.save``, run by every NN worker at the same step boundary): each worker drains
its in-flight gradient pushes; a barrier; rank 0 has every shard dump concurrently while each rank writes its own
state; a second collective releases the workers once every file is durable; rank 0 then writes the manifest by an
atomic rename (``os.replace``; on Cloud Storage the manifest object is uploaded last, and an object appears
whole).
"""

from __future__ import annotations

import base64
import io as _io
import json
import logging
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

from persia_core import io
from persia_core.checkpoints import (
    DENSE_FILE,
    CheckpointError,
    CheckpointSettings,
    checkpoint_path,
    prune,
    rank_file,
    read_file_checked,
    remove_manifest,
    write_durable,
    write_manifest,
)
from persia_core.embedding.backend import EmbeddingBackend
from persia_core.model_store import shard_file_name

log = logging.getLogger("persia.checkpoint")


# ---- the dense model, RNG states ------------------------------------------------------------------------------
def dense_bytes(model: torch.nn.Module, optimizer) -> bytes:
    buf = _io.BytesIO()
    torch.save(
        {"model": {k: v.detach().cpu() for k, v in model.state_dict().items()}, "optimizer": optimizer.state_dict()},
        buf,
    )
    return buf.getvalue()


def load_dense(data: bytes) -> tuple[dict, dict]:
    """``(model state_dict, optimizer state_dict)`` from ``dense.pt`` bytes (no pickles executed)."""
    d = torch.load(_io.BytesIO(data), weights_only=True, map_location="cpu")
    return d["model"], d["optimizer"]


def rng_state() -> dict:
    """Python, NumPy and torch global RNG states, JSON-able."""
    py = random.getstate()
    # the legacy form of the state (numpy's stubs also allow the dict form)
    name, keys, pos, has_gauss, gauss = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
    }


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    raw = np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()
    torch.set_rng_state(torch.from_numpy(raw))


# ---- the consistent cut, from the NN workers ----------------------------------------------------------------
class Checkpointer:
    """Writes checkpoints from inside the NN workers' loop (``persia_core.train.worker.run_worker``).

    Every rank calls ``due`` after each step with the same arguments (the time rule is decided by rank 0 and
    shared through the step's loss all-reduce), and ``save`` when it says so; see the module docstring for the
    protocol. ``lineage`` goes into every manifest."""

    def __init__(
        self,
        settings: CheckpointSettings,
        rank: int,
        world: int,
        backend: EmbeddingBackend,
        num_shards: int,
        lineage_info: dict,
        extra: dict | None = None,
    ):
        self.settings = settings
        self.rank = rank
        self.world = world
        self.backend = backend
        self.num_shards = num_shards
        self.lineage = lineage_info
        self.extra = extra or {}
        self.last_time = time.monotonic()
        self.last_step: int | None = None
        self.written: list[str] = []

    def time_due(self) -> bool:
        """Rank 0's clock says a checkpoint is due (``every_s``)."""
        s = self.settings
        return self.rank == 0 and s.every_s > 0 and time.monotonic() - self.last_time >= s.every_s

    def due(self, steps_done: int, time_flag: bool) -> bool:
        s = self.settings
        return (s.every_steps > 0 and steps_done % s.every_steps == 0) or time_flag

    def save(self, steps_done: int, pipe, model, optimizer, state: dict) -> str | None:
        """Write the checkpoint of the state after ``steps_done`` steps (every rank calls this at the same
        boundary). ``state``: this rank's data position and history (JSON-able). Returns the path on rank 0."""
        t0 = time.perf_counter()
        path = checkpoint_path(self.settings.dir, steps_done)
        if pipe is not None:
            pipe.drain()
        if self.rank == 0:
            remove_manifest(path)
        if self.world > 1:
            dist.barrier()
        futs: Future | None = None
        if self.rank == 0:
            ex = ThreadPoolExecutor(max_workers=1)
            futs = ex.submit(self.backend.dump, [io.join(path, shard_file_name(s)) for s in range(self.num_shards)])
            ex.shutdown(wait=False)
        files: list[dict[str, Any]] = []
        rel = rank_file(self.rank)
        n, c = write_durable(io.join(path, rel), json.dumps({**state, "rng": rng_state()}).encode("utf-8"))
        files.append({"path": rel, "bytes": n, "crc32c": c, "role": "worker", "rank": self.rank})
        if self.rank == 0:
            n, c = write_durable(io.join(path, DENSE_FILE), dense_bytes(model, optimizer))
            files.append({"path": DENSE_FILE, "bytes": n, "crc32c": c, "role": "dense"})
            assert futs is not None
            for s, (n, c) in enumerate(futs.result()):
                files.append({"path": shard_file_name(s), "bytes": n, "crc32c": c, "role": "shard", "shard": s})
        if self.world > 1:
            gathered: list = [None] * self.world
            dist.all_gather_object(gathered, files)
            files = [f for part in gathered for f in part]
        self.last_time = time.monotonic()
        self.last_step = steps_done
        if self.rank != 0:
            return None
        files.sort(key=lambda e: e["path"])
        write_manifest(
            path,
            steps_done,
            files,
            self.lineage,
            {
                "num_shards": self.num_shards,
                "num_workers": self.world,
                "seconds_to_write": time.perf_counter() - t0,
                **self.extra,
            },
        )
        self.written.append(path)
        removed = prune(self.settings.dir, self.settings.keep)
        log.info(
            "checkpoint %s written in %.2f s (%d files, %.1f MB)%s",
            path,
            time.perf_counter() - t0,
            len(files),
            sum(f["bytes"] for f in files) / 1e6,
            f"; removed {len(removed)} older" if removed else "",
        )
        return path


def load_rank_state(ckpt: str, manifest: dict, rank: int, world: int) -> dict:
    """Rank ``rank``'s saved state (checked). Raises ``CheckpointError`` when the checkpoint was written by a
    different number of NN workers (the data position is per worker)."""
    if int(manifest.get("num_workers", world)) != world:
        raise CheckpointError(
            f"{ckpt} was written by {manifest.get('num_workers')} NN workers, this run has "
            f"{world}: the data position is per worker, so resume with the same "
            f"trainer.num_workers"
        )
    return json.loads(read_file_checked(ckpt, manifest, rank_file(rank)))
