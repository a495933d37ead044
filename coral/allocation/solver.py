"""The allocation MILP: columns (template, region), demand and availability rows, scale-up penalty, and a
three-step solve (LP by column generation → incumbent on a restricted column set → exact MIP on the columns that
survive reduced-cost fixing).

Model (cost mode). x_j ∈ Z≥0 instances of column j = (template, region), c_j its $/h, T_j its tokens/s:
    min  Σ_j c_j x_j + Σ_j I_j
    s.t. Σ_{j ∈ key} T_j x_j ≥ D_key                       every (model, phase) with demand
         Σ_j n_{jc} x_j ≤ A_{rc}  over j in region r       every (region, config)
         I_j ≥ K c_j (x_j − ν_j),  I_j ≥ 0                  scale-up penalty against the running ν
For a column that is not running (ν_j = 0) the penalty is exactly K c_j x_j and is folded into its cost, so I_j
exists only for running columns; scale-down (x_j < ν_j) is free.

Separable bounds (lossless). Rows of the form Σ a x ≤ U with a ≥ 0 (availability) are the only ones that tie
demand keys together. Dropping another key's columns from such a row relaxes it (x ≥ 0), so the optimum of one
key's columns alone is a lower bound L_k on what those columns cost in any feasible solution: Σ_k L_k bounds
the whole problem, and when the keys' own optima fit the shared rows together they are its optimum (within the
keys' gaps). Keys whose optima overflow a shared row together are merged and solved jointly (the same argument
holds for a group of keys) until the optima fit or one group is left; then the full solve below runs, with
Σ L_k as a bound. The requested gap is on the whole objective, so a merged group may close at the absolute gap
the other parts leave unused (`gap_budget`).

Reduced-cost fixing (lossless). For any multipliers y of the rows with the right signs and reduced costs
r = c − Aᵀy, every feasible x satisfies c·x ≥ z(y) + Σ_{r_j>0} r_j x_j with z(y) = Σ_i y_i b_i + Σ_{r_j<0} r_j u_j.
Hence a column with z(y) + r_j > UB (UB = any incumbent's objective) is zero in every solution at least as good
as the incumbent, and dropping it keeps the optimum. y comes from the LP relaxation solved by column generation.

Deterministic. Every decision of the pipeline rests on counts (cut rounds, columns, branch-and-bound nodes per
MIP, `milp`'s simplex iteration limit), never on the clock, so the same problem gives the same plan on an idle or
a loaded machine. The `time_limit` of a call is a wall-clock safety net only: every HiGHS solve in it gets what
is left of it, none starts once it has run out (every loop then ends with its incumbent or warm start), and when
it stops one, `Outcome.safety_net` says where (the answer then depends on the machine).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from coral.allocation import milp


@dataclass
class Problem:
    """min cost·x over rows L ≤ A x ≤ U and 0 ≤ x ≤ upper, with A given as COO entries sorted by column."""

    cost: np.ndarray
    upper: np.ndarray
    integer: np.ndarray
    entry_row: np.ndarray
    entry_col: np.ndarray
    entry_val: np.ndarray
    row_lower: np.ndarray
    row_upper: np.ndarray
    protected: np.ndarray  # columns never removed by fixing (running, penalty, t)
    score: np.ndarray  # higher = better column to seed the restricted problems with
    group: np.ndarray  # seed group of each column (-1: always seeded)
    artificial: np.ndarray  # LP-only slack columns (demand shortfall at a prohibitive cost)
    parent: np.ndarray | None = None  # column whose capacity a share column uses (-1: none)

    @property
    def n(self) -> int:
        return len(self.cost)

    def rows(self, cols: np.ndarray) -> milp.SparseRows:
        """Constraint rows restricted to `cols` (renumbered in the given order)."""
        pos = np.full(self.n, -1, dtype=np.int64)
        pos[cols] = np.arange(len(cols))
        keep = pos[self.entry_col] >= 0
        rows = milp.SparseRows(len(cols))
        rows.add_many(self.entry_row[keep], pos[self.entry_col[keep]], self.entry_val[keep],
                      self.row_lower, self.row_upper)
        return rows

    def reduced_costs(self, y: np.ndarray) -> np.ndarray:
        return self.cost - np.bincount(self.entry_col, self.entry_val * y[self.entry_row], minlength=self.n)

    def lagrangian_bound(self, y: np.ndarray, rc: np.ndarray) -> float:
        """z(y) over the real (non-artificial) columns."""
        rows = np.where(y > 0, y * np.where(np.isfinite(self.row_lower), self.row_lower, 0.0),
                        y * np.where(np.isfinite(self.row_upper), self.row_upper, 0.0))
        neg = (rc < 0) & ~self.artificial
        return float(rows.sum() + (rc[neg] * self.upper[neg]).sum())

    def violation(self, x: np.ndarray) -> float:
        ax = np.bincount(self.entry_row, self.entry_val * x[self.entry_col], minlength=len(self.row_lower))
        scale = np.maximum(1.0, np.abs(np.where(np.isfinite(self.row_lower), self.row_lower, 0.0)))
        low = np.where(np.isfinite(self.row_lower), self.row_lower - ax, 0.0) / scale
        high = np.where(np.isfinite(self.row_upper), ax - self.row_upper, 0.0) / scale
        return float(max(low.max(initial=0.0), high.max(initial=0.0), (x - self.upper).max(initial=0.0)))


@dataclass
class Outcome:
    status: str
    x: np.ndarray | None
    objective: float | None
    bound: float | None
    gap: float | None
    time_s: float
    n_cols: int
    n_rows: int
    notes: list[str] = field(default_factory=list)
    lp_bound: float | None = None
    row_dual: np.ndarray | None = None
    safety_net: str | None = None  # words when the wall-clock time limit stopped a solve (the answer then depends
    # on the machine's speed and load); None: every limit that stopped a solve was a deterministic one


def _gap(objective: float, bound: float) -> float:
    """The relative gap of `objective` over `bound`, at least 0 (0 at a zero objective)."""
    return max(0.0, (objective - bound) / max(abs(objective), 1e-9)) if objective else 0.0


def _nets(*nets: str | None) -> str | None:
    """Safety-net hits joined in words (each once), None when there are none."""
    seen = list(dict.fromkeys(n for part in nets if part for n in part.split("; ")))
    return "; ".join(seen) or None


def _left(deadline: float) -> float:
    """Seconds left before `deadline` (the safety net of the whole call), 0 once it has passed (then no further
    HiGHS run starts, `milp.solve`, and every loop of the pipeline ends with its incumbent)."""
    return max(0.0, deadline - time.perf_counter())


Rounder = Callable[[np.ndarray], np.ndarray | None]  # LP point -> feasible point (or None)

SEED_PER_GROUP = 8
PRICE_BATCH = 400
CUT_ROUNDS = 12  # 0 disables the cutting-plane rounds (benchmarks compare)
CUT_MULTIPLES = (1, 2, 3)
SEPARATE = True  # False skips the separate optima of the parts (benchmarks compare)
FULL_MIP_COLUMNS = 12_000  # a final MIP estimated to set up in over PARTIAL_S keeps this many columns
MIP_S_PER_COLUMN = 2e-4  # HiGHS's set-up seconds per column of a large MIP on 2 cores: a fixed estimate, not measured
PARTIAL_S = 20.0  # estimated set-up seconds above which the final MIP is restricted (100,000 columns)
# work limits in branch-and-bound nodes (deterministic; the time limit is a safety net only). The allocator's
# problems close in far fewer: core and extended, every mode, in at most a few hundred per MIP
RESTRICTED_NODES = 2_000  # the incumbent's MIP on the restricted column set
FINAL_NODES = milp.MIP_NODES  # the final MIP, and `one_mip`
SEPARATE_NODES = (2_000, milp.MIP_NODES)  # each part's MIPs in separate_optima: first pass, then the parts that
# did not close their gap in it, from their incumbents


def _seed(p: Problem, start: np.ndarray | None) -> np.ndarray:
    """Always-seeded columns, the best SEED_PER_GROUP of every group by score, and the warm start's support."""
    sel = np.zeros(p.n, dtype=bool)
    sel[p.group < 0] = True
    order = np.lexsort((-p.score, p.group))
    g = p.group[order]
    first = np.searchsorted(g, g)
    rank = np.arange(len(g)) - first
    sel[order[(rank < SEED_PER_GROUP) & (g >= 0)]] = True
    if start is not None:
        sel |= start > 0
    if p.parent is not None:  # the shares of every seeded column
        share = p.parent >= 0
        sel[share] |= sel[p.parent[share]]
    return np.flatnonzero(sel)


