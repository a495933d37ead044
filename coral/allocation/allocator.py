"""The online allocator: integer instance counts per (template, region) at least cost, or, under scarcity, the
largest served fraction of demand (goodput mode) or the paper's uniform demand scale-down (scaled mode)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from coral.allocation import core, milp, solver
from coral.allocation.availability import headroom_availability, market_availability
from coral.allocation.classes import KeyClasses, key_classes
from coral.allocation.demand import DemandKey, scenario_demand
from coral.allocation.latency import KeyLatency, LatencyBound, latency_bound, scenario_latency
from coral.allocation.plan import Plan, PlanClass, SolveReport
from coral.allocation.reductions import pareto_columns
from coral.allocation.rows import key_rows
from coral.catalog.loader import Catalog, CoralInputError, market_catalog
from coral.catalog.schema import Scenario
from coral.perf.model import Phase
from coral.templates.library import TemplateLibrary

Mode = Literal["cost", "goodput", "maxmin", "scaled"]
MODES = ("cost", "goodput", "maxmin", "scaled")
UNLIMITED = core.UNLIMITED
#: max-min and goodput problems of at most this many variables go to HiGHS whole, warm-started: there the LP
#: pipeline's rounds cost more than they save (`benchmarks/allocator.py --replan`)
DIRECT_COLUMNS = 4000
STAGE_S = 0.05  # the least wall-clock safety net a stage gets: past the call's, each stage may still find a plan
RESERVE = 0.1  # share of the time limit (the safety net) kept for building the plan and HiGHS's overrun of it
FAIRNESS = 0.5  # goodput mode: every model keeps at least this share of the uniform max-min fraction


class InfeasibleDemand(CoralInputError):
    """Demand cannot be met under the availability; names the models and (region, config)s that bind."""

    def __init__(self, message: str, models: list[DemandKey], configs: list[tuple[str, str]], fraction: float,
                 bound: float | None = None):
        super().__init__(message)
        self.models = models
        self.configs = configs
        self.fraction = fraction  # the uniform share the best plan found serves
        self.bound = bound  # a proven upper bound on it (None: none was proven before a limit stopped the solve)


@dataclass
class _Context:
    library: TemplateLibrary
    scenario: Scenario
    keys: list[DemandKey]
    demand: np.ndarray
    weights: np.ndarray
    market: core.Market
    running: dict[tuple[int, str], int]
    penalty_k: float | None
    cols: core.Columns
    reduce: bool
    classes: dict[int, KeyClasses]
    bound: list[LatencyBound]
    cover: _Coverage | None = None  # scarcity modes: the models that can each get an instance (`_coverage`)

    @property
    def model_group(self) -> tuple[list[str], np.ndarray]:
        """The models (sorted) and, per key, the index of its model: a request needs both its model's phases."""
        models = sorted({m for m, _p in self.keys})
        return models, np.array([models.index(m) for m, _p in self.keys], dtype=np.int64)


@dataclass
class _Coverage:
    """Which models get an instance of each phase with demand: in the water-filling plan when it serves them all,
    else in the plan of `_coverage`'s MIP."""

    x: np.ndarray | None  # the MIP's plan, water-filled (a start of the max-min and goodput stages); None when
    # the water-filling plan, a start already, serves every model
    covered: np.ndarray  # per key: its model is served
    floor: np.ndarray  # per key where covered: the least share one instance serves over its model's keys (its
    # goodput floor: a model's phases share one served fraction, and any instance of each meets it), else 0
    proven: bool  # no plan serves more (priority-weighted) models with instances that serve every class
    words: str

    @property
    def t_zero(self) -> bool:
        """Proven: some model can get no instance, so the max-min t is 0 in every plan."""
        return self.proven and not self.covered.all()


