"""View-model numbers of the report: cost breakdowns, instance diagrams, comparisons, CDFs, live state."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coral.allocation.plan import Plan
from coral.catalog.loader import CoralInputError, builtin_catalog
from coral.report import ReportInputs, adapt_inputs, latency_from_requests, load_inputs, view_model
from coral.report.examples import example_baseline, example_inputs, example_plan, make_instance, make_plan
from coral.report.inputs import LatencySeries, cdf_at, cdf_points, quantile
from coral.report.view import gpu_colors, gpu_cost_split, live_section

# Hand-computed from offerings.yaml (aws-us-east-2: 1xL40S 1.861, 4xL4 4.6016, 1xA10G 1.006;
# aws-ap-northeast-2: 1xL40S 2.288, 1xL4 0.9896).
QWEN_PREFILL = 1.861 + 4.6016 + 2 * 1.006
QWEN_DECODE = 2 * 2.288


@pytest.fixture(scope="module")
def vm() -> dict:
    return view_model(example_plan(), baselines=[example_baseline()], sim=example_inputs())


def test_every_breakdown_adds_up_to_the_plan_cost(vm: dict) -> None:
    total = example_plan().cost_per_hour
    assert vm["summary"]["cost_per_hour"] == pytest.approx(total)
    for key in ("by_model", "by_phase", "by_region", "by_gpu"):
        assert sum(b["value"] for b in vm["costs"][key]) == pytest.approx(total), key
    assert sum(r["cost_per_hour"] for r in vm["serving"]) == pytest.approx(total)
    assert vm["notes"] == []


def test_cost_per_model_golden(vm: dict) -> None:
    by_model = {b["label"]: b["value"] for b in vm["costs"]["by_model"]}
    assert by_model["qwen3-32b"] == pytest.approx(2 * QWEN_PREFILL + 2 * QWEN_DECODE)
    assert by_model["gpt-oss-20b"] == pytest.approx(2.288 + 0.9896 + 0.8048)
    values = [b["value"] for b in vm["costs"]["by_model"]]
    assert values == sorted(values, reverse=True)


def test_gpu_split_of_the_three_stage_instance_uses_node_prices() -> None:
    het = next(i for i in example_plan().instances if i.model == "qwen3-32b" and i.phase == "prefill")
    split = gpu_cost_split(het, builtin_catalog())
    assert split == pytest.approx({"L40S": 1.861, "L4": 4.6016, "A10G": 2.012})


def test_gpu_split_falls_back_to_gpu_counts_without_prices() -> None:
    inst = make_instance(
        "phi-4", "prefill", 1, "aws-us-east-2", [(20, ["1xL40S"], [1.0]), (20, ["4xL4"], [1.0])]
    )
    inst = inst.model_copy(update={"region": "nowhere", "cost_per_hour": 10.0})
    assert gpu_cost_split(inst, builtin_catalog()) == pytest.approx({"L40S": 2.0, "L4": 8.0})


def test_instance_groups_cover_every_instance_with_contiguous_layers(vm: dict) -> None:
    plan = example_plan()
    groups = vm["instance_groups"]
    assert sum(g["count"] for g in groups) == len(plan.instances)
    assert sorted(i for g in groups for i in g["ids"]) == sorted(i.id for i in plan.instances)
    het = next(g for g in groups if g["model"] == "qwen3-32b" and g["phase"] == "prefill")
    assert het["count"] == 2 and het["heterogeneous"]
    ranges = [(s["first_layer"], s["last_layer"]) for s in het["stages"]]
    assert ranges == [(0, 19), (20, 43), (44, 63)]
    assert [[n["config"] for n in s["nodes"]] for s in het["stages"]] == [
        ["1xL40S"],
        ["4xL4"],
        ["1xA10G", "1xA10G"],
    ]
    assert [n["gpu"] for n in het["stages"][2]["nodes"]] == ["A10G", "A10G"]


def test_summary_counts(vm: dict) -> None:
    sm = vm["summary"]
    assert (sm["n_instances"], sm["n_nodes"], sm["n_gpus"], sm["n_heterogeneous"]) == (9, 18, 27, 3)


def test_comparison_ratio_and_served(vm: dict) -> None:
    rows = {r["method"]: r for r in vm["comparison"]["rows"]}
    coral, homo = example_plan(), example_baseline()
    assert rows["coral"]["ratio"] == pytest.approx(1.0)
    assert rows["homo"]["ratio"] == pytest.approx(homo.cost_per_hour / coral.cost_per_hour)
    assert rows["homo"]["min_served_fraction"] == pytest.approx(14000 / 20480)
    assert sum(rows["homo"]["by_model"].values()) == pytest.approx(homo.cost_per_hour)
    assert vm["comparison"]["rows"][0]["method"] == "coral"


def test_mismatched_plan_total_becomes_a_note() -> None:
    plan = example_plan().model_copy(update={"cost_per_hour": 1.0})
    notes = view_model(plan)["notes"]
    assert len(notes) == 1 and "$1.00/h" in notes[0]


def test_gpu_colours_are_stable_and_distinct() -> None:
    a = gpu_colors(["L4", "L40S", "A10G"])
    assert a == gpu_colors(["A10G", "L4", "L40S", "L40S"])
    assert len(set(a.values())) == 3
    assert gpu_colors(["MysteryGPU"]) == gpu_colors(["MysteryGPU"])


def test_view_model_is_strict_json(vm: dict) -> None:
    assert json.loads(json.dumps(vm, allow_nan=False)) == vm


def test_epochs_grouped_per_method_plan_method_first(vm: dict) -> None:
    assert [s["method"] for s in vm["epochs"]] == ["coral", "homo"]
    for series in vm["epochs"]:
        assert [p["epoch"] for p in series["points"]] == [0, 1, 2, 3, 4]
    extra = view_model(
        example_plan(), epochs=[{"epoch": 1, "cost_per_hour": 3.0}, {"epoch": 0, "cost_per_hour": 2.0}]
    )
    assert extra["epochs"] == [
        {
            "method": "coral",
            "points": [
                {"epoch": 0, "cost_per_hour": 2.0, "goodput": 0.0, "churn": 0.0},
                {"epoch": 1, "cost_per_hour": 3.0, "goodput": 0.0, "churn": 0.0},
            ],
        }
    ]


def test_latency_stats_from_samples_and_from_cdf_points() -> None:
    samples = [float(x) for x in range(1000, 0, -100)]  # 100..1000, unsorted
    sim = ReportInputs(latency={"m": LatencySeries(ttft_ms=samples, tpot_ms=[(10.0, 0.5), (20.0, 1.0)],
                                                  slo_ttft_ms=450, slo_tpot_ms=15)})  # fmt: skip
    charts = {c["metric"]: c for c in view_model(example_plan(), sim=sim)["latency"]}
    ttft, tpot = charts["ttft"], charts["tpot"]
    assert (ttft["attainment"], ttft["p50"], ttft["p90"], ttft["p99"], ttft["n"]) == (
        0.4,
        500.0,
        900.0,
        1000.0,
        10,
    )
    assert ttft["points"][0] == [100.0, 0.1] and ttft["points"][-1] == [1000.0, 1.0]
    assert (tpot["attainment"], tpot["p50"], tpot["p99"]) == (0.5, 10.0, 20.0)


def test_cdf_points_repair_non_monotone_input() -> None:
    assert cdf_points([(1.0, 0.2), (3.0, 1.0), (2.0, 0.1)]) == [[1.0, 0.2], [2.0, 0.2], [3.0, 1.0]]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0, 1e5, allow_nan=False), min_size=1, max_size=900),
    st.floats(0, 1e5, allow_nan=False),
)
def test_cdf_thinning_keeps_ends_and_exact_stats(samples: list[float], slo: float) -> None:
    full = cdf_points(samples)
    thin = cdf_points(samples, 50)
    assert len(thin) <= 50 and thin[0] == full[0] and thin[-1] == full[-1]
    assert all(a[0] <= b[0] and a[1] <= b[1] for a, b in itertools.pairwise(thin))
    assert cdf_at(full, slo) == pytest.approx(sum(x <= slo for x in samples) / len(samples))
    assert quantile(full, 1.0) == max(samples)


def test_adapt_inputs_from_request_records_and_unknown_keys() -> None:
    inputs = adapt_inputs(
        {
            "requests": [
                {"model": "a", "ttft_s": 0.5, "tpot_ms": 20},
                {"model": "a", "ttft_ms": 700},
                {"model": "", "ttft_ms": 1},
                {"model": "b", "tpot_s": 0.03},
            ],
            "slos": {"a": {"ttft_ms": 600, "tpot_ms": 25}},
            "whatever_the_simulator_adds": {"x": 1},
        }
    )
    assert inputs.latency["a"].ttft_ms == [500.0, 700.0]
    assert inputs.latency["a"].tpot_ms == [20.0]
    assert (inputs.latency["a"].slo_ttft_ms, inputs.latency["b"].slo_ttft_ms) == (600, None)
    assert inputs.latency["b"].tpot_ms == pytest.approx([30.0])
    assert latency_from_requests([]) == {}


def test_bad_inputs_name_the_field(tmp_path) -> None:
    with pytest.raises(CoralInputError, match=r"epochs\.0\.cost_per_hour"):
        adapt_inputs({"epochs": [{"epoch": 0, "cost_per_hour": -1}]})
    with pytest.raises(CoralInputError, match="requests: must be a list"):
        adapt_inputs({"requests": 12})
    with pytest.raises(CoralInputError, match="schema_version"):
        adapt_inputs({"schema_version": 2})
    path = tmp_path / "sim.json"
    path.write_text(json.dumps({"latency": {"m": {"ttft_ms": [[5, 1.5]]}}}))
    with pytest.raises(CoralInputError, match=r"sim\.json.*\n.*latency\.m\.ttft_ms"):
        load_inputs(path)
    path.write_text("[1, 2]")
    with pytest.raises(CoralInputError, match="mapping"):
        load_inputs(path)


def test_load_inputs_round_trip_yaml_and_json(tmp_path) -> None:
    inputs = example_inputs(seed=3, n=20)
    (tmp_path / "a.json").write_text(inputs.model_dump_json())
    assert load_inputs(tmp_path / "a.json") == inputs
    (tmp_path / "b.yaml").write_text("epochs:\n  - {epoch: 2, cost_per_hour: 4.5, goodput: 10}\n")
    assert load_inputs(tmp_path / "b.yaml").epochs[0].cost_per_hour == 4.5


def test_example_inputs_are_seeded() -> None:
    assert example_inputs(seed=1) == example_inputs(seed=1)
    assert example_inputs(seed=1) != example_inputs(seed=2)


def test_live_section_traffic_split_and_tolerance() -> None:
    plan = example_plan()
    ids = [i.id for i in plan.instances_of("phi-4", "prefill")]
    live = live_section(
        plan,
        [
            {"id": ids[0], "state": "READY", "inflight": 3, "requests": 10, "weight": 3.0},
            {"id": ids[1], "state": "starting", "weight": 1.0},
            {"id": "stray", "model": "x", "phase": "decode", "weight": "not a number"},
            {},
            "garbage",  # type: ignore[list-item]
        ],
    )
    assert live["states"] == {"ready": 1, "starting": 1, "unknown": 2}
    split = {(t["model"], t["phase"]): t["shares"] for t in live["traffic"]}
    assert [s["share"] for s in split[("phi-4", "prefill")]] == [0.75, 0.25]
    assert [s["share"] for s in split[("x", "decode")]] == [0.0]
    assert (live["total_inflight"], live["total_requests"]) == (3.0, 10.0)


def test_empty_plan_renders() -> None:
    vm = view_model(make_plan("coral", []))
    assert vm["instance_groups"] == [] and vm["summary"]["n_instances"] == 0
    assert all(v == [] for v in vm["costs"].values())


def test_inputs_from_a_real_simulation(tmp_path) -> None:
    from coral.catalog.loader import load_scenario
    from coral.report import inputs_from_sim
    from coral.simulation.run import simulate

    scenario = load_scenario("core")
    result = simulate(example_plan(), scenario, duration_s=60, seed=0, startup_delay_s=0, epoch_s=30)
    inputs = inputs_from_sim(result, method="coral")
    assert sorted(inputs.latency) == sorted(m.model for m in scenario.models)
    assert [e.epoch for e in inputs.epochs] == [e.epoch for e in result.epochs]
    charts = {(c["model"], c["metric"]): c for c in view_model(example_plan(), sim=inputs)["latency"]}
    for m in result.models:
        ttft = charts[(m.model, "ttft")]
        assert ttft["attainment"] == m.ttft_attainment and ttft["n"] == m.requests
        assert ttft["slo_ms"] == next(s.prefill_slo_ms for s in scenario.models if s.model == m.model)
        assert ttft["points"][-1] == [pytest.approx(m.ttft_ms.max), 1.0]
    assert inputs.overall_attainment == result.slo_attainment and inputs.scenario == "core"
    # time series come from the per-request record: every request counted once in the rate bins
    ts = inputs.timeseries
    assert ts is not None and len(ts.t_s) == len(ts.rate["phi-4"])
    assert sum(sum(r or 0.0 for r in ts.rate[m.model]) * ts.bin_s for m in result.models) == pytest.approx(result.requests)
    assert all(q is not None and q >= 0 for m in result.models for q in ts.queue[m.model])
    path = result.save_json(tmp_path / "sim.json")
    assert load_inputs(path, method="coral") == inputs.model_copy(update={"timeseries": None})
    # the SimResult object (or its JSON dict) can be handed to the report directly
    direct = view_model(example_plan(), sim=result)
    assert direct["latency"] == view_model(example_plan(), sim=result.model_dump(mode="json"))["latency"]
    assert direct["latency"] == list(charts.values())


def test_slo_section_pass_fail_against_the_target() -> None:
    """Hand-made attainments: pass means at least the target share of requests within the SLO."""
    inputs = ReportInputs(
        latency={
            "a": LatencySeries(ttft_ms=[1.0], slo_ttft_ms=100, slo_tpot_ms=10, ttft_attainment=0.95,
                               tpot_attainment=0.85, slo_attainment=0.84),
            "b": LatencySeries(ttft_ms=[50.0, 150.0, 90.0, 80.0], slo_ttft_ms=100),
        },
        overall_attainment=0.91,
    )
    slo = view_model(example_plan(), sim=inputs)["slo"]
    rows = {r["model"]: r for r in slo["models"]}
    assert (rows["a"]["ttft_pass"], rows["a"]["tpot_pass"], rows["a"]["pass"]) == (True, False, False)
    assert rows["b"]["ttft_attainment"] == 0.75 and rows["b"]["ttft_pass"] is False  # 3 of 4 within 100 ms
    assert rows["b"]["tpot_pass"] is None and rows["b"]["pass"] is None
    assert (slo["overall"], slo["overall_pass"], slo["target"]) == (0.91, True, 0.9)
    assert view_model(example_plan(), sim=inputs, slo_target=0.95)["slo"]["overall_pass"] is False


def test_savings_per_model_and_phase_add_up(vm: dict) -> None:
    plan, base = example_plan(), example_baseline()
    (sv,) = vm["savings"]
    assert sv["method"] == base.method
    assert sum(r["saving"] for r in sv["rows"]) == pytest.approx(base.cost_per_hour - plan.cost_per_hour)
    assert [r["saving"] for r in sv["rows"]] == sorted((r["saving"] for r in sv["rows"]), reverse=True)
    top = sv["rows"][0]
    assert f"{top['model']} {top['phase']}" in sv["text"]


def test_engine_badges_follow_stock_vllm(vm: dict) -> None:
    from coral.deploy.vllm import realisable

    plan = example_plan()
    for g in vm["instance_groups"]:
        inst = next(i for i in plan.instances if i.id == g["ids"][0])
        check = realisable(inst, builtin_catalog().model(inst.model), inst.phase)
        assert g["engines"] == {"coral": True, "vllm": check.ok, "vllm_reason": check.reason}


def test_demand_assumptions_come_from_the_scenario(vm: dict) -> None:
    from coral.catalog.loader import load_scenario

    sc = load_scenario(example_plan().scenario)
    assert [d["model"] for d in vm["demand"]] == [m.model for m in sc.models]
    assert vm["demand"][0]["request_rate"] == sc.models[0].request_rate


def test_simulation_of_another_plan_is_flagged() -> None:
    from coral.report.view import plan_fingerprint

    plan, other = example_plan(), example_baseline()
    assert plan_fingerprint(plan) != plan_fingerprint(other)
    assert plan_fingerprint(plan) == plan_fingerprint(plan.model_copy(update={"created_at": "x"}))
    same = ReportInputs(scenario=plan.scenario, plan_fingerprint=plan_fingerprint(plan))
    assert view_model(plan, sim=same)["notes"] == []
    notes = view_model(plan, sim=same.model_copy(update={"plan_fingerprint": plan_fingerprint(other)}))["notes"]
    assert any("another plan" in n for n in notes)
    notes = view_model(plan, sim=ReportInputs(scenario="extended"))["notes"]
    assert any("'extended'" in n for n in notes)


def checked(plan: Plan, attained: dict[str, float], target: float, engine: str = "coral") -> Plan:
    """`plan` as the planner's SLO check leaves it: `target` per model, `attained` on held-out requests."""
    from coral.allocation.plan import SloCheck

    verdict = {m: "pass" if a >= target else "fail: short" for m, a in attained.items()}
    slo = SloCheck(target=dict.fromkeys(attained, target), tuned=attained, held_out=attained, duration_s=60.0,
                   verdict=verdict)
    return plan.model_copy(update={"slo": slo, "engine": engine})


