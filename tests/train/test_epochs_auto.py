"""``epochs: auto``: the validation slice, early stopping on its logloss, and the best epoch's model kept exactly."""

import json
import os
import threading
import time

import numpy as np
import pytest
import torch
from support import tiny_config, write_dataset

from persia_core.config import RunConfig
from persia_core.data.reader import read_ts, shard_files, validation_cutoff
from persia_core.embedding.delta import apply_deltas, list_deltas, load_with_deltas, superseded_deltas
from persia_core.embedding.shard_file import read_shard_file
from persia_core.embedding.shard_tables import load_shard_file, lru_state_dict, make_tables
from persia_core.evaluate.run import LoadedModel, score
from persia_core.train.embedding_worker import rank_split
from persia_core.train.launcher import train
from persia_core.train.validation import Z_CAP, EarlyStopping, paired_worse_z


def _auto(max_epochs: int, **over) -> RunConfig:
    d = tiny_config(embedding_staleness=0, shuffle=True, embedding_workers=2).to_dict()
    d["trainer"].update(epochs="auto", max_epochs=max_epochs, patience=2, validation_fraction=0.25, dense_lr=0.005)
    d["trainer"]["patience_z"] = 0.0  # patience alone (test_patience_z_... turns it on)
    d["embedding"]["tables"][0]["optimizer"]["lr"] = 0.05  # fast to fit, fast to overfit: a curve that turns
    d["model"]["wide"] = True
    for k, v in over.items():
        d["trainer"][k] = v
    return RunConfig.from_dict(d)


def test_epochs_takes_auto_and_refuses_other_words():
    assert _auto(5).trainer.scheduled_epochs == 5 and _auto(5).trainer.auto_epochs
    assert tiny_config(epochs=3).trainer.scheduled_epochs == 3 and not tiny_config(epochs=3).trainer.auto_epochs
    with pytest.raises(ValueError, match=r"trainer.epochs.*'auto', got 'often'"):
        tiny_config(epochs="often")
    with pytest.raises(ValueError, match=r"trainer.epochs.*>= 1"):
        tiny_config(epochs=0)
    with pytest.raises(ValueError, match=r"trainer.validation_fraction"):
        _auto(5, validation_fraction=0.0)


def test_the_validation_slice_is_the_latest_rows_of_the_train_split(tmp_path):
    data = write_dataset(str(tmp_path / "d"), rows=200)  # ts = row number: the slice is the last rows by order
    ts = read_ts(shard_files(data, "train"))
    cut = validation_cutoff(data, 0.1)
    assert (ts > cut).sum() == 20 and ts[ts > cut].min() > ts[ts <= cut].max()
    with pytest.raises(ValueError, match="too few"):
        validation_cutoff(write_dataset(str(tmp_path / "one"), rows=1, shards=1), 0.5)


def test_early_stopping_keeps_the_lowest_logloss_and_stops_after_patience_epochs_without_one():
    s = EarlyStopping(patience=2)
    assert [s.update(e, 10 * e, v, 5) for e, v in enumerate([0.6, 0.5, 0.55, 0.5, 0.7], 1)] == [
        True,
        True,
        False,
        False,
        False,
    ]
    assert (s.best_epoch, s.best_step, s.best_logloss, s.stopped) == (2, 20, 0.5, True)  # a tie is not better
    assert EarlyStopping.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_early_stopping_stops_at_once_when_an_epoch_is_patience_z_standard_errors_worse():
    s = EarlyStopping(patience=3, patience_z=3.0)
    # epoch 3: a bump within the noise (z 1.5) goes on; epoch 5: a fall of 4 standard errors stops at once,
    # two epochs before patience would
    for e, v, z in [(1, 0.6, None), (2, 0.5, -9.0), (3, 0.51, 1.5), (4, 0.49, -2.0)]:
        s.update(e, 10 * e, v, 5, z)
        assert not s.stopped and s.stop_reason == ""
    assert not s.update(5, 50, 0.52, 5, 4.0) and s.stopped and s.best_epoch == 4
    assert s.stop_reason == "4.0 standard errors worse than the best (patience_z 3)"
    assert [h.get("worse_z") for h in s.history] == [None, -9.0, 1.5, -2.0, 4.0]
    assert EarlyStopping.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    off = EarlyStopping(patience=3)  # patience_z 0: patience alone, however far the fall
    for e, v, z in [(1, 0.5, None), (2, 0.9, Z_CAP), (3, 0.9, Z_CAP)]:
        off.update(e, e, v, 5, z)
        assert not off.stopped
    off.update(4, 4, 0.9, 5, Z_CAP)
    assert off.stopped and off.stop_reason == "3 epochs without a better one"
    with pytest.raises(ValueError, match=r"trainer.patience_z.*>= 0"):
        _auto(5, patience_z=-1.0)
    with pytest.raises(ValueError, match=r"trainer.patience_z"):
        _auto(5, patience_z=float("nan"))