def _coverage(ctx: _Context, weights: np.ndarray, time_limit: float) -> _Coverage:
    """The most priority-weighted models that can each get an instance of every phase with demand (a request
    needs both): the water-filling plan when it serves every key, else a small MIP over one instance per column
    (x_j ∈ {0, 1}, y_m ∈ {0, 1}: Σ_{j of key} x_j ≥ y_m for each key of model m, the availability rows, max
    Σ w_m y_m) warm-started from it, over the columns of least node footprint (`_footprints`: an instance
    is an instance here) and the water-filling plan's. Only instances serving every class of their key count
    (T_j > 0). Every served fraction can be above 0 (the max-min t > 0) only when every model is covered; when
    the MIP proves fewer, t = 0 is the optimum, and its plan names the models the goodput stage keeps above 0
    (among sets of equal weight, the one asking the most generated tokens/s). `time_limit`: its safety net."""
    cols, pos = ctx.cols, ctx.demand > 0
    wf = core.water_fill(cols, ctx.market, ctx.demand * weights)
    useful = (cols.throughput > 0) & (cols.shortfall <= 0)  # one instance meets the pooled latency row alone
    least = np.full(len(ctx.demand), np.inf)
    np.minimum.at(least, cols.key[useful], cols.throughput[useful])
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(pos & np.isfinite(least), np.minimum(1.0, least / ctx.demand), np.inf)
    models, group = ctx.model_group
    model_share = np.full(len(models), np.inf)
    np.minimum.at(model_share, group, share)
    share = np.where(pos & np.isfinite(model_share[group]), model_share[group], 0.0) * (1 - 1e-6)
    have = np.bincount(cols.key, (wf > 0) & useful, minlength=len(ctx.demand)) > 0
    model_ok = np.ones(len(models), dtype=bool)
    np.logical_and.at(model_ok, group, have | ~pos)
    if model_ok[group].all():
        return _Coverage(None, np.ones(len(ctx.demand), dtype=bool), share, True,
                         "the water-filling plan serves every model")
    sel = _footprints(cols, len(ctx.market.regions), useful)
    sel = np.union1d(sel, np.flatnonzero((wf > 0) & useful))  # the water-filling plan's instances: its start
    n, n_m = len(sel), len(models)
    rows = milp.SparseRows(n + n_m)
    for k in np.flatnonzero(pos):
        js = np.flatnonzero(cols.key[sel] == k)
        rows.add(np.append(js, n + group[k]), np.append(np.ones(len(js)), -1.0), 0.0, np.inf)
    for r, c in zip(*np.nonzero(np.isfinite(ctx.market.avail)), strict=True):
        js = np.flatnonzero((cols.region[sel] == r) & (cols.counts[sel, c] > 0))
        if len(js):
            rows.add(js, cols.counts[sel[js], c].astype(float), -np.inf, float(ctx.market.avail[r, c]))
    w_m = np.zeros(n_m)
    np.maximum.at(w_m, group[pos], weights[pos])
    # among sets of models of equal weight, the one of most weighted tokens/s asked (the goodput stage then serves
    # them: covering a small model instead of a large one would give up goodput for no fairness): a tie-break
    # worth under 1e-3 of the least model weight in all
    asked = np.zeros(n_m)
    np.add.at(asked, group[pos], (ctx.demand * weights * _generated(ctx))[pos])
    bonus = 1e-3 * w_m[w_m > 0].min(initial=1.0) * asked / max(float(asked.sum()), 1e-12)
    cost = np.concatenate([np.zeros(n), -(w_m + bonus)])
    start = np.concatenate([np.minimum(wf[sel], 1.0), model_ok])
    res = milp.solve(cost, np.zeros(n + n_m), np.concatenate([np.minimum(cols.upper[sel], 1.0), np.ones(n_m)]),
                     np.ones(n + n_m, dtype=bool), rows, time_limit=time_limit, gap=0.0, start=start)
    y = (res.x if res.x is not None else start)[n:] > 0.5
    x = np.zeros(len(cols))
    x[sel] = np.round((res.x if res.x is not None else start)[:n])
    has_demand = np.bincount(group[pos], minlength=n_m) > 0
    proven = res.status == "Optimal" and not ctx.classes
    words = (f"{int(y[has_demand].sum())} of {int(has_demand.sum())} models can each get an instance of every phase "
             f"({'proven: no plan serves more' if proven else f'the best plan found; {res.status}'})")
    covered = y[group] | ~pos
    return _Coverage(core.water_fill(cols, ctx.market, ctx.demand * weights, base=x), covered, share * covered, proven,
                     words)


def _generated(ctx: _Context) -> np.ndarray:
    """Per key, whether its tokens are what the goodput counts: decode, or prefill for a model with no decode."""
    decoding = {m for (m, p), d in zip(ctx.keys, ctx.demand, strict=True) if p == Phase.DECODE and d > 0}
    return np.array([p == Phase.DECODE or m not in decoding for m, p in ctx.keys])


def _footprints(cols: core.Columns, n_regions: int, useful: np.ndarray) -> np.ndarray:
    """The `useful` columns whose node multiset is minimal in their (key, region): one per distinct multiset, none
    whose multiset holds another's (one instance of the smaller fits wherever one of the larger does); the
    skyline of `pareto_columns` on node counts alone."""
    idx = np.flatnonzero(useful)
    alive = pareto_columns(cols.key[idx] * n_regions + cols.region[idx], np.zeros(len(idx)), np.zeros(len(idx)),
                           cols.counts[idx], np.zeros(len(idx), dtype=bool))
    return idx[alive]


def _keys_and_demand(scenario: Scenario, demand: Mapping[DemandKey, float] | None) -> tuple[list[DemandKey], np.ndarray]:
    """Capacity to plan per (model, phase): `demand` as given, or the scenario's (mean traffic × headroom, see
    `coral.allocation.demand`)."""
    base = scenario_demand(scenario) if demand is None else {(m, Phase(p)): float(v) for (m, p), v in demand.items()}
    for (m, p), v in base.items():
        if v < 0 or not math.isfinite(v):
            raise CoralInputError(f"demand[{m}/{p}]: must be a finite number >= 0, not {v}")
    keys = list(base)
    return keys, np.array([base[k] for k in keys], dtype=float)


