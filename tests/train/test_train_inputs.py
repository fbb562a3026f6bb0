"""Training refuses inputs that do not fit together before it writes or starts anything."""

import json
import os
import tempfile

import pytest

from persia_core.__main__ import main
from persia_core.config import RunConfig
from persia_core.data.reader import ParquetExamples, shard_files
from persia_core.embedding.plan import init_shards
from persia_core.train import launcher
from persia_core.train.launcher import train
from tests.support import tiny_config, write_dataset


@pytest.fixture
def data(tmp_path):
    return write_dataset(str(tmp_path / "data"))


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """Temporary folders go under tmp_path/tmp, so a test sees whether training left one behind."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def _refused(cfg, data, tmp_path, scratch, exc, **kw):
    model = tmp_path / "model"
    with pytest.raises(exc) as e:
        train(cfg, data, str(model), **kw)
    assert not model.exists()  # nothing written ...
    assert not os.listdir(scratch)  # ... and no temporary work folder left behind
    return str(e.value)


def test_init_shards_planned_for_another_shard_count_are_refused_naming_both_counts(tmp_path, data, scratch):
    init = str(tmp_path / "init3")
    init_shards(tiny_config().with_overrides({"embedding.num_shards": 3}), data, init)
    msg = _refused(tiny_config(), data, tmp_path, scratch, ValueError, init_dir=init)  # the config says 2
    assert "shard_plan.json" in msg and "planned for 3 shards" in msg and "embedding.num_shards is 2" in msg


def test_init_shards_of_another_embedding_dim_are_refused(tmp_path, data, scratch):
    init = str(tmp_path / "init")
    init_shards(tiny_config(), data, init)
    cfg = tiny_config().with_overrides(
        {"embedding.tables": [{"name": "default", "dim": 8, "optimizer": {"name": "rowwise_adagrad", "lr": 0.1}}]}
    )
    msg = _refused(cfg, data, tmp_path, scratch, ValueError, init_dir=init)
    assert "table 'default' was planned with dim 4" in msg and "8" in msg


def test_a_missing_init_folder_and_a_folder_that_is_no_init_output_are_refused(tmp_path, data, scratch):
    msg = _refused(tiny_config(), data, tmp_path, scratch, FileNotFoundError, init_dir=str(tmp_path / "nope"))
    assert "nope" in msg and "no such folder" in msg
    (tmp_path / "empty").mkdir()
    msg = _refused(tiny_config(), data, tmp_path, scratch, FileNotFoundError, init_dir=str(tmp_path / "empty"))
    assert "not an init_shards output" in msg


def test_a_config_whose_slots_the_data_lacks_is_refused_naming_them(tmp_path, data, scratch):
    d = tiny_config().to_dict()  # a config for data with a column C1, which this data was not made from
    d["layout"]["columns"].append("C1")
    d["slots"] = [{"name": "a", "source": "a"}, {"name": "C1", "source": "C1"}]
    cfg = RunConfig.from_dict(d)
    msg = _refused(cfg, data, tmp_path, scratch, ValueError)
    assert "schema.json" in msg and "['C1']" in msg and "'tags'" in msg


def test_data_whose_train_split_holds_no_row_is_refused(tmp_path, data, scratch):
    # before: training ran, reported success with 0 samples/s and no loss
    import json

    path = os.path.join(data, "schema.json")
    schema = json.load(open(path))
    schema["rows"] = {"train": 0, "eval": 0, "malformed": 12, "read": 12}
    json.dump(schema, open(path, "w"))
    msg = _refused(tiny_config(), data, tmp_path, scratch, ValueError)
    assert "schema.json" in msg and "train split holds no row (12 read, 12 malformed" in msg


def test_resuming_from_a_checkpoint_folder_that_does_not_exist_is_refused(tmp_path, data, scratch):
    msg = _refused(tiny_config(), data, tmp_path, scratch, FileNotFoundError, resume_from=str(tmp_path / "ckpt-none"))
    assert "ckpt-none" in msg and "no such checkpoint folder" in msg


@pytest.mark.processes
def test_the_cli_exits_2_for_a_shard_count_mismatch_and_a_missing_init(tmp_path, data, scratch, capsys):
    with open(os.path.join(data, "run_config.yaml"), "w") as f:  # as preprocess leaves it
        f.write(tiny_config().to_yaml())
    init = str(tmp_path / "init3")
    assert main(["init-shards", "--data", data, "--output", init, "--set", "embedding.num_shards=3"]) == 0
    capsys.readouterr()
    out = str(tmp_path / "m")
    assert main(["train", "--data", data, "--init", init, "--output", out, "--set", "embedding.num_shards=2"]) == 2
    assert "planned for 3 shards" in capsys.readouterr().err
    assert main(["train", "--data", data, "--init", str(tmp_path / "no-such"), "--output", out]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert not os.path.exists(out)
    # the matching count trains, from the init folder's own config
    assert main(["train", "--data", data, "--init", init, "--output", out]) == 0
    assert len(json.loads(capsys.readouterr().out)["summary"]["rows"]) == 3


@pytest.mark.processes
def test_a_refused_initial_state_leaves_no_work_folder_behind(tmp_path, data, scratch):
    # issue 20, case 9: before, /tmp/persia-train-* stayed behind, unnamed
    from persia_core.model_store import shard_file_name

    init = str(tmp_path / "init")
    init_shards(tiny_config(), data, init)
    with open(os.path.join(init, shard_file_name(1)), "r+b") as f:
        f.truncate(100)  # a partial shard file: its server refuses it
    with pytest.raises(Exception, match="refused"):
        train(tiny_config(), data, str(tmp_path / "model"), init_dir=init)
    assert not os.listdir(scratch)


@pytest.mark.processes
def test_a_failed_run_keeps_its_logs_in_the_model_folder_and_names_them_not_a_removed_work_folder(
    tmp_path, data, scratch, monkeypatch, caplog
):
    from persia_core.data.reader import shard_files
    from persia_core.train.local_cluster import TrainingFailed

    with open(shard_files(data, "train")[0], "r+b") as f:
        f.truncate(200)  # the NN worker of rank 0 cannot read its data
    monkeypatch.setattr(launcher, "check_shards_readable", lambda *a: None)  # (refused up front otherwise)
    model = tmp_path / "model"
    with pytest.raises(TrainingFailed) as e:
        train(tiny_config(), data, str(model))
    assert not os.listdir(scratch)
    assert f"all logs kept in {model / 'logs'}" in str(e.value)
    assert (model / "logs" / "nn_worker-0.log").read_text()
    # PERSIA_KEEP_WORK_DIR keeps the work folder, and the log names it
    monkeypatch.setenv("PERSIA_KEEP_WORK_DIR", "1")
    with pytest.raises(TrainingFailed):
        train(tiny_config(), data, str(tmp_path / "model2"))
    (kept,) = os.listdir(scratch)
    assert any(str(scratch / kept) in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_a_damaged_parquet_shard_is_refused_naming_it_before_anything_starts(tmp_path, data, scratch, capsys):
    # found by a fresh-user trial: a train shard overwritten with other bytes failed inside the NN worker, with a
    # multi-line traceback naming no file; now the launcher opens every shard's footer first, and a reader names
    # the file whose pages it cannot decode
    files = shard_files(data, "train")
    intact = open(files[-1], "rb").read()
    with open(files[-1], "wb") as f:
        f.write(b"not parquet at all" * 10)
    message = _refused(tiny_config(), data, tmp_path, scratch, ValueError)
    assert files[-1] in message and "not a readable Parquet shard" in message
    with open(os.path.join(data, "run_config.yaml"), "w") as f:
        f.write(tiny_config().to_yaml())
    assert main(["train", "--data", data, "--output", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert files[-1] in err and "Traceback" not in err
    # an intact footer over damaged pages: the reader names the file
    damaged = bytearray(intact)
    middle = len(damaged) // 2
    damaged[4:middle] = bytes(middle - 4)
    with open(files[-1], "wb") as f:
        f.write(bytes(damaged))
    with pytest.raises(ValueError, match="damaged Parquet shard") as e:
        ParquetExamples(files, ["a", "b", "tags"])
    assert files[-1] in str(e.value)
