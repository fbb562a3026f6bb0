"""pipelines.k8s_schema: strict offline validation of JobSets (vendored JobSet definitions + kubernetes-validate's
Kubernetes types) and of core kinds (kubernetes-validate)."""

import copy
import json
import re

import pytest

from pipelines import k8s_schema
from pipelines.k8s_schema import JOBSET_API_VERSION, JOBSET_SCHEMA, validate_manifest

POD = "spec.replicatedJobs[0].template.spec.template.spec"


def _replicated_job(name: str, replicas: int, completions: int) -> dict:
    return {
        "name": name,
        "replicas": replicas,
        "template": {
            "spec": {
                "completionMode": "Indexed",
                "completions": completions,
                "parallelism": completions,
                "backoffLimit": 0,
                "template": {
                    "metadata": {"labels": {"app.kubernetes.io/name": "persia"}},
                    "spec": {
                        "restartPolicy": "Never",
                        "serviceAccountName": "persia-train",
                        "nodeSelector": {"cloud.google.com/gke-nodepool": "cpu"},
                        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                        "containers": [
                            {
                                "name": "main",
                                "image": "persia-kfp:local",
                                "command": ["persia", "train"],
                                "args": ["--role", name],
                                "ports": [{"containerPort": 8470, "name": "grpc"}],
                                "env": [
                                    {
                                        "name": "PERSIA_TOKEN",
                                        "valueFrom": {"secretKeyRef": {"name": "persia-x", "key": "token"}},
                                    },
                                    {
                                        "name": "POD_NAME",
                                        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                                    },
                                    {"name": "PERSIA_ROLE", "value": name},
                                ],
                                "resources": {
                                    "requests": {"cpu": "2", "memory": "4Gi"},
                                    "limits": {"memory": "4Gi", "nvidia.com/gpu": 1},
                                },
                                "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
                            }
                        ],
                        "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}],
                    },
                },
            }
        },
    }


def _jobset() -> dict:
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {
            "name": "persia-x",
            "namespace": "kubeflow",
            "labels": {"pipeline/runid": "abc"},
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": "train-step-pod",
                    "uid": "7d4a2c1e-0000-4000-8000-000000000000",
                    "controller": False,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": "persia-x"},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": ["workers"]},
            "failurePolicy": {"maxRestarts": 0},
            "ttlSecondsAfterFinished": 600,
            "replicatedJobs": [_replicated_job("workers", 1, 2), _replicated_job("ps", 1, 2)],
        },
    }


def _secret() -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "persia-x", "namespace": "kubeflow"},
        "type": "Opaque",
        "stringData": {"token": "s3cret"},
    }


def _refused(obj: dict) -> str:
    with pytest.raises(ValueError) as info:
        validate_manifest(obj)
    return str(info.value)


def test_the_vendored_definitions_are_the_version_the_module_names():
    with open(k8s_schema._SWAGGER) as f:
        swagger = json.load(f)
    assert swagger["info"]["version"] == JOBSET_SCHEMA
    assert all(name.startswith(f"jobset.{JOBSET_API_VERSION.split('/')[1]}.") for name in swagger["definitions"])


def test_a_minimal_jobset_validates():
    validate_manifest(_jobset())
    validate_manifest(_jobset(), k8s_version="v1.35")


def test_a_misspelled_jobset_field_is_refused():
    js = _jobset()
    js["spec"]["replicatedJob"] = js["spec"].pop("replicatedJobs")
    assert "JobSet persia-x: spec.replicatedJob: unknown field" in _refused(js).splitlines()


def test_a_wrong_type_in_the_jobset_is_refused():
    js = _jobset()
    js["spec"]["replicatedJobs"][1]["replicas"] = "2"
    assert _refused(js) == "JobSet persia-x: spec.replicatedJobs[1].replicas: '2' is not of type 'integer'"


def test_a_misspelled_field_deep_in_the_pod_template_is_refused():
    js = _jobset()
    container = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    container["imagee"] = container.pop("image")
    assert _refused(js) == f"JobSet persia-x: {POD}.containers[0].imagee: unknown field"


def test_a_wrong_type_in_the_pod_template_is_refused():
    js = _jobset()
    container = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    container["resources"]["limits"] = [{"memory": "4Gi"}]
    message = _refused(js)
    assert re.fullmatch(
        rf"JobSet persia-x: {re.escape(POD)}\.containers\[0\]\.resources\.limits: .* is not of type 'object', 'null'",
        message,
    ), message


def test_every_error_is_listed_with_its_path():
    js = _jobset()
    js["spec"]["failurePolicy"]["maxRestart"] = 1
    js["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]["volumes"][0]["emptyDir"]["medium"] = 1
    js["metadata"]["ownerReferences"][0].pop("uid")
    lines = _refused(js).splitlines()
    assert lines == [
        "JobSet persia-x: metadata.ownerReferences[0]: 'uid' is a required property",
        "JobSet persia-x: spec.failurePolicy.maxRestart: unknown field",
        f"JobSet persia-x: {POD.replace('[0]', '[1]', 1)}.volumes[0].emptyDir.medium: "
        "1 is not of type 'string', 'null'",
    ]


def test_a_secret_validates_and_a_wrong_one_is_refused():
    validate_manifest(_secret())

    bad_value = _secret()
    bad_value["stringData"]["port"] = 8470
    assert _refused(bad_value) == "Secret persia-x: stringData.port: 8470 is not of type 'string', 'null'"

    unknown = copy.deepcopy(_secret())
    unknown["stringdata"] = unknown.pop("stringData")
    assert _refused(unknown) == "Secret persia-x: stringdata: unknown field"


def test_other_core_kinds_go_through_kubernetes_validate():
    validate_manifest(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "persia-train"},
            "rules": [{"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets"], "verbs": ["create", "get"]}],
        }
    )
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "ps"}, "spec": {"clusterIP": None}}
    service["spec"]["portz"] = []
    assert _refused(service) == "Service ps: spec.portz: unknown field"


@pytest.mark.parametrize(
    ("api_version", "kind"),
    [("jobset.x-k8s.io/v1alpha1", "JobSet"), ("kubeflow.org/v1", "PyTorchJob"), ("v1", "Secrett")],
)
def test_an_unknown_api_version_or_kind_is_refused(api_version, kind):
    message = _refused({"apiVersion": api_version, "kind": kind, "metadata": {"name": "x"}})
    assert api_version in message and kind in message


def test_a_manifest_without_api_version_or_kind_or_with_an_unknown_kubernetes_version_is_refused():
    assert "apiVersion" in _refused({"kind": "Secret", "metadata": {"name": "x"}})
    with pytest.raises(ValueError, match="no schemas for Kubernetes 1.99"):
        validate_manifest(_secret(), k8s_version="1.99.0")
