"""The gateway `coral deploy` renders for every target and engine: the deployment's single client endpoint, routing
every model, prefill then decode, to the rendered engines; its keys from secrets, never from a command line; the
scripts that fill in engine URLs known only once launched; the `next:` lines ending at the URL clients use; `--strict`
by default; and the scenario's current plan when no `--plan` is given."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml
from sky_check import sky_python
from typer.main import get_command
from typer.testing import CliRunner

from coral.allocation.plan import Plan
from coral.cli import runtime
from coral.cli.common import current_plan_path
from coral.cli.main import app
from coral.cli.runtime import static_registry
from coral.deploy import gateway
from coral.deploy.coral_engine import CORAL_IMAGE, CORAL_TARGETS
from coral.deploy.endpoints import EndpointsFile
from coral.deploy.render import TARGETS, render
from coral.deploy.schemas import validate_manifest
from coral.runtime.gateway.config import OPEN_PATHS
from coral.runtime.handmade import make_instance, make_plan

SKY_CHECK = Path(__file__).with_name("sky_check.py")
CKPT = "/models/ckpt"
RENDERS = [("vllm", t) for t in TARGETS] + [("coral", t) for t in CORAL_TARGETS]
GATEWAY = "coral-core-gateway"
CLI = get_command(app)


def pd_plan() -> Plan:
    """Prefill and decode instances of two models that every target of both engines launches whole: single-node
    replicas (one instance of two), a one-config prefill pipeline."""
    return make_plan([
        make_instance("phi-4", "prefill", [(40, ["1xL40S"])], 5000.0, template_id=1),
        make_instance("phi-4", "decode", [(40, ["1xL40S", "1xL40S"])], 1600.0, template_id=2),
        make_instance("qwen3-32b", "prefill", [(30, ["4xL40S"]), (34, ["4xL40S"])], 900.0, template_id=3),
        make_instance("qwen3-32b", "decode", [(64, ["4xL40S"])], 700.0, template_id=4),
    ], scenario="core")


def deploy(plan: Plan, engine: str, target: str, out: Path):
    return render(plan, target, out, engine=engine, checkpoint=CKPT if engine == "coral" else None)


def index_of(out: Path) -> dict[str, Any]:
    return json.loads((out / "index.json").read_text())


def parse(argv: list[str]) -> dict[str, Any]:
    """The parameters of the command line `argv` (`coral COMMAND ...`), by the real CLI's parser: an option renamed
    or gone fails here."""
    assert argv[0] == "coral", argv
    return dict(CLI.commands[argv[1]].make_context(argv[1], argv[2:]).params)  # type: ignore[attr-defined]


def k8s_docs(out: Path, name: str) -> dict[str, dict[str, Any]]:
    """kind -> the document of that kind in `out/name`, each validated (kubernetes-validate --strict)."""
    docs = {}
    for doc in yaml.safe_load_all((out / name).read_text()):
        validate_manifest(doc, name)
        docs[doc["kind"]] = doc
    return docs


def stub(folder: Path, name: str, body: str) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text("#!/bin/sh\n" + body)
    (folder / name).chmod(0o755)


def run_script(path: Path, env: dict[str, str], bin_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
    path_var = f"{bin_dir}:/usr/bin:/bin" if bin_dir else "/usr/bin:/bin"
    return subprocess.run(["bash", str(path)], env={"PATH": path_var, "HOME": str(path.parent), **env},
                          capture_output=True, text=True, timeout=60)


# --- every target -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("engine", "target"), [r for r in RENDERS if r[1] != "kuberay"])
def test_one_gateway_routes_every_model_and_phase_to_the_rendered_engines(tmp_path, engine, target):
    """Every engine API rendered is in the gateway's endpoints file once, at the planned capacity behind it: per
    (model, phase) the weights add up to the plan's throughput, prefill and decode of both models included."""
    res = deploy(pd_plan(), engine, target, tmp_path)
    index = index_of(tmp_path)["endpoints"]
    (gw,) = index["gateways"]
    assert gw["name"] == GATEWAY and set(gw["files"]) <= set(index_of(tmp_path)["files"])
    spec = EndpointsFile.load(tmp_path / (index["template"] or index["file"]))
    assert [e.id for e in spec.endpoints] == list(index["engines"]) and len(set(index["engines"])) == len(spec.endpoints)
    weight: dict[tuple[str, str], float] = defaultdict(float)
    for e in spec.endpoints:
        weight[(e.model, e.phase)] += e.weight
    assert weight == pytest.approx({(i.model, i.phase): i.throughput for i in pd_plan().instances})
    registry = static_registry(spec)  # what `coral gateway` builds from the file
    assert {(e.model, e.phase) for e in registry.all()} == set(weight)
    assert res.gateways[0].url == gw["url"] and gw["url"].endswith("/v1")


