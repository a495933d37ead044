"""Per-model composition of the search's rounds: the exact choice of parts (hand-solved, and against brute force),
the composed plan, the premise that a model's simulated attainment depends on its own instances only (the real
simulator on core), and the composed round in the search."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from toy_search import NEEDED, toy_evaluator, toy_planner, toy_scenario

from coral.allocation.allocator import allocate
from coral.allocation.availability import PLENTY
from coral.allocation.demand import scenario_traffic
from coral.allocation.plan import ModelServing, Plan, PlanInstance, SolveReport
from coral.catalog.loader import load_scenario
from coral.perf.model import Phase
from coral.planning.compose import (
    Part,
    availability_limits,
    cheapest_parts,
    composed_plan,
    leftover,
    part_of,
    seen_limits,
)
from coral.planning.slo_search import Planner, SearchSettings, binds, search_plan
from coral.simulation.run import simulate
from coral.templates.store import load_library
from coral.workload.traces import workload_for

L40S = ("r1", "1xL40S")


def _part(model: str, cost: float, nodes: dict[tuple[str, str], int], index: int = 0) -> Part:
    plan = Plan(scenario="t", method="t", instances=[], serving=[], cost_per_hour=cost,
                solve={"status": "t"})  # type: ignore[arg-type]
    return Part(model, index, plan, cost, nodes)


def test_cheapest_parts_by_hand() -> None:
    # a: $10 on 2 L40S or $15 on none; b: $8 on 2 L40S or $20 on none; 2 L40S in all.
    # a1+b1 = $18 needs 4 L40S; a1+b2 = $30, a2+b1 = $23, a2+b2 = $35: the cheapest that fits is a2+b1
    a1, a2 = _part("a", 10, {L40S: 2}), _part("a", 15, {})
    b1, b2 = _part("b", 8, {L40S: 2}), _part("b", 20, {})
    options = {"a": [a1, a2], "b": [b1, b2]}
    assert cheapest_parts(options, {L40S: 2}) == [a2, b1]
    assert cheapest_parts(options, None) == [a1, b1]  # unlimited
    assert cheapest_parts(options, {L40S: 4}) == [a1, b1]
    assert cheapest_parts(options, {}) == [a2, b2]  # a config no region lists: none
    assert cheapest_parts({"a": [a1], "b": [b1]}, {L40S: 3}) is None  # nothing fits
    assert cheapest_parts({"a": [a1], "b": []}, None) is None  # a model with no passing part


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=4),
                min_size=1, max_size=3),
       st.integers(0, 6), st.integers(0, 6))
def test_cheapest_parts_matches_brute_force(models: list[list[tuple[int, int, int]]], cap_x: int, cap_y: int) -> None:
    keys = (("r1", "x"), ("r2", "y"))
    options = {f"m{i}": [_part(f"m{i}", c, {keys[0]: x, keys[1]: y}, j) for j, (c, x, y) in enumerate(opts)]
               for i, opts in enumerate(models)}
    limits = {keys[0]: cap_x, keys[1]: cap_y}
    feasible = [sum(p.cost_per_hour for p in combo) for combo in itertools.product(*options.values())
                if all(sum(p.nodes.get(k, 0) for p in combo) <= limits[k] for k in keys)]
    got = cheapest_parts(options, limits)
    if not feasible:
        assert got is None
    else:
        assert got is not None and [p.model for p in got] == list(options)
        assert all(sum(p.nodes.get(k, 0) for p in got) <= limits[k] for k in keys)
        assert sum(p.cost_per_hour for p in got) == pytest.approx(min(feasible))


def test_limits_from_availability_and_from_the_plans_seen() -> None:
    assert availability_limits("unlimited") is None
    assert availability_limits({"r1": {"1xL40S": 2, "1xL4": 5}}) == {("r1", "1xL40S"): 2, ("r1", "1xL4"): 5}


@pytest.fixture(scope="module")
def core_plans() -> tuple[Plan, Plan]:
    """Two real plans on core: the mean traffic x2.5 and x1.2 (market unlimited)."""
    sc = load_scenario("core")
    lib = load_library("core", Path("out"))
    traffic = scenario_traffic(sc)
    return tuple(allocate(lib, sc, demand={k: v * f for k, v in traffic.items()}, availability="unlimited")
                 for f in (2.5, 1.2))  # type: ignore[return-value]


def test_composed_plan_takes_each_models_part(core_plans: tuple[Plan, Plan]) -> None:
    big, small = core_plans
    models = [m.model for m in load_scenario("core").models]
    parts = [part_of(big if m == models[0] else small, m, 0 if m == models[0] else 1) for m in models]
    plan = composed_plan(parts)
    for p in parts:
        assert [i.id for i in plan.instances if i.model == p.model] == [
            i.id for i in p.plan.instances if i.model == p.model]
        assert plan.request_classes.get(p.model) == p.plan.request_classes.get(p.model)
        assert [s.capacity for s in plan.serving if s.model == p.model] == [
            s.capacity for s in p.plan.serving if s.model == p.model]
    assert plan.cost_per_hour == pytest.approx(sum(i.cost_per_hour for i in plan.instances))
    assert plan.cost_per_hour == pytest.approx(sum(p.cost_per_hour for p in parts))
    assert plan.solve.notes == [f"composed: {models[0]} from round 1, " + ", ".join(
        f"{m} from round 2" for m in models[1:])]
    # no more nodes of a region and config than one of the plans used
    limits = seen_limits([big, small])
    assert all(n <= limits[k] for p in parts for k, n in p.nodes.items())


def test_a_models_attainment_depends_on_its_own_instances_only(core_plans: tuple[Plan, Plan]) -> None:
    """The premise of composition, in the real simulator: the plan made of phi-4's instances of one plan and the
    others' of another attains, per model, exactly what that model attained in its own plan."""
    sc = load_scenario("core")
    big, small = core_plans
    models = [m.model for m in sc.models]
    mixed = composed_plan([part_of(big if m == models[0] else small, m, 0) for m in models])
    requests = workload_for(sc, 600.0, 3, part="tune")
    runs = {name: simulate(p, sc, requests, duration_s=600.0, seed=3)
            for name, p in (("big", big), ("small", small), ("mixed", mixed))}
    for m in models:
        source = runs["big" if m == models[0] else "small"].model(m)
        got = runs["mixed"].model(m)
        assert (got.slo_attainment, got.ttft_attainment, got.tpot_attainment, got.finished) == (
            source.slo_attainment, source.ttft_attainment, source.tpot_attainment, source.finished)
    # and the two plans differ where it matters: the big one attains more for the model taken from it
    assert runs["big"].model(models[0]).slo_attainment > runs["small"].model(models[0]).slo_attainment


