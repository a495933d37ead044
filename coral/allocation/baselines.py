"""Baselines on the same library, perf model and market as Coral (paper §6.1, "Baselines").

Every baseline uses only *homogeneous* templates: all nodes of a replica are one node config (e.g. 2x 4xL40S);
different replicas may use different configs.

* ``homo-greedy`` (the paper's Homo, literally): per (model, phase), in the scenario's model order and prefill
  before decode, rank the homogeneous (template, region) strategies by goodput per USD (SLO tokens/s per $/h) and
  replicate the best one until demand is met; when availability (after what earlier keys took) runs out, move to
  the next best. No cross-model coordination; demand that cannot be met stays unserved.
* ``cauchy-paper`` (the paper's adaptation of Cauchy, SoCC'25): per model, a "GPU combo" *unit* is one prefill
  replica feeding k decode replicas in one region (1 ≤ k ≤ MAX_DECODE_PER_PREFILL, each phase homogeneous, every
  decode replica adding throughput). A unit serves min(T_p/I, k·T_d/O) requests/s (I, O: mean input/output
  tokens). As Cauchy's abstract puts it, it "works out the top performers of cost efficiency as GPU Combo
  candidates, and deploys a set of combos to satisfy QoS". Assumptions (neither paper gives more detail): per-model
  cost efficiency (requests/s per $/h) enters through candidate selection, the UNITS_PER_REGION most
  cost-efficient units per model and region; an ILP then picks integer unit counts meeting every model's request
  rate under availability at least cost (unmet rate costs a prohibitive price, so scarcity degrades instead of
  failing). Prefill and decode of a unit share a region; the request rate planned is max(D_p/I, D_d/O).
* ``homo-ilp`` (the strongest homogeneous baseline): Coral's own allocation ILP (cross-model optimisation,
  availability, scarcity modes) restricted to homogeneous templates. Coral's template set is a superset, so
  Coral's optimum is never dearer; the gap between the two is what heterogeneity inside a replica buys.
* Mélange-style: for one model, the GPU-mix ILP over single-node configurations (min Σ price·x with
  Σ throughput·x ≥ demand per phase and x within availability); a special-case check of the allocator.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np

from coral.allocation import core, milp
from coral.allocation.allocator import UNLIMITED, Mode, _keys_and_demand, allocate, resolve_availability
from coral.allocation.demand import DemandKey
from coral.allocation.plan import Plan, SolveReport
from coral.catalog.loader import Catalog, CoralInputError, market_catalog
from coral.catalog.schema import Scenario
from coral.perf.model import Phase
from coral.templates.library import TemplateLibrary

UNITS_PER_REGION = 200
MAX_DECODE_PER_PREFILL = 16


def _setup(library: TemplateLibrary, scenario: Scenario, demand: Mapping[DemandKey, float] | None,
           availability: core.Availability | str | None, catalog: Catalog | None
           ) -> tuple[list[DemandKey], np.ndarray, core.Market]:
    catalog = catalog or market_catalog(scenario)
    keys, dem = _keys_and_demand(scenario, demand)
    if availability is None:
        availability = resolve_availability(scenario, library, catalog)
    avail = None if availability == UNLIMITED else availability
    if isinstance(avail, str):
        raise CoralInputError(f"availability: expected a mapping or {UNLIMITED!r}")
    return keys, dem, core.make_market(library, scenario, catalog, avail)


def homo_greedy(library: TemplateLibrary, scenario: Scenario, *, demand: Mapping[DemandKey, float] | None = None,
                availability: core.Availability | str | None = None, catalog: Catalog | None = None) -> Plan:
    """The paper's Homo baseline (module doc): per (model, phase), replicate the homogeneous strategy with the
    highest goodput per USD, falling back to the next best when availability runs out."""
    t0 = time.perf_counter()
    keys, dem, market = _setup(library, scenario, demand, availability, catalog)
    cols = core.make_columns(library, keys, market, dem, {}, homogeneous=True)
    x = np.zeros(len(cols), dtype=np.int64)
    used = np.zeros_like(market.avail)
    for k in range(len(keys)):
        residual = float(dem[k])
        idx = np.flatnonzero(cols.key == k)
        for j in idx[np.lexsort((cols.template[idx], -cols.throughput[idx] / cols.cost[idx]))]:
            if residual <= 1e-9 * max(1.0, float(dem[k])):
                break
            with np.errstate(divide="ignore"):
                room = np.where(cols.counts[j] > 0, (market.avail[cols.region[j]] - used[cols.region[j]])
                                / np.maximum(cols.counts[j], 1), np.inf).min()
            n = int(min(np.ceil(residual / cols.throughput[j] - 1e-9), room))
            if n > 0:
                x[j] += n
                used[cols.region[j]] += n * cols.counts[j]
                residual -= n * float(cols.throughput[j])
    chosen = [(int(cols.template[j]), int(cols.region[j]), int(x[j])) for j in np.flatnonzero(x > 0)]
    report = SolveReport(status="greedy", objective=float(cols.cost @ x), time_s=time.perf_counter() - t0,
                         n_variables=len(cols))
    return core.build_plan(library, scenario, keys, dem, market, chosen, method="homo-greedy", mode="cost",
                           report=report, running={}, penalty_k=None)


def homogeneous_rows(library: TemplateLibrary) -> np.ndarray:
    """Template rows whose nodes all have one config."""
    return np.flatnonzero((library.counts > 0).sum(axis=1) == 1)


def homo_ilp(library: TemplateLibrary, scenario: Scenario, *, demand: Mapping[DemandKey, float] | None = None,
             availability: core.Availability | str | None = None, catalog: Catalog | None = None,
             mode: Mode = "cost", time_limit: float = 30.0, gap: float = 1e-4,
             slack: core.SlackPrice | None = None) -> Plan:
    """Coral's allocation ILP over the homogeneous templates only (module doc); raises `InfeasibleDemand` like
    `allocate` in cost mode. Availability defaults to the scenario's, resolved with the full library; `slack` as
    `allocate`'s."""
    catalog = catalog or market_catalog(scenario)
    if availability is None:
        availability = resolve_availability(scenario, library, catalog)
    rows = homogeneous_rows(library)
    # one subset object per library: what the allocator memoises per library (key rows, latency ratings) holds
    sub = allocate(library.memo(("homogeneous subset",), lambda: library.subset(rows)), scenario, demand=demand, availability=availability, catalog=catalog,
                   mode=mode, time_limit=time_limit, gap=gap, method="homo-ilp", slack=slack)
    keys, dem, market = _setup(library, scenario, demand, availability, catalog)
    region = {r: i for i, r in enumerate(market.regions)}
    tally: dict[tuple[int, int], int] = {}
    for inst in sub.instances:
        key = (int(rows[inst.template_id]), region[inst.region])
        tally[key] = tally.get(key, 0) + 1
    capacity = {(s.model, Phase(s.phase)): s.capacity for s in sub.serving}  # class-aware, as the allocator's
    return core.build_plan(library, scenario, keys, dem, market, [(t, r, n) for (t, r), n in tally.items()],
                           method="homo-ilp", mode=sub.mode, report=sub.solve, running={}, penalty_k=None,
                           demand_scale=sub.demand_scale, capacity=capacity)


