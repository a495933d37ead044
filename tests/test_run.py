"""`coral run`, the README's main job, end to end on the default scenario (shortened simulation)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coral.allocation.plan import Plan
from coral.cli.main import app
from coral.report.adapters import load_inputs
from coral.report.view import plan_fingerprint, view_model
from coral.simulation.metrics import SimResult


def test_coral_run_writes_plans_simulation_and_report(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["run", "--out", str(tmp_path), "--duration", "600", "--rounds", "4",
                                       "--allow-miss"])
    assert res.exit_code == 0, res.output
    folder = tmp_path / "run-core"
    summary = json.loads((folder / "summary.json").read_text())
    costs = summary["planned_cost_per_hour"]
    assert set(costs) == {"coral", "homo-greedy", "cauchy-paper"}
    # every method's plan was searched and scored against the targets on held-out requests, with a verdict
    plan = Plan.load(folder / "plan.cost.coral.json")
    assert plan.slo is not None and plan.slo.target == {m: 0.9 for m in ("phi-4", "gpt-oss-20b", "qwen3-32b")}
    assert plan.slo.held_out_seeds and set(plan.slo.verdict) == set(plan.slo.target)
    assert all(v.startswith(("pass", "fail")) for v in plan.slo.verdict.values())
    assert "Verdict per model" in res.output and "synthetic stand-in" in res.output
    for s in plan.serving:
        assert s.headroom is not None and s.headroom >= 1.0
        assert summary["headroom"][f"{s.model}/{s.phase}"] == pytest.approx(s.headroom, rel=1e-3)
    assert summary["slo"]["homo-greedy"]["verdict"]
    # Coral's plan came from homo-ilp's rounds, its own, its rounds pricing slack or parts of them composed; the
    # baselines' from their own or their parts composed
    assert summary["chosen_trial"]["coral"] in ("subset", "planner", "variant 1", "composed", "refined", "confirmed")
    assert summary["chosen_trial"]["homo-greedy"] in ("planner", "composed", "refined", "confirmed")
    # each method's verdict is certified alike: per model its bound, pooled, p5 and worst window, on 20 windows
    for method in costs:
        cert = summary["certified"][method]
        assert cert["windows_simulated"] >= 20 and cert["seconds"] > 0
        for row in cert["models"].values():
            assert row["windows"] == 20 and row["lower_bound"] <= row["pooled"] and row["worst"] <= row["p5"]
            assert row["pass"] == (row["lower_bound"] >= row["target"] and row["p5"] >= row["target"] - 0.03)
    assert abs(sum(i.cost_per_hour for i in plan.instances) - plan.cost_per_hour) < 1e-6
    html = (folder / "report.html").read_text()
    assert "<html" in html and plan.scenario in html
    # the plan chosen is the scenario's current plan, and the report's headline is its verdict as printed
    current = Plan.load(tmp_path / "core.current.plan.json")
    assert plan_fingerprint(current) == plan_fingerprint(plan) and current.cost_per_hour == plan.cost_per_hour
    found = re.search(r'<script id="coral-data" type="application/json">(.*?)</script>', html)
    assert found is not None
    data = json.loads(found.group(1))
    assert data["verdict"]["cost_per_hour"] == plan.cost_per_hour
    assert f"Verdict per model: Coral's plan, ${plan.cost_per_hour:,.2f}/h" in res.output
    table = res.output.split("Verdict per model")[1]
    printed = {words[0]: line for line in table.splitlines()
               if (words := re.sub(r"[│┃|]", " ", line).split()) and words[0] in plan.slo.target}
    for row in data["verdict"]["models"]:
        m = row["model"]
        assert row["held_out"] == plan.slo.held_out[m] and row["pass"] == plan.slo.passed(m)
        assert f"{row['held_out']:.1%}" in printed[m] and ("pass" in printed[m]) == row["pass"]
        assert f"{row['certified']:.1%}" in printed[m] and row["certified"] == plan.slo.certified[m].lower_bound
    assert data["slo"]["run"].startswith("Coral's plan re-planned") and "mean" in data["slo"]["run"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # nothing left aside
    assert (folder / "sim.json").exists() and (folder / "latency_cdf.png").exists()
    assert (tmp_path / "core.templates.sqlite").exists()
    # every method's plan is simulated on the same requests, and the report gets them all
    methods = list(costs)  # coral first, then the baselines
    inputs = load_inputs(folder / "report-inputs.json")
    assert [(m.method, m.how) for m in inputs.methods][1:] == [(m, "plan held fixed") for m in methods]
    assert set(summary["fixed_plan_slo_attainment"]) == set(methods)
    assert inputs.plan_fingerprint == plan_fingerprint(plan) and inputs.timeseries is not None
    for method in methods:
        sim = SimResult.load_json(folder / f"sim.fixed.{method}.json")
        assert sim.plan_fingerprint == plan_fingerprint(Plan.load(folder / f"plan.cost.{method}.json"))
    vm = view_model(plan, sim=inputs)
    assert not vm["notes"] and vm["slo"]["overall"] == inputs.overall_attainment
    other = Plan.load(folder / f"plan.cost.{methods[1]}.json")
    if plan_fingerprint(other) != plan_fingerprint(plan):
        assert any("another plan" in n for n in view_model(other, sim=inputs)["notes"])


def test_a_staged_folder_replaces_the_previous_one_only_when_complete(tmp_path: Path) -> None:
    from coral.cli.common import staged_folder

    folder = tmp_path / "run-core"
    folder.mkdir()
    (folder / "summary.json").write_text("old")
    with pytest.raises(KeyboardInterrupt), staged_folder(folder) as work:
        (work / "summary.json").write_text("half")
        raise KeyboardInterrupt
    assert (folder / "summary.json").read_text() == "old" and sorted(tmp_path.iterdir()) == [folder]
    with staged_folder(folder) as work:
        (work / "plan.json").write_text("new")
        assert (folder / "summary.json").read_text() == "old"  # not yet
    assert [p.name for p in folder.iterdir()] == ["plan.json"] and sorted(tmp_path.iterdir()) == [folder]


def test_an_interrupted_run_says_the_previous_outputs_are_unchanged(tmp_path: Path, monkeypatch) -> None:
    import coral.cli.run as run_module

    def interrupted(*_a: object, **_k: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "scenario_and_market", interrupted)
    res = CliRunner().invoke(app, ["run", "--out", str(tmp_path)])
    assert res.exit_code == 130
    assert "interrupted" in res.output and "unchanged" in res.output and str(tmp_path / "run-core") in res.output


def test_the_search_status_says_rounds_done_of_the_budget_and_the_most_time_left() -> None:
    """The live status line of `coral run`: after round 3 of a 42-round budget, the next simulation's line names
    round 4 of at most 42 and an upper bound on the time left at the pace so far; certification has no budget."""
    import io

    from rich.console import Console

    from coral.cli.run import SearchStatus
    from coral.planning.evaluation import Attainment

    class Lines:
        def __init__(self) -> None:
            self.lines: list[str] = []

        def update(self, line: str) -> None:
            self.lines.append(line)

    plan = Plan.model_validate({"scenario": "core", "method": "x", "instances": [], "serving": [],
                                "cost_per_hour": 12.5, "solve": {"status": "x"}})
    status = Lines()
    watch = SearchStatus("coral", status, Console(file=io.StringIO()), lambda p, s, share=1.0: {  # type: ignore[arg-type]
        "m": Attainment(1.0, 1.0, 1.0)}, most_rounds=42)
    watch.show("round 3: $12.50/h, m 100.0%")
    watch(plan, 0)
    assert re.search(r"round 4 of at most 42; \d+ s so far, at most ~\d+ s more at this pace", status.lines[-1])
    watch.show("confirmed 2 parts of 3 looked at on 16 fresh windows; certifying")
    watch(plan, 1)
    assert "of at most" not in status.lines[-1] and "s so far" in status.lines[-1]
