"""Plans the simulator can run without the allocator: instances from templates, and a greedy cover (the
cheapest $/throughput template of each (model, phase), replicated to cover demand x headroom). Used by the
benchmark, the tests and `coral simulate --greedy`; it is not Coral's allocator."""

from __future__ import annotations

import math

import numpy as np

from coral.allocation.plan import ModelServing, Plan, PlanInstance, SolveReport
from coral.catalog.loader import Catalog, CoralInputError, builtin_catalog
from coral.catalog.schema import Scenario
from coral.templates.library import Template, TemplateLibrary


def plan_instance(t: Template, region: str, cost_per_hour: float, index: int) -> PlanInstance:
    """One instance of template `t` in `region`."""
    return PlanInstance.of_stages(t.model, str(t.phase), t.id, region, index,
                                  [(s.layers, s.nodes, s.node_throughput) for s in t.stages], t.throughput,
                                  cost_per_hour, counts=dict(t.counts))


def plan_of(scenario: str, instances: list[PlanInstance], method: str = "hand") -> Plan:
    """A Plan holding `instances` (serving rows summarise capacity; demand left at 0)."""
    serving: dict[tuple[str, str], tuple[float, float]] = {}
    for i in instances:
        cap, cost = serving.get((i.model, i.phase), (0.0, 0.0))
        serving[(i.model, i.phase)] = (cap + i.throughput, cost + i.cost_per_hour)
    return Plan(
        scenario=scenario, method=method, instances=instances,
        serving=[ModelServing(model=m, phase=p, demand=0.0, capacity=c, served_fraction=1.0,  # type: ignore[arg-type]
                              cost_per_hour=k) for (m, p), (c, k) in serving.items()],
        cost_per_hour=sum(i.cost_per_hour for i in instances), solve=SolveReport(status="stand-in"),
    )


def greedy_plan(
    library: TemplateLibrary,
    scenario: Scenario,
    catalog: Catalog | None = None,
    headroom: float = 1.2,
    rate_scale: float = 1.0,
) -> Plan:
    """Cover every (model, phase) demand x `headroom` with copies of its cheapest-per-token template."""
    catalog = catalog or builtin_catalog()
    costs = {r: library.costs(catalog.prices(r)) for r in scenario.regions}
    instances: list[PlanInstance] = []
    for m in scenario.models:
        for phase, tokens in (("prefill", m.mean_input_tokens), ("decode", m.mean_output_tokens)):
            demand = m.request_rate * rate_scale * tokens * headroom
            rows = library.select(m.model, phase, include_dominated=False)
            if demand <= 0:
                continue
            if not len(rows):
                raise CoralInputError(f"library has no {phase} template for {m.model}")
            best: tuple[float, int, str] | None = None
            for region, c in costs.items():
                per_token = c[rows] / library.throughput[rows]
                k = int(np.argmin(per_token))
                if math.isfinite(per_token[k]) and (best is None or per_token[k] < best[0]):
                    best = (float(per_token[k]), int(rows[k]), region)
            if best is None:
                raise CoralInputError(f"no region offers the configs of any {phase} template of {m.model}")
            _, row, region = best
            t = library.template(row)
            copies = max(1, math.ceil(demand / t.throughput))
            cost = float(costs[region][row])
            instances += [plan_instance(t, region, cost, i) for i in range(copies)]
    return plan_of(scenario.name, instances, method="greedy")
