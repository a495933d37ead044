"""Deterministic planning (issue 28, item 5): the same inputs give the same plan on an idle or a loaded machine.

A loaded machine is played by a clock that runs fast in the planning modules: every wall-clock limit is then a
safety net only, so the plan is the same unless one is hit, and a hit is recorded. No test asserts on timings."""

from __future__ import annotations

import json
import shutil
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from toy_search import toy_evaluator, toy_planner, toy_scenario
from typer.testing import CliRunner

from coral.allocation import allocator, milp, solver
from coral.allocation.allocator import allocate, resolve_availability
from coral.allocation.demand import scenario_demand, scenario_traffic
from coral.allocation.plan import Plan, SloCheck
from coral.catalog.loader import load_scenario
from coral.catalog.schema import Scenario
from coral.planning import slo_search
from coral.planning.slo_search import (
    Round,
    SearchResult,
    SearchSettings,
    default_rounds,
    search_plan,
)
from coral.templates.library import TemplateLibrary
from coral.templates.store import load_library

PLANNING_MODULES = (solver, milp, allocator, slo_search)


def fast_clock(factor: float, start: float | None = None) -> Callable[[], float]:
    """A perf_counter that runs `factor` times faster than the real one."""
    real = time.perf_counter
    t0 = real() if start is None else start
    return lambda: t0 + factor * (real() - t0)


def patch_clock(monkeypatch: pytest.MonkeyPatch, clock: Callable[[], float],
                modules: tuple[types.ModuleType, ...] = PLANNING_MODULES) -> None:
    """`clock` as `time.perf_counter` in `modules` only (their `time` replaced, the real module untouched)."""
    for module in modules:
        fake = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("__")})
        fake.perf_counter = clock
        monkeypatch.setattr(module, "time", fake)


@pytest.fixture(scope="module")
def core_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An output folder with core's library (copied from out/ when cached there, else built)."""
    folder = tmp_path_factory.mktemp("out")
    cached = Path("out") / "core.templates.sqlite"
    if cached.exists():
        shutil.copy(cached, folder / cached.name)
    load_library("core", folder)  # rebuilt when the copy is stale
    return folder


@pytest.fixture(scope="module")
def core_library(core_out: Path) -> TemplateLibrary:
    return load_library("core", core_out)


def plan_key(plan: Plan) -> tuple[Any, ...]:
    return (sorted((i.id, i.template_id, i.region, tuple(sorted(i.counts.items()))) for i in plan.instances),
            round(plan.cost_per_hour, 9), [(s.model, s.phase, round(s.capacity, 6)) for s in plan.serving])


# --- (a) the allocator -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode,factor", [("cost", None), ("goodput", 0.5)])
def test_allocate_gives_the_same_plan_on_a_slow_clock(monkeypatch: pytest.MonkeyPatch, core_library: TemplateLibrary,
                                                      mode: str, factor: float | None) -> None:
    sc = load_scenario("core")
    avail = resolve_availability(sc, core_library, factor=factor)
    # time_limit: the safety net, far above what core needs even 20x "slower"
    idle = allocate(core_library, sc, availability=avail, mode=mode, time_limit=600)  # type: ignore[arg-type]
    patch_clock(monkeypatch, fast_clock(20.0))
    loaded = allocate(core_library, sc, availability=avail, mode=mode, time_limit=600)  # type: ignore[arg-type]
    assert idle.solve.safety_net is None and loaded.solve.safety_net is None
    assert plan_key(loaded) == plan_key(idle)
    assert loaded.solve.status == idle.solve.status


