"""The reference joint formulation for the exactness check (tiny instances only).

Instead of the two-stage pipeline (templates with their best placement, then the allocation ILP), one ILP
chooses node multisets *and* their placements directly: every (multiset, assignment of nodes to stages, layer
split, region) is a column with the throughput that placement achieves (slowest stage, a stage being the sum of
its nodes' T^S_j), and the ILP picks integer counts meeting demand within availability at least cost. No
dominance, no reductions, no placement solver: if the pipeline is exact, both reach the same optimal cost.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Literal

import numpy as np

from coral.allocation import milp
from coral.allocation.classes import class_ratings, demand_split, model_classes
from coral.allocation.demand import DemandKey
from coral.catalog.loader import Catalog, market_catalog
from coral.catalog.schema import Scenario
from coral.perf.model import Phase
from coral.templates.library import TemplateLibrary
from coral.templates.placement import all_placements


def placements(slots: tuple[int, ...], tables: np.ndarray) -> list[float]:
    """Throughput of every placement of the nodes `slots`; see `coral.templates.placement.all_placements`."""
    return list(all_placements(slots, tables))


def joint_cost(tables: np.ndarray, n_max: int, prices: list[dict[int, float]], availability: list[dict[int, int]],
               demand: float) -> float | None:
    """Optimal $/h of the joint ILP for one (model, phase) over regions (price and availability per config
    index), or None when infeasible."""
    n_cfg = tables.shape[1]
    cols: list[tuple[float, float, int, tuple[int, ...]]] = []  # throughput, $/h, region, slots
    for size in range(1, n_max + 1):
        for slots in itertools.combinations_with_replacement(range(n_cfg), size):
            thr = [t for t in placements(slots, tables) if t > 0]
            for r, pr in enumerate(prices):
                if all(c in pr for c in slots):
                    cost = sum(pr[c] for c in slots)
                    cols.extend((t, cost, r, slots) for t in thr)
    if not cols:
        return None
    n = len(cols)
    rows = milp.SparseRows(n)
    rows.add(np.arange(n), np.array([c[0] for c in cols]), demand, np.inf)
    for r, avail in enumerate(availability):
        for cfg, cap in avail.items():
            idx = [i for i, c in enumerate(cols) if c[2] == r and cfg in c[3]]
            if idx:
                rows.add(np.array(idx), np.array([float(cols[i][3].count(cfg)) for i in idx]), -np.inf, float(cap))
    res = milp.solve(np.array([c[1] for c in cols]), np.zeros(n), np.full(n, 1e4), np.ones(n, dtype=bool), rows,
                     time_limit=60.0, gap=1e-12)
    return res.objective



def plain_solve(library: TemplateLibrary, scenario: Scenario, availability: Mapping[str, Mapping[str, int]] | None,
                catalog: Catalog | None = None, time_limit: float = 300.0, *,
                demand: Mapping[DemandKey, float] | None = None, fraction: float | Mapping[DemandKey, float] = 1.0,
                objective: Literal["cost", "maxmin", "goodput"] = "cost",
                weights: Mapping[DemandKey, float] | None = None) -> milp.MilpResult:
    """The allocation written out directly, for checking the pipeline: one integer count per (usable template,
    region offering all its configs) and, for a (model, phase) with request classes, one continuous share per
    (count, class), with demand, share and availability rows; no reductions, cuts, column generation or warm
    start; HiGHS at gap 1e-9. `demand`: capacity to plan per (model, phase) (default: the scenario's).

    Objectives: "cost" min $/h with capacity ≥ fraction · D per key (`fraction` a number or per key); "maxmin"
    max t ≤ 1 with capacity ≥ t · w · D (the result's objective is −t); "goodput" max Σ w · f · D_decode over
    served fractions f ∈ [fraction, 1], one per model, with capacity ≥ f · D in both phases (objective
    −Σ w f D_decode: generated tokens/s served; D_prefill for a model with no decode demand). `weights` default
    1."""
    from coral.allocation.allocator import _keys_and_demand

    catalog = catalog or market_catalog(scenario)
    models = {sm.model: sm for sm in scenario.models}
    keys, planned = _keys_and_demand(scenario, demand)
    ints: list[tuple[int, int]] = []  # (template, region)
    cost: list[float] = []
    parts: list[tuple[DemandKey, np.ndarray, np.ndarray, np.ndarray]] = []  # key, columns, ratings (n, K), split
    for key, d in zip(keys, planned.tolist(), strict=True):
        m, phase = key
        rows = library.select(m, phase)
        rows = rows[library.throughput[rows] > 0]
        if d <= 0 or not len(rows):
            continue
        cls = model_classes(models[m])
        ratings = (class_ratings(library, rows, models[m], phase, cls, catalog) if len(cls) > 1
                   else library.throughput[rows][:, None].astype(float))
        idx_all, rat_all = [], []
        for r, region in enumerate(scenario.regions):
            offered_prices = catalog.prices(region)
            price = np.array([offered_prices.get(c, np.inf) if c in scenario.configs else np.inf
                              for c in library.configs])
            ok = ((library.counts[rows] > 0) <= np.isfinite(price)).all(axis=1)
            idx_all.append(np.arange(len(ints), len(ints) + int(ok.sum())))
            rat_all.append(ratings[ok])
            ints.extend((int(t), r) for t in rows[ok])
            cost.extend((library.counts[rows[ok]] * np.where(np.isfinite(price), price, 0.0)).sum(axis=1).tolist())
        parts.append((key, np.concatenate(idx_all), np.concatenate(rat_all), d * demand_split(cls, phase)))
    n_int = len(ints)
    n_share = sum(len(i) * len(dem) for _, i, _, dem in parts if len(dem) > 1)
    model_of = {m: i for i, m in enumerate(dict.fromkeys(key[0] for key, *_ in parts))}
    decoding = {key[0] for key, *_ in parts if key[1] == Phase.DECODE}
    n_served = 0 if objective == "cost" else 1 if objective == "maxmin" else len(model_of)
    n = n_int + n_share + n_served
    full_cost = np.concatenate([np.array(cost), np.zeros(n - n_int)]) if objective == "cost" else np.zeros(n)
    low, high = np.zeros(n), np.full(n, np.inf)
    high[:n_int] = 1e4
    rows_ = milp.SparseRows(n)
    nxt = n_int
    for key, idx, ratings, dem in parts:
        w = 1.0 if weights is None else float(weights.get(key, 1.0))
        f = fraction if isinstance(fraction, float | int) else float(fraction.get(key, 1.0))
        served = n_int + n_share + (0 if objective == "maxmin" else model_of[key[0]])
        if objective == "goodput":
            counts = key[1] == Phase.DECODE or key[0] not in decoding  # prompt tokens where nothing is generated
            full_cost[served] -= w * float(dem.sum()) if counts else 0.0
            low[served], high[served] = max(low[served], min(float(f), 1.0)), 1.0
        elif objective == "maxmin":
            full_cost[served], high[served] = -1.0, 1.0
        scale = w if objective == "maxmin" else 1.0
        if len(dem) == 1:
            cols, vals = idx, ratings[:, 0]
            _demand_row(rows_, cols, vals, float(dem[0]) * scale, objective == "cost", f, served)
            continue
        share = nxt + np.arange(len(idx) * len(dem)).reshape(len(idx), len(dem))
        nxt += share.size
        for c in range(len(dem)):
            _demand_row(rows_, share[:, c], ratings[:, c], float(dem[c]) * scale, objective == "cost", f, served)
        for k, j in enumerate(idx):
            rows_.add(np.concatenate([share[k], [j]]), np.concatenate([np.ones(len(dem)), [-1.0]]), -np.inf, 0.0)
    tpl = np.array([t for t, _ in ints], dtype=np.int64)
    reg = np.array([r for _, r in ints], dtype=np.int64)
    for r, region in enumerate(scenario.regions if availability is not None else []):
        for c, cfg in enumerate(library.configs):
            members = np.flatnonzero((reg == r) & (library.counts[tpl, c] > 0))
            if len(members):
                cap = float((availability or {}).get(region, {}).get(cfg, 0))
                rows_.add(members, library.counts[tpl[members], c].astype(float), -np.inf, cap)
    integer = np.arange(n) < n_int
    return milp.solve(full_cost, low, high, integer, rows_, time_limit=time_limit, gap=1e-9)


def _demand_row(rows: milp.SparseRows, cols: np.ndarray, vals: np.ndarray, demand: float, fixed: bool,
                fraction: float, served: int) -> None:
    """Σ vals · x[cols] ≥ fraction · demand (`fixed`), or ≥ demand · x[served]."""
    if fixed:
        rows.add(cols, vals, fraction * demand, np.inf)
    else:
        rows.add(np.append(cols, served), np.append(vals, -demand), 0.0, np.inf)


def plain_cost(library: TemplateLibrary, scenario: Scenario, availability: Mapping[str, Mapping[str, int]] | None,
               catalog: Catalog | None = None, time_limit: float = 300.0) -> float | None:
    """Optimal $/h of `plain_solve` at full demand; None when infeasible."""
    return plain_solve(library, scenario, availability, catalog, time_limit).objective
