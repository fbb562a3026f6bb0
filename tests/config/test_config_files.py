"""A run config file that is not one (empty, not UTF-8, not a mapping) is refused in one line naming it."""

import pytest

from persia_core.config import load_config


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"", "the file is empty"),
        (b"# only a comment\n", "the file is empty"),
        (b"\xff\xfeslots: []\n", "not UTF-8 text"),
        (b"- a\n- b\n", "expected a mapping of sections"),
        (b"slots: [\n", "not valid YAML"),
    ],
)
def test_a_config_file_that_is_not_a_config_is_refused_naming_it(tmp_path, content, why):
    # found by a fresh-user trial: a non-UTF-8 file gave "'utf-8' codec can't decode byte 0xff" without the file's
    # name, and an empty one "config field 'slots': at least one slot is needed"
    path = tmp_path / "mine.yaml"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=why) as e:
        load_config(str(path))
    assert str(e.value).startswith(f"run config {path}: ")
