"""Allocator: demand derivation, reductions, properties, scarcity modes, baselines and exactness checks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from coral.allocation import baselines, solver
from coral.allocation.allocator import FAIRNESS, UNLIMITED, InfeasibleDemand, Mode, allocate
from coral.allocation.availability import headroom_availability
from coral.allocation.demand import phase_demand, scenario_demand
from coral.allocation.plan import Plan
from coral.allocation.reference import joint_cost
from coral.catalog.loader import CoralInputError, builtin_catalog
from coral.catalog.schema import Scenario, ScenarioModel, TargetUtilization
from coral.perf.model import Phase
from coral.templates.dominance import _undominated_pairwise, undominated
from coral.templates.library import Stage, Template, TemplateLibrary
from coral.templates.placement import set_partitions, solve_node_sets

REGIONS = ["aws-us-east-2", "aws-ap-northeast-2"]
CONFIGS = ["1xL4", "1xA10G", "1xL40S", "4xL4"]


def scenario(models: list[str], rates: list[float] | None = None, priority: list[float] | None = None,
             k: float = 0.1) -> Scenario:
    rates = rates or [1.0] * len(models)
    priority = priority or [1.0] * len(models)
    return Scenario(  # planned capacity = mean demand (no burst headroom): these tests are about the solver
        name="tiny", regions=REGIONS, configs=CONFIGS, availability={"mode": "headroom", "factor": 3.0},
        init_penalty_k=k, target_utilization=TargetUtilization(prefill=1.0, decode=1.0),
        models=[ScenarioModel(model=m, prefill_slo_ms=1000, decode_slo_ms=50, request_rate=r, mean_input_tokens=100,
                              mean_output_tokens=20, priority=p) for m, r, p in zip(models, rates, priority, strict=True)],
    )


def template(model: str, phase: Phase, counts: dict[str, int], thr: float) -> Template:
    nodes = tuple(c for c, n in counts.items() for _ in range(n))
    stage = Stage(layers=4, nodes=nodes, node_throughput=tuple(thr / len(nodes) for _ in nodes))
    return Template(id=0, model=model, phase=phase, slo_ms=1000, counts=counts, stages=(stage,), throughput=thr)


def random_library(seed: int, models: list[str], n: int = 12, homogeneous_only: bool = False) -> TemplateLibrary:
    rng = np.random.default_rng(seed)
    rows = []
    for m in models:
        for phase in Phase:
            for _ in range(n):
                k = int(rng.integers(1, 4))
                cfgs = [CONFIGS[int(rng.integers(0, len(CONFIGS)))]]
                picks = cfgs * k if homogeneous_only else [CONFIGS[int(i)] for i in rng.integers(0, len(CONFIGS), k)]
                counts: dict[str, int] = {}
                for c in picks:
                    counts[c] = counts.get(c, 0) + 1
                rows.append(template(m, phase, counts, float(rng.integers(20, 200)) * k))
    return TemplateLibrary.from_templates(CONFIGS, rows, {})


def demand_of(sc: Scenario, scale: float = 1.0) -> dict[tuple[str, Phase], float]:
    return scenario_demand(sc, scale)


def avail(n: int) -> dict[str, dict[str, int]]:
    return {r: dict.fromkeys(CONFIGS, n) for r in REGIONS}


def check_plan(plan: Plan, av: dict[str, dict[str, int]] | None) -> None:
    for s in plan.serving:
        assert s.capacity >= s.demand * plan.demand_scale * (1 - 1e-9) or plan.mode in ("goodput", "maxmin")
    if av is not None:
        used: dict[tuple[str, str], int] = {}
        for inst in plan.instances:
            for c, n in inst.counts.items():
                used[(inst.region, c)] = used.get((inst.region, c), 0) + n
        for (r, c), n in used.items():
            assert n <= av[r][c]


# --- demand --------------------------------------------------------------------------------------------------
def test_phase_demand_derivation() -> None:
    sm = ScenarioModel(model="x", prefill_slo_ms=1, decode_slo_ms=1, request_rate=10, mean_input_tokens=1155,
                       mean_output_tokens=211)
    assert phase_demand(sm) == {Phase.PREFILL: 11550.0, Phase.DECODE: 2110.0}
    assert phase_demand(sm, rate=2.0) == {Phase.PREFILL: 2310.0, Phase.DECODE: 422.0}
    with pytest.raises(ValueError):
        phase_demand(sm, rate=-1)


# --- reductions ----------------------------------------------------------------------------------------------
@given(st.integers(0, 10_000))
@settings(max_examples=60, deadline=None)
def test_fast_dominance_matches_pairwise(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, c = int(rng.integers(1, 30)), int(rng.integers(1, 4))
    counts = rng.integers(0, 3, (n, c))
    thr = rng.integers(1, 6, n).astype(float)
    keep = rng.random(n) < 0.2
    assert (undominated(counts, thr, keep) == _undominated_pairwise(counts, thr, keep)).all()


def test_dominance_golden() -> None:
    counts = np.array([[1, 0], [1, 1], [2, 0], [1, 0]])
    thr = np.array([10.0, 10.0, 25.0, 10.0])
    # row 1 ⊃ row 0 with equal throughput; row 3 duplicates row 0; row 2 gives more throughput
    assert undominated(counts, thr).tolist() == [True, False, True, False]
    assert undominated(counts, thr, np.array([False, True, False, False])).tolist() == [True, True, True, False]


@given(st.integers(0, 10_000), st.integers(1, 3), st.integers(0, 2), st.integers(1, 4))
@settings(max_examples=80, deadline=None)
def test_pareto_columns_match_the_definition(seed: int, n_thr: int, n_use: int, block: int) -> None:
    """The sort-filter skyline (any block size) drops exactly the columns that another column of their group
    (not running) weakly dominates — strictly somewhere, or identical with a lower index."""
    from coral.allocation.reductions import pareto_columns

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    group, cost = rng.integers(0, 3, n), rng.integers(1, 5, n).astype(float)
    thr, use = rng.integers(1, 4, (n, n_thr)).astype(float), rng.integers(0, 3, (n, n_use))
    keep = rng.random(n) < 0.15
    expect = np.ones(n, dtype=bool)
    for j in range(n):
        for i in range(n):
            weak = (group[i] == group[j] and cost[i] <= cost[j] and (thr[i] >= thr[j]).all()
                    and (use[i] <= use[j]).all())
            strict = cost[i] < cost[j] or (thr[i] > thr[j]).any() or (use[i] < use[j]).any() or i < j
            if i != j and not keep[i] and not keep[j] and weak and strict:
                expect[j] = False
    assert pareto_columns(group, cost, thr, use, keep, block=block).tolist() == expect.tolist()


@pytest.mark.parametrize("seed", range(6))
def test_reductions_are_lossless(seed: int) -> None:
    models = ["a", "b"]
    lib = random_library(seed, models)
    sc = scenario(models, rates=[3.0, 2.0])
    av = avail(int(np.random.default_rng(seed).integers(4, 12)))
    try:
        with_red = allocate(lib, sc, availability=av, gap=1e-9)
    except InfeasibleDemand:
        with pytest.raises(InfeasibleDemand):
            allocate(lib, sc, availability=av, gap=1e-9, reduce=False)
        return
    without = allocate(lib, sc, availability=av, gap=1e-9, reduce=False)
    assert with_red.cost_per_hour == pytest.approx(without.cost_per_hour, rel=1e-9)
    check_plan(with_red, av)


def hand_problem(shared: float) -> solver.Problem:
    """Keys A, B, C (demand 2 each, one token/s per instance). A: a1 $1 or a2 $2; B: b1 $1 or b2 $3; a1 and b1 share
    a row of `shared` nodes; C: c1 $1 on its own row of 9 nodes. Alone each key takes its $1 column twice."""
    cost = np.array([1.0, 2.0, 1.0, 3.0, 1.0])
    #            demand A, demand B, demand C, shared, C's row
    entries = [(0, 0), (3, 0), (0, 1), (1, 2), (3, 2), (1, 3), (2, 4), (4, 4)]
    rows, cols = (np.array(v) for v in zip(*entries, strict=True))
    n = len(cost)
    return solver.Problem(cost, np.full(n, 10.0), np.ones(n, dtype=bool), rows, cols, np.ones(len(entries)),
                          np.array([2.0, 2.0, 2.0, -np.inf, -np.inf]), np.array([np.inf, np.inf, np.inf, shared, 9.0]),
                          np.zeros(n, dtype=bool), np.zeros(n), np.full(n, -1), np.zeros(n, dtype=bool))


def test_separate_optima_golden() -> None:
    """Room for both keys' cheap columns: the three separate optima are the answer ($6). One node short: A and B
    overflow the shared row, are merged and solved jointly — B keeps both cheap nodes (it saves $2 a node, A $1) —
    while C stays apart: $7, as the plain MIP finds."""
    fit = solver.solve_block(hand_problem(4.0), gap=1e-9)
    assert fit.objective == pytest.approx(6.0) and fit.bound == pytest.approx(6.0)
    assert fit.notes == ["3 parts solved separately (3 after merging) fit the shared rows together (bound 6)"]
    short = hand_problem(3.0)
    merged = solver.separate_optima(short, time_limit=10, gap=1e-9, start=None)
    assert merged is not None and merged.n_initial == 3 and len(merged.parts) == 2
    assert merged.x.tolist() == pytest.approx([1, 1, 2, 0, 2]) and merged.bounds.sum() == pytest.approx(7.0)
    out = solver.solve_block(short, gap=1e-9)
    plain = solver.solve_block(short, gap=1e-9, reduce=False)
    assert out.objective == pytest.approx(7.0) == plain.objective
    assert "after merging" in out.notes[0]


@pytest.mark.parametrize("seed", range(12))
def test_separate_optima_are_lossless(seed: int) -> None:
    """Three models (six keys) on scarce random availability — the seeds cover optima that fit at once, fit after
    merging, and overflow to the end: the shipped solve equals the solve without separate optima and the plain MIP."""
    models = ["a", "b", "c"]
    lib = random_library(100 + seed, models)
    sc = scenario(models, rates=[6.0, 4.0, 5.0])
    av = avail(int(np.random.default_rng(seed).integers(2, 7)))
    costs = []
    for separate, reduce in ((True, True), (False, True), (False, False)):
        solver.SEPARATE = separate
        try:
            plan = allocate(lib, sc, availability=av, gap=1e-9, reduce=reduce)
        except InfeasibleDemand:
            costs.append(None)
            continue
        finally:
            solver.SEPARATE = True
        check_plan(plan, av)
        costs.append(plan.cost_per_hour)
    assert costs[0] == pytest.approx(costs[1], rel=1e-9) and costs[0] == pytest.approx(costs[2], rel=1e-9)


def test_gap_budget_golden() -> None:
    """Parts costing 2 (bound 1.9) and 3 (bound 3), the merged last part bounded by 4: at 10 % the whole may be
    0.1 · (2 + 3 + 4) = 0.9 off, of which 0.1 is spent, so the last part may close at 0.8; at 1 % nothing is left."""
    cost, x = np.ones(4), np.array([2.0, 3.0, 0.0, 5.0])
    parts, bounds = [np.array([0]), np.array([1]), np.array([2, 3])], np.array([1.9, 3.0, 4.0])
    assert solver.gap_budget(cost, x, parts, bounds, 0.1) == pytest.approx(0.8)
    assert solver.gap_budget(cost, x, parts, bounds, 0.01) == 0.0


@pytest.mark.parametrize("seed", range(12))
def test_separate_optima_keep_the_requested_gap(seed: int) -> None:
    """At a loose gap (2 %) the merged parts close at the whole's unused gap: the plan is still within 2 % of the
    exact optimum, and the reported bound is a true lower bound."""
    models = ["a", "b", "c"]
    lib = random_library(100 + seed, models)
    sc = scenario(models, rates=[6.0, 4.0, 5.0])
    av = avail(int(np.random.default_rng(seed).integers(2, 7)))
    try:
        exact = allocate(lib, sc, availability=av, gap=1e-9, reduce=False)
    except InfeasibleDemand:
        return
    loose = allocate(lib, sc, availability=av, gap=0.02)
    check_plan(loose, av)
    assert loose.solve.gap is not None and loose.solve.gap <= 0.02 + 1e-9
    assert loose.cost_per_hour <= exact.cost_per_hour * 1.02 + 1e-9
    assert loose.solve.bound is not None and loose.solve.bound <= exact.cost_per_hour + 1e-6


# --- properties ----------------------------------------------------------------------------------------------
@given(st.integers(0, 10_000), st.integers(3, 10), st.integers(1, 6))
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_more_availability_and_templates_never_cost_more(seed: int, n_avail: int, extra: int) -> None:
    models = ["a"]
    lib = random_library(seed, models, n=10)
    sc = scenario(models, rates=[2.0])
    try:
        base = allocate(lib, sc, availability=avail(n_avail), gap=1e-9)
    except InfeasibleDemand:
        return
    check_plan(base, avail(n_avail))
    assert all(float(n).is_integer() for n in [len(base.instances)])
    more = allocate(lib, sc, availability=avail(n_avail + extra), gap=1e-9)
    assert more.cost_per_hour <= base.cost_per_hour * (1 + 1e-9)
    extra_lib = random_library(seed + 1, models, n=10)
    both = TemplateLibrary.from_templates(
        CONFIGS, [lib.template(i) for i in range(len(lib))] + [extra_lib.template(i) for i in range(len(extra_lib))], {})
    assert allocate(both, sc, availability=avail(n_avail), gap=1e-9).cost_per_hour <= base.cost_per_hour * (1 + 1e-9)


# --- slack priced ----------------------------------------------------------------------------------------------
def test_slack_priced_golden() -> None:
    """Solved by hand. Prefill demand 500 tok/s; 1xL4 (100 tok/s, $0.8048/h) and 1xA10G (200 tok/s, $1.006/h) in
    aws-us-east-2. Cost alone: 1 L4 + 2 A10G = 500 tok/s at $2.8168 (3 A10G: 600 at $3.018; 5 L4: $4.024).
    Slack priced (15 % of demand, i.e. 75 tok/s, worth 0.8 x the cheapest rate $1.006/200 per tok/s): 1 L4 + 2
    A10G carries none, so its objective is 2.8168 + 0.8 x 0.00503 x 75 = 3.1186, above 3 A10G's 3.018 (100 tok/s
    of slack, all 75 valued): the plan $0.20/h dearer that carries 20 % more capacity wins. Decode (20 tok/s,
    one 1xL4 of 1000) is the same in both."""
    from coral.allocation.core import SlackPrice

    rows = [template("a", Phase.PREFILL, {"1xL4": 1}, 100.0), template("a", Phase.PREFILL, {"1xA10G": 1}, 200.0),
            template("a", Phase.DECODE, {"1xL4": 1}, 1000.0)]
    lib = TemplateLibrary.from_templates(CONFIGS, rows, {})
    sc = scenario(["a"])
    demand = {("a", Phase.PREFILL): 500.0, ("a", Phase.DECODE): 20.0}

    def prefill(plan: Plan) -> dict[str, int]:
        got: dict[str, int] = {}
        for inst in plan.instances:
            if inst.phase == "prefill":
                for c, n in inst.counts.items():
                    got[c] = got.get(c, 0) + n
        return got

    plain = allocate(lib, sc, demand=demand, availability=UNLIMITED)
    priced = allocate(lib, sc, demand=demand, availability=UNLIMITED, slack=SlackPrice(share=0.15, price=0.8))
    assert prefill(plain) == {"1xL4": 1, "1xA10G": 2} and plain.cost_per_hour == pytest.approx(2.8168 + 0.8048)
    assert prefill(priced) == {"1xA10G": 3} and priced.cost_per_hour == pytest.approx(3.018 + 0.8048)
    assert any("slack priced" in n for n in priced.solve.notes)
    # worth less than the $0.20/h it costs (0.5 x 0.00503 x 75 = 0.189): the cost plan stays
    cheap = allocate(lib, sc, demand=demand, availability=UNLIMITED, slack=SlackPrice(share=0.15, price=0.5))
    assert prefill(cheap) == {"1xL4": 1, "1xA10G": 2}
    with pytest.raises(CoralInputError, match="slack price"):
        SlackPrice(price=1.0)


@given(st.integers(0, 10_000), st.integers(2, 8), st.floats(0.3, 3.0))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_slack_priced_meets_demand_and_costs_at_most_its_worth_more(seed: int, n_avail: int, scale: float) -> None:
    """Pricing slack keeps every demand met and availability respected, and costs no less than the cost optimum
    and at most share x price more (its worth is at most share x price x Σ_k cheapest rate_k x D_k, which no
    plan meeting the demand undercuts)."""
    from coral.allocation.core import SlackPrice

    models = ["a", "b"]
    lib = random_library(seed, models, n=8)
    sc = scenario(models, rates=[2.0, 1.0])
    demand = demand_of(sc, scale)
    slack = SlackPrice(share=0.15, price=0.8)
    try:
        plain = allocate(lib, sc, demand=demand, availability=avail(n_avail), gap=1e-9)
    except InfeasibleDemand:
        return
    priced = allocate(lib, sc, demand=demand, availability=avail(n_avail), gap=1e-9, slack=slack)
    check_plan(priced, avail(n_avail))
    assert plain.cost_per_hour * (1 - 1e-6) <= priced.cost_per_hour
    assert priced.cost_per_hour <= plain.cost_per_hour * (1 + slack.share * slack.price) + 1e-6


def test_scale_down_is_never_penalised_and_scale_up_is() -> None:
    models = ["a"]
    lib = random_library(3, models)
    sc = scenario(models, rates=[4.0], k=0.5)
    high = allocate(lib, sc, availability=UNLIMITED, gap=1e-9)
    low_sc = scenario(models, rates=[1.0], k=0.5)
    low_fresh = allocate(lib, low_sc, availability=UNLIMITED, gap=1e-9)
    low_from_high = allocate(lib, low_sc, availability=UNLIMITED, running=high, gap=1e-9)
    # keeping (a subset of) what runs is free, so the plan never pays more than the running cost
    assert low_from_high.solve.objective is not None
    assert low_from_high.solve.objective <= high.cost_per_hour + 1e-9
    assert low_from_high.solve.objective <= low_fresh.cost_per_hour * 1.5 + 1e-9
    assert low_from_high.solve.objective == pytest.approx(low_from_high.cost_per_hour + low_from_high.penalty_per_hour)
    up = allocate(lib, sc, availability=UNLIMITED, running=low_fresh, gap=1e-9)
    started = {}
    for i in up.instances:
        started[(i.template_id, i.region)] = started.get((i.template_id, i.region), 0) + 1
    for i in low_fresh.instances:
        started[(i.template_id, i.region)] = started.get((i.template_id, i.region), 0) - 1
    expect = sum(0.5 * next(i.cost_per_hour for i in up.instances if (i.template_id, i.region) == key) * max(0, n)
                 for key, n in started.items() if n > 0)
    assert up.penalty_per_hour == pytest.approx(expect)
    assert up.solve.objective == pytest.approx(up.cost_per_hour + up.penalty_per_hour)


def test_running_plan_is_kept_when_it_is_optimal() -> None:
    lib = random_library(5, ["a"])
    sc = scenario(["a"], rates=[2.0], k=0.3)
    first = allocate(lib, sc, availability=UNLIMITED, gap=1e-9)
    again = allocate(lib, sc, availability=UNLIMITED, running=first, gap=1e-9)
    assert again.penalty_per_hour == 0.0
    assert again.cost_per_hour == pytest.approx(first.cost_per_hour)


# --- scarcity ------------------------------------------------------------------------------------------------
def scarce_case() -> tuple[TemplateLibrary, Scenario, dict[str, dict[str, int]]]:
    rows = []
    for m in ("a", "b"):
        for phase in Phase:
            rows.append(template(m, phase, {"1xL4": 1}, 100.0))
    lib = TemplateLibrary.from_templates(CONFIGS, rows, {})
    sc = scenario(["a", "b"], rates=[1.0, 1.0])  # prefill 100 tok/s, decode 20 tok/s per model
    av = {REGIONS[0]: {"1xL4": 3}, REGIONS[1]: {}}
    return lib, sc, av


def test_infeasible_cost_mode_names_models_and_configs() -> None:
    lib, sc, av = scarce_case()
    dem = {("a", Phase.PREFILL): 300.0, ("a", Phase.DECODE): 20.0, ("b", Phase.PREFILL): 300.0,
           ("b", Phase.DECODE): 20.0}
    with pytest.raises(InfeasibleDemand) as err:
        allocate(lib, sc, demand=dem, availability=av)
    assert ("aws-us-east-2", "1xL4") in err.value.configs
    assert {("a", Phase.PREFILL), ("b", Phase.PREFILL)} <= set(err.value.models)
    assert "1xL4" in str(err.value)


def test_goodput_and_scaled_modes() -> None:
    lib, sc, av = scarce_case()
    # 8 nodes of demand (a: 3 prefill + 1 decode, b: 3 + 1) on 6 nodes
    av = {REGIONS[0]: {"1xL4": 6}, REGIONS[1]: {}}
    dem = {("a", Phase.PREFILL): 300.0, ("a", Phase.DECODE): 100.0, ("b", Phase.PREFILL): 300.0,
           ("b", Phase.DECODE): 100.0}
    fair = allocate(lib, sc, demand=dem, availability=av, mode="maxmin")
    fractions = {(s.model, s.phase): s.served_fraction for s in fair.serving}
    assert min(fractions.values()) == pytest.approx(2 / 3)
    check_plan(fair, av)
    # goodput: all 6 nodes serve (600 of 800 tok/s), every key keeps at least FAIRNESS x 2/3 of its demand
    good = allocate(lib, sc, demand=dem, availability=av, mode="goodput")
    assert sum(min(s.capacity, s.demand) for s in good.serving) == pytest.approx(600.0)
    assert min(s.served_fraction for s in good.serving) >= FAIRNESS * 2 / 3 - 1e-9
    assert allocate(lib, sc, demand=dem, availability=av, mode="goodput", fairness=1.0).cost_per_hour == \
        pytest.approx(fair.cost_per_hour)
    check_plan(good, av)
    scaled = allocate(lib, sc, demand=dem, availability=av, mode="scaled", scale_step=0.05)
    assert scaled.demand_scale == pytest.approx(0.65)
    check_plan(scaled, av)
    ample = allocate(lib, sc, demand=dem, availability=avail(20), mode="goodput")
    assert ample.cost_per_hour == pytest.approx(allocate(lib, sc, demand=dem, availability=avail(20)).cost_per_hour)


@pytest.mark.parametrize("mode", ["goodput", "maxmin"])
def test_goodput_priorities_weight_the_served_fraction(mode: Mode) -> None:
    lib, _, _ = scarce_case()
    sc = scenario(["a", "b"], priority=[2.0, 1.0])
    av = {REGIONS[0]: {"1xL4": 6}, REGIONS[1]: {}}
    dem = {("a", Phase.PREFILL): 400.0, ("a", Phase.DECODE): 0.0, ("b", Phase.PREFILL): 400.0,
           ("b", Phase.DECODE): 0.0}
    plan = allocate(lib, sc, demand=dem, availability=av, mode=mode)
    frac = {s.model: s.served_fraction for s in plan.serving if s.phase == "prefill"}
    assert frac["a"] == pytest.approx(1.0) and frac["b"] == pytest.approx(0.5)


# --- baselines -----------------------------------------------------------------------------------------------
def test_baselines_meet_demand_and_never_beat_coral() -> None:
    lib = random_library(11, ["a", "b"])
    sc = scenario(["a", "b"], rates=[2.0, 1.0])
    coral = allocate(lib, sc, availability=UNLIMITED, gap=1e-9)
    for plan in (baselines.homo_greedy(lib, sc, availability=UNLIMITED),
                 baselines.cauchy_paper(lib, sc, availability=UNLIMITED)):
        assert all(s.served_fraction == pytest.approx(1.0) for s in plan.serving)
        assert all(len(i.counts) == 1 for i in plan.instances)
        assert plan.cost_per_hour >= coral.cost_per_hour - 1e-9
    assert baselines.homo_greedy(lib, sc, availability=UNLIMITED).method == "homo-greedy"


def test_homo_degrades_under_scarcity() -> None:
    lib, sc, av = scarce_case()
    dem = {("a", Phase.PREFILL): 300.0, ("a", Phase.DECODE): 20.0, ("b", Phase.PREFILL): 300.0,
           ("b", Phase.DECODE): 20.0}
    plan = baselines.homo_greedy(lib, sc, demand=dem, availability=av)
    assert sum(i.n_nodes for i in plan.instances) == 3
    assert min(s.served_fraction for s in plan.serving) < 1


@pytest.mark.parametrize("seed", range(4))
def test_melange_special_case(seed: int) -> None:
    lib = random_library(seed, ["a"], n=8, homogeneous_only=True)
    single = [lib.template(i) for i in range(len(lib)) if lib.template(i).n_nodes == 1]
    lib1 = TemplateLibrary.from_templates(CONFIGS, single, {})
    sc = scenario(["a"], rates=[3.0])
    av = avail(5)
    try:
        coral = allocate(lib1, sc, availability=av, gap=1e-9)
    except InfeasibleDemand:
        return
    assert coral.cost_per_hour == pytest.approx(baselines.melange(lib1, sc, "a", availability=av), rel=1e-9)


# --- exactness: two-stage pipeline vs the joint formulation --------------------------------------------------
def tiny_tables(rng: np.random.Generator, n_cfg: int = 2, n_layers: int = 4, s_max: int = 3) -> np.ndarray:
    t = np.zeros((s_max, n_cfg, n_layers + 1))
    for s in range(s_max):
        for c in range(n_cfg):
            fits = int(rng.integers(1, n_layers + 1))
            vals = np.sort(rng.uniform(10, 100, n_layers))[::-1]
            t[s, c, 1:fits + 1] = vals[:fits]
    return t


def pipeline_library(tables: np.ndarray, configs: list[str], n_max: int) -> TemplateLibrary:
    rows = []
    for size in range(1, n_max + 1):
        sets = np.array(list(itertools.combinations_with_replacement(range(len(configs)), size)))
        padded = np.zeros((len(sets), n_max), dtype=np.int64)
        padded[:, :size] = sets
        thr, part, layers = solve_node_sets(padded, np.full(len(sets), size), tables)
        labels, _ = set_partitions(size)
        for i, nodes in enumerate(sets):
            if thr[i] <= 0:
                continue
            lab = labels[part[i]]
            stages = []
            for s in range(int(lab.max()) + 1):
                members = [configs[int(nodes[k])] for k in range(size) if lab[k] == s]
                stages.append(Stage(int(layers[i, s]), tuple(members), tuple(1.0 for _ in members)))
            counts: dict[str, int] = {}
            for k in nodes:
                counts[configs[int(k)]] = counts.get(configs[int(k)], 0) + 1
            rows.append(Template(0, "a", Phase.PREFILL, 1000, counts, tuple(stages), float(thr[i])))
    return TemplateLibrary.from_templates(configs, rows, {})


@pytest.mark.parametrize("seed", range(5))
def test_two_stage_pipeline_equals_joint_formulation(seed: int) -> None:
    rng = np.random.default_rng(seed)
    configs = ["1xL4", "1xA10G"]
    tables = tiny_tables(rng)
    lib = pipeline_library(tables, configs, 3)
    demand = float(rng.uniform(50, 400))
    caps = [{c: int(rng.integers(1, 6)) for c in configs} for _ in REGIONS]
    cat = builtin_catalog()
    prices = [{i: cat.prices(r)[c] for i, c in enumerate(configs)} for r in REGIONS]
    ref = joint_cost(tables, 3, prices, [{i: cap[c] for i, c in enumerate(configs)} for cap in caps], demand)
    sc = Scenario(name="tiny", regions=REGIONS, configs=configs, availability={"mode": "headroom", "factor": 1.0},
                  models=[ScenarioModel(model="a", prefill_slo_ms=1000, decode_slo_ms=50, request_rate=1,
                                        mean_input_tokens=100, mean_output_tokens=20)])
    av = {r: cap for r, cap in zip(REGIONS, caps, strict=True)}
    dem = {("a", Phase.PREFILL): demand, ("a", Phase.DECODE): 0.0}
    if ref is None:
        with pytest.raises(InfeasibleDemand):
            allocate(lib, sc, demand=dem, availability=av)
        return
    plan = allocate(lib, sc, demand=dem, availability=av, gap=1e-12)
    assert plan.cost_per_hour == pytest.approx(ref, rel=1e-9)


# --- availability --------------------------------------------------------------------------------------------
def test_headroom_availability_rule() -> None:
    sc = scenario(["a"])
    out = headroom_availability(sc, {"1xL4": 4, "4xL4": 1}, 1.25)
    assert out["aws-us-east-2"]["1xL4"] == 3 and out["aws-ap-northeast-2"]["1xL4"] == 3  # ceil(1.25*4/2)
    assert out["aws-us-east-2"]["4xL4"] == 1 and out["aws-us-east-2"]["1xA10G"] == 0


def test_plan_roundtrip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    lib = random_library(2, ["a"])
    plan = allocate(lib, scenario(["a"]), availability=UNLIMITED)
    assert Plan.load(plan.save(tmp_path / "p.json")) == plan
    assert plan.solve.status == "Optimal" and plan.solve.gap is not None and plan.solve.gap <= 1e-4


@pytest.mark.parametrize("time_limit", [0.0, 0.01])
def test_time_limit_returns_best_incumbent_and_no_bound_it_did_not_prove(time_limit: float) -> None:
    """Out of time (always at 0 s; at 0.01 s on a loaded machine HiGHS then reported a bound of -inf and a gap of
    inf, which the report refused): the warm start comes back as the plan, its report
    gives no bound and no gap rather than infinite ones, and says the safety net acted (on an idle machine the LP
    bound may still prove the warm start optimal: then no stage counts as stopped)."""
    lib = random_library(8, ["a", "b"], n=30)
    sc = scenario(["a", "b"], rates=[5.0, 4.0])
    plan = allocate(lib, sc, availability=UNLIMITED, time_limit=time_limit)
    check_plan(plan, None)
    solve = plan.solve
    assert solve.objective is not None and (solve.bound is None) == (solve.gap is None)
    assert solve.bound is None or solve.bound <= solve.objective + 1e-9
    assert bool(solve.stopped) == (solve.status != "Optimal")  # a plan proved optimal anyway names no stage
    if time_limit == 0.0:
        assert solve.safety_net


def test_explicit_availability_and_bad_inputs() -> None:
    from coral.allocation.allocator import resolve_availability
    from coral.catalog.loader import CoralInputError

    lib = random_library(1, ["a"])
    sc = scenario(["a"]).model_copy(update={"availability": {REGIONS[0]: {"1xL4": 2}}})
    assert resolve_availability(sc, lib) == {REGIONS[0]: {"1xL4": 2}, REGIONS[1]: {}}
    with pytest.raises(CoralInputError, match="mode"):
        allocate(lib, sc, mode="cheap")  # type: ignore[arg-type]
    with pytest.raises(CoralInputError, match="region"):
        allocate(lib, sc, availability={"mars": {"1xL4": 1}})
    with pytest.raises(CoralInputError, match="demand"):
        allocate(lib, sc, availability=UNLIMITED, demand={("a", Phase.PREFILL): -1.0})


def test_planned_capacity_is_traffic_times_headroom() -> None:
    """The scenario's capacity to plan is mean traffic × headroom: 1 / target_utilization where a phase sets one
    (the explicit override), else the burst factor of the model's traffic; an explicit demand is used as given."""
    from coral.allocation.allocator import _keys_and_demand
    from coral.allocation.demand import headroom, scenario_traffic
    from coral.catalog.loader import load_scenario
    from coral.catalog.schema import TargetUtilization

    sc = load_scenario("core")
    keys, burst = _keys_and_demand(sc, None)
    traffic, room = scenario_traffic(sc), headroom(sc)
    assert np.allclose(burst, [traffic[k] * room[k] for k in keys]) and all(room[k] > 1 for k in keys)
    fixed = sc.model_copy(update={"target_utilization": TargetUtilization(prefill=0.55, decode=0.8)})
    _, part = _keys_and_demand(fixed, None)
    target = np.array([0.55 if str(p) == "prefill" else 0.8 for _, p in keys])
    assert np.allclose(part, [traffic[k] for k in keys] / target)
    _, explicit = _keys_and_demand(sc, {keys[0]: 110.0})
    assert explicit.tolist() == [110.0]


