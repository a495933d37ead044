"""The paper's placement ILP (§4.2), solved with HiGHS: the reference the fast solver is checked against."""

from __future__ import annotations

from dataclasses import dataclass

import highspy
import numpy as np

from coral.highs import quiet_highs


@dataclass(frozen=True)
class IlpResult:
    throughput: float
    stages: int
    status: str
    seconds: float


def sparse_model(
    n_cols: int, rows: list[tuple[dict[int, float], float, float]], cost: np.ndarray,
    lower: np.ndarray, upper: np.ndarray, integer: np.ndarray, maximise: bool,
) -> highspy.HighsLp:
    """A HiGHS model from sparse rows {col: coef} with bounds, passed column-wise."""
    lp = highspy.HighsLp()
    lp.num_col_ = n_cols
    lp.num_row_ = len(rows)
    lp.col_cost_ = cost.astype(float)
    lp.col_lower_ = lower.astype(float)
    lp.col_upper_ = upper.astype(float)
    lp.row_lower_ = np.array([r[1] for r in rows], dtype=float)
    lp.row_upper_ = np.array([r[2] for r in rows], dtype=float)
    entries = sorted((c, i, v) for i, (coefs, _, _) in enumerate(rows) for c, v in coefs.items())
    cols = np.array([e[0] for e in entries], dtype=np.int64)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.searchsorted(cols, np.arange(n_cols + 1)).astype(np.int32)
    lp.a_matrix_.index_ = np.array([e[1] for e in entries], dtype=np.int32)
    lp.a_matrix_.value_ = np.array([e[2] for e in entries], dtype=float)
    lp.integrality_ = [highspy.HighsVarType.kInteger if b else highspy.HighsVarType.kContinuous for b in integer]
    lp.sense_ = highspy.ObjSense.kMaximize if maximise else highspy.ObjSense.kMinimize
    return lp


def solve_stage_count(slots: list[int], tables: np.ndarray, s_count: int, time_limit: float = 60.0) -> IlpResult:
    """max T over x_sj (stage s holds j layers), y_sk (node k in stage s), z_sjk = x_sj * y_sk."""
    n, n_layers = len(slots), tables.shape[2] - 1
    js = range(1, n_layers + 1)
    x = {(s, j): i for i, (s, j) in enumerate((s, j) for s in range(s_count) for j in js)}
    y = {(s, k): len(x) + i for i, (s, k) in enumerate((s, k) for s in range(s_count) for k in range(n))}
    z: dict[tuple[int, int, int], int] = {}
    for s in range(s_count):
        for j in js:
            for k in range(n):
                z[(s, j, k)] = len(x) + len(y) + len(z)
    t_col = len(x) + len(y) + len(z)
    rows: list[tuple[dict[int, float], float, float]] = []
    for s in range(s_count):
        rows.append(({x[(s, j)]: 1.0 for j in js}, 1.0, 1.0))
    for k in range(n):
        rows.append(({y[(s, k)]: 1.0 for s in range(s_count)}, 1.0, 1.0))
    rows.append(({x[(s, j)]: float(j) for s in range(s_count) for j in js}, n_layers, n_layers))
    for s in range(s_count):
        coefs = {t_col: 1.0}
        for j in js:
            for k in range(n):
                coefs[z[(s, j, k)]] = -float(tables[s_count - 1, slots[k], j])
        rows.append((coefs, -np.inf, 0.0))
    for (s, j, k), col in z.items():
        rows.append(({col: 1.0, x[(s, j)]: -1.0}, -np.inf, 0.0))
        rows.append(({col: 1.0, y[(s, k)]: -1.0}, -np.inf, 0.0))
        rows.append(({col: 1.0, x[(s, j)]: -1.0, y[(s, k)]: -1.0}, -1.0, np.inf))
    n_cols = t_col + 1
    cost = np.zeros(n_cols)
    cost[t_col] = 1.0
    upper = np.ones(n_cols)
    upper[t_col] = np.inf
    integer = np.ones(n_cols, dtype=bool)
    integer[t_col] = False
    h = quiet_highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", 1e-9)
    h.setOptionValue("mip_feasibility_tolerance", 1e-9)
    h.passModel(sparse_model(n_cols, rows, cost, np.zeros(n_cols), upper, integer, maximise=True))
    h.run()
    status = h.modelStatusToString(h.getModelStatus())
    value = h.getInfo().objective_function_value if status == "Optimal" else 0.0
    return IlpResult(float(value), s_count, status, float(h.getRunTime()))


def solve_reference(slots: list[int], tables: np.ndarray, time_limit: float = 60.0) -> IlpResult:
    """Best over S = 1..min(n, L) of the per-S ILP, as the paper does."""
    n_layers = tables.shape[2] - 1
    results = [solve_stage_count(slots, tables, s, time_limit) for s in range(1, min(len(slots), n_layers) + 1)]
    best = max(results, key=lambda r: r.throughput)
    return IlpResult(best.throughput, best.stages, best.status, sum(r.seconds for r in results))
