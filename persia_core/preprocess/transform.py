"""The whole preprocess step as one composite ``PTransform``: raw files -> Parquet train/eval shards + statistics.

Steps (each a composite ``PTransform``; runs on the DirectRunner here and on Dataflow with runner options)::

    1. ReadNumberedLines   each input file read in order with FileSystems (local or gs://), so every line keeps
                           "<file>:<line>" (1-based, the header counts) and its global row number (``read``)
    2. ParseDelimited /    lines -> records (``layouts``) -> encoded rows (``delimited``); MovieLens joins ratings
       JoinMovieLens       with movies and tags by movieId (CoGroupByKey; tags per rating by sort + bisect + one
                           sweep) and, with ``layout.history_length > 0``, adds each rating's user history
                           (GroupByKey by userId; sort + bisect per user); see ``movielens``
    3. SplitAndShard       eval = rows with ts >= cutoff, cutoff = sorted_ts[floor((1 - eval_fraction) * n)];
                           each split is cut into shards at order statistics of a hash of ``source`` (the file
                           named relative to the input root, ``read.source_names``, so the same files give the
                           same shards however the path is typed or wherever the folder lies), so shards are
                           balanced (sizes differ by at most one row) and deterministic (``split``)
    4. WriteShards         one Parquet file per shard (``schema.arrow_schema``), rows sorted by that hash (``write``)
    5. WriteDeadLetters    malformed lines -> dead_letter/*.jsonl {"source", "reason", "raw"}, counted by file
                           and reason (``write``)
    6. statistics          dense mean/std over train, distinct IDs per slot (HyperLogLog), row counts (also per
                           input file: a file with no data rows is warned of) ->
                           ``preprocess_stats.json`` (the CombineFns are in ``stats``); the driver
                           (``pipeline.run_preprocess``) then checks the malformed budget and writes
                           ``schema.json`` and ``run_config.yaml``

Inside the pipeline an example is an encoded row, a compact tuple (``rows``).
"""

from __future__ import annotations

import apache_beam as beam
from apache_beam.pvalue import AsSingleton

from persia_core.config import RunConfig
from persia_core.data import schema
from persia_core.preprocess.delimited import ParseDelimited
from persia_core.preprocess.movielens import JoinMovieLens
from persia_core.preprocess.read import ReadNumberedLines, header_orders
from persia_core.preprocess.split import SplitAndShard
from persia_core.preprocess.stats import DenseStatsFn, DistinctIdsFn
from persia_core.preprocess.write import WriteDeadLetters, WriteShards, WriteStatsFn


def _named(file_rows: tuple[str, int], names: dict[str, str]) -> tuple[str, int]:
    """``(path, rows)`` -> ``(its source name, rows)``."""
    return names.get(file_rows[0], file_rows[0]), file_rows[1]


class Preprocess(beam.PTransform):
    """The whole preprocess step: ``PBegin`` -> Parquet shards, dead letters and ``preprocess_stats.json``.

    ``inputs``: from ``resolve_inputs`` (``{"ratings"|"movies"|"tags": [path]}`` for MovieLens,
    ``{"files": [paths in name order]}`` for delimited). ``names``: each input path's name in rows' sources
    (``read.source_names``; default: the path itself). Returns the stats PCollection (one dict).
    """

    def __init__(
        self, config: RunConfig, inputs: dict[str, list[str]], output_dir: str, names: dict[str, str] | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.inputs = inputs
        self.output_dir = output_dir
        self.names = dict(names or {})

    def expand(self, pbegin):
        config, layout, split = self.config, self.config.layout, self.config.split
        if layout.kind == "movielens":
            reads = {
                name: pbegin
                | f"Read{name.title()}"
                >> ReadNumberedLines(
                    self.inputs[name], True, split.max_rows if name == "ratings" else 0, example=name == "ratings"
                )
                for name in ("ratings", "movies", "tags")
            }
            parsed = {name: r["lines"] for name, r in reads.items()} | "JoinMovieLens" >> JoinMovieLens(
                config, self.names
            )
            read_dead = [r["dead"] for r in reads.values()]
            read_count = reads["ratings"]["read"]
            file_rows = [r["file_rows"] for r in reads.values()] | "RowsPerInputFile" >> beam.Flatten()
        else:
            # the headers first: a file whose columns differ from the config's fails the step before any row
            orders = header_orders(self.inputs["files"], layout) if layout.has_header else {}
            read = pbegin | "ReadLines" >> ReadNumberedLines(
                self.inputs["files"], layout.has_header, split.max_rows, example=True, redistribute=True
            )
            parsed = read["lines"] | "ParseDelimited" >> ParseDelimited(config, orders, self.names)
            read_dead = [read["dead"]]
            read_count = read["read"]
            file_rows = read["file_rows"]
        rows = parsed["rows"]
        dead = (*read_dead, parsed["dead"]) | "AllDeadLetters" >> beam.Flatten()
        malformed = dead | "WriteDeadLetters" >> WriteDeadLetters(self.output_dir)

        split_out = rows | "SplitAndShard" >> SplitAndShard(
            split.eval_fraction, split.num_train_shards, split.num_eval_shards
        )
        num_dense = len(layout.dense_fields())
        shards = split_out["keyed"] | "WriteShards" >> WriteShards(
            self.output_dir,
            config.slot_names,
            num_dense,
            {schema.TRAIN_DIR: split.num_train_shards, schema.EVAL_DIR: split.num_eval_shards},
        )
        dense = split_out["train_dense"] | "DenseStats" >> beam.CombineGlobally(DenseStatsFn(num_dense))
        distinct = rows | "DistinctIds" >> beam.CombineGlobally(DistinctIdsFn(config.slot_names))
        return (
            pbegin
            | "StatsTrigger" >> beam.Create([None])
            | "WriteStats"
            >> beam.ParDo(
                WriteStatsFn(self.output_dir),
                plan=AsSingleton(split_out["plan"]),
                dense=AsSingleton(dense),
                distinct=AsSingleton(distinct),
                read=AsSingleton(read_count),
                file_rows=beam.pvalue.AsList(file_rows | "NameFiles" >> beam.Map(_named, self.names)),
                malformed=AsSingleton(malformed),
                shards=beam.pvalue.AsList(shards),
            )
        )