def _context(library: TemplateLibrary, scenario: Scenario, demand: Mapping[DemandKey, float] | None,
             availability: core.Availability | str | None, catalog: Catalog | None,
             running: Plan | core.Running | None, reduce: bool,
             latency: bool | Mapping[DemandKey, KeyLatency] = True) -> _Context:
    catalog = catalog or market_catalog(scenario)
    keys, dem = _keys_and_demand(scenario, demand)
    for m, p in keys:
        if dem[keys.index((m, p))] > 0 and not len(key_rows(library, m, str(p), False)[0]):
            raise CoralInputError(f"demand: the template library has no templates for {m}/{p}")
    if availability is None:
        availability = resolve_availability(scenario, library, catalog)
    avail = None if availability == UNLIMITED else availability
    if isinstance(avail, str):
        raise CoralInputError(f"availability: expected a mapping or {UNLIMITED!r}, not {avail!r}")
    market = core.make_market(library, scenario, catalog, avail)
    run = core.running_counts(running, library)
    prio = {sm.model: sm.priority for sm in scenario.models}
    w = np.array([prio.get(m, 1.0) for m, _ in keys], dtype=float)
    w = w / w.max() if len(w) else w
    models = {sm.model: sm for sm in scenario.models}
    classes: dict[int, KeyClasses] = {}
    for k, (m, p) in enumerate(keys):
        if dem[k] > 0 and m in models:
            kc = key_classes(library, models[m], p, *key_rows(library, m, str(p), False), catalog)
            if kc is not None:
                classes[k] = kc
    rating = dict(latency) if isinstance(latency, Mapping) else scenario_latency(library, scenario, catalog) \
        if latency else {}
    rated = {k: rating[key] for k, key in enumerate(keys) if key in rating and dem[k] > 0}
    cols = core.make_columns(library, keys, market, dem, run, reduce=reduce, classes=classes, latency=rated)
    return _Context(library, scenario, keys, dem, w, market, run, scenario.init_penalty_k if running is not None
                    else None, cols, reduce, classes, latency_bound([rating[k] for k in keys if k in rating]))


@dataclass
class _Stage:
    """One solved stage: the outcome, where its variables sit, and each key's served fraction (1 without
    demand; all zero when the stage found no solution)."""

    out: solver.Outcome
    layout: core.Layout
    served: np.ndarray

    def shares(self) -> np.ndarray | None:
        """The solution's class shares, capped by its rounded instance counts (a start for the next stage)."""
        if self.out.x is None or not len(self.layout.share_parent):
            return None
        j = self.layout.share_parent
        nu = np.round(self.out.x[:self.layout.n_x])
        share = np.maximum(self.out.x[self.layout.share_start:], 0.0)
        used = np.bincount(j, share, minlength=self.layout.n_x)
        return share * np.minimum(1.0, nu[j] / np.where(used[j] > 0, used[j], 1.0))


def _stage(ctx: _Context, out: solver.Outcome, layout: core.Layout) -> _Stage:
    served = np.zeros(len(ctx.demand))
    if out.x is not None:
        cap = _capacity(ctx, layout, out.x)
        with np.errstate(divide="ignore", invalid="ignore"):
            served = np.where(ctx.demand > 0, np.minimum(1.0, cap / ctx.demand), 1.0)
    return _Stage(out, layout, served)


def _with_served(ctx: _Context, v: np.ndarray, layout: core.Layout, weights: np.ndarray) -> np.ndarray:
    """`v` with the max-min t and goodput's served fractions set from the capacity of its instances."""
    served = _stage(ctx, solver.Outcome("", v, None, None, None, 0.0, 0, 0), layout).served
    for col in set(layout.served_col.values()):
        v[col] = min(float(served[k]) for k, c in layout.served_col.items() if c == col)
    if layout.t_col is not None:
        pos = ctx.demand > 0
        v[layout.t_col] = float(min(1.0, (served[pos] / weights[pos]).min(initial=1.0)))
    return v


