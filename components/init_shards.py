"""Component 2: the shard plan, memory estimate and initial state of each embedding parameter server."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Output

from components import BASE_IMAGE


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def init_shards(dataset: Input[Dataset], shards: Output[Artifact], plan: Output[Metrics], warm_start_from: str = ""):
    """Write ``shard_plan.json``, ``run_config.yaml`` and ``shards/shard-*.npz`` into ``shards``; fail with a
    clear error when the estimated memory exceeds ``embedding.shard_memory_bytes``.

    ``warm_start_from``: the previous run's Model artifact, a checkpoint, or a blessed-model location (its
    latest blessed model; none yet = cold start); empty = cold start. Its rows, optimizer state and dense
    weights start this run; a config that no longer matches it fails the step naming the difference."""
    from persia_core.train.processes import die_with_local_runner

    die_with_local_runner()  # a task of run_local ends with it, even a SIGKILLed one, not running on orphaned

    import os

    from persia_core.config import load_config
    from persia_core.embedding.plan import init_shards as run

    cfg = load_config(os.path.join(dataset.path, "run_config.yaml"))
    p = run(cfg, dataset.path, shards.path, warm_start_from=warm_start_from)
    plan.log_metric("num_shards", p["num_shards"])
    plan.log_metric("estimated_bytes_per_shard", p["estimated_bytes_per_shard"])
    plan.log_metric("shard_memory_bytes", p["shard_memory_bytes"])
    ws = p.get("warm_start") or {}
    plan.log_metric("warm_start_rows", sum((ws.get("rows") or {}).values()))
    plan.log_metric("warm_start_dropped_rows", sum((ws.get("dropped_rows") or {}).values()))
