"""`coral run`, the README's main job, end to end on the default scenario (shortened simulation)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from coral.allocation.plan import Plan
from coral.cli.main import app


def test_coral_run_writes_plans_simulation_and_report(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["run", "--out", str(tmp_path), "--duration", "600"])
    assert res.exit_code == 0, res.output
    folder = tmp_path / "run-core"
    summary = json.loads((folder / "summary.json").read_text())
    costs = summary["planned_cost_per_hour"]
    assert costs["coral"] <= costs["homo"] and costs["coral"] <= costs["cauchy"]
    assert summary["served_fraction"]["coral"] == 1.0
    plan = Plan.load(folder / "plan.coral.json")
    assert abs(sum(i.cost_per_hour for i in plan.instances) - plan.cost_per_hour) < 1e-6
    html = (folder / "report.html").read_text()
    assert "<html" in html and plan.scenario in html
    assert (folder / "sim.json").exists() and (folder / "latency_cdf.png").exists()
    assert (tmp_path / "core.templates.sqlite").exists()
