"""Offline validation of rendered manifests through the `kubernetes` client's pydantic models (optional `deploy`
extra), plus the DNS-1123 rule for object names that those models do not check."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from coral.catalog.loader import CoralInputError, format_validation_error

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def validate_manifest(doc: dict[str, Any], source: str = "manifest") -> None:
    """Raise CoralInputError naming the field when `doc` is not a valid object of its kind."""
    from kubernetes import client

    kinds: dict[str, Any] = {"Deployment": client.V1Deployment, "Service": client.V1Service}
    kind = doc.get("kind")
    model = kinds.get(str(kind))
    if model is None:
        raise CoralInputError(f"{source}: kind: unsupported kind {kind!r}")
    name = str((doc.get("metadata") or {}).get("name", ""))
    if len(name) > 63 or not _DNS_LABEL.match(name):
        raise CoralInputError(f"{source} ({kind}): metadata.name: {name!r} is not a DNS-1123 label")
    try:
        model.model_validate(doc)
    except ValidationError as exc:
        raise CoralInputError(format_validation_error(f"{source} ({kind})", exc)) from exc
