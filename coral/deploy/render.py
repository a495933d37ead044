"""Deployment manifests for a plan: SkyPilot services, Kubernetes (Deployments and KubeRay RayClusters), and
plain per-node shell commands.

Instances are grouped by (model, phase, template, region): a single-node group becomes one SkyPilot service
or one Kubernetes Deployment with `replicas` = group size. A multi-node pipeline becomes one KubeRay
`RayCluster` per instance (stage 0 on the head, one worker group per node config of the other stages) plus a
Job that submits the `vllm serve` launch to it and a Service for its API; SkyPilot services cannot hold
heterogeneous multi-node replicas, so those instances are listed as skipped for that target. The `commands`
target writes the exact `--node-rank` launch of every node, which places stages exactly.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from coral.allocation.plan import Plan, PlanInstance
from coral.catalog.loader import Catalog, CoralInputError, builtin_catalog
from coral.catalog.schema import NodeOffering, parse_config_name
from coral.deploy.endpoints import EndpointsFile, EndpointSpec
from coral.deploy.vllm import VLLM_PORT, NodeLaunch, launch_commands, realisable

Target = Literal["skypilot", "kubernetes", "commands"]
TARGETS: tuple[Target, ...] = ("skypilot", "kubernetes", "commands")
VLLM_IMAGE = "vllm/vllm-openai:v0.33.0"
RAY_VERSION = "2.60.0"
READINESS_DELAY_S = 1200


class _NoAliasDumper(yaml.SafeDumper):
    """Plain YAML without anchors (shared label dicts would otherwise become &id001 aliases)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


@dataclass
class RenderResult:
    files: list[Path] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # instance id -> reason
    endpoints: list[EndpointSpec] = field(
        default_factory=list
    )  # kubernetes: one per Service (endpoints.json)


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


def groups(plan: Plan) -> dict[tuple[str, str, int, str], list[PlanInstance]]:
    out: dict[tuple[str, str, int, str], list[PlanInstance]] = defaultdict(list)
    for inst in plan.instances:
        out[(inst.model, inst.phase, inst.template_id, inst.region)].append(inst)
    return dict(out)


def group_name(inst: PlanInstance) -> str:
    return dns_name(inst.model, inst.phase, f"t{inst.template_id}", inst.region)


def replica_groups(insts: list[PlanInstance], catalog: Catalog) -> dict[str, tuple[NodeLaunch, int, float]]:
    """Single-stage instances of one group as replica sets: name -> (launch, replicas, planned tokens/s), one
    set per node config (a data-parallel stage runs each of its nodes as an independent replica)."""
    launches: dict[str, list[NodeLaunch]] = defaultdict(list)
    weight: dict[str, float] = defaultdict(float)
    for inst in insts:
        for nl in launch_commands(inst, catalog.model(inst.model)):
            launches[nl.config].append(nl)
            weight[nl.config] += inst.stages[0].node_throughput[nl.replica]
    base = group_name(insts[0])
    return {
        (base if len(launches) == 1 else dns_name(base, cfg, limit=60)): (nls[0], len(nls), weight[cfg])
        for cfg, nls in sorted(launches.items())
    }


# --- SkyPilot ---------------------------------------------------------------------------------------------
def skypilot_service(
    inst: PlanInstance, launch: NodeLaunch, name: str, replicas: int, catalog: Catalog
) -> dict[str, Any]:
    """SkyPilot task + service YAML (as a dict) for `replicas` single-node replicas running `launch`."""
    o = offering(catalog, launch.config, inst.region)
    gpu, n = parse_config_name(launch.config)
    return {
        "name": name,
        "resources": {
            "cloud": o.cloud,
            "region": cloud_region(o),
            "accelerators": f"{gpu}:{n}",
            "instance_type": o.instance_type,
            "ports": VLLM_PORT,
        },
        "envs": {"HF_TOKEN": None, **launch.env},
        "run": launch.shell(),
        "service": {
            "readiness_probe": {"path": "/health", "initial_delay_seconds": READINESS_DELAY_S},
            "replicas": replicas,
        },
    }


