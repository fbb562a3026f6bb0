"""The hybrid trainer: pooling, K = 0 equivalences against in-process references, DDP, staleness, uneven data."""

import json
import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from slow_server import SlowPushes
from support import tiny_config, write_dataset

from persia_core.config import RunConfig
from persia_core.data.reader import ParquetExamples, shard_files
from persia_core.embedding.layout import model_slot_order, prepare_ids, table_layouts
from persia_core.embedding.pooling import pool
from persia_core.embedding.reference import LocalEmbedding
from persia_core.embedding.routing import positions_by_shard
from persia_core.embedding.shard_tables import load_shard_file, make_tables
from persia_core.sparse import IdBatch
from persia_core.train.embedding_worker import BatchSource, StepRules
from persia_core.train.feeders import ThreadFeeders
from persia_core.train.hybrid import HybridTrainPipeline
from persia_core.train.launcher import train
from persia_core.train.local_cluster import LocalCluster
from persia_core.train.ready_ring import PHASES, RingLayout
from persia_core.train.schedule import make_schedule
from persia_core.train.worker import build_dense, run_worker


def test_empty_multi_hot_bag_pools_to_exact_zeros_with_zero_gradient():
    # slot 0: [a], [b, a]; slot 1 (multi-hot): [], [c]
    ids = IdBatch(["s0", "s1"], np.array([1, 2, 1, 3], np.uint64), np.array([0, 1, 3, 3, 4]), 2)
    layout = [type("L", (), {"name": "t", "dim": 3, "slots": ["s0", "s1"]})()]
    prep = prepare_ids(ids, layout)["t"]
    rows = torch.tensor(np.arange(9, dtype=np.float32).reshape(3, 3) + 1, requires_grad=True)
    out = pool(rows, prep, 2, 2)  # [B, S, D]
    assert out.shape == (2, 2, 3)
    assert torch.equal(out[0, 1], torch.zeros(3))
    out[0, 1].sum().backward(retain_graph=True)
    assert torch.equal(rows.grad, torch.zeros(3, 3))
    rows.grad = None
    out.sum().backward()
    # ID 1 appears twice: its gradient is summed into one row
    assert rows.grad[0].tolist() == [2.0, 2.0, 2.0]


def test_ids_prepared_for_shards_are_grouped_by_the_shard_that_owns_them():
    rng = np.random.default_rng(2)
    values = rng.integers(1, 2**63, 500).astype(np.uint64)
    ids = IdBatch(["s0", "s1"], np.concatenate([values, values[:300]]), np.arange(801), 400)
    layout = [type("L", (), {"name": "t", "dim": 3, "slots": ["s0", "s1"]})()]
    plain, grouped = prepare_ids(ids, layout)["t"], prepare_ids(ids, layout, num_shards=3)["t"]
    assert plain.bounds is None and grouped.bounds[0] == 0 and grouped.bounds[-1] == len(grouped.uniq)
    np.testing.assert_array_equal(grouped.uniq[grouped.inverse], ids.values)  # the same IDs per bag
    np.testing.assert_array_equal(np.sort(grouped.uniq), np.sort(plain.uniq))
    for s in range(3):  # each shard's IDs contiguous, as routing places them
        part = grouped.uniq[grouped.bounds[s] : grouped.bounds[s + 1]]
        np.testing.assert_array_equal(part, plain.uniq[positions_by_shard(plain.uniq, 3)[s]])


def test_one_id_per_bag_pools_by_gather_equal_to_embedding_bag():
    rng = np.random.default_rng(0)
    b, s = 64, 3
    values = rng.integers(0, 20, b * s).astype(np.uint64)  # repeats: gradients must be summed per unique ID
    ids = IdBatch([f"s{i}" for i in range(s)], values, np.arange(b * s + 1), b)
    layout = [type("L", (), {"name": "t", "dim": 5, "slots": ids.keys})()]
    prep = prepare_ids(ids, layout)["t"]
    assert prep.one_per_bag
    rows = torch.tensor(rng.normal(size=(len(prep.uniq), 5)).astype(np.float32))
    weight = torch.tensor(rng.normal(size=(b, s, 5)).astype(np.float32))
    fast, ref = rows.clone().requires_grad_(True), rows.clone().requires_grad_(True)
    out_fast = pool(fast, prep, s, b)
    prep.one_per_bag = False
    out_ref = pool(ref, prep, s, b)
    torch.testing.assert_close(out_fast, out_ref, rtol=0, atol=0)
    (out_fast * weight).sum().backward()
    (out_ref * weight).sum().backward()
    torch.testing.assert_close(fast.grad, ref.grad, rtol=1e-6, atol=1e-6)
    multi = IdBatch(["a"], np.array([1, 2, 3], np.uint64), np.array([0, 2, 3]), 2)  # a bag of two
    assert not prepare_ids(multi, [type("L", (), {"name": "t", "dim": 5, "slots": ["a"]})()])["t"].one_per_bag


