"""Offline validation of rendered manifests: Kubernetes built-in kinds through the `kubernetes` client's
pydantic models (optional `deploy` extra), KubeRay `RayCluster` through a small schema of its required
fields whose pod templates are again checked with the client's `V1PodTemplateSpec`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from coral.catalog.loader import CoralInputError, format_validation_error


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rayStartParams: dict[str, str]
    template: dict[str, Any]

    @field_validator("template")
    @classmethod
    def _pod_template(cls, v: dict[str, Any]) -> dict[str, Any]:
        from kubernetes.client import V1PodTemplateSpec

        V1PodTemplateSpec.model_validate(v)
        return v


class _WorkerGroup(_Group):
    groupName: str = Field(min_length=1)
    replicas: int = Field(ge=0)
    minReplicas: int = Field(ge=0)
    maxReplicas: int = Field(ge=0)


class _RaySpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    rayVersion: str
    headGroupSpec: _Group
    workerGroupSpecs: list[_WorkerGroup]


class _Meta(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class RayCluster(BaseModel):
    """Required fields of a KubeRay `ray.io/v1` RayCluster."""

    model_config = ConfigDict(extra="forbid")
    apiVersion: Literal["ray.io/v1"]
    kind: Literal["RayCluster"]
    metadata: _Meta
    spec: _RaySpec


def validate_manifest(doc: dict[str, Any], source: str = "manifest") -> None:
    """Raise CoralInputError naming the field when `doc` is not a valid object of its kind."""
    from kubernetes import client

    kinds: dict[str, Any] = {
        "Deployment": client.V1Deployment,
        "Service": client.V1Service,
        "Job": client.V1Job,
        "RayCluster": RayCluster,
    }
    kind = doc.get("kind")
    model = kinds.get(str(kind))
    if model is None:
        raise CoralInputError(f"{source}: kind: unsupported kind {kind!r}")
    try:
        model.model_validate(doc)
    except ValidationError as exc:
        raise CoralInputError(format_validation_error(f"{source} ({kind})", exc)) from exc