def test_the_search_composes_passing_parts_of_different_rounds() -> None:
    """A planner that ignores demand and plans, round by round: a sufficient and b short, then a short and b
    sufficient, then both with 50 % to spare. Only the third round passes; composed of a's part of the first
    and b's of the second, a plan 27 % cheaper passes too, is simulated as a round of its own and chosen."""
    traffic = scenario_traffic(toy_scenario())
    script = [{"a": 1.1, "b": 0.8}, {"a": 0.8, "b": 1.1}, {"a": 1.5, "b": 1.5}]
    calls = iter(script)

    def scripted(demand: dict[tuple[str, Phase], float]) -> Plan:
        times = next(calls)
        return toy_planner({k: traffic[k] * NEEDED[k] * times[k[0]] for k in traffic})

    res = search_plan(scripted, toy_scenario(), SearchSettings(max_rounds=3), evaluate=toy_evaluator())
    assert [r.passed for r in res.rounds] == [False, False, True, True]
    composed = res.rounds[-1]
    assert composed.trial == "composed" and res.chosen == composed.index == 3
    cost = {i: sum(traffic[k] * NEEDED[k] * times[k[0]] for k in traffic) for i, times in enumerate(script)}
    expected = sum(traffic[k] * NEEDED[k] * 1.1 for k in traffic)
    assert res.plan is not None and res.plan.cost_per_hour == pytest.approx(expected)
    assert expected == pytest.approx(cost[2] * 1.1 / 1.5)
    assert res.plan.solve.notes == ["composed: a from round 1, b from round 2"]
    # its headroom is its parts' rounds'
    assert composed.headroom[("a", Phase.PREFILL)] == res.rounds[0].headroom[("a", Phase.PREFILL)]
    assert composed.headroom[("b", Phase.DECODE)] == res.rounds[1].headroom[("b", Phase.DECODE)]


def test_a_composed_round_is_simulated_only_when_cheaper_than_every_passing_round() -> None:
    """The toy planner's own search: a composed round, if any, was cheaper than every passing round before it,
    and the plan kept is never dearer than the cheapest of those."""
    res = search_plan(toy_planner, toy_scenario(), SearchSettings(max_rounds=14), evaluate=toy_evaluator())
    passing = [r.cost_per_hour for r in res.rounds if r.passed and r.trial != "composed" and r.cost_per_hour]
    composed = [r for r in res.rounds if r.trial == "composed"]
    assert res.plan is not None and res.plan.cost_per_hour <= min(passing)
    assert all(r.cost_per_hour is not None and r.cost_per_hour < min(passing) for r in composed)


H, L = "1xH", "1xL"  # a scarce fast config and a plentiful slow one


