"""vLLM realisability and commands, and the SkyPilot / Kubernetes / commands renderers."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from sky_check import INSTALL_HINT as SKY_INSTALL_HINT
from sky_check import sky_python
from typer.testing import CliRunner

from coral.catalog.loader import CoralInputError, builtin_catalog
from coral.catalog.schema import ModelArch
from coral.cli.main import app
from coral.deploy.common import dns_name
from coral.deploy.endpoints import EndpointsFile
from coral.deploy.render import TARGETS, launchable, render
from coral.deploy.schemas import validate_manifest
from coral.deploy.vllm import (
    KV_TRANSFER_CONFIG,
    launch_commands,
    realisable,
    side_channel_env,
    vllm_compatible_filter,
)
from coral.perf.model import Phase
from coral.runtime.handmade import make_instance, make_plan
from coral.templates.engines import DEPLOY_TARGETS, engine_library
from coral.templates.library import Stage, Template, TemplateLibrary

CAT = builtin_catalog()
SKY_CHECK = Path(__file__).with_name("sky_check.py")
PHI = CAT.model("phi-4")
QWEN = CAT.model("qwen3-32b")


def hetero_pipeline():
    return make_instance("qwen3-32b", "prefill", [(30, ["4xL4"]), (34, ["4xL40S"])], 900.0, template_id=3)


def sample_plan():
    return make_plan(
        [
            make_instance("phi-4", "prefill", [(40, ["1xL40S"])], 5000.0, template_id=1),
            make_instance("phi-4", "decode", [(40, ["1xL40S"])], 800.0, template_id=2, index=0),
            make_instance("phi-4", "decode", [(40, ["1xL40S"])], 800.0, template_id=2, index=1),
            hetero_pipeline(),
            make_instance("qwen3-32b", "decode", [(64, ["1xL40S", "1xL40S"])], 700.0, template_id=4),
            make_instance(
                "qwen3-32b", "decode", [(32, ["1xL4", "1xL4"]), (32, ["1xL4"])], 300.0, template_id=7
            ),
        ],
        scenario="core",
    )


@pytest.mark.parametrize(
    ("phase", "stages", "ok", "why"),
    [
        ("decode", [(40, ["1xL40S"])], True, ""),
        ("prefill", [(20, ["2xL4"]), (20, ["2xA10G"])], True, ""),  # mixed GPU types, equal TP
        ("decode", [(20, ["2xL4"]), (20, ["2xA10G"])], False, "NixlConnector"),  # no PP on the decode side
        ("decode", [(40, ["1xL40S", "1xL4"])], True, ""),  # one stage, two nodes: two independent replicas
        ("prefill", [(20, ["1xL40S", "1xL40S"]), (20, ["1xL40S"])], False, "data-parallel"),
        ("prefill", [(20, ["1xL40S"]), (20, ["2xL40S"])], False, "tensor-parallel"),
    ],
)
def test_realisable_golden(phase, stages, ok, why):
    inst = make_instance("phi-4", phase, stages, 100.0)
    r = realisable(inst, PHI)
    assert bool(r) is ok
    assert why in r.reason


def test_realisable_checks_head_divisibility():
    arch = PHI.model_copy(update={"num_attention_heads": 6, "num_key_value_heads": 6})
    assert isinstance(arch, ModelArch)
    r = realisable(make_instance("phi-4", "decode", [(40, ["4xL4"])], 1.0), arch)
    assert not r and "6 attention heads" in r.reason


def test_filter_accepts_library_templates():
    good = Template(
        0,
        "phi-4",
        Phase.DECODE,
        60,
        {"1xL4": 2},
        (Stage(20, ("1xL4",), (1.0,)), Stage(20, ("1xL4",), (1.0,))),
        1.0,
    )
    dp = Template(
        1,
        "phi-4",
        Phase.DECODE,
        60,
        {"1xL4": 3},
        (Stage(20, ("1xL4", "1xL4"), (1.0, 1.0)), Stage(20, ("1xL4",), (1.0,))),
        2.0,
    )
    assert vllm_compatible_filter(good.stages)
    assert not vllm_compatible_filter(good.stages, phase="decode")
    assert not vllm_compatible_filter(dp.stages)


def test_launch_commands_golden_heterogeneous_pipeline():
    with pytest.raises(ValueError, match="push connector"):
        launch_commands(hetero_pipeline(), QWEN)
    r0, r1 = launch_commands(hetero_pipeline(), QWEN, push=True)
    assert (r0.config, r1.config) == ("4xL4", "4xL40S")
    side = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "$CORAL_NODE_ADDR", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"}
    assert side_channel_env() == side
    assert r0.env == r1.env == {"VLLM_PP_LAYER_PARTITION": "30,34", **side}
    assert r0.argv[:3] == ["vllm", "serve", "Qwen/Qwen3-32B"]
    for nl, rank in ((r0, "0"), (r1, "1")):
        a = nl.argv
        assert a[a.index("--tensor-parallel-size") + 1] == "4"
        assert a[a.index("--pipeline-parallel-size") + 1] == "2"
        assert a[a.index("--nnodes") + 1] == "2"
        assert a[a.index("--node-rank") + 1] == rank
        assert json.loads(a[a.index("--kv-transfer-config") + 1]) == {
            "kv_connector": "NixlPushConnector",
            "kv_role": "kv_producer",
        }
    assert "--port" in r0.argv and "--headless" not in r0.argv
    assert "--headless" in r1.argv and "--port" not in r1.argv
    assert '--master-addr "$CORAL_HEAD_ADDR"' in r1.shell()
    assert 'VLLM_NIXL_SIDE_CHANNEL_HOST="$CORAL_NODE_ADDR"' in r1.shell()
    assert shlex.split(r0.shell())[0] == "VLLM_PP_LAYER_PARTITION=30,34"


def test_launch_commands_single_node():
    (one,) = launch_commands(
        make_instance("phi-4", "decode", [(40, ["2xL40S"])], 1.0), PHI, disaggregated=False
    )
    assert one.env == {} and "--kv-transfer-config" not in one.argv and "--nnodes" not in one.argv
    (pd,) = launch_commands(make_instance("phi-4", "decode", [(40, ["2xL40S"])], 1.0), PHI)
    assert json.loads(pd.argv[pd.argv.index("--kv-transfer-config") + 1]) == KV_TRANSFER_CONFIG
    (push,) = launch_commands(make_instance("phi-4", "decode", [(40, ["2xL40S"])], 1.0), PHI, push=True)
    assert "kv_consumer" in push.argv[push.argv.index("--kv-transfer-config") + 1]
    with pytest.raises(ValueError, match="data parallelism"):
        launch_commands(make_instance("phi-4", "prefill", [(20, ["1xL4", "1xL4"]), (20, ["1xL4"])], 1.0), PHI)
    a, b = launch_commands(make_instance("phi-4", "decode", [(40, ["1xL4", "2xL4"])], 1.0), PHI)
    assert (a.replica, a.gpus, b.replica, b.gpus) == (0, 1, 1, 2) and "--port" in b.argv


@settings(max_examples=40, deadline=None)
@given(
    layers=st.lists(st.integers(1, 20), min_size=1, max_size=6),
    gpus=st.sampled_from([1, 2, 4, 8]),
    types=st.lists(st.sampled_from(["L4", "A10G", "L40S"]), min_size=6, max_size=6),
)
def test_launch_commands_property(layers, gpus, types):
    stages = [(n, [f"{gpus}x{types[k]}"]) for k, n in enumerate(layers)]
    inst = make_instance("phi-4", "prefill", stages, 1.0)
    arch = PHI.model_copy(update={"num_hidden_layers": sum(layers)})
    cmds = launch_commands(inst, arch, push=True)
    assert len(cmds) == len(layers)
    assert [c.config for c in cmds] == [s[1][0] for s in stages]
    if len(layers) > 1:
        part = [int(x) for x in cmds[0].env["VLLM_PP_LAYER_PARTITION"].split(",")]
        assert part == layers
        assert sorted(int(c.argv[c.argv.index("--node-rank") + 1]) for c in cmds) == list(range(len(layers)))
    assert sum(1 for c in cmds if "--port" in c.argv) == 1


def test_kubernetes_manifests_validate(tmp_path):
    res = render(sample_plan(), "kubernetes", tmp_path)
    assert set(res.skipped) == {"qwen3-32b.decode.t7.aws-us-east-2.0"}
    assert "NixlConnector" in next(iter(res.skipped.values()))
    assert res.uncovered == []
    kinds: dict[str, list[dict]] = {}
    for path in res.files:
        for doc in yaml.safe_load_all(path.read_text()):
            validate_manifest(doc, path.name)
            kinds.setdefault(doc["kind"], []).append(doc)
    deps = {d["metadata"]["name"]: d for d in kinds["Deployment"]}
    assert deps["phi-4-decode-t2-aws-us-east-2"]["spec"]["replicas"] == 2
    assert deps["qwen3-32b-decode-t4-aws-us-east-2"]["spec"]["replicas"] == 2  # data-parallel stage
    c = deps["phi-4-prefill-t1-aws-us-east-2"]["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    argv = launch_commands(sample_plan().instances[0], PHI, push=False)[0].argv
    assert c["command"] + c["args"] == argv
    env = {e["name"]: e for e in c["env"]}
    assert env["CORAL_NODE_ADDR"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["value"] == "$(CORAL_NODE_ADDR)"  # expanded by the kubelet
    assert {p["containerPort"] for p in c["ports"]} == {8000, 5600}
    # the heterogeneous prefill pipeline: one pinned Deployment per rank, explicit --node-rank, headless rank-0 Service
    r0, r1 = (deps[f"qwen3-32b-prefill-t3-aws-us-east-2-0-r{r}"] for r in (0, 1))
    for rank, dep, itype, gpus in ((0, r0, "g6.12xlarge", "4"), (1, r1, "g6e.12xlarge", "4")):
        pod = dep["spec"]["template"]["spec"]
        assert pod["nodeSelector"]["node.kubernetes.io/instance-type"] == itype
        ctr = pod["containers"][0]
        assert ctr["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert ctr["args"][ctr["args"].index("--node-rank") + 1] == str(rank)
        assert ctr["args"][ctr["args"].index("--master-addr") + 1] == "$(CORAL_HEAD_ADDR)"
        assert "NixlPushConnector" in ctr["args"][ctr["args"].index("--kv-transfer-config") + 1]
        envs = {e["name"]: e.get("value") for e in ctr["env"]}
        assert envs["CORAL_HEAD_ADDR"] == "qwen3-32b-prefill-t3-aws-us-east-2-0"
        assert envs["VLLM_PP_LAYER_PARTITION"] == "30,34"
        assert dep["spec"]["selector"]["matchLabels"]["coral.io/rank"] == str(rank)
    assert "readinessProbe" in r0["spec"]["template"]["spec"]["containers"][0]
    assert "readinessProbe" not in r1["spec"]["template"]["spec"]["containers"][0]
    svcs = {d["metadata"]["name"]: d for d in kinds["Service"]}
    head = svcs["qwen3-32b-prefill-t3-aws-us-east-2-0"]["spec"]
    assert head["clusterIP"] == "None" and head["selector"]["coral.io/rank"] == "0"
    assert len(kinds["Service"]) == 4 + 1  # and the gateway's
    eps = {e.id: e for e in EndpointsFile.load(tmp_path / "endpoints.json").endpoints}
    assert set(eps) == set(svcs) - {"coral-core-gateway"}
    decode = eps["phi-4-decode-t2-aws-us-east-2"]
    assert (decode.url, decode.weight, decode.phase) == (
        "http://phi-4-decode-t2-aws-us-east-2:8000",
        1600.0,
        "decode",
    )
    assert eps["qwen3-32b-prefill-t3-aws-us-east-2-0"].weight == 900.0
    index = json.loads((tmp_path / "index.json").read_text())
    assert set(index["files"]) == {p.name for p in res.files}


def test_manifest_validation_names_the_field():
    bad = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {"replicas": "many"},
    }
    with pytest.raises(CoralInputError, match=r"spec\.replicas"):
        validate_manifest(bad)
    with pytest.raises(CoralInputError, match=r"metadata\.name"):
        validate_manifest({**bad, "metadata": {"name": "Bad_Name"}})
    with pytest.raises(CoralInputError, match="kind"):
        validate_manifest({"kind": "Pod"})


def test_skypilot_services(tmp_path):
    res = render(sample_plan(), "skypilot", tmp_path)
    assert "node configs 4xL4 | 4xL40S" in res.skipped["qwen3-32b.prefill.t3.aws-us-east-2.0"]
    assert "NixlConnector" in res.skipped["qwen3-32b.decode.t7.aws-us-east-2.0"]
    assert res.uncovered == [("qwen3-32b", "prefill")]
    docs = {p.name: yaml.safe_load(p.read_text()) for p in res.files if p.name.endswith(".sky.yaml")}
    assert len(docs) == 3 and "coral-core-gateway.gateway.yaml" in {p.name for p in res.files}
    svc = docs["phi-4-decode-t2-aws-us-east-2.sky.yaml"]
    assert svc["resources"] == {
        "cloud": "aws",
        "region": "us-east-2",
        "accelerators": "L40S:1",
        "instance_type": "g6e.xlarge",
        "image_id": "docker:vllm/vllm-openai:v0.33.0",
        "ports": [8000, 5600],
    }
    assert svc["secrets"] == {"HF_TOKEN": None} and "HF_TOKEN" not in svc["envs"]
    assert svc["service"]["replicas"] == 2 and svc["service"]["readiness_probe"]["path"] == "/health"
    assert svc["service"]["ports"] == 8000  # the replica's serving port: sky serve up needs it with two ports open
    assert "num_nodes" not in svc
    first, second = svc["run"].splitlines()
    assert first.startswith("export CORAL_NODE_ADDR=$(hostname -I")
    assert shlex.split(second)[2:4] == ["vllm", "serve"]


def one_config_pipeline(index: int = 0):
    return make_instance("qwen3-32b", "prefill", [(30, ["4xL40S"]), (34, ["4xL40S"])], 900.0, template_id=5,
                         index=index)


def test_skypilot_runs_a_one_config_pipeline_as_multi_node_replicas(tmp_path):
    """Two instances of a 4xL40S | 4xL40S prefill pipeline: one service of 2 replicas of 2 nodes, node r running
    exactly rank r's command of `launch_commands`, rendezvous at SkyPilot's head node."""
    res = render(make_plan([one_config_pipeline(0), one_config_pipeline(1)]), "skypilot", tmp_path)
    assert res.skipped == {} and res.uncovered == []
    (path,) = [p for p in res.files if p.name.endswith(".sky.yaml")]
    (endpoint,) = EndpointsFile.load(tmp_path / "endpoints.template.json").endpoints
    assert (endpoint.id, endpoint.weight) == (path.name.removesuffix(".sky.yaml"), 2 * 900.0)  # both replicas
    svc = yaml.safe_load(path.read_text())
    assert (svc["num_nodes"], svc["service"]["replicas"], svc["service"]["ports"]) == (2, 2, 8000)
    assert svc["resources"]["instance_type"] == "g6e.12xlarge" and svc["resources"]["accelerators"] == "L40S:4"
    lines = svc["run"].splitlines()
    assert lines[1] == 'export CORAL_HEAD_ADDR=$(echo "$SKYPILOT_NODE_IPS" | head -n1)'
    assert lines[2] == 'case "$SKYPILOT_NODE_RANK" in' and lines[-1] == "esac"
    for launch in launch_commands(one_config_pipeline(), QWEN, push=True):
        (case,) = [ln for ln in lines if ln.startswith(f"  {launch.rank}) ")]
        words = shlex.split(case.removeprefix(f"  {launch.rank}) ").removesuffix(" ;;"))
        assert words[words.index("exec") + 1:] == launch.argv


def test_skypilot_services_pass_sky_serve_up_checks(tmp_path):
    """Every service file `coral deploy --target skypilot` writes (single-node and multi-node replicas) passes
    the checks `sky serve up` runs on it (`tests/sky_check.py`), with SkyPilot in a venv of its own."""
    python = sky_python()
    if python is None:
        pytest.skip(f"SkyPilot is not installed: `{SKY_INSTALL_HINT}` installs it (or set CORAL_SKY_PYTHON)")
    plan = sample_plan()
    plan.instances.append(one_config_pipeline())
    files = [str(p) for p in render(plan, "skypilot", tmp_path).files if p.name.endswith(".sky.yaml")]
    assert len(files) == 4
    out = subprocess.run([python, str(SKY_CHECK), *files], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    bad = yaml.safe_load(Path(files[0]).read_text())
    del bad["service"]["ports"]  # what rendering wrote before: sky serve up refuses it
    (tmp_path / "bad.sky.yaml").write_text(yaml.safe_dump(bad))
    out = subprocess.run([python, str(SKY_CHECK), str(tmp_path / "bad.sky.yaml")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and "service.ports" in out.stdout


def test_commands_target_writes_one_script_per_node(tmp_path):
    res = render(sample_plan(), "commands", tmp_path)
    names = {p.name for p in res.files}
    assert {"qwen3-32b-prefill-t3-aws-us-east-2-0.rank0.sh", "qwen3-32b-prefill-t3-aws-us-east-2-0.rank1.sh"} <= names
    assert {"qwen3-32b-decode-t4-aws-us-east-2-0.replica0.sh", "qwen3-32b-decode-t4-aws-us-east-2-0.replica1.sh"} <= names
    assert len(res.files) == 1 + 2 + 2 + 2 + 1  # phi prefill, phi decode x2, qwen prefill ranks, qwen decode replicas,
    # and the gateway's script
    rank1 = (tmp_path / "qwen3-32b-prefill-t3-aws-us-east-2-0.rank1.sh").read_text()
    assert rank1.count("vllm serve") == 1 and "--node-rank 1" in rank1
    assert ': "${CORAL_HEAD_ADDR:?' in rank1 and "exec vllm serve" in rank1
    for p in res.files:
        subprocess.run(["bash", "-n", str(p)], check=True)  # valid shell
    name = dns_name("A" * 80, "b.c")
    assert len(name) <= 50 and name == name.lower() and "." not in name


def test_deploy_cli(tmp_path):
    """A plan of which one instance cannot be launched (a 300 tok/s decode pipeline): refused by default, writing
    nothing; deployed without it, with a warning naming the capacity lost, with --no-strict."""
    plan_path = sample_plan().save(tmp_path / "plan.json")
    out = tmp_path / "k8s"
    r = CliRunner().invoke(app, ["deploy", "--engine", "vllm", "--plan", str(plan_path), "--target", "kubernetes", "--out", str(out)])
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and not out.exists()
    assert "--strict (the default): 1 instance(s) cannot be rendered (qwen3-32b/decode loses 300 tok/s)" in text
    assert "nothing was written (--no-strict deploys the rest)" in text
    r = CliRunner().invoke(
        app, ["deploy", "--engine", "vllm", "--plan", str(plan_path), "--target", "kubernetes", "--out", str(out), "--no-strict"]
    )
    assert r.exit_code == 0, r.output
    assert (out / "index.json").exists() and "cannot launch" in r.output and "capacity is reduced" in r.output
    r = CliRunner().invoke(
        app, ["deploy", "--engine", "vllm", "--plan", str(plan_path), "--target", "kubernetes", "--out", str(tmp_path / "s"), "--strict"]
    )
    assert r.exit_code != 0 and not (tmp_path / "s").exists()
    r = CliRunner().invoke(
        app, ["deploy", "--engine", "vllm", "--plan", str(tmp_path / "nope.json"), "--target", "kubernetes", "--out", str(out)]
    )
    assert r.exit_code == 2


@pytest.mark.parametrize("target", [["--target", "commands"],
                                    ["--target", "kuberay", "--engine", "coral", "--checkpoint", "/ckpt"]])
def test_a_plan_without_instances_is_refused(tmp_path, target):
    path = make_plan([], scenario="core").save(tmp_path / "plan.json")
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["deploy", "--engine", "vllm", "--plan", str(path), *target, "--out", str(out)])
    assert r.exit_code == 2 and "nothing to deploy" in r.output and not out.exists()
    with pytest.raises(CoralInputError, match="instances: the plan has none"):
        render(make_plan([], scenario="core"), "commands", out)


def test_deploy_fails_and_writes_nothing_when_a_phase_is_left_uncovered(tmp_path):
    plan = make_plan(
        [
            make_instance("phi-4", "prefill", [(40, ["1xL40S"])], 5000.0, template_id=1),
            make_instance("phi-4", "decode", [(20, ["1xL4"]), (20, ["1xL4"])], 800.0, template_id=2),
        ],
        scenario="core",
    )
    plan_path = plan.save(tmp_path / "plan.json")
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["deploy", "--engine", "vllm", "--plan", str(plan_path), "--target", "commands", "--out", str(out)])
    assert r.exit_code != 0
    text = " ".join(r.output.split())
    assert "phi-4/decode" in text and "`coral allocate core --target commands`" in text
    assert "core.cost.coral.commands.plan.json" in text
    assert not out.exists()


def _library(layouts):
    configs = sorted({c for _, _, st_ in layouts for _, nodes in st_ for c in nodes})
    temps = []
    for i, (model, phase, st_) in enumerate(layouts):
        counts: dict[str, int] = {}
        for _, nodes in st_:
            for c in nodes:
                counts[c] = counts.get(c, 0) + 1
        stages = tuple(Stage(n, tuple(nodes), tuple(1.0 for _ in nodes)) for n, nodes in st_)
        temps.append(Template(i, model, Phase(phase), 100, counts, stages, 1.0 + i))
    return TemplateLibrary.from_templates(configs, temps, {})


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["phi-4", "qwen3-32b"]),
            st.sampled_from(["prefill", "decode"]),
            st.lists(
                st.tuples(st.integers(1, 10), st.lists(st.sampled_from(["1xL4", "2xL4", "4xL40S", "4xL4", "8xA10G"]),
                                                       min_size=1, max_size=2)),
                min_size=1, max_size=3,
            ),
        ),
        min_size=1, max_size=12,
    )
)
def test_vllm_engine_library_keeps_exactly_the_realisable_templates(layouts):
    """The library filter and the deploy stage's per-instance refusals are the same rule: for stock vLLM, and
    for each deploy target (a plan made with `--target` is never refused by `coral deploy --target`)."""
    lib = _library(layouts)
    sub = engine_library(lib, "vllm", CAT)
    want = [i for i in range(len(lib)) if realisable(lib.template(i), CAT.model(str(lib.model[i])))]
    assert sorted(sub.throughput.tolist()) == sorted(lib.throughput[want].tolist())
    assert tuple(DEPLOY_TARGETS) == TARGETS  # the renderers' targets are the ones the rules name
    for target in DEPLOY_TARGETS:
        sub = engine_library(lib, "vllm", CAT, target)
        want = [i for i in range(len(lib)) if launchable(lib.template(i), CAT.model(str(lib.model[i])), target)]
        assert sorted(sub.throughput.tolist()) == sorted(lib.throughput[want].tolist())
    assert engine_library(lib, "coral", CAT) is lib
    with pytest.raises(CoralInputError, match="--engine"):
        engine_library(lib, "sglang", CAT)
    with pytest.raises(CoralInputError, match="--target"):
        engine_library(lib, "vllm", CAT, "slurm")


def test_mixed_data_parallel_stage_gives_one_replica_set_per_config(tmp_path):
    inst = make_instance("phi-4", "decode", [(40, ["1xL40S", "1xL4", "1xL4"])], 900.0, template_id=8)
    res = render(make_plan([inst]), "kubernetes", tmp_path)
    reps = {}
    for path in res.files:
        for doc in yaml.safe_load_all(path.read_text()):
            validate_manifest(doc, path.name)
            if doc["kind"] == "Deployment" and "coral.io/phase" in doc["metadata"]["labels"]:  # an engine's
                reps[doc["metadata"]["name"]] = doc["spec"]["replicas"]
    assert reps == {"phi-4-decode-t8-aws-us-east-2-1xl4": 2, "phi-4-decode-t8-aws-us-east-2-1xl40s": 1}


def test_endpoints_file_carries_request_classes(tmp_path):
    """A plan with classes: the replica set of both phi-4 decode instances (800 tok/s each, 500 of class q1 and 300
    of q2) gets class weights 1000 / 600, the file the plan's classes, and a gateway built from the file both."""
    from coral.allocation.plan import PlanClass
    from coral.cli.runtime import static_registry

    plan = sample_plan()
    shares = {"q1": 500.0, "q2": 300.0}
    classes = [PlanClass(name="q1", share=0.5, mean_input_tokens=100, mean_output_tokens=50, max_input_tokens=200),
               PlanClass(name="q2", share=0.5, mean_input_tokens=900, mean_output_tokens=50)]
    plan = plan.model_copy(update={"request_classes": {"phi-4": classes}, "instances": [
        i.model_copy(update={"class_throughput": shares}) if i.model == "phi-4" and i.phase == "decode" else i
        for i in plan.instances]})
    render(plan, "kubernetes", tmp_path)
    spec = EndpointsFile.load(tmp_path / "endpoints.json")
    eps = {e.id: e for e in spec.endpoints}
    assert eps["phi-4-decode-t2-aws-us-east-2"].class_weights == pytest.approx({"q1": 1000.0, "q2": 600.0})
    assert eps["phi-4-prefill-t1-aws-us-east-2"].class_weights is None
    assert [c.name for c in spec.request_classes["phi-4"]] == ["q1", "q2"]
    registry = static_registry(spec)
    assert registry.class_of("phi-4", 150) == "q1" and registry.class_of("phi-4", 5000) == "q2"
    assert registry.get("phi-4-decode-t2-aws-us-east-2").weight_for("q2") == pytest.approx(600.0)


