"""NN worker process: one torch DDP rank running ``HybridTrainPipeline`` against the parameter servers.

Started by ``persia_core.train.launcher`` (or by a Vertex AI worker pool) with the torch.distributed environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; or, on one machine, ``PERSIA_DIST_FILE_STORE``: a
file rendezvous that listens nowhere) and ``PERSIA_PS_ADDRESSES`` (comma-separated ``host:port`` of shard
0..N-1). Rank 0 writes the dense weights (``dense.pt``) and ``train_metrics.json``.

Checkpoints (``persia_core.train.checkpointer``): every N steps and/or T seconds and at the end, all ranks stop at
the same step boundary and write one. Resuming (``--resume``) restores the dense model, its Adam state, the RNG
states, the loss history and the data position (the next step: the schedule is a function of seed, epoch and
rank, so the same batches follow). A warm start (``--init-dense``) loads only the dense weights.

Each run's parameter-server client takes a fresh id, so the applied-push records a shard restores from a
checkpoint (which belong to the previous run's clients) can never mark a new push as a duplicate.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import io as _io
import json
import logging
import os
import time
import uuid
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from persia_core import checkpoints as ckpt
from persia_core import io
from persia_core.allocator import keep_freed_memory
from persia_core.cluster_spec import DEVICE_ENV
from persia_core.config import RunConfig, load_config
from persia_core.data.reader import read_labels, read_schema, shard_files
from persia_core.embedding.backend import EmbeddingBackend
from persia_core.embedding.layout import table_layouts, wide_layout
from persia_core.logging_utils import PROGRESS_FORMAT, setup_logging
from persia_core.models import build_model, decay_dense_lr, dense_optimizer, load_dense_weights
from persia_core.models.dense import ModelBase
from persia_core.process_exit import exit_now
from persia_core.ps.client import EmbeddingClient
from persia_core.ps.protocol import EW_ADDRESSES_ENV, TOKEN_HEADER
from persia_core.train.checkpointer import Checkpointer, load_dense, load_rank_state, set_rng_state
from persia_core.train.embedding_worker import BatchSource, StepRules, rank_split
from persia_core.train.feeders import (
    Feeders,
    NetworkFeeders,
    ProcessFeeders,
    ThreadFeeders,
    auto_embedding_workers,
)
from persia_core.train.hybrid import HybridTrainPipeline
from persia_core.train.processes import die_with_spawner
from persia_core.train.ready_ring import RingLayout
from persia_core.train.schedule import make_schedule
from persia_core.train.validation import (
    INITIAL_DIR,
    BestCut,
    EarlyStopping,
    load_initial,
    paired_worse_z,
    remove_best,
    restore_best,
    save_best,
    save_initial,
    validation_loss,
)

log = logging.getLogger("persia.worker")


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> the GPU of this local rank when CUDA is available, else the CPU; ``$PERSIA_NN_DEVICE=cuda``
    (``cluster_spec.DEVICE_ENV``, set where the job was given GPUs) makes ``auto`` mean ``cuda``. Raises
    ``ValueError`` for ``cuda`` on a machine without CUDA."""
    if name == "auto" and os.environ.get(DEVICE_ENV) == "cuda":
        name = "cuda"
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError(
                f"trainer.device is 'cuda' (or ${DEVICE_ENV}=cuda: GPUs were requested) but CUDA is not available "
                f"on this machine: is the GPU driver visible to the process (on GKE, LD_LIBRARY_PATH holds "
                f"/usr/local/nvidia/lib64) and is torch a CUDA build?"
            )
        idx = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(idx)
        return torch.device("cuda", idx)
    return torch.device("cpu")


def build_dense(config: RunConfig, schema: dict, base_rate: float | None = None) -> ModelBase:
    """The dense model for a run, seeded by ``trainer.seed`` (identical on every rank); its logit's bias at the
    log-odds of ``base_rate`` (the train rows' fraction of positives) where given (``model.bias_init``)."""
    torch.manual_seed(config.trainer.seed)
    layouts = table_layouts(config)
    return build_model(
        config.model,
        sum(len(t.slots) for t in layouts),
        layouts[0].dim,
        len(schema["dense"]),
        schema.get("dense_mean"),
        schema.get("dense_std"),
        base_rate,
    )


