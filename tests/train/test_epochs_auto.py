"""``epochs: auto``: the validation slice, early stopping on its logloss, and the best epoch's model kept exactly."""

import json
import os

import numpy as np
import pytest
import torch
from support import tiny_config, write_dataset

from persia_core.config import RunConfig
from persia_core.data.reader import read_ts, shard_files, validation_cutoff
from persia_core.embedding.shard_tables import load_shard_file, make_tables
from persia_core.train.launcher import train
from persia_core.train.validation import EarlyStopping


def _auto(max_epochs: int, **over) -> RunConfig:
    d = tiny_config(embedding_staleness=0, shuffle=True, embedding_workers=2).to_dict()
    d["trainer"].update(epochs="auto", max_epochs=max_epochs, patience=2, validation_fraction=0.25, dense_lr=0.005)
    d["embedding"]["tables"][0]["optimizer"]["lr"] = 0.05  # fast to fit, fast to overfit: a curve that turns
    d["model"]["wide"] = True
    for k, v in over.items():
        d["trainer"][k] = v
    return RunConfig.from_dict(d)


def test_epochs_takes_auto_and_refuses_other_words_and_auto_with_incremental_exports():
    assert _auto(5).trainer.scheduled_epochs == 5 and _auto(5).trainer.auto_epochs
    assert tiny_config(epochs=3).trainer.scheduled_epochs == 3 and not tiny_config(epochs=3).trainer.auto_epochs
    with pytest.raises(ValueError, match=r"trainer.epochs.*'auto', got 'often'"):
        tiny_config(epochs="often")
    with pytest.raises(ValueError, match=r"trainer.epochs.*>= 1"):
        tiny_config(epochs=0)
    with pytest.raises(ValueError, match=r"trainer.delta_every_s.*epochs: auto"):
        _auto(5, delta_every_s=1.0)
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


@pytest.mark.processes
def test_auto_keeps_the_epoch_of_the_best_validation_logloss_and_restores_its_model_exactly(tmp_path):
    data = write_dataset(str(tmp_path / "data"), rows=256)
    cfg = _auto(8)
    model = str(tmp_path / "model")
    manifest = train(cfg, data, model, work_dir=str(tmp_path / "work"))
    hist = json.load(open(os.path.join(model, "train_metrics.json")))
    curve = [v["logloss"] for v in hist["validation"]]
    best = int(np.argmin(curve)) + 1
    assert hist["best_epoch"] == best and hist["stopped_early"] and best >= 2, curve
    assert len(curve) == best + 2 and min(curve[best:]) >= curve[best - 1]  # patience 2, then it stopped
    assert hist["steps_trained"] == len(curve) * hist["best_step"] // best
    assert not os.path.exists(os.path.join(model, "best"))
    # the same run scheduled for the best epoch only ends there: its model is the one kept, bit for bit
    ref_model = str(tmp_path / "ref")
    ref_manifest = train(_auto(best), data, ref_model, work_dir=str(tmp_path / "ref-work"))
    got, ref = _tables(cfg, model, manifest), _tables(cfg, ref_model, ref_manifest)
    assert set(got) == set(ref) == {"default", "wide"}
    for name in got:
        for k in ref[name]:
            np.testing.assert_array_equal(got[name][k], ref[name][k], err_msg=f"{name}.{k}")
    a = torch.load(os.path.join(model, "dense.pt"), weights_only=True)
    b = torch.load(os.path.join(ref_model, "dense.pt"), weights_only=True)
    for k in b:
        assert torch.equal(a[k], b[k]), k


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