# --- infeasible only when it is: phase one, regressions, parity with the plain formulation ------------------
def seeded_out_problem(reachable: bool) -> solver.Problem:
    """Twelve $1 columns of one group: the eight seeded ones (highest score) may not be used (a row of 0 nodes),
    and a covering row Σ x ≥ 1 without slack (like a rounding cut). `reachable`: the last four are free of the
    0-node row, so the optimum is $1; otherwise no column can cover the row."""
    n = 12
    blocked = np.arange(n if not reachable else 9)
    rows = np.concatenate([np.zeros(n, dtype=np.int64), np.ones(len(blocked), dtype=np.int64)])
    cols = np.concatenate([np.arange(n), blocked])
    return solver.Problem(np.ones(n), np.full(n, 10.0), np.ones(n, dtype=bool), rows, cols, np.ones(len(rows)),
                          np.array([1.0, -np.inf]), np.array([np.inf, 0.0]), np.zeros(n, dtype=bool),
                          -np.arange(n, dtype=float), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool))


def test_restricted_lp_infeasible_prices_in_the_columns_that_cover_it() -> None:
    out = solver.solve_block(seeded_out_problem(True), gap=1e-9)
    assert out.objective == pytest.approx(1.0) and out.x is not None and out.x[9:].sum() == pytest.approx(1.0)
    none = solver.solve_block(seeded_out_problem(False), gap=1e-9)
    assert none.x is None and none.status == "Infeasible"
    assert none.row_dual is not None and none.row_dual[0] > 0 and none.row_dual[1] < 0  # the rows that bind


