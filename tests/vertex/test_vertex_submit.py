"""pipelines.submit offline: the exact Vertex AI requests for a run, a schedule and a Model Registry upload, built
with anonymous credentials and the gapic clients replaced at their boundary; bad input fails before sending."""

import json

import pytest
import yaml
from apache_beam.options.pipeline_options import GoogleCloudOptions, PipelineOptions, StandardOptions, WorkerOptions

from components import endpoint
from pipelines import jobs, parameters, schedules, submit
from pipelines.persia_pipeline import compile_pipeline
from pipelines.vertex import VertexSettings

PROJECT, REGION, ROOT = "test-project", "us-central1", "gs://persia-test/pipeline-root"
IMAGE = "us-central1-docker.pkg.dev/test-project/persia/persia-kfp:abc123"
SA = "pipelines@test-project.iam.gserviceaccount.com"
TARGET = ["--project", PROJECT, "--region", REGION]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / "persia_pipeline_vertex.yaml"
    return compile_pipeline(str(path), "vertex", VertexSettings(image=IMAGE))


class _Done:
    """A long-running operation already done, as the gapic clients return one: ``result()`` gives ``result``."""

    def __init__(self, parent: str, result=None):
        self._result = result
        self.operation = type("Op", (), {"name": f"{parent}/operations/1"})()

    def result(self, timeout=None):
        return self._result


@pytest.fixture
def gapic(monkeypatch, offline_aiplatform, gcs_emulator):
    """Anonymous credentials; Pipeline/Schedule/Model service clients record requests instead of sending;
    Cloud Storage (the pipeline root's bucket) is the emulator."""
    from google.cloud.aiplatform_v1.services.model_service import client as model_client
    from google.cloud.aiplatform_v1.services.pipeline_service import client as pipeline_client
    from google.cloud.aiplatform_v1.services.schedule_service import client as schedule_client
    from google.cloud.aiplatform_v1.types import model as model_types
    from google.cloud.aiplatform_v1.types import model_service
    from google.cloud.aiplatform_v1.types import pipeline_job as pj_types
    from google.cloud.aiplatform_v1.types import schedule as schedule_types

    sent = []
    parent = f"projects/{PROJECT}/locations/{REGION}"
    schedules = {}

    def record(method, **kw):
        sent.append((method, kw))

    def create_pipeline_job(self, request=None, *, parent=None, pipeline_job=None, pipeline_job_id=None, **kw):
        record("create_pipeline_job", parent=parent, pipeline_job=pipeline_job, pipeline_job_id=pipeline_job_id)
        job = pj_types.PipelineJob(pipeline_job)
        job.name = f"{parent}/pipelineJobs/{pipeline_job_id}"
        return job

    def create_schedule(self, request=None, *, parent=None, schedule=None, **kw):
        record("create_schedule", parent=parent, schedule=schedule)
        s = schedule_types.Schedule(schedule)
        s.name = f"{parent}/schedules/42"
        s.state = schedule_types.Schedule.State.ACTIVE
        schedules[s.name] = s
        return s

    def get_schedule(self, request=None, *, name=None, **kw):
        name = name or request.name
        return schedules.get(name) or schedule_types.Schedule(
            name=name,
            display_name="nightly",
            cron="TZ=UTC 0 3 * * *",
            state=schedule_types.Schedule.State.ACTIVE,
            create_pipeline_job_request={"parent": parent, "pipeline_job": {"display_name": "x"}},
        )

    def list_schedules(self, request=None, **kw):
        record("list_schedules", request=request)
        return [get_schedule(self, name=f"{parent}/schedules/42")]

    def pause_schedule(self, request=None, *, name=None, **kw):
        record("pause_schedule", name=name or request.name)

    def resume_schedule(self, request=None, *, name=None, **kw):
        record("resume_schedule", name=name or request.name)

    def delete_schedule(self, request=None, *, name=None, **kw):
        record("delete_schedule", name=name or request.name)
        return _Done(parent)

    def upload_model(self, request=None, **kw):
        record("upload_model", request=request)
        return _Done(parent, model_service.UploadModelResponse(model=f"{parent}/models/7", model_version_id="3"))

    def get_model(self, request=None, *, name=None, **kw):
        return model_types.Model(  # as the API answers for a model uploaded with a serving container
            name=f"{parent}/models/7",
            version_id="3",
            display_name="persia-ctr",
            supported_deployment_resources_types=[model_types.Model.DeploymentResourcesType.DEDICATED_RESOURCES],
        )

    for cls, methods in (
        (pipeline_client.PipelineServiceClient, [create_pipeline_job]),
        (
            schedule_client.ScheduleServiceClient,
            [create_schedule, get_schedule, list_schedules, pause_schedule, resume_schedule, delete_schedule],
        ),
        (model_client.ModelServiceClient, [upload_model, get_model]),
    ):
        for m in methods:
            monkeypatch.setattr(cls, m.__name__, m)
    return sent


