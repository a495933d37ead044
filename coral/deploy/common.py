"""What both engines' deployers share (`coral.deploy.render` for stock vLLM, `coral.deploy.coral_engine` for the
Coral engine): names, offerings, pod and SkyPilot resource specs, labels, endpoints and the file writer."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from coral.allocation.plan import Plan, PlanInstance
from coral.catalog.loader import Catalog, CoralInputError
from coral.catalog.schema import NodeOffering, parse_config_name
from coral.deploy.endpoints import EndpointSpec
from coral.deploy.shell import NODE_ADDR_VAR
from coral.deploy.vllm import VLLM_PORT

READINESS_DELAY_S = 1200


class _NoAliasDumper(yaml.SafeDumper):
    """Plain YAML without anchors (shared label dicts would otherwise become &id001 aliases)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


@dataclass(frozen=True)
class DeferredUrl:
    """An engine URL known only once the engine runs (a SkyPilot load balancer, a machine's address): `expr`, a
    bash word giving it, and `how`, what gives it (shown when it is missing or malformed)."""

    expr: str
    how: str


@dataclass(frozen=True)
class Gateway:
    """The single client endpoint of a deployment: `name` (its Service or SkyPilot service), `url` (the OpenAI
    API base clients use; a shell expression where it is known only once launched) and the files that run it."""

    name: str
    url: str
    files: tuple[str, ...]


@dataclass
class RenderResult:
    files: list[Path] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # instance id -> reason
    endpoints: list[EndpointSpec] = field(default_factory=list)  # one per rendered engine API (the gateway's file)
    deferred: dict[str, DeferredUrl] = field(default_factory=dict)  # endpoint id -> its URL, once launched
    uncovered: list[tuple[str, str]] = field(default_factory=list)  # (model, phase) with no launchable instance
    gateways: list[Gateway] = field(default_factory=list)  # one, or one per RayCluster (kuberay)


def dns_name(*parts: str, limit: int = 50) -> str:
    """A DNS-1123 label from `parts` (lowercase, '-', at most `limit` chars, hashed suffix when cut)."""
    raw = "-".join(parts)
    s = re.sub(r"[^a-z0-9-]+", "-", raw.lower()).strip("-")
    s = re.sub(r"-+", "-", s)
    if len(s) > limit:
        s = s[: limit - 9].rstrip("-") + "-" + hashlib.sha1(raw.encode()).hexdigest()[:8]
    return s


def offering(catalog: Catalog, config: str, region: str) -> NodeOffering:
    """Cheapest offering of `config` in `region`."""
    offers = [o for o in catalog.offerings if o.config == config and o.region == region]
    if not offers:
        raise CoralInputError(f"no offering of {config} in region {region!r}")
    return min(offers, key=lambda o: o.price_per_hour)


def cloud_region(o: NodeOffering) -> str:
    """Catalog regions are prefixed by the cloud ('aws-us-east-2'); SkyPilot wants the bare name."""
    prefix = f"{o.cloud}-"
    return o.region[len(prefix) :] if o.region.startswith(prefix) else o.region


def skypilot_resources(catalog: Catalog, config: str, region: str, image: str, ports: int | list[int]) -> dict[str, Any]:
    """A SkyPilot `resources` spec: the cheapest offering of node config `config` in `region`, in `image`."""
    o = offering(catalog, config, region)
    gpu, n = parse_config_name(config)
    return {
        "cloud": o.cloud,
        "region": cloud_region(o),
        "accelerators": f"{gpu}:{n}",
        "instance_type": o.instance_type,
        "image_id": f"docker:{image}",
        "ports": ports,
    }


SKY_NODE_ADDR = f"export {NODE_ADDR_VAR}=$(hostname -I | awk '{{print $1}}')\n"


def node_selector(o: NodeOffering) -> dict[str, str]:
    """The node selector that pins a pod to offering `o`'s instance type (the well-known Kubernetes label)."""
    return {"node.kubernetes.io/instance-type": o.instance_type}


def pod_spec(container: dict[str, Any], o: NodeOffering) -> dict[str, Any]:
    return {
        "nodeSelector": node_selector(o),
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }


def k8s_labels(inst: PlanInstance, name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": name,
        "coral.io/model": dns_name(inst.model),
        "coral.io/phase": inst.phase,
    }


def endpoint_spec(service: str, inst: PlanInstance, weight: float, url: str | None = None) -> EndpointSpec:
    """The endpoint of `service` (at `url`, default `http://<service>:VLLM_PORT`): `weight` tokens/s of instances
    like `inst` (class weights in proportion)."""
    per_class = inst.class_throughput
    return EndpointSpec(
        id=service, model=inst.model, phase=inst.phase, url=url or f"http://{service}:{VLLM_PORT}", weight=weight,
        class_weights=None if per_class is None else {c: v * weight / inst.throughput for c, v in per_class.items()},
    )


def uncovered_keys(plan: Plan, skipped: dict[str, str]) -> list[tuple[str, str]]:
    """(model, phase) pairs of the plan left with no launchable instance."""
    keys = dict.fromkeys((i.model, i.phase) for i in plan.instances)
    return [k for k in keys if all(i.id in skipped for i in plan.instances_of(*k))]


def writer(out: Path, res: RenderResult) -> Callable[[str, list[dict[str, Any]] | str], None]:
    """`write(name, docs)`: YAML documents (or text) to `out/name`, recorded in `res.files`."""

    def write(name: str, docs: list[dict[str, Any]] | str) -> None:
        path = out / name
        path.write_text(
            docs if isinstance(docs, str) else yaml.dump_all(docs, Dumper=_NoAliasDumper, sort_keys=False)
        )
        res.files.append(path)

    return write