def _lp(p: Problem, cols: np.ndarray, time_limit: float, nets: list[str] | None = None
        ) -> tuple[milp.MilpResult, np.ndarray, np.ndarray]:
    """LP over all columns by column generation from `cols`; returns the LP, its columns and row duals. When
    the restricted LP is infeasible (its columns cannot cover a row that others could), `_phase_one` first
    prices in columns until it is feasible; when no column set is, the LP is infeasible and the duals are
    phase one's (positive on the rows that cannot be covered, negative on the rows that bind them). An LP that
    a limit stopped (not optimal, not infeasible) is returned without a point (`x` None). `time_limit` is the
    safety net of all its LPs together; its hits are appended to `nets`."""
    cols = np.sort(cols)
    deadline = time.perf_counter() + time_limit
    while True:
        res = milp.solve(p.cost[cols], np.zeros(len(cols)), p.upper[cols], p.integer[cols], p.rows(cols),
                         time_limit=_left(deadline), relax=True)
        if res.safety_net and nets is not None:
            nets.append(res.safety_net)
        if res.status not in ("Optimal", "Infeasible"):
            res.x, res.row_dual = None, None
        if res.status == "Infeasible":
            grown, y = _phase_one(p, cols, _left(deadline), nets)
            if y is not None or len(grown) == len(cols):
                return res, grown, np.zeros(len(p.row_lower)) if y is None else y
            cols = grown
            continue
        if res.row_dual is None or res.x is None:
            return res, cols, np.zeros(len(p.row_lower))
        y = _signed(p, res.row_dual)
        rc = p.reduced_costs(y)
        rc[cols] = 0.0
        tol = 1e-9 * max(1.0, float(np.abs(p.cost).max(initial=1.0)))
        cand = np.flatnonzero(rc < -tol)
        if not len(cand):
            return res, cols, y
        add = cand[np.argsort(rc[cand])[:PRICE_BATCH]]
        cols = np.union1d(cols, add)


