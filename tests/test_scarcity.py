"""Scarcity (issue 29): every model the nodes allow keeps an instance, "at most" only from a proven bound, stages
stopped by a limit are named, and the time limit of a whole call holds."""

from __future__ import annotations

import time
from typing import Any

import highspy
import numpy as np
import pytest
from test_allocation import CONFIGS, REGIONS, random_library, scenario, template

from coral.allocation import core, milp
from coral.allocation.allocator import (
    InfeasibleDemand,
    _context,
    _coverage,
    _solve_served,
    _uniform,
    allocate,
)
from coral.allocation.demand import DemandKey
from coral.allocation.plan import Plan
from coral.catalog.schema import Scenario
from coral.perf.model import Phase
from coral.report.view import solver_in_words
from coral.templates.library import TemplateLibrary

Case = tuple[TemplateLibrary, Scenario, dict[DemandKey, float], dict[str, dict[str, int]]]


def covering_case() -> Case:
    """Hand-solved: 2 × 1xL40S for three decode-only models whose instances take one node each, a at 150 tok/s
    (demand 1000), b and c at 100 tok/s (demand 100 each). No plan gives every model an instance (t = 0 is the
    max-min optimum), but two models can have one each; the most tokens/s alone (a on both nodes: 300 against
    250) leaves two models at 0."""
    lib = TemplateLibrary.from_templates(CONFIGS, [template("a", Phase.DECODE, {"1xL40S": 1}, 150.0),
                                                   template("b", Phase.DECODE, {"1xL40S": 1}, 100.0),
                                                   template("c", Phase.DECODE, {"1xL40S": 1}, 100.0)], {})
    dem = {("a", Phase.DECODE): 1000.0, ("b", Phase.DECODE): 100.0, ("c", Phase.DECODE): 100.0}
    av = {REGIONS[0]: {**dict.fromkeys(CONFIGS, 0), "1xL40S": 2}, REGIONS[1]: dict.fromkeys(CONFIGS, 0)}
    return lib, scenario(["a", "b", "c"]), dem, av


def starved_by_water_fill() -> Case:
    """Hand-solved: a's instances are 2 × 1xL40S at 1000 tok/s (the cheapest per token/s) or 1 × 1xL4 at 10 tok/s,
    b's only 1 × 1xL40S at 100 tok/s; 2 × 1xL40S and 1 × 1xL4 available. Water-filling gives a (first, both at
    0 %) its cheapest instance, both L40S nodes, and b nothing (t = 0); a on the L4 and b on one L40S serve
    both (t > 0)."""
    lib = TemplateLibrary.from_templates(CONFIGS, [template("a", Phase.DECODE, {"1xL40S": 2}, 1000.0),
                                                   template("a", Phase.DECODE, {"1xL4": 1}, 10.0),
                                                   template("b", Phase.DECODE, {"1xL40S": 1}, 100.0)], {})
    dem = {("a", Phase.DECODE): 1000.0, ("b", Phase.DECODE): 100.0}
    av = {REGIONS[0]: {**dict.fromkeys(CONFIGS, 0), "1xL40S": 2, "1xL4": 1}, REGIONS[1]: dict.fromkeys(CONFIGS, 0)}
    return lib, scenario(["a", "b"]), dem, av


def models_at_zero(plan: Plan) -> set[str]:
    return {s.model for s in plan.serving if s.demand > 0 and s.served_fraction <= 0}


def test_goodput_keeps_an_instance_for_every_model_it_can() -> None:
    """Goodput mode leaves at 0 only the models that no plan can serve alongside the others (here one of three);
    it used to maximise tokens/s alone when t = 0 and leave two at 0."""
    lib, sc, dem, av = covering_case()
    plan = allocate(lib, sc, demand=dem, availability=av, mode="goodput")
    assert len(models_at_zero(plan)) == 1
    assert any("2 of 3 models can each get an instance" in n and "proven" in n for n in plan.solve.notes)
    assert any("proven t ≤ 0" in n for n in plan.solve.notes)


