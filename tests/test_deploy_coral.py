"""`coral deploy --engine coral`: KubeRay, Kubernetes, SkyPilot and per-node scripts for the Coral engine, on a
heterogeneous plan (pipelines whose stages use different node configs), and the offline manifest validation
(kubernetes-validate --strict for built-in kinds, the KubeRay CRD schema for RayCluster)."""

from __future__ import annotations

import copy
import json
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from sky_check import INSTALL_HINT as SKY_INSTALL_HINT
from sky_check import sky_python
from typer.testing import CliRunner

from coral.allocation.plan import Plan
from coral.catalog.loader import CoralInputError
from coral.cli.main import app
from coral.deploy.coral_engine import CORAL_IMAGE, node_argv, scheduler_argv, serve_argv
from coral.deploy.endpoints import EndpointsFile
from coral.deploy.render import render
from coral.deploy.schemas import KUBERAY_SCHEMA, raycluster_schema, validate_manifest
from coral.runtime.handmade import make_instance, make_plan

SKY_CHECK = Path(__file__).with_name("sky_check.py")
CKPT = "/models/qwen3-32b"
PREFILL = "qwen3-32b.prefill.t1.aws-us-east-2.0"  # 4xL40S | 1xL4
DECODE = "qwen3-32b.decode.t2.aws-us-east-2.0"  # 1xL4 | 1xL4 + 4xA10G
ONE_CONFIG = "qwen3-32b.decode.t3.aws-us-east-2.0"  # 1xL4 | 1xL4


def hetero_plan() -> Plan:
    """Two heterogeneous pipelines (a TP-4 L40S node then an L4 node; an L4 stage then a data-parallel stage of
    an L4 and a TP-4 A10G node) and a one-config pipeline, in the shape of the engine tests' plan on the node
    configs AWS offers (it sells no 2-GPU shapes)."""
    return make_plan([
        make_instance("qwen3-32b", "prefill", [(40, ["4xL40S"]), (24, ["1xL4"])], 6000.0, template_id=1),
        make_instance("qwen3-32b", "decode", [(16, ["1xL4"]), (48, ["1xL4", "4xA10G"])], 500.0, template_id=2),
        make_instance("qwen3-32b", "decode", [(32, ["1xL4"]), (32, ["1xL4"])], 300.0, template_id=3),
    ], scenario="core")


def load_docs(paths) -> dict[str, list[dict]]:
    """kind -> documents of every rendered .k8s.yaml, each validated on the way."""
    kinds: dict[str, list[dict]] = {}
    for path in paths:
        if path.name.endswith(".k8s.yaml"):
            for doc in yaml.safe_load_all(path.read_text()):
                validate_manifest(doc, path.name)
                kinds.setdefault(doc["kind"], []).append(doc)
    return kinds


def argv_of(container: dict) -> list[str]:
    return container["command"] + container.get("args", [])


