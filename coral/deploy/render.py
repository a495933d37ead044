"""Deployment manifests for a plan: SkyPilot services, Kubernetes (Deployments and Services), and
plain per-node shell commands.

Instances are grouped by (model, phase, template, region): a single-node group becomes one SkyPilot service
or one Kubernetes Deployment with `replicas` = group size. A multi-node pipeline becomes, per instance, one
single-pod Deployment per pipeline rank (pinned by node selector to its stage's instance type and started with
an explicit `--node-rank`, so a node always loads the layers the plan gave its stage) and a headless Service on
rank 0 (API and rendezvous address). A SkyPilot service replica is one task, whose nodes share one resources
spec: a pipeline whose stages all use one node config becomes a multi-node replica (`num_nodes`, each node running
its rank by `$SKYPILOT_NODE_RANK`); other pipelines are listed as skipped for that target (the rule is
`coral.templates.engines.DEPLOY_TARGETS`, which also restricts planning with `--target`). The `commands` target
writes one script per node.

Every target also gets the gateway (`coral.deploy.gateway`): the deployment's single client endpoint, routing to
every rendered engine API (a replica set's Service or SkyPilot service, a pipeline's rank 0, a node script's
replica), prefill then decode.

With `engine="coral"` the Coral engine is deployed instead (`coral.deploy.coral_engine`: KubeRay, Kubernetes,
SkyPilot and scripts), through the same checks, staging and index.

Rendering never drops a (model, phase) silently: `RenderResult.uncovered` lists those left with no launchable
instance, and the CLI fails on them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Literal, cast

from coral.allocation.plan import Plan, PlanInstance
from coral.allocation.plan_check import check_plan
from coral.catalog.loader import Catalog, CoralInputError, builtin_catalog
from coral.catalog.schema import ModelArch, NodeOffering
from coral.deploy import coral_engine, gateway
from coral.deploy.common import (
    READINESS_DELAY_S,
    SKY_NODE_ADDR,
    RenderResult,
    dns_name,
    endpoint_spec,
    k8s_labels,
    offering,
    pod_spec,
    skypilot_resources,
    uncovered_keys,
    writer,
)
from coral.deploy.shell import HEAD_ADDR_VAR, NODE_ADDR_VAR, SKY_RANK_VAR, k8s_word
from coral.deploy.vllm import (
    NIXL_SIDE_CHANNEL_PORT,
    VLLM_PORT,
    NodeLaunch,
    Realisability,
    launch_commands,
    push_models,
    realisable,
)
from coral.templates.engines import target_refusal
from coral.templates.library import Template

Target = Literal["skypilot", "kubernetes", "commands"]
TARGETS: tuple[Target, ...] = ("skypilot", "kubernetes", "commands")
VLLM_IMAGE = "vllm/vllm-openai:v0.33.0"


def groups(plan: Plan) -> dict[tuple[str, str, int, str], list[PlanInstance]]:
    out: dict[tuple[str, str, int, str], list[PlanInstance]] = defaultdict(list)
    for inst in plan.instances:
        out[(inst.model, inst.phase, inst.template_id, inst.region)].append(inst)
    return dict(out)


def group_name(inst: PlanInstance) -> str:
    return dns_name(inst.model, inst.phase, f"t{inst.template_id}", inst.region)


def replica_groups(
    insts: list[PlanInstance], catalog: Catalog, push: bool
) -> dict[str, tuple[NodeLaunch, int, float]]:
    """Single-stage instances of one group as replica sets: name -> (launch, replicas, planned tokens/s), one
    set per node config (a data-parallel stage runs each of its nodes as an independent replica)."""
    launches: dict[str, list[NodeLaunch]] = defaultdict(list)
    weight: dict[str, float] = defaultdict(float)
    for inst in insts:
        for nl in launch_commands(inst, catalog.model(inst.model), push=push):
            launches[nl.config].append(nl)
            weight[nl.config] += inst.stages[0].node_throughput[nl.replica]
    base = group_name(insts[0])
    return {
        (base if len(launches) == 1 else dns_name(base, cfg, limit=60)): (nls[0], len(nls), weight[cfg])
        for cfg, nls in sorted(launches.items())
    }


# --- SkyPilot ---------------------------------------------------------------------------------------------
def _skypilot_task(
    inst: PlanInstance, launch: NodeLaunch, name: str, replicas: int, catalog: Catalog, image: str, run: str
) -> dict[str, Any]:
    """SkyPilot task + service YAML (as a dict) for `replicas` replicas on `launch`'s node config running `run`
    in the vLLM image. The replica serves on `VLLM_PORT` (`service.ports`, needed as soon as the NIXL port is
    opened too); the Hugging Face token is a secret (`sky serve up --secret HF_TOKEN`), never written here."""
    return {
        "name": name,
        "resources": skypilot_resources(catalog, launch.config, inst.region, image,
                                        [VLLM_PORT, NIXL_SIDE_CHANNEL_PORT] if launch.env else VLLM_PORT),
        "secrets": {"HF_TOKEN": None},
        "envs": dict(launch.env),
        "run": run,
        "service": {
            "readiness_probe": {"path": "/health", "initial_delay_seconds": READINESS_DELAY_S},
            "replicas": replicas,
            "ports": VLLM_PORT,
        },
    }


def skypilot_service(
    inst: PlanInstance, launch: NodeLaunch, name: str, replicas: int, catalog: Catalog, image: str = VLLM_IMAGE
) -> dict[str, Any]:
    """The service of `replicas` single-node replicas running `launch`."""
    run = (SKY_NODE_ADDR if launch.env else "") + launch.shell()
    return _skypilot_task(inst, launch, name, replicas, catalog, image, run)


def skypilot_pipeline(
    inst: PlanInstance, launches: list[NodeLaunch], name: str, replicas: int, catalog: Catalog,
    image: str = VLLM_IMAGE,
) -> dict[str, Any]:
    """The service of `replicas` multi-node replicas of a one-config pipeline: `num_nodes` = stages, node r runs
    rank r (`$SKYPILOT_NODE_RANK`; rank 0, SkyPilot's head node, serves), the head's address from
    `$SKYPILOT_NODE_IPS` is the rendezvous."""
    cases = "".join(f"  {nl.rank}) {nl.shell(exec_=True)} ;;\n" for nl in launches)
    run = (SKY_NODE_ADDR + f'export {HEAD_ADDR_VAR}=$(echo "$SKYPILOT_NODE_IPS" | head -n1)\n'
           + f'case "${SKY_RANK_VAR}" in\n{cases}esac\n')
    task = _skypilot_task(inst, launches[0], name, replicas, catalog, image, run)
    return {"name": name, "num_nodes": len(launches), **{k: v for k, v in task.items() if k != "name"}}


# --- Kubernetes -------------------------------------------------------------------------------------------
def _container(launch: NodeLaunch, image: str, head_addr: str | None = None) -> dict[str, Any]:
    """The vLLM container of one node: its GPUs, its command, the node's own address (NIXL side channel),
    the rank-0 address (pipelines) and the HF token from the `hf-token` secret; rank 0 serves and is probed."""
    env: list[dict[str, Any]] = [
        {"name": NODE_ADDR_VAR, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token", "optional": True}}},
    ]
    if head_addr is not None:
        env.append({"name": HEAD_ADDR_VAR, "value": head_addr})
    env += [{"name": k, "value": k8s_word(v)} for k, v in launch.env.items()]
    ports = [{"containerPort": NIXL_SIDE_CHANNEL_PORT, "name": "nixl"}] if launch.env else []
    c: dict[str, Any] = {
        "name": "vllm",
        "image": image,
        "command": launch.argv[:2],
        "args": [k8s_word(a) for a in launch.argv[2:]],
        "resources": {
            "limits": {"nvidia.com/gpu": str(launch.gpus)},
            "requests": {"nvidia.com/gpu": str(launch.gpus)},
        },
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
        "env": env,
        "ports": ports,
    }
    if launch.rank == 0:
        c["ports"] = [{"containerPort": VLLM_PORT, "name": "http"}, *ports]
        c["readinessProbe"] = {
            "httpGet": {"path": "/health", "port": VLLM_PORT},
            "initialDelaySeconds": 60,
            "periodSeconds": 10,
            "failureThreshold": READINESS_DELAY_S // 10,
        }
    return c


def _service(name: str, selector: dict[str, str], headless: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "selector": selector,
        "ports": [{"name": "http", "port": VLLM_PORT, "targetPort": VLLM_PORT}],
    }
    if headless:
        spec["clusterIP"] = "None"
        spec["publishNotReadyAddresses"] = True  # the other ranks must reach rank 0 before it is ready
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec}


def _deployment(
    name: str, labels: dict[str, str], replicas: int, launch: NodeLaunch, o: NodeOffering, image: str,
    head_addr: str | None = None,
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": {k: labels[k] for k in ("app.kubernetes.io/name", "coral.io/rank")
                                         if k in labels}},
            "template": {
                "metadata": {"labels": labels},
                "spec": pod_spec(_container(launch, image, head_addr), o),
            },
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
    labels = k8s_labels(inst, name)
    o = offering(catalog, launch.config, inst.region)
    dep = _deployment(name, labels, replicas, launch, o, image)
    return [dep, _service(name, {"app.kubernetes.io/name": name})]


def k8s_pipeline(
    inst: PlanInstance, index: int, catalog: Catalog, image: str = VLLM_IMAGE, push: bool = False
) -> list[dict[str, Any]]:
    """One single-pod Deployment per pipeline rank plus a headless Service on rank 0.

    Rank r runs on an instance of stage r's config (node selector) with `--node-rank r`: the mapping from
    stages to nodes is fixed by the manifest, not by scheduling order."""
    name = dns_name(group_name(inst), str(index), limit=40)
    docs: list[dict[str, Any]] = []
    for launch in launch_commands(inst, catalog.model(inst.model), push=push):
        labels = {**k8s_labels(inst, name), "coral.io/rank": str(launch.rank)}
        o = offering(catalog, launch.config, inst.region)
        docs.append(_deployment(f"{name}-r{launch.rank}", labels, 1, launch, o, image, head_addr=name))
    docs.append(_service(name, {"app.kubernetes.io/name": name, "coral.io/rank": "0"}, headless=True))
    return docs


# --- coverage ---------------------------------------------------------------------------------------------
def launchable(inst: PlanInstance | Template, arch: ModelArch, target: Target) -> Realisability:
    """Whether `target` launches `inst` (a plan instance or a library template) with stock vLLM (`realisable`,
    then the target's own limit)."""
    check = realisable(inst, arch)
    if not check:
        return check
    why = target_refusal(target, [st.nodes for st in inst.stages])
    return Realisability(not why, why)


def skipped_instances(plan: Plan, target: Target, catalog: Catalog) -> dict[str, str]:
    """Instance id -> why stock vLLM on `target` cannot launch it."""
    out: dict[str, str] = {}
    for inst in plan.instances:
        check = launchable(inst, catalog.model(inst.model), target)
        if not check:
            out[inst.id] = check.reason
    return out


def node_script(inst: PlanInstance, launch: NodeLaunch) -> str:
    """A stand-alone script for one node: run it on that node (pipelines: every rank, rank 0 anywhere first)."""
    role = f"pipeline rank {launch.rank} of {len(inst.stages)}" if len(inst.stages) > 1 else f"replica {launch.replica}"
    lines = [
        "#!/usr/bin/env bash",
        f"# {inst.id}: {role}, on a {launch.config} node in {inst.region}",
        "set -euo pipefail",
        f"export {NODE_ADDR_VAR}=${{{NODE_ADDR_VAR}:-$(hostname -I | awk '{{print $1}}')}}",
    ]
    if len(inst.stages) > 1:
        lines.append(f': "${{{HEAD_ADDR_VAR}:?set {HEAD_ADDR_VAR} to the address of the rank-0 node}}"')
    lines.append(launch.shell(exec_=True))
    return "\n".join(lines) + "\n"


# --- writing ---------------------------------------------------------------------------------------------
def render(
    plan: Plan, target: str, out_dir: str | Path, catalog: Catalog | None = None, image: str | None = None,
    engine: str = "vllm", checkpoint: str | None = None, gateway_image: str | None = None,
) -> RenderResult:
    """Write the manifests of `plan` for `target` and its gateway into `out_dir` (plus `index.json` and the
    gateway's endpoints file); returns files, skips and the gateway.

    `engine`: `vllm` (stock vLLM, `TARGETS`, image default `VLLM_IMAGE`) or `coral` (the Coral engine,
    `coral.deploy.coral_engine.CORAL_TARGETS`, image default `CORAL_IMAGE`, `checkpoint` required: the checkpoint
    directory as the nodes see it). `gateway_image` runs `coral gateway` (default: `image` with the Coral engine,
    else `CORAL_IMAGE`). The whole plan is checked first (`check_plan`); files are rendered into a
    temporary folder beside `out_dir` and moved into it only once every one rendered, so a failure leaves `out_dir`
    as it was."""
    if engine not in ("vllm", "coral"):
        raise CoralInputError(f"--engine: must be vllm or coral, not {engine!r}")
    if engine == "coral":
        coral_engine.check_target(target, checkpoint)
    elif target not in TARGETS:
        raise CoralInputError(f"target: must be one of {', '.join(TARGETS)}, not {target!r}")
    cat = catalog or builtin_catalog()
    check_plan(plan, cat)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if engine == "coral":
            assert checkpoint is not None  # check_target
            res = coral_engine.render_into(plan, target, staging, cat, image or coral_engine.CORAL_IMAGE, checkpoint)
        else:
            res = _render_into(plan, cast(Target, target), staging, cat, image or VLLM_IMAGE)
        gw_image = gateway_image or (image if engine == "coral" and image else coral_engine.CORAL_IMAGE)
        gateway.add_gateway(plan, target, res, writer(staging, res), cat, gw_image)
        write_index(staging, res, plan, target, engine)
        out.mkdir(exist_ok=True)
        for f in sorted(staging.iterdir()):
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    res.files = [out / f.name for f in res.files]
    return res


def write_index(out: Path, res: RenderResult, plan: Plan, target: str, engine: str) -> None:
    """The gateway's endpoints file (when there are engines: `endpoints.json`, or its template when URLs are known
    only once launched) and `index.json` (files, gateway and engines, skips, uncovered) into `out`."""
    if res.endpoints:
        name = gateway.ENDPOINTS_TEMPLATE if res.deferred else gateway.ENDPOINTS_FILE
        gateway.endpoints_file(plan, res).save(out / name)
    index = {
        "target": target,
        "engine": engine,
        "endpoints": gateway.index_entry(res),
        "scenario": plan.scenario,
        "files": [p.name for p in res.files],
        "skipped": res.skipped,
        "uncovered": [f"{m}/{p}" for m, p in res.uncovered],
    }
    (out / "index.json").write_text(json.dumps(index, indent=2))


def _render_into(plan: Plan, target: Target, out: Path, cat: Catalog, image: str) -> RenderResult:
    res = RenderResult()
    write = writer(out, res)
    push = push_models(plan.instances)
    res.skipped = skipped_instances(plan, target, cat)
    res.uncovered = uncovered_keys(plan, res.skipped)
    for (_m, _p, _t, _r), insts in groups(plan).items():
        first = insts[0]
        if first.id in res.skipped:
            continue
        use_push = first.model in push
        if len(first.stages) == 1 and target != "commands":
            for name, (launch, replicas, weight) in replica_groups(insts, cat, use_push).items():
                if target == "skypilot":
                    write(f"{name}.sky.yaml", [skypilot_service(first, launch, name, replicas, cat, image)])
                    gateway.add_deferred(res, name, first, weight, gateway.sky_url(name))
                else:
                    write(f"{name}.k8s.yaml", k8s_deployment(first, launch, name, replicas, cat, image))
                    res.endpoints.append(endpoint_spec(name, first, weight))
        elif target == "skypilot":
            name = group_name(first)
            launches = launch_commands(first, cat.model(first.model), push=use_push)
            write(f"{name}.sky.yaml", [skypilot_pipeline(first, launches, name, len(insts), cat, image)])
            gateway.add_deferred(res, name, first, sum(i.throughput for i in insts), gateway.sky_url(name))
        elif target == "kubernetes":
            for k, inst in enumerate(insts):
                docs = k8s_pipeline(inst, k, cat, image, use_push)
                write(f"{group_name(first)}-{k}.pipeline.k8s.yaml", docs)
                res.endpoints.append(endpoint_spec(docs[-1]["metadata"]["name"], inst, inst.throughput))
        else:
            for inst in insts:
                for nl in launch_commands(inst, cat.model(inst.model), push=use_push):
                    role = f"rank{nl.rank}" if len(inst.stages) > 1 else f"replica{nl.replica}"
                    script = f"{dns_name(inst.id, limit=60)}.{role}.sh"
                    write(script, node_script(inst, nl))
                    if nl.rank == 0:  # serves the API: a single-stage replica, or a pipeline's rank 0
                        eid = dns_name(inst.id, role, limit=60)
                        weight = inst.throughput if len(inst.stages) > 1 else inst.stages[0].node_throughput[nl.replica]
                        gateway.add_deferred(res, eid, inst, weight, gateway.machine_url(eid, script, VLLM_PORT))
    return res