def _phase_one(p: Problem, cols: np.ndarray, time_limit: float, nets: list[str] | None = None
               ) -> tuple[np.ndarray, np.ndarray | None]:
    """Column generation on the phase-one LP: min Σ_i s_i / scale_i with a slack s_i on every row that x = 0
    violates (lower > 0 or upper < 0), all other costs zero. Every restricted phase-one LP is feasible by
    construction. Returns (columns, None) once the slacks reach zero (the restricted LP over those columns is
    feasible), or (columns, row duals) when no column prices out and a slack stays positive: then no x in the
    bounds meets the rows, i.e. the LP over all columns is infeasible (the duals are a Farkas certificate).
    `time_limit`: the safety net of all its LPs together (hits appended to `nets`)."""
    deadline = time.perf_counter() + time_limit
    low_bad = np.isfinite(p.row_lower) & (p.row_lower > 0)
    high_bad = np.isfinite(p.row_upper) & (p.row_upper < 0)
    bad = np.flatnonzero(low_bad | high_bad)
    sign = np.where(low_bad[bad], 1.0, -1.0)
    scale = np.maximum(1.0, np.abs(np.where(low_bad[bad], p.row_lower[bad], p.row_upper[bad])))
    while True:
        rows = p.rows(cols)
        slack = milp.SparseRows(len(cols) + len(bad))
        slack.rows, slack.cols, slack.vals = list(rows.rows), list(rows.cols), list(rows.vals)
        slack.lower, slack.upper = rows.lower, rows.upper
        slack.rows.append(bad)
        slack.cols.append(len(cols) + np.arange(len(bad)))
        slack.vals.append(sign)
        n = len(cols) + len(bad)
        upper = np.concatenate([p.upper[cols], np.full(len(bad), np.inf)])
        res = milp.solve(np.concatenate([np.zeros(len(cols)), 1.0 / scale]), np.zeros(n), upper,
                         np.zeros(n, dtype=bool), slack, time_limit=_left(deadline), relax=True)
        if res.safety_net and nets is not None:
            nets.append(res.safety_net)
        if res.x is None or res.row_dual is None or res.status != "Optimal":
            return cols, np.zeros(len(p.row_lower))
        if (res.x[len(cols):] <= 1e-9 * scale).all():
            return cols, None
        y = _signed(p, res.row_dual)
        rc = -np.bincount(p.entry_col, p.entry_val * y[p.entry_row], minlength=p.n)
        rc[cols] = 0.0
        cand = np.flatnonzero((rc < -1e-9) & (p.upper > 0))
        if not len(cand):
            return cols, y
        cols = np.union1d(cols, cand[np.argsort(rc[cand])[:PRICE_BATCH]])


def _signed(p: Problem, dual: np.ndarray) -> np.ndarray:
    """Row multipliers with the signs that make the Lagrangian bound valid (≥ rows: y ≥ 0, ≤ rows: y ≤ 0)."""
    y = np.asarray(dual, dtype=float).copy()
    y[~np.isfinite(p.row_lower) & (y > 0)] = 0.0
    y[~np.isfinite(p.row_upper) & (y < 0)] = 0.0
    return y


