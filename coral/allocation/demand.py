"""Demand per (model, phase) in tokens/s, derived from the request rate and the mean request shape.

Derivation. With PD disaggregation every request is prefilled once (all of its ``I`` prompt tokens pass through
a prefill instance) and then decoded token by token (``O`` output tokens are produced by decode instances). At a
steady arrival rate of ``λ`` requests/s, Little's law on token flows gives the token rates each pool must sustain:

    prefill tokens/s = λ · mean_input_tokens        decode tokens/s = λ · mean_output_tokens

Template throughputs in the library are in the same units (prefill: prompt tokens/s under the TTFT SLO, decode:
generated tokens/s under the TPOT SLO), so a pool meets demand when the sum of its instances' throughput is at
least this rate.
"""

from __future__ import annotations

from coral.catalog.schema import Scenario, ScenarioModel
from coral.perf.model import Phase

DemandKey = tuple[str, Phase]


def phase_demand(scenario_model: ScenarioModel, rate: float | None = None) -> dict[Phase, float]:
    """Tokens/s per phase for one model: prefill = rate × mean_input_tokens, decode = rate × mean_output_tokens.

    `rate` overrides the scenario's request rate (requests/s)."""
    lam = scenario_model.request_rate if rate is None else rate
    if lam < 0:
        raise ValueError("rate must be >= 0")
    return {
        Phase.PREFILL: lam * scenario_model.mean_input_tokens,
        Phase.DECODE: lam * scenario_model.mean_output_tokens,
    }


def scenario_demand(scenario: Scenario, scale: float = 1.0) -> dict[DemandKey, float]:
    """Demand of every (model, phase) of a scenario, all rates multiplied by `scale`."""
    out: dict[DemandKey, float] = {}
    for sm in scenario.models:
        for phase, value in phase_demand(sm, sm.request_rate * scale).items():
            out[(sm.model, phase)] = value
    return out
