"""Bill of materials of a plan: which cloud instances to rent, how many, at what price, and for what.

Every node of every plan instance is one rented instance: its node config ('2xL40S') in its region maps to the
cheapest offering of that config there (the offering the allocator priced it with, `Catalog.prices`, and the one
`coral deploy` launches, `coral.deploy.common.offering`). Rows group identical offerings; their total equals the
plan's `cost_per_hour` when the plan was priced from the same offerings, and the bill says so when it was not.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from pydantic import BaseModel, Field

from coral.allocation.plan import Plan
from coral.catalog.loader import (
    Catalog,
    CoralInputError,
    builtin_catalog,
    builtin_scenarios,
    data_path,
    load_offerings,
    load_scenario,
    market_catalog,
)
from coral.catalog.schema import NodeOffering
from coral.deploy.common import offering

CSV_COLUMNS = (
    "cloud", "region", "instance_type", "gpu", "gpus_per_node", "count", "price_per_hour", "total_per_hour", "instances",
)  # fmt: skip


class BomRow(BaseModel):
    """One kind of cloud instance to rent: `count` of them at `price_per_hour` each."""

    cloud: str
    region: str
    instance_type: str
    gpu: str
    gpus_per_node: int
    count: int = Field(ge=0)
    price_per_hour: float = Field(ge=0, description="$/h of one instance")
    total_per_hour: float = Field(ge=0, description="$/h of all `count`")
    instances: list[str] = Field(description="ids of the plan instances using them")


class BillOfMaterials(BaseModel):
    """What to rent for a plan, its $/h, and whether that matches what the plan states."""

    scenario: str
    method: str
    offerings: str = Field(description="where the prices come from")
    rows: list[BomRow]
    total_per_hour: float = Field(description="$/h of every row")
    plan_cost_per_hour: float = Field(description="$/h the plan states")
    matches_plan: bool = Field(description="the total equals the plan's cost and every node has an offering")
    notes: list[str] = Field(default_factory=list, description="why the total differs from the plan's cost")

    def to_csv(self) -> str:
        """One CSV line per row (instance ids space-separated); the total is the sum of `total_per_hour`."""
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(CSV_COLUMNS)
        for r in self.rows:
            writer.writerow([r.cloud, r.region, r.instance_type, r.gpu, r.gpus_per_node, r.count,
                             r.price_per_hour, round(r.total_per_hour, 6), " ".join(r.instances)])
        return buf.getvalue()


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)


def _ids(ids: list[str], limit: int = 3) -> str:
    return ", ".join(ids[:limit]) + (f" and {len(ids) - limit} more" if len(ids) > limit else "")


def bill_of_materials(plan: Plan, catalog: Catalog, source: str = "the shipped offerings") -> BillOfMaterials:
    """The bill of `plan` at `catalog`'s offerings (`source` names them in the notes)."""
    rows: dict[tuple[str, str, str, str], tuple[NodeOffering, int, list[str]]] = {}
    missing: dict[tuple[str, str], list[str]] = {}
    repriced: list[tuple[str, float, float]] = []
    for inst in plan.instances:
        market_cost, priced = 0.0, True
        for config, n in sorted(inst.counts.items()):
            try:
                o = offering(catalog, config, inst.region)
            except CoralInputError:
                missing.setdefault((config, inst.region), []).append(inst.id)
                priced = False
                continue
            key = (o.cloud, o.region, o.instance_type, o.config)
            _, count, ids = rows.get(key, (o, 0, []))
            rows[key] = (o, count + n, ids if inst.id in ids else [*ids, inst.id])
            market_cost += n * o.price_per_hour
        if priced and not _close(market_cost, inst.cost_per_hour):
            repriced.append((inst.id, inst.cost_per_hour, market_cost))
    bom_rows = [
        BomRow(cloud=o.cloud, region=o.region, instance_type=o.instance_type, gpu=o.gpu, gpus_per_node=o.gpus_per_node,
               count=count, price_per_hour=o.price_per_hour, total_per_hour=count * o.price_per_hour, instances=ids)
        for o, count, ids in sorted(rows.values(), key=lambda r: (r[0].cloud, r[0].region, r[0].gpu,
                                                                   r[0].gpus_per_node, r[0].instance_type))
    ]
    total = sum(r.total_per_hour for r in bom_rows)
    notes = [
        f"no offering of {config} in {region} in {source} (instances {_ids(ids)}): the plan was made with another "
        "market; pass its offerings file with --offerings"
        for (config, region), ids in sorted(missing.items())
    ]
    if repriced:
        stated, market = sum(r[1] for r in repriced), sum(r[2] for r in repriced)
        notes.append(
            f"{len(repriced)} instance(s) ({_ids([r[0] for r in repriced])}) cost ${stated:,.2f}/h in the plan but "
            f"${market:,.2f}/h at {source}: the plan was priced from a different market file; re-plan with these "
            "offerings, or pass the plan's with --offerings"
        )
    instances_total = sum(i.cost_per_hour for i in plan.instances)
    if not _close(instances_total, plan.cost_per_hour):
        notes.append(f"the plan's instances add up to ${instances_total:,.2f}/h but the plan states "
                     f"${plan.cost_per_hour:,.2f}/h")
    if not notes and not _close(total, plan.cost_per_hour):
        notes.append(f"the rented instances cost ${total:,.2f}/h but the plan states ${plan.cost_per_hour:,.2f}/h")
    return BillOfMaterials(
        scenario=plan.scenario, method=plan.method, offerings=source, rows=bom_rows, total_per_hour=total,
        plan_cost_per_hour=plan.cost_per_hour, matches_plan=not notes, notes=notes,
    )


def plan_market(
    plan: Plan, offerings: Path | None = None, scenario: str | Path | None = None
) -> tuple[Catalog, str]:
    """The offerings to price `plan` at, and where they come from: `offerings` when given, else the `offerings`
    file of `scenario` (a built-in scenario name or a scenario file the caller names), else of the plan's
    scenario when it names a built-in one, else the shipped ones. The plan's `scenario` is never read as a path:
    a plan file must not make its reader open other files."""
    if offerings is not None:
        return load_offerings(offerings), str(offerings)
    if scenario is not None:
        sc = load_scenario(scenario)
    elif plan.scenario in builtin_scenarios():
        sc = load_scenario(data_path("scenarios", f"{plan.scenario}.yaml"))
    else:
        return builtin_catalog(), "the shipped offerings"
    if sc.offerings is None:
        return builtin_catalog(), "the shipped offerings"
    return market_catalog(sc), str(sc.offerings)
