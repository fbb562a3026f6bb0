"""components.k8s_job against a scripted Kubernetes API: a real HTTP server on 127.0.0.1 that answers as the API
server does (201 and the object on create, ``{"kind": ..., "items": [...]}`` lists, a ``Status`` with 404) and
records every request, and a real ``kubernetes.client.ApiClient`` pointed at it. Each test asserts the exact
requests of a run: create, watch, fail, cancel (SIGTERM in a child process), retry, clean up."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest
from kubernetes.client import ApiClient, ApiException, Configuration
from support import tiny_config

from components import k8s_job
from components.jobset import JOBSET_NAME_LABEL, REPLICATED_JOB_LABEL, RUN_KEY_LABEL, jobset_manifests, jobset_name
from components.jobset import run_key as make_run_key
from pipelines.kubeflow import KubeflowSettings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NS = "kubeflow-user"
MODEL = "gs://persia-test/root/train/model"
KEY = make_run_key(MODEL)
NAME = jobset_name(KEY, "a1b2")
SECRET = f"{NAME}-token"
JOBSETS = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets"
SECRETS = f"/api/v1/namespaces/{NS}/secrets"
PODS = f"/api/v1/namespaces/{NS}/pods"
BY_KEY = {"labelSelector": f"{RUN_KEY_LABEL}={KEY}"}
BY_NAME = {"labelSelector": f"{JOBSET_NAME_LABEL}={NAME}"}
BACKGROUND = {"propagationPolicy": "Background"}
OWNER = {"apiVersion": "v1", "kind": "Pod", "name": "persia-train-step", "uid": "0d9c7a5e-step-pod"}
RUNNING = {"conditions": [], "replicatedJobsStatus": [{"name": "primary", "active": 1}]}
COMPLETED = {
    "conditions": [
        {"type": "Completed", "status": "True", "reason": "AllJobsCompleted", "message": "jobset completed"}
    ],
    "terminalState": "Completed",
}


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    body: Any


def _status(code: int, reason: str, message: str) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


PATH = re.compile(
    r"^/(?:api/v1|apis/jobset\.x-k8s\.io/v1alpha2)/namespaces/([^/]+)/(jobsets|secrets|pods)(?:/([^/]+))?(/log)?$"
)


class FakeApi:
    """The scripted API: Secrets and JobSets are kept as created (``objects``); a JobSet's ``status`` on its
    n-th GET is ``statuses[n]`` (the last one repeats), the pods on the n-th LIST ``pod_lists[n]`` likewise;
    ``logs``: pod name -> log text (``tailLines`` honoured); ``pods``: pod name -> pod (for a GET of one);
    ``refuse``: ``(method, path) -> HTTP code`` answered with a Status instead."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.objects: dict[str, dict[str, dict]] = {"jobsets": {}, "secrets": {}}
        self.statuses: list[dict] = [RUNNING]
        self.pod_lists: list[list[dict]] = [[]]
        self.logs: dict[str, str] = {}
        self.pods: dict[str, dict] = {}
        self.refuse: dict[tuple[str, str], int] = {}
        self.lock = threading.Lock()
        self._gets = self._lists = 0

    def count(self, method: str, path: str) -> int:
        with self.lock:
            return sum(r.method == method and r.path == path for r in self.requests)

    def answer(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        with self.lock:
            self.requests.append(Request(method, path, query, body))
            if (method, path) in self.refuse:
                code = self.refuse[(method, path)]
                return code, _status(code, "Forbidden" if code == 403 else "NotFound", f"refused: {method} {path}")
            m = PATH.match(path)
            assert m, path
            _, plural, name, log = m.groups()
            kind = {"jobsets": "JobSet", "secrets": "Secret", "pods": "Pod"}[plural]
            if plural == "pods":
                if log:
                    lines = self.logs[name].splitlines()
                    return 200, "\n".join(lines[-int(query["tailLines"]) :]) + "\n"
                if name:
                    return (200, self.pods[name]) if name in self.pods else (404, _status(404, "NotFound", name))
                pods = self.pod_lists[min(self._lists, len(self.pod_lists) - 1)]
                self._lists += 1
                return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": pods}
            store = self.objects[plural]
            if method == "POST":
                obj = json.loads(json.dumps(body))
                obj["metadata"]["uid"] = f"uid-{obj['metadata']['name']}"
                store[obj["metadata"]["name"]] = obj
                return 201, obj
            if method == "GET" and not name:
                k, _, v = query["labelSelector"].partition("=")
                items = [o for o in store.values() if o["metadata"].get("labels", {}).get(k) == v]
                return 200, {"kind": f"{kind}List", "apiVersion": "v1", "metadata": {}, "items": items}
            if name not in store:
                return 404, _status(404, "NotFound", f'{plural} "{name}" not found')
            if method == "DELETE":
                del store[name]
                return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}
            if self._gets >= 100:  # a run that never stops polling fails its test instead of hanging it
                return 500, _status(500, "InternalError", "the test's script ran out")
            status = self.statuses[min(self._gets, len(self.statuses) - 1)]
            self._gets += 1
            return 200, dict(store[name], status=status)


