"""No string a plan carries can run a command or inject YAML through `coral deploy`: a plan whose every free-text
field holds shell and YAML payloads is rendered for every target of both engines; every YAML file must parse with
the safe loader, and every script a target would run (SkyPilot `run`/`setup`, a container's `bash -c` script, the
per-node scripts) is run by bash against stub executables without the payload's command ever running."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from coral.allocation.plan import ModelServing, Plan, PlanClass, SloCheck, SolveReport
from coral.catalog.loader import CoralInputError, load_scenario
from coral.catalog.schema import Scenario, shown
from coral.deploy.coral_engine import CORAL_TARGETS
from coral.deploy.endpoints import EndpointsFile
from coral.deploy.render import TARGETS, render
from coral.runtime.handmade import make_instance, make_plan

MARK = "MARK"
PAYLOADS = [
    f"$(touch {MARK})",
    f"`touch {MARK}`",
    f"x; touch {MARK}",
    f"x' ; touch {MARK} ; '",
    f'x" ; touch {MARK} ; "',
    f"x\ntouch {MARK}\n",
    f"core$(touch${{IFS}}{MARK})",
    f"$CORAL_HEAD_ADDR$(touch {MARK})",  # one of our own variables, then a command
    f"\\$(touch {MARK})",  # a backslash before the dollar
    f"&anchor !!python/object/apply:os.system ['touch {MARK}']",
    "*anchor",
    "$(HF_TOKEN)",  # what the kubelet would expand in a container's args
]
STUBS = ("python", "python3", "coral", "ray", "sky", "vllm", "hostname", "nvidia-smi")
KUBELET_VARS = {"POD_IP", "CORAL_NODE_ADDR", "CORAL_HEAD_ADDR"}  # the variables our containers define
RENDERS = [("vllm", t) for t in TARGETS] + [("coral", t) for t in CORAL_TARGETS]


def payload_plan(text: str) -> Plan:
    """Single-stage instances (one over two configs), a two-config pipeline and a one-config pipeline, with `text`
    in every free-text field of the plan (escaped where a field takes printable text only: class names)."""
    insts = [
        make_instance("phi-4", "prefill", [(40, ["1xL40S"])], 5000.0, template_id=1),
        make_instance("phi-4", "decode", [(40, ["1xL40S", "1xL4"])], 800.0, template_id=2),
        make_instance("qwen3-32b", "prefill", [(30, ["4xL4"]), (34, ["4xL40S"])], 900.0, template_id=3),
        make_instance("qwen3-32b", "prefill", [(32, ["1xL4"]), (32, ["1xL4"])], 300.0, template_id=4),
        make_instance("qwen3-32b", "decode", [(64, ["1xL40S"])], 700.0, template_id=5),
    ]
    label = shown(text)  # class names are printable labels (the schema refuses line breaks there)
    insts[0].class_throughput = {label: 5000.0}
    plan = make_plan(insts, scenario=text)
    plan.method = text
    plan.created_at = text
    plan.request_classes = {"phi-4": [PlanClass(name=label, share=1.0, mean_input_tokens=100, mean_output_tokens=10)]}
    plan.serving = [ModelServing(model=text, phase="prefill", demand=1, capacity=1, served_fraction=1,
                                 cost_per_hour=1)]
    plan.solve = SolveReport(status=text, notes=[text], safety_net=text)
    plan.slo = SloCheck(target={text: 0.9}, tuned={text: 0.9}, duration_s=60, verdict={text: text}, notes=[text],
                        safety_net=text)
    return Plan.model_validate(plan.model_dump())  # every field as the schema lets it through


def containers(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every container of a Deployment or a RayCluster (head and worker groups)."""
    spec = doc.get("spec", {})
    templates = [spec.get("template")]
    templates += [spec.get("headGroupSpec", {}).get("template")]
    templates += [g.get("template") for g in spec.get("workerGroupSpecs", [])]
    for t in templates:
        if t:
            yield from t["spec"]["containers"]


def bash_script(argv: list[str]) -> str | None:
    """The script of a `bash -c` command line (None for any other command, or none: the image's own)."""
    if not argv or Path(argv[0]).name not in ("bash", "sh") or "-c" not in argv:
        return None
    rest = [a for a in argv[argv.index("-c") + 1:] if a != "--"]
    return rest[0]


def scripts(out: Path) -> Iterator[tuple[str, str, dict[str, str]]]:
    """(where, script, environment) of everything the rendered files would run through a shell."""
    for path in sorted(out.iterdir()):
        if path.suffix == ".sh":
            yield path.name, path.read_text(), {}
        elif path.name.endswith((".sky.yaml", ".gateway.yaml")):  # SkyPilot: engines, gateway
            task = yaml.safe_load(path.read_text())
            for rank in range(task.get("num_nodes", 1)):
                env = {"SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2"}
                for key in ("setup", "run"):
                    if task.get(key):
                        yield f"{path.name} {key} rank {rank}", task[key], env
        elif path.name.endswith(".k8s.yaml"):
            for doc in yaml.safe_load_all(path.read_text()):
                for c in containers(doc):
                    script = bash_script([kubelet(a) for a in [*c.get("command", []), *c.get("args", [])]])
                    if script is not None:
                        yield f"{path.name} {c['name']}", script, {"KUBERAY_GEN_RAY_START_CMD": "true"}


