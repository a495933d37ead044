"""Re-planning with Coral's allocator: every epoch, allocate on the demand observed over the previous epoch (or
the scenario's forecast at epoch 0), the availability in force, and the running plan (scale-up penalty)."""

from __future__ import annotations

from coral.allocation.allocator import InfeasibleDemand, Mode, allocate
from coral.allocation.plan import Plan
from coral.catalog.loader import Catalog
from coral.catalog.schema import Scenario
from coral.perf.model import Phase
from coral.simulation.engine import ObservedDemand, Replanner
from coral.templates.library import TemplateLibrary


def allocator_replanner(
    library: TemplateLibrary,
    scenario: Scenario,
    *,
    catalog: Catalog | None = None,
    mode: Mode = "cost",
    headroom: float = 1.0,
    time_limit: float = 30.0,
    log: list[str] | None = None,
) -> Replanner:
    """A `replan(epoch, observed, running) -> Plan` that calls `allocate` with demand x `headroom`. In "cost"
    mode, demand that cannot be met falls back to "goodput" mode (largest served fraction), as an operator
    would rather serve part of a spike than nothing; `log` collects one line per epoch."""

    def replan(epoch: int, observed: ObservedDemand, running: Plan | None) -> Plan:
        demand: dict[tuple[str, Phase], float] = {}
        for m, d in observed.models.items():
            demand[(m, Phase.PREFILL)] = d.prefill_tokens_s * headroom
            demand[(m, Phase.DECODE)] = d.decode_tokens_s * headroom

        def run(m: Mode) -> Plan:
            return allocate(library, scenario, mode=m, demand=demand, availability=observed.availability,
                            catalog=catalog, running=running, time_limit=time_limit)

        try:
            plan = run(mode)
        except InfeasibleDemand as exc:
            if mode != "cost":
                raise
            plan = run("goodput")
            if log is not None:
                log.append(f"epoch {epoch}: {exc}; fell back to goodput mode")
        if log is not None:
            log.append(f"epoch {epoch}: {len(plan.instances)} instances, {plan.cost_per_hour:.2f} $/h, "
                       f"solve {plan.solve.status} in {plan.solve.time_s:.2f} s")
        return plan

    return replan
