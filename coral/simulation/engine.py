"""The event loop: PD-disaggregated serving of a plan, request by request.

Routing: a model planned with request-length classes (`Plan.request_classes`) routes each request by the class of
its prompt length, with each instance's planned tokens/s for that class as its weight (instances planned for
none of the class's load only get it when no instance is), and sizes each instance's batch cap for the mix of
classes it is planned for (a kept instance keeps its cap across re-plans, as a running engine would).

Prefill: the router picks a prefill instance, the instance one node per stage (smooth weighted round-robin on
node throughput). Each stage node runs continuous batching with chunked prefill: a step takes queued prompt
tokens, FCFS, up to the template's planned batch, and lasts the perf model's step time for that many tokens;
each chunk then queues at the request's next stage node (pipelined). Once the whole prompt has passed the last
stage the first token is out (TTFT) and the router picks a decode instance.

Decode: a request waits at its decode instance (FIFO) until each stage has a node with KV room for it and a
free batch slot; its path is then the node of each stage that weighted round-robin (on node throughput) picks
among those, so a full node never holds up requests another node of its stage could take. It is charged its
prompt plus half its output ("mean": what a paged KV cache holds for it on average over its decode, so the
cache's occupancy matches vLLM's without simulating preemption) or its whole final context ("max": reserve up front, never preempt). Then its KV cache crosses from prefill to decode nodes
(`coral.perf.latency`: every node sends or receives its own layers' KV at once, so the hand-off lasts attended prompt
tokens x KV bytes per layer x the largest layers / NIC of any node on the prefill or the decode path) and it
joins the batches of its path. Each token passes the path's S stage nodes, where a node's
step time is that of a micro-batch of ceil(k/S) of the k sequences it holds at their mean context (prompt +
output/2 each, the perf model's decode context). A sequence makes one token per pipeline cycle: the sum of its
nodes' step times, or, with m = min(S, k) micro-batches in flight, m x the slowest node's step time if that is
longer (the bottleneck stage runs the micro-batches one after another; the planner's "slowest stage").
Step times only change when a batch changes, so instead of one event per step the loop jumps from one change
to the next (per path: a virtual token clock and a heap of finishing targets) — the
same arithmetic as stepping, with a joining sequence starting at once rather than at the next step boundary.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from coral.allocation.plan import Plan, PlanClass, PlanInstance, SolveReport, class_indices
from coral.allocation.shedding import Shedder, shed_capacity
from coral.catalog.loader import Catalog
from coral.perf.model import Workload
from coral.simulation.kernels import KernelCache, NodeKernel, decode_step

STARTING, READY, DRAINING, STOPPED = 0, 1, 2, 3
_K_PREFILL, _K_KV, _K_PATH, _K_READY, _K_EPOCH, _K_RETIRE, _K_AVAIL = 0, 1, 2, 3, 4, 5, 6
_EPS = 1e-7
T = TypeVar("T")


class Stride(Generic[T]):
    """Smooth weighted round-robin (stride scheduling): item i is picked in proportion to weights[i]."""

    __slots__ = ("heap", "items", "single", "step")

    def __init__(self, items: list[T], weights: list[float]) -> None:
        w = [x if x > 0 else 0.0 for x in weights]
        if not any(w):
            w = [1.0] * len(items)
        self.items = items
        self.single = items[0] if len(items) == 1 else None
        self.step = [1.0 / x if x > 0 else float("inf") for x in w]
        self.heap = [(self.step[i], i) for i in range(len(items))]
        heapq.heapify(self.heap)

    def pick(self) -> T:
        if self.single is not None:
            return self.single
        p, i = self.heap[0]
        heapq.heapreplace(self.heap, (p + self.step[i], i))
        return self.items[i]

    def pick_among(self, allowed: list[T]) -> T:
        """What `pick` would return if only the (non-empty) `allowed` items took part."""
        best = min(e for e in self.heap if self.items[e[1]] in allowed)
        if self.single is None:
            self.heap[self.heap.index(best)] = (best[0] + self.step[best[1]], best[1])
            heapq.heapify(self.heap)
        return self.items[best[1]]


def take_chunks(queue: deque[list[Any]], cap: int) -> tuple[list[list[Any]], int]:
    """One chunked-prefill step's batch: [request, prompt tokens] items taken FCFS from `queue` up to `cap` tokens
    (the last one split, its rest left queued), and the tokens taken."""
    tokens = 0
    batch: list[list[Any]] = []
    while queue and tokens < cap:
        item = queue[0]
        take = cap - tokens
        if item[1] <= take:
            tokens += item[1]
            batch.append(item)
            queue.popleft()
        else:
            item[1] -= take
            batch.append([item[0], take])
            tokens = cap
    return batch, tokens


class PNode:
    """A prefill stage node; queue and batch hold [request, prompt tokens still to pass this node]."""

    __slots__ = ("batch", "busy", "busy_time", "cap", "gpus", "inst", "last", "layers_per_nic", "queue", "stage",
                 "table")

    def __init__(self, k: NodeKernel, inst: Instance, stage: int, n_stages: int, layers: int) -> None:
        self.table, self.cap, self.gpus, self.inst = k.table, k.cap, k.gpus, inst
        self.layers_per_nic = layers / k.nic_bytes_s  # its share of a hand-off, per KV byte of a layer
        self.stage, self.last = stage, stage == n_stages - 1
        self.queue: deque[list[int]] = deque()
        self.batch: list[list[int]] = []
        self.busy = False
        self.busy_time = 0.0


class DNode:
    """A decode stage node: k resident sequences, `slots` admitted (resident or receiving KV)."""

    __slots__ = ("busy_time", "cap", "ctx_sum", "dt", "gpus", "inst", "k", "k_area", "kv_cap", "kv_free",
                 "layers_per_nic", "paths", "slots", "t_mark", "table")

    def __init__(self, k: NodeKernel, inst: Instance, stage: int, n_stages: int, layers: int) -> None:
        self.table, self.cap, self.gpus, self.inst = k.ctx_table, k.cap, k.gpus, inst
        self.layers_per_nic = layers / k.nic_bytes_s
        self.ctx_sum = 0.0  # decode context (prompt + output/2) summed over resident sequences
        self.kv_cap = self.kv_free = k.kv_tokens
        self.k = self.slots = 0
        self.dt = decode_step(k.ctx_table, 0, 1.0)
        self.paths: list[Path] = []
        self.t_mark = 0.0  # time of the last batch change; busy_time and k_area are integrated up to it
        self.k_area = 0.0
        self.busy_time = 0.0


class Stepping(Protocol):
    """A decode stage node as `cycle_s` sees it: its step time and resident sequences."""

    @property
    def dt(self) -> float: ...

    @property
    def k(self) -> int: ...


def cycle_s(nodes: Sequence[Stepping]) -> float:
    """Seconds per token of a sequence on a decode path: one micro-batch's pass over the stages, or, with
    several micro-batches in flight, the bottleneck node's step time once per micro-batch."""
    if len(nodes) == 1:
        return nodes[0].dt
    total = slowest = 0.0
    in_flight = len(nodes)
    for n in nodes:
        total += n.dt
        slowest = n.dt if n.dt > slowest else slowest
        in_flight = n.k if n.k < in_flight else in_flight
    return max(total, in_flight * slowest)


