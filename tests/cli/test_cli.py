"""The ``persia`` command line: help, exit codes (2 bad input, 1 failure), and each step on tiny local files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import types

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score
from support import tiny_config, write_dataset

from persia_core.__main__ import main
from persia_core.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMANDS = ("preprocess", "init-shards", "train", "evaluate", "predict", "plan", "serve-shards")


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "persia_core", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.processes
def test_cli_help_lists_every_subcommand_and_explains_flags(capsys):
    p = _run("--help")
    assert p.returncode == 0
    for cmd in COMMANDS:
        assert cmd in p.stdout
    assert "Exit codes" in p.stdout
    assert main(["evaluate", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--data", "--report", "--user-slot", "--blessed-dir", "--min-auc", "--bless"):
        assert flag in out


def _typo_config(tmp_path) -> str:
    text = tiny_config().to_yaml().replace("batch_size:", "batch_sise:")
    path = tmp_path / "typo.yaml"
    path.write_text(text)
    return str(path)


def test_config_misspelled_key_fails_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"trainer\.batch_sise': unknown key \(did you mean 'batch_size'\? known: \["):
        load_config(_typo_config(tmp_path))


def test_cli_misspelled_config_key_exits_2_naming_the_key(tmp_path, capsys):
    data = write_dataset(str(tmp_path / "data"))
    rc = main(["init-shards", "--data", data, "--output", str(tmp_path / "shards"), "--config", _typo_config(tmp_path)])
    assert rc == 2
    assert "trainer.batch_sise" in capsys.readouterr().err


def test_cli_bad_input_exits_2_and_failures_exit_1(tmp_path, capsys, monkeypatch):
    assert main(["evaluate", "--model", str(tmp_path / "nope"), "--data", str(tmp_path)]) == 2  # missing file
    assert "manifest.json" in capsys.readouterr().err
    assert main(["train", "--data", str(tmp_path)]) == 2  # usage: --output missing
    assert main(["no-such-command"]) == 2
    assert main(["predict", "--model", "m", "--input", "i", "--output", "o", "--batch-size", "0"]) == 2
    assert main(["init-shards", "--data", "d", "--output", "o", "--bogus"]) == 2
    assert main(["init-shards", "--data", "d", "--output", "o", "--set", "nokeyvalue"]) == 2

    import persia_core.embedding.plan as plan

    def boom(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(plan, "init_shards", boom)
    data = write_dataset(str(tmp_path / "data"))
    cfg = tmp_path / "ok.yaml"
    cfg.write_text(tiny_config().to_yaml())
    capsys.readouterr()
    assert main(["init-shards", "--data", data, "--output", str(tmp_path / "s"), "--config", str(cfg)]) == 1
    assert "disk on fire" in capsys.readouterr().err


def test_cli_plan_delegates_to_the_planner_or_says_it_is_missing(monkeypatch, capsys):
    seen = []
    fake = types.ModuleType("persia_core.planner")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "persia_core.planner", fake)
    assert main(["plan", "--rows", "1e9", "--dim", "16"]) == 0
    assert main(["plan", "--help"]) == 0
    assert seen == [["--rows", "1e9", "--dim", "16"], ["--help"]]
    monkeypatch.setitem(sys.modules, "persia_core.planner", None)  # as if the module did not exist
    assert main(["plan"]) == 1
    assert "planner" in capsys.readouterr().err


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_cli_init_shards_train_evaluate_predict_on_tiny_data(tmp_path, capsys):
    data = write_dataset(str(tmp_path / "data"), rows=256, eval_rows=120)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(tiny_config().to_yaml())
    shards, model = str(tmp_path / "shards"), str(tmp_path / "model")

    assert main(["init-shards", "--data", data, "--output", shards, "--config", str(cfg)]) == 0
    assert json.loads(capsys.readouterr().out)["num_shards"] == 2
    assert main(["train", "--data", data, "--init", shards, "--output", model, "--set", "trainer.epochs=1"]) == 0
    assert "samples_per_s" in json.loads(capsys.readouterr().out)["summary"]

    report, blessed = str(tmp_path / "report.html"), str(tmp_path / "blessed")
    rc = main(
        [
            "evaluate",
            "--model",
            model,
            "--data",
            data,
            "--report",
            report,
            "--user-slot",
            "a",
            "--blessed-dir",
            blessed,
            "--min-auc",
            "0",
            "--max-ne",
            "100",
            "--lr-margin",
            "1",
            "--bless",
            "--metrics-json",
            str(tmp_path / "m.json"),
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gate"]["decision"] == "bless" and os.path.exists(os.path.join(out["blessed_model"], "dense.pt"))
    assert out["user_split"]["slot"] == "a" and set(out["coverage"]) == {"a", "b", "tags"}
    html = open(report).read()
    assert "Model gate" in html and "Per-slot coverage" in html and "Users seen and not seen" in html
    assert json.load(open(tmp_path / "m.json"))["metrics"] == out["metrics"]

    preds = str(tmp_path / "preds.csv")
    eval_file = os.path.join(data, "eval", "eval-00000-of-00001.parquet")
    assert main(["predict", "--model", model, "--input", eval_file, "--output", preds]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 120
    rows = np.loadtxt(preds, delimiter=",", skiprows=1, usecols=(1, 2))
    assert roc_auc_score(rows[:, 1], rows[:, 0].astype(np.float32)) == out["metrics"]["auc"]

    # the next day: warm-start from the blessed location, train afresh into a new folder
    warm = str(tmp_path / "warm")
    assert (
        main(["init-shards", "--data", data, "--output", warm, "--config", str(cfg), "--warm-start-from", blessed]) == 0
    )
    assert json.loads(capsys.readouterr().out)["warm_start"]["rows"]["default"] > 0
    assert (
        main(
            [
                "train",
                "--data",
                data,
                "--init",
                warm,
                "--output",
                str(tmp_path / "model2"),
                "--set",
                "trainer.epochs=1",
                "--resume-from",
                "",
            ]
        )
        == 0
    )
    capsys.readouterr()
    # a blessed-model location given as --model with --bless: its latest blessed model is scored and copied (before:
    # scored, then refused as "not a trained model")
    other = str(tmp_path / "blessed-copy")
    assert (
        main(
            [
                "evaluate",
                "--model",
                blessed,
                "--data",
                data,
                "--report",
                str(tmp_path / "r2.html"),
                "--blessed-dir",
                other,
                "--min-auc",
                "0",
                "--max-ne",
                "100",
                "--lr-margin",
                "1",
                "--bless",
            ]
        )
        == 0
    )
    again = json.loads(capsys.readouterr().out)
    assert again["metrics"]["auc"] == out["metrics"]["auc"]
    assert os.path.exists(os.path.join(again["blessed_model"], "dense.pt"))


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_cli_train_on_sigterm_stops_its_processes_removes_its_shared_memory_and_exits_143(tmp_path):
    # SIGTERM is how Kubernetes, KFP and Vertex AI cancel a task; before, Python's default ended the launcher at
    # once: its children died with it, but their /dev/shm segments stayed until the next train started
    import glob
    import time

    from persia_core.train.processes import descendants, process_state

    data = write_dataset(str(tmp_path / "data"), rows=256)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(tiny_config(epochs=500, network_delay_s=0.002, num_workers=2).to_yaml())
    work = tmp_path / "work"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "persia_core",
            "train",
            "--data",
            data,
            "--config",
            str(cfg),
            "--output",
            str(tmp_path / "model"),
            "--work-dir",
            str(work),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and "step 21/" not in "".join(
            open(f, errors="replace").read() for f in glob.glob(str(work / "logs" / "nn_worker-*.log"))
        ):
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        children = descendants(proc.pid)
        assert len(children) >= 4  # 2 servers + 2 NN workers
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert "persia train: terminated (SIGTERM)" in err
    assert not [c for c in children if process_state(c) not in ("", "Z")]
    from persia_core.ps.shm import PREFIX, SHM_DIR

    mine = tuple(f"{PREFIX}{c & 0xFFFFFFFF:08x}" for c in children)
    assert not [f for f in os.listdir(SHM_DIR) if f.startswith(mine)] if os.path.isdir(SHM_DIR) else True


@pytest.mark.processes
def test_cli_serve_shards_prints_addresses_and_stops_on_ctrl_c(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(tiny_config().to_yaml())
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "persia_core",
            "serve-shards",
            "--config",
            str(cfg),
            "--num-shards",
            "2",
            "--work-dir",
            str(tmp_path / "work"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        info = json.loads(line)
        assert len(info["addresses"]) == 2 and all(a.startswith("127.0.0.1:") for a in info["addresses"])
        assert oct(os.stat(info["token_file"]).st_mode & 0o777) == "0o600"
        from persia_core.ps.client import EmbeddingClient

        client = EmbeddingClient(info["addresses"], tiny_config().embedding, token=open(info["token_file"]).read())
        try:
            assert len(client.stats()) == 2
        finally:
            client.close()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert not os.path.exists(info["token_file"])  # the dead servers' token is not left behind
        assert os.path.isdir(tmp_path / "work" / "logs")  # a folder the user named is kept
        assert not os.path.exists(tmp_path / "work" / "dumps")  # ... but not its empty dumps folder
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.processes
def test_cli_serve_shards_leaves_no_temporary_folder_when_refused_or_stopped(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(tiny_config().to_yaml())
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "persia_core",
            "serve-shards",
            "--config",
            str(cfg),
            "--init",
            str(tmp_path / "no-such"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "is not a folder" in refused.stderr
    assert os.listdir(scratch) == []
    proc = subprocess.Popen(
        [sys.executable, "-m", "persia_core", "serve-shards", "--config", str(cfg), "--num-shards", "1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        info = json.loads(proc.stdout.readline() or proc.stderr.read())
        assert info["token_file"].startswith(str(scratch))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert os.listdir(scratch) == []  # its own temporary folder (token, logs) is removed on a clean stop
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_preprocess_runs_beam_on_raw_files_and_applies_overrides(tmp_path, capsys):
    folder = tmp_path / "ml"
    folder.mkdir()
    files = {
        "ratings.csv": ["userId,movieId,rating,timestamp"]
        + [
            f"{u},{m},{(u + m) % 5 + 1}.0,{1000 + 10 * i}"
            for i, (u, m) in enumerate([(1, 1), (1, 2), (2, 1), (2, 2), (3, 1)])
        ],
        "movies.csv": ["movieId,title,genres", "1,A (1999),Drama", "2,B (2001),Comedy|Drama"],
        "tags.csv": ["userId,movieId,tag,timestamp"],
    }
    for name, lines in files.items():
        (folder / name).write_text("\n".join(lines) + "\n")
    out = str(tmp_path / "out")
    rc = main(["preprocess", "--data", str(folder), "--output", out, "--set", "split.num_train_shards=1"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["rows"]["train"] + summary["rows"]["eval"] == 5
    assert load_config(os.path.join(out, "run_config.yaml")).split.num_train_shards == 1
    assert main(["preprocess", "--data", str(tmp_path / "missing"), "--output", out]) == 2
    # a mistyped flag of ours is refused, not handed to Beam (which dropped it with a warning and ran on, exit 0)
    capsys.readouterr()
    rc = main(
        [
            "preprocess",
            "--data",
            str(folder),
            "--output",
            str(tmp_path / "out2"),
            "--sett",
            "split.eval_fraction=0.5",
            "--direct_num_workers=1",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "--sett: did you mean --set?" in err and "direct_num_workers" not in err.splitlines()[-1]
    assert not (tmp_path / "out2").exists()


def test_config_error_in_a_nested_section_says_where_it_sits(tmp_path):
    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "persia_core", "configs", "movielens.yaml")).read()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("name: rowwise_adagrad", "name: rowwise_adagrd"))
    with pytest.raises(ValueError, match=r"optimizer.name.*rowwise_adagrd.*embedding.tables\[default\].optimizer"):
        load_config(str(bad))


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("trainer.dense_lr", ".nan", "expected a finite number"),
        ("embedding.tables.default.optimizer.lr", ".nan", "expected a finite number"),
        ("trainer.rpc_timeout_s", ".nan", "expected a finite number"),
        ("trainer.network_delay_s", ".inf", "expected a finite number"),
        ("embedding.tables.default.optimizer.eps", ".inf", "expected a finite number"),
        ("embedding.tables.default.optimizer.weight_decay", "-5", "must be >= 0"),
        ("trainer.seed", "-1", "must be >= 0"),
        ("embedding.shard_memory_bytes", "1.0e+20", "does not fit in a 64-bit integer"),
        ("trainer.rpc_timeout_s", "1.0e+10", "must be in (0, 86400] seconds"),  # gRPC failed every call at once
        ("embedding.tables.default.optimizer", "{name: adagrad, name: sgd}", "duplicate key 'name'"),
    ],
)
def test_cli_non_finite_negative_or_oversized_values_exit_2_naming_the_key(tmp_path, capsys, key, value, says):
    # before: NaN learning rates, an infinite delay or a 1e20-byte budget passed validation and failed (or not)
    # later inside a worker
    data = write_dataset(str(tmp_path / "data"))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(tiny_config().to_yaml())
    rc = main(
        [
            "init-shards",
            "--data",
            data,
            "--output",
            str(tmp_path / "shards"),
            "--config",
            str(cfg),
            "--set",
            f"{key}={value}",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2, err
    assert says in err and key.rsplit(".", 1)[-1] in err
    assert not os.path.exists(tmp_path / "shards")


def test_a_number_in_exponent_notation_without_a_dot_is_a_number():
    # YAML 1.1 reads 1e-3 as a string; before, --set trainer.dense_lr=1e-3 was refused as "expected a number"
    from persia_core.config import parse_overrides

    assert tiny_config().with_overrides(parse_overrides(["trainer.dense_lr=1e-3"])).trainer.dense_lr == 0.001


def test_config_file_with_a_key_twice_is_refused_naming_the_key_and_line(tmp_path):
    text = tiny_config().to_yaml().replace("  batch_size:", "  batch_size: 7\n  batch_size:", 1)
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"duplicate key 'batch_size'[\s\S]*line \d+"):
        load_config(str(path))
    # YAML merge keys stay valid: a key merged from an anchor may be given again, overriding it
    import yaml

    from persia_core.config.loading import UniqueKeyLoader

    text = "a: &opt {name: adagrad, lr: 0.1}\nb: {<<: *opt, lr: 0.2}\n"
    assert yaml.load(text, Loader=UniqueKeyLoader) == yaml.safe_load(text)
    assert yaml.safe_load(text)["b"] == {"name": "adagrad", "lr": 0.2}


def test_a_local_job_of_more_processes_than_the_machine_allows_is_refused_before_any_starts(tmp_path):
    from persia_core.train.local_cluster import LocalCluster, max_local_processes

    with pytest.raises(ValueError, match=r"embedding.num_shards=100000 .*python -m pipelines\.submit"):
        LocalCluster(str(tmp_path / "cfg.yaml"), 100000, 2, str(tmp_path / "work"))
    assert max_local_processes() >= 64
    assert not os.path.exists(tmp_path / "work")


def test_cli_init_shards_refuses_a_warm_start_location_where_nothing_exists_but_starts_cold_from_an_empty_one(
    tmp_path, capsys
):
    # before: a typo printed a warning and started cold with exit 0, every night of a cron schedule
    data = write_dataset(str(tmp_path / "data"))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(tiny_config().to_yaml())
    args = ["init-shards", "--data", data, "--config", str(cfg)]
    assert main([*args, "--output", str(tmp_path / "a"), "--warm-start-from", str(tmp_path / "blesed")]) == 2
    assert "--warm-start-from" in capsys.readouterr().err and not os.path.exists(tmp_path / "a")
    # the first day of a schedule, said on purpose (on Cloud Storage there is no empty folder to create)
    assert (
        main(
            [
                *args,
                "--output",
                str(tmp_path / "b"),
                "--warm-start-from",
                str(tmp_path / "blessed"),
                "--cold-start-if-missing",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["warm_start"]["cold_start"] == "no model blessed there yet"
    (tmp_path / "blessed").mkdir()  # or the location exists, nothing blessed yet
    assert main([*args, "--output", str(tmp_path / "c"), "--warm-start-from", str(tmp_path / "blessed")]) == 0
    assert json.loads(capsys.readouterr().out)["warm_start"]["cold_start"] == "no model blessed there yet"


def test_cli_serve_shards_refuses_a_model_of_another_shard_count(tmp_path, capsys):
    """Each server loads the file of its own shard number: serving 2 shard files on 3 servers would lose rows."""
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(tiny_config().to_yaml())
    model = tmp_path / "model" / "shards"
    model.mkdir(parents=True)
    for s in range(2):
        (model / f"shard-{s:05d}.npz").write_bytes(b"")
    rc = main(
        [
            "serve-shards",
            "--config",
            str(cfg),
            "--num-shards",
            "3",
            "--init",
            str(tmp_path / "model"),
            "--work-dir",
            str(tmp_path / "work"),
        ]
    )
    assert rc == 2
    assert "holds 2 shard files but 3 shards were asked" in capsys.readouterr().err


def test_cli_shard_budget_below_1024_rows_exits_2_naming_the_field_and_value(tmp_path, capsys):
    import yaml

    from persia_core.config import RunConfig

    data = write_dataset(str(tmp_path / "data"))
    d = tiny_config().to_dict()
    d["embedding"]["tables"][0]["dim"] = 16  # as the shipped configs
    cfg = tmp_path / "dim16.yaml"
    cfg.write_text(yaml.safe_dump(d))
    out = tmp_path / "shards"
    rc = main(
        [
            "init-shards",
            "--data",
            data,
            "--output",
            str(out),
            "--config",
            str(cfg),
            "--set",
            "embedding.shard_memory_bytes=70000",
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "embedding.shard_memory_bytes" in err and "70000" in err and "Traceback" not in err
    assert "give at least" in err and not out.exists()
    # the least budget it names is enough
    least = int(err.split("give at least")[1].split()[0])
    d["embedding"]["shard_memory_bytes"] = least
    assert RunConfig.from_dict(d).embedding.shard_memory_bytes == least
    d["embedding"]["shard_memory_bytes"] = least - 1
    with pytest.raises(ValueError, match=r"'embedding\.shard_memory_bytes': .*holds? fewer than 1024 rows"):
        RunConfig.from_dict(d)


def test_set_reaches_a_table_or_slot_by_name_or_index(tmp_path, capsys):
    from tests.support import write_dataset

    data = write_dataset(str(tmp_path / "data"))
    (tmp_path / "data" / "run_config.yaml").write_text(tiny_config().to_yaml())
    out = str(tmp_path / "init")
    assert (
        main(
            [
                "init-shards",
                "--data",
                data,
                "--output",
                out,
                "--set",
                "embedding.tables.default.dim=8",
                "--set",
                "embedding.tables[0].optimizer.lr=0.5",
                "--set",
                "slots.b.id_dropout=0.25",
            ]
        )
        == 0
    )
    cfg = load_config(os.path.join(out, "run_config.yaml"))
    assert (cfg.embedding.tables[0].dim, cfg.embedding.tables[0].optimizer.lr) == (8, 0.5)
    assert [s.id_dropout for s in cfg.slots] == [0.0, 0.25, 0.0]
    assert json.load(open(os.path.join(out, "shard_plan.json")))["tables"]["default"]["dim"] == 8
    capsys.readouterr()
    assert main(["init-shards", "--data", data, "--output", out, "--set", "embedding.tables.dflt.dim=8"]) == 2
    assert "no item 'dflt' (by name: ['default']" in capsys.readouterr().err
    assert main(["init-shards", "--data", data, "--output", out, "--set", "trainer.num_nn_workers=2"]) == 2
    assert "unknown key 'num_nn_workers' (did you mean 'num_workers'? known: [" in capsys.readouterr().err


def test_cli_serve_shards_resolves_a_blessed_location_and_refuses_a_folder_without_shards(tmp_path, capsys):
    """A blessed-model location (as evaluate and predict take) serves its latest blessed model; a folder with no
    shard files is refused instead of starting empty servers that nothing reports."""
    from persia_core.model_store import BLESSED_FORMAT, BLESSED_MARKER

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(tiny_config().to_yaml())
    blessed = tmp_path / "blessed"
    shards = blessed / "models" / "m1" / "shards"
    shards.mkdir(parents=True)
    for s in range(2):
        (shards / f"shard-{s:05d}.npz").write_bytes(b"")
    (blessed / BLESSED_MARKER).write_text(
        json.dumps({"format": BLESSED_FORMAT, "model": "models/m1", "metrics": {"auc": 0.7}})
    )
    rc = main(
        [
            "serve-shards",
            "--config",
            str(cfg),
            "--num-shards",
            "3",
            "--init",
            str(blessed),
            "--work-dir",
            str(tmp_path / "work"),
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "models/m1 holds 2 shard files but 3 shards were asked" in err  # the blessed model's own shards
    (blessed / BLESSED_MARKER).write_text(json.dumps({"format": BLESSED_FORMAT, "metrics": {"auc": 0.7}}))  # no "model"
    rc = main(["serve-shards", "--config", str(cfg), "--init", str(blessed), "--work-dir", str(tmp_path / "work")])
    assert rc == 2 and f"{blessed / BLESSED_MARKER}: a blessed-model marker needs 'model'" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    rc = main(
        ["serve-shards", "--config", str(cfg), "--init", str(tmp_path / "empty"), "--work-dir", str(tmp_path / "work")]
    )
    assert rc == 2
    assert "no shard files" in capsys.readouterr().err
