"""The Coral pipeline engine as a controller backend: each plan instance runs on this machine as one process
per node (`coral.engine`), its stages mapped onto a checkpoint's layers.

Without a checkpoint, each model of the plan is served under its plan name by the tiny model of its catalog
architecture (`coral.tiny_model`: the catalog's `model_type`, e.g. phi-4 by a tiny phi3, gpt-oss by a tiny
gpt_oss with experts, sinks and sliding-window layers), made once in a cache directory; a model the catalog does
not know, or whose architecture the engine does not run, gets the tiny Llama. The plan's layer split is scaled to
the tiny model's 8 layers, so instances of up to 8 stages run (see `coral.engine.layout`), and a node's TP degree
is capped at 2 (its KV heads; see `coral.engine.launch.InstanceProcesses.node_tp`).
"""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from pathlib import Path

from coral.allocation.plan import PlanInstance
from coral.engine.instance import CoralInstance, EngineConfig
from coral.runtime.backends import Handle

SERVE_MODEL_LAYERS = 8


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "coral"


def serve_architecture(model: str) -> str:
    """The tiny architecture standing in for catalog model `model`: its `model_type` where the engine runs it,
    else llama."""
    from coral.catalog.loader import builtin_catalog
    from coral.tiny_model import ARCHITECTURES

    arch = builtin_catalog().models.get(model)
    return arch.model_type if arch is not None and arch.model_type in ARCHITECTURES else "llama"


class CoralEngineBackend:
    """Coral engine instances on this machine; with `api_key`, their `/v1/*` answers only requests bearing it
    (the gateway's `upstream_api_key`)."""

    def __init__(
        self,
        checkpoint: Path | None = None,
        config: EngineConfig | None = None,
        cache_dir: Path | None = None,
        log_dir: Path | None = None,
        api_key: str | None = None,
    ) -> None:
        self.checkpoint = checkpoint
        config = config or EngineConfig()
        self.config = replace(config, api_key=api_key) if api_key else config
        self.cache_dir = cache_dir or default_cache_dir()
        self.log_dir = log_dir
        self.instances: dict[str, CoralInstance] = {}
        self._lock = threading.Lock()

    def model_dir(self, model: str = "") -> Path:
        """The checkpoint serving plan model `model`: the given one, or the tiny model of its architecture (made
        on first use, in `cache_dir / f"tiny-{architecture}"`; no model: the tiny Llama)."""
        if self.checkpoint is not None:
            return self.checkpoint
        from coral.tiny_model import TinySpec, make_tiny

        arch = serve_architecture(model)
        spec = TinySpec(num_hidden_layers=SERVE_MODEL_LAYERS, initializer_range=0.25)
        return make_tiny(arch, self.cache_dir / f"tiny-{arch}", spec)

    def start(self, instance: PlanInstance) -> Handle:
        with self._lock:
            running = self.instances.get(instance.id)
            if running is None or not running.alive():
                if running is not None:
                    running.stop()
                running = CoralInstance.from_plan(instance, self.model_dir(instance.model), self.config,
                                                  self.log_dir).start()
                self.instances[instance.id] = running
        return {"url": running.url, "pids": [p.pid for p in running.procs]}

    def stop(self, instance_id: str, handle: Handle) -> None:
        with self._lock:
            running = self.instances.pop(instance_id, None)
        if running is not None:
            running.stop()

    def alive(self, instance_id: str, handle: Handle) -> bool:
        running = self.instances.get(instance_id)
        return running is not None and running.alive()

    def close(self) -> None:
        for iid in list(self.instances):
            self.stop(iid, {})
