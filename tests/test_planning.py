"""SLO-true planning: the percentile rule (hand-computed), trace superposition, the search's stopping rule and
bounds on a synthetic world, verdicts for a target that cannot be met, and the real search on core."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from toy_search import NEEDED, toy_evaluator, toy_planner, toy_scenario

from coral.allocation.demand import TUNING_SEED, headroom, scenario_traffic
from coral.allocation.plan import Plan
from coral.catalog.loader import load_scenario
from coral.catalog.schema import TargetUtilization
from coral.perf.model import Phase
from coral.planning.slo_search import Evaluator, SearchSettings, search_plan
from coral.workload.burst import burst_factors, decode_concurrency, prefill_window_rates, weighted_percentile
from coral.workload.traces import RequestSet, rescale, superpose, synthetic, tile, workload_for

SMALL = RequestSet(np.array([0.0, 0.5, 1.0, 3.0]), np.array([100, 200, 300, 400]), np.array([10, 10, 10, 10]))


def test_prefill_window_rates_by_hand() -> None:
    # trailing windows (t - 1, t]: {0}, {0, 0.5}, {0.5, 1.0} (t = 0 is outside (0, 1]), {3.0}
    assert prefill_window_rates(SMALL.arrival_s, SMALL.input_tokens, 1.0).tolist() == [100, 300, 500, 400]


def test_weighted_percentile_by_hand() -> None:
    rates, tokens = np.array([100, 300, 500, 400.0]), np.array([100, 200, 300, 400.0])
    # by rate: 100 (w 100), 300 (w 200), 400 (w 400), 500 (w 300); cumulative 100, 300, 700, 1000
    assert weighted_percentile(rates, tokens, 0.5) == 400
    assert weighted_percentile(rates, tokens, 0.7) == 400
    assert weighted_percentile(rates, tokens, 0.71) == 500
    assert weighted_percentile(rates, tokens, 0.0) == 100


def test_decode_concurrency_by_hand() -> None:
    # 1 s each at tpot 0.1: [0, 1], [0.5, 1.5], [1, 2], [3, 4]; an end and a start at t = 1 (end first)
    level, dt = decode_concurrency(SMALL.arrival_s, SMALL.output_tokens, 0.1)
    segments = [(n, round(d, 9)) for n, d in zip(level.tolist(), dt.tolist(), strict=True) if d > 0]
    assert segments == [(1, 0.5), (2, 0.5), (2, 0.5), (1, 0.5), (0, 1.0), (1, 1.0)]


def test_burst_factors_by_hand() -> None:
    # mean prompt rate: 1000 tokens over a span of 3 x 4/3 = 4 s = 250/s; the median token sees 400/s
    # decode: time-mean concurrency 1; token-weighted N: 1 (weight 2), 2 (weight 2)
    assert burst_factors(SMALL, 1.0, 0.1, 0.5) == pytest.approx((1.6, 1.0))
    assert burst_factors(SMALL, 1.0, 0.1, 0.9) == pytest.approx((2.0, 2.0))


def test_headroom_override_and_burst_default() -> None:
    sc = load_scenario("core")
    room = headroom(sc)
    assert all(v >= 1.0 for v in room.values())
    # the bursty Azure code trace needs more headroom than the conversation trace
    assert room[("gpt-oss-20b", Phase.PREFILL)] > room[("phi-4", Phase.PREFILL)]
    fixed = sc.model_copy(update={"target_utilization": TargetUtilization(prefill=0.5)})
    assert headroom(fixed)[("phi-4", Phase.PREFILL)] == 2.0
    assert headroom(fixed)[("phi-4", Phase.DECODE)] == room[("phi-4", Phase.DECODE)]
    strict = sc.model_copy(update={"models": [m.model_copy(update={"slo_attainment": 0.99}) for m in sc.models]})
    assert all(headroom(strict)[k] >= v for k, v in room.items())


def test_superpose_keeps_rate_and_lengths_and_is_seeded() -> None:
    base = synthetic(2.0, 3600, 800, 100, seed=3, arrival="gamma", cv=3.0)
    out = superpose(base, 7.0, 1800, seed=11)
    assert len(out) / 1800 == pytest.approx(7.0, rel=0.05)
    assert np.all(np.diff(out.arrival_s) >= 0) and out.arrival_s[-1] < 1800
    for ours, theirs in ((out.input_tokens, base.input_tokens), (out.output_tokens, base.output_tokens)):
        assert np.mean(ours) == pytest.approx(np.mean(theirs), rel=0.05)
        assert np.percentile(ours, [10, 50, 90]) == pytest.approx(np.percentile(theirs, [10, 50, 90]), rel=0.1)
    again = superpose(base, 7.0, 1800, seed=11)
    assert np.array_equal(out.arrival_s, again.arrival_s)
    assert not np.array_equal(out.arrival_s[:50], superpose(base, 7.0, 1800, seed=12).arrival_s[:50])


def test_superpose_spreads_what_compression_packs() -> None:
    # a trace of clumps: 20 requests spread over one second, every 10 s (2 req/s); brought to 7 req/s,
    # compressing time packs each clump into 0.29 s, independent segments keep it over a second
    rng = np.random.default_rng(0)
    t = np.sort(np.concatenate([10.0 * k + rng.random(20) for k in range(360)]))
    clumps = RequestSet(t - t[0], np.full(len(t), 500), np.full(len(t), 50))

    def seen_per_quarter_second(r: RequestSet) -> float:
        """Requests in the same quarter second as a request, averaged over requests."""
        counts = np.bincount((r.arrival_s * 4).astype(int))
        return float((counts**2).sum() / counts.sum())

    packed = tile(rescale(clumps, 7.0), 1800, seed=1)
    spread = superpose(clumps, 7.0, 1800, seed=1)
    assert len(spread) / 1800 == pytest.approx(7.0, rel=0.05) and len(packed) / 1800 == pytest.approx(7.0, rel=0.05)
    assert seen_per_quarter_second(packed) >= 12
    assert seen_per_quarter_second(spread) <= 0.6 * seen_per_quarter_second(packed)


def test_workload_scaling_option() -> None:
    sc = load_scenario("core")
    sup = workload_for(sc, 600, 0)["gpt-oss-20b"]
    comp = workload_for(sc, 600, 0, scaling="compress")["gpt-oss-20b"]
    assert len(sup) / 600 == pytest.approx(10, rel=0.15) and len(comp) / 600 == pytest.approx(10, rel=0.3)
    assert not np.array_equal(sup.arrival_s[:20], comp.arrival_s[:20])


# --- the search on a synthetic world -------------------------------------------------------------------------

def _world(ceiling: float = 1.0) -> tuple[list[tuple[int, float]], Evaluator]:
    calls: list[tuple[int, float]] = []
    return calls, toy_evaluator(ceiling, calls)


def test_search_finds_a_near_cheapest_passing_plan_and_stops() -> None:
    calls, evaluate = _world()
    res = search_plan(toy_planner, toy_scenario(), SearchSettings(max_rounds=30, time_budget_s=60), evaluate=evaluate)
    assert res.met and res.plan is not None and res.plan.slo is not None
    # the cheapest passing plan has each model's phases jointly at 90 % + margin; cost within a few % of the
    # cheapest plan meeting 0.91 with both phases sized equally (within tolerance^2 of that)
    traffic = scenario_traffic(toy_scenario())
    need = {k: NEEDED[k] * 0.91 ** (1 / 8) for k in NEEDED}
    floor = sum(traffic[k] * need[k] for k in NEEDED)
    assert floor * 0.9 <= res.plan.cost_per_hour <= floor * 1.06**2
    # it stopped before its bound, when every bracket was settled, and the held-out sets were scored
    assert len(res.rounds) < 30
    cfg = SearchSettings()  # tuned on its tuning sets, confirmed on fresh tuning windows, certified on held-out ones
    assert {seed for seed, _ in calls} == {TUNING_SEED, 10, 11, *cfg.confirm_seeds, *cfg.held_out_seeds}
    assert res.plan.slo.verdict == {m: res.plan.slo.verdict[m] for m in ("a", "b")}
    assert all(v.startswith("pass") for v in res.plan.slo.verdict.values())
    passing = [r.cost_per_hour for r in res.rounds if r.passed]
    assert res.plan.cost_per_hour == min(c for c in passing if c is not None)


def test_search_respects_its_round_and_time_bounds() -> None:
    _, evaluate = _world()
    assert len(search_plan(toy_planner, toy_scenario(), SearchSettings(max_rounds=3), evaluate=evaluate).rounds) == 3
    # a spent time budget still runs one round, and returns its plan with a verdict
    res = search_plan(toy_planner, toy_scenario(), SearchSettings(time_budget_s=0.0), evaluate=evaluate)
    assert len(res.rounds) == 1 and res.plan is not None and res.plan.slo is not None


def test_unreachable_target_gets_a_verdict_that_says_why() -> None:
    calls, evaluate = _world(ceiling=0.8)
    res = search_plan(toy_planner, toy_scenario(), SearchSettings(max_rounds=6), evaluate=evaluate)
    assert not res.met and res.plan is not None and res.plan.slo is not None
    for m in ("a", "b"):
        verdict = res.plan.slo.verdict[m]
        assert verdict.startswith("fail") and "served alone only 80.0%" in verdict and "<= 0.80" in verdict
    assert (SearchSettings().held_out_seeds[0], 0.02) in calls  # the ceiling: on a thinned held-out window


@pytest.mark.slow
def test_search_meets_every_target_on_core_held_out() -> None:
    from coral.allocation.allocator import resolve_availability
    from coral.experiments.allocation import load_library
    from coral.planning import allocator_planner

    sc = load_scenario("core")
    lib = load_library("core", Path("out"))
    res = search_plan(allocator_planner(lib, sc, resolve_availability(sc, lib)), sc)
    assert res.plan is not None and res.plan.slo is not None
    assert res.met, res.plan.slo.verdict
    assert all(res.plan.slo.held_out[m] >= 0.9 for m in res.plan.slo.target)
    for s in res.plan.serving:
        assert s.headroom is not None and math.isclose(s.headroom, res.headroom[(s.model, Phase(s.phase))])


@pytest.mark.slow
def test_a_target_single_requests_cannot_meet_gets_a_real_verdict() -> None:
    """phi-4 on core's nodes with a 450 ms TTFT SLO: its longer prompts cannot be prefilled in time on any
    template (the best serves 90.6 % of them alone), however many there are, so 99 % is out of reach: the plan
    names the model latency-bound, and the verdict says so and names what is reachable. (At 600 ms the fastest
    templates serve 99.7 % alone, and the latency rating now plans on them: 99 % is met there.)"""
    from coral.allocation.allocator import resolve_availability
    from coral.planning import allocator_planner
    from coral.templates.build import build_library

    core = load_scenario("core")
    phi = core.models[0].model_copy(update={"prefill_slo_ms": 450.0, "request_rate": 2.0, "slo_attainment": 0.99})
    sc = core.model_copy(update={"name": "tight", "models": [phi], "epochs": 1, "epoch_minutes": 10})
    lib = build_library(sc, workers=1)
    res = search_plan(allocator_planner(lib, sc, resolve_availability(sc, lib)), sc,
                      SearchSettings(max_rounds=3, held_out_seeds=(1,)))
    assert res.plan is not None and res.plan.slo is not None and not res.met
    verdict = res.plan.slo.verdict["phi-4"]
    assert verdict.startswith("fail") and "even served alone" in verdict and "slo_attainment <=" in verdict
    assert any(n.startswith("phi-4/prefill is latency-bound") for n in res.plan.solve.notes)


def test_search_with_a_subset_planner_is_never_dearer_than_the_subset_search() -> None:
    """A full planner whose plans are 10 % cheaper at equal demand but attain as if given 60 % of the capacity
    (the heterogeneous plans that priced throughput only): on its own its search ends 1.5x dearer than the
    subset's; searching the subset first keeps the subset's plan."""
    def full(demand: dict[tuple[str, Phase], float]) -> Plan:
        plan = toy_planner({k: v * 0.6 for k, v in demand.items()})
        plan.method, plan.cost_per_hour = "full", plan.cost_per_hour / 0.6 * 0.9
        return plan

    evaluate = toy_evaluator()

    settings = SearchSettings(max_rounds=12)
    alone = search_plan(full, toy_scenario(), settings, evaluate=evaluate)
    subset = search_plan(toy_planner, toy_scenario(), settings, evaluate=evaluate)
    both = search_plan(full, toy_scenario(), settings, evaluate=evaluate, subset=toy_planner)
    assert alone.met and subset.met and both.met
    assert alone.plan is not None and subset.plan is not None and both.plan is not None
    assert alone.plan.cost_per_hour > 1.3 * subset.plan.cost_per_hour
    assert both.plan.cost_per_hour <= subset.plan.cost_per_hour + 1e-9
    assert [r.headroom for r in both.rounds[:len(subset.rounds)]] == [r.headroom for r in subset.rounds]
    assert len(both.rounds) > len(subset.rounds)  # then the full planner's own rounds, numbered on
    assert [r.index for r in both.rounds] == list(range(len(both.rounds)))


def test_variants_run_after_and_the_cheapest_passing_plan_of_every_trial_is_kept() -> None:
    """Coral's search: the subset's rounds, the planner's, then each variant's (labelled, numbered on); the plan
    kept is the cheapest that passed in any trial, here the variant's (a planner 20 % cheaper at equal demand
    that attains the same), and never dearer than the subset's or the planner's own."""
    def variant(demand: dict[tuple[str, Phase], float]) -> Plan:
        plan = toy_planner(demand)
        plan.method, plan.cost_per_hour = "variant", plan.cost_per_hour * 0.8
        return plan

    evaluate = toy_evaluator()
    settings = SearchSettings(max_rounds=12)
    plain = search_plan(toy_planner, toy_scenario(), settings, evaluate=evaluate, subset=toy_planner)
    both = search_plan(toy_planner, toy_scenario(), settings, evaluate=evaluate, subset=toy_planner,
                       variants=[variant])
    assert plain.plan is not None and both.plan is not None and both.met and both.chosen is not None
    assert [r.trial for r in both.rounds[:len(plain.rounds)]] == [r.trial for r in plain.rounds]
    assert {r.trial for r in both.rounds} == {"subset", "planner", "variant 1"}
    assert both.rounds[both.chosen].trial == "variant 1" and both.plan.method == "variant"
    assert both.plan.cost_per_hour < plain.plan.cost_per_hour
    assert [r.index for r in both.rounds] == list(range(len(both.rounds)))


def test_a_search_whose_rounds_would_repeat_stops() -> None:
    """A planner that returns one fixed plan whatever is asked (as homo-greedy did at its cap), in a world where it
    never passes: once a round moves no bracket, the next would repeat it, so the search stops there instead of
    running its 12 rounds (homo-greedy ran 12 identical rounds, cauchy-paper 10)."""
    fixed = toy_planner({k: v * 1.5 for k, v in scenario_traffic(toy_scenario()).items()})
    _, evaluate = _world(ceiling=0.5)
    res = search_plan(lambda demand: fixed.model_copy(deep=True), toy_scenario(), SearchSettings(max_rounds=12),
                      evaluate=evaluate)
    assert 2 <= len(res.rounds) <= 3 and not res.met
    assert len({r.cost_per_hour for r in res.rounds}) == 1
    # a search whose brackets still move runs on (the world above, with a planner that follows demand)
    assert len(search_plan(toy_planner, toy_scenario(), SearchSettings(max_rounds=12),
                           evaluate=_world(ceiling=0.5)[1]).rounds) > 3


def test_a_key_that_does_not_respond_to_capacity_stops_drawing_it() -> None:
    """Model a's prompts meet the TTFT SLO for at most 80 % of requests whatever its prefill capacity (a latency
    ceiling): the search stops growing that key and says why, rather than buying capacity every round."""
    evaluate = toy_evaluator(phase_cap={("a", Phase.PREFILL): 0.8})
    res = search_plan(toy_planner, toy_scenario(), SearchSettings(max_rounds=14), evaluate=evaluate)
    key = ("a", Phase.PREFILL)
    grown = [r.headroom[key] for r in res.rounds]
    # three misses while it grew 2x without gaining: frozen from then on, not climbing round after round
    assert max(grown) <= 2.1 * grown[0] and len(set(grown[3:])) == 1 and len(grown) > 4
    assert res.plan is not None and res.plan.slo is not None
    assert any(n.startswith("a/prefill does not respond to capacity") for n in res.plan.slo.notes)
    assert res.plan.slo.verdict["b"].startswith("pass") or res.plan.slo.held_out["b"] >= 0.9
