"""Baselines (homo-greedy, homo-ilp, cauchy-paper): a hand-solved golden case, the cost ordering implied by
their template sets, and the waterfall from the paper's setting (consistent with running each step directly)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coral.allocation import baselines
from coral.allocation.allocator import UNLIMITED, allocate, resolve_availability
from coral.catalog.loader import builtin_catalog
from coral.catalog.schema import Scenario, ScenarioModel, TargetUtilization
from coral.experiments.allocation import compare_plans, waterfall_rows
from coral.experiments.paper import paper_catalog, paper_setting, waterfall_settings
from coral.perf.model import Phase
from coral.templates.library import Stage, Template, TemplateLibrary

REGION = "aws-us-east-2"
CONFIGS = ["1xL4", "1xA10G", "1xL40S"]
PRICE = builtin_catalog().prices(REGION)


def scenario(models: list[str], target: tuple[float, float] = (1.0, 1.0)) -> Scenario:
    return Scenario(
        name="tiny", regions=[REGION], configs=CONFIGS, availability={"mode": "headroom", "factor": 1.5},
        target_utilization=TargetUtilization(prefill=target[0], decode=target[1]),
        models=[ScenarioModel(model=m, prefill_slo_ms=1000, decode_slo_ms=50, request_rate=2.0, mean_input_tokens=100,
                              mean_output_tokens=20, request_classes="off") for m in models],
    )


def template(model: str, phase: Phase, counts: dict[str, int], thr: float) -> Template:
    nodes = tuple(c for c, n in counts.items() for _ in range(n))
    stage = Stage(layers=4, nodes=nodes, node_throughput=tuple(thr / len(nodes) for _ in nodes))
    return Template(id=0, model=model, phase=phase, slo_ms=1000, counts=counts, stages=(stage,), throughput=thr)


def golden_library() -> TemplateLibrary:
    """Prefill: 1xL4 (100 tok/s), 2 nodes of 1xL40S (500), 1xL4 + 1xL40S (400, heterogeneous); decode: 1xA10G."""
    rows = [template("a", Phase.PREFILL, {"1xL4": 1}, 100.0),
            template("a", Phase.PREFILL, {"1xL40S": 2}, 500.0),
            template("a", Phase.PREFILL, {"1xL4": 1, "1xL40S": 1}, 400.0),
            template("a", Phase.DECODE, {"1xA10G": 1}, 1000.0)]
    return TemplateLibrary.from_templates(CONFIGS, rows, {})


def test_golden_case_orders_the_methods_as_solved_by_hand() -> None:
    lib, sc = golden_library(), scenario(["a"])
    dem = {("a", Phase.PREFILL): 600.0, ("a", Phase.DECODE): 10.0}
    l4, l40s, a10g = PRICE["1xL4"], PRICE["1xL40S"], PRICE["1xA10G"]
    assert 500 / (2 * l40s) > 100 / l4  # the pair of L40S nodes is the best homogeneous goodput/USD
    # homo-greedy replicates the best homogeneous prefill strategy: ceil(600 / 500) = 2 copies
    greedy = baselines.homo_greedy(lib, sc, demand=dem, availability=UNLIMITED)
    assert greedy.cost_per_hour == pytest.approx(4 * l40s + a10g)
    # homo-ilp: min over a·100 + b·500 ≥ 600 → one L40S pair + one L4
    homo = baselines.homo_ilp(lib, sc, demand=dem, availability=UNLIMITED, gap=1e-9)
    assert homo.cost_per_hour == pytest.approx(2 * l40s + l4 + a10g)
    assert all(len(i.counts) == 1 for i in homo.instances)
    assert {i.template_id for i in homo.instances} == {1, 0, 3}  # ids of the full library
    # Coral: the heterogeneous 400 tok/s replica + two 1xL4 replicas
    coral = allocate(lib, sc, demand=dem, availability=UNLIMITED, gap=1e-9)
    assert coral.cost_per_hour == pytest.approx(3 * l4 + l40s + a10g)
    # cauchy-paper: 6 req/s of prefill, every unit has its own decode replica: (pair + dec) + (L4 + dec)
    cauchy = baselines.cauchy_paper(lib, sc, demand=dem, availability=UNLIMITED, gap=1e-9)
    assert cauchy.cost_per_hour == pytest.approx(2 * l40s + l4 + 2 * a10g)
    assert coral.cost_per_hour < homo.cost_per_hour < cauchy.cost_per_hour < greedy.cost_per_hour


def test_homo_greedy_falls_back_to_the_next_strategy_when_availability_runs_out() -> None:
    lib, sc = golden_library(), scenario(["a"])
    dem = {("a", Phase.PREFILL): 600.0, ("a", Phase.DECODE): 10.0}
    plan = baselines.homo_greedy(lib, sc, demand=dem, availability={REGION: {"1xL40S": 2, "1xL4": 3, "1xA10G": 1}})
    counts = sorted(tuple(i.counts.items()) for i in plan.instances)
    assert counts == [(("1xA10G", 1),), (("1xL4", 1),), (("1xL40S", 2),)]
    assert plan.cost_per_hour == pytest.approx(2 * PRICE["1xL40S"] + PRICE["1xL4"] + PRICE["1xA10G"])


def random_library(seed: int, models: list[str], n: int = 8) -> TemplateLibrary:
    rng = np.random.default_rng(seed)
    rows = []
    for m in models:
        for phase in Phase:
            for _ in range(n):
                picks = [CONFIGS[int(i)] for i in rng.integers(0, len(CONFIGS), int(rng.integers(1, 4)))]
                if rng.random() < 0.5:
                    picks = [picks[0]] * len(picks)
                counts: dict[str, int] = {}
                for c in picks:
                    counts[c] = counts.get(c, 0) + 1
                rows.append(template(m, phase, counts, float(rng.integers(20, 200)) * len(picks)))
            rows.append(template(m, phase, {CONFIGS[int(rng.integers(0, 3))]: 1}, float(rng.integers(20, 200))))
    return TemplateLibrary.from_templates(CONFIGS, rows, {})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), n_avail=st.sampled_from([None, 4, 8]))
def test_coral_le_homo_ilp_le_homo_greedy_and_cauchy(seed: int, n_avail: int | None) -> None:
    lib, sc = random_library(seed, ["a", "b"]), scenario(["a", "b"])
    av = UNLIMITED if n_avail is None else {REGION: dict.fromkeys(CONFIGS, n_avail)}
    plans = compare_plans(lib, sc, av, None, time_limit=30.0)
    met = {m: all(s.served_fraction >= 1 - 1e-9 for s in p.serving) and p.mode == "cost" for m, p in plans.items()}
    cost = {m: p.cost_per_hour for m, p in plans.items()}
    for m in ("homo-ilp", "homo-greedy", "cauchy-paper"):
        assert all(len(i.counts) == 1 for i in plans[m].instances)
    if met["coral"] and met["homo-ilp"]:
        assert cost["coral"] <= cost["homo-ilp"] * (1 + 2e-4)
    for m in ("homo-greedy", "cauchy-paper"):
        if met[m]:
            assert met["homo-ilp"] and cost["homo-ilp"] <= cost[m] * (1 + 2e-4)


def test_paper_prices_follow_table_1() -> None:
    cat = builtin_catalog()
    rel = paper_setting().relative_cost_per_gpu
    paper = paper_catalog(cat, rel)
    for region in ("aws-us-east-2", "gcp-us-central1"):
        prices = paper.prices(region)
        assert set(prices) == {c for c in cat.prices(region) if c.split("x", 1)[1] in rel}
        assert prices["8xH100"] / prices["1xL4"] == pytest.approx(8 * rel["H100"])
    assert paper.prices("aws-us-east-2")["4xL40S"] / paper.prices("aws-us-east-2")["1xL4"] == pytest.approx(8.8)
    assert paper.prices("aws-us-east-2")["1xL4"] == pytest.approx(paper.prices("gcp-us-central1")["1xL4"])


def test_waterfall_steps_match_running_each_setting_directly() -> None:
    lib, sc = random_library(3, ["a", "b"]), scenario(["a", "b"], target=(0.5, 0.8))
    rows = waterfall_rows(lib, sc)
    steps = waterfall_settings(sc)
    assert len(rows) == len(paper_setting().waterfall) + 1 == len(steps)
    assert steps[-1].scenario == sc and steps[-1].catalog == builtin_catalog() and not steps[-1].unlimited
    first = steps[0]
    assert first.unlimited and first.scenario.target_utilization == TargetUtilization(prefill=1.0, decode=1.0)
    direct = {
        0: compare_plans(lib, first.scenario, UNLIMITED, None, 30.0,
                         paper_catalog(builtin_catalog(), paper_setting().relative_cost_per_gpu)),
        len(rows) - 1: compare_plans(lib, sc, resolve_availability(sc, lib), None, 30.0),
    }
    for step, plans in direct.items():
        assert rows[step]["coral"] == pytest.approx(plans["coral"].cost_per_hour, abs=1e-4)
        for m in ("homo-ilp", "homo-greedy", "cauchy-paper"):
            assert rows[step][m] == pytest.approx(plans[m].cost_per_hour, abs=1e-4)
            assert rows[step][f"{m} x"] == pytest.approx(plans[m].cost_per_hour / plans["coral"].cost_per_hour,
                                                         rel=1e-3)
    assert rows[0]["coral"] != rows[-1]["coral"]
