"""A train task that fails on bad input is not retried into the same failure: the failure is recorded in the
task's model artifact, the task exits 2, and a retried attempt that finds the record fails at once.

KFP's retry (``set_retry``, used on the train task for transient failures such as a lost machine) has no
policy: before, a config that does not fit the data failed three times, waiting out the back-off between."""

from __future__ import annotations

import os
import time

import pytest
from kfp import dsl
from support import tiny_config, write_dataset

from components.train import train as train_component
from persia_core.config import RunConfig
from persia_core.embedding.plan import init_shards
from persia_core.train import launcher


@pytest.mark.processes
def test_a_train_task_failing_on_bad_input_exits_2_and_its_retry_fails_at_once(tmp_path, capsys):
    data = write_dataset(str(tmp_path / "data"))
    shards = tmp_path / "shards"
    init_shards(tiny_config(), data, str(shards))
    good = (shards / "run_config.yaml").read_text()
    bad = tiny_config().to_dict()
    bad["slots"].append({"name": "x_id", "source": "x"})  # a slot the preprocessed data does not hold
    (shards / "run_config.yaml").write_text(RunConfig.from_dict(bad).to_yaml())

    def attempt():
        return train_component.python_func(
            dataset=dsl.Dataset(uri=data),
            shards=dsl.Artifact(uri=str(shards)),
            model=dsl.Model(uri=str(tmp_path / "model")),
            metrics=dsl.Metrics(uri=str(tmp_path / "metrics")),
            checkpoint_every_s=0.0,
        )

    with pytest.raises(SystemExit) as first:
        attempt()
    assert first.value.code == 2
    assert "x_id" in capsys.readouterr().err
    assert os.path.exists(tmp_path / "model" / "bad_input.json")
    (shards / "run_config.yaml").write_text(good)  # a retry gets the same inputs; even fixed, it does not train
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as retry:
        attempt()
    assert retry.value.code == 2 and time.monotonic() - t0 < 5
    err = capsys.readouterr().err
    assert "an earlier attempt of this task failed on bad input" in err and "x_id" in err
    assert not os.path.exists(tmp_path / "model" / "manifest.json")


@pytest.mark.processes
def test_a_train_task_failing_for_another_reason_records_nothing_and_may_be_retried(tmp_path, monkeypatch):
    data = write_dataset(str(tmp_path / "data"))
    shards = tmp_path / "shards"
    init_shards(tiny_config(), data, str(shards))
    from persia_core.data.reader import shard_files
    from persia_core.train.local_cluster import TrainingFailed

    with open(shard_files(data, "train")[0], "r+b") as f:
        f.truncate(200)  # a process fails (here: its data cannot be read): not an input check, so retried
    monkeypatch.setattr(launcher, "check_shards_readable", lambda *a: None)  # (refused up front otherwise)
    with pytest.raises(TrainingFailed):
        train_component.python_func(
            dataset=dsl.Dataset(uri=data),
            shards=dsl.Artifact(uri=str(shards)),
            model=dsl.Model(uri=str(tmp_path / "model")),
            metrics=dsl.Metrics(uri=str(tmp_path / "metrics")),
            checkpoint_every_s=0.0,
        )
    assert not os.path.exists(tmp_path / "model" / "bad_input.json")