def test_the_gateway_reads_keys_from_the_variables_coral_gateway_reads():
    assert (gateway.API_KEYS_ENV, gateway.READ_TOKENS_ENV, gateway.ADMIN_TOKEN_ENV) == (
        runtime.API_KEYS_ENV, runtime.READ_TOKENS_ENV, runtime.ADMIN_TOKEN_ENV)
    assert {"/health", "/ready"} <= OPEN_PATHS  # the liveness and readiness probes need no key


# --- kubernetes ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["vllm", "coral"])
def test_kubernetes_gateway_is_a_deployment_and_service_over_the_engine_services(tmp_path, engine):
    deploy(pd_plan(), engine, "kubernetes", tmp_path)
    index = index_of(tmp_path)
    (gw,) = index["endpoints"]["gateways"]
    assert gw == {"name": GATEWAY, "url": f"http://{GATEWAY}:8080/v1", "files": [f"{GATEWAY}.gateway.k8s.yaml"]}
    docs = k8s_docs(tmp_path, gw["files"][0])
    assert set(docs) == {"ConfigMap", "Deployment", "Service"}
    cm, dep, svc = docs["ConfigMap"], docs["Deployment"], docs["Service"]
    spec = EndpointsFile.model_validate_json(cm["data"]["endpoints.json"])
    assert spec == EndpointsFile.load(tmp_path / "endpoints.json")
    # each endpoint is a Service rendered beside it (the Coral engine: its scheduler's name under the headless one)
    services: dict[str, dict[str, Any]] = {}
    for f in index["files"]:
        for doc in yaml.safe_load_all((tmp_path / f).read_text()):
            if doc["kind"] == "Service" and doc["metadata"]["name"] != GATEWAY:
                services[doc["metadata"]["name"]] = doc
    for e in spec.endpoints:
        host, port = e.url.removeprefix("http://").split(":")
        service = services[host if engine == "vllm" else host.removeprefix("scheduler.")]
        assert int(port) in {p["port"] for p in service["spec"]["ports"]}
    pod = dep["spec"]["template"]
    (ctr,) = pod["spec"]["containers"]
    params = parse(ctr["command"] + ctr["args"])
    (mount,) = ctr["volumeMounts"]
    assert params["endpoints"] == Path(mount["mountPath"]) / "endpoints.json" and params["port"] == 8080
    assert params["host"] == "0.0.0.0" and params["api_keys_file"] is None  # keys from the env, never in args
    assert pod["spec"]["volumes"] == [{"name": mount["name"], "configMap": {"name": cm["metadata"]["name"]}}]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in ctr["env"]}
    assert refs == {"CORAL_API_KEYS": {"name": "coral-gateway", "key": "api-keys"},  # required: no open gateway
                    "CORAL_READ_TOKENS": {"name": "coral-gateway", "key": "read-tokens", "optional": True}}
    assert "resources" not in ctr and "nodeSelector" not in pod["spec"]  # no GPU
    assert ctr["image"] == CORAL_IMAGE and ctr["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 8080}
    assert ctr["livenessProbe"]["httpGet"] == {"path": "/health", "port": 8080}
    assert svc["metadata"]["name"] == GATEWAY
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8080, "targetPort": 8080}]
    assert ctr["ports"] == [{"containerPort": 8080, "name": "http"}]


def test_the_gateway_pod_changes_with_its_endpoints(tmp_path):
    """The pod template carries the endpoints file's digest, so `kubectl apply` of a new plan restarts the gateway
    (which reads its file once)."""
    def digest(plan: Plan, out: Path) -> str:
        render(plan, "kubernetes", out)
        dep = k8s_docs(out, f"{GATEWAY}.gateway.k8s.yaml")["Deployment"]
        return str(dep["spec"]["template"]["metadata"]["annotations"]["coral.io/endpoints-sha256"])

    other = pd_plan()
    other.instances[3] = make_instance("qwen3-32b", "decode", [(64, ["4xL40S"])], 650.0, template_id=4)
    assert digest(pd_plan(), tmp_path / "a") == digest(pd_plan(), tmp_path / "b") != digest(other, tmp_path / "c")


