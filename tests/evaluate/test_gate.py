"""The model gate: the decision rules, blessing with the marker written last, and dsl.If gating under kfp.local.

No ``from __future__ import annotations`` here: KFP reads the pipeline's annotations as types.
"""

import json
import os
import re

import pytest

from persia_core import io
from persia_core.evaluate.decision import DEFAULT_LR_MARGIN, DEFAULT_MAX_NE, decide
from persia_core.evaluate.gate import bless, read_baseline
from persia_core.model_store import BLESSED_MARKER, latest_blessed_model


def _fake_model(path, tag: str) -> str:
    """A folder that looks like a Model artifact (manifest.json + a shard file) whose bytes name ``tag``."""
    os.makedirs(os.path.join(path, "shards"), exist_ok=True)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump({"format": "persia-model/1", "tag": tag}, f)
    with open(os.path.join(path, "shards", "shard-00000.npz"), "wb") as f:
        f.write(tag.encode() * 100)
    return str(path)


BASE = {"auc": 0.75, "logloss": 0.50}


def test_gate_blesses_a_better_model_and_rejects_a_worse_one():
    better = decide({"auc": 0.76, "logloss": 0.49, "ne": 0.8}, BASE, min_auc=0.6, max_auc_drop=0.0)
    assert better["bless"] and better["decision"] == "bless"
    assert all(r.startswith("passed") for r in better["reasons"])
    worse_auc = decide({"auc": 0.74, "logloss": 0.49}, BASE, min_auc=0.6, max_auc_drop=0.0)
    assert not worse_auc["bless"] and worse_auc["decision"] == "reject"
    assert any("rejected: AUC 0.740000 < baseline AUC 0.750000" in r for r in worse_auc["reasons"])
    # within the allowed drop and logloss tolerance
    assert decide({"auc": 0.745, "logloss": 0.505}, BASE, 0.6, max_auc_drop=0.01, max_logloss_increase=0.01)["bless"]
    worse_ll = decide({"auc": 0.80, "logloss": 0.52}, BASE, 0.6, 0.0, max_logloss_increase=0.01)
    assert not worse_ll["bless"] and any("logloss 0.520000 >" in r for r in worse_ll["reasons"])


def test_gate_without_baseline_uses_the_threshold_and_never_blesses_undefined_auc():
    assert decide({"auc": 0.61, "logloss": 0.9}, None, min_auc=0.6, max_auc_drop=0.0)["bless"]
    low = decide({"auc": 0.59, "logloss": 0.1}, None, min_auc=0.6, max_auc_drop=0.0)
    assert not low["bless"] and "min_auc" in low["reasons"][0]
    undefined = decide({"auc": None, "logloss": 0.1}, None, min_auc=0.0, max_auc_drop=1.0)
    assert not undefined["bless"] and "undefined" in undefined["reasons"][0]
    with pytest.raises(ValueError, match="max_auc_drop"):
        decide({"auc": 0.7}, None, 0.5, -0.1)
    # AUC above the threshold but logloss no better than the base rate: never blessed, with or without a baseline
    for base in (None, {"auc": 0.5, "logloss": 0.9}):
        worse = decide(
            {"auc": 0.62, "logloss": 0.7, "ne": 1.006}, base, min_auc=0.5, max_auc_drop=0.0, max_logloss_increase=1.0
        )
        assert not worse["bless"] and any(
            "normalized entropy 1.006000 >= max_ne 1 (logloss no better than predicting the base rate)" in r
            for r in worse["reasons"]
        )
    passed = decide({"auc": 0.62, "logloss": 0.6, "ne": 0.95}, None, min_auc=0.5)
    assert passed["bless"] and "passed: normalized entropy 0.950000 < max_ne 1" in passed["reasons"]
    for ne in (None, float("nan")):  # one class in the eval split: said, not silently skipped
        assert any("normalized entropy undefined" in r for r in decide({"auc": 0.6, "ne": ne}, None)["reasons"])
    assert not decide({"auc": 0.62, "logloss": 0.6, "ne": 0.95}, None, min_auc=0.5, max_ne=0.9)["bless"]
    assert decide({"auc": 0.62, "logloss": 0.7, "ne": 1.006}, None, min_auc=0.5, max_ne=2.0)["bless"]  # opted out
    with pytest.raises(ValueError, match="max_ne"):
        decide({"auc": 0.7}, None, 0.5, max_ne=0.0)