def stub_path(folder: Path) -> str:
    """A PATH whose `STUBS` exit 0 at once, in front of the system's own tools (`touch` among them)."""
    folder.mkdir()
    for name in STUBS:
        (folder / name).write_text("#!/bin/sh\nexit 0\n")
        (folder / name).chmod(0o755)
    return f"{folder}:/usr/bin:/bin"


_KUBELET = re.compile(r"\$\$|\$\((\w+)\)")


def kubelet(value: str) -> str:
    """`value` of a container's `command` or `args` as the kubelet hands it on: `$$` is a dollar and `$(NAME)` a
    variable of the container (it defines none that these tests need)."""
    return _KUBELET.sub(lambda m: "$" if m.group(0) == "$$" else m.group(0), value)


def kubelet_refs(value: str) -> set[str]:
    """Variables the kubelet expands in `value`."""
    return {m.group(1) for m in _KUBELET.finditer(value) if m.group(1)}


@pytest.mark.parametrize("payload", PAYLOADS)
def test_no_plan_string_runs_or_injects(tmp_path: Path, payload: str) -> None:
    plan = payload_plan(payload)
    path = stub_path(tmp_path / "bin")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    ran = 0
    for engine, target in RENDERS:
        out = tmp_path / f"{engine}-{target}"
        render(plan, target, out, engine=engine, checkpoint="/ckpt" if engine == "coral" else None)
        assert json.loads((out / "index.json").read_text())["scenario"] == payload
        for f in out.iterdir():
            if f.suffix == ".yaml":
                for doc in yaml.safe_load_all(f.read_text()):  # the safe loader refuses any tag it does not know
                    if doc.get("kind") == "ConfigMap" and "plan.json" in doc["data"]:
                        assert Plan.model_validate_json(doc["data"]["plan.json"]) == plan
                    elif doc.get("kind") == "ConfigMap":  # the gateway's: the plan's classes as they are
                        spec = EndpointsFile.model_validate_json(doc["data"]["endpoints.json"])
                        assert [c.name for c in spec.request_classes["phi-4"]] == [shown(payload)]
                    for c in containers(doc):
                        values = c.get("args", []) + [e["value"] for e in c.get("env", []) if "value" in e]
                        assert all(kubelet_refs(v) <= KUBELET_VARS for v in values), (f.name, values)
        for where, script, env in scripts(out):
            ran += 1
            run_env = {"PATH": path, "HOME": str(tmp_path), "CORAL_HEAD_ADDR": "10.0.0.1",
                       "CORAL_SCHEDULER_ADDR": "10.0.0.2", **env}
            subprocess.run(["bash", "-c", script], cwd=cwd, env=run_env, capture_output=True, timeout=60)
            assert not list(tmp_path.rglob(MARK)), f"{engine}/{target}: {where} ran the payload"
    assert ran >= 20  # every target wrote scripts: per node, per SkyPilot rank, the KubeRay head


def test_the_kuberay_head_serves_the_scenario_by_its_literal_name(tmp_path: Path) -> None:
    payload = PAYLOADS[6]
    res = render(payload_plan(payload), "kuberay", tmp_path, engine="coral", checkpoint="/ckpt")
    (cluster,) = [d for d in yaml.safe_load_all(res.files[0].read_text()) if d["kind"] == "RayCluster"]
    head = next(containers(cluster))
    script = bash_script([kubelet(a) for a in head["command"] + head["args"]])
    assert script is not None
    (serve,) = [w for w in (shlex.split(line) for line in script.splitlines()) if w[:2] == ["coral", "serve"]]
    assert serve[2] == payload


@pytest.mark.parametrize("name", [*PAYLOADS, "a b", "-rf", "x" * 129, ""])
def test_a_scenario_name_must_be_a_safe_name(tmp_path: Path, name: str) -> None:
    doc = load_scenario("core").model_dump(mode="json")
    doc["name"] = name
    with pytest.raises(ValidationError, match="name"):
        Scenario.model_validate(doc)
    path = tmp_path / "evil.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(CoralInputError, match="name: String should match pattern"):
        load_scenario(path)


def test_the_stubs_stand_in_for_the_commands(tmp_path: Path) -> None:
    """The check above can see a payload run: an unquoted one does."""
    path = stub_path(tmp_path / "bin")
    subprocess.run(["bash", "-c", f"coral serve {PAYLOADS[6]}"], cwd=tmp_path, env={**os.environ, "PATH": path},
                   timeout=60)
    assert (tmp_path / MARK).exists()
