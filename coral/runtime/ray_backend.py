"""The Coral engine on a Ray cluster: each plan node is a Ray actor on a Ray node that advertises its node
config, the instance's scheduler an actor beside node 0; the controller reconciles plans through it.

A Ray node offers a node config by advertising the custom resource `coral-node/<config>`, one unit per machine
(`ray start --resources '{"coral-node/1xL4": 1}'`, or a KubeRay worker group's `rayStartParams`), beside its
GPUs. An instance is placed whole, as one placement group with a bundle per plan node (`coral-node/<config>: 1`,
and the config's GPUs on CUDA): it starts only when every node fits; otherwise `start` fails after
`place_timeout_s` naming the configs short, and the controller tries again. Each node actor starts its node's
processes (`python -m coral.engine.node`, one per TP rank; they exit when the actor is gone); the scheduler actor
runs in node 0's bundle, the torch.distributed rendezvous is on node 0's machine, and every address travels
through Ray actor calls. Activations go over torch.distributed (gloo on CPU, NCCL on GPU), commands over ZeroMQ,
exactly as on one machine; the checkpoint path must exist on every Ray node.

A watcher thread waits on each actor's `wait` call. When an actor dies (its Ray node was lost) or a node process
exits, the whole instance is stopped at once (its HTTP server too, so the gateway's retries go elsewhere) and
`on_change` is called (`coral serve` wires it to the controller, which marks the instance failed and re-places
it when capacity allows).

Without a Ray address (`address` or `RAY_ADDRESS`), the backend starts a local multi-node cluster of its own
(`LocalRayCluster`): one raylet per plan node, each advertising that node's config, added as plans need them.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from coral.allocation.plan import PlanInstance
from coral.catalog.loader import CoralInputError
from coral.catalog.schema import parse_config_name
from coral.engine.instance import CoralInstance, EngineConfig
from coral.runtime.backends import Handle
from coral.runtime.coral_backend import CoralEngineBackend
from coral.runtime.ray_actors import NodeActor, SchedulerActor
from coral.templates.engines import RAY_NODE_RESOURCE_PREFIX, node_resource


@dataclass
class RayInstance:
    """A placed instance: its placement group, actors and the calls that return when something dies."""

    placement_group: Any
    scheduler: Any
    nodes: list[Any]
    handle: Handle
    watches: list[Any] = field(default_factory=list)
    failure: str = ""
    stopped: bool = False


class LocalRayCluster:
    """A Ray cluster on this machine (`ray.cluster_utils.Cluster`): a head without resources and raylets that each
    advertise one node config, as a real cluster's machines would; `ensure` adds the raylets a plan lacks."""

    def __init__(self, raylets: Counter[str] | None = None) -> None:
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
        self.raylets: dict[str, list[Any]] = {}
        self.ensure(raylets or Counter())

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def add(self, config: str) -> Any:
        """Start one more raylet advertising `config`."""
        node = self.cluster.add_node(num_cpus=1, resources={node_resource(config): 1})
        self.raylets.setdefault(config, []).append(node)
        return node

    def ensure(self, configs: Counter[str]) -> None:
        for config, need in configs.items():
            while len(self.raylets.get(config, [])) < need:
                self.add(config)

    def kill(self, node: Any) -> None:
        """Stop a raylet at once, with the workers on it (a machine lost)."""
        for nodes in self.raylets.values():
            if node in nodes:
                nodes.remove(node)
        self.cluster.remove_node(node, allow_graceful=False)

    def shutdown(self) -> None:
        self.cluster.shutdown()


