"""Engine backends the controller starts and stops instances through.

A backend identifies instances by id: `start` is idempotent (an instance already running returns its
handle), which lets a restarted controller adopt what survived it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from coral.allocation.plan import PlanInstance
from coral.catalog.loader import Catalog, CoralInputError, builtin_catalog
from coral.catalog.schema import parse_config_name
from coral.deploy.vllm import launch_commands
from coral.perf.model import PerfModel
from coral.perf.roofline import RooflineModel
from coral.runtime.emulated import instance_engine_app
from coral.runtime.server import ServerThread, free_port

Handle = dict[str, Any]


class Backend(Protocol):
    def start(self, instance: PlanInstance) -> Handle:
        """Launch `instance` (or find it running); the handle has at least its API base `url`."""
        ...

    def stop(self, instance_id: str, handle: Handle) -> None: ...

    def alive(self, instance_id: str, handle: Handle) -> bool: ...


class EmulatedBackend:
    """One emulated engine server (uvicorn thread on loopback) per instance, timed by the perf model."""

    def __init__(
        self,
        time_scale: float = 1.0,
        catalog: Catalog | None = None,
        perf: PerfModel | RooflineModel | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.time_scale = time_scale
        self.catalog = catalog
        self.perf = perf
        self.host = host
        self.servers: dict[str, ServerThread] = {}
        self.apps: dict[str, Any] = {}
        self.starts = 0
        self._lock = threading.Lock()

    def start(self, instance: PlanInstance) -> Handle:
        with self._lock:
            srv = self.servers.get(instance.id)
            if srv is None or not srv.alive():
                app = instance_engine_app(instance, self.time_scale, self.catalog, self.perf)
                srv = self.servers[instance.id] = ServerThread(app, host=self.host).start()
                self.apps[instance.id] = app
                self.starts += 1
        return {"url": srv.url, "port": srv.port}

    def stop(self, instance_id: str, handle: Handle) -> None:
        with self._lock:
            srv = self.servers.pop(instance_id, None)
            self.apps.pop(instance_id, None)
        if srv is not None:
            srv.stop()

    def alive(self, instance_id: str, handle: Handle) -> bool:
        srv = self.servers.get(instance_id)
        return srv is not None and srv.alive()

    def kill(self, instance_id: str) -> None:
        """Crash an instance: open connections drop at once (failure injection for tests and demos)."""
        srv = self.servers.get(instance_id)
        if srv is not None:
            srv.stop(force=True)

    def engine(self, instance_id: str) -> Any:
        """The `EngineState` counters of a running emulated instance."""
        return self.apps[instance_id].state.engine

    def close(self) -> None:
        for iid in list(self.servers):
            self.stop(iid, {})


class VllmProcessBackend:
    """`vllm serve` as a local process per single-node instance (one multi-GPU machine).

    Each instance gets `tp` GPUs from `gpus` through CUDA_VISIBLE_DEVICES (no assignment when `gpus` is
    empty) and a free loopback port; the command and environment are those of `coral.deploy.vllm`.
    Multi-node pipelines need a cluster: render them with `coral deploy`. Handles carry the pid, so a
    restarted controller adopts and stops processes it did not start itself.
    """

    def __init__(
        self,
        gpus: Sequence[int] = (),
        executable: Sequence[str] = ("vllm",),
        catalog: Catalog | None = None,
        host: str = "127.0.0.1",
        log_dir: Path | None = None,
        stop_timeout_s: float = 30.0,
    ) -> None:
        self.free = list(gpus)
        self.assign = bool(gpus)
        self.executable = list(executable)
        self.catalog = catalog or builtin_catalog()
        self.host = host
        self.log_dir = log_dir
        self.stop_timeout_s = stop_timeout_s
        self.procs: dict[str, tuple[subprocess.Popen[bytes], Handle]] = {}
        self._lock = threading.Lock()

    def command(self, instance: PlanInstance, port: int) -> tuple[list[str], dict[str, str]]:
        """(argv, extra environment) of the instance's single node."""
        if len(instance.stages) != 1:
            raise CoralInputError(
                f"{instance.id}: a {len(instance.stages)}-node pipeline cannot run on one machine; use `coral deploy`"
            )
        if len(instance.stages[0].nodes) != 1:
            raise CoralInputError(
                f"{instance.id}: {len(instance.stages[0].nodes)} data-parallel replicas need one endpoint each; "
                "use `coral deploy`"
            )
        (launch,) = launch_commands(instance, self.catalog.model(instance.model), port=port)
        argv = [*self.executable, *launch.argv[1:]]
        argv[argv.index("--host") + 1] = self.host
        return argv, dict(launch.env)

    def start(self, instance: PlanInstance) -> Handle:
        with self._lock:
            running = self.procs.get(instance.id)
            if running is not None and running[0].poll() is None:
                return running[1]
            port = free_port(self.host)
            argv, env = self.command(instance, port)
            tp = parse_config_name(instance.stages[0].nodes[0])[1]
            gpus: list[int] = []
            if self.assign:
                if len(self.free) < tp:
                    raise CoralInputError(f"{instance.id}: needs {tp} GPU(s), {len(self.free)} free")
                gpus, self.free = self.free[:tp], self.free[tp:]
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
            out: Any = subprocess.DEVNULL
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                out = (self.log_dir / f"{instance.id}.log").open("ab")
            proc = subprocess.Popen(
                argv, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            handle: Handle = {"url": f"http://{self.host}:{port}", "pid": proc.pid, "gpus": gpus}
            self.procs[instance.id] = (proc, handle)
        return handle

    def stop(self, instance_id: str, handle: Handle) -> None:
        with self._lock:
            running = self.procs.pop(instance_id, None)
            self.free.extend((running[1] if running else handle).get("gpus", []))
        if running is not None:
            proc = running[0]
            proc.terminate()
            try:
                proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(self.stop_timeout_s)
        elif _pid_alive(handle.get("pid")):  # started by a previous controller run
            os.kill(int(handle["pid"]), signal.SIGTERM)

    def alive(self, instance_id: str, handle: Handle) -> bool:
        running = self.procs.get(instance_id)
        if running is not None:
            return running[0].poll() is None
        return _pid_alive(handle.get("pid"))

    def close(self) -> None:
        for iid, (_proc, handle) in list(self.procs.items()):
            self.stop(iid, handle)


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True
