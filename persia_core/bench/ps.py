"""``make bench-ps``: parameter-server throughput and memory, against a plain PyTorch static table.

Workload (issue "Embedding parameter server at production quality"): batches of 1M raw feature IDs (counted
before dedup) drawn with Zipf exponent 1.05 over a permuted set of 10M live IDs; dim 16; row-wise Adagrad;
numba and torch on one thread. Measured in the same run:

- in-process table: lookup (``EmbeddingTable.lookup`` of the raw batch) and gradient apply (``apply_gradients``
  of the raw batch with one gradient row per raw ID: duplicates summed, one update per unique row);
- end to end: the embedding-worker client with 2 parameter-server processes on 127.0.0.1 (dedup on the client,
  lookup of the unique IDs, gradient push of the unique IDs);
- bytes per row from the table's own accounting at dim 16 and dim 64, against the raw bytes of weights +
  optimizer state;
- plain PyTorch: ``nn.EmbeddingBag`` of 10M rows, modulo hashing, sparse gradients, ``torch.optim.Adagrad``.
  Its lookup and update figures start, like ours, from the raw uint64 feature IDs, so they include the modulo
  hashing; its gather alone (rows hashed beforehand) is reported as ``torch_static_gather_only_per_s_per_core``.

The in-process table and the PyTorch table are timed alternately, batch by batch, so that what else the shared
machine runs meanwhile falls on both alike; each figure is the best of ``--repeats`` rounds, and each round's paired
ratio (the static table's seconds over ours, on the same batch a moment apart) is summarized by its median and
quartiles (``lookup_speed_ratio_paired``, ``update_speed_ratio_paired``): > 1 means ours is faster.

Prints human-readable lines, then one JSON object as the last line. Ratios are what count: the machine is shared.
Sizes can be reduced for a quick look: ``--rows 1000000 --batch 100000``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time

from persia_core.argchecks import int_at_least


def _zipf_sampler(live, exponent: float, seed: int):
    import numpy as np

    ranks = np.arange(1, len(live) + 1, dtype=np.float64)
    cdf = np.cumsum(ranks**-exponent)
    cdf /= cdf[-1]
    rng = np.random.default_rng(seed)
    return lambda n: live[np.minimum(np.searchsorted(cdf, rng.random(n)), len(live) - 1)]


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _interleaved(ours, theirs, batches: int, rounds: int) -> tuple[float, float, list[float]]:
    """Best seconds of ``ours(i)`` and of ``theirs(i)`` over ``rounds`` rounds of batch ``i`` (cycling over
    ``batches``), the two called alternately (which goes first alternates too), and each round's speed ratio
    (theirs' seconds / ours': > 1 means ours is faster), paired on the same batch a moment apart, so that a burst of
    load from elsewhere on the machine moves both sides of a ratio rather than one figure."""
    best = [float("inf"), float("inf")]
    ratios = []
    for r in range(rounds):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        took = [0.0, 0.0]
        for k in order:
            fn = ours if k == 0 else theirs
            t0 = time.perf_counter()
            fn(r % batches)
            took[k] = time.perf_counter() - t0
            best[k] = min(best[k], took[k])
        ratios.append(took[1] / took[0])
    return best[0], best[1], ratios


def _ratio_summary(ratios: list[float]) -> dict:
    """Median, quartiles and extremes of per-round speed ratios (theirs' seconds / ours')."""
    import numpy as np

    q = np.percentile(ratios, [0, 25, 50, 75, 100])
    return {
        "median": float(q[2]),
        "q1": float(q[1]),
        "q3": float(q[3]),
        "min": float(q[0]),
        "max": float(q[4]),
        "rounds": len(ratios),
    }


MIN_ROWS = 1024
"""The fewest live IDs the benchmark takes: a table (and a parameter-server shard's budget, sized from the
row count below) holds at least 1024 rows (``embedding.table.capacity_for_budget``)."""


def _static_vs_ours(table, batches: list, grads, n_live: int, dim: int, batch: int, repeats: int, uniq_counts) -> dict:
    """The in-process ``table`` and a plain PyTorch static table of ``n_live`` rows, timed interleaved on
    ``batches`` (see the module docstring); prints their figures and returns them. The static table and its
    optimizer are freed on return."""
    import numpy as np
    import torch

    emb = torch.nn.EmbeddingBag(n_live, dim, mode="sum", sparse=True)
    topt = torch.optim.Adagrad(emb.parameters(), lr=0.01)
    offsets = torch.arange(batch)
    n_static = np.uint64(n_live)

    def static_rows(ids):
        """The static table's modulo hashing of raw feature IDs ``uint64[N]`` -> ``int64[N]`` rows: numpy's
        uint64 remainder (faster here than torch's int64 remainder; torch has none for uint64); the rows are
        below 2^63, so the int64 view is exact."""
        return torch.from_numpy((ids % n_static).view(np.int64))

    tb = [static_rows(b) for b in batches]

    # Both tables are timed from the same raw uint64 feature IDs, so the static table's lookup includes its
    # modulo hashing (ours includes its hash probes). Its gather alone, from rows hashed beforehand, is reported too.
    def t_gather_only(i):
        with torch.no_grad():
            emb(tb[i], offsets)

    def t_lookup(i):
        with torch.no_grad():
            emb(static_rows(batches[i]), offsets)

    def t_update(i):
        out = emb(static_rows(batches[i]), offsets)
        out.backward(torch.from_numpy(grads))
        topt.step()
        topt.zero_grad(set_to_none=True)

    # warm caches and JIT, then alternate the two contestants batch by batch, so that whatever else the shared
    # machine runs meanwhile falls on both alike; the best time of each is kept
    table.lookup(batches[0])
    t_update(0)
    lookup_s = _interleaved(lambda i: table.lookup(batches[i]), t_lookup, len(batches), repeats)
    gather_s = _interleaved(lambda i: table.lookup(batches[i]), t_gather_only, len(batches), repeats)
    apply_s = _interleaved(lambda i: table.apply_gradients(batches[i], grads), t_update, len(batches), repeats)
    lookup_ratio, apply_ratio = _ratio_summary(lookup_s[2]), _ratio_summary(apply_s[2])
    lookups, torch_lookups = batch / lookup_s[0], batch / lookup_s[1]
    updates, torch_updates = batch / apply_s[0], batch / apply_s[1]
    print(
        f"in-process: lookup {lookups / 1e6:.2f}M IDs/s, apply {updates / 1e6:.2f}M IDs/s "
        f"({np.mean(uniq_counts) * updates / batch / 1e6:.2f}M unique rows/s)"
    )
    torch_gather = batch / gather_s[1]
    print(
        f"plain PyTorch EmbeddingBag: lookup {torch_lookups / 1e6:.2f}M IDs/s (modulo hashing included; "
        f"gather alone from rows hashed beforehand {torch_gather / 1e6:.2f}M IDs/s, ours in the same rounds "
        f"{batch / gather_s[0] / 1e6:.2f}M), forward+backward+Adagrad {torch_updates / 1e6:.2f}M IDs/s"
    )
    print(
        f"paired rounds (static table's time / ours, > 1: ours faster): lookup median {lookup_ratio['median']:.3f} "
        f"(quartiles {lookup_ratio['q1']:.3f}-{lookup_ratio['q3']:.3f}, {lookup_ratio['rounds']} rounds), "
        f"apply median {apply_ratio['median']:.2f}"
    )
    return {
        "lookups": lookups,
        "updates": updates,
        "torch_lookups": torch_lookups,
        "torch_updates": torch_updates,
        "torch_gather": torch_gather,
        "lookup_ratio": lookup_ratio,
        "apply_ratio": apply_ratio,
    }


def _table_figures(live, batches: list, grads, uniq_counts, dim: int, opt, batch: int, repeats: int) -> dict:
    """Fill an in-process table with the ``live`` IDs, time it against the static table (``_static_vs_ours``),
    and print its bytes per row; returns the figures of both. The table is freed on return."""
    from persia_core.embedding.table import EmbeddingTable
    from persia_core.memory import bytes_per_row, row_bytes_without_index

    table = EmbeddingTable(dim, opt, capacity=len(live) + batch, init_scale=0.01)
    t0 = time.perf_counter()
    for i in range(0, len(live), 1_000_000):
        table.lookup(live[i : i + 1_000_000])
    print(f"filled the table in {time.perf_counter() - t0:.1f} s")
    speed = _static_vs_ours(table, batches, grads, len(live), dim, batch, repeats, uniq_counts)

    # ---- memory accounting ---------------------------------------------------------------------------
    cap = table.capacity
    bpr16 = bytes_per_row("rowwise_adagrad", 16, cap)
    bpr64 = bytes_per_row("rowwise_adagrad", 64, cap)
    raw16, raw64 = 16 * 4 + 4, 64 * 4 + 4
    bpr16_fp16 = bytes_per_row("rowwise_adagrad", 16, cap, "fp16")
    print(
        f"bytes/row: dim16 {bpr16:.1f} (raw {raw16}, x{bpr16 / raw16:.2f}); dim64 {bpr64:.1f} "
        f"(raw {raw64}, x{bpr64 / raw64:.3f}); dim16 with fp16 storage {bpr16_fp16:.1f}; "
        f"excluding index: {row_bytes_without_index('rowwise_adagrad', 16)}"
    )
    return {**speed, "bpr16": bpr16, "bpr64": bpr64, "raw16": raw16, "raw64": raw64, "bpr16_fp16": bpr16_fp16}


def _grpc_figure(live, batches: list, grads, dim: int, batch: int, repeats: int) -> float:
    """End to end through gRPC: raw IDs per second of dedup + lookup + push with 2 parameter servers on
    127.0.0.1 (filled with the ``live`` IDs first); prints it."""
    import torch

    from persia_core.config import RunConfig
    from persia_core.embedding.kernels import dedup
    from persia_core.ps.client import EmbeddingClient
    from persia_core.train.local_cluster import LocalCluster

    cfg = RunConfig.from_dict(
        {
            "layout": {"kind": "delimited", "columns": ["label", "a"], "label_column": "label"},
            "slots": [{"name": "a", "source": "a"}],
            "embedding": {
                "tables": [{"name": "default", "dim": dim, "optimizer": {"name": "rowwise_adagrad"}}],
                "num_shards": 2,
                "shard_memory_bytes": 2 * len(live) * 100,
            },
        }
    )
    work = tempfile.mkdtemp(prefix="bench-ps-")
    path = os.path.join(work, "cfg.yaml")
    with open(path, "w") as f:
        f.write(cfg.to_yaml())
    with LocalCluster(path, 2, 0, work) as cluster:
        addrs = cluster.start_servers()
        client = EmbeddingClient(addrs, cfg.embedding, token=cluster.token, timeout_s=120)
        t0 = time.perf_counter()
        for i in range(0, len(live), 1_000_000):
            client.lookup("default", live[i : i + 1_000_000])
        print(f"filled 2 servers over gRPC in {time.perf_counter() - t0:.1f} s")
        calls = itertools.count(1)

        def e2e():
            b = batches[next(calls) % len(batches)]
            uniq, inverse = dedup(b)
            client.lookup("default", uniq)
            # worker-side aggregation: one gradient row per unique ID (summed over its raw occurrences)
            g = torch.zeros(len(uniq), dim).index_add_(0, torch.from_numpy(inverse), torch.from_numpy(grads))
            client.push("default", uniq, g.numpy()).result()

        e2e()
        grpc_ids = batch / _best(e2e, repeats)
        client.close()
    print(f"end to end, 2 servers on 127.0.0.1: {grpc_ids / 1e6:.2f}M raw IDs/s (dedup + lookup + push)")
    return grpc_ids


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see the module docstring); returns 0. Bad arguments: argparse's usage error (exit 2)."""
    p = argparse.ArgumentParser(prog="python -m persia_core.bench.ps", description=__doc__.split("\n")[0])
    p.add_argument(
        "--rows", type=int_at_least(MIN_ROWS), default=10_000_000, help=f"live IDs (rows), at least {MIN_ROWS}"
    )
    p.add_argument("--batch", type=int_at_least(1), default=1_000_000, help="raw IDs per batch (>= 1)")
    p.add_argument(
        "--repeats",
        type=int_at_least(1),
        default=12,
        help="timed rounds per figure, cycling over 3 batches (best is kept; >= 1)",
    )
    p.add_argument("--skip-grpc", action="store_true", help="skip the end-to-end gRPC figure")
    args = p.parse_args(argv)
    os.environ["NUMBA_NUM_THREADS"] = "1"
    # PyTorch's CPU allocator backs large tensors with transparent huge pages only when asked; numpy always asks.
    # Without them the static table's random gathers miss the TLB and its lookup rate swings from run to run,
    # so the reference is held at its best.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    import warnings

    import numpy as np
    import torch

    torch.set_num_threads(1)
    # torch's note on its own sparse gradients (the static table's), printed once amid the figures
    warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
    from persia_core.config import OptimizerConfig
    from persia_core.embedding.kernels import dedup

    dim = 16
    opt = OptimizerConfig(name="rowwise_adagrad", lr=0.01)
    rng = np.random.default_rng(0)
    live = rng.integers(0, 2**64 - 1, size=args.rows, dtype=np.uint64, endpoint=True)
    live = np.unique(live)  # distinct; the permutation below decides which are hot
    live = live[rng.permutation(len(live))]
    sample = _zipf_sampler(live, 1.05, 1)
    batches = [sample(args.batch) for _ in range(3)]
    uniq_counts = [len(dedup(b)[0]) for b in batches]
    print(
        f"workload: {len(live):,} live IDs, batches of {args.batch:,} raw IDs "
        f"(~{int(np.mean(uniq_counts)):,} unique), Zipf 1.05, dim {dim}, rowwise_adagrad, 1 thread"
    )
    grads = np.random.default_rng(2).normal(size=(args.batch, dim)).astype(np.float32) * 0.01
    t = _table_figures(live, batches, grads, uniq_counts, dim, opt, args.batch, args.repeats)
    grpc_ids = None if args.skip_grpc else _grpc_figure(live, batches, grads, dim, args.batch, args.repeats)

    result = {
        "lookups_per_s_per_core": t["lookups"],
        "updates_per_s_per_core": t["updates"],
        "grpc_ids_per_s": grpc_ids,
        "bytes_per_row": t["bpr16"],
        "raw_bytes_per_row": t["raw16"],
        "bytes_per_row_dim64": t["bpr64"],
        "raw_bytes_per_row_dim64": t["raw64"],
        "bytes_per_row_fp16": t["bpr16_fp16"],
        "torch_static_lookups_per_s_per_core": t["torch_lookups"],
        "torch_static_updates_per_s_per_core": t["torch_updates"],
        "torch_static_gather_only_per_s_per_core": t["torch_gather"],
        "lookup_speed_ratio_paired": t["lookup_ratio"],
        "update_speed_ratio_paired": t["apply_ratio"],
        "unique_ids_per_batch": float(np.mean(uniq_counts)),
        "batch_raw_ids": args.batch,
        "live_ids": len(live),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
