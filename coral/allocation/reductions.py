"""Lossless reductions of the allocation problem, applied before the MILP is built.

Reductions 1 and 2 depend on the library alone: they are computed when the library is built and stored as its
`dominated` column (`coral.templates.dominance.undominated`); the allocator reads them.

1. Identical node counts within one (model, phase): keep the template with the most throughput.
2. Dominance: template i is dropped when another template j of the same (model, phase) uses no more of every
   node config (a proper sub-multiset of i's nodes) and gives no less throughput. Any solution using i stays
   feasible with j instead (demand: no less tokens/s; availability: no more nodes) and costs no more (prices are
   positive, and a config offered in a region keeps j offered there). The relation is a strict partial order, so
   every dropped template has an undominated dominator that is kept. Templates in the running allocation are kept
   regardless: swapping them out could add a scale-up penalty.
3. Columns (template, region) whose configs are not all offered in the region, or that do not fit the region's
   availability even once, are dropped (they can only be zero).
4. Within one (key, region), columns another column beats on cost, throughput and scarce nodes
   (`pareto_columns`, a sort-filter skyline).
"""

from __future__ import annotations

import numpy as np


def pareto_columns(group: np.ndarray, cost: np.ndarray, throughput: np.ndarray, usage: np.ndarray,
                   keep: np.ndarray, block: int = 256) -> np.ndarray:
    """Boolean mask of columns not dominated within their `group` (one demand key and region), reduction 4:
    column j is dropped when a column i of the same group costs no more, gives no less throughput (every column
    of the 2-D `throughput`, i.e. every request class) and uses no more nodes of every scarce config (`usage`:
    node counts, zero where availability is unlimited). Replacing j by i keeps any solution feasible and no
    dearer (an instance count above ⌈D/T_i⌉ is never needed), so the optimum survives; ties keep the lowest
    index. Columns in `keep` (running) are neither dropped nor used as dominators (their cost differs by the
    scale-up penalty).

    Sort-filter skyline: in the order (group, cost ↑, Σ throughput ↓, Σ usage ↑, index ↑) every dominator comes
    before what it dominates, so j is dropped exactly when an earlier column of its group weakly dominates it,
    and (dominance being transitive) when an earlier *kept* one does. With one rating and no scarce usage that
    is a running maximum of throughput (n log n); otherwise each block of `block` columns is compared with the
    group's kept columns so far and with the block's earlier columns."""
    thr = throughput.reshape(len(cost), -1).astype(float)
    use = usage.reshape(len(cost), -1)
    out = np.ones(len(cost), dtype=bool)
    cand = np.flatnonzero(~keep)
    order = cand[np.lexsort((cand, use[cand].sum(axis=1), -thr[cand].sum(axis=1), cost[cand], group[cand]))]
    g = group[order]
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    for lo, hi in zip(starts, np.r_[starts[1:], len(order)], strict=True):
        idx = order[lo:hi]
        u = use[idx][:, (use[idx] > 0).any(axis=0)]
        if thr.shape[1] == 1 and not u.shape[1]:
            best = np.maximum.accumulate(thr[idx, 0])
            out[idx[1:]] = thr[idx[1:], 0] > best[:-1]
            continue
        c, t = cost[idx], thr[idx]
        front = np.zeros(0, dtype=np.int64)  # positions in idx of the columns kept so far
        for s in range(0, len(idx), block):
            j = np.arange(s, min(s + block, len(idx)))
            earlier = np.concatenate([front, j])
            dom = ((c[earlier][None, :] <= c[j][:, None]) & (t[earlier][None] >= t[j][:, None]).all(axis=2)
                   & (u[earlier][None] <= u[j][:, None]).all(axis=2))
            dom &= (earlier[None, :] < j[:, None])
            alive = ~dom.any(axis=1)
            out[idx[j]] = alive
            front = np.concatenate([front, j[alive]])
    return out


def vector_dominated(counts: np.ndarray, ratings: np.ndarray, rows: np.ndarray, chunk: int = 64) -> np.ndarray:
    """For each of `rows`: is it dominated by a row with no more of every node config and no less of every rating
    (`ratings` (N, K), e.g. one per request class), one of them strictly or an identical row of lower index?"""
    out = np.zeros(len(rows), dtype=bool)
    c = counts.astype(np.int64)
    for s in range(0, len(rows), chunk):
        j = rows[s:s + chunk]
        a, b = np.nonzero((ratings[None] >= ratings[j, None]).all(axis=2))  # a: index in j, b: candidate row
        ok = (c[b] <= c[j[a]]).all(axis=1) & (b != j[a])
        strict = (c[b] < c[j[a]]).any(axis=1) | (ratings[b] > ratings[j[a]]).any(axis=1) | (b < j[a])
        out[s + np.unique(a[ok & strict])] = True
    return out
