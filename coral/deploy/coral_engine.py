"""Deployment files for the Coral engine (`coral deploy --engine coral`): every plan instance, heterogeneous
pipelines included, on real clusters. Targets (`CORAL_TARGETS`):

- `kuberay`: one KubeRay `RayCluster` (ray.io/v1) per region of the plan. Its head runs Ray and the Coral controller
  and gateway (`coral serve <scenario> --backend coral --ray`, port `GATEWAY_PORT`, exposed by a Service
  `<cluster>-gateway`, the deployment's endpoint; its keys and admin token from the Secret `coral-gateway`); one
  worker group per node config the plan uses (`2xL40S`: pods pinned to that config's
  instance type with 2 GPUs), each worker offering one unit of the Ray custom resource `coral-node/<config>`, which
  is what the Ray backend requests for a node of that config. Worker groups start with as many pods as the plan has
  nodes of that config (`replicas` = `maxReplicas`, `minReplicas` 0): raise `maxReplicas` by hand to let the Ray
  autoscaler add spares.
- `kubernetes`: the engine without Ray. Per instance, a headless Service `<instance>-rdzv` (stable DNS names for
  its pods: `scheduler.<instance>-rdzv`, `node-<r>.<instance>-rdzv`), a one-pod Deployment for its scheduler (no
  GPU) and a one-pod Deployment per node, rank r counting the plan's nodes in stage order, pinned to its config's
  instance type. The gateway (`coral.deploy.gateway`) routes to each instance's scheduler.
- `skypilot`: one SkyPilot service per instance whose nodes all share one node config (`num_nodes` = nodes, node r
  = `$SKYPILOT_NODE_RANK`, rank 0 also runs the scheduler); instances mixing node configs are listed as skipped.
  The gateway's endpoints are the services' URLs, filled in once they are up.
- `commands`: per instance a scheduler script and one script per node, beside a copy of the plan; the gateway's
  endpoints are the schedulers' machines.

The plan travels as a ConfigMap mounted at `PLAN_DIR` (kubernetes, kuberay), a SkyPilot file mount, or `plan.json`
beside the scripts. The checkpoint is not shipped: `checkpoint` is its directory as every node sees it (baked into
the image or mounted there). The image (`CORAL_IMAGE` by default) must hold coral installed with the `ray` and
`engine` extras and a CUDA build of torch.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any, Literal

from coral.allocation.plan import Plan, PlanInstance
from coral.catalog.loader import Catalog, CoralInputError
from coral.catalog.schema import parse_config_name
from coral.deploy.common import (
    READINESS_DELAY_S,
    SKY_NODE_ADDR,
    Gateway,
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
from coral.deploy.gateway import (
    ADMIN_TOKEN_ENV,
    API_KEYS_ENV,
    GATEWAY_PORT,
    READ_TOKENS_ENV,
    add_deferred,
    gateway_service,
    machine_url,
    secret_env,
    sky_url,
)
from coral.deploy.shell import (
    HEAD_ADDR_VAR,
    NODE_ADDR_VAR,
    PLAN_VAR,
    SCHEDULER_ADDR_VAR,
    SKY_RANK_VAR,
    k8s_literal,
    sh_line,
)
from coral.templates.engines import DEPLOY_TARGETS, node_resource

CoralTarget = Literal["kuberay", "kubernetes", "skypilot", "commands"]
CORAL_TARGETS: tuple[CoralTarget, ...] = ("kuberay", "kubernetes", "skypilot", "commands")
CORAL_IMAGE = "coral:0.1.0"
"""Default image: build it from this repository with `pip install '.[ray,engine]'` over a CUDA torch."""
PLAN_DIR = "/etc/coral"
PLAN_PATH = f"{PLAN_DIR}/plan.json"
HTTP_PORT = 8000  # an instance's scheduler: OpenAI API
RESULTS_PORT = 5555  # the scheduler's results socket (nodes push finished tokens to it)
RDZV_PORT = 29500  # torch.distributed rendezvous, on node 0
_CHECKPOINT = re.compile(r"^/[A-Za-z0-9._/+:@=-]*$")


def instance_nodes(inst: PlanInstance) -> list[str]:
    """Node configs of `inst` by rank: stages in order, the nodes of a stage in order."""
    return [c for st in inst.stages for c in st.nodes]


def check_target(target: str, checkpoint: str | None) -> None:
    """CoralInputError unless `target` is a Coral-engine target and `checkpoint` an absolute path."""
    if target not in CORAL_TARGETS:
        raise CoralInputError(f"--target: with --engine coral must be one of {', '.join(CORAL_TARGETS)}, "
                              f"not {target!r}")
    if not checkpoint:
        raise CoralInputError("--checkpoint: required with --engine coral (the checkpoint directory as every node "
                              "sees it: in the image or on a volume mounted there)")
    if not _CHECKPOINT.match(checkpoint):
        raise CoralInputError(f"--checkpoint: {checkpoint!r} must be an absolute path of letters, digits and "
                              "'._/+:@=-'")


# --- commands -----------------------------------------------------------------------------------------------
def scheduler_argv(inst_id: str, checkpoint: str, advertise: str, head: str, plan_path: str = PLAN_PATH) -> list[str]:
    """The scheduler of instance `inst_id` (nodes started elsewhere), reached by the nodes at `advertise`, with
    the rendezvous on node 0 at `head`."""
    return ["python", "-m", "coral.engine.instance", plan_path, inst_id, checkpoint, "--no-launch",
            "--host", "0.0.0.0", "--advertise", advertise, "--port", str(HTTP_PORT),
            "--results-port", str(RESULTS_PORT), "--dist-init", f"tcp://{head}:{RDZV_PORT}",
            "--device", "cuda", "--dist-backend", "nccl"]


def node_argv(inst_id: str, checkpoint: str, rank: int | str, scheduler: str, head: str, advertise: str,
              plan_path: str = PLAN_PATH) -> list[str]:
    """Node `rank` of instance `inst_id`: results to the scheduler at `scheduler`, rendezvous on node 0 at `head`,
    reached by the other nodes at `advertise`."""
    return ["python", "-m", "coral.engine.node", "--plan", plan_path, "--instance", inst_id,
            "--checkpoint", checkpoint, "--node-rank", str(rank), "--scheduler", f"tcp://{scheduler}:{RESULTS_PORT}",
            "--dist-init", f"tcp://{head}:{RDZV_PORT}", "--advertise", advertise, "--device", "cuda",
            "--dist-backend", "nccl"]


def serve_argv(scenario: str, checkpoint: str) -> list[str]:
    """`coral serve` on the Ray head: the controller places every instance's nodes on the Ray cluster."""
    return ["coral", "serve", scenario, "--backend", "coral", "--ray", "--plan", PLAN_PATH, "--checkpoint",
            checkpoint, "--host", "0.0.0.0", "--port", str(GATEWAY_PORT)]


