"""Shared machinery of the allocator and the baselines: the market (prices, availability), candidate columns
(template, region), the MILP assembly, a greedy warm start and turning a solution into a `Plan`."""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Literal

import numpy as np

from coral.allocation.classes import KeyClasses
from coral.allocation.demand import DemandKey
from coral.allocation.plan import ModelServing, Plan, PlanClass, PlanInstance, SolveReport
from coral.allocation.reductions import pareto_columns
from coral.allocation.rows import key_rows
from coral.allocation.solver import Problem
from coral.catalog.loader import Catalog, CoralInputError
from coral.catalog.schema import Scenario
from coral.catalog.suggest import did_you_mean
from coral.perf.model import Phase
from coral.templates.library import TemplateLibrary

if TYPE_CHECKING:
    from coral.allocation.latency import KeyLatency

UNLIMITED = "unlimited"  # availability: no limit on any node config
Availability = Mapping[str, Mapping[str, int]]
Running = Mapping[tuple[int, str], int]
GREEDY_PER_GROUP = 64


@dataclass(frozen=True)
class SlackPrice:
    """Capacity above demand priced in the cost objective: up to `share` × a key's demand of surplus is worth
    `price` × the key's cheapest $/h per token/s (its cheapest column's). With `price` < 1 no instance is bought
    for its slack alone (any capacity costs at least the cheapest rate), but where whole instances make one plan
    carry slack that another, a little cheaper, trims, the slack is kept when it costs under `price` of its
    cheapest rate: the slack a coarser plan carries for free. Demand itself is always met in full."""

    share: float = 0.15
    price: float = 0.8

    def __post_init__(self) -> None:
        if not 0 <= self.share <= 1:
            raise CoralInputError(f"slack share: must be in [0, 1], not {self.share}")
        if not 0 <= self.price < 1:
            raise CoralInputError(f"slack price: must be in [0, 1) of the cheapest rate, not {self.price}")


@dataclass
class Market:
    """Regions × library configs: $/node-hour (inf where not offered or not a scenario config) and node counts
    available (inf = unlimited)."""

    regions: list[str]
    configs: list[str]
    price: np.ndarray
    avail: np.ndarray


def make_market(library: TemplateLibrary, scenario: Scenario, catalog: Catalog,
                availability: Availability | None) -> Market:
    regions = list(scenario.regions)
    price = np.full((len(regions), len(library.configs)), np.inf)
    avail = np.full_like(price, np.inf)
    for r, region in enumerate(regions):
        offered = catalog.prices(region)
        for c, cfg in enumerate(library.configs):
            if cfg in scenario.configs and cfg in offered:
                price[r, c] = offered[cfg]
        if availability is not None:
            given = availability.get(region, {})
            for cfg, n in given.items():
                if cfg not in library.configs:
                    raise CoralInputError(f"availability.{region}: config {cfg!r} is not in the template library"
                                          f"{did_you_mean(cfg, library.configs)}")
                if n < 0:
                    raise CoralInputError(f"availability.{region}.{cfg}: count must be >= 0")
            avail[r] = [float(given.get(cfg, 0)) for cfg in library.configs]
    for region in (availability or {}):
        if region not in regions:
            raise CoralInputError(f"availability: region {region!r} is not in the scenario's regions"
                                  f"{did_you_mean(region, regions)}")
    return Market(regions, list(library.configs), price, avail)


@dataclass
class Columns:
    """Candidate (template, region) pairs with what the MILP needs of each. For a key planned with request
    classes, `class_thr[j]` holds column j's tokens/s per class (zero-padded), `split[key]` each class's fraction
    of the key's demand, and `throughput` the rating of the key's class mix in proportion to demand,
    1 / Σ_c split_c / T_c (0 when a class cannot run on the template). `shortfall[j]`: the pooled latency row's
    coefficient per token/s (`KeyLatency.shortfall`; 0 for a key without a rating)."""

    template: np.ndarray
    region: np.ndarray
    key: np.ndarray
    throughput: np.ndarray
    cost: np.ndarray
    counts: np.ndarray
    running: np.ndarray
    upper: np.ndarray
    dropped: int = 0
    class_thr: np.ndarray | None = None
    split: dict[int, np.ndarray] = field(default_factory=dict)
    shortfall: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def __len__(self) -> int:
        return len(self.template)


