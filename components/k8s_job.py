"""The Kubeflow train step's launcher: runs one attempt's JobSet (``components.jobset``) on the cluster to its end.

Lifecycle of one attempt (``run_jobset``):

* retry: KFP retries a failed step in a new pod, so the previous attempt's JobSet and Secret may still exist
  (the old step pod owns them but is kept). The JobSet carries the train step's ``persia-kfp/run-key`` label,
  the same on every attempt: each JobSet listed by it is deleted first, with its Secret, found by name
  (background propagation: the JobSet's Jobs and pods go with it).
* create: the Secret (the parameter servers' token), then the JobSet.
* watch: every ``poll_s`` seconds the JobSet's pods are listed and the JobSet read. Its ``Completed`` condition
  ends the step; its ``Failed`` condition, or any pod that failed (its ``persia`` container exited non-zero),
  fails it at once with the pod's role, name, exit code and last log lines. Pods that cannot be scheduled or
  whose image cannot be pulled are reported once through ``on_event`` (the cluster autoscaler may still add a
  node; a JobSet never started fails no sooner than its jobs' deadline, ``KubeflowSettings.timeout_s``).
* cancel: KFP cancels a run by terminating the step's pod; SIGTERM (and Ctrl-C) raise in the watch loop.
* clean up: whatever the end (success, failure, API error, cancel), the JobSet and the Secret are deleted.
  Their ``ownerReferences`` entry (the step's pod, ``owner_reference``) is the backstop where the step's pod
  is deleted before it could clean up.

RBAC of the step's ServiceAccount in the JobSet's namespace (and ``get`` on pods in its own, for
``owner_reference``)::

    jobset.x-k8s.io  jobsets    create, get, list, delete
    ""               pods       get, list
    ""               pods/log   get
    ""               secrets    create, delete
"""

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from kubernetes.client import ApiClient, ApiException, CoreV1Api, CustomObjectsApi

from components.jobset import CONTAINER, JOBSET_NAME_LABEL, REPLICATED_JOB_LABEL, ROLE_LABEL, RUN_KEY_LABEL
from components.jobset import secret_name as token_secret_name

GROUP, VERSION, PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
"""Where a pod reads its own namespace (mounted with its ServiceAccount's token)."""
PROPAGATION = "Background"
REQUEST_TIMEOUT_S = 30.0
"""Seconds one API request may take (connect and read) before it raises."""
WAITING_REASONS = ("ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError")
"""Reasons of a waiting container that are reported (once per pod) while the JobSet runs."""
SLOW_START_S = 300.0
"""A container still being created after this many seconds of the watch is reported (once): usually a volume that
cannot be mounted, such as Cloud Storage without Workload Identity for the pods' ServiceAccount."""


class Terminated(BaseException):
    """SIGTERM arrived while ``run_jobset`` ran (a ``BaseException``, as ``KeyboardInterrupt``: no ``except
    Exception`` on the way swallows it)."""


