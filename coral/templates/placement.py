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
def _solve_one(
    slots: np.ndarray,
    n: int,
    tables: np.ndarray,
    labels: np.ndarray,
    groups: np.ndarray,
    n_layers: int,
    group_tab: np.ndarray,
    ptr: np.ndarray,
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
        for s in range(s_count):
            for j in range(1, n_layers + 1):
                group_tab[s, j] = 0.0
        for k in range(n):
            g = labels[p, k]
            row = tables[s_count - 1, slots[k]]
            for j in range(1, n_layers + 1):
                group_tab[g, j] += row[j]
        first = group_tab[0, 1]
        for s in range(1, s_count):
            if group_tab[s, 1] < first:
                first = group_tab[s, 1]
        if first <= best:
            continue
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
            if value <= best:
                break
        if value > first:
            value = first
        if value > best:
            best = value
            best_p = p
    if best_p < 0:
        return 0.0, -1
    # Layer counts for the best partition: each stage takes as many layers as keep it >= best, then trim.
    s_count = groups[best_p]
    for s in range(s_count):
        for j in range(1, n_layers + 1):
            group_tab[s, j] = 0.0
    for k in range(n):
        row = tables[s_count - 1, slots[k]]
        g = labels[best_p, k]
        for j in range(1, n_layers + 1):
            group_tab[g, j] += row[j]
    total = 0
    for s in range(s_count):
        c = 0
        while c < n_layers and group_tab[s, c + 1] >= best:
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
    return best, best_p


@njit(cache=True)
def solve_batch(
    node_sets: np.ndarray,
    sizes: np.ndarray,
    tables: np.ndarray,
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
    for i in range(m):
        n = sizes[i]
        b, p = _solve_one(
            node_sets[i], n, tables, labels_by_n[n], groups_by_n[n], n_layers, group_tab, ptr, layers[i]
        )
        best[i] = b
        part[i] = p
    return best, part, layers


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
    node_sets: np.ndarray, sizes: np.ndarray, tables: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Solve many node sets. `node_sets` (M, W) holds config indices sorted ascending (padding ignored),
    `tables` (S_max, C, L+1) node throughput for j layers under budget SLO/S. Returns (throughput,
    partition index into set_partitions(n), layers per stage)."""
    width = node_sets.shape[1]
    if width > MAX_NODES:
        raise ValueError(f"at most {MAX_NODES} nodes per template")
    if tables.shape[0] < width:
        raise ValueError("tables must cover S = 1..width stages")
    labels, groups = partition_tables(width)
    n_layers = tables.shape[2] - 1
    return solve_batch(
        np.ascontiguousarray(node_sets, dtype=np.int64),
        np.ascontiguousarray(sizes, dtype=np.int64),
        np.ascontiguousarray(tables, dtype=np.float64),
        labels,
        groups,
        n_layers,
    )


def all_placements(slots: Sequence[int], tables: np.ndarray) -> Iterator[float]:
    """Throughput of every placement of the nodes `slots` (config indices): each stage assignment (as ordered
    stage labels) and layer split, by exhaustive search (tiny inputs only)."""
    n = len(slots)
    n_layers = tables.shape[2] - 1
    for assign in itertools.product(range(n), repeat=n):
        s_count = max(assign) + 1
        if sorted(set(assign)) != list(range(s_count)) or s_count > n_layers:
            continue
        for split in itertools.product(range(1, n_layers + 1), repeat=s_count):
            if sum(split) != n_layers:
                continue
            stage = [0.0] * s_count
            for k, st in enumerate(assign):
                stage[st] += float(tables[s_count - 1, slots[k], split[st]])
            yield min(stage)


def brute_force(slots: Sequence[int], tables: np.ndarray) -> float:
    """The best placement's throughput by exhaustive search: the reference for the fast solver."""
    return max(all_placements(slots, tables), default=0.0)