def running_counts(running: Plan | Running | None, library: TemplateLibrary) -> dict[tuple[int, str], int]:
    """Running instances per (template id, region), from a previous plan or a mapping."""
    if running is None:
        return {}
    if isinstance(running, Plan):
        out: dict[tuple[int, str], int] = {}
        for inst in running.instances:
            key = (inst.template_id, inst.region)
            out[key] = out.get(key, 0) + 1
            if inst.template_id >= len(library) or library.model[inst.template_id] != inst.model \
                    or library.phase[inst.template_id] != inst.phase:
                raise CoralInputError(f"running: instance {inst.id} does not match template {inst.template_id} "
                                      "of this library (re-plan with the library it was made from)")
        return out
    return {(int(t), str(r)): int(n) for (t, r), n in running.items() if n > 0}


def make_columns(
    library: TemplateLibrary,
    keys: list[DemandKey],
    market: Market,
    demand: np.ndarray,
    running: dict[tuple[int, str], int],
    *,
    reduce: bool = True,
    homogeneous: bool = False,
    classes: Mapping[int, KeyClasses] | None = None,
    latency: Mapping[int, KeyLatency] | None = None,
) -> Columns:
    """Columns for every key with positive demand. With `reduce`, dominated templates (see reductions) and
    columns that cannot be used once are dropped; running columns are always kept. `homogeneous` keeps only
    single-config templates (the baselines). `classes`: keys planned with request classes (by key index).
    `latency` (not with `homogeneous`): per key index, its rating (`coral.allocation.latency`): only its kept
    templates are columns (running or not), its candidates stand for the undominated ones, and each column's
    `shortfall` is set."""
    classes = classes or {}
    latency = latency or {}
    region_idx = {r: i for i, r in enumerate(market.regions)}
    run_pairs: dict[int, set[int]] = {}
    for (t, reg_name), _n in running.items():
        if reg_name not in region_idx:
            raise CoralInputError(f"running: region {reg_name!r} is not in the scenario's regions"
                                  f"{did_you_mean(reg_name, market.regions)}")
        run_pairs.setdefault(t, set()).add(region_idx[reg_name])
    parts: list[tuple[np.ndarray, np.ndarray, int]] = []
    total = 0
    for k, (model, phase_) in enumerate(keys):
        if demand[k] <= 0:
            continue
        usable, kept = key_rows(library, model, str(phase_), homogeneous)
        if k in latency:  # rated on the key's usable rows (`key_rows`): its kept templates are among them
            usable, kept = latency[k].kept, latency[k].candidates
        if k in classes:
            kept = np.union1d(np.intersect1d(classes[k].kept, usable), kept)
        total += len(usable) * len(market.regions)
        rows = usable
        if reduce:
            ran = np.array(sorted(t for t in run_pairs if library.model[t] == model and library.phase[t] == phase_
                                  and library.throughput[t] > 0), dtype=np.int64)
            ran = ran[np.isin(ran, usable)]
            rows = np.union1d(kept, ran) if len(ran) else kept
        cnt = library.counts[rows]
        for r in range(len(market.regions)):
            offered = ((cnt > 0) <= np.isfinite(market.price[r])).all(axis=1)
            ok = offered
            if reduce:
                fits = (cnt <= market.avail[r]).all(axis=1)
                ok = offered & fits
            if run_pairs:
                ok |= np.isin(rows, [t for t, regs in run_pairs.items() if r in regs]) & offered
            sel = rows[ok]
            parts.append((sel, np.full(len(sel), r), k))
    template = np.concatenate([q[0] for q in parts]) if parts else np.zeros(0, dtype=np.int64)
    region = np.concatenate([q[1] for q in parts]) if parts else np.zeros(0, dtype=np.int64)
    key = np.concatenate([np.full(len(q[0]), q[2]) for q in parts]) if parts else np.zeros(0, dtype=np.int64)
    counts = library.counts[template]
    price = np.where(np.isfinite(market.price), market.price, 0.0)
    cost = (counts * price[region]).sum(axis=1)
    thr = library.throughput[template].astype(float)
    shortfall = np.zeros(len(template))
    for k, kl in latency.items():
        on = key == k
        shortfall[on] = kl.shortfall(template[on])
    class_thr = None
    split: dict[int, np.ndarray] = {}
    if classes:
        width = max(len(kc.classes) for kc in classes.values())
        class_thr = np.zeros((len(template), width))
        for k, kc in classes.items():
            on = key == k
            class_thr[on, :len(kc.classes)] = kc.rating_of(template[on])
            split[k] = kc.split
            with np.errstate(divide="ignore"):
                inv = (kc.split / class_thr[on, :len(kc.classes)]).sum(axis=1)
            thr[on] = np.where(np.isfinite(inv) & (inv > 0), 1.0 / inv, 0.0)
    run = np.zeros(len(template))
    for (t, reg), n in running.items():
        run[(template == t) & (region == region_idx[reg])] = n
    if reduce and len(template):
        usage = np.where(np.isfinite(market.avail[region]), counts, 0)  # scarce nodes, compared within one region
        ratings = thr[:, None] if class_thr is None else np.where(np.isin(key, list(split))[:, None], class_thr,
                                                                   thr[:, None])
        if (shortfall > 0).any():  # the pooled row's room, Σ T (share − level): no more of it used is better
            ratings = np.concatenate([ratings, -(thr * shortfall)[:, None]], axis=1)
        alive = skyline(key * len(market.regions) + region, cost, ratings, usage, run > 0)
        template, region, key, thr, cost, counts, run, shortfall = (
            a[alive] for a in (template, region, key, thr, cost, counts, run, shortfall))
        class_thr = None if class_thr is None else class_thr[alive]
    counts = counts.astype(np.int64)
    with np.errstate(divide="ignore", invalid="ignore"):
        cap = np.where(counts > 0, np.floor(market.avail[region] / np.maximum(counts, 1)), np.inf).min(axis=1)
    with np.errstate(divide="ignore"):
        need = np.ceil(demand[key] / thr - 1e-9) if len(key) else np.zeros(0)
        for k in split:  # an instance is useless past serving all of the classes it can run
            on = key == k
            ct = class_thr[on, :len(split[k])] if class_thr is not None else np.zeros((0, 0))
            need[on] = np.ceil((demand[k] * split[k] / np.where(ct > 0, ct, np.inf)).sum(axis=1) - 1e-9)
    return Columns(template, region, key, thr, cost, counts, run, np.minimum(cap, need),
                   dropped=total - len(template), class_thr=class_thr, split=split, shortfall=shortfall)


