"""One log format across processes, progress as log lines off a terminal, and TensorBoard training metrics."""

from __future__ import annotations

import io
import logging
import os

import pytest

from persia_core.logging_utils import log_format, progress, setup_logging, write_tensorboard


@pytest.fixture
def root_logger():
    """The root logger, with its handlers and level restored after the test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)


def test_cli_log_lines_name_role_rank_and_logger(root_logger):
    stream = io.StringIO()
    setup_logging("nn_worker", 3, stream=stream)
    logging.getLogger("persia.worker").info("step %d", 7)
    line = stream.getvalue().strip()
    assert line.endswith("INFO nn_worker[3] persia.worker: step 7"), line
    assert log_format("evaluate") == "%(asctime)s %(levelname)s evaluate %(name)s: %(message)s"
    stream2 = io.StringIO()
    setup_logging("ps", 0, stream=stream2)  # replaces the previous handler, not added beside it
    logging.getLogger("persia.ps").warning("hello")
    assert "WARNING ps[0] persia.ps: hello" in stream2.getvalue()
    assert "hello" not in stream.getvalue()
    with pytest.raises(ValueError, match="role"):
        log_format("")


def test_cli_progress_off_a_terminal_is_periodic_log_lines(caplog):
    stream = io.StringIO()  # not a terminal
    with caplog.at_level(logging.INFO, logger="persia.progress"):
        items = list(progress(range(5), total=5, desc="evaluate", unit="batch", interval_s=0.0, stream=stream))
    assert items == [0, 1, 2, 3, 4]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 6 and lines[-1].startswith("evaluate: 5/5 batch (100%)")
    assert stream.getvalue() == ""  # no bar drawn into a log file
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="persia.progress"):
        list(progress(iter(range(3)), desc="x", interval_s=3600, stream=stream))
    assert [r.getMessage().split(",")[0] for r in caplog.records] == ["x: 3 it"]


HISTORY = {
    "samples": [16, 32, 48],
    "loss": [0.7, 0.6, 0.55],
    "elapsed_s": [0.1, 0.2, 0.4],
    "staleness": [0, 1, 1],
    "samples_per_s": 120.0,
    "max_staleness": 1,
}


def test_training_metrics_written_as_tensorboard_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = write_tensorboard(HISTORY, str(tmp_path / "tb"))
    assert out == str(tmp_path / "tb")
    acc = EventAccumulator(out)
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [16, 32, 48]
    assert [round(e.value, 6) for e in loss] == [0.7, 0.6, 0.55]
    assert [round(e.value, 3) for e in acc.Scalars("train/samples_per_s")] == [160.0, 80.0]
    assert acc.Scalars("summary/max_staleness")[0].value == 1.0


def test_training_metrics_tensorboard_is_skipped_with_a_warning_without_the_package(tmp_path, caplog, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    with caplog.at_level(logging.WARNING):
        assert write_tensorboard(HISTORY, str(tmp_path / "tb")) is None
    assert "tensorboard" in caplog.text
    assert not os.path.exists(tmp_path / "tb")


def _tiny_movielens(folder) -> str:
    folder.mkdir()
    files = {
        "ratings.csv": [
            "userId,movieId,rating,timestamp",
            "1,1,4.0,1000",
            "1,2,3.0,1010",
            "2,1,5.0,1020",
            "3,2,1.0,1030",
        ],
        "movies.csv": ["movieId,title,genres", "1,A (1999),Drama", "2,B (2001),Comedy|Drama"],
        "tags.csv": ["userId,movieId,tag,timestamp"],
    }
    for name, lines in files.items():
        (folder / name).write_text("\n".join(lines) + "\n")
    return str(folder)


def test_cli_preprocess_keeps_beams_info_lines_out_unless_debug(tmp_path, capsys, root_logger):
    from persia_core.__main__ import main

    data = _tiny_movielens(tmp_path / "ml")
    beam = logging.getLogger("apache_beam")
    before = beam.level
    assert main(["preprocess", "--data", data, "--output", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "native_type_compatibility" not in err and " INFO preprocess apache_beam" not in err
    assert "INFO preprocess persia_core.preprocess.pipeline: preprocess:" in err  # our own INFO lines stay
    assert beam.level == before  # the process's logging is left as it was
    # asked for everything, even after an earlier caller in this process (preprocess.pipeline.main, as in the
    # preprocess tests) left Beam's logger at WARNING: before, such a DEBUG run showed no Beam line at all
    beam.setLevel(logging.WARNING)
    try:
        assert main(["--log-level", "DEBUG", "preprocess", "--data", data, "--output", str(tmp_path / "out2")]) == 0
        assert "DEBUG preprocess apache_beam.runners." in capsys.readouterr().err
        assert beam.level == logging.WARNING  # and left as it was
    finally:
        beam.setLevel(before)
