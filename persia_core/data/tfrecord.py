"""TFRecord input: ``tf.train.Example`` records (as TFX / Vertex AI data pipelines write them) -> the delimited text
of the run config's layout, which the preprocess step then turns into Parquet shards.

Runs in its own environment (``.venv-tfrecord``, ``requirements-tfrecord.txt``): tensorflow-io 0.37.1 needs
tensorflow 2.16, protobuf < 5 and numpy < 2, which kfp 2.17 and apache-beam[gcp] 2.77 cannot share. So the
conversion is a step of its own, and everything after it is the one code path every input takes::

    TFRecord files --[this module, .venv-tfrecord]--> <name>.tsv --[preprocess, .venv]--> Parquet shards

Each input file ``<name>.tfrecord[.gz]`` becomes ``<name><suffix>`` with one line per Example, fields in
``layout.columns`` order, so the Parquet rows equal those of the same data given as text. A column takes the
Example feature of the same name::

    int64_list [v]      str(v)
    float_list [v]      the shortest text that reads back as the same float32 (``0.1``, ``3``)
    bytes_list [v]      v as UTF-8
    absent or []        empty (missing, as in Criteo's TSV)

A feature with several values, or text holding the delimiter or a line break, has no delimited form:
``ValueError`` naming the file, record and feature. Records are read with ``tf.data.TFRecordDataset`` (GZIP
by the ``.gz`` suffix; ``tensorflow_io`` registers its file systems). Local and ``/gcs/`` paths are read in
place; ``gs://`` files go through ``persia_core.io`` (google-cloud-storage, the project's one Cloud Storage path,
which honours ``STORAGE_EMULATOR_HOST``): each is copied to a temporary local file, read, and deleted, and the
text files are written through it too. (TensorFlow's own ``gs://`` file system has no emulator endpoint, and
tensorflow-io's GCS plugin crashes when forced on TensorFlow 2.16 with ``TF_USE_MODULAR_FILESYSTEM``.)
Only delimited layouts apply (MovieLens is three joined CSV files).

    python -m persia_core.data.tfrecord --input 'gs://b/examples/*.tfrecord.gz' --output gs://b/text --config criteo
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator

import numpy as np

from persia_core import io
from persia_core.config import RunConfig, load_config

log = logging.getLogger("persia.tfrecord")

TFRECORD_SUFFIXES = (".tfrecord.gz", ".tfrecords.gz", ".tfrecord", ".tfrecords", ".gz")


def _tf():
    import tensorflow as tf

    try:  # registers tensorflow-io's file systems (gs://, s3://, http) where available
        import tensorflow_io  # noqa: F401
    except ImportError:  # pragma: no cover - requirements-tfrecord.txt installs it
        pass
    return tf


def format_float32(x: float) -> str:
    """The shortest decimal text that reads back as the same float32 (``0.1`` for float32(0.1))."""
    return np.format_float_positional(np.float32(x), unique=True, trim="-")


def example_to_fields(example, columns: list[str], where: str) -> list[str]:
    """The text fields of one ``tf.train.Example`` in ``columns`` order (see module docstring)."""
    feats = example.features.feature
    out = []
    for name in columns:
        if name not in feats:
            out.append("")
            continue
        f = feats[name]
        kind = f.WhichOneof("kind")
        values = list(getattr(f, kind).value) if kind else []
        if len(values) > 1:
            raise ValueError(f"{where}: feature {name!r} has {len(values)} values; a delimited column holds one")
        if not values:
            out.append("")
        elif kind == "int64_list":
            out.append(str(int(values[0])))
        elif kind == "float_list":
            out.append(format_float32(values[0]))
        else:
            try:
                out.append(values[0].decode("utf-8"))
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: feature {name!r} is not UTF-8 text") from e
    return out


def examples_to_lines(records: Iterable[bytes], layout, where: str = "") -> Iterator[str]:
    """Serialized Examples -> lines (no line end) of ``layout`` (a delimited ``LayoutConfig``)."""
    tf = _tf()
    for i, raw in enumerate(records):
        example = tf.train.Example.FromString(raw)
        at = f"{where}record {i}"
        fields = example_to_fields(example, layout.columns, at)
        for name, text in zip(layout.columns, fields, strict=True):
            if layout.delimiter in text or "\n" in text or "\r" in text:
                raise ValueError(f"{at}: feature {name!r} holds the delimiter or a line break: {text!r}")
        yield layout.delimiter.join(fields)


def input_files(pattern: str) -> list[str]:
    """TFRecord files of ``pattern``: a file, a glob, or a folder (its ``*.tfrecord[s][.gz]`` files), sorted."""
    if io.isdir(pattern):
        return [io.join(pattern, n) for n in io.listdir(pattern) if n.endswith(TFRECORD_SUFFIXES)]
    return io.glob(pattern)


def _records(path: str) -> Iterator[bytes]:
    """The serialized records of one TFRecord file (local, /gcs/ or gs://)."""
    tf = _tf()
    compression = "GZIP" if path.endswith(".gz") else ""
    if not io.is_remote(path):
        for r in tf.data.TFRecordDataset([path], compression_type=compression):
            yield r.numpy()
        return
    with tempfile.TemporaryDirectory(prefix="persia-tfrecord-") as tmp:
        local = os.path.join(tmp, "input" + (".gz" if compression else ""))
        with open(local, "wb") as f:
            f.write(io.read_bytes(path))
        for r in tf.data.TFRecordDataset([local], compression_type=compression):
            yield r.numpy()


def output_name(path: str, suffix: str) -> str:
    base = path.rstrip("/").rsplit("/", 1)[-1]
    for s in TFRECORD_SUFFIXES:
        if base.endswith(s):
            base = base[: -len(s)]
            break
    return base + suffix


def convert(input_pattern: str, output_dir: str, config) -> list[str]:
    """Write each TFRecord file of ``input_pattern`` as delimited text into ``output_dir`` (local or gs://) in
    the layout of ``config`` (a ``RunConfig``, or a shipped name / YAML path). Returns the files written.

    Raises ``FileNotFoundError`` when nothing matches, ``ValueError`` for a non-delimited layout or an Example
    without a delimited form."""
    if not isinstance(config, RunConfig):
        config = load_config(config)
    layout = config.layout
    if layout.kind != "delimited":
        raise ValueError(f"TFRecord input needs a delimited layout (layout.kind), got {layout.kind!r}")
    files = input_files(input_pattern)
    if not files:
        raise FileNotFoundError(f"no TFRecord files match {input_pattern!r}")
    suffix = ".tsv" if layout.delimiter == "\t" else ".csv"
    written = []
    for path in files:
        out = io.join(output_dir, output_name(path, suffix))
        if out in written:
            raise ValueError(f"two inputs map to {out}; rename one of them")
        lines = [layout.delimiter.join(layout.columns)] if layout.has_header else []
        lines += examples_to_lines(_records(path), layout, f"{path}: ")
        io.write_text(out, "".join(line + "\n" for line in lines))  # whole file, atomic
        log.info("%s -> %s (%d examples)", path, out, len(lines) - bool(layout.has_header))
        written.append(out)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="persia_core.data.tfrecord", description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True, help="TFRecord file, glob or folder (local or gs://)")
    p.add_argument("--output", required=True, help="folder for the delimited files (local or gs://)")
    p.add_argument("--config", default="criteo", help="run config (shipped name or YAML path) with a delimited layout")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s tfrecord %(message)s")
    try:
        for path in convert(args.input, args.output, args.config):
            print(path)
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
