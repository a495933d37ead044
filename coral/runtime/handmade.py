"""Plans built by hand (tests, benchmarks, demos without a template library): one call per instance."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from coral.allocation.plan import Plan, PlanInstance, PlanStage, SolveReport


def make_instance(
    model: str,
    phase: str,
    stages: Sequence[tuple[int, Sequence[str]]],
    throughput: float,
    template_id: int = 0,
    region: str = "aws-us-east-2",
    index: int = 0,
    cost_per_hour: float = 1.0,
) -> PlanInstance:
    """An instance from `(layers, node configs)` per stage; node throughput splits the total evenly."""
    counts = Counter(n for _, nodes in stages for n in nodes)
    n_nodes = sum(counts.values())
    out, first = [], 0
    for layers, nodes in stages:
        thr = [throughput / n_nodes * len(stages)] * len(nodes)
        out.append(PlanStage(first_layer=first, layers=layers, nodes=list(nodes), node_throughput=thr))
        first += layers
    return PlanInstance(
        id=f"{model}.{phase}.t{template_id}.{region}.{index}",
        model=model,
        phase=phase,  # type: ignore[arg-type]
        template_id=template_id,
        region=region,
        counts=dict(counts),
        stages=out,
        throughput=throughput,
        cost_per_hour=cost_per_hour,
    )


def make_plan(instances: Sequence[PlanInstance], scenario: str = "handmade") -> Plan:
    return Plan(
        scenario=scenario,
        method="handmade",
        instances=list(instances),
        serving=[],
        cost_per_hour=sum(i.cost_per_hour for i in instances),
        solve=SolveReport(status="handmade"),
    )