# --- kuberay ------------------------------------------------------------------------------------------------
def test_kuberay_one_worker_group_per_node_config(tmp_path):
    res = render(hetero_plan(), "kuberay", tmp_path, engine="coral", checkpoint=CKPT)
    assert res.skipped == {} and res.uncovered == []
    assert [p.name for p in res.files] == ["coral-core.raycluster.k8s.yaml"]
    kinds = load_docs(res.files)
    (cluster,) = kinds["RayCluster"]
    (cm,) = kinds["ConfigMap"]
    (gateway,) = kinds["Service"]
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["metadata"]["name"] == "coral-core"
    assert Plan.model_validate_json(cm["data"]["plan.json"]) == hetero_plan()
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    # nodes per config over all instances, stages and data-parallel nodes: 1xL4 = 1 + 2 + 2
    want = {"1xl4": ("1xL4", 5, "g6.xlarge", "1"), "4xl40s": ("4xL40S", 1, "g6e.12xlarge", "4"),
            "4xa10g": ("4xA10G", 1, "g5.12xlarge", "4")}
    assert set(groups) == set(want)
    for name, (config, replicas, itype, gpus) in want.items():
        g = groups[name]
        assert (g["replicas"], g["minReplicas"], g["maxReplicas"]) == (replicas, 0, replicas)
        params = g["rayStartParams"]
        assert params["num-gpus"] == gpus
        assert params["resources"] == f"'{{\"coral-node/{config}\":1}}'"  # quoted for KubeRay's bash line
        assert json.loads(params["resources"].strip("'")) == {f"coral-node/{config}": 1}
        pod = g["template"]["spec"]
        assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": itype}
        (ctr,) = pod["containers"]
        assert ctr["resources"]["limits"]["nvidia.com/gpu"] == gpus and ctr["image"] == CORAL_IMAGE
        assert {"name": "plan", "configMap": {"name": cm["metadata"]["name"]}} in pod["volumes"]
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"] == {"dashboard-host": "0.0.0.0", "num-gpus": "0"}
    assert head["template"]["metadata"]["annotations"] == {"ray.io/overwrite-container-cmd": "true"}
    (ctr,) = head["template"]["spec"]["containers"]
    assert ctr["args"][0].count("$") == 2 * ctr["args"][0].count("$$")  # every dollar escaped for the kubelet
    script = ctr["args"][0].replace("$$", "$")
    assert '/bin/bash -c "$KUBERAY_GEN_RAY_START_CMD" &' in script
    (serve,) = [ln for ln in script.splitlines() if ln.startswith("coral serve")]
    assert shlex.split(serve.removesuffix(" &")) == serve_argv("core", CKPT) == [
        "coral", "serve", "core", "--backend", "coral", "--ray", "--plan", "/etc/coral/plan.json",
        "--checkpoint", CKPT, "--host", "0.0.0.0", "--port", "8080"]
    assert "nvidia.com/gpu" not in json.dumps(head)
    subprocess.run(["bash", "-n", "-c", script], check=True)
    assert gateway["metadata"]["name"] == "coral-core-gateway"
    assert gateway["spec"]["selector"] == {"ray.io/cluster": "coral-core", "ray.io/node-type": "head"}
    assert gateway["spec"]["ports"][0]["port"] == 8080
    index = json.loads((tmp_path / "index.json").read_text())
    assert (index["engine"], index["target"]) == ("coral", "kuberay")
    assert index["endpoints"]["gateways"] == [{"name": "coral-core-gateway", "url": "http://coral-core-gateway:8080/v1",
                                               "files": ["coral-core.raycluster.k8s.yaml"]}]
    assert index["endpoints"]["engines"] == {} and index["endpoints"]["file"] is None  # the controller places them


def test_kuberay_renders_one_cluster_per_region(tmp_path):
    plan = hetero_plan()
    plan.instances.append(make_instance("qwen3-32b", "decode", [(64, ["4xL40S"])], 100.0, template_id=4,
                                        region="aws-ap-northeast-2"))
    res = render(plan, "kuberay", tmp_path, engine="coral", checkpoint=CKPT)
    names = sorted(p.name for p in res.files)
    assert names == ["coral-core-aws-ap-northeast-2.raycluster.k8s.yaml", "coral-core-aws-us-east-2.raycluster.k8s.yaml"]
    docs = load_docs([tmp_path / names[0]])
    (cluster,) = docs["RayCluster"]
    assert [(g["groupName"], g["replicas"]) for g in cluster["spec"]["workerGroupSpecs"]] == [("4xl40s", 1)]
    part = Plan.model_validate_json(docs["ConfigMap"][0]["data"]["plan.json"])
    assert [i.region for i in part.instances] == ["aws-ap-northeast-2"]


def _cluster(tmp_path) -> dict:
    res = render(hetero_plan(), "kuberay", tmp_path, engine="coral", checkpoint=CKPT)
    return next(d for d in yaml.safe_load_all(res.files[0].read_text()) if d["kind"] == "RayCluster")


