"""persia_core.io against a real Cloud Storage emulator: gs:// and unmounted /gcs/ paths, and local ones."""

import os

import numpy as np
import pytest

from persia_core import io


def test_gcs_join_keeps_the_scheme_and_never_collapses_the_double_slash():
    assert io.join("gs://b", "x") == "gs://b/x"
    assert io.join("gs://b/", "/x/", "y") == "gs://b/x/y"
    assert io.join("gs://b/dir/", "", "f.parquet") == "gs://b/dir/f.parquet"
    assert io.join("/gcs/b/dir", "f") == "/gcs/b/dir/f"
    assert io.join("local", "a", "b") == os.path.join("local", "a", "b")
    assert "gs:/b" not in io.join("gs://b", "x").replace("gs://", "")
    with pytest.raises(ValueError, match="bucket"):
        io.join("gs://", "x")


def test_gcs_uri_and_fuse_forms_convert_both_ways():
    assert io.to_uri("/gcs/b/k/x") == "gs://b/k/x"
    assert io.to_fuse("gs://b/k/x") == "/gcs/b/k/x"
    assert io.to_uri("data/x") == "data/x" and io.to_fuse("/tmp/x") == "/tmp/x"
    assert io.split_gcs("gs://b/k/x") == ("b", "k/x")
    assert io.split_gcs("/gcs/b") == ("b", "")


def test_gcs_round_trip_bytes_and_text(gcs_bucket):
    uri = f"gs://{gcs_bucket}/dir/sub/blob.bin"
    payload = bytes(range(256)) * 10
    io.write_bytes(uri, payload)
    assert io.read_bytes(uri) == payload
    io.write_text(f"gs://{gcs_bucket}/dir/t.txt", "héllo\n")
    assert io.read_text(f"gs://{gcs_bucket}/dir/t.txt") == "héllo\n"
    io.write_text(f"gs://{gcs_bucket}/dir/t.txt", "replaced")
    assert io.read_text(f"gs://{gcs_bucket}/dir/t.txt") == "replaced"


def test_gcs_unmounted_fuse_path_reaches_the_same_object(gcs_bucket):
    assert not os.path.isdir(f"/gcs/{gcs_bucket}")
    io.write_text(f"/gcs/{gcs_bucket}/m/manifest.json", "{}")
    assert io.read_text(f"gs://{gcs_bucket}/m/manifest.json") == "{}"
    assert io.exists(f"/gcs/{gcs_bucket}/m") and io.isdir(f"/gcs/{gcs_bucket}/m")
    assert io.listdir(f"/gcs/{gcs_bucket}/m") == ["manifest.json"]
    assert io.glob(f"/gcs/{gcs_bucket}/m/*.json") == [f"/gcs/{gcs_bucket}/m/manifest.json"]
    assert not os.path.exists(f"/gcs/{gcs_bucket}")  # nothing was written to the local disk


def test_gcs_exists_isdir_isfile_on_objects_folders_and_missing_paths(gcs_bucket):
    b = f"gs://{gcs_bucket}"
    io.write_text(f"{b}/data/train/part-0.parquet", "x")
    assert io.exists(b) and io.isdir(b)
    assert io.exists(f"{b}/data") and io.isdir(f"{b}/data") and io.isdir(f"{b}/data/")
    assert io.exists(f"{b}/data/train/part-0.parquet") and io.isfile(f"{b}/data/train/part-0.parquet")
    assert not io.isdir(f"{b}/data/train/part-0.parquet") and not io.isfile(f"{b}/data")
    assert not io.exists(f"{b}/dat")  # a name prefix is not a folder
    assert not io.exists(f"{b}/nothing") and not io.isdir(f"{b}/nothing")
    assert not io.exists("gs://no-such-bucket-persia/x")
    with pytest.raises(FileNotFoundError, match="nothing"):
        io.read_bytes(f"{b}/nothing")


def test_gcs_listdir_shows_files_and_folders_one_level_deep(gcs_bucket):
    b = f"gs://{gcs_bucket}"
    for k in ("d/a.csv", "d/b.csv", "d/sub/c.csv", "d/sub/deeper/e.csv", "other/x"):
        io.write_text(f"{b}/{k}", k)
    io.gcs_client().bucket(gcs_bucket).blob("d/").upload_from_string(b"")  # a console-made "folder" object
    with pytest.raises(IsADirectoryError):
        io.write_bytes(f"{b}/d/", b"")
    assert io.listdir(f"{b}/d") == ["a.csv", "b.csv", "sub"]
    assert io.listdir(f"{b}/d/") == ["a.csv", "b.csv", "sub"]
    assert io.listdir(b) == ["d", "other"]
    assert io.walk_files(f"{b}/d") == ["a.csv", "b.csv", "sub/c.csv", "sub/deeper/e.csv"]
    with pytest.raises(FileNotFoundError):
        io.listdir(f"{b}/missing")


