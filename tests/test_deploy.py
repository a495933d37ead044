"""vLLM realisability and commands, and the SkyPilot / Kubernetes / commands renderers."""

from __future__ import annotations

import json
import shlex

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from coral.catalog.loader import CoralInputError, builtin_catalog
from coral.catalog.schema import ModelArch
from coral.cli.main import app
from coral.deploy.endpoints import EndpointsFile
from coral.deploy.render import dns_name, render
from coral.deploy.schemas import validate_manifest
from coral.deploy.vllm import KV_TRANSFER_CONFIG, launch_commands, realisable, vllm_compatible_filter
from coral.perf.model import Phase
from coral.runtime.handmade import make_instance, make_plan
from coral.templates.library import Stage, Template

CAT = builtin_catalog()
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
    ("stages", "ok", "why"),
    [
        ([(40, ["1xL40S"])], True, ""),
        ([(20, ["2xL4"]), (20, ["2xA10G"])], True, ""),  # mixed GPU types, equal TP
        ([(40, ["1xL40S", "1xL4"])], True, ""),  # one stage, two nodes: two independent replicas
        ([(20, ["1xL40S", "1xL40S"]), (20, ["1xL40S"])], False, "data-parallel"),
        ([(20, ["1xL40S"]), (20, ["2xL40S"])], False, "tensor-parallel"),
    ],
)
def test_realisable_golden(stages, ok, why):
    inst = make_instance("phi-4", "decode", stages, 100.0)
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
    assert not vllm_compatible_filter(dp.stages)


def test_launch_commands_golden_heterogeneous_pipeline():
    r0, r1 = launch_commands(hetero_pipeline(), QWEN)
    assert (r0.config, r1.config) == ("4xL4", "4xL40S")
    assert r0.env == r1.env == {"VLLM_PP_LAYER_PARTITION": "30,34"}
    assert r0.argv[:3] == ["vllm", "serve", "Qwen/Qwen3-32B"]
    for nl, rank in ((r0, "0"), (r1, "1")):
        a = nl.argv
        assert a[a.index("--tensor-parallel-size") + 1] == "4"
        assert a[a.index("--pipeline-parallel-size") + 1] == "2"
        assert a[a.index("--nnodes") + 1] == "2"
        assert a[a.index("--node-rank") + 1] == rank
        assert json.loads(a[a.index("--kv-transfer-config") + 1]) == KV_TRANSFER_CONFIG
    assert "--port" in r0.argv and "--headless" not in r0.argv
    assert "--headless" in r1.argv and "--port" not in r1.argv
    assert '--master-addr "$CORAL_HEAD_ADDR"' in r1.shell()
    assert shlex.split(r0.shell())[0] == "VLLM_PP_LAYER_PARTITION=30,34"


def test_launch_commands_single_node_and_ray():
    (one,) = launch_commands(
        make_instance("phi-4", "decode", [(40, ["2xL40S"])], 1.0), PHI, disaggregated=False
    )
    assert one.env == {} and "--kv-transfer-config" not in one.argv and "--nnodes" not in one.argv
    (ray,) = launch_commands(hetero_pipeline(), QWEN, executor="ray")
    assert ray.argv[-2:] == ["--distributed-executor-backend", "ray"]
    with pytest.raises(ValueError, match="data parallelism"):
        launch_commands(make_instance("phi-4", "decode", [(20, ["1xL4", "1xL4"]), (20, ["1xL4"])], 1.0), PHI)
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
    inst = make_instance("phi-4", "decode", stages, 1.0)
    arch = PHI.model_copy(update={"num_hidden_layers": sum(layers)})
    cmds = launch_commands(inst, arch)
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
    assert "data-parallel" in next(iter(res.skipped.values()))
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
    assert c["command"] + c["args"] == launch_commands(sample_plan().instances[0], PHI)[0].argv
    (rc,) = kinds["RayCluster"]
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]
    assert head["nodeSelector"]["node.kubernetes.io/instance-type"] == "g6.12xlarge"  # 4xL4 in us-east-2
    (wg,) = rc["spec"]["workerGroupSpecs"]
    assert (
        wg["replicas"],
        wg["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
    ) == (1, "4")
    (job,) = kinds["Job"]
    assert "VLLM_PP_LAYER_PARTITION=30,34" in job["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    assert len(kinds["Service"]) == 4
    eps = {e.id: e for e in EndpointsFile.load(tmp_path / "endpoints.json").endpoints}
    assert set(eps) == {d["metadata"]["name"] for d in kinds["Service"]}
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
    rc = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "Bad_Name"}, "spec": {}}
    with pytest.raises(CoralInputError, match=r"metadata\.name"):
        validate_manifest(rc)
    with pytest.raises(CoralInputError, match="kind"):
        validate_manifest({"kind": "Pod"})