class Path:
    """One node per stage of a decode instance; `progress` counts tokens made by each of its sequences."""

    __slots__ = ("heap", "inst", "layers", "nodes", "progress", "rate", "t_last", "version")

    def __init__(self, nodes: tuple[DNode, ...], layers: list[int], inst: Instance) -> None:
        self.nodes, self.layers, self.inst = nodes, layers, inst
        self.progress = 0.0
        self.t_last = 0.0
        self.rate = 1.0 / cycle_s(nodes)
        self.heap: list[tuple[float, int]] = []
        self.version = 0
        for n in nodes:
            n.paths.append(self)


class Instance:
    """A running (or starting / draining) serving instance of a plan."""

    __slots__ = ("cost", "drain_s", "key", "layers", "lost", "model", "outstanding", "paths", "phase", "pickers",
                 "ready_s", "retiring", "spec", "stages", "start_s", "state", "stop_s", "waiting", "weight")

    def __init__(self, spec: PlanInstance, kernels: KernelCache, start_s: float, ready_s: float,
                 workload: Workload | None = None) -> None:
        self.spec = spec
        self.key = (spec.model, spec.phase)
        self.model, self.phase = spec.model, spec.phase
        self.weight = spec.throughput
        self.cost = spec.cost_per_hour
        self.start_s, self.ready_s = start_s, ready_s
        self.stop_s = self.drain_s = float("inf")
        self.state = STARTING
        self.retiring = False  # removed by a re-plan, serving until its replacements are ready
        self.lost = False  # its nodes were taken away (availability fell): stopped at once, not drained
        self.outstanding = 0
        self.waiting: deque[int] = deque()
        self.paths: dict[tuple[int, ...], Path] = {}
        s = len(spec.stages)
        node_cls = PNode if spec.phase == "prefill" else DNode
        self.stages: list[list[Any]] = [
            [node_cls(kernels.kernel(spec.model, spec.phase, c, st.layers, s, workload), self, j, s, st.layers)
             for c in st.nodes]
            for j, st in enumerate(spec.stages)
        ]
        self.layers = [st.layers for st in spec.stages]
        self.pickers = [
            Stride(list(range(len(nodes))), list(st.node_throughput) or [1.0] * len(nodes))
            for nodes, st in zip(self.stages, spec.stages, strict=True)
        ]

    def all_nodes(self) -> list[Any]:
        return [n for st in self.stages for n in st]

    def pick_path(self) -> tuple[int, ...]:
        return tuple(p.pick() for p in self.pickers)

    def path_with_room(self, need: float) -> Path | None:
        """The decode path for a request charged `need` KV tokens: per stage, the node the weighted round-robin
        would pick among those with a free batch slot and KV room (None while some stage has none)."""
        def room(n: DNode) -> bool:
            return n.slots < n.cap and n.kv_free >= min(need, n.kv_cap)

        free = [[i for i, n in enumerate(st) if room(n)] for st in self.stages]
        if not all(free):
            return None
        idx = [picker.pick_among(ok) for picker, ok in zip(self.pickers, free, strict=True)]
        key = tuple(idx)
        path = self.paths.get(key)
        if path is None:
            nodes = tuple(st[i] for st, i in zip(self.stages, key, strict=True))
            path = self.paths[key] = Path(nodes, self.layers, self)
        return path