INJECTIONS = ["x\ntouch /tmp/pwned #", "a b", "$(id)", "a;b", "`id`", "it's", "a|b", "-rf", "x" * 129, ""]


@pytest.mark.parametrize("value", INJECTIONS)
@pytest.mark.parametrize("field", ["id", "model", "region", "node"])
def test_unsafe_ids_and_names_are_refused_by_the_plan_schema(tmp_path, field, value):
    doc = sample_plan().model_dump(mode="json")
    inst = doc["instances"][0]
    if field == "node":
        inst["stages"][0]["nodes"][0] = value
    else:
        inst[field] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["deploy", "--engine", "vllm", "--plan", str(path), "--target", "commands", "--out", str(out)])
    assert r.exit_code == 2, r.output
    assert "String should match pattern" in r.output and not out.exists()


def test_command_scripts_quote_every_word(tmp_path):
    plan = make_plan([make_instance("phi-4", "decode", [(40, ["1xL40S"])], 800.0, template_id=2)], scenario="core")
    plan.instances[0].id = "phi-4.decode:t2+x_0"
    res = render(plan, "commands", tmp_path)
    (script,) = [p for p in res.files if p.name != "gateway.sh"]
    line = script.read_text().splitlines()[-1]
    (launch,) = launch_commands(plan.instances[0], PHI)
    words = shlex.split(line)
    assert words[words.index("exec") + 1:] == launch.argv


