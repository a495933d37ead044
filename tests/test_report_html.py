"""The static HTML report (self-contained, data embedded safely), the CLI and the terminal tables."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from coral.cli.main import app
from coral.report import build_report, view_model
from coral.report.examples import example_baseline, example_inputs, example_plan
from coral.report.html import render_page
from coral.report.terminal import layout_text, print_inputs, print_plan, progress

DATA = re.compile(r'<script id="coral-data" type="application/json">(.*?)</script>', re.S)
CONFIG = re.compile(r'<script id="coral-config" type="application/json">(.*?)</script>', re.S)


def embedded(page: str, pattern: re.Pattern[str] = DATA) -> dict:
    match = pattern.search(page)
    assert match
    return json.loads(match.group(1))


def test_page_embeds_the_view_model_and_needs_no_network() -> None:
    plan, base, sim = example_plan(), example_baseline(), example_inputs()
    page = build_report(plan, baselines=[base], sim=sim)
    assert embedded(page) == view_model(plan, baselines=[base], sim=sim)
    assert embedded(page, CONFIG) == {}
    assert "{{" not in page
    # nothing is fetched: no external scripts, stylesheets, images or fonts
    assert not re.search(r"<(link|img|iframe)\b", page)
    assert not re.search(r"<script[^>]*\bsrc=", page)
    assert not re.search(r"url\(|@import", page)
    assert set(re.findall(r"https?://[^\s\"']+", page)) == {"http://www.w3.org/2000/svg"}


def test_hostile_names_cannot_break_out_of_the_data_script() -> None:
    evil = "</script><script>alert(1)</script><!--"
    plan = example_plan().model_copy(update={"scenario": evil})
    page = build_report(plan)
    assert evil not in page
    assert page.count("</script>") == 3
    assert embedded(page)["summary"]["scenario"] == evil
    assert "<title>Coral plan — &lt;/script&gt;" in page


def test_live_config_is_embedded() -> None:
    page = render_page(view_model(example_plan()), {"poll_url": "/dashboard/state.json", "interval_ms": 1500})
    assert embedded(page, CONFIG) == {"poll_url": "/dashboard/state.json", "interval_ms": 1500}


def test_cli_writes_the_report_from_files(tmp_path) -> None:
    plan_path = example_plan().save(tmp_path / "plan.json")
    base_path = example_baseline().save(tmp_path / "homo.json")
    sim_path = tmp_path / "sim.json"
    sim_path.write_text(example_inputs(n=30).model_dump_json())
    exp_path = tmp_path / "exp.yaml"
    exp_path.write_text("epochs:\n  - {epoch: 0, cost_per_hour: 40.0, goodput: 100, method: cauchy}\n")
    out = tmp_path / "r" / "report.html"
    result = CliRunner().invoke(
        app,
        ["report", "--plan", str(plan_path), "--baseline", str(base_path), "--sim", str(sim_path),
         "--experiment", str(exp_path), "--out", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    vm = embedded(out.read_text())
    assert vm["summary"]["cost_per_hour"] == pytest.approx(example_plan().cost_per_hour)
    assert [r["method"] for r in vm["comparison"]["rows"]] == ["coral", "homo"]
    assert [s["method"] for s in vm["epochs"]] == ["coral", "cauchy", "homo"]
    assert len(vm["latency"]) == 6
    assert "Comparison with baselines" in result.output and "$38.51/h" in result.output


def test_cli_errors_name_the_file_and_field(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # no current plan here (out/core.current.plan.json)
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps({"scenario": "core"}))
    result = CliRunner().invoke(app, ["report", "--plan", str(bad), "--out", str(tmp_path / "x.html")])
    assert result.exit_code == 2
    assert "plan.json" in result.output and "method" in result.output
    assert not (tmp_path / "x.html").exists()
    none = CliRunner().invoke(app, ["report", "--out", str(tmp_path / "x.html")])
    assert none.exit_code == 2 and "--plan: not given, and core has no current plan" in " ".join(none.output.split())


def test_cli_example(tmp_path) -> None:
    out = tmp_path / "ex.html"
    result = CliRunner().invoke(app, ["report", "--example", "--quiet", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert embedded(out.read_text())["summary"]["method"] == "coral"


def test_terminal_tables() -> None:
    console = Console(record=True, width=200)
    plan = example_plan()
    print_plan(plan, console)
    print_inputs(example_inputs(n=50), plan.method, console)
    text = console.export_text()
    het = next(i for i in plan.instances if i.model == "qwen3-32b" and i.phase == "prefill")
    assert layout_text(het) == "[1xL40S] L0-19 → [4xL4] L20-43 → [2×1xA10G] L44-63"
    assert layout_text(het) in text
    assert "$38.51/h" in text and "Latency against SLOs" in text and "Per epoch" in text


def test_progress_bar_counts() -> None:
    console = Console(record=True, width=100)
    with progress(console) as bar:
        task = bar.add_task("templates", total=3)
        for _ in range(3):
            bar.advance(task)
    assert bar.tasks[0].completed == 3
    assert "3/3" in console.export_text()


def test_cli_warns_when_the_simulation_belongs_to_another_plan(tmp_path: Path) -> None:
    from coral.report.inputs import ReportInputs
    from coral.report.view import plan_fingerprint

    plan_path = example_plan().save(tmp_path / "plan.json")
    sim = tmp_path / "inputs.json"
    sim.write_text(ReportInputs(plan_fingerprint=plan_fingerprint(example_baseline())).model_dump_json())
    result = CliRunner().invoke(app, ["report", "--plan", str(plan_path), "--sim", str(sim), "-o",
                                      str(tmp_path / "r.html"), "-q"])
    assert result.exit_code == 0, result.output
    assert "another plan" in result.output and "another plan" in (tmp_path / "r.html").read_text()
    sim.write_text(ReportInputs(plan_fingerprint=plan_fingerprint(example_plan())).model_dump_json())
    result = CliRunner().invoke(app, ["report", "--plan", str(plan_path), "--sim", str(sim), "-o",
                                      str(tmp_path / "r.html"), "-q"])
    assert "another plan" not in result.output
