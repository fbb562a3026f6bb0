"""The Vertex AI target: compiled YAML (train = CustomJob with role pools), the launcher's CustomJob request
(offline: anonymous credentials, the gapic JobServiceClient replaced), and the scheduled run's data path."""

import datetime as dt
import json
import re

import pytest
import yaml

from components import custom_job, data_path
from components.resolve_data import resolve_data
from components.vertex_train import train as vertex_train
from pipelines import vertex
from pipelines.persia_pipeline import compile_pipeline
from pipelines.persia_pipeline import main as compile_main

IMAGE = "us-central1-docker.pkg.dev/test-project/persia/persia-kfp:abc123"
CUDA_IMAGE = "us-central1-docker.pkg.dev/test-project/persia/persia-kfp-cuda:abc123"
ENTRY = ["python", "-m", "persia_core.cluster"]


def _settings(**kw):
    d = dict(
        image=IMAGE,
        cuda_image=CUDA_IMAGE,
        region="europe-west4",
        nn_machine_type="a2-highgpu-1g",
        accelerator_type="NVIDIA_TESLA_A100",
        accelerator_count=1,
        ps_machine_type="m1-ultramem-40",
        nn_replicas=3,
        ps_replicas=4,
        service_account="trainer@test-project.iam.gserviceaccount.com",
    )
    d.update(kw)
    return vertex.VertexSettings(**d)


@pytest.fixture(scope="module")
def vertex_yaml(tmp_path_factory):
    """The Vertex YAML compiled once for the module's tests, which only read it."""
    path = compile_pipeline(
        str(tmp_path_factory.mktemp("vertex") / "persia_pipeline_vertex.yaml"), "vertex", _settings()
    )
    return yaml.safe_load(open(path))


def test_vertex_yaml_train_task_is_a_custom_job_with_one_pool_per_role(vertex_yaml):
    train = vertex_yaml["root"]["dag"]["tasks"]["train"]
    params = train["inputs"]["parameters"]
    pools = json.loads(params["worker_pool_specs"]["runtimeValue"]["constant"])
    assert params["location"]["runtimeValue"]["constant"] == "europe-west4"
    assert len(pools) == 3
    primary, workers, servers = pools
    assert primary["replicaCount"] == 1
    assert primary["machineSpec"] == {
        "machineType": "a2-highgpu-1g",
        "acceleratorType": "NVIDIA_TESLA_A100",
        "acceleratorCount": 1,
    }
    assert workers["replicaCount"] == 2 and workers["machineSpec"] == primary["machineSpec"]
    assert servers["replicaCount"] == 4 and servers["machineSpec"] == {"machineType": "m1-ultramem-40"}
    assert primary["containerSpec"]["imageUri"] == workers["containerSpec"]["imageUri"] == CUDA_IMAGE
    assert servers["containerSpec"]["imageUri"] == IMAGE
    for pool in pools:
        c = pool["containerSpec"]
        assert c["command"] == ENTRY
        args = c["args"]
        assert args[args.index("--config") + 1] == "{{shards}}/run_config.yaml"
        assert args[args.index("--data") + 1] == "{{dataset}}" and args[args.index("--out") + 1] == "{{model}}"
        assert args[args.index("--init") + 1] == "{{shards}}"
        assert pool["diskSpec"]["bootDiskType"] == "pd-ssd"


def test_vertex_yaml_every_step_runs_in_the_configured_image_and_train_runs_the_launcher(vertex_yaml):
    executors = vertex_yaml["deploymentSpec"]["executors"]
    assert {e["container"]["image"] for e in executors.values()} == {IMAGE}
    train_exec = executors[vertex_yaml["components"]["comp-train"]["executorLabel"]]["container"]
    assert "run_custom_job" in "\n".join(train_exec["command"])
    outs = vertex_yaml["components"]["comp-train"]["outputDefinitions"]["artifacts"]
    assert set(outs) == {"model", "metrics"}  # the same outputs as the local train step