def _start(ctx: _Context, problem: solver.Problem, layout: core.Layout, targets: np.ndarray | None,
           prev: _Stage | None, weights: np.ndarray) -> np.ndarray | None:
    """The best feasible start of `problem` (least objective) among the greedy plan meeting `targets` (when
    given), the water-filling plan of all weighted demand and the coverage plan (`_coverage`, when it was
    needed; for the served objectives), the greedy plan serving what it can, largest demand first (goodput) and
    the previous stage's solution; None when none is feasible (`_with_served` sets the served variables)."""
    starts: list[np.ndarray] = []
    greedy = [] if targets is None else [core.greedy(ctx.cols, ctx.market, targets)]
    if layout.t_col is not None or layout.served_col:
        greedy.append(core.water_fill(ctx.cols, ctx.market, ctx.demand * weights))
        if ctx.cover is not None and ctx.cover.x is not None:
            greedy.append(ctx.cover.x)
    if layout.served_col:
        greedy.append(core.greedy(ctx.cols, ctx.market, ctx.demand * weights, partial=True))
    starts += [core.full_start(x0, problem, layout, ctx.cols, ctx.penalty_k) for x0 in greedy if x0 is not None]
    if prev is not None and prev.out.x is not None:
        starts.append(core.full_start(np.round(prev.out.x[:prev.layout.n_x]), problem, layout, ctx.cols,
                                      ctx.penalty_k, prev.shares()))
    feasible = [v for v in (_with_served(ctx, v, layout, weights) for v in starts) if problem.violation(v) <= 1e-9]
    return min(feasible, key=lambda v: float(problem.cost @ v)) if feasible else None


def _solve_cost(ctx: _Context, fraction: float | np.ndarray, weights: np.ndarray | None, time_limit: float,
                gap: float, prev: _Stage | None = None, slack: core.SlackPrice | None = None) -> _Stage:
    """Least cost with capacity ≥ fraction·w·D per key (capacity above it, up to `slack`'s share, priced),
    warm-started from the greedy plan or `prev`."""
    w = weights if weights is not None else np.ones(len(ctx.demand))
    problem, layout = core.assemble(ctx.cols, ctx.market, ctx.demand * w, penalty_k=ctx.penalty_k,
                                    min_fraction=fraction, slack=slack)
    start = _start(ctx, problem, layout, ctx.demand * w * fraction, prev, w)
    nets: list[str] = []
    homo = _homogeneous_optimum(ctx, problem, layout, time_limit / 2, gap, nets)
    if homo is not None and (start is None or float(problem.cost @ homo) < float(problem.cost @ start)):
        start = homo
    out = solver.solve(problem, time_limit=time_limit / 2 if homo is not None else time_limit, gap=gap, start=start,
                       reduce=ctx.reduce)
    if homo is not None and (out.x is None or float(problem.cost @ out.x) > float(problem.cost @ homo) + 1e-9):
        out.notes.append(f"the homogeneous plan (${float(problem.cost @ homo):,.2f}/h) beat what the solver "
                         "returned; kept")
        out.x, out.objective = homo, float(problem.cost @ homo)
    out.safety_net = solver._nets(*nets, out.safety_net)
    return _stage(ctx, out, layout)


def _homogeneous_optimum(ctx: _Context, problem: solver.Problem, layout: core.Layout, time_limit: float,
                         gap: float, nets: list[str] | None = None) -> np.ndarray | None:
    """The best plan of `problem` using single-config templates only (the homogeneous ILP at the same demand), or
    None when the columns are all of one kind or no such plan exists: the full problem's warm start and its
    floor, so a plan is never dearer than the homogeneous subset of its own columns."""
    mixed = (ctx.cols.counts > 0).sum(axis=1) > 1
    if not mixed.any() or mixed.all():
        return None
    upper = problem.upper.copy()
    upper[:layout.n_x][mixed] = 0.0
    if layout.share_parent is not None and len(layout.share_parent):
        upper[layout.share_start:][mixed[layout.share_parent]] = 0.0
    sub = replace(problem, upper=upper)
    out = solver.solve(sub, time_limit=time_limit, gap=gap, start=None, reduce=ctx.reduce)
    if out.safety_net and nets is not None:  # the wall-clock safety net stopped it (`solver.Outcome.safety_net`)
        nets.append(out.safety_net)
    if out.x is None or problem.violation(out.x) > 1e-9:
        return None
    return out.x


