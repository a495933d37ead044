"""Plans built by hand (tests, benchmarks, demos without a template library): one call per instance."""

from __future__ import annotations

from collections.abc import Sequence

from coral.allocation.plan import Plan, PlanInstance, SolveReport


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
    n_nodes = sum(len(nodes) for _, nodes in stages)
    per_node = throughput / n_nodes * len(stages)
    return PlanInstance.of_stages(model, phase, template_id, region, index,
                                  [(layers, nodes, [per_node] * len(nodes)) for layers, nodes in stages],
                                  throughput, cost_per_hour)


def make_plan(instances: Sequence[PlanInstance], scenario: str = "handmade") -> Plan:
    return Plan(
        scenario=scenario,
        method="handmade",
        instances=list(instances),
        serving=[],
        cost_per_hour=sum(i.cost_per_hour for i in instances),
        solve=SolveReport(status="handmade"),
    )
