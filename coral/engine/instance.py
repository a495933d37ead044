"""Start, serve and stop one Coral engine instance: its node processes, scheduler and HTTP server.

`CoralInstance.from_plan(plan_instance, checkpoint).start()` maps the instance's stages onto the checkpoint's
layers (`Layout.from_plan`), starts one process per node and TP rank (`python -m coral.engine.node`; a node
of config '2xA10G' is a tensor-parallel pair), all in one torch.distributed process group initialised through
a file in a temporary directory (or `EngineConfig.dist_init` across machines), waits until every node has
loaded its shard, and serves the OpenAI API on `url`. With `EngineConfig(local=True)` the nodes are threads of
this process exchanging activations through queues (same node and scheduler code, no TP; for tests).

Once serving, a watcher thread polls the node processes (or threads): when one is gone the scheduler fails every
request in flight at once and refuses new ones, and /health names the node (`problem`).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import zmq

from coral.allocation.plan import PlanInstance
from coral.engine.launch import (
    EngineConfig,
    InstanceProcesses,
    NodeConfig,
    plan_instance,
    plan_layout,
    spawn_node,
)
from coral.engine.layout import Layout
from coral.engine.node import serve_local
from coral.engine.scheduler import Scheduler
from coral.engine.transport import LocalHub, advertised


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
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name=f"coral-watch-{layout.instance_id}", daemon=True)
        self.nodes = InstanceProcesses(layout, self.checkpoint, self.config)
        self.tp = self.nodes.tp  # processes of each node (its TP degree)
        self.processes = self.nodes.processes  # (node, TP rank) of each process, by process rank

    @classmethod
    def from_plan(cls, instance: PlanInstance, checkpoint: str | Path, config: EngineConfig | None = None,
                  log_dir: Path | None = None) -> CoralInstance:
        """The plan instance's stages over the checkpoint's layers (split scaled, see `coral.engine.layout`)."""
        return cls(plan_layout(instance, checkpoint), checkpoint, config, log_dir)

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
        `results`."""
        dist_init = f"file://{self._tmp.name}/dist-store" if self._tmp is not None else ""
        return self.nodes.node_configs(results, self._name, dist_init)

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
            self._watcher.start()
            if self.config.http:
                self._serve_http()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_nodes(self, nodes: list[NodeConfig]) -> None:
        if self.config.local:
            hub = LocalHub()
            for ncfg in nodes:
                t = threading.Thread(target=serve_local, args=(ncfg, hub, self.ctx), daemon=True,
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

        from coral.engine.server import Limits, create_instance_app
        from coral.http_serving import ServerThread

        assert self.scheduler is not None
        tokenizer = AutoTokenizer.from_pretrained(self.checkpoint)
        model_config = AutoConfig.from_pretrained(self.checkpoint)
        limits = Limits(int(model_config.max_position_embeddings), self.config.max_waiting, self.config.retry_after_s,
                        generation_defaults(self.checkpoint))
        app = create_instance_app(self.scheduler, tokenizer, int(model_config.vocab_size), self.layout.model,
                                  self.layout.instance_id, limits, self.problem, self.config.api_key)
        self.server = ServerThread(app, host=self.config.host, port=self.config.port).start()

    def problem(self) -> str | None:
        """What is broken: the first node process (or thread) gone, or the scheduler's error; None if nothing."""
        for rank, p in enumerate(self.procs):
            if (code := p.poll()) is not None:
                node, tp_rank = self.processes[rank]
                return (f"node {node.rank} ({node.config}, stage {node.stage}, TP rank {tp_rank}, pid {p.pid}) "
                        f"exited with code {code}")
        for t in self.threads:
            if not t.is_alive():
                return f"node thread {t.name} ended"
        return self.scheduler.error if self.scheduler is not None else None

    def _watch(self) -> None:
        """Fail the scheduler's requests as soon as a node is gone."""
        while not self._stopping.wait(0.1):
            if (why := self.problem()) is not None:
                assert self.scheduler is not None
                self.scheduler.fail(why)
                return

    def alive(self) -> bool:
        sched = self.scheduler
        return (
            sched is not None and sched.thread.is_alive() and self.problem() is None
            and (self.server is None or self.server.alive())
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving, stop the nodes (terminate those that do not exit; at once when a node failed: the
        others may wait on it forever), release everything."""
        self._stopping.set()
        if self.problem() is not None:
            timeout_s = 0.0
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


def generation_defaults(checkpoint: str | Path) -> dict[str, Any]:
    """Sampling defaults the checkpoint's generation_config.json sets (vLLM's `--generation-config auto`: the
    fields of vLLM's `get_diff_sampling_param` the engine implements)."""
    path = Path(checkpoint) / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    return {k: config[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if k in config}


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
    planned = plan_instance(args.plan, args.instance_id)
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


if __name__ == "__main__":
    main()