@pytest.fixture
def fake():
    api = FakeApi()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body go out as separate writes

        def _serve(self) -> None:
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            code, out = api.answer(self.command, url.path, dict(parse_qsl(url.query)), json.loads(raw) if raw else None)
            data = out.encode() if isinstance(out, str) else json.dumps(out).encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain" if isinstance(out, str) else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = _serve

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    api.host = f"http://127.0.0.1:{server.server_address[1]}"  # type: ignore[attr-defined]
    yield api
    server.shutdown()
    server.server_close()


@pytest.fixture
def client(fake):
    c = ApiClient(Configuration(host=fake.host))
    yield c
    c.close()


@pytest.fixture(scope="module")
def manifests(tmp_path_factory):
    """One attempt's Secret and JobSet from ``components.jobset`` (1 primary, 2 parameter servers)."""
    shards = tmp_path_factory.mktemp("shards")
    (shards / "run_config.yaml").write_text(tiny_config(num_workers=1).to_yaml())
    (shards / "shard_plan.json").write_text(json.dumps({"shard_memory_bytes": 1 << 22}))
    settings = KubeflowSettings(image="registry.example/persia-kfp:abc", gpus=0).to_json()
    out = jobset_manifests(settings, "gs://persia-test/root/pre/dataset", str(shards), MODEL, NAME, NS, "t" * 32, OWNER)
    assert out["jobset"]["metadata"]["labels"][RUN_KEY_LABEL] == KEY
    assert out["secret"]["metadata"]["name"] == SECRET
    return out


