"""Start, serve and stop one Coral engine instance: its node processes, scheduler and HTTP server.

`CoralInstance.from_plan(plan_instance, checkpoint).start()` maps the instance's stages onto the checkpoint's
layers (`Layout.from_plan`), starts one process per node and TP rank (`python -m coral.engine.node`; a node
of config '2xA10G' is a tensor-parallel pair), all in one torch.distributed process group initialised through
a file in a temporary directory (or `EngineConfig.dist_init` across machines), waits until every node has
loaded its shard, and serves the OpenAI API on `url`. With `EngineConfig(local=True)` the nodes are threads of
this process exchanging activations through queues (same node and scheduler code, no TP; for tests).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import zmq

from coral.allocation.plan import PlanInstance
from coral.engine.launch import NodeConfig, on_machine, spawn_node
from coral.engine.layout import Layout, NodeSlot
from coral.engine.node import Node
from coral.engine.scheduler import Scheduler
from coral.engine.shard import checkpoint_layers
from coral.engine.transport import LocalHub, LocalTransport, advertised


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"  # 'cpu', or 'cuda': process of rank r on cuda:r (one machine, a GPU per process)
    dist_backend: str = "gloo"  # 'nccl' with CUDA devices
    dist_init: str = ""  # torch.distributed init_method; empty: a file in a temporary directory (one machine)
    host: str = "127.0.0.1"  # address the scheduler, the nodes and the HTTP server bind to
    results_port: int = 0  # port of the scheduler's results socket (0: one the OS picks; nodes started elsewhere
    # from the plan, `python -m coral.engine.node --plan`, need a fixed one)
    advertise: str = ""  # address other machines reach this one by, when `host` is 0.0.0.0
    launch: bool = True  # start the node processes here; False: they are started elsewhere (`node_commands`)
    threads_per_node: int = 1
    max_batch: int = 32  # sequences per micro-batch
    max_batch_tokens: int = 4096  # new tokens per micro-batch (decode steps first, prefills chunked to the rest)
    kv_cache_gib: float = 0.25  # KV pool preallocated by each node process
    kv_block_size: int = 16  # tokens per KV block
    kv_blocks: int = 0  # KV blocks per node process (0: as many as fit in the budget)
    kv_cache_fraction: float = 0.0  # > 0: each node's KV budget is this fraction of its device's free memory
    max_inflight: int | None = None  # default: stages x widest stage
    start_timeout_s: float = 180.0
    kv_ttl_s: float = 120.0
    local: bool = False  # nodes as threads of this process (tests)
    http: bool = True  # serve the OpenAI API (False: drive `scheduler` directly)
    port: int = 0  # HTTP port (0: a free one)
    tensor_parallel: bool = True  # a node of TP degree t runs as t processes (1 when `local`; see `node_tp`)
    api_key: str | None = field(default=None, repr=False)  # the gateway's engine token: `/v1/*` needs it


class CoralInstance:
    def __init__(self, layout: Layout, checkpoint: str | Path, config: EngineConfig | None = None,
                 log_dir: Path | None = None) -> None:
        self.layout = layout
        self.checkpoint = str(checkpoint)
        self.config = config or EngineConfig()
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.threads: list[threading.Thread] = []
        # local instances share the process's context, so their inproc KV addresses reach each other (PD)
        self.ctx: zmq.Context[Any] = zmq.Context.instance() if self.config.local else zmq.Context()
        self.scheduler: Scheduler | None = None
        self.server: Any = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._name = ""
        self.tp = [self.node_tp(n.tp) for n in layout.nodes]
        leaders = [sum(self.tp[:r]) for r in range(len(self.tp))]
        # (node, TP rank) of each process, by process rank; the leader (TP rank 0) of node r has rank leaders[r]
        self.processes = [(n, t) for n in layout.nodes for t in range(self.tp[n.rank])]
        self.leaders = leaders
        self.tp_groups = [list(range(a, a + t)) for a, t in zip(leaders, self.tp, strict=True) if t > 1]

    def node_tp(self, planned: int) -> int:
        """Processes of a node of TP degree `planned`: the largest degree <= it that divides the model's
        attention heads, KV heads and MLP width (the tiny model has 2 KV heads); 1 for thread nodes."""
        if self.config.local or not self.config.tensor_parallel:
            return 1
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(self.checkpoint)
        dims = (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size)
        return max(t for t in range(1, planned + 1) if all(d % t == 0 for d in dims))

    @classmethod
    def from_plan(cls, instance: PlanInstance, checkpoint: str | Path, config: EngineConfig | None = None,
                  log_dir: Path | None = None) -> CoralInstance:
        """The plan instance's stages over the checkpoint's layers (split scaled, see `coral.engine.layout`)."""
        return cls(Layout.from_plan(instance, checkpoint_layers(checkpoint)), checkpoint, config, log_dir)

    @property
    def url(self) -> str:
        if self.server is None:
            raise RuntimeError(f"{self.layout.instance_id}: not serving HTTP")
        return str(self.server.url)

    def open(self) -> list[NodeConfig]:
        """Start the scheduler (idempotent); the configuration of each node, by rank."""
        cfg = self.config
        if self.scheduler is None:
            if not cfg.local and not cfg.launch and not cfg.dist_init:
                raise ValueError("dist_init: nodes started elsewhere need a 'tcp://HOST:PORT' rendezvous")
            self._name = f"{self.layout.instance_id}-{uuid.uuid4().hex[:8]}"
            results = f"inproc://{self._name}/results" if cfg.local else f"tcp://{cfg.host}"
            if cfg.results_port and not cfg.local:
                results += f":{cfg.results_port}"
            self.scheduler = Scheduler(self.layout, self.ctx, results, cfg.max_batch, cfg.max_batch_tokens,
                                       cfg.max_inflight).start()
            if not cfg.local and not cfg.dist_init:
                self._tmp = tempfile.TemporaryDirectory(prefix="coral-engine-")
        return self.node_configs(advertised(self.scheduler.results_addr, cfg.advertise))

    def node_configs(self, results: str) -> list[NodeConfig]:
        """The configuration of each node process, by process rank, for a scheduler whose results socket is
        `results` (also called, without a scheduler here, by nodes started from the plan on their machines)."""
        return [self._node_config(n, p, results) for p, (n, _) in enumerate(self.processes)]

    def node_commands(self) -> list[list[str]]:
        """argv of each process, by process rank (run them on the nodes' machines when `launch` is False)."""
        return [["python", "-m", "coral.engine.node", c.to_json()] for c in self.open()]

    def start(self) -> CoralInstance:
        """Start the scheduler and (with `launch`) the nodes, wait until every node is ready, serve HTTP."""
        try:
            nodes = self.open()
            if self.config.launch:
                self._start_nodes(nodes)
            self._wait_ready()
            if self.config.http:
                self._serve_http()
        except BaseException:
            self.stop()
            raise
        return self

    def _node_config(self, node: NodeSlot, process: int, results: str) -> NodeConfig:
        cfg = self.config
        device = f"cuda:{process}" if cfg.device == "cuda" else cfg.device
        dist_init = cfg.dist_init or (f"file://{self._tmp.name}/dist-store" if self._tmp is not None else "")
        return NodeConfig(
            instance_id=self._name, rank=node.rank, world_size=len(self.processes), first=node.first,
            last=node.last, process_rank=process, leaders=self.leaders, tp_groups=self.tp_groups,
            checkpoint=self.checkpoint, results=results,
            bind="inproc" if cfg.local else f"tcp://{cfg.host}", advertise=cfg.advertise if cfg.launch else "",
            device=device,
            dist_backend=cfg.dist_backend, dist_init=dist_init, threads=cfg.threads_per_node,
            kv_ttl_s=cfg.kv_ttl_s, kv_cache_gib=cfg.kv_cache_gib, kv_block_size=cfg.kv_block_size,
            kv_blocks=cfg.kv_blocks, kv_cache_fraction=cfg.kv_cache_fraction,
            parent_pid=os.getpid() if cfg.launch and not cfg.local else 0,
        )

    def _start_nodes(self, nodes: list[NodeConfig]) -> None:
        if self.config.local:
            hub = LocalHub()
            for ncfg in nodes:
                t = threading.Thread(target=_serve_local, args=(ncfg, hub, self.ctx), daemon=True,
                                     name=f"coral-node-{ncfg.instance_id}-{ncfg.rank}")
                t.start()
                self.threads.append(t)
            return
        self.procs += [spawn_node(ncfg, self.log_dir, self.layout.instance_id) for ncfg in nodes]

    def _wait_ready(self) -> None:
        assert self.scheduler is not None
        deadline = time.monotonic() + self.config.start_timeout_s
        while not self.scheduler.ready.wait(0.1):
            dead = [p.args for p in self.procs if p.poll() is not None]
            if self.scheduler.error or dead or not all(t.is_alive() for t in self.threads):
                raise RuntimeError(f"{self.layout.instance_id}: a node failed to start "
                                   f"({self.scheduler.error or 'process exited'}; logs: {self.log_dir})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.layout.instance_id}: nodes not ready within {self.config.start_timeout_s} s")

    def _serve_http(self) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from coral.engine.server import create_instance_app
        from coral.runtime.server import ServerThread

        assert self.scheduler is not None
        tokenizer = AutoTokenizer.from_pretrained(self.checkpoint)
        vocab = int(AutoConfig.from_pretrained(self.checkpoint).vocab_size)
        app = create_instance_app(self.scheduler, tokenizer, vocab, self.layout.model, self.layout.instance_id,
                                  self._nodes_alive, self.config.api_key)
        self.server = ServerThread(app, host=self.config.host, port=self.config.port).start()

    def _nodes_alive(self) -> bool:
        return all(p.poll() is None for p in self.procs) and all(t.is_alive() for t in self.threads)

    def alive(self) -> bool:
        sched = self.scheduler
        return (
            sched is not None and sched.thread.is_alive() and sched.error is None and self._nodes_alive()
            and (self.server is None or self.server.alive())
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving, stop the nodes (terminate those that do not exit), release everything."""
        if self.server is not None:
            self.server.stop()
        if self.scheduler is not None:
            self.scheduler.stop()
        for p in self.procs:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.terminate()
                try:
                    p.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for t in self.threads:
            t.join(timeout_s)
        if self._tmp is not None:
            self._tmp.cleanup()
        if not self.config.local:
            self.ctx.destroy(linger=0)


def _serve_local(cfg: NodeConfig, hub: LocalHub, ctx: zmq.Context[Any]) -> None:
    Node(cfg, LocalTransport(hub, cfg.rank), ctx).serve()


def main(argv: list[str] | None = None) -> None:
    """Serve one instance of a plan: `python -m coral.engine.instance PLAN.json INSTANCE_ID CHECKPOINT [...]`.
    With `--no-launch` it prints the command of each node (to run on the nodes' machines) and waits for them."""
    import argparse


    ap = argparse.ArgumentParser(prog="python -m coral.engine.instance", description=main.__doc__)
    ap.add_argument("plan", type=Path)
    ap.add_argument("instance_id")
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--advertise", default="", help="address of this machine as the nodes reach it")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--device", default="cpu", help="cpu | cuda (rank r on cuda:r) | cuda:N")
    ap.add_argument("--dist-backend", default="gloo", help="gloo | nccl")
    ap.add_argument("--dist-init", default="", help="tcp://HOST:PORT rendezvous (required with --no-launch)")
    ap.add_argument("--no-launch", action="store_true", help="nodes are started on other machines")
    ap.add_argument("--results-port", type=int, default=0,
                    help="fixed port of the scheduler's results socket (nodes started with --plan connect to it)")
    args = ap.parse_args(argv)
    planned = _plan_instance(args.plan, args.instance_id)
    config = EngineConfig(device=args.device, dist_backend=args.dist_backend, dist_init=args.dist_init,
                          host=args.host, advertise=args.advertise, port=args.port, launch=not args.no_launch,
                          results_port=args.results_port)
    inst = CoralInstance.from_plan(planned, args.checkpoint, config)
    if args.no_launch:
        for (node, tp_rank), argv_ in zip(inst.processes, inst.node_commands(), strict=True):
            print(f"# node {node.rank} ({node.config}, TP rank {tp_rank}): stage {node.stage}, "
                  f"layers [{node.first}, {node.last})")
            print(shlex.join(argv_))
    inst.start()
    print(f"serving {planned.id} on {inst.url}/v1", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        inst.stop()


def _plan_instance(path: Path, instance_id: str) -> PlanInstance:
    """Instance `instance_id` of the plan file `path` (SystemExit naming both when it has none)."""
    from coral.allocation.plan import Plan

    for inst in Plan.load(path).instances:
        if inst.id == instance_id:
            return inst
    raise SystemExit(f"{path}: no instance {instance_id!r}")


def serve_plan_node(argv: list[str]) -> None:
    """Start the processes of one node of a plan instance on this machine and wait for them:
    `python -m coral.engine.node --plan PLAN.json --instance ID --checkpoint DIR --node-rank R --scheduler
    tcp://HOST:PORT --dist-init tcp://HOST:PORT [--advertise ADDR]` (the scheduler runs `python -m
    coral.engine.instance ... --no-launch --results-port PORT`; the rendezvous is on node 0's machine)."""
    import argparse


    ap = argparse.ArgumentParser(prog="python -m coral.engine.node", description=serve_plan_node.__doc__)
    ap.add_argument("--plan", type=Path, required=True)
    ap.add_argument("--instance", required=True)
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--node-rank", type=int, required=True)
    ap.add_argument("--scheduler", required=True, help="the scheduler's results socket, tcp://HOST:PORT")
    ap.add_argument("--dist-init", required=True, help="torch.distributed rendezvous, tcp://HOST:PORT on node 0")
    ap.add_argument("--host", default="0.0.0.0", help="address this node's sockets bind to")
    ap.add_argument("--advertise", default="", help="address the scheduler and other nodes reach this one by")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (TP rank t on cuda:t)")
    ap.add_argument("--dist-backend", default="gloo", help="gloo | nccl")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--log-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    config = EngineConfig(device=args.device, dist_backend=args.dist_backend, dist_init=args.dist_init,
                          launch=False, threads_per_node=args.threads)
    inst = CoralInstance.from_plan(_plan_instance(args.plan, args.instance), args.checkpoint, config)
    mine = [c for c in inst.node_configs(args.scheduler) if c.rank == args.node_rank]
    if not mine:
        raise SystemExit(f"--node-rank {args.node_rank}: {args.instance} has nodes 0..{len(inst.layout.nodes) - 1}")
    procs = [spawn_node(replace(on_machine(c, args.host, args.advertise), parent_pid=os.getpid()), args.log_dir,
                        args.instance) for c in mine]
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
    raise SystemExit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
