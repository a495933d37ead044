"""Bill of materials: a hand-made plan checked by hand, core's allocated plan, other markets, and `coral plan bom`."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from coral.allocation.plan import Plan, PlanInstance
from coral.catalog.loader import builtin_catalog, load_offerings
from coral.cli.main import app
from coral.deploy.bom import BillOfMaterials, bill_of_materials, plan_market
from coral.report.examples import make_plan

EAST, SEOUL = "aws-us-east-2", "aws-ap-northeast-2"


def offer(region: str, instance_type: str, gpu: str, per_node: int, price: float) -> dict[str, object]:
    return {"cloud": "aws", "region": region, "instance_type": instance_type, "gpu": gpu, "gpus_per_node": per_node,
            "price_per_hour": price, "vcpus": 4, "host_memory_gb": 16, "nic_gbps": 10, "price_date": "2026-12",
            "source": "test"}


@pytest.fixture
def market(tmp_path: Path) -> Path:
    """Round prices; two shapes offer 1xL4 in us-east-2 (the cheaper one is rented)."""
    path = tmp_path / "offerings.yaml"
    path.write_text(yaml.safe_dump({"schema_version": 1, "offerings": [
        offer(EAST, "g6.xlarge", "L4", 1, 1.0),
        offer(EAST, "g6.2xlarge", "L4", 1, 1.5),
        offer(EAST, "g6.12xlarge", "L4", 4, 5.0),
        offer(SEOUL, "g6e.xlarge", "L40S", 1, 2.0),
    ]}))
    return path


def instance(model: str, phase: str, region: str, stages: list[list[str]], cost: float, k: int = 0) -> PlanInstance:
    return PlanInstance.of_stages(model, phase, 1, region, k, [(10, s, [1.0] * len(s)) for s in stages], 1.0, cost)


def hand_plan() -> Plan:
    """Priced by hand at `market`: 2x1xL4 + 4xL4 = $7, 1xL4 = $1 (twice), 1xL40S = $2; $11/h in all."""
    return make_plan("coral", [
        instance("phi-4", "prefill", EAST, [["1xL4", "1xL4"], ["4xL4"]], 7.0),
        instance("phi-4", "decode", EAST, [["1xL4"]], 1.0, 0),
        instance("phi-4", "decode", EAST, [["1xL4"]], 1.0, 1),
        instance("qwen3-32b", "decode", SEOUL, [["1xL40S"]], 2.0),
    ])


def test_hand_made_plan_by_hand(market: Path) -> None:
    plan = hand_plan()
    bom = bill_of_materials(plan, load_offerings(market), str(market))
    rows = [(r.region, r.instance_type, r.gpu, r.gpus_per_node, r.count, r.price_per_hour, r.total_per_hour)
            for r in bom.rows]
    assert rows == [
        (SEOUL, "g6e.xlarge", "L40S", 1, 1, 2.0, 2.0),
        (EAST, "g6.xlarge", "L4", 1, 4, 1.0, 4.0),  # the cheaper of the two 1xL4 shapes
        (EAST, "g6.12xlarge", "L4", 4, 1, 5.0, 5.0),
    ]
    assert bom.rows[1].instances == [plan.instances[0].id, plan.instances[1].id, plan.instances[2].id]
    assert bom.rows[2].instances == [plan.instances[0].id]
    assert bom.total_per_hour == 11.0 == plan.cost_per_hour and bom.matches_plan and bom.notes == []


def test_core_plan_total_equals_its_cost() -> None:
    """The allocator's plan for core (built library, shipped offerings) rents exactly what it costs."""
    from coral.allocation.allocator import allocate
    from coral.catalog.loader import load_scenario
    from coral.templates.build import build_library

    sc = load_scenario("core")
    plan = allocate(build_library(sc, workers=1), sc, time_limit=30)
    catalog, source = plan_market(plan)
    assert source == "the shipped offerings"
    bom = bill_of_materials(plan, catalog, source)
    assert bom.total_per_hour == pytest.approx(plan.cost_per_hour, rel=1e-9) and bom.matches_plan
    assert sum(r.count for r in bom.rows) == sum(i.n_nodes for i in plan.instances)
    used = {iid for r in bom.rows for iid in r.instances}
    assert used == {i.id for i in plan.instances}


def test_a_plan_priced_elsewhere_is_named(market: Path) -> None:
    """At the shipped prices the hand-made plan's instances cost other amounts; a node config the offerings lack
    in a region is named, not guessed."""
    plan = hand_plan()
    bom = bill_of_materials(plan, builtin_catalog())
    assert not bom.matches_plan and bom.total_per_hour != pytest.approx(plan.cost_per_hour)
    assert "4 instance(s)" in bom.notes[0] and "different market file" in bom.notes[0]
    lonely = make_plan("coral", [instance("phi-4", "decode", SEOUL, [["1xL4"]], 1.0)])
    bom = bill_of_materials(lonely, load_offerings(market), "test.yaml")
    assert bom.rows == [] and not bom.matches_plan
    assert bom.notes[0].startswith(f"no offering of 1xL4 in {SEOUL} in test.yaml")


