"""Experiments and the allocate/experiment CLI on the core scenario (library built once per module)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coral.allocation.allocator import allocate
from coral.allocation.demand import scenario_demand
from coral.allocation.plan import Plan
from coral.catalog.loader import CoralInputError, load_scenario
from coral.cli.main import app
from coral.experiments.allocation import _churn, _imbalanced_demand, load_library, run_experiment


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("out")
    load_library("core", folder)
    return folder


def test_epochs_experiment_is_deterministic_and_writes_files(out: Path) -> None:
    first = run_experiment("epochs", out, scenario="core")
    again = run_experiment("epochs", out, scenario="core")
    assert len(first.rows) == load_scenario("core").epochs
    timing = ("solve_s", "wall_s", "gap")  # the gap depends on when a wall-clock time limit hits
    strip = [{k: v for k, v in r.items() if k not in timing} for r in first.rows]
    assert strip == [{k: v for k, v in r.items() if k not in timing} for r in again.rows]
    assert first.rows[0]["stopped"] == 0 and first.rows[0]["penalty_per_hour"] == 0.0
    for r in first.rows:
        assert r["min_served"] == pytest.approx(1.0)
    data = json.loads((out / "experiments" / "epochs.json").read_text())
    assert data["rows"] == json.loads(json.dumps(again.rows))
    assert (out / "experiments" / "epochs.png").stat().st_size > 0


def test_unknown_experiment(out: Path) -> None:
    with pytest.raises(CoralInputError, match="unknown"):
        run_experiment("nope", out)


def test_churn_counts_started_and_stopped(out: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["allocate", "core", "--out", str(out)])
    assert res.exit_code == 0, res.output
    plan = Plan.load(out / "core.cost.coral.plan.json")
    assert _churn(None, plan) == (len(plan.instances), 0)
    assert _churn(plan, plan) == (0, 0)
    smaller = plan.model_copy(update={"instances": plan.instances[1:]})
    assert _churn(plan, smaller) == (0, 1)


def test_cli_modes_and_errors(out: Path) -> None:
    runner = CliRunner()
    for args in (["--method", "homo-greedy"], ["--method", "homo-ilp"], ["--method", "cauchy-paper"],
                 ["--mode", "goodput", "--availability-factor", "1.25"]):
        res = runner.invoke(app, ["allocate", "core", "--out", str(out), *args])
        assert res.exit_code == 0, res.output
    bad = runner.invoke(app, ["allocate", "core", "--out", str(out), "--mode", "cheap"])
    assert bad.exit_code == 2 and "--mode" in bad.output
    bad = runner.invoke(app, ["experiment", "default", "core", "--out", str(out)])
    assert bad.exit_code == 2 and "takes no scenario" in bad.output


@pytest.mark.slow
def test_waterfall_on_core_ends_at_the_default_scenario(out: Path) -> None:
    res = CliRunner().invoke(app, ["experiment", "waterfall", "core", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads((out / "experiments" / "waterfall-core.json").read_text())["rows"]
    assert [r["step"] for r in rows] == list(range(len(rows)))
    coral = allocate(load_library("core", out), load_scenario("core"))
    assert rows[-1]["coral"] == pytest.approx(coral.cost_per_hour, abs=1e-4)
    assert (out / "experiments" / "waterfall-core.png").stat().st_size > 0


def test_imbalanced_demand_shifts_toward_large_models() -> None:
    sc = load_scenario("core")
    base = scenario_demand(sc)
    heavy = _imbalanced_demand(sc, large_heavy=True)
    light = _imbalanced_demand(sc, large_heavy=False)
    for key, v in base.items():
        assert {heavy[key] / v, light[key] / v} == {2.0, 0.5}
