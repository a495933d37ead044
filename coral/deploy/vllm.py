"""vLLM launch commands for plan instances, and which templates stock vLLM can realise.

Stock vLLM (0.33) runs a pipeline with one tensor-parallel size for every stage and no data parallelism
inside a stage; uneven layer splits go through `VLLM_PP_LAYER_PARTITION`. A template is therefore realisable
when it is a single stage (each of its data-parallel nodes then runs as an independent replica), or a
pipeline whose every stage is exactly one node with the same GPU count (GPU types may differ between stages:
each node runs its own rank of a multi-node launch). The attention heads must also divide by the TP size.

Prefill/decode disaggregation adds the KV connector's limits: `NixlConnector` rejects pipeline ranks above 0,
so a disaggregated decode instance must be a single stage; a prefill pipeline is launched with the push-based
`NixlPushConnector` (the prefill ranks write each layer's KV to the decode node), and then every instance of
that model uses it, since both sides of a transfer must speak the same connector. Each rank advertises its
NIXL side channel on `VLLM_NIXL_SIDE_CHANNEL_HOST` (the node's own address) and port 5600.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from coral.allocation.plan import PlanInstance
from coral.catalog.schema import ModelArch, parse_config_name
from coral.deploy.shell import HEAD_ADDR_VAR, NODE_ADDR_VAR, sh_line

VLLM_PORT = 8000
NIXL_SIDE_CHANNEL_PORT = 5600
KV_TRANSFER_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


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


def check_stages(
    stages: Sequence[_StageLike], arch: ModelArch | None = None, phase: str | None = None
) -> Realisability:
    """Single stage: every node is an independent replica (any configs). Pipeline: one node per stage, one
    GPU count for all, and not on the decode side of a disaggregated deployment (`phase="decode"`)."""
    if not stages:
        return Realisability(False, "no stages")
    if phase == "decode" and len(stages) > 1:
        return Realisability(
            False,
            f"a {len(stages)}-stage decode pipeline: vLLM's NixlConnector rejects pipeline ranks above 0, so a "
            "disaggregated decode instance must be one stage",
        )
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


def realisable(
    template: _TemplateLike, arch: ModelArch | None = None, phase: str | None = None
) -> Realisability:
    """Whether stock vLLM can run `template` (a Template or a PlanInstance) in a disaggregated deployment,
    with the reason when not; `phase` defaults to the template's own."""
    return check_stages(template.stages, arch, phase or _phase_of(template))


def _phase_of(template: object) -> str | None:
    phase = getattr(template, "phase", None)
    return None if phase is None else str(getattr(phase, "value", phase))


def vllm_compatible_filter(stages: Sequence[_StageLike], phase: str | None = None) -> bool:
    """Predicate for template generation: keep only layouts stock vLLM can launch."""
    return check_stages(stages, phase=phase).ok


def kv_transfer_config(phase: str, push: bool) -> dict[str, str]:
    """The `--kv-transfer-config` of a disaggregated instance: NIXL pull (`kv_both`) by default, the push
    connector (prefill produces, decode consumes) when some prefill instance of the model is a pipeline."""
    if not push:
        return dict(KV_TRANSFER_CONFIG)
    return {"kv_connector": "NixlPushConnector", "kv_role": "kv_producer" if phase == "prefill" else "kv_consumer"}


def side_channel_env(node_addr: str = f"${NODE_ADDR_VAR}") -> dict[str, str]:
    """NIXL's side channel: each rank advertises its own address (not the pod's 0.0.0.0) and a fixed port."""
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": node_addr, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(NIXL_SIDE_CHANNEL_PORT)}


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

    def shell(self, exec_: bool = False) -> str:
        """One bash line (`exec_`: replacing the shell); only our own `$VAR`s expand (`shell.sh_word`)."""
        return sh_line(self.argv, self.env, exec_=exec_)


def launch_commands(
    instance: PlanInstance,
    arch: ModelArch,
    port: int = VLLM_PORT,
    head_addr: str = f"${HEAD_ADDR_VAR}",
    disaggregated: bool = True,
    push: bool = False,
    node_addr: str = f"${NODE_ADDR_VAR}",
) -> list[NodeLaunch]:
    """`vllm serve` per node of `instance`.

    A single-stage instance gives one independent replica per node (each serves the API). A pipeline gives
    one rank per stage with an explicit `--node-rank` (the node of stage r runs rank r, so it loads exactly the
    layers the plan gave its stage): rank 0 serves the API, the others run headless. `disaggregated` adds the
    KV connector (`push`: the push connector, see `kv_transfer_config`) and the NIXL side-channel address.
    """
    check = realisable(instance, arch) if disaggregated else check_stages(instance.stages, arch)
    if not check:
        raise ValueError(f"instance {instance.id} is not realisable by stock vLLM: {check.reason}")
    pp = len(instance.stages)
    if disaggregated and pp > 1 and not push:
        raise ValueError(f"instance {instance.id}: a disaggregated prefill pipeline needs the push connector (push=True)")
    kv_env = side_channel_env(node_addr) if disaggregated else {}

    def base(tp: int) -> list[str]:
        argv = ["vllm", "serve", arch.hf_id or arch.name, "--served-model-name", instance.model]
        argv += ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp)]
        if disaggregated:
            kv = kv_transfer_config(instance.phase, push)
            argv += ["--kv-transfer-config", json.dumps(kv, separators=(",", ":"))]
        return argv

    api = ["--host", "0.0.0.0", "--port", str(port)]
    if pp == 1:
        return [
            NodeLaunch(instance.id, 0, cfg, g, base(g) + api, dict(kv_env), replica=k)
            for k, cfg in enumerate(instance.stages[0].nodes)
            for g in [parse_config_name(cfg)[1]]
        ]
    tp = parse_config_name(instance.stages[0].nodes[0])[1]
    env = {"VLLM_PP_LAYER_PARTITION": ",".join(str(s.layers) for s in instance.stages), **kv_env}
    out = []
    for r, s in enumerate(instance.stages):
        dist = ["--nnodes", str(pp), "--node-rank", str(r), "--master-addr", head_addr]
        argv = base(tp) + (api + dist if r == 0 else [*dist, "--headless"])
        out.append(NodeLaunch(instance.id, r, s.nodes[0], tp, argv, dict(env)))
    return out


def push_models(instances: Sequence[PlanInstance]) -> set[str]:
    """Models whose disaggregated instances need the push connector: some prefill instance is a pipeline."""
    return {i.model for i in instances if i.phase == "prefill" and len(i.stages) > 1}