def nodes_beyond(instances: Iterable[Instance], counts: Counts) -> dict[tuple[str, str], tuple[int, int]]:
    """(region, config) -> (nodes `instances` hold, the count) where they hold more than `counts` allows (a pair it
    does not list is unbounded)."""
    used: dict[tuple[str, str], int] = {}
    for inst in instances:
        for cfg, n in inst.spec.counts.items():
            used[(inst.spec.region, cfg)] = used.get((inst.spec.region, cfg), 0) + n
    return {k: (n, counts[k[0]][k[1]]) for k, n in used.items()
            if k[1] in counts.get(k[0], {}) and n > counts[k[0]][k[1]]}


def signature(spec: PlanInstance) -> tuple[Any, ...]:
    """Instances with equal signatures are interchangeable across re-plans."""
    stages = tuple((s.layers, tuple(s.nodes)) for s in spec.stages)
    return (spec.model, spec.phase, spec.region, spec.template_id, stages)


@dataclass(frozen=True)
class ModelDemand:
    """Demand seen for one model over an epoch window."""

    rate: float
    prefill_tokens_s: float
    decode_tokens_s: float


@dataclass(frozen=True)
class ObservedLatency:
    """Latencies (seconds) of one model's requests that arrived in an observation window, as known when it is
    read: TTFT (still waiting: the wait so far) and mean TPOT (still decoding: the time per token so far over
    all of its tokens; NaN before the first token or with fewer than 2 output tokens)."""

    ttft_s: np.ndarray
    tpot_s: np.ndarray


@dataclass(frozen=True)
class ObservedDemand:
    """What a re-planner sees at the start of an epoch: demand over [start_s, end_s) — the previous epoch (for
    epoch 0, the scenario's forecast, start_s = end_s = 0) or, with an oracle forecast, the coming one — and
    the node availability now in force (None = the scenario's own). `series` splits the window's demand into
    consecutive intervals of `interval_s` (the last one possibly shorter); `latency` holds the window's observed
    latencies per model (empty for the scenario's forecast and for an oracle's coming epoch); `market` is the
    catalog of offerings and prices now in force when it differs from the re-planner's own (None = unchanged)."""

    epoch: int
    start_s: float
    end_s: float
    models: dict[str, ModelDemand]
    availability: dict[str, dict[str, int]] | None = None
    interval_s: float = 0.0
    series: dict[str, list[ModelDemand]] = field(default_factory=dict)
    latency: dict[str, ObservedLatency] = field(default_factory=dict)
    market: Catalog | None = None


Replanner = Callable[[int, ObservedDemand, Plan | None], Plan]


@dataclass
class Trace:
    """Everything the loop records, for the metrics stage."""

    instances: list[Instance] = field(default_factory=list)
    end_s: float = 0.0
    losses: list[str] = field(default_factory=list)  # what each availability drop took away, in words
    rerouted: int = 0  # requests sent to another instance because theirs was lost
    failed: int = 0  # requests lost mid-decode with their instance (never finished)


@dataclass(frozen=True)
class Record:
    """Per request, what a run recorded: first token, decode admission and finish times (NaN: never), times
    finished (0 or 1), shed at arrival, and its prefill and decode instance (index into `Trace.instances`, -1:
    none)."""

    first_token_s: np.ndarray
    decode_admit_s: np.ndarray
    done_s: np.ndarray
    done_count: np.ndarray
    refused: np.ndarray
    prefill_instance: np.ndarray
    decode_instance: np.ndarray


Counts = dict[str, dict[str, int]]