def test_vertex_yaml_data_comes_from_the_schedule_time(vertex_yaml):
    tasks = vertex_yaml["root"]["dag"]["tasks"]
    assert tasks["preprocess"]["inputs"]["parameters"]["data"] == {
        "taskOutputParameter": {"outputParameterKey": "Output", "producerTask": "resolve-data"}
    }
    resolve = tasks["resolve-data"]["inputs"]["parameters"]
    assert resolve["schedule_time"]["runtimeValue"]["constant"] == "{{$.pipeline_job_schedule_time_utc}}"
    assert resolve["template"] == {"componentInputParameter": "data"}
    params = vertex_yaml["root"]["inputDefinitions"]["parameters"]
    assert params["data"]["defaultValue"] == "data/movielens"


def test_vertex_and_local_targets_share_the_pipeline_parameters_and_the_local_one_is_unchanged(vertex_yaml, tmp_path):
    local = yaml.safe_load(open(compile_pipeline(str(tmp_path / "local.yaml"))))
    assert local["root"]["inputDefinitions"] == vertex_yaml["root"]["inputDefinitions"]
    assert local["root"]["outputDefinitions"] == vertex_yaml["root"]["outputDefinitions"]
    assert "resolve-data" not in local["root"]["dag"]["tasks"]
    assert "worker_pool_specs" not in local["components"]["comp-train"].get("inputDefinitions", {}).get(
        "parameters", {}
    )
    assert local["pipelineInfo"]["name"] == vertex_yaml["pipelineInfo"]["name"] == "persia-hybrid-training"


def test_vertex_yaml_deploys_a_newly_blessed_model_only_when_an_endpoint_is_given(vertex_yaml, tmp_path):
    comps = vertex_yaml["components"]
    bless_dag = comps[vertex_yaml["root"]["dag"]["tasks"]["condition-1"]["componentRef"]["name"]]["dag"]
    cond = bless_dag["tasks"]["condition-2"]
    assert cond["triggerPolicy"]["condition"] == "inputs.parameter_values['pipelinechannel--deploy_endpoint'] != ''"
    task = comps[cond["componentRef"]["name"]]["dag"]["tasks"]["deploy"]
    params = task["inputs"]["parameters"]
    assert params["blessed_model"]["componentInputParameter"] == "pipelinechannel--bless-model-Output"
    assert cond["inputs"]["parameters"]["pipelinechannel--bless-model-Output"]["taskOutputParameter"] == {
        "outputParameterKey": "Output",
        "producerTask": "bless-model",
    }
    assert params["endpoint"]["componentInputParameter"] == "pipelinechannel--deploy_endpoint"
    assert params["registry_model"]["componentInputParameter"] == "pipelinechannel--registry_model"
    assert params["machine_type"]["componentInputParameter"] == "pipelinechannel--serving_machine_type"
    assert params["location"]["runtimeValue"]["constant"] == "europe-west4"
    assert params["serving_image"]["runtimeValue"]["constant"] == IMAGE
    local = yaml.safe_load(open(compile_pipeline(str(tmp_path / "local.yaml"))))
    assert "comp-deploy" not in local["components"]  # local runs cannot reach Vertex AI: the parameter is ignored


