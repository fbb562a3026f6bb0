"""Multi-process training: a killed parameter server fails fast; a retry resumes exactly; warm start carries on.

One uninterrupted reference run (module fixture) serves the resume comparison and is the previous model of the
warm start; one run has a parameter server SIGKILLed after its second checkpoint."""

import json
import os
import re
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support import tiny_config, write_dataset

from persia_core.checkpoints import CheckpointSettings, list_checkpoints
from persia_core.data.reader import ParquetExamples, shard_files
from persia_core.embedding.layout import prepare_ids
from persia_core.embedding.plan import init_shards
from persia_core.embedding.pooling import pool
from persia_core.embedding.shard_tables import load_shard_file, make_tables
from persia_core.embedding.warm_start import WarmStartError
from persia_core.evaluate.run import LoadedModel
from persia_core.model_store import shard_file_name
from persia_core.train.launcher import train
from persia_core.train.local_cluster import TrainingFailed
from persia_core.train.schedule import make_schedule

EPOCHS = 20  # 2 workers x 96 rows / batch 16 = 6 steps per epoch: 120 steps
SETTINGS = CheckpointSettings(every_steps=20, keep=3)


def _config(**over):
    """2 NN workers of 2 embedding workers each: resume is exact whatever E is."""
    return tiny_config(num_workers=2, embedding_staleness=0, epochs=EPOCHS, shuffle=True, embedding_workers=2, **over)