def test_gateway_image_is_an_option(tmp_path):
    path = pd_plan().save(tmp_path / "plan.json")
    r = CliRunner().invoke(app, ["deploy", "--engine", "vllm", "--plan", str(path), "--target", "commands", "--out", str(tmp_path / "o"),
                                 "--gateway-image", "me/coral:cpu"])
    assert r.exit_code == 2 and "--gateway-image: only with --target kubernetes or skypilot" in r.output
    assert not (tmp_path / "o").exists()
    res = render(pd_plan(), "kubernetes", tmp_path / "k", gateway_image="me/coral:cpu")
    dep = k8s_docs(tmp_path / "k", res.gateways[0].files[0])["Deployment"]
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "me/coral:cpu"
    res = render(pd_plan(), "kubernetes", tmp_path / "c", engine="coral", checkpoint=CKPT, image="me/coral:gpu")
    dep = k8s_docs(tmp_path / "c", res.gateways[0].files[0])["Deployment"]
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "me/coral:gpu"  # the engine's image


# --- kuberay ------------------------------------------------------------------------------------------------------
def test_kuberay_head_serves_the_gateway_with_keys_from_the_secret(tmp_path):
    res = deploy(pd_plan(), "coral", "kuberay", tmp_path)
    (gw,) = res.gateways
    docs = k8s_docs(tmp_path, gw.files[0])
    cluster, svc = docs["RayCluster"], docs["Service"]
    assert svc["metadata"]["name"] == gw.name == GATEWAY == f"{cluster['metadata']['name']}-gateway"
    assert svc["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    (head,) = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert {"containerPort": 8080, "name": "gateway"} in head["ports"] and svc["spec"]["ports"][0]["port"] == 8080
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in head["env"]}
    assert refs == {"CORAL_API_KEYS": {"name": "coral-gateway", "key": "api-keys"},
                    "CORAL_ADMIN_TOKEN": {"name": "coral-gateway", "key": "admin-token"},
                    "CORAL_READ_TOKENS": {"name": "coral-gateway", "key": "read-tokens", "optional": True}}
    script = head["args"][0].replace("$$", "$")
    (serve,) = [shlex.split(ln.removesuffix(" &")) for ln in script.splitlines() if ln.startswith("coral serve")]
    params = parse(serve)
    assert (params["port"], params["api_keys_file"], params["admin_token_file"]) == (8080, None, None)
    assert index_of(tmp_path)["endpoints"]["gateways"] == [{"name": GATEWAY, "url": f"http://{GATEWAY}:8080/v1",
                                                           "files": list(gw.files)}]


# --- skypilot -----------------------------------------------------------------------------------------------------
SKY_STUB = """echo "$*" >> "$SKY_LOG"
if [ -n "${SKY_ANSWER+set}" ]; then printf '%s\\n' "$SKY_ANSWER"; else echo "http://$4.lb.example:30001"; fi
"""


