"""Shedding at the planned share: one admission rule for the gateway and the simulator.

When a plan cannot serve all of a model's demand (goodput mode after GPUs ran out, `sheds`), or instances serving
a model were lost (their nodes went, or they died: `shed_capacity`) until their replacements are ready, the excess
of a model's traffic queues behind what its instances can do, and every request behind it misses its SLO, the
admitted ones included (on core after every L40S went: attainment 50.5 %, TTFT p99 80 s). Refusing the excess at
once keeps the rest within the SLO: a model is admitted up to the capacity serving it, the tokens/s of its
ready instances per phase, and a request beyond it is refused (429 with Retry-After at the gateway, a refused
request in the simulator).

Per (model, phase) a token bucket fills at that capacity and holds `depth_s` seconds of it, the model's TTFT SLO:
a burst beyond capacity x TTFT SLO cannot start within the SLO (its prompts cannot be prefilled in time, its
requests wait for decode slots). A request takes its prompt tokens from its model's prefill bucket and its output
tokens (max_tokens, else the model's mean; the simulator knows them) from the decode bucket, or neither when
either is short; then it may try again once the shorter one has refilled (Retry-After).

Measured by hand while choosing the rule, with the plan of `tests/test_simulation.py` (which asserts the 3x case;
one phi-4 PD pair offered 1.5x, 3x and 6x its decode capacity for 60 s):
every admitted request met both SLOs and SLO goodput stayed at the planned 470 tokens/s; unshed, 4 % met them at
3x. A deeper decode bucket (the time a mean request decodes, 12.7 s) let 90 % of admitted requests miss at 3x,
and admitting at 80 % of capacity only lowered goodput (377 tokens/s).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from coral.allocation.plan import Plan
from coral.catalog.schema import Scenario


def sheds(plan: Plan) -> bool:
    """Whether the plan serves only a share of some model's demand (goodput mode), so its gateway sheds."""
    return any(s.demand > 0 and s.served_fraction < 1.0 - 1e-9 for s in plan.serving)


Key = tuple[str, str]


def shed_capacity(ready: Mapping[Key, float], plan: Plan | None, mode: str,
                  down: Collection[Key] = ()) -> dict[Key, float]:
    """The (model, phase)s to shed, each with the capacity (tokens/s) serving it: with `mode` "always" every key
    with ready instances; with "plan" every key of a plan that serves only a share of some model's demand, and
    each key of `down` (it lost instances the plan in force has: their nodes went, or they died) while its ready
    capacity is below what the plan planned for it; with "off" none. A key whose instances are only starting
    (a scale-up, a first start) is not shed: its requests wait for them. `ready`: the planned tokens/s of the
    ready instances per (model, phase)."""
    if mode == "off" or (mode == "plan" and plan is None):
        return {}
    if mode == "always" or (plan is not None and sheds(plan)):
        return dict(ready)
    if not down:  # the common case, checked on every request at the gateway
        return {}
    assert plan is not None
    planned: dict[Key, float] = {}
    for inst in plan.instances:
        planned[(inst.model, inst.phase)] = planned.get((inst.model, inst.phase), 0.0) + inst.throughput
    return {k: ready.get(k, 0.0) for k in down if ready.get(k, 0.0) < planned.get(k, 0.0) * (1 - 1e-9)}


@dataclass
class TokenBucket:
    """Tokens refilled at `rate` per second up to `depth`; starts full."""

    rate: float
    depth: float
    level: float
    at: float

    def refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.depth, self.level + (now - self.at) * self.rate)
            self.at = now

    def short_s(self, tokens: float) -> float:
        """Seconds until `tokens` fit (0: now; inf: never, at rate 0: nothing serves the key)."""
        if self.rate <= 0:
            return float("inf")
        need = min(tokens, self.depth) - self.level
        return max(0.0, need / self.rate)


@dataclass
class Shedder:
    """Admission at the capacity serving each model (module doc). `depth_s[(model, phase)]` from
    `Shedder.for_scenario`; `capacity` is set whenever the instances serving a model change."""

    depth_s: dict[tuple[str, str], float]
    mean_output: dict[str, float]
    buckets: dict[tuple[str, str], TokenBucket] = field(default_factory=dict)
    time_scale: float = 1.0
    """Clock seconds per second of the engines' time (emulated engines slowed by `coral serve --time-scale`):
    buckets refill at the capacity / `time_scale` per clock second and hold the same tokens."""

    @classmethod
    def for_scenario(cls, scenario: Scenario, time_scale: float = 1.0) -> Shedder:
        depth: dict[tuple[str, str], float] = {}
        for m in scenario.models:
            for phase in ("prefill", "decode"):
                depth[(m.model, phase)] = m.prefill_slo_ms / 1e3
        return cls(depth, {m.model: float(m.mean_output_tokens) for m in scenario.models}, time_scale=time_scale)

    def set_capacity(self, capacity: Mapping[tuple[str, str], float], now: float) -> None:
        """Tokens/s serving each (model, phase) from `now` on (a key left out is not shed); a bucket keeps its
        level (capped at its new depth) across changes."""
        for key in list(self.buckets):
            if key not in capacity:
                del self.buckets[key]
        for key, tokens_s in capacity.items():
            depth = tokens_s * self.depth_s.get(key, 1.0)
            rate = tokens_s / self.time_scale
            b = self.buckets.get(key)
            if b is None:
                self.buckets[key] = TokenBucket(rate, depth, depth, now)
            else:
                b.refill(now)
                b.rate, b.depth, b.level = rate, depth, min(b.level, depth)

    def admit(self, model: str, prompt_tokens: float, output_tokens: float | None, now: float) -> float:
        """0 when the request is admitted (its tokens taken), else the seconds after which to try again."""
        out = self.mean_output.get(model, 0.0) if output_tokens is None else output_tokens
        want = [(self.buckets.get((model, "prefill")), prompt_tokens), (self.buckets.get((model, "decode")), out)]
        wait = 0.0
        for bucket, tokens in want:
            if bucket is not None:
                bucket.refill(now)
                wait = max(wait, bucket.short_s(tokens))
        if wait > 0:
            return wait
        for bucket, tokens in want:
            if bucket is not None:
                bucket.level -= min(tokens, bucket.depth)
        return 0.0