def test_raycluster_validation_names_the_field(tmp_path):
    good = _cluster(tmp_path)
    validate_manifest(good)
    bad = copy.deepcopy(good)
    bad["spec"]["workerGroupSpecs"][0]["replicas"] = "three"
    with pytest.raises(CoralInputError, match=r"spec\.workerGroupSpecs\.0\.replicas: 'three' is not of type"):
        validate_manifest(bad, "x.yaml")
    bad = copy.deepcopy(good)
    bad["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imagePullPolice"] = "Always"
    with pytest.raises(CoralInputError,
                       match=r"spec\.headGroupSpec\.template\.spec\.containers\.0\.imagePullPolice: unknown field"):
        validate_manifest(bad)
    bad = copy.deepcopy(good)
    bad["spec"]["workerGroups"] = bad["spec"].pop("workerGroupSpecs")  # a misspelt list: refused, not pruned
    with pytest.raises(CoralInputError, match=r"spec\.workerGroups: unknown field"):
        validate_manifest(bad)
    bad = copy.deepcopy(good)
    del bad["spec"]["workerGroupSpecs"][1]["groupName"]
    bad["spec"]["workerGroupSpecs"][2]["template"]["spec"]["containers"][0]["resources"]["limits"] = {
        "nvidia.com/gpu": "four"}
    with pytest.raises(CoralInputError, match="2 problems") as exc:
        validate_manifest(bad)
    assert "spec.workerGroupSpecs.1: 'groupName' is a required property" in str(exc.value)
    assert "spec.workerGroupSpecs.2.template.spec.containers.0.resources.limits.nvidia.com/gpu" in str(exc.value)
    with pytest.raises(CoralInputError, match=r"apiVersion: 'ray.io/v1alpha1'"):
        validate_manifest({**good, "apiVersion": "ray.io/v1alpha1"})
    with pytest.raises(CoralInputError, match=r"metadata\.name"):
        validate_manifest({**good, "metadata": {"name": "Coral_Core"}})


def test_the_shipped_kuberay_schema_is_the_crds_v1_schema():
    from importlib import resources

    text = resources.files("coral").joinpath(KUBERAY_SCHEMA).read_text()
    assert "ray-project/kuberay" in text and "tag v1.7.0" in text and "ray.io_rayclusters.yaml" in text
    schema = raycluster_schema()
    spec = schema["properties"]["spec"]["properties"]
    assert {"headGroupSpec", "workerGroupSpecs"} <= set(spec)
    assert {"groupName", "rayStartParams", "replicas", "maxReplicas"} <= set(spec["workerGroupSpecs"]["items"]["properties"])
    assert (resources.files("coral").joinpath(KUBERAY_SCHEMA).parent / "LICENSE").is_file()


# --- built-in kinds -----------------------------------------------------------------------------------------
def test_builtin_kinds_are_checked_strictly(tmp_path):
    res = render(hetero_plan(), "kubernetes", tmp_path, engine="coral", checkpoint=CKPT)
    kinds = load_docs(res.files)
    # the plan, and the gateway's endpoints; per instance its rendezvous Service, and the gateway's; per instance
    # a scheduler and one Deployment per node (7), and the gateway
    assert {k: len(v) for k, v in kinds.items()} == {"ConfigMap": 1 + 1, "Service": 3 + 1, "Deployment": 3 + 7 + 1}
    cm = copy.deepcopy(kinds["ConfigMap"][0])
    cm["datas"] = cm.pop("data")
    with pytest.raises(CoralInputError, match=r"\(ConfigMap\): datas: unknown field"):
        validate_manifest(cm)
    old_api = {**kinds["Deployment"][0], "apiVersion": "extensions/v1beta1"}  # removed in Kubernetes 1.16
    with pytest.raises(CoralInputError, match=r"\(Deployment\): apiVersion: .*extensions/v1beta1"):
        validate_manifest(old_api)
    dep = copy.deepcopy(kinds["Deployment"][1])
    dep["spec"]["template"]["spec"]["hostName"] = "node-0"  # misspelt: the pod would get no stable DNS name
    with pytest.raises(CoralInputError, match=r"spec\.template\.spec\.hostName: unknown field"):
        validate_manifest(dep)
    svc = copy.deepcopy(kinds["Service"][0])
    svc["spec"]["ports"][0]["port"] = "http"
    with pytest.raises(CoralInputError, match=r"\(Service\).*spec\.ports\.0\.port"):
        validate_manifest(svc)
    with pytest.raises(CoralInputError, match="kind"):
        validate_manifest({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}})