def test_paired_worse_z_is_the_paired_t_statistic_of_the_rows_loglosses():
    from scipy.stats import ttest_rel

    rng = np.random.default_rng(0)
    best = rng.exponential(0.5, 3000).astype(np.float32)
    for shift, noise in [(0.01, 0.2), (-0.003, 0.05), (0.0005, 0.3)]:
        now = (best + shift + rng.normal(0, noise, best.shape)).astype(np.float32)
        ref = ttest_rel(now.astype(np.float64), best.astype(np.float64)).statistic  # float64, scipy
        got = paired_worse_z(now, best, 1, torch.device("cpu"))
        assert got == pytest.approx(ref, rel=1e-9) and np.sign(got) == np.sign(now.mean() - best.mean()), (got, ref)
    assert paired_worse_z(best + np.float32(0.25), best, 1, torch.device("cpu")) == Z_CAP  # every row worse alike
    assert paired_worse_z(best - np.float32(0.25), best, 1, torch.device("cpu")) == -Z_CAP
    assert paired_worse_z(best.copy(), best, 1, torch.device("cpu")) == 0.0
    with pytest.raises(ValueError, match="2999 rows against the best epoch's 3000"):
        paired_worse_z(best[1:], best, 1, torch.device("cpu"))


def _tables(cfg: RunConfig, model: str, manifest: dict) -> dict:
    out = {}
    for rel in manifest["shard_files"]:
        tables = make_tables(cfg.embedding.tables, cfg.embedding.shard_memory_bytes)
        load_shard_file(os.path.join(model, rel), tables)
        for name, t in tables.items():
            sd = t.state_dict()
            order = np.argsort(sd["keys"])
            for k, v in sd.items():
                if k != "last_used":  # recency: later epochs' lookups touched the rows
                    out.setdefault(name, {}).setdefault(k, []).append(v[order])
    return {n: {k: np.concatenate(v) for k, v in d.items()} for n, d in out.items()}


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto")
    data = write_dataset(str(root / "data"), rows=256)
    cfg = _auto(8)
    model = str(root / "model")
    manifest = train(cfg, data, model, work_dir=str(root / "work"))
    return {"root": root, "data": data, "cfg": cfg, "model": model, "manifest": manifest}


def _same_model(cfg: RunConfig, a: str, a_manifest: dict, b: str, b_manifest: dict) -> None:
    """Every table's keys, weights and optimizer state, and the dense weights, bit for bit."""
    got, ref = _tables(cfg, a, a_manifest), _tables(cfg, b, b_manifest)
    assert set(got) == set(ref) == {"default", "wide"}
    for name in got:
        for k in ref[name]:
            np.testing.assert_array_equal(got[name][k], ref[name][k], err_msg=f"{name}.{k}")
    da = torch.load(os.path.join(a, "dense.pt"), weights_only=True)
    db = torch.load(os.path.join(b, "dense.pt"), weights_only=True)
    for k in db:
        assert torch.equal(da[k], db[k]), k