@pytest.mark.parametrize("engine", ["vllm", "coral"])
def test_skypilot_gateway_is_filled_from_sky_serve_status(tmp_path, engine):
    """`sky-endpoints.sh` asks `sky serve status --endpoint NAME` of every engine service and writes each URL into
    the gateway's file; the gateway's SkyPilot service mounts that file and serves it with `coral gateway`."""
    out = tmp_path / "out"
    deploy(pd_plan(), engine, "skypilot", out)
    index = index_of(out)
    entry = index["endpoints"]
    (gw,) = entry["gateways"]
    assert gw == {"name": GATEWAY, "url": f"$(sky serve status --endpoint {GATEWAY})/v1",
                  "files": [f"{GATEWAY}.gateway.yaml", "sky-endpoints.sh"]}
    services = {f.removesuffix(".sky.yaml") for f in index["files"] if f.endswith(".sky.yaml")}
    assert set(entry["engines"]) == services and entry["file"] == "endpoints.json"
    assert (entry["template"], entry["filled_by"]) == ("endpoints.template.json", "sky-endpoints.sh")
    assert not (out / "endpoints.json").exists()
    stub(tmp_path / "bin", "sky", SKY_STUB)
    log = tmp_path / "sky.log"
    done = run_script(out / "sky-endpoints.sh", {"SKY_LOG": str(log)}, tmp_path / "bin")
    assert done.returncode == 0, done.stderr
    assert f"sky serve up -y -n {GATEWAY} {GATEWAY}.gateway.yaml --secret CORAL_API_KEYS" in done.stdout
    assert sorted(log.read_text().splitlines()) == sorted(f"serve status --endpoint {s}" for s in services)
    spec = EndpointsFile.load(out / "endpoints.json")
    template = EndpointsFile.load(out / "endpoints.template.json")
    assert {e.id: e.url for e in spec.endpoints} == {s: f"http://{s}.lb.example:30001" for s in services}
    assert [e.model_copy(update={"url": "x"}) for e in spec.endpoints] == [
        e.model_copy(update={"url": "x"}) for e in template.endpoints]
    task = yaml.safe_load((out / gw["files"][0]).read_text())
    ((mounted, source),) = task["file_mounts"].items()
    assert source == "endpoints.json"  # relative: `sky serve up` runs in the output folder
    words = shlex.split(task["run"])
    assert words[:3] == ["exec", "coral", "gateway"]
    params = parse(words[1:])
    assert (params["endpoints"], params["host"], params["port"]) == (Path(mounted), "0.0.0.0", 8080)
    assert task["secrets"] == {"CORAL_API_KEYS": None}  # given by `sky serve up --secret`, never written here
    assert "accelerators" not in task["resources"] and task["resources"]["image_id"] == f"docker:{CORAL_IMAGE}"
    assert (task["resources"]["cloud"], task["resources"]["region"]) == ("aws", "us-east-2")
    assert task["service"]["ports"] == task["resources"]["ports"] == 8080
    assert task["service"]["readiness_probe"]["path"] == "/ready"


def test_skypilot_gateway_passes_sky_serve_up_checks(tmp_path):
    """The gateway's service file passes the checks `sky serve up` runs (`tests/sky_check.py`), and from the output
    folder its file mount resolves to the endpoints file the script wrote."""
    python = sky_python()
    if python is None:
        pytest.skip("SkyPilot is not installed: `bash .ci/install-skypilot` installs it (or set CORAL_SKY_PYTHON)")
    out = tmp_path / "out"
    deploy(pd_plan(), "vllm", "skypilot", out)
    stub(tmp_path / "bin", "sky", SKY_STUB)
    assert run_script(out / "sky-endpoints.sh", {"SKY_LOG": os.devnull}, tmp_path / "bin").returncode == 0
    name = f"{GATEWAY}.gateway.yaml"
    check = subprocess.run([python, str(SKY_CHECK), name], capture_output=True, text=True, timeout=120, cwd=out)
    assert check.returncode == 0, check.stdout + check.stderr
    mounts = (f"import sky; t = sky.Task.from_yaml({name!r}); t.expand_and_validate_file_mounts(); "
              "print(list(t.file_mounts.values())[0])")
    got = subprocess.run([python, "-c", mounts], capture_output=True, text=True, timeout=120, cwd=out)
    assert got.returncode == 0 and Path(got.stdout.strip()) == out / "endpoints.json", got.stderr


@pytest.mark.parametrize("answer", ["-", "", "10.0.0.1:30001", "http://10.0.0.1:30001/v1", "http://a b:1",
                                    'http://a":1', "http://10.0.0.1:3000$(touch MARK)", "http://a:1\nhttp://b:2",
                                    "http://a:1&", "ftp://a:1"])
def test_the_fill_script_refuses_what_is_not_an_engine_url(tmp_path, answer):
    out = tmp_path / "out"
    deploy(pd_plan(), "vllm", "skypilot", out)
    stub(tmp_path / "bin", "sky", SKY_STUB)
    done = run_script(out / "sky-endpoints.sh", {"SKY_LOG": os.devnull, "SKY_ANSWER": answer}, tmp_path / "bin")
    assert done.returncode == 1
    assert "endpoint phi-4-prefill-t1-aws-us-east-2: `sky serve status --endpoint" in done.stderr
    assert "not an http(s)://host[:port] URL" in done.stderr
    assert not (out / "endpoints.json").exists() and not list(tmp_path.rglob("MARK"))


