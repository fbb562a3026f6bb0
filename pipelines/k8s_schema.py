"""Offline schema validation of the Kubernetes manifests the Kubeflow target creates.

``validate_manifest`` checks one manifest (a dict, as ``yaml.safe_load`` gives it) against a strict schema: unknown
fields are refused, as the API server's strict field validation does.

- Core kinds (Secret, Service, ServiceAccount, Role, RoleBinding, Pod, Job, ...): kubernetes-validate's strict
  schemas of Kubernetes ``K8S_VERSION``.
- ``jobset.x-k8s.io/v1alpha2`` JobSets: the JobSet API's OpenAPI definitions vendored in ``k8s/jobset/swagger.json``
  (SDK schema ``JOBSET_SCHEMA``; source repository and commit in ``k8s/jobset/README.md``), every object definition
  made strict (``additionalProperties: false``); their references to Kubernetes types (``io.k8s.*``: ObjectMeta,
  JobTemplateSpec, Condition, ...) resolve to kubernetes-validate's strict definitions of the same Kubernetes
  version, so a JobSet's pod template is checked as deeply as a Job's.

Only the schema is checked: the API server's semantic checks (name formats, immutable fields, the JobSet webhook's
rules) are not.
"""

import functools
import importlib.resources
import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
from jsonschema import Draft202012Validator, ValidationError
from kubernetes_validate.utils import VersionNotSupportedError
from referencing import Registry, Resource

K8S_VERSION = "1.35.0"
"""Kubernetes version whose schemas ``validate_manifest`` checks against by default (the vendored JobSet
definitions refer to Kubernetes v1.35 types)."""
JOBSET_SCHEMA = "v0.1.4"
"""``info.version`` of the vendored JobSet OpenAPI definitions (``k8s/jobset/swagger.json``)."""
JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"
"""The one JobSet apiVersion the vendored definitions describe."""

_SWAGGER = Path(__file__).parent / "k8s" / "jobset" / "swagger.json"
_K8S_DEFINITIONS_ID = "https://kubernetes.io/api/_definitions.json"
"""``$id`` of kubernetes-validate's ``_definitions.json`` (its strict definitions live under ``#/$defs/``)."""
_JOBSET_ID = "https://github.com/kubernetes-sigs/jobset/hack/python-sdk/swagger.json"
"""``$id`` given to the in-memory JobSet schema (the vendored file's origin; never fetched)."""
_K8S_REF = re.compile(
    r"https://raw\.githubusercontent\.com/kubernetes/kubernetes/refs/tags/v[0-9.]+/api/openapi-spec/swagger\.json"
    r"#/definitions/(io\.k8s\.[A-Za-z0-9_.]+)"
)


def validate_manifest(obj: dict[str, Any], k8s_version: str = K8S_VERSION) -> None:
    """Check one manifest against its kind's strict schema (Kubernetes ``k8s_version``, e.g. ``"1.35.0"``).

    Raises ``ValueError`` with one line per schema error, ``<Kind> <name>: <path>: <message>`` (path in
    ``spec.items[0].field`` form; ``unknown field`` for a field the schema does not know), where
    ``apiVersion``/``kind`` is missing or has no schema here (neither a core kind nor a v1alpha2 JobSet), or where
    kubernetes-validate has no schemas for ``k8s_version``.
    """
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    if not isinstance(api_version, str) or not isinstance(kind, str) or not api_version or not kind:
        raise ValueError(f"manifest without a string apiVersion and kind: apiVersion={api_version!r} kind={kind!r}")
    schema_dir = _schema_dir(k8s_version)
    if (api_version, kind) == (JOBSET_API_VERSION, "JobSet"):
        errors = list(_jobset_validator(schema_dir).iter_errors(obj))
    else:
        errors = _core_errors(obj, api_version, kind, k8s_version, schema_dir)
    if errors:
        label = f"{kind} {_name(obj)}"
        lines = [f"{label}: {line}" for e in sorted(errors, key=_error_key) for line in _describe(e)]
        raise ValueError("\n".join(lines))


def _core_errors(
    obj: dict[str, Any], api_version: str, kind: str, k8s_version: str, schema_dir: str
) -> list[ValidationError]:
    """Every strict-schema error of a core-kind manifest: [] when kubernetes-validate accepts it, else all of them
    (kubernetes-validate stops at the first one; the rest come from the same per-kind schema file)."""
    try:
        kubernetes_validate.validate(obj, k8s_version, strict=True)
        return []
    except kubernetes_validate.SchemaNotFoundError as e:
        raise ValueError(f"no schema for apiVersion {api_version!r} kind {kind!r} (Kubernetes {k8s_version})") from e
    except VersionNotSupportedError as e:
        raise ValueError(f"kubernetes-validate has no schemas for Kubernetes {k8s_version}") from e
    except kubernetes_validate.ValidationError as first:
        # kubernetes-validate's file name: the group without its domain, e.g. rbac.authorization.k8s.io/v1 -> rbac-v1
        group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
        validator = _core_validator(schema_dir, f"{kind.lower()}-{group_version}.json")
        return list(validator.iter_errors(obj)) if validator is not None else [first]