def rounding_cuts(p: Problem, x: np.ndarray) -> Problem | None:
    """`p` with the Chvátal-Gomory cuts that `x` violates appended, or None when there are none. From every
    covering row Σ a_i x_i ≥ b over integer columns (a > 0; the LP-only artificial slack is left out, it is zero
    in every real solution) and every column j fractional in `x`: Σ ⌈u a_i⌉ x_i ≥ ⌈u b⌉ with u = m / a_j
    (m in CUT_MULTIPLES), valid for every integer point because the left side is an integer ≥ u·b."""
    real = ~p.artificial[p.entry_col]
    order = np.argsort(p.entry_row, kind="stable")
    bounds = np.searchsorted(p.entry_row[order], np.arange(len(p.row_lower) + 1))
    er: list[np.ndarray] = []
    ec: list[np.ndarray] = []
    ev: list[np.ndarray] = []
    lower: list[float] = []
    for r in np.flatnonzero(np.isfinite(p.row_lower) & (p.row_lower > 0) & ~np.isfinite(p.row_upper)):
        e = order[bounds[r]:bounds[r + 1]]
        e = e[real[e]]
        cols, a = p.entry_col[e], p.entry_val[e]
        if not len(cols) or not p.integer[cols].all() or (a <= 0).any():
            continue
        b = float(p.row_lower[r])
        frac = cols[np.abs(x[cols] - np.round(x[cols])) > 1e-6]
        for j in frac:
            for m in CUT_MULTIPLES:
                u = m / float(a[cols == j][0])
                coef, rhs = np.ceil(u * a - 1e-9), float(np.ceil(u * b - 1e-6))
                if coef @ x[cols] < rhs - 1e-6:
                    er.append(np.full(len(cols), len(p.row_lower) + len(lower)))
                    ec.append(cols)
                    ev.append(coef)
                    lower.append(rhs)
    if not lower:
        return None
    return Problem(p.cost, p.upper, p.integer, np.concatenate([p.entry_row, *er]),
                   np.concatenate([p.entry_col, *ec]), np.concatenate([p.entry_val, *ev]),
                   np.concatenate([p.row_lower, lower]), np.concatenate([p.row_upper, np.full(len(lower), np.inf)]),
                   p.protected, p.score, p.group, p.artificial, p.parent)


def repair(p: Problem, x: np.ndarray, max_steps: int = 20_000) -> np.ndarray | None:
    """A feasible point from the LP point `x`, or None: integer columns rounded down (which keeps every packing
    row Σ a x ≤ U with a ≥ 0), artificial slack dropped, then, while a row is short of its lower bound, raise a
    continuous column of it (a scale-up penalty) or buy one more unit of the integer column with the least cost
    per unit of the row's shortfall among those that keep every upper bound. For cost problems without
    share columns (None otherwise): the fallback incumbent when the MIP finds none in time."""
    if (p.cost < 0).any() or (p.parent is not None and (p.parent >= 0).any()):
        return None
    v = np.where(p.integer, np.floor(np.asarray(x, dtype=float) + 1e-9), x)
    v[p.artificial] = 0.0
    v = np.clip(v, 0.0, p.upper)
    by_row = np.argsort(p.entry_row, kind="stable")
    row_ptr = np.searchsorted(p.entry_row[by_row], np.arange(len(p.row_lower) + 1))
    by_col = np.argsort(p.entry_col, kind="stable")
    col_ptr = np.searchsorted(p.entry_col[by_col], np.arange(p.n + 1))
    ax = np.bincount(p.entry_row, p.entry_val * v[p.entry_col], minlength=len(p.row_lower))
    scale = np.maximum(1.0, np.abs(np.where(np.isfinite(p.row_lower), p.row_lower, 0.0)))
    for _ in range(max_steps):
        short = np.where(np.isfinite(p.row_lower), p.row_lower - ax, 0.0) / scale
        r = int(np.argmax(short))
        if short[r] <= 1e-9:
            return v if p.violation(v) <= 1e-9 else None
        e = by_row[row_ptr[r]:row_ptr[r + 1]]
        ok = (p.entry_val[e] > 0) & ~p.artificial[p.entry_col[e]] & (v[p.entry_col[e]] < p.upper[p.entry_col[e]])
        cols, a = p.entry_col[e[ok]], p.entry_val[e[ok]]
        cont = ~p.integer[cols]
        if cont.any():
            j, aj = int(cols[cont][0]), float(a[cont][0])
            step = min((p.row_lower[r] - ax[r]) / aj, p.upper[j] - v[j])
        else:
            lens = col_ptr[cols + 1] - col_ptr[cols]
            owner = np.repeat(np.arange(len(cols)), lens)
            ce = by_col[np.repeat(col_ptr[cols], lens) + np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens,
                                                                                               lens)]
            over = ax[p.entry_row[ce]] + p.entry_val[ce] > p.row_upper[p.entry_row[ce]] + 1e-9
            fits = np.bincount(owner, over, minlength=len(cols)) == 0
            if not fits.any():
                return None
            pick = np.flatnonzero(fits)[np.argmin(p.cost[cols[fits]] / a[fits])]
            j, step = int(cols[pick]), 1.0
        v[j] += step
        ce = by_col[col_ptr[j]:col_ptr[j + 1]]
        ax[p.entry_row[ce]] += step * p.entry_val[ce]
    return None


