"""``make bench-ckpt`` end to end on a small table: its last line is the JSON other checks read."""

import json

from persia_core.bench import ckpt


def test_bench_ckpt_prints_the_rates_as_a_json_last_line(tmp_path, capsys):
    assert ckpt.main(["--rows", "20000", "--reps", "1", "--warmup", "0", "--dir", str(tmp_path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    r = json.loads(last)
    for key in ("dump_mb_per_s", "load_mb_per_s", "seq_write_mb_per_s", "seq_read_mb_per_s"):
        assert r[key] > 0, key
    assert r["rows"] == 20000 and r["bytes"] > 20000 * 80
