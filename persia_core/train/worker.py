"""NN worker process: one torch DDP rank running ``HybridTrainPipeline`` against the parameter servers.

Started by ``persia_core.train.launcher`` (or by a Vertex AI worker pool) with the torch.distributed environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and ``PERSIA_PS_ADDRESSES`` (comma-separated
``host:port`` of shard 0..N-1). Rank 0 writes the dense weights (``dense.pt``) and ``train_metrics.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from persia_core import io
from persia_core.config import RunConfig, load_config
from persia_core.data.reader import ParquetExamples, read_schema, shard_files
from persia_core.models import build_model
from persia_core.train.hybrid import HybridTrainPipeline, make_schedule, model_slot_order, table_layouts

log = logging.getLogger("persia.worker")


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> the GPU of this local rank when CUDA is available, else the CPU. Raises ``ValueError`` for
    ``cuda`` on a machine without CUDA."""
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("trainer.device is 'cuda' but CUDA is not available on this machine")
        idx = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(idx)
        return torch.device("cuda", idx)
    return torch.device("cpu")


def build_dense(config: RunConfig, schema: dict) -> torch.nn.Module:
    """The dense model for a run, seeded by ``trainer.seed`` (identical on every rank)."""
    torch.manual_seed(config.trainer.seed)
    layouts = table_layouts(config)
    return build_model(config.model, sum(len(t.slots) for t in layouts), layouts[0].dim, len(schema["dense"]),
                       schema.get("dense_mean"), schema.get("dense_std"))


def run_worker(config: RunConfig, data_dir: str, out_dir: str, backend, rank: int, world: int,
               progress_every: int = 20, on_step=None) -> dict:
    """Train on this rank's share of the train split (files r, r+M, ...). Needs torch.distributed initialized
    when ``world > 1``. ``on_step(result: StepResult, global_loss: float, model)`` is called after every step.
    Returns the training history (global mean loss per step, samples, elapsed seconds, staleness)."""
    tc = config.trainer
    schema = read_schema(data_dir)
    files = shard_files(data_dir, "train")[rank::world]
    slots = model_slot_order(config)
    examples = ParquetExamples(files, slots)
    counts = [len(examples)]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, len(examples))
        counts = [int(c) for c in gathered]
    schedule = make_schedule(counts, tc.batch_size, tc.epochs, tc.seed, tc.shuffle)
    device = resolve_device(tc.device, int(os.environ.get("LOCAL_RANK", rank)))
    model = build_dense(config, schema).to(device)
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    else:
        net = model
    opt = torch.optim.Adam(model.parameters(), lr=tc.dense_lr)
    dropout = {s.name: s.id_dropout for s in config.slots}
    batches = ((t, examples.batch(rows), schedule.global_batch[t]) for t, rows in enumerate(schedule.rows[rank]))
    pipe = HybridTrainPipeline(net, opt, backend, table_layouts(config), batches, tc.embedding_staleness, world,
                               rank, dropout, tc.seed, device=device, fp16_transfer=tc.fp16_transfer,
                               prefetch_threads=tc.prefetch_threads)
    history = {"step": [], "samples": [], "loss": [], "elapsed_s": [], "staleness": []}
    total_steps = len(schedule.global_batch)
    t0 = time.perf_counter()
    samples = 0
    wait = 0.0
    try:
        while True:
            try:
                r = pipe.progress()
            except StopIteration:
                break
            wait += r.wait_s
            loss = torch.tensor([r.loss_sum], dtype=torch.float64)
            if world > 1:
                dist.all_reduce(loss)
            gb = schedule.global_batch[r.step]
            samples += gb
            history["step"].append(r.step)
            history["samples"].append(samples)
            history["loss"].append(float(loss.item()) / max(gb, 1))
            history["elapsed_s"].append(time.perf_counter() - t0)
            history["staleness"].append(r.staleness)
            if on_step is not None:
                on_step(r, history["loss"][-1], model)
            if rank == 0 and (r.step % progress_every == 0 or r.step == total_steps - 1):
                log.info("step %d/%d loss %.4f samples/s %.0f staleness %d", r.step + 1, total_steps,
                         history["loss"][-1], samples / max(history["elapsed_s"][-1], 1e-9), r.staleness)
        pipe.drain()
    finally:
        pipe.close()
    elapsed = time.perf_counter() - t0
    max_stal = torch.tensor([pipe.max_staleness])
    if world > 1:
        dist.all_reduce(max_stal, op=dist.ReduceOp.MAX)
        dist.barrier()
    history.update({"samples_per_s": samples / max(elapsed, 1e-9), "max_staleness": int(max_stal.item()),
                    "train_seconds": elapsed, "wait_seconds_rank0": wait, "steps": total_steps,
                    "num_workers": world, "embedding_staleness": tc.embedding_staleness, "device": str(device),
                    "fp16_fallbacks": pipe.fp16_fallbacks})
    if rank == 0:
        buf = __import__("io").BytesIO()
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, buf)
        io.write_bytes(io.join(out_dir, "dense.pt"), buf.getvalue())
        io.write_text(io.join(out_dir, "train_metrics.json"), json.dumps(history))
    return history


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="persia_core.train.worker", description="One NN worker (DDP rank).")
    p.add_argument("--config", required=True, help="run config YAML")
    p.add_argument("--data", required=True, help="preprocess output folder")
    p.add_argument("--out", required=True, help="model output folder")
    args = p.parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s nn_worker[{rank}] %(message)s")
    config = load_config(args.config)
    torch.set_num_threads(config.trainer.threads_per_worker)
    if world > 1:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        backend = "nccl" if resolve_device(config.trainer.device, local_rank).type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    from persia_core.ps.client import EmbeddingClient

    addresses = [a for a in os.environ["PERSIA_PS_ADDRESSES"].split(",") if a]
    tc = config.trainer
    client = EmbeddingClient(addresses, config.embedding, timeout_s=tc.rpc_timeout_s, client_id=f"worker{rank}",
                             delay_s=tc.network_delay_s, bandwidth_bytes_per_s=tc.network_bandwidth_bytes_per_s)
    try:
        run_worker(config, args.data, args.out, client, rank, world)
    finally:
        client.close()
        if world > 1:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
