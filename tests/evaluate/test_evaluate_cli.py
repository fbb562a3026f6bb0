"""``persia evaluate``: bad flags, flag combinations and a user slot the model lacks exit 2 before evaluating."""

from __future__ import annotations

import os

import pytest
from support import tiny_config

from persia_core.__main__ import main
from persia_core.evaluate.run import evaluate

SLOTS = ["a", "b", "tags"]
ROWS = [
    {"label": 1, "x": 0.5, "a": ["1"], "b": ["x"], "tags": ["t1"]},
    {"label": 0, "x": -1.0, "a": ["2"], "b": ["y"], "tags": []},
]


@pytest.fixture(scope="module")
def hand_made(tmp_path_factory, model_factory, eval_rows_writer):
    root = tmp_path_factory.mktemp("cli")
    model = model_factory(str(root / "model"), tiny_config(), {"a": ["1"], "b": ["x"], "tags": ["t1"]})
    data = eval_rows_writer(str(root / "data"), ROWS, SLOTS)
    return model, data


def _evaluate(model, data, report, *flags) -> int:
    return main(["evaluate", "--model", model, "--data", data, "--report", report, *flags])


def test_cli_evaluate_bless_without_blessed_dir_exits_2_before_evaluating(hand_made, tmp_path, capsys):
    report = str(tmp_path / "r.html")
    assert _evaluate(*hand_made, report, "--bless") == 2
    err = capsys.readouterr().err
    assert "--bless needs --blessed-dir" in err and "Traceback" not in err
    assert not os.path.exists(report)  # refused before the evaluation wrote anything


def test_cli_evaluate_unknown_user_slot_exits_2_naming_it_and_the_models_slots(hand_made, tmp_path, capsys):
    report = str(tmp_path / "r.html")
    assert _evaluate(*hand_made, report, "--user-slot", "nosuchslot") == 2
    err = capsys.readouterr().err
    assert "'nosuchslot'" in err and str(SLOTS) in err
    assert not os.path.exists(report)


def test_evaluate_refuses_an_unknown_user_slot_before_reading_the_data(hand_made, tmp_path):
    model, _ = hand_made
    # the data folder does not exist: the user slot is checked first, from the manifest alone
    with pytest.raises(ValueError, match=r"user slot 'nosuchslot' is not a slot .*\['a', 'b', 'tags'\]"):
        evaluate(model, str(tmp_path / "no-data"), user_slot="nosuchslot")


def test_cli_evaluate_default_or_empty_user_slot_absent_is_skipped_not_refused(hand_made, tmp_path, capsys):
    for flags in ([], ["--user-slot", ""]):  # the default "user" is not a slot of this model
        report = str(tmp_path / "r.html")
        assert _evaluate(*hand_made, report, *flags) == 0
        assert os.path.exists(report)
        os.remove(report)
    assert '"user_split": null' in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--min-auc", "2"], "--min-auc"),
        (["--min-auc", "nan"], "--min-auc"),
        (["--max-auc-drop", "-0.1"], "--max-auc-drop"),
        (["--max-logloss-increase", "-1"], "--max-logloss-increase"),
    ],
)
def test_cli_evaluate_gate_thresholds_out_of_range_exit_2_naming_the_flag(hand_made, tmp_path, capsys, flags, named):
    report = str(tmp_path / "r.html")
    assert _evaluate(*hand_made, report, *flags) == 2
    assert named in capsys.readouterr().err.strip().splitlines()[-1]
    assert not os.path.exists(report)


def test_cli_evaluate_unwritable_outputs_or_bad_marker_exit_2_before_evaluating(hand_made, tmp_path, capsys):
    (tmp_path / "f").write_text("a file")
    metrics = str(tmp_path / "m.json")
    assert _evaluate(*hand_made, str(tmp_path / "f" / "r.html")) == 2
    assert f"--report {tmp_path / 'f' / 'r.html'}" in capsys.readouterr().err
    report = str(tmp_path / "r.html")
    assert _evaluate(*hand_made, report, "--metrics-json", str(tmp_path)) == 2
    assert f"--metrics-json {tmp_path}" in capsys.readouterr().err
    blessed = tmp_path / "blessed"
    blessed.mkdir()
    (blessed / "BLESSED.json").write_text("{not json")
    assert _evaluate(*hand_made, report, "--metrics-json", metrics, "--blessed-dir", str(blessed)) == 2
    assert "BLESSED.json" in capsys.readouterr().err
    assert not os.path.exists(report) and not os.path.exists(metrics)
