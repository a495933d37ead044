"""What the gateway measures of answers: token times of streams, latency records, scrape-time gauges."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

from prometheus_client.core import GaugeMetricFamily

from coral.runtime.registry import Registry


class Occupancy(Protocol):
    """What the scrape-time gauges read of the gateway (`upstream.Gateway`): its endpoints and its admission
    counts."""

    @property
    def registry(self) -> Registry: ...

    @property
    def waiting(self) -> int: ...

    @property
    def active(self) -> int: ...


class Answer(NamedTuple):
    """One answered request as the gateway timed it (seconds from its arrival)."""

    e2e_s: float
    ttft_s: float
    """to the first byte of the answer (the whole answer when not streamed), as the traffic meter reads it"""
    first_token_s: float | None
    """time to the first token: the first streamed token, or the prefill instance's answer (PD, not streamed);
    None when not observable (a non-streamed answer without a prefill instance)"""
    tpot_s: float | None
    """mean time per output token between the first and last streamed token; None when not streamed"""


class TokenClock:
    """Times the tokens of a streamed answer from its SSE events: each event carrying generated text is a token
    (one event per token, as vLLM and the emulated engines send)."""

    MAX_PENDING = 1 << 16  # a partial event longer than this is not an SSE event: stop buffering it

    def __init__(self) -> None:
        self.pending = b""
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.done = False  # the stream's `data: [DONE]` was read: the answer is whole

    def feed(self, chunk: bytes, at: float) -> None:
        """Read a chunk of the answer that arrived at `at` (perf_counter seconds)."""
        *events, rest = (self.pending + chunk).replace(b"\r\n", b"\n").split(b"\n\n")
        self.pending = rest if len(rest) <= self.MAX_PENDING else b""
        for event in events:
            self.done = self.done or event.strip() == b"data: [DONE]"
            if _carries_text(event):
                self.tokens += 1
                self.first = at if self.first is None else self.first
                self.last = at

    @property
    def tpot_s(self) -> float | None:
        if self.first is None or self.last is None or self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)


def _carries_text(event: bytes) -> bool:
    """Whether an SSE event of a (chat) completion stream carries generated text (not the role-only opening,
    the usage chunk or [DONE])."""
    for line in event.split(b"\n"):
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            continue
        try:
            choices = json.loads(line[5:]).get("choices") or []
        except (ValueError, AttributeError):
            return False
        for c in choices if isinstance(choices, list) else []:
            delta = c.get("delta") if isinstance(c, dict) else None
            if isinstance(c, dict) and c.get("text"):
                return True
            if isinstance(delta, dict) and any(delta.get(k) for k in ("content", "reasoning_content", "tool_calls")):
                return True
    return False


class InflightCollector:
    """Scrape-time gauges read from the registry, so removed instances vanish and counts never go stale."""

    def __init__(self, gw: Occupancy) -> None:
        self.gw = gw

    def collect(self) -> Iterable[GaugeMetricFamily]:
        inflight = GaugeMetricFamily(
            "coral_gateway_inflight", "requests in flight per instance", labels=["instance"]
        )
        ready = GaugeMetricFamily(
            "coral_gateway_instance_routable", "1 if the instance gets new requests", labels=["instance"]
        )
        for ep in self.gw.registry.all():
            inflight.add_metric([ep.id], ep.inflight)
            ready.add_metric([ep.id], 1.0 if ep.routable else 0.0)
        queue = GaugeMetricFamily("coral_gateway_queue_waiting", "requests waiting for admission")
        queue.add_metric([], self.gw.waiting)
        active = GaugeMetricFamily("coral_gateway_active", "admitted requests being served")
        active.add_metric([], self.gw.active)
        return [inflight, ready, queue, active]


def pct(sorted_vals: Sequence[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    return float(sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))])



