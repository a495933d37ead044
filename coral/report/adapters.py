"""Map other stages' results onto `ReportInputs` and read report input files of either shape."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from coral.catalog.loader import CoralInputError, _read_structured, load_scenario, validate
from coral.catalog.schema import Scenario
from coral.report.inputs import (
    EpochPoint,
    LatencySeries,
    MethodResult,
    ReportInputs,
    TimeSeries,
    adapt_inputs,
)
from coral.simulation.metrics import LatencyStats, SimResult


def _cdf(stats: LatencyStats) -> list[tuple[float, float]]:
    """SimResult's percentile ladder (cdf[i] = i-th of n evenly spaced percentiles) as CDF points."""
    n = len(stats.cdf)
    return [(x, i / (n - 1)) for i, x in enumerate(stats.cdf) if i > 0] if n > 1 else []


def _scenario_of(result: SimResult) -> Scenario | None:
    try:
        return load_scenario(result.scenario)
    except CoralInputError:
        return None


def inputs_from_sim(result: SimResult, scenario: Scenario | None = None, method: str = "") -> ReportInputs:
    """Latency CDFs (with the scenario's SLOs and the simulator's exact attainment) and per-epoch points.

    `scenario` defaults to the built-in one named in the result, if any. Churn per epoch is the number of
    instances starting or draining at the epoch's start.
    """
    scenario = scenario or _scenario_of(result)
    slos = {m.model: (m.prefill_slo_ms, m.decode_slo_ms) for m in scenario.models} if scenario else {}
    latency = {
        m.model: LatencySeries(
            ttft_ms=_cdf(m.ttft_ms),
            tpot_ms=_cdf(m.tpot_ms),
            slo_ttft_ms=slos.get(m.model, (None, None))[0],
            slo_tpot_ms=slos.get(m.model, (None, None))[1],
            count=m.requests,
            ttft_attainment=m.ttft_attainment,
            tpot_attainment=m.tpot_attainment,
            slo_attainment=m.slo_attainment,
        )
        for m in result.models
    }
    epochs = [
        EpochPoint(
            epoch=e.epoch,
            cost_per_hour=e.cost_per_hour,
            goodput=e.goodput_tokens_s,
            churn=e.instances_starting + e.instances_draining,
            method=method,
        )
        for e in result.epochs
    ]
    return ReportInputs(
        epochs=epochs,
        latency=latency,
        overall_attainment=result.slo_attainment,
        timeseries=timeseries_from_sim(result),
        scenario=result.scenario,
        plan_fingerprint=result.plan_fingerprint,
    )


def timeseries_from_sim(result: SimResult, bins: int = 60, min_bin_s: float = 10.0) -> TimeSeries | None:
    """Arrival rate, p99 TTFT / TPOT of the requests arriving in each bin, and queue depth (arrived, not yet
    decoding) at each bin's end, per model; None when the per-request record is gone (a result read from JSON)."""
    req = result.per_request()
    if not req or not len(req.get("arrival_s", ())):
        return None
    bin_s = max(min_bin_s, result.duration_s / bins)
    n = max(1, int(np.ceil(result.duration_s / bin_s)))
    edges = np.arange(n + 1) * bin_s
    arrival, admit = req["arrival_s"], np.nan_to_num(req["decode_admit_s"], nan=np.inf)
    ts = TimeSeries(t_s=[float(x) for x in edges[:-1]], bin_s=bin_s)

    def p99(values: np.ndarray) -> float | None:
        values = values[np.isfinite(values)]
        return float(np.percentile(values, 99) * 1e3) if len(values) else None

    for k, m in enumerate(result.models):
        sel = req["model"] == k
        arr, adm = arrival[sel], admit[sel]
        which = np.minimum((arr // bin_s).astype(np.int64), n - 1)
        ttft, tpot = req["ttft_s"][sel], req["tpot_s"][sel]
        ts.rate[m.model] = [float(c) / bin_s for c in np.bincount(which, minlength=n)[:n]]
        ts.ttft_p99_ms[m.model] = [p99(ttft[which == b]) for b in range(n)]
        ts.tpot_p99_ms[m.model] = [p99(tpot[which == b]) for b in range(n)]
        ts.queue[m.model] = [float(((arr <= e) & (adm > e)).sum()) for e in edges[1:]]
    return ts


def method_result(result: SimResult, method: str, how: str) -> MethodResult:
    """One method's simulated SLO attainment, goodput and cost, for the report's side-by-side table."""
    return MethodResult(
        method=method,
        how=how,
        slo_attainment=result.slo_attainment,
        goodput_tokens_s=result.goodput_tokens_s,
        cost_per_hour=result.mean_cost_per_hour,
        by_model={m.model: m.slo_attainment for m in result.models},
    )


def as_inputs(
    data: SimResult | ReportInputs | BaseModel | Mapping[str, Any] | None,
    source: str = "simulation result",
    method: str = "",
) -> ReportInputs:
    """Any supported result as ReportInputs: a SimResult (object or its JSON dict), or what `adapt_inputs` takes."""
    if isinstance(data, SimResult):
        return inputs_from_sim(data, method=method)
    if isinstance(data, Mapping) and "overall" in data and "models" in data:
        return inputs_from_sim(validate(SimResult, data, source), method=method)
    return adapt_inputs(data, source)


def load_inputs(path: str | Path, method: str = "") -> ReportInputs:
    """Read a SimResult JSON (from `coral simulate`) or a ReportInputs JSON/YAML; errors name file and field."""
    path = Path(path)
    data = _read_structured(path)
    if not isinstance(data, Mapping):
        raise CoralInputError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return as_inputs(data, str(path), method)