def class_mix(spec: PlanInstance, classes: list[PlanClass]) -> Workload | None:
    """The mean request shape of the classes an instance is planned for, weighted by its planned requests/s of
    each (None: it serves the model's whole mix)."""
    if not spec.class_throughput or not classes:
        return None
    per_req = {c.name: c.mean_input_tokens if spec.phase == "prefill" else c.mean_output_tokens for c in classes}
    rate = {c.name: spec.class_throughput.get(c.name, 0.0) / per_req[c.name] for c in classes}
    total = sum(rate.values())
    if total <= 0:
        return None
    return Workload(sum(rate[c.name] * c.mean_input_tokens for c in classes) / total,
                    sum(rate[c.name] * c.mean_output_tokens for c in classes) / total)


def class_weights(members: list[Instance], request_class: str | None) -> list[float]:
    """Router weights of `members` for a request of `request_class`: their planned tokens/s of the class, or
    their throughput when none is planned for it."""
    weights = [i.spec.weight_for(request_class) for i in members]
    return weights if any(w > 0 for w in weights) else [i.weight for i in members]


def request_classes(classes: dict[str, list[PlanClass]], models: list[str], model_of: np.ndarray,
                    input_tokens: np.ndarray) -> list[str | None]:
    """Each request's class name (`class_indices`; None for models planned without classes)."""
    out: list[str | None] = [None] * len(model_of)
    for m, cls in classes.items():
        if m not in models or not cls:
            continue
        sel = np.flatnonzero(model_of == models.index(m))
        idx = class_indices(cls, input_tokens[sel])
        for r, i in zip(sel.tolist(), idx.tolist(), strict=True):
            out[r] = cls[i].name
    return out