@pytest.mark.processes
def test_auto_keeps_the_epoch_of_the_best_validation_logloss_and_restores_its_model_exactly(auto_run):
    root, data, cfg, model = auto_run["root"], auto_run["data"], auto_run["cfg"], auto_run["model"]
    hist = json.load(open(os.path.join(model, "train_metrics.json")))
    curve = [v["logloss"] for v in hist["validation"]]
    best = int(np.argmin(curve)) + 1
    assert hist["best_epoch"] == best and hist["stopped_early"] and best >= 2, curve
    assert len(curve) == best + 2 and min(curve[best:]) >= curve[best - 1]  # patience 2, then it stopped
    assert hist["steps_trained"] == len(curve) * hist["best_step"] // best
    assert not os.path.exists(os.path.join(model, "best"))
    # then one pass over the validation slice (trainer.train_on_validation): every late row, as the ranks split it
    world, batch = cfg.trainer.num_workers, cfg.trainer.batch_size
    files, cut = shard_files(data, "train"), validation_cutoff(data, cfg.trainer.validation_fraction)
    late = [int((read_ts(files[r::world]) > cut).sum()) for r in range(world)]
    assert hist["validation_pass"]["rows"] == sum(late) > 0
    assert hist["validation_pass"]["steps"] == max(-(-n // batch) for n in late)
    # it trained the kept model on them: their logloss (float64, from the Model artifact) fell below the kept epoch's
    loaded = LoadedModel(model)
    rows = [rank_split(cfg, data, r, world)[1] for r in range(world)]
    labels = np.concatenate([v.labels for v in rows]).astype(np.float64)
    p = np.clip(np.concatenate([score(loaded, v) for v in rows]).astype(np.float64), 1e-12, 1 - 1e-12)
    after = float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))
    assert len(labels) == sum(late) and after < hist["validation"][best - 1]["logloss"] - 0.01, after
    # the same run scheduled for the best epoch only ends there (then makes the same pass): its model is the one
    # kept, bit for bit, so the best epoch's rows, dense weights and dense optimizer state were all restored
    ref = str(root / "ref")
    ref_manifest = train(_auto(best), data, ref, work_dir=str(root / "ref-work"))
    _same_model(cfg, model, auto_run["manifest"], ref, ref_manifest)


@pytest.mark.processes
def test_patience_z_stops_at_the_first_epoch_measured_worse_than_the_best(tmp_path, auto_run):
    # auto_run's curve (patience 2 alone) turns; with patience_z just above 0 any epoch scored worse than the best
    # is past it, so the same run (seeded, staleness 0) stops at the first one, on the same curve up to there
    ref = [v["logloss"] for v in json.load(open(os.path.join(auto_run["model"], "train_metrics.json")))["validation"]]
    first_worse = next(e for e in range(2, len(ref) + 1) if ref[e - 1] >= min(ref[: e - 1]))
    model = str(tmp_path / "model")
    train(_auto(8, patience_z=1e-6), auto_run["data"], model, work_dir=str(tmp_path / "work"))
    hist = json.load(open(os.path.join(model, "train_metrics.json")))
    curve = [v["logloss"] for v in hist["validation"]]
    assert curve == ref[:first_worse] and hist["stopped_early"], (curve, ref)
    assert hist["best_epoch"] == int(np.argmin(curve)) + 1 and first_worse - hist["best_epoch"] < 2  # not patience
    # every epoch after the first measured against the best before it: the paired mean is the loglosses' difference
    for e in range(2, len(curve) + 1):
        z = hist["validation"][e - 1]["worse_z"]
        assert np.sign(z) == np.sign(curve[e - 1] - min(curve[: e - 1])) and z != 0, (e, z)
    assert "worse_z" not in hist["validation"][0]


@pytest.mark.processes
def test_deltas_after_the_kept_epoch_are_superseded_and_every_delta_in_order_ends_at_the_kept_model(tmp_path):
    # incremental exports while epochs: auto trains past its best epoch: a consumer applying every delta as it
    # came (online serving) ends at the Model's rows, as does one starting from the Model's shard files
    data = write_dataset(str(tmp_path / "data"), rows=256)
    cfg = _auto(8, delta_every_s=0.02)
    model, deltas = str(tmp_path / "model"), str(tmp_path / "deltas")
    manifest = train(cfg, data, model, work_dir=str(tmp_path / "work"), delta_dir=deltas)
    hist = json.load(open(os.path.join(model, "train_metrics.json")))
    assert hist["stopped_early"] and hist["best_epoch"] < len(hist["validation"])
    kept = _tables(cfg, model, manifest)
    superseded, rows = 0, {}
    for s, rel in enumerate(manifest["shard_files"]):
        superseded += len(superseded_deltas(deltas, s))
        contents = read_shard_file(os.path.join(model, rel), build_index=False)
        empty = {n: {k: v[:0] for k, v in lru_state_dict(ta).items()} for n, ta in contents.tables.items()}
        for name, state in (
            ("every delta in order", apply_deltas(empty, [p for _, p in list_deltas(deltas, s)])),
            ("the Model and the deltas after it", load_with_deltas(os.path.join(model, rel), deltas, s)),
        ):
            for table, sd in state.items():
                rows[name, table] = rows.get((name, table), 0) + len(sd["keys"])
                o = np.argsort(sd["keys"])
                mine = np.isin(kept[table]["keys"], sd["keys"])
                for k in kept[table]:
                    np.testing.assert_array_equal(sd[k][o], kept[table][k][mine], err_msg=f"{name}: {table}.{k}")
    assert rows == {(n, t): len(kept[t]["keys"]) for n, t in rows} and len(rows) == 4  # no row missing
    assert superseded > 0  # deltas were written after the kept epoch, and marked