def packing_rows(p: Problem) -> np.ndarray:
    """Rows Σ a x ≤ U with every a ≥ 0: dropping columns from them relaxes the problem (all x ≥ 0)."""
    negative = np.bincount(p.entry_row, p.entry_val < 0, minlength=len(p.row_lower)) > 0
    return ~np.isfinite(p.row_lower) & ~negative


def components(p: Problem, ignore: np.ndarray | None = None) -> np.ndarray:
    """Component label of every column: columns sharing a row (other than the `ignore`d ones) are in one."""
    label = np.arange(p.n)
    order = np.argsort(p.entry_row, kind="stable")
    rows, cols = p.entry_row[order], p.entry_col[order]
    bounds = np.searchsorted(rows, np.arange(len(p.row_lower) + 1))
    linking = np.flatnonzero(np.ones(len(p.row_lower), dtype=bool) if ignore is None else ~ignore)
    changed = True
    while changed:
        changed = False
        for r in linking:
            members = cols[bounds[r]:bounds[r + 1]]
            if len(members) < 2:
                continue
            roots = label[members]
            low = roots.min()
            if (roots != low).any():
                label[np.isin(label, roots)] = low
                changed = True
    return label


def subproblem(p: Problem, cols: np.ndarray) -> tuple[Problem, np.ndarray]:
    """The problem over `cols` and the rows touching them (returned as the second item)."""
    pos = np.full(p.n, -1, dtype=np.int64)
    pos[cols] = np.arange(len(cols))
    keep = pos[p.entry_col] >= 0
    rows = np.unique(p.entry_row[keep])
    rpos = np.full(len(p.row_lower), -1, dtype=np.int64)
    rpos[rows] = np.arange(len(rows))
    parent = None if p.parent is None else np.where(p.parent[cols] >= 0, pos[p.parent[cols]], -1)
    sub = Problem(p.cost[cols], p.upper[cols], p.integer[cols], rpos[p.entry_row[keep]], pos[p.entry_col[keep]],
                  p.entry_val[keep], p.row_lower[rows], p.row_upper[rows], p.protected[cols], p.score[cols],
                  p.group[cols], p.artificial[cols], parent)
    return sub, rows


def solve(
    p: Problem,
    *,
    time_limit: float = 30.0,
    gap: float = 1e-4,
    start: np.ndarray | None = None,
    reduce: bool = True,
    rounder: Rounder | None = None,
) -> Outcome:
    """Solve `p` to `gap` within the work limits (module doc; best incumbent when one stops a MIP), with
    `time_limit` (s, for the whole call) as the wall-clock safety net. `start` is a feasible warm start;
    `rounder` a problem-specific heuristic turning an LP point into a feasible point (tried when `p` is solved
    as one block). With `reduce`, independent blocks (no shared row, e.g. models that share no scarce config)
    are solved separately, each with the reductions of `solve_block`."""
    if not reduce:
        return one_mip(p, time_limit=time_limit, gap=gap, start=start, note="reductions off")
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    label = components(p)
    blocks = [np.flatnonzero(label == v) for v in np.unique(label)]
    rowless = [b for b in blocks if not np.isin(b, p.entry_col).any()]
    blocks = [b for b in blocks if np.isin(b, p.entry_col).any()]
    if len(blocks) <= 1 and not rowless:
        return solve_block(p, time_limit=time_limit, gap=gap, start=start, rounder=rounder)
    x = np.zeros(p.n)
    y = np.zeros(len(p.row_lower))
    objective, lp_bound, statuses, n_cols, n_rows = 0.0, 0.0, [], 0, 0
    bound: float | None = 0.0  # None once a block has none (a limit stopped it before it proved any)
    nets: list[str | None] = []
    for b in blocks:
        sub, rows = subproblem(p, b)
        out = solve_block(sub, time_limit=_left(deadline), gap=gap, start=None if start is None else start[b])
        statuses.append(out.status)
        nets.append(out.safety_net)
        if out.row_dual is not None:
            y[rows] = out.row_dual
        if out.x is None:
            return Outcome(out.status, None, None, None, None, time.perf_counter() - t0, p.n, len(p.row_lower),
                           out.notes, row_dual=y, safety_net=_nets(*nets))
        x[b] = out.x
        objective += out.objective or 0.0
        bound = None if bound is None or out.bound is None else bound + out.bound
        lp_bound += out.lp_bound or 0.0
        n_cols += out.n_cols
        n_rows += out.n_rows
    for b in rowless:  # columns in no row: zero unless their cost is negative (then at their upper bound)
        x[b] = np.where(p.cost[b] < 0, p.upper[b], 0.0)
        objective += float(p.cost[b] @ x[b])
        bound = None if bound is None else bound + float(p.cost[b] @ x[b])
    worst = next((st for st in statuses if st != "Optimal"), "Optimal")
    g = None if bound is None else _gap(objective, bound)
    return Outcome(worst, x, objective, bound, g, time.perf_counter() - t0, n_cols, n_rows,
                   [f"{len(blocks)} independent blocks", f"LP bound {lp_bound:.6g}"], lp_bound=lp_bound,
                   row_dual=y, safety_net=_nets(*nets))