def served_total(plan: Plan) -> float:
    return sum(min(s.capacity, s.demand) for s in plan.serving)


def goodput_of(plan: Plan) -> float:
    """Generated tokens/s a plan serves: per model, its decode demand × the least share served of its phases."""
    least: dict[str, float] = {}
    for s in plan.serving:
        least[s.model] = min(least.get(s.model, 1.0), s.served_fraction)
    decoding = {s.model for s in plan.serving if s.phase == Phase.DECODE and s.demand > 0}
    return sum(s.demand * least[s.model] for s in plan.serving if s.phase == Phase.DECODE or s.model not in decoding)


def nodes_of(plan: Plan) -> dict[str, dict[str, int]]:
    used: dict[str, dict[str, int]] = {r: {} for r in REGIONS}
    for inst in plan.instances:
        for c, n in inst.counts.items():
            used[inst.region][c] = used[inst.region].get(c, 0) + n
    return used


@given(st.integers(0, 10_000), st.floats(0.05, 3.0), st.sampled_from(["cost", "goodput", "maxmin", "scaled"]))
@example(3243, 0.125, "goodput")  # the reference's floor of 1e-6 for a kept model did not keep it (see below)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_allocator_matches_the_plain_formulation(seed: int, factor: float, mode: Mode) -> None:
    """Random small libraries × availability (factor × the unlimited plan's nodes, the headroom rule) × every
    mode: the allocator raises only where the plain formulation (`reference.plain_solve`) has no solution, and
    each stage's objective is the reference's within the requested gap."""
    from coral.allocation.reference import plain_solve

    rng = np.random.default_rng(seed)
    models = ["a", "b"]
    lib = random_library(seed, models, n=5)
    sc = scenario(models)
    dem = {(m, p): float(rng.uniform(50, 600) if p == Phase.PREFILL else rng.uniform(20, 300))
           for m in models for p in Phase}
    est: dict[str, int] = {}
    for inst in allocate(lib, sc, demand=dem, availability=UNLIMITED, gap=1e-9).instances:
        for c, n in inst.counts.items():
            est[c] = est.get(c, 0) + n
    av = headroom_availability(sc, est, factor)
    gap = 1e-6

    def ref(**kw: object) -> float | None:
        return plain_solve(lib, sc, av, demand=dem, **kw).objective  # type: ignore[arg-type]

    t_ref = -(ref(objective="maxmin") or 0.0)
    if mode == "cost":
        cost = ref()
        if cost is None:
            with pytest.raises(InfeasibleDemand):
                allocate(lib, sc, demand=dem, availability=av, gap=gap)
            return
        plan = allocate(lib, sc, demand=dem, availability=av, gap=gap)
        assert cost - 1e-6 <= plan.cost_per_hour <= cost * (1 + gap) + 1e-6
        check_plan(plan, av)
        return
    scale = t_ref if mode != "scaled" else np.floor(t_ref / 0.05 + 1e-9) * 0.05
    if mode != "goodput" and scale <= 0:
        with pytest.raises(InfeasibleDemand):
            allocate(lib, sc, demand=dem, availability=av, mode=mode, gap=gap)
        return
    plan = allocate(lib, sc, demand=dem, availability=av, mode=mode, gap=gap)
    check_plan(plan, av)
    least = min(s.served_fraction for s in plan.serving)
    if mode == "goodput":
        best = -(ref(objective="goodput", fraction=FAIRNESS * t_ref) or 0.0)
        if t_ref <= 0:  # not every model can have a share: the allocator keeps the models its coverage can above 0
            # (tests/test_scarcity.py checks how many; which ones among sets of that size is a tie-break), then
            # the most goodput with them: the reference keeps the same models above 0 (by a floor of 1e-3: one of
            # 1e-6 is within HiGHS's feasibility tolerance, and the reference served another model instead)
            kept = {m for m in models if all(s.served_fraction > 0 for s in plan.serving if s.model == m)}
            best = -(ref(objective="goodput", fraction={(m, p): 1e-3 if m in kept else 0.0
                                                        for m in models for p in Phase}) or 0.0)
        assert goodput_of(plan) >= best * (1 - gap) - 1e-6 and least >= FAIRNESS * t_ref - 1e-6
        fractions = {(s.model, Phase(s.phase)): s.served_fraction * (1 - 1e-9) for s in plan.serving}
    else:
        assert least >= scale - 1e-6 and (mode == "scaled" or least == pytest.approx(t_ref, abs=1e-6))
        assert plan.demand_scale == pytest.approx(scale if mode == "scaled" else 1.0)
        fractions = dict.fromkeys(dem, scale * (1 - 1e-9))
    cost = ref(fraction=fractions)
    assert cost is not None and plan.cost_per_hour <= cost * (1 + gap) + 1e-6