def _solve_served(ctx: _Context, objective: Literal["maxmin", "goodput"], weights: np.ndarray,
                  floor: np.ndarray | None, time_limit: float, gap: float, prev: _Stage | None = None,
                  duals: bool = False) -> _Stage:
    """Max-min served fraction, or the SLO goodput: max the priority-weighted generated tokens/s served (prompt
    tokens/s for a model with no decode demand), one served fraction per model for both its phases (a request
    needs both), with per-key floors; warm-started
    from `prev` or the water-filling plan (`core.water_fill`), whichever is better, and from the LP optimum
    rounded down and water-filled (the solver's rounder). Small problems go to HiGHS whole (`DIRECT_COLUMNS`)
    unless the LP's row `duals` are wanted (to name what binds). When `_coverage` proved t = 0, the max-min
    problem is not solved: its best start is optimal."""
    _models, group = ctx.model_group
    counts = _generated(ctx)  # prompts where none decode
    gain = weights * ctx.demand * counts / max(float((ctx.demand * counts).sum()), 1e-12)
    problem, layout = core.assemble(ctx.cols, ctx.market, ctx.demand, penalty_k=None, objective=objective,
                                    weights=weights, min_fraction=floor, served_group=group, gain=gain)
    start = _start(ctx, problem, layout, None, prev, weights)
    if objective == "maxmin" and ctx.cover is not None and ctx.cover.t_zero and start is not None and not duals:
        return _stage(ctx, solver.Outcome("Optimal", start, float(problem.cost @ start), 0.0, 0.0, 0.0, problem.n,
                                          len(problem.row_lower), [f"t = 0 is optimal: {ctx.cover.words}"]), layout)

    def rounder(lp_x: np.ndarray) -> np.ndarray | None:
        x = core.water_fill(ctx.cols, ctx.market, ctx.demand * weights, base=lp_x[:layout.n_x])
        return _with_served(ctx, core.full_start(x, problem, layout, ctx.cols, ctx.penalty_k), layout, weights)

    if ctx.reduce and problem.n <= DIRECT_COLUMNS and not duals:
        out = solver.one_mip(problem, time_limit=time_limit, gap=gap, start=start,
                             note=f"one MIP over all {problem.n} variables")
    else:
        out = solver.solve(problem, time_limit=time_limit, gap=gap, start=start, reduce=ctx.reduce, rounder=rounder)
    return _stage(ctx, out, layout)


def _class_served(ctx: _Context, layout: core.Layout, x: np.ndarray) -> np.ndarray | None:
    """(columns, classes) tokens/s each column's instances serve per class in a solution (the shares capped by
    the rounded instance counts); None without request classes."""
    if not len(layout.share_parent) or ctx.cols.class_thr is None:
        return None
    nu = np.round(x[:layout.n_x])
    j, c = layout.share_parent, layout.share_class
    share = np.maximum(x[layout.share_start:], 0.0)
    used = np.bincount(j, share, minlength=layout.n_x)
    share = share * np.minimum(1.0, nu[j] / np.where(used[j] > 0, used[j], 1.0))
    served = np.zeros((layout.n_x, ctx.cols.class_thr.shape[1]))
    np.add.at(served, (j, c), ctx.cols.class_thr[j, c] * share)
    return served


def _capacity(ctx: _Context, layout: core.Layout, x: np.ndarray) -> np.ndarray:
    """Tokens/s each key's instances serve in a solution (rounded instance counts); for a key with classes, its
    demand × the least served fraction over its classes (shares capped by the rounded instances)."""
    nu = np.round(x[:layout.n_x])
    cap = np.bincount(ctx.cols.key, ctx.cols.throughput * nu, minlength=len(ctx.demand))
    col_served = _class_served(ctx, layout, x)
    if col_served is not None:
        served = np.zeros((len(ctx.demand), col_served.shape[1]))
        np.add.at(served, ctx.cols.key, col_served)
        for k in ctx.cols.split:
            need = ctx.demand[k] * ctx.cols.split[k]
            cap[k] = ctx.demand[k] * float((served[k, :len(need)] / need).min()) if ctx.demand[k] > 0 else 0.0
    return cap


def _stopped(stages: Mapping[str, solver.Outcome]) -> list[str]:
    """Each stage that a limit stopped before it proved its optimum (within the gap), and on which limit."""
    return [f"{name}: {out.status}" + (" (the wall-clock safety net)" if out.safety_net else " (a work limit)")
            for name, out in stages.items() if out.status != "Optimal"]


def _report(ctx: _Context, out: solver.Outcome, extra_time: float = 0.0, notes: list[str] | None = None,
            stages: Mapping[str, solver.Outcome] | None = None, slack: core.SlackPrice | None = None
            ) -> SolveReport:
    """The plan's solve report: `out`'s, with the wall-clock safety net's hits in `out` and the earlier `stages`
    (`safety_net`, also noted first: a plan made when it hit depends on the machine's speed and load), and the
    stages, `out` (the cost stage) included, that a limit stopped (`stopped`). With `slack`, the objective is
    $/h less the priced slack's worth, and a note says so."""
    stages = stages or {}
    net = solver._nets(*(st.safety_net for st in stages.values()), out.safety_net)
    pre = [f"{len(ctx.cols)} candidate columns (template, region); {ctx.cols.dropped} removed by dominance, "
           "availability fit and latency (templates on which fewer requests than the target meet the SLO served "
           "alone)"
           ] if ctx.reduce else []
    pre += [b.words() for b in ctx.bound]
    if slack is not None:
        pre.append(f"slack priced: capacity above demand, up to {slack.share:.0%} of it per (model, phase), is worth "
                   f"{slack.price:g} x the key's cheapest $/h per token/s; objective and bound are $/h plus the worth "
                   "of the slack not carried")
    return SolveReport(status=out.status, objective=out.objective, bound=out.bound, gap=out.gap,
                       time_s=out.time_s + extra_time, n_variables=out.n_cols, n_constraints=out.n_rows,
                       notes=([f"safety net: {net}"] if net else []) + pre + (notes or []) + out.notes,
                       safety_net=net, stopped=_stopped(stages if any(o is out for o in stages.values())
                                                        else {**stages, "cost": out}))