def cauchy_paper(library: TemplateLibrary, scenario: Scenario, *, demand: Mapping[DemandKey, float] | None = None,
           availability: core.Availability | str | None = None, catalog: Catalog | None = None,
           time_limit: float = 30.0, gap: float = 1e-4) -> Plan:
    """The paper's Cauchy adaptation (module doc). Demand is taken per model from the prefill/decode token rates."""
    keys, dem, market = _setup(library, scenario, demand, availability, catalog)
    cols = core.make_columns(library, keys, market, dem, {}, homogeneous=True)
    shape = {sm.model: (sm.mean_input_tokens, sm.mean_output_tokens) for sm in scenario.models}
    units: list[tuple[int, int, int, int, float, float]] = []  # model index, p col, d col, k, req/s, $/h
    models = list(dict.fromkeys(m for m, _ in keys))
    rate = np.zeros(len(models))
    for mi, model in enumerate(models):
        kp, kd = keys.index((model, Phase.PREFILL)), keys.index((model, Phase.DECODE))
        n_in, n_out = shape[model]
        rate[mi] = max(dem[kp] / n_in, dem[kd] / n_out)
        if rate[mi] <= 0:
            continue
        for r in range(len(market.regions)):
            pc = np.flatnonzero((cols.key == kp) & (cols.region == r))
            dc = np.flatnonzero((cols.key == kd) & (cols.region == r))
            if not len(pc) or not len(dc):
                continue
            rp = cols.throughput[pc][:, None, None] / n_in
            rd = cols.throughput[dc][None, :, None] / n_out
            ks = np.arange(1, MAX_DECODE_PER_PREFILL + 1)[None, None, :]
            k = np.broadcast_to(ks, (len(pc), len(dc), ks.shape[2]))
            served = np.minimum(rp, k * rd)
            cost = cols.cost[pc][:, None, None] + k * cols.cost[dc][None, :, None]
            useful = (k == 1) | ((k - 1) * rd < rp)  # the k-th decode replica still adds throughput
            eff = np.where(useful, served / cost, -np.inf).ravel()
            for flat in np.argsort(-eff)[:UNITS_PER_REGION]:
                i, j, kk = np.unravel_index(int(flat), k.shape)
                units.append((mi, int(pc[i]), int(dc[j]), int(k[i, j, kk]), float(served[i, j, kk]),
                              float(cost[i, j, kk])))
    n_u, n_m = len(units), len(models)
    rows = milp.SparseRows(n_u + n_m)
    for mi in range(n_m):
        members = [u for u in range(n_u) if units[u][0] == mi]
        rows.add(np.array([*members, n_u + mi]), np.array([*(units[u][4] for u in members), 1.0]),
                 float(rate[mi]), np.inf)
    for r in range(len(market.regions)):
        for c in range(len(market.configs)):
            if not np.isfinite(market.avail[r, c]):
                continue
            idx, val = [], []
            for u, (_, pcol, dcol, kd, _, _) in enumerate(units):
                use = 0
                if cols.region[pcol] == r:
                    use += int(cols.counts[pcol, c]) + kd * int(cols.counts[dcol, c])
                if use:
                    idx.append(u)
                    val.append(float(use))
            if idx:
                rows.add(np.array(idx), np.array(val), -np.inf, float(market.avail[r, c]))
    unit_cost = np.array([u[5] for u in units])
    big = 1e6 * float(max((unit_cost / np.array([u[4] for u in units])).max(initial=1.0), 1.0))
    cost = np.concatenate([unit_cost, np.full(n_m, big)])
    upper = np.concatenate([np.full(n_u, 1e6), rate])
    integer = np.concatenate([np.ones(n_u, dtype=bool), np.zeros(n_m, dtype=bool)])
    res = milp.solve(cost, np.zeros(n_u + n_m), upper, integer, rows, time_limit=time_limit, gap=gap)
    chosen: dict[tuple[int, int], int] = {}
    if res.x is not None:
        for u, y in enumerate(np.round(res.x[:n_u]).astype(int)):
            if y > 0:
                _, pcol, dcol, kd, _, _ = units[u]
                for col, n in ((pcol, y), (dcol, kd * y)):
                    key = (int(cols.template[col]), int(cols.region[col]))
                    chosen[key] = chosen.get(key, 0) + int(n)
    provision = float(unit_cost @ np.round(res.x[:n_u])) if res.x is not None else None
    report = SolveReport(status=res.status, objective=provision, bound=res.bound, gap=res.gap, time_s=res.time_s,
                         n_variables=res.n_cols, n_constraints=res.n_rows,
                         notes=[f"{n_u} candidate units (prefill + k decode replicas)"])
    return core.build_plan(library, scenario, keys, dem, market, [(t, r, n) for (t, r), n in chosen.items()],
                           method="cauchy-paper", mode="cost", report=report, running={}, penalty_k=None)


