"""One pipeline node: a process (or, in tests, a thread) holding one shard, driven by the instance scheduler.

Channels:
- control, ZeroMQ: the node binds a PULL socket for the scheduler's commands (`run` a micro-batch, `free` or
  `keep` requests' KV, `pull` KV from a prefill instance, `stop`) and PUSHes results (`ready` with the size of
  its KV pool, sampled tokens, `released` KV that was kept for hand-off, errors) to the scheduler;
- activations, torch.distributed P2P (`coral.engine.transport`), tagged by micro-batch;
- KV hand-off, ZeroMQ: the node binds a ROUTER socket serving `take` requests from decode nodes of another
  instance (a separate process group, so not reachable by P2P): the layers asked for are removed from the
  shard and sent as raw frames. KV kept for hand-off and never taken is dropped after `kv_ttl_s`.

A decode node's `pull` never blocks its command loop (`Pulls`): it sends its `take` requests (a DEALER socket
per prefill node, every ask at once) and goes on running micro-batches; the answers are matched to their pull
as they arrive, and a pull whose layers have all come is imported, at most one per command handled, so the
work between two decode steps grows by one request's KV copy at most, however many requests arrive at once. A
prefill node answers takes only between its own micro-batches (a 4,096-token prefill chunk can take over a
second on a CPU): a decode node that waited for that answer (as it once did: a blocking REQ per pull, in
command order) delivered no token to any of its streams meanwhile, and each pull queued before a decode step
added another such wait (measured under `benchmarks/engine_load.py`: pulls of 1.0-1.7 s, and 6.2 s without a
decode step, so the gateway cut streams as stalled). A pull not answered within `kv_pull_timeout_s` fails
(the scheduler prefills the request locally); late answers are dropped.

The node's KV pool (`kv_cache_gib`, a `kv_cache_fraction` of the free device memory, or `kv_blocks` blocks of
`kv_block_size` tokens) is preallocated when the shard loads; the scheduler keeps the accounting of its blocks
(it admits and preempts by it), so a `run` always finds its blocks free.

Commands are handled one at a time in arrival order; the scheduler sends each micro-batch to all its nodes at
dispatch, so every node sees micro-batches in the same global order and the pipeline cannot deadlock.

A node of tensor-parallel degree t is t processes (its own torch.distributed group): the leader (TP rank 0)
owns the channels above and mirrors each command to the followers (`broadcast_object_list`), with the input
activations; all run the shard's layers together (the row-parallel projections all-reduce). KV handed off
leaves and arrives with all heads: the leader gathers the followers' heads on export and scatters on import, so
prefill and decode nodes of different TP degrees exchange KV.

Run one node: `python -m coral.engine.node '<NodeConfig JSON>'` (how `CoralInstance` starts them).
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import zmq

from coral.engine.launch import NodeConfig, serve_plan_node
from coral.engine.sampling import Histories, sample
from coral.engine.shard import KV, Shard, Step
from coral.engine.transport import (
    DistTransport,
    LocalHub,
    LocalTransport,
    Transport,
    advertised,
    frames_tensors,
    tensor_frames,
)


class Node:
    def __init__(self, cfg: NodeConfig, transport: Transport, ctx: zmq.Context[Any], tp_group: Any = None) -> None:
        self.cfg = cfg
        self.transport = transport
        self.tp_group = tp_group
        self.leader_process = self.process(cfg.rank)
        self.shard = Shard(cfg.checkpoint, cfg.first, cfg.last, cfg.device, tp_group, cfg.kv_cache_gib,
                           cfg.kv_block_size, cfg.kv_blocks, cfg.kv_cache_fraction)
        self.hidden = int(self.shard.config.hidden_size)
        self.ctx = ctx
        self.histories = Histories()  # last stage: the token history of each penalised request (its leader samples)
        if self.shard.tp_rank:
            return  # a follower: no channels of its own
        self.cmd = ctx.socket(zmq.PULL)
        self.kv_server = ctx.socket(zmq.ROUTER)
        if cfg.bind == "inproc":
            self.cmd.bind(f"inproc://{cfg.instance_id}/{cfg.rank}/cmd")
            self.kv_server.bind(f"inproc://{cfg.instance_id}/{cfg.rank}/kv")
        else:
            self.cmd.bind_to_random_port(cfg.bind)
            self.kv_server.bind_to_random_port(cfg.bind)
        self.out = ctx.socket(zmq.PUSH)
        self.out.connect(cfg.results)
        self.kept: dict[str, float] = {}  # request id -> when its KV was kept for hand-off
        self.pulls = Pulls(ctx, cfg.kv_pull_timeout_s)

    def process(self, node_rank: int) -> int:
        """The process rank of a node's leader (for P2P)."""
        return self.cfg.leaders[node_rank] if self.cfg.leaders else node_rank

    def _mirror(self, msg: dict[str, Any], payload: Any = None, has_payload: bool = False) -> None:
        """Leader: hand a command (and an object with it) to the followers."""
        if self.tp_group is not None:
            dist.broadcast_object_list([msg], src=self.leader_process, group=self.tp_group)
            if has_payload:
                dist.broadcast_object_list([payload], src=self.leader_process, group=self.tp_group)

    def _receive(self) -> Any:
        """Follower: the next object from the leader."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=self.leader_process, group=self.tp_group)
        return box[0]

    def follow(self) -> None:
        """A tensor-parallel follower: run what the leader mirrors until `stop`."""
        try:
            while True:
                msg = self._receive()
                op = msg["op"]
                if op == "run":
                    self._run(msg)
                elif op == "free":
                    for rid in msg["rids"]:
                        self.shard.free(rid)
                elif op == "export":
                    self._export(msg["rid"], msg["first"], msg["last"])
                elif op == "import":
                    kv = self._receive()
                    if msg["ok"]:
                        self.shard.import_kv(msg["rid"], kv)
                elif op == "stop":
                    return
        finally:
            self.transport.close()

    def endpoint(self, sock: zmq.Socket[Any]) -> str:
        host = self.cfg.advertise
        if not host and self.cfg.bind == "tcp://0.0.0.0":
            host = socket.gethostbyname(socket.gethostname())
        return advertised(sock.getsockopt_string(zmq.LAST_ENDPOINT), host)

    def serve(self) -> None:
        """Announce the node, then handle commands and KV requests until `stop`."""
        self.out.send_json({"kind": "ready", "rank": self.cfg.rank, "cmd": self.endpoint(self.cmd),
                            "kv": self.endpoint(self.kv_server), "blocks": self.shard.pool.blocks,
                            "block_size": self.shard.pool.block_size})
        poller = zmq.Poller()
        poller.register(self.cmd, zmq.POLLIN)
        poller.register(self.kv_server, zmq.POLLIN)
        try:
            while True:
                self.pulls.register(poller)
                events = dict(poller.poll(self.pulls.wait_ms(1000)))
                self._expire_kept()
                if self.kv_server in events:
                    self._serve_take()
                self.pulls.receive(events)
                for rid in self.pulls.expire():
                    self._pulled(rid, {}, False)
                if (landed := self.pulls.landed()) is not None:  # one import per command at most
                    self._pulled(*landed)
                if self.cmd in events and not self._handle(self.cmd.recv_json()):
                    break
        except Exception:  # report, then die: the instance is broken (downstream nodes would wait forever)
            self.out.send_json({"kind": "error", "rank": self.cfg.rank, "message": traceback.format_exc()})
            raise
        finally:
            self.close()

    def close(self) -> None:
        for sock in [self.cmd, self.kv_server, self.out]:
            sock.close(linger=100)
        self.pulls.close()
        self.transport.close()

    def _handle(self, msg: dict[str, Any]) -> bool:
        op = msg["op"]
        if op in ("run", "free", "stop"):
            self._mirror(msg)
        if op == "run":
            self._run(msg)
        elif op == "free":
            for rid in msg["rids"]:
                self.shard.free(rid)
                self.pulls.drop(rid)
                self.histories.drop(rid)
        elif op == "keep":
            now = time.monotonic()
            self.kept.update(dict.fromkeys(msg["rids"], now))
            for rid in msg["rids"]:
                self.histories.drop(rid)
        elif op == "pull":
            if self.pulls.start(msg, self.shard.first, self.shard.last) is not None:  # no source for some layer
                self._pulled(msg["rid"], {}, False)
        elif op == "stop":
            return False
        return True

    def _run(self, msg: dict[str, Any]) -> None:
        """One micro-batch, all its requests' new tokens as one flattened batch through the shard; hidden
        states to the next stage, or from the last stage the tokens sampled for the sampled steps (each with its
        step's parameters, `coral.engine.sampling`; and the logits if asked) to the scheduler."""
        reqs, mb = msg["reqs"], msg["mb"]
        steps = [Step(r["rid"], r["start"], r["n"], r["sample"]) for r in reqs]
        if self.shard.is_first:
            x = torch.tensor([t for r in reqs for t in r["tokens"]], dtype=torch.long)
        else:
            shape = (sum(s.n for s in steps), self.hidden)
            if self.shard.tp_rank:
                x = torch.empty(shape, dtype=self.shard.dtype, device=self.shard.device)
            else:
                x = self.transport.recv(shape, self.shard.dtype, self.process(msg["src"]), mb)
            if self.tp_group is not None:
                dist.broadcast(x, src=self.leader_process, group=self.tp_group)
        out = self.shard.forward_batch(steps, x)
        if self.shard.tp_rank:
            return  # the leader sends the result on
        if not self.shard.is_last:
            self.transport.send(out, self.process(msg["dst"]), mb)
            return
        sampled = [r for r in reqs if r["sample"]]
        steps_sp = [r["sp"] for r in sampled]
        histories = self.histories.rows([r["rid"] for r in sampled], steps_sp, out.device)
        chosen = sample(out, steps_sp, histories)
        self.histories.record(histories, chosen)
        tokens = [s.wire() for s in chosen]
        header = json.dumps({"kind": "tokens", "mb": mb, "tokens": tokens}).encode()
        if msg.get("logits"):
            self.out.send_multipart([header, *tensor_frames([out])])
        else:
            self.out.send_multipart([header])

    def _released(self, rid: str) -> None:
        """Tell the scheduler that KV kept for hand-off is gone (taken or expired): its blocks are free."""
        self.kept.pop(rid, None)
        self.out.send_json({"kind": "released", "rank": self.cfg.rank, "rid": rid})

    def _expire_kept(self) -> None:
        cutoff = time.monotonic() - self.cfg.kv_ttl_s
        expired = [r for r, t in self.kept.items() if t < cutoff]
        if expired:
            self._handle({"op": "free", "rids": expired})
        for rid in expired:
            self._released(rid)

    def _serve_take(self) -> None:
        """Answer every waiting `take` {rid, first, last}: the layers' KV, removed from this node."""
        while True:
            try:
                ident, empty, raw = self.kv_server.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ask = json.loads(raw)
            ask = {"rid": ask["rid"], "first": ask["first"], "last": ask["last"]}  # echoed: the answer's key
            self._mirror({"op": "export", **ask})
            layers = self._export(ask["rid"], ask["first"], ask["last"])
            if layers is None:
                error = f"request {ask['rid']}: no KV on layers [{self.shard.first}, {self.shard.last})"
                self.kv_server.send_multipart([ident, empty, json.dumps({**ask, "error": error}).encode()])
                continue
            if not self.shard.holds(ask["rid"]):
                self._released(ask["rid"])
            order = sorted(layers)
            tensors = [t for i in order for t in layers[i]]
            self.kv_server.send_multipart(
                [ident, empty, json.dumps({**ask, "layers": order}).encode(), *tensor_frames(tensors)]
            )

    def _export(self, rid: str, first: int, last: int) -> dict[int, KV] | None:
        """Remove and return the KV of layers [first, last) of `rid`, all heads (gathered on the leader; None
        there if some rank has none)."""
        try:
            mine: dict[int, KV] | None = self.shard.export_kv(rid, first, last)
        except KeyError:
            mine = None
        if self.tp_group is None:
            return mine
        parts: list[Any] | None = [None] * self.shard.tp_size if not self.shard.tp_rank else None
        dist.gather_object(mine, parts, dst=self.leader_process, group=self.tp_group)
        if parts is None or any(p is None for p in parts):
            return None
        return {i: (torch.cat([p[i][0] for p in parts], 1), torch.cat([p[i][1] for p in parts], 1))
                for i in parts[0]}

    def _pulled(self, rid: str, kv: dict[int, KV], ok: bool) -> None:
        """Install a pulled request's KV (on every TP rank) and tell the scheduler whether the pull worked (if
        not, it prefills the request here instead)."""
        self._mirror({"op": "import", "rid": rid, "ok": ok}, kv, has_payload=True)
        if ok:
            self.shard.import_kv(rid, kv)
        self.out.send_json({"kind": "pulled", "rank": self.cfg.rank, "rid": rid, "ok": ok})


@dataclass
class Pull:
    """One request's KV being taken from a prefill instance: the asks not answered yet, what came."""

    rid: str
    deadline: float  # time.monotonic()
    asks: set[tuple[str, int, int]]  # (prefill node's KV address, first layer, last layer) not answered yet
    frames: list[tuple[dict[str, Any], list[bytes]]] = field(default_factory=list)  # answers: header, tensors
    failed: bool = False


class Pulls:
    """A decode node's KV pulls in flight, none blocking its command loop: `start` sends a pull's takes (one per
    prefill node holding some of its layers, all at once, on a DEALER socket per prefill node); `receive` files
    the answers that came, matched by (remote request, first, last), which the prefill node echoes; `landed`
    gives the next pull whose answers are all in (its KV decoded), one at a time, so the caller bounds the work
    done between two of its commands; `expire` gives the pulls past their deadline (a prefill node that did not
    answer in time; its late answers are dropped)."""

    def __init__(self, ctx: zmq.Context[Any], timeout_s: float) -> None:
        self.ctx, self.timeout_s = ctx, timeout_s
        self.clients: dict[str, zmq.Socket[Any]] = {}  # prefill node KV address -> DEALER socket
        self.registered: set[zmq.Socket[Any]] = set()
        self.pending: dict[str, Pull] = {}  # request id (here) -> its pull
        self.waiting: dict[tuple[str, int, int], str] = {}  # (remote request, first, last) -> request id here
        self.done: deque[str] = deque()  # pulls whose answers are all in, in arrival order

    def start(self, msg: dict[str, Any], first: int, last: int) -> str | None:
        """Send the takes of layers [first, last) of `msg`'s request; why it cannot be pulled, or None."""
        rid, remote = msg["rid"], msg["remote_rid"]
        asks: set[tuple[str, int, int]] = set()
        covered: set[int] = set()
        for src in msg["sources"]:
            lo, hi = max(src["first"], first), min(src["last"], last)
            if lo < hi:
                asks.add((src["kv"], lo, hi))
                covered.update(range(lo, hi))
        if missing := set(range(first, last)) - covered:
            return f"KV of {remote}: no source for layers {sorted(missing)}"
        self.pending[rid] = Pull(rid, time.monotonic() + self.timeout_s, set(asks))
        for addr, lo, hi in asks:
            sock = self.clients.get(addr)
            if sock is None:
                sock = self.clients[addr] = self.ctx.socket(zmq.DEALER)
                sock.connect(addr)
            self.waiting[(remote, lo, hi)] = rid
            try:  # never wait here: a prefill node gone for long has a full queue
                sock.send_multipart([b"", json.dumps({"rid": remote, "first": lo, "last": hi}).encode()], zmq.NOBLOCK)
            except zmq.Again:
                self.drop(rid)
                return f"KV of {remote}: {addr} takes no more requests"
        return None

    def register(self, poller: zmq.Poller) -> None:
        for sock in self.clients.values():
            if sock not in self.registered:
                poller.register(sock, zmq.POLLIN)
                self.registered.add(sock)

    def wait_ms(self, longest: int) -> int:
        """How long the command loop may wait for events: not past the soonest pull deadline, not at all while
        a landed pull waits for its import."""
        if self.done:
            return 0
        soonest = min((p.deadline for p in self.pending.values()), default=None)
        if soonest is None:
            return longest
        return max(0, min(longest, math.ceil((soonest - time.monotonic()) * 1000)))

    def receive(self, events: dict[Any, int]) -> None:
        """File every answer that came (no decoding here: recv only)."""
        for addr, sock in self.clients.items():
            if sock not in events:
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                head = json.loads(frames[1])
                remote, lo, hi = str(head.get("rid")), int(head.get("first", -1)), int(head.get("last", -1))
                pull = self.pending.get(self.waiting.pop((remote, lo, hi), ""))
                if pull is None:
                    continue  # a pull that expired or was dropped
                pull.asks.discard((addr, lo, hi))
                if "error" in head:  # no KV there: the pull fails now, its other answers are dropped
                    pull.failed = True
                    self._forget(pull.rid)
                    pull.asks.clear()
                pull.frames.append((head, frames[2:]))
                if not pull.asks:
                    self.done.append(pull.rid)

    def landed(self) -> tuple[str, dict[int, KV], bool] | None:
        """The next pull whose answers are all in: (request id, its layers' KV, whether all came)."""
        while self.done:
            pull = self.pending.pop(self.done.popleft(), None)
            if pull is None:
                continue
            if pull.failed:
                return pull.rid, {}, False
            kv: dict[int, KV] = {}
            for head, frames in pull.frames:
                tensors = frames_tensors(frames)
                kv.update({i: (tensors[2 * j], tensors[2 * j + 1]) for j, i in enumerate(head["layers"])})
            return pull.rid, kv, True
        return None

    def expire(self) -> list[str]:
        """The pulls past their deadline (forgotten: their answers, if they come, are dropped)."""
        now = time.monotonic()
        gone = [rid for rid, p in self.pending.items() if p.deadline <= now and p.asks]
        for rid in gone:
            self.drop(rid)
        return gone

    def drop(self, rid: str) -> None:
        """Forget `rid`'s pull (its KV is freed, or it expired)."""
        if self.pending.pop(rid, None) is not None:
            self._forget(rid)

    def _forget(self, rid: str) -> None:
        """Drop the answers still awaited for `rid`'s pull when they come."""
        for key in [k for k, r in self.waiting.items() if r == rid]:
            del self.waiting[key]

    def close(self) -> None:
        for sock in self.clients.values():
            sock.close(linger=0)


def serve_local(cfg: NodeConfig, hub: LocalHub, ctx: zmq.Context[Any]) -> None:
    """A node as a thread of the instance's process (`EngineConfig.local`), its activations through `hub`."""
    Node(cfg, LocalTransport(hub, cfg.rank), ctx).serve()


def _exit_when_orphaned(parent_pid: int) -> None:
    """Exit as soon as the owner `parent_pid` is gone, even while the node waits on a receive from a dead peer."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


def main(argv: list[str] | None = None) -> None:
    """Entry point of a node process: `python -m coral.engine.node '<NodeConfig JSON>'`; with `--plan`, start
    the processes of one node of a plan instance on this machine (`coral.engine.launch.serve_plan_node`)."""
    args = argv if argv is not None else sys.argv[1:]
    if args and not args[0].lstrip().startswith("{"):
        serve_plan_node(args)
        return
    cfg = NodeConfig(**json.loads(args[0]))
    if cfg.parent_pid:
        threading.Thread(target=_exit_when_orphaned, args=(cfg.parent_pid,), daemon=True).start()
    torch.set_num_threads(cfg.threads)
    process = cfg.process_rank if cfg.process_rank >= 0 else cfg.rank
    transport = DistTransport(cfg.dist_backend, cfg.dist_init, process, cfg.world_size, cfg.device)
    tp_group = None
    for ranks in cfg.tp_groups:  # every process creates every group, in the same order
        group = dist.new_group(ranks)
        if process in ranks:
            tp_group = group
    ctx: zmq.Context[Any] = zmq.Context()
    node = Node(cfg, transport, ctx, tp_group)
    if node.shard.tp_rank:
        node.follow()
    else:
        node.serve()
    ctx.term()


if __name__ == "__main__":
    main()