class Engine:
    """One simulation run. Requests arrive sorted by time; `model_of[r]` indexes `models`."""

    def __init__(
        self,
        kernels: KernelCache,
        models: list[str],
        arrival: np.ndarray,
        model_of: np.ndarray,
        input_tokens: np.ndarray,
        output_tokens: np.ndarray,
        *,
        router: str,
        startup_delay_s: float,
        horizon_s: float,
        handover: bool = True,
        kv_reserve: str = "mean",
        available: Callable[[float], Counts] | None = None,
        shedder: Shedder | None = None,
        shed: str = "plan",
    ) -> None:
        if router not in ("wrr", "lor"):
            raise ValueError(f"router must be 'wrr' or 'lor', not {router!r}")
        if kv_reserve not in ("mean", "max"):
            raise ValueError(f"kv_reserve must be 'mean' or 'max', not {kv_reserve!r}")
        self.kernels = kernels
        self.models = models
        self.router = router
        self.startup = startup_delay_s
        self.handover = handover
        self.available = available  # node counts in force at a time (None: unlimited)
        if shed not in ("plan", "always", "off"):
            raise ValueError(f"shed must be 'plan', 'always' or 'off', not {shed!r}")
        self.shedder, self.shed = shedder, shed
        self.shedding = False  # some (model, phase) is shed now (coral.allocation.shedding)
        self.plan_in_force: Plan | None = None
        self.down: set[tuple[str, str]] = set()  # (model, phase)s that lost instances, until back to their plan
        self.horizon = horizon_s
        n = len(arrival)
        self.n = n
        self.arrival, self.model_of, self.inp_array, self.out_array = arrival, model_of, input_tokens, output_tokens
        kv_in = np.zeros(n)
        kv_res = np.zeros(n)
        for i, m in enumerate(models):
            sel = model_of == i
            if sel.any():
                kb = kernels.models[m].kv_bytes_per_token_layer
                kv_in[sel] = kernels.attended(m, input_tokens[sel]) * kb
                grown = output_tokens[sel] if kv_reserve == "max" else output_tokens[sel] / 2
                kv_res[sel] = kernels.attended(m, input_tokens[sel] + grown)
        self.kv_in_array = kv_in  # KV bytes per layer of the prompt
        self.kv_res_array = kv_res  # KV tokens per layer a request is charged while decoding
        self.d_ctx_array = input_tokens + output_tokens / 2  # mean context over its decode
        self.lists_made = False  # the Python loop's per-request state (`make_lists`)
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.routers: dict[tuple[str, str], list[Instance]] = {}
        self.strides: dict[tuple[str, str, str | None], Stride[Instance]] = {}  # per class, built when first used
        self.classes: dict[str, list[PlanClass]] = {}
        self.req_class: list[str | None] = [None] * n
        self.backlog: dict[tuple[str, str], list[int]] = {}
        self.trace = Trace()

    def make_lists(self) -> None:
        """The per-request state of the Python loop, as lists (what it indexes one request at a time)."""
        n = self.n
        self.arr = self.arrival.tolist()
        self.mod = self.model_of.tolist()
        self.inp = self.inp_array.tolist()
        self.out = self.out_array.tolist()
        self.kv_in = self.kv_in_array.tolist()
        self.kv_res = self.kv_res_array.tolist()
        self.d_ctx = self.d_ctx_array.tolist()
        self.t_first = [float("nan")] * n
        self.t_done = [float("nan")] * n
        self.t_admit = [float("nan")] * n  # decode admission (KV room found, transfer starts)
        self.refused = [False] * n  # shed at arrival: beyond the capacity serving its model
        self.done_count = [0] * n
        self.p_inst: list[Instance | None] = [None] * n
        self.p_nodes: list[tuple[PNode, ...]] = [()] * n
        self.p_left = [0] * n  # prompt tokens not yet through the last prefill stage
        self.d_inst: list[Instance | None] = [None] * n  # decode instance, chosen when prefill ends
        self.d_path: list[Path | None] = [None] * n  # its nodes, chosen at admission
        self.lists_made = True

    def record(self) -> Record:
        """What the Python loop recorded, per request."""
        index = {id(inst): k for k, inst in enumerate(self.trace.instances)}
        return Record(
            first_token_s=np.asarray(self.t_first), done_s=np.asarray(self.t_done),
            decode_admit_s=np.asarray(self.t_admit), done_count=np.asarray(self.done_count, dtype=np.int64),
            refused=np.asarray(self.refused, dtype=bool),
            prefill_instance=np.array([index[id(i)] if i is not None else -1 for i in self.p_inst], dtype=np.int64),
            decode_instance=np.array([index[id(i)] if i is not None else -1 for i in self.d_inst], dtype=np.int64),
        )

    # --- plans ------------------------------------------------------------------------------------------
    def push(self, t: float, kind: int, obj: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj))

    def apply_plan(self, plan: Plan, t: float, initial: bool) -> None:
        """Reconcile running instances with `plan`: keep matching ones, start new ones (ready after the
        start-up delay, or at once for the initial plan) and retire the rest. A retired instance that is still
        starting stops at once; a ready one drains (takes no new requests, stops after its last one) — at once,
        or with `handover` once the new instances of its (model, phase) are ready (make before break)."""
        have: dict[tuple[Any, ...], list[Instance]] = {}
        for inst in self.trace.instances:
            if inst.state in (STARTING, READY):
                have.setdefault(signature(inst.spec), []).append(inst)
        want: dict[tuple[Any, ...], list[PlanInstance]] = {}
        for spec in plan.instances:
            want.setdefault(signature(spec), []).append(spec)
        retire: list[Instance] = []
        new_ready: dict[tuple[str, str], float] = {}
        for sig, specs in want.items():
            old = sorted(have.pop(sig, []), key=lambda i: (i.state != READY, -i.outstanding))
            for inst, spec in zip(old, specs, strict=False):
                inst.spec = spec
                inst.retiring = False
            retire += old[len(specs):]
            for spec in specs[len(old):]:
                ready = t if initial else t + self.startup
                inst = Instance(spec, self.kernels, t, ready, class_mix(spec, plan.request_classes.get(spec.model, [])))
                self.trace.instances.append(inst)
                if ready <= t:
                    inst.state = READY
                else:
                    self.push(ready, _K_READY, inst)
                    new_ready[inst.key] = ready
        for rest in have.values():
            retire += rest
        self.plan_in_force = plan
        if plan.request_classes != self.classes:
            self.classes = plan.request_classes
            self.req_class = request_classes(self.classes, self.models, self.model_of, self.inp_array)
        full = self.over_availability(t)  # with the new instances and those still to hand over
        for inst in retire:
            fits = not any((inst.spec.region, c) in full for c in inst.spec.counts)
            when = new_ready.get(inst.key) if self.handover and inst.state == READY and fits else None
            if when is None:
                self.drain(inst, t)
            elif not inst.retiring:
                inst.retiring = True
                self.push(when, _K_RETIRE, inst)
        self.rebuild_routers(t)

    def over_availability(self, t: float) -> dict[tuple[str, str], int]:
        """(region, config) -> nodes held by instances starting, serving or draining beyond the count in force at
        `t` (empty without an availability)."""
        if self.available is None:
            return {}
        held = (i for i in self.trace.instances if i.state != STOPPED)
        return {k: n - cap for k, (n, cap) in nodes_beyond(held, self.available(t)).items()}

    def enforce_availability(self, t: float) -> None:
        """Availability fell: instances on nodes no longer there are lost (`lose`) until every (region, config)
        fits, starting ones first, then draining ones, then serving ones with the fewest requests."""
        for (region, cfg), extra in sorted(self.over_availability(t).items()):
            on = [i for i in self.trace.instances
                  if i.state != STOPPED and i.spec.region == region and cfg in i.spec.counts]
            on.sort(key=lambda i: ({STARTING: 0, DRAINING: 1, READY: 2}[i.state], i.outstanding))
            taken = []
            for inst in on:
                if extra <= 0:
                    break
                extra -= inst.spec.counts[cfg]
                taken.append(inst.spec.id)
                self.lose(inst, t)
            self.trace.losses.append(f"{region}:{cfg} fell below the nodes held at {t:.0f} s: lost {', '.join(taken)}")

    def lose(self, inst: Instance, t: float) -> None:
        """`inst`'s nodes are gone at `t`: it stops serving and billing at once. Requests still prefilling or
        waiting for a decode slot are routed again (prefill starts over); requests decoding on it are lost
        (never finished)."""
        was = inst.state
        inst.lost = True
        self.stop(inst, t)
        inst.outstanding = 0
        if was != STARTING:
            self.down.add(inst.key)
        self.rebuild_routers(t)
        if was == STARTING:
            return
        again: list[int] = []
        if inst.phase == "prefill":
            for node in inst.all_nodes():
                again += [item[0] for item in (*node.queue, *node.batch)]
                node.queue.clear()
                node.batch = []
                node.busy = False
            for r in sorted(set(again)):
                self.route_prefill(r, t)
        else:
            again = list(inst.waiting)
            inst.waiting.clear()
            held = set(again)
            dead = [r for r, d in enumerate(self.d_inst) if d is inst and r not in held and self.done_count[r] == 0]
            for path in inst.paths.values():
                path.version += 1  # its pending events are void
            for r in dead:
                self.d_path[r] = None
            self.trace.failed += len(dead)
            for r in again:
                self.route_decode(r, t)
        self.trace.rerouted += len(set(again))

    def drain(self, inst: Instance, t: float) -> None:
        was_ready = inst.state == READY
        inst.state = DRAINING
        inst.drain_s = t
        if inst.outstanding == 0 or not was_ready:
            self.stop(inst, t)

    def stop(self, inst: Instance, t: float) -> None:
        inst.state = STOPPED
        inst.stop_s = t
        for n in inst.all_nodes():
            if isinstance(n, DNode) and n.k > 0:
                n.busy_time += t - n.t_mark
                n.k_area += n.k * (t - n.t_mark)
                n.t_mark = t

    def running_plan(self, like: Plan) -> Plan:
        live = [i.spec for i in self.trace.instances if i.state in (STARTING, READY) and not i.retiring]
        return Plan(
            scenario=like.scenario, method="running", instances=live, serving=[],
            cost_per_hour=sum(i.cost_per_hour for i in live), solve=SolveReport(status="running"),
        )

    def rebuild_routers(self, t: float) -> None:
        members: dict[tuple[str, str], list[Instance]] = {}
        for inst in self.trace.instances:
            if inst.state == READY:
                members.setdefault(inst.key, []).append(inst)
        self.routers = members
        self.strides = {}
        if self.shedder is not None:
            ready = {k: sum(i.weight for i in v) for k, v in members.items()}
            shed = shed_capacity(ready, self.plan_in_force, self.shed, self.down)
            self.down &= set(shed)  # a key back to its planned capacity is no longer down
            self.shedder.set_capacity(shed, t)
            self.shedding = bool(shed)
        for key in list(self.backlog):
            if key in self.routers:
                waiting = self.backlog.pop(key)
                for r in waiting:
                    if key[1] == "prefill":
                        self.route_prefill(r, t)
                    else:
                        self.route_decode(r, t)

    def pick(self, key: tuple[str, str], r: int) -> Instance | None:
        members = self.routers.get(key)
        if members is None:
            return None
        cls = self.req_class[r]
        if self.router == "wrr":
            skey = (key[0], key[1], cls)
            stride = self.strides.get(skey)
            if stride is None:
                stride = self.strides[skey] = Stride(members, class_weights(members, cls))
            return stride.pick()
        best, score = members[0], float("inf")
        for inst, w in zip(members, class_weights(members, cls), strict=True):
            s = (inst.outstanding + 1) / w if w > 0 else float("inf")
            if s < score:
                best, score = inst, s
        return best

    def release(self, inst: Instance, t: float) -> None:
        inst.outstanding -= 1
        if inst.state == DRAINING and inst.outstanding == 0:
            self.stop(inst, t)

    def shed_at_arrival(self, r: int, t: float) -> bool:
        """Whether request `r`, arriving at `t`, is beyond the capacity serving its model (the gateway's rule:
        `coral.allocation.shedding`)."""
        assert self.shedder is not None
        return self.shedder.admit(self.models[self.mod[r]], self.inp[r], self.out[r], t) > 0

    # --- prefill ----------------------------------------------------------------------------------------
    def route_prefill(self, r: int, t: float) -> None:
        key = (self.models[self.mod[r]], "prefill")
        inst = self.pick(key, r)
        if inst is None:
            self.backlog.setdefault(key, []).append(r)
            return
        inst.outstanding += 1
        self.p_inst[r] = inst
        idx = inst.pick_path()
        nodes = tuple(st[i] for st, i in zip(inst.stages, idx, strict=True))
        self.p_nodes[r] = nodes
        self.p_left[r] = self.inp[r]
        node = nodes[0]
        node.queue.append([r, self.inp[r]])
        if not node.busy:
            self.start_prefill(node, t)

    def start_prefill(self, node: PNode, t: float) -> None:
        """One chunked-prefill step: queued prompt tokens FCFS up to the node's planned batch."""
        batch, tokens = take_chunks(node.queue, node.cap)
        dt = node.table[tokens]
        node.busy = True
        node.batch = batch
        node.busy_time += dt
        self.seq += 1
        heapq.heappush(self.heap, (t + dt, self.seq, _K_PREFILL, node))

    def prefill_step_done(self, node: PNode, t: float) -> None:
        """Chunks that passed a middle stage go on to the request's next stage node (pipelined); a request is
        prefilled once all its prompt has passed the last stage."""
        if node.inst.lost:  # its requests were routed again
            return
        node.busy = False
        if node.last:
            p_left = self.p_left
            for r, tok in node.batch:
                left = p_left[r] - tok
                p_left[r] = left
                if left == 0:
                    self.t_first[r] = t
                    self.release(node.inst, t)
                    if self.out[r] <= 1:
                        self.finish(r, t)
                    else:
                        self.route_decode(r, t)
        else:
            nxt_stage = node.stage + 1
            p_nodes = self.p_nodes
            for item in node.batch:
                nxt = p_nodes[item[0]][nxt_stage]
                q = nxt.queue
                if q and q[-1][0] == item[0]:
                    q[-1][1] += item[1]
                else:
                    q.append(item)
                if not nxt.busy:
                    self.start_prefill(nxt, t)
        node.batch = []
        if node.queue:
            self.start_prefill(node, t)

    # --- decode -----------------------------------------------------------------------------------------
    def route_decode(self, r: int, t: float) -> None:
        key = (self.models[self.mod[r]], "decode")
        inst = self.pick(key, r)
        if inst is None:
            self.backlog.setdefault(key, []).append(r)
            return
        inst.outstanding += 1
        self.d_inst[r] = inst
        inst.waiting.append(r)
        if len(inst.waiting) == 1:
            self.admit(inst, t)

    def admit(self, inst: Instance, t: float) -> None:
        """Admit waiting requests FIFO while the head fits: each stage has a node with KV room and a free batch
        slot (the node is chosen now, so a full node does not hold up requests another node could take)."""
        w = inst.waiting
        while w:
            r = w[0]
            need = self.kv_res[r]
            path = inst.path_with_room(need)
            if path is None:
                return
            self.d_path[r] = path
            w.popleft()
            self.t_admit[r] = t
            busiest = 0.0  # the hand-off rule of coral.perf.latency: the busiest NIC of either side
            for pn in self.p_nodes[r]:
                if pn.layers_per_nic > busiest:
                    busiest = pn.layers_per_nic
            for n in path.nodes:
                n.slots += 1
                n.kv_free -= min(need, n.kv_cap)
                if n.layers_per_nic > busiest:
                    busiest = n.layers_per_nic
            self.push(t + self.kv_in[r] * busiest, _K_KV, r)

    def _change(self, path: Path, delta: int, ctx: float, t: float) -> None:
        """Add (+1) or remove (-1) one sequence of decode context `ctx` on every node of `path`, keeping all
        clocks consistent."""
        touched: list[Path] = []
        for n in path.nodes:
            for p in n.paths:
                if p.t_last != t:
                    p.progress += (t - p.t_last) * p.rate
                    p.t_last = t
                    touched.append(p)
                elif p not in touched:
                    touched.append(p)
            if n.k:
                n.busy_time += t - n.t_mark
                n.k_area += n.k * (t - n.t_mark)
            n.t_mark = t
            k = n.k + delta
            n.k = k
            n.ctx_sum = n.ctx_sum + delta * ctx if k else 0.0
            n.dt = decode_step(n.table, k, n.ctx_sum / k if k else 1.0)
        for p in touched:
            p.rate = 1.0 / cycle_s(p.nodes)
            p.version += 1
            if p.heap:
                self.seq += 1
                heapq.heappush(
                    self.heap, (t + (p.heap[0][0] - p.progress) / p.rate, self.seq, _K_PATH, (p, p.version))
                )

    def kv_done(self, r: int, t: float) -> None:
        path = self.d_path[r]
        if path is None:  # lost with its instance during the hand-off
            return
        if path.t_last != t:
            path.progress += (t - path.t_last) * path.rate
            path.t_last = t
        heapq.heappush(path.heap, (path.progress + self.out[r] - 1, r))
        self._change(path, +1, self.d_ctx[r], t)

    def path_event(self, path: Path, version: int, t: float) -> None:
        if version != path.version:
            return
        path.progress += (t - path.t_last) * path.rate
        path.t_last = t
        h = path.heap
        limit = path.progress + _EPS
        inst = path.inst
        if h and h[0][0] > limit:  # rounding left the head short of its target: look again when it is due
            self.seq += 1
            heapq.heappush(
                self.heap, (t + (h[0][0] - path.progress) / path.rate, self.seq, _K_PATH, (path, path.version))
            )
            return
        while h and h[0][0] <= limit:
            _, r = heapq.heappop(h)
            need = self.kv_res[r]
            for n in path.nodes:
                n.slots -= 1
                n.kv_free += min(need, n.kv_cap)
            self._change(path, -1, self.d_ctx[r], t)
            self.finish(r, t)
            self.release(inst, t)
        if inst.waiting:
            self.admit(inst, t)

    def finish(self, r: int, t: float) -> None:
        self.t_done[r] = t
        self.done_count[r] += 1

    # --- loop -------------------------------------------------------------------------------------------
    def run(
        self,
        first_plan: Plan,
        replan: Replanner | None,
        epoch_s: float,
        duration_s: float,
        demand_of: Callable[[int], ObservedDemand],
        changes: Sequence[float] = (),
    ) -> Trace:
        """Serve until the horizon: arrivals, engine events, re-plans every epoch and, at each time in `changes`,
        the availability in force (nodes it no longer has are lost)."""
        self.start(first_plan, changes)
        return self.serve(first_plan, replan, epoch_s, duration_s, demand_of)

    def start(self, first_plan: Plan, changes: Sequence[float] = (), lists: bool = True) -> None:
        """Put `first_plan` in force at time 0 (every instance ready) and schedule the availability changes.
        `lists`: make the Python loop's state now (else `serve` does; an availability makes it at once)."""
        if lists or self.available is not None:
            self.make_lists()
        self.apply_plan(first_plan, 0.0, initial=True)
        self.enforce_availability(0.0)
        for at in changes:
            if at > 0:
                self.push(at, _K_AVAIL, at)

    def stays_put(self) -> bool:
        """Whether, once started with no re-planner and no scheduled change, nothing but requests moves: every
        instance serving, none shed (what `coral.simulation.compiled` runs)."""
        return not self.heap and not self.shedding and all(i.state == READY for i in self.trace.instances)

    def serve(
        self,
        first_plan: Plan,
        replan: Replanner | None,
        epoch_s: float,
        duration_s: float,
        demand_of: Callable[[int], ObservedDemand],
    ) -> Trace:
        """The Python event loop, from a started engine to the horizon (see `run`)."""
        if not self.lists_made:
            self.make_lists()
        n_epochs = max(1, int(np.ceil(duration_s / epoch_s - 1e-9)))
        for e in range(1, n_epochs if replan is not None else 1):
            self.push(e * epoch_s, _K_EPOCH, e)
        heap, arr, n = self.heap, self.arr, self.n
        pop = heapq.heappop
        ai = 0
        t = 0.0
        horizon = self.horizon
        while True:
            if ai < n and (not heap or arr[ai] <= heap[0][0]):
                t = arr[ai]
                if self.shedding and self.shed_at_arrival(ai, t):
                    self.refused[ai] = True
                else:
                    self.route_prefill(ai, t)
                ai += 1
                continue
            if not heap:
                break
            t, _, kind, obj = pop(heap)
            if t > horizon:
                t = horizon
                break
            if kind == _K_PATH:
                p, v = obj
                self.path_event(p, v, t)
            elif kind == _K_PREFILL:
                self.prefill_step_done(obj, t)
            elif kind == _K_KV:
                self.kv_done(obj, t)
            elif kind == _K_READY:
                inst: Instance = obj
                if inst.state == STARTING:
                    inst.state = READY
                    self.rebuild_routers(t)
            elif kind == _K_RETIRE:
                inst = obj
                if inst.retiring and inst.state == READY:
                    inst.retiring = False
                    self.drain(inst, t)
                    self.rebuild_routers(t)
            elif kind == _K_AVAIL:
                self.enforce_availability(t)
            else:  # _K_EPOCH, only scheduled with a re-planner
                assert replan is not None
                plan = replan(obj, demand_of(obj), self.running_plan(first_plan))
                self.apply_plan(plan, t, initial=False)
        end = max(t, duration_s)
        for inst in self.trace.instances:
            if inst.state != STOPPED:
                self.stop(inst, end)
        self.trace.end_s = end
        return self.trace
