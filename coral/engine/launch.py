"""How a node process is described (`NodeConfig`) and started (`spawn_node`, `on_machine`), apart from the
node itself: this module imports no torch, so launchers such as Ray's node actors start fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO


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