def _in_process(config: RunConfig, data_dir: str, out_dir: str):
    os.makedirs(out_dir, exist_ok=True)
    backend = LocalEmbedding(config.embedding, num_shards=1, seed=config.trainer.seed)
    hist = run_worker(config, data_dir, out_dir, backend, rank=0, world=1)
    return hist, backend


def _dense(path):
    return torch.load(path, weights_only=True)


@pytest.mark.processes
@pytest.mark.parametrize("embedding_workers", [1, 2])
def test_two_servers_one_worker_k0_gives_the_loss_curve_of_the_in_process_reference(tmp_path, embedding_workers):
    data = write_dataset(str(tmp_path / "data"), rows=192)
    cfg = tiny_config(num_workers=1, embedding_staleness=0, epochs=2, shuffle=True, embedding_workers=embedding_workers)
    manifest = train(cfg, data, str(tmp_path / "model"), work_dir=str(tmp_path / "work"))
    dist_hist = json.load(open(tmp_path / "model" / "train_metrics.json"))
    ref_hist, ref = _in_process(cfg, data, str(tmp_path / "ref"))
    assert len(dist_hist["loss"]) == len(ref_hist["loss"]) == 24
    np.testing.assert_allclose(dist_hist["loss"], ref_hist["loss"], atol=1e-5, rtol=0)
    a, b = _dense(tmp_path / "model" / "dense.pt"), _dense(tmp_path / "ref" / "dense.pt")
    for k in a:
        np.testing.assert_allclose(a[k].numpy(), b[k].numpy(), atol=1e-5)
    # every embedding row the servers hold equals the reference's
    for rel in manifest["shard_files"]:
        tables = make_tables(cfg.embedding.tables, cfg.embedding.shard_memory_bytes)
        load_shard_file(str(tmp_path / "model" / rel), tables)
        sd = tables["default"].state_dict()
        np.testing.assert_allclose(sd["weights"], ref.lookup_readonly("default", sd["keys"]), atol=1e-5)
    assert dist_hist["max_staleness"] == 0


def _rank_main(rank, world, port, addrs, token, cfg_dict, data, out_dir):
    import torch.distributed as dist

    from persia_core.ps.client import EmbeddingClient

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    cfg = RunConfig.from_dict(cfg_dict)
    client = EmbeddingClient(addrs, cfg.embedding, token=token, client_id=f"w{rank}")
    digests = []

    def on_step(r, loss, model):
        digests.append(
            [float(p.detach().double().sum()) for p in model.parameters()]
            + [float(p.detach().double().abs().sum()) for p in model.parameters()]
        )

    hist = run_worker(cfg, data, out_dir, client, rank, world, on_step=on_step)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"digests": digests, "loss": hist["loss"], "max_staleness": hist["max_staleness"]}, f)
    client.close()
    dist.destroy_process_group()


def _run_two_ranks(tmp_path, cfg: RunConfig, data: str, name: str):
    from persia_core.train.processes import free_port

    out = str(tmp_path / name)
    os.makedirs(out, exist_ok=True)
    cfg_path = str(tmp_path / f"{name}.yaml")
    with open(cfg_path, "w") as f:
        f.write(cfg.to_yaml())
    with LocalCluster(cfg_path, cfg.embedding.num_shards, 2, str(tmp_path / f"{name}-work")) as cluster:
        addrs = cluster.start_servers()
        mp.start_processes(
            _rank_main,
            args=(2, free_port(), addrs, cluster.token, cfg.to_dict(), data, out),
            nprocs=2,
            join=True,
            start_method="spawn",
        )
        from persia_core.ps.client import EmbeddingClient

        client = EmbeddingClient(addrs, cfg.embedding, token=cluster.token)
        paths = [str(tmp_path / name / f"shard{s}.npz") for s in range(cfg.embedding.num_shards)]
        client.dump(paths)
        client.close()
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    return out, ranks, paths


