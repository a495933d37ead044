"""Offline validation of rendered manifests (optional `deploy` extra), each error a CoralInputError naming the field.

- Built-in kinds (Deployment, Service, ConfigMap): `kubernetes-validate --strict` (its Python API: the Kubernetes
  OpenAPI schemas of `KUBERNETES_VERSION` with unknown fields refused, as `kubectl apply --validate=strict` refuses
  them; an API version that Kubernetes release no longer serves is refused too), then the `kubernetes` client's
  pydantic models.
- RayCluster (ray.io/v1): the KubeRay CRD's OpenAPI v3 schema shipped in `coral/data/schemas/kuberay-v1.7.0/`
  (source and licence beside it), through `jsonschema`, made strict: the API server prunes unknown fields of a
  structural schema silently, so every object schema that lists `properties` (and does not keep unknown fields,
  `x-kubernetes-preserve-unknown-fields`) refuses fields it does not list.
- Every kind: `metadata.name` must be a DNS-1123 label (at most 63 characters), which none of the schemas checks.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml
from pydantic import ValidationError

from coral.catalog.loader import CoralInputError, format_validation_error

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
KUBERNETES_VERSION = "1.33"  # the schemas kubernetes-validate checks built-in kinds against
KUBERAY_VERSION = "1.7.0"
KUBERAY_SCHEMA = f"data/schemas/kuberay-v{KUBERAY_VERSION}/raycluster-v1.yaml"
BUILTIN_KINDS = ("Deployment", "Service", "ConfigMap")
KINDS = (*BUILTIN_KINDS, "RayCluster")


def _path(parts: Iterable[Any]) -> str:
    return ".".join(str(p) for p in parts) or "(document)"


def _describe(err: Any) -> list[str]:
    """'field.path: problem' lines for one jsonschema error; unknown fields are named one by one."""
    where = list(err.absolute_path)
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        known = set((err.schema or {}).get("properties", {}))
        extra = sorted(k for k in err.instance if k not in known)
        if extra:
            return [f"{_path([*where, k])}: unknown field" for k in extra]
    return [f"{_path(where)}: {err.message}"]


def _fail(source: str, kind: str, problems: list[str]) -> None:
    raise CoralInputError(f"{source} ({kind}): " + (problems[0] if len(problems) == 1 else
                                                   f"{len(problems)} problems\n  " + "\n  ".join(problems)))


def _strict(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that lists `properties` and neither
    allows other fields already nor keeps unknown fields (`x-kubernetes-preserve-unknown-fields`)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@lru_cache(maxsize=1)
def raycluster_schema() -> dict[str, Any]:
    """The KubeRay RayCluster v1 OpenAPI v3 schema as shipped (not made strict)."""
    text = resources.files("coral").joinpath(KUBERAY_SCHEMA).read_text()
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    schema: dict[str, Any] = yaml.load(text, Loader=loader)["openAPIV3Schema"]
    return schema


@lru_cache(maxsize=1)
def _raycluster_validator() -> Any:
    import jsonschema

    schema = _strict(copy.deepcopy(raycluster_schema()))
    return jsonschema.Draft7Validator(schema)


def validate_raycluster(doc: dict[str, Any], source: str = "manifest") -> None:
    """Raise CoralInputError naming every field of `doc` that the KubeRay RayCluster v1 schema refuses
    (unknown fields included)."""
    if doc.get("apiVersion") != "ray.io/v1":
        _fail(source, "RayCluster", [f"apiVersion: {doc.get('apiVersion')!r}, expected 'ray.io/v1'"])
    errors = sorted(_raycluster_validator().iter_errors(doc), key=lambda e: [str(p) for p in e.absolute_path])
    problems = [line for e in errors for line in _describe(e)]
    if problems:
        _fail(source, "RayCluster", problems)


def _validate_builtin(doc: dict[str, Any], kind: str, source: str) -> None:
    import kubernetes_validate
    from kubernetes import client

    models: dict[str, Any] = {"Deployment": client.V1Deployment, "Service": client.V1Service,
                              "ConfigMap": client.V1ConfigMap}
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        _fail(source, kind, _describe(exc))
    except kubernetes_validate.SchemaNotFoundError as exc:
        _fail(source, kind, [f"apiVersion: {exc.message}"])
    try:
        models[kind].model_validate(doc)
    except ValidationError as exc:
        raise CoralInputError(format_validation_error(f"{source} ({kind})", exc)) from exc


def validate_manifest(doc: dict[str, Any], source: str = "manifest") -> None:
    """Raise CoralInputError naming the field when `doc` is not a valid object of its kind (one of `KINDS`)."""
    kind = doc.get("kind")
    if kind not in KINDS:
        raise CoralInputError(f"{source}: kind: unsupported kind {kind!r} (checked: {', '.join(KINDS)})")
    name = str((doc.get("metadata") or {}).get("name", ""))
    if len(name) > 63 or not _DNS_LABEL.match(name):
        raise CoralInputError(f"{source} ({kind}): metadata.name: {name!r} is not a DNS-1123 label")
    if kind == "RayCluster":
        validate_raycluster(doc, source)
    else:
        _validate_builtin(doc, str(kind), source)