@pytest.mark.parametrize("seed", range(4))
def test_cost_mode_on_the_cluster_of_its_own_plan(seed: int) -> None:
    """A fixed cluster holding exactly the unlimited optimum's nodes: all demand fits, so cost mode finds a plan
    at the same cost (it used to report 'at most 100.0 % of demand can be served')."""
    models = ["a", "b", "c"]
    lib = random_library(200 + seed, models)
    sc = scenario(models, rates=[6.0, 4.0, 5.0])
    free = allocate(lib, sc, availability=UNLIMITED, gap=1e-9)
    fixed = allocate(lib, sc, availability=nodes_of(free), gap=1e-9)
    assert fixed.cost_per_hour == pytest.approx(free.cost_per_hour, rel=1e-9)


@pytest.mark.parametrize("seed", range(8))
def test_repaired_lp_point_is_feasible(seed: int) -> None:
    """The fallback incumbent (LP point rounded down, then repaired) meets every row of the cost MILP, running
    plans (scale-up penalty rows) included, whenever it is found; on these cases it is found."""
    models = ["a", "b", "c"]
    lib = random_library(300 + seed, models)
    sc = scenario(models, rates=[6.0, 4.0, 5.0], k=0.3)
    av = avail(int(np.random.default_rng(seed).integers(4, 9)))
    free = allocate(lib, sc, availability=UNLIMITED, gap=1e-9)
    from coral.allocation.allocator import _context
    from coral.allocation.core import assemble

    ctx = _context(lib, sc, None, av, None, free, True)
    problem, _ = assemble(ctx.cols, ctx.market, ctx.demand, penalty_k=ctx.penalty_k)
    lp, cols, _ = solver._lp(problem, solver._seed(problem, None), 10.0)
    assert lp.x is not None
    x = np.zeros(problem.n)
    x[cols] = lp.x
    fixed = solver.repair(problem, x)
    assert fixed is not None and problem.violation(fixed) <= 1e-9
    assert np.allclose(fixed[problem.integer], np.round(fixed[problem.integer]))


