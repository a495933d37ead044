"""Instance registry of the gateway and its routing rule.

Routing (per model and phase): smooth weighted round-robin (nginx's algorithm) on the instances' planned
throughput, with a least-outstanding correction. Every pick adds each routable instance's weight to its credit
and takes the instance with the largest credit; if that instance holds more than `max_excess` requests above
its weighted share of the pool's in-flight requests, the pick goes instead to the instance with the lowest
(in-flight + 1) / weight. The chosen instance pays the total weight from its credit, so an instance that was
skipped keeps its credit and catches up once its backlog clears: long-run shares follow the weights while a
slow or stalled instance stops receiving work.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import StrEnum


class InstanceState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass
class Endpoint:
    """One engine instance the gateway can send requests to."""

    id: str
    model: str
    phase: str
    url: str
    weight: float
    state: InstanceState = InstanceState.STARTING
    healthy: bool = True
    inflight: int = 0
    served: int = 0
    failed: int = 0
    credit: float = 0.0
    health_failures: int = 0

    @property
    def routable(self) -> bool:
        return self.state is InstanceState.READY and self.healthy


@dataclass
class Registry:
    """Thread-safe set of endpoints (the controller thread mutates it, the gateway loop reads and picks)."""

    max_excess: float = 4.0
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, ep: Endpoint) -> Endpoint:
        if ep.weight <= 0:
            raise ValueError(f"endpoint {ep.id}: weight must be > 0")
        with self.lock:
            old = self.endpoints.get(ep.id)
            if old is None:
                self.endpoints[ep.id] = ep
                return ep
            # re-registration updates in place: in-flight requests hold the object and release it later
            old.url, old.weight, old.state, old.healthy = ep.url, ep.weight, ep.state, ep.healthy
            return old

    def remove(self, instance_id: str) -> Endpoint | None:
        with self.lock:
            ep = self.endpoints.pop(instance_id, None)
        if ep is not None:
            ep.state = InstanceState.STOPPED
        return ep

    def set_state(self, instance_id: str, state: InstanceState) -> None:
        with self.lock:
            ep = self.endpoints.get(instance_id)
            if ep is not None:
                ep.state = state

    def get(self, instance_id: str) -> Endpoint | None:
        return self.endpoints.get(instance_id)

    def all(self) -> list[Endpoint]:
        with self.lock:
            return list(self.endpoints.values())

    def models(self) -> list[str]:
        return sorted({e.model for e in self.all()})

    def pool(self, model: str, phase: str) -> list[Endpoint]:
        return [e for e in self.all() if e.model == model and e.phase == phase]

    def pick(self, model: str, phase: str, exclude: frozenset[str] = frozenset()) -> Endpoint | None:
        """Choose a routable endpoint and count one request in flight on it (caller must `release`)."""
        with self.lock:
            cands = [
                e
                for e in self.endpoints.values()
                if e.model == model and e.phase == phase and e.routable and e.id not in exclude
            ]
            if not cands:
                return None
            total_w = sum(e.weight for e in cands)
            for e in cands:
                e.credit += e.weight
            best = max(cands, key=lambda e: e.credit)
            total_in = sum(e.inflight for e in cands) + 1
            if best.inflight - best.weight / total_w * total_in > self.max_excess:
                best = min(cands, key=lambda e: ((e.inflight + 1) / e.weight, -e.credit))
            best.credit -= total_w
            best.inflight += 1
            return best

    def release(self, ep: Endpoint, ok: bool) -> None:
        with self.lock:
            ep.inflight -= 1
            if ok:
                ep.served += 1
            else:
                ep.failed += 1
