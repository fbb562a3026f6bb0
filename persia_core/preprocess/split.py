"""Step 3 of the preprocess pipeline: encoded rows -> train/eval split and shard of each row.

The split plan (time cutoff and shard bounds, ``stats.SplitPlanFn``) is computed over all rows, then each row is
assigned ``(split, shard)`` against it (``AssignShardFn``).
"""

from __future__ import annotations

import bisect
from typing import Any

import apache_beam as beam
from apache_beam.pvalue import AsSingleton, TaggedOutput

from persia_core.data import schema
from persia_core.preprocess.counters import counter
from persia_core.preprocess.rows import DENSE, KEY, TS
from persia_core.preprocess.stats import SplitPlanFn

_TRAIN_DENSE = "train_dense"


class AssignShardFn(beam.DoFn):
    """An encoded row + the split plan -> ``((split, shard), row)``; train rows' dense bytes also go to the
    ``train_dense`` output (for the mean/std)."""

    def __init__(self) -> None:
        self.train = counter("train_rows")
        self.eval = counter("eval_rows")

    def process(self, row: tuple, plan: dict[str, Any]):
        if row[TS] >= plan["cutoff"]:
            self.eval.inc()
            yield (schema.EVAL_DIR, bisect.bisect_right(plan["eval_bounds"], row[KEY])), row
        else:
            self.train.inc()
            yield TaggedOutput(_TRAIN_DENSE, row[DENSE])
            yield (schema.TRAIN_DIR, bisect.bisect_right(plan["train_bounds"], row[KEY])), row


class SplitAndShard(beam.PTransform):
    """Encoded rows -> ``{"keyed": ((split, shard), row), "plan": one plan dict, "train_dense": bytes}``.

    Eval = rows with ``ts >= cutoff``, ``cutoff = sorted_ts[floor((1 - eval_fraction) * n)]`` (ties at the
    cutoff all go to eval). Within a split, rows are cut into shards at order statistics of their source hash.
    """

    def __init__(self, eval_fraction: float, num_train_shards: int, num_eval_shards: int) -> None:
        super().__init__()
        self.eval_fraction = eval_fraction
        self.num_train_shards = num_train_shards
        self.num_eval_shards = num_eval_shards

    def expand(self, rows):
        plan = (
            rows
            | "TsAndKey" >> beam.Map(lambda r: (r[TS], r[KEY]))
            | "PlanSplit"
            >> beam.CombineGlobally(SplitPlanFn(self.eval_fraction, self.num_train_shards, self.num_eval_shards))
        )
        keyed = rows | "AssignShards" >> beam.ParDo(AssignShardFn(), plan=AsSingleton(plan)).with_outputs(
            _TRAIN_DENSE, main="keyed"
        )
        return {"keyed": keyed.keyed, "plan": plan, "train_dense": keyed[_TRAIN_DENSE]}