class RayCoralBackend(CoralEngineBackend):
    """Coral engine instances on a Ray cluster; see the module docstring. `host` binds every engine socket and
    HTTP server to that address (tests and one-machine clusters: 127.0.0.1; default: each Ray node's IP)."""

    def __init__(
        self,
        checkpoint: Path | None = None,
        config: EngineConfig | None = None,
        cache_dir: Path | None = None,
        log_dir: Path | None = None,
        api_key: str | None = None,
        address: str | None = None,
        host: str = "",
        place_timeout_s: float = 10.0,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(checkpoint, config, cache_dir, log_dir, api_key)
        self.address = address if address is not None else os.environ.get("RAY_ADDRESS", "")
        self.host = host
        self.place_timeout_s = place_timeout_s
        self.on_change = on_change
        self.placed: dict[str, RayInstance] = {}
        self.local: LocalRayCluster | None = None
        self.placements = 0
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None

    # --- Ray ------------------------------------------------------------------------------------------
    def connect(self) -> None:
        """Join the Ray cluster at `address` (or start a local one), and start the watcher."""
        import ray

        if not ray.is_initialized():
            if not self.address:
                self.local = LocalRayCluster()
                self.address = self.local.address
            ray.init(address=self.address, log_to_driver=False, namespace="coral")
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="coral-ray-watch", daemon=True)
            self._watcher.start()

    def _place(self, instance: PlanInstance) -> RayInstance:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        layout = CoralInstance.from_plan(instance, self.model_dir(instance.model), self.config).layout
        configs = [n.config for n in layout.nodes]
        if self.local is not None:
            self.local.ensure(Counter(configs))
        cuda = self.config.device.startswith("cuda")
        gpus = [parse_config_name(c)[1] if cuda else 0 for c in configs]
        bundles = [{node_resource(c): 1.0, **({"GPU": float(g)} if g else {})} for c, g in zip(configs, gpus, strict=True)]
        pg = placement_group(bundles, strategy="PACK", name=f"coral-{instance.id}")
        if not pg.wait(self.place_timeout_s):
            remove_placement_group(pg)
            free = {k: v for k, v in ray.available_resources().items() if k.startswith(RAY_NODE_RESOURCE_PREFIX)}
            raise CoralInputError(
                f"{instance.id}: no room on the Ray cluster for its nodes {' + '.join(configs)} within "
                f"{self.place_timeout_s:.0f} s (each needs a Ray node advertising {RAY_NODE_RESOURCE_PREFIX}<config>; free now: "
                f"{', '.join(f'{k} {v:g}' for k, v in sorted(free.items())) or 'none'})"
            )

        def bundle(i: int) -> Any:
            return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)

        node_cls, sched_cls = ray.remote(NodeActor), ray.remote(SchedulerActor)
        nodes: list[Any] = [node_cls.options(num_cpus=0, num_gpus=g, max_concurrency=4, scheduling_strategy=bundle(i)).remote()
                 for i, g in enumerate(gpus)]
        placed = RayInstance(pg, None, nodes, {})
        try:
            addrs = ray.get([a.address.remote(self.host) for a in nodes], timeout=60)
            head = addrs[0]
            cfg = replace(self.config, launch=False, host=head["ip"], dist_init=f"tcp://{head['ip']}:{head['port']}",
                          port=0, local=False)
            placed.scheduler = sched_cls.options(num_cpus=0, max_concurrency=4, scheduling_strategy=bundle(0)).remote(
                instance.model_dump_json(), str(self.model_dir(instance.model)), cfg)
            by_rank: dict[int, list[str]] = {}
            for raw in ray.get(placed.scheduler.node_configs.remote(), timeout=60):
                by_rank.setdefault(int(json.loads(raw)["rank"]), []).append(raw)
            log_dir = str(self.log_dir) if self.log_dir is not None else None
            pids = ray.get([a.launch.remote(by_rank[r], addrs[r]["ip"], log_dir) for r, a in enumerate(nodes)],
                           timeout=60)
            placed.watches = [a.wait.remote() for a in nodes]
            serving = placed.scheduler.serve.remote()
            done, _ = ray.wait([serving, *placed.watches], num_returns=1, timeout=cfg.start_timeout_s)
            if serving not in done:
                why = ray.get(done[0]) if done else f"not ready within {cfg.start_timeout_s:.0f} s"
                raise RuntimeError(f"{instance.id}: {why}")
            url = ray.get(serving)
            placed.watches.append(placed.scheduler.wait.remote())
            placed.handle = {"url": url, "ray_nodes": [a["ray_node"] for a in addrs], "pids": pids}
        except BaseException:
            self._release(placed, graceful=False)
            raise
        self.placements += 1
        return placed

    def _release(self, placed: RayInstance, graceful: bool = True) -> None:
        """Stop the scheduler (HTTP first), then the nodes, and free the bundles; not `graceful` (a broken
        instance): kill the actors at once, so open connections drop and the gateway retries elsewhere (the
        node processes exit with their actor)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        placed.stopped = True
        actors = [a for a in [placed.scheduler, *placed.nodes] if a is not None]
        for actor in actors:
            if graceful:
                with contextlib.suppress(Exception):  # a dead actor or Ray node: nothing left to stop there
                    ray.get(actor.stop.remote(), timeout=15)
            ray.kill(actor, no_restart=True)
        remove_placement_group(placed.placement_group)

    def _watch(self) -> None:
        """Stop an instance as soon as one of its actors dies or reports a failure; tell `on_change`."""
        import ray

        while not self._closing.is_set():
            watched = {ref: p for p in list(self.placed.values()) if not p.stopped for ref in p.watches}
            if not watched:
                time.sleep(0.2)
                continue
            done, _ = ray.wait(list(watched), num_returns=1, timeout=0.5)
            for ref in done:
                placed = watched[ref]
                if placed.stopped or self._closing.is_set():
                    continue
                try:
                    placed.failure = str(ray.get(ref))
                except Exception as exc:  # the actor died with its Ray node
                    placed.failure = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                with self._lock:
                    self._release(placed, graceful=False)
                if self.on_change is not None:
                    self.on_change()

    # --- Backend ----------------------------------------------------------------------------------------
    def start(self, instance: PlanInstance) -> Handle:
        self.connect()
        with self._lock:
            placed = self.placed.get(instance.id)
            if placed is not None and not placed.stopped:
                return placed.handle
            self.placed.pop(instance.id, None)
            placed = self.placed[instance.id] = self._place(instance)
        return placed.handle

    def stop(self, instance_id: str, handle: Handle) -> None:
        with self._lock:
            placed = self.placed.pop(instance_id, None)
            if placed is not None and not placed.stopped:
                self._release(placed)

    def alive(self, instance_id: str, handle: Handle) -> bool:
        placed = self.placed.get(instance_id)
        return placed is not None and not placed.stopped

    def failure(self, instance_id: str) -> str:
        """Why a placed instance stopped by itself ('' if it did not)."""
        placed = self.placed.get(instance_id)
        return placed.failure if placed is not None else ""

    def close(self) -> None:
        import ray

        self._closing.set()
        for iid in list(self.placed):
            self.stop(iid, {})
        if self._watcher is not None:
            self._watcher.join(5)
        if self.local is not None:
            ray.shutdown()
            self.local.shutdown()
