"""The reference joint formulation for the exactness check (tiny instances only).

Instead of the two-stage pipeline (templates with their best placement, then the allocation ILP), one ILP
chooses node multisets *and* their placements directly: every (multiset, assignment of nodes to stages, layer
split, region) is a column with the throughput that placement achieves (slowest stage, a stage being the sum of
its nodes' T^S_j), and the ILP picks integer counts meeting demand within availability at least cost. No
dominance, no reductions, no placement solver: if the pipeline is exact, both reach the same optimal cost.
"""

from __future__ import annotations

import itertools

import numpy as np

from coral.allocation import milp
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