# --- commands -----------------------------------------------------------------------------------------------------
CORAL_STUB = """printf '%s\\n' "$@" > "$ARGV_LOG"
printf '%s' "$CORAL_API_KEYS" > "$KEYS_LOG"
"""


@pytest.mark.parametrize("engine", ["vllm", "coral"])
def test_commands_gateway_script_fills_addresses_and_runs_coral_gateway(tmp_path, engine):
    out = tmp_path / "out"
    deploy(pd_plan(), engine, "commands", out)
    entry = index_of(out)["endpoints"]
    (gw,) = entry["gateways"]
    assert gw["files"] == ["gateway.sh"] and entry["filled_by"] == "gateway.sh"
    addresses = {gateway.address_var(eid): f"10.0.0.{k + 1}" for k, eid in enumerate(entry["engines"])}
    for eid, how in entry["engines"].items():
        assert how.startswith(f"http://${gateway.address_var(eid)}:8000 (set ")
    script = out / "gateway.sh"
    stub(tmp_path / "bin", "coral", CORAL_STUB)
    logs = {"ARGV_LOG": str(tmp_path / "argv"), "KEYS_LOG": str(tmp_path / "keys")}
    done = run_script(script, {**logs, **addresses}, tmp_path / "bin")
    assert done.returncode != 0 and "CORAL_API_KEYS" in done.stderr and not (out / "endpoints.json").exists()
    keys = {"CORAL_API_KEYS": "key-one-123,key-two-456"}
    first, *rest = addresses
    done = run_script(script, {**logs, **keys, **{v: addresses[v] for v in rest}}, tmp_path / "bin")
    assert done.returncode == 1 and f"set {first} to the address of the machine running" in done.stderr
    assert not (out / "endpoints.json").exists()
    done = run_script(script, {**logs, **keys, **addresses}, tmp_path / "bin")
    assert done.returncode == 0, done.stderr
    spec = EndpointsFile.load(out / "endpoints.json")
    assert {e.id: e.url for e in spec.endpoints} == {
        eid: f"http://{addresses[gateway.address_var(eid)]}:8000" for eid in entry["engines"]}
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[0] == "gateway"
    params = parse(["coral", *argv])
    assert (params["endpoints"], params["host"], params["port"]) == (Path("endpoints.json"), "0.0.0.0", 8080)
    assert (tmp_path / "keys").read_text() == keys["CORAL_API_KEYS"]  # from the environment, not the command line
    hostile = {**addresses, first: "10.0.0.1;touch MARK"}
    done = run_script(script, {**logs, **keys, **hostile}, tmp_path / "bin")
    assert done.returncode == 1 and not list(tmp_path.rglob("MARK"))


# --- the CLI ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("engine", "target"), RENDERS)
def test_next_lines_end_at_the_gateway(tmp_path, engine, target):
    path = pd_plan().save(tmp_path / "plan.json")
    out = tmp_path / "out"
    args = ["deploy", "--plan", str(path), "--target", target, "--out", str(out), "--engine", engine]
    r = CliRunner().invoke(app, args + (["--checkpoint", CKPT] if engine == "coral" else []))
    assert r.exit_code == 0, r.output
    steps = [" ".join(chunk.split()) for chunk in r.output.split("next: ")[1:]]
    (gw,) = index_of(out)["endpoints"]["gateways"]
    assert steps[-1].startswith(f"clients use {gw['url']}") and "Authorization: Bearer KEY" in steps[-1]
    launches = " ".join(steps[:-1])
    if target in ("kubernetes", "kuberay"):
        assert 'kubectl create secret generic coral-gateway --from-literal=api-keys="$CORAL_API_KEYS"' in launches
        assert f'for f in {out}/*.k8s.yaml; do kubectl apply -f "$f"; done' in launches  # not index.json
        assert ("--from-literal=admin-token" in launches) == (target == "kuberay")
    elif target == "skypilot":
        engines, fill, up = steps[:3]
        assert engines.startswith(f"cd {out} && for f in *.sky.yaml; do sky serve up")
        assert fill.startswith(f"bash {out}/sky-endpoints.sh")
        assert up == f"cd {out} && sky serve up -y -n {GATEWAY} {GATEWAY}.gateway.yaml --secret CORAL_API_KEYS"
    else:
        assert f"bash {out}/gateway.sh" in steps[-2]


