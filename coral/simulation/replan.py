"""Re-planning with Coral's allocator: every epoch, allocate for the traffic expected next — the demand observed
over the previous epoch, or a forecast from its per-interval demand (`coral.allocation.forecast`) — times each
(model, phase)'s headroom, optionally corrected by the latencies observed, under the availability in force and
from the running plan (scale-up penalty)."""

from __future__ import annotations

from collections.abc import Mapping

from coral.allocation.allocator import InfeasibleDemand, Mode, allocate
from coral.allocation.demand import DemandKey
from coral.allocation.demand import headroom as scenario_headroom
from coral.allocation.forecast import DemandForecaster, LatencyCorrection, plan_headroom, planned_capacity
from coral.allocation.plan import Plan
from coral.catalog.loader import Catalog
from coral.catalog.schema import Scenario
from coral.perf.model import Phase
from coral.simulation.engine import ObservedDemand, Replanner
from coral.templates.library import TemplateLibrary


def capacity(plan: Plan, key: DemandKey) -> float:
    """Tokens/s `plan` serves for one (model, phase)."""
    return sum(i.throughput for i in plan.instances_of(key[0], key[1].value))


def allocator_replanner(
    library: TemplateLibrary,
    scenario: Scenario,
    *,
    catalog: Catalog | None = None,
    mode: Mode = "cost",
    headroom: float | Mapping[DemandKey, float] = 1.0,
    initial: Plan | None = None,
    forecaster: DemandForecaster | None = None,
    correction: LatencyCorrection | None = None,
    ahead_s: float = 0.0,
    hold: float = 0.0,
    floor_tokens_s: float = 0.0,
    at_least_observed: bool = False,
    time_limit: float = 30.0,
    log: list[str] | None = None,
) -> Replanner:
    """A `replan(epoch, observed, running) -> Plan` that calls `allocate` for expected traffic x headroom x
    latency correction per (model, phase).

    Epoch 0 returns `initial` when given, else plans for the scenario's forecast. Headroom (capacity ÷ mean
    traffic): a mapping gives it per (model, phase); a number multiplies the plan's own — `initial`'s where it
    recorded its traffic, else the scenario's (`coral.allocation.demand.headroom`). Expected traffic: the
    previous epoch's mean, or with `forecaster` its forecast over the window the new plan will serve, from
    `ahead_s` (the start-up delay) after the re-plan to one epoch later, with `at_least_observed` never below the
    previous epoch's mean (so the headroom is a floor on the traffic seen, not only on a forecast). `correction` is first updated with
    the previous epoch's latencies, stepping the factor of the capacity that served most of it: the last
    re-plan's, or with `ahead_s` over half an epoch the one before (the last one's was not ready yet). With `hold` > 0 a (model, phase) whose running capacity lies within
    [1, 1 + hold] × the capacity asked for asks for its running capacity instead, so that the allocator keeps
    its instances rather than trade them for a slightly smaller set it would pay start-ups for. Each (model,
    phase) asks for at least `floor_tokens_s` (> 0 keeps an instance of every model, even idle). In "cost" mode,
    demand that cannot be met falls back to "goodput" mode (largest served fraction), as an operator would
    rather serve part of a spike than nothing; `log` collects one line per epoch. Prices and offerings are the
    observed market's when it has one (`ObservedDemand.market`), else `catalog`'s."""
    if isinstance(headroom, Mapping):
        room = dict(headroom)
    else:
        room = {**scenario_headroom(scenario), **(plan_headroom(initial) if initial is not None else {})}
        room = {k: v * headroom for k, v in room.items()}

    def expected(observed: ObservedDemand) -> dict[DemandKey, float]:
        mean = {}
        for m, d in observed.models.items():
            mean[(m, Phase.PREFILL)] = d.prefill_tokens_s
            mean[(m, Phase.DECODE)] = d.decode_tokens_s
        if forecaster is None or observed.end_s <= observed.start_s:
            return mean
        for m, series in observed.series.items():
            forecaster.observe((m, Phase.PREFILL), [d.prefill_tokens_s for d in series])
            forecaster.observe((m, Phase.DECODE), [d.decode_tokens_s for d in series])
        epoch_s = observed.end_s - observed.start_s
        ahead = {k: forecaster.forecast(k, ahead_s, ahead_s + epoch_s) for k in mean}
        return {k: max(v, mean[k]) for k, v in ahead.items()} if at_least_observed else ahead

    used: list[dict[DemandKey, float]] = []  # the correction each re-plan applied, oldest first

    def replan(epoch: int, observed: ObservedDemand, running: Plan | None) -> Plan:
        if epoch == 0 and initial is not None:
            used.append({})
            return initial
        if correction is not None:
            # the capacity that served most of the window: the last re-plan's once ready, or the one before
            back = 2 if ahead_s > (observed.end_s - observed.start_s) / 2 else 1
            in_force = used[-back] if len(used) >= back else {}
            for m, lat in observed.latency.items():
                for key, values in (((m, Phase.PREFILL), lat.ttft_s), ((m, Phase.DECODE), lat.tpot_s)):
                    correction.observe(key, values, in_force.get(key, 1.0))
        traffic = expected(observed)
        demand = {k: max(v, floor_tokens_s) for k, v in planned_capacity(traffic, room, correction).items()}
        used.append({k: correction.factor(k) for k in demand} if correction is not None else {})
        held: list[DemandKey] = []
        if running is not None and hold > 0:
            have = {k: capacity(running, k) for k in demand}
            held = [k for k, need in demand.items() if 0 < need <= have[k] <= need * (1 + hold)]
            demand.update({k: have[k] for k in held})

        def run(m: Mode) -> Plan:
            return allocate(library, scenario, mode=m, demand=demand, availability=observed.availability,
                            catalog=observed.market or catalog, running=running, time_limit=time_limit)

        try:
            plan = run(mode)
        except InfeasibleDemand as exc:
            if mode != "cost":
                raise
            plan = run("goodput")
            if log is not None:
                log.append(f"epoch {epoch}: {exc}; fell back to goodput mode")
        if log is not None:
            factors = "".join(f", x{correction.factor(k):.2f} {k[0]}/{k[1].value}" for k in demand
                              if correction is not None and correction.factor(k) != 1.0)
            log.append(f"epoch {epoch}: {len(plan.instances)} instances, {plan.cost_per_hour:.2f} $/h, "
                       f"solve {plan.solve.status} in {plan.solve.time_s:.2f} s{factors}, {len(held)} held")
        return plan

    return replan
