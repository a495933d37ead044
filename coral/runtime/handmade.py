"""Plans built by hand (tests, benchmarks, demos without a template library): one call per instance."""

from __future__ import annotations

from collections.abc import Sequence

from coral.allocation.plan import Plan, PlanInstance, SolveReport
from coral.catalog.loader import Catalog, builtin_catalog


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


def two_gpu_catalog(region: str = "aws-us-east-2", gpus: tuple[str, ...] = ("L40S", "A10G")) -> Catalog:
    """The built-in catalog plus 2-GPU nodes of `gpus` in `region`, which AWS does not sell (`/replan` checks a
    plan against the catalog), each at twice the 1-GPU node's price: for hand-made plans on such nodes."""
    base = builtin_catalog()
    extra = [o.model_copy(update={"gpus_per_node": 2, "instance_type": f"handmade-2x{o.gpu.lower()}",
                                  "price_per_hour": 2 * o.price_per_hour})
             for o in base.offerings if o.region == region and o.gpus_per_node == 1 and o.gpu in gpus]
    return base.with_offerings([*base.offerings, *extra])