def skyline(group: np.ndarray, cost: np.ndarray, ratings: np.ndarray, usage: np.ndarray, keep: np.ndarray
            ) -> np.ndarray:
    """`pareto_columns`, faster with several ratings (the pooled latency row's room beside throughput): every
    column is first compared with the skyline of each rating alone (a one-rating skyline is a running maximum),
    and only the columns none of those dominates go through the full skyline. Exact: a column that a dropped
    one dominates is dominated by what dropped it too (dominance and the skyline's order are transitive)."""
    if ratings.shape[1] == 1:
        return pareto_columns(group, cost, ratings, usage, keep)
    n = len(cost)
    usage = usage.reshape(n, -1)
    usage = usage[:, (usage > 0).any(axis=0)]  # the scarce configs any column uses
    order = np.lexsort((np.arange(n), usage.sum(axis=1), -ratings.sum(axis=1), cost, group))
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    seeds = np.zeros(n, dtype=bool)
    for r in range(ratings.shape[1]):
        seeds |= pareto_columns(group, cost, ratings[:, r], np.zeros((n, 0)), keep) & ~keep
    alive = np.ones(n, dtype=bool)
    for g in np.unique(group[seeds]):
        mine = np.flatnonzero((group == g) & ~keep)
        by = np.flatnonzero(seeds & (group == g))
        for lo in range(0, len(mine), 512):
            j = mine[lo:lo + 512]
            dom = ((rank[by][None, :] < rank[j][:, None]) & (cost[by][None, :] <= cost[j][:, None])
                   & (ratings[by][None] >= ratings[j][:, None]).all(axis=2)
                   & (usage[by][None] <= usage[j][:, None]).all(axis=2))
            alive[j] = ~dom.any(axis=1)
    rest = np.flatnonzero(alive & ~keep)
    out = keep.copy()
    out[rest] = pareto_columns(group[rest], cost[rest], ratings[rest], usage[rest], np.zeros(len(rest), dtype=bool))
    return out


@dataclass
class Layout:
    """Where each kind of variable sits in a Problem."""

    n_x: int
    penalty_of: np.ndarray  # column index of I_j for every running x column j
    t_col: int | None  # the max-min objective's t
    demand_rows: dict[int, int]  # key -> row (keys without classes)
    avail_rows: list[tuple[int, int]]
    n_vars: int
    class_rows: dict[int, list[int]] = field(default_factory=dict)  # key -> one row per class
    avail_row0: int = 0
    share_start: int = 0  # share variables s (column j, class c) from here on
    share_parent: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    share_class: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    served_col: dict[int, int] = field(default_factory=dict)  # key -> its served fraction f_k (goodput)
    priced_col: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # priced slack (`SlackPrice`)
    priced_row: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # ... and its demand row
    latency_rows: dict[int, int] = field(default_factory=dict)  # key -> its pooled latency row


