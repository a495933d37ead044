"""One latency model for planner and simulator: the KV hand-off rule, templates rated by the share of requests that
meet the SLO served alone (as the simulator serves them), and the allocator's use of that rating."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coral.allocation import core
from coral.allocation.allocator import InfeasibleDemand, allocate
from coral.allocation.baselines import homo_ilp
from coral.allocation.demand import TUNING_SEED, model_key, run_length_s, scenario_demand
from coral.allocation.latency import RequestSample, model_latency, request_sample, scenario_latency
from coral.allocation.plan import SolveReport
from coral.catalog.loader import load_scenario, market_catalog
from coral.perf.latency import chunked_prefill_s, handoff_side_s
from coral.perf.model import Phase
from coral.planning.slo_search import simulator_evaluator
from coral.simulation.run import simulate
from coral.templates.build import build_library
from coral.templates.library import TemplateLibrary
from coral.workload.traces import RequestSet, thinned, workload_for

GB = 1e9


def test_handoff_is_the_busiest_nic_of_either_side_solved_by_hand() -> None:
    # 1 MB of KV per layer. Prefill: 30 layers on a 10 GB/s node, 10 on a 1 GB/s node (10 ms); decode: 40 layers on
    # one 5 GB/s node (8 ms). Busiest NIC: the slow prefill node, 10 ms (the old rule sent all 40 decode layers over
    # the slowest prefill NIC: 40 ms).
    def handoff(send: list[tuple[int, float]], receive: list[tuple[int, float]]) -> float:
        sides = [handoff_side_s(1e6, np.array([[n for n, _ in side]]), np.array([[b for _, b in side]]))
                 for side in (send, receive)]
        return float(max(sides[0][0], sides[1][0]))

    assert handoff([(30, 10 * GB), (10, 1 * GB)], [(40, 5 * GB)]) == pytest.approx(0.010)
    assert handoff([(40, 10 * GB)], [(20, 5 * GB), (20, 5 * GB)]) == pytest.approx(0.004)
    side = handoff_side_s(np.array([1e6, 2e6]), np.array([[30, 10, 0]]), np.array([[10 * GB, 1 * GB, 1.0]]))
    assert side == pytest.approx([0.010, 0.020])  # a slot without layers sends nothing, whatever its NIC


def test_chunked_prefill_pays_every_first_chunk_and_the_bottleneck_rest() -> None:
    # two stages: 3 chunks of 0.1 s on the first, 3 of 0.2 s on the second: 0.1 + 0.2 + 2 x 0.2
    first = np.array([0.1, 0.2])
    assert chunked_prefill_s(first, np.array([0.3, 0.6])) == pytest.approx(0.7)
    assert chunked_prefill_s(first, first) == pytest.approx(0.3)  # one chunk: the sum of the stages


@pytest.fixture(scope="module")
def core_lib() -> TemplateLibrary:
    return build_library(load_scenario("core"), workers=1)


def _alone(lib: TemplateLibrary, model: str, prefill: int, decode: int, requests: RequestSet) -> dict[str, float]:
    """Attainment of one prefill and one decode instance serving `requests` of `model` (thinned: nothing queues)."""
    sc = load_scenario("core")
    cat = market_catalog(sc)
    market = core.make_market(lib, sc, cat, None)
    keys = [(model, Phase.PREFILL), (model, Phase.DECODE)]
    plan = core.build_plan(lib, sc, keys, np.ones(2), market, [(prefill, 0, 1), (decode, 0, 1)], method="test",
                           mode="cost", report=SolveReport(status="test"), running={}, penalty_k=None)
    res = simulate(plan, sc, {model: requests}, duration_s=run_length_s(sc), catalog=cat).model(model)
    return {"ttft": res.ttft_attainment, "tpot": res.tpot_attainment}


def test_rating_predicts_what_the_simulator_charges_a_request_served_alone(core_lib: TemplateLibrary) -> None:
    """Rated on exactly the requests the simulator serves (a 1 % thinning: nothing queues), a template's share
    within the SLO matches the simulated attainment, for mixed and single-config templates of both phases."""
    sc = load_scenario("core")
    cat = market_catalog(sc)
    model = "gpt-oss-20b"  # the Azure code trace: long prompts, few output tokens, the tightest SLOs
    sm = next(m for m in sc.models if m.model == model)
    requests = thinned(workload_for(sc, run_length_s(sc), TUNING_SEED, part="tune"), 0.01, 5)[model]
    import coral.allocation.latency as latency

    key = model_key(sc, sm)
    saved = latency._SAMPLES.get(key)
    latency._SAMPLES[key] = RequestSample(requests.input_tokens.astype(np.int64), requests.output_tokens.astype(np.int64))
    try:
        lib = core_lib.subset(np.arange(len(core_lib)))  # a fresh object: nothing memoised from other tests
        rating = model_latency(lib, sc, sm, cat)
    finally:
        latency._SAMPLES.pop(key)
        if saved is not None:
            latency._SAMPLES[key] = saved
    market = core.make_market(lib, sc, cat, None)
    offered = lambda rows: rows[((lib.counts[rows] > 0) <= np.isfinite(market.price[0])).all(axis=1)]  # noqa: E731
    p_rows, d_rows = offered(rating[Phase.PREFILL].rows), offered(rating[Phase.DECODE].rows)
    share_p = dict(zip(rating[Phase.PREFILL].rows.tolist(), rating[Phase.PREFILL].share.tolist(), strict=True))
    share_d = dict(zip(rating[Phase.DECODE].rows.tolist(), rating[Phase.DECODE].share.tolist(), strict=True))
    fast_p = max(p_rows, key=lambda t: (share_p[t], -t))
    fast_d = max(d_rows, key=lambda t: (share_d[t], -t))
    assert share_p[fast_p] == share_d[fast_d] == 1.0
    mixed = lambda rows: [t for t in rows if (lib.counts[t] > 0).sum() > 1]  # noqa: E731
    picks_p = sorted(p_rows, key=lambda t: share_p[t])[:3] + mixed(sorted(p_rows, key=lambda t: share_p[t]))[:2]
    picks_d = sorted(d_rows, key=lambda t: share_d[t])[:3] + mixed(sorted(d_rows, key=lambda t: share_d[t]))[:2]
    assert min(share_p[t] for t in picks_p) < 0.95 and min(share_d[t] for t in picks_d) < 0.99  # cases that matter
    for t in picks_p:
        got = _alone(lib, model, int(t), int(fast_d), requests)
        # the prefill share also asks that its hand-off side leave the decode room: compare with both SLOs met
        assert min(got["ttft"], got["tpot"]) == pytest.approx(share_p[t], abs=0.03), (lib.template(int(t)), got)
    for t in picks_d:
        got = _alone(lib, model, int(fast_p), int(t), requests)
        assert got["tpot"] == pytest.approx(share_d[t], abs=0.02), (lib.template(int(t)), got)


def test_allocator_meets_the_pooled_latency_rule(core_lib: TemplateLibrary) -> None:
    """Every instance's template reaches the target alone, and each key's instances together miss at most the
    quarter allowance (capacity-weighted, as requests spread over them)."""
    sc = load_scenario("core")
    cat = market_catalog(sc)
    rating = scenario_latency(core_lib, sc, cat)
    assert any(len(kl.kept) < len(kl.rows) for kl in rating.values())  # the rating removes templates on core
    plan = allocate(core_lib, sc, availability="unlimited", catalog=cat)
    for key, kl in rating.items():
        inst = [i for i in plan.instances if (i.model, Phase(i.phase)) == key]
        assert all(i.template_id in kl.kept for i in inst)
        share = kl.share[np.searchsorted(kl.rows, [i.template_id for i in inst])]
        thr = np.array([i.throughput for i in inst])
        assert thr @ share >= kl.level * thr.sum() - 1e-9
    before = allocate(core_lib, sc, availability="unlimited", catalog=cat, latency=False)
    assert plan.cost_per_hour >= before.cost_per_hour - 1e-6  # fewer columns never cost less
    low = sc.model_copy(update={"models": [m.model_copy(update={"slo_attainment": 0.5}) for m in sc.models]})
    loose = scenario_latency(core_lib, low, cat)
    assert all(len(loose[k].kept) >= len(rating[k].kept) for k in rating)  # a lower target keeps more


def test_latency_bound_model_is_named_with_what_would_help(core_lib: TemplateLibrary) -> None:
    """A TTFT SLO no template meets for the longest prompts: the model is latency-bound, the plan says so."""
    sc = load_scenario("core")
    tight = sc.model_copy(update={"models": [m.model_copy(update={"prefill_slo_ms": 300.0}) if m.model == "gpt-oss-20b"
                                             else m for m in sc.models]})
    lib = build_library(tight, workers=1)
    cat = market_catalog(tight)
    rating = scenario_latency(lib, tight, cat)
    kl = rating[("gpt-oss-20b", Phase.PREFILL)]
    assert kl.bound and 0 < kl.best < kl.floor and kl.level == pytest.approx(kl.best - (1 - 0.9) / 4)
    assert (kl.share[np.isin(kl.rows, kl.kept)] >= min(0.9, kl.level) - 1e-12).all()
    plan = allocate(lib, tight, availability="unlimited", catalog=cat)
    assert any("gpt-oss-20b/prefill is latency-bound" in n for n in plan.solve.notes)


def test_coral_is_never_dearer_than_the_homogeneous_ilp_at_equal_demand(core_lib: TemplateLibrary) -> None:
    """The homogeneous optimum at the same demand is Coral's warm start and floor: its columns are a subset."""
    sc = load_scenario("core")
    cat = market_catalog(sc)
    checked = 0
    for scale in (1.0, 1.7, 3.1):
        demand = {k: v * scale for k, v in scenario_demand(sc).items()}
        for avail in ("unlimited", {"aws-us-east-2": {"1xL40S": 8, "1xL4": 60, "1xA10G": 60, "4xA10G": 16},
                                    "aws-ap-northeast-2": {"1xL40S": 3, "1xL4": 40, "1xA10G": 40, "4xA10G": 8}}):
            try:
                homo = homo_ilp(core_lib, sc, demand=demand, availability=avail, catalog=cat)
            except InfeasibleDemand:
                continue  # (Coral may still have a plan: mixed templates use scarce nodes better)
            mixed = allocate(core_lib, sc, demand=demand, availability=avail, catalog=cat)
            assert mixed.cost_per_hour <= homo.cost_per_hour + 1e-6, (scale, avail)
            checked += 1
    assert checked >= 4