def _plan(ctx: _Context, out: solver.Outcome, layout: core.Layout, mode: str, report: SolveReport,
          method: str, scale: float = 1.0) -> Plan:
    assert out.x is not None
    x = np.round(out.x[:layout.n_x]).astype(int)
    chosen = [(int(ctx.cols.template[j]), int(ctx.cols.region[j]), int(x[j])) for j in np.flatnonzero(x > 0)]
    cap = _capacity(ctx, layout, out.x)
    served = _class_served(ctx, layout, out.x)
    class_thr: dict[tuple[int, int], dict[str, float]] = {}
    if served is not None:
        for j in np.flatnonzero(x > 0):
            kc = ctx.classes.get(int(ctx.cols.key[j]))
            if kc is not None:
                class_thr[int(ctx.cols.template[j]), int(ctx.cols.region[j])] = {
                    c.name: float(served[j, i] / x[j]) for i, c in enumerate(kc.classes)}
    plan_classes = {ctx.keys[k][0]: [PlanClass(name=c.name, share=c.share, mean_input_tokens=c.input_tokens,
                                               mean_output_tokens=c.output_tokens, max_input_tokens=c.max_input_tokens)
                                     for c in kc.classes] for k, kc in sorted(ctx.classes.items())}
    return core.build_plan(ctx.library, ctx.scenario, ctx.keys, ctx.demand, ctx.market, chosen, method=method,
                           mode=mode, report=report, running=ctx.running, penalty_k=ctx.penalty_k,
                           demand_scale=scale, capacity={ctx.keys[k]: float(cap[k]) for k in ctx.classes},
                           class_throughput=class_thr, request_classes=plan_classes)


def diagnose(ctx: _Context, out: solver.Outcome, layout: core.Layout, t: float, bound: float | None
             ) -> InfeasibleDemand:
    """Which models and (region, config)s bind: rows with a nonzero multiplier in the max-min LP; when the LP is
    not short (integrality alone), the models below full service and the configs fully used by the max-min
    solution. In words: the share `t` the best plan found serves every model and the proven `bound` on it
    (`_t_bound`; None: none was proven)."""
    tol = 1e-9
    models: list[DemandKey] = []
    configs: list[tuple[str, str]] = []
    if out.row_dual is not None:
        rows = {**{k: [r] for k, r in layout.demand_rows.items()}, **layout.class_rows}
        models = [ctx.keys[k] for k, rs in sorted(rows.items()) if (out.row_dual[rs] > tol).any()]
        configs = [(ctx.market.regions[r], ctx.market.configs[c])
                   for i, (r, c) in enumerate(layout.avail_rows) if out.row_dual[layout.avail_row0 + i] < -tol]
    if (not models or not configs) and out.x is not None:
        x = np.round(out.x[:layout.n_x])
        cap = _capacity(ctx, layout, out.x)
        models = models or [ctx.keys[k] for k in range(len(ctx.keys)) if ctx.demand[k] > 0 and cap[k] < ctx.demand[k]]
        used = np.zeros_like(ctx.market.avail)
        np.add.at(used, ctx.cols.region, ctx.cols.counts * x[:, None])
        configs = configs or [(ctx.market.regions[r], ctx.market.configs[c]) for r, c in zip(
            *np.nonzero(np.isfinite(ctx.market.avail) & (used >= ctx.market.avail) & (ctx.market.avail > 0)),
            strict=True)]
    names = ", ".join(f"{m}/{p}" for m, p in models) or "(none identified)"
    cfgs = ", ".join(f"{r}:{c}" for r, c in configs) or "(none identified)"
    proof = (f"no plan serves more than {bound:.1%} (a proven bound)" if bound is not None else
             f"no bound was proven before a limit stopped the solve ({out.status})")
    cover = f" ({ctx.cover.words})" if ctx.cover is not None and not ctx.cover.covered.all() else ""
    msg = (f"demand cannot be met: the best plan found serves {t:.1%} of every model's demand; {proof}{cover}. "
           f"Binding models: {names}. Binding node configs: {cfgs}. Use mode 'goodput' or 'scaled', or add "
           "availability.")
    return InfeasibleDemand(msg, models, configs, t, bound)