# --- Kubernetes -------------------------------------------------------------------------------------------
def _container(name: str, launch: NodeLaunch | None, gpus: int, image: str) -> dict[str, Any]:
    """A GPU container; with `launch` it runs that vLLM command and probes `/health`."""
    c: dict[str, Any] = {
        "name": name,
        "image": image,
        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}, "requests": {"nvidia.com/gpu": str(gpus)}},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
        "env": [
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token", "optional": True}},
            }
        ],
    }
    if launch is not None:
        c["command"] = launch.argv[:2]
        c["args"] = launch.argv[2:]
        c["env"] += [{"name": k, "value": v} for k, v in launch.env.items()]
        c["ports"] = [{"containerPort": VLLM_PORT, "name": "http"}]
        c["readinessProbe"] = {
            "httpGet": {"path": "/health", "port": VLLM_PORT},
            "initialDelaySeconds": 60,
            "periodSeconds": 10,
            "failureThreshold": READINESS_DELAY_S // 10,
        }
    return c


def _pod_spec(container: dict[str, Any], o: NodeOffering) -> dict[str, Any]:
    return {
        "nodeSelector": {"node.kubernetes.io/instance-type": o.instance_type},
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }


def _labels(inst: PlanInstance, name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": name,
        "coral.io/model": dns_name(inst.model),
        "coral.io/phase": inst.phase,
    }


def _service(name: str, selector: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {
            "selector": selector,
            "ports": [{"name": "http", "port": VLLM_PORT, "targetPort": VLLM_PORT}],
        },
    }


def k8s_deployment(
    inst: PlanInstance,
    launch: NodeLaunch,
    name: str,
    replicas: int,
    catalog: Catalog,
    image: str = VLLM_IMAGE,
) -> list[dict[str, Any]]:
    """Deployment + Service for `replicas` single-node replicas running `launch`."""
    labels = _labels(inst, name)
    o = offering(catalog, launch.config, inst.region)
    dep = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
            "template": {
                "metadata": {"labels": labels},
                "spec": _pod_spec(_container("vllm", launch, launch.gpus, image), o),
            },
        },
    }
    return [dep, _service(name, {"app.kubernetes.io/name": name})]


def k8s_raycluster(
    inst: PlanInstance, index: int, catalog: Catalog, image: str = VLLM_IMAGE
) -> list[dict[str, Any]]:
    """RayCluster (head = stage 0, a worker group per node config of the other stages) + launch Job + Service.

    vLLM's Ray executor gives rank 0 to the driver (the head, stage 0) and orders the other workers by node
    IP: with three or more stages on different configs the stage-to-config mapping of the later stages is not
    guaranteed. `--target commands` places every stage exactly (explicit `--node-rank`)."""
    (launch,) = launch_commands(inst, catalog.model(inst.model), executor="ray")
    name = dns_name(group_name(inst), str(index), limit=40)
    labels = _labels(inst, name)
    head_cfg = inst.stages[0].nodes[0]
    head_o = offering(catalog, head_cfg, inst.region)
    workers: dict[str, int] = defaultdict(int)
    for s in inst.stages[1:]:
        workers[s.nodes[0]] += 1
    worker_groups = []
    for cfg, n in sorted(workers.items()):
        _, gpus = parse_config_name(cfg)
        o = offering(catalog, cfg, inst.region)
        worker_groups.append(
            {
                "groupName": dns_name(cfg, limit=30),
                "replicas": n,
                "minReplicas": n,
                "maxReplicas": n,
                "rayStartParams": {},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": _pod_spec(_container("ray-worker", None, gpus, image), o),
                },
            }
        )
    cluster = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "rayVersion": RAY_VERSION,
            "headGroupSpec": {
                "rayStartParams": {"dashboard-host": "0.0.0.0"},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": _pod_spec(
                        _container("ray-head", None, parse_config_name(head_cfg)[1], image), head_o
                    ),
                },
            },
            "workerGroupSpecs": worker_groups,
        },
    }
    submit = [
        "ray",
        "job",
        "submit",
        "--address",
        f"http://{name}-head-svc:8265",
        "--no-wait",
        "--",
        "bash",
        "-c",
        launch.shell(),
    ]
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": f"{name}-launch", "labels": labels},
        "spec": {
            "backoffLimit": 10,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "OnFailure",
                    "containers": [{"name": "submit", "image": image, "command": submit}],
                },
            },
        },
    }
    return [cluster, job, _service(name, {"ray.io/cluster": name, "ray.io/node-type": "head"})]