@pytest.mark.processes
def test_two_workers_keep_identical_dense_weights_after_every_step_and_loss_falls(tmp_path):
    data = write_dataset(str(tmp_path / "data"), rows=512)
    cfg = tiny_config(num_workers=2, embedding_staleness=2, epochs=3, shuffle=True)
    _, ranks, _ = _run_two_ranks(tmp_path, cfg, data, "ddp")
    assert len(ranks[0]["digests"]) == len(ranks[1]["digests"]) == 48
    for d0, d1 in zip(ranks[0]["digests"], ranks[1]["digests"], strict=True):
        assert d0 == d1  # bitwise identical after every step
    loss = ranks[0]["loss"]
    assert np.mean(loss[-16:]) < np.mean(loss[:16]) - 0.02
    assert 0 <= ranks[0]["max_staleness"] <= 2


@pytest.mark.processes
def test_two_workers_k0_equal_one_worker_on_the_concatenated_batches(tmp_path):
    data = write_dataset(str(tmp_path / "data"), rows=256, shard_rows=[128, 96])
    cfg = tiny_config(num_workers=2, embedding_staleness=0, epochs=2, shuffle=True)
    out, ranks, shard_paths = _run_two_ranks(tmp_path, cfg, data, "two")

    # reference: one worker, one in-process table, batches = rank 0's batch t + rank 1's batch t
    files = shard_files(data, "train")
    ex = [ParquetExamples([files[0]], model_slot_order(cfg)), ParquetExamples([files[1]], model_slot_order(cfg))]
    both = ParquetExamples(files, model_slot_order(cfg))
    sched = make_schedule([len(ex[0]), len(ex[1])], cfg.trainer.batch_size, cfg.trainer.epochs, 0, True)
    rows = [np.concatenate([sched.rows[0][t], len(ex[0]) + sched.rows[1][t]]) for t in range(len(sched.global_batch))]
    from persia_core.data.reader import read_schema

    # the output bias starts at the log-odds of the positives of both ranks' rows together (unequal shards)
    model = build_dense(cfg, read_schema(data), float(both.labels.astype(np.float64).mean()))
    opt = torch.optim.Adam(model.parameters(), lr=cfg.trainer.dense_lr)
    ref = LocalEmbedding(cfg.embedding, 1)
    layouts = table_layouts(cfg)
    num_dense = len(read_schema(data)["dense"])
    ring = RingLayout(1, 2, 2 * cfg.trainer.batch_size, sum(len(t.slots) for t in layouts), layouts[0].dim, num_dense)
    source = BatchSource(both, rows, sched.global_batch)
    feeders = ThreadFeeders(ref, layouts, source, ring, 0, StepRules(staleness=0, num_workers=1, rank=0))
    feeders.wait_started()
    pipe = HybridTrainPipeline(model, opt, feeders, sched.global_batch, 0, num_workers=1)
    losses = []
    while True:
        try:
            r = pipe.progress()
        except StopIteration:
            break
        losses.append(r.loss_sum / sched.global_batch[r.step])
    pipe.drain()
    pipe.close()
    assert len(losses) == len(ranks[0]["loss"]) == 16
    np.testing.assert_allclose(ranks[0]["loss"], losses, atol=1e-5, rtol=0)
    dense = torch.load(os.path.join(out, "dense.pt"), weights_only=True)
    for k, v in model.state_dict().items():
        np.testing.assert_allclose(dense[k].numpy(), v.numpy(), atol=1e-5)
    for p in shard_paths:
        tables = make_tables(cfg.embedding.tables, cfg.embedding.shard_memory_bytes)
        load_shard_file(p, tables)
        sd = tables["default"].state_dict()
        np.testing.assert_allclose(sd["weights"], ref.lookup_readonly("default", sd["keys"]), atol=1e-5)
        np.testing.assert_allclose(
            sd["acc"],
            np.concatenate(
                [
                    ref.shards[0]["default"].state_dict()["acc"][ref.shards[0]["default"].state_dict()["keys"] == k]
                    for k in sd["keys"]
                ]
            ),
            atol=1e-5,
        )


@pytest.mark.processes
def test_uneven_shards_across_two_ranks_finish(tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="persia.launcher")
    data = write_dataset(str(tmp_path / "data"), shard_rows=[100, 7])
    cfg = tiny_config(num_workers=2, embedding_staleness=1, epochs=1, embedding_workers=2)
    train(cfg, data, str(tmp_path / "model"), work_dir=str(tmp_path / "work"))
    hist = json.load(open(tmp_path / "model" / "train_metrics.json"))
    assert hist["embedding_workers"] == 2
    assert hist["samples"][-1] == 107
    assert len(hist["loss"]) == 7  # ceil(100 / 16) steps; rank 1 runs empty steps after its data ends
    # the launcher repeats rank 0's progress in its own log (before: silence until the end)
    relayed = [r.getMessage() for r in caplog.records if r.name == "persia.launcher"]
    assert any(m.startswith("nn_worker-0: step 7/7 loss ") for m in relayed), relayed