def _children(marker: str) -> list[int]:
    """Pids of live processes whose command line contains ``marker`` (our work folder)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            out.append(int(pid))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    data = write_dataset(str(root / "data"), rows=192)
    ref = str(root / "reference")
    train(_config(), data, ref, work_dir=str(root / "reference-work"), checkpoint=SETTINGS)
    # the run that dies: slowed down by an injected network delay, which does not change the arithmetic
    killed = str(root / "killed")
    work = str(root / "killed-work")
    box = {}

    def kill_after_second_checkpoint():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            done = [
                p
                for _, p in list_checkpoints(os.path.join(killed, "checkpoints"))
                if os.path.exists(os.path.join(p, "manifest.json"))
            ]
            if len(done) >= 2:
                box["pids"] = _children(work)
                (pid,) = _children(os.path.join(work, "ps-1.port"))  # the server of shard 1
                box["killed_at"] = time.monotonic()
                os.kill(pid, 9)
                return
            time.sleep(0.005)

    killer = threading.Thread(target=kill_after_second_checkpoint)
    killer.start()
    try:
        train(_config(network_delay_s=0.004), data, killed, work_dir=work, checkpoint=SETTINGS)
        box["error"] = None
    except TrainingFailed as e:
        box["error"] = e
    box["raised_at"] = time.monotonic()
    killer.join()
    box["left"] = _children(work)
    return {"root": root, "data": data, "reference": ref, "killed": killed, "killed_run": box}


@pytest.mark.processes
def test_killed_parameter_server_fails_the_step_within_60s_naming_it_and_leaves_no_process(runs):
    box = runs["killed_run"]
    assert box["error"] is not None, "training finished before the parameter server was killed"
    msg = str(box["error"])
    assert "ps-1" in msg and "SIGKILL" in msg and "last log lines" in msg
    assert box["raised_at"] - box["killed_at"] < 60
    assert len(box["pids"]) == 4  # 2 servers + 2 NN workers were running
    assert box["left"] == [], f"processes left running: {box['left']}"


def _rows(model_dir: str, cfg) -> dict:
    out = {}
    manifest = json.load(open(os.path.join(model_dir, "manifest.json")))
    for rel in manifest["shard_files"]:
        tables = make_tables(cfg.embedding.tables, cfg.embedding.shard_memory_bytes)
        load_shard_file(os.path.join(model_dir, rel), tables)
        sd = tables["default"].state_dict()
        out.update({int(k): (w, a) for k, w, a in zip(sd["keys"], sd["weights"], sd["acc"], strict=True)})
    return out


@pytest.mark.processes
def test_resume_after_the_kill_skips_a_corrupt_checkpoint_and_ends_as_the_uninterrupted_run(runs):
    killed, ref = runs["killed"], runs["reference"]
    done = [
        p
        for _, p in list_checkpoints(os.path.join(killed, "checkpoints"))
        if os.path.exists(os.path.join(p, "manifest.json"))
    ]
    newest, previous = done[0], done[1]
    shard = os.path.join(newest, "shards", "shard-00000.npz")  # same size, one bit flipped
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    manifest = train(_config(), runs["data"], killed, work_dir=str(runs["root"] / "resume-work"), checkpoint=SETTINGS)
    assert manifest["resumed_from"] == previous
    assert any("CRC-32C" in r for r in manifest["checkpoints_refused"])
    a = json.load(open(os.path.join(ref, "train_metrics.json")))
    b = json.load(open(os.path.join(killed, "train_metrics.json")))
    assert b["resumed_from_step"] == int(previous.rsplit("-", 1)[1]) > 0
    assert a["step"] == b["step"] == list(range(6 * EPOCHS))  # the same samples, step by step
    assert a["samples"] == b["samples"]
    np.testing.assert_allclose(b["loss"], a["loss"], atol=1e-6, rtol=0)
    da = torch.load(os.path.join(ref, "dense.pt"), weights_only=True)
    db = torch.load(os.path.join(killed, "dense.pt"), weights_only=True)
    for k in da:
        np.testing.assert_allclose(db[k].numpy(), da[k].numpy(), atol=1e-6, rtol=0)
    cfg = _config()
    ra, rb = _rows(ref, cfg), _rows(killed, cfg)
    assert ra.keys() == rb.keys()
    for k, (w, acc) in ra.items():
        np.testing.assert_allclose(rb[k][0], w, atol=1e-6, rtol=0)
        np.testing.assert_allclose(rb[k][1], acc, atol=1e-6, rtol=0)


@pytest.mark.processes
def test_warm_start_from_the_previous_model_continues_its_loss_and_refuses_a_changed_config(runs):
    root, data, previous = runs["root"], runs["data"], runs["reference"]
    cfg = tiny_config(num_workers=1, embedding_staleness=0, epochs=1, shuffle=True)
    cfg = cfg.with_overrides({"embedding.num_shards": 3})  # re-sharded 2 -> 3 on the way
    from persia_core.config import RunConfig

    def changed(edit) -> RunConfig:
        d = cfg.to_dict()
        edit(d)
        return RunConfig.from_dict(d)

    for edit, expected in (
        (lambda d: d["embedding"]["tables"][0].update(dim=8), r"dim: 4 -> 8"),
        (
            lambda d: d["embedding"]["tables"][0]["optimizer"].update(name="adam"),
            r"optimizer.name: 'rowwise_adagrad' -> 'adam'",
        ),
        (lambda d: d.update(slots=d["slots"][:2]), r"slots: \['a', 'b', 'tags'\] -> \['a', 'b'\]"),
    ):
        with pytest.raises(WarmStartError, match=expected):
            init_shards(changed(edit), data, str(root / "refused"), warm_start_from=previous)
    shards = str(root / "warm-shards")
    plan = init_shards(cfg, data, shards, warm_start_from=previous)
    assert plan["warm_start"]["previous_num_shards"] == 2 and plan["warm_start"]["dropped_rows"] == {"default": 0}
    model = str(root / "warm-model")
    train(cfg, data, model, init_dir=shards, work_dir=str(root / "warm-work"))
    first_loss = json.load(open(os.path.join(model, "train_metrics.json")))["loss"][0]
    expected = _previous_models_first_batch_loss(previous, data, cfg)
    assert abs(first_loss - expected) < 1e-6, (first_loss, expected)
    assert abs(first_loss - np.log(2)) > 0.01  # not a fresh model's loss


def _previous_models_first_batch_loss(previous: str, data: str, cfg) -> float:
    """The previous final model's loss on the first batch of a new one-worker run of ``cfg``."""
    prev = LoadedModel(previous)
    examples = ParquetExamples(shard_files(data, "train"), prev.slots)
    rows = make_schedule([len(examples)], cfg.trainer.batch_size, 1, cfg.trainer.seed, True).rows[0][0]
    batch = examples.batch(rows)
    with torch.no_grad():
        prep = prepare_ids(batch.ids, prev.layouts)
        uniq = prep["default"].uniq
        assert prev.embedding.contains("default", uniq).all()  # every ID of the batch has a row: no init involved
        rows_of = torch.from_numpy(prev.embedding.lookup_readonly("default", uniq))
        emb = pool(rows_of, prep["default"], 3, batch.size)
        logits = prev.dense(emb, torch.from_numpy(batch.dense))
        return float(F.binary_cross_entropy_with_logits(logits, torch.from_numpy(batch.labels)))


