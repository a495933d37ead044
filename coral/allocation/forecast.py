"""The online stage's demand estimate: forecast the coming epoch's traffic from observed per-interval token rates,
and correct the planned capacity by how far observed latencies sit from the SLOs.

Used by the simulator's re-planner (`coral.simulation.replan`) and the runtime's planner (`coral serve`); both
plan, per (model, phase),

    capacity = forecast of the mean tokens/s over the coming epoch × headroom × latency correction

where *headroom* is the plan's own capacity ÷ mean traffic (`ModelServing.headroom`: the burst factor the planner
sized it with), so a re-plan keeps the burst margin the plan was made with and moves with the traffic.

Forecast (`DemandForecaster`). Holt's linear exponential smoothing with a damped trend (statsmodels'
`ExponentialSmoothing`, parameters fitted on the history, the trend's smoothing kept at most 0.05 so that a step
reads as a new level rather than a trend to extrapolate), averaged over the window the new plan will serve
(from the end of the start-up delay to the next re-plan's), and the last value while the history is shorter than
`min_points`. Peak tracking: the forecast is at least the recent peak of the `peak_window`-interval moving mean,
halved every `peak_half_life` intervals since it occurred, so a rise is planned for at once and only given back
gradually (a smoother alone needs several intervals to follow a step).

Correction (`LatencyCorrection`), after NVIDIA Dynamo's SLA planner, which scales its profiled throughput by
observed ÷ expected latency: for each (model, phase) the ratio r of the observed latency at the model's
attainment quantile (TTFT for prefill, TPOT for decode; quantile = `slo_attainment`, so r > 1 exactly when fewer
than that share of the requests meet this phase's SLO) to the SLO. The factor multiplying the capacity moves by
r^gain when r > 1, by (r / relax_below)^gain when r < relax_below (latency far below the SLO: capacity to give
back), and stays put in between; each step is at most `max_step`×, the factor stays within `bounds`. By default
it never goes below 1: latency stays far below the SLO until a pool is nearly full (queueing is not linear in
load), so a low ratio says nothing about how much capacity could go — the plan's headroom is the floor, and the
correction only adds to it, and gives the addition back. With a lower bound of 0.5 it cut capacity on the
extended scenario until attainment fell from 96 % to 80 % (`benchmarks/online.py`).
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coral.allocation.demand import DemandKey
from coral.allocation.plan import Plan
from coral.catalog.schema import Scenario
from coral.perf.model import Phase

_NEVER_S = 1e6  # stands in for an infinite latency (a request never served) in quantiles
# a step reads as a new level, not a trend (a free trend smoothing extrapolates a step 3x over 10 intervals);
# a ramp sustained over several intervals still builds one
_HOLT_BOUNDS = {"smoothing_trend": (0.0, 0.05), "damping_trend": (0.8, 0.98)}


class DemandForecaster:
    """Per-(model, phase) forecast of the mean token rate over a coming window, from per-interval observations
    (module doc). Deterministic: the same observations give the same forecasts."""

    def __init__(
        self,
        interval_s: float = 60.0,
        *,
        min_points: int = 8,
        history: int = 720,
        peak_window: int = 5,
        peak_half_life: float = 10.0,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        if min_points < 4 or peak_window < 1 or peak_half_life <= 0 or history < min_points:
            raise ValueError("need min_points >= 4, peak_window >= 1, peak_half_life > 0, history >= min_points")
        self.interval_s = interval_s
        self.min_points = min_points
        self.peak_window = peak_window
        self.peak_half_life = peak_half_life
        self.series: dict[DemandKey, deque[float]] = {}
        self._history = history

    def observe(self, key: DemandKey, rates: Iterable[float]) -> None:
        """Append the tokens/s of consecutive intervals (oldest first) of `key`."""
        s = self.series.setdefault(key, deque(maxlen=self._history))
        for r in rates:
            if not math.isfinite(r) or r < 0:
                raise ValueError(f"{key}: observed rate must be a finite number >= 0, not {r}")
            s.append(float(r))

    def smoothed(self, key: DemandKey, ahead_s: float, until_s: float) -> float:
        """Holt's damped-trend forecast of `key`, mean over [now + ahead_s, now + until_s) (the last value while
        the history is short; 0 without one)."""
        y = np.array(self.series.get(key, ()), dtype=float)
        if not len(y):
            return 0.0
        if len(y) < self.min_points or np.ptp(y) == 0:
            return float(y[-1])
        from statsmodels.tsa.holtwinters import ExponentialSmoothing

        first = max(int(ahead_s // self.interval_s), 0)
        last = max(math.ceil(until_s / self.interval_s), first + 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # convergence notes on short, noisy series
            fit = ExponentialSmoothing(y, trend="add", damped_trend=True, initialization_method="estimated",
                                       bounds=_HOLT_BOUNDS).fit()
            path = np.asarray(fit.forecast(last))[first:last]
        return float(max(path.mean(), 0.0))

    def peak(self, key: DemandKey) -> float:
        """The largest `peak_window`-interval moving mean of `key`, halved per `peak_half_life` intervals since."""
        y = np.array(self.series.get(key, ()), dtype=float)
        if not len(y):
            return 0.0
        w = min(self.peak_window, len(y))
        means = np.convolve(y, np.ones(w) / w, mode="valid")  # means[j] ends at interval j + w - 1
        age = np.arange(len(means))[::-1]
        return float((means * 0.5 ** (age / self.peak_half_life)).max())

    def forecast(self, key: DemandKey, ahead_s: float, until_s: float) -> float:
        """Mean tokens/s of `key` expected over [now + ahead_s, now + until_s): max(Holt forecast, decayed peak)."""
        return max(self.smoothed(key, ahead_s, until_s), self.peak(key))

    def forecasts(self, ahead_s: float, until_s: float) -> dict[DemandKey, float]:
        return {k: self.forecast(k, ahead_s, until_s) for k in self.series}


@dataclass
class LatencyCorrection:
    """Per-(model, phase) factor on planned capacity from observed ÷ SLO latency (module doc)."""

    slo_s: dict[DemandKey, float]
    quantile: dict[str, float]
    gain: float = 0.5
    relax_below: float = 0.5
    max_step: float = 2.0
    bounds: tuple[float, float] = (1.0, 3.0)
    min_samples: int = 20
    factors: dict[DemandKey, float] = field(default_factory=dict)

    @classmethod
    def for_scenario(cls, scenario: Scenario, **kw: Any) -> LatencyCorrection:
        """SLOs (TTFT for prefill, TPOT for decode) and attainment quantiles of the scenario's models."""
        slo: dict[DemandKey, float] = {}
        for sm in scenario.models:
            slo[(sm.model, Phase.PREFILL)] = sm.prefill_slo_ms / 1e3
            slo[(sm.model, Phase.DECODE)] = sm.decode_slo_ms / 1e3
        return cls(slo, {sm.model: sm.slo_attainment for sm in scenario.models}, **kw)

    def ratio(self, key: DemandKey, latencies_s: Iterable[float]) -> float | None:
        """Observed latency at the model's attainment quantile ÷ the SLO (None: too few samples)."""
        v = np.asarray(list(latencies_s), dtype=float)
        v = np.minimum(v[~np.isnan(v)], _NEVER_S)
        if len(v) < self.min_samples:
            return None
        return float(np.quantile(v, self.quantile.get(key[0], 0.9))) / self.slo_s[key]

    def observe(self, key: DemandKey, latencies_s: Iterable[float], in_force: float | None = None) -> float:
        """Update `key`'s factor from an epoch's latencies (seconds; inf = never served) and return it. The step
        applies to `in_force`, the factor of the capacity that served those requests (default: the current one;
        when a re-plan takes effect late, an earlier one: stepping the current one again would count a shortfall
        already corrected twice)."""
        c = self.factors.get(key, 1.0) if in_force is None else in_force
        r = self.ratio(key, latencies_s)
        if r is not None:
            lo, hi = self.bounds
            if r > 1.0:
                c *= min(r, self.max_step) ** self.gain
            elif r < self.relax_below:
                c *= max(r / self.relax_below, 1.0 / self.max_step) ** self.gain
            c = min(max(c, lo), hi)
        self.factors[key] = c
        return c

    def factor(self, key: DemandKey) -> float:
        return self.factors.get(key, 1.0)


def plan_headroom(plan: Plan) -> dict[DemandKey, float]:
    """Capacity asked for ÷ mean traffic per (model, phase) of `plan`, where it recorded its traffic."""
    return {(s.model, Phase(s.phase)): h for s in plan.serving if (h := s.headroom) is not None}


def planned_capacity(
    traffic: Mapping[DemandKey, float],
    headroom: Mapping[DemandKey, float],
    correction: LatencyCorrection | None = None,
) -> dict[DemandKey, float]:
    """Capacity to plan per (model, phase): expected mean traffic × headroom (1 where none) × correction."""
    return {
        k: v * headroom.get(k, 1.0) * (correction.factor(k) if correction is not None else 1.0)
        for k, v in traffic.items()
    }
