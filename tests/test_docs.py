"""The documentation: the guides' example commands run as written, the generated reference has an entry for every
CLI command, option and schema field, every command's help names its docs page, the results renderer renders what
the benchmarks write, and the README stays a guide (short, no history)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hooks() -> ModuleType:
    return _module(DOCS / "hooks.py", "coral_docs_hooks")


def _coral() -> list[str]:
    exe = Path(sys.executable).parent / "coral"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "coral.cli.main"]


def _sh(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """One command of a guide, run in `cwd` as a user would run it from the repository's root."""
    env = {**os.environ, "COLUMNS": "160", "PYTHONUNBUFFERED": "1"}
    cmd = [*_coral(), *args[1:]] if args[0] == "coral" else [sys.executable, *args[1:]] if args[0] == "python" else args
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of examples/ in a fresh directory, planned once with the scenario guide's `coral run` command."""
    work = tmp_path_factory.mktemp("docs-examples")
    shutil.copytree(ROOT / "examples", work / "examples")
    res = _sh(["coral", "run", "examples/my-scenario.yaml", "--baselines", "none"], work, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return work


# ----------------------------------------------------------------------------------------------------------------
# README


def test_readme_is_a_short_guide_without_history() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for word in ("this change", "stop ", "earlier version"):
        assert word not in text.lower(), word
    # the two quick-start commands, as they have always been
    assert "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && coral run\n" in text
    assert ('python3 -m venv .venv && . .venv/bin/activate && pip install "torch==2.13.0" && pip install -e '
            '".[dev,ray,deploy,engine]" && python -m pytest -q\n') in text
    for link in re.findall(r"\]\(((?:docs|examples)/[^)#]*)", text):  # every link into the docs is a file
        assert (ROOT / link).exists(), link
    assert (ROOT / "LICENSE").read_text().startswith(" " * 33 + "Apache License")


# ----------------------------------------------------------------------------------------------------------------
# generated reference


def _section(markdown: str, heading: str) -> str:
    """The text of `markdown` from the line `heading` to the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = markdown.splitlines()
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines))
                if lines[i].startswith("#") and len(lines[i]) - len(lines[i].lstrip("#")) <= level), len(lines))
    return "\n".join(lines[start:end])


def test_cli_reference_has_every_command_and_option(hooks: ModuleType) -> None:
    markdown = hooks.cli_reference()
    commands = list(hooks.walk_commands(hooks.cli_command()))
    assert len(commands) > 15
    for path, cmd in commands:
        heading = f"{'#' * min(len(path) + 1, 4)} `{' '.join(path)}`"
        assert heading in markdown.splitlines(), f"no entry for {' '.join(path)}"
        section = _section(markdown, heading)
        for param in cmd.params:
            names = [*getattr(param, "opts", []), *getattr(param, "secondary_opts", [])]
            if param.param_type_name == "argument":
                names = [(param.metavar or param.name).upper()]
            for name in names:
                assert f"`{name}`" in section, f"{' '.join(path)}: {name} is missing from the CLI reference"
        if cmd.help:
            first = " ".join(cmd.help.split())[:40]
            assert first in " ".join(section.split()), f"{' '.join(path)}: its help text is missing"


def test_every_command_help_ends_with_its_docs_page(hooks: ModuleType) -> None:
    from typer.testing import CliRunner

    from coral.cli.main import app

    for path, cmd in hooks.walk_commands(hooks.cli_command()):
        assert cmd.epilog and cmd.epilog.startswith("Docs: docs/"), f"{' '.join(path)} has no docs epilog"
        page = cmd.epilog.split()[1]
        assert (ROOT / page).is_file(), f"{' '.join(path)} names {page}, which does not exist"
    res = CliRunner().invoke(app, ["deploy", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    assert res.output.strip().splitlines()[-1].strip().startswith("Docs: docs/guides/deploy.md")


@pytest.mark.parametrize("kind", ["inputs", "outputs"])
def test_schema_references_have_every_field(hooks: ModuleType, kind: str) -> None:
    markdown = hooks.inputs_reference() if kind == "inputs" else hooks.outputs_reference()
    models = hooks.input_models() if kind == "inputs" else hooks.output_models()
    mode = "validation" if kind == "inputs" else "serialization"
    checked = 0
    for _title, _what, model in models:
        for name, fields in hooks.field_names(model, mode).items():
            section = _section(markdown, f"### `{name}`")
            for field in fields:
                assert f"| `{field}` |" in section, f"{kind}: {name}.{field} has no entry"
                checked += 1
    assert checked > 50


def test_summary_json_keys_are_all_described(hooks: ModuleType, workdir: Path) -> None:
    summary = json.loads((workdir / "out" / "run-my-scenario" / "summary.json").read_text())
    json_only = {"folder", "report", "current_plan"}
    assert set(summary) == set(hooks.SUMMARY_FIELDS) - json_only, \
        "summary.json's keys and docs/hooks.py SUMMARY_FIELDS differ: describe the new key there"
    for key in summary:
        assert f"| `{key}` |" in hooks.outputs_reference()


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="the docs extra is not installed")
def test_the_site_builds_strict(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "coral serve" in cli and "--backend" in cli


# ----------------------------------------------------------------------------------------------------------------
# the guides' examples, run as the guides say


def test_example_inputs_validate() -> None:
    import yaml

    from coral.catalog.loader import load_scenario
    from coral.catalog.schema import AvailabilitySchedule, MarketSnapshot, OfferingCatalog

    sc = load_scenario(str(ROOT / "examples" / "my-scenario.yaml"))
    assert sc.name == "my-scenario" == (ROOT / "examples" / "my-scenario.yaml").stem
    assert len(sc.models) == 2
    OfferingCatalog.model_validate(yaml.safe_load((ROOT / "examples" / "my-market.yaml").read_text()))
    MarketSnapshot.model_validate(yaml.safe_load((ROOT / "examples" / "my-market-update.yaml").read_text()))
    AvailabilitySchedule.model_validate(yaml.safe_load((ROOT / "examples" / "my-availability.yaml").read_text()))


def test_scenario_guide_commands(workdir: Path) -> None:
    plan = json.loads((workdir / "out" / "my-scenario.current.plan.json").read_text())
    assert plan["scenario"] == "my-scenario" and plan["instances"]
    assert all(v.startswith("pass") for v in plan["slo"]["verdict"].values()), plan["slo"]["verdict"]

    res = _sh(["coral", "allocate", "examples/my-scenario.yaml"], workdir)
    assert res.returncode == 0, res.stderr[-2000:]

    res = _sh(["python", "examples/logs_to_trace.py", "examples/traces/requests.jsonl", "examples/traces/my-trace.csv",
               "--model", "phi-4"], workdir)
    assert res.returncode == 0, res.stderr
    assert "request_rate:" in res.stdout and "mean_input_tokens:" in res.stdout
    assert (workdir / "examples/traces/my-trace.csv").read_text() == (ROOT / "examples/traces/my-trace.csv").read_text()

    res = _sh(["coral", "simulate", "examples/my-scenario.yaml", "--plan", "out/my-scenario.current.plan.json",
               "--trace", "phi-4=examples/traces/my-trace.csv", "--json"], workdir)
    assert res.returncode == 0, res.stderr[-2000:]


def test_market_and_plan_guide_commands(workdir: Path) -> None:
    res = _sh(["coral", "simulate", "examples/my-scenario.yaml", "--availability", "examples/my-availability.yaml"],
              workdir)
    assert res.returncode == 0, res.stderr[-2000:]
    res = _sh(["coral", "plan", "bom", "--scenario", "examples/my-scenario.yaml", "--format", "json"], workdir)
    assert res.returncode == 0, res.stderr[-2000:]
    plan = json.loads((workdir / "out" / "my-scenario.current.plan.json").read_text())
    bill = json.loads(res.stdout)
    assert bill["matches_plan"] and abs(bill["plan_cost_per_hour"] - plan["cost_per_hour"]) < 0.005
    res = _sh(["coral", "report", "--plan", "out/my-scenario.current.plan.json", "--sim",
               "out/run-my-scenario/report-inputs.json", "-o", "out/my-report.html", "-q"], workdir)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (workdir / "out" / "my-report.html").stat().st_size > 10_000


def test_deploy_guide_command(workdir: Path) -> None:
    res = _sh(["coral", "deploy", "--scenario", "examples/my-scenario.yaml", "--target", "kubernetes",
               "--checkpoint", "/models/ckpt", "--out", "deploy/k8s"], workdir)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "coral-my-scenario-gateway" in res.stdout + res.stderr
    assert (workdir / "deploy" / "k8s" / "index.json").exists()


def test_serve_guide_answers_curl_and_openai(workdir: Path) -> None:
    from coral.http_serving import free_port

    port = free_port()
    cmd = [*_coral(), "serve", "examples/my-scenario.yaml", "--backend", "emulated", "--port", str(port),
           "--interval", "3600"]
    proc = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "160"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                state = httpx.get(f"{base}/state", timeout=5).json()
                if state.get("instances") and all(i["state"] == "ready" for i in state["instances"]):
                    break
            except (httpx.HTTPError, ValueError):
                pass
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "coral serve never came up"
            time.sleep(0.3)
        ready = httpx.get(f"{base}/ready", timeout=10).status_code
        assert ready in (200, 404), ready  # readiness (404 only where the endpoint is not served yet)
        models = {m["id"] for m in httpx.get(f"{base}/v1/models", timeout=10).json()["data"]}
        assert models == {"phi-4", "llama-3-8b"}
        # the guide's curl request
        r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": "phi-4", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16})
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        assert body["choices"][0]["message"]["content"] and body["usage"]["completion_tokens"] == 16
        if importlib.util.find_spec("openai") is not None:  # the guide's openai client example
            from openai import OpenAI

            client = OpenAI(base_url=f"{base}/v1", api_key="unused-without-keys")
            text = "".join(c.choices[0].text for c in client.completions.create(
                model="llama-3-8b", prompt="Once upon a time", max_tokens=16, stream=True,
                stream_options={"include_usage": True}) if c.choices)
            assert text
    finally:
        proc.terminate()
        proc.wait(30)


# ----------------------------------------------------------------------------------------------------------------
# results pages


META = {"commit": "0123456789abcdef", "dirty": False, "date": "2026-12-07T08:00:00+00:00",
        "machine": {"host": "ci", "cpu": "Test CPU", "cores": 2, "memory_gb": 8.0, "gpus": None},
        "load_average": [1.5, 1.25, 1.0], "command": "equal_attainment.py --scenario core"}


def test_results_renderer_on_fixture_json(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        render = _module(ROOT / "benchmarks" / "render_results.py", "coral_render_results")
        console = _module(ROOT / "benchmarks" / "_console.py", "coral_bench_console")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    src = tmp_path / "out" / "benchmarks"
    src.mkdir(parents=True)
    row = {"scenario": "core", "setting": "best-gpu-4", "target": 0.9, "held_out": {"a": 0.918, "b": 0.95},
           "held_out_worst": {"a": 0.905, "b": 0.93}, "certified": {"a": 0.909, "b": 0.94}, "rounds": 79,
           "heterogeneous_instances": 10, "chosen_trial": "refined", "safety_net": None, "met_held_out": True}
    (src / "equal_attainment.json").write_text(json.dumps({"rows": [
        {**row, "method": "coral", "cost_per_hour": 91.66, "meta": META},
        {**row, "method": "homo-ilp", "cost_per_hour": 129.36, "meta": META},
        {**row, "method": "homo-greedy", "cost_per_hour": 150.0, "met_held_out": False}]}))
    (src / "simulator.json").write_text(console.stamped_json({"requests": 272637, "runs": [
        {"router": "wrr", "seconds": 6.6}, {"router": "lor", "seconds": 9.5}]}))
    exp = tmp_path / "out" / "experiments"
    exp.mkdir()
    (exp / "scarce-core.json").write_text(json.dumps({
        "name": "scarce-core", "title": "Scarce markets (core)", "columns": ["market", "coral $/h"],
        "rows": [{"market": "core-scarce", "coral $/h": 101.05}], "notes": ["a note"]}))
    data = tmp_path / "data"
    render.collect([src, exp], data)
    out = render.render_pages(data)
    equal = out["equal-attainment.md"]
    assert ("| core | best-gpu-4 | 90.0 % | coral | 91.66 | 1.000× | 90.9 % | 91.8 % | 90.5 % | 10 | 79 | refined | no "
            "| run 1 |") in equal
    assert "| homo-ilp | 129.4 | 1.411× |" in equal
    assert "homo-greedy (misses) | 150.0 | – |" in equal
    assert "commit 0123456789; 2026-12-07T08:00:00+00:00; machine: ci, Test CPU, 2 cores, 8.0 GB, no GPU; " \
           "load average (1 / 5 / 15 min): 1.5 / 1.25 / 1" in equal
    assert render.NOT_RECORDED in equal  # the row without meta, in a file without one
    assert "| core-scarce | 101.0 |" in out["experiments.md"] and "- a note" in out["experiments.md"]
    assert render.NOT_RECORDED in out["experiments.md"]
    bench = out["benchmarks.md"]
    assert "| `requests` | 272,637 |" in bench and "| lor | 9.500 |" in bench
    assert "load average (1 / 5 / 15 min):" in bench and render.NOT_RECORDED not in bench
    empty = render.render_pages(tmp_path / "nothing")
    assert "python benchmarks/equal_attainment.py" in empty["equal-attainment.md"]
    assert "No results are recorded" in empty["benchmarks.md"]
    # the committed pages are what the renderer makes of the committed JSON
    for name, text in render.render_pages(DOCS / "results" / "data").items():
        assert (DOCS / "results" / name).read_text() == text, f"docs/results/{name} is stale: run " \
            "python benchmarks/render_results.py --from"