def one_mip(p: Problem, *, time_limit: float, gap: float, start: np.ndarray | None, note: str) -> Outcome:
    """`p` handed to HiGHS whole (its real columns, no LP pipeline), warm-started from `start`; it stops at
    FINAL_NODES nodes (`time_limit`: the safety net)."""
    t0 = time.perf_counter()
    real = np.flatnonzero(~p.artificial)
    res = milp.solve(p.cost[real], np.zeros(len(real)), p.upper[real], p.integer[real], p.rows(real),
                     time_limit=time_limit, gap=gap, start=None if start is None else start[real],
                     max_nodes=FINAL_NODES)
    full = None
    if res.x is not None:
        full = np.zeros(p.n)
        full[real] = res.x
    return Outcome(res.status, full, res.objective, res.bound, res.gap, time.perf_counter() - t0,
                   res.n_cols, res.n_rows, [note], safety_net=res.safety_net)


@dataclass
class SeparateOptima:
    """Each part of a problem solved alone (its packing rows restricted to its columns)."""

    parts: list[np.ndarray]  # column indices of each part
    x: np.ndarray  # the parts' solutions side by side
    bounds: np.ndarray  # lower bound on each part's cost in any feasible solution
    statuses: list[str]
    n_cols: int
    n_initial: int  # parts before merging
    safety_net: str | None = None  # the wall-clock safety net stopped a part's solve (`Outcome.safety_net`)


def separate_optima(p: Problem, *, time_limit: float, gap: float, start: np.ndarray | None) -> SeparateOptima | None:
    """Solve every part of `p` that only packing rows tie to the others (e.g. one demand key) on its own; parts
    whose optima overflow a shared row together are merged and solved jointly, until the optima fit or one part
    is left. None when `p` has a single part or a part has no solution with a bound. Work by need: a first
    pass gives every part's MIPs SEPARATE_NODES[0] nodes, the parts that did not close their gap in it go on from
    their incumbents with SEPARATE_NODES[1]; `time_limit` (s, all parts together) is the safety net."""
    label = components(p, ignore=packing_rows(p))
    parts = [np.flatnonzero(label == v) for v in np.unique(label)]
    if len(parts) < 2:
        return None
    n_initial = len(parts)
    deadline = time.perf_counter() + time_limit
    nets: list[str | None] = []
    x = np.zeros(p.n)
    bounds = np.zeros(len(parts))
    statuses = [""] * len(parts)
    n_cols = 0
    todo = list(range(len(parts)))
    abs_gap: float | None = None
    while todo:
        for again in (False, True):
            pending = [i for i in todo if not again or statuses[i] != "Optimal"]
            for i in pending:
                cols = parts[i]
                sub, _rows = subproblem(p, cols)
                warm = x[cols] if again else None if start is None else start[cols]
                out = solve_block(sub, time_limit=_left(deadline), gap=gap, separate=False, start=warm,
                                  abs_gap=abs_gap, nodes=SEPARATE_NODES[again])
                nets.append(out.safety_net)
                if out.x is None or out.bound is None or not np.isfinite(out.bound):
                    return None
                x[cols] = out.x
                bounds[i] = max(bounds[i], out.bound)
                statuses[i] = out.status
                n_cols += out.n_cols
        over = overflowing_rows(p, x)
        if not over.any():
            break
        used = np.zeros(p.n, dtype=bool)
        touch = over[p.entry_row] & (x[p.entry_col] > 1e-9)
        used[p.entry_col[touch]] = True
        clash = [i for i, cols in enumerate(parts) if used[cols].any()]
        if len(clash) == len(parts) or len(clash) < 2:
            break
        merged = np.concatenate([parts[i] for i in clash])
        keep = [i for i in range(len(parts)) if i not in clash]
        parts = [parts[i] for i in keep] + [merged]
        bounds = np.append(bounds[keep], bounds[clash].sum())
        statuses = [statuses[i] for i in keep] + [""]
        todo = [len(parts) - 1]
        abs_gap = gap_budget(p.cost, x, parts, bounds, gap)
    return SeparateOptima(parts, x, bounds, statuses, n_cols, n_initial, _nets(*nets))