def assemble(
    cols: Columns,
    market: Market,
    demand: np.ndarray,
    *,
    penalty_k: float | None,
    objective: Literal["cost", "maxmin", "goodput"] = "cost",
    weights: np.ndarray | None = None,
    min_fraction: float | np.ndarray | None = None,
    served_group: np.ndarray | None = None,
    gain: np.ndarray | None = None,
    slack: SlackPrice | None = None,
) -> tuple[Problem, Layout]:
    """The MILP of `cols` (w = `weights`, default 1; `min_fraction` a number or one per key, default 1):
    "cost" min $/h (+ scale-up penalty; `penalty_k` None disables it) with capacity ≥ min_fraction·w·D;
    "maxmin" max t ≤ 1 with capacity ≥ t·w·D; "goodput" max Σ gain_k·f_k (default gain w·D / Σ D: the weighted
    tokens/s served) over served fractions f ∈ [min_fraction, 1] with capacity ≥ f·D, one f per group of
    keys (`served_group`, e.g. a model's prefill and decode: a request needs both; default one per key). A
    group's floor row f ≥ max min_fraction of its keys is feasible by the phase-one pricing of the solver
    whenever some solution is.

    A key with request classes (`cols.split`) has one demand row per class, and every column j of it a share
    variable s_jc ≥ 0 per class it can run (T_jc > 0): Σ_c s_jc ≤ x_j and Σ_j T_jc s_jc ≥ split_c·D.

    With `slack` (cost only), every demand row asks (1 + share)·D and gets a priced slack column v ∈ [0, share·D]
    at price × the key's cheapest $/h per token/s: capacity ≥ D stays a hard requirement, and each token/s above
    it, up to share·D, lowers the objective by that price (`SlackPrice`).

    Every key with a latency rating some of whose columns fall short of its level has the pooled latency row
    Σ_j T_j (level − share_j) x_j / D ≤ 0 (`coral.allocation.latency`; `cols.shortfall`), in every objective."""
    n = len(cols)
    maxmin = objective != "cost"  # capacity rows against a served-fraction variable, no artificial slack
    weights = weights if weights is not None else np.ones(len(demand))
    k_pen = penalty_k or 0.0
    running = np.flatnonzero(cols.running > 0) if k_pen > 0 and not maxmin else np.zeros(0, dtype=np.int64)
    n_pen = len(running)
    keys = [k for k in range(len(demand)) if demand[k] > 0]
    items = [(k, c) for k in keys for c in (range(len(cols.split[k])) if k in cols.split else [-1])]
    t_col = n + n_pen if objective == "maxmin" else None
    served_col: dict[int, int] = {}
    if objective == "goodput":
        group_of = np.arange(len(demand)) if served_group is None else np.asarray(served_group)
        first = {g: i for i, g in enumerate(dict.fromkeys(int(group_of[k]) for k in keys))}
        served_col = {k: n + n_pen + first[int(group_of[k])] for k in keys}
    n_served = len(set(served_col.values()))
    n_slack = 0 if maxmin else len(items)
    slack = None if maxmin else slack
    n_priced = len(items) if slack is not None else 0
    share_start = n + n_pen + (1 if t_col is not None else 0) + n_served + n_slack + n_priced
    on_class = np.isin(cols.key, list(cols.split)) if cols.split else np.zeros(n, dtype=bool)
    if cols.class_thr is not None:
        share_parent, share_class = np.nonzero((cols.class_thr > 0) & on_class[:, None])
    else:
        share_parent = share_class = np.zeros(0, dtype=np.int64)
    n_vars = share_start + len(share_parent)
    er: list[np.ndarray] = []
    ec: list[np.ndarray] = []
    ev: list[np.ndarray] = []
    lower: list[float] = []
    upper: list[float] = []
    demand_rows: dict[int, int] = {}
    class_rows: dict[int, list[int]] = {}
    floor = np.broadcast_to(np.asarray(1.0 if min_fraction is None else min_fraction, dtype=float), demand.shape)
    target = demand * weights * floor
    rating = np.where(cols.throughput > 0, cols.throughput, np.inf)
    if cols.class_thr is not None:
        rating = np.minimum(rating, np.where(cols.class_thr > 0, cols.class_thr, np.inf).min(axis=1))
    big = 1e6 * float(max((cols.cost / rating).max(initial=1.0), 1.0))
    item_target: list[float] = []
    priced_row: list[int] = []
    grow = 1.0 + (slack.share if slack is not None else 0.0)
    for i, (k, c) in enumerate(items):
        r = len(lower)
        frac = 1.0 if c < 0 else float(cols.split[k][c])
        if c < 0:
            demand_rows[k] = r
            members = np.flatnonzero(cols.key == k)
            er.append(np.full(len(members), r))
            ec.append(members)
            ev.append(cols.throughput[members])
        else:
            class_rows.setdefault(k, []).append(r)
            sh = np.flatnonzero((cols.key[share_parent] == k) & (share_class == c))
            er.append(np.full(len(sh), r))
            ec.append(share_start + sh)
            ev.append(cols.class_thr[share_parent[sh], c] if cols.class_thr is not None else np.zeros(0))
        if maxmin:
            er.append(np.array([r]))
            ec.append(np.array([t_col if t_col is not None else served_col[k]]))
            ev.append(np.array([-demand[k] * frac * (weights[k] if t_col is not None else 1.0)]))
            lower.append(0.0)
        else:
            own = np.array([n + n_pen + i] + ([n + n_pen + n_slack + i] if slack is not None else []))
            er.append(np.full(len(own), r))
            ec.append(own)
            ev.append(np.ones(len(own)))
            lower.append(float(target[k] * frac * grow))
            item_target.append(float(target[k] * frac))
            if slack is not None:
                priced_row.append(r)
        upper.append(np.inf)
    group_floor: dict[int, float] = {}
    for k, col in served_col.items():
        group_floor[col] = max(group_floor.get(col, 0.0), float(min(floor[k], 1.0)))
    for col, least in group_floor.items():  # f ≥ its floor
        er.append(np.array([len(lower)]))
        ec.append(np.array([col]))
        ev.append(np.array([1.0]))
        lower.append(least)
        upper.append(np.inf)
    avail_row0 = len(lower)
    avail_rows: list[tuple[int, int]] = []
    use = np.zeros_like(market.avail)
    if n:
        np.add.at(use, cols.region, cols.counts * np.where(np.isfinite(cols.upper), cols.upper, 1e9)[:, None])
    for r in range(len(market.regions)):
        for c in range(len(market.configs)):
            if np.isfinite(market.avail[r, c]) and use[r, c] > market.avail[r, c]:
                members = np.flatnonzero((cols.region == r) & (cols.counts[:, c] > 0))
                row = len(lower)
                avail_rows.append((r, c))
                er.append(np.full(len(members), row))
                ec.append(members)
                ev.append(cols.counts[members, c].astype(float))
                lower.append(-np.inf)
                upper.append(float(market.avail[r, c]))
    latency_rows: dict[int, int] = {}
    for k in keys:  # the pooled latency row, scaled by the key's demand
        members = np.flatnonzero(cols.key == k)
        if len(cols.shortfall) and (cols.shortfall[members] > 0).any():
            latency_rows[k] = len(lower)
            er.append(np.full(len(members), len(lower)))
            ec.append(members)
            ev.append(cols.throughput[members] * cols.shortfall[members] / demand[k])
            lower.append(-np.inf)
            upper.append(0.0)
    if len(share_parent):  # Σ_c s_jc − x_j ≤ 0 for every column with shares
        parents, link = np.unique(share_parent, return_inverse=True)
        row0 = len(lower)
        er.extend([row0 + link, row0 + np.arange(len(parents))])
        ec.extend([share_start + np.arange(len(share_parent)), parents])
        ev.extend([np.ones(len(share_parent)), -np.ones(len(parents))])
        lower.extend([-np.inf] * len(parents))
        upper.extend([0.0] * len(parents))
    for i, j in enumerate(running):
        row = len(lower)
        kc = k_pen * cols.cost[j]
        er.append(np.array([row, row]))
        ec.append(np.array([n + i, j]))
        ev.append(np.array([1.0, -kc]))
        lower.append(-kc * cols.running[j])
        upper.append(np.inf)
    if not maxmin:
        for k in cols.split:  # Σ_j T_jc x_j ≥ split_c·D, implied by s_jc ≤ x_j: integer rows the solver can round
            if k not in keys or cols.class_thr is None:
                continue
            for c, frac in enumerate(cols.split[k]):
                members = np.flatnonzero((cols.key == k) & (cols.class_thr[:, c] > 0))
                er.append(np.full(len(members), len(lower)))
                ec.append(members)
                ev.append(cols.class_thr[members, c])
                lower.append(float(target[k] * frac))
                upper.append(np.inf)
        _rounding_cuts(cols, keys, target, er, ec, ev, lower, upper)
    cost = np.zeros(n_vars)
    ub = np.zeros(n_vars)
    integer = np.zeros(n_vars, dtype=bool)
    protected = np.zeros(n_vars, dtype=bool)
    artificial = np.zeros(n_vars, dtype=bool)
    group = np.full(n_vars, -1, dtype=np.int64)
    score = np.zeros(n_vars)
    ub[:n] = np.where(np.isfinite(cols.upper), cols.upper, 1e9)
    integer[:n] = True
    group[:n] = cols.key * len(market.regions) + cols.region
    score[:n] = cols.throughput / np.maximum(cols.cost, 1e-12)
    protected[running] = True
    if not maxmin:
        cost[:n] = cols.cost * np.where(cols.running > 0, 1.0, 1.0 + k_pen)
        cost[n:n + n_pen] = 1.0
        ub[n:n + n_pen] = k_pen * cols.cost[running] * ub[running]
        protected[n:n + n_pen] = True
        for i, tgt in enumerate(item_target):
            s = n + n_pen + i
            cost[s], ub[s], artificial[s] = big, tgt * grow, True
        if slack is not None:
            rate = np.full(len(demand), np.inf)
            np.minimum.at(rate, cols.key, np.where(cols.throughput > 0, cols.cost / np.where(
                cols.throughput > 0, cols.throughput, 1.0), np.inf))
            for i, ((k, _c), tgt) in enumerate(zip(items, item_target, strict=True)):
                s = n + n_pen + n_slack + i
                cost[s] = slack.price * (float(rate[k]) if np.isfinite(rate[k]) else 0.0)
                ub[s] = slack.share * tgt
    elif t_col is not None:
        cost[t_col], ub[t_col], protected[t_col] = -1.0, 1.0, True
    else:
        per_key = gain if gain is not None else weights * demand / max(float(demand[keys].sum()), 1e-12)
        for k, col in served_col.items():
            cost[col] -= per_key[k]
            ub[col], protected[col] = 1.0, True
    ub[share_start:] = ub[share_parent]
    group[share_start:] = group[share_parent]
    entry_row = np.concatenate(er) if er else np.zeros(0, dtype=np.int64)
    entry_col = np.concatenate(ec) if ec else np.zeros(0, dtype=np.int64)
    entry_val = np.concatenate(ev) if ev else np.zeros(0)
    parent = np.full(n_vars, -1, dtype=np.int64)
    parent[share_start:] = share_parent
    problem = Problem(cost, ub, integer, entry_row.astype(np.int64), entry_col.astype(np.int64), entry_val,
                      np.array(lower), np.array(upper), protected, score, group, artificial, parent)
    pen_of = np.full(n, -1, dtype=np.int64)
    pen_of[running] = n + np.arange(n_pen)
    priced = n + n_pen + n_slack + np.arange(n_priced, dtype=np.int64)
    return problem, Layout(n, pen_of, t_col, demand_rows, avail_rows, n_vars, class_rows, avail_row0, share_start,
                           share_parent, share_class, served_col, priced, np.array(priced_row, dtype=np.int64),
                           latency_rows)