def test_progress_relay_repeats_the_newest_progress_line_at_most_once_per_interval_and_milestones_at_once(
    tmp_path, caplog, monkeypatch
):
    import logging

    from persia_core.train import local_cluster

    caplog.set_level(logging.INFO, logger="persia.launcher")
    now = [100.0]
    monkeypatch.setattr(local_cluster.time, "monotonic", lambda: now[0])
    path = tmp_path / "nn_worker-0.log"
    relay = local_cluster.ProgressRelay(str(path), interval_s=10.0)
    relay.poll()  # no file yet: nothing, no error
    line = "2026-01-01 INFO nn_worker[0] persia.worker: step {}/9 loss 0.6{} samples/s 100 staleness 1\n"
    epoch = "2026-01-01 INFO nn_worker[0] persia.worker: epoch 1: validation logloss 0.5 over 8 rows (best: epoch 1)\n"
    refit = (
        "2026-01-01 INFO nn_worker[0] persia.worker: trainer.refit: training again from the initial state, 1 epochs\n"
    )
    with open(path, "a") as f:
        f.write(line.format(1, 1) + "other line\n" + line.format(2, 2) + line.format(3, 3)[:30])  # 3: unfinished
    relay.poll()
    now[0] += 5
    with open(path, "a") as f:
        f.write(line.format(3, 3)[30:] + epoch + line.format(4, 4))
    relay.poll()  # within the interval: not repeated; an epoch's score always, at once
    now[0] += 6
    relay.poll()  # nothing new since
    with open(path, "a") as f:
        f.write(line.format(5, 5))
    relay.poll()
    with open(path, "a") as f:
        f.write(refit + line.format(9, 9))
    relay.poll()  # the last step: always
    got = [r.getMessage() for r in caplog.records if r.name == "persia.launcher"]
    assert got == [
        "nn_worker-0: step 2/9 loss 0.62 samples/s 100 staleness 1",
        "nn_worker-0: epoch 1: validation logloss 0.5 over 8 rows (best: epoch 1)",
        "nn_worker-0: step 5/9 loss 0.65 samples/s 100 staleness 1",
        "nn_worker-0: trainer.refit: training again from the initial state, 1 epochs",
        "nn_worker-0: step 9/9 loss 0.69 samples/s 100 staleness 1",
    ]


@pytest.mark.processes
def test_a_rank_without_any_train_file_runs_empty_steps_and_the_run_finishes(tmp_path):
    # 3 workers, 2 train files: rank 2 holds no row at all, so its batches must still have the schema's dense width
    data = write_dataset(str(tmp_path / "data"), shard_rows=[40, 9])
    cfg = tiny_config(num_workers=3, embedding_staleness=1, epochs=1)
    train(cfg, data, str(tmp_path / "model"), work_dir=str(tmp_path / "work"))
    hist = json.load(open(tmp_path / "model" / "train_metrics.json"))
    assert hist["samples"][-1] == 49
    assert len(hist["loss"]) == 3  # ceil(40 / 16) steps; ranks 1 and 2 run empty steps


def test_worker_leaves_nothing_frozen_so_its_model_and_pipeline_are_freed_before_shutdown(tmp_path):
    # run_worker freezes the garbage collector while training. Left frozen, the DDP model (a reference cycle) keeps
    # the process group alive past destroy_process_group, into interpreter shutdown, where gloo aborted a worker
    # (SIGABRT) in CI. After run_worker returns, a collection must free the model and the pipeline.
    import gc

    data = write_dataset(str(tmp_path / "data"), rows=64)
    cfg = tiny_config(num_workers=1, embedding_staleness=1, epochs=1)
    _in_process(cfg, data, str(tmp_path / "out"))
    assert gc.get_freeze_count() == 0
    assert not [o for o in gc.get_objects() if isinstance(o, HybridTrainPipeline)]  # already freed on return


