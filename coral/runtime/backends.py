"""Engine backends the controller starts and stops instances through.

A backend identifies instances by id: `start` is idempotent (an instance already running returns its
handle), which lets a restarted controller adopt what survived it. A backend may say why an instance stopped by
itself (`failure`). `Watchdog` polls the instances a controller runs through any backend's `alive` and reports
a death at once (the controller re-reconciles then instead of at its next pass).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from coral import vllm_cpu
from coral.allocation.plan import PlanInstance
from coral.catalog.loader import Catalog, CoralInputError, builtin_catalog
from coral.catalog.schema import Scenario, parse_config_name
from coral.deploy.vllm import launch_commands
from coral.http_serving import ServerThread, free_port
from coral.perf.roofline import RooflineModel
from coral.runtime.emulated import instance_engine_app
from coral.simulation.kernels import KernelCache

Handle = dict[str, Any]


class Backend(Protocol):
    def start(self, instance: PlanInstance) -> Handle:
        """Launch `instance` (or find it running); the handle has at least its API base `url`."""
        ...

    def stop(self, instance_id: str, handle: Handle) -> None: ...

    def alive(self, instance_id: str, handle: Handle) -> bool: ...


class Watchdog:
    """A thread polling `alive(instance_id, handle)` of the watched instances every `poll_s`; calls
    `on_death(instance_id)` once when one stops being alive (it is no longer watched then)."""

    def __init__(
        self, alive: Callable[[str, Handle], bool], on_death: Callable[[str], None], poll_s: float = 0.2
    ) -> None:
        self.alive, self.on_death, self.poll_s = alive, on_death, poll_s
        self.watched: dict[str, Handle] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, instance_id: str, handle: Handle) -> None:
        with self._lock:
            self.watched[instance_id] = handle

    def forget(self, instance_id: str) -> None:
        """Stop watching (before stopping the instance on purpose)."""
        with self._lock:
            self.watched.pop(instance_id, None)

    def start(self) -> Watchdog:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="coral-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def check(self) -> list[str]:
        """One poll: the watched instances found dead (each reported to `on_death`)."""
        with self._lock:
            watched = list(self.watched.items())
        dead = []
        for iid, handle in watched:
            if self.alive(iid, handle):
                continue
            with self._lock:
                if self.watched.get(iid) is not handle:  # forgotten or restarted meanwhile
                    continue
                del self.watched[iid]
            dead.append(iid)
            self.on_death(iid)
        return dead

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.check()


class EmulatedBackend:
    """One emulated engine server (uvicorn thread on loopback) per instance, timed as the simulator serves it with
    `scenario`'s SLOs and request sizes (needed unless `time_scale` is 0); with `api_key`, its `/v1/*` answers
    only requests bearing it (the gateway's `upstream_api_key`)."""

    def __init__(
        self,
        time_scale: float = 1.0,
        scenario: Scenario | None = None,
        catalog: Catalog | None = None,
        perf: RooflineModel | None = None,
        host: str = "127.0.0.1",
        api_key: str | None = None,
    ) -> None:
        self.time_scale = time_scale
        self.kernels = KernelCache(scenario, catalog or builtin_catalog(), perf or RooflineModel()) if scenario else None
        self.host = host
        self.api_key = api_key
        self.servers: dict[str, ServerThread] = {}
        self.apps: dict[str, Any] = {}
        self.starts = 0
        self._lock = threading.Lock()

    def start(self, instance: PlanInstance) -> Handle:
        with self._lock:
            srv = self.servers.get(instance.id)
            if srv is None or not srv.alive():
                app = instance_engine_app(instance, self.time_scale, self.kernels, self.api_key)
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

    def failure(self, instance_id: str) -> str:
        """Why a started instance is not running ('' while it is)."""
        srv = self.servers.get(instance_id)
        return "its server thread stopped" if srv is not None and not srv.alive() else ""

    def engine(self, instance_id: str) -> Any:
        """The `EngineState` counters of a running emulated instance."""
        return self.apps[instance_id].state.engine

    def close(self) -> None:
        """Stop every engine at once, dropping what is still in flight (the gateway drained before this)."""
        with self._lock:
            servers = list(self.servers.values())
            self.servers.clear()
            self.apps.clear()
        for srv in servers:
            srv.server.force_exit = srv.server.should_exit = True
        for srv in servers:
            srv.stop(force=True)


class VllmProcessBackend:
    """A vLLM OpenAI server as a local process per single-node instance (one multi-GPU machine, or a CPU).

    GPU nodes: `vllm serve` with `tp` GPUs from `gpus` through CUDA_VISIBLE_DEVICES (no assignment when `gpus`
    is empty); the command and environment are those of `coral.deploy.vllm`. CPU nodes (`1xCPU`): vLLM's CPU
    build run by `python` (`coral.vllm_cpu`) on the model's local checkpoint (`checkpoints`, else the tiny
    model for `tiny-llama`, else its Hugging Face id) with dummy weights, `--enforce-eager`, a KV cache of
    `cpu_kv_cache_gib` and at most `cpu_max_model_len` tokens per sequence. Each instance gets a free loopback
    port; with `api_key`, vLLM's `/v1/*` needs it (`VLLM_API_KEY`). Multi-node pipelines need a cluster: render them with `coral deploy`. Handles carry the pid, so a
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
        python: str | None = None,
        checkpoints: Mapping[str, Path] | None = None,
        cpu_kv_cache_gib: int = 1,
        cpu_max_model_len: int = 512,
        api_key: str | None = None,
    ) -> None:
        self.free = list(gpus)
        self.api_key = api_key
        self.assign = bool(gpus)
        self.executable = list(executable)
        self.catalog = catalog or builtin_catalog()
        self.host = host
        self.log_dir = log_dir
        self.stop_timeout_s = stop_timeout_s
        self.python = vllm_cpu.vllm_python(python)
        self.checkpoints = dict(checkpoints or {})
        self.cpu_kv_cache_gib = cpu_kv_cache_gib
        self.cpu_max_model_len = cpu_max_model_len
        self.procs: dict[str, tuple[subprocess.Popen[bytes], Handle]] = {}
        self._lock = threading.Lock()

    def command(self, instance: PlanInstance, port: int) -> tuple[list[str], dict[str, str]]:
        """(argv, extra environment) of the instance's single node."""
        cpu = _on_cpu(instance)
        if len(instance.stages) != 1:
            raise CoralInputError(
                f"{instance.id}: a {len(instance.stages)}-node pipeline cannot run on one machine; use `coral deploy`"
            )
        if len(instance.stages[0].nodes) != 1:
            raise CoralInputError(
                f"{instance.id}: {len(instance.stages[0].nodes)} data-parallel replicas need one endpoint each; "
                "use `coral deploy`"
            )
        arch = self.catalog.model(instance.model)
        if cpu:
            source = self.checkpoints.get(instance.model) or vllm_cpu.model_source(arch)
            arch = arch.model_copy(update={"hf_id": str(source)})
        (launch,) = launch_commands(instance, arch, port=port, disaggregated=not cpu)
        if cpu:
            argv = vllm_cpu.api_server_argv(self.python, launch.argv)
            argv += vllm_cpu.cpu_server_args(self.cpu_max_model_len)
            env = {**launch.env, **vllm_cpu.cpu_env(self.cpu_kv_cache_gib)}
        else:
            argv, env = [*self.executable, *launch.argv[1:]], dict(launch.env)
        argv[argv.index("--host") + 1] = self.host
        return argv, env

    def start(self, instance: PlanInstance) -> Handle:
        with self._lock:
            running = self.procs.get(instance.id)
            if running is not None and running[0].poll() is None:
                return running[1]
            port = free_port(self.host)
            argv, env = self.command(instance, port)
            tp = parse_config_name(instance.stages[0].nodes[0])[1]
            gpus: list[int] = []
            if self.assign and not _on_cpu(instance):
                if len(self.free) < tp:
                    raise CoralInputError(f"{instance.id}: needs {tp} GPU(s), {len(self.free)} free")
                gpus, self.free = self.free[:tp], self.free[tp:]
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
            if self.api_key:
                env["VLLM_API_KEY"] = self.api_key
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
            except subprocess.TimeoutExpired:  # its session holds vLLM's engine and worker processes too
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(self.stop_timeout_s)
        elif _pid_alive(handle.get("pid")):  # started by a previous controller run
            os.kill(int(handle["pid"]), signal.SIGTERM)

    def alive(self, instance_id: str, handle: Handle) -> bool:
        running = self.procs.get(instance_id)
        if running is not None:
            return running[0].poll() is None
        return _pid_alive(handle.get("pid"))

    def failure(self, instance_id: str) -> str:
        """Why a started process is not running ('' while it is): its exit status or signal."""
        running = self.procs.get(instance_id)
        code = running[0].poll() if running is not None else None
        if code is None:
            return ""
        return f"vLLM process exited with status {code}" if code >= 0 else f"vLLM process killed by signal {-code}"

    def close(self) -> None:
        for iid, (_proc, handle) in list(self.procs.items()):
            self.stop(iid, handle)


def _on_cpu(instance: PlanInstance) -> bool:
    """Whether `instance` runs on CPU nodes; CoralInputError unless it is one `1xCPU` node (what vLLM's CPU
    build runs: tensor parallelism over CPU processes is not used, and pipeline parallelism fails)."""
    configs = [c for s in instance.stages for c in s.nodes]
    cpus = [c for c in configs if vllm_cpu.is_cpu_config(c)]
    if not cpus:
        return False
    if len(configs) != 1 or configs[0] != f"1x{vllm_cpu.CPU_DEVICE}":
        raise CoralInputError(
            f"{instance.id}: nodes {', '.join(configs)}: vLLM on CPU runs single-node instances of one "
            f"1x{vllm_cpu.CPU_DEVICE} node only (TP=1; pipeline parallelism fails in vllm-cpu "
            f"{vllm_cpu.VLLM_CPU_VERSION} on its first request)"
        )
    return True


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True