def melange(library: TemplateLibrary, scenario: Scenario, model: str, *,
            demand: Mapping[DemandKey, float] | None = None, availability: core.Availability | str | None = None,
            catalog: Catalog | None = None) -> float:
    """Optimal $/h of the Mélange-style GPU-mix ILP for one model over its single-node templates."""
    keys, dem, market = _setup(library, scenario, demand, availability, catalog)
    var: list[tuple[int, int, int, float, float]] = []  # key, region, config, tokens/s, $/h
    for k, (m, phase) in enumerate(keys):
        if m != model or dem[k] <= 0:
            continue
        for t in library.select(m, phase):
            cnt = library.counts[t]
            if cnt.sum() != 1:
                continue
            c = int(np.flatnonzero(cnt)[0])
            for r in range(len(market.regions)):
                if np.isfinite(market.price[r, c]):
                    var.append((k, r, c, float(library.throughput[t]), float(market.price[r, c])))
    rows = milp.SparseRows(len(var))
    for k in {v[0] for v in var}:
        idx = [i for i, v in enumerate(var) if v[0] == k]
        rows.add(np.array(idx), np.array([var[i][3] for i in idx]), float(dem[k]), np.inf)
    for r in range(len(market.regions)):
        for c in range(len(market.configs)):
            idx = [i for i, v in enumerate(var) if v[1] == r and v[2] == c]
            if idx and np.isfinite(market.avail[r, c]):
                rows.add(np.array(idx), np.ones(len(idx)), -np.inf, float(market.avail[r, c]))
    res = milp.solve(np.array([v[4] for v in var]), np.zeros(len(var)), np.full(len(var), 1e6),
                     np.ones(len(var), dtype=bool), rows, time_limit=60.0, gap=1e-9)
    if res.objective is None:
        raise CoralInputError(f"melange: demand of {model} cannot be met ({res.status})")
    return res.objective