@pytest.mark.parametrize("slots", [["a", "b"], ["a", "tags", "b"]], ids=["one-hot", "multi-hot"])
def test_parquet_batches_hold_each_rows_ids_slot_major_on_both_paths(tmp_path, slots):
    # one-hot slots take the one-gather path (ids held as a matrix); a multi-hot slot the jagged path
    import pyarrow.parquet as pq

    from persia_core.data import schema as S

    data = write_dataset(str(tmp_path / "data"), rows=120, shards=2)
    files = shard_files(data, "train")
    ex = ParquetExamples(files, slots)
    assert (ex.fixed is not None) == ("tags" not in slots)
    table = [r for f in files for r in pq.read_table(f).to_pylist()]
    rows = np.array([5, 0, 119, 5, 64, 63])
    b = ex.batch(rows)
    assert b.ids.keys == slots and b.ids.batch_size == len(rows)
    bags = [b.ids.values[b.ids.offsets[i] : b.ids.offsets[i + 1]].tolist() for i in range(len(slots) * len(rows))]
    assert bags == [table[r][S.slot_column(s)] for s in slots for r in rows]
    np.testing.assert_array_equal(b.labels, [table[r][S.LABEL] for r in rows])
    np.testing.assert_array_equal(b.dense[:, 0], np.float32([table[r][S.DENSE][0] for r in rows]))
    assert ex.batch(np.zeros(0, np.int64)).ids.values.shape == (0,)
    # the copy an NN worker saves for its embedding-worker processes maps back to the same batches
    ex.save(str(tmp_path / "saved"))
    mapped = ParquetExamples.mapped(str(tmp_path / "saved"))
    assert (
        isinstance(mapped.labels, np.memmap) and len(mapped) == len(ex) and (mapped.fixed is None) == (ex.fixed is None)
    )
    m = mapped.batch(rows)
    assert m.ids.keys == b.ids.keys and m.ids.batch_size == b.ids.batch_size
    for x, y in (
        (m.ids.values, b.ids.values),
        (m.ids.offsets, b.ids.offsets),
        (m.dense, b.dense),
        (m.labels, b.labels),
    ):
        np.testing.assert_array_equal(x, y)
        assert x.dtype == y.dtype


def _half_ring_run(tmp_path, half: bool, scale: float = 1.0):
    """One worker on an in-process table with a ring of fp32 or fp16 embeddings (``half``); the dense model's
    logits are multiplied by ``scale``. Returns (first step's embeddings as the model saw them, losses, pipeline,
    the table)."""
    from persia_core.data.reader import read_schema

    data = str(tmp_path / "data")
    if not os.path.exists(data):
        write_dataset(data, rows=128)
    cfg = tiny_config(num_workers=1, embedding_staleness=0, epochs=2, shuffle=True)
    examples = ParquetExamples(shard_files(data, "train"), model_slot_order(cfg))
    sched = make_schedule([len(examples)], cfg.trainer.batch_size, cfg.trainer.epochs, 0, True)
    torch.manual_seed(0)
    model = build_dense(cfg, read_schema(data))
    seen: list[torch.Tensor] = []

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, emb, dense):
            seen.append(emb.detach().clone())
            return self.inner(emb, dense) * scale

    opt = torch.optim.Adam(model.parameters(), lr=cfg.trainer.dense_lr)
    table = LocalEmbedding(cfg.embedding, 1)
    layouts = table_layouts(cfg)
    ring = RingLayout(1, 2, cfg.trainer.batch_size, 3, layouts[0].dim, 1, half=half)
    feeders = ThreadFeeders(
        table,
        layouts,
        BatchSource(examples, sched.rows[0], sched.global_batch),
        ring,
        0,
        StepRules(staleness=0, num_workers=1, rank=0),
    )
    feeders.wait_started()
    pipe = HybridTrainPipeline(Scaled(), opt, feeders, sched.global_batch, 0, num_workers=1)
    losses = []
    try:
        while True:
            try:
                losses.append(pipe.progress().loss_sum)
            except StopIteration:
                break
        pipe.drain()
    finally:
        pipe.close()
    return seen[0], losses, pipe, table


def test_a_half_ring_hands_over_the_fp16_rounding_of_the_pooled_embeddings_and_trains_as_fp32(tmp_path):
    emb32, loss32, _, t32 = _half_ring_run(tmp_path, half=False)
    emb16, loss16, pipe, t16 = _half_ring_run(tmp_path, half=True)
    assert emb16.dtype == torch.float32
    assert torch.equal(emb16, emb32.half().float())  # the embedding worker's conversion, nothing else
    assert not torch.equal(emb16, emb32)  # the ring did carry fp16
    assert pipe.fp16_fallbacks == 0 and len(loss16) == len(loss32) == 16
    np.testing.assert_allclose(loss16, loss32, rtol=2e-3)
    keys = t32.shards[0]["default"].state_dict()["keys"]
    np.testing.assert_allclose(t16.lookup_readonly("default", keys), t32.lookup_readonly("default", keys), atol=2e-3)