def test_coverage_gives_the_same_plan_on_a_slow_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no plan serves every model (issue 29), the coverage MIP and the stages after it stop on work limits
    too: the same plan on an idle or a loaded machine."""
    from test_scarcity import covering_case

    lib, sc, dem, av = covering_case()
    idle = allocate(lib, sc, demand=dem, availability=av, mode="goodput", time_limit=600)
    patch_clock(monkeypatch, fast_clock(20.0))
    loaded = allocate(lib, sc, demand=dem, availability=av, mode="goodput", time_limit=600)
    assert idle.solve.safety_net is None and loaded.solve.safety_net is None
    assert plan_key(loaded) == plan_key(idle) and loaded.solve.stopped == idle.solve.stopped == []


def test_a_safety_net_hit_reaches_the_plan(monkeypatch: pytest.MonkeyPatch, core_library: TemplateLibrary) -> None:
    real_solve = milp.solve

    def stopped(*args: Any, **kwargs: Any) -> milp.MilpResult:
        res = real_solve(*args, **kwargs)
        if not kwargs.get("relax"):
            res.safety_net = "the wall-clock time limit (test) stopped HiGHS"
        return res

    monkeypatch.setattr(milp, "solve", stopped)
    sc = load_scenario("core")
    plan = allocate(core_library, sc, availability=resolve_availability(sc, core_library))
    assert plan.solve.safety_net is not None and "(test)" in plan.solve.safety_net
    assert plan.solve.notes[0].startswith("safety net:")
    assert Plan.model_validate_json(plan.model_dump_json()).solve.safety_net == plan.solve.safety_net
    # old plan files (no safety_net fields) still load
    old = json.loads(plan.model_dump_json())
    del old["solve"]["safety_net"]
    assert Plan.model_validate(old).solve.safety_net is None


def _hard_mip() -> tuple[np.ndarray, milp.SparseRows]:
    """A covering MIP that takes HiGHS many thousands of nodes to prove optimal."""
    rng = np.random.default_rng(0)
    n, m = 200, 60
    a = rng.integers(1, 100, (m, n)).astype(float)
    rows = milp.SparseRows(n)
    for i in range(m):
        rows.add(np.arange(n), a[i], float(rng.integers(1000, 3000)), np.inf)
    return rng.integers(50, 150, n).astype(float), rows


def test_milp_stops_on_its_node_limit_deterministically() -> None:
    cost, rows = _hard_mip()
    n = len(cost)
    args = (cost, np.zeros(n), np.full(n, 10.0), np.ones(n, dtype=bool), rows)
    first = milp.solve(*args, gap=1e-9, max_nodes=20, time_limit=600)
    second = milp.solve(*args, gap=1e-9, max_nodes=20, time_limit=600)
    assert first.status == "Node limit reached" and first.safety_net is None
    assert first.x is not None and second.x is not None and np.array_equal(first.x, second.x)
    assert first.objective == second.objective
    # the wall clock stops it only as a safety net, and says so
    stopped = milp.solve(*args, gap=1e-9, time_limit=0.01)
    assert stopped.status == milp.TIME_LIMIT_STATUS and stopped.safety_net is not None
    assert "wall-clock time limit" in stopped.safety_net
    # stopped before it proved any bound: none is reported (HiGHS says -inf, and a gap of inf)
    unproved = milp.solve(*args, gap=1e-9, time_limit=0.0)
    assert unproved.bound is None and unproved.gap is None and unproved.safety_net is not None


# --- (b) the SLO search ----------------------------------------------------------------------------------------

def _evaluate(ceiling: float = 1.0) -> slo_search.Evaluator:
    return toy_evaluator(ceiling)


def rounds_key(res: SearchResult) -> list[tuple[Any, ...]]:
    return [(sorted(r.headroom.items()), r.cost_per_hour, sorted(r.attainment.items()), r.passed, r.note)
            for r in res.rounds]


def test_search_rounds_do_not_depend_on_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = SearchSettings(max_rounds=30)
    idle = search_plan(toy_planner, toy_scenario(), settings, evaluate=_evaluate())
    assert idle.safety_net is None and idle.plan is not None and idle.plan.slo is not None
    assert idle.plan.slo.safety_net is None and idle.tuned_passed and not idle.plan.slo.notes
    # a clock 1000x fast (every round "takes" far longer), under the default safety net: same rounds, same plan
    patch_clock(monkeypatch, fast_clock(1000.0), (slo_search,))
    loaded = search_plan(toy_planner, toy_scenario(), settings, evaluate=_evaluate())
    assert loaded.safety_net is None
    assert rounds_key(loaded) == rounds_key(idle) and len(idle.rounds) > 3
    assert loaded.plan is not None and loaded.plan.cost_per_hour == idle.plan.cost_per_hour


def test_search_records_its_safety_net(monkeypatch: pytest.MonkeyPatch) -> None:
    idle = search_plan(toy_planner, toy_scenario(), SearchSettings(max_rounds=30), evaluate=_evaluate())
    ticks = iter(range(0, 10**9, 100))  # every reading of the clock 100 s later: the net (250 s) after 2 rounds
    patch_clock(monkeypatch, lambda: float(next(ticks)), (slo_search,))
    res = search_plan(toy_planner, toy_scenario(), SearchSettings(max_rounds=30, time_budget_s=250), evaluate=_evaluate())
    assert 0 < len(res.rounds) < len(idle.rounds)
    assert rounds_key(res) == rounds_key(idle)[:len(res.rounds)]  # the rounds it ran are the same
    assert res.safety_net is not None and "safety net (250 s)" in res.safety_net
    assert res.plan is not None and res.plan.slo is not None and res.plan.slo.safety_net == res.safety_net


def test_search_notes_a_chosen_round_that_missed() -> None:
    res = search_plan(toy_planner, toy_scenario(), SearchSettings(max_rounds=4, held_out_seeds=(1,)),
                      evaluate=_evaluate(ceiling=0.8))
    assert res.plan is not None and res.plan.slo is not None
    assert not res.tuned_passed and not res.met
    assert any(n.startswith("missed: no round met every target") for n in res.plan.slo.notes)


def test_default_rounds_grow_with_the_models() -> None:
    assert default_rounds(load_scenario("core")) == 14
    assert default_rounds(load_scenario("extended")) == 17
    assert slo_search.default_budget_s(load_scenario("core")) == 480.0
    # Coral's search: homo-ilp's trial, its own and its slack-priced one
    assert slo_search.default_budget_s(load_scenario("core"), 3) == 720.0
    assert slo_search.default_budget_s(load_scenario("extended"), 3) == 2880.0
    assert slo_search.default_budget_s(load_scenario("core"), 1) == 480.0


# --- (c) `coral run` on a missed target ------------------------------------------------------------------------


def _fake_search(passed: bool, net: str | None) -> Callable[..., SearchResult]:
    """search_plan's stand-in: the planner's plan at the scenario's demand, one round, passed or not on the tuning
    requests (held-out verdicts pass), with the safety net `net`."""

    def search(planner: Callable[[Any], Plan], scenario: Scenario, settings: SearchSettings | None = None,
               **_: Any) -> SearchResult:
        plan = slo_search.with_traffic(planner(scenario_demand(scenario)), scenario_traffic(scenario))
        target = {sm.model: sm.slo_attainment for sm in scenario.models}
        att = {m: (t + 0.05 if passed else t - 0.05) for m, t in target.items()}
        rnd = Round(0, {}, plan.cost_per_hour, att, passed)
        plan.slo = SloCheck(target=target, tuned=att, held_out=dict.fromkeys(target, 0.99),
                            held_out_seeds=[1], duration_s=60.0, safety_net=net,
                            verdict={m: "pass: 99.0% on held-out requests" for m in target})
        if not passed:
            plan.slo.notes.append(slo_search.missed_words(rnd, target, 1, 1))
        return SearchResult(plan, {}, [rnd], 0.0, net, 0)

    return search


@pytest.mark.parametrize("passed,allow,code", [(False, False, 3), (False, True, 0), (True, False, 0)])
def test_coral_run_exits_3_on_a_missed_target(monkeypatch: pytest.MonkeyPatch, core_out: Path, tmp_path: Path,
                                              passed: bool, allow: bool, code: int) -> None:
    from coral.cli.main import app

    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(core_out / "core.templates.sqlite", out / "core.templates.sqlite")
    net = None if passed else "the search's wall-clock safety net (1 s) stopped it after 1 of 14 rounds"
    monkeypatch.setattr("coral.planning.slo_search.search_plan", _fake_search(passed, net))  # what search_method calls
    args = ["run", "core", "--out", str(out), "--duration", "60", "--baselines", "none"]
    res = CliRunner().invoke(app, [*args, "--allow-miss"] if allow else args)
    assert res.exit_code == code, res.output
    summary = json.loads((out / "run-core" / "summary.json").read_text())
    plan = Plan.load(out / "run-core" / "plan.cost.coral.json")
    assert plan.slo is not None
    if passed:
        assert summary["missed"] == [] and summary["safety_net"] == {} and not plan.slo.notes
        return
    assert summary["missed"] and summary["missed"][0].startswith("missed: no round met every target")
    assert plan.slo.notes == summary["missed"]
    assert summary["safety_net"] == {"coral": net}
    assert "coral missed a target" in res.output and "safety net" in res.output