BLESSED = [
    "--param",
    "blessed_dir=gs://persia-test/blessed/criteo",
    "--param",
    "warm_start_from=gs://persia-test/blessed/criteo",
]


def _runtime(job):
    return {k: v for k, v in job.runtime_config.parameter_values.items()}


def test_submit_run_sends_one_create_pipeline_job_request_with_typed_parameters(template, gapic, capsys):
    rc = submit.main(
        [
            "run",
            *TARGET,
            "--pipeline-root",
            ROOT,
            "--template",
            template,
            "--service-account",
            SA,
            "--param",
            "data=gs://persia-test/criteo/dt={date-1d}/",
            "--param",
            "config=criteo",
            "--param",
            "num_parameter_servers=4",
            "--param",
            "epochs=1",
            *BLESSED,
            "--no-cache",
            "--label",
            "team=ranking",
            "--display-name",
            "persia-manual",
        ]
    )
    assert rc == 0
    ((method, req),) = gapic
    assert method == "create_pipeline_job" and req["parent"] == f"projects/{PROJECT}/locations/{REGION}"
    job = req["pipeline_job"]
    assert job.display_name == "persia-manual" and job.service_account == SA
    assert job.runtime_config.gcs_output_directory == ROOT
    params = _runtime(job)
    assert params["data"] == "gs://persia-test/criteo/dt={date-1d}/" and params["config"] == "criteo"
    assert params["num_parameter_servers"] == 4 and params["epochs"] == 1
    assert params["blessed_dir"] == params["warm_start_from"] == "gs://persia-test/blessed/criteo"
    assert dict(job.labels)["team"] == "ranking"
    tasks = job.pipeline_spec["root"]["dag"]["tasks"]
    assert all(not t.get("cachingOptions", {}).get("enableCache", False) for t in tasks.values())
    assert capsys.readouterr().out.strip().startswith(f"projects/{PROJECT}/locations/{REGION}/pipelineJobs/")
    from persia_core import io

    assert io.exists("gs://persia-test")  # submit made the pipeline root's bucket (in the emulator)


@pytest.mark.parametrize(
    "param, message",
    [
        ("nope=1", "unknown pipeline parameter"),
        ("num_parameter_servers=two", "'num_parameter_servers': expected an integer"),
        ("epochs=1.5", "'epochs': expected an integer"),
        ("data", "NAME=VALUE"),
    ],
)
def test_submit_rejects_unknown_or_ill_typed_parameters_before_sending(template, gapic, param, message, capsys):
    with pytest.raises(SystemExit) as e:
        submit.main(["run", *TARGET, "--pipeline-root", ROOT, "--template", template, "--param", param])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert gapic == []


@pytest.mark.parametrize(
    "params, message",
    [
        ([], "blessed_dir 'local_outputs/blessed' is a folder inside the run's container"),
        (["--param", "blessed_dir=/tmp/blessed"], "blessed_dir '/tmp/blessed'"),
        ([*BLESSED[:2], "--param", "warm_start_from=local_outputs/blessed"], "warm_start_from 'local_outputs/blessed'"),
        ([*BLESSED, "--param", "data=gs://b/dt={date-1x}/"], "unrecognized date token"),
        ([*BLESSED, "--param", "data=gs://b/dt={data}/"], "{data} is not a token"),
        ([*BLESSED, "--param", "data=gs://b/dt={date-100000000d}/"], "a date offset beyond the calendar"),
        ([*BLESSED, "--param", "num_nn_workers=-1"], "num_nn_workers must be >= 0"),
        (
            [*BLESSED, "--param", "epochs=-2"],
            "epochs must be >= 0 (0 = the run config's value, or -1 for epochs: auto)",
        ),
        ([*BLESSED, "--param", "min_auc=2"], "min_auc must be in [0, 1]"),
        ([*BLESSED, "--param", "max_ne=0"], "max_ne must be > 0"),
        ([*BLESSED, "--param", "lr_margin=-1"], "lr_margin must be >= 0"),
        ([*BLESSED, "--param", "embedding_staleness=-7"], "embedding_staleness must be >= 0, or -1"),
        ([*BLESSED, "--param", "delta_dir=/tmp/deltas"], "delta_dir '/tmp/deltas' is a folder inside the run's"),
        ([*BLESSED, "--param", "delta_every_s=-5"], "delta_every_s must be a number of seconds >= 0"),
        ([*BLESSED, "--param", "delta_every_s=nan"], "delta_every_s must be a number of seconds >= 0"),
        (
            [*BLESSED, "--param", "config=critea"],
            "config 'critea' is not a shipped run config ['criteo', 'dcnv2', 'dcnv2_mlperf', 'movielens']",
        ),
    ],
)
def test_submit_refuses_values_that_would_only_fail_or_be_lost_on_vertex(template, gapic, params, message, capsys):
    with pytest.raises(SystemExit) as e:
        submit.main(["run", *TARGET, "--pipeline-root", ROOT, "--template", template, *params])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert gapic == []