def test_request_sample_is_the_tuning_part_and_deterministic() -> None:
    sc = load_scenario("core")
    a = request_sample(sc, sc.models[1])
    import coral.allocation.latency as latency

    latency._SAMPLES.clear()
    b = request_sample(sc, sc.models[1])
    assert np.array_equal(a.input_tokens, b.input_tokens) and len(a.input_tokens) == latency.SAMPLE


def test_at_equal_capacity_mixed_templates_attain_what_homogeneous_ones_do(core_lib: TemplateLibrary) -> None:
    """The rating is honest: phi-4's prefill pool with Coral's mixed pipeline (2 L4 stage + 2 L40S stage, the
    template its cost plan picks on core) attains, on each tuning set, what the 1xL40S pools on either side of its
    capacity attain, interpolated at its capacity (the rest of the plan fixed). The plain cost plan at equal
    demand attains less only because it carries less capacity: a homogeneous plan's whole-instance rounding
    leaves slack that the cost optimum trims (priced by the search's variant: the test below)."""
    sc = load_scenario("core")
    cat = market_catalog(sc)
    lib = core_lib
    market = core.make_market(lib, sc, cat, None)
    keys = [(m.model, ph) for m in sc.models for ph in Phase]

    def template(model: str, phase: str, counts: dict[str, int], stages: int) -> int:
        return next(int(t) for t in lib.select(model, phase) if lib.template(int(t)).counts == counts
                    and len(lib.template(int(t)).stages) == stages)

    rest = [(template("phi-4", "decode", {"1xL40S": 6}, 1), 0, 1),
            (template("gpt-oss-20b", "prefill", {"1xL40S": 2}, 1), 0, 2),
            (template("gpt-oss-20b", "decode", {"1xL40S": 1}, 1), 0, 1),
            (template("qwen3-32b", "prefill", {"1xL40S": 2}, 2), 0, 3),
            (template("qwen3-32b", "decode", {"4xA10G": 2}, 2), 0, 1)]
    single = template("phi-4", "prefill", {"1xL40S": 1}, 1)
    mixed = template("phi-4", "prefill", {"1xL4": 2, "1xL40S": 2}, 2)
    evaluate = simulator_evaluator(sc, run_length_s(sc), cat)

    def ttft(pool: list[tuple[int, int, int]], seed: int) -> tuple[float, float]:
        plan = core.build_plan(lib, sc, keys, np.ones(len(keys)), market, rest + pool, method="test", mode="cost",
                               report=SolveReport(status="test"), running={}, penalty_k=None)
        capacity = sum(i.throughput for i in plan.instances if (i.model, i.phase) == ("phi-4", "prefill"))
        return capacity, evaluate(plan, seed, 1.0)["phi-4"].ttft

    for seed in (TUNING_SEED, 10):
        (c_lo, a_lo), (c_hi, a_hi) = ttft([(single, 0, 4)], seed), ttft([(single, 0, 5)], seed)
        c_mix, a_mix = ttft([(single, 0, 2), (mixed, 0, 1)], seed)
        assert c_lo < c_mix < c_hi
        expected = a_lo + (a_hi - a_lo) * (c_mix - c_lo) / (c_hi - c_lo)
        assert a_mix == pytest.approx(expected, abs=0.015), (seed, c_mix, a_mix, expected)