def _endpoint(service: str, inst: PlanInstance, weight: float) -> EndpointSpec:
    return EndpointSpec(
        id=service, model=inst.model, phase=inst.phase, url=f"http://{service}:{VLLM_PORT}", weight=weight
    )


# --- writing ----------------------------------------------------------------------------------------------
def render(
    plan: Plan, target: Target, out_dir: str | Path, catalog: Catalog | None = None, image: str = VLLM_IMAGE
) -> RenderResult:
    """Write the manifests of `plan` for `target` into `out_dir` (plus `index.json`); returns files and skips."""
    if target not in TARGETS:
        raise CoralInputError(f"target: must be one of {', '.join(TARGETS)}, not {target!r}")
    cat = catalog or builtin_catalog()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    res = RenderResult()

    def write(name: str, docs: list[dict[str, Any]] | str) -> None:
        path = out / name
        path.write_text(
            docs if isinstance(docs, str) else yaml.dump_all(docs, Dumper=_NoAliasDumper, sort_keys=False)
        )
        res.files.append(path)

    for (_m, _p, _t, _r), insts in groups(plan).items():
        first = insts[0]
        check = realisable(first, cat.model(first.model))
        if not check:
            res.skipped.update({i.id: check.reason for i in insts})
            continue
        single = len(first.stages) == 1
        if single and target != "commands":
            for name, (launch, replicas, weight) in replica_groups(insts, cat).items():
                if target == "skypilot":
                    write(f"{name}.sky.yaml", [skypilot_service(first, launch, name, replicas, cat)])
                else:
                    write(f"{name}.k8s.yaml", k8s_deployment(first, launch, name, replicas, cat, image))
                    res.endpoints.append(_endpoint(name, first, weight))
        elif target == "skypilot":
            res.skipped.update(
                {i.id: "multi-node pipeline: use --target kubernetes or commands" for i in insts}
            )
        elif target == "kubernetes":
            for k, inst in enumerate(insts):
                docs = k8s_raycluster(inst, k, cat, image)
                write(f"{group_name(first)}-{k}.raycluster.yaml", docs)
                res.endpoints.append(_endpoint(docs[-1]["metadata"]["name"], inst, inst.throughput))
        else:
            for inst in insts:
                lines = [
                    "#!/usr/bin/env bash",
                    f"# {inst.id}: one line per node (pipelines: run rank 0 first)",
                    "set -euo pipefail",
                ]
                for nl in launch_commands(inst, cat.model(inst.model)):
                    role = f"rank {nl.rank}" if len(inst.stages) > 1 else f"replica {nl.replica}"
                    lines.append(f"# {role} on a {nl.config} node in {inst.region}")
                    lines.append(nl.shell())
                write(f"{dns_name(inst.id, limit=60)}.sh", "\n".join(lines) + "\n")
    if res.endpoints:
        EndpointsFile(endpoints=res.endpoints).save(out / "endpoints.json")
    index = {
        "target": target,
        "endpoints": "endpoints.json" if res.endpoints else None,
        "scenario": plan.scenario,
        "files": [p.name for p in res.files],
        "skipped": res.skipped,
    }
    (out / "index.json").write_text(json.dumps(index, indent=2))
    return res
