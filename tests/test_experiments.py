"""Experiments and the allocate/experiment CLI on the core scenario (library built once per module)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coral.allocation.allocator import allocate
from coral.allocation.plan import Plan
from coral.catalog.loader import CoralInputError, load_scenario
from coral.cli.main import app
from coral.experiments.allocation import _churn, paper_imbalanced_rates, run_experiment
from coral.templates.store import load_library


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
    data = json.loads((out / "experiments" / "epochs-core.json").read_text())
    assert data["rows"] == json.loads(json.dumps(again.rows))
    assert (out / "experiments" / "epochs-core.png").stat().st_size > 0


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
    bad = runner.invoke(app, ["experiment", "scarce", "tiny", "--out", str(out)])
    assert bad.exit_code == 2 and "core or extended" in bad.output


@pytest.mark.slow
def test_waterfall_on_core_ends_at_the_default_scenario(out: Path) -> None:
    res = CliRunner().invoke(app, ["experiment", "waterfall", "core", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads((out / "experiments" / "waterfall-core.json").read_text())["rows"]
    assert [r["step"] for r in rows] == list(range(len(rows)))
    coral = allocate(load_library("core", out), load_scenario("core"))
    assert rows[-1]["coral"] == pytest.approx(coral.cost_per_hour, abs=1e-4)
    assert (out / "experiments" / "waterfall-core.png").stat().st_size > 0


def test_scarce_core_plans_in_every_mode_and_cost_mode_fits_its_own_cluster(out: Path) -> None:
    """Issue 19's two cases on core: at availability × 0.5 every scarcity mode returns a plan (goodput used to
    raise although 60.9 % can be served) and goodput serves at least as much as max-min; on a fixed cluster of
    exactly the unlimited optimum's nodes, cost mode finds that optimum again."""
    from coral.allocation.allocator import estimated_nodes
    from coral.allocation.availability import headroom_availability

    sc, lib = load_scenario("core"), load_library("core", out)
    scarce = headroom_availability(sc, estimated_nodes(sc, lib), 0.5)
    plans = {mode: allocate(lib, sc, availability=scarce, mode=mode) for mode in ("goodput", "maxmin", "scaled")}
    served = {mode: sum(min(s.capacity, s.demand) for s in p.serving) for mode, p in plans.items()}
    assert 0 < served["maxmin"] <= served["goodput"] + 1e-6
    free = allocate(lib, sc, availability="unlimited", gap=1e-9)
    cluster: dict[str, dict[str, int]] = {r: {} for r in sc.regions}
    for inst in free.instances:
        for c, n in inst.counts.items():
            cluster[inst.region][c] = cluster[inst.region].get(c, 0) + n
    assert allocate(lib, sc, availability=cluster, gap=1e-9).cost_per_hour == pytest.approx(free.cost_per_hour)


def test_paper_imbalanced_rates_put_80_percent_on_a_third_of_the_models() -> None:
    """§6.5: the scenario's total request rate, 80 % on the largest (smallest) third — qwen3-32b (phi-4) in core."""
    sc = load_scenario("core")
    total = sum(sm.request_rate for sm in sc.models)
    for heavy, model in ((True, "qwen3-32b"), (False, "phi-4")):
        rates = paper_imbalanced_rates(sc, heavy)
        assert rates == pytest.approx({sm.model: total * (0.8 if sm.model == model else 0.1) for sm in sc.models})


def test_offerings_file_replaces_the_market_from_the_cli_and_the_scenario(out: Path, tmp_path: Path) -> None:
    """`--offerings FILE` and a scenario's `offerings:` field: every price doubled doubles the plan's cost (same
    nodes); a file naming an unknown GPU is refused with its path and field."""
    import yaml

    from coral.catalog.loader import data_path

    shipped = yaml.safe_load(data_path("offerings.yaml").read_text())
    for o in shipped["offerings"]:
        o["price_per_hour"] *= 2
    dear = tmp_path / "dear.yaml"
    dear.write_text(yaml.safe_dump(shipped))
    runner = CliRunner()
    costs = []
    for args, name in (([], "core.cost.coral.plan.json"),
                       (["--offerings", str(dear)], "core.cost.coral.offerings-dear.plan.json")):
        res = runner.invoke(app, ["allocate", "core", "--out", str(out), "--gap", "1e-9", *args])
        assert res.exit_code == 0, res.output
        costs.append(Plan.load(out / name).cost_per_hour)
    assert costs[1] == pytest.approx(2 * costs[0])
    assert Plan.load(out / "core.cost.coral.plan.json").cost_per_hour == costs[0]  # the default plan is kept
    scenario = yaml.safe_load(data_path("scenarios", "core.yaml").read_text())
    (tmp_path / "core.yaml").write_text(yaml.safe_dump({**scenario, "offerings": "dear.yaml"}))
    sc = load_scenario(tmp_path / "core.yaml")
    assert sc.offerings == str(dear.resolve())
    plan = allocate(load_library("core", out), sc, gap=1e-9)
    assert plan.cost_per_hour == pytest.approx(costs[1])
    shipped["offerings"][0]["gpu"] = "Z9"
    dear.write_text(yaml.safe_dump(shipped))
    bad = runner.invoke(app, ["allocate", "core", "--out", str(out), "--offerings", str(dear)])
    assert bad.exit_code == 2 and "offerings.0.gpu" in bad.output and "Z9" in bad.output


