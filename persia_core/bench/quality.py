"""``make bench-quality``: eval AUC and logloss of the shipped models against the LR reference, by data size.

Datasets and sizes (issue "Model quality"):

- ``movielens``: the bundled ratings, the first 10,000 and 30,000 by timestamp and all of them, preprocessed with
  the shipped ``movielens`` config (its chronological train/eval split);
- ``criteo_synth``: the synthetic Criteo-shaped set (``persia_core.bench.criteo_synth``, generator unchanged)
  with 10,000, 100,000 and 1,000,000 train rows and 1,000,000 eval rows; its ``planted_auc`` is the ceiling.

Models per dataset: the dataset's shipped default config (``default: true``, ``criteo`` or ``movielens``), and on
``criteo_synth`` the shipped ``dcnv2`` config and ``criteo_before``, the ``criteo`` config as shipped before the
issue (DLRM, no wide table, one epoch), at the largest size only (where the issue compares them; at every size when
``--models`` names it). ``--models all`` adds the other models on a default config's slots and
trainer (``EXTRA_MODELS``: DCNv2 and DeepFM on MovieLens, DeepFM on ``criteo_synth``). Every model but
``criteo_before`` trains with ``epochs: auto``. Each is trained (``init_shards`` + ``train``, as the pipeline does)
and evaluated (``persia_core.evaluate.run.evaluate``) once per seed; the LR reference is fitted by the evaluate
step once per dataset and size (it does not depend on the seed) and kept beside the dataset in ``--work`` for
later runs.

Prints progress lines, then one JSON line per dataset x size x model with ``dataset``, ``size`` (ratings or
train rows), ``train_rows``, ``model``, ``default``, ``seeds``, ``auc``, ``auc_std``, ``logloss``,
``logloss_std`` (means and population std over the seeds), ``lr_auc``, ``lr_logloss``, ``auc_lift`` (AUC minus
the LR reference's), ``beats_lr`` (AUC >= and logloss <= the reference's), ``epochs_kept`` and
``epochs_scored`` (per seed: the kept epoch, and the epochs trained and scored on the validation slice before
training stopped; 0 without ``epochs: auto``), ``train_seconds`` (mean) and, on ``criteo_synth``, ``planted_auc``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from persia_core.bench.compare import loadavg, log

MOVIELENS_SIZES = "10000,30000,all"
CRITEO_SIZES = "10000,100000,1000000"
EXTRA_MODELS = frozenset({"movielens_dcnv2", "movielens_deepfm", "criteo_deepfm"})


def model_configs(dataset: str) -> dict[str, tuple[Any, bool]]:
    """``name -> (RunConfig, is the dataset's default)`` of the models ``dataset`` is benchmarked with."""
    from persia_core.config import WIDE_TABLE, RunConfig, load_config

    auto = {"trainer.epochs": "auto"}
    if dataset == "movielens":
        base = load_config("movielens").with_overrides(auto)
        return {
            "movielens": (base, True),
            "movielens_dcnv2": (base.with_overrides({"model.kind": "dcnv2"}), False),
            "movielens_deepfm": (base.with_overrides({"model.kind": "deepfm"}), False),
        }
    base = load_config("criteo").with_overrides(auto)
    before = base.to_dict()  # the criteo config before issue #18: DLRM, no wide table, one epoch
    before["model"]["wide"] = False
    before["embedding"]["tables"] = [t for t in before["embedding"]["tables"] if t["name"] != WIDE_TABLE]
    # the pre-issue trainer's own settings; every other one (refit, the rate decay, ...) at its default
    pre = {k: before["trainer"][k] for k in ("batch_size", "embedding_staleness", "num_workers", "seed")}
    before["trainer"] = {**pre, "epochs": 1, "dense_lr": 0.001}
    before["model"].update(dropout=0.0, bias_init="zero")
    for t in before["embedding"]["tables"]:
        t["optimizer"].update(initial_accumulator=0.0, weight_decay=0.0)
    return {
        "criteo": (base, True),
        "dcnv2": (load_config("dcnv2").with_overrides(auto), False),
        "criteo_deepfm": (base.with_overrides({"model.kind": "deepfm"}), False),
        "criteo_before": (RunConfig.from_dict(before), False),
    }


def model_names(models: str) -> set[str]:
    """The names ``--models`` (comma-separated) gives."""
    return {m for m in models.split(",") if m}


def chosen_models(dataset: str, models: str) -> dict[str, tuple[Any, bool]]:
    """``model_configs(dataset)`` as ``--models`` picks them: ``models`` comma-separated names, ``all``, or empty
    for all but ``EXTRA_MODELS``."""
    names = model_names(models)
    every = model_configs(dataset)
    if "all" in names:
        return every
    return {k: v for k, v in every.items() if (k in names if names else k not in EXTRA_MODELS)}


def models_at_size(models: dict[str, Any], size: str, sizes: list[str], named: str) -> dict[str, Any]:
    """``models`` (``chosen_models``) to run at ``size`` of ``sizes`` (``all`` or counts): ``criteo_before`` only at
    the largest size (the issue compares it there), unless ``named`` (``--models``) names it."""
    largest = max(sizes, key=lambda s: float("inf") if s == "all" else float(s))
    keep_before = size == largest or "criteo_before" in model_names(named)
    return {k: v for k, v in models.items() if k != "criteo_before" or keep_before}


def movielens_subset(src: str, out: str, ratings: int | None) -> str:
    """A copy of the MovieLens folder ``src`` under ``out`` holding its first ``ratings`` ratings by timestamp
    (ties in file order; all of them for None). Returns the folder."""
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(src):
        if name != "ratings.csv" and os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), out)
    with open(os.path.join(src, "ratings.csv"), newline="") as f:
        rows = list(csv.reader(f))
    header, body = rows[0], rows[1:]
    ts = header.index("timestamp")
    body = sorted(body, key=lambda r: int(r[ts]))[: ratings or len(body)]
    with open(os.path.join(out, "ratings.csv"), "w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows([header, *body])
    return out


def prepare(dataset: str, size: str, work: str, movielens: str, eval_rows: int) -> tuple[str, int, float | None]:
    """The preprocessed data folder of ``dataset`` at ``size`` (reused from ``work``), its train rows and the
    planted AUC (synthetic set only)."""
    from persia_core.config import load_config
    from persia_core.data.reader import read_schema
    from persia_core.preprocess.pipeline import run_preprocess

    folder = os.path.join(work, f"{dataset}-{size}")
    data = os.path.join(folder, "data")
    if not os.path.exists(os.path.join(data, "schema.json")):
        if dataset == "movielens":
            raw = movielens_subset(movielens, os.path.join(folder, "raw"), None if size == "all" else int(size))
            run_preprocess(load_config("movielens"), raw, data)
        else:
            from persia_core.bench.criteo_synth import write_criteo_synth

            write_criteo_synth(data, int(size), eval_rows)
    schema = read_schema(data)
    return data, int(schema["rows"]["train"]), (schema.get("synthetic") or {}).get("planted_auc")


def run_model(config, data: str, work: str, seed: int, lr_reference: bool) -> dict:
    """Train ``config`` at ``seed`` on ``data`` and evaluate it; the run's folder is removed afterwards."""
    from persia_core.embedding.plan import init_shards
    from persia_core.evaluate.run import evaluate
    from persia_core.train.launcher import train

    cfg = config.with_overrides({"trainer.seed": seed})
    shutil.rmtree(work, ignore_errors=True)
    init, model = os.path.join(work, "init"), os.path.join(work, "model")
    t0 = time.time()
    init_shards(cfg, data, init)
    train(cfg, data, model, init_dir=init, work_dir=os.path.join(work, "run"))
    seconds = time.time() - t0
    with open(os.path.join(model, "train_metrics.json")) as f:
        hist = json.load(f)
    m = evaluate(model, data, lr_reference=lr_reference, coverage=False)["metrics"]
    shutil.rmtree(work, ignore_errors=True)
    return {
        "metrics": m,
        "train_seconds": seconds,
        "epoch": hist.get("best_epoch", cfg.trainer.scheduled_epochs),
        "scored": len(hist.get("validation", [])),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--datasets", default="movielens,criteo_synth", help="comma-separated: movielens, criteo_synth")
    p.add_argument("--movielens-sizes", default=MOVIELENS_SIZES, help="ratings, first by time (all: every one)")
    p.add_argument("--criteo-sizes", default=CRITEO_SIZES, help="train rows of the synthetic set")
    p.add_argument(
        "--models", default="", help="comma-separated model names to run, or all (default: all but EXTRA_MODELS)"
    )
    p.add_argument("--seeds", type=int, default=int(os.environ.get("BENCH_SEEDS", 3)))
    p.add_argument("--eval-rows", type=int, default=1_000_000, help="eval rows of the synthetic set")
    p.add_argument("--movielens-data", default="data/movielens")
    p.add_argument("--work", default="", help="working folder (datasets are reused from it); default: temporary")
    p.add_argument("--out", default="", help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error("--seeds must be >= 1")
    work = args.work or tempfile.mkdtemp(prefix="bench-quality-")
    t_all = time.time()
    for dataset in [d for d in args.datasets.split(",") if d]:
        if dataset not in ("movielens", "criteo_synth"):
            p.error(f"--datasets: unknown dataset {dataset!r} (movielens, criteo_synth)")
        models = chosen_models(dataset, args.models)
        sizes = args.movielens_sizes if dataset == "movielens" else args.criteo_sizes
        size_list = [s for s in sizes.split(",") if s]
        for size in size_list:
            at_size = models_at_size(models, size, size_list, args.models)
            data, train_rows, planted = prepare(dataset, size, work, args.movielens_data, args.eval_rows)
            log(f"{dataset} {size}: {train_rows} train rows")
            ref_path = os.path.join(os.path.dirname(data), "lr_reference.json")  # reused with the dataset
            reference: dict[str, Any] = {}
            if os.path.exists(ref_path):
                with open(ref_path) as f:
                    reference = json.load(f)
            for name, (config, default) in at_size.items():
                runs = []
                for seed in range(args.seeds):
                    r = run_model(config, data, os.path.join(work, "run"), seed, lr_reference=not reference)
                    m = r["metrics"]
                    if not reference:
                        reference = {"lr_auc": m.get("lr_auc"), "lr_logloss": m.get("lr_logloss")}
                        with open(ref_path, "w") as f:
                            json.dump(reference, f)
                    runs.append(r)
                    log(
                        f"{dataset} {size} {name} seed {seed}: AUC {m['auc']:.4f} logloss {m['logloss']:.4f} "
                        f"(epoch {r['epoch']}, {r['train_seconds']:.0f} s)"
                    )
                aucs = [r["metrics"]["auc"] for r in runs]
                lls = [r["metrics"]["logloss"] for r in runs]
                auc, ll = statistics.mean(aucs), statistics.mean(lls)
                lr_auc, lr_ll = reference.get("lr_auc"), reference.get("lr_logloss")
                line = {
                    "dataset": dataset,
                    "size": int(size) if size != "all" else "all",
                    "train_rows": train_rows,
                    "model": name,
                    "default": default,
                    "seeds": args.seeds,
                    "auc": round(auc, 5),
                    "auc_std": round(statistics.pstdev(aucs), 5),
                    "logloss": round(ll, 5),
                    "logloss_std": round(statistics.pstdev(lls), 5),
                    "lr_auc": None if lr_auc is None else round(lr_auc, 5),
                    "lr_logloss": None if lr_ll is None else round(lr_ll, 5),
                    "auc_lift": None if lr_auc is None else round(auc - lr_auc, 5),
                    "beats_lr": None if lr_auc is None or lr_ll is None else bool(auc >= lr_auc and ll <= lr_ll),
                    "epochs_kept": [r["epoch"] for r in runs],
                    "epochs_scored": [r["scored"] for r in runs],
                    "train_seconds": round(statistics.mean(r["train_seconds"] for r in runs), 1),
                    "loadavg": loadavg(),
                }
                if planted is not None:
                    line["planted_auc"] = round(planted, 5)
                text = json.dumps(line)
                print(text, flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(text + "\n")
    log(f"bench-quality: {time.time() - t_all:.0f} s")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
