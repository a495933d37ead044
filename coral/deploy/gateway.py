"""The gateway of a deployment: `coral gateway` (or, on KubeRay, `coral serve` on the Ray head) as its single client
endpoint, routing every model to the rendered engines, prefill then decode where a model has both.

- `kubernetes` (both engines): a ConfigMap `<gateway>-endpoints` holding the endpoints file (each engine Service's
  DNS name, known when rendering), a one-pod Deployment running `coral gateway` over it (no GPU) and a Service
  `<gateway>` on `GATEWAY_PORT`, all in `<gateway>.gateway.k8s.yaml`.
- `kuberay`: the Ray head of each RayCluster serves already (`coral serve --ray`, Service `<cluster>-gateway`); its
  controller places the engines, so there is no endpoints file (`coral.deploy.coral_engine`).
- `skypilot`: an engine service's URL (its load balancer) is known only after `sky serve up`, so the endpoints file is
  rendered as `endpoints.template.json` with a placeholder URL per engine (`placeholder_url`), and `sky-endpoints.sh`,
  run where `sky` is, writes `endpoints.json` from `sky serve status --endpoint NAME` of each engine service; the
  gateway is the SkyPilot service `<gateway>.gateway.yaml`, which mounts that file (named apart from the engines'
  `*.sky.yaml`, which are brought up first).
- `commands`: `gateway.sh` writes `endpoints.json` from the template and one address variable per engine
  (`address_var`: the machine running that engine's script), then runs `coral gateway`.

The scripts check every URL they fill in (`URL_PATTERN`: `http(s)://host[:port]`, nothing else) before it reaches the
file, so neither SkyPilot's answer nor a variable can put anything else there. Keys are never in a command line:
`coral gateway` and `coral serve` read them from `CORAL_API_KEYS` (and `CORAL_READ_TOKENS`, `CORAL_ADMIN_TOKEN`), set
from the Kubernetes Secret `GATEWAY_SECRET` (`secret_env`), a SkyPilot secret (`sky serve up --secret
CORAL_API_KEYS`), or the environment of `gateway.sh`, which refuses to start without API keys.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

from coral.allocation.plan import Plan, PlanInstance
from coral.catalog.loader import Catalog
from coral.deploy.common import (
    DeferredUrl,
    Gateway,
    RenderResult,
    cloud_region,
    dns_name,
    endpoint_spec,
)
from coral.deploy.endpoints import EndpointsFile
from coral.deploy.shell import sh_line, sh_word

GATEWAY_PORT = 8080
GATEWAY_DIR = "/etc/coral-gateway"  # where the gateway's endpoints file is mounted (kubernetes, skypilot)
ENDPOINTS_FILE = "endpoints.json"
ENDPOINTS_TEMPLATE = "endpoints.template.json"  # skypilot, commands: placeholder URLs, filled by the scripts below
SKY_FILL_SCRIPT = "sky-endpoints.sh"
COMMANDS_SCRIPT = "gateway.sh"
GATEWAY_SECRET = "coral-gateway"  # the Kubernetes Secret holding the keys (kubernetes, kuberay)
API_KEYS_ENV = "CORAL_API_KEYS"  # the variables `coral gateway` and `coral serve` read keys from
READ_TOKENS_ENV = "CORAL_READ_TOKENS"
ADMIN_TOKEN_ENV = "CORAL_ADMIN_TOKEN"
SECRET_KEYS = {API_KEYS_ENV: "api-keys", READ_TOKENS_ENV: "read-tokens", ADMIN_TOKEN_ENV: "admin-token"}
"""Variable -> its key in `GATEWAY_SECRET`; every one is required there but the read-only tokens."""
PLACEHOLDER_DOMAIN = "endpoint.invalid"  # a reserved name (RFC 2606): never resolves
URL_PATTERN = r"^https?://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(:[0-9]+)?$"
"""What the scripts accept as an engine URL: scheme, host name, IPv4 or bracketed IPv6 address, optional port."""
SKY_GATEWAY_CPUS = "4+"


def gateway_name(scenario: str) -> str:
    """The gateway's Service / SkyPilot service name, as KubeRay names a one-region plan's: `coral-<scenario>-gateway`."""
    return dns_name(dns_name("coral", scenario, limit=40), "gateway", limit=63)


def gateway_argv(endpoints: str) -> list[str]:
    """`coral gateway` over the endpoints file `endpoints`, reachable from other hosts (keys come from the env)."""
    return ["coral", "gateway", "--endpoints", endpoints, "--host", "0.0.0.0", "--port", str(GATEWAY_PORT)]


def secret_env(*names: str) -> list[dict[str, Any]]:
    """Container env of the variables `names` from `GATEWAY_SECRET` (a pod without a required one does not start)."""
    return [{"name": n, "valueFrom": {"secretKeyRef": {"name": GATEWAY_SECRET, "key": SECRET_KEYS[n],
                                                       **({"optional": True} if n == READ_TOKENS_ENV else {})}}}
            for n in names]


# --- engines whose URL is known once launched -----------------------------------------------------------------------
def placeholder_url(endpoint_id: str) -> str:
    """The URL of engine `endpoint_id` in the endpoints template, until a script fills in the real one."""
    return f"http://{endpoint_id}.{PLACEHOLDER_DOMAIN}"


def address_var(endpoint_id: str) -> str:
    """The variable `gateway.sh` reads the address of engine `endpoint_id`'s machine from (a DNS label's id)."""
    var = "CORAL_ADDR_" + re.sub(r"[^A-Z0-9]", "_", endpoint_id.upper())
    assert re.fullmatch(r"[A-Z][A-Z0-9_]*", var), endpoint_id
    return var


def sky_url(service: str) -> DeferredUrl:
    """The URL of SkyPilot service `service`: its load balancer, as `sky serve status --endpoint` prints it."""
    how = f"sky serve status --endpoint {service}"
    return DeferredUrl(f'"$({sh_line(how.split())})"', f"`{how}` (is the service up?)")


def machine_url(endpoint_id: str, script: str, port: int) -> DeferredUrl:
    """The URL of an engine served on `port` by `script`, on the machine whose address is in `address_var`."""
    var = address_var(endpoint_id)
    return DeferredUrl(f'"http://${{{var}:-}}:{port}"', f"http://${var}:{port} (set {var} to the address of the "
                       f"machine running {script})")


def add_deferred(res: RenderResult, endpoint_id: str, inst: PlanInstance, weight: float, url: DeferredUrl) -> None:
    """Record engine `endpoint_id` (`weight` tokens/s of instances like `inst`) whose URL is `url` once launched."""
    res.endpoints.append(endpoint_spec(endpoint_id, inst, weight, url=placeholder_url(endpoint_id)))
    res.deferred[endpoint_id] = url


def fill_script(res: RenderResult, purpose: str, checks: list[str], tail: list[str]) -> str:
    """A bash script (in the output folder) that writes `ENDPOINTS_FILE` from `ENDPOINTS_TEMPLATE`, each placeholder
    replaced by its engine's URL once checked against `URL_PATTERN` (it stops at the first bad one, naming it),
    after the lines `checks` and before the lines `tail`."""
    lines = [
        "#!/usr/bin/env bash",
        f"# {purpose}",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        *checks,
        f"url_re={sh_word(URL_PATTERN)}",
        f"endpoints=$(<{ENDPOINTS_TEMPLATE})",
        "put() {  # put ID URL HOW: engine ID answers at URL, which HOW gave",
        "  if [[ ! $2 =~ $url_re ]]; then",
        """    echo "endpoint $1: $3 gave '$2', not an http(s)://host[:port] URL" >&2""",
        "    exit 1",
        "  fi",
        f'  endpoints=${{endpoints//"http://$1.{PLACEHOLDER_DOMAIN}\\""/"$2\\""}}',
        "}",
        *(f"put {sh_word(eid)} {url.expr} {sh_word(url.how)}" for eid, url in res.deferred.items()),
        f"""printf '%s\\n' "$endpoints" > {ENDPOINTS_FILE}.tmp""",
        f"mv {ENDPOINTS_FILE}.tmp {ENDPOINTS_FILE}",
        *tail,
    ]
    return "\n".join(lines) + "\n"


# --- the gateway per target ---------------------------------------------------------------------------------------
def endpoints_file(plan: Plan, res: RenderResult) -> EndpointsFile:
    """The gateway's endpoints file: every rendered engine, and the plan's request classes."""
    return EndpointsFile(endpoints=res.endpoints, request_classes=plan.request_classes)


def k8s_gateway(name: str, spec: EndpointsFile, image: str) -> list[dict[str, Any]]:
    """ConfigMap of `spec`, a one-pod Deployment of `coral gateway` over it (restarted when `spec` changes: its
    digest is in the pod's annotations) and the Service `name` in front of it."""
    text = spec.model_dump_json(indent=2)
    configmap = dns_name(name, "endpoints", limit=63)
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "gateway",
              "app.kubernetes.io/part-of": "coral"}
    argv = gateway_argv(f"{GATEWAY_DIR}/{ENDPOINTS_FILE}")
    container = {
        "name": "gateway", "image": image, "command": argv[:2], "args": argv[2:],
        "env": secret_env(API_KEYS_ENV, READ_TOKENS_ENV),
        "ports": [{"containerPort": GATEWAY_PORT, "name": "http"}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": GATEWAY_PORT}, "periodSeconds": 10},
        "livenessProbe": {"httpGet": {"path": "/health", "port": GATEWAY_PORT}, "periodSeconds": 10,
                          "failureThreshold": 6},
        "volumeMounts": [{"name": "endpoints", "mountPath": GATEWAY_DIR, "readOnly": True}],
    }
    digest = hashlib.sha256(text.encode()).hexdigest()
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": configmap, "labels": labels},
         "data": {ENDPOINTS_FILE: text}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
         "spec": {"replicas": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
                  "template": {"metadata": {"labels": labels, "annotations": {"coral.io/endpoints-sha256": digest}},
                               "spec": {"containers": [container],
                                        "volumes": [{"name": "endpoints", "configMap": {"name": configmap}}]}}}},
        gateway_service(name, {"app.kubernetes.io/name": name}, labels),
    ]


