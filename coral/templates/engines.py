"""Which templates each engine, and each `coral deploy` target, can run.

Every template runs on the Coral engine. On stock vLLM (disaggregated prefill/decode): single-node templates and
prefill pipelines of one node per stage with one TP degree, whose TP degrees divide the model's attention heads
(no decode pipeline under NixlConnector). The per-instance rule the deploy stage checks plans with is
`coral.deploy.vllm.realisable`; `engine_library` applies the same rule over a library's columns, so that a plan
is made only from templates its engine launches.

A deploy target launches stock vLLM with limits of its own, kept here in `DEPLOY_TARGETS` and read both by
`engine_library(..., target=...)` (the templates a plan for that target may use) and by the renderers'
refusals (`target_refusal`), so that `coral deploy` never refuses a plan made for its target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from coral.catalog.loader import Catalog, CoralInputError
from coral.catalog.schema import parse_config_name
from coral.templates.library import TemplateLibrary, dominated_rows

ENGINES = ("coral", "vllm")
RAY_NODE_RESOURCE_PREFIX = "coral-node/"


def node_resource(config: str) -> str:
    """The Ray custom resource a Ray node advertises to host one plan node of `config` ('coral-node/2xL40S'), which
    the Coral engine's Ray backend requests and the KubeRay worker groups offer."""
    return RAY_NODE_RESOURCE_PREFIX + config


@dataclass(frozen=True)
class DeployTarget:
    """What one `coral deploy` target launches on top of stock vLLM's own limits.

    `one_config_pipelines`: every node of a multi-node instance must have the same node config (one instance
    type), with `why` saying what of the target imposes it."""

    name: str
    one_config_pipelines: bool
    why: str


DEPLOY_TARGETS: dict[str, DeployTarget] = {
    t.name: t
    for t in (
        DeployTarget(
            "skypilot", True,
            "a SkyPilot task's nodes share one resources spec (one instance type), so each pipeline rank of a "
            "multi-node replica runs on the same node config",
        ),
        DeployTarget("kubernetes", False, "one Deployment per pipeline rank, each pinned to its stage's instance type"),
        DeployTarget("commands", False, "one script per node"),
    )
}


def deploy_target(name: str) -> DeployTarget:
    """The target called `name`, or CoralInputError naming the choices."""
    if name not in DEPLOY_TARGETS:
        raise CoralInputError(f"--target: must be one of {', '.join(DEPLOY_TARGETS)}, not {name!r}")
    return DEPLOY_TARGETS[name]


def target_refusal(target: str, stage_configs: Sequence[Sequence[str]]) -> str:
    """Why `target` cannot launch an instance whose stages hold these node configs (given that stock vLLM can);
    "" when it can."""
    rule = deploy_target(target)
    if len(stage_configs) > 1 and rule.one_config_pipelines:
        configs = sorted({c for stage in stage_configs for c in stage})
        if len(configs) > 1:
            return f"a pipeline over node configs {' | '.join(configs)}: {rule.why}"
    return ""


def engine_library(
    library: TemplateLibrary, engine: str, catalog: Catalog, target: str | None = None
) -> TemplateLibrary:
    """The templates `engine` can run: all of them for the Coral engine, the ones stock vLLM launches in a
    disaggregated deployment for `vllm` (`realisable`, vectorised over the library's columns). A deploy
    `target` implies stock vLLM and keeps only what that target launches (`target_refusal`). Dominance flags
    are recomputed within what is left."""
    if engine not in ENGINES:
        raise CoralInputError(f"--engine: must be one of {', '.join(ENGINES)}, not {engine!r}")
    rule = None if target is None else deploy_target(target)
    if (engine == "coral" and rule is None) or not len(library):
        return library
    used = library.nodes >= 0
    tp_of = np.array([parse_config_name(c)[1] for c in library.configs])
    tp = np.where(used, tp_of[np.maximum(library.nodes, 0)], 0)
    heads = np.array([catalog.model(str(m)).num_attention_heads for m in library.model])
    heads_ok = ((heads[:, None] % np.maximum(tp, 1) == 0) | ~used).all(axis=1)
    n_stages = library.n_stages
    one_node_per_stage = used.sum(axis=1) == n_stages
    one_tp = tp.max(axis=1) == np.where(used, tp, tp.max() + 1).min(axis=1)
    pipeline_ok = one_node_per_stage & one_tp & (library.phase != "decode")
    if rule is not None and rule.one_config_pipelines:
        pipeline_ok &= library.nodes.max(axis=1) == np.where(used, library.nodes, len(library.configs)).min(axis=1)
    keep = heads_ok & ((n_stages == 1) | pipeline_ok)
    sub = library.subset(np.flatnonzero(keep))
    sub.dominated = dominated_rows(sub)
    return sub
