"""The instance scheduler: admission, path choice, KV block accounting, micro-batching and token streaming for one
instance.

A request gets a path (one node per stage) at admission by smooth weighted round-robin over each stage's nodes,
weighted by the placement's per-node throughput, and keeps it while its KV lives there. Micro-batches are formed
per path (continuous batching) under a token budget (`max_batch_tokens`) and a sequence cap (`max_batch`): decode
steps first, then running prefills, then waiting requests in arrival order, prefills chunked to fill what is left
of the budget. Up to `max_inflight` micro-batches flow down the pipeline at once. The last stage samples a token
(`coral.engine.sampling`, with the step's parameters sent along with the micro-batch) for each step that
completes its request's input and returns the tokens here, which hands them to each request's callback.

KV blocks: every node reports its pool (blocks of `block_size` tokens) when ready, and the scheduler keeps the
accounting of each node's free blocks (a request holds the same number of blocks on every node of its path). A
step is sent only when its blocks fit on the whole path; a waiting request is admitted only then (in arrival
order), and a running one that does not fit preempts the newest requests idle on the full node, or itself if
it is the newest: a preempted request's KV is freed and it is recomputed from its prompt and the tokens it has
produced (greedy and seeded outputs are unchanged: a seeded token's draw depends on the seed and its index only).

Waiting requests (submitted, no step sent yet) are counted (`waiting`, for the server's admission bound); one
whose `deadline` passes before its first step is dropped with finish reason 'deadline'. A failed node (reported
by the node, or by the instance watching its processes: `fail`) ends every request with 'error' and refuses new
ones.

All ZeroMQ sockets are owned by the scheduler thread; other threads talk to it through `submit`/`cancel`/`fail`.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from coral.engine.layout import Layout
from coral.engine.sampling import GREEDY, Sampled, SamplingParams, history_wire
from coral.engine.transport import frames_tensors

# (token or None, finish reason or None, logits of the step if asked) -> None; called on the scheduler thread.
# Finish reasons: 'stop', 'length', and without a token 'abort' (cancelled or shut down), 'error' (a node failed:
# `Scheduler.error` says which; or the request can never fit the KV pool), 'deadline' (expired while waiting).
EventFn = Callable[[int | None, str | None, list[float] | None], None]


class SmoothWRR:
    """Smooth weighted round-robin (nginx's): every pick raises each item by its weight and lowers the chosen
    one by the total, so picks interleave in proportion to the weights."""

    def __init__(self, weights: Sequence[float]) -> None:
        self.weights = list(weights)
        self.current = [0.0] * len(weights)

    def pick(self) -> int:
        total = sum(self.weights)
        for i, w in enumerate(self.weights):
            self.current[i] += w
        best = max(range(len(self.weights)), key=lambda i: self.current[i])
        self.current[best] -= total
        return best


@dataclass(eq=False)
class Request:
    rid: str
    prompt: list[int]
    max_tokens: int
    on_event: EventFn
    stop_ids: frozenset[int] = frozenset()
    sampling: SamplingParams = GREEDY
    deadline: float | None = None  # time.monotonic() by which its first step must be sent, else dropped
    want_logits: bool = False
    keep_kv: bool = False  # PD prefill: leave the KV on the nodes for a decode instance to take
    remote: dict[str, Any] | None = None  # PD decode: {request_id, prompt_tokens, first_token, sources}
    path: tuple[int, ...] = ()
    seq: int = 0  # arrival order (lower: older, preempted later)
    position: int = 0  # tokens whose KV is on the path
    pending: list[int] = field(default_factory=list)  # input tokens not yet computed (a chunk at a time)
    output: list[int] = field(default_factory=list)
    logprobs: list[Sampled] = field(default_factory=list)  # per output token, when `sampling.logprobs` is set
    started: bool = False  # a step was sent (no longer waiting)
    blocks: int = 0  # KV blocks held on each node of the path
    busy: bool = False
    cancelled: bool = False
    pulling: bool = False  # PD decode: pulls sent
    pulls: dict[int, bool] = field(default_factory=dict)  # PD decode: rank -> took its layers' KV
    history_sent: bool = False  # penalised: the last node of its path holds its token history (while its KV does)


class Scheduler:
    def __init__(
        self,
        layout: Layout,
        ctx: zmq.Context[Any],
        results_bind: str,
        max_batch: int = 32,
        max_batch_tokens: int = 4096,
        max_inflight: int | None = None,
    ) -> None:
        """`results_bind`: 'tcp://HOST' (port chosen by the OS), 'tcp://HOST:PORT' or an 'inproc://NAME' address."""
        self.layout = layout
        self.ctx = ctx
        self.max_batch, self.max_batch_tokens = max_batch, max_batch_tokens
        widest = max(len(s) for s in layout.stages)
        self.max_inflight = max_inflight or len(layout.stages) * widest
        self.results = ctx.socket(zmq.PULL)
        if results_bind.startswith("inproc://") or _has_port(results_bind):
            self.results.bind(results_bind)
        else:
            self.results.bind_to_random_port(results_bind)
        self.results_addr = self.results.getsockopt_string(zmq.LAST_ENDPOINT)
        wake = f"inproc://coral-wake-{uuid.uuid4().hex}"
        self.wake_in = ctx.socket(zmq.PULL)
        self.wake_in.bind(wake)
        self.wake_out = ctx.socket(zmq.PUSH)
        self.wake_out.connect(wake)
        self.wake_lock = threading.Lock()
        self.inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.cmd: dict[int, zmq.Socket[Any]] = {}
        self.kv_addr: dict[int, str] = {}
        self.ready = threading.Event()
        self.closed = False
        self.error: str | None = None
        self.wrr = [SmoothWRR([n.weight for n in stage]) for stage in layout.stages]
        self.active: dict[str, Request] = {}  # insertion order = arrival order
        self.flight: dict[int, list[tuple[Request, int, bool]]] = {}  # micro-batch -> (request, tokens, sampled)
        self.batches = 0  # micro-batches dispatched (also the next micro-batch id)
        self.remote_prefills = 0  # requests admitted with their KV taken from a prefill instance
        self.preemptions = 0
        self.arrivals = 0
        self.submitted = 0  # requests submitted (under `wake_lock`)
        self.unwaited = 0  # requests that stopped waiting: started, finished or refused (scheduler thread)
        self.deadlines: dict[str, Request] = {}  # waiting requests with a deadline
        self.block_size = 0  # tokens per KV block (the nodes' pools, reported when ready)
        self.capacity: dict[int, int] = {}  # node rank -> KV blocks of its pool
        self.free: dict[int, int] = {}  # node rank -> KV blocks not held by any request
        self.kept: dict[str, dict[int, int]] = {}  # request kept for hand-off -> {rank: blocks held there}
        self.peak_blocks: dict[int, int] = {}  # node rank -> most blocks in use at once
        self.thread = threading.Thread(target=self._loop, name=f"coral-sched-{layout.instance_id}", daemon=True)

    # --- other threads ----------------------------------------------------------------------------------
    def start(self) -> Scheduler:
        self.thread.start()
        return self

    def submit(self, request: Request) -> None:
        self._post("submit", request)

    def cancel(self, rid: str) -> None:
        self._post("cancel", rid)

    def fail(self, message: str) -> None:
        """A node is gone (`message` says which): end every request with an error, refuse new ones."""
        self._post("fail", message)

    @property
    def waiting(self) -> int:
        """Requests submitted whose first step is not sent yet."""
        return self.submitted - self.unwaited

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.thread.is_alive():
            self._post("stop", None)
            self.thread.join(timeout_s)

    def kv_sources(self, path: Sequence[int]) -> list[dict[str, Any]]:
        """Where the KV of a request on `path` lives: per node, its KV address and layer range."""
        nodes = {n.rank: n for n in self.layout.nodes}
        return [{"kv": self.kv_addr[r], "first": nodes[r].first, "last": nodes[r].last} for r in path]

    def _post(self, kind: str, item: Any) -> None:
        with self.wake_lock:
            if self.closed:
                if kind == "submit":
                    item.on_event(None, "error", None)
                return
            self.submitted += kind == "submit"
            self.inbox.put((kind, item))
            self.wake_out.send(b"", zmq.NOBLOCK)

    # --- scheduler thread -------------------------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.results, zmq.POLLIN)
        poller.register(self.wake_in, zmq.POLLIN)
        running = True
        try:
            while running:
                events = dict(poller.poll(self._next_deadline_ms()))
                if self.wake_in in events:
                    while self.wake_in.poll(0):
                        self.wake_in.recv()
                    running = self._drain_inbox()
                if self.results in events:
                    while self.results.poll(0):
                        self._on_result(self.results.recv_multipart())
                self._expire()
                if running and self.ready.is_set() and self.error is None:
                    self._dispatch()
        finally:
            self._shutdown()

    def _next_deadline_ms(self) -> int | None:
        """Milliseconds to the earliest deadline of a waiting request (None: no such deadline)."""
        soonest = min((r.deadline for r in self.deadlines.values() if r.deadline is not None), default=None)
        return None if soonest is None else max(0, math.ceil((soonest - time.monotonic()) * 1000))

    def _expire(self) -> None:
        """Drop the waiting requests whose deadline has passed."""
        now = time.monotonic()
        for req in [r for r in self.deadlines.values() if r.deadline is not None and r.deadline <= now]:
            self.active.pop(req.rid)
            self._unwait(req)
            req.on_event(None, "deadline", None)

    def _unwait(self, req: Request) -> None:
        """`req` is no longer waiting (its first step is sent, or it ended before one)."""
        if not req.started:
            req.started = True
            self.unwaited += 1
            self.deadlines.pop(req.rid, None)

    def _drain_inbox(self) -> bool:
        while True:
            try:
                kind, item = self.inbox.get_nowait()
            except queue.Empty:
                return True
            if kind == "stop":
                return False
            if kind == "submit":
                self._admit(item)
            elif kind == "fail":
                if self.error is None:
                    self._fail(item)
            elif kind == "cancel":
                req = self.active.get(item)
                if req is not None:
                    req.cancelled = True
                    if not req.busy:
                        self._finish(req)

    def _admit(self, req: Request) -> None:
        if self.error is not None:
            self._unwait(req)
            req.on_event(None, "error", None)
            return
        req.path = tuple(stage[w.pick()].rank for stage, w in zip(self.layout.stages, self.wrr, strict=True))
        total = len(req.prompt) + req.max_tokens
        room = min((self.capacity.get(r, 0) for r in req.path), default=0)
        if self.ready.is_set() and self._blocks_for(total) > room:  # could never run, even alone
            self._unwait(req)
            req.on_event(None, "error", None)
            return
        req.seq, self.arrivals = self.arrivals, self.arrivals + 1
        self.active[req.rid] = req
        if req.deadline is not None:
            self.deadlines[req.rid] = req
        if req.remote is None:
            req.pending = list(req.prompt)

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size) if self.block_size else 0

    def _hold(self, req: Request, blocks: int) -> None:
        """`req` holds `blocks` more KV blocks (fewer if negative) on every node of its path."""
        req.blocks += blocks
        for rank in req.path:
            self.free[rank] -= blocks
            self.peak_blocks[rank] = max(self.peak_blocks.get(rank, 0), self.capacity[rank] - self.free[rank])

    def _start_pulls(self) -> None:
        """PD decode requests, in arrival order while their prompt's blocks fit: each node of the path takes
        its layers' KV from the prefill nodes."""
        for req in self.active.values():
            if req.remote is None or req.pulling or req.cancelled:
                continue
            need = self._blocks_for(int(req.remote["prompt_tokens"]))
            if any(self.free[rank] < need for rank in req.path):
                return
            self._hold(req, need)
            self._unwait(req)
            req.pulling = req.busy = True  # busy until every node of the path has its layers' KV
            for rank in req.path:
                self.cmd[rank].send_json(
                    {"op": "pull", "rid": req.rid, "remote_rid": req.remote["request_id"],
                     "sources": req.remote["sources"]}
                )

    def _on_pulled(self, req: Request, rank: int, ok: bool) -> None:
        """A node of `req`'s path took (or failed to take) its layers' KV; once all answered, decode from the
        prefill's first token, or, if any failed, drop what was taken and prefill here."""
        req.pulls[rank] = ok
        if len(req.pulls) < len(req.path):
            return
        req.busy = False
        if req.cancelled:
            self._finish(req)
        elif all(req.pulls.values()) and req.remote is not None:
            self.remote_prefills += 1
            req.position = int(req.remote["prompt_tokens"])
            first = req.remote.get("first_sampled") or [req.remote["first_token"]]
            self._emit(req, Sampled.of_wire(first), None)
        else:
            self._drop_kv(req)
            req.pending = list(req.prompt)

    def _drop_kv(self, req: Request) -> None:
        """Free `req`'s KV on its path (the nodes and the accounting); it starts again from position 0."""
        for rank in req.path:
            self.cmd[rank].send_json({"op": "free", "rids": [req.rid]})
        self._hold(req, -req.blocks)
        req.position = 0
        req.history_sent = False  # the last node dropped it with the KV

    def _emit(self, req: Request, sampled: Sampled, logits: list[float] | None) -> None:
        """A new token of `req`: finish the request or queue its next step, then hand the token on."""
        token = sampled.token
        req.output.append(token)
        if req.sampling.logprobs is not None:
            req.logprobs.append(sampled)
        finish = "stop" if token in req.stop_ids else "length" if len(req.output) >= req.max_tokens else None
        if finish is not None:  # finished before its caller hears so: no longer active, its KV kept or freed
            self._finish(req)
        else:
            req.pending = [token]
        req.on_event(token, finish, logits)

    def _finish(self, req: Request) -> None:
        self.active.pop(req.rid, None)
        self._unwait(req)
        if req.cancelled:
            req.on_event(None, "abort", None)
        if req.keep_kv and not req.cancelled:
            self.kept[req.rid] = dict.fromkeys(req.path, req.blocks)  # free once each node says it is released
            msg = {"op": "keep", "rids": [req.rid]}
        else:
            self._hold(req, -req.blocks)
            msg = {"op": "free", "rids": [req.rid]}
        for rank in req.path:
            self.cmd[rank].send_json(msg)

    def _dispatch(self) -> None:
        """Start the PD pulls that fit, then send micro-batches while fewer than `max_inflight` are in flight:
        for the path of the oldest request with work (or the next path where a step fits)."""
        self._start_pulls()
        while len(self.flight) < self.max_inflight:
            ready = [r for r in self.active.values() if not r.busy and r.pending]
            for path in dict.fromkeys(r.path for r in ready):
                batch = self._form(path, [r for r in ready if r.path == path])
                if batch:
                    self._send_run(batch)
                    break
            else:
                return

    def _form(self, path: tuple[int, ...], ready: list[Request]) -> list[tuple[Request, int]]:
        """A micro-batch on `path`: at most 1/stages of the requests on the path (so they form enough
        micro-batches to fill its pipeline) and `max_batch`, at most `max_batch_tokens` new tokens; decode steps
        first, then running prefills, then waiting requests (arrival order; one that does not fit stops
        admission), prefills chunked to the budget left. Reserves the steps' KV blocks."""
        on_path = sum(r.path == path for r in self.active.values())
        limit = min(self.max_batch, -(-on_path // len(path)))
        budget = self.max_batch_tokens
        order = sorted(ready, key=lambda r: (0 if r.blocks and len(r.pending) == 1 else 1 if r.blocks else 2,
                                             r.seq))
        batch: list[tuple[Request, int]] = []
        for r in order:
            if len(batch) >= limit or budget <= 0:
                break
            waiting, n = not r.blocks, min(len(r.pending), budget)
            if not self._reserve(r, n, [q for q, _ in batch]):
                if waiting:
                    break  # the oldest waiting request does not fit: admit none after it
                continue
            batch.append((r, n))
            budget -= n
        return batch

    def _reserve(self, req: Request, n: int, taken: list[Request]) -> bool:
        """Hold the KV blocks of `req`'s next `n` tokens on its path. A running request short of blocks
        preempts the newest idle requests holding blocks on the full nodes, or, being the newest, itself."""
        need = self._blocks_for(req.position + n) - req.blocks
        while True:
            full = {rank for rank in req.path if self.free[rank] < need}
            if not full:
                self._hold(req, need)
                return True
            if not req.blocks:
                return False  # a waiting request never preempts
            idle = [q for q in self.active.values() if q is not req and not q.busy and q.blocks
                    and q not in taken and full & set(q.path)]
            if not idle:
                return False  # the holders are in flight: wait for them
            victim = max(idle, key=lambda q: q.seq)
            if victim.seq < req.seq:
                self._preempt(req)
                return False
            self._preempt(victim)

    def _preempt(self, req: Request) -> None:
        """Free `req`'s KV; it is recomputed (prompt and produced tokens as one prefill) when blocks allow."""
        self.preemptions += 1
        self._drop_kv(req)
        req.pending = [*req.prompt, *req.output]

    def _send_run(self, batch: list[tuple[Request, int]]) -> None:
        mb, self.batches = self.batches, self.batches + 1
        path = batch[0][0].path
        steps = [(r, n, n == len(r.pending)) for r, n in batch]
        reqs = [{"rid": r.rid, "n": n, "start": r.position, "sample": sample} for r, n, sample in steps]
        histories: dict[str, dict[str, list[int]]] = {}  # penalised requests' token histories, to the last node
        for q, (r, _, sample) in zip(reqs, steps, strict=True):
            self._unwait(r)
            if sample:
                q["sp"] = r.sampling.step(len(r.output), r.stop_ids)
                if r.sampling.penalized and not r.history_sent:
                    histories[r.rid] = history_wire(r.prompt, r.output)
                    r.history_sent = True
        logits = any(r.want_logits and sample for r, _, sample in steps)
        for k, rank in enumerate(path):
            msg: dict[str, Any] = {
                "op": "run", "mb": mb, "reqs": reqs, "logits": logits,
                "src": path[k - 1] if k else None, "dst": path[k + 1] if k + 1 < len(path) else None,
            }
            if k == 0:
                msg["reqs"] = [{**q, "tokens": r.pending[:n]} for q, (r, n, _) in zip(reqs, steps, strict=True)]
            if k == len(path) - 1 and histories:
                msg["reqs"] = [{**q, "sp": {**q["sp"], "hist": histories[q["rid"]]}} if q["rid"] in histories else q
                               for q in msg["reqs"]]
            self.cmd[rank].send_json(msg)
        for r, _, _ in steps:
            r.busy = True
        self.flight[mb] = steps

    def _on_result(self, frames: list[bytes]) -> None:
        msg = json.loads(frames[0])
        kind = msg["kind"]
        if kind == "ready":
            rank = int(msg["rank"])
            sock = self.cmd[rank] = self.ctx.socket(zmq.PUSH)
            sock.connect(msg["cmd"])
            self.kv_addr[rank] = msg["kv"]
            self.capacity[rank] = self.free[rank] = int(msg["blocks"])
            self.block_size = int(msg["block_size"])
            if len(self.cmd) == len(self.layout.nodes):
                self.ready.set()
        elif kind == "pulled":
            req = self.active.get(msg["rid"])
            if req is not None:
                self._on_pulled(req, int(msg["rank"]), bool(msg["ok"]))
        elif kind == "released":
            held = self.kept.get(msg["rid"], {})
            self.free[int(msg["rank"])] += held.pop(int(msg["rank"]), 0)
            if not held:
                self.kept.pop(msg["rid"], None)
        elif kind == "error":
            self._fail(f"node {msg['rank']}: {msg['message']}")
        elif kind == "tokens":
            steps = self.flight.pop(msg["mb"])
            logits = frames_tensors(frames[1:])[0].tolist() if len(frames) > 1 else None
            sampled = iter(enumerate(msg["tokens"]))
            for req, n, sample in steps:
                req.position += n
                req.pending = req.pending[n:]
                req.busy = False
                i, raw = next(sampled) if sample else (-1, None)
                if req.cancelled:
                    self._finish(req)
                elif raw is not None:
                    self._emit(req, Sampled.of_wire(raw), logits[i] if logits is not None and req.want_logits else None)

    def _fail(self, message: str) -> None:
        """A node failed: the instance is broken; every request ends with an error."""
        self.error = message
        for req in list(self.active.values()):
            self._unwait(req)
            req.on_event(None, "error", None)
        self.active.clear()
        self.flight.clear()

    def _shutdown(self) -> None:
        with self.wake_lock:
            self.closed = True
        while not self.inbox.empty():  # submitted after the stop: never admitted
            kind, item = self.inbox.get_nowait()
            if kind == "submit":
                self._unwait(item)
                item.on_event(None, "abort", None)
        for sock in self.cmd.values():
            sock.send_json({"op": "stop"})
        for req in list(self.active.values()):
            self._unwait(req)
            req.on_event(None, "abort", None)
        self.active.clear()
        for sock in [*self.cmd.values(), self.results, self.wake_in, self.wake_out]:
            sock.close(linger=500)


def _has_port(endpoint: str) -> bool:
    """Whether a 'tcp://HOST[:PORT]' endpoint names its port (HOST may be a bracketed IPv6 address)."""
    rest = endpoint.removeprefix("tcp://")
    return "]:" in rest if rest.startswith("[") else ":" in rest