def gateway_service(name: str, selector: dict[str, str], labels: dict[str, str]) -> dict[str, Any]:
    """The Service `name` clients reach the gateway pods (`selector`) by, on `GATEWAY_PORT`."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
            "spec": {"selector": selector,
                     "ports": [{"name": "http", "port": GATEWAY_PORT, "targetPort": GATEWAY_PORT}]}}


def sky_gateway(name: str, plan: Plan, res: RenderResult, catalog: Catalog, image: str) -> dict[str, Any]:
    """The SkyPilot service of the gateway: a CPU machine in the region holding most of the rendered capacity,
    serving `ENDPOINTS_FILE` (filled by `SKY_FILL_SCRIPT`, mounted from the output folder, where `sky serve up`
    runs), the API keys a SkyPilot secret."""
    load = Counter({i.region: i.throughput for i in plan.instances if i.id not in res.skipped})
    region = load.most_common(1)[0][0]
    o = min((o for o in catalog.offerings if o.region == region), key=lambda o: o.price_per_hour)
    mounted = f"{GATEWAY_DIR}/{ENDPOINTS_FILE}"
    return {
        "name": name,
        "resources": {"cloud": o.cloud, "region": cloud_region(o), "cpus": SKY_GATEWAY_CPUS,
                      "image_id": f"docker:{image}", "ports": GATEWAY_PORT},
        "secrets": {API_KEYS_ENV: None},
        "file_mounts": {mounted: ENDPOINTS_FILE},
        "run": sh_line(gateway_argv(mounted), exec_=True) + "\n",
        "service": {"readiness_probe": {"path": "/ready", "initial_delay_seconds": 120}, "replicas": 1,
                    "ports": GATEWAY_PORT},
    }


def add_gateway(plan: Plan, target: str, res: RenderResult, write: Callable[[str, list[dict[str, Any]] | str], None],
                catalog: Catalog, image: str) -> None:
    """Write the gateway of `target` in front of the engines `res` holds, and record it in `res.gateways` (KubeRay's
    are rendered with their clusters; nothing when no engine was rendered)."""
    if target == "kuberay" or not res.endpoints:
        return
    name = gateway_name(plan.scenario)
    if target == "kubernetes":
        file = f"{name}.gateway.k8s.yaml"
        write(file, k8s_gateway(name, endpoints_file(plan, res), image))
        res.gateways.append(Gateway(name, f"http://{name}:{GATEWAY_PORT}/v1", (file,)))
    elif target == "skypilot":
        file = f"{name}.gateway.yaml"
        write(file, [sky_gateway(name, plan, res, catalog, image)])
        up = f"sky serve up -y -n {name} {file} --secret {API_KEYS_ENV}"
        write(SKY_FILL_SCRIPT, fill_script(
            res, f"Writes {ENDPOINTS_FILE} for the gateway {name}: each engine service's URL from `sky serve status "
            f"--endpoint NAME`. Run it once `sky serve up` has returned for every *.sky.yaml here, then: {up}",
            [], [sh_line(["echo", f"wrote {ENDPOINTS_FILE} ({len(res.deferred)} engine services); next: {up}"])]))
        res.gateways.append(Gateway(name, f"$(sky serve status --endpoint {name})/v1", (file, SKY_FILL_SCRIPT)))
    else:
        need_keys = (f': "${{{API_KEYS_ENV}:?set {API_KEYS_ENV} to the gateway API keys, comma-separated (clients send '
                     f'one as Authorization: Bearer KEY)}}"')
        write(COMMANDS_SCRIPT, fill_script(
            res, f"The gateway {name} (OpenAI API on port {GATEWAY_PORT}, no GPU): run it once the engines run, with "
            f"{API_KEYS_ENV} and one CORAL_ADDR_<ENGINE> per engine set (index.json lists them)",
            [need_keys], [sh_line(gateway_argv(ENDPOINTS_FILE), exec_=True)]))
        res.gateways.append(Gateway(name, f"http://<address of the machine running {COMMANDS_SCRIPT}>:{GATEWAY_PORT}/v1",
                                    (COMMANDS_SCRIPT,)))


def index_entry(res: RenderResult) -> dict[str, Any]:
    """`index.json`'s `endpoints`: the gateway(s) clients use, each engine behind them (its URL, or what gives it once
    launched), and the gateway's endpoints file (with its template and the script that fills it, where deferred)."""
    script = next((f for g in res.gateways for f in g.files if f.endswith(".sh")), None)
    return {
        "gateways": [{"name": g.name, "url": g.url, "files": list(g.files)} for g in res.gateways],
        "engines": {e.id: res.deferred[e.id].how if e.id in res.deferred else e.url for e in res.endpoints},
        "file": ENDPOINTS_FILE if res.endpoints else None,
        "template": ENDPOINTS_TEMPLATE if res.deferred else None,
        "filled_by": script if res.deferred else None,
    }
