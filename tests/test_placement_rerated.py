"""Placement search under the shared-cycle (re-rated) objective: exhaustive checks that no placement of the same
nodes beats the one the solver returns, on random profiles, real perf-model tables and a built library."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_templates import random_tables

from coral.catalog.loader import builtin_catalog, load_scenario
from coral.perf import RooflineModel
from coral.templates.build import JobResult, prepare_job, results_to_library, run_jobs, scenario_jobs
from coral.templates.placement import (
    brute_force,
    coupled_rate,
    coupled_rates,
    set_partitions,
    solve_node_sets,
)


def consistent_fit(rng: np.random.Generator, tables: np.ndarray) -> np.ndarray:
    """A step-time fit matching `tables` as `profile_tables` does: micro-batch B, t(b) = a + c b with a >= 0,
    c > 0 and t(B) = B / T."""
    batch = np.where(tables > 0, rng.uniform(1.0, 64.0, tables.shape), 0.0)
    frac = rng.uniform(0.05, 0.95, tables.shape)
    full = np.where(tables > 0, batch / np.where(tables > 0, tables, 1.0), 0.0)
    slope = np.where(batch > 0, frac * full / np.where(batch > 0, batch, 1.0), 0.0)
    return np.stack([batch, (1 - frac) * full, slope])


def cycle_scan(slots: list[int], assign: list[int], split: list[int], tables: np.ndarray, fit: np.ndarray) -> float:
    """The shared-cycle rating by its definition (the library's re-rating before the closed form): max over
    cycles C of min_k S b_k(C) / (C w_k), with b_k(C) = clip((C/S - a_k) / c_k, 0, B_k), trying every cycle where
    a node's rising term meets another's cap."""
    s_count = len(split)
    if s_count == 1:
        return float(sum(tables[0, c, split[0]] for c in slots))
    thr = np.array([tables[s_count - 1, c, split[g]] for c, g in zip(slots, assign, strict=True)])
    b_max, a, c = (np.array([fit[i, s_count - 1, k, split[g]] for k, g in zip(slots, assign, strict=True)])
                   for i in range(3))
    stage_sum = np.array([thr[np.array(assign) == g].sum() for g in assign])
    if stage_sum.min() <= 0:
        return 0.0  # a stage no node can serve: the slowest stage carries nothing
    live = thr > 0
    w = thr[live] / stage_sum[live]
    b_max, a, c = b_max[live], a[live], c[live]
    best = 0.0
    for k, m in itertools.product(range(len(w)), repeat=2):
        cycle = s_count * (a[k] + c[k] * w[k] * b_max[m] / w[m])
        grow = np.clip((cycle / s_count - a) / c, 0.0, b_max)
        best = max(best, float(np.min(s_count * grow / (cycle * w))))
    return best


def every_placement(n: int, n_layers: int, max_stages: int) -> tuple[np.ndarray, np.ndarray]:
    """(stage of each node, layers of each stage) of every placement of n nodes over L layers, as arrays."""
    labels, groups = set_partitions(n)
    rows_l, rows_s = [], []
    for lab, g in zip(labels, groups, strict=True):
        if g > min(max_stages, n_layers):
            continue
        for cuts in itertools.combinations(range(1, n_layers), int(g) - 1):
            bounds = (0, *cuts, n_layers)
            split = np.zeros(n, dtype=np.int32)
            split[:g] = np.diff(bounds)
            rows_l.append(lab)
            rows_s.append(split)
    return np.array(rows_l, dtype=np.int8), np.array(rows_s, dtype=np.int32)


def best_of_every_placement(slots: list[int], tables: np.ndarray, fit: np.ndarray) -> float:
    labels, splits = every_placement(len(slots), tables.shape[2] - 1, tables.shape[0])
    sets = np.tile(np.array(slots, dtype=np.int64), (len(labels), 1))
    return float(coupled_rates(sets, np.full(len(labels), len(slots)), labels, splits, tables, fit).max())


def achieved(slots: list[int], part: int, layers: np.ndarray, tables: np.ndarray, fit: np.ndarray) -> float:
    labels, groups = set_partitions(len(slots))
    return coupled_rate(np.array(slots), len(slots), labels[part], int(groups[part]), layers, tables, fit)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 4), st.integers(1, 3), st.integers(1, 6))
def test_solver_equals_brute_force_under_coupled_rating(seed: int, n: int, n_configs: int, n_layers: int) -> None:
    """Every stage assignment and layer split of <= 4 nodes: none beats the solver, whose placement achieves its
    value."""
    rng = np.random.default_rng(seed)
    tables = random_tables(rng, n, n_configs, n_layers)
    fit = consistent_fit(rng, tables)
    slots = sorted(rng.integers(0, n_configs, size=n).tolist())
    value, part, layers = solve_node_sets(np.array([slots]), np.array([n]), tables, fit)
    assert value[0] == pytest.approx(brute_force(slots, tables, fit), rel=1e-12, abs=1e-12)
    if value[0] > 0:
        s_count = int(set_partitions(n)[1][part[0]])
        assert layers[0, :s_count].sum() == n_layers and layers[0, :s_count].min() >= 1
        assert achieved(slots, int(part[0]), layers[0], tables, fit) == pytest.approx(value[0], rel=1e-12)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 5), st.integers(1, 3), st.integers(2, 8))
def test_closed_form_equals_cycle_scan_and_never_exceeds_tables(
    seed: int, n: int, n_configs: int, n_layers: int
) -> None:
    """coupled_rate's closed form equals the maximum over candidate cycles, and is at most the slowest stage's
    table throughput (the bound the search prunes with)."""
    rng = np.random.default_rng(seed)
    tables = random_tables(rng, n, n_configs, n_layers)
    fit = consistent_fit(rng, tables)
    slots = sorted(rng.integers(0, n_configs, size=n).tolist())
    s_count = int(rng.integers(1, min(n, n_layers) + 1))
    assign = list(range(s_count)) + rng.integers(0, s_count, size=n - s_count).tolist()
    cuts = sorted(rng.choice(np.arange(1, n_layers), size=s_count - 1, replace=False).tolist())
    split = np.diff([0, *cuts, n_layers]).tolist()
    value = coupled_rate(np.array(slots), n, np.array(assign, dtype=np.int8), s_count,
                         np.array(split + [0] * (n - s_count), dtype=np.int32), tables, fit)
    assert value == pytest.approx(cycle_scan(slots, assign, split, tables, fit), rel=1e-9, abs=1e-12)
    stage = np.zeros(s_count)
    for k, g in zip(slots, assign, strict=True):
        stage[g] += tables[s_count - 1, k, split[g]]
    assert value <= stage.min() * (1 + 1e-12)


@pytest.fixture(scope="module")
def qwen_decode() -> JobResult:
    sc = load_scenario("extended")
    job = next(j for j in scenario_jobs(sc, builtin_catalog()) if j.key == "qwen3-32b/decode")
    return prepare_job(job, RooflineModel())


def test_real_fit_meets_the_closed_form_conditions(qwen_decode: JobResult) -> None:
    """Real step-time fits have a >= 0, c > 0 and t(B) = B / T wherever a node can serve."""
    batch, a, c = qwen_decode.step_fit
    live = qwen_decode.tables > 0
    assert (a[live] >= 0).all() and (c[live] > 0).all()
    assert np.allclose((a + c * batch)[live], (batch / np.where(live, qwen_decode.tables, 1.0))[live], rtol=1e-9)


def test_paper_example_stored_placement_is_best(qwen_decode: JobResult) -> None:
    """Extended Qwen3-32B decode on [8xL4, 8xL4, 8xA10G, 2xH100] (issue 10): the solver's placement is the best
    of all placements under the coupled rating, at least the old choice (table optimum, then re-rated) and one
    data-parallel stage, and at most the table optimum."""
    names = [c.name for c in qwen_decode.job.configs]
    slots = sorted(names.index(c) for c in ("8xL4", "8xL4", "8xA10G", "2xH100"))
    tables, fit = qwen_decode.tables, qwen_decode.step_fit
    assert fit is not None
    value, part, layers = solve_node_sets(np.array([slots]), np.array([4]), tables, fit)
    table_value, table_part, table_layers = solve_node_sets(np.array([slots]), np.array([4]), tables)
    old = achieved(slots, int(table_part[0]), table_layers[0], tables, fit)
    one_stage = float(tables[0, slots, -1].sum())
    assert value[0] == pytest.approx(best_of_every_placement(slots, tables, fit), rel=1e-12)
    assert value[0] == pytest.approx(achieved(slots, int(part[0]), layers[0], tables, fit), rel=1e-12)
    assert old <= value[0] * (1 + 1e-12) and one_stage <= value[0] * (1 + 1e-12)
    assert value[0] <= table_value[0] * (1 + 1e-12)


def test_real_tables_small_sets_match_exhaustive(qwen_decode: JobResult) -> None:
    """Random 2-3 node sets of real Qwen3-32B decode tables (64 layers): solver == every placement's best."""
    fit = qwen_decode.step_fit
    assert fit is not None
    rng = np.random.default_rng(11)
    rows = rng.choice(np.flatnonzero((qwen_decode.sizes >= 2) & (qwen_decode.sizes <= 3)), 20, replace=False)
    sets = np.where(qwen_decode.node_sets[rows] >= 0, qwen_decode.node_sets[rows], 0)
    value, _, _ = solve_node_sets(sets, qwen_decode.sizes[rows], qwen_decode.tables, fit)
    for i, r in enumerate(rows):
        slots = [int(c) for c in qwen_decode.node_sets[r] if c >= 0]
        assert value[i] == pytest.approx(best_of_every_placement(slots, qwen_decode.tables, fit), rel=1e-12)


def test_built_library_templates_are_never_beaten() -> None:
    """A built library (core GPT-OSS 20B decode, 24 layers): for sampled multi-node templates, no placement of
    the same nodes rates higher than the stored one, and the stored rate is what the stored layout gives."""
    sc = load_scenario("core")
    job = next(j for j in scenario_jobs(sc, builtin_catalog()) if j.key == "gpt-oss-20b/decode")
    res = run_jobs([job], RooflineModel())[0]
    lib, _ = results_to_library([res], sc.configs, {})
    assert res.step_fit is not None
    cfg_pos = {name: i for i, name in enumerate(c.name for c in job.configs)}
    multi = np.flatnonzero(lib.counts.sum(axis=1) >= 2)
    small = multi[lib.counts[multi].sum(axis=1) <= 4]
    for i in np.random.default_rng(3).choice(small, size=min(25, len(small)), replace=False):
        t = lib.template(int(i))
        slots = sorted(cfg_pos[c] for c, k in t.counts.items() for _ in range(k))
        best = best_of_every_placement(slots, res.tables, res.step_fit)
        assert best <= t.throughput * (1 + 1e-9), (t.counts, best, t.throughput)
        assert t.throughput == pytest.approx(best, rel=1e-9)