def test_vertex_compile_without_an_image_fails_naming_persia_base_image(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("PERSIA_BASE_IMAGE", raising=False)
    with pytest.raises(ValueError, match="PERSIA_BASE_IMAGE"):
        compile_pipeline(str(tmp_path / "v.yaml"), "vertex")
    with pytest.raises(SystemExit) as e:
        compile_main(["--target", "vertex", "--output", str(tmp_path / "v.yaml")])
    assert e.value.code == 2 and "PERSIA_BASE_IMAGE" in capsys.readouterr().err
    assert not (tmp_path / "v.yaml").exists()


def test_vertex_compile_cli_reads_persia_variables_and_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("PERSIA_BASE_IMAGE", IMAGE)
    monkeypatch.setenv("PERSIA_PS_MACHINE_TYPE", "n2-highmem-80")
    monkeypatch.setenv("PERSIA_SHARDS_PER_SERVER", "2")
    out = tmp_path / "v.yaml"
    assert (
        compile_main(
            [
                "--target",
                "vertex",
                "--output",
                str(out),
                "--accelerator-type",
                "",
                "--accelerator-count",
                "0",
                "--nn-machine-type",
                "n1-standard-16",
            ]
        )
        == 0
    )
    pools = json.loads(
        yaml.safe_load(open(out))["root"]["dag"]["tasks"]["train"]["inputs"]["parameters"]["worker_pool_specs"][
            "runtimeValue"
        ]["constant"]
    )
    assert pools[0]["machineSpec"] == {"machineType": "n1-standard-16"}
    assert pools[2]["machineSpec"] == {"machineType": "n2-highmem-80"}
    args = pools[2]["containerSpec"]["args"]
    assert args[args.index("--shards-per-server") + 1] == "2"
    monkeypatch.setenv("PERSIA_ACCELERATOR_COUNT", "two")
    with pytest.raises(ValueError, match="PERSIA_ACCELERATOR_COUNT"):
        vertex.VertexSettings.from_env()


def test_vertex_custom_job_counts_follow_the_run_config_and_paths_use_the_gcs_mount(tmp_path):
    from support import tiny_config

    cfg = tiny_config(num_workers=3).with_overrides({"embedding.num_shards": 4})
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "run_config.yaml").write_text(cfg.to_yaml())
    template = json.dumps(_settings(shards_per_server=2).worker_pool_specs())
    specs, base = custom_job.custom_job_request(
        template, "gs://b/root/pre/dataset", str(shards), "gs://b/root/train/model", ps_token_secret=""
    )
    assert [s["replicaCount"] for s in specs] == [1, 2, 2]
    args = specs[0]["containerSpec"]["args"]
    assert args[args.index("--data") + 1] == "/gcs/b/root/pre/dataset"
    assert args[args.index("--out") + 1] == "/gcs/b/root/train/model"
    assert args[args.index("--control") + 1] == "/gcs/b/root/train/model_job/control"
    assert base == "gs://b/root/train/model_job"
    tokens = {e["value"] for s in specs for e in s["containerSpec"]["env"] if e["name"] == "PERSIA_PS_TOKEN"}
    assert len(tokens) == 1 and len(tokens.pop()) == 32  # one fresh token shared by every pool
    one = custom_job.fill_worker_pool_specs(
        json.loads(template),
        {p: "/x" for p in custom_job.PLACEHOLDERS},
        1,
        1,
        {"PERSIA_PS_TOKEN_SECRET": "projects/p/secrets/t/versions/1"},
    )
    assert one[1] == {} and one[2]["containerSpec"]["env"] == [
        {"name": "PERSIA_PS_TOKEN_SECRET", "value": "projects/p/secrets/t/versions/1"}
    ]
    ckpt, _ = custom_job.custom_job_request(
        template, "gs://b/root/pre/dataset", str(shards), "gs://b/root/train/model", checkpoint_every_s=600.0
    )
    for spec in (s for s in ckpt if s):  # every pool: workers write checkpoints, every replica resumes from them
        tail = spec["containerSpec"]["args"][spec["containerSpec"]["args"].index("--") :]
        assert tail[:3] == ["--", "--checkpoint-dir", "/gcs/b/root/train/model/checkpoints"]
        assert tail[tail.index("--checkpoint-every-s") + 1] == "600.0"
    assert "--" not in specs[0]["containerSpec"]["args"]  # checkpoints off: no flags
    assert "--delta-dir" not in specs[2]["containerSpec"]["args"]  # deltas off: no flags
    # deltas: the replicas' entry point gets the folder (default <model>/deltas, or the pipeline's delta_dir),
    # before the "--" that starts the NN workers' own flags
    for delta_dir, want in (("", "/gcs/b/root/train/model/deltas"), ("gs://b/deltas/criteo", "/gcs/b/deltas/criteo")):
        both, _ = custom_job.custom_job_request(
            template,
            "gs://b/root/pre/dataset",
            str(shards),
            "gs://b/root/train/model",
            checkpoint_every_s=600.0,
            delta_dir=delta_dir,
            delta_every_s=30.0,
        )
        for spec in (s for s in both if s):
            args = spec["containerSpec"]["args"]
            i = args.index("--delta-dir")
            assert args[i : i + 4] == ["--delta-dir", want, "--delta-every-s", "30.0"] and i < args.index("--")
    # an embedding-worker pool: 3 NN workers x E = 4 over 6 processes per replica = 2 replicas of pool 3
    (shards / "run_config.yaml").write_text(cfg.to_yaml())
    four = json.dumps(_settings(embedding_workers=4, embedding_workers_per_replica=6).worker_pool_specs())
    assert [s["replicaCount"] for s in json.loads(four)] == [1, 2, 4, 2]
    ews, _ = custom_job.custom_job_request(four, "gs://b/d", str(shards), "gs://b/m")
    assert [s["replicaCount"] for s in ews] == [1, 2, 4, 2]
    assert ews[3]["machineSpec"] == {"machineType": "n2-standard-32"}
    args = ews[3]["containerSpec"]["args"]
    assert args[args.index("--embedding-workers") + 1] == "4" and ews[3]["containerSpec"]["command"] == ENTRY
    assert args[args.index("--embedding-workers-per-replica") + 1] == "6"
    with pytest.raises(ValueError, match="embedding workers per replica 5"):
        five = _settings(embedding_workers=4, embedding_workers_per_replica=5).worker_pool_specs()
        custom_job.custom_job_request(json.dumps(five), "gs://b/d", str(shards), "gs://b/m")
    bad = tiny_config(num_workers=3).with_overrides({"embedding.num_shards": 3})
    (shards / "run_config.yaml").write_text(bad.to_yaml())
    with pytest.raises(ValueError, match="multiple"):
        custom_job.custom_job_request(template, "gs://b/d", str(shards), "gs://b/m")


