"""The one rule for reading the lines of a text input (``persia_core.preprocess.lines``), and the header of a
delimited file checked against ``layout.columns``: the same in preprocess and predict."""

from __future__ import annotations

import gzip
import io
import json
import logging

import pytest

from persia_core.config import RunConfig
from persia_core.preprocess import lines
from persia_core.preprocess.layouts import ParseError
from persia_core.preprocess.read import ReadFileLinesFn
from persia_core.preprocess.write import STATS_FILE

COLUMNS = ["label", "x", "a", "b", "tags"]


def _layout(**kw):
    cfg = {"kind": "delimited", "columns": COLUMNS, "dense_columns": ["x"], "has_header": True, **kw}
    return RunConfig.from_dict({"layout": cfg, "slots": [{"name": "a", "source": "a"}]}).layout


def test_lines_split_at_lf_only_strip_a_trailing_cr_and_a_leading_bom():
    data = "\ufeff1\t2\r\nform\x0cfeed\t\u2028sep\u2029\x1c\x1d\x1e\x85x\n\n\xe9\nlast".encode()
    data = data.replace("\xe9".encode(), b"\xe9")  # one byte that is not UTF-8
    got = list(lines.read_lines(io.BytesIO(data)))
    assert [n for n, _ in got] == [1, 2, 3, 4, 5]
    assert [raw for _, raw in got] == [
        b"1\t2",
        "form\x0cfeed\t\u2028sep\u2029\x1c\x1d\x1e\x85x".encode(),
        b"",
        b"\xe9",
        b"last",
    ]
    assert lines.decode_line(got[1][1]) == "form\x0cfeed\t\u2028sep\u2029\x1c\x1d\x1e\x85x"
    assert lines.decode_line(b"\xe9") is None


def test_a_bom_only_counts_at_the_start_of_a_file():
    got = list(lines.read_lines(io.BytesIO(b"a\n\xef\xbb\xbfb\n")))
    assert got == [(1, b"a"), (2, b"\xef\xbb\xbfb")]


def test_preprocess_reads_the_first_line_of_a_file_with_a_bom_as_without_it(tmp_path):
    fn = ReadFileLinesFn(skip_header=False, max_lines=0)
    with_bom, without = tmp_path / "bom.tsv", tmp_path / "plain.tsv"
    with_bom.write_bytes(b"\xef\xbb\xbf1\t2\ta\n0\t3\tb\n")
    without.write_bytes(b"1\t2\ta\n0\t3\tb\n")
    texts = [
        [e[4] for e in fn.process((0, str(p))) if isinstance(e, tuple) and len(e) == 6] for p in (with_bom, without)
    ]
    assert texts[0] == texts[1] == ["1\t2\ta", "0\t3\tb"]


def test_a_header_equal_to_the_columns_reads_in_order():
    assert lines.header_order("label\tx\ta\tb\ttags", _layout(), "f.tsv") is None


def test_a_header_that_differs_from_the_columns_is_refused_naming_the_first_difference():
    with pytest.raises(ValueError, match=r"f.tsv:1: .*column 3 is 'b'.*layout.columns\[2\] is 'a'.*map_header_by_name"):
        lines.header_order("label\tx\tb\ta\ttags", _layout(), "f.tsv")
    with pytest.raises(ValueError, match=r"f.tsv:1: .*4 columns.*5"):
        lines.header_order("label\tx\ta\tb", _layout(), "f.tsv")


def test_map_header_by_name_reorders_the_fields_into_the_config_order():
    layout = _layout(map_header_by_name=True)
    order = lines.header_order("tags\tb\textra\tlabel\tx\ta", layout, "f.tsv")
    assert lines.reorder("t\tB\tzz\t1\t0.5\tA", order, layout) == "1\t0.5\tA\tB\tt"
    # a row one field short of its header is malformed, never read in the config's order instead (it has 5)
    with pytest.raises(ParseError, match=r"wrong field count: 5 != 6 \(this file's header\)"):
        lines.reorder("t\tB\t1\t0.5\tA", order, layout)
    with pytest.raises(ValueError, match=r"f.tsv:1: .*no column 'x'"):
        lines.header_order("tags\tb\tlabel\ta", layout, "f.tsv")
    with pytest.raises(ValueError, match=r"f.tsv:1: .*'a' twice"):
        lines.header_order("a\tlabel\tx\ta\tb\ttags", layout, "f.tsv")


