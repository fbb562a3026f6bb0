"""The file-writing sinks of the preprocess pipeline: Parquet shards, dead letters and ``preprocess_stats.json``.

``WriteShards`` writes one Parquet file per shard (``schema.shard_file``, ``schema.arrow_schema``), every shard
of the plan, empty or not; ``WriteDeadLetters`` writes the dead letters as JSON lines and summarizes them;
``WriteStatsFn`` gathers the pipeline's statistics into ``STATS_FILE``. Paths are local or gs://.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import apache_beam as beam
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems

from persia_core.data import schema
from persia_core.preprocess.rows import KEY, SOURCE, rows_to_table
from persia_core.preprocess.stats import MalformedSummaryFn

STATS_FILE = "preprocess_stats.json"
DEAD_LETTER_PREFIX = "dead_letter"

_BATCH_ROWS = 1 << 16


class WriteShardFn(beam.DoFn):
    """``((split, shard), rows)`` -> one Parquet file ``<output_dir>/<split>/<split>-SSSSS-of-NNNNN.parquet``.

    Rows are written sorted by their source hash (deterministic, and not in user or time order) in row groups
    of 65536; a shard without rows is an empty file with the schema. A shard must fit in a worker's memory:
    use more shards for bigger data. Yields ``(split, shard, rows written)``.
    """

    def __init__(self, output_dir: str, slot_names: list[str], num_dense: int, num_shards: dict[str, int]) -> None:
        self.output_dir = output_dir
        self.slot_names = list(slot_names)
        self.num_dense = num_dense
        self.num_shards = dict(num_shards)

    def process(self, element: tuple):
        (split, shard), rows = element
        rows = sorted((r for r in rows if r is not None), key=lambda r: (r[KEY], r[SOURCE]))
        path = FileSystems.join(self.output_dir, schema.shard_file(split, shard, self.num_shards[split]))
        if "://" in path:  # remote (gs://): write a local file, then copy it with FileSystems
            with tempfile.TemporaryDirectory() as tmp:
                local = os.path.join(tmp, "shard.parquet")
                self._write(local, rows)
                with open(local, "rb") as src, FileSystems.create(path) as dst:
                    shutil.copyfileobj(src, dst, 1 << 22)
        else:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self._write(path, rows)
        yield split, shard, len(rows)

    def _write(self, path: str, rows: list[tuple]) -> None:
        arrow_schema = schema.arrow_schema(self.slot_names)
        with pq.ParquetWriter(path, arrow_schema) as writer:
            if not rows:
                writer.write_table(arrow_schema.empty_table())
            for start in range(0, len(rows), _BATCH_ROWS):
                writer.write_table(rows_to_table(rows[start : start + _BATCH_ROWS], self.slot_names, self.num_dense))


class WriteShards(beam.PTransform):
    """``((split, shard), row)`` -> Parquet shards, every one of ``num_shards[split]`` written (empty or not).

    Returns a PCollection of ``(split, shard, rows written)``.
    """

    def __init__(self, output_dir: str, slot_names: list[str], num_dense: int, num_shards: dict[str, int]) -> None:
        super().__init__()
        self.output_dir = output_dir
        self.slot_names = list(slot_names)
        self.num_dense = num_dense
        self.num_shards = dict(num_shards)

    def expand(self, keyed):
        all_keys = [((split, i), None) for split, n in self.num_shards.items() for i in range(n)]
        every_shard = keyed.pipeline | "ShardKeys" >> beam.Create(all_keys)
        return (
            (keyed, every_shard)
            | "WithEveryShard" >> beam.Flatten()
            | "GroupByShard" >> beam.GroupByKey()
            | "WriteParquet"
            >> beam.ParDo(WriteShardFn(self.output_dir, self.slot_names, self.num_dense, self.num_shards))
        )


def dead_letter_json(dead: dict[str, Any]) -> str:
    """A dead letter as its JSON line: ``{"source": "<file>:<line>", "reason": ..., "raw": <the line>}``, plus
    ``"raw_base64"``, the line's exact bytes, for a line that is not UTF-8 (its ``raw`` shows U+FFFD for them)."""
    out = {"source": dead["source"], "reason": dead["reason"], "raw": dead["raw"]}
    if "raw_base64" in dead:
        out["raw_base64"] = dead["raw_base64"]
    return json.dumps(out, ensure_ascii=False)


class WriteDeadLetters(beam.PTransform):
    """Dead letters -> ``<output_dir>/dead_letter/dead_letter-00000-of-00001.jsonl`` (JSON lines).

    Returns one summary dict (``MalformedSummaryFn``).
    """

    def __init__(self, output_dir: str) -> None:
        super().__init__()
        self.output_dir = output_dir

    def expand(self, dead):
        _ = (
            dead
            | "ToJson" >> beam.Map(dead_letter_json)
            | "WriteJsonLines"
            >> beam.io.WriteToText(
                FileSystems.join(self.output_dir, schema.DEAD_LETTER_DIR, DEAD_LETTER_PREFIX),
                file_name_suffix=".jsonl",
                num_shards=1,
                shard_name_template="-SSSSS-of-NNNNN",
            )
        )
        return dead | "SummarizeMalformed" >> beam.CombineGlobally(MalformedSummaryFn())


class WriteStatsFn(beam.DoFn):
    """Gathers the pipeline's statistics (side inputs) into one dict, written to ``<output_dir>/preprocess_stats.json``.

    The dict: ``{"plan": SplitPlanFn output, "dense": DenseStatsFn output, "distinct_ids": {slot: n}, "read": n,
    "files": {input file's source name: data rows kept (under split.max_rows; they add up to read)}, "malformed":
    MalformedSummaryFn output, "shard_rows": {"train/0": n, ...}}``.
    """

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir

    def process(self, _, plan, dense, distinct, read, file_rows, malformed, shards):
        stats = {
            "plan": plan,
            "dense": dense,
            "distinct_ids": distinct,
            "read": int(read),
            "files": {name: int(n) for name, n in sorted(file_rows)},
            "malformed": malformed,
            "shard_rows": {f"{split}/{shard}": n for split, shard, n in shards},
        }
        with FileSystems.create(FileSystems.join(self.output_dir, STATS_FILE)) as f:
            f.write(json.dumps(stats, indent=1, sort_keys=True).encode("utf-8"))
        yield stats