def _bad_plans():
    def plan_with(**changes):
        doc = sample_plan().model_dump(mode="json")
        inst = doc["instances"][changes.pop("k", 0)]
        for path, value in changes.items():
            *head, last = path.split("__")
            obj = inst
            for p in head:
                obj = obj[int(p)] if p.isdigit() else obj[p]
            obj[int(last) if last.isdigit() else last] = value
        return doc

    dup = sample_plan().model_dump(mode="json")
    dup["instances"][2]["id"] = dup["instances"][1]["id"]
    return [
        (plan_with(region="gcp-us-central1"), "no offering of 1xL40S in region 'gcp-us-central1'"),
        (plan_with(stages__0__nodes=["3xL40S"], counts={"3xL40S": 1}), "must look like"),
        (plan_with(stages__0__nodes=["1xNOPE"], counts={"1xNOPE": 1}), "unknown GPU 'NOPE'"),
        (plan_with(stages__0__node_throughput=[]), "node_throughput: 0 values for 1 nodes"),
        (plan_with(stages__0__layers=39), "cover 39 layers, phi-4 has 40"),
        (plan_with(k=3, stages__1__first_layer=31), "first_layer: 31, expected 30"),
        (plan_with(counts={"1xL40S": 2}), "counts"),
        (plan_with(model="no-such-model"), "unknown model 'no-such-model'"),
        (dup, "appears 2 times"),
    ]