def allocate(
    library: TemplateLibrary,
    scenario: Scenario,
    *,
    demand: Mapping[DemandKey, float] | None = None,
    availability: core.Availability | str | None = None,
    catalog: Catalog | None = None,
    running: Plan | core.Running | None = None,
    mode: Mode = "cost",
    time_limit: float = 30.0,
    gap: float = 1e-4,
    reduce: bool = True,
    scale_step: float = 0.05,
    method: str = "coral",
    fairness: float = FAIRNESS,
    latency: bool | Mapping[DemandKey, KeyLatency] = True,
    slack: core.SlackPrice | None = None,
) -> Plan:
    """Plan instances of `library` templates per region for `demand` (tokens/s per (model, phase); default: the
    scenario's, see `phase_demand`) under `availability` ({region: {config: nodes}}; None = the scenario's,
    resolved by `resolve_availability`; "unlimited" = none).

    Modes (w = priority / max priority): "cost" minimises $/h + scale-up penalty and raises `InfeasibleDemand`
    when demand cannot be met; "goodput" (for scarcity) finds the largest uniform served fraction t (capacity ≥
    t·w·D, t ≤ 1), then maximises the SLO goodput (Σ w · generated tokens/s served, one served fraction per
    model for both phases, `_solve_served`) with every key served at least `fairness`·t·w of its demand, then
    minimises cost at what each key got; "maxmin" maximises t and then
    minimises cost at t; "scaled" scales all demand by the largest multiple of `scale_step` that is feasible
    (the paper's protocol) and minimises cost there. With `running` (a previous plan or {(template id, region):
    count}), starting an instance costs K·price extra (K = scenario.init_penalty_k). With `latency` (default), a
    (model, phase)'s instances together must serve enough of its requests within the SLO served alone, and
    each template on its own its target (`coral.allocation.latency`, the pooled rule; latency-bound keys are
    named in the report's notes); a mapping gives the ratings ({(model, phase): `KeyLatency`}, e.g. by hand). With `slack` (cost mode),
    capacity above demand is priced (`core.SlackPrice`): a plan that carries slack for little more is preferred
    to one a little cheaper that trims it (the SLO search plans so: its demand is an estimate of a percentile).

    Deterministic: the solves stop on work limits (`coral.allocation.solver`), so the same inputs give the same
    plan on an idle or a loaded machine. `time_limit` (s) is only a wall-clock safety net for the whole call,
    every stage included (each gets an equal share of what is left among the stages to come; `RESERVE` of it
    is kept for building the plan); when it stops a solve, the plan's `solve.safety_net` says where, and no
    solve starts once it has run out. A stage stopped by a limit keeps its incumbent (`solve.stopped` names
    it); when a later stage finds nothing, the plan of the stage before it is returned (noted in the report).
    In the scarcity modes, `_coverage` first finds the most models that can each get an instance: they keep
    one in goodput mode when t = 0. Only the cost mode raises, when no plan meets the demand; "maxmin" and
    "scaled" raise when t = 0."""
    if mode not in MODES:
        raise CoralInputError(f"mode: must be one of {', '.join(MODES)}, not {mode!r}")
    if not 0 < scale_step <= 1:
        raise CoralInputError("scale_step: must be in (0, 1]")
    if not 0 <= fairness <= 1:
        raise CoralInputError("fairness: must be in [0, 1]")
    slack = slack if mode == "cost" else None  # the scarcity modes meet what they can: no slack to price
    deadline = time.perf_counter() + time_limit * (1 - RESERVE)
    ctx = _context(library, scenario, demand, availability, catalog, running, reduce, latency)

    def left(stages: int = 1) -> float:
        """The safety net of the next stage: an equal share of what is left of the whole call's among the
        `stages` to come, this one included (what a stage leaves unused goes to the next; a stage that stops on
        its work limits does not depend on it), at least STAGE_S: the call overruns its net by at most STAGE_S a
        stage, not a solve (past its own net, a stage starts no further solve, `solver._left`, and keeps its
        incumbent or warm start)."""
        return max(STAGE_S, (deadline - time.perf_counter()) / stages)

    ones = np.ones(len(ctx.demand))
    stages: dict[str, solver.Outcome] = {}
    notes: list[str] = []
    spent = 0.0
    if mode == "cost":
        cost = _solve_cost(ctx, 1.0, None, left(), gap, slack=slack)
        if cost.out.x is not None:
            return _plan(ctx, cost.out, cost.layout, "cost", _report(ctx, cost.out, slack=slack), method)
        # a limit stopped it before any plan: the stages below decide, the max-min stage whether demand can be
        # met (when it serves every key in full, its plan is one), then the cost stage again, from that plan
        stages["cost (first)"], spent = cost.out, cost.out.time_s
        notes.append(f"cost stage found no plan ({cost.out.status}): the max-min stage, then the cost stage from "
                     "its plan")
    weights = ones if mode in ("scaled", "cost") else ctx.weights
    to_come = 3 if mode == "goodput" else 2  # max-min, goodput, cost
    ctx.cover = _coverage(ctx, weights, left(to_come + 1))
    mm = _solve_served(ctx, "maxmin", weights, None, left(to_come), gap)
    t, t_max = _uniform(ctx, mm, weights), _t_bound(ctx, mm)
    stages["stage 1 (max-min)"] = mm.out
    if ctx.cover.x is not None:
        notes.append(f"coverage: {ctx.cover.words}")
    notes.append(f"stage 1 (max-min served fraction): t = {t:.6g} (proven t ≤ "
                 f"{'(no bound proven)' if t_max is None else f'{t_max:.6g}'}), {mm.out.status}, {mm.out.time_s:.3f} s")
    source, scale = mm, 1.0
    spent += mm.out.time_s
    if (mm.served >= 1 - 1e-9).all():
        fraction: float | np.ndarray = 1.0
        cost_weights = None
    elif mode == "cost":
        raise _explain(ctx, mm, weights, left(), gap)
    elif mode == "scaled":
        scale = math.floor(t / scale_step + 1e-9) * scale_step
        if scale <= 0:
            raise _explain(ctx, mm, weights, left(), gap)
        fraction, cost_weights = scale, None
        notes.append(f"demand scale {scale:.4g}")
    elif mode == "maxmin":
        if t <= 0:
            raise _explain(ctx, mm, weights, left(), gap)
        fraction, cost_weights = t * (1 - 1e-9), weights
    else:
        floor = fairness * t * weights
        if fairness > 0 and t <= 0:  # no uniform share: every model the coverage serves keeps an instance
            floor = ctx.cover.floor
        gp = _solve_served(ctx, "goodput", weights, floor, left(2), gap, prev=mm)
        spent += gp.out.time_s
        stages["stage 2 (goodput)"] = gp.out
        notes.append(f"stage 2 (SLO goodput, floor {fairness:g}·t per model"
                     f"{', an instance of each phase for each covered model' if t <= 0 < fairness else ''}): "
                     f"{_served_words(ctx, gp.served)}, {gp.out.status}, {gp.out.time_s:.3f} s")
        if gp.out.x is not None:
            source = gp
        # each model's phases at the lesser of their shares: a request needs both, more of one phase is waste
        least = {m: min(f for (mm, _p), f in zip(ctx.keys, source.served, strict=True) if mm == m) for m, _p in ctx.keys}
        fraction, cost_weights = np.array([least[m] for m, _p in ctx.keys]) * (1 - 1e-9), None
    cost = _solve_cost(ctx, fraction, cost_weights, left(), gap, prev=source, slack=slack)
    if cost.out.x is None:
        if source.out.x is None:
            raise _explain(ctx, mm, weights, left(), gap)
        notes.append(f"cost stage found no plan ({cost.out.status}): the previous stage's plan is kept")
        stages["stage 3 (cost)"] = cost.out
        cost = source
    return _plan(ctx, cost.out, cost.layout, mode, _report(ctx, cost.out, spent, notes, stages, slack), method,
                 scale=scale)