def test_one_pass_threshold_the_plans_target() -> None:
    """SLO verdicts and CDF captions use the plan's attainment target (default 0.9), never another threshold."""
    models = ["gpt-oss-20b", "phi-4", "qwen3-32b"]
    inputs = example_inputs()
    default = view_model(example_plan(), sim=inputs)
    assert default["slo"]["target"] == 0.9 and {c["target"] for c in default["latency"]} == {0.9}
    assert all(r["target"] == 0.9 for r in default["slo"]["models"])
    # every example CDF has 96-98 % within its SLO: a pass at the default target (captions were red below 99 %)
    assert all(0.9 <= c["attainment"] < 0.99 for c in default["latency"])
    strict = view_model(checked(example_plan(), dict.fromkeys(models, 0.99), 0.97), sim=inputs)
    assert strict["slo"]["target"] == 0.97 and {c["target"] for c in strict["latency"]} == {0.97}
    verdicts = {row["model"]: row["ttft_pass"] for row in strict["slo"]["models"]}
    assert verdicts == {"gpt-oss-20b": True, "phi-4": True, "qwen3-32b": False}  # 97.5 %, 97 %, 96.5 % within
    mixed = checked(example_plan(), dict.fromkeys(models, 0.97), 0.95)
    mixed.slo.target["phi-4"] = 0.8  # type: ignore[union-attr]
    rows = {r["model"]: r for r in view_model(mixed, sim=inputs)["slo"]["models"]}
    assert rows["phi-4"]["target"] == 0.8 and rows["qwen3-32b"]["target"] == 0.95