CUTS_PER_KEY = 6


def _rounding_cuts(cols: Columns, keys: list[int], target: np.ndarray, er: list[np.ndarray], ec: list[np.ndarray],
                   ev: list[np.ndarray], lower: list[float], upper: list[float]) -> None:
    """Chvátal-Gomory rounding cuts of every key's capacity row Σ_j R_j x_j ≥ D (integer x ≥ 0; R_j = T_j, or
    for a key with classes its best class rating, since Σ_c s_jc ≤ x_j): Σ_j ⌈u R_j⌉ x_j ≥ ⌈u D⌉ for u = 1/R_j
    of the CUTS_PER_KEY most cost-efficient columns and u = 1/D. They tighten the LP bound (an instance is
    bought whole) without removing any integer point. CUTS_PER_KEY = 0 disables them (benchmarks compare)."""
    if not CUTS_PER_KEY:
        return
    rating = cols.throughput.copy()
    if cols.class_thr is not None and cols.split:
        on = np.isin(cols.key, list(cols.split))
        rating[on] = cols.class_thr[on].max(axis=1)
    for k in keys:
        members = np.flatnonzero((cols.key == k) & (rating > 0))
        d = float(target[k])
        if not len(members) or d <= 0:
            continue
        best = members[np.argsort(cols.cost[members] / rating[members], kind="stable")]
        scales = np.unique(np.concatenate([1.0 / rating[best[:CUTS_PER_KEY]], [1.0 / d]]))
        for u in scales:
            rhs = math.ceil(u * d - 1e-6)
            coef = np.ceil(u * rating[members] - 1e-9)
            row = len(lower)
            er.append(np.full(len(members), row))
            ec.append(members)
            ev.append(coef)
            lower.append(float(rhs))
            upper.append(np.inf)