def test_a_half_ring_sends_a_gradient_that_overflows_fp16_as_fp32_never_as_inf(tmp_path):
    _, losses, pipe, table = _half_ring_run(tmp_path, half=True, scale=1e9)  # d loss / d emb >> 65504
    assert pipe.fp16_fallbacks == len(losses) == 16
    state = table.shards[0]["default"].state_dict()
    assert np.isfinite(state["weights"]).all() and np.isfinite(state["acc"]).all()
    assert state["acc"].max() > 1e6  # the fp32 gradients were applied, not clipped to fp16


@pytest.mark.parametrize("embedding_workers", [1, 3])
def test_staleness_bound_holds_under_a_slow_server(tmp_path, embedding_workers):
    """Lookups never run more than K batches ahead of the oldest unapplied push, even when pushes are slow, and
    however many embedding workers share the bound."""
    data = write_dataset(str(tmp_path / "data"), rows=160, shards=1)
    cfg = tiny_config(num_workers=1, embedding_staleness=2, epochs=1, embedding_workers=embedding_workers)

    # pushes applied 0.5 s late: longer than the start-up work after the pipeline starts (gc.collect)
    backend = SlowPushes(cfg.embedding, 1, 0.5)
    hist = run_worker(cfg, data, str(tmp_path / "out"), backend, rank=0, world=1)
    assert max(hist["staleness"]) <= 2
    assert hist["max_staleness"] == 2  # the slow server makes the worker use its whole budget
    assert len(backend.applied) == len(hist["loss"]) == 10
    assert hist["embedding_workers"] == embedding_workers
    # the embedding workers' phases: the slow pushes show as waits for the bound, which is what a user reads there
    ew = hist["embedding_worker_phase_seconds"]
    assert list(ew) == list(PHASES) and ew["wait_bound"] > 0.5 and ew["lookup_pool"] > 0
    assert 0 < hist["utilization"]["embedding_workers"] < 1 and 0 < hist["utilization"]["nn_worker"] < 1


def test_phase_seconds_keep_the_first_batch_wait_apart_from_the_steady_state_wait(tmp_path):
    import gc
    import time

    def run(rows: int, name: str):
        """In-process training whose first embedding lookup ends 0.3 s after start-up (a slow first batch)."""
        cfg = tiny_config(num_workers=1, embedding_staleness=1, epochs=1)  # batch 16
        backend = LocalEmbedding(cfg.embedding, num_shards=1, seed=cfg.trainer.seed)
        plain, calls, frozen = backend.lookup, [], gc.get_freeze_count()

        def lookup(*a, **k):
            if not calls:
                # until start-up is over (run_worker freezes the garbage collector just before its loop: before,
                # a fixed 1 s sleep, which a garbage collection of a large test heap outlasted in CI), then longer
                deadline = time.monotonic() + 60
                while gc.get_freeze_count() <= frozen and time.monotonic() < deadline:
                    time.sleep(0.005)
                time.sleep(0.3)
            calls.append(1)
            return plain(*a, **k)

        backend.lookup = lookup
        out = str(tmp_path / name)
        os.makedirs(out)
        return run_worker(cfg, write_dataset(str(tmp_path / f"data-{name}"), rows=rows), out, backend, rank=0, world=1)

    one = run(16, "one")  # a single step: its wait is all start-up
    ph = one["phase_seconds"]
    assert len(one["loss"]) == 1 and ph["first_batch_wait"] > 0 and ph["wait"] == 0
    assert abs(ph["first_batch_wait"] - one["wait_seconds_rank0"]) < 0.001
    four = run(64, "four")
    ph = four["phase_seconds"]
    assert len(four["loss"]) == 4 and ph["first_batch_wait"] > 0
    # the two parts add up to every step's wait as the worker sums it (nothing dropped or counted twice; the
    # figures are rounded to 1 ms)
    assert abs(ph["first_batch_wait"] + ph["wait"] - four["wait_seconds_rank0"]) < 0.002
    assert set(ph) >= {"first_batch_wait", "wait", "forward", "backward", "push", "optimizer"}
