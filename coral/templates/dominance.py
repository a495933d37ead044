"""Dominance among the templates of one (model, phase), a property of the library alone (computed at build).

1. Identical node counts: keep the template with the most throughput (lowest index on ties).
2. Template i is dominated when another template j uses no more of every node config (a proper sub-multiset of
   i's nodes) and gives no less throughput: any plan using i stays feasible with j instead and costs no more.
The sub-multiset test is exact and fast because templates have at most n_max nodes: for every vector v in the
downward closure of the library, f(v) = best throughput of a template <= v is computed level by level.
"""

from __future__ import annotations

import numpy as np


def _keys(counts: np.ndarray, base: int) -> np.ndarray:
    weights = base ** np.arange(counts.shape[1], dtype=np.int64)
    return counts.astype(np.int64) @ weights


def undominated(counts: np.ndarray, throughput: np.ndarray, keep: np.ndarray | None = None) -> np.ndarray:
    """Boolean mask of rows that survive reductions 1 and 2 (rows in `keep` always survive).

    `counts` (N, C) node counts, `throughput` (N,), all rows of one (model, phase)."""
    n = len(throughput)
    out = np.zeros(n, dtype=bool)
    if n == 0:
        return out
    counts = counts.astype(np.int64)
    base = int(counts.max()) + 1
    if counts.shape[1] * np.log2(max(base, 2)) > 62:
        return _undominated_pairwise(counts, throughput, keep)
    keys = _keys(counts, base)
    weights = base ** np.arange(counts.shape[1], dtype=np.int64)
    # 1. identical vectors: the best throughput wins (lowest index on ties)
    order = np.lexsort((np.arange(n), -throughput, keys))
    first = np.ones(n, dtype=bool)
    first[1:] = keys[order][1:] != keys[order][:-1]
    winners = order[first]
    ukeys, ucounts, uthr = keys[winners], counts[winners], throughput[winners]
    size = ucounts.sum(axis=1)
    top = int(size.max())
    # downward closure, level by level from the top
    level_keys: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * (top + 1)
    level_counts: list[np.ndarray] = [np.zeros((0, counts.shape[1]), dtype=np.int64)] * (top + 1)
    carry_k, carry_c = np.zeros(0, dtype=np.int64), np.zeros((0, counts.shape[1]), dtype=np.int64)
    for k in range(top, -1, -1):
        sel = size == k
        ks = np.concatenate([ukeys[sel], carry_k])
        cs = np.concatenate([ucounts[sel], carry_c])
        ks, idx = np.unique(ks, return_index=True)
        cs = cs[idx]
        level_keys[k], level_counts[k] = ks, cs
        child_k, child_c = [], []
        for c in range(counts.shape[1]):
            has = cs[:, c] > 0
            if has.any():
                child_k.append(ks[has] - weights[c])
                cc = cs[has].copy()
                cc[:, c] -= 1
                child_c.append(cc)
        carry_k = np.concatenate(child_k) if child_k else np.zeros(0, dtype=np.int64)
        carry_c = np.concatenate(child_c) if child_c else np.zeros((0, counts.shape[1]), dtype=np.int64)
    # f(v) bottom-up; sub(v) = best throughput over proper sub-multisets (ukeys is sorted)
    f_prev = np.zeros(0)
    sub = np.zeros(len(ukeys))
    for k in range(top + 1):
        ks, cs = level_keys[k], level_counts[k]
        best_sub = np.zeros(len(ks))
        if k > 0:
            for c in range(counts.shape[1]):
                where = np.flatnonzero(cs[:, c] > 0)
                if len(where):
                    child = np.searchsorted(level_keys[k - 1], ks[where] - weights[c])
                    np.maximum.at(best_sub, where, f_prev[child])
        pos = np.clip(np.searchsorted(ukeys, ks), 0, len(ukeys) - 1)
        in_lib = ukeys[pos] == ks
        own_thr = np.where(in_lib, uthr[pos], 0.0)
        f_prev = np.maximum(best_sub, own_thr)
        sub[pos[in_lib]] = best_sub[in_lib]
    dominated = sub >= uthr
    out[winners[~dominated]] = True
    if keep is not None:
        out |= keep
    return out


def _undominated_pairwise(counts: np.ndarray, throughput: np.ndarray, keep: np.ndarray | None) -> np.ndarray:
    """Same relation by direct comparison (for very wide count vectors)."""
    n = len(throughput)
    out = np.ones(n, dtype=bool)
    for i in range(n):
        le = (counts <= counts[i]).all(axis=1) & (throughput >= throughput[i])
        strict = (counts < counts[i]).any(axis=1) | (throughput > throughput[i]) | (np.arange(n) < i)
        le[i] = False
        if (le & strict).any():
            out[i] = False
    if keep is not None:
        out |= keep
    return out
