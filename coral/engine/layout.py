"""Where an instance's layers live: stages of layer ranges, each held by one or more nodes (ranks).

A plan instance is written for the real model (e.g. 64 layers split 40/24); the engine may run a checkpoint with
fewer layers (the tiny test model has 4). The plan's split is then scaled proportionally to the checkpoint's
layer count by largest remainder, keeping every stage at least one layer (so a checkpoint needs at least as many
layers as the instance has stages).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from coral.allocation.plan import PlanInstance
from coral.catalog.schema import parse_config_name


@dataclass(frozen=True)
class NodeSlot:
    """One node of an instance: its rank, stage, node config, layers, router weight and tensor-parallel degree
    (from the config's name, e.g. 2 for '2xL40S'; 1 for names that are not node configs)."""

    rank: int
    stage: int
    config: str
    first: int
    last: int
    weight: float
    tp: int = 1


@dataclass(frozen=True)
class Layout:
    instance_id: str
    model: str
    phase: str
    stages: tuple[tuple[NodeSlot, ...], ...]

    @property
    def nodes(self) -> list[NodeSlot]:
        return [n for stage in self.stages for n in stage]

    @property
    def n_layers(self) -> int:
        return self.stages[-1][0].last

    def holders(self, layer: int) -> list[NodeSlot]:
        """Nodes holding `layer` (those of its stage)."""
        return [n for stage in self.stages for n in stage if n.first <= layer < n.last]

    @classmethod
    def of(
        cls,
        layers: Sequence[int],
        nodes: Sequence[Sequence[str]],
        weights: Sequence[Sequence[float]] | None = None,
        instance_id: str = "instance",
        model: str = "model",
        phase: str = "decode",
    ) -> Layout:
        """A layout from layers per stage, node configs per stage and their router weights (1 each if absent)."""
        if len(layers) != len(nodes) or not layers:
            raise ValueError(f"layers {list(layers)} and nodes per stage {len(nodes)}: need one entry per stage")
        stages, rank, first = [], 0, 0
        for s, (n_layers, configs) in enumerate(zip(layers, nodes, strict=True)):
            if n_layers < 1 or not configs:
                raise ValueError(f"stage {s}: needs >= 1 layer and >= 1 node, has {n_layers} and {len(configs)}")
            ws = list(weights[s]) if weights is not None else []
            if len(ws) != len(configs) or not all(w > 0 for w in ws):
                ws = [1.0] * len(configs)  # no usable throughput figures: equal weights
            stage = []
            for cfg, w in zip(configs, ws, strict=True):
                stage.append(NodeSlot(rank, s, cfg, first, first + n_layers, w, _tp_of(cfg)))
                rank += 1
            stages.append(tuple(stage))
            first += n_layers
        return cls(instance_id, model, phase, tuple(stages))

    @classmethod
    def from_plan(cls, instance: PlanInstance, checkpoint_layers: int) -> Layout:
        """The instance's stages and nodes over a checkpoint of `checkpoint_layers` layers (split scaled)."""
        layers = scale_layers([s.layers for s in instance.stages], checkpoint_layers)
        return cls.of(
            layers,
            [s.nodes for s in instance.stages],
            [s.node_throughput for s in instance.stages],
            instance.id,
            instance.model,
            instance.phase,
        )


def _tp_of(config: str) -> int:
    try:
        return parse_config_name(config)[1]
    except ValueError:
        return 1


def scale_layers(layers: Sequence[int], total: int) -> list[int]:
    """Split `total` layers over stages in proportion to `layers`, each stage >= 1 (largest remainder)."""
    n, planned = len(layers), sum(layers)
    if n == 0 or planned <= 0 or any(x < 1 for x in layers):
        raise ValueError(f"layers per stage {list(layers)}: need >= 1 stage, each with >= 1 layer")
    if total < n:
        raise ValueError(f"the checkpoint has {total} layers, fewer than the instance's {n} stages")
    if planned == total:
        return list(layers)
    spare = total - n  # layers beyond the one every stage gets
    share = [spare * x / planned for x in layers]
    out = [1 + math.floor(s) for s in share]
    by_remainder = sorted(range(n), key=lambda i: (share[i] - math.floor(share[i]), layers[i]), reverse=True)
    for i in by_remainder[: total - sum(out)]:
        out[i] += 1
    return out
