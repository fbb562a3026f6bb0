"""Fixtures of the preprocess tests: small raw MovieLens and Criteo-layout files, and helpers to run the
Beam pipeline on them (DirectRunner) and read back its outputs."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from persia_core.config import RunConfig, load_config
from persia_core.preprocess import pipeline
from persia_core.preprocess.pipeline import run_preprocess

REPO = Path(__file__).resolve().parents[2]
MOVIELENS_DIR = str(REPO / "data" / "movielens")

# Tiny MovieLens files (CRLF line ends like the GroupLens files). Rating timestamps are 1e9 + 100 * k.
TINY_MOVIES = [
    "movieId,title,genres",
    "1,Toy Story (1995),Adventure|Animation|Children|Comedy|Fantasy",
    '2,"Babe Ruth Story, The (1948) ",Drama',
    "3,Li'l Quinquin,(no genres listed)",
    "4,Fawlty Towers (1975-1979),Comedy",
]
TINY_RATINGS = [
    "userId,movieId,rating,timestamp",
    "1,1,4.0,1000000000",  # line 2: tags strictly before 1e9 -> only "pixar"
    "1,2,3.5,1000000100",  # line 3
    "2,1,5.0,1000000200",  # line 4: tags -> "funny" (at 1e9), "pixar"
    "2,3,2.0,1000000300",  # line 5: no genres, no year
    "3,4,4.5,1000000400",  # line 6: year range -> no year
    "3,99,4.0,1000000500",  # line 7: unknown movieId
    "4,1,abc,1000000600",  # line 8: unparsable rating
    "4,2,1.0,1000000700",  # line 9
    "5,1,4.0,1000000800",  # line 10: all four tags
    "5,2,4.0,1000000900",  # line 11
]
TINY_TAGS = [
    "userId,movieId,tag,timestamp",
    "5,1,Pixar,999999000",
    "6,1, pixar ,999999500",
    "7,1,Funny,1000000000",
    "8,1,Later,1000000300",
    '9,1,"Dwayne ""The Rock"" Johnson",1000000700',
]


def _write_lines(path: Path, lines: list[str], newline: str = "\r\n") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes((newline.join(lines) + newline).encode("utf-8"))
    return str(path)


@pytest.fixture(scope="session")
def tiny_movielens(tmp_path_factory) -> str:
    """A folder with tiny ratings.csv / movies.csv / tags.csv (see the comments on TINY_RATINGS)."""
    d = tmp_path_factory.mktemp("tiny_movielens")
    _write_lines(d / "movies.csv", TINY_MOVIES)
    _write_lines(d / "ratings.csv", TINY_RATINGS)
    _write_lines(d / "tags.csv", TINY_TAGS)
    return str(d)


@pytest.fixture(scope="session")
def movielens_dir() -> str:
    """The bundled MovieLens ml-latest-small folder."""
    return MOVIELENS_DIR


def config_with(name: str, **overrides) -> RunConfig:
    """A shipped config with dotted overrides given as keyword arguments (``split__max_rows=10``)."""
    return load_config(name, {k.replace("__", "."): v for k, v in overrides.items()})


def read_split(out_dir: str, split: str | None = None) -> list[dict]:
    """All rows of a preprocess output (one split or both) as dicts, sorted by ``source``."""
    pattern = f"{split}/*.parquet" if split else "*/*.parquet"
    files = sorted(glob.glob(os.path.join(out_dir, pattern)))
    rows = [r for f in files for r in pq.read_table(f).to_pylist()]
    return sorted(rows, key=lambda r: (r["source"].rsplit(":", 1)[0], int(r["source"].rsplit(":", 1)[1])))


def read_dead_letters(out_dir: str) -> list[dict]:
    """The dead-letter JSON lines of a preprocess output."""
    out = []
    for f in sorted(glob.glob(os.path.join(out_dir, "dead_letter", "*.jsonl"))):
        with open(f, encoding="utf-8") as fh:
            out += [json.loads(line) for line in fh if line.strip()]
    return out


@pytest.fixture
def helpers():
    """Namespace of helpers: ``config_with``, ``read_split``, ``read_dead_letters``, ``run``, ``table``."""

    class H:
        pass

    h = H()
    h.config_with = config_with
    h.read_split = read_split
    h.read_dead_letters = read_dead_letters
    h.run = run_preprocess
    h.table = lambda path: pq.read_table(path)
    h.concat = lambda out, split: pa.concat_tables(
        [pq.read_table(f) for f in sorted(glob.glob(os.path.join(out, split, "*.parquet")))]
    )
    return h


# the command line of tiny_movielens_run: our flags, --set overrides of the shipped config (4 train shards) and
# Beam pipeline options, which main must tell apart
TINY_MOVIELENS_ARGS = [
    "--config",
    "movielens",
    "--set",
    "split.max_malformed_fraction=0.5",
    "--set",
    "split.num_train_shards=2",
    "--direct_num_workers=1",
    "--direct_running_mode=in_memory",
]


@pytest.fixture(scope="session")
def tiny_movielens_run(tiny_movielens, tmp_path_factory) -> tuple[str, dict]:
    """Preprocess of ``tiny_movielens`` with a malformed budget of 50% and 2 train shards, run once by the command
    line's ``pipeline.main`` with ``TINY_MOVIELENS_ARGS``: ``(output dir, schema dict)``."""
    out = str(tmp_path_factory.mktemp("tiny_ml_out"))
    return out, pipeline.main(["--data", tiny_movielens, "--output", out, *TINY_MOVIELENS_ARGS])