# --- plan as a ConfigMap ------------------------------------------------------------------------------------
def plan_configmap(name: str, plan: Plan) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name},
            "data": {"plan.json": plan.model_dump_json(indent=2)}}


def _plan_volume(configmap: str) -> dict[str, Any]:
    return {"name": "plan", "configMap": {"name": configmap}}


_PLAN_MOUNT = {"name": "plan", "mountPath": PLAN_DIR, "readOnly": True}
_SHM_MOUNT = {"name": "dshm", "mountPath": "/dev/shm"}


def _gpus(config: str) -> dict[str, Any]:
    _gpu, n = parse_config_name(config)
    return {"limits": {"nvidia.com/gpu": str(n)}, "requests": {"nvidia.com/gpu": str(n)}}


def _gpu_pod(container: dict[str, Any], catalog: Catalog, config: str, region: str, configmap: str) -> dict[str, Any]:
    """The pod spec of a GPU node of `config`: pinned to its instance type (`common.node_selector`), /dev/shm in
    memory, the plan mounted."""
    pod = pod_spec(container, offering(catalog, config, region))
    pod["volumes"].append(_plan_volume(configmap))
    return pod


# --- kuberay ------------------------------------------------------------------------------------------------
def head_script(scenario: str, checkpoint: str) -> str:
    """The Ray head container's script: KubeRay's own `ray start` (`$KUBERAY_GEN_RAY_START_CMD`, the pod is
    annotated `ray.io/overwrite-container-cmd`) in the background, then `coral serve` once Ray answers; the
    container exits (and is restarted) when either ends. `coral serve` joins the local Ray through RAY_ADDRESS
    (KubeRay sets it on the head; `auto` otherwise)."""
    return "\n".join([
        "ulimit -n 65536",
        '/bin/bash -c "$KUBERAY_GEN_RAY_START_CMD" &',
        "until ray status >/dev/null 2>&1; do sleep 2; done",
        'export RAY_ADDRESS="${RAY_ADDRESS:-auto}"',
        sh_line(serve_argv(scenario, checkpoint), background=True),
        "wait -n",
        "exit $?",
    ]) + "\n"