def test_title_names_the_engine_and_comparison_states_attainment() -> None:
    from coral.report.inputs import MethodResult

    models = ["gpt-oss-20b", "phi-4", "qwen3-32b"]
    plan = checked(example_plan(), dict.fromkeys(models, 0.96), 0.95, engine="vllm")
    base = checked(example_baseline(), {"gpt-oss-20b": 0.99, "phi-4": 0.93, "qwen3-32b": 0.97}, 0.95)
    vm = view_model(plan, baselines=[base])
    assert vm["title"] == "Coral plan — core (coral) for stock vLLM" and vm["summary"]["engine"] == "vllm"
    assert view_model(example_plan())["title"].endswith("for the Coral engine")
    rows = {r["method"]: r for r in vm["comparison"]["rows"]}
    assert (rows["homo"]["attainment"], rows["homo"]["attainment_pass"]) == (0.93, False)
    assert rows["homo"]["attainment_source"] == "planner's check, worst model (phi-4)"
    assert (rows["coral"]["attainment"], rows["coral"]["attainment_pass"]) == (0.96, True)
    # a simulated run of the method wins over the planner's check; unknown stays None
    runs = example_inputs().model_copy(update={"methods": [MethodResult(method="homo", slo_attainment=0.91)]})
    rows = {r["method"]: r for r in view_model(plan, baselines=[base], sim=runs)["comparison"]["rows"]}
    assert (rows["homo"]["attainment"], rows["homo"]["attainment_pass"], rows["homo"]["attainment_source"]) == (
        0.91, False, "simulated")
    bare = {r["method"]: r for r in view_model(example_plan(), baselines=[example_baseline()])["comparison"]["rows"]}
    assert bare["homo"]["attainment"] is None and bare["homo"]["attainment_pass"] is None


def test_what_to_rent_adds_up_to_the_plan(vm: dict) -> None:
    plan = example_plan()
    bom = vm["bom"]
    assert bom["total_per_hour"] == pytest.approx(plan.cost_per_hour) and bom["matches_plan"]
    assert bom["count"] == sum(i.n_nodes for i in plan.instances)
    east_l40s = next(r for r in bom["rows"] if r["instance_type"] == "g6e.xlarge" and r["region"] == "aws-us-east-2")
    assert (east_l40s["count"], east_l40s["price_per_hour"]) == (4, 1.861)  # 2 qwen prefill + 2 phi-4 prefill
    assert east_l40s["used_by"] == "phi-4 prefill ×2, qwen3-32b prefill ×2"
    assert view_model(make_plan("coral", []))["bom"] is None