def test_at_equal_demand_coral_pricing_slack_attains_what_homo_ilp_does(core_lib: TemplateLibrary) -> None:
    """At the percentile rule's demand on core (what every search asks first), Coral's allocator as the search's
    variant runs it (slack priced, `SEARCH_SLACK`) is no dearer than homo-ilp priced alike (its objective: $/h
    less the slack's worth) and attains, per model, at least what homo-ilp's plain cost plan attains less the
    simulator's seed noise: two standard errors of the difference of the two means over the three tuning sets.
    The plain cost optimum ($51.78/h against homo-ilp's $52.03/h) fails it, measured: phi-4 88.7 % against
    92.2 %, planning 1.00x its prefill demand where homo-ilp's whole instances carry 1.12x. (Under the former
    per-template latency floor homo-ilp's plain plan cost $52.29/h, as much as Coral's slack-priced one; the
    pooled rule lets it mix cheaper gpt-oss-20b prefill templates: 93 % attained against 97 %.)"""
    from coral.planning.slo_search import SEARCH_SLACK, SearchSettings

    sc = load_scenario("core")
    cat = market_catalog(sc)
    demand = scenario_demand(sc)
    homo = homo_ilp(core_lib, sc, demand=demand, availability="unlimited", catalog=cat)
    coral = allocate(core_lib, sc, demand=demand, availability="unlimited", catalog=cat, slack=SEARCH_SLACK)
    priced = homo_ilp(core_lib, sc, demand=demand, availability="unlimited", catalog=cat, slack=SEARCH_SLACK)
    assert coral.solve.objective is not None and priced.solve.objective is not None
    assert coral.solve.objective <= priced.solve.objective + 1e-6
    evaluate = simulator_evaluator(sc, run_length_s(sc), cat)
    seeds = SearchSettings().tune_seeds
    got = {name: [evaluate(plan, seed, 1.0) for seed in seeds] for name, plan in (("coral", coral), ("homo", homo))}
    for sm in sc.models:
        c = np.array([r[sm.model].slo for r in got["coral"]])
        h = np.array([r[sm.model].slo for r in got["homo"]])
        noise = 2 * np.sqrt((c.var(ddof=1) + h.var(ddof=1)) / len(seeds))
        assert c.mean() >= h.mean() - noise, (sm.model, c, h, noise)