def _explain(ctx: _Context, mm: _Stage | None, weights: np.ndarray, time_limit: float, gap: float
             ) -> InfeasibleDemand:
    """`diagnose` of the max-min stage `mm`, solved (again) through the LP pipeline when it has no row duals (the
    better of the two solves' t and the lesser of their proven bounds on it are kept)."""
    solved = [] if mm is None else [mm]
    if mm is None or mm.out.row_dual is None:
        mm = _solve_served(ctx, "maxmin", weights, None, time_limit, gap, duals=True)
        solved.append(mm)
    proven = [b for b in (_t_bound(ctx, st) for st in solved) if b is not None]
    t = max(_uniform(ctx, st, weights) for st in solved)
    return diagnose(ctx, mm.out, mm.layout, t, min(proven) if proven else None)


def _t_bound(ctx: _Context, mm: _Stage) -> float | None:
    """A proven upper bound on the max-min stage's t (never an incumbent): 0 when `_coverage` proved that some
    model can get no instance, else the solver's bound on its objective −t (HiGHS's dual bound, or the LP
    pipeline's), at most 1; None when no bound was proven (a limit stopped the solve first)."""
    if ctx.cover is not None and ctx.cover.t_zero:
        return 0.0
    b = mm.out.bound
    return None if b is None or not np.isfinite(b) else float(min(1.0, max(0.0, -b)))


def _uniform(ctx: _Context, stage: _Stage, weights: np.ndarray) -> float:
    """The uniform weighted share a stage reaches: min over keys with demand of served / w, at most 1."""
    pos = ctx.demand > 0
    return float(min(1.0, (stage.served[pos] / weights[pos]).min(initial=1.0)))


def _served_words(ctx: _Context, served: np.ndarray) -> str:
    total = float(ctx.demand.sum())
    got = float((served * ctx.demand).sum())
    return f"{got / total if total else 1.0:.1%} of demand served, least {served.min(initial=1.0):.1%}"


def estimated_nodes(scenario: Scenario, library: TemplateLibrary, catalog: Catalog | None = None) -> dict[str, int]:
    """Nodes per config in the cost-optimal plan with unlimited availability (E_c of `coral.allocation.availability`). Memoised per library
    object, scenario and prices: a re-planner resolving availability every epoch solves it once."""
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