def _server_pids(work: str) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if os.path.join(work, "ps-1.port").encode() in f.read():
                    out.append(int(pid))
        except OSError:
            continue
    return out


@pytest.mark.processes
def test_a_run_killed_after_its_best_epoch_resumes_and_keeps_the_same_best_model(auto_run, tmp_path):
    from persia_core.checkpoints import CheckpointSettings, list_checkpoints
    from persia_core.train.local_cluster import TrainingFailed

    hist = json.load(open(os.path.join(auto_run["model"], "train_metrics.json")))
    after_best = hist["best_step"] + hist["best_step"] // hist["best_epoch"]  # the epoch after the best one
    settings = CheckpointSettings(every_steps=hist["best_step"] // hist["best_epoch"], keep=8, at_end=False)
    model, work = str(tmp_path / "model"), str(tmp_path / "work")

    def kill_once_checkpointed():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            done = [
                s
                for s, p in list_checkpoints(os.path.join(model, "checkpoints"))
                if os.path.exists(f"{p}/manifest.json")
            ]
            if after_best in done:
                for pid in _server_pids(work):
                    os.kill(pid, 9)
                return
            time.sleep(0.002)

    killer = threading.Thread(target=kill_once_checkpointed)
    killer.start()
    slow = _auto(8, network_delay_s=0.01)  # the arithmetic is the same; the kill lands before the last epoch
    with pytest.raises(TrainingFailed):
        train(slow, auto_run["data"], model, work_dir=work, checkpoint=settings)
    killer.join()
    assert os.path.isdir(os.path.join(model, "best"))  # kept for the retry
    manifest = train(slow, auto_run["data"], model, work_dir=str(tmp_path / "retry"), checkpoint=settings)
    assert manifest["resumed_from"].endswith(f"ckpt-{after_best:010d}")
    resumed = json.load(open(os.path.join(model, "train_metrics.json")))
    assert (resumed["best_epoch"], resumed["best_step"]) == (hist["best_epoch"], hist["best_step"])
    _same_model(auto_run["cfg"], model, manifest, auto_run["model"], auto_run["manifest"])


def test_the_pipeline_parameters_minus_one_epochs_is_epochs_auto_and_zero_keeps_the_config():
    from persia_core.config import load_config
    from persia_core.config.loading import pipeline_overrides
    from persia_core.config.trainer import AUTO_EPOCHS

    assert pipeline_overrides(0, 0, -1, AUTO_EPOCHS, 0) == {"trainer.epochs": "auto"}
    assert pipeline_overrides(3, 2, 0, 4, 100) == {
        "embedding.num_shards": 3,
        "trainer.num_workers": 2,
        "trainer.epochs": 4,
        "split.max_rows": 100,
        "trainer.embedding_staleness": 0,
    }
    assert load_config("movielens", pipeline_overrides(0, 0, -1, AUTO_EPOCHS, 0)).trainer.auto_epochs
    assert load_config("movielens", pipeline_overrides(0, 0, -1, 0, 0)).trainer.epochs == 1


@pytest.mark.processes
def test_refit_trains_the_chosen_epochs_again_on_every_row_from_the_initial_state(tmp_path):
    # trainer.refit: the slice picks the number of epochs, then the model is trained again from the initial state
    # on the whole train split: the run scheduled for that many epochs, bit for bit (K = 0)
    data = write_dataset(str(tmp_path / "data"), rows=256)
    cfg = _auto(8, refit=True)
    model = str(tmp_path / "model")
    manifest = train(cfg, data, model, work_dir=str(tmp_path / "work"))
    hist = json.load(open(os.path.join(model, "train_metrics.json")))
    best = hist["best_epoch"]
    assert (
        best >= 1
        and hist["refit"]["epochs"] == best
        and hist["refit"]["rows"] == len(read_ts(shard_files(data, "train")))
    )
    assert not os.path.exists(os.path.join(model, "initial")) and "validation_pass" not in hist
    d = cfg.to_dict()
    d["trainer"].update(epochs=best)
    ref = str(tmp_path / "ref")
    ref_manifest = train(RunConfig.from_dict(d), data, ref, work_dir=str(tmp_path / "ref-work"))
    _same_model(cfg, model, manifest, ref, ref_manifest)