def test_gate_bless_copies_the_model_and_writes_the_marker_last(tmp_path, monkeypatch):
    blessed = str(tmp_path / "blessed")
    assert read_baseline(blessed) is None and read_baseline("") is None and latest_blessed_model(blessed) is None
    m1 = _fake_model(tmp_path / "m1", "one")
    marker = bless(m1, {**BASE, "note": "x", "nested": {"dropped": 1}}, blessed)
    assert read_baseline(blessed) == {**BASE, "note": "x"}
    first = latest_blessed_model(blessed)
    assert first == os.path.join(blessed, marker["model"])
    assert open(os.path.join(first, "shards", "shard-00000.npz"), "rb").read() == b"one" * 100

    # a copy that dies half-way leaves the previous blessed model and its marker untouched
    m2 = _fake_model(tmp_path / "m2", "two")
    real_write = io.write_bytes
    calls = []

    def flaky(path, data):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        real_write(path, data)

    monkeypatch.setattr(io, "write_bytes", flaky)
    with pytest.raises(OSError, match="disk full"):
        bless(m2, {"auc": 0.9, "logloss": 0.3}, blessed)
    monkeypatch.setattr(io, "write_bytes", real_write)
    assert read_baseline(blessed) == {**BASE, "note": "x"} and latest_blessed_model(blessed) == first

    bless(m2, {"auc": 0.9, "logloss": 0.3}, blessed)
    second = latest_blessed_model(blessed)
    assert second != first and read_baseline(blessed)["auc"] == 0.9
    assert json.load(open(os.path.join(second, "manifest.json")))["tag"] == "two"
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        bless(str(tmp_path), BASE, blessed)


def test_bless_never_removes_a_version_another_run_is_blessing_at_the_same_time(tmp_path):
    """Versions older than the one the marker named before are removed; a newer one (another run copying its
    model right now) stays, so whichever marker lands last names a complete model."""
    import time

    blessed = str(tmp_path / "blessed")
    v1 = bless(_fake_model(tmp_path / "m1", "one"), BASE, blessed)["model"]
    time.sleep(1.1)  # versions are named by the second
    v2 = bless(_fake_model(tmp_path / "m2", "two"), BASE, blessed)["model"]
    models = os.path.join(blessed, "models")
    assert sorted(os.listdir(models)) == sorted([v1.split("/")[1], v2.split("/")[1]])  # the previous one is kept
    time.sleep(1.1)
    busy = os.path.join(models, "29991231T000000Z-ffffff")  # a concurrent run's copy in progress (no marker yet)
    os.makedirs(busy)
    open(os.path.join(busy, "partial"), "w").close()
    v3 = bless(_fake_model(tmp_path / "m3", "three"), BASE, blessed)["model"]
    left = sorted(os.listdir(models))
    assert v1.split("/")[1] not in left  # older than the one named before: removed
    assert v2.split("/")[1] in left and v3.split("/")[1] in left and os.path.basename(busy) in left


# --------------------------------------------------------------------------------------------- kfp.local


