"""Exact throughput-optimal placement of a model over a node set (the paper's per-S ILP, solved combinatorially).

Problem (paper §4.2): split L layers into S stages of j_s >= 1 layers, put every node in exactly one stage, and
maximise the slowest stage's throughput, where a stage's throughput is the sum over its nodes of T^S_j(node)
(node throughput holding j layers under a per-stage budget SLO/S), over S = 1..|nodes|.

Why this is exact and fast: for a fixed partition of the nodes into S groups, every group's table
g_s(j) = sum_k T^S_j(k) is non-increasing in j, so "min_s g_s(j_s) >= T with sum_s j_s = L, j_s >= 1" holds iff
T <= min_s g_s(1) and at least L of the S*L values g_s(j) are >= T. The optimum for the partition is therefore
min(g_min(1), L-th largest of the union), found by an L-step merge of S sorted lists. Enumerating the set
partitions of <= 8 nodes (Bell(6) = 203) with bound pruning (a partition can never beat min_s g_s(1), and the merge
stops once it falls below the incumbent) and skipping partitions that are mirror images under swaps of identical
nodes gives the optimum in microseconds per node set.

The library rates a multi-stage placement at one micro-batch cycle shared by all stages (`coupled_rate`, the
pipeline timing the simulator runs), which is never above the table rating above. Placements are searched under
that rating directly, exactly: groupings whose table optimum cannot beat the incumbent are skipped, and within a
grouping every layer split whose stages all keep g_s(j_s) above the incumbent is rated (the others cannot win);
one-stage placements, which the coupling leaves unchanged, set a strong incumbent first.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from functools import cache

import numpy as np
from numba import njit

MAX_NODES = 8


@cache
def set_partitions(n: int) -> tuple[np.ndarray, np.ndarray]:
    """All set partitions of n items as restricted-growth label rows (P, n) and their group counts (P,)."""
    rows: list[list[int]] = []

    def grow(prefix: list[int], top: int) -> None:
        if len(prefix) == n:
            rows.append(prefix.copy())
            return
        for label in range(top + 2):
            prefix.append(label)
            grow(prefix, max(top, label))
            prefix.pop()

    grow([], -1)
    labels = np.array(rows, dtype=np.int8).reshape(len(rows), n)
    groups = (labels.max(axis=1) + 1).astype(np.int8) if n else np.zeros(1, dtype=np.int8)
    order = np.argsort(groups, kind="stable")  # few stages first: strong incumbents early for pruning
    return np.ascontiguousarray(labels[order]), np.ascontiguousarray(groups[order])


@njit(cache=True)
def _canonical(slots: np.ndarray, labels: np.ndarray, n: int) -> bool:
    """False if swapping two identical adjacent nodes gives a lexicographically smaller labelling.

    Nodes are sorted by config, so identical nodes are adjacent; requiring labels to be non-decreasing within
    each run of identical nodes keeps one representative of every multiset partition.
    """
    for k in range(1, n):  # noqa: SIM110 - numba compiles loops, not generators
        if slots[k] == slots[k - 1] and labels[k] < labels[k - 1]:
            return False
    return True


@njit(cache=True)
def _fill_groups(
    slots: np.ndarray, n: int, tables: np.ndarray, labels: np.ndarray, s_count: int, n_layers: int,
    group_tab: np.ndarray,
) -> None:
    """group_tab[s, j] = sum over the nodes of stage s of their table throughput at j layers."""
    for s in range(s_count):
        for j in range(1, n_layers + 1):
            group_tab[s, j] = 0.0
    for k in range(n):
        row = tables[s_count - 1, slots[k]]
        g = labels[k]
        for j in range(1, n_layers + 1):
            group_tab[g, j] += row[j]


@njit(cache=True)
def _table_value(group_tab: np.ndarray, s_count: int, n_layers: int, floor: float, ptr: np.ndarray) -> float:
    """min(min_s g_s(1), L-th largest g_s(j)): the best layer split's slowest stage; stops early (returning a
    value <= floor) once it cannot beat `floor`."""
    first = group_tab[0, 1]
    for s in range(1, s_count):
        if group_tab[s, 1] < first:
            first = group_tab[s, 1]
    if first <= floor:
        return first
    for s in range(s_count):
        ptr[s] = 1
    value = 0.0
    for _ in range(n_layers):
        pick = -1
        pick_v = -1.0
        for s in range(s_count):
            if ptr[s] <= n_layers and group_tab[s, ptr[s]] > pick_v:
                pick_v = group_tab[s, ptr[s]]
                pick = s
        value = pick_v
        ptr[pick] += 1
        if value <= floor:
            break
    return min(value, first)


@njit(cache=True)
def coupled_rate(
    slots: np.ndarray, n: int, labels: np.ndarray, s_count: int, split: np.ndarray,
    tables: np.ndarray, step_fit: np.ndarray,
) -> float:
    """Tokens/s of a placement when all stages share one micro-batch cycle (the rating the simulator runs).

    Node k (table throughput T_k, planned micro-batch B_k, step time t_k(b) = a_k + c_k b with t_k(B_k) = B_k/T_k)
    takes the share w_k = T_k / G_s of its stage s (G_s: the stage's summed T). With S micro-batches in flight
    the cycle C must cover S steps of every node; at template rate X node k carries micro-batches of w_k X C / S.
    X(C) is the minimum of falling terms (nodes at their cap B_k: X <= S B_k / (C w_k)) and rising ones (nodes
    whose step fits C/S), so the best cycle is where the lowest falling term meets the rising ones: with
    beta = min_k B_k / w_k (template tokens per micro-batch slot), X* = beta / max_k t_k(w_k beta). One stage has
    no coupling: X = G_1. Needs a_k >= 0 and c_k > 0 (true of `profile_tables`); then X* <= min_s G_s, the
    table rating (for k in stage s, w_k beta <= B_k and b / t_k(b) grows with b, so
    X* <= beta / t_k(w_k beta) <= B_k / (w_k t_k(B_k)) = G_s). Nodes with T_k = 0 carry nothing and do not constrain the cycle; a stage with none
    that can serve its layers rates the placement 0."""
    if s_count == 1:
        total = 0.0
        for k in range(n):
            total += tables[0, slots[k], split[0]]
        return total
    stage_sum = np.zeros(s_count)
    for k in range(n):
        stage_sum[labels[k]] += tables[s_count - 1, slots[k], split[labels[k]]]
    if stage_sum.min() <= 0:
        return 0.0
    beta = np.inf
    for k in range(n):
        j = split[labels[k]]
        thr = tables[s_count - 1, slots[k], j]
        if thr > 0:
            beta = min(beta, step_fit[0, s_count - 1, slots[k], j] * stage_sum[labels[k]] / thr)
    if not np.isfinite(beta):
        return 0.0
    slowest = 0.0
    for k in range(n):
        j = split[labels[k]]
        thr = tables[s_count - 1, slots[k], j]
        if thr > 0:
            share = thr / stage_sum[labels[k]]
            step = step_fit[1, s_count - 1, slots[k], j] + step_fit[2, s_count - 1, slots[k], j] * share * beta
            slowest = max(slowest, step)
    return beta / slowest if slowest > 0 else 0.0


@njit(cache=True)
def _best_split(
    slots: np.ndarray, n: int, labels: np.ndarray, s_count: int, n_layers: int, tables: np.ndarray,
    step_fit: np.ndarray, group_tab: np.ndarray, best: float, split: np.ndarray, out: np.ndarray,
) -> float:
    """Best coupled rating of a grouping above `best` (written to `out`), or `best` if none beats it.

    Exhaustive over layer splits, pruned soundly: a placement's coupled rating never exceeds its slowest stage's
    table throughput min_s g_s(j_s), so every stage must keep g_s(j_s) > best (a prefix of j, g being
    non-increasing), and the split must still be able to reach L layers."""
    hi = np.zeros(s_count, dtype=np.int64)
    top = np.zeros(s_count + 1, dtype=np.int64)  # top[s]: most layers stages s.. can take

    def bounds(floor: float) -> bool:
        for s in range(s_count):
            c = 0
            while c < n_layers and group_tab[s, c + 1] > floor:
                c += 1
            hi[s] = c
            if c == 0:
                return False
        top[s_count] = 0
        for s in range(s_count - 1, -1, -1):
            top[s] = top[s + 1] + hi[s]
        return top[0] >= n_layers

    if not bounds(best):
        return best
    last = s_count - 1
    for s in range(s_count):
        split[s] = 0
    s = 0
    used = 0
    while s >= 0:
        if s == last:
            j = n_layers - used
            if 1 <= j <= hi[last]:
                split[last] = j
                value = coupled_rate(slots, n, labels, s_count, split, tables, step_fit)
                if value > best:
                    best = value
                    out[:s_count] = split[:s_count]
                    if not bounds(best):
                        return best
            s -= 1
            if s >= 0:
                used -= split[s]
            continue
        split[s] += 1
        j = split[s]
        rest = s_count - 1 - s
        if j > hi[s] or used + j + rest > n_layers:
            split[s] = 0
            s -= 1
            if s >= 0:
                used -= split[s]
            continue
        if used + j + top[s + 1] < n_layers:
            continue  # too few layers so far: take more here
        used += j
        s += 1
    return best


@njit(cache=True)
def _solve_one(
    slots: np.ndarray,
    n: int,
    tables: np.ndarray,
    step_fit: np.ndarray,
    coupled: bool,
    labels: np.ndarray,
    groups: np.ndarray,
    n_layers: int,
    group_tab: np.ndarray,
    ptr: np.ndarray,
    split: np.ndarray,
    layers_out: np.ndarray,
) -> tuple[float, int]:
    best = 0.0
    best_p = -1
    for p in range(labels.shape[0]):
        s_count = groups[p]
        if s_count > n_layers:
            continue
        if not _canonical(slots, labels[p], n):
            continue
        _fill_groups(slots, n, tables, labels[p], s_count, n_layers, group_tab)
        value = _table_value(group_tab, s_count, n_layers, best, ptr)
        if value <= best:
            continue
        if coupled and s_count > 1:
            value = _best_split(
                slots, n, labels[p], s_count, n_layers, tables, step_fit, group_tab, best, split, layers_out
            )
            if value > best:
                best = value
                best_p = p
            continue
        best = value
        best_p = p
        if s_count == 1:
            layers_out[0] = n_layers
        else:
            _table_split(group_tab, s_count, n_layers, best, layers_out)
    if best_p < 0:
        return 0.0, -1
    return best, best_p


@njit(cache=True)
def _table_split(group_tab: np.ndarray, s_count: int, n_layers: int, value: float, layers_out: np.ndarray) -> None:
    """Layer counts reaching `value` under the table rating: each stage takes as many layers as keep it >= value,
    then the widest stages give layers back."""
    total = 0
    for s in range(s_count):
        c = 0
        while c < n_layers and group_tab[s, c + 1] >= value:
            c += 1
        layers_out[s] = c
        total += c
    while total > n_layers:
        widest = 0
        for s in range(1, s_count):
            if layers_out[s] > layers_out[widest]:
                widest = s
        layers_out[widest] -= 1
        total -= 1


@njit(cache=True)
def solve_batch(
    node_sets: np.ndarray,
    sizes: np.ndarray,
    tables: np.ndarray,
    step_fit: np.ndarray,
    coupled: bool,
    labels_by_n: tuple[np.ndarray, ...],
    groups_by_n: tuple[np.ndarray, ...],
    n_layers: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Optimal throughput, partition index and layers per stage for each node set (rows sorted by config)."""
    m = node_sets.shape[0]
    width = node_sets.shape[1]
    best = np.zeros(m)
    part = np.full(m, -1, dtype=np.int32)
    layers = np.zeros((m, width), dtype=np.int32)
    group_tab = np.zeros((width, n_layers + 1))
    ptr = np.zeros(width, dtype=np.int64)
    split = np.zeros(width, dtype=np.int32)
    for i in range(m):
        n = sizes[i]
        b, p = _solve_one(
            node_sets[i], n, tables, step_fit, coupled, labels_by_n[n], groups_by_n[n], n_layers, group_tab, ptr,
            split, layers[i],
        )
        best[i] = b
        part[i] = p
    return best, part, layers


@njit(cache=True)
def coupled_rates(
    node_sets: np.ndarray, sizes: np.ndarray, node_stage: np.ndarray, stage_layers: np.ndarray,
    tables: np.ndarray, step_fit: np.ndarray,
) -> np.ndarray:
    """`coupled_rate` of the given placement of every node set (stage of each node, layers of each stage)."""
    out = np.zeros(node_sets.shape[0])
    for i in range(node_sets.shape[0]):
        n = sizes[i]
        s_count = 0
        for k in range(n):
            s_count = max(s_count, node_stage[i, k] + 1)
        out[i] = coupled_rate(node_sets[i], n, node_stage[i], s_count, stage_layers[i], tables, step_fit)
    return out


def partition_tables(width: int) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """Label and group-count arrays indexed by node count 0..width (index 0 is a dummy)."""
    labels = [np.zeros((1, 1), dtype=np.int8)]
    groups = [np.zeros(1, dtype=np.int8)]
    for n in range(1, width + 1):
        lab, grp = set_partitions(n)
        pad = np.zeros((lab.shape[0], max(width, 1)), dtype=np.int8)
        pad[:, :n] = lab
        labels.append(pad)
        groups.append(grp)
    labels[0] = np.zeros((1, max(width, 1)), dtype=np.int8)
    return tuple(labels), tuple(groups)


def solve_node_sets(
    node_sets: np.ndarray, sizes: np.ndarray, tables: np.ndarray, step_fit: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Solve many node sets. `node_sets` (M, W) holds config indices sorted ascending (padding ignored),
    `tables` (S_max, C, L+1) node throughput for j layers under budget SLO/S. Without `step_fit` the objective is
    the paper's (slowest stage's table throughput); with `step_fit` (3, S_max, C, L+1: planned micro-batch, step
    intercept, step slope) it is `coupled_rate`, the shared-cycle rating. Returns (throughput, partition index
    into set_partitions(n), layers per stage)."""
    width = node_sets.shape[1]
    if width > MAX_NODES:
        raise ValueError(f"at most {MAX_NODES} nodes per template")
    if tables.shape[0] < width:
        raise ValueError("tables must cover S = 1..width stages")
    labels, groups = partition_tables(width)
    n_layers = tables.shape[2] - 1
    coupled = step_fit is not None
    fit = step_fit if step_fit is not None else np.zeros((3, *tables.shape))
    return solve_batch(
        np.ascontiguousarray(node_sets, dtype=np.int64),
        np.ascontiguousarray(sizes, dtype=np.int64),
        np.ascontiguousarray(tables, dtype=np.float64),
        np.ascontiguousarray(fit, dtype=np.float64),
        coupled,
        labels,
        groups,
        n_layers,
    )


def placements(n: int, n_layers: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every placement of n nodes over L layers: (stage of each node, layers of each stage), by exhaustive
    enumeration (tiny inputs only)."""
    for assign in itertools.product(range(n), repeat=n):
        s_count = max(assign) + 1
        if sorted(set(assign)) != list(range(s_count)) or s_count > n_layers:
            continue
        for split in itertools.product(range(1, n_layers + 1), repeat=s_count):
            if sum(split) == n_layers:
                yield assign, split


def all_placements(slots: Sequence[int], tables: np.ndarray, step_fit: np.ndarray | None = None) -> Iterator[float]:
    """Rating of every placement of the nodes `slots` (config indices): the slowest stage's table throughput,
    or with `step_fit` the shared-cycle `coupled_rate`."""
    n = len(slots)
    for assign, split in placements(n, tables.shape[2] - 1):
        s_count = len(split)
        if step_fit is not None:
            yield coupled_rate(
                np.array(slots, dtype=np.int64), n, np.array(assign, dtype=np.int8), s_count,
                np.array(split, dtype=np.int32), tables, step_fit,
            )
            continue
        stage = [0.0] * s_count
        for k, st in enumerate(assign):
            stage[st] += float(tables[s_count - 1, slots[k], split[st]])
        yield min(stage)


def brute_force(slots: Sequence[int], tables: np.ndarray, step_fit: np.ndarray | None = None) -> float:
    """The best placement's rating by exhaustive search: the reference for the fast solver."""
    return max(all_placements(slots, tables, step_fit), default=0.0)