@functools.lru_cache(maxsize=8)
def _schema_dir(k8s_version: str) -> str:
    """kubernetes-validate's strict schema folder for ``k8s_version``: the newest Kubernetes release it bundles
    that is not newer than ``k8s_version``'s major.minor (kubernetes-validate's own choice), e.g.
    ``v1.35.0-local-strict``. Raises ``ValueError`` when it bundles none."""
    m = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.\d+)?", k8s_version)
    if m is None:
        raise ValueError(f"not a Kubernetes version: {k8s_version!r} (expected e.g. '1.35.0')")
    wanted = (int(m.group(1)), int(m.group(2)))
    bundled = {}
    for entry in _schema_root().iterdir():
        d = re.fullmatch(r"v(\d+)\.(\d+)\.\d+-local-strict", entry.name)
        if d is not None:
            bundled[(int(d.group(1)), int(d.group(2)))] = entry.name
    if not bundled or wanted > max(bundled) or wanted < min(bundled):
        raise ValueError(f"kubernetes-validate has no schemas for Kubernetes {k8s_version}")
    return bundled[max(v for v in bundled if v <= wanted)]


def _schema_root() -> Any:
    """kubernetes-validate's bundled schema folder (an importlib.resources Traversable)."""
    return importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"


@functools.lru_cache(maxsize=4)
def _k8s_registry(schema_dir: str) -> Registry:
    """A registry holding kubernetes-validate's strict ``_definitions.json`` of ``schema_dir`` (at its ``$id``)."""
    definitions = json.loads((_schema_root() / schema_dir / "_definitions.json").read_text())
    return Resource.from_contents(definitions) @ Registry()


@functools.lru_cache(maxsize=32)
def _core_validator(schema_dir: str, filename: str) -> Draft202012Validator | None:
    """Validator of one kubernetes-validate per-kind strict schema (None when the file is not bundled)."""
    path = _schema_root() / schema_dir / filename
    if not path.is_file():
        return None
    return Draft202012Validator(json.loads(path.read_text()), registry=_k8s_registry(schema_dir))


@functools.lru_cache(maxsize=1)
def _jobset_schema() -> dict[str, Any]:
    """The vendored JobSet swagger definitions as a JSON Schema (draft 2020-12) of a v1alpha2 JobSet.

    ``#/definitions/jobset.v1alpha2.*`` references are kept; every jobset definition with ``properties`` gets
    ``additionalProperties: false``; each ``io.k8s.*`` reference into the Kubernetes swagger becomes a reference
    to the definition of the same name in kubernetes-validate's ``_definitions.json``. Raises ``ValueError`` when
    the file's ``info.version`` is not ``JOBSET_SCHEMA`` or it refers to anything else.
    """
    swagger = json.loads(_SWAGGER.read_text())
    if swagger["info"]["version"] != JOBSET_SCHEMA:
        raise ValueError(f"{_SWAGGER}: info.version {swagger['info']['version']!r}, expected {JOBSET_SCHEMA!r}")

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: rewrite(v) for k, v in node.items()}
        ref = out.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#/definitions/jobset."):
            m = _K8S_REF.fullmatch(ref)
            if m is None:
                raise ValueError(f"{_SWAGGER}: unexpected $ref {ref!r}")
            out["$ref"] = f"{_K8S_DEFINITIONS_ID}#/$defs/{m.group(1)}"
        return out

    definitions = rewrite(swagger["definitions"])
    for definition in definitions.values():
        if "properties" in definition:
            definition["additionalProperties"] = False
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": _JOBSET_ID,
        "$ref": "#/definitions/jobset.v1alpha2.JobSet",
        "definitions": definitions,
    }


@functools.lru_cache(maxsize=4)
def _jobset_validator(schema_dir: str) -> Draft202012Validator:
    """Validator of a v1alpha2 JobSet whose Kubernetes types come from ``schema_dir``'s strict definitions.

    Raises ``ValueError`` when a referenced ``io.k8s.*`` definition is missing there.
    """
    schema = _jobset_schema()
    registry = _k8s_registry(schema_dir)
    known = registry.contents(_K8S_DEFINITIONS_ID)["$defs"]
    prefix = f"{_K8S_DEFINITIONS_ID}#/$defs/"
    for ref in _refs(schema):
        if ref.startswith(prefix) and ref.removeprefix(prefix) not in known:
            raise ValueError(f"JobSet schema refers to {ref.removeprefix(prefix)}, which {schema_dir} does not define")
    return Draft202012Validator(schema, registry=registry)


def _refs(node: Any) -> list[str]:
    """Every ``$ref`` value in a schema."""
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    if not isinstance(node, dict):
        return []
    own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
    return own + [r for v in node.values() for r in _refs(v)]


def _name(obj: dict[str, Any]) -> str:
    """``metadata.name`` (or ``generateName``), ``?`` when there is none."""
    metadata = obj.get("metadata")
    if isinstance(metadata, dict):
        for key in ("name", "generateName"):
            if isinstance(metadata.get(key), str) and metadata[key]:
                return str(metadata[key])
    return "?"


def _path(parts: Any) -> str:
    """A JSON path as ``spec.items[0].field`` (keys that are not plain names as ``["app.kubernetes.io/x"]``)."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_$][A-Za-z0-9_$-]*", part):
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(part)}]"
    return out


def _describe(error: ValidationError) -> list[str]:
    """``<path>: <message>`` lines of one error: an unknown-field error gives one line per unknown field."""
    path = list(error.absolute_path)
    if (
        error.validator == "additionalProperties"
        and error.validator_value is False
        and isinstance(error.instance, dict)
    ):
        known = error.schema.get("properties", {})
        patterns = error.schema.get("patternProperties", {})
        unknown = [k for k in error.instance if k not in known and not any(re.search(p, k) for p in patterns)]
        if unknown:
            return [f"{_path([*path, k])}: unknown field" for k in unknown]
    return [f"{_path(path) or '(root)'}: {error.message}"]


def _error_key(error: ValidationError) -> list[tuple[int, int | str]]:
    """Sort key of an error: its path, list indices in numeric order."""
    return [(0, p) if isinstance(p, int) else (1, p) for p in error.absolute_path]