def run_worker(
    config: RunConfig,
    data_dir: str,
    out_dir: str,
    backend: EmbeddingBackend,
    rank: int,
    world: int,
    progress_every: int = 20,
    on_step=None,
    checkpointer: Checkpointer | None = None,
    resume: tuple[str, dict] | None = None,
    init_dense: str = "",
    embedding_worker_addresses: list[str] | None = None,
    client_suffix: str = "ew",
) -> dict:
    """Train on this rank's share of the train split (files r, r+M, ...). Needs torch.distributed initialized
    when ``world > 1``. ``on_step(result: StepResult, global_loss: float, model)`` is called after every step.
    ``client_suffix``: the embedding workers' client ids' (``open_feeders``).

    ``checkpointer``: writes checkpoints when due and at the end (see ``persia_core.train.checkpointer.Checkpointer``).
    ``resume``: ``(checkpoint path, manifest)`` to continue from (the servers must hold that checkpoint's
    shards). ``init_dense``: a ``dense.pt`` whose weights start the model (warm start).
    Returns the training history (global mean loss per step, samples, elapsed seconds, staleness)."""
    tc = config.trainer
    schema = read_schema(data_dir)
    remote = list(embedding_worker_addresses or [])
    # embedding workers on other hosts read this rank's rows themselves: here only their count is needed (and,
    # with epochs: auto, this rank's validation rows, which it scores itself)
    examples, validation = (None, None) if remote and not tc.auto_epochs else rank_split(config, data_dir, rank, world)
    labels = read_labels(shard_files(data_dir, "train")[rank::world]) if examples is None else examples.labels
    mine = (len(labels), float(labels.sum(dtype=np.float64)))  # rows, positives: the base rate of the output bias
    if remote:
        examples = None
    gathered: list[Any] = [mine]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
    counts = [int(c) for c, _ in gathered]
    base_rate = sum(p for _, p in gathered) / max(sum(counts), 1)
    schedule = make_schedule(counts, tc.batch_size, tc.scheduled_epochs, tc.seed, tc.shuffle, rank)
    device = resolve_device(tc.device, int(os.environ.get("LOCAL_RANK", rank)))
    model = build_dense(config, schema, base_rate).to(device)
    model.load_kernels()  # at start-up, not in the first step
    torch.manual_seed(tc.seed * 100_003 + rank)  # the dropout masks (model.dropout): distinct per rank, seeded
    first_order_lr = tc.wide_dense_lr if config.model.wide else None  # the wide part's linear dense term's rate
    opt = dense_optimizer(model, tc.dense_lr, tc.dense_weight_decay, fused=True, first_order_lr=first_order_lr)
    history: dict[str, Any] = {"step": [], "samples": [], "loss": [], "elapsed_s": [], "staleness": []}
    start, samples, elapsed0, max_stal0 = 0, 0, 0.0, 0
    stopping = EarlyStopping(tc.patience, tc.patience_z) if tc.auto_epochs else None
    best_rows: np.ndarray | None = None  # this rank's per-row validation loglosses of the best epoch
    refit = stopping is not None and tc.refit  # the epochs chosen, the model is trained again on every row
    cut = BestCut(out_dir, config.embedding.num_shards, rank, world)  # where the best epoch's model waits
    best_state: dict | None = None  # this rank's copy of the best epoch's dense weights (epochs: auto)
    if resume is not None:
        path, manifest = resume
        saved = load_rank_state(path, manifest, rank, world)
        model_sd, opt_sd = load_dense(ckpt.read_file_checked(path, manifest, ckpt.DENSE_FILE))
        model.load_state_dict(model_sd)
        opt.load_state_dict(opt_sd)
        set_rng_state(saved["rng"])
        start, samples = int(saved["step"]), int(saved["samples"])
        elapsed0, max_stal0 = float(saved.get("elapsed_s", 0.0)), int(saved.get("max_staleness", 0))
        history = saved.get("history") or history
        if saved.get("early_stopping") is not None:
            stopping = EarlyStopping.from_dict(saved["early_stopping"])
        if len(schedule.global_batch) < start:
            raise ckpt.CheckpointError(f"{path} is at step {start}, beyond this run's {len(schedule.global_batch)}")
        log.info("resumed from %s at step %d (%d samples seen)", path, start, samples)
    # K of each stretch of steps ([first step, K], ...): K may change on resume (an execution setting), and the
    # run's metrics then say which steps ran at which K
    segments = history.get("staleness_segments")
    if not segments:
        lineage = resume[1].get("lineage", {}) if resume is not None else {}
        old_k = ((lineage.get("config") or {}).get("trainer") or {}).get("embedding_staleness", tc.embedding_staleness)
        segments = [[0, int(old_k)]]
    if segments[-1][1] != tc.embedding_staleness:
        if rank == 0:
            log.warning(
                "trainer.embedding_staleness is %d from step %d on; the checkpoint's steps ran at %d "
                "(train_metrics.json: staleness_segments)",
                tc.embedding_staleness,
                start,
                segments[-1][1],
            )
        segments.append([start, tc.embedding_staleness])
    history["staleness_segments"] = segments
    samples0 = samples
    if resume is None and init_dense:
        load_dense_weights(model, io.read_state_dict(init_dense), init_dense)
        log.info("dense weights warm-started from %s", init_dense)
    net: torch.nn.Module = model
    if world > 1:
        # the model's buffers (dense-feature normalization, index tables) are constants built identically on every
        # rank, so DDP need not broadcast them before each forward (one collective and sync point less per step)
        with warnings.catch_warnings():  # torch's own advice: keep broadcast_buffers=False until init_sync_buffers
            warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
            net = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device] if device.type == "cuda" else None, broadcast_buffers=False
            )
    layouts = table_layouts(config)
    if remote and tc.embedding_workers and tc.embedding_workers != len(remote):
        raise ValueError(
            f"trainer.embedding_workers={tc.embedding_workers} but NN worker {rank} was given {len(remote)} "
            f"embedding-worker addresses ({EW_ADDRESSES_ENV})"
        )
    ring = RingLayout(
        len(remote) or tc.embedding_workers or auto_embedding_workers(int(os.environ.get("LOCAL_WORLD_SIZE", world))),
        tc.prefetch_threads + 1,
        tc.batch_size,
        sum(len(t.slots) for t in layouts),
        layouts[0].dim,
        len(schema["dense"]),
        half=tc.fp16_transfer and device.type == "cuda",  # fp16 across PCIe, converted by the embedding workers
        wide=config.model.wide,
    )
    if refit and resume is None:  # the state the refit starts from, before any lookup creates a row
        assert stopping is not None
        stopping.initial_files = save_initial(cut, backend)
    feeders = open_feeders(
        config,
        backend,
        layouts,
        ring,
        rank,
        world,
        schedule,
        counts,
        start,
        examples,
        remote,
        data_dir,
        client_suffix=client_suffix,
    )
    examples = None  # freed: embedding-worker processes map their saved copy
    loop_started_unix = time.time()  # the embedding workers start preparing the first batches at once
    pipe = HybridTrainPipeline(net, opt, feeders, schedule.global_batch, start, world, device=device)
    total_steps = len(schedule.global_batch)
    # everything built so far lives until the end: keep it out of the garbage collector's scans. Unfrozen (in
    # ``finally`` below) before returning: the DDP model and this pipeline sit in reference cycles, and frozen
    # they would outlive ``destroy_process_group`` into interpreter shutdown, where gloo's threads still running
    # abort the process (SIGABRT, "terminate called without an active exception").
    gc.collect()
    gc.freeze()
    t0 = time.perf_counter()
    cpu0, main_cpu0 = time.process_time(), time.thread_time()
    wait = 0.0
    loss_sync_s = 0.0
    done = start

    def state(steps_done: int, pipe: HybridTrainPipeline) -> dict:
        """This rank's data position and history after ``steps_done`` steps (a checkpoint's rank file)."""
        return {
            "step": steps_done,
            "samples": samples,
            "rank": rank,
            "world": world,
            "elapsed_s": elapsed0 + time.perf_counter() - t0,
            "max_staleness": max(max_stal0, pipe.max_staleness),
            "total_steps": total_steps,
            "history": history if rank == 0 else None,
            "early_stopping": stopping.to_dict() if stopping is not None else None,
        }

    if checkpointer is not None:
        checkpointer.last_time = time.monotonic()  # the T-second clock starts with training, not start-up
    # The global loss of a step is an all-reduce over ranks. It is done every step only when something needs
    # it at once (an ``on_step`` callback, or time-based checkpoints, whose clocks the ranks must agree on);
    # otherwise the local losses of up to ``progress_every`` steps go in one all-reduce.
    timed = world > 1 and checkpointer is not None and checkpointer.settings.every_s > 0
    every_step = world == 1 or on_step is not None or timed
    pending: list = []  # (StepResult, local loss sum) not yet reduced

    def flush(time_flag: float = 0.0) -> bool:
        """Reduce the pending local losses (and, for time-based checkpoints, whether any rank's clock is due)."""
        nonlocal loss_sync_s
        if not pending:
            return False
        local = torch.tensor([p[1] for p in pending] + [time_flag], dtype=torch.float64)
        if world > 1:
            ta = time.perf_counter()
            local = local.to(device) if dist.get_backend() == "nccl" else local
            dist.all_reduce(local)
            local = local.cpu()
            loss_sync_s += time.perf_counter() - ta
        values = local.tolist()
        for (res, _), total in zip(pending, values[:-1], strict=True):
            history["loss"].append(total / max(schedule.global_batch[res.step], 1))
            if on_step is not None:
                on_step(res, history["loss"][-1], model)
        pending.clear()
        return values[-1] > 0

    steps_per_epoch = max(total_steps // tc.scheduled_epochs, 1)
    wide = wide_layout(config)
    try:
        while stopping is None or not stopping.stopped:
            try:
                r = pipe.progress()
            except StopIteration:
                break
            wait += r.wait_s
            pending.append((r, r.loss_sum))
            time_due = False
            if every_step:
                time_flag = 1.0 if checkpointer is not None and checkpointer.time_due() else 0.0
                time_due = flush(time_flag) if timed else (flush() or time_flag > 0)
            gb = schedule.global_batch[r.step]
            samples += gb
            done = r.step + 1
            if tc.dense_lr_decay != 1.0 and done % steps_per_epoch == 0:  # before a checkpoint of this boundary
                decay_dense_lr(opt, model, tc.dense_lr_decay)
            history["step"].append(r.step)
            history["samples"].append(samples)
            history["elapsed_s"].append(elapsed0 + time.perf_counter() - t0)
            history["staleness"].append(r.staleness)
            if r.step % progress_every == 0 or r.step == total_steps - 1:
                flush()
                if rank == 0:
                    log.info(
                        PROGRESS_FORMAT,
                        r.step + 1,
                        total_steps,
                        history["loss"][-1],
                        samples / max(history["elapsed_s"][-1], 1e-9),
                        r.staleness,
                    )
            if stopping is not None and done % steps_per_epoch == 0:  # an epoch's end: score the validation slice
                flush()
                pipe.drain()
                v_loss, v_rows, v_row_losses = validation_loss(model, backend, layouts, wide, validation, device, world)
                worse_z = None if best_rows is None else paired_worse_z(v_row_losses, best_rows, world, device)
                better = stopping.update(done // steps_per_epoch, done, v_loss, v_rows, worse_z)
                if better:
                    best_rows = v_row_losses
                if better and not refit:  # a refit needs only the number of epochs
                    best_state, stopping.shard_files = save_best(cut, model, opt, backend)
                if rank == 0:
                    log.info(
                        "epoch %d: validation logloss %.6f over %d rows (best: epoch %d)%s",
                        done // steps_per_epoch,
                        v_loss,
                        v_rows,
                        stopping.best_epoch,
                        f"; stopping: {stopping.stop_reason}" if stopping.stopped else "",
                    )
            if checkpointer is not None and done < total_steps and checkpointer.due(done, time_due):
                flush()
                checkpointer.save(done, pipe, model, opt, state(done, pipe))
        flush()
        pipe.drain()
        loop_ended_unix = time.time()  # every push of this rank applied
        ew_phases = feeders.phase_seconds()
        if (
            checkpointer is not None
            and checkpointer.settings.at_end
            and checkpointer.last_step != done
            and not (resume is not None and done == start)
        ):
            checkpointer.save(done, pipe, model, opt, state(done, pipe))
    finally:
        pipe.close()
        gc.unfreeze()
    if stopping is not None and not refit:  # the embedding workers are stopped: nothing looks rows up any more
        if stopping.best_step and stopping.best_step != done:
            restore_best(cut, model, opt, backend, stopping, best_state)
        if rank == 0:
            remove_best(out_dir)
        if tc.train_on_validation:
            assert validation is not None  # read with the train rows (rank_split) when epochs: auto
            kept = int(stopping.best_epoch) or done // steps_per_epoch  # epochs in the model it goes on from
            history["validation_pass"] = train_validation_slice(
                config, net, opt, backend, layouts, ring, rank, world, validation, device, data_dir, bool(remote), kept
            )
            max_stal0 = max(max_stal0, history["validation_pass"]["max_staleness"])
    if stopping is not None:
        history.update(
            {
                "validation": stopping.history,
                "best_epoch": stopping.best_epoch,
                "best_step": stopping.best_step,
                "stopped_early": done < total_steps,
                "steps_trained": done,
            }
        )
    elapsed = time.perf_counter() - t0
    cpu_s, main_cpu_s = time.process_time() - cpu0, time.thread_time() - main_cpu0
    max_stal = torch.tensor([max(max_stal0, pipe.max_staleness)])
    if world > 1:
        max_stal = max_stal.to(device) if dist.get_backend() == "nccl" else max_stal
        dist.all_reduce(max_stal, op=dist.ReduceOp.MAX)
        max_stal = max_stal.cpu()
        dist.barrier()
    history.update(
        {
            "samples_per_s": (samples - samples0) / max(elapsed, 1e-9),
            "max_staleness": int(max_stal.item()),
            "train_seconds": elapsed0 + elapsed,
            "wait_seconds_rank0": wait,
            "steps": total_steps,
            "num_workers": world,
            "embedding_staleness": tc.embedding_staleness,
            "device": str(device),
            "fp16_fallbacks": pipe.fp16_fallbacks,
            "embedding_workers": feeders.E,
            "resumed_from_step": start,
            # wall-clock bounds of this rank's training loop (Unix seconds), from the first batch's preparation to
            # the last push applied: the window in which make bench-feed counts every process's CPU time
            "train_loop_unix": [loop_started_unix, loop_ended_unix],
            "embedding_worker_phase_seconds": {
                p: round(sum(e[p] for e in ew_phases), 3) for p in (ew_phases[0] if ew_phases else {})
            },
            # busy share of the training loop's wall time: an NN worker near 1 is the bottleneck; embedding workers
            # near 1 (and a large "wait" of the NN worker) say that E is too small
            "utilization": utilization(pipe.phase_s, ew_phases, loop_ended_unix - loop_started_unix),
            "phase_seconds": {
                **{k: round(v, 3) for k, v in pipe.phase_s.items()},
                "loss_all_reduce": round(loss_sync_s, 3),
                "cpu_process": round(cpu_s, 3),
                "cpu_main_thread": round(main_cpu_s, 3),
            },
        }
    )
    if refit and stopping is not None and not stopping.best_epoch:  # no epoch scored: no refit, the last model
        if rank == 0:
            remove_best(out_dir, INITIAL_DIR)
    elif refit and stopping is not None:
        del pipe, net
        gc.collect()
        again = refit_from_initial(config, data_dir, out_dir, backend, cut, stopping, progress_every, init_dense)
        epochs = int(stopping.best_epoch)
        per_epoch = max(len(again["loss"]) // epochs, 1)
        history["refit"] = {
            "epochs": epochs,
            "rows": int(again["samples"][-1]) // epochs if again["samples"] else 0,
            "steps": int(again["steps"]),
            "loss": float(np.mean(again["loss"][-per_epoch:])) if again["loss"] else None,
            "seconds": round(float(again["train_seconds"]), 3),
            "samples_per_s": again["samples_per_s"],
            "max_staleness": again["max_staleness"],
        }
        history["train_seconds"] += again["train_seconds"]
        history["max_staleness"] = max(history["max_staleness"], again["max_staleness"])
        if rank == 0:  # the refit wrote the dense weights; its history goes beside the selection's
            io.write_text(io.join(out_dir, "train_metrics.json"), json.dumps(history))
        return history
    if rank == 0:
        buf = _io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, buf)
        io.write_bytes(io.join(out_dir, "dense.pt"), buf.getvalue())
        io.write_text(io.join(out_dir, "train_metrics.json"), json.dumps(history))
    # free the DDP model and the pipeline (reference cycles) now, so that the process group they hold can really be
    # destroyed by the caller's destroy_process_group, whoever the caller is
    del pipe, net
    gc.collect()
    return history


def open_feeders(
    config: RunConfig,
    backend: EmbeddingBackend,
    layouts: list,
    ring: RingLayout,
    rank: int,
    world: int,
    schedule,
    counts: list[int],
    start: int,
    examples,
    remote: list[str],
    data_dir: str,
    epochs: int | None = None,
    client_suffix: str = "ew",
    epoch0: int = 0,
) -> Feeders:
    """NN worker ``rank``'s embedding workers, started at step ``start`` of ``schedule`` (``counts`` rows per
    rank over ``epochs``, the config's where None): on other hosts at the ``remote`` addresses (they read
    ``data_dir`` themselves), else as processes beside it sharing one saved copy of ``examples`` (against the
    parameter servers of an ``EmbeddingClient``), else as threads against an in-process ``backend``. Their
    clients' ids end in ``-<client_suffix>-e<i>`` (a pass of its own needs ids of its own: the servers drop a
    push whose client id and sequence number they have applied). ``epoch0``: the number of the schedule's first
    epoch (``trainer.embedding_lr_decay``: the epochs trained before it). Returns them once started; raises
    ``ValueError`` for remote embedding workers without parameter servers, ``EmbeddingWorkerFailed`` for one that
    did not start."""
    feeders: Feeders
    if remote and not isinstance(backend, EmbeddingClient):
        raise ValueError("embedding workers on other hosts need the parameter servers (an EmbeddingClient)")
    if isinstance(backend, EmbeddingClient):  # embedding workers of their own, each with its own client
        spec = {"config": config.to_dict(), "world": world, "counts": counts}
        spec["client_id"] = f"{backend.client_id}-{client_suffix}"
        if epochs is not None:
            spec["epochs"] = epochs
        if epoch0:
            spec["epoch0"] = epoch0
        token = dict(backend.metadata).get(TOKEN_HEADER)
        if remote:  # on other hosts: they read this NN worker's share of the data themselves
            feeders = NetworkFeeders(
                ring, start, rank, dict(spec, data=data_dir), list(backend.addresses), token, remote
            )
        else:  # beside it, sharing one saved copy of its examples
            assert examples is not None  # read by the caller unless remote
            feeders = ProcessFeeders(ring, start, rank, spec, list(backend.addresses), token, examples)
    else:
        assert examples is not None
        source = BatchSource(examples, schedule.rows[rank], schedule.global_batch)
        rules = StepRules.of(config, rank, world, schedule.steps_per_epoch, epoch0)
        feeders = ThreadFeeders(backend, layouts, source, ring, start, rules)
    try:
        feeders.wait_started()
    except BaseException:
        feeders.close()
        raise
    return feeders


def refit_from_initial(
    config: RunConfig,
    data_dir: str,
    out_dir: str,
    backend: EmbeddingBackend,
    cut: BestCut,
    stopping: EarlyStopping,
    progress_every: int,
    init_dense: str,
) -> dict:
    """``trainer.refit``: the servers back at their initial state (``save_initial``), train the model again on the
    whole train split, validation slice included, for the ``stopping.best_epoch`` epochs the slice chose: the run
    ``trainer.epochs: <that many>`` would be (its dense weights seeded or warm-started from ``init_dense`` alike),
    with embedding workers beside this NN worker and no checkpoints (a job stopped meanwhile resumes from the
    selection's last checkpoint and refits again). Writes the dense weights (rank 0). Returns that run's
    history."""
    load_initial(cut, backend, stopping.initial_files)
    epochs = int(stopping.best_epoch)
    if cut.rank == 0:
        log.info("trainer.refit: training again from the initial state on every train row, %d epochs", epochs)
    again = config.with_overrides({"trainer.epochs": epochs, "trainer.refit": False})
    return run_worker(
        again,
        data_dir,
        out_dir,
        backend,
        cut.rank,
        cut.world,
        progress_every,
        init_dense=init_dense,
        client_suffix="rf",
    )


def train_validation_slice(
    config: RunConfig,
    net: torch.nn.Module,
    opt: torch.optim.Optimizer,
    backend: EmbeddingBackend,
    layouts: list,
    ring: RingLayout,
    rank: int,
    world: int,
    validation,
    device: torch.device,
    data_dir: str,
    remote: bool,
    epoch0: int = 0,
) -> dict:
    """``trainer.train_on_validation``: one pass of the kept model over the validation slice (this rank's
    ``validation`` examples, shuffled as an epoch is; every rank takes the same number of steps) under the same
    staleness bound as training, through embedding workers beside this NN worker as in training or, where those
    were on other hosts (``remote``: they served their one stream), through one embedding-worker thread of its
    own against its client; its embedding tables step at the rate of epoch ``epoch0`` + 1 (the epochs kept before
    it, ``trainer.embedding_lr_decay``). Every push is applied on return. Returns ``{"rows",
    "steps", "loss" (mean train logloss over the pass), "seconds", "max_staleness"}``."""
    tc = config.trainer
    t0 = time.perf_counter()
    gathered: list[Any] = [len(validation)]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, len(validation))
    counts = [int(c) for c in gathered]
    schedule = make_schedule(counts, tc.batch_size, 1, tc.seed, tc.shuffle, rank)
    feeders: Feeders
    if remote:  # its embedding workers on other hosts served their one stream: a thread here, without /dev/shm
        source = BatchSource(validation, schedule.rows[rank], schedule.global_batch)
        rules = StepRules.of(config, rank, world, schedule.steps_per_epoch, epoch0)
        feeders = ThreadFeeders(backend, layouts, source, dataclasses.replace(ring, workers=1), 0, rules)
        feeders.wait_started()
    else:
        feeders = open_feeders(
            config, backend, layouts, ring, rank, world, schedule, counts, 0, validation, [], data_dir, 1, "vp", epoch0
        )
    pipe = HybridTrainPipeline(net, opt, feeders, schedule.global_batch, 0, world, device=device)
    total = 0.0
    try:
        while True:
            try:
                total += pipe.progress().loss_sum
            except StopIteration:
                break
        pipe.drain()
    finally:
        pipe.close()
    loss = torch.tensor([total], dtype=torch.float64)
    if world > 1:
        loss = loss.to(device) if dist.get_backend() == "nccl" else loss
        dist.all_reduce(loss)
        loss = loss.cpu()
    rows = sum(counts)
    if rank == 0:
        log.info("trained one pass over the validation slice: %d rows, %d steps", rows, len(schedule.global_batch))
    return {
        "rows": rows,
        "steps": len(schedule.global_batch),
        "loss": float(loss.item()) / max(rows, 1),
        "seconds": round(time.perf_counter() - t0, 3),
        "max_staleness": pipe.max_staleness,
    }


def utilization(nn_phases: dict[str, float], ew_phases: list[dict[str, float]], wall_s: float) -> dict[str, float]:
    """``{"nn_worker": busy share, "embedding_workers": mean busy share}`` of ``wall_s`` seconds: the NN worker's
    phases but its waits, the embedding workers' phases but theirs (``wait_slot``, ``wait_bound``, ``wait_fresh``)."""
    wall = max(wall_s, 1e-9)
    nn = sum(v for k, v in nn_phases.items() if "wait" not in k)
    ew = [sum(v for k, v in e.items() if not k.startswith("wait")) for e in ew_phases]
    return {"nn_worker": round(nn / wall, 3), "embedding_workers": round(sum(ew) / max(len(ew), 1) / wall, 3)}


def settings_from(config: RunConfig, args, out_dir: str) -> ckpt.CheckpointSettings | None:
    """Checkpoint settings from the command line (``--checkpoint-dir`` and friends), else from the
    ``trainer.checkpoint_*`` config fields where the config has them. None when checkpoints are off."""
    if args.checkpoint_dir:

        def num(v, default):
            return default if v is None else v

        return ckpt.CheckpointSettings(
            dir=args.checkpoint_dir,
            every_steps=num(args.checkpoint_every_steps, 0),
            every_s=num(args.checkpoint_every_s, 0.0),
            keep=num(args.checkpoint_keep, 2),
            at_end=not args.no_checkpoint_at_end,
        )
    settings = ckpt.checkpoint_settings(config, out_dir)
    return settings if settings.periodic or settings.at_end else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="persia_core.train.worker", description="One NN worker (DDP rank).")
    p.add_argument("--config", required=True, help="run config YAML")
    p.add_argument("--data", required=True, help="preprocess output folder")
    p.add_argument("--out", required=True, help="model output folder")
    p.add_argument("--checkpoint-dir", default="", help="write checkpoints under this folder (empty: none)")
    p.add_argument("--checkpoint-every-steps", type=int, default=None, help="checkpoint every N steps (0: off)")
    p.add_argument("--checkpoint-every-s", type=float, default=None, help="checkpoint every T seconds (0: off)")
    p.add_argument("--checkpoint-keep", type=int, default=None, help="complete checkpoints to keep (default 2)")
    p.add_argument("--no-checkpoint-at-end", action="store_true", help="no checkpoint after the last step")
    p.add_argument("--resume", default="", help="checkpoint folder to continue from")
    p.add_argument("--init-dense", default="", help="dense.pt whose weights start the model (warm start)")
    p.add_argument("--lineage", default="", help="JSON file with the run's lineage (default: computed here)")
    args = p.parse_args(argv)
    if not die_with_spawner():  # the launcher died before this process could follow it
        return 1
    keep_freed_memory()  # the gradient handed back is a fresh multi-MiB tensor every step
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    setup_logging("nn_worker", rank)
    config = load_config(args.config)
    torch.set_num_threads(config.trainer.threads_per_worker)
    torch.set_flush_denormal(True)  # denormal floats are flushed to zero (as in the benchmark's baselines)
    if world > 1:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        backend = "nccl" if resolve_device(config.trainer.device, local_rank).type == "cuda" else "gloo"
        # long enough for a checkpoint of big shards; a dead peer is handled by the launcher, which kills all
        timeout = float(os.environ.get("PERSIA_DIST_TIMEOUT_S", "1800"))
        store_path = os.environ.get("PERSIA_DIST_FILE_STORE", "")
        # one machine (the local launcher): a file rendezvous, so nothing listens beyond 127.0.0.1; a cluster:
        # torch's env:// rendezvous at MASTER_ADDR:MASTER_PORT
        store = dist.FileStore(store_path, world) if store_path else None
        dist.init_process_group(
            backend, rank=rank, world_size=world, store=store, timeout=datetime.timedelta(seconds=timeout)
        )
    addresses = [a for a in os.environ["PERSIA_PS_ADDRESSES"].split(",") if a]
    tc = config.trainer
    client = EmbeddingClient(
        addresses,
        config.embedding,
        timeout_s=tc.rpc_timeout_s,
        client_id=f"worker{rank}-{uuid.uuid4().hex[:12]}",
        delay_s=tc.network_delay_s,
        bandwidth_bytes_per_s=tc.network_bandwidth_bytes_per_s,
        shared_memory=None if tc.shared_memory else False,
    )
    try:
        resume = None
        if args.resume:
            resume = (args.resume, ckpt.verify(args.resume, deep=True, deep_roles=("dense", "worker")))
        settings = settings_from(config, args, args.out)
        checkpointer = None
        if settings is not None:
            info = (
                json.loads(io.read_text(args.lineage))
                if args.lineage
                else (ckpt.lineage(config, args.data) if rank == 0 else {})
            )
            checkpointer = Checkpointer(settings, rank, world, client, len(addresses), info)
        run_worker(
            config,
            args.data,
            args.out,
            client,
            rank,
            world,
            checkpointer=checkpointer,
            resume=resume,
            init_dense=args.init_dense,
            embedding_worker_addresses=[a for a in os.environ.get(EW_ADDRESSES_ENV, "").split(",") if a],
        )
    finally:
        client.close()
        gc.collect()  # the DDP model (a reference cycle) releases the process group before it is destroyed
        if world > 1:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_now(main())
