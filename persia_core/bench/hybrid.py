"""``make bench``: the hybrid engine side by side with fully synchronous training, plain PyTorch and TorchRec.

Contestants, each trained on the same data, model and number of training samples, then evaluated on the same
evaluation split (issue "Hybrid engine at speed"):

    (a) hybrid     this project, staleness K = 4: 2 parameter-server processes + NN workers (``train``)
    (b) sync       the same engine with K = 0 (fully synchronous)
    (c) plain      plain PyTorch in one process (``persia_core.bench.baselines``)
    (d) torchrec   TorchRec's fused EmbeddingBagCollection + its DLRM, in ``.venv-torchrec``
                   (``persia_core.bench.torchrec_contestant``); null with ``torchrec_error`` if it cannot run

(a) and (b) also run with an injected network cost per parameter-server call (``trainer.network_delay_s``,
default 2 ms round trip) for samples/s only. NN-worker layouts ``MxT`` (M workers of T torch threads) are all
tried for (a) and (b) on the first seed, and so are torch thread counts (``--baseline-threads``, default 1 and
2) for (c) and (d); each contestant keeps its fastest, and later seeds use it (on a shared 2-core machine two
OpenMP threads collapse when anything else runs, so no contestant is held to one setting). The global batch is
the same for everyone (per-worker batch = global / M).

Datasets: the bundled MovieLens (preprocessed once with the shipped config; one pass over its train split
whatever ``--samples`` says, the shipped config's epochs) and the synthetic Criteo-shaped set
(``persia_core.bench.criteo_synth``: ``--samples`` train rows, one pass; 1,000,000 eval rows). samples/s are
from the first seed, AUC/logloss are means over the seeds. Progress lines first, then one JSON object per
dataset, the Criteo-shaped set last. The machine is shared: ratios measured in the same run are what count,
and ``loadavg`` says how busy it was.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from persia_core.bench.compare import bench_dataset, loadavg, log

DEFAULT_SAMPLES = 1_800_000
"""Training samples per contestant on the Criteo-shaped set unless ``--samples`` or ``BENCH_SAMPLES`` say otherwise."""


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """``"1x2,2x1"`` -> ``[(1, 2), (2, 1)]`` (NN workers x torch threads each). Raises ``ValueError``."""
    out = []
    for part in [p for p in text.split(",") if p.strip()]:
        try:
            m, t = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise ValueError(f"--layouts: {part!r} is not MxT (workers x threads), e.g. 1x2") from None
        if m < 1 or t < 1:
            raise ValueError(f"--layouts: {part!r} needs M >= 1 and T >= 1")
        out.append((m, t))
    if not out:
        raise ValueError("--layouts: give at least one MxT")
    return out


def bench_movielens_config():
    """The shipped MovieLens config with the model and trainer this benchmark has always used (no wide table,
    no L2 on embedding rows, Adagrad accumulators starting at 0, the logit's bias starting at 0, dense learning
    rate 0.001), so that its figures stay comparable across releases and every contestant trains the same
    model."""
    from persia_core.config import WIDE_TABLE, RunConfig, load_config

    d = load_config("movielens").to_dict()
    d["model"].update(wide=False, bias_init="zero")
    d["embedding"]["tables"] = [t for t in d["embedding"]["tables"] if t["name"] != WIDE_TABLE]
    for t in d["embedding"]["tables"]:
        t["optimizer"].update(weight_decay=0.0, initial_accumulator=0.0)
    d["trainer"]["dense_lr"] = 0.001
    return RunConfig.from_dict(d)


def prepare_movielens(data: str, out_dir: str):
    """Preprocess the bundled MovieLens with the shipped config into ``out_dir`` (reused when it is there).
    Returns (``bench_movielens_config()``, schema)."""
    from persia_core.data.reader import read_schema
    from persia_core.preprocess.pipeline import run_preprocess

    config = bench_movielens_config()
    if os.path.exists(os.path.join(out_dir, "schema.json")):
        return config, read_schema(out_dir)
    log(f"movielens: preprocessing {data} -> {out_dir}")
    return config, run_preprocess(config, data, out_dir)


def prepare_criteo(out_dir: str, samples: int, eval_rows: int, vocab: int):
    """Write the Criteo-shaped set (``samples`` train rows) into ``out_dir`` unless it is already there.
    Returns its schema."""
    from persia_core.bench.criteo_synth import write_criteo_synth
    from persia_core.data.reader import read_schema

    if os.path.exists(os.path.join(out_dir, "schema.json")):
        return read_schema(out_dir)
    log(f"criteo_synth: writing {samples} train + {eval_rows} eval rows -> {out_dir}")
    schema = write_criteo_synth(out_dir, samples, eval_rows, vocab=vocab)
    log(
        f"criteo_synth: written in {schema['synthetic']['seconds']:.0f} s, planted AUC "
        f"{schema['synthetic']['planted_auc']:.4f}"
    )
    return schema


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--samples",
        type=int,
        default=int(os.environ.get("BENCH_SAMPLES") or DEFAULT_SAMPLES),
        help="training samples per contestant on the Criteo-shaped set (env BENCH_SAMPLES)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=int(os.environ.get("BENCH_SEEDS") or 3),
        help="seeds; AUC is the mean over them, samples/s from the first (env BENCH_SEEDS)",
    )
    p.add_argument("--datasets", default="movielens,criteo", help="comma-separated: movielens, criteo")
    p.add_argument(
        "--layouts",
        default=os.environ.get("BENCH_LAYOUTS", "1x1,1x2,2x1"),
        help="NN-worker layouts MxT tried for (a) and (b): M workers x T torch threads (env BENCH_LAYOUTS)",
    )
    p.add_argument(
        "--baseline-threads",
        default=os.environ.get("BENCH_BASELINE_THREADS", "1,2"),
        help="torch threads tried for (c) and (d) on the first seed, fastest kept (env BENCH_BASELINE_THREADS)",
    )
    p.add_argument(
        "--delay",
        type=float,
        default=float(os.environ.get("BENCH_DELAY_S") or 0.002),
        help="injected seconds per parameter-server call (env BENCH_DELAY_S; 0 and no bandwidth: skip)",
    )
    p.add_argument(
        "--bandwidth",
        type=float,
        default=float(os.environ.get("BENCH_BANDWIDTH") or 0.0),
        help="injected bandwidth cap of parameter-server calls, bytes/s (env BENCH_BANDWIDTH; 0: none)",
    )
    p.add_argument("--batch-size", type=int, default=4096, help="global batch on the Criteo-shaped set")
    p.add_argument("--eval-rows", type=int, default=1_000_000, help="eval rows of the Criteo-shaped set")
    p.add_argument("--vocab", type=int, default=100_000, help="IDs per slot of the Criteo-shaped set")
    p.add_argument("--movielens-data", default="data/movielens")
    p.add_argument("--work", default="", help="working folder (datasets are reused from it); default: temporary")
    p.add_argument(
        "--torchrec-python",
        default="",
        help="python of the TorchRec environment (default: $TORCHREC_PYTHON or .venv-torchrec/bin/python)",
    )
    p.add_argument("--out", default="", help="also write the JSON lines to this file")
    p.add_argument("--keep", action="store_true", help="keep the trained models")
    args = p.parse_args(argv)
    from persia_core.config import RunConfig

    if args.samples < 1 or args.seeds < 1:
        raise ValueError("--samples and --seeds must be >= 1")
    datasets = [d for d in args.datasets.split(",") if d]
    unknown = [d for d in datasets if d not in ("movielens", "criteo")]
    if unknown:
        raise ValueError(f"--datasets: unknown {unknown} (known: movielens, criteo)")
    layouts = parse_layouts(args.layouts)
    try:
        baseline_threads = [int(v) for v in args.baseline_threads.split(",") if v.strip()]
    except ValueError:
        raise ValueError(
            f"--baseline-threads: expected comma-separated integers, got {args.baseline_threads!r}"
        ) from None
    if not baseline_threads or min(baseline_threads) < 1:
        raise ValueError("--baseline-threads: give at least one thread count >= 1")
    work = args.work or tempfile.mkdtemp(prefix="bench-hybrid-")
    os.makedirs(work, exist_ok=True)
    log(
        f"work folder {work}; {args.samples} samples, {args.seeds} seed(s), layouts {args.layouts}, "
        f"{os.cpu_count()} CPUs, load {loadavg()}"
    )
    lines = []
    common = dict(
        seeds=args.seeds,
        layouts=layouts,
        delay_s=args.delay,
        bandwidth=args.bandwidth,
        torchrec_python=args.torchrec_python,
        baseline_threads=baseline_threads,
        keep=args.keep,
    )
    for name in sorted(datasets, key=lambda d: d != "movielens"):  # MovieLens first, the Criteo-shaped set last
        if name == "movielens":
            data_dir = os.path.join(work, "movielens")
            config, schema = prepare_movielens(args.movielens_data, data_dir)
            tc = config.trainer
            samples = int(schema["rows"]["train"]) * tc.scheduled_epochs
            line = bench_dataset(
                "movielens",
                config,
                data_dir,
                work,
                samples,
                tc.batch_size * tc.num_workers,
                extra={"train_rows": schema["rows"]["train"], "eval_rows": schema["rows"]["eval"]},
                **common,
            )
        else:
            from persia_core.bench.criteo_synth import criteo_config_dict

            data_dir = os.path.join(work, f"criteo_synth-{args.samples}-{args.eval_rows}-{args.vocab}")
            schema = prepare_criteo(data_dir, args.samples, args.eval_rows, args.vocab)
            config = RunConfig.from_dict(criteo_config_dict(args.batch_size))
            line = bench_dataset(
                "criteo_synth",
                config,
                data_dir,
                work,
                args.samples,
                args.batch_size,
                extra={
                    "train_rows": args.samples,
                    "eval_rows": args.eval_rows,
                    "vocab_per_slot": args.vocab,
                    "planted_auc": schema["synthetic"]["planted_auc"],
                },
                **common,
            )
        lines.append(json.dumps(line))
        log(f"{name} done")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    for text in lines:
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