def test_skypilot_services(tmp_path):
    res = render(sample_plan(), "skypilot", tmp_path)
    assert "multi-node" in res.skipped["qwen3-32b.prefill.t3.aws-us-east-2.0"]
    assert "data-parallel" in res.skipped["qwen3-32b.decode.t7.aws-us-east-2.0"]
    docs = {p.name: yaml.safe_load(p.read_text()) for p in res.files}
    svc = docs["phi-4-decode-t2-aws-us-east-2.sky.yaml"]
    assert svc["resources"] == {
        "cloud": "aws",
        "region": "us-east-2",
        "accelerators": "L40S:1",
        "instance_type": "g6e.xlarge",
        "ports": 8000,
    }
    assert svc["service"]["replicas"] == 2 and svc["service"]["readiness_probe"]["path"] == "/health"
    assert svc["run"].startswith("vllm serve microsoft/phi-4 ")


def test_skypilot_schema_when_installed(tmp_path):
    sky = pytest.importorskip("sky")
    from sky.serve import SkyServiceSpec

    for path in render(sample_plan(), "skypilot", tmp_path).files:
        cfg = yaml.safe_load(path.read_text())
        sky.Task.from_yaml_config({k: v for k, v in cfg.items() if k != "service"})
        SkyServiceSpec.from_yaml_config(cfg["service"])


def test_commands_target_and_dns_names(tmp_path):
    res = render(sample_plan(), "commands", tmp_path)
    text = (tmp_path / "qwen3-32b-prefill-t3-aws-us-east-2-0.sh").read_text()
    assert text.count("vllm serve") == 2 and "--node-rank 1" in text
    assert len(res.files) == 5
    dp = (tmp_path / "qwen3-32b-decode-t4-aws-us-east-2-0.sh").read_text()
    assert dp.count("vllm serve") == 2 and "replica 1" in dp
    name = dns_name("A" * 80, "b.c")
    assert len(name) <= 50 and name == name.lower() and "." not in name


def test_deploy_cli(tmp_path):
    plan_path = sample_plan().save(tmp_path / "plan.json")
    out = tmp_path / "k8s"
    r = CliRunner().invoke(
        app, ["deploy", "--plan", str(plan_path), "--target", "kubernetes", "--out", str(out)]
    )
    assert r.exit_code == 0, r.output
    assert (out / "index.json").exists() and "skipped" in r.output
    r = CliRunner().invoke(
        app, ["deploy", "--plan", str(tmp_path / "nope.json"), "--target", "kubernetes", "--out", str(out)]
    )
    assert r.exit_code == 2


def test_mixed_data_parallel_stage_gives_one_replica_set_per_config(tmp_path):
    inst = make_instance("phi-4", "decode", [(40, ["1xL40S", "1xL4", "1xL4"])], 900.0, template_id=8)
    res = render(make_plan([inst]), "kubernetes", tmp_path)
    reps = {}
    for path in res.files:
        for doc in yaml.safe_load_all(path.read_text()):
            validate_manifest(doc, path.name)
            if doc["kind"] == "Deployment":
                reps[doc["metadata"]["name"]] = doc["spec"]["replicas"]
    assert reps == {"phi-4-decode-t8-aws-us-east-2-1xl4": 2, "phi-4-decode-t8-aws-us-east-2-1xl40s": 1}