def pod(name: str, role: str, phase: str = "Running", exit_code: int | None = None, **status: Any) -> dict:
    state: dict[str, Any] = {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
    if exit_code is not None:
        state = {"terminated": {"exitCode": exit_code, "reason": "Error" if exit_code else "Completed"}}
    return {
        "metadata": {"name": name, "labels": {JOBSET_NAME_LABEL: NAME, REPLICATED_JOB_LABEL: role}},
        "status": {"phase": phase, "containerStatuses": [{"name": "persia", "state": state}], **status},
    }


def calls(fake: FakeApi) -> list[tuple[str, str, dict[str, str]]]:
    return [(r.method, r.path, r.query) for r in fake.requests]


START = [("GET", JOBSETS, BY_KEY), ("POST", SECRETS, {}), ("POST", JOBSETS, {})]
POLL = [("GET", PODS, BY_NAME), ("GET", f"{JOBSETS}/{NAME}", {})]
CLEANUP = [("DELETE", f"{JOBSETS}/{NAME}", BACKGROUND), ("DELETE", f"{SECRETS}/{SECRET}", BACKGROUND)]


def test_a_run_creates_the_secret_then_the_jobset_watches_it_complete_and_deletes_both(fake, client, manifests):
    fake.statuses = [RUNNING, COMPLETED]
    fake.pod_lists = [
        [pod(f"{NAME}-primary-0-0-x", "primary")],
        [pod(f"{NAME}-primary-0-0-x", "primary", "Succeeded", 0)],
    ]
    before = signal.getsignal(signal.SIGTERM)
    events: list[str] = []
    out = k8s_job.run_jobset(client, NS, manifests, poll_s=0.01, on_event=events.append)
    assert out["status"] == COMPLETED and out["metadata"]["name"] == NAME
    assert calls(fake) == START + POLL + POLL + CLEANUP
    bodies = {(r.method, r.path): r.body for r in fake.requests}
    assert bodies[("POST", SECRETS)] == manifests["secret"]
    assert bodies[("POST", JOBSETS)] == manifests["jobset"]
    assert [r.body for r in fake.requests if r.method != "POST"] == [None] * 7
    assert fake.objects == {"jobsets": {}, "secrets": {}}
    assert signal.getsignal(signal.SIGTERM) is before  # the step's own handler is back
    assert events[0].startswith(f"created JobSet {NS}/{NAME}") and f"JobSet {NS}/{NAME} completed" in events


def test_a_retry_deletes_the_previous_attempts_jobset_and_secret_before_creating_its_own(fake, client, manifests):
    old = jobset_name(KEY, "0ld0")
    labels = manifests["jobset"]["metadata"]["labels"]
    fake.objects["jobsets"][old] = {"metadata": {"name": old, "namespace": NS, "labels": dict(labels)}}
    fake.objects["secrets"][f"{old}-token"] = {"metadata": {"name": f"{old}-token", "labels": dict(labels)}}
    other = {"metadata": {"name": "persia-other-0000", "labels": {RUN_KEY_LABEL: "another-step"}}}
    fake.objects["jobsets"]["persia-other-0000"] = other
    fake.statuses = [COMPLETED]
    k8s_job.run_jobset(client, NS, manifests, poll_s=0.01, on_event=lambda line: None)
    assert calls(fake) == [
        ("GET", JOBSETS, BY_KEY),
        ("DELETE", f"{JOBSETS}/{old}", BACKGROUND),
        ("DELETE", f"{SECRETS}/{old}-token", BACKGROUND),  # by name: the step does not list Secrets
        ("POST", SECRETS, {}),
        ("POST", JOBSETS, {}),
        *POLL,
        *CLEANUP,
    ]
    assert fake.objects == {"jobsets": {"persia-other-0000": other}, "secrets": {}}  # another step's is left


def test_a_failed_pod_fails_the_run_at_once_with_its_role_exit_code_and_last_log_lines(fake, client, manifests):
    ps = f"{NAME}-parameter-server-0-1-q7x"
    primary = pod(f"{NAME}-primary-0-0-x", "primary")
    fake.pod_lists = [[primary, pod(ps, "parameter-server")], [primary, pod(ps, "parameter-server", "Failed", 3)]]
    fake.logs[ps] = "\n".join(f"ps log line {i}" for i in range(30))
    fake.refuse[("DELETE", f"{JOBSETS}/{NAME}")] = 404  # already gone: fine
    with pytest.raises(RuntimeError) as e:
        k8s_job.run_jobset(client, NS, manifests, poll_s=0.01, log_lines=20, on_event=lambda line: None)
    msg = str(e.value)
    assert f"pod {ps} (role parameter-server) exited with code 3 (Error)" in msg
    assert "ps log line 10\n" in msg and msg.endswith("ps log line 29") and "ps log line 9\n" not in msg
    log = ("GET", f"{PODS}/{ps}/log", {"container": "persia", "tailLines": "20"})
    assert calls(fake) == START + POLL + POLL + [log] + CLEANUP  # the second poll saw it: no third
    assert fake.objects["secrets"] == {}


def test_the_pod_that_failed_first_is_blamed_not_those_the_jobset_stopped_after_it(fake, client, manifests):
    def ended(name, role, code, reason, at):
        p = pod(name, role, "Failed", code)
        p["status"]["containerStatuses"][0]["state"]["terminated"].update(reason=reason, finishedAt=at)
        return p

    ps, primary = f"{NAME}-parameter-server-0-0-a", f"{NAME}-primary-0-0-b"
    fake.pod_lists = [  # listed by name: the servers the controller stopped come before the primary
        [
            ended(ps, "parameter-server", 143, "Error", "2026-01-01T00:00:09Z"),
            ended(primary, "primary", 137, "OOMKilled", "2026-01-01T00:00:07Z"),
        ]
    ]
    fake.logs[primary] = "step 7\nout of memory"
    with pytest.raises(RuntimeError) as e:
        k8s_job.run_jobset(client, NS, manifests, poll_s=0.01, on_event=lambda line: None)
    assert f"pod {primary} (role primary) exited with code 137 (OOMKilled) (first of 2 failed pods)" in str(e.value)
    assert str(e.value).endswith("out of memory")
    # an exit code of its own beats a signal's, whenever it ended
    fake.pod_lists = [
        [
            ended(ps, "parameter-server", 143, "Error", "2026-01-01T00:00:01Z"),
            ended(primary, "primary", 1, "Error", "2026-01-01T00:00:05Z"),
        ]
    ]
    with pytest.raises(RuntimeError, match=f"pod {primary} \\(role primary\\) exited with code 1"):
        k8s_job.run_jobset(client, NS, manifests, poll_s=0.01, on_event=lambda line: None)


def test_a_failed_jobset_fails_the_run_with_its_condition(fake, client, manifests):
    fake.statuses = [
        {
            "conditions": [
                {"type": "Failed", "status": "True", "reason": "FailedJobs", "message": "jobset failed due to job"}
            ],
            "terminalState": "Failed",
        }
    ]
    with pytest.raises(RuntimeError, match=f"JobSet {NS}/{NAME} failed: FailedJobs: jobset failed due to job"):
        k8s_job.run_jobset(client, NS, manifests, poll_s=0.01, on_event=lambda line: None)
    assert calls(fake) == START + POLL + CLEANUP


def test_unschedulable_pods_and_image_pull_errors_are_reported_once_and_do_not_fail(fake, client, manifests):
    ps = f"{NAME}-parameter-server-0-0-a"
    primary = f"{NAME}-primary-0-0-b"
    pending = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes: memory"}
    waiting = {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}}
    stuck = [
        pod(ps, "parameter-server", "Pending", conditions=[pending], containerStatuses=[]),
        pod(primary, "primary", "Pending", containerStatuses=[{"name": "persia", "state": waiting}]),
    ]
    fake.pod_lists = [stuck, stuck, stuck]
    fake.statuses = [RUNNING, RUNNING, COMPLETED]
    events: list[str] = []
    k8s_job.run_jobset(client, NS, manifests, poll_s=0.01, on_event=events.append)
    assert [e for e in events if "pod " in e] == [
        f"pod {ps} (role parameter-server) cannot be scheduled: 0/3 nodes: memory",
        f"pod {primary} (role primary) container persia: ImagePullBackOff: Back-off pulling image",
    ]
    assert calls(fake) == START + POLL * 3 + CLEANUP


