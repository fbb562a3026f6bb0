"""Component 2: the shard plan, memory estimate and initial state of each embedding parameter server."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Metrics, Output

from components import BASE_IMAGE


@dsl.component(base_image=BASE_IMAGE, install_kfp_package=False)
def init_shards(dataset: Input[Dataset], shards: Output[Artifact], plan: Output[Metrics]):
    """Write ``shard_plan.json``, ``run_config.yaml`` and ``shards/shard-*.npz`` into ``shards``; fail with a
    clear error when the estimated memory exceeds ``embedding.shard_memory_bytes``."""
    import os

    from persia_core.config import load_config
    from persia_core.embedding.plan import init_shards as run

    cfg = load_config(os.path.join(dataset.path, "run_config.yaml"))
    p = run(cfg, dataset.path, shards.path)
    plan.log_metric("num_shards", p["num_shards"])
    plan.log_metric("estimated_bytes_per_shard", p["estimated_bytes_per_shard"])
    plan.log_metric("shard_memory_bytes", p["shard_memory_bytes"])