@pytest.fixture
def offline_vertex(monkeypatch, offline_aiplatform):
    """Anonymous credentials and the gapic JobServiceClient replaced at its boundary; yields the requests."""
    from google.cloud.aiplatform_v1.services.job_service import client as job_client
    from google.cloud.aiplatform_v1.types import custom_job as custom_job_types
    from google.cloud.aiplatform_v1.types import job_state

    sent = []

    def create_custom_job(self, request=None, *, parent=None, custom_job=None, **kw):
        sent.append({"parent": parent or request.parent, "custom_job": custom_job or request.custom_job})
        job = custom_job_types.CustomJob(custom_job or request.custom_job)
        job.name = f"{parent}/customJobs/123"
        job.state = job_state.JobState.JOB_STATE_SUCCEEDED
        return job

    def get_custom_job(self, request=None, *, name=None, **kw):
        job = custom_job_types.CustomJob(sent[-1]["custom_job"])
        job.name = name or request.name
        job.state = job_state.JobState.JOB_STATE_SUCCEEDED
        return job

    monkeypatch.setattr(job_client.JobServiceClient, "create_custom_job", create_custom_job)
    monkeypatch.setattr(job_client.JobServiceClient, "get_custom_job", get_custom_job)
    return sent


def test_vertex_launcher_sends_the_custom_job_request_and_logs_the_models_metrics(offline_vertex, tmp_path):
    from kfp import dsl
    from support import tiny_config

    shards, model, dataset = tmp_path / "shards", tmp_path / "model", tmp_path / "dataset"
    shards.mkdir()
    model.mkdir()
    (shards / "run_config.yaml").write_text(tiny_config(num_workers=2).to_yaml())
    summary = {"samples_per_s": 10.0, "max_staleness": 2, "final_loss": 0.5, "wall_seconds": 3.0}
    (model / "manifest.json").write_text(json.dumps({"num_shards": 2, "summary": summary}))  # as the primary would
    metrics = dsl.Metrics(uri=str(tmp_path / "metrics"))
    out_model = dsl.Model(uri=str(model))
    vertex_train.python_func(
        dataset=dsl.Dataset(uri=str(dataset)),
        shards=dsl.Artifact(uri=str(shards)),
        model=out_model,
        metrics=metrics,
        worker_pool_specs=json.dumps(_settings().worker_pool_specs()),
        location="europe-west4",
        service_account="trainer@test-project.iam.gserviceaccount.com",
    )
    assert len(offline_vertex) == 1
    req = offline_vertex[0]
    assert req["parent"] == "projects/test-project/locations/europe-west4"
    spec = req["custom_job"].job_spec
    assert spec.service_account == "trainer@test-project.iam.gserviceaccount.com"
    assert spec.base_output_directory.output_uri_prefix == str(model) + "_job"
    pools = spec.worker_pool_specs
    assert [p.replica_count for p in pools] == [1, 1, 2]
    assert pools[0].machine_spec.machine_type == "a2-highgpu-1g" and pools[0].machine_spec.accelerator_count == 1
    assert pools[2].machine_spec.machine_type == "m1-ultramem-40"
    assert [list(p.container_spec.command) for p in pools] == [ENTRY] * 3
    assert list(pools[2].container_spec.args)[:2] == ["--config", f"{shards}/run_config.yaml"]
    assert metrics.metadata["samples_per_s"] == 10.0 and out_model.metadata["num_shards"] == 2