def test_submit_python_api_checks_types_of_given_values(template, gapic):
    target = parameters.Target(PROJECT, REGION, ROOT)
    with pytest.raises(ValueError, match="'max_rows': expected an integer"):
        jobs.submit(template, target, {"max_rows": "10"})
    with pytest.raises(ValueError, match="'data': expected a string"):
        jobs.submit(template, target, {"data": 3})
    with pytest.raises(ValueError, match="pipeline-root"):
        parameters.Target(PROJECT, REGION, "/local/root")
    with pytest.raises(ValueError, match="project"):
        parameters.Target("Bad_Project", REGION)
    assert gapic == []


def test_submit_refuses_a_template_compiled_for_the_local_target(tmp_path, gapic, monkeypatch):
    monkeypatch.delenv("PERSIA_BASE_IMAGE", raising=False)
    local = compile_pipeline(str(tmp_path / "local.yaml"))
    with pytest.raises(ValueError, match="local target"):
        jobs.submit(local, parameters.Target(PROJECT, REGION, ROOT))
    with pytest.raises(FileNotFoundError, match="make compile"):
        jobs.submit(str(tmp_path / "missing.yaml"), parameters.Target(PROJECT, REGION, ROOT))
    assert gapic == []


def test_schedule_create_sends_cron_time_zone_concurrency_and_the_run_request(template, gapic, capsys):
    rc = submit.main(
        [
            "schedule",
            "create",
            *TARGET,
            "--pipeline-root",
            ROOT,
            "--template",
            template,
            "--name",
            "persia-nightly",
            "--cron",
            "0 3 * * *",
            "--time-zone",
            "Europe/Berlin",
            "--max-concurrent-runs",
            "1",
            "--max-runs",
            "30",
            "--service-account",
            SA,
            "--param",
            "data=gs://persia-test/criteo/dt={date-1d}/",
            *BLESSED,
        ]
    )
    assert rc == 0
    ((method, req),) = gapic
    assert method == "create_schedule" and req["parent"] == f"projects/{PROJECT}/locations/{REGION}"
    s = req["schedule"]
    assert s.display_name == "persia-nightly" and s.cron == "TZ=Europe/Berlin 0 3 * * *"
    assert s.max_concurrent_run_count == 1 and s.max_run_count == 30
    run = s.create_pipeline_job_request
    assert run.parent == f"projects/{PROJECT}/locations/{REGION}"
    assert run.pipeline_job.service_account == SA
    assert _runtime(run.pipeline_job)["data"] == "gs://persia-test/criteo/dt={date-1d}/"
    assert run.pipeline_job.runtime_config.gcs_output_directory == ROOT
    assert capsys.readouterr().out.strip() == f"projects/{PROJECT}/locations/{REGION}/schedules/42"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--cron", "0 3 * *"], "5 fields"),
        (["--cron", "0 3 * * *", "--time-zone", "Mars/Olympus"], "IANA time zone"),
        (["--cron", "TZ=UTC 0 3 * * *"], "--time-zone"),
        (["--cron", "0 3 * * *", "--max-concurrent-runs", "0"], "max-concurrent-runs"),
        (["--cron", "0 3 * * *", "--start-time", "tomorrow"], "RFC 3339"),
        (["--cron", "0 25 * * *"], "hour '25' must lie in 0-23"),
        (["--cron", "60 3 * * *"], "minute '60' must lie in 0-59"),
        (["--cron", "0 3 0 * *"], "day-of-month '0' must lie in 1-31"),
        (["--cron", "0 3 * 13 *"], "month '13' must lie in 1-12"),
        (["--cron", "0 3 * * 8"], "day-of-week '8' must lie in 0-7"),
        (["--cron", "*/0 3 * * *"], "bad step '0'"),
        (["--cron", "0 5-2 * * *"], "runs backwards"),
    ],
)
def test_schedule_create_rejects_bad_settings_before_sending(template, gapic, extra, message, capsys):
    with pytest.raises(SystemExit):
        submit.main(
            ["schedule", "create", *TARGET, "--pipeline-root", ROOT, "--template", template, "--name", "n", *extra]
        )
    assert message in capsys.readouterr().err and gapic == []