def test_experiment_rows_carry_simulated_slo_goodput(out: Path, tmp_path: Path) -> None:
    """The paper's goodput beside the planned share: every method's plan simulated on the held-out workload;
    Coral's goodput_x is 1 and a goodput never exceeds the tokens/s offered. A market file (`--offerings`) is
    what the plans are priced in: every price doubled doubles every method's $/h."""
    import yaml

    from coral.catalog.loader import data_path
    from coral.experiments.allocation import Inputs, Judge, _availability, _compare

    inputs = Inputs(out)
    sc, cat, lib = inputs("core")
    rows = _compare("core x1.25", lib, sc, _availability(sc, lib, 1.25, cat), 30.0, cat, Judge())
    by = {r["method"]: r for r in rows}
    assert by["coral"]["goodput_x"] == 1.0
    for r in rows:
        assert r["sim_goodput"] > 0 and 0 < r["goodput_share"] <= 1 and 0 <= r["least_attainment"] <= r["attainment"]
        assert r["goodput_x"] == pytest.approx(by["coral"]["sim_goodput"] / r["sim_goodput"], rel=1e-3)

    shipped = yaml.safe_load(data_path("offerings.yaml").read_text())
    for o in shipped["offerings"]:
        o["price_per_hour"] *= 2
    market = tmp_path / "double.yaml"
    market.write_text(yaml.safe_dump(shipped))
    sc2, cat2, lib2 = Inputs(out, market)("core")
    doubled = _compare("core x1.25", lib2, sc2, _availability(sc2, lib2, 1.25, cat2), 30.0, cat2, None)
    assert {r["method"]: r["cost_per_hour"] for r in doubled} == pytest.approx(
        {m: 2 * r["cost_per_hour"] for m, r in by.items()}, rel=1e-6)


def test_scarce_plans_are_judged_on_the_share_they_serve(out: Path) -> None:
    """Under scarcity each model is offered the share of its requests its plan serves (the rest shed and
    counted as missed): the shares are the plan's least served fraction per model, and attainment over all
    offered requests never exceeds the least share served."""
    from coral.experiments.allocation import Inputs, Judge, _availability

    sc, cat, lib = Inputs(out)("core")
    plan = allocate(lib, sc, availability=_availability(sc, lib, 0.5, cat), mode="goodput", catalog=cat)
    shares = plan.model_shares()
    assert shares == {m.model: min(s.served_fraction for s in plan.serving if s.model == m.model) for m in sc.models}
    assert min(shares.values()) < 1
    judged = Judge()(plan, sc, cat)
    assert judged["least_attainment"] <= min(shares.values()) + 0.02  # thinning is random: a share ± noise


def test_scarce_markets_limit_the_best_gpus_as_their_files_say_and_every_offering_has_a_count() -> None:
    """The scarce experiment's markets (issue 29) are data, independent of any plan: every offering carries a node
    count, the counts follow the file's rule (a per-region GPU quota split over the shapes sold, rounded down),
    and the market's availability is those counts: core-scarce holds 2 one-GPU L40S nodes per region and no
    larger L40S node, beside 48 GPUs each of L4 and A10G."""
    from coral.allocation.availability import market_availability
    from coral.catalog.loader import builtin_catalog, load_offerings, scenario_and_market
    from coral.catalog.schema import parse_config_name
    from coral.experiments.allocation import SCARCE_MARKETS, market_file

    shipped = {(o.region, o.instance_type): o for o in builtin_catalog().offerings}
    for scenario, markets in SCARCE_MARKETS.items():
        for market in markets:
            cat = load_offerings(market_file(market))
            assert cat.offerings and all(o.available is not None for o in cat.offerings), market
            for o in cat.offerings:  # the shipped rows, counts added: a price change there must reach these files
                assert o.model_copy(update={"available": None}) == shipped[(o.region, o.instance_type)], o
            sc, _ = scenario_and_market(scenario, market_file(market))
            assert {o.region for o in cat.offerings} == set(sc.regions)
    sc, cat = scenario_and_market("core", market_file("core-scarce"))
    avail = market_availability(sc, cat)
    assert isinstance(avail, dict)
    for counts in avail.values():
        assert {c: n for c, n in counts.items() if c.endswith("L40S") and n} == {"1xL40S": 2}
        for gpu in ("L4", "A10G"):
            assert sum(n * parse_config_name(c)[1] for c, n in counts.items() if parse_config_name(c)[0] == gpu) == 48


def test_at_target_rows_fall_back_to_goodput_mode_where_the_market_holds_no_plan(out: Path) -> None:
    """Where no plan meeting the targets fits the market (one node of each shape per region), every method's row
    is its most-goodput plan (Coral's: goodput mode), scored on held-out requests: served below 1, not met,
    Coral's goodput_x 1 and every ratio its $/h over Coral's."""
    from coral.experiments.allocation import Inputs, Judge, at_target_rows, most_goodput
    from coral.planning import SearchSettings

    sc, cat, lib = Inputs(out)("core")
    tiny = {r: {c: 1 for c in sc.configs} for r in sc.regions}
    settings = SearchSettings(max_rounds=2, duration_s=300.0, tune_seeds=(0,))
    rows = at_target_rows("tiny", lib, sc, tiny, cat, Judge(), 30.0, settings=settings)
    assert [r["method"] for r in rows] == ["coral", "homo-ilp", "homo-greedy", "cauchy-paper"]
    by = {r["method"]: r for r in rows}
    for r in rows:
        assert r["planned"] == "goodput mode" and not r["met"] and r["served"] < 1
        assert r["ratio"] == pytest.approx(r["cost_per_hour"] / by["coral"]["cost_per_hour"], rel=1e-3)
        assert 0 <= r["least_attainment"] <= r["attainment"] <= 1
    assert by["coral"]["goodput_x"] == 1.0
    coral = most_goodput("coral", lib, sc, tiny, cat, 30.0)
    assert by["coral"]["cost_per_hour"] == pytest.approx(coral.cost_per_hour, abs=1e-4)
