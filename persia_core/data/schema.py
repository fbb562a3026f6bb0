"""Column layout of the Parquet shards that preprocess writes and the trainer and evaluator read.

Each row is one example::

    label      float32              0.0 or 1.0
    dense      list<float32>        F dense features, in ``schema.json["dense"]`` order (transformed, not scaled)
    slot_<s>   list<uint64>         the feature IDs of slot s (empty list = missing / no value)
    ts         int64                Unix seconds of the example (row number for layouts without time)
    source     string               "<file>:<line>" of the raw row it came from; <file> relative to the input root

A shard's path under the output folder is ``shard_file(split, shard, num_shards)``. Beside the shards,
``schema.json`` (see ``SCHEMA_FILE``) holds::

    {"slots": [..], "dense": [..], "dense_mean": [..], "dense_std": [..],   # mean/std over the train split
     "rows": {"train": n, "eval": n, "malformed": n, "read": n},
     "distinct_ids": {slot: estimate}, "split": {"by": "time"|"row_order", "cutoff": int},
     "train_files": [..], "eval_files": [..], "config": {...run config...}}
"""

LABEL = "label"
DENSE = "dense"
TS = "ts"
SOURCE = "source"
SCHEMA_FILE = "schema.json"
TRAIN_DIR = "train"
EVAL_DIR = "eval"
DEAD_LETTER_DIR = "dead_letter"


def slot_column(slot: str) -> str:
    """Parquet column of a slot's feature IDs."""
    return f"slot_{slot}"


def shard_file(split: str, shard: int, num_shards: int) -> str:
    """A shard's path relative to the output folder: ``train/train-00001-of-00004.parquet``."""
    return f"{split}/{split}-{shard:05d}-of-{num_shards:05d}.parquet"


def arrow_schema(slots: list[str]):
    """The pyarrow schema of a shard for these slots."""
    import pyarrow as pa

    fields = [
        pa.field(LABEL, pa.float32()),
        pa.field(DENSE, pa.list_(pa.float32())),
        *[pa.field(slot_column(s), pa.list_(pa.uint64())) for s in slots],
        pa.field(TS, pa.int64()),
        pa.field(SOURCE, pa.string()),
    ]
    return pa.schema(fields)