def test_preprocess_refuses_a_header_that_differs_before_reading_any_row(tmp_path, helpers):
    data = tmp_path / "swapped.tsv"
    data.write_text("label\tx\tb\ta\ttags\n1\t0.5\t3\t17\t4\n")
    cfg = RunConfig.from_dict({"layout": _layout().__dict__, "slots": [{"name": "a", "source": "a"}]})
    with pytest.raises(ValueError, match=rf"{data}:1: .*column 3 is 'b'"):
        helpers.run(cfg, str(data), str(tmp_path / "out"))
    assert not (tmp_path / "out" / "schema.json").exists()


def test_preprocess_with_a_header_skips_a_file_without_any_line_but_refuses_a_blank_first_line(
    tmp_path, helpers, caplog
):
    # found by a tester: a 0-byte file among the inputs failed the header check ("the first line is empty"); a file
    # without any line has no header to check and no rows, so it is read as one without data rows
    data = tmp_path / "in"
    data.mkdir()
    rows = ["1\t0.5\t3\t17\t4", "0\t1.5\t5\t19\t6"] * 5
    (data / "a.tsv").write_text("\t".join(COLUMNS) + "\n" + "".join(r + "\n" for r in rows))
    (data / "empty.tsv").write_bytes(b"")
    (data / "empty.tsv.gz").write_bytes(gzip.compress(b""))  # not 0 bytes, but no line either
    cfg = RunConfig.from_dict({"layout": _layout().__dict__, "slots": [{"name": "a", "source": "a"}]})
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING):
        result = helpers.run(cfg, str(data), str(out))
    assert result["rows"]["read"] == len(helpers.read_split(str(out))) == 10
    stats = json.loads((out / STATS_FILE).read_text())
    assert stats["files"] == {"a.tsv": 10, "empty.tsv": 0, "empty.tsv.gz": 0}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for name in ("empty.tsv", "empty.tsv.gz"):
        assert [m for m in warned if f"{data / name} holds no data rows" in m], warned
    # a first line that is there but blank is not a header: refused as before
    blank = data / "blank.tsv"
    blank.write_text("\n" + "\t".join(COLUMNS) + "\n" + rows[0] + "\n")
    with pytest.raises(ValueError, match=rf"{blank}:1: layout.has_header is set, but the first line is empty"):
        helpers.run(cfg, str(data), str(tmp_path / "out_blank"))
    assert not (tmp_path / "out_blank" / "schema.json").exists()


def test_preprocess_with_map_header_by_name_gives_the_rows_of_the_file_in_config_order(tmp_path, helpers):
    rows = [["1", "0.5", "3", "17", "4"], ["0", "", "19", "", ""], ["1", "2.5", "7", "1", "9"]] * 4
    in_order, shuffled = tmp_path / "a" / "d.tsv", tmp_path / "b" / "d.tsv"
    in_order.parent.mkdir()
    shuffled.parent.mkdir()
    in_order.write_text("\t".join(COLUMNS) + "\n" + "".join("\t".join(r) + "\n" for r in rows))
    perm = [4, 2, 0, 3, 1]  # tags, a, label, b, x; then a column the config does not read
    shuffled.write_text(
        "\t".join(COLUMNS[i] for i in perm)
        + "\textra\n"
        + "".join("\t".join(r[i] for i in perm) + "\tzz\n" for r in rows)
    )
    slots = [{"name": s, "source": s} for s in ("a", "b", "tags")]
    cfg = RunConfig.from_dict({"layout": _layout(map_header_by_name=True).__dict__, "slots": slots})
    helpers.run(cfg, str(in_order), str(tmp_path / "out_a"))
    # a row without its last field has as many fields as the config has columns: before, it was read in the
    # config's order, its values in the wrong slots
    with open(shuffled, "a") as f:
        f.write("\t".join(rows[0][i] for i in perm) + "\n")
    helpers.run(cfg.with_overrides({"split.max_malformed_fraction": 0.2}), str(shuffled), str(tmp_path / "out_b"))
    (dead,) = helpers.read_dead_letters(str(tmp_path / "out_b"))
    assert dead["source"].endswith(":14") and dead["reason"].startswith("wrong field count: 5 != 6")
    strip = lambda rs: [{k: v for k, v in r.items() if k != "source"} for r in rs]  # noqa: E731
    assert strip(helpers.read_split(str(tmp_path / "out_a"))) == strip(helpers.read_split(str(tmp_path / "out_b")))
    assert len(helpers.read_split(str(tmp_path / "out_b"))) == 12


