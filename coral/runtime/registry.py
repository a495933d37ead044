"""Instance registry of the gateway and its routing rule.

Routing (per model, phase and request class): smooth weighted round-robin (nginx's algorithm) on the
instances' planned throughput, with a least-outstanding correction. A request's length class (`class_of`, from
the plan's request classes) selects the weights: an instance's planned tokens/s for that class
(`class_weights`; instances without them serve every class with their plain weight); instances with weight 0
for the class are not candidates, and when no routable candidate has a positive weight for it (or the request
has no class) the plain weights of all candidates apply. Every pick adds each candidate's weight to its credit
for the class and takes the candidate with the largest credit; if that instance holds more than `max_excess`
requests above its weighted share of the candidates' in-flight requests, the pick goes instead to the
candidate with the lowest (in-flight + 1) / weight. The chosen instance pays the total weight from its credit,
so an instance that was skipped keeps its credit and catches up once its backlog clears: each class's long-run
shares follow its weights while a slow or stalled instance stops receiving work.

Outlier ejection: an instance on which a request timed out (the gateway's phase budgets) is `eject`ed: no
requests for `eject_s`, doubled on each consecutive ejection (at most `MAX_EJECT_DOUBLINGS` times). After that
it is on probation: one request at a time until a request on it completes, which clears its record. Ejection is
capped per pool (`Registry.eject`): at most `max_fraction` of a (model, phase) pool's instances are out at
once, and never its last routable one.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum

from coral.allocation.plan import Plan, PlanClass, class_of, class_weight

MAX_EJECT_DOUBLINGS = 4
"""An instance ejected again and again stays out at most 2^4 times `eject_s` at a time."""


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
    class_weights: dict[str, float] | None = None
    """Planned tokens/s per request class (None: every class at `weight`)."""
    credits: dict[str | None, float] = field(default_factory=dict)
    """Smooth-WRR credit per request class (None: plain weights)."""
    health_failures: int = 0
    ejected_until: float = 0.0
    """`time.monotonic()` until which the gateway sends it nothing (a request timed out on it)."""
    ejections: int = 0
    """Consecutive ejections (reset when a request on it completes); while > 0, it takes one request at a time."""
    progress_at: float = 0.0
    """Event-loop time of the last chunk it delivered to any stream (the gateway's stall check)."""

    def weight_for(self, request_class: str | None) -> float:
        """Router weight for a request of `request_class` (None: no class)."""
        return class_weight(self.weight, self.class_weights, request_class)

    @property
    def routable(self) -> bool:
        return self.state is InstanceState.READY and self.healthy and time.monotonic() >= self.ejected_until

    def eject(self, eject_s: float) -> None:
        """No requests for `eject_s` x 2^(consecutive ejections - 1), then one at a time until one completes."""
        self.ejections += 1
        self.ejected_until = time.monotonic() + eject_s * 2 ** min(self.ejections - 1, MAX_EJECT_DOUBLINGS)


@dataclass
class Registry:
    """Thread-safe set of endpoints (the controller thread mutates it, the gateway loop reads and picks)."""

    max_excess: float = 4.0
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    classes: dict[str, list[PlanClass]] = field(default_factory=dict)
    """Request classes per model, shortest first (set from the plan; models without them are unclassed)."""
    plan: Plan | None = None
    """The plan in force (set by the controller): whether and where the gateway sheds
    (`coral.allocation.shedding.shed_capacity`)."""
    expected: frozenset[str] = frozenset()
    """Models to be served while no plan is in force yet (`coral serve`: the scenario's), so that a request for one
    is told to come back (503), not that the model does not exist."""
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
            old.class_weights = ep.class_weights
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

    def planned_models(self) -> list[str]:
        """The models to be served: those of the plan in force; before one, `expected` and those registered."""
        if self.plan is not None:
            return sorted({i.model for i in self.plan.instances})
        return sorted(self.expected | set(self.models()))

    def pool(self, model: str, phase: str) -> list[Endpoint]:
        return [e for e in self.all() if e.model == model and e.phase == phase]

    def down(self) -> set[tuple[str, str]]:
        """(model, phase)s with a ready instance that is down (found dead or failing): it lost capacity."""
        return {(e.model, e.phase) for e in self.all() if e.state is InstanceState.READY and not e.healthy}

    def capacity(self) -> dict[tuple[str, str], float]:
        """Planned tokens/s of the routable instances per (model, phase): the sum of their weights."""
        out: dict[tuple[str, str], float] = {}
        for e in self.all():
            if e.routable:
                out[(e.model, e.phase)] = out.get((e.model, e.phase), 0.0) + e.weight
        return out

    def class_of(self, model: str, input_tokens: float) -> str | None:
        """The request class of a prompt of `input_tokens` for `model` (None: the model has no classes)."""
        return class_of(self.classes.get(model, []), input_tokens)

    def pick(
        self, model: str, phase: str, exclude: frozenset[str] = frozenset(), request_class: str | None = None
    ) -> Endpoint | None:
        """Choose a routable endpoint for a request of `request_class` and count one request in flight on it
        (caller must `release`)."""
        with self.lock:
            pool = [
                e
                for e in self.endpoints.values()
                if e.model == model and e.phase == phase and e.routable and e.id not in exclude
                and not (e.ejections and e.inflight)  # on probation: one request at a time
            ]
            cls = request_class
            if not any(e.weight_for(cls) > 0 for e in pool):
                cls = None  # nobody planned for this class: plain weights
            w = {e.id: e.weight_for(cls) for e in pool}
            cands = [e for e in pool if w[e.id] > 0]
            if not cands:
                return None
            total_w = sum(w[e.id] for e in cands)
            for e in cands:
                e.credits[cls] = e.credits.get(cls, 0.0) + w[e.id]
            best = max(cands, key=lambda e: e.credits[cls])
            total_in = sum(e.inflight for e in cands) + 1
            if best.inflight - w[best.id] / total_w * total_in > self.max_excess:
                best = min(cands, key=lambda e: ((e.inflight + 1) / w[e.id], -e.credits[cls]))
            best.credits[cls] -= total_w
            best.inflight += 1
            return best

    def eject(self, ep: Endpoint, eject_s: float, max_fraction: float) -> bool:
        """Eject `ep` (`Endpoint.eject`) unless that would take more than `max_fraction` of its pool's instances
        out at once or leave the pool without a routable instance; whether it was ejected."""
        with self.lock:
            now = time.monotonic()
            pool = [e for e in self.endpoints.values() if e.model == ep.model and e.phase == ep.phase]
            out = sum(e is not ep and e.ejected_until > now for e in pool)
            others = any(e is not ep and e.routable for e in pool)
            if not others or out + 1 > max_fraction * len(pool):
                return False
            ep.eject(eject_s)
            return True

    def release(self, ep: Endpoint, ok: bool | None) -> None:
        """A request on `ep` ended: served (`ok`), failed, or refused by the engine for now (None: counted as
        neither)."""
        with self.lock:
            ep.inflight -= 1
            if ok is None:
                return
            if ok:
                ep.served += 1
                ep.ejections = 0
            else:
                ep.failed += 1