@pytest.mark.parametrize(("doc", "why"), _bad_plans())
@pytest.mark.parametrize("target", ["commands", "kubernetes"])
def test_deploy_checks_the_whole_plan_and_writes_nothing(tmp_path, doc, why, target):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["deploy", "--engine", "vllm", "--plan", str(path), "--target", target, "--out", str(out)])
    assert r.exit_code == 2, r.output
    assert why in " ".join(r.output.split()) and "nothing was written" in r.output
    assert not out.exists() and "Traceback" not in r.output


def test_a_failure_mid_render_leaves_the_out_folder_as_it_was(tmp_path, monkeypatch):
    import coral.deploy.render as render_mod

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    calls = []

    def failing(inst, launch):
        calls.append(inst.id)
        if len(calls) == 3:
            raise RuntimeError("disk full")
        return "#!/bin/sh\n"

    monkeypatch.setattr(render_mod, "node_script", failing)
    with pytest.raises(RuntimeError):
        render(sample_plan(), "commands", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folder left behind
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    monkeypatch.undo()
    res = render(sample_plan(), "commands", out)
    assert {p.name for p in out.iterdir()} == {"keep.txt", "index.json", "endpoints.template.json",
                                               *(p.name for p in res.files)}


@pytest.fixture(scope="module")
def core_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from coral.templates.store import load_library

    out = tmp_path_factory.mktemp("out")
    load_library("core", out)
    return out


@pytest.mark.parametrize("target", list(DEPLOY_TARGETS))
def test_a_plan_made_for_a_target_deploys_whole(core_out, tmp_path, target):
    """README's deploy path: `coral allocate core --target T` writes core.cost.coral.T.plan.json, recording T;
    `coral deploy` of it on T skips nothing. The plan made without a target is refused or cut on SkyPilot (its
    qwen3-32b prefill pipelines mix node configs), with advice naming the command that plans for it."""
    from coral.allocation.plan import Plan

    runner = CliRunner()
    r = runner.invoke(app, ["allocate", "core", "--out", str(core_out), "--target", target])
    assert r.exit_code == 0, r.output
    path = core_out / f"core.cost.coral.{target}.plan.json"
    plan = Plan.load(path)
    assert (plan.engine, plan.target) == ("vllm", target)
    r = runner.invoke(app, ["deploy", "--engine", "vllm", "--plan", str(path), "--target", target, "--out", str(tmp_path / "d"),
                            "--strict"])
    assert r.exit_code == 0, r.output
    index = json.loads((tmp_path / "d" / "index.json").read_text())
    assert index["skipped"] == {} and index["uncovered"] == [] and index["files"]
    (gateway,) = index["endpoints"]["gateways"]  # one endpoint for clients, in front of every engine
    assert gateway["name"] == "coral-core-gateway" and set(gateway["files"]) <= set(index["files"])
    assert {(e.model, e.phase) for e in EndpointsFile.load(tmp_path / "d" / (index["endpoints"]["template"] or
            "endpoints.json")).endpoints} == {(i.model, i.phase) for i in plan.instances}
    if target == "kubernetes":
        for f in index["files"]:
            for doc in yaml.safe_load_all((tmp_path / "d" / f).read_text()):
                validate_manifest(doc, f)
    if target == "skypilot":  # the endpoints name the gateway and every engine service
        services = {f.removesuffix(".sky.yaml") for f in index["files"] if f.endswith(".sky.yaml")}
        assert set(index["endpoints"]["engines"]) == services and len(services) > 1
        python = sky_python()
        if python is not None:
            files = [str(tmp_path / "d" / f) for f in index["files"] if f.endswith((".sky.yaml", ".gateway.yaml"))]
            check = subprocess.run([python, str(SKY_CHECK), *files], capture_output=True, text=True, timeout=120)
            assert check.returncode == 0, check.stdout + check.stderr
        r = runner.invoke(app, ["allocate", "core", "--out", str(core_out)])
        assert r.exit_code == 0, r.output
        r = runner.invoke(app, ["deploy", "--engine", "vllm", "--plan", str(core_out / "core.cost.coral.plan.json"), "--target", target,
                                "--out", str(tmp_path / "s"), "--strict"])
        text = " ".join(r.output.split())
        assert r.exit_code == 2 and "`coral allocate core --target skypilot`" in text and "--engine" not in text


def test_advice_never_repeats_the_flags_of_a_plan_made_for_the_target(tmp_path):
    """A plan recording --target skypilot that holds what SkyPilot cannot launch was changed after planning:
    the advice says so instead of proposing the command that made it as a fix."""
    plan = make_plan([hetero_pipeline()], scenario="core").model_copy(update={"engine": "vllm", "target": "skypilot"})
    path = plan.save(tmp_path / "plan.json")
    r = CliRunner().invoke(app, ["deploy", "--engine", "vllm", "--plan", str(path), "--target", "skypilot", "--out", str(tmp_path / "o")])
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and "changed after planning" in text and "Plan for this target" not in text
    mode_method = plan.model_copy(update={"target": None, "mode": "goodput", "method": "homo-ilp"})
    r = CliRunner().invoke(app, ["deploy", "--engine", "vllm", "--plan", str(mode_method.save(tmp_path / "p2.json")), "--target",
                                 "skypilot", "--out", str(tmp_path / "o")])
    text = " ".join(r.output.split())
    assert "`coral allocate core --mode goodput --method homo-ilp --target skypilot`" in text
    assert "core.goodput.homo-ilp.skypilot.plan.json" in text