def test_gcs_glob_matches_files_of_the_last_component_only(gcs_bucket):
    b = f"gs://{gcs_bucket}"
    for k in ("raw/day_0.tsv", "raw/day_1.tsv", "raw/day_10.tsv", "raw/readme.txt", "raw/day_x/inner.tsv"):
        io.write_text(f"{b}/{k}", k)
    assert io.glob(f"{b}/raw/day_?.tsv") == [f"{b}/raw/day_0.tsv", f"{b}/raw/day_1.tsv"]
    assert io.glob(f"{b}/raw/day_*.tsv") == [f"{b}/raw/day_0.tsv", f"{b}/raw/day_1.tsv", f"{b}/raw/day_10.tsv"]
    assert io.glob(f"{b}/raw/*") == [
        f"{b}/raw/day_0.tsv",
        f"{b}/raw/day_1.tsv",
        f"{b}/raw/day_10.tsv",
        f"{b}/raw/readme.txt",
    ]
    assert io.glob(f"{b}/raw/[r]*") == [f"{b}/raw/readme.txt"]
    assert io.glob(f"{b}/raw/readme.txt") == [f"{b}/raw/readme.txt"]
    assert io.glob(f"{b}/nope/*.tsv") == []
    with pytest.raises(ValueError, match="last path component"):
        io.glob(f"{b}/r*/x.tsv")


def test_gcs_copy_and_remove_across_forms(gcs_bucket, tmp_path):
    b = f"gs://{gcs_bucket}"
    local = str(tmp_path / "x.bin")
    io.write_bytes(local, b"abc")
    io.copy(local, f"{b}/c/x.bin")
    io.copy(f"{b}/c/x.bin", f"{b}/c/y.bin")
    io.copy(f"{b}/c/y.bin", str(tmp_path / "back" / "y.bin"))
    assert open(tmp_path / "back" / "y.bin", "rb").read() == b"abc"
    io.remove(f"{b}/c/x.bin")
    assert io.listdir(f"{b}/c") == ["y.bin"]
    with pytest.raises(FileNotFoundError):
        io.remove(f"{b}/c/x.bin")


def test_local_paths_behave_like_gcs_ones(tmp_path):
    root = str(tmp_path)
    io.write_text(io.join(root, "d", "a.csv"), "a")
    io.write_text(io.join(root, "d", "sub", "b.csv"), "b")
    assert io.listdir(io.join(root, "d")) == ["a.csv", "sub"]
    assert io.glob(io.join(root, "d", "*")) == [io.join(root, "d", "a.csv")]
    assert io.walk_files(io.join(root, "d")) == ["a.csv", "sub/b.csv"]
    assert io.isdir(io.join(root, "d")) and io.isfile(io.join(root, "d", "a.csv"))
    assert not [f for f in os.listdir(io.join(root, "d")) if ".tmp-" in f]


def test_gcs_parquet_shards_read_with_parquet_examples_match_the_local_read(gcs_bucket, tiny_data):
    from persia_core.data.reader import ParquetExamples, read_schema, shard_files

    remote = f"gs://{gcs_bucket}/dataset"
    for rel in io.walk_files(tiny_data):
        io.copy(os.path.join(tiny_data, rel), io.join(remote, rel))
    assert read_schema(remote) == read_schema(tiny_data)
    files = shard_files(remote, "train")
    assert all(f.startswith(f"gs://{gcs_bucket}/dataset/train/") for f in files)
    slots = ["a", "b", "tags"]
    got = ParquetExamples(files, slots)
    want = ParquetExamples(shard_files(tiny_data, "train"), slots)
    assert len(got) == len(want) > 0
    np.testing.assert_array_equal(got.labels, want.labels)
    np.testing.assert_array_equal(got.dense, want.dense)
    for s in slots:
        np.testing.assert_array_equal(got.ids[s][0], want.ids[s][0])
        np.testing.assert_array_equal(got.ids[s][1], want.ids[s][1])
    with pytest.raises(FileNotFoundError, match="not found"):
        ParquetExamples([f"{remote}/train/missing.parquet"], slots)


def test_gcs_init_shards_writes_the_shard_plan_to_a_bucket(gcs_bucket, tiny_data):
    from support import tiny_config

    from persia_core.embedding.plan import init_shards

    out = f"gs://{gcs_bucket}/shards"
    data = f"gs://{gcs_bucket}/dataset"
    for rel in io.walk_files(tiny_data):
        io.copy(os.path.join(tiny_data, rel), io.join(data, rel))
    plan = init_shards(tiny_config(), data, out)
    assert io.walk_files(out) == ["run_config.yaml", "shard_plan.json", *plan["shard_files"]]


def test_gcs_missing_bucket_lists_nothing_and_reads_fail_clearly(gcs_emulator):
    assert io.glob("gs://no-such-bucket-persia/*.csv") == []
    assert io.walk_files("gs://no-such-bucket-persia/d") == []
    with pytest.raises(FileNotFoundError, match="no-such-bucket-persia"):
        io.listdir("gs://no-such-bucket-persia/d")
    with pytest.raises(FileNotFoundError, match="no-such-bucket-persia"):
        io.read_bytes("gs://no-such-bucket-persia/d/x")


def test_gcs_warm_start_from_a_blessed_location_before_its_first_model_is_a_cold_start(gcs_bucket):
    from persia_core import io
    from persia_core.embedding.warm_start import resolve_warm_start

    assert resolve_warm_start(f"gs://{gcs_bucket}/blessed/criteo") == ""  # day one: no object under it yet
    io.write_text(f"gs://{gcs_bucket}/other/notes.txt", "x")
    with pytest.raises(FileNotFoundError, match="not a Model artifact"):
        resolve_warm_start(f"gs://{gcs_bucket}/other")