def _gated_pipeline():
    from kfp import dsl
    from kfp.dsl import Model

    from components.gate import bless_model, gate

    @dsl.pipeline(name="gate-test")
    def gated(model_path: str, metrics_json: str, blessed_dir: str, min_auc: float = 0.6) -> str:
        # kfp.local cannot take an artifact as a pipeline input: import the Model folder by path
        model = dsl.importer(artifact_uri=model_path, artifact_class=Model, reimport=False)
        g = gate(
            metrics_json=metrics_json,
            blessed_dir=blessed_dir,
            min_auc=min_auc,
            max_auc_drop=0.0,
            max_logloss_increase=0.01,
            max_ne=DEFAULT_MAX_NE,
            lr_margin=DEFAULT_LR_MARGIN,
        )
        with dsl.If(g.outputs["Output"] == "bless"):
            bless_model(model=model.output, metrics_json=metrics_json, blessed_dir=blessed_dir)
        return g.outputs["Output"]

    return gated


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_gate_under_kfp_local_blocks_a_worse_model_and_blesses_a_better_one(tmp_path):
    from kfp import local

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"), raise_on_error=True)
    gated = _gated_pipeline()
    blessed = str(tmp_path / "blessed")
    bless(_fake_model(tmp_path / "m0", "zero"), BASE, blessed)  # yesterday's model
    before = open(os.path.join(blessed, BLESSED_MARKER)).read()

    worse = _fake_model(tmp_path / "worse", "worse")
    run = gated(model_path=worse, metrics_json=json.dumps({"auc": 0.70, "logloss": 0.55}), blessed_dir=blessed)
    assert run.output == "reject"
    assert open(os.path.join(blessed, BLESSED_MARKER)).read() == before
    assert json.load(open(os.path.join(latest_blessed_model(blessed), "manifest.json")))["tag"] == "zero"

    better = _fake_model(tmp_path / "better", "better")
    run = gated(model_path=better, metrics_json=json.dumps({"auc": 0.80, "logloss": 0.45}), blessed_dir=blessed)
    assert run.output == "bless"
    assert read_baseline(blessed) == {"auc": 0.80, "logloss": 0.45}
    copy = latest_blessed_model(blessed)
    assert json.load(open(os.path.join(copy, "manifest.json")))["tag"] == "better"
    assert open(os.path.join(copy, "shards", "shard-00000.npz"), "rb").read() == b"better" * 100

    # the gate component wrote its decision as Markdown
    md = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "root") for f in fs if f == "decision"]
    texts = sorted(open(p).read() for p in md)
    assert any("**bless**" in t for t in texts) and any("**reject**" in t for t in texts)


@pytest.mark.processes
def test_the_gate_compares_with_the_blessed_model_re_scored_on_the_same_evaluation_rows(tmp_path, trained):
    # The metrics stored at blessing came from that day's evaluation split. Here they are far better than what the
    # blessed model scores on today's rows (another day's easier data): compared with them, the same model would
    # be rejected; re-scored on today's rows, the same model ties with itself and passes.
    from persia_core.evaluate.gate import RESCORED_KEY, gate, rescore_baseline
    from persia_core.evaluate.run import evaluate
    from persia_core.model_store import read_marker

    model, data = trained
    blessed = str(tmp_path / "blessed")
    bless(model, {"auc": 0.99, "logloss": 0.05, "ne": 0.1, "count": 10}, blessed)
    new = evaluate(model, data, user_slot="")["metrics"]
    stale = gate(new, blessed, max_ne=2.0, lr_margin=1.0)  # a tiny model: NE and LR not what this test is about
    assert stale["decision"] == "reject" and "stored when the latest blessed model was blessed" in stale["reasons"][-1]

    base = rescore_baseline(blessed, data)
    assert base["source"] == "re-scored" and base["auc"] == new["auc"] and base["logloss"] == new["logloss"]
    d = gate({**new, RESCORED_KEY: base}, blessed, max_ne=2.0, lr_margin=1.0)
    assert d["decision"] == "bless", d["reasons"]
    assert d["baseline"]["auc"] == new["auc"]
    assert d["reasons"][-1] == (
        f"baseline: the latest blessed model re-scored on this evaluation data ({new['count']} rows)"
    )
    # the re-scored baseline never ends up in the next marker's stored metrics
    bless(model, {**new, RESCORED_KEY: base}, blessed)
    assert RESCORED_KEY not in read_marker(blessed)["metrics"]
    # that bless made another model the latest: the baseline re-scored before it is stale and not used
    late = gate({**new, RESCORED_KEY: base}, blessed, max_ne=2.0, lr_margin=1.0)
    assert late["baseline_source"].startswith("the metrics stored") and "model" not in late["baseline"]


