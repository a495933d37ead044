"""Checks of a plan against the catalog, the scenario it serves and size caps: what `coral deploy` runs before
rendering and `POST /replan` runs before adopting a posted plan. Every problem names its field path and why."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pydantic import ValidationError

from coral.allocation.plan import Plan, PlanInstance
from coral.catalog.loader import Catalog, CoralInputError, format_validation_error
from coral.catalog.schema import Scenario, parse_config_name
from coral.catalog.suggest import did_you_mean

MAX_LISTED = 20
"""Problems a refusal lists (then how many more): a plan near the caps may have thousands."""


@dataclass(frozen=True)
class PlanLimits:
    """Caps on what one plan may ask a controller to run (`coral serve --max-instances / --max-nodes`)."""

    max_instances: int = 256
    max_nodes: int = 1024


def cap_problems(plan: Plan, limits: PlanLimits) -> list[str]:
    """The caps `plan` goes past: its instances, and its nodes in all (those its stages hold, and those its
    counts say)."""
    problems = []
    if len(plan.instances) > limits.max_instances:
        problems.append(f"instances: {len(plan.instances)} instances, over the cap of {limits.max_instances} per "
                        "plan (max_instances)")
    staged = sum(len(st.nodes) for inst in plan.instances for st in inst.stages)
    counted = sum(n for inst in plan.instances for n in inst.counts.values() if n > 0)
    for field, nodes in (("stages", staged), ("counts", counted)):
        if nodes > limits.max_nodes:
            problems.append(f"instances: their {field} hold {nodes} nodes in all, over the cap of {limits.max_nodes} "
                            "per plan (max_nodes)")
    return problems


def instance_problems(inst: PlanInstance, where: str, catalog: Catalog, offered: set[tuple[str, str]]) -> list[str]:
    """What is wrong with one instance (at field path `where`) against the catalog: its model, region, node configs
    and their offerings there, node counts, node throughputs and its stages' layers (in order, covering the model's
    layers once)."""
    problems = []
    if inst.model not in catalog.models:
        problems.append(f"{where}.model: unknown model {inst.model!r}{did_you_mean(inst.model, catalog.models)}")
    regions = {r for r, _ in offered}
    if inst.region not in regions:
        problems.append(f"{where}.region: no offerings known for region {inst.region!r}"
                        f"{did_you_mean(inst.region, regions)}; known: {', '.join(sorted(regions))}")
    next_layer = 0
    for j, st in enumerate(inst.stages):
        at = f"{where}.stages.{j}"
        if st.first_layer != next_layer:
            problems.append(f"{at}.first_layer: {st.first_layer}, expected {next_layer} (stages must follow on)")
        next_layer = st.first_layer + st.layers
        if len(st.node_throughput) != len(st.nodes):
            problems.append(f"{at}.node_throughput: {len(st.node_throughput)} values for {len(st.nodes)} nodes")
        for cfg in sorted(set(st.nodes)):
            try:
                gpu, _n = parse_config_name(cfg)
            except ValueError as exc:
                problems.append(f"{at}.nodes: {exc}")
                continue
            if gpu not in catalog.gpus:
                problems.append(f"{at}.nodes: unknown GPU {gpu!r} in {cfg!r}{did_you_mean(gpu, catalog.gpus)}")
            elif inst.region in regions and (inst.region, cfg) not in offered:
                problems.append(f"{at}.nodes: no offering of {cfg} in region {inst.region!r}")
    arch = catalog.models.get(inst.model)
    if arch is not None and next_layer != arch.num_hidden_layers:
        problems.append(f"{where}.stages: cover {next_layer} layers, {inst.model} has {arch.num_hidden_layers}")
    counted = Counter(n for st in inst.stages for n in st.nodes)
    for cfg in sorted(set(inst.counts) | set(counted)):
        n = inst.counts.get(cfg, 0)
        if cfg in inst.counts and n < 1:
            problems.append(f"{where}.counts.{cfg}: {n} nodes, must be at least 1")
        elif n != counted[cfg]:
            problems.append(f"{where}.counts.{cfg}: {n} nodes, but the stages hold {counted[cfg]}")
    return problems


def scenario_problems(inst: PlanInstance, where: str, scenario: Scenario) -> list[str]:
    """What of one instance the scenario does not serve: its model, its region, its node configs."""
    models = [m.model for m in scenario.models]
    problems = []
    if inst.model not in models:
        problems.append(f"{where}.model: {inst.model!r} is not a model of scenario {scenario.name}"
                        f"{did_you_mean(inst.model, models)}; it serves {', '.join(models)}")
    if inst.region not in scenario.regions:
        problems.append(f"{where}.region: {inst.region!r} is not a region of scenario {scenario.name}"
                        f"{did_you_mean(inst.region, scenario.regions)}; its regions: {', '.join(scenario.regions)}")
    for cfg in sorted(set(inst.counts) | {n for st in inst.stages for n in st.nodes}):
        if cfg not in scenario.configs:
            problems.append(f"{where}.counts.{cfg}: {cfg!r} is not a node config of scenario {scenario.name}"
                            f"{did_you_mean(cfg, scenario.configs)}")
    return problems


def plan_problems(plan: Plan, catalog: Catalog, scenario: Scenario | None = None) -> list[str]:
    """Every problem of `plan` (field path: reason) against the catalog and the `scenario` served (None: any)."""
    problems = [] if plan.instances else ["instances: the plan has none, so there is nothing to deploy or serve"]
    offered = {(o.region, o.config) for o in catalog.offerings}
    for k, inst in enumerate(plan.instances):
        where = f"instances.{k} ({inst.id})"
        problems += instance_problems(inst, where, catalog, offered)
        if scenario is not None:
            problems += scenario_problems(inst, where, scenario)
    return problems


def check_plan(
    plan: Plan,
    catalog: Catalog,
    source: str = "plan",
    scenario: Scenario | None = None,
    limits: PlanLimits | None = None,
    outcome: str = "nothing was written",
) -> None:
    """Raise CoralInputError naming `source`, saying `outcome` and listing the problems (the first `MAX_LISTED`)
    if there are any: what would make rendering or running the plan fail or lie. In order, each step only when the
    one before passed: the caps (None: none; a plan past them is not read further), the schema again (the object
    may have been built or changed without validation), then `plan_problems`."""
    def refuse(problems: list[str]) -> None:
        if problems:
            more = [f"... and {len(problems) - MAX_LISTED} more"] if len(problems) > MAX_LISTED else []
            raise CoralInputError(f"{source}: {len(problems)} problem(s), {outcome}\n  "
                                  + "\n  ".join(problems[:MAX_LISTED] + more))

    if limits is not None:
        refuse(cap_problems(plan, limits))
    try:
        Plan.model_validate(plan.model_dump())
    except ValidationError as exc:
        raise CoralInputError(f"{format_validation_error(source, exc)}\n{outcome}") from None
    refuse(plan_problems(plan, catalog, scenario))
