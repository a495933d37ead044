"""How an instance's node processes are described (`EngineConfig`, `InstanceProcesses`, `NodeConfig`) and started
(`spawn_node`, `on_machine`, `serve_plan_node`), apart from the node itself: this module imports no torch at
import, so launchers such as Ray's node actors start fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from coral.allocation.plan import PlanInstance
    from coral.engine.layout import Layout, NodeSlot


@dataclass(frozen=True)
class EngineConfig:
    """How an instance runs (`coral.engine.instance.CoralInstance`) and how its nodes are configured."""

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
    kv_pull_timeout_s: float = 30.0  # a decode node's KV pull not answered within this fails (prefilled locally)
    local: bool = False  # nodes as threads of this process (tests)
    http: bool = True  # serve the OpenAI API (False: drive `scheduler` directly)
    port: int = 0  # HTTP port (0: a free one)
    tensor_parallel: bool = True  # a node of TP degree t runs as t processes (1 when `local`; `InstanceProcesses`)
    api_key: str | None = field(default=None, repr=False)  # the gateway's engine token: `/v1/*` needs it
    max_waiting: int = 1024  # requests waiting for their first step; more get 503 + Retry-After at once
    retry_after_s: int = 1  # Retry-After of the instance's 503s (overloaded, a node dead)


@dataclass(frozen=True)
class NodeConfig:
    instance_id: str
    rank: int  # node rank (the scheduler's id of the node; its leader's process in the P2P group)
    world_size: int  # processes of the instance
    first: int
    last: int
    checkpoint: str
    results: str  # the scheduler's PULL address
    bind: str = "tcp://127.0.0.1"  # 'tcp://HOST' (ports chosen by the OS) or 'inproc' (threads)
    advertise: str = ""  # host the scheduler and other instances reach this node by (default: its bind host,
    # or this machine's address when bound to 0.0.0.0)
    device: str = "cpu"  # 'cuda:0', ... on GPU nodes
    dist_backend: str = "gloo"  # 'nccl' on GPU nodes
    dist_init: str = ""  # torch.distributed init_method: 'file://PATH' or 'tcp://HOST:PORT'
    threads: int = 1  # torch intra-op threads (1: node processes share the machine's cores)
    kv_ttl_s: float = 120.0
    kv_pull_timeout_s: float = 30.0  # a KV pull not answered within this fails (the request is prefilled here)
    kv_cache_gib: float = 0.25  # KV pool of each process (a TP rank holds its heads)
    kv_block_size: int = 16  # tokens per KV block
    kv_blocks: int = 0  # blocks in the pool (0: as many as fit in the budget)
    kv_cache_fraction: float = 0.0  # > 0: the budget is this fraction of the device's free memory, not the GiB
    parent_pid: int = 0  # a node process exits when this process (its owner) is gone, even mid-receive; 0: no check
    process_rank: int = -1  # torch.distributed rank of this process (-1: the node rank)
    leaders: list[int] = field(default_factory=list)  # process rank of each node's leader (empty: node ranks)
    tp_groups: list[list[int]] = field(default_factory=list)  # the instance's tensor-parallel groups (size > 1)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def spawn_node(cfg: NodeConfig, log_dir: Path | None = None, instance_id: str = "") -> subprocess.Popen[bytes]:
    """Start the process of `cfg` (`python -m coral.engine.node JSON`) with `cfg.threads` torch threads, its
    output appended to `<log_dir>/<instance_id>.process<rank>.log` (or dropped)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads), "TOKENIZERS_PARALLELISM": "false"}
    out: IO[bytes] | None = None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        out = (log_dir / f"{instance_id or cfg.instance_id}.process{cfg.process_rank}.log").open("ab")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "coral.engine.node", cfg.to_json()], env=env,
            stdout=out or subprocess.DEVNULL, stderr=subprocess.STDOUT if out else subprocess.DEVNULL,
            start_new_session=True,
        )
    finally:
        if out is not None:
            out.close()