def test_cron_fields_in_range_steps_lists_and_names_are_accepted():
    for cron in ("0 3 * * *", "*/15 0-23/2 1,15 jan-jun mon-fri", "5 4 * * sun", "0 0 29 2 7", "0,30 9-17 * * 1-5"):
        assert schedules.cron_with_time_zone(cron, "UTC") == f"TZ=UTC {cron}"


def test_schedule_list_pause_resume_delete_address_the_schedule(gapic, capsys):
    name = f"projects/{PROJECT}/locations/{REGION}/schedules/42"
    assert submit.main(["schedule", "list", *TARGET, "--filter", 'display_name="nightly"']) == 0
    assert gapic[0][0] == "list_schedules" and gapic[0][1]["request"]["filter"] == 'display_name="nightly"'
    assert name in capsys.readouterr().out
    for action in ("pause", "resume", "delete"):
        assert submit.main(["schedule", action, *TARGET, "42"]) == 0
    assert [(m, kw.get("name")) for m, kw in gapic[1:]] == [
        ("pause_schedule", name),
        ("resume_schedule", name),
        ("delete_schedule", name),
    ]


def test_register_model_sends_the_upload_model_request_for_the_blessed_folder(gapic, capsys):
    rc = submit.main(
        [
            "register-model",
            *TARGET,
            "--artifact-uri",
            "/gcs/persia-test/blessed/current",
            "--display-name",
            "persia-ctr",
            "--serving-image",
            IMAGE,
            "--parent-model",
            f"projects/{PROJECT}/locations/{REGION}/models/7",
            "--alias",
            "blessed",
            "--label",
            "run=nightly",
            "--description",
            "nightly blessed model",
        ]
    )
    assert rc == 0
    ((method, req),) = gapic
    r = req["request"]
    assert method == "upload_model" and r.parent == f"projects/{PROJECT}/locations/{REGION}"
    assert r.parent_model == f"projects/{PROJECT}/locations/{REGION}/models/7"
    m = r.model
    assert m.display_name == "persia-ctr" and m.artifact_uri == "gs://persia-test/blessed/current"
    assert m.container_spec.image_uri == IMAGE
    c = m.container_spec  # deployable as it is: persia serve on Vertex AI's port, routes and model copy
    assert list(c.command) == ["python", "-m", "persia_core", "serve", "--host", "0.0.0.0"]
    assert (c.predict_route, c.health_route, [p.container_port for p in c.ports]) == ("/predict", "/health", [8080])
    assert set(m.version_aliases) == {"default", "blessed"}
    assert dict(m.labels) == {"framework": "persia-kfp", "run": "nightly"}
    assert capsys.readouterr().out.strip() == f"projects/{PROJECT}/locations/{REGION}/models/7@3"
    with pytest.raises(ValueError, match="gs://"):
        endpoint.upload_model("/local/model", "x", PROJECT, REGION, IMAGE)


def test_submit_dataflow_flags_become_the_beam_args_parameter(template, gapic):
    submit.main(
        [
            "run",
            *TARGET,
            "--pipeline-root",
            ROOT,
            "--template",
            template,
            "--dataflow",
            "--dataflow-image",
            IMAGE,
            "--dataflow-max-workers",
            "25",
            "--dataflow-machine-type",
            "n2-highmem-8",
            *BLESSED,
        ]
    )
    ((method, req),) = gapic
    args = json.loads(_runtime(req["pipeline_job"])["beam_args"])
    opts = PipelineOptions(args)
    gcp = opts.view_as(GoogleCloudOptions)
    assert opts.view_as(StandardOptions).runner == "DataflowRunner"
    assert (gcp.project, gcp.region, gcp.temp_location) == (PROJECT, REGION, ROOT + "/tmp")
    w = opts.view_as(WorkerOptions)
    assert (w.machine_type, w.max_num_workers, w.sdk_container_image) == ("n2-highmem-8", 25, IMAGE)