def _running_kept(cols: Columns, market: Market) -> tuple[np.ndarray, np.ndarray]:
    """The running instances that fit the availability (instance vector, nodes used per region and config)."""
    x = np.zeros(len(cols))
    used = np.zeros_like(market.avail)
    for j in np.flatnonzero(cols.running > 0):
        for _ in range(int(min(cols.running[j], cols.upper[j]))):
            if (used[cols.region[j]] + cols.counts[j] <= market.avail[cols.region[j]]).all():
                x[j] += 1
                used[cols.region[j]] += cols.counts[j]
    return x, used


def _short_list(cols: Columns, market: Market) -> np.ndarray:
    """Columns the greedy plans look at first: the GREEDY_PER_GROUP most tokens/s per $ of each (key, region),
    and every running column."""
    group = cols.key * len(market.regions) + cols.region
    by_eff = np.lexsort((-cols.throughput / np.maximum(cols.cost, 1e-12), group))
    g = group[by_eff]
    rank = np.arange(len(g)) - np.searchsorted(g, g)
    short = np.zeros(len(cols), dtype=bool)
    short[by_eff[rank < GREEDY_PER_GROUP]] = True
    return short | (cols.running > 0)


def _cheapest_fit(cols: Columns, market: Market, idx: np.ndarray, x: np.ndarray, used: np.ndarray,
                  residual: float, room: float) -> int | None:
    """Among columns `idx` (of one key), the instance with the least $ per useful token/s (cost / min(throughput,
    residual)) that fits the availability left and the `room` left in its key's pooled latency row (Σ T
    (share − level) x); None when none fits."""
    fits = (used[cols.region[idx]] + cols.counts[idx] <= market.avail[cols.region[idx]]).all(axis=1)
    fits &= x[idx] < cols.upper[idx]
    if len(cols.shortfall):
        fits &= cols.throughput[idx] * cols.shortfall[idx] <= room + 1e-12 * cols.throughput[idx]
    if not fits.any():
        return None
    with np.errstate(divide="ignore"):
        score = np.where(fits, cols.cost[idx] / np.minimum(cols.throughput[idx], residual), np.inf)
    return int(idx[int(np.argmin(score))])


