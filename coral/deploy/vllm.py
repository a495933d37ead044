"""vLLM launch commands for plan instances, and which templates stock vLLM can realise.

Stock vLLM (0.33) runs a pipeline with one tensor-parallel size for every stage and no data parallelism
inside a stage; uneven layer splits go through `VLLM_PP_LAYER_PARTITION`. A template is therefore realisable
when it is a single stage (each of its data-parallel nodes then runs as an independent replica), or a
pipeline whose every stage is exactly one node with the same GPU count (GPU types may differ between stages:
each node runs its own rank of a multi-node launch). The attention heads must also divide by the TP size. Prefill and decode instances are launched with a NIXL KV-transfer config (`kv_both`), the setup of
vLLM's disaggregated-prefill proxy, which the Coral gateway reproduces.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from coral.allocation.plan import PlanInstance
from coral.catalog.schema import ModelArch, parse_config_name

VLLM_PORT = 8000
KV_TRANSFER_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
HEAD_ADDR_VAR = "CORAL_HEAD_ADDR"


class _StageLike(Protocol):
    @property
    def layers(self) -> int: ...
    @property
    def nodes(self) -> Sequence[str]: ...


class _TemplateLike(Protocol):
    @property
    def stages(self) -> Sequence[_StageLike]: ...


@dataclass(frozen=True)
class Realisability:
    """Whether stock vLLM can launch a template, and why not."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


def _heads_divide(arch: ModelArch | None, tp: int) -> Realisability:
    if arch is not None and arch.num_attention_heads % tp:
        return Realisability(False, f"{arch.num_attention_heads} attention heads do not divide by TP {tp}")
    return Realisability(True)


def check_stages(stages: Sequence[_StageLike], arch: ModelArch | None = None) -> Realisability:
    """Single stage: every node is an independent replica (any configs). Pipeline: one node per stage, one
    GPU count for all."""
    if not stages:
        return Realisability(False, "no stages")
    if len(stages) == 1:
        for cfg in sorted(set(stages[0].nodes)):
            check = _heads_divide(arch, parse_config_name(cfg)[1])
            if not check:
                return check
        return Realisability(True)
    for k, s in enumerate(stages):
        if len(s.nodes) != 1:
            return Realisability(
                False,
                f"stage {k} of a pipeline has {len(s.nodes)} data-parallel nodes; vLLM has no data parallelism inside a stage",
            )
    tps = sorted({parse_config_name(s.nodes[0])[1] for s in stages})
    if len(tps) > 1:
        return Realisability(
            False, f"stages use different GPU counts {tps}; vLLM needs one --tensor-parallel-size"
        )
    return _heads_divide(arch, tps[0])


def realisable(template: _TemplateLike, arch: ModelArch | None = None) -> Realisability:
    """Whether stock vLLM can run `template` (a Template or a PlanInstance), with the reason when not."""
    return check_stages(template.stages, arch)


def vllm_compatible_filter(stages: Sequence[_StageLike]) -> bool:
    """Predicate for template generation: keep only layouts stock vLLM can launch."""
    return check_stages(stages).ok


@dataclass(frozen=True)
class NodeLaunch:
    """The command and environment of one node (pipeline rank) of an instance."""

    instance_id: str
    rank: int
    config: str
    gpus: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    replica: int = 0

    def shell(self) -> str:
        """One shell line; `$VAR` arguments stay expandable, everything else is quoted."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        args = " ".join(f'"{a}"' if re.fullmatch(r"\$\w+", a) else shlex.quote(a) for a in self.argv)
        return (env + " " if env else "") + args


def launch_commands(
    instance: PlanInstance,
    arch: ModelArch,
    port: int = VLLM_PORT,
    head_addr: str = f"${HEAD_ADDR_VAR}",
    disaggregated: bool = True,
    executor: str = "mp",
) -> list[NodeLaunch]:
    """`vllm serve` per node of `instance`.

    A single-stage instance gives one independent replica per node (each serves the API). A pipeline gives
    one rank per stage: rank 0 serves the API, the others run headless; `executor="mp"` gives every node an
    explicit `--node-rank` (exact stage placement), `"ray"` one command for the head of a Ray cluster that
    already holds the nodes (KubeRay).
    """
    check = realisable(instance, arch)
    if not check:
        raise ValueError(f"instance {instance.id} is not realisable by stock vLLM: {check.reason}")
    pp = len(instance.stages)

    def base(tp: int) -> list[str]:
        argv = ["vllm", "serve", arch.hf_id or arch.name, "--served-model-name", instance.model]
        argv += ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp)]
        if disaggregated:
            argv += ["--kv-transfer-config", json.dumps(KV_TRANSFER_CONFIG, separators=(",", ":"))]
        return argv

    api = ["--host", "0.0.0.0", "--port", str(port)]
    if pp == 1:
        return [
            NodeLaunch(instance.id, 0, cfg, g, base(g) + api, replica=k)
            for k, cfg in enumerate(instance.stages[0].nodes)
            for g in [parse_config_name(cfg)[1]]
        ]
    tp = parse_config_name(instance.stages[0].nodes[0])[1]
    env = {"VLLM_PP_LAYER_PARTITION": ",".join(str(s.layers) for s in instance.stages)}
    if executor == "ray":
        argv = [*base(tp), *api, "--distributed-executor-backend", "ray"]
        return [NodeLaunch(instance.id, 0, instance.stages[0].nodes[0], tp, argv, env)]
    out = []
    for r, s in enumerate(instance.stages):
        dist = ["--nnodes", str(pp), "--node-rank", str(r), "--master-addr", head_addr]
        argv = base(tp) + (api + dist if r == 0 else [*dist, "--headless"])
        out.append(NodeLaunch(instance.id, r, s.nodes[0], tp, argv, dict(env)))
    return out
