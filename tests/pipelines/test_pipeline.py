"""The compiled pipeline, and a kfp.local run of the whole pipeline on a tiny subset of the bundled data."""

import json
import os
import re

import pytest
import yaml
from kfp import components

from persia_core.embedding.delta import list_deltas
from pipelines.persia_pipeline import compile_pipeline
from pipelines.run_local import main as run_local
from pipelines.run_local import run_dirs, this_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = ("preprocess", "init-shards", "train", "evaluate")


def test_compiled_yaml_loads_back_and_holds_the_four_components(tmp_path):
    path = compile_pipeline(str(tmp_path / "p.yaml"))
    loaded = components.load_component_from_file(path)
    assert loaded.name == "persia-hybrid-training"
    spec = yaml.safe_load(open(path))
    comps = set(spec["components"])
    for step in STEPS:
        assert f"comp-{step}" in comps
    tasks = spec["root"]["dag"]["tasks"]
    assert tasks["train"]["dependentTasks"] == ["init-shards", "preprocess"] or set(
        tasks["train"]["dependentTasks"]
    ) == {"init-shards", "preprocess"}
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert params["data"]["defaultValue"] == "data/movielens"
    assert params["num_parameter_servers"]["defaultValue"] == 0  # the run config's, unless a run says otherwise
    assert params["embedding_staleness"]["defaultValue"] == -1
    # the gate refuses a model below the LR reference by default; both the evaluate report and the gate apply it
    assert params["lr_margin"]["defaultValue"] == 0.0
    for step in ("evaluate", "gate"):
        given = tasks[step]["inputs"]["parameters"]["lr_margin"]
        assert given == {"componentInputParameter": "lr_margin"}, given


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_kfp_local_runs_the_whole_pipeline_on_a_tiny_subset(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(ROOT)
    rc = run_local(
        [
            "--data",
            os.path.join(ROOT, "data/movielens"),
            "--pipeline-root",
            str(tmp_path / "out"),
            "--max-rows",
            "3000",
            "--epochs",
            "1",
            "--parameter-servers",
            "2",
            "--nn-workers",
            "2",
            "--delta-every-s",
            "0.5",
            "--delta-dir",
            str(tmp_path / "deltas"),
        ]
    )
    assert rc == 0
    lines = capfd.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("eval: AUC=")
    # deltas in the stable folder named by the pipeline parameter, not inside the run's Model artifact
    assert all(list_deltas(str(tmp_path / "deltas"), s) for s in (0, 1))
    # the train task's progress reaches the terminal (before: "train: running", then silence until the end)
    assert any(
        re.fullmatch(r"\d\d:\d\d:\d\d train: step (\d+)/\1 loss \S+ samples/s \S+ staleness \d+", ln) for ln in lines
    ), lines
    assert "cold start" in lines  # says how training started (no warm_start_from given)
    auc = float(lines[-1].split("AUC=")[1].split()[0])
    assert 0.0 < auc < 1.0
    found = {}
    for d, _, files in os.walk(tmp_path / "out"):
        for f in files:
            found.setdefault(f, []).append(os.path.join(d, f))
    assert "manifest.json" in found and "schema.json" in found and "shard_plan.json" in found
    manifest = json.load(open(found["manifest.json"][0]))
    assert manifest["num_shards"] == 2 and len(manifest["shard_files"]) == 2
    assert manifest["deltas"] == {"dir": str(tmp_path / "deltas"), "every_s": 0.5}  # the Model says where they are
    reports = [
        p
        for d, _, fs in os.walk(tmp_path / "out")
        for p in [os.path.join(d, f) for f in fs]
        if os.path.basename(os.path.dirname(p)) == "evaluate" or p.endswith("report")
    ]
    assert any("<img" in open(p, errors="ignore").read() for p in reports if os.path.isfile(p))


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_kfp_local_failure_names_the_error_and_keeps_the_whole_output_in_a_log(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(ROOT)
    data = tmp_path / "garbled"  # the files exist, so the run starts; every rating is malformed
    data.mkdir()
    (data / "ratings.csv").write_text("userId,movieId,rating,timestamp\n" + "x,y,z\n" * 50)
    (data / "movies.csv").write_text("movieId,title,genres\n1,Toy Story (1995),Animation\n")
    (data / "tags.csv").write_text("userId,movieId,tag,timestamp\n")
    rc = run_local(["--data", str(data), "--pipeline-root", str(tmp_path / "out")])
    assert rc == 1
    out, err = capfd.readouterr()
    assert "preprocess: running" in out and "preprocess: failure" in out  # one line per task on the terminal
    assert "Got executor_input" not in out  # kfp.local's own output is not (the tail on stderr has it)
    assert "the pipeline failed" in err and "malformed" in err and "ratings.csv" in err  # the task's own error
    # the task's exception, first and last, and none of kfp's once-per-component type-hint notes in the tail
    named = [line for line in err.splitlines() if line.startswith("run_local: the failing task's error: ")]
    assert len(named) == 2 and "ValueError: preprocess:" in named[0] and "malformed" in named[0]
    assert err.strip().splitlines()[-1] == named[0]
    assert "Converting string literal type hint" not in err
    logs = os.listdir(tmp_path / "out" / "logs")
    assert len(logs) == 1
    text = open(tmp_path / "out" / "logs" / logs[0]).read()
    assert "Executing task" in text and "malformed" in text  # kfp.local's output went to the log


def test_missing_local_data_is_refused_before_any_pipeline_task_starts(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert run_local(["--data", str(tmp_path / "no-such-data"), "--pipeline-root", str(tmp_path / "out")]) == 2
    out, err = capfd.readouterr()
    assert "run_local: preprocess: MovieLens ratings file" in err and "no-such-data" in err and "not found" in err
    assert len(err.strip().splitlines()) == 1 and not out  # one line, no task output, no traceback
    assert not (tmp_path / "out").exists()
    rc = run_local(
        ["--data", str(tmp_path / "none-*.tsv"), "--config", "criteo", "--pipeline-root", str(tmp_path / "out")]
    )
    assert rc == 2 and "no input files match" in capfd.readouterr().err


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_sigterm_to_run_local_ends_the_running_task_and_its_processes_and_exits_143(tmp_path):
    # before: run_local exited, while the train task's launcher, servers and workers ran on to the end
    import signal
    import subprocess
    import sys
    import time

    root = str(tmp_path / "out")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelines.run_local", "--pipeline-root", root, "--epochs", "30", "--max-rows", "20000"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline and " train: step " not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr.read()
        assert " train: step " in line, "training never started"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143 and "run_local: terminated (SIGTERM)" in err
    time.sleep(1)

    def ours():
        out = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
                state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if root.encode() in cmd and state != "Z":
                out.append(int(pid))
        return out

    deadline = time.monotonic() + 15
    while ours() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ours() == []


def test_run_local_fills_date_tokens_of_the_data_path_from_the_current_utc_time(tmp_path, capfd, monkeypatch):
    # a local cron job reads its own day's partition, as a Vertex AI schedule does (before: the token was taken
    # literally and no file matched)
    import datetime

    monkeypatch.chdir(ROOT)
    day = (datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=1)).strftime("%Y-%m-%d")
    part = tmp_path / f"dt={day}"  # not written: the check before any task names the resolved path
    rc = run_local(
        ["--data", str(tmp_path / "dt={date-1d}"), "--config", "criteo", "--pipeline-root", str(tmp_path / "out")]
    )
    out, err = capfd.readouterr()
    assert f"data: {part}" in out
    assert rc == 2 and f"no input files match '{part}'" in err
    assert not (tmp_path / "out").exists()


def test_more_local_processes_than_the_machine_allows_are_refused_before_any_task(tmp_path, capfd, monkeypatch):
    # before: preprocess ran, then the train task failed the same way three times, 60 s and 120 s apart
    monkeypatch.chdir(ROOT)
    rc = run_local(
        [
            "--data",
            os.path.join(ROOT, "data/movielens"),
            "--pipeline-root",
            str(tmp_path / "out"),
            "--nn-workers",
            "5000",
        ]
    )
    out, err = capfd.readouterr()
    assert rc == 2 and "trainer.num_workers=5000" in err and "python -m pipelines.submit" in err
    assert len(err.strip().splitlines()) == 1 and not out
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flag, value, says",
    [
        ("--min-auc", "1.5", "--min-auc must be in [0, 1]"),
        ("--max-ne", "0", "--max-ne must be > 0"),
        ("--lr-margin", "-0.1", "--lr-margin must be >= 0"),
        ("--epochs", "-2", "--epochs must be >= 0 (0 = the config's value, or auto)"),
        ("--epochs", "often", "--epochs: expected a number of epochs or 'auto', got 'often'"),
    ],
)
def test_gate_thresholds_out_of_range_are_refused_before_any_task(tmp_path, capfd, monkeypatch, flag, value, says):
    # before: accepted, then the evaluate task failed after preprocess and train had run
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        run_local(
            ["--data", os.path.join(ROOT, "data/movielens"), "--pipeline-root", str(tmp_path / "out"), flag, value]
        )
    assert e.value.code == 2 and says in capfd.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_warm_start_location_that_is_missing_and_not_the_blessed_dir_is_refused_before_any_task(
    tmp_path, capfd, monkeypatch
):
    """Day one of a schedule warm-starts from its own, still empty, blessed_dir: a cold start. Any other location
    where nothing exists is a typo that would cold-start every run: refused."""
    from persia_core.embedding.warm_start import check_warm_start_location

    blessed = str(tmp_path / "blessed" / "movielens")
    check_warm_start_location(blessed + "/", blessed)  # nothing there yet: fine
    check_warm_start_location("/gcs/b/blessed", "gs://b/blessed/")  # the same location in its two forms
    (tmp_path / "old-model").mkdir()
    check_warm_start_location(str(tmp_path / "old-model"), blessed)  # exists: init-shards judges its contents
    with pytest.raises(FileNotFoundError, match="nothing there, and it is not this run's blessed_dir"):
        check_warm_start_location(str(tmp_path / "blesed" / "movielens"), blessed)
    monkeypatch.chdir(ROOT)
    rc = run_local(
        [
            "--pipeline-root",
            str(tmp_path / "out"),
            "--blessed-dir",
            blessed,
            "--warm-start-from",
            str(tmp_path / "blesed" / "movielens"),
        ]
    )
    assert rc == 2 and "blesed" in capfd.readouterr().err
    assert not (tmp_path / "out").exists()


def test_run_local_reports_its_own_run_when_another_shares_the_pipeline_root(tmp_path):
    """Two runs in one pipeline root: each finds its own folder by what its evaluate step returned, never the
    newest one."""
    root = tmp_path / "out"
    old = root / "persia-hybrid-training-old"
    (old / "evaluate").mkdir(parents=True)
    before = set(run_dirs(str(root)))
    for name, auc in (("persia-hybrid-training-a", 0.71), ("persia-hybrid-training-b", 0.72)):
        (root / name / "evaluate").mkdir(parents=True)
        out = json.dumps({"auc": auc})
        (root / name / "evaluate" / "executor_output.json").write_text(json.dumps({"parameterValues": {"Output": out}}))
    assert this_run(str(root), before, json.dumps({"auc": 0.71})) == str(root / "persia-hybrid-training-a")
    assert this_run(str(root), before, json.dumps({"auc": 0.72})) == str(root / "persia-hybrid-training-b")
    assert this_run(str(root), before, json.dumps({"auc": 0.9})) == ""
