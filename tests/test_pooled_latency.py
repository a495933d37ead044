"""The pooled latency rule (`coral.allocation.latency`): a (model, phase)'s instances together, not each template,
must serve enough of its requests within the SLO served alone (one row per key in the allocator's program)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coral.allocation.allocator import UNLIMITED, InfeasibleDemand, Mode, allocate
from coral.allocation.demand import DemandKey
from coral.allocation.latency import ALLOWANCE_SHARE, KeyLatency, key_latency
from coral.allocation.plan import Plan
from coral.allocation.rows import key_rows
from coral.catalog.schema import Scenario, ScenarioModel, TargetUtilization
from coral.perf.model import Phase
from coral.templates.library import Stage, Template, TemplateLibrary

REGIONS = ["aws-us-east-2"]
CONFIGS = ["1xL4", "1xA10G", "1xL40S", "4xL4"]


def scenario(models: list[str], target: float) -> Scenario:
    return Scenario(name="pooled", regions=REGIONS, configs=CONFIGS, availability=UNLIMITED,
                    target_utilization=TargetUtilization(prefill=1.0, decode=1.0),
                    models=[ScenarioModel(model=m, prefill_slo_ms=1000, decode_slo_ms=50, request_rate=1.0,
                                          mean_input_tokens=100, mean_output_tokens=20, slo_attainment=target)
                            for m in models])


def template(model: str, phase: Phase, counts: dict[str, int], thr: float) -> Template:
    nodes = tuple(c for c, n in counts.items() for _ in range(n))
    stage = Stage(layers=4, nodes=nodes, node_throughput=tuple(thr / len(nodes) for _ in nodes))
    return Template(id=0, model=model, phase=phase, slo_ms=1000, counts=counts, stages=(stage,), throughput=thr)


def ratings(lib: TemplateLibrary, shares: dict[DemandKey, np.ndarray], target: float) -> dict[DemandKey, KeyLatency]:
    """Hand-made ratings: each key's usable templates (in `key_rows` order) with the given shares."""
    return {(m, p): key_latency(lib, m, p, key_rows(lib, m, str(p), False)[0], share, target)
            for (m, p), share in shares.items()}


def pooled_miss(plan: Plan, rating: dict[DemandKey, KeyLatency]) -> dict[DemandKey, float]:
    """Per key, the capacity-weighted share of requests its planned instances miss served alone."""
    out = {}
    for key, kl in rating.items():
        inst = [i for i in plan.instances if (i.model, Phase(i.phase)) == key]
        thr = np.array([i.throughput for i in inst])
        share = kl.share[np.searchsorted(kl.rows, [i.template_id for i in inst])] if inst else np.zeros(0)
        out[key] = float(thr @ (1 - share) / thr.sum()) if inst else 0.0
    return out


def test_the_per_template_floor_no_longer_rejects_a_mix_that_meets_the_target_pooled() -> None:
    """Prefill on a cheap 1xL4 template whose share (96 %) is just under the former per-template floor (97.5 % at
    a 90 % target) and on a dear 1xL40S one meeting every request: 5 cheap + 3 dear instances miss 5 x 4 % / 8 =
    2.5 % of the requests, the quarter allowance, so the plan mixes them where the floor bought 8 dear ones."""
    target = 0.9
    lib = TemplateLibrary.from_templates(CONFIGS, [
        template("m", Phase.PREFILL, {"1xL4": 1}, 100.0), template("m", Phase.PREFILL, {"1xL40S": 1}, 100.0),
        template("m", Phase.DECODE, {"1xL40S": 1}, 100.0)], {})
    floor = 1 - (1 - target) * ALLOWANCE_SHARE
    rating = ratings(lib, {("m", Phase.PREFILL): np.array([0.96, 1.0]), ("m", Phase.DECODE): np.array([1.0])},
                     target)
    cheap, dear = key_rows(lib, "m", "prefill", False)[0]
    assert rating[("m", Phase.PREFILL)].share[0] < floor  # the former floor rejected the cheap template
    sc = scenario(["m"], target)
    demand = {("m", Phase.PREFILL): 800.0, ("m", Phase.DECODE): 50.0}
    plan = allocate(lib, sc, demand=demand, availability=UNLIMITED, latency=rating)
    counts = {t: sum(i.template_id == t for i in plan.instances) for t in (cheap, dear)}
    assert counts == {cheap: 5, dear: 3}
    assert pooled_miss(plan, rating)[("m", Phase.PREFILL)] <= (1 - target) * ALLOWANCE_SHARE + 1e-12
    all_dear = allocate(lib, sc, demand=demand, availability=UNLIMITED, latency=ratings(
        lib, {("m", Phase.PREFILL): np.array([0.85, 1.0]), ("m", Phase.DECODE): np.array([1.0])}, target))
    assert {i.template_id for i in all_dear.instances if i.phase == "prefill"} == {dear}  # under the target: out
    assert plan.cost_per_hour < all_dear.cost_per_hour


