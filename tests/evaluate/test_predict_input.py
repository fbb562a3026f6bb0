"""predict reads raw rows by the same line rule as preprocess (``persia_core.preprocess.lines``): lines split at
``\\n`` only, a BOM dropped, an undecodable line a dead letter, ``.gz`` by extension, the header checked."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from support import tiny_config

from persia_core.evaluate.predict import predict

ROWS = [["1", "0.5", "3", "17", "4"], ["0", "", "19", "", ""], ["1", "2.5", "7", "1", "9"]]


@pytest.fixture(scope="module")
def model(tmp_path_factory, model_factory):
    seen = {"a": ["3", "19", "7", "x\x0cy"], "b": ["17", "1"], "tags": ["4", "9"]}
    return model_factory(str(tmp_path_factory.mktemp("model")), tiny_config(), seen)


def _tsv(rows) -> bytes:
    return "".join("\t".join(r) + "\n" for r in rows).encode()


def _score(model, tmp_path, name: str, data: bytes, **kw):
    path = tmp_path / name
    path.write_bytes(data)
    return path, predict(model, str(path), str(tmp_path / f"{name}.csv"), **kw)


def test_a_field_holding_a_form_feed_or_a_unicode_line_separator_stays_in_its_line(model, tmp_path):
    rows = [ROWS[0], ["0", "", "x\x0cy", "", "\u2028"], ROWS[2]]
    _, out = _score(model, tmp_path, "ff.tsv", _tsv(rows), dead_letter=str(tmp_path / "ff.dead"))
    assert out["rows"] == 3 and out["malformed"] == 0


def test_an_undecodable_line_is_a_dead_letter_with_its_bytes_and_the_others_are_scored(model, tmp_path):
    data = _tsv(ROWS).replace(b"19", b"1\xe99", 1)
    dead = tmp_path / "bad.dead"
    path, out = _score(model, tmp_path, "bad.tsv", data, dead_letter=str(dead))
    assert out["rows"] == 2 and out["malformed"] == 1
    (letter,) = [json.loads(line) for line in dead.read_text().splitlines()]
    assert letter["source"] == f"{path}:2" and letter["reason"] == "not utf-8"
    import base64

    assert base64.b64decode(letter["raw_base64"]) == b"0\t\t1\xe99\t\t"
    _, plain = _score(model, tmp_path, "good.tsv", _tsv([ROWS[0], ROWS[2]]))
    assert np.array_equal(out["probability"], plain["probability"])
    with pytest.raises(ValueError, match=rf"{path}:2: not utf-8"):
        predict(model, str(path), str(tmp_path / "x.csv"))


def test_a_bom_at_the_start_of_the_file_is_not_part_of_the_first_row(model, tmp_path):
    _, with_bom = _score(model, tmp_path, "bom.tsv", b"\xef\xbb\xbf" + _tsv(ROWS))
    _, without = _score(model, tmp_path, "plain.tsv", _tsv(ROWS))
    assert np.array_equal(with_bom["probability"], without["probability"])
    assert list(with_bom["label"]) == [1.0, 0.0, 1.0]


def test_a_gzip_file_is_read_by_its_extension(model, tmp_path):
    path, packed = _score(model, tmp_path, "rows.tsv.gz", gzip.compress(_tsv(ROWS)))
    _, plain = _score(model, tmp_path, "rows.tsv", _tsv(ROWS))
    assert np.array_equal(packed["probability"], plain["probability"])
    with open(tmp_path / "rows.tsv.gz.csv") as f:
        assert f"{path}:3" in f.read()


def test_a_header_is_checked_against_the_columns_as_in_preprocess(model, tmp_path):
    header = lambda cols: ("\t".join(cols) + "\n").encode()  # noqa: E731
    cfg = tiny_config()
    cfg.layout.has_header = True
    _, ok = _score(model, tmp_path, "h.tsv", header(cfg.layout.columns) + _tsv(ROWS), config=cfg)
    _, plain = _score(model, tmp_path, "p.tsv", _tsv(ROWS))
    assert np.array_equal(ok["probability"], plain["probability"])
    # rows to serve: the header without the label column
    _, served = _score(
        model, tmp_path, "s.tsv", header(cfg.layout.columns[1:]) + _tsv([r[1:] for r in ROWS]), config=cfg
    )
    assert np.array_equal(served["probability"], plain["probability"]) and served["label"] is None
    swapped = header(["label", "x", "b", "a", "tags"]) + _tsv(ROWS)
    with pytest.raises(ValueError, match=r"swapped.tsv:1: .*column 3 is 'b'"):
        _score(model, tmp_path, "swapped.tsv", swapped, config=cfg)


def test_with_map_header_by_name_a_row_short_of_its_header_is_set_aside_not_read_in_config_order(model, tmp_path):
    cfg = tiny_config()
    cfg.layout.has_header, cfg.layout.map_header_by_name = True, True
    perm = [4, 2, 0, 3, 1]  # tags, a, label, b, x; then a column the config does not read
    header = "\t".join(cfg.layout.columns[i] for i in perm) + "\textra\n"
    rows = "".join("\t".join(r[i] for i in perm) + "\tzz\n" for r in ROWS)
    short = "\t".join(ROWS[1][i] for i in perm) + "\n"  # as many fields as the config's columns
    _, out = _score(
        model, tmp_path, "byname.tsv", (header + rows + short).encode(), config=cfg, dead_letter=str(tmp_path / "d")
    )
    _, plain = _score(model, tmp_path, "plain.tsv", _tsv(ROWS))
    assert out["rows"] == 3 and out["malformed"] == 1
    np.testing.assert_array_equal(out["probability"], plain["probability"])


def test_a_truncated_gzip_file_fails_naming_it(model, tmp_path):
    packed = gzip.compress(_tsv(ROWS * 20))
    with pytest.raises(ValueError, match=r"cut.tsv.gz: not a valid .gz file \(truncated or corrupt\)"):
        _score(model, tmp_path, "cut.tsv.gz", packed[: len(packed) // 2])
