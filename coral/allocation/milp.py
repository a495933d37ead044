"""A thin HiGHS wrapper: a sparse (column-wise) MILP in, status/objective/bound/gap/solution out.

Deterministic: HiGHS runs with one thread and serial simplex, and stops on work limits (branch-and-bound nodes
for a MIP, simplex iterations for an LP), so the same model gives the same answer on an idle or a loaded
machine. The wall-clock `time_limit` is only a safety net: when it stops HiGHS (or has run out before the
solve, which then does not start) the result says so (`MilpResult.safety_net`), since what it returns then
depends on the machine's speed and load."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import highspy
import numpy as np

from coral.highs import quiet_highs


@dataclass
class SparseRows:
    """Constraint rows collected as COO triplets, turned into a CSC matrix for HiGHS."""

    n_cols: int
    rows: list[np.ndarray] = field(default_factory=list)
    cols: list[np.ndarray] = field(default_factory=list)
    vals: list[np.ndarray] = field(default_factory=list)
    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)

    @property
    def n_rows(self) -> int:
        return len(self.lower)

    def add(self, cols: np.ndarray, vals: np.ndarray, lower: float, upper: float) -> int:
        """Append one row sum(vals · x[cols]) in [lower, upper]; returns its index."""
        r = self.n_rows
        self.rows.append(np.full(len(cols), r, dtype=np.int64))
        self.cols.append(np.asarray(cols, dtype=np.int64))
        self.vals.append(np.asarray(vals, dtype=float))
        self.lower.append(lower)
        self.upper.append(upper)
        return r

    def add_many(self, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, lower: np.ndarray,
                 upper: np.ndarray) -> None:
        """Append len(lower) rows given as triplets with row numbers local to this batch."""
        base = self.n_rows
        self.rows.append(np.asarray(rows, dtype=np.int64) + base)
        self.cols.append(np.asarray(cols, dtype=np.int64))
        self.vals.append(np.asarray(vals, dtype=float))
        self.lower.extend(np.asarray(lower, dtype=float).tolist())
        self.upper.extend(np.asarray(upper, dtype=float).tolist())

    def csc(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        r = np.concatenate(self.rows) if self.rows else np.zeros(0, dtype=np.int64)
        c = np.concatenate(self.cols) if self.cols else np.zeros(0, dtype=np.int64)
        v = np.concatenate(self.vals) if self.vals else np.zeros(0)
        keep = v != 0
        r, c, v = r[keep], c[keep], v[keep]
        order = np.lexsort((r, c))
        r, c, v = r[order], c[order], v[order]
        start = np.searchsorted(c, np.arange(self.n_cols + 1)).astype(np.int32)
        return start, r.astype(np.int32), v


@dataclass
class MilpResult:
    status: str
    x: np.ndarray | None
    objective: float | None
    bound: float | None
    gap: float | None
    time_s: float
    n_cols: int
    n_rows: int
    row_dual: np.ndarray | None = None
    safety_net: str | None = None  # words when the wall-clock time limit stopped HiGHS (else None)
    nodes: int = 0  # branch-and-bound nodes HiGHS explored (0 for an LP)


#: work limits (`solve`'s defaults): simplex iterations of an LP, branch-and-bound nodes of a MIP. Far above what
#: the allocator's problems need (core and extended close in at most a few hundred nodes); they bound the work
#: deterministically, where the time limit is a safety net only
LP_ITERATIONS = 5_000_000
MIP_NODES = 50_000
TIME_LIMIT_STATUS = "Time limit reached"
_threads_fixed: bool | None = None  # whether HiGHS's thread scheduler runs one thread (None: not known yet)


def _single_threaded(h: highspy.Highs) -> None:
    """One HiGHS thread and serial simplex. HiGHS's scheduler is global: once another solve in the process started
    it with more threads, asking for one fails the run, so then only the serial simplex is set (HiGHS's MIP search
    is deterministic for a given thread count)."""
    h.setOptionValue("parallel", "off")
    h.setOptionValue("simplex_strategy", 1)  # dual simplex, serial
    h.setOptionValue("random_seed", 0)
    if _threads_fixed is not False:
        h.setOptionValue("threads", 1)


def _finite(value: float) -> float | None:
    """`value` as a float, None where HiGHS reports none (an infinite bound or gap)."""
    return float(value) if math.isfinite(value) else None


def solve(
    cost: np.ndarray,
    lower: np.ndarray,
    upper: np.ndarray,
    integer: np.ndarray,
    rows: SparseRows,
    *,
    maximise: bool = False,
    time_limit: float = 30.0,
    gap: float = 1e-4,
    abs_gap: float | None = None,
    start: np.ndarray | None = None,
    cutoff: float | None = None,
    relax: bool = False,
    max_nodes: int = MIP_NODES,
    max_iterations: int = LP_ITERATIONS,
) -> MilpResult:
    """Solve min/max cost·x over rows and bounds; the best incumbent is returned when a limit stops the search:
    the work limits `max_nodes` (branch-and-bound nodes) and `max_iterations` (simplex iterations of an LP), or
    the wall-clock `time_limit`, a safety net whose hit is recorded in `safety_net`. `relax` drops
    integrality (then `row_dual` is filled). `start` is a feasible warm start of a minimisation, passed as an
    objective cutoff (HiGHS 1.16's setSolution returned the start vector with another solution's objective
    on large models here) and returned when nothing better exists. The MIP stops at relative gap `gap` or, when
    given, at absolute gap `abs_gap` (objective − bound), whichever comes first."""
    t0 = time.perf_counter()
    n = len(cost)
    mip = not relax and integer.any()
    start_obj = float(np.dot(cost, start)) if start is not None and not relax else None
    if time_limit <= 0:  # the safety net has run out: no run, the warm start (if any) is the answer
        return MilpResult(TIME_LIMIT_STATUS, None if start_obj is None else np.asarray(start, dtype=float), start_obj,
                          None, None, 0.0, n, rows.n_rows, safety_net="the wall-clock time limit had run out before a "
                          f"{'MIP' if mip else 'LP'} of {n} columns and {rows.n_rows} rows")
    lp = highspy.HighsLp()
    lp.num_col_ = n
    lp.num_row_ = rows.n_rows
    lp.col_cost_ = np.asarray(cost, dtype=float)
    lp.col_lower_ = np.asarray(lower, dtype=float)
    lp.col_upper_ = np.asarray(upper, dtype=float)
    lp.row_lower_ = np.array(rows.lower, dtype=float)
    lp.row_upper_ = np.array(rows.upper, dtype=float)
    start_idx, index, value = rows.csc()
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = start_idx
    lp.a_matrix_.index_ = index
    lp.a_matrix_.value_ = value
    lp.sense_ = highspy.ObjSense.kMaximize if maximise else highspy.ObjSense.kMinimize
    if not relax and integer.any():
        lp.integrality_ = [highspy.HighsVarType.kInteger if b else highspy.HighsVarType.kContinuous for b in integer]
    global _threads_fixed
    h = quiet_highs()
    h.setOptionValue("output_flag", False)
    _single_threaded(h)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_max_nodes", int(max(1, max_nodes)))
    h.setOptionValue("simplex_iteration_limit", int(max(1, max_iterations)))
    h.setOptionValue("mip_rel_gap", float(gap))
    if abs_gap is not None:
        h.setOptionValue("mip_abs_gap", float(abs_gap))
    if start_obj is not None:
        cutoff = start_obj + 1e-9 * max(1.0, abs(start_obj)) if cutoff is None else min(cutoff, start_obj)
    if cutoff is not None and not relax:
        h.setOptionValue("objective_bound", float(cutoff))
    h.passModel(lp)
    ran = h.run()
    if ran == highspy.HighsStatus.kError and h.getModelStatus() == highspy.HighsModelStatus.kNotset and \
            _threads_fixed is not False:
        _threads_fixed = False  # the scheduler already runs more threads (`_single_threaded`)
        h.setOptionValue("threads", 0)
        h.run()
    elif _threads_fixed is None:
        _threads_fixed = True
    status = h.modelStatusToString(h.getModelStatus())
    if status == "Solution limit reached":  # what HiGHS calls a stop at `mip_max_nodes`
        status = "Node limit reached"
    net = None
    if status == TIME_LIMIT_STATUS:
        net = (f"the wall-clock time limit ({time_limit:.3g} s) stopped HiGHS on a {'MIP' if mip else 'LP'} of {n} "
               f"columns and {rows.n_rows} rows")
    status = "Optimal" if status == "Empty" else status  # no columns or rows: the zero point is optimal
    info = h.getInfo()
    solution = h.getSolution()
    has_x = bool(solution.value_valid) and info.primal_solution_status == 2
    x = np.array(solution.col_value) if has_x else None
    objective = float(info.objective_function_value) if has_x else None
    dual_bound = _finite(info.mip_dual_bound)  # HiGHS says -inf when a limit stopped it before any bound
    bound = dual_bound if mip else objective
    mip_gap = _finite(info.mip_gap) if mip and has_x else (0.0 if has_x else None)
    duals = np.array(solution.row_dual) if relax and solution.dual_valid else None
    if x is None and start is not None:
        # nothing better than the warm start exists (infeasible under the cutoff) or was found within the limits
        x, objective = np.asarray(start, dtype=float), start_obj
        bound = start_obj if status == "Infeasible" else (
            None if dual_bound is None else min(dual_bound, start_obj or 0.0))
        status = "Optimal" if status == "Infeasible" else status
        mip_gap = None if bound is None else \
            max(0.0, ((objective or 0.0) - bound) / max(abs(objective or 0.0), 1e-9))
    return MilpResult(status, x, objective, bound, mip_gap, time.perf_counter() - t0, n, rows.n_rows, duals, net,
                      int(info.mip_node_count) if mip else 0)