def test_dataflow_beam_args_build_the_runner_options_and_check_them():
    args = parameters.dataflow_beam_args(
        PROJECT,
        "europe-west1",
        "gs://b/tmp",
        "n2-standard-8",
        40,
        IMAGE,
        service_account="df@test-project.iam.gserviceaccount.com",
        subnetwork="regions/europe-west1/subnetworks/default",
    )
    opts = PipelineOptions(args)
    gcp, w = opts.view_as(GoogleCloudOptions), opts.view_as(WorkerOptions)
    assert opts.view_as(StandardOptions).runner == "DataflowRunner"
    assert (gcp.project, gcp.region, gcp.temp_location, gcp.staging_location) == (
        PROJECT,
        "europe-west1",
        "gs://b/tmp",
        "gs://b/tmp",
    )
    assert gcp.service_account_email == "df@test-project.iam.gserviceaccount.com"
    assert (w.machine_type, w.max_num_workers, w.sdk_container_image) == ("n2-standard-8", 40, IMAGE)
    assert w.subnetwork == "regions/europe-west1/subnetworks/default"
    with pytest.raises(ValueError, match="temp-location"):
        parameters.dataflow_beam_args(PROJECT, REGION, "/tmp", sdk_container_image=IMAGE)
    with pytest.raises(ValueError, match="sdk-container-image"):
        parameters.dataflow_beam_args(PROJECT, REGION, "gs://b/tmp")


def test_upload_template_posts_the_yaml_to_the_kfp_registry(template, monkeypatch):
    from kfp.registry import ApiAuth, registry_client

    calls = []

    class Resp:
        status_code = 200
        text = "persia-hybrid-training/sha256:abc"

        def raise_for_status(self):
            pass

    def post(**kw):
        kw["content"] = kw["files"]["content"].read()  # the open YAML file
        calls.append(kw)
        return Resp()

    monkeypatch.setattr(registry_client.requests, "post", post)
    host = "https://us-central1-kfp.pkg.dev/test-project/persia"
    name, version = jobs.upload_template(host, template, ["v1", "latest"], "nightly build", auth=ApiAuth("t"))
    assert (name, version) == ("persia-hybrid-training", "sha256:abc")
    (call,) = calls
    assert call["url"] == host and call["headers"] == {"description": "nightly build"}
    assert yaml.safe_load(call["content"])["pipelineInfo"]["name"] == "persia-hybrid-training"
    assert call["data"] == {"tags": "v1,latest"} and call["auth"]._token == "t"


def test_submit_without_credentials_says_so_in_one_line(template, monkeypatch, capsys):
    from google.auth.exceptions import DefaultCredentialsError

    def no_credentials(*a, **k):
        raise DefaultCredentialsError("Your default credentials were not found.\nTo set up ADC, see ...")

    monkeypatch.setattr(submit, "submit", no_credentials)
    rc = submit.main(["run", *TARGET, "--pipeline-root", ROOT, "--template", template, *BLESSED])
    err = capsys.readouterr().err
    assert rc == 1 and len(err.strip().splitlines()) == 1
    assert "DefaultCredentialsError: Your default credentials were not found." in err and "Traceback" not in err


@pytest.fixture
def endpoints(gapic, monkeypatch):
    """The Endpoint service records create/deploy requests instead of sending them (into ``gapic``'s list)."""
    from google.cloud.aiplatform_v1.services.endpoint_service import client as endpoint_client
    from google.cloud.aiplatform_v1.types import endpoint as endpoint_types
    from google.cloud.aiplatform_v1.types import endpoint_service

    parent = f"projects/{PROJECT}/locations/{REGION}"

    def create_endpoint(self, request=None, *, parent=None, endpoint=None, **kw):
        gapic.append(("create_endpoint", {"parent": parent, "endpoint": endpoint}))
        return _Done(parent, endpoint_types.Endpoint(name=f"{parent}/endpoints/55", display_name=endpoint.display_name))

    def get_endpoint(self, request=None, *, name=None, **kw):
        return endpoint_types.Endpoint(name=name or request.name, display_name="persia-ctr")

    def deploy_model(self, request=None, *, endpoint=None, deployed_model=None, traffic_split=None, **kw):
        gapic.append(
            ("deploy_model", {"endpoint": endpoint, "deployed_model": deployed_model, "traffic": traffic_split})
        )
        return _Done(parent, endpoint_service.DeployModelResponse(deployed_model={"id": "9"}))

    for m in (create_endpoint, get_endpoint, deploy_model):
        monkeypatch.setattr(endpoint_client.EndpointServiceClient, m.__name__, m)
    return gapic


