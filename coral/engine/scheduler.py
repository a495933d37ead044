"""The instance scheduler: admission, path choice, micro-batching and token streaming for one instance.

A request gets a path (one node per stage) at admission by smooth weighted round-robin over each stage's nodes,
weighted by the placement's per-node throughput, and keeps it while its KV lives there. Requests that are not
waiting on a step form micro-batches of requests sharing a path (continuous batching: prefills and decode steps
of different lengths together, up to `max_batch` requests and `max_batch_tokens` new tokens); up to
`max_inflight` micro-batches flow down the pipeline at once. The last stage samples greedily (argmax) and
returns the tokens here, which hands them to each request's callback.

All ZeroMQ sockets are owned by the scheduler thread; other threads talk to it through `submit`/`cancel`.
"""

from __future__ import annotations

import json
import queue
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from coral.engine.layout import Layout
from coral.engine.transport import frames_tensors

# (token or None, finish reason or None, logits of the step if asked) -> None; called on the scheduler thread
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
    want_logits: bool = False
    keep_kv: bool = False  # PD prefill: leave the KV on the nodes for a decode instance to take
    remote: dict[str, Any] | None = None  # PD decode: {request_id, prompt_tokens, first_token, sources}
    path: tuple[int, ...] = ()
    position: int = 0  # tokens whose KV is on the path
    pending: list[int] = field(default_factory=list)  # the next step's input tokens
    output: list[int] = field(default_factory=list)
    busy: bool = False
    cancelled: bool = False
    pulls: dict[int, bool] = field(default_factory=dict)  # PD decode: rank -> took its layers' KV


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
        """`results_bind`: 'tcp://HOST' (port chosen by the OS) or an 'inproc://NAME' address."""
        self.layout = layout
        self.ctx = ctx
        self.max_batch, self.max_batch_tokens = max_batch, max_batch_tokens
        widest = max(len(s) for s in layout.stages)
        self.max_inflight = max_inflight or len(layout.stages) * widest
        self.results = ctx.socket(zmq.PULL)
        if results_bind.startswith("inproc://"):
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
        self.flight: dict[int, list[Request]] = {}
        self.batches = 0  # micro-batches dispatched (also the next micro-batch id)
        self.remote_prefills = 0  # requests admitted with their KV taken from a prefill instance
        self.thread = threading.Thread(target=self._loop, name=f"coral-sched-{layout.instance_id}", daemon=True)

    # --- other threads ----------------------------------------------------------------------------------
    def start(self) -> Scheduler:
        self.thread.start()
        return self

    def submit(self, request: Request) -> None:
        self._post("submit", request)

    def cancel(self, rid: str) -> None:
        self._post("cancel", rid)

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
                events = dict(poller.poll())
                if self.wake_in in events:
                    while self.wake_in.poll(0):
                        self.wake_in.recv()
                    running = self._drain_inbox()
                if self.results in events:
                    while self.results.poll(0):
                        self._on_result(self.results.recv_multipart())
                if running and self.ready.is_set() and self.error is None:
                    self._dispatch()
        finally:
            self._shutdown()

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
            elif kind == "cancel":
                req = self.active.get(item)
                if req is not None:
                    req.cancelled = True
                    if not req.busy:
                        self._finish(req)

    def _admit(self, req: Request) -> None:
        if self.error is not None:
            req.on_event(None, "error", None)
            return
        req.path = tuple(stage[w.pick()].rank for stage, w in zip(self.layout.stages, self.wrr, strict=True))
        self.active[req.rid] = req
        if req.remote is None:
            req.pending = list(req.prompt)
            return
        req.busy = True  # until every node of the path has its layers' KV
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
            self._emit(req, int(req.remote["first_token"]), None)
        else:
            for rank_ in req.path:
                self.cmd[rank_].send_json({"op": "free", "rids": [req.rid]})
            req.position, req.pending = 0, list(req.prompt)

    def _emit(self, req: Request, token: int, logits: list[float] | None) -> None:
        """A new token of `req`: hand it on, then finish the request or queue its next step."""
        req.output.append(token)
        finish = "stop" if token in req.stop_ids else "length" if len(req.output) >= req.max_tokens else None
        req.on_event(token, finish, logits)
        if finish is not None:
            self._finish(req)
        else:
            req.pending = [token]

    def _finish(self, req: Request) -> None:
        self.active.pop(req.rid, None)
        if req.cancelled:
            req.on_event(None, "abort", None)
        msg = {"op": "keep" if req.keep_kv and not req.cancelled else "free", "rids": [req.rid]}
        for rank in req.path:
            self.cmd[rank].send_json(msg)

    def _dispatch(self) -> None:
        """Send micro-batches while fewer than `max_inflight` are in flight: the oldest ready request's path,
        at most 1/stages of the requests on that path (so the path's requests form enough micro-batches to
        fill its pipeline), within `max_batch` requests and `max_batch_tokens` new tokens each."""
        while len(self.flight) < self.max_inflight:
            ready = [r for r in self.active.values() if not r.busy]
            if not ready:
                return
            path = ready[0].path
            on_path = sum(r.path == path for r in self.active.values())
            limit = min(self.max_batch, -(-on_path // len(path)))
            batch, tokens = list[Request](), 0
            for r in (r for r in ready if r.path == path):
                if batch and (len(batch) >= limit or tokens + len(r.pending) > self.max_batch_tokens):
                    break
                batch.append(r)
                tokens += len(r.pending)
            self._send_run(batch)

    def _send_run(self, batch: list[Request]) -> None:
        mb, self.batches = self.batches, self.batches + 1
        path = batch[0].path
        reqs = [{"rid": r.rid, "n": len(r.pending), "start": r.position} for r in batch]
        logits = any(r.want_logits for r in batch)
        for k, rank in enumerate(path):
            msg: dict[str, Any] = {
                "op": "run", "mb": mb, "reqs": reqs, "logits": logits,
                "src": path[k - 1] if k else None, "dst": path[k + 1] if k + 1 < len(path) else None,
            }
            if k == 0:
                msg["reqs"] = [{**q, "tokens": r.pending} for q, r in zip(reqs, batch, strict=True)]
            self.cmd[rank].send_json(msg)
        for r in batch:
            r.busy = True
        self.flight[mb] = batch

    def _on_result(self, frames: list[bytes]) -> None:
        msg = json.loads(frames[0])
        kind = msg["kind"]
        if kind == "ready":
            sock = self.cmd[msg["rank"]] = self.ctx.socket(zmq.PUSH)
            sock.connect(msg["cmd"])
            self.kv_addr[msg["rank"]] = msg["kv"]
            if len(self.cmd) == len(self.layout.nodes):
                self.ready.set()
        elif kind == "pulled":
            req = self.active.get(msg["rid"])
            if req is not None:
                self._on_pulled(req, int(msg["rank"]), bool(msg["ok"]))
        elif kind == "error":
            self._fail(f"node {msg['rank']}: {msg['message']}")
        elif kind == "tokens":
            batch = self.flight.pop(msg["mb"])
            logits = frames_tensors(frames[1:])[0].tolist() if len(frames) > 1 else None
            for i, (req, token) in enumerate(zip(batch, msg["tokens"], strict=True)):
                req.position += len(req.pending)
                req.busy = False
                if req.cancelled:
                    self._finish(req)
                else:
                    self._emit(req, int(token), logits[i] if logits is not None and req.want_logits else None)

    def _fail(self, message: str) -> None:
        """A node failed: the instance is broken; every request ends with an error."""
        self.error = message
        for req in list(self.active.values()):
            req.on_event(None, "error", None)
        self.active.clear()
        self.flight.clear()

    def _shutdown(self) -> None:
        with self.wake_lock:
            self.closed = True
        while not self.inbox.empty():  # submitted after the stop: never admitted
            kind, item = self.inbox.get_nowait()
            if kind == "submit":
                item.on_event(None, "abort", None)
        for sock in self.cmd.values():
            sock.send_json({"op": "stop"})
        for req in list(self.active.values()):
            req.on_event(None, "abort", None)
        self.active.clear()
        for sock in [*self.cmd.values(), self.results, self.wake_in, self.wake_out]:
            sock.close(linger=500)