def _add(cols: Columns, market: Market, k: int, short: np.ndarray, x: np.ndarray, used: np.ndarray,
         residual: float) -> int | None:
    """Add key `k`'s cheapest fitting instance (`_cheapest_fit`, short list first, then all its columns) to `x`
    and `used`; the column added, or None when none fits."""
    mine = cols.key == k
    room = -float((cols.throughput[mine] * cols.shortfall[mine]) @ x[mine]) if len(cols.shortfall) else 0.0
    j = _cheapest_fit(cols, market, np.flatnonzero(mine & short), x, used, residual, room)
    if j is None:
        j = _cheapest_fit(cols, market, np.flatnonzero(mine & ~short), x, used, residual, room)
    if j is not None:
        x[j] += 1
        used[cols.region[j]] += cols.counts[j]
    return j


def greedy(cols: Columns, market: Market, target: np.ndarray, partial: bool = False) -> np.ndarray | None:
    """A feasible instance vector meeting `target` per key, or None: keep what runs (while it fits), then, key by
    key (largest demand first), add the instance with the least $ per useful token/s (cost / min(throughput,
    residual)) until demand is met. `partial` keeps going when a key cannot be met (most tokens/s served, the
    goodput start)."""
    x, used = _running_kept(cols, market)
    short = _short_list(cols, market)
    for k in np.argsort(-target):
        residual = target[k] - float(cols.throughput[cols.key == k] @ x[cols.key == k])
        while residual > 1e-9 * max(1.0, target[k]):
            j = _add(cols, market, int(k), short, x, used, residual)
            if j is None:
                if partial:
                    break
                return None
            residual -= cols.throughput[j]
    return x


def water_fill(cols: Columns, market: Market, target: np.ndarray, base: np.ndarray | None = None) -> np.ndarray:
    """A feasible instance vector that serves every key a large share of `target` (the max-min start): from
    `base` (instance counts that fit the availability, e.g. an LP optimum rounded down; default: what runs,
    while it fits), repeatedly give the key with the least served share of its target its cheapest useful
    instance that fits; a key none of whose instances fits any more drops out. Unlike `greedy`, no key takes
    the scarce nodes before the others have any."""
    if base is None:
        x, used = _running_kept(cols, market)
    else:
        x = np.minimum(np.floor(base + 1e-9), cols.upper)
        used = np.zeros_like(market.avail)
        np.add.at(used, cols.region, cols.counts * x[:, None])
    short = _short_list(cols, market)
    got = np.bincount(cols.key, cols.throughput * x, minlength=len(target)).astype(float)
    heap = [(got[k] / target[k], int(k)) for k in np.flatnonzero(target > 0)]
    heapq.heapify(heap)
    while heap:
        share, k = heapq.heappop(heap)
        if share >= 1 - 1e-9:
            break
        j = _add(cols, market, k, short, x, used, target[k] - got[k])
        if j is not None:
            got[k] += cols.throughput[j]
            heapq.heappush(heap, (got[k] / target[k], k))
    return x