@pytest.mark.parametrize(
    "template, schedule, want",
    [
        ("gs://b/criteo/dt={date-1d}/", "2025-03-02T03:00:00Z", "gs://b/criteo/dt=2025-03-01/"),
        ("gs://b/t/{date:%Y/%m/%d}/{date-2h:%H}", "2025-03-02T01:30:00.123456789Z", "gs://b/t/2025/03/02/23"),
        ("gs://b/t/{date+1d:%Y%m%d}", "2025-12-31T23:00:00+00:00", "gs://b/t/20260101"),
        ("gs://b/t/{date}", "2025-03-02T01:00:00+02:00", "gs://b/t/2025-03-01"),
        ("data/movielens", "2025-03-02T03:00:00Z", "data/movielens"),
    ],
)
def test_vertex_schedule_time_fills_the_date_partition_of_the_data_path(template, schedule, want):
    assert data_path.resolve_data_path(template, schedule) == want


def test_vertex_unscheduled_run_uses_the_current_time_and_bad_tokens_fail():
    now = dt.datetime(2025, 6, 1, 12, tzinfo=dt.UTC)
    assert data_path.resolve_data_path("x/{date-1d}", "", now=now) == "x/2025-05-31"
    assert data_path.resolve_data_path("x/{date}", "{{$.pipeline_job_schedule_time_utc}}", now=now) == "x/2025-06-01"
    with pytest.raises(ValueError, match="date token"):
        data_path.resolve_data_path("x/{date-1w}", "2025-03-02T03:00:00Z")
    with pytest.raises(ValueError, match="RFC 3339"):
        data_path.resolve_data_path("x/{date}", "yesterday")
    assert (
        resolve_data.python_func(
            template="gs://b/{date}",
            schedule_time="2025-03-02T03:00:00Z",
            blessed_dir="gs://b/blessed",
            warm_start_from="gs://b/blessed",
        )
        == "gs://b/2025-03-02"
    )
    # a run started from the UI with the compiled default blessed_dir fails here, before any training
    with pytest.raises(ValueError, match="inside the run's container"):
        resolve_data.python_func(template="gs://b/x", schedule_time="", blessed_dir="local_outputs/blessed")
    with pytest.raises(ValueError, match="warm_start_from"):
        resolve_data.python_func(
            template="gs://b/x", schedule_time="", blessed_dir="/gcs/b/blessed", warm_start_from="local_outputs/blessed"
        )


def test_vertex_settings_refuse_a_gpu_on_the_wrong_machine_and_allow_cpu_only_nn_pools():
    with pytest.raises(ValueError, match="a2-"):
        vertex.VertexSettings.from_env({"PERSIA_BASE_IMAGE": IMAGE, "PERSIA_NN_MACHINE_TYPE": "n2-standard-8"})
    with pytest.raises(ValueError, match="one rank per GPU"):
        vertex.VertexSettings.from_env({"PERSIA_BASE_IMAGE": IMAGE, "PERSIA_RANKS_PER_REPLICA": "8"})
    cpu = vertex.VertexSettings.from_env(
        {"PERSIA_BASE_IMAGE": IMAGE, "PERSIA_ACCELERATOR_TYPE": "none", "PERSIA_NN_MACHINE_TYPE": "n2-standard-8"}
    )
    assert (cpu.accelerator_type, cpu.accelerator_count) == ("", 0)
    assert "acceleratorType" not in cpu.worker_pool_specs()[0]["machineSpec"]
    # CPU-only with the default machine: a CPU machine, not the GPU default; a GPU-only family named: refused
    cpu = vertex.VertexSettings.from_env({"PERSIA_BASE_IMAGE": IMAGE}, accelerator_type="", accelerator_count=0)
    assert cpu.worker_pool_specs()[0]["machineSpec"] == {"machineType": vertex.CPU_NN_MACHINE_TYPE}
    assert vertex.VertexSettings(image=IMAGE).nn_machine_type == "a2-highgpu-1g"
    with pytest.raises(ValueError, match="carries GPUs, but the NN pools are CPU-only"):
        vertex.VertexSettings.from_env(
            {"PERSIA_BASE_IMAGE": IMAGE, "PERSIA_ACCELERATOR_TYPE": "none", "PERSIA_NN_MACHINE_TYPE": "a2-highgpu-1g"}
        )
    eight = vertex.VertexSettings.from_env(
        {
            "PERSIA_BASE_IMAGE": IMAGE,
            "PERSIA_NN_MACHINE_TYPE": "a3-highgpu-8g",
            "PERSIA_ACCELERATOR_TYPE": "NVIDIA_H100_80GB",
            "PERSIA_ACCELERATOR_COUNT": "8",
            "PERSIA_RANKS_PER_REPLICA": "8",
        }
    )
    assert eight.worker_pool_specs()[0]["machineSpec"]["acceleratorCount"] == 8


@pytest.mark.parametrize(
    "env, says",
    [
        ({"PERSIA_BASE_IMAGE": "persia-kfp:local"}, "not a registry image"),
        ({"PERSIA_CUDA_IMAGE": "persia-kfp-cuda"}, "not a registry image"),
        ({"PERSIA_VERTEX_REGION": "us-central"}, "not a Google Cloud region"),
        ({"PERSIA_PS_MACHINE_TYPE": "highmem"}, "not a Compute Engine machine type"),
        ({"PERSIA_ACCELERATOR_COUNT": "3"}, "a2-highgpu-1g carries 1 GPU(s), not accelerator_count=3"),
        (
            {"PERSIA_ACCELERATOR_TYPE": "nvidia-tesla-a100", "PERSIA_NN_MACHINE_TYPE": "n2-standard-8"},
            "NVIDIA_TESLA_A100 GPUs come only on a2-* machines",
        ),
        ({"PERSIA_ACCELERATOR_TYPE": "NVIDIA_GTX_1080"}, "not a GPU this project knows"),
    ],
)
def test_vertex_settings_refuse_values_vertex_would_refuse_at_job_start(env, says):
    # before: compiled without a word, and the job failed on Vertex AI
    with pytest.raises(ValueError, match=re.escape(says)):
        vertex.VertexSettings.from_env({"PERSIA_BASE_IMAGE": IMAGE, "PERSIA_CUDA_IMAGE": CUDA_IMAGE, **env})


def test_vertex_settings_take_a_lower_case_gpu_name_and_warn_of_gpus_without_a_cuda_image():
    s = vertex.VertexSettings.from_env(
        {"PERSIA_BASE_IMAGE": IMAGE, "PERSIA_CUDA_IMAGE": CUDA_IMAGE, "PERSIA_ACCELERATOR_TYPE": "nvidia_tesla_a100"}
    )
    assert s.worker_pool_specs()[0]["machineSpec"]["acceleratorType"] == "NVIDIA_TESLA_A100"
    for machine in ("e2-medium", "c3-standard-4-lssd", "n2-custom-8-65536"):  # other valid machine names
        assert (
            vertex.VertexSettings.from_env(
                {"PERSIA_BASE_IMAGE": IMAGE, "PERSIA_ACCELERATOR_TYPE": "none", "PERSIA_PS_MACHINE_TYPE": machine}
            ).ps_machine_type
            == machine
        )
    with pytest.warns(UserWarning, match="no CUDA image is set") as warned:
        vertex.VertexSettings.from_env({"PERSIA_BASE_IMAGE": IMAGE})
    assert warned[0].filename.endswith(".py")  # a file the user can open (before: "<string>", a generated __init__)