@pytest.mark.processes
def test_a_wide_table_added_since_the_previous_model_starts_cold_while_the_rest_warm_starts(runs):
    root, data, previous = runs["root"], runs["data"], runs["reference"]
    d = tiny_config(num_workers=1, embedding_staleness=0, epochs=1, shuffle=True).to_dict()
    d["model"]["wide"] = True
    from persia_core.config import RunConfig

    cfg = RunConfig.from_dict(d)
    shards = str(root / "wide-shards")
    plan = init_shards(cfg, data, shards, warm_start_from=previous)
    assert plan["warm_start"]["cold_tables"] == ["wide"] and plan["warm_start"]["rows"]["default"] > 0
    assert "wide" not in plan["warm_start"]["rows"]
    d["model"]["kind"] = "lr"  # the dense model changed: still refused
    with pytest.raises(WarmStartError, match=r"model.kind: 'dnn' -> 'lr'"):
        init_shards(RunConfig.from_dict(d), data, str(root / "wide-refused"), warm_start_from=previous)
    model = str(root / "wide-model")
    train(cfg, data, model, init_dir=shards, work_dir=str(root / "wide-work"))
    # the wide rows start at 0: the first batch's loss is the previous model's, to float32 rounding
    first_loss = json.load(open(os.path.join(model, "train_metrics.json")))["loss"][0]
    expected = _previous_models_first_batch_loss(previous, data, cfg)
    assert abs(first_loss - expected) < 1e-6, (first_loss, expected)
    held = LoadedModel(model).embedding.state_dicts()
    assert sum(len(t["wide"]["keys"]) for t in held) > 0 and any(np.abs(t["wide"]["weights"]).max() > 0 for t in held)


@pytest.mark.processes
def test_starting_afresh_over_an_earlier_runs_checkpoints_is_refused_before_anything_starts(runs, tmp_path):
    # before: the new run's checkpoints (lower steps) were pruned as soon as written, and a retry resumed the
    # earlier run's, beyond the new run's last step
    import shutil

    model = tmp_path / "model"
    shutil.copytree(os.path.join(runs["reference"], "checkpoints"), model / "checkpoints")
    with pytest.raises(ValueError, match=r"resume_from '': .*holds checkpoints of an earlier run \(ckpt-"):
        train(_config(), runs["data"], str(model), work_dir=str(tmp_path / "work"), checkpoint=SETTINGS, resume_from="")
    assert not (model / "manifest.json").exists() and not (tmp_path / "work").exists()


@pytest.mark.processes
def test_a_warm_start_from_a_checkpoint_makes_the_checks_a_resume_makes(runs, tmp_path):
    # before: a manifest that had lost a shard entry (its CRC recomputed) warm-started from half the rows
    import shutil

    from persia_core import checkpoints as ckpt

    newest = [p for _, p in list_checkpoints(os.path.join(runs["reference"], "checkpoints"))][0]
    copy = str(tmp_path / os.path.basename(newest))
    shutil.copytree(newest, copy)
    cfg = tiny_config(num_workers=1, embedding_staleness=0, epochs=1, shuffle=True)
    plan = init_shards(cfg, runs["data"], str(tmp_path / "ok"), warm_start_from=copy)  # a sound one is taken
    assert plan["warm_start"]["previous_num_shards"] == 2
    mpath = os.path.join(copy, ckpt.MANIFEST)
    manifest = json.load(open(mpath))
    manifest["files"] = [e for e in manifest["files"] if e["path"] != shard_file_name(1)]
    manifest["manifest_crc32c"] = ckpt.manifest_crc(manifest)
    json.dump(manifest, open(mpath, "w"))
    with pytest.raises(WarmStartError, match=r"refused: .*lists no shards/shard-00001\.npz"):
        init_shards(cfg, runs["data"], str(tmp_path / "refused"), warm_start_from=copy)


