"""A small hand-made plan, baseline and simulation result (core scenario shapes) for `coral report --example`
and the report tests: three models, a three-stage heterogeneous Qwen3-32B prefill instance, two regions."""

from __future__ import annotations

import numpy as np

from coral.allocation.plan import ModelServing, Plan, PlanInstance, SolveReport
from coral.catalog.loader import builtin_catalog
from coral.report.inputs import EpochPoint, LatencySeries, ReportInputs

# (layers, node configs, tokens/s per node) per stage
StageSpec = tuple[int, list[str], list[float]]

_DEMAND = {  # tokens/s: 10 req/s x mean input (prefill) / output (decode) tokens, core scenario
    ("phi-4", "prefill"): 11550.0,
    ("phi-4", "decode"): 2110.0,
    ("gpt-oss-20b", "prefill"): 20480.0,
    ("gpt-oss-20b", "decode"): 280.0,
    ("qwen3-32b", "prefill"): 6110.0,
    ("qwen3-32b", "decode"): 1230.0,
}
SLOS_MS = {"phi-4": (1200.0, 60.0), "gpt-oss-20b": (900.0, 30.0), "qwen3-32b": (1600.0, 100.0)}


def make_instance(
    model: str, phase: str, template_id: int, region: str, stages: list[StageSpec], k: int = 0
) -> PlanInstance:
    """An instance priced at the built-in catalog's node prices; throughput = slowest stage."""
    prices = builtin_catalog().prices(region)
    cost = sum(prices[c] for _, nodes, _ in stages for c in nodes)
    throughput = min(sum(tput) for _, _, tput in stages)
    return PlanInstance.of_stages(model, phase, template_id, region, k, stages, throughput, cost)


def make_plan(method: str, instances: list[PlanInstance], notes: list[str] | None = None) -> Plan:
    """A plan over `instances` with serving rows against the example demand."""
    serving = []
    for (model, phase), demand in _DEMAND.items():
        mine = [i for i in instances if i.model == model and i.phase == phase]
        cap = sum(i.throughput for i in mine)
        serving.append(
            ModelServing(
                model=model,
                phase=phase,  # type: ignore[arg-type]
                demand=demand,
                capacity=cap,
                served_fraction=min(1.0, cap / demand),
                cost_per_hour=sum(i.cost_per_hour for i in mine),
            )
        )
    return Plan(
        scenario="core",
        method=method,
        instances=instances,
        serving=serving,
        cost_per_hour=sum(i.cost_per_hour for i in instances),
        solve=SolveReport(
            status="optimal",
            objective=sum(i.cost_per_hour for i in instances),
            gap=0.0,
            time_s=0.21,
            notes=notes or [],
        ),
        created_at="2026-12-02T14:00:00Z",
    )


def example_plan() -> Plan:
    """Coral-style plan: heterogeneous multi-stage prefill for Qwen3-32B, small nodes elsewhere."""
    e, a = "aws-us-east-2", "aws-ap-northeast-2"
    qwen_het = [
        (20, ["1xL40S"], [3200.0]),
        (24, ["4xL4"], [3100.0]),
        (20, ["1xA10G", "1xA10G"], [1600.0, 1550.0]),
    ]
    return make_plan(
        "coral",
        [
            make_instance("qwen3-32b", "prefill", 412, e, qwen_het, 0),
            make_instance("qwen3-32b", "prefill", 412, e, qwen_het, 1),
            make_instance(
                "qwen3-32b", "decode", 77, a, [(32, ["1xL40S"], [700.0]), (32, ["1xL40S"], [690.0])], 0
            ),
            make_instance(
                "qwen3-32b", "decode", 77, a, [(32, ["1xL40S"], [700.0]), (32, ["1xL40S"], [690.0])], 1
            ),
            *(make_instance("phi-4", "prefill", 9, e, [(40, ["1xL40S"], [6100.0])], k) for k in range(2)),
            make_instance("phi-4", "decode", 31, e, [(40, ["4xL4"], [2300.0])], 0),
            *(
                make_instance(
                    "gpt-oss-20b", "prefill", 5, a, [(24, ["1xL40S", "1xL4"], [14000.0, 7200.0])], k
                )
                for k in range(1)
            ),
            make_instance("gpt-oss-20b", "decode", 3, e, [(24, ["1xL4"], [400.0])], 0),
        ],
    )


def example_baseline() -> Plan:
    """Homo-style baseline: one homogeneous node type per replica, bigger nodes; under-serves gpt-oss prefill."""
    e = "aws-us-east-2"
    return make_plan(
        "homo",
        [
            *(make_instance("qwen3-32b", "prefill", 2, e, [(64, ["4xL40S"], [3900.0])], k) for k in range(2)),
            *(make_instance("qwen3-32b", "decode", 4, e, [(64, ["4xL40S"], [1400.0])], k) for k in range(1)),
            *(make_instance("phi-4", "prefill", 1, e, [(40, ["4xA10G"], [6000.0])], k) for k in range(2)),
            make_instance("phi-4", "decode", 6, e, [(40, ["4xL4"], [2300.0])], 0),
            make_instance("gpt-oss-20b", "prefill", 8, e, [(24, ["1xL40S"], [14000.0])], 0),
            make_instance("gpt-oss-20b", "decode", 3, e, [(24, ["1xL4"], [400.0])], 0),
        ],
    )


def example_inputs(seed: int = 0, n: int = 400) -> ReportInputs:
    """Seeded latency samples (log-normal around ~half the SLO) and five epochs for coral and homo."""
    rng = np.random.default_rng(seed)
    latency = {}
    for model, (ttft_slo, tpot_slo) in SLOS_MS.items():
        latency[model] = LatencySeries(
            ttft_ms=sorted(rng.lognormal(np.log(0.45 * ttft_slo), 0.45, n).round(1).tolist()),
            tpot_ms=sorted(rng.lognormal(np.log(0.55 * tpot_slo), 0.3, n).round(2).tolist()),
            slo_ttft_ms=ttft_slo,
            slo_tpot_ms=tpot_slo,
        )
    coral, homo = example_plan().cost_per_hour, example_baseline().cost_per_hour
    series = (("coral", coral, 31000, [8, 1, 2, 0, 1]), ("homo", homo, 26000, [7, 2, 3, 2, 2]))
    epochs = [
        EpochPoint(epoch=e, cost_per_hour=round(cost * (1.0 + 0.08 * np.sin(e)), 3),
                   goodput=round(goodput * (1.0 + 0.08 * np.sin(e)), 1), churn=churn[e], method=method)
        for e in range(5)
        for method, cost, goodput, churn in series
    ]
    return ReportInputs(epochs=epochs, latency=latency)
