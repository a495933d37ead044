"""Availability per (region, node config): explicit counts from the scenario, the market's (offerings with an
`available` count; the shipped scenarios' default, unlimited where the offerings set none), unlimited, or
derived from demand.

Headroom mode ({mode: headroom, factor: f}). The *estimated demand* E_c of node config c is the number of c
nodes in the cost-optimal plan with unlimited availability (the nodes the cheapest plan would want). The market
then offers f·E_c nodes of c in total, spread evenly over the regions of the scenario that sell c:

    A[r][c] = ceil(f · E_c / |R_c|)   for r in R_c (regions offering c),   0 elsewhere and for unused configs.

So f = 1.25 leaves 25% headroom on the cheapest plan's shapes, and spreading over regions forces a scarce plan
to use dearer regions or other shapes. Since E_c is Coral's own plan, the rule favours Coral's shapes: the
built-in "scarce" experiments use it (f = 1.25 core, 1.75 extended), the shipped scenarios plan in the market.
"""

from __future__ import annotations

import json
import math

from coral.allocation.core import UNLIMITED
from coral.catalog.loader import Catalog, market_catalog
from coral.catalog.schema import Scenario
from coral.templates.library import TemplateLibrary


def estimated_nodes(scenario: Scenario, library: TemplateLibrary, catalog: Catalog | None = None) -> dict[str, int]:
    """Nodes per config in the cost-optimal plan with unlimited availability (E_c above). Memoised per library
    object, scenario and prices: a re-planner resolving availability every epoch solves it once."""
    from coral.allocation.allocator import allocate

    catalog = catalog or market_catalog(scenario)

    def make() -> dict[str, int]:
        plan = allocate(library, scenario, availability=UNLIMITED, catalog=catalog, time_limit=30.0, gap=1e-6)
        out: dict[str, int] = {}
        for inst in plan.instances:
            for cfg, n in inst.counts.items():
                out[cfg] = out.get(cfg, 0) + n
        return out

    prices = json.dumps({r: catalog.prices(r) for r in scenario.regions}, sort_keys=True)
    return dict(library.memo(("estimated_nodes", scenario.model_dump_json(), prices), make))


def headroom_availability(scenario: Scenario, estimate: dict[str, int], factor: float,
                          catalog: Catalog | None = None) -> dict[str, dict[str, int]]:
    """A[r][c] = ceil(factor · E_c / |R_c|) over the regions R_c offering c."""
    catalog = catalog or market_catalog(scenario)
    offered = {r: catalog.prices(r) for r in scenario.regions}
    out: dict[str, dict[str, int]] = {r: {} for r in scenario.regions}
    for cfg in scenario.configs:
        sellers = [r for r in scenario.regions if cfg in offered[r]]
        for r in sellers:
            out[r][cfg] = math.ceil(factor * estimate.get(cfg, 0) / len(sellers) - 1e-9)
    return out


#: nodes standing for "as many as asked" for a config of a market that limits others (the allocator's explicit
#: tables list every config; a count no plan reaches)
PLENTY = 1_000_000


def market_availability(scenario: Scenario, catalog: Catalog | None = None) -> dict[str, dict[str, int]] | str:
    """Nodes per region and config that the market offers: the sum of the offerings' `available` counts of each
    (region, config); a config with an offering without a count is unlimited ("unlimited" when all are)."""
    catalog = catalog or market_catalog(scenario)
    out: dict[str, dict[str, int]] = {r: {} for r in scenario.regions}
    limited = False
    for o in catalog.offerings:
        if o.region not in out or o.config not in scenario.configs:
            continue
        have = out[o.region].get(o.config, 0)
        if o.available is None or have >= PLENTY:
            out[o.region][o.config] = PLENTY
        else:
            out[o.region][o.config] = have + o.available
            limited = True
    return out if limited else UNLIMITED


def resolve_availability(scenario: Scenario, library: TemplateLibrary, catalog: Catalog | None = None,
                         factor: float | None = None) -> dict[str, dict[str, int]] | str:
    """Node counts per region and config ("unlimited" for none): the scenario's explicit table, the market's
    counts (`market_availability`), or the headroom rule (module doc). `factor` overrides the scenario's headroom
    factor (and forces headroom mode)."""
    if factor is None and isinstance(scenario.availability, dict):
        return {r: dict(scenario.availability.get(r, {})) for r in scenario.regions}
    if factor is None and scenario.availability == "market":
        return market_availability(scenario, catalog)
    if factor is None and scenario.availability == UNLIMITED:
        return UNLIMITED
    f = factor if factor is not None else getattr(scenario.availability, "factor", 3.0)
    return headroom_availability(scenario, estimated_nodes(scenario, library, catalog), f, catalog)