def _request(what: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> bytes:
    """The body of the response to ``call(*args, **kwargs)``; an error raised gets the note ``request: <what>``."""
    try:
        resp = call(*args, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S, **kwargs)
    except Exception as e:
        e.add_note(f"request: {what}")
        raise
    return resp.data


def _json(what: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    return json.loads(_request(what, call, *args, **kwargs))


def _delete(what: str, call: Callable[..., Any], *args: Any) -> bool:
    """Delete with background propagation; False when the object was already gone (404)."""
    try:
        _request(what, call, *args, propagation_policy=PROPAGATION)
    except ApiException as e:
        if e.status == 404:
            return False
        raise
    return True


def _jobsets_path(namespace: str) -> str:
    return f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"


def step_pod(namespace_file: str = NAMESPACE_FILE, environ: Mapping[str, str] | None = None) -> tuple[str, str, str]:
    """``(namespace, pod name, pod uid)`` of the pod this runs in. KFP's launcher sets ``$KFP_NAMESPACE``,
    ``$KFP_POD_NAME`` and ``$KFP_POD_UID`` in a step's container (from the downward API: the pod's full name,
    where ``$HOSTNAME`` is cut to 63 characters); without them the namespace comes from the ServiceAccount's
    mount (``namespace_file``), the name from ``$HOSTNAME`` and the uid is "" (``owner_reference`` reads it).
    Raises ``RuntimeError`` outside a pod."""
    env = os.environ if environ is None else environ
    if env.get("KFP_POD_NAME") and env.get("KFP_POD_UID") and env.get("KFP_NAMESPACE"):
        return env["KFP_NAMESPACE"], env["KFP_POD_NAME"], env["KFP_POD_UID"]
    try:
        with open(namespace_file, encoding="utf-8") as f:
            namespace = f.read().strip()
    except FileNotFoundError:
        namespace = ""
    pod = env.get("HOSTNAME", "")
    if not namespace or not pod:
        raise RuntimeError(
            f"not in a Kubernetes pod: $KFP_NAMESPACE, $KFP_POD_NAME and $KFP_POD_UID (KFP's launcher), or "
            f"{namespace_file} (the pod's namespace) and $HOSTNAME (its name) must be set"
        )
    return namespace, pod, ""


def owner_reference(api_client: ApiClient, namespace: str, pod_name: str, uid: str = "") -> dict[str, str]:
    """An ``ownerReferences`` entry naming pod ``pod_name`` of ``namespace``; without ``uid``, read from the API.
    Raises ``kubernetes.client.ApiException`` when it cannot be read."""
    if uid:
        return {"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": uid}
    core = CoreV1Api(api_client)
    pod = _json(f"GET /api/v1/namespaces/{namespace}/pods/{pod_name}", core.read_namespaced_pod, pod_name, namespace)
    return {"apiVersion": "v1", "kind": "Pod", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[Callable[[], None]]:
    """While inside, the first SIGTERM raises ``Terminated``; later ones, and any after the yielded ``disarm()``
    is called, are ignored (so that the clean-up runs to its end). The previous handler is restored on leaving.
    Off the main thread, where Python cannot handle signals, nothing is installed."""
    armed = True

    def disarm() -> None:
        nonlocal armed
        armed = False

    def handler(signum: int, frame: object) -> None:
        if armed:
            disarm()
            raise Terminated("SIGTERM: the step was cancelled")

    if threading.current_thread() is not threading.main_thread():
        yield disarm
        return
    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield disarm
    finally:
        signal.signal(signal.SIGTERM, old if old is not None else signal.SIG_DFL)


def _condition(jobset: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """The JobSet's condition of type ``kind`` (``Completed``, ``Failed``) with status True; ``{}`` where only
    its ``terminalState`` is ``kind``; None where neither."""
    status = jobset.get("status") or {}
    for c in status.get("conditions") or []:
        if c.get("type") == kind and c.get("status") == "True":
            return c
    return {} if status.get("terminalState") == kind else None


def _container(statuses: list[dict[str, Any]] | None, name: str) -> dict[str, Any]:
    return next((c for c in statuses or [] if c.get("name") == name), {})


def _terminated(pod: dict[str, Any]) -> dict[str, Any]:
    """The ``terminated`` state of ``pod``'s ``persia`` container (``{}`` while it has not ended)."""
    statuses = (pod.get("status") or {}).get("containerStatuses")
    return (_container(statuses, CONTAINER).get("state") or {}).get("terminated") or {}


def _failure(pod: dict[str, Any]) -> str:
    """What failed in ``pod`` ("" when nothing did): its phase ``Failed``, or its ``persia`` container
    terminated with a non-zero exit code."""
    status = pod.get("status") or {}
    term = _terminated(pod)
    code = term.get("exitCode")
    if code not in (None, 0):
        return f"exited with code {code} ({term.get('reason') or 'Error'})"
    if status.get("phase") == "Failed":
        why = ": ".join(x for x in (status.get("reason"), status.get("message")) if x) or "no reason given"
        return f"failed (exit code {code}; {why})" if code is not None else f"failed ({why})"
    return ""


def _failed_order(pod: dict[str, Any]) -> tuple[bool, str]:
    """Sort key of failed pods, the cause first: not stopped by a signal (exit codes 137, 143) before stopped,
    then by when the ``persia`` container finished (RFC 3339 times sort as text)."""
    term = _terminated(pod)
    return term.get("exitCode") in (137, 143), term.get("finishedAt") or "~"


def _events(pod: dict[str, Any]) -> list[tuple[str, str]]:
    """``(reason, message)`` of what keeps ``pod`` from running: unschedulable, or a container waiting for
    its image or its configuration."""
    status = pod.get("status") or {}
    out = []
    if status.get("phase") == "Pending":
        for c in status.get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
                out.append(("Unschedulable", f"cannot be scheduled: {c.get('message', '')}"))
    for c in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        waiting = (c.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in WAITING_REASONS:
            out.append(
                (waiting["reason"], f"container {c.get('name')}: {waiting['reason']}: {waiting.get('message', '')}")
            )
        elif waiting.get("reason") == "ContainerCreating":
            out.append(
                (
                    "ContainerCreating",
                    f"container {c.get('name')} still being created after {SLOW_START_S:.0f} s: a volume that cannot "
                    f"be mounted? (kubectl describe pod shows the events; the Cloud Storage FUSE driver needs "
                    f"Workload Identity for the pods' ServiceAccount)",
                )
            )
    return out


def run_jobset(
    api_client: ApiClient,
    namespace: str,
    manifests: dict[str, dict],
    poll_s: float = 5.0,
    log_lines: int = 20,
    on_event: Callable[[str], object] = print,
) -> dict[str, Any]:
    """Run ``manifests`` (``components.jobset.jobset_manifests``: ``{"secret": ..., "jobset": ...}``) in
    ``namespace`` to the JobSet's end, as the module docstring describes: delete the previous attempt's
    objects, create these, read the JobSet's state every ``poll_s`` seconds, delete both at the end.
    ``log_lines``: how many of a failed pod's last log lines the error quotes. ``on_event``: called with a line
    on creation, clean-up and each problem of a pod that does not fail it (reported once per pod and reason).

    Returns the JobSet (its last state read) once it completed. Raises ``RuntimeError`` when it or one of its
    pods failed, ``Terminated`` on SIGTERM, ``kubernetes.client.ApiException`` (noted with the request) when
    the API refuses a request other than a delete of something already gone."""
    custom, core = CustomObjectsApi(api_client), CoreV1Api(api_client)
    secret, jobset = manifests["secret"], manifests["jobset"]
    name, secret_name = jobset["metadata"]["name"], secret["metadata"]["name"]
    key = jobset["metadata"]["labels"][RUN_KEY_LABEL]
    jobsets, secrets = _jobsets_path(namespace), f"/api/v1/namespaces/{namespace}/secrets"
    cr = (GROUP, VERSION, namespace, PLURAL)
    with _sigterm_raises() as disarm:
        by_key = f"{RUN_KEY_LABEL}={key}"
        old = _json(
            f"GET {jobsets}?labelSelector={by_key}", custom.list_namespaced_custom_object, *cr, label_selector=by_key
        )
        for item in old.get("items") or []:
            n = item["metadata"]["name"]
            if _delete(f"DELETE {jobsets}/{n}", custom.delete_namespaced_custom_object, *cr, n):
                on_event(f"deleted JobSet {namespace}/{n} of a previous attempt")
            t = token_secret_name(n)  # by name: the step needs no right to list (and read) the namespace's Secrets
            _delete(f"DELETE {secrets}/{t}", core.delete_namespaced_secret, t, namespace)
        posted: list[str] = []  # before each POST: a POST cut short by SIGTERM may still have created its object
        try:
            posted.append("secret")
            _json(f"POST {secrets}", core.create_namespaced_secret, namespace, secret)
            posted.append("jobset")
            _json(f"POST {jobsets}", custom.create_namespaced_custom_object, *cr, jobset)
            on_event(f"created JobSet {namespace}/{name} ({len(jobset['spec']['replicatedJobs'])} replicated jobs)")
            return _watch(core, custom, namespace, name, poll_s, log_lines, on_event)
        finally:
            disarm()  # a second SIGTERM must not cut the clean-up short
            todo: list[tuple[str, Callable[..., Any], tuple[str, ...]]] = []
            if "jobset" in posted:
                todo.append((f"DELETE {jobsets}/{name}", custom.delete_namespaced_custom_object, (*cr, name)))
            if "secret" in posted:
                todo.append(
                    (f"DELETE {secrets}/{secret_name}", core.delete_namespaced_secret, (secret_name, namespace))
                )
            errors: list[Exception] = []
            for what, call, args in todo:  # each one, whatever the other did
                try:
                    _delete(what, call, *args)
                except Exception as e:
                    errors.append(e)
            if errors:
                raise errors[0]
            if todo:
                on_event(f"cleaned up: JobSet {namespace}/{name} and Secret {secret_name} deleted")


def _watch(
    core: CoreV1Api,
    custom: CustomObjectsApi,
    namespace: str,
    name: str,
    poll_s: float,
    log_lines: int,
    on_event: Callable[[str], object],
) -> dict[str, Any]:
    """Poll JobSet ``name`` until it completes (returned) or it or a pod of it fails (``RuntimeError``).

    Each round lists the pods before reading the JobSet: when the JobSet completes, its controller deletes the
    pods still running, and their exit codes must not fail a step whose JobSet already completed."""
    pods_path = f"/api/v1/namespaces/{namespace}/pods"
    path = f"{_jobsets_path(namespace)}/{name}"
    selector = f"{JOBSET_NAME_LABEL}={name}"
    reported: set[tuple[str, str]] = set()
    first_seen: dict[tuple[str, str], float] = {}
    while True:
        pods = _json(
            f"GET {pods_path}?labelSelector={selector}", core.list_namespaced_pod, namespace, label_selector=selector
        )
        js = _json(f"GET {path}", custom.get_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, name)
        if _condition(js, "Completed") is not None:
            on_event(f"JobSet {namespace}/{name} completed")
            return js
        failed = _condition(js, "Failed")
        broken = [(p, what) for p in pods.get("items") or [] if (what := _failure(p))]
        if broken:
            # the first to fail is the cause: the others are the ones the JobSet controller stopped after it
            # (SIGTERM: exit code 143, or 137 when killed), which end later
            pod, what = min(broken, key=lambda b: _failed_order(b[0]))
            msg = f"JobSet {namespace}/{name} failed: {_describe(pod)} {what}"
            if len(broken) > 1:
                msg += f" (first of {len(broken)} failed pods)"
            if failed:
                msg += f" (JobSet: {failed.get('reason', '')}: {failed.get('message', '')})"
            raise RuntimeError(msg + _log_tail(core, namespace, pod["metadata"]["name"], log_lines))
        if failed is not None:
            raise RuntimeError(
                f"JobSet {namespace}/{name} failed: {failed.get('reason', 'Failed')}: {failed.get('message', '')}"
            )
        now = time.monotonic()
        for pod in pods.get("items") or []:
            for reason, text in _events(pod):
                seen = first_seen.setdefault((pod["metadata"]["name"], reason), now)
                if reason == "ContainerCreating" and now - seen < SLOW_START_S:
                    continue  # every container is created for a while
                if (pod["metadata"]["name"], reason) not in reported:
                    reported.add((pod["metadata"]["name"], reason))
                    on_event(f"{_describe(pod)} {text}")
        time.sleep(poll_s)


def _describe(pod: dict[str, Any]) -> str:
    labels = pod["metadata"].get("labels") or {}
    role = labels.get(REPLICATED_JOB_LABEL) or labels.get(ROLE_LABEL) or "?"
    return f"pod {pod['metadata']['name']} (role {role})"


def _log_tail(core: CoreV1Api, namespace: str, pod: str, lines: int) -> str:
    """``\\n`` and the last ``lines`` lines of ``pod``'s ``persia`` container's log, under a heading (a note
    instead when the log cannot be read: the failure is reported either way)."""
    if lines <= 0:
        return ""
    what = f"GET /api/v1/namespaces/{namespace}/pods/{pod}/log?container={CONTAINER}&tailLines={lines}"
    try:
        text = _request(what, core.read_namespaced_pod_log, pod, namespace, container=CONTAINER, tail_lines=lines)
    except ApiException as e:
        return f"\n(its log could not be read: HTTP {e.status} {e.reason})"
    body = text.decode("utf-8", errors="replace").rstrip("\n")
    return f"\nlast {lines} log lines of its {CONTAINER} container:\n{body}"
