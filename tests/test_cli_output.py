"""What the `coral` command prints: a quick start, JSON for scripts, tables for people, and warnings that explain."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from coral.allocation.plan import Plan
from coral.catalog.loader import load_scenario
from coral.cli.main import app
from coral.templates.library import TemplateLibrary
from coral.templates.store import build_estimate_s, load_library

#: packages `import coral.cli.main` must not load (it runs for every command, `--help` and `--version` included).
HEAVY = ("torch", "matplotlib", "pandas", "aiohttp", "fastapi", "starlette", "uvicorn", "httpx", "numpy", "highspy",
         "scipy", "numba")

runner = CliRunner()


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("out")
    load_library("core", folder)
    return folder


@pytest.fixture(scope="module")
def plan_path(out: Path) -> Path:
    res = runner.invoke(app, ["allocate", "core", "--out", str(out), "--time-limit", "600"])
    assert res.exit_code == 0, res.output
    return out / "core.cost.coral.plan.json"


def test_importing_the_cli_loads_no_heavy_package() -> None:
    code = "import json, sys, coral.cli.main; print(json.dumps(sorted(sys.modules)))"
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           check=True).stdout))
    assert not {m for m in loaded if m.split(".")[0] in HEAVY}


def test_version_comes_from_the_package_metadata() -> None:
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.stdout.strip() == f"coral {version('coral')}"


def test_allocate_json_is_one_document_with_the_plan_summary(out: Path) -> None:
    res = runner.invoke(app, ["allocate", "core", "--out", str(out), "--time-limit", "600", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    plan = Plan.load(doc["plan_path"])
    assert (doc["scenario"], doc["mode"], doc["method"]) == ("core", "cost", "coral")
    assert doc["cost_per_hour"] == pytest.approx(plan.cost_per_hour, abs=1e-4)
    assert {(s["model"], s["phase"]) for s in doc["serving"]} == {(s.model, s.phase) for s in plan.serving}
    for s in doc["serving"]:
        assert s["capacity_tokens_s"] >= s["demand_tokens_s"] > 0 and s["served_fraction"] == pytest.approx(1.0)
        assert sum(s["instances"].values()) == len(plan.instances_of(s["model"], s["phase"]))
    assert doc["solve"]["status"] == "Optimal" and doc["solve"]["gap"] == 0.0
    assert doc["time_s"]["total"] >= doc["time_s"]["solver"] > 0
    assert "solver:" in res.stderr and "time:" in res.stderr and "┃" not in res.stdout


def test_experiment_json(out: Path) -> None:
    res = runner.invoke(app, ["experiment", "epochs", "core", "--out", str(out), "--time-limit", "600", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["name"] == "epochs-core" and len(doc["rows"]) == load_scenario("core").epochs
    assert set(doc["columns"]) == set(doc["rows"][0]) and all(Path(f).exists() for f in doc["files"])


def test_status_json(monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    state = {"plan": {"scenario": "core", "method": "coral", "cost_per_hour": 57.62, "instances": [{}, {}]},
             "instances": [{"id": "phi-4.decode.t2.aws-us-east-2.1", "model": "phi-4", "phase": "decode",
                            "state": "ready", "healthy": True, "inflight": 1, "served": 7, "target_share": 1.0,
                            "observed_share": 1.0, "url": "http://x"}],
             "actions": [{"seq": i, "kind": "start", "instance_id": "a", "status": "done", "detail": "",
                          "ts": 0.0} for i in range(12)],
             "last_error": None}

    def get(url: str, **_: Any) -> httpx.Response:
        return httpx.Response(200, json=state, request=httpx.Request("GET", url))

    monkeypatch.setattr(httpx, "get", get)
    res = runner.invoke(app, ["status", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["plan"] == {"scenario": "core", "method": "coral", "instances": 2, "cost_per_hour": 57.62}
    assert doc["instances"][0]["state"] == "ready" and "url" not in doc["instances"][0]
    assert len(doc["actions"]) == 10 and doc["last_error"] is None


def test_piped_tables_keep_names_whole_and_round_numbers(out: Path, plan_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    text = subprocess.run([sys.executable, "-m", "coral.cli.main", "allocate", "core", "--out", str(out),
                           "--time-limit", "600"], capture_output=True, text=True, env=env, check=True,
                          stdin=subprocess.DEVNULL).stdout
    rows = [line for line in text.splitlines() if line.startswith("│")]
    assert sum("│ gpt-oss-20b " in r for r in rows) == 2 and not any("gpt-oss-2 " in r for r in rows)
    solver = next(line for line in text.splitlines() if line.startswith("solver:"))
    assert re.search(r"objective [\d,]+\.\d\d, bound [\d,]+\.\d\d, gap 0 %", solver), solver
    assert not re.search(r"\de-\d", solver) and "cost_per_hour" not in text


def test_folding_table_leaves_out_optional_columns_when_narrow() -> None:
    from coral.report.terminal import FoldingTable

    table = FoldingTable(title="t")
    table.add_column("model", no_wrap=True)
    table.add_column("demand tok/s", justify="right")
    table.add_column("batch fill", justify="right", optional=True)
    table.add_row("gpt-oss-20b", "85,153", "26%")
    wide, narrow = (Console(width=w, record=True, file=io.StringIO()) for w in (120, 27))
    wide.print(table)
    narrow.print(table)
    assert "batch fill" in wide.export_text() and "left out" not in wide.export_text()
    shown = narrow.export_text()
    assert "gpt-oss-20b" in shown and "85,153" in shown and "26%" not in shown
    assert "left out for the terminal's width: batch fill" in " ".join(shown.split())
    assert [c.header for c in table.columns] == ["model", "demand tok/s", "batch fill"]  # the table is unchanged


def test_numbers_and_headers_for_people() -> None:
    from coral.report.terminal import cell, gap_text, header, human

    assert human(235.26690000000002) == "235.27" and human(1.13e-16) == "0" and human(3.0) == "3"
    assert human(0.012345) == "0.0123" and human(12345) == "12,345" and human(None) == "-" and human(True) == "yes"
    assert gap_text(1.13e-16) == "0 %" and gap_text(0.0123) == "1.2 %" and gap_text(None) == "-"
    assert header("cost_per_hour") == "$/h" and header("solve_s") == "solve s" and header("epoch") == "epoch"
    assert cell("min_served", 0.9731) == "97.3%" and cell("cost_per_hour", 57.6234) == "57.62"


def test_a_build_says_why_and_how_long_before_it_starts(out: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    cached = TemplateLibrary.load(out / "core.templates.sqlite")
    monkeypatch.setattr("coral.templates.build.build_library", lambda *_, **__: cached)
    load_library("core", tmp_path)
    said = capsys.readouterr().err
    assert re.search(r"building the template library of core \(\S+ is missing\); expected about \d+ s", said)
    stale = TemplateLibrary.load(tmp_path / "core.templates.sqlite")
    stale.meta["fingerprint"] = json.dumps({"format": "old"})
    stale.save(tmp_path / "core.templates.sqlite")
    load_library("core", tmp_path)
    assert "was built for other inputs (models, slos, configs, perf, n_max, rho, format changed)" in \
        capsys.readouterr().err
    core, extended = build_estimate_s(load_scenario("core"), 2), build_estimate_s(load_scenario("extended"), 2)
    assert 2 < core < 10 and 60 < extended < 200  # measured: about 4 s and 96 s on 2 cores (BUILD_REFERENCE)


def test_simulate_warns_when_the_trace_is_not_what_the_plan_was_made_for(out: Path, plan_path: Path) -> None:
    args = ["simulate", "core", "--plan", str(plan_path), "--duration", "60", "--out", str(out)]
    res = runner.invoke(app, [*args, "--trace", "gpt-oss-20b=azure-conversation", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    (warning,) = doc["trace_warnings"]
    assert warning.startswith("gpt-oss-20b:") and "mean output tokens" in warning and "vs 28 planned" in warning
    assert "warning:" in res.stderr and doc["runs"][0]["requests"] > 0
    quiet = runner.invoke(app, [*args, "--trace", "gpt-oss-20b=azure-code", "--json"])
    assert json.loads(quiet.stdout)["trace_warnings"] == []
    bad = runner.invoke(app, [*args, "--trace", "gpt-oss-20b=azure-chat"])
    assert bad.exit_code == 2 and "'azure-chat' is not a shipped trace" in bad.output
    assert "azure-code, azure-conversation, burstgpt" in bad.output


def test_simulate_says_why_requests_did_not_finish(out: Path, plan_path: Path, tmp_path: Path) -> None:
    plan = Plan.load(plan_path)
    plan.instances = [i for i in plan.instances if (i.model, i.phase) != ("gpt-oss-20b", "decode")]
    starved = plan.save(tmp_path / "starved.json")
    res = runner.invoke(app, ["simulate", "core", "--plan", str(starved), "--duration", "60", "--out",
                              str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    (why,) = json.loads(res.stdout)["runs"][0]["unfinished_reasons"]
    assert re.match(r"gpt-oss-20b: [\d,]+ of [\d,]+ requests did not finish: the plan's decode was sized for "
                    r"[\d,]+ tok/s \(capacity 0 tok/s\), the trace offers [\d,]+ tok/s", why), why


def test_run_search_status_names_the_round_and_the_request_set() -> None:
    from coral.cli.run import SearchStatus

    shown: list[str] = []

    class Status:
        def update(self, text: str) -> None:
            shown.append(text)

    printed = Console(file=io.StringIO())
    watch = SearchStatus("coral", Status(), printed, lambda plan, seed, share: {})  # type: ignore[arg-type]
    watch.show("round 1: $57.62/h, phi-4 92.4% - meets every target")
    fake = Plan.model_construct(cost_per_hour=57.62)
    watch(fake, 10, 1.0)
    assert shown[-1].startswith("coral round 2: simulating the $57.62/h plan on request set 10")
    watch.show("confirmed 3 parts of 4 looked at on 16 fresh windows; certifying the $57.62/h plan on 20 "
               "held-out windows")
    watch.many(fake, [1000, 1001], 0.02)
    assert shown[-1].startswith("coral certification: simulating the $57.62/h plan on 2 request sets")
    assert "(2% of each)" in shown[-1]
    assert "coral round 1: $57.62/h" in printed.file.getvalue()  # type: ignore[attr-defined]


def test_serve_defaults_to_the_core_scenario() -> None:
    import typer

    serve = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    assert next(p for p in serve.params if p.name == "scenario").default == "core"


def test_allocate_at_80_columns_keeps_every_template_string_whole(out: Path, plan_path: Path) -> None:
    from coral.cli.allocate import instance_groups

    env = {**os.environ, "COLUMNS": "80"}
    text = subprocess.run([sys.executable, "-m", "coral.cli.main", "allocate", "core", "--out", str(out),
                           "--time-limit", "600"], capture_output=True, text=True, env=env, check=True,
                          stdin=subprocess.DEVNULL).stdout
    plan = Plan.load(plan_path)
    names = [n for s in plan.serving for n in instance_groups(plan, s.model, s.phase)]
    lines = text.splitlines()
    assert names and all(any(n in line for line in lines) for n in names), text
    assert max(len(line) for line in lines) <= 80
    # detail columns go (in the order named), never the template strings; which ones depends on the plan's width
    said = " ".join(text.split())
    assert "left out for the terminal's width:" in said
    left = said.split("left out for the terminal's width:")[1]
    named = [c.strip() for c in left.split(";")[0].split(",")]
    assert "spare" in named and set(named) <= {"served", "demand tok/s", "capacity tok/s", "spare"}


def test_allocate_with_offerings_keeps_the_default_plan(out: Path, plan_path: Path, tmp_path: Path) -> None:
    from coral.catalog.loader import data_path
    from coral.cli.allocate import allocate_file_name

    market = tmp_path / "market.yaml"
    market.write_text(data_path("offerings.yaml").read_text())
    before = plan_path.read_bytes()
    res = runner.invoke(app, ["allocate", "core", "--out", str(out), "--time-limit", "600", "--offerings", str(market),
                              "--json"])
    assert res.exit_code == 0, res.output
    written = Path(json.loads(res.stdout)["plan_path"])
    assert written == out / "core.cost.coral.offerings-market.plan.json" and written.is_file()
    assert plan_path.read_bytes() == before
    assert allocate_file_name("core", "cost", "coral", "vllm", "skypilot", None) == "core.cost.coral.skypilot.plan.json"
    assert allocate_file_name("x/mine.yaml", "goodput", "homo-ilp", "vllm", None, Path("a/b.yaml")) == \
        "mine.goodput.homo-ilp.vllm.offerings-b.plan.json"


def test_simulate_keeps_each_plans_results_and_judges_each_model(out: Path, plan_path: Path, tmp_path: Path) -> None:
    from coral.report.view import plan_fingerprint

    plan = Plan.load(plan_path)
    plan.instances = [i for i in plan.instances if (i.model, i.phase) != ("gpt-oss-20b", "decode")]
    starved = plan.save(tmp_path / "starved.plan.json")
    targets = {m.model: m.slo_attainment for m in load_scenario("core").models}
    runs = {}
    for path in (plan_path, starved):
        res = runner.invoke(app, ["simulate", "core", "--plan", str(path), "--duration", "60", "--out", str(tmp_path),
                                  "--json"])
        assert res.exit_code == 0, res.output
        runs[path] = json.loads(res.stdout)["runs"][0]
    folders = {Path(r["folder"]) for r in runs.values()}
    assert len(folders) == 2 and all((f / "result.json").is_file() for f in folders)
    assert Path(runs[starved]["folder"]) == tmp_path / "sim" / f"core-starved-{plan_fingerprint(plan)[:8]}-wrr"
    for run in runs.values():
        assert {m["model"]: m["slo_target"] for m in run["models"]} == targets
        assert all(m["passed"] == (m["slo_attainment"] >= m["slo_target"]) for m in run["models"])
        assert run["all_passed"] == all(m["passed"] for m in run["models"])
    starving = {m["model"]: m for m in runs[starved]["models"]}["gpt-oss-20b"]
    assert starving["passed"] is False and runs[starved]["all_passed"] is False
    shown = runner.invoke(app, ["simulate", "core", "--plan", str(starved), "--duration", "60", "--out",
                                str(tmp_path)])
    lines = shown.stdout.splitlines()
    assert any("target" in line and "verdict" in line for line in lines)
    row = next(line for line in lines if line.startswith("│ gpt-oss-20b"))
    assert f"{targets['gpt-oss-20b']:.1%}" in row and "fail" in row
    assert any(line.startswith("│ all") and "1 fail" in line for line in lines)
    assert f"wrote to {runs[starved]['folder']}: result.json" in shown.stdout