def full_start(x: np.ndarray, problem: Problem, layout: Layout, cols: Columns, penalty_k: float | None,
               shares: np.ndarray | None = None) -> np.ndarray:
    """Extend an instance vector to all variables of `problem`: class shares as given (default: each instance
    serves its key's class mix in proportion), penalties at their minimum, served fractions 0 (the allocator's
    `_with_served` sets them from the capacity), no artificial slack, priced slack (`SlackPrice`) where the
    capacity falls short of (1 + share)·D."""
    v = np.zeros(problem.n)
    v[:layout.n_x] = x
    if shares is not None:
        v[layout.share_start:] = shares
    elif len(layout.share_parent) and cols.class_thr is not None:
        j, c = layout.share_parent, layout.share_class
        split = np.array([cols.split[int(k)][int(ci)] for k, ci in zip(cols.key[j], c, strict=True)])
        v[layout.share_start:] = np.where(cols.throughput[j] > 0,
                                          x[j] * cols.throughput[j] * split / cols.class_thr[j, c], 0.0)
    run = np.flatnonzero(layout.penalty_of >= 0)
    v[layout.penalty_of[run]] = (penalty_k or 0.0) * cols.cost[run] * np.maximum(0.0, x[run] - cols.running[run])
    if len(layout.priced_col):
        ax = np.bincount(problem.entry_row, problem.entry_val * v[problem.entry_col], minlength=len(problem.row_lower))
        short = problem.row_lower[layout.priced_row] - ax[layout.priced_row]
        v[layout.priced_col] = np.clip(short, 0.0, problem.upper[layout.priced_col])
    return v


def build_plan(
    library: TemplateLibrary,
    scenario: Scenario,
    keys: list[DemandKey],
    demand: np.ndarray,
    market: Market,
    chosen: list[tuple[int, int, int]],
    *,
    method: str,
    mode: str,
    report: SolveReport,
    running: dict[tuple[int, str], int],
    penalty_k: float | None,
    demand_scale: float = 1.0,
    capacity: Mapping[DemandKey, float] | None = None,
    class_throughput: Mapping[tuple[int, int], dict[str, float]] | None = None,
    request_classes: dict[str, list[PlanClass]] | None = None,
) -> Plan:
    """A Plan from (template id, region index, count) triples. `demand` is what each key asked for; `capacity`
    overrides the summed template ratings of keys planned with request classes, `class_throughput` gives each
    (template, region index)'s instances their tokens/s per class and `request_classes` the models' classes."""
    instances: list[PlanInstance] = []
    cap = dict.fromkeys(keys, 0.0)
    key_cost = dict.fromkeys(keys, 0.0)
    penalty = 0.0
    ids = sorted({t for t, _, _ in chosen})
    sub = library.subset(np.array(ids, dtype=np.int64))  # template() scans the whole library; a subset does not
    templates = {t: sub.template(i) for i, t in enumerate(ids)}
    for t, r, count in sorted(chosen):
        region = market.regions[r]
        tpl = templates[t]
        prices = {c: float(market.price[r, i]) for i, c in enumerate(market.configs) if np.isfinite(market.price[r, i])}
        cost = tpl.cost(prices)
        if not math.isfinite(cost):
            raise CoralInputError(f"template {t} uses a config not offered in {region}")
        stages = [(st.layers, st.nodes, st.node_throughput) for st in tpl.stages]
        for i in range(count):
            instances.append(PlanInstance.of_stages(tpl.model, str(tpl.phase), t, region, i, stages, tpl.throughput,
                                                    cost, counts=dict(tpl.counts),
                                                    class_throughput=(class_throughput or {}).get((t, r))))
        key = (tpl.model, Phase(tpl.phase))
        cap[key] = cap.get(key, 0.0) + count * tpl.throughput
        key_cost[key] = key_cost.get(key, 0.0) + count * cost
        penalty += (penalty_k or 0.0) * cost * max(0, count - running.get((t, region), 0))
    cap.update(capacity or {})
    serving = []
    for k, key in enumerate(keys):
        d = float(demand[k])
        frac = 1.0 if d <= 0 else min(1.0, cap[key] / d)
        serving.append(ModelServing(model=key[0], phase=str(key[1]), demand=d, capacity=cap[key],  # type: ignore[arg-type]
                                    served_fraction=frac, cost_per_hour=key_cost[key]))
    return Plan(
        scenario=scenario.name, method=method, mode=mode, demand_scale=demand_scale,  # type: ignore[arg-type]
        instances=instances, request_classes=request_classes or {}, serving=serving, cost_per_hour=float(sum(i.cost_per_hour for i in instances)),
        penalty_per_hour=penalty, solve=report,
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )
