"""Request-length classes: class derivation, schema, hand-solved goldens, and properties of the shared-capacity
formulation (one class == scalar demand, demand met per class, reductions lossless)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from coral.allocation import classes as classes_mod
from coral.allocation import milp, reference
from coral.allocation.allocator import UNLIMITED, InfeasibleDemand, allocate
from coral.allocation.classes import (
    AUTO_CLASSES,
    LengthClass,
    demand_split,
    model_classes,
    prompt_spread,
    quantile_classes,
)
from coral.allocation.reductions import pareto_columns
from coral.catalog.loader import builtin_catalog
from coral.catalog.schema import (
    AvailabilityHeadroom,
    RequestClass,
    Scenario,
    ScenarioModel,
    TargetUtilization,
)
from coral.perf.model import Phase
from coral.templates.library import Stage, Template, TemplateLibrary

REGION = "aws-us-east-2"
CONFIGS = ["1xL4", "1xA10G", "1xL40S", "4xL4"]
SHORT_LONG = [RequestClass(share=0.5, mean_input_tokens=50, mean_output_tokens=100, name="short"),
              RequestClass(share=0.5, mean_input_tokens=150, mean_output_tokens=100, name="long")]


def scenario(request_classes: object, regions: list[str] | None = None) -> Scenario:
    """One model; capacity planned at the mean (target utilisation 1) so that the scenario's demand is its traffic."""
    return Scenario(
        name="classes", regions=regions or [REGION], configs=CONFIGS, availability=AvailabilityHeadroom(factor=3.0),
        target_utilization=TargetUtilization(prefill=1.0, decode=1.0),
        models=[ScenarioModel(model="phi-4", prefill_slo_ms=1000, decode_slo_ms=50, request_rate=1.0,
                              mean_input_tokens=100, mean_output_tokens=100,
                              request_classes=request_classes)],  # type: ignore[arg-type]
    )


def library(rows: list[tuple[dict[str, int], float]]) -> TemplateLibrary:
    tpls = []
    for counts, thr in rows:
        nodes = tuple(c for c, n in counts.items() for _ in range(n))
        stage = Stage(layers=4, nodes=nodes, node_throughput=tuple(thr / len(nodes) for _ in nodes))
        tpls.append(Template(0, "phi-4", Phase.DECODE, 50, counts, (stage,), thr))
    return TemplateLibrary.from_templates(CONFIGS, tpls, {})


def rated(monkeypatch: pytest.MonkeyPatch, table: dict[int, list[float]]) -> None:
    """Class ratings by template id instead of the perf model (hand-made templates have no real placement)."""
    def fake(lib: TemplateLibrary, rows: np.ndarray, *args: object, **kwargs: object) -> np.ndarray:
        return np.array([table[int(r)] for r in rows], dtype=float).reshape(len(rows), -1)
    monkeypatch.setattr(classes_mod, "class_ratings", fake)
    monkeypatch.setattr(reference, "class_ratings", fake)


def prices() -> dict[str, float]:
    return builtin_catalog().prices(REGION)


def decode(d: float) -> dict[tuple[str, Phase], float]:
    return {("phi-4", Phase.PREFILL): 0.0, ("phi-4", Phase.DECODE): d}


def test_quantile_classes_and_spread() -> None:
    inp = np.array([10, 20, 30, 1000, 2000, 3000])
    out = np.array([1, 1, 1, 5, 5, 5])
    cl = quantile_classes(inp, out, 2)
    assert [c.share for c in cl] == [0.5, 0.5]
    assert (cl[0].input_tokens, cl[0].output_tokens, cl[1].input_tokens) == (20, 1, 2000)
    assert [c.max_input_tokens for c in cl] == [30, None]
    assert prompt_spread(np.full(10, 7)) == 1.0
    split = demand_split(cl, "prefill")
    assert split == pytest.approx([60 / 6060, 6000 / 6060])


def test_auto_classes_follow_the_trace_and_keep_the_scenario_means() -> None:
    sm = ScenarioModel(model="phi-4", prefill_slo_ms=1000, decode_slo_ms=50, request_rate=1, mean_input_tokens=1000,
                       mean_output_tokens=200, trace="azure-conversation", request_classes="auto")
    cl = model_classes(sm)
    assert len(cl) == AUTO_CLASSES
    assert [c.input_tokens for c in cl] == sorted(c.input_tokens for c in cl)
    assert sum(c.share for c in cl) == pytest.approx(1.0)
    assert sum(c.share * c.input_tokens for c in cl) == pytest.approx(1000)
    assert sum(c.share * c.output_tokens for c in cl) == pytest.approx(200)
    assert model_classes(sm.model_copy(update={"request_classes": "off"})) == [LengthClass("all", 1.0, 1000, 200)]
    assert len(model_classes(sm.model_copy(update={"trace": "synthetic"}))) == 1