def test_ratings_are_cached_beside_the_library_and_recomputed_when_stale(core_lib: TemplateLibrary, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A library read from a file has its ratings written beside it; a fresh process (a new library object) reads
    them without rating again; a corrupt file, other SLOs or another library are rated anew, never misread."""
    import coral.allocation.latency as latency

    sc = load_scenario("core")
    cat = market_catalog(sc)
    path = core_lib.subset(np.arange(len(core_lib))).save(tmp_path / "core.templates.sqlite")
    first = scenario_latency(TemplateLibrary.load(path), sc, cat)
    cache = path.with_suffix(".latency.npz")
    assert cache.is_file()
    rated = latency._model_shares

    def no_rating(*args: object) -> None:
        raise AssertionError("rated again")

    monkeypatch.setattr(latency, "_model_shares", no_rating)
    again = scenario_latency(TemplateLibrary.load(path), sc, cat)
    for k, kl in first.items():
        assert np.array_equal(kl.share, again[k].share) and np.array_equal(kl.candidates, again[k].candidates)
        assert np.array_equal(kl.kept, again[k].kept) and kl.level == again[k].level
    monkeypatch.setattr(latency, "_model_shares", rated)
    cache.write_bytes(b"not a zip file")
    corrupt = scenario_latency(TemplateLibrary.load(path), sc, cat)
    assert all(np.array_equal(first[k].share, corrupt[k].share) for k in first)
    tight = sc.model_copy(update={"models": [m.model_copy(update={"decode_slo_ms": m.decode_slo_ms / 4})
                                             for m in sc.models]})
    stricter = scenario_latency(TemplateLibrary.load(path), tight, cat)
    assert any(stricter[k].share.sum() < first[k].share.sum() for k in first)
    fewer = TemplateLibrary.load(path)
    fewer.throughput[fewer.select("phi-4", "decode")[0]] = 0.0  # another library: one template fewer
    assert len(scenario_latency(fewer, sc, cat)[("phi-4", Phase.DECODE)].rows) == len(first[("phi-4", Phase.DECODE)].rows) - 1
