"""The Ray actors of the Coral engine on Ray (`coral.runtime.ray_backend`): `NodeActor` starts one plan node's
processes on its Ray node, `SchedulerActor` runs the instance's scheduler and HTTP server beside node 0.

Ray imports an actor's module in every actor process, so this one stays light: node actors import neither torch
nor the model code (the node processes they start do); the scheduler actor imports the engine when created.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coral.engine.launch import NodeConfig, on_machine, spawn_node
from coral.http_serving import free_port

if TYPE_CHECKING:
    from coral.engine.instance import EngineConfig


class NodeActor:
    """One plan node on its Ray node: starts the node's processes and reports when one exits."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stopping = threading.Event()

    def address(self, host: str) -> dict[str, Any]:
        """This Ray node's address (`host` if given), a free port on it, and its Ray node id."""
        import ray

        ip = host or ray.util.get_node_ip_address()
        return {"ip": ip, "port": free_port(ip), "ray_node": ray.get_runtime_context().get_node_id()}

    def launch(self, configs: list[str], host: str, log_dir: str | None) -> list[int]:
        """Start one process per NodeConfig JSON (the node's TP ranks), bound to `host`; their pids."""
        for raw in configs:
            cfg = replace(on_machine(NodeConfig(**json.loads(raw)), host), parent_pid=os.getpid())
            self.procs.append(spawn_node(cfg, Path(log_dir) if log_dir else None))
        return [p.pid for p in self.procs]

    def wait(self) -> str:
        """Block until a process exits (or `stop`); why."""
        while not self.stopping.wait(0.2):
            for p in self.procs:
                if p.poll() is not None:
                    return f"node process {p.pid} exited with {p.returncode}"
        return "stopped"

    def stop(self, timeout_s: float = 10.0) -> None:
        self.stopping.set()
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class SchedulerActor:
    """The instance's scheduler and OpenAI HTTP server (`CoralInstance` whose nodes run in `NodeActor`s)."""

    def __init__(self, instance_json: str, checkpoint: str, config: EngineConfig) -> None:
        from coral.allocation.plan import PlanInstance
        from coral.engine.instance import (
            CoralInstance,  # torch and the model code: only the scheduler's actor
        )

        self.instance = CoralInstance.from_plan(PlanInstance.model_validate_json(instance_json), checkpoint, config)
        self.stopping = threading.Event()

    def node_configs(self) -> list[str]:
        """The NodeConfig JSON of each process, by process rank (starts the scheduler)."""
        return [c.to_json() for c in self.instance.open()]

    def serve(self) -> str:
        """Wait until every node is ready, serve HTTP; the API base URL."""
        self.instance.start()
        return self.instance.url

    def wait(self) -> str:
        """Block until the scheduler or its server fails (or `stop`); why."""
        while not self.stopping.wait(0.2):
            if not self.instance.alive():
                sched = self.instance.scheduler
                return f"scheduler failed: {sched.error if sched is not None else 'not started'}"
        return "stopped"

    def stop(self) -> None:
        self.stopping.set()
        self.instance.stop()