def raycluster(plan: Plan, name: str, catalog: Catalog, image: str, checkpoint: str, configmap: str,
               region: str) -> list[dict[str, Any]]:
    """The RayCluster for the instances of `plan` (all in `region`) and the Service of its gateway."""
    counts = Counter(c for inst in plan.instances for c in instance_nodes(inst))
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "coral"}
    head_ports = [{"containerPort": 6379, "name": "gcs-server"}, {"containerPort": 8265, "name": "dashboard"},
                  {"containerPort": 10001, "name": "client"}, {"containerPort": GATEWAY_PORT, "name": "gateway"}]
    head = {
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": "0"},
        "template": {
            "metadata": {"labels": labels, "annotations": {"ray.io/overwrite-container-cmd": "true"}},
            "spec": {
                "containers": [{
                    "name": "ray-head",
                    "image": image,
                    "command": ["/bin/bash", "-c", "--"],
                    "args": [k8s_literal(head_script(plan.scenario, checkpoint))],  # bash gets it as written
                    "ports": head_ports,
                    "env": secret_env(API_KEYS_ENV, ADMIN_TOKEN_ENV, READ_TOKENS_ENV),  # `coral serve` reads them
                    "volumeMounts": [_PLAN_MOUNT],
                }],
                "volumes": [_plan_volume(configmap)],
            },
        },
    }
    groups = []
    for config in sorted(counts):
        _gpu, n = parse_config_name(config)
        container = {"name": "ray-worker", "image": image, "resources": _gpus(config),
                     "volumeMounts": [_SHM_MOUNT, _PLAN_MOUNT]}
        groups.append({
            "groupName": dns_name(config),
            "replicas": counts[config],
            "minReplicas": 0,
            "maxReplicas": counts[config],
            # KubeRay pastes each parameter into a bash command line: the JSON is single-quoted for that shell
            # (and KubeRay strips those quotes itself where it reads the value)
            "rayStartParams": {"num-gpus": str(n),
                               "resources": "'" + json.dumps({node_resource(config): 1}, separators=(",", ":")) + "'"},
            "template": {
                "metadata": {"labels": {**labels, "coral.io/node-config": dns_name(config)}},
                "spec": _gpu_pod(container, catalog, config, region, configmap),
            },
        })
    cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": name, "labels": labels},
               "spec": {"headGroupSpec": head, "workerGroupSpecs": groups}}
    gateway = gateway_service(cluster_gateway(name), {"ray.io/cluster": name, "ray.io/node-type": "head"},
                              {**labels, "app.kubernetes.io/component": "gateway"})
    return [cluster, gateway]


def cluster_gateway(cluster: str) -> str:
    """The Service of the gateway on RayCluster `cluster`'s head."""
    return dns_name(cluster, "gateway", limit=63)


# --- kubernetes ---------------------------------------------------------------------------------------------
def instance_name(inst: PlanInstance) -> str:
    """DNS-1123 base name of `inst`'s objects (room left for `-scheduler`, `-node-<r>`, `-rdzv`)."""
    return dns_name(inst.id, limit=50)


def _one_pod_deployment(name: str, labels: dict[str, str], pod: dict[str, Any]) -> dict[str, Any]:
    selector = {k: labels[k] for k in ("app.kubernetes.io/name", "app.kubernetes.io/component", "coral.io/rank")
                if k in labels}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
            "spec": {"replicas": 1, "strategy": {"type": "Recreate"}, "selector": {"matchLabels": selector},
                     "template": {"metadata": {"labels": labels}, "spec": pod}}}