@pytest.mark.processes
def test_a_model_whose_dense_file_is_corrupt_is_refused_naming_that_file(runs, tmp_path):
    # before: a warm start or an evaluation of such a model stopped with torch's own message (which names no file)
    import shutil

    model = str(tmp_path / "model")
    shutil.copytree(runs["reference"], model, ignore=shutil.ignore_patterns("checkpoints"))
    manifest = json.load(open(os.path.join(model, "manifest.json")))
    dense = os.path.join(model, manifest["dense_file"])
    data = open(dense, "rb").read()
    open(dense, "wb").write(data[: len(data) // 2])  # truncated, as by a copy cut short
    cfg = tiny_config(num_workers=1, embedding_staleness=0, epochs=1, shuffle=True)
    with pytest.raises(
        WarmStartError,
        match=rf"dense weights .*{manifest['dense_file']} cannot be read: .*not a readable dense-model "
        rf"file \({len(data) // 2} bytes",
    ):
        init_shards(cfg, runs["data"], str(tmp_path / "refused"), warm_start_from=model)
    with pytest.raises(ValueError, match=rf"{manifest['dense_file']}: not a readable dense-model file"):
        LoadedModel(model)


@pytest.mark.processes
def test_a_corrupt_newest_checkpoint_refused_while_re_sharding_it_falls_back_to_the_previous_one(runs, tmp_path):
    # before: with another shard count, the re-shard read the flipped shard file, raised, and the run failed (exit
    # 2) though the previous checkpoint was sound
    import shutil

    src = os.path.join(runs["reference"], "checkpoints")
    folder = str(tmp_path / "checkpoints")
    shutil.copytree(src, folder)
    newest, previous = [p for _, p in list_checkpoints(folder)][:2]
    shard = os.path.join(newest, "shards", "shard-00000.npz")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    cfg = _config().with_overrides({"embedding.num_shards": 3})
    settings = CheckpointSettings(dir=folder, every_steps=20, keep=3)
    manifest = train(cfg, runs["data"], str(tmp_path / "model"), work_dir=str(tmp_path / "work"), checkpoint=settings)
    assert manifest["resumed_from"] == previous
    assert any("CRC-32C" in r or "crc" in r.lower() for r in manifest["checkpoints_refused"])


def _signal_once_training(model: str, work: str, role: str, sig: int, box: dict) -> threading.Thread:
    """A started thread that sends ``sig`` to ``role`` (``ps-1`` or ``nn_worker-1``) of the run in ``work`` once its
    first checkpoint exists, noting when in ``box["signalled_at"]``."""

    def run():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if list_checkpoints(os.path.join(model, "checkpoints")):
                if role == "ps-1":
                    (pid,) = _children(os.path.join(work, "ps-1.port"))  # the server of shard 1
                else:
                    (pid,) = [
                        p
                        for p in _children(work)
                        if b"RANK=1" in open(f"/proc/{p}/environ", "rb").read()
                        and b"persia_core.train.worker" in open(f"/proc/{p}/cmdline", "rb").read()
                    ]
                box["signalled_at"] = time.monotonic()
                os.kill(pid, sig)
                return
            time.sleep(0.005)

    th = threading.Thread(target=run)
    th.start()
    return th


@pytest.mark.processes
def test_killed_nn_worker_fails_the_step_and_its_peer_blocked_on_it_is_stopped_too(runs):
    root = runs["root"]
    model, work = str(root / "worker-killed"), str(root / "worker-killed-work")
    box = {}
    killer = _signal_once_training(model, work, "nn_worker-1", 9, box)
    with pytest.raises(TrainingFailed, match=r"nn_worker-1 \(pid \d+\) was killed by SIGKILL") as err:
        train(_config(network_delay_s=0.004), runs["data"], model, work_dir=work, checkpoint=SETTINGS)
    raised_at = time.monotonic()
    killer.join()
    assert "last log lines" in str(err.value)
    assert f"all logs kept in {os.path.join(work, 'logs')}" in str(err.value)  # where to look, named
    assert raised_at - box["signalled_at"] < 60
    assert _children(work) == []


@pytest.mark.processes
@pytest.mark.parametrize("role", ["ps-1", "nn_worker-1"])
def test_a_stopped_child_fails_the_job_after_the_stopped_limit_naming_it_and_leaves_no_process(runs, role, monkeypatch):
    # SIGSTOP: alive but frozen. Its peers would wait on it for the gloo timeout (a worker) or minutes of RPC
    # retries (a server); the launcher sees the stopped state and fails the job after STOPPED_FAIL_S.
    import signal

    from persia_core.train import local_cluster

    monkeypatch.setattr(local_cluster, "STOPPED_FAIL_S", 3.0)
    root = runs["root"]
    model, work = str(root / f"stopped-{role}"), str(root / f"stopped-{role}-work")
    box = {}
    stopper = _signal_once_training(model, work, role, signal.SIGSTOP, box)
    with pytest.raises(TrainingFailed, match=rf"{role} \(pid \d+\) has been stopped") as err:
        train(_config(network_delay_s=0.004), runs["data"], model, work_dir=work, checkpoint=SETTINGS)
    raised_at = time.monotonic()
    stopper.join()
    assert "signalled_at" in box, "training finished before the child was stopped"
    assert "last log lines" in str(err.value)
    assert 3.0 <= raised_at - box["signalled_at"] < 30
    deadline = time.monotonic() + 10
    while _children(work) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _children(work) == []


def test_warm_start_from_a_blessed_location_before_its_first_model_is_a_cold_start(tmp_path):
    """Day one of a daily schedule: warm_start_from names the blessed-model location, which does not exist yet
    (or is empty): a cold start. A location holding files but no model is still refused."""
    from persia_core.embedding.warm_start import resolve_warm_start

    assert resolve_warm_start(str(tmp_path / "blessed" / "criteo")) == ""
    (tmp_path / "empty").mkdir()
    assert resolve_warm_start(str(tmp_path / "empty")) == ""
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="not a Model artifact"):
        resolve_warm_start(str(tmp_path / "junk"))


@pytest.mark.processes
@pytest.mark.parametrize("storage", ["fp16", "bf16"])
def test_a_warm_start_into_another_storage_precision_converts_the_rows_at_init_shards(runs, tmp_path, storage):
    # before: init-shards copied the fp32 rows as they were and train's servers refused them, a step late
    from persia_core.embedding.precision import decode, encode
    from persia_core.embedding.shard_file import read_shard_file

    previous = runs["reference"]
    cfg = tiny_config(num_workers=1, embedding_staleness=0, epochs=1).with_overrides({"embedding.storage": storage})
    shards = tmp_path / "shards"
    init_shards(cfg, runs["data"], str(shards), warm_start_from=previous)
    old = {}
    for s in range(2):
        t = read_shard_file(os.path.join(previous, shard_file_name(s)), build_index=False).tables["default"]
        n = t.meta["rows"]
        old.update(zip(t.arrays["keys"][:n].tolist(), t.arrays["weights"][:n], strict=True))
    got = {}
    for s in range(cfg.embedding.num_shards):
        tables = make_tables(cfg.embedding.tables, cfg.embedding.shard_memory_bytes, storage=storage)
        load_shard_file(str(shards / shard_file_name(s)), tables)  # a server's load: refused before the fix
        sd = tables["default"].state_dict()
        got.update(zip(sd["keys"].tolist(), decode(sd["weights"], storage), strict=True))
    assert got.keys() == old.keys() and len(got) > 10
    keys = sorted(got)
    want = decode(encode(np.stack([old[k] for k in keys]), storage), storage)  # the target precision's rounding
    np.testing.assert_array_equal(np.stack([got[k] for k in keys]), want)


@pytest.mark.processes
def test_a_full_disk_while_checkpointing_fails_the_step_naming_the_role_and_the_file_on_its_first_line(tmp_path):
    # issue 20, case 10: before, "nn_worker-0 exited with code 1" and a raw traceback, the path not named
    import subprocess

    small = tmp_path / "small"
    small.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(small)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill here (needs root): {r.stderr.strip()}")
    try:
        data = write_dataset(str(tmp_path / "data"), rows=64)
        settings = CheckpointSettings(dir=str(small / "ckpt"), every_steps=1, keep=2)
        with pytest.raises(TrainingFailed) as e:
            train(tiny_config(), data, str(tmp_path / "model"), work_dir=str(tmp_path / "work"), checkpoint=settings)
        first = str(e.value).splitlines()[0]
        assert re.search(r"^(nn_worker|ps)-\d .*No space left on device", first), first
        assert str(small / "ckpt") in first, first
    finally:
        subprocess.run(["umount", str(small)], check=True)