def _market_planner(market: Mapping[str, Mapping[str, int]], greedy: bool = False) -> Planner:
    """Each model with demand on one fast node at $0.6 per token/s while any is left, else on a slow node at $1;
    `greedy`: the first model takes two fast nodes (one idle, $1/h) and leaves the second the slow one."""

    def plan(demand: dict[tuple[str, Phase], float]) -> Plan:
        left, instances, serving = market["r"].get(H, 0), [], []
        for i, m in enumerate(("a", "b")):
            want = {p: demand.get((m, p), 0.0) for p in Phase}
            if sum(want.values()) <= 0:
                continue
            take = (2 if i == 0 else 0) if greedy else min(1, left)
            fast = take > 0 and left >= take
            left -= take if fast else 0
            rate = 0.6 if fast else 1.0
            idle = 1.0 if fast and take == 2 else 0.0
            cost = {p: want[p] * rate + (idle if p is Phase.PREFILL else 0.0) for p in Phase}
            instances.append(PlanInstance(id=f"{m}.0", model=m, phase="prefill", template_id=0, region="r",
                                          counts={H: take} if fast else {L: 1}, stages=[],
                                          throughput=sum(want.values()), cost_per_hour=sum(cost.values())))
            serving += [ModelServing(model=m, phase=p.value, demand=want[p], capacity=want[p], served_fraction=1,
                                     cost_per_hour=cost[p]) for p in Phase]
        return Plan(scenario="toy", method="toy", instances=instances, serving=serving,
                    cost_per_hour=sum(s.cost_per_hour for s in serving), solve=SolveReport(status="toy"))

    return plan


def test_leftover_and_binds() -> None:
    plan = _market_planner({"r": {H: 2}}, greedy=True)({("a", Phase.PREFILL): 1.0, ("b", Phase.PREFILL): 1.0})
    market = {"r": {H: 2, L: PLENTY}}
    assert leftover(market, plan, "a") == {"r": {H: 2, L: PLENTY - 1}}  # b's slow node is not a's to use
    assert leftover(market, plan, "b") == {"r": {H: 0, L: PLENTY}}
    assert binds(plan, market)  # both fast nodes used
    assert not binds(plan, {"r": {H: 3, L: PLENTY}}) and not binds(plan, {"r": {H: PLENTY, L: PLENTY}})


def test_the_search_refines_one_model_at_a_time_where_models_compete() -> None:
    """The joint planner gives model a both fast nodes (one idle) and b a slow one. Refined alone within what b
    leaves, a takes one fast node; then b, within what a's new part leaves, takes the other: both on fast nodes,
    cheaper than every round before, within the market, each model still meeting its target."""
    market = {"r": {H: 2, L: PLENTY}}
    cfg = SearchSettings(max_rounds=14, refine_rounds=14)  # the toy's burst factors are far above what it needs
    res = search_plan(_market_planner(market, greedy=True), toy_scenario(), cfg,
                      evaluate=toy_evaluator(), availability=market, within=lambda av: [_market_planner(av)])
    assert res.plan is not None and res.tuned_passed and res.chosen_trial == "refined"
    before = min(r.cost_per_hour or 0.0 for r in res.rounds if r.passed and r.trial != "refined")
    assert res.plan.cost_per_hour < before
    assert {i.model: i.counts for i in res.plan.instances} == {"a": {H: 1}, "b": {H: 1}}
    refined = [r for r in res.rounds if r.trial == "refined"]
    assert refined and all(r.attainment["a"] >= 0.9 or r.attainment["b"] >= 0.9 for r in refined)
    # a market where the fast nodes do not run out: the models do not compete, nothing is refined
    plenty = {"r": {H: PLENTY, L: PLENTY}}
    res = search_plan(_market_planner(plenty, greedy=True), toy_scenario(), cfg,
                      evaluate=toy_evaluator(), availability=plenty, within=lambda av: [_market_planner(av)])
    assert res.tuned_passed and all(r.trial != "refined" for r in res.rounds)


def test_a_later_plan_of_the_same_cost_to_the_micro_dollar_is_not_chosen() -> None:
    """Two passing rounds whose $/h differ in the last bits only (sums of the same prices in another order): the
    earlier one is kept, so a re-ordered sum does not swap the plan (nor the trial it is credited to)."""
    traffic = scenario_traffic(toy_scenario())
    plans = iter([1.5, 1.5 * (1 - 1e-13), 1.5 * (1 - 1e-13)])

    def scripted(demand: dict[tuple[str, Phase], float]) -> Plan:
        times = next(plans)
        return toy_planner({k: traffic[k] * NEEDED[k] * times for k in traffic})

    res = search_plan(scripted, toy_scenario(), SearchSettings(max_rounds=2), evaluate=toy_evaluator())
    costs = [r.cost_per_hour or 0.0 for r in res.rounds]
    assert len(costs) == 2 and all(r.passed for r in res.rounds) and costs[1] < costs[0]
    assert res.chosen == 0
