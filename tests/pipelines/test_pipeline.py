"""The compiled pipeline, and a kfp.local run of the whole pipeline on a tiny subset of the bundled data."""

import json
import os

import pytest
import yaml
from kfp import components

from pipelines.persia_pipeline import compile_pipeline
from pipelines.run_local import main as run_local

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
        tasks["train"]["dependentTasks"]) == {"init-shards", "preprocess"}
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert params["data"]["defaultValue"] == "data/movielens"
    assert params["num_parameter_servers"]["defaultValue"] == 2


@pytest.mark.timeout(180)
def test_kfp_local_runs_the_whole_pipeline_on_a_tiny_subset(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    rc = run_local(["--data", os.path.join(ROOT, "data/movielens"), "--pipeline-root", str(tmp_path / "out"),
                    "--max-rows", "3000", "--epochs", "1", "--parameter-servers", "2", "--nn-workers", "2"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("eval: AUC=")
    auc = float(lines[-1].split("AUC=")[1].split()[0])
    assert 0.0 < auc < 1.0
    found = {}
    for d, _, files in os.walk(tmp_path / "out"):
        for f in files:
            found.setdefault(f, []).append(os.path.join(d, f))
    assert "manifest.json" in found and "schema.json" in found and "shard_plan.json" in found
    manifest = json.load(open(found["manifest.json"][0]))
    assert manifest["num_shards"] == 2 and len(manifest["shard_files"]) == 2
    reports = [p for d, _, fs in os.walk(tmp_path / "out") for p in [os.path.join(d, f) for f in fs]
               if os.path.basename(os.path.dirname(p)) == "evaluate" or p.endswith("report")]
    assert any("<img" in open(p, errors="ignore").read() for p in reports if os.path.isfile(p))
