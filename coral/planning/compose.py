"""Per-model composition of a search's rounds: the cheapest plan made of each model's part of some round where
that model met its target, within availability.

A model's attainment in the simulator depends on its own instances only (its requests are routed to them alone;
the models share nodes with no one), so a round where one model missed still shows what every other model's
instances attain. The bracket search moves every key at once, and the allocator reshuffles scarce nodes between
models as demand moves, so the cheapest passing part of each model often sits in different rounds: on core with 4
L40S GPUs at ≥ 99 %, the cheapest plan of the rounds cost $173.90/h where parts of them made one at $168.23/h.
Which parts may go together is an exact choice among few options (one part per model, the nodes of each region
and config at most what is available), solved as a small MIP with HiGHS. The search simulates the composed plan
as a round of its own (module `coral.planning.slo_search`) and keeps it only when it meets every target there.

The same independence lets the search refine one model at a time where models compete for scarce nodes: the
model planned alone (`alone`) within what the others' parts leave of the availability (`leftover`), the others
keeping their parts, so a round passes exactly when that model meets its target."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from coral.allocation.core import Availability
from coral.allocation.demand import DemandKey
from coral.allocation.milp import SparseRows, solve
from coral.allocation.plan import Plan, PlanInstance, SolveReport

#: (region, node config) -> nodes
NodeUse = Mapping[tuple[str, str], int]


@dataclass(frozen=True)
class Part:
    """One model's instances in one round's plan."""

    model: str
    round_index: int
    plan: Plan
    cost_per_hour: float
    nodes: NodeUse

    @property
    def signature(self) -> str:
        """Identical instances and capacity in two rounds: the same part."""
        return plan_key(self.plan, self.model)


def plan_key(plan: Plan, model: str | None = None) -> str:
    """What a plan (or one model's part of it) serves with: its instances and the capacity planned per key."""
    return json.dumps([sorted((i.model, i.template_id, i.region, sorted(i.counts.items())) for i in plan.instances
                              if model in (None, i.model)),
                       sorted((s.model, s.phase, round(s.capacity, 6)) for s in plan.serving
                              if model in (None, s.model))])


def node_use(instances: Sequence[PlanInstance]) -> dict[tuple[str, str], int]:
    use: Counter[tuple[str, str]] = Counter()
    for inst in instances:
        for config, n in inst.counts.items():
            use[(inst.region, config)] += n
    return dict(use)


def part_of(plan: Plan, model: str, round_index: int) -> Part:
    return Part(model, round_index, plan, sum(s.cost_per_hour for s in plan.serving if s.model == model),
                node_use([i for i in plan.instances if i.model == model]))


def seen_limits(plans: Sequence[Plan]) -> dict[tuple[str, str], int]:
    """Node limits safe without knowing the availability the plans were made within: per (region, config), the
    most any one of them uses (each plan kept within the availability, so no limit is above it)."""
    limits: dict[tuple[str, str], int] = {}
    for plan in plans:
        for key, n in node_use(plan.instances).items():
            limits[key] = max(limits.get(key, 0), n)
    return limits


def availability_limits(availability: Availability | str) -> dict[tuple[str, str], int] | None:
    """Node limits per (region, config) of an availability table; None: unlimited. A config a region does not
    list has none."""
    if isinstance(availability, str):
        return None
    return {(r, c): int(n) for r, configs in availability.items() for c, n in configs.items()}


def cheapest_parts(options: Mapping[str, Sequence[Part]],
                   limits: Mapping[tuple[str, str], int] | None) -> list[Part] | None:
    """One part per model, the cheapest set whose nodes stay within `limits` (None: no limit; a (region, config)
    it does not list: none available), or None when no such set exists (or, which a MIP of so few columns never
    meets, the solve stopped before proving its optimum)."""
    models = list(options)
    if not models or any(not options[m] for m in models):
        return None
    cols = [p for m in models for p in options[m]]
    rows = SparseRows(len(cols))
    start = 0
    for m in models:  # exactly one part per model
        n = len(options[m])
        rows.add(np.arange(start, start + n), np.ones(n), 1.0, 1.0)
        start += n
    if limits is not None:
        keys = sorted({k for p in cols for k in p.nodes})
        for key in keys:
            idx = [j for j, p in enumerate(cols) if p.nodes.get(key, 0) > 0]
            rows.add(np.array(idx), np.array([cols[j].nodes[key] for j in idx], dtype=float), 0.0,
                     float(limits.get(key, 0)))
    n_cols = len(cols)
    res = solve(np.array([p.cost_per_hour for p in cols]), np.zeros(n_cols), np.ones(n_cols),
                np.ones(n_cols, dtype=bool), rows, gap=0.0, time_limit=10.0)
    if res.x is None or res.status != "Optimal":  # a few columns: a limit never stops it short of the optimum
        return None
    return [cols[j] for j in range(n_cols) if res.x[j] > 0.5]


def composed_plan(parts: Sequence[Part]) -> Plan:
    """The plan made of `parts` (one per model): each model's instances, serving and request classes from its
    part's plan; the solve report names the round each part came from. No scale-up penalty: the search plans
    from scratch (its planners are given no running plan)."""
    first = parts[0].plan
    instances = [i for p in parts for i in p.plan.instances if i.model == p.model]
    serving = [s for p in parts for s in p.plan.serving if s.model == p.model]
    classes = {p.model: p.plan.request_classes[p.model] for p in parts if p.model in p.plan.request_classes}
    cost = sum(p.cost_per_hour for p in parts)
    report = SolveReport(status="Optimal", objective=cost, bound=cost, gap=0.0, n_variables=len(instances),
                         notes=["composed: " + ", ".join(f"{p.model} from round {p.round_index + 1}" for p in parts)],
                         safety_net="; ".join(dict.fromkeys(
                             p.plan.solve.safety_net for p in parts if p.plan.solve.safety_net)) or None)
    return first.model_copy(deep=True, update={
        "instances": [i.model_copy(deep=True) for i in instances], "serving": [s.model_copy(deep=True) for s in serving],
        "request_classes": {m: [c.model_copy(deep=True) for c in cs] for m, cs in classes.items()},
        "cost_per_hour": cost, "penalty_per_hour": 0.0, "solve": report, "slo": None})


def leftover(availability: Mapping[str, Mapping[str, int]], plan: Plan, model: str) -> dict[str, dict[str, int]]:
    """`availability` less the nodes the other models' instances of `plan` use: what `model` may plan within
    while they keep their parts."""
    used = node_use([i for i in plan.instances if i.model != model])
    return {r: {c: max(0, n - used.get((r, c), 0)) for c, n in cs.items()} for r, cs in availability.items()}


def alone(model: str, others: Plan,
          planner: Callable[[dict[DemandKey, float]], Plan]) -> Callable[[dict[DemandKey, float]], Plan]:
    """`planner` asked for `model`'s demand alone, its plan composed with the other models' parts of `others`:
    the other models' attainment stays theirs in `others`, so the plan passes when `model` meets its target."""

    def plan(demand: dict[DemandKey, float]) -> Plan:
        mine = planner({k: (v if k[0] == model else 0.0) for k, v in demand.items()})
        models = list(dict.fromkeys([s.model for s in others.serving] + [model]))
        out = composed_plan([part_of(mine if m == model else others, m, 0) for m in models])
        out.solve = mine.solve.model_copy(update={"notes": [*mine.solve.notes, f"{model} planned alone, the other "
                                                            "models' parts kept from the plan refined"]})
        return out

    return plan