def test_schema_rejects_bad_class_lists() -> None:
    with pytest.raises(ValidationError, match="sum to 1"):
        scenario([RequestClass(share=0.5, mean_input_tokens=1, mean_output_tokens=1)])
    with pytest.raises(ValidationError):
        scenario([])
    with pytest.raises(ValidationError):
        scenario("sometimes")


def test_golden_specialists_share_the_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """L4 serves short requests at 100 tok/s and long at 10, L40S the reverse; 100 tok/s of each. One of each
    (shares 1/0 and 0/1) is optimal; one type alone needs 11 instances (10 for the class it is bad at)."""
    lib = library([({"1xL4": 1}, 100.0), ({"1xL40S": 1}, 100.0)])
    rated(monkeypatch, {0: [100, 10], 1: [10, 100]})
    plan = allocate(lib, scenario(SHORT_LONG), demand=decode(200), availability=UNLIMITED, gap=1e-9)
    p = prices()
    assert min(11 * p["1xL4"], 11 * p["1xL40S"]) > p["1xL4"] + p["1xL40S"]
    assert plan.cost_per_hour == pytest.approx(p["1xL4"] + p["1xL40S"])
    assert sorted(i.template_id for i in plan.instances) == [0, 1]
    assert plan.serving[-1].served_fraction == pytest.approx(1.0)
    # the plan tells routers who serves which class: the L4 the short requests, the L40S the long ones
    shares = {i.template_id: i.class_throughput for i in plan.instances}
    assert shares[0] == pytest.approx({"short": 100.0, "long": 0.0})
    assert shares[1] == pytest.approx({"short": 0.0, "long": 100.0})
    assert [(c.name, c.max_input_tokens) for c in plan.request_classes["phi-4"]] == [("short", 100.0), ("long", None)]
    assert plan.class_of("phi-4", 100) == "short" and plan.class_of("phi-4", 101) == "long"
    assert plan.instances[0].weight_for("long") == 0.0 and plan.instances[0].weight_for(None) == 100.0


def test_golden_class_split_changes_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same ratings, short 200 tok/s and long 10 tok/s: three L4 (two on short, one on long) beat two L4 + one
    L40S (one L4 + one L40S tops out at 110 short tok/s)."""
    lib = library([({"1xL4": 1}, 100.0), ({"1xL40S": 1}, 100.0)])
    rated(monkeypatch, {0: [100, 10], 1: [10, 100]})
    mix = [RequestClass(share=200 / 210, mean_input_tokens=100, mean_output_tokens=100),
           RequestClass(share=10 / 210, mean_input_tokens=100, mean_output_tokens=100)]
    plan = allocate(lib, scenario(mix), demand=decode(210), availability=UNLIMITED, gap=1e-9)
    p = prices()
    assert 3 * p["1xL4"] < 2 * p["1xL4"] + p["1xL40S"]
    assert plan.cost_per_hour == pytest.approx(3 * p["1xL4"])
    assert [i.template_id for i in plan.instances] == [0, 0, 0]
    for inst in plan.instances:  # instances of one column split its work evenly: 200 short + 10 long over three
        assert inst.class_throughput == pytest.approx({"c1": 200 / 3, "c2": 10 / 3})


def _random_case(seed: int) -> tuple[TemplateLibrary, dict[int, list[float]], list[RequestClass]]:
    rng = np.random.default_rng(seed)
    rows, table = [], {}
    for i in range(int(rng.integers(3, 9))):
        k = int(rng.integers(1, 3))
        counts: dict[str, int] = {}
        for c in rng.choice(CONFIGS, k):
            counts[str(c)] = counts.get(str(c), 0) + 1
        rows.append((counts, float(rng.integers(20, 200))))
        table[i] = [float(rng.integers(5, 200)) for _ in range(2)]
    share = float(rng.uniform(0.1, 0.9))
    cls = [RequestClass(share=share, mean_input_tokens=100, mean_output_tokens=100),
           RequestClass(share=1 - share, mean_input_tokens=100, mean_output_tokens=100)]
    return library(rows), table, cls


def _per_class_feasible(lib: TemplateLibrary, table: dict[int, list[float]], split: list[float], d: float,
                        counts: dict[int, int]) -> bool:
    """Independent check: an LP over shares of the planned instances meets every class's demand."""
    ids = sorted(counts)
    n = 2 * len(ids)
    rows = milp.SparseRows(n)
    for c in range(2):
        rows.add(np.arange(c, n, 2), np.array([table[t][c] for t in ids]), split[c] * d * (1 - 1e-7), np.inf)
    for i, t in enumerate(ids):
        rows.add(np.array([2 * i, 2 * i + 1]), np.ones(2), -np.inf, float(counts[t]))
    res = milp.solve(np.zeros(n), np.zeros(n), np.full(n, np.inf), np.zeros(n, dtype=bool), rows, relax=True)
    return res.x is not None


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), d=st.floats(50, 2000))
def test_demand_met_per_class_and_reductions_lossless(monkeypatch: pytest.MonkeyPatch, seed: int, d: float) -> None:
    lib, table, cls = _random_case(seed)
    rated(monkeypatch, table)
    sc = scenario(cls, regions=[REGION, "aws-ap-northeast-2"])
    plan = allocate(lib, sc, demand=decode(d), availability=UNLIMITED, gap=1e-9)
    counts: dict[int, int] = {}
    for inst in plan.instances:
        counts[inst.template_id] = counts.get(inst.template_id, 0) + 1
    assert _per_class_feasible(lib, table, [c.share for c in cls], d, counts)
    plain = allocate(lib, sc, demand=decode(d), availability=UNLIMITED, gap=1e-9, reduce=False)
    assert plan.cost_per_hour == pytest.approx(plain.cost_per_hour, rel=1e-6)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), rate=st.floats(0.5, 20), scarce=st.booleans())