def k8s_instance(inst: PlanInstance, catalog: Catalog, image: str, checkpoint: str,
                 configmap: str) -> list[dict[str, Any]]:
    """Headless rendezvous Service, scheduler Deployment and one Deployment per node of `inst`."""
    base = instance_name(inst)
    rdzv = f"{base}-rdzv"
    scheduler_host, head_host = f"scheduler.{rdzv}", f"node-0.{rdzv}"
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": rdzv}, "spec": {
        "clusterIP": "None",
        "publishNotReadyAddresses": True,  # the nodes must reach node 0 and the scheduler before they are ready
        "selector": {"app.kubernetes.io/name": base},
        "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": HTTP_PORT},
                  {"name": "results", "port": RESULTS_PORT, "targetPort": RESULTS_PORT},
                  {"name": "rdzv", "port": RDZV_PORT, "targetPort": RDZV_PORT}],
    }}
    argv = scheduler_argv(inst.id, checkpoint, scheduler_host, head_host)
    scheduler = {
        "name": "scheduler", "image": image, "command": argv[:3], "args": argv[3:],
        "ports": [{"containerPort": HTTP_PORT, "name": "http"}, {"containerPort": RESULTS_PORT, "name": "results"}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": HTTP_PORT}, "initialDelaySeconds": 30,
                           "periodSeconds": 10, "failureThreshold": READINESS_DELAY_S // 10},
        "volumeMounts": [_PLAN_MOUNT],
    }
    docs = [svc, _one_pod_deployment(f"{base}-scheduler", {**k8s_labels(inst, base), "app.kubernetes.io/component":
                                                            "scheduler"}, {
        "hostname": "scheduler", "subdomain": rdzv, "containers": [scheduler],
        "volumes": [_plan_volume(configmap)]})]
    for rank, config in enumerate(instance_nodes(inst)):
        argv = node_argv(inst.id, checkpoint, rank, scheduler_host, head_host, "$(POD_IP)")
        container = {
            "name": "node", "image": image, "command": argv[:3], "args": argv[3:],
            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            "resources": _gpus(config),
            "ports": [{"containerPort": RDZV_PORT, "name": "rdzv"}] if rank == 0 else [],
            "volumeMounts": [_SHM_MOUNT, _PLAN_MOUNT],
        }
        pod = _gpu_pod(container, catalog, config, inst.region, configmap)
        pod.update(hostname=f"node-{rank}", subdomain=rdzv)
        labels = {**k8s_labels(inst, base), "app.kubernetes.io/component": "node", "coral.io/rank": str(rank)}
        docs.append(_one_pod_deployment(f"{base}-node-{rank}", labels, pod))
    return docs


# --- SkyPilot -----------------------------------------------------------------------------------------------
def skypilot_refusal(inst: PlanInstance) -> str:
    """Why one SkyPilot task cannot hold `inst` ("" when it can): its nodes must share one node config."""
    configs = sorted(set(instance_nodes(inst)))
    if len(configs) > 1:
        return f"nodes over node configs {' | '.join(configs)}: {DEPLOY_TARGETS['skypilot'].why}"
    return ""


def skypilot_instance(inst: PlanInstance, catalog: Catalog, image: str, checkpoint: str) -> dict[str, Any]:
    """The SkyPilot service of `inst` (one replica of `num_nodes` nodes, one node config): node r runs rank r;
    rank 0, SkyPilot's head node, also runs the scheduler and is the rendezvous."""
    (config,) = set(instance_nodes(inst))
    nodes = len(instance_nodes(inst))
    head, me = f"${HEAD_ADDR_VAR}", f"${NODE_ADDR_VAR}"
    node = node_argv(inst.id, checkpoint, f"${SKY_RANK_VAR}", head, head, me)
    run = (SKY_NODE_ADDR + f'export {HEAD_ADDR_VAR}=$(echo "$SKYPILOT_NODE_IPS" | head -n1)\n'
           + f'if [ "${SKY_RANK_VAR}" = 0 ]; then\n'
           + f"  {sh_line(scheduler_argv(inst.id, checkpoint, head, head), background=True)}\n"
           + f"  {sh_line(node, background=True)}\n"
           + "  wait -n\n  exit $?\nfi\n"
           + sh_line(node, exec_=True) + "\n")
    task: dict[str, Any] = {"name": instance_name(inst)}
    if nodes > 1:
        task["num_nodes"] = nodes
    task.update({
        "resources": skypilot_resources(catalog, config, inst.region, image, HTTP_PORT),
        "file_mounts": {PLAN_PATH: "plan.json"},  # relative to where `sky serve up` runs: the output folder
        "run": run,
        "service": {"readiness_probe": {"path": "/health", "initial_delay_seconds": READINESS_DELAY_S},
                    "replicas": 1, "ports": HTTP_PORT},
    })
    return task


# --- scripts ------------------------------------------------------------------------------------------------
_SCRIPT_HEAD = ["#!/usr/bin/env bash", "set -euo pipefail",
                f'export {PLAN_VAR}="${{{PLAN_VAR}:-$(cd "$(dirname "$0")" && pwd)/plan.json}}"',
                f"export {NODE_ADDR_VAR}=${{{NODE_ADDR_VAR}:-$(hostname -I | awk '{{print $1}}')}}",
                f': "${{{HEAD_ADDR_VAR}:?set {HEAD_ADDR_VAR} to the address of the node-0 machine (rendezvous)}}"']


def instance_scripts(inst: PlanInstance, checkpoint: str) -> dict[str, str]:
    """Suffix (`scheduler`, `node<r>`) -> script for `inst`: the scheduler anywhere, node r on a `config` machine."""
    plan, head, me = f"${PLAN_VAR}", f"${HEAD_ADDR_VAR}", f"${NODE_ADDR_VAR}"
    out = {"scheduler": "\n".join([
        _SCRIPT_HEAD[0], f"# {inst.id}: Coral engine scheduler (HTTP on {HTTP_PORT}; no GPU needed)", *_SCRIPT_HEAD[1:],
        sh_line(scheduler_argv(inst.id, checkpoint, me, head, plan), exec_=True)]) + "\n"}
    for rank, config in enumerate(instance_nodes(inst)):
        out[f"node{rank}"] = "\n".join([
            _SCRIPT_HEAD[0], f"# {inst.id}: node {rank} of {len(instance_nodes(inst))}, on a {config} machine in "
            f"{inst.region}", *_SCRIPT_HEAD[1:],
            f': "${{{SCHEDULER_ADDR_VAR}:?set {SCHEDULER_ADDR_VAR} to the address of the scheduler machine}}"',
            sh_line(node_argv(inst.id, checkpoint, rank, f"${SCHEDULER_ADDR_VAR}", head, me, plan), exec_=True)]) + "\n"
    return out


# --- writing ------------------------------------------------------------------------------------------------
def skipped_instances(plan: Plan, target: str) -> dict[str, str]:
    """Instance id -> why the Coral engine on `target` cannot launch it (only SkyPilot refuses any)."""
    if target != "skypilot":
        return {}
    return {inst.id: why for inst in plan.instances if (why := skypilot_refusal(inst))}


def render_into(plan: Plan, target: str, out: Path, cat: Catalog, image: str, checkpoint: str) -> RenderResult:
    """Write `plan`'s files for the Coral engine on `target` into folder `out` (`render` checks and stages)."""
    res = RenderResult()
    write = writer(out, res)
    res.skipped = skipped_instances(plan, target)
    res.uncovered = uncovered_keys(plan, res.skipped)
    if target == "kuberay":
        regions = sorted({i.region for i in plan.instances})
        for region in regions:
            part = plan if len(regions) == 1 else plan.model_copy(
                update={"instances": [i for i in plan.instances if i.region == region]})
            name = dns_name("coral", plan.scenario, *([region] if len(regions) > 1 else []), limit=40)
            configmap = dns_name(name, "plan", limit=63)
            file = f"{name}.raycluster.k8s.yaml"
            write(file, [plan_configmap(configmap, part),
                         *raycluster(part, name, cat, image, checkpoint, configmap, region)])
            res.gateways.append(Gateway(cluster_gateway(name), f"http://{cluster_gateway(name)}:{GATEWAY_PORT}/v1",
                                        (file,)))
    elif target == "kubernetes":
        configmap = dns_name("coral-plan", plan.scenario, limit=63)
        write(f"{configmap}.k8s.yaml", [plan_configmap(configmap, plan)])
        for inst in plan.instances:
            base = instance_name(inst)
            write(f"{base}.coral.k8s.yaml", k8s_instance(inst, cat, image, checkpoint, configmap))
            res.endpoints.append(endpoint_spec(base, inst, inst.throughput, url=f"http://scheduler.{base}-rdzv:{HTTP_PORT}"))
    else:
        (out / "plan.json").write_text(plan.model_dump_json(indent=2))
        res.files.append(out / "plan.json")
        for inst in plan.instances:
            if inst.id in res.skipped:
                continue
            base = instance_name(inst)
            if target == "skypilot":
                write(f"{base}.sky.yaml", [skypilot_instance(inst, cat, image, checkpoint)])
                add_deferred(res, base, inst, inst.throughput, sky_url(base))
            else:
                for role, text in instance_scripts(inst, checkpoint).items():
                    write(f"{base}.{role}.sh", text)
                add_deferred(res, base, inst, inst.throughput, machine_url(base, f"{base}.scheduler.sh", HTTP_PORT))
    return res