@pytest.mark.parametrize("where", ["same", "inside", "inside_glob"])
def test_an_output_folder_that_is_or_lies_inside_the_input_is_refused_before_anything_is_written(
    tmp_path, helpers, where
):
    data = tmp_path / "raw"
    data.mkdir()
    (data / "d.tsv").write_text("1\t0.5\t3\t17\t4\n" * 10)
    cfg = RunConfig.from_dict({"layout": _layout(has_header=False).__dict__, "slots": [{"name": "a", "source": "a"}]})
    given = {"same": str(data), "inside": str(data), "inside_glob": str(data / "*.tsv")}[where]
    out = {"same": data, "inside": data / "prep", "inside_glob": data / "sub" / "prep"}[where]
    with pytest.raises(ValueError, match=r"output folder .* is inside the input"):
        helpers.run(cfg, given, str(out) + ("/" if where == "same" else ""))
    assert sorted(p.name for p in data.iterdir()) == ["d.tsv"]  # nothing written, nothing removed


def test_compressed_files_decompress_by_extension_and_a_truncated_one_fails_naming_it():
    import bz2
    import gzip
    import lzma

    data = b"1\t2\ta\n0\t3\tb\n" * 50
    for name, packed in (("x.gz", gzip.compress(data)), ("x.GZ", gzip.compress(data)), ("x.bz2", bz2.compress(data))):
        assert [raw for _, raw in lines.numbered_lines(io.BytesIO(packed), name)] == data.splitlines()
        with pytest.raises(ValueError, match=rf"{name}: not a valid .* file \(truncated or corrupt\)"):
            list(lines.numbered_lines(io.BytesIO(packed[: len(packed) // 2]), name))
    assert len(list(lines.numbered_lines(io.BytesIO(lzma.compress(data)), "x.xz"))) == 100
    with pytest.raises(ValueError, match=r"x.gz: not a valid .gz file"):
        list(lines.numbered_lines(io.BytesIO(data), "x.gz"))  # a plain file named .gz
    with pytest.raises(ValueError, match=r"x.zst: .zst files are not read"):
        list(lines.numbered_lines(io.BytesIO(data), "x.zst"))


def test_preprocess_fails_naming_a_truncated_compressed_file_instead_of_dropping_its_rows(tmp_path, helpers):
    import bz2

    data = tmp_path / "in"
    data.mkdir()
    body = "1\t0.5\t3\t17\t4\n" * 200
    (data / "a.tsv").write_text(body)
    packed = bz2.compress(body.encode())
    (data / "b.tsv.bz2").write_bytes(packed[: len(packed) // 2])  # before: its rows silently dropped, exit 0
    cfg = RunConfig.from_dict({"layout": _layout(has_header=False).__dict__, "slots": [{"name": "a", "source": "a"}]})
    with pytest.raises(Exception, match=r"b.tsv.bz2: not a valid .bz2 file \(truncated or corrupt\)"):
        helpers.run(cfg, str(data), str(tmp_path / "out"))
    assert not (tmp_path / "out" / "schema.json").exists()


@pytest.mark.parametrize("sub", ["dead_letter", "train"])
def test_an_input_inside_a_folder_the_output_replaces_is_refused_and_left_alone(tmp_path, helpers, sub):
    # found by a helper session: --data out/dead_letter --output out deleted the input with the old dead letters
    out = tmp_path / "out"
    (out / sub).mkdir(parents=True)
    raw = out / sub / "d.tsv"
    raw.write_text("1\t0.5\t3\t17\t4\n" * 10)
    cfg = RunConfig.from_dict({"layout": _layout(has_header=False).__dict__, "slots": [{"name": "a", "source": "a"}]})
    for given in (str(out / sub), str(raw)):
        with pytest.raises(ValueError, match=rf"the input .* lies in {out / sub}"):
            helpers.run(cfg, given, str(out))
    assert raw.exists()


def test_a_run_removes_only_its_own_dead_letter_files(tmp_path, helpers):
    data, out = tmp_path / "d.tsv", tmp_path / "out"
    data.write_text("1\t0.5\t3\t17\t4\n" * 10 + "bad\n")
    (out / "dead_letter").mkdir(parents=True)
    (out / "dead_letter" / "README").write_text("notes of mine")
    cfg = RunConfig.from_dict({"layout": _layout(has_header=False).__dict__, "slots": [{"name": "a", "source": "a"}]})
    helpers.run(cfg.with_overrides({"split.max_malformed_fraction": 0.5}), str(data), str(out))
    assert (out / "dead_letter" / "README").read_text() == "notes of mine"
    assert len(helpers.read_dead_letters(str(out))) == 1