@pytest.mark.parametrize("mode", ["cost", "goodput", "maxmin", "scaled"])
def test_a_tiny_time_limit_still_returns_a_plan(mode: Mode) -> None:
    """With almost no time every stage keeps its warm start (greedy plan, the previous stage's plan or the
    repaired LP point): a plan within availability comes back instead of an 'infeasible' verdict."""
    models = ["a", "b", "c"]
    lib = random_library(21, models, n=30)
    sc = scenario(models, rates=[6.0, 4.0, 5.0])
    free = allocate(lib, sc, availability=UNLIMITED, gap=1e-9)
    cluster = nodes_of(free)
    if mode != "cost":  # scarce: half of the unlimited optimum's nodes
        cluster = {r: {c: n // 2 for c, n in cs.items()} for r, cs in cluster.items()}
    plan = allocate(lib, sc, availability=cluster, mode=mode, time_limit=0.01)
    check_plan(plan, {r: {c: cluster[r].get(c, 0) for c in CONFIGS} for r in REGIONS})
    assert plan.instances and (mode != "cost" or min(s.served_fraction for s in plan.serving) == pytest.approx(1.0))


def test_cost_mode_stopped_before_any_plan_returns_the_max_min_plan_that_serves_all(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a loaded machine the cost stage's safety net can stop it before it has any plan (seen: a 0.01 s limit
    beside two busy processes). When the max-min stage then serves every key in full, demand can be met: cost
    mode returns a plan within availability, says why, and does not raise 'infeasible' (it did)."""
    from coral.allocation import allocator

    models = ["a", "b", "c"]
    lib = random_library(21, models, n=30)
    sc = scenario(models, rates=[6.0, 4.0, 5.0])
    cluster = nodes_of(allocate(lib, sc, availability=UNLIMITED, gap=1e-9))
    real = allocator._solve_cost
    calls = []

    def stopped_first(*args: object, **kwargs: object) -> allocator._Stage:
        stage = real(*args, **kwargs)  # type: ignore[arg-type]
        calls.append(stage)
        if len(calls) > 1:
            return stage
        out = solver.Outcome("time limit", None, None, None, None, 0.0, stage.out.n_cols, stage.out.n_rows,
                             safety_net="the wall-clock time limit had run out")
        return allocator._Stage(out, stage.layout, np.zeros_like(stage.served))

    monkeypatch.setattr(allocator, "_solve_cost", stopped_first)
    plan = allocate(lib, sc, availability=cluster)
    check_plan(plan, {r: {c: cluster[r].get(c, 0) for c in CONFIGS} for r in REGIONS})
    assert min(s.served_fraction for s in plan.serving) == pytest.approx(1.0)
    assert any("cost stage found no plan" in n for n in plan.solve.notes)
    assert plan.solve.safety_net


@pytest.mark.parametrize("seed", range(30))
def test_final_mip_on_few_columns_keeps_a_true_bound(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Short of time past FULL_MIP_COLUMNS, the final MIP keeps the columns of least reduced cost: the plan stays
    feasible and the reported bound stays a lower bound on the true optimum (the restricted MIP's own bound is
    not used)."""
    models = ["a", "b", "c"]
    lib = random_library(400 + seed, models, n=30)
    sc = scenario(models, rates=[6.0, 4.0, 5.0])
    av = avail(int(np.random.default_rng(seed).integers(3, 8)))
    try:
        exact = allocate(lib, sc, availability=av, gap=1e-9)
    except InfeasibleDemand:
        return
    monkeypatch.setattr(solver, "FULL_MIP_COLUMNS", 2)
    monkeypatch.setattr(solver, "MIP_S_PER_COLUMN", 1e3)
    monkeypatch.setattr(solver, "SEPARATE", False)
    few = allocate(lib, sc, availability=av, gap=1e-9)
    check_plan(few, av)
    assert few.solve.bound is not None and few.solve.bound <= exact.cost_per_hour + 1e-6
    assert few.cost_per_hour >= exact.cost_per_hour - 1e-6


def test_water_fill_serves_every_key_where_greedy_starves_one() -> None:
    """Hand-solved: one region with 4 × 1xL40S; key a's instance (1 node) serves 100 tok/s, key b's (1 node)
    50 tok/s; demand a = 400, b = 100. The greedy plan (largest demand first) gives a all four nodes and b none;
    water-filling gives the least served key the next node: a (0 → 25 %), b (0 → 50 %), a (→ 50 %), then a on
    the tie (→ 75 %): a at 75 %, b at 50 %, the max-min optimum t = 0.5."""
    from coral.allocation import core
    from coral.allocation.allocator import _context

    lib = TemplateLibrary.from_templates(CONFIGS, [template("a", Phase.DECODE, {"1xL40S": 1}, 100.0),
                                                   template("b", Phase.DECODE, {"1xL40S": 1}, 50.0)], {})
    sc = scenario(["a", "b"])
    av = {REGIONS[0]: {**dict.fromkeys(CONFIGS, 0), "1xL40S": 4}, REGIONS[1]: dict.fromkeys(CONFIGS, 0)}
    ctx = _context(lib, sc, {("a", Phase.DECODE): 400.0, ("b", Phase.DECODE): 100.0}, av, None, None, True)
    served = {}
    for name, x in (("greedy", core.greedy(ctx.cols, ctx.market, ctx.demand, partial=True)),
                    ("water", core.water_fill(ctx.cols, ctx.market, ctx.demand))):
        assert x is not None
        cap = np.bincount(ctx.cols.key, ctx.cols.throughput * x, minlength=2)
        served[name] = {ctx.keys[k][0]: float(cap[k] / ctx.demand[k]) for k in range(2)}
    assert served["greedy"] == {"a": 1.0, "b": 0.0}
    assert served["water"] == {"a": 0.75, "b": 0.5}
    plan = allocate(lib, sc, demand={("a", Phase.DECODE): 400.0, ("b", Phase.DECODE): 100.0}, availability=av,
                    mode="maxmin")
    assert min(s.served_fraction for s in plan.serving) == pytest.approx(0.5)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), factor=st.sampled_from([0.3, 0.6, 1.0]))