def gap_budget(cost: np.ndarray, x: np.ndarray, parts: list[np.ndarray], bounds: np.ndarray, gap: float) -> float:
    """Absolute gap the last part may close at so that the whole stays within relative `gap`: the gap is on the
    sum of the parts, so the others' unused share goes to it. With O_i, B_i the others' objectives and bounds
    and B the last part's bound (its objective is at least B): gap · (Σ O_i + B) − Σ (O_i − B_i)."""
    others = [float(cost[c] @ x[c]) for c in parts[:-1]]
    return max(0.0, gap * (sum(others) + float(bounds[-1])) - sum(o - b for o, b in zip(others, bounds[:-1], strict=True)))


def overflowing_rows(p: Problem, x: np.ndarray) -> np.ndarray:
    """Rows whose upper limit `x` exceeds."""
    ax = np.bincount(p.entry_row, p.entry_val * x[p.entry_col], minlength=len(p.row_lower))
    return np.isfinite(p.row_upper) & (ax > p.row_upper + 1e-9 * np.maximum(1.0, np.abs(p.row_upper)))


def solve_block(
    p: Problem,
    *,
    time_limit: float = 30.0,
    gap: float = 1e-4,
    start: np.ndarray | None = None,
    reduce: bool = True,
    separate: bool = True,
    abs_gap: float | None = None,
    rounder: Rounder | None = None,
    nodes: int = FINAL_NODES,
) -> Outcome:
    """Solve one block: the separate optima of its parts (the answer when they fit together, a bound otherwise),
    LP by column generation, incumbent on a restricted set (the better of `start`, the `rounder`'s point from
    the LP optimum and the repaired LP point), reduced-cost fixing, MIP. The MIPs stop at relative gap `gap` or
    absolute gap `abs_gap` (when given), whichever comes first, or at their work limit (the final MIP at `nodes`
    nodes, the restricted one at RESTRICTED_NODES); `time_limit` (s, the whole block) is the safety net."""
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    notes: list[str] = []
    nets: list[str] = []
    separate_bound = -np.inf
    if start is not None and p.violation(start) > 1e-9:
        start = None
    if reduce and separate and SEPARATE:
        sep = separate_optima(p, time_limit=time_limit, gap=gap, start=start)
        if sep is not None:
            if sep.safety_net:
                nets.append(sep.safety_net)
            sep_objective = float(p.cost @ sep.x)
            sep_bound = float(sep.bounds.sum())
            g = _gap(sep_objective, sep_bound)
            fits = p.violation(sep.x) <= 1e-9
            if fits and (g <= gap or sep.safety_net):  # out of time (the safety net): the parts' plan is kept
                worst = next((st for st in sep.statuses if st != "Optimal"), "Optimal")
                return Outcome(worst, sep.x, sep_objective, sep_bound, g, time.perf_counter() - t0, sep.n_cols,
                               len(p.row_lower), [f"{sep.n_initial} parts solved separately ({len(sep.parts)} after "
                                                  f"merging) fit the shared rows together (bound {sep_bound:.6g})"],
                               lp_bound=sep_bound, safety_net=sep.safety_net)
            separate_bound = sep_bound
            if fits:  # within the work limits but not the gap: the parts' plan is the warm start of the full solve
                start = sep.x
            notes.append(f"{sep.n_initial} parts solved separately {'fit short of the gap' if fits else 'overflow'} "
                         f"shared rows (bound {sep_bound:.6g})")
    if not reduce:
        out = one_mip(p, time_limit=_left(deadline), gap=gap, start=start, note="reductions off")
        out.safety_net = _nets(*nets, out.safety_net)
        return out
    n_rows = len(p.row_lower)
    lp, lp_cols, y = _lp(p, _seed(p, start), _left(deadline), nets)
    for _ in range(CUT_ROUNDS):  # tighten the LP bound with rounding cuts at the LP optimum (CUT_ROUNDS at most)
        if lp.x is None:
            break
        lp_x = np.zeros(p.n)
        lp_x[lp_cols] = lp.x
        cut = rounding_cuts(p, lp_x)
        if cut is None:
            break
        p = cut
        lp, lp_cols, y = _lp(p, lp_cols, _left(deadline), nets)
    if lp.x is None:
        kept = start if lp.status != "Infeasible" else None  # stopped by a limit: the warm start is the incumbent
        return Outcome(lp.status if kept is None else f"{lp.status} (incumbent)", kept,
                       None if kept is None else float(p.cost @ kept), None, None, time.perf_counter() - t0, p.n,
                       len(p.row_lower), [f"LP relaxation: {lp.status}"], row_dual=y[:n_rows],
                       safety_net=_nets(*nets))
    lp_x = np.zeros(p.n)
    lp_x[lp_cols] = lp.x
    shortfall = float(lp_x[p.artificial].sum())
    if shortfall > 1e-6:
        return Outcome("Infeasible", None, None, None, None, time.perf_counter() - t0, p.n, len(p.row_lower),
                       [f"LP relaxation short of demand by {shortfall:.6g} tokens/s"], row_dual=y[:n_rows],
                       safety_net=_nets(*nets))
    rc = p.reduced_costs(y)
    z = p.lagrangian_bound(y, rc)
    notes.append(f"LP bound {z:.6g} over {p.n} columns ({len(lp_cols)} generated)")
    rounded = rounder(lp_x) if rounder is not None else None
    if rounded is not None and p.violation(rounded) <= 1e-9 and (start is None or p.cost @ rounded < p.cost @ start):
        start = rounded
        notes.append("incumbent from the LP point by the problem's rounding heuristic")
    if start is None:  # a rounded-and-repaired LP point as the incumbent, when one is found
        start = repair(p, lp_x)
        if start is not None:
            notes.append("incumbent from the LP point, rounded down and repaired")
    incumbent, ub = start, (float(p.cost @ start) if start is not None else np.inf)
    restricted = np.setdiff1d(np.union1d(lp_cols, np.flatnonzero(lp_x > 1e-9)), np.flatnonzero(p.artificial))
    if start is not None:
        restricted = np.union1d(restricted, np.flatnonzero(start > 0))
    sub = milp.solve(p.cost[restricted], np.zeros(len(restricted)), p.upper[restricted], p.integer[restricted],
                     p.rows(restricted), time_limit=_left(deadline), gap=gap, abs_gap=abs_gap,
                     start=None if incumbent is None else incumbent[restricted], max_nodes=min(nodes, RESTRICTED_NODES))
    if sub.safety_net:
        nets.append(sub.safety_net)
    if sub.x is not None and sub.objective is not None and sub.objective < ub:
        incumbent = np.zeros(p.n)
        incumbent[restricted] = np.round(np.where(p.integer[restricted], sub.x, 0.0)) + np.where(
            p.integer[restricted], 0.0, sub.x)
        ub = float(p.cost @ incumbent)
    if np.isfinite(ub):
        slack = 1e-7 * max(1.0, abs(ub))
        alive = (z + rc <= ub + slack) | p.protected
        if incumbent is not None:
            alive |= incumbent > 0
    else:
        alive = np.ones(p.n, dtype=bool)
    alive &= ~p.artificial
    cols = np.flatnonzero(alive)
    notes.append(f"reduced-cost fixing kept {len(cols)} of {p.n} columns (incumbent {ub:.6g})")
    # HiGHS's set-up alone takes long on a very large MIP: when its estimate (MIP_S_PER_COLUMN per column) passes
    # PARTIAL_S, the final MIP keeps the FULL_MIP_COLUMNS columns of least reduced cost (decided on the column
    # count, never on the clock, so that the plan does not depend on the machine)
    partial = len(cols) > FULL_MIP_COLUMNS and MIP_S_PER_COLUMN * len(cols) > PARTIAL_S
    if partial:
        must = p.protected[cols] | (np.zeros(len(cols), dtype=bool) if incumbent is None else incumbent[cols] > 0)
        cols = np.union1d(cols[must], cols[np.argsort(rc[cols], kind="stable")[:FULL_MIP_COLUMNS]])
        if p.parent is not None:  # with the shares of every kept column and the columns of every kept share
            sel = np.zeros(p.n, dtype=bool)
            sel[cols] = True
            share = p.parent >= 0
            sel[share] |= sel[p.parent[share]]
            sel[p.parent[share & sel]] = True
            cols = np.flatnonzero(sel)
        notes.append(f"final MIP on the {len(cols)} columns of least reduced cost (its bound is not the problem's)")
    res = milp.solve(p.cost[cols], np.zeros(len(cols)), p.upper[cols], p.integer[cols], p.rows(cols),
                     time_limit=_left(deadline), gap=gap, abs_gap=abs_gap,
                     start=None if incumbent is None else incumbent[cols], max_nodes=nodes)
    if res.safety_net:
        nets.append(res.safety_net)
    x = None
    if res.x is not None:
        x = np.zeros(p.n)
        x[cols] = res.x
    elif incumbent is not None:
        x = incumbent
    objective = float(p.cost @ x) if x is not None else None
    mip_bound = res.bound if res.bound is not None and not partial else -np.inf
    bound = max(z, separate_bound, mip_bound)
    gap_out = None if objective is None else _gap(objective, bound)
    status = res.status if res.x is not None or x is None else f"{res.status} (incumbent)"
    notes.append(f"{len(p.row_lower) - n_rows} rounding cuts")
    notes.append(f"final MIP: {res.nodes} branch-and-bound nodes (limit {nodes})")
    return Outcome(status, x, objective, bound, gap_out, time.perf_counter() - t0, len(cols), res.n_rows,
                   notes, lp_bound=z, row_dual=y[:n_rows], safety_net=_nets(*nets))
