"""A synthetic world for the SLO search: two models whose attainment follows the capacity planned in closed form,
so searches run in milliseconds and their answers can be solved by hand."""

from __future__ import annotations

from collections.abc import Mapping

from coral.allocation.demand import scenario_traffic
from coral.allocation.plan import ModelServing, Plan, SolveReport
from coral.catalog.schema import Scenario, ScenarioModel
from coral.perf.model import Phase
from coral.planning.slo_search import Attainment, Evaluator

#: headroom (planned capacity ÷ mean traffic) at which each phase meets its SLO for every request
NEEDED = {("a", Phase.PREFILL): 2.0, ("a", Phase.DECODE): 1.3, ("b", Phase.PREFILL): 3.0, ("b", Phase.DECODE): 1.1}


def toy_scenario(target: float = 0.9) -> Scenario:
    models = [ScenarioModel(model=m, prefill_slo_ms=1000, decode_slo_ms=50, request_rate=1, mean_input_tokens=100,
                            mean_output_tokens=10, slo_attainment=target, trace="synthetic") for m in ("a", "b")]
    return Scenario(name="toy", regions=["r"], configs=["1xL4"], models=models, availability={"r": {"1xL4": 1}})


def toy_planner(demand: Mapping[tuple[str, Phase], float]) -> Plan:
    """Capacity exactly the demand, at $1/h per token/s."""
    serving = [ModelServing(model=m, phase=p.value, demand=d, capacity=d, served_fraction=1, cost_per_hour=d)
               for (m, p), d in demand.items()]
    return Plan(scenario="toy", method="toy", instances=[], serving=serving,
                cost_per_hour=sum(demand.values()), solve=SolveReport(status="toy"))


def toy_evaluator(ceiling: float = 1.0, calls: list[tuple[int, float]] | None = None,
                  phase_cap: Mapping[tuple[str, Phase], float] | None = None) -> Evaluator:
    """A phase meets its SLO for a share min(1, h / needed)^4 of requests (h: planned / mean traffic), at most
    `phase_cap` of it (a latency ceiling); both phases for the product, at most `ceiling`. Records (seed, share) of
    every evaluation in `calls`."""
    traffic = scenario_traffic(toy_scenario())
    caps = phase_cap or {}

    def evaluate(plan: Plan, seed: int, share: float = 1.0) -> dict[str, Attainment]:
        if calls is not None:
            calls.append((seed, share))
        h = {(s.model, Phase(s.phase)): s.demand / traffic[(s.model, Phase(s.phase))] for s in plan.serving}
        out = {}
        for m in sorted({s.model for s in plan.serving}):
            p, d = (min(caps.get((m, ph), 1.0), min(1.0, h[(m, ph)] / NEEDED[(m, ph)]) ** 4)
                    for ph in (Phase.PREFILL, Phase.DECODE))
            out[m] = Attainment(min(ceiling, p * d), p, d)
        return out

    return evaluate