def test_a_container_still_being_created_is_reported_only_after_the_slow_start_time(
    fake, client, manifests, monkeypatch
):
    creating = {"waiting": {"reason": "ContainerCreating"}}
    ps = f"{NAME}-parameter-server-0-0-a"
    stuck = [pod(ps, "parameter-server", "Pending", containerStatuses=[{"name": "persia", "state": creating}])]
    fake.pod_lists, fake.statuses = [stuck] * 4, [RUNNING] * 3 + [COMPLETED]
    monkeypatch.setattr(k8s_job, "SLOW_START_S", 0.015)  # a few polls of 0.01 s
    events: list[str] = []
    k8s_job.run_jobset(client, NS, manifests, poll_s=0.01, on_event=events.append)
    slow = [e for e in events if "still being created" in e]
    assert len(slow) == 1 and slow[0].startswith(f"pod {ps} (role parameter-server) container persia")
    assert "Workload Identity" in slow[0]
    monkeypatch.setattr(k8s_job, "SLOW_START_S", 60.0)  # a container created within it: nothing said
    fake.pod_lists, fake.statuses, fake._gets, fake._lists = [stuck] * 2, [RUNNING, COMPLETED], 0, 0
    events.clear()
    k8s_job.run_jobset(client, NS, manifests, poll_s=0.01, on_event=events.append)
    assert not [e for e in events if "still being created" in e]


def test_an_api_error_names_its_request_and_what_was_posted_is_still_deleted(fake, client, manifests):
    fake.refuse[("POST", JOBSETS)] = 403
    with pytest.raises(ApiException) as e:
        k8s_job.run_jobset(client, NS, manifests, poll_s=0.01, on_event=lambda line: None)
    assert e.value.status == 403 and e.value.__notes__ == [f"request: POST {JOBSETS}"]
    assert calls(fake) == START + CLEANUP  # the JobSet's DELETE answers 404: fine
    assert fake.objects == {"jobsets": {}, "secrets": {}}


def test_ctrl_c_still_deletes_the_jobset_and_the_secret(fake, client, manifests):
    def interrupt(line: str) -> None:
        if line.startswith("created"):  # while the JobSet runs
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        k8s_job.run_jobset(client, NS, manifests, poll_s=0.01, on_event=interrupt)
    assert calls(fake) == START + CLEANUP
    assert fake.objects == {"jobsets": {}, "secrets": {}}


CHILD = """
import json, sys
from kubernetes.client import ApiClient, Configuration
from components.k8s_job import run_jobset
host, namespace, path = sys.argv[1:]
with open(path) as f:
    manifests = json.load(f)
run_jobset(ApiClient(Configuration(host=host)), namespace, manifests, poll_s=0.05)
"""