def on_machine(cfg: NodeConfig, host: str, advertise: str = "") -> NodeConfig:
    """`cfg` for a node started on its own machine: its sockets bound to `host` (reached by `advertise`, when
    bound to 0.0.0.0) and, on GPUs, its TP rank's device among the machine's GPUs."""
    device = cfg.device
    if device.startswith("cuda"):
        leader = cfg.leaders[cfg.rank] if cfg.leaders else cfg.rank
        tp_rank = cfg.process_rank - leader if cfg.process_rank >= 0 else 0
        device = f"cuda:{tp_rank}"
    return replace(cfg, bind=f"tcp://{host}", advertise=advertise, device=device)


class InstanceProcesses:
    """The processes of an instance's nodes, by process rank: a node of TP degree t is t processes (its leader,
    TP rank 0, first), node after node."""

    def __init__(self, layout: Layout, checkpoint: str, config: EngineConfig) -> None:
        self.layout, self.checkpoint, self.config = layout, checkpoint, config
        self.tp = [self.node_tp(n.tp) for n in layout.nodes]
        self.leaders = [sum(self.tp[:r]) for r in range(len(self.tp))]  # process rank of each node's leader
        self.processes: list[tuple[NodeSlot, int]] = [(n, t) for n in layout.nodes for t in range(self.tp[n.rank])]
        self.tp_groups = [list(range(a, a + t)) for a, t in zip(self.leaders, self.tp, strict=True) if t > 1]

    def node_tp(self, planned: int) -> int:
        """Processes of a node of TP degree `planned`: the largest degree <= it that divides the model's
        attention heads, KV heads and MLP width (the tiny model has 2 KV heads); 1 for thread nodes."""
        if self.config.local or not self.config.tensor_parallel:
            return 1
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(self.checkpoint)
        dims = (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size)
        return max(t for t in range(1, planned + 1) if all(d % t == 0 for d in dims))

    def node_configs(self, results: str, name: str = "", dist_init: str = "") -> list[NodeConfig]:
        """The configuration of each process, by process rank, for a scheduler whose results socket is
        `results`; `name`: the instance's run name; `dist_init`: the rendezvous when the config names none."""
        cfg = self.config
        return [NodeConfig(
            instance_id=name, rank=node.rank, world_size=len(self.processes), first=node.first, last=node.last,
            process_rank=process, leaders=self.leaders, tp_groups=self.tp_groups, checkpoint=self.checkpoint,
            results=results, bind="inproc" if cfg.local else f"tcp://{cfg.host}",
            advertise=cfg.advertise if cfg.launch else "",
            device=f"cuda:{process}" if cfg.device == "cuda" else cfg.device,
            dist_backend=cfg.dist_backend, dist_init=cfg.dist_init or dist_init, threads=cfg.threads_per_node,
            kv_ttl_s=cfg.kv_ttl_s, kv_pull_timeout_s=cfg.kv_pull_timeout_s, kv_cache_gib=cfg.kv_cache_gib,
            kv_block_size=cfg.kv_block_size, kv_blocks=cfg.kv_blocks, kv_cache_fraction=cfg.kv_cache_fraction,
            parent_pid=os.getpid() if cfg.launch and not cfg.local else 0,
        ) for process, (node, _) in enumerate(self.processes)]


def plan_layout(instance: PlanInstance, checkpoint: str | Path) -> Layout:
    """The plan instance's stages over the checkpoint's layers (split scaled, see `coral.engine.layout`)."""
    from coral.engine.layout import Layout
    from coral.engine.shard import checkpoint_layers

    return Layout.from_plan(instance, checkpoint_layers(checkpoint))


def plan_instance(path: Path, instance_id: str) -> PlanInstance:
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
    layout = plan_layout(plan_instance(args.plan, args.instance), args.checkpoint)
    nodes = InstanceProcesses(layout, str(args.checkpoint), config)
    mine = [c for c in nodes.node_configs(args.scheduler) if c.rank == args.node_rank]
    if not mine:
        raise SystemExit(f"--node-rank {args.node_rank}: {args.instance} has nodes 0..{len(layout.nodes) - 1}")
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
