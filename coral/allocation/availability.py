"""Availability per (region, node config): explicit counts from the scenario, the market's (offerings with an
`available` count; the shipped scenarios' default, unlimited where the offerings set none), unlimited, or
derived from demand. (`coral.allocation.allocator.resolve_availability` picks among them: the headroom rule
needs the allocator's own unlimited plan.)

Headroom mode ({mode: headroom, factor: f}). The *estimated demand* E_c of node config c is the number of c
nodes in the cost-optimal plan with unlimited availability (the nodes the cheapest plan would want). The market
then offers f·E_c nodes of c in total, spread evenly over the regions of the scenario that sell c:

    A[r][c] = ceil(f · E_c / |R_c|)   for r in R_c (regions offering c),   0 elsewhere and for unused configs.

So f = 1.25 leaves 25% headroom on the cheapest plan's shapes, and spreading over regions forces a scarce plan
to use dearer regions or other shapes. Since E_c is Coral's own plan, the rule favours Coral's shapes: only the
built-in "below" and "epochs" experiments use it; the shipped scenarios plan in the market, and the "scarce"
experiment in market files of its own (`coral/data/markets/`).
"""

from __future__ import annotations

import math

from coral.allocation.core import UNLIMITED
from coral.catalog.loader import Catalog, market_catalog
from coral.catalog.schema import Scenario


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
