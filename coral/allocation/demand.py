"""Demand per (model, phase) in tokens/s: the mean traffic, and the capacity to plan for it.

Traffic. With PD disaggregation every request is prefilled once (all of its ``I`` prompt tokens pass through a
prefill instance) and then decoded token by token (``O`` output tokens are produced by decode instances). At a
steady arrival rate of ``λ`` requests/s, Little's law on token flows gives the mean token rates each pool
serves:

    prefill tokens/s = λ · mean_input_tokens        decode tokens/s = λ · mean_output_tokens

Capacity to plan. A pool sized for the mean is full on average, so every burst queues and misses its SLO. The
capacity planned for a (model, phase) is the mean × a *headroom* factor: by default the burst factor of the
model's traffic at its SLO-attainment target (`coral.workload.burst`: the token rate the q-th percentile token
sees over SLO-length windows, q = `slo_attainment`), computed on the scenario's own workload (its trace at its
rate, the scenario's run length, seed 0 of the tuning part of the trace, `TracePart` "tune": requests the
planner tunes on, none of them held out); or 1 / `target_utilization` of the
phase where the scenario sets one (an explicit override). `coral.planning` then corrects the factor per
(model, phase) with the simulator in the loop.

Template throughputs in the library are in the same units (prefill: prompt tokens/s under the TTFT SLO, decode:
generated tokens/s under the TPOT SLO), so a pool meets demand when the sum of its instances' throughput is at
least this rate.
"""

from __future__ import annotations

from coral.catalog.schema import Scenario, ScenarioModel
from coral.perf.model import Phase
from coral.workload.burst import burst_factors
from coral.workload.traces import RequestSet, workload_for

DemandKey = tuple[str, Phase]

#: seed of the workload the planner sizes and tunes on, read from the tuning part of each trace ("tune"); plans are
#: scored on the held-out part ("held_out"), whose requests no tuning seed reads (`workload_for`'s `part`)
TUNING_SEED = 0


def phase_demand(scenario_model: ScenarioModel, rate: float | None = None) -> dict[Phase, float]:
    """Mean tokens/s per phase for one model: prefill = rate × mean_input_tokens, decode = rate ×
    mean_output_tokens. `rate` overrides the scenario's request rate (requests/s)."""
    lam = scenario_model.request_rate if rate is None else rate
    if lam < 0:
        raise ValueError("rate must be >= 0")
    return {
        Phase.PREFILL: lam * scenario_model.mean_input_tokens,
        Phase.DECODE: lam * scenario_model.mean_output_tokens,
    }


def scenario_traffic(scenario: Scenario, scale: float = 1.0) -> dict[DemandKey, float]:
    """Mean tokens/s of every (model, phase) of a scenario, all rates multiplied by `scale`."""
    out: dict[DemandKey, float] = {}
    for sm in scenario.models:
        for phase, value in phase_demand(sm, sm.request_rate * scale).items():
            out[(sm.model, phase)] = value
    return out


def run_length_s(scenario: Scenario) -> float:
    """Simulated seconds of one run of the scenario: epochs × epoch length."""
    return scenario.epochs * scenario.epoch_minutes * 60.0


_TUNING: dict[str, RequestSet] = {}
_BURST: dict[str, tuple[float, float]] = {}


def model_key(scenario: Scenario, sm: ScenarioModel) -> str:
    """What one model's tuning workload depends on, as a memo key."""
    return f"{sm.model_dump_json()}|{scenario.trace_scaling}|{run_length_s(scenario)}"


def tuning_requests(scenario: Scenario, sm: ScenarioModel) -> RequestSet:
    """One model's tuning workload: its trace's tuning part at its rate, for the scenario's run length, seed
    `TUNING_SEED` (memoised; the burst rule and the latency rating both read it)."""
    key = model_key(scenario, sm)
    if key not in _TUNING:
        one = scenario.model_copy(update={"models": [sm]})
        _TUNING[key] = workload_for(one, run_length_s(scenario), TUNING_SEED, part="tune")[sm.model]
    return _TUNING[key]


def model_burst(scenario: Scenario, sm: ScenarioModel) -> tuple[float, float]:
    """(prefill, decode) burst factors of one model's tuning workload at its attainment target (memoised)."""
    key = model_key(scenario, sm)
    if key not in _BURST:
        _BURST[key] = burst_factors(tuning_requests(scenario, sm), sm.prefill_slo_ms / 1e3, sm.decode_slo_ms / 1e3,
                                    sm.slo_attainment)
    return _BURST[key]


def headroom(scenario: Scenario) -> dict[DemandKey, float]:
    """Planned capacity ÷ mean traffic per (model, phase) (module doc): 1 / target_utilization where the
    scenario sets it for the phase, else the burst factor of the model's traffic at its attainment target."""
    out: dict[DemandKey, float] = {}
    for sm in scenario.models:
        for i, phase in enumerate((Phase.PREFILL, Phase.DECODE)):
            target = scenario.target_utilization.of(phase.value)
            out[(sm.model, phase)] = 1.0 / target if target is not None else model_burst(scenario, sm)[i]
    return out


def scenario_demand(scenario: Scenario, scale: float = 1.0) -> dict[DemandKey, float]:
    """Capacity to plan for every (model, phase) of a scenario: mean traffic (rates × `scale`) × `headroom`."""
    room = headroom(scenario)
    return {k: v * room[k] for k, v in scenario_traffic(scenario, scale).items()}