@pytest.mark.processes
def test_a_blessed_model_that_cannot_score_the_new_data_falls_back_to_its_stored_metrics(tmp_path, trained):
    import shutil

    import pyarrow.parquet as pq

    from persia_core.evaluate.gate import gate, rescore_baseline

    model, data = trained
    blessed = str(tmp_path / "blessed")
    assert rescore_baseline(blessed, data) is None and rescore_baseline("", data) is None  # nothing blessed
    bless(model, BASE, blessed)
    # today's evaluation rows lack one of the model's slots: the model loads but cannot score them
    other = str(tmp_path / "other-data")
    shutil.copytree(data, other)
    for d, _, files in os.walk(os.path.join(other, "eval")):
        for f in files:
            if f.endswith(".parquet"):
                t = pq.read_table(os.path.join(d, f))
                pq.write_table(t.drop_columns(["slot_b"]), os.path.join(d, f))
    assert rescore_baseline(blessed, other) is None
    d = gate({"auc": 0.76, "logloss": 0.49, "ne": 0.8}, blessed)
    assert d["decision"] == "bless" and d["baseline"] == BASE
    assert "stored when the latest blessed model was blessed" in d["baseline_source"]


@pytest.mark.processes
@pytest.mark.parametrize("damage", ["dense", "shard", "no config"])
def test_a_blessed_model_that_cannot_be_loaded_is_replaced_by_a_sound_new_model(tmp_path, trained, damage):
    # before: the gate fell back to the broken model's stored metrics and kept it (its files unusable by any warm
    # start) against a sound new model that scored a little lower on another day's rows; the reason was only in
    # kfp.local's log
    from persia_core.evaluate.gate import RESCORED_KEY, UNLOADABLE, evaluate_gate, gate, rescore_baseline

    model, data = trained
    blessed = str(tmp_path / "blessed")
    if damage == "no config":
        marker = bless(_fake_model(tmp_path / "m", "old format"), BASE, blessed)
        expect = r"ValueError: .*manifest\.json: a model manifest needs \['config'"
    else:
        marker = bless(model, BASE, blessed)
        folder = os.path.join(blessed, marker["model"])
        if damage == "dense":
            with open(os.path.join(folder, "dense.pt"), "wb") as f:
                f.write(b"not a torch file" * 100)
            expect = r"dense\.pt: not a readable dense-model file"
        else:
            path = os.path.join(folder, "shards", "shard-00001.npz")
            raw = bytearray(open(path, "rb").read())
            raw[len(raw) // 2] ^= 0xFF
            open(path, "wb").write(bytes(raw))
            expect = r"ShardFileError: .*shard-00001\.npz"
    base = rescore_baseline(blessed, data)
    assert base["source"] == UNLOADABLE and base["model"] == marker["model"]
    assert re.search(expect, base["error"]), base["error"]
    # below the stored AUC (0.75), above min_auc: blessed, and the reason says why no baseline was used
    new = {"auc": 0.74, "logloss": 0.51, "ne": 0.8}
    d = gate({**new, RESCORED_KEY: base}, blessed)
    assert d["decision"] == "bless" and d["baseline"] is None, d["reasons"]
    assert any(
        r.startswith(f"baseline: none: the latest blessed model {marker['model']} cannot be loaded")
        for r in d["reasons"]
    )
    assert gate(new, blessed)["decision"] == "reject"  # without the re-score: the stored metrics, as before
    assert not gate({"auc": 0.4, "logloss": 0.51, "ne": 0.8, RESCORED_KEY: base}, blessed, min_auc=0.5)["bless"]
    decision, carried = evaluate_gate(new, blessed, data)
    assert decision["decision"] == "bless" and carried[RESCORED_KEY]["source"] == UNLOADABLE
    json.dumps(carried)  # handed to the gate step as JSON