def test_allocator_matches_the_plain_formulation(monkeypatch: pytest.MonkeyPatch, seed: int, rate: float,
                                                 scarce: bool) -> None:
    """The pipeline (reductions, cuts, column generation, fixing) against `reference.plain_cost`."""
    lib, table, cls = _random_case(seed)
    rated(monkeypatch, table)
    sc = scenario(cls, regions=[REGION, "aws-ap-northeast-2"])
    sc = sc.model_copy(update={"models": [sc.models[0].model_copy(update={"request_rate": rate})]})
    avail = {REGION: {c: 3 for c in CONFIGS}, "aws-ap-northeast-2": {"1xL4": 2}} if scarce else None
    ref = reference.plain_cost(lib, sc, avail)
    try:
        plan = allocate(lib, sc, demand=decode(rate * 100), availability=avail or UNLIMITED, gap=1e-9)
    except InfeasibleDemand:
        assert ref is None
        return
    assert ref is not None and plan.cost_per_hour == pytest.approx(ref, rel=1e-6)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), d=st.floats(50, 2000))
def test_identical_classes_equal_the_scalar_plan(monkeypatch: pytest.MonkeyPatch, seed: int, d: float) -> None:
    """Two classes rated like the template itself are one class: the same optimal cost as scalar demand."""
    lib, _, cls = _random_case(seed)
    rated(monkeypatch, {i: [float(t)] * 2 for i, t in enumerate(lib.throughput)})
    two = allocate(lib, scenario(cls), demand=decode(d), availability=UNLIMITED, gap=1e-9)
    one = allocate(lib, scenario("off"), demand=decode(d), availability=UNLIMITED, gap=1e-9)
    assert two.cost_per_hour == pytest.approx(one.cost_per_hour, rel=1e-6)


def test_pareto_columns_golden() -> None:
    group = np.zeros(4, dtype=np.int64)
    cost = np.array([1.0, 2.0, 2.0, 1.0])
    thr = np.array([[10.0], [9.0], [20.0], [10.0]])
    usage = np.array([[1], [1], [1], [0]])
    keep = pareto_columns(group, cost, thr, usage, np.zeros(4, dtype=bool))
    # 1 is beaten by 0 (dearer, slower); 0 by 3 (same cost and speed, fewer scarce nodes); 2 is fastest
    assert keep.tolist() == [False, False, True, True]
    assert pareto_columns(group, cost, thr, usage, np.array([True, True, False, False])).tolist() == [True] * 2 + [True] * 2


def test_golden_goodput_with_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    """One L4 (100 short / 10 long tok/s) for 100 tok/s of each class: shares t and 10t fill it at t = 1/11."""
    lib = library([({"1xL4": 1}, 100.0), ({"1xL40S": 1}, 100.0)])
    rated(monkeypatch, {0: [100, 10], 1: [10, 100]})
    avail = {REGION: {"1xL4": 1, "1xL40S": 0}}
    plan = allocate(lib, scenario(SHORT_LONG), demand=decode(200), availability=avail, mode="goodput", gap=1e-9)
    assert [i.template_id for i in plan.instances] == [0]
    assert plan.serving[-1].served_fraction == pytest.approx(1 / 11, rel=1e-6)