@pytest.mark.processes
def test_sigterm_cancels_the_run_deleting_the_jobset_and_the_secret(fake, manifests, tmp_path):
    path = tmp_path / "manifests.json"
    path.write_text(json.dumps(manifests))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, fake.host, NS, str(path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 15
        while fake.count("GET", f"{JOBSETS}/{NAME}") < 2:  # polling
            if child.poll() is not None or time.monotonic() > deadline:
                child.kill()
                pytest.fail(f"the child never polled: {child.communicate()}")
            time.sleep(0.02)
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=15)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode != 0
    assert "Terminated: SIGTERM: the step was cancelled" in err
    seen = calls(fake)
    assert seen[: len(START)] == START and seen[-2:] == CLEANUP
    assert len(seen) >= 8 and all(
        c in POLL for c in seen[len(START) : -2]
    )  # polls (the last may be cut short), no more
    assert fake.objects == {"jobsets": {}, "secrets": {}}


def test_owner_reference_names_the_step_pod_with_its_uid(fake, client):
    fake.pods["persia-train-step"] = {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {"name": "persia-train-step", "namespace": NS, "uid": "0d9c7a5e-step-pod"},
        "spec": {"containers": [{"name": "main", "image": "x"}]},
    }
    assert k8s_job.owner_reference(client, NS, "persia-train-step") == OWNER
    assert calls(fake) == [("GET", f"{PODS}/persia-train-step", {})]
    # under KFP's launcher the uid is known: no request
    assert k8s_job.owner_reference(client, NS, OWNER["name"], OWNER["uid"]) == OWNER and len(fake.requests) == 1


def test_step_pod_reads_the_namespace_file_and_hostname_and_refuses_outside_a_pod(tmp_path, monkeypatch):
    ns_file = tmp_path / "namespace"
    ns_file.write_text(NS + "\n")
    for var in ("KFP_NAMESPACE", "KFP_POD_NAME", "KFP_POD_UID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOSTNAME", "persia-train-step")
    assert k8s_job.step_pod(str(ns_file)) == (NS, "persia-train-step", "")
    with pytest.raises(RuntimeError, match="not in a Kubernetes pod"):
        k8s_job.step_pod(str(tmp_path / "missing"))
    # KFP's launcher names the pod in full (a recurring run's pod name is longer than the 63 characters of
    # $HOSTNAME) and gives its uid
    long_name = "daily-retrain-2j9lq-1234567890-system-container-impl-3385719836"  # 63+ characters
    kfp = {"KFP_NAMESPACE": "team", "KFP_POD_NAME": long_name + "x" * 8, "KFP_POD_UID": "u-1"}
    assert k8s_job.step_pod(str(tmp_path / "missing"), kfp) == ("team", long_name + "x" * 8, "u-1")
    monkeypatch.delenv("HOSTNAME")
    with pytest.raises(RuntimeError, match="HOSTNAME"):
        k8s_job.step_pod(str(ns_file))


def _rbac_allows(method: str, path: str, rules: list[dict]) -> bool:
    """Whether the Role's ``rules`` grant the request (its API group, resource, subresource and verb)."""
    m = re.fullmatch(r"/(?:api/v1|apis/([^/]+)/[^/]+)/namespaces/[^/]+/([^/]+)(?:/([^/]+))?(?:/([^/]+))?", path)
    assert m, path
    group, resource, name, sub = m.group(1) or "", m.group(2), m.group(3), m.group(4)
    verb = {"POST": "create", "DELETE": "delete", "GET": "get" if name else "list"}[method]
    resource = f"{resource}/{sub}" if sub else resource
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)


def test_the_shipped_role_grants_every_request_the_step_sends(fake, client, manifests):
    from importlib.resources import files

    import yaml

    docs = yaml.safe_load_all(files("pipelines").joinpath("k8s/rbac.yaml").read_text())
    rules = next(d for d in docs if d["kind"] == "Role")["rules"]
    ps = f"{NAME}-parameter-server-0-1-q7x"
    fake.pod_lists = [[pod(ps, "parameter-server", "Failed", 3)]]
    fake.logs[ps] = "ps log line"
    with pytest.raises(RuntimeError):
        k8s_job.run_jobset(client, NS, manifests, poll_s=0.01, on_event=lambda line: None)
    fake.pod_lists, fake.statuses = [[]], [COMPLETED]
    k8s_job.run_jobset(client, NS, manifests, poll_s=0.01, on_event=lambda line: None)
    fake.pods[OWNER["name"]] = {"kind": "Pod", "apiVersion": "v1", "metadata": dict(OWNER, namespace=NS)}
    k8s_job.owner_reference(client, NS, OWNER["name"])
    sent = {(r.method, r.path) for r in fake.requests}
    assert {m for m, _ in sent} == {"GET", "POST", "DELETE"}
    assert [s for s in sorted(sent) if not _rbac_allows(*s, rules)] == []
    assert not _rbac_allows("DELETE", f"{PODS}/x", rules)  # the check can fail: the Role deletes no pods