def test_max_min_starts_above_zero_where_water_filling_starves_a_model() -> None:
    """The max-min stage's start serves every model (t > 0) even where water-filling leaves one at 0: with no
    time to solve, the start is the answer."""
    lib, sc, dem, av = starved_by_water_fill()
    ctx = _context(lib, sc, dem, av, None, None, True)
    x = core.water_fill(ctx.cols, ctx.market, ctx.demand)
    assert np.bincount(ctx.cols.key, ctx.cols.throughput * x, minlength=len(ctx.demand)).min() == 0
    ctx.cover = _coverage(ctx, ctx.weights, 10.0)
    assert ctx.cover.x is not None and ctx.cover.covered.all() and not ctx.cover.t_zero
    mm = _solve_served(ctx, "maxmin", ctx.weights, None, 0.0, 1e-4)
    assert _uniform(ctx, mm, ctx.weights) > 0
    plan = allocate(lib, sc, demand=dem, availability=av, mode="goodput")
    assert not models_at_zero(plan)


def test_at_most_words_come_from_a_proven_bound() -> None:
    """The diagnosis's "no plan serves more than X" is a proven bound (≥ the share the best plan serves), never
    the incumbent's share: 0 where the coverage proves a model must go without, the LP pipeline's bound in cost
    mode."""
    lib, sc, dem, av = covering_case()
    with pytest.raises(InfeasibleDemand) as err:
        allocate(lib, sc, demand=dem, availability=av, mode="maxmin")
    assert err.value.bound == 0.0 and err.value.fraction == 0.0
    assert "no plan serves more than 0.0% (a proven bound)" in str(err.value) and "at most" not in str(err.value)
    lib, sc, dem, av = starved_by_water_fill()
    with pytest.raises(InfeasibleDemand) as err:
        allocate(lib, sc, demand=dem, availability=av)
    assert err.value.bound is not None and err.value.fraction > 0
    assert err.value.bound >= err.value.fraction - 1e-9
    assert f"no plan serves more than {err.value.bound:.1%}" in str(err.value)


def test_words_name_the_stages_a_limit_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """"proved" only where every stage proved its optimum: stages stopped on a (work) limit are named."""
    lib, sc, dem, av = starved_by_water_fill()
    proven = allocate(lib, sc, demand=dem, availability=av, mode="goodput")
    assert proven.solve.stopped == [] and "not proven" not in solver_in_words(proven.solve, "goodput")
    real = milp.solve

    def node_limited(*args: Any, **kwargs: Any) -> milp.MilpResult:
        res = real(*args, **kwargs)
        res.status = "Node limit reached"
        return res

    monkeypatch.setattr(milp, "solve", node_limited)
    plan = allocate(lib, sc, demand=dem, availability=av, mode="goodput")
    words = solver_in_words(plan.solve, "goodput")
    assert "stage 1 (max-min): Node limit reached (a work limit)" in plan.solve.stopped
    assert "not proven optimal, stopped early: stage 1 (max-min)" in words and "proved" not in words


def test_the_time_limit_holds_for_the_whole_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """With HiGHS made slow (every run 0.2 s longer: a loaded machine), no solve starts once a stage's share of
    the call's safety net has run out: the call returns, reports the net, and takes a few runs past its limit,
    not one per remaining solve of the pipeline."""
    models = ["a", "b", "c"]
    lib = random_library(21, models, n=30)
    sc = scenario(models, rates=[6.0, 4.0, 5.0])
    av = {r: dict.fromkeys(CONFIGS, 1) for r in REGIONS}
    real = highspy.Highs.run
    runs: list[float] = []

    def slow_run(self: highspy.Highs) -> highspy.HighsStatus:
        runs.append(time.perf_counter())
        time.sleep(0.2)
        return real(self)

    monkeypatch.setattr(highspy.Highs, "run", slow_run)
    t0 = time.perf_counter()
    plan = allocate(lib, sc, availability=av, mode="goodput", time_limit=1.0)
    assert plan.instances and plan.solve.safety_net is not None
    # one run per stage at most past the net (it used to start every remaining solve: about 45 runs)
    assert sum(r > t0 + 1.0 for r in runs) <= 5