def test_deploy_creates_an_endpoint_and_moves_all_traffic_to_the_model_version(endpoints, capsys):
    parent = f"projects/{PROJECT}/locations/{REGION}"
    rc = submit.main(
        [
            "deploy",
            *TARGET,
            "--model",
            f"{parent}/models/7@3",
            "--machine-type",
            "n2-highmem-8",
            "--min-replicas",
            "2",
            "--max-replicas",
            "4",
            "--service-account",
            SA,
        ]
    )
    assert rc == 0
    sent = [(m, kw) for m, kw in endpoints if m in ("create_endpoint", "deploy_model")]
    assert [m for m, _ in sent] == ["create_endpoint", "deploy_model"]
    created = sent[0][1]
    assert created["parent"] == parent and created["endpoint"].display_name == "persia-ctr"
    deployed = sent[1][1]
    assert deployed["endpoint"] == f"{parent}/endpoints/55"
    d = deployed["deployed_model"]
    assert d.model == f"{parent}/models/7@3" and d.service_account == SA
    r = d.dedicated_resources
    assert (r.machine_spec.machine_type, r.min_replica_count, r.max_replica_count) == ("n2-highmem-8", 2, 4)
    assert dict(deployed["traffic"]) == {"0": 100}  # all traffic to the model being deployed
    assert capsys.readouterr().out.strip() == f"{parent}/endpoints/55"
    # an existing endpoint: no new one; a bad model name or replica counts are refused before anything is sent
    endpoints.clear()
    assert submit.main(["deploy", *TARGET, "--model", f"{parent}/models/7", "--endpoint", "55"]) == 0
    assert [m for m, _ in endpoints if m in ("create_endpoint", "deploy_model")] == ["deploy_model"]
    for bad, says in (
        (["--model", "models/7"], "expected projects/"),
        (["--model", f"{parent}/models/7", "--min-replicas", "0"], "replicas"),
        (["--model", "projects//models/"], "expected projects/"),
        (["--model", "projects/p/locations/europe-west4/models/7@3"], "is in europe-west4, not in the region"),
    ):
        endpoints.clear()
        with pytest.raises(SystemExit):
            submit.main(["deploy", *TARGET, *bad])
        assert endpoints == [] and says in capsys.readouterr().err


def test_pipeline_deploy_step_registers_the_blessed_model_and_moves_the_endpoint_traffic(endpoints):
    # the optional step of the Vertex AI pipeline (deploy_endpoint set): the run's project, the blessed copy
    # uploaded as a new version of the Registry model, then deployed with all of the endpoint's traffic
    from components.deploy import deploy

    parent = f"projects/{PROJECT}/locations/{REGION}"
    out = deploy.python_func(
        blessed_model="/gcs/persia-test/blessed/criteo/model-1",
        config="criteo",
        endpoint="55",
        location=REGION,
        serving_image=IMAGE,
        registry_model=f"{parent}/models/7",
        machine_type="n2-highmem-8",
    )
    sent = [(m, kw) for m, kw in endpoints if m in ("upload_model", "create_endpoint", "deploy_model")]
    assert [m for m, _ in sent] == ["upload_model", "deploy_model"]
    up = sent[0][1]["request"]
    assert up.parent == parent and up.parent_model == f"{parent}/models/7"
    assert (
        up.model.display_name == "persia-criteo" and up.model.artifact_uri == "gs://persia-test/blessed/criteo/model-1"
    )
    assert up.model.container_spec.image_uri == IMAGE and "blessed" in up.model.version_aliases
    dep = sent[1][1]
    assert dep["endpoint"] == f"{parent}/endpoints/55" and dep["deployed_model"].model == f"{parent}/models/7@3"
    assert dep["deployed_model"].dedicated_resources.machine_spec.machine_type == "n2-highmem-8"
    assert dict(dep["traffic"]) == {"0": 100}
    assert out == f"{parent}/models/7@3 -> {parent}/endpoints/55"


def test_run_help_names_every_pipeline_parameter(capsys):
    with pytest.raises(SystemExit):
        submit.main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in submit.pipeline_parameter_names():
        assert name in text
    assert {"data", "blessed_dir", "delta_dir", "deploy_endpoint"} <= set(submit.pipeline_parameter_names())