def test_a_plan_losing_capacity_is_refused_by_default(tmp_path):
    plan = pd_plan()
    plan.instances.append(make_instance("qwen3-32b", "decode", [(32, ["1xL4"]), (32, ["1xL4"])], 300.0, template_id=7))
    path = plan.save(tmp_path / "plan.json")
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["deploy", "--engine", "vllm", "--plan", str(path), "--target", "kubernetes", "--out", str(out)])
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and "qwen3-32b/decode loses 300 tok/s" in text and "--no-strict" in text
    assert not out.exists()
    r = CliRunner().invoke(app, ["deploy", "--engine", "vllm", "--plan", str(path), "--target", "kubernetes", "--out", str(out),
                                 "--no-strict"])
    assert r.exit_code == 0 and "capacity is reduced" in r.output and (out / "index.json").exists()


def test_deploy_takes_the_scenarios_current_plan_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    current = current_plan_path("core")
    assert not current.is_absolute()  # under the working directory: tmp_path
    current.parent.mkdir(parents=True)
    pd_plan().save(current)
    r = CliRunner().invoke(app, ["deploy", "--engine", "vllm", "--target", "skypilot", "--out", "d"])
    assert r.exit_code == 0, r.output
    assert f"plan: {current} (the current plan of core" in " ".join(r.output.split())
    assert set(index_of(tmp_path / "d")["endpoints"]["engines"]) == {
        "phi-4-prefill-t1-aws-us-east-2", "phi-4-decode-t2-aws-us-east-2", "qwen3-32b-prefill-t3-aws-us-east-2",
        "qwen3-32b-decode-t4-aws-us-east-2"}
    other = make_plan([make_instance("phi-4", "prefill", [(40, ["1xL40S"])], 10.0, template_id=9)], scenario="mine")
    given = other.save(tmp_path / "given.json")
    r = CliRunner().invoke(app, ["deploy", "--engine", "vllm", "--plan", str(given), "--target", "kubernetes", "--out", "g"])
    assert r.exit_code == 0 and "current plan" not in r.output  # a given plan wins
    assert index_of(tmp_path / "g")["scenario"] == "mine"
    other.save(current_plan_path("mine"))
    r = CliRunner().invoke(app, ["deploy", "--engine", "vllm", "--scenario", "mine", "--target", "kubernetes", "--out", "m"])
    assert r.exit_code == 0 and index_of(tmp_path / "m")["scenario"] == "mine"


def test_deploy_without_a_plan_or_a_current_one_names_plan(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["deploy", "--engine", "vllm", "--target", "skypilot", "--out", "d"])
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and "--plan: not given, and core has no current plan" in text
    assert "`coral run core`" in text and not (tmp_path / "d").exists() and not (tmp_path / "out").exists()


def test_deploy_launches_the_engine_the_plan_was_made_for_unless_told(tmp_path, monkeypatch):
    """`coral run`'s plan (made for the Coral engine) deploys the Coral engine, saying so; a plan made for stock
    vLLM deploys vLLM; --engine overrides either."""
    monkeypatch.chdir(tmp_path)
    path = pd_plan().save(tmp_path / "p.json")
    r = CliRunner().invoke(app, ["deploy", "--plan", str(path), "--target", "kubernetes", "--out", "c"])
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and "engine: the Coral engine, the one the plan was made for" in text
    assert "--checkpoint: required with --engine coral" in text and not (tmp_path / "c").exists()
    r = CliRunner().invoke(app, ["deploy", "--plan", str(path), "--target", "kubernetes", "--out", "c",
                                 "--checkpoint", "/models/ckpt"])
    assert r.exit_code == 0, r.output
    assert index_of(tmp_path / "c")["engine"] == "coral"
    vllm_plan = pd_plan()
    vllm_plan.engine = "vllm"
    r = CliRunner().invoke(app, ["deploy", "--plan", str(vllm_plan.save(tmp_path / "v.json")), "--target",
                                 "kubernetes", "--out", "v"])
    assert r.exit_code == 0 and "engine: stock vLLM, the one the plan was made for" in " ".join(r.output.split())
    assert index_of(tmp_path / "v")["engine"] == "vllm"
