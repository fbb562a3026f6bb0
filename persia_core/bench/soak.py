"""``make soak``: training at 1.6 billion parameters on this machine, through the CLI, with eviction, a checkpoint
and a resume, and the resident memory of every process sampled (issue "Hostile input and faults").

Data (``write_soak_data``): the synthetic Criteo-shaped set (``criteo_synth``: 26 slots of one ID each, 13 dense
features, the planted labels) written directly as the preprocess step's Parquet shards, where a ``fresh`` fraction
of each slot's IDs is replaced by IDs never seen before (``splitmix64`` of a running counter), so that the set
holds ``rows * 26 * fresh`` distinct IDs beyond the hot vocabularies: about 125M at the default size.

Job: 2 parameter servers, 1 NN worker (the dense model one linear layer, as ``make bench-feed``), K = 0 (fully
synchronous: two runs are then equal row for row), dim 16, row-wise Adagrad, a memory budget that holds
``capacity_rows`` rows, fewer than the distinct IDs (``embedding.evict_at_capacity``: the least recently used
rows are evicted), one epoch. Steps, every one through ``python -m persia_core``:

1. ``init-shards``: the shard plan and its estimate of each server's memory;
2. run A: ``train``, uninterrupted;
3. run B: ``train`` with a checkpoint every half epoch, SIGKILLed (its whole process group) once the first
   checkpoint is complete, then ``train`` again, which resumes from it and finishes;
4. each model's shards, row count and an order-independent CRC-32C of every per-row array (keys, weights,
   optimizer state, recency: ``model_checksums``), A against B.

Checks (exit 1 when one fails): the models equal (rows, weights and optimizer state; recency is reported apart,
``RECENCY``); rows were evicted; run B resumed from its checkpoint; every parameter server's peak RSS within
``RSS_TOLERANCE`` of the plan's ``estimated_bytes_per_shard`` (a server's own start-up memory, the Python
interpreter, gRPC and the compiled kernels, about 0.2 GB, counts); every other process's peak RSS under
``OTHER_RSS_CAP``; the work folder at most ``DISK_CAP`` bytes at its fullest. Everything written is removed at the
end (``--keep`` keeps it). Output: one line per step, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

from persia_core.argchecks import float_in, int_at_least

RSS_TOLERANCE = 0.10
"""How far a parameter server's peak RSS may be from the plan's per-shard estimate (fraction of the estimate)."""
OTHER_RSS_CAP = 6 << 30
"""Peak RSS allowed to every process other than a parameter server (bytes). The NN worker holds its rows' IDs and
dense features (26 x 8 + 13 x 4 + 12 bytes a row: 1.6 GB at the default 6M rows), up to twice that while it reads
them, and torch; each embedding worker maps the NN worker's saved copy (counted in its RSS as far as it is read);
the launcher and the CLI are small."""
RECENCY = ("last_used", "keys_by_recency")
"""What a resumed table may hold differently from the uninterrupted one: the lookup step each row was last read
at, and the order of rows within one step. A checkpoint at step t can hold step t's lookup, which the resumed run
makes again (one more lookup step counted, its rows re-queued in lookup order). Reported, not checked."""
DISK_CAP = 30 << 30
"""The most the work folder may hold at once (bytes): data, two models and a checkpoint."""
NUM_SHARDS = 2


def _log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_soak_data(out_dir: str, train_rows: int, eval_rows: int, fresh: float, seed: int = 0) -> dict:
    """Write the soak's set under ``out_dir`` (``train/`` in 4 shards, ``eval/``, ``schema.json``; see the module
    docstring) and return its schema dict; ``distinct_ids`` per slot is exact: the hot values drawn plus the slot's
    fresh IDs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from persia_core.bench import criteo_synth as C
    from persia_core.data import schema as S
    from persia_core.hashing import splitmix64

    model = C.PlantedModel(seed)
    fresh_per_slot = np.zeros(C.NUM_SLOTS, dtype=np.int64)
    hot_seen = np.zeros((C.NUM_SLOTS, model.vocab), dtype=bool)
    counter = [0]

    def table(rng: np.random.Generator, n: int, start: int) -> pa.Table:
        def ids_of(s: int, ranks: np.ndarray) -> np.ndarray:
            ids = model.ids[s][ranks]
            new = rng.random(n) < fresh
            k = int(new.sum())
            # a running counter, mixed: never one of the hot IDs (hashes of strings) in practice
            ids[new] = splitmix64(np.arange(counter[0], counter[0] + k, dtype=np.uint64) + np.uint64(1 << 62))
            counter[0] += k
            fresh_per_slot[s] += k
            hot_seen[s, ranks[~new]] = True
            return ids

        return model.table(rng, n, start, ids_of, source="soak")[0]

    files: dict[str, list[str]] = {"train": [], "eval": []}
    start = 0
    shards = {"train": [train_rows // 4 + (1 if i < train_rows % 4 else 0) for i in range(4)], "eval": [eval_rows]}
    for split, sizes in shards.items():
        os.makedirs(os.path.join(out_dir, split), exist_ok=True)
        for i, n in enumerate(sizes):
            rel = f"{split}/{split}-{i:05d}-of-{len(sizes):05d}.parquet"
            rng = np.random.default_rng([seed, 20 if split == "train" else 21, i])
            with pq.ParquetWriter(os.path.join(out_dir, rel), S.arrow_schema(C.SLOTS)) as w:
                done = 0
                while done < n:
                    k = min(C.CHUNK_ROWS, n - done)
                    w.write_table(table(rng, k, start))
                    done, start = done + k, start + k
            files[split].append(rel)
    schema = {
        "slots": list(C.SLOTS),
        "dense": list(C.DENSE),
        "dense_mean": [float(v) for v in model.z_mean],
        "dense_std": [float(v) for v in model.z_std],
        "rows": {"train": train_rows, "eval": eval_rows, "malformed": 0, "read": train_rows + eval_rows},
        "distinct_ids": {s: int(hot_seen[i].sum() + fresh_per_slot[i]) for i, s in enumerate(C.SLOTS)},
        "split": {"by": "row_order", "cutoff": train_rows},
        "train_files": files["train"],
        "eval_files": files["eval"],
        "synthetic": {"generator": "persia_core.bench.soak", "seed": seed, "fresh": fresh},
    }
    with open(os.path.join(out_dir, S.SCHEMA_FILE), "w") as f:
        json.dump(schema, f, indent=1)
    return schema


def soak_config(batch: int, budget_bytes: int, seed: int) -> dict:
    """The run config of the soak (``RunConfig.from_dict`` input): ``feed_config``'s, K = 0, 2 shards of
    ``budget_bytes`` that evict at capacity, one checkpoint kept."""
    from persia_core.bench.feed import feed_config

    d = feed_config(batch, 0, seed).to_dict()
    d["embedding"].update(num_shards=NUM_SHARDS, shard_memory_bytes=int(budget_bytes), evict_at_capacity=True)
    d["trainer"].update(checkpoint_keep=1)
    return d


def budget_for_rows(rows: int, optimizer: str = "rowwise_adagrad", dim: int = 16) -> int:
    """The smallest shard budget (bytes) whose capacity (``memory.capacity_for_budget``) is at least ``rows``."""
    from persia_core.memory import QUEUE_FIXED_BYTES, index_slots, row_bytes_without_index

    return rows * row_bytes_without_index(optimizer, dim) + 4 * index_slots(rows) + QUEUE_FIXED_BYTES


def model_checksums(model_dir: str) -> dict:
    """Per shard file of a Model folder: per table its row count and, for every array with one entry per row,
    the CRC-32C of its rows in key order (so that two tables holding the same rows in different orders agree), and
    of the keys in recency order (``keys_by_recency``: the order in which rows would be evicted)."""
    from persia_core.embedding.checksums import crc32c
    from persia_core.embedding.shard_file import read_shard_file

    out = {}
    shards = os.path.join(model_dir, "shards")
    for name in sorted(os.listdir(shards)):
        contents = read_shard_file(os.path.join(shards, name), build_index=False)
        tables = {}
        for tname, ta in sorted(contents.tables.items()):
            keys = ta.arrays["keys"]
            order = np.argsort(keys, kind="stable")
            sums = {}
            for aname, arr in sorted(ta.arrays.items()):
                if aname == "lru_rows":  # row positions in recency order: compared as the keys in that order
                    sums["keys_by_recency"] = crc32c(np.ascontiguousarray(keys[arr]))
                elif len(arr) == len(keys):
                    sums[aname] = crc32c(np.ascontiguousarray(arr[order]))
            tables[tname] = {"rows": int(len(keys)), "crc32c": sums}
        out[name] = tables
        del contents
    return out


def _du(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(d, f)).st_size
            except OSError:
                pass
    return total


class _DiskWatch:
    """The largest size of a folder seen at the calls of ``sample``."""

    def __init__(self, path: str):
        self.path, self.peak = path, 0

    def sample(self) -> int:
        self.peak = max(self.peak, _du(self.path))
        return self.peak


def _persia(args: list[str], log_path: str) -> subprocess.Popen:
    """``python -m persia_core <args>`` in a session of its own (its whole process group can be killed), its output
    to ``log_path``."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "persia_core", *args], stdout=log, stderr=log, start_new_session=True
        )


def _wait(p: subprocess.Popen, what: str, log_path: str, disk: _DiskWatch, until=None) -> None:
    """Wait for ``p`` to exit 0 (or, with ``until``, for ``until()`` to be true, then SIGKILL its group); raises
    ``RuntimeError`` naming ``what`` and the log's last lines otherwise."""
    last_du = 0.0
    while p.poll() is None:
        if until is not None and until():
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return
        if time.monotonic() - last_du > 5:
            disk.sample()
            last_du = time.monotonic()
        time.sleep(0.2)
    disk.sample()
    if p.returncode != 0 or until is not None:
        with open(log_path, errors="replace") as f:
            tail = "".join(f.readlines()[-30:])
        how = "ended before its checkpoint" if p.returncode == 0 else f"exited with code {p.returncode}"
        raise RuntimeError(f"soak: {what} {how}; last lines of {log_path}:\n{tail}")


def _complete_checkpoint(ckpt_dir: str) -> bool:
    from persia_core.checkpoints import list_checkpoints

    return any(os.path.exists(os.path.join(p, "manifest.json")) for _, p in list_checkpoints(ckpt_dir))


def run(args: argparse.Namespace) -> dict:
    from persia_core.bench.feed import role_of
    from persia_core.bench.proc_cpu import ProcessTreeSampler
    from persia_core.config import RunConfig

    t_start = time.time()
    work = os.path.abspath(args.work)
    if os.path.exists(work):
        shutil.rmtree(work)
    os.makedirs(work)
    disk = _DiskWatch(work)
    data, init, log = os.path.join(work, "data"), os.path.join(work, "init"), os.path.join(work, "soak.log")
    _log(f"writing {args.rows} rows with {args.fresh:.0%} fresh IDs -> {data}")
    schema = write_soak_data(data, args.rows, args.eval_rows, args.fresh, args.seed)
    distinct = sum(schema["distinct_ids"].values())
    capacity = -(-args.capacity_rows // NUM_SHARDS)
    if NUM_SHARDS * capacity >= distinct:
        raise ValueError(
            f"soak: {distinct} distinct IDs fit in --capacity-rows {args.capacity_rows}: nothing would be evicted "
            "(raise --rows or --fresh)"
        )
    cfg = RunConfig.from_dict(soak_config(args.batch, budget_for_rows(capacity), args.seed))
    config_path = os.path.join(work, "config.yaml")
    with open(config_path, "w") as f:
        f.write(cfg.to_yaml())
    steps = -(-args.rows // args.batch)
    _log(f"{distinct} distinct IDs, {capacity} rows per shard ({NUM_SHARDS * capacity * 16} parameters), {steps} steps")
    disk.sample()

    sampler = ProcessTreeSampler(interval_s=0.5)
    with sampler:
        p = _persia(["init-shards", "--data", data, "--output", init, "--config", config_path], log)
        _wait(p, "init-shards", log, disk)
        with open(os.path.join(init, "shard_plan.json")) as f:
            plan = json.load(f)
        estimate = int(plan["estimated_bytes_per_shard"])
        _log(f"plan: {estimate / 2**30:.2f} GiB per shard, evicts: {plan['tables']['default']['evicts']}")
        times = {}
        common = ["--data", data, "--init", init, "--config", config_path]
        a = os.path.join(work, "model_a")
        t0 = time.time()
        p = _persia(
            ["train", *common, "--output", a, "--work-dir", os.path.join(work, "run_a"), "--resume-from", ""], log
        )
        _wait(p, "run A (uninterrupted)", log, disk)
        times["run_a_s"] = round(time.time() - t0, 1)
        _log(f"run A done in {times['run_a_s']} s")
        b = os.path.join(work, "model_b")
        every = ["--set", f"trainer.checkpoint_every_steps={max(1, steps // 2)}"]
        t0 = time.time()
        p = _persia(["train", *common, *every, "--output", b, "--work-dir", os.path.join(work, "run_b1")], log)
        _wait(p, "run B (to be killed)", log, disk, until=lambda: _complete_checkpoint(os.path.join(b, "checkpoints")))
        times["run_b_until_kill_s"] = round(time.time() - t0, 1)
        _log(f"run B SIGKILLed after its first checkpoint, {times['run_b_until_kill_s']} s in")
        t0 = time.time()
        p = _persia(["train", *common, *every, "--output", b, "--work-dir", os.path.join(work, "run_b2")], log)
        _wait(p, "run B (resumed)", log, disk)
        times["run_b_resumed_s"] = round(time.time() - t0, 1)
        _log(f"run B resumed and done in {times['run_b_resumed_s']} s")
    with open(os.path.join(b, "manifest.json")) as f:
        resumed = json.load(f).get("resumed_from")
    sums_a, sums_b = model_checksums(a), model_checksums(b)
    rows = sum(t["rows"] for shard in sums_a.values() for t in shard.values())
    differ = {
        name
        for shard, tables in sums_a.items()
        for t, got in tables.items()
        for name, crc in got["crc32c"].items()
        if sums_b.get(shard, {}).get(t, {}).get("crc32c", {}).get(name) != crc
    }
    rows_b = {(sh, t): got["rows"] for sh, ts in sums_b.items() for t, got in ts.items()}
    if rows_b != {(sh, t): got["rows"] for sh, ts in sums_a.items() for t, got in ts.items()}:
        differ.add("rows")
    peaks: dict[str, int] = {}
    servers: list[int] = []  # peak RSS of the servers of the runs that trained to the end (their tables full)
    killed: list[int] = []  # of the killed run's
    for proc in sampler.processes.values():
        role = role_of(proc.cmdline)
        if role == "server":
            (killed if f"{os.sep}run_b1{os.sep}" in proc.cmdline else servers).append(proc.peak_rss)
        else:
            peaks[role] = max(peaks.get(role, 0), proc.peak_rss)
    deviation = max(abs(r - estimate) / estimate for r in servers) if servers else None
    out = {
        "rows_per_run": args.rows,
        "distinct_ids": distinct,
        "capacity_rows_per_shard": capacity,
        "parameters": rows * 16,
        "model_rows": rows,
        "server_estimate_bytes": estimate,
        "server_peak_rss_bytes": sorted(servers),
        "killed_run_server_peak_rss_bytes": sorted(killed),
        "server_rss_deviation": None if deviation is None else round(deviation, 4),
        "other_peak_rss_bytes": peaks,
        "disk_peak_bytes": disk.peak,
        "resumed_from": resumed,
        # the model: its rows, weights and optimizer state; recency is reported apart (``RECENCY``)
        "models_equal": not [d for d in differ if d not in RECENCY],
        "recency_equal": not [d for d in differ if d in RECENCY],
        "arrays_differing": sorted(differ),
        **times,
        "wall_s": round(time.time() - t_start, 1),
    }
    out["checks"] = {
        "models_equal": out["models_equal"],
        "resumed": bool(resumed),
        "evicted": rows < distinct,
        "server_rss_within_tolerance": deviation is not None and deviation <= RSS_TOLERANCE,
        "other_rss_under_cap": all(v <= OTHER_RSS_CAP for v in peaks.values()),
        "disk_under_cap": disk.peak <= DISK_CAP,
    }
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
        out["removed"] = not os.path.exists(work)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="persia_core.bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int_at_least(4096), default=6_000_000, help="training rows (one epoch)")
    p.add_argument("--eval-rows", type=int_at_least(1), default=10_000, help="eval rows of the set")
    p.add_argument(
        "--fresh", type=float_in(0.0, 1.0), default=0.8, help="fraction of each slot's IDs never seen before"
    )
    p.add_argument(
        "--capacity-rows",
        type=int_at_least(2048),
        default=100_000_000,
        help="rows the 2 shards hold together at dim 16 (default: 1.6 billion parameters); fewer than the distinct "
        "IDs of the set, so that eviction runs",
    )
    p.add_argument("--batch", type=int_at_least(1), default=4096, help="batch of the NN worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="bench_outputs/soak", help="work folder (removed at the end unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    args = p.parse_args(argv)
    out = run(args)
    failed = [k for k, ok in out["checks"].items() if not ok]
    _log("passed" if not failed else f"FAILED: {', '.join(failed)}")
    print(json.dumps(out))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