def test_cli_formats_parse_and_agree(market: Path, tmp_path: Path) -> None:
    plan_path = hand_plan().save(tmp_path / "plan.json")
    runner = CliRunner()
    out = runner.invoke(app, ["plan", "bom", str(plan_path), "--offerings", str(market), "--format", "csv"])
    assert out.exit_code == 0, out.output
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    assert [(r["instance_type"], int(r["count"]), float(r["total_per_hour"])) for r in rows] == [
        ("g6e.xlarge", 1, 2.0), ("g6.xlarge", 4, 4.0), ("g6.12xlarge", 1, 5.0)]
    assert len(rows[1]["instances"].split()) == 3
    target = tmp_path / "bom.json"
    out = runner.invoke(app, ["plan", "bom", str(plan_path), "--offerings", str(market), "--format", "json",
                              "--out", str(target)])
    assert out.exit_code == 0, out.output
    bom = BillOfMaterials.model_validate(json.loads(target.read_text()))
    assert bom.total_per_hour == 11.0 and bom.matches_plan and f"wrote {target}" in out.stdout
    table = runner.invoke(app, ["plan", "bom", str(plan_path), "--offerings", str(market)], env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "What to rent" in table.stdout and "$11.00" in table.stdout
    assert "equals the plan's $11.00/h" in table.stdout
    shipped = runner.invoke(app, ["plan", "bom", str(plan_path), "--format", "json"])
    assert shipped.exit_code == 0 and "different market file" in shipped.stderr
    assert json.loads(shipped.stdout)["matches_plan"] is False
    missing = runner.invoke(app, ["plan", "bom", str(tmp_path / "nope.json")])
    assert missing.exit_code == 2


@pytest.mark.parametrize("named", ["/etc/passwd", "scenario-file"])
def test_a_plan_never_makes_bom_open_a_path_it_names(market: Path, tmp_path: Path, named: str) -> None:
    """A plan's scenario is looked up among the built-in scenarios only; a scenario file (here one whose offerings
    price the plan exactly) is read only when the command line names it."""
    from coral.catalog.loader import load_scenario

    scenario_file = tmp_path / "mine.yaml"
    doc = load_scenario("core").model_dump(mode="json", exclude_none=True)
    scenario_file.write_text(yaml.safe_dump({**doc, "offerings": str(market)}))
    plan = hand_plan()
    plan.scenario = str(scenario_file) if named == "scenario-file" else named
    assert plan_market(plan)[1] == "the shipped offerings"
    plan_path = plan.save(tmp_path / "plan.json")
    runner = CliRunner()
    shipped = runner.invoke(app, ["plan", "bom", str(plan_path), "--format", "json"])
    assert shipped.exit_code == 0 and json.loads(shipped.stdout)["offerings"] == "the shipped offerings"
    named_here = runner.invoke(app, ["plan", "bom", str(plan_path), "--scenario", str(scenario_file), "--format",
                                     "json"])
    assert named_here.exit_code == 0, named_here.output
    bom = json.loads(named_here.stdout)
    assert bom["offerings"] == str(market.resolve()) and bom["matches_plan"] is True


def many_instances_plan() -> Plan:
    """Ten phi-4 decode instances on 1xL4 and one prefill on 1xL40S: a bill of two rows whose first row serves ten
    plan instances (their ids fill many lines when shown)."""
    return make_plan("coral", [
        *(instance("phi-4", "decode", EAST, [["1xL4"]], 0.8048, k) for k in range(10)),
        instance("phi-4", "prefill", SEOUL, [["1xL40S"]], 2.0),
    ])


def bom_text(args: list[str], columns: int, cwd: Path | None = None) -> str:
    """What `coral plan bom ARGS` prints in a terminal `columns` wide (a process of its own: the CLI's console
    takes COLUMNS when it is imported)."""
    env = {**os.environ, "COLUMNS": str(columns)}
    proc = subprocess.run([sys.executable, "-m", "coral.cli.main", "plan", "bom", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, stdin=subprocess.DEVNULL, check=True)
    return proc.stdout


def test_bom_fits_an_80_column_terminal(tmp_path: Path) -> None:
    """At 80 columns the plan instances are left out (and named) instead of folding every id into a column a few
    letters wide; names stay whole and prices are to the cent."""
    path = tmp_path / "offerings.yaml"
    path.write_text(yaml.safe_dump({"schema_version": 1, "offerings": [
        offer(EAST, "g6.xlarge", "L4", 1, 0.8048), offer(SEOUL, "g6e.xlarge", "L40S", 1, 2.0)]}))
    plan = many_instances_plan().save(tmp_path / "plan.json")
    narrow = bom_text([str(plan), "--offerings", str(path)], 80)
    lines = narrow.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert len(lines) <= 2 + 14, narrow  # two rows and the chrome: title, header, rules, footer, caption, note
    assert "left out for the terminal's width: plan instances" in " ".join(narrow.split())
    assert "phi-4.decode" not in narrow and all(name in narrow for name in (EAST, SEOUL, "g6.xlarge", "g6e.xlarge"))
    assert "$0.80 " in narrow and "$0.8048" not in narrow and "$8.05" in narrow and "$10.05" in narrow
    wide = bom_text([str(plan), "--offerings", str(path)], 200)
    assert "plan instances" in wide and "left out" not in wide
    assert all(i.id in wide for i in Plan.load(plan).instances) and len(wide.splitlines()) < len(lines) + 10


def test_bom_takes_the_current_plan_without_one(market: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from coral.cli.common import current_plan_path

    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    missing = runner.invoke(app, ["plan", "bom", "--offerings", str(market)])
    said = " ".join(missing.output.split())
    assert missing.exit_code == 2 and "PLAN: not given, and core has no current plan" in said
    hand_plan().save(current_plan_path("core"))
    got = runner.invoke(app, ["plan", "bom", "--offerings", str(market), "--format", "json"])
    assert got.exit_code == 0, got.output
    assert json.loads(got.stdout)["total_per_hour"] == 11.0
    assert "plan: out/core.current.plan.json (the current plan of core" in got.stderr
    other = runner.invoke(app, ["plan", "bom", "--scenario", "extended", "--offerings", str(market)])
    assert other.exit_code == 2 and "extended has no current plan" in " ".join(other.output.split())
