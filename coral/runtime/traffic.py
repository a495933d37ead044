"""What the gateway saw, as the re-planner's observation: the runtime's counterpart of the simulator's epochs, read
by `coral serve`'s planner (`coral.cli.runtime.allocator_planner`) once per controller interval."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from coral.catalog.schema import Scenario
from coral.simulation.engine import ModelDemand, ObservedDemand, ObservedLatency
from coral.simulation.run import scenario_forecast


class TrafficMeter:
    """Each `observe()` returns what the attached gateway saw since the previous one, as one interval of an
    `ObservedDemand`: per model the request rate from the gateway's request counter (every outcome: refused
    requests are demand too), token rates = requests × the scenario's mean prompt / output tokens (the gateway
    does not tokenize), and the latencies of the requests answered since — TTFT as the gateway measures it
    (first byte of the answer) and, for streamed answers, TPOT ≈ (latency − TTFT) ÷ (mean output tokens − 1).
    Before a gateway is attached, and at the first reading, it returns the scenario's forecast (no window). With
    engines slowed by `time_scale` (`coral serve --backend emulated --time-scale K`), rates and latencies are in the
    engines' time: K times the rates and 1/K of the latencies the clock shows (the interval, `interval_s`, too)."""

    def __init__(self, scenario: Scenario, gateway: Any = None, time_scale: float = 1.0) -> None:
        self.scenario = scenario
        self.gateway = gateway
        self.time_scale = time_scale
        self.epoch = 0
        self._last: tuple[float, dict[str, float], dict[str, float]] | None = None

    def counts(self) -> tuple[dict[str, float], dict[str, float]]:
        """(requests of every outcome, requests answered) per model since the gateway started."""
        requests: dict[str, float] = {}
        served: dict[str, float] = {}
        for metric in self.gateway.requests.collect():
            for s in metric.samples:
                if s.name.endswith("_total"):
                    m = s.labels["model"]
                    requests[m] = requests.get(m, 0.0) + s.value
                    if s.labels["outcome"] == "ok":
                        served[m] = served.get(m, 0.0) + s.value
        return requests, served

    def observe(self) -> ObservedDemand:
        epoch, self.epoch = self.epoch, self.epoch + 1
        if self.gateway is None:
            return ObservedDemand(epoch, 0.0, 0.0, scenario_forecast(self.scenario))
        now = time.monotonic()
        requests, served = self.counts()
        last, self._last = self._last, (now, requests, served)
        if last is None or now <= last[0]:
            return ObservedDemand(epoch, 0.0, 0.0, scenario_forecast(self.scenario))
        span = (now - last[0]) / self.time_scale
        models: dict[str, ModelDemand] = {}
        latency: dict[str, ObservedLatency] = {}
        for sm in self.scenario.models:
            m = sm.model
            rate = (requests.get(m, 0.0) - last[1].get(m, 0.0)) / span
            models[m] = ModelDemand(rate, rate * sm.mean_input_tokens, rate * sm.mean_output_tokens)
            new = int(served.get(m, 0.0) - last[2].get(m, 0.0))
            recent = self.gateway.recent.get(m)
            answered = list(recent.copy())[-new:] if recent is not None and new > 0 else []  # copy: atomic
            e2e = np.array([a[0] for a in answered], dtype=float) / self.time_scale
            ttft = np.array([a[1] for a in answered], dtype=float) / self.time_scale
            streamed = e2e > ttft
            tpot = np.where(streamed, (e2e - ttft) / max(sm.mean_output_tokens - 1.0, 1.0), np.nan)
            latency[m] = ObservedLatency(ttft, tpot)
        return ObservedDemand(epoch, last[0], now, models, interval_s=span,
                              series={m: [d] for m, d in models.items()}, latency=latency)