# --- kubernetes ---------------------------------------------------------------------------------------------
def test_kubernetes_target_pods_and_argv(tmp_path):
    res = render(hetero_plan(), "kubernetes", tmp_path, engine="coral", checkpoint=CKPT)
    assert res.skipped == {} and res.uncovered == []
    kinds = load_docs(res.files)
    deps = {d["metadata"]["name"]: d for d in kinds["Deployment"]}
    svcs = {d["metadata"]["name"]: d for d in kinds["Service"]}
    (cm,) = [d for d in kinds["ConfigMap"] if "plan.json" in d["data"]]
    base = "qwen3-32b-decode-t2-aws-us-east-2-0"
    rdzv = f"{base}-rdzv"
    svc = svcs[rdzv]["spec"]
    assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
    assert svc["selector"] == {"app.kubernetes.io/name": base}
    assert {(p["name"], p["port"]) for p in svc["ports"]} == {("http", 8000), ("results", 5555), ("rdzv", 29500)}
    sched = deps[f"{base}-scheduler"]["spec"]["template"]
    assert sched["metadata"]["labels"]["app.kubernetes.io/name"] == base
    pod = sched["spec"]
    assert (pod["hostname"], pod["subdomain"]) == ("scheduler", rdzv) and "nodeSelector" not in pod
    assert argv_of(pod["containers"][0]) == scheduler_argv(DECODE, CKPT, f"scheduler.{rdzv}", f"node-0.{rdzv}") == [
        "python", "-m", "coral.engine.instance", "/etc/coral/plan.json", DECODE, CKPT, "--no-launch", "--host",
        "0.0.0.0", "--advertise", f"scheduler.{rdzv}", "--port", "8000", "--results-port", "5555", "--dist-init",
        f"tcp://node-0.{rdzv}:29500", "--device", "cuda", "--dist-backend", "nccl"]
    # ranks in stage order, the data-parallel stage's nodes in order: 1xL4 | 1xL4, 4xA10G
    for rank, itype, gpus in ((0, "g6.xlarge", "1"), (1, "g6.xlarge", "1"), (2, "g5.12xlarge", "4")):
        dep = deps[f"{base}-node-{rank}"]
        assert dep["spec"]["replicas"] == 1 and dep["spec"]["selector"]["matchLabels"]["coral.io/rank"] == str(rank)
        pod = dep["spec"]["template"]["spec"]
        assert (pod["hostname"], pod["subdomain"]) == (f"node-{rank}", rdzv)
        assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": itype}
        (ctr,) = pod["containers"]
        assert ctr["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert argv_of(ctr) == node_argv(DECODE, CKPT, rank, f"scheduler.{rdzv}", f"node-0.{rdzv}", "$(POD_IP)")
        a = argv_of(ctr)
        assert a[:3] == ["python", "-m", "coral.engine.node"]
        assert a[a.index("--node-rank") + 1] == str(rank)
        assert a[a.index("--scheduler") + 1] == f"tcp://scheduler.{rdzv}:5555"
        assert a[a.index("--dist-init") + 1] == f"tcp://node-0.{rdzv}:29500"
        assert a[a.index("--advertise") + 1] == "$(POD_IP)"  # expanded by the kubelet
        assert ctr["env"] == [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
        assert {"name": "plan", "mountPath": "/etc/coral", "readOnly": True} in ctr["volumeMounts"]
        assert {"name": "plan", "configMap": {"name": cm["metadata"]["name"]}} in pod["volumes"]
    prefill = "qwen3-32b-prefill-t1-aws-us-east-2-0"
    assert [deps[f"{prefill}-node-{r}"]["spec"]["template"]["spec"]["nodeSelector"]["node.kubernetes.io/instance-type"]
            for r in (0, 1)] == ["g6e.12xlarge", "g6.xlarge"]
    eps = {e.id: e for e in EndpointsFile.load(tmp_path / "endpoints.json").endpoints}
    assert set(eps) == {prefill, base, "qwen3-32b-decode-t3-aws-us-east-2-0"}
    assert (eps[base].url, eps[base].weight, eps[base].phase) == (f"http://scheduler.{rdzv}:8000", 500.0, "decode")


def test_kubernetes_names_stay_dns_labels_for_long_ids(tmp_path):
    plan = hetero_plan()
    plan.instances[1].id = "qwen3-32b.decode." + "x" * 100 + ".0"
    res = render(plan, "kubernetes", tmp_path, engine="coral", checkpoint=CKPT)
    kinds = load_docs(res.files)  # validates every name
    for docs in kinds.values():
        names = [d["metadata"]["name"] for d in docs]
        assert len(names) == len(set(names)) and max(map(len, names)) <= 63


# --- SkyPilot -----------------------------------------------------------------------------------------------
def test_skypilot_skips_mixed_config_instances_with_a_reason(tmp_path):
    res = render(hetero_plan(), "skypilot", tmp_path, engine="coral", checkpoint=CKPT)
    assert set(res.skipped) == {PREFILL, DECODE}
    assert "node configs 1xL4 | 4xL40S" in res.skipped[PREFILL] and "one resources spec" in res.skipped[PREFILL]
    assert "node configs 1xL4 | 4xA10G" in res.skipped[DECODE]
    assert res.uncovered == [("qwen3-32b", "prefill")]
    assert sorted(p.name for p in res.files) == ["coral-core-gateway.gateway.yaml", "plan.json",
                                                 "qwen3-32b-decode-t3-aws-us-east-2-0.sky.yaml", "sky-endpoints.sh"]
    task = yaml.safe_load((tmp_path / "qwen3-32b-decode-t3-aws-us-east-2-0.sky.yaml").read_text())
    assert task["num_nodes"] == 2
    assert task["resources"] == {"cloud": "aws", "region": "us-east-2", "accelerators": "L4:1",
                                 "instance_type": "g6.xlarge", "image_id": f"docker:{CORAL_IMAGE}", "ports": 8000}
    assert task["file_mounts"] == {"/etc/coral/plan.json": "plan.json"}
    assert task["service"]["replicas"] == 1 and task["service"]["ports"] == 8000
    run = task["run"]
    subprocess.run(["bash", "-n", "-c", run], check=True)
    lines = run.splitlines()
    assert lines[1] == 'export CORAL_HEAD_ADDR=$(echo "$SKYPILOT_NODE_IPS" | head -n1)'
    head, me, rank = "$CORAL_HEAD_ADDR", "$CORAL_NODE_ADDR", "$SKYPILOT_NODE_RANK"
    (sched,) = [ln for ln in lines if "coral.engine.instance" in ln]
    assert shlex.split(sched.strip().removesuffix(" &"), posix=True) == scheduler_argv(ONE_CONFIG, CKPT, head, head)
    assert lines[-1].startswith("exec ")
    assert shlex.split(lines[-1])[1:] == node_argv(ONE_CONFIG, CKPT, rank, head, head, me)
    assert '--dist-init "tcp://$CORAL_HEAD_ADDR:29500"' in lines[-1] and '--node-rank "$SKYPILOT_NODE_RANK"' in lines[-1]
    assert Plan.model_validate_json((tmp_path / "plan.json").read_text()) == hetero_plan()


def test_skypilot_services_pass_sky_serve_up_checks(tmp_path):
    python = sky_python()
    if python is None:
        pytest.skip(f"SkyPilot is not installed: `{SKY_INSTALL_HINT}` installs it (or set CORAL_SKY_PYTHON)")
    plan = make_plan([make_instance("qwen3-32b", "decode", [(32, ["1xL4"]), (32, ["1xL4"])], 300.0, template_id=3),
                      make_instance("qwen3-32b", "prefill", [(64, ["4xL40S"])], 900.0, template_id=5)])
    res = render(plan, "skypilot", tmp_path, engine="coral", checkpoint=CKPT)
    files = [p.name for p in res.files if p.name.endswith(".sky.yaml")]
    assert len(files) == 2 and res.skipped == {}
    # `sky serve up` runs in the output folder, where the plan file mount's source is
    out = subprocess.run([python, str(SKY_CHECK), *files], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


# --- commands -----------------------------------------------------------------------------------------------
def test_commands_target_writes_scheduler_and_node_scripts(tmp_path):
    res = render(hetero_plan(), "commands", tmp_path, engine="coral", checkpoint=CKPT)
    base = "qwen3-32b-decode-t2-aws-us-east-2-0"
    names = {p.name for p in res.files}
    assert {f"{base}.scheduler.sh", f"{base}.node0.sh", f"{base}.node1.sh", f"{base}.node2.sh", "plan.json"} <= names
    assert len(names) == 1 + 3 + 4 + 3 + 1  # plan, then per instance its scheduler and nodes, and the gateway
    for p in res.files:
        if p.suffix == ".sh":
            subprocess.run(["bash", "-n", str(p)], check=True)
    node2 = (tmp_path / f"{base}.node2.sh").read_text()
    assert "on a 4xA10G machine" in node2 and ': "${CORAL_SCHEDULER_ADDR:?' in node2
    assert shlex.split(node2.splitlines()[-1])[1:] == node_argv(
        DECODE, CKPT, 2, "$CORAL_SCHEDULER_ADDR", "$CORAL_HEAD_ADDR", "$CORAL_NODE_ADDR", "$CORAL_PLAN")
    out = subprocess.run(["bash", str(tmp_path / f"{base}.node2.sh")], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.returncode != 0 and "CORAL_HEAD_ADDR" in out.stderr  # refuses to start without the rendezvous


# --- CLI ----------------------------------------------------------------------------------------------------
def test_cli_deploy_engine_coral_kuberay(tmp_path):
    plan_path = hetero_plan().save(tmp_path / "plan.json")
    out = tmp_path / "ray"
    r = CliRunner().invoke(app, ["deploy", "--plan", str(plan_path), "--engine", "coral", "--target", "kuberay",
                                 "--checkpoint", CKPT, "--out", str(out), "--image", "me/coral:gpu"])
    assert r.exit_code == 0, r.output
    index = json.loads((out / "index.json").read_text())
    assert index["files"] == ["coral-core.raycluster.k8s.yaml"] and index["engine"] == "coral"
    kinds = load_docs([out / index["files"][0]])
    assert {c["image"] for g in kinds["RayCluster"][0]["spec"]["workerGroupSpecs"]
            for c in g["template"]["spec"]["containers"]} == {"me/coral:gpu"}
    assert "kubectl apply" in r.output


def test_cli_deploy_engine_coral_refusals(tmp_path):
    plan_path = hetero_plan().save(tmp_path / "plan.json")
    runner = CliRunner()

    def deploy(*args: str):
        r = runner.invoke(app, ["deploy", "--plan", str(plan_path), "--out", str(tmp_path / "o"), *args])
        return r.exit_code, " ".join(r.output.split())

    code, text = deploy("--engine", "coral", "--target", "skypilot", "--checkpoint", CKPT)
    assert code == 2 and "qwen3-32b/prefill would get no launchable instance on skypilot" in text
    assert "2 instance(s) the Coral engine cannot launch on skypilot" in text and "--target kuberay" in text
    code, text = deploy("--engine", "coral", "--target", "kuberay")
    assert code == 2 and "--checkpoint: required with --engine coral" in text
    code, text = deploy("--engine", "coral", "--target", "slurm", "--checkpoint", CKPT)
    assert code == 2 and "kuberay, kubernetes, skypilot, commands" in text
    code, text = deploy("--target", "kuberay")
    assert code == 2 and "--engine coral" in text
    code, text = deploy("--engine", "coral", "--target", "kubernetes", "--checkpoint", "models/x; rm -rf /")
    assert code == 2 and "absolute path" in text
    assert not (tmp_path / "o").exists()
    code, text = deploy("--engine", "coral", "--target", "commands", "--checkpoint", CKPT)
    assert code == 0 and "CORAL_SCHEDULER_ADDR" in text
    assert (tmp_path / "o" / "qwen3-32b-prefill-t1-aws-us-east-2-0.node1.sh").exists()