def test_water_fill_from_an_lp_point_is_feasible(seed: int, factor: float) -> None:
    """The max-min rounder's point (an LP optimum rounded down, then water-filled) respects every availability
    row and serves at least what the rounded-down point served."""
    from coral.allocation import core
    from coral.allocation.allocator import _context

    models = ["a", "b", "c"]
    lib = random_library(seed, models, n=6)
    sc = scenario(models, rates=[3.0, 2.0, 4.0])
    ctx = _context(lib, sc, None, UNLIMITED, None, None, True)
    x_free = core.greedy(ctx.cols, ctx.market, ctx.demand)
    assert x_free is not None
    used = np.zeros_like(ctx.market.avail)
    np.add.at(used, ctx.cols.region, ctx.cols.counts * x_free[:, None])
    av = {r: {c: int(np.floor(factor * used.sum(axis=0)[i] / len(REGIONS))) for i, c in enumerate(ctx.market.configs)}
          for r in REGIONS}
    ctx = _context(lib, sc, None, av, None, None, True)
    lp = np.random.default_rng(seed).uniform(0, 1.5, len(ctx.cols))  # any point; its floor must fit to be a base
    base = np.floor(lp)
    fill = np.zeros_like(ctx.market.avail)
    for j in np.argsort(-lp):
        while base[j] > 0 and (fill[ctx.cols.region[j]] + base[j] * ctx.cols.counts[j] > ctx.market.avail[ctx.cols.region[j]]).any():
            base[j] -= 1
        fill[ctx.cols.region[j]] += base[j] * ctx.cols.counts[j]
    x = core.water_fill(ctx.cols, ctx.market, ctx.demand, base=base)
    used = np.zeros_like(ctx.market.avail)
    np.add.at(used, ctx.cols.region, ctx.cols.counts * x[:, None])
    assert (used <= ctx.market.avail + 1e-9).all() and (x >= base).all()