def random_library(rng: np.random.Generator, models: list[str], n: int) -> TemplateLibrary:
    rows = []
    for m in models:
        for phase in Phase:
            for _ in range(n):
                picks = [CONFIGS[int(i)] for i in rng.integers(0, len(CONFIGS), int(rng.integers(1, 3)))]
                counts = {c: picks.count(c) for c in dict.fromkeys(picks)}
                rows.append(template(m, phase, counts, float(rng.integers(20, 200)) * len(picks)))
    return TemplateLibrary.from_templates(CONFIGS, rows, {})


@given(st.integers(0, 10_000), st.sampled_from([0.8, 0.9, 0.95]), st.sampled_from(["cost", "goodput", "maxmin"]),
       st.integers(1, 6))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_every_plan_meets_the_pooled_row_of_every_key(seed: int, target: float, mode: Mode, nodes: int) -> None:
    """Random libraries and shares (a key may be latency-bound), unlimited (cost) or scarce (goodput, max-min)
    availability: the plan's instances of every key miss at most its allowance together (1 − level), and each
    template reaches its sanity floor (`kept`)."""
    rng = np.random.default_rng(seed)
    models = ["a", "b"]
    lib = random_library(rng, models, 6)
    shares = {}
    for m in models:
        for p in Phase:
            n = len(key_rows(lib, m, str(p), False)[0])
            shares[(m, p)] = np.round(np.where(rng.random(n) < 0.5, rng.uniform(0.95, 1.0, n), rng.uniform(0.7, 1.0, n)), 3)
    rating = ratings(lib, shares, target)
    demand = {(m, p): float(rng.uniform(100, 900)) for m in models for p in Phase}
    avail = UNLIMITED if mode == "cost" else {r: dict.fromkeys(CONFIGS, nodes) for r in REGIONS}
    try:
        plan = allocate(lib, scenario(models, target), demand=demand, availability=avail, mode=mode,
                        latency=rating, gap=1e-6)
    except InfeasibleDemand:
        assert mode == "maxmin"  # some model gets no instance: t = 0 (goodput mode still plans the others)
        return
    for key, miss in pooled_miss(plan, rating).items():
        assert miss <= 1 - rating[key].level + 1e-9, (key, miss, rating[key].level)
    for i in plan.instances:
        assert i.template_id in rating[(i.model, Phase(i.phase))].kept
    if mode == "cost" and not any(kl.bound for kl in rating.values()):  # never dearer than the former floor
        floor = {k: np.where(v >= rating[k].floor - 1e-12, v, 0.0) for k, v in shares.items()}
        before = allocate(lib, scenario(models, target), demand=demand, availability=avail,
                          latency=ratings(lib, floor, target), gap=1e-6)
        assert plan.cost_per_hour <= before.cost_per_hour * (1 + 1e-6) + 1e-9
