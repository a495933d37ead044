"""Benchmark the offline stage: extended-scenario library build, placements under the shared-cycle rating vs the
paper's objective (table optimum, re-rated afterwards), and the fast solver vs the paper's ILP.

    python benchmarks/templates.py [--scenario extended] [--workers 2] [--ilp-sets 24]

Prints a table and writes out/benchmarks/templates.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
from _console import stamped_json, table_console  # benchmarks/_console.py
from rich.table import Table

from coral.catalog.loader import builtin_catalog, load_scenario
from coral.perf import RooflineModel
from coral.report.terminal import progress
from coral.templates.build import (
    BuildJob,
    JobResult,
    build_library,
    layout_columns,
    prepare_job,
    run_jobs,
    scenario_jobs,
)
from coral.templates.library import TemplateLibrary
from coral.templates.placement import coupled_rates, solve_node_sets
from coral.templates.reference_ilp import solve_reference


def rerated(result: JobResult) -> np.ndarray:
    """Shared-cycle rating of each node set's solved placement (0 where infeasible)."""
    assert result.step_fit is not None
    cols = layout_columns(result)
    sets = np.where(result.node_sets >= 0, result.node_sets, 0)
    rate = coupled_rates(sets, result.sizes, cols["node_stage"], cols["stage_layers"].astype(np.int32),
                         result.tables, result.step_fit)
    return np.where(result.partition >= 0, rate, 0.0)


def objective_comparison(sc_jobs: list[BuildJob], workers: int) -> dict[str, object]:
    """Solve every candidate set twice, side by side: the paper's objective then re-rated (the old library) and
    the shared-cycle objective (the library now); count node sets whose rating changed and the gains."""
    pm = RooflineModel()
    t0 = time.perf_counter()
    old = run_jobs(sc_jobs, pm, workers, coupled=False)
    old_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    new = run_jobs(sc_jobs, pm, workers)
    new_s = time.perf_counter() - t1
    out: dict[str, object] = {"solve_seconds_table_objective": round(old_s, 2),
                              "solve_seconds_coupled_objective": round(new_s, 2),
                              "solve_time_ratio": round(new_s / max(old_s, 1e-9), 2)}
    for phase in ("prefill", "decode"):
        gains = []
        for o, n in zip(old, new, strict=True):
            if str(o.job.phase) != phase:
                continue
            before, after = rerated(o), n.throughput
            live = (after > 0) & (o.sizes >= 2)
            if (after[live] < before[live] * (1 - 1e-9)).any():
                raise AssertionError(f"{o.job.key}: the coupled search lost to the table optimum")
            gains.append(after[live] / np.maximum(before[live], 1e-12))
        g = np.concatenate(gains) if gains else np.zeros(0)
        up = g[g > 1 + 1e-9]
        out[phase] = {"multi_node_sets": len(g), "improved": len(up),
                      "median_gain": round(float(np.median(up)), 3) if len(up) else 1.0,
                      "max_gain": round(float(up.max()), 3) if len(up) else 1.0}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default="extended")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--ilp-sets", type=int, default=8, help="node sets solved by both solvers")
    ap.add_argument("--out", type=Path, default=Path("out/benchmarks"))
    args = ap.parse_args()
    console = table_console()
    sc = load_scenario(args.scenario)

    t0 = time.perf_counter()
    with progress(console=console, transient=True) as bar:
        task = bar.add_task(f"placement jobs of {sc.name}", total=None)
        lib = build_library(sc, workers=args.workers,
                            progress=lambda done, total: bar.update(task, completed=done, total=total))
    build_s = time.perf_counter() - t0
    path = lib.save(args.out / f"{sc.name}.templates.sqlite")
    t1 = time.perf_counter()
    TemplateLibrary.load(path)
    load_s = time.perf_counter() - t1
    stats = json.loads(lib.meta["stats"])

    comparison = objective_comparison(scenario_jobs(sc, builtin_catalog()), args.workers)

    # Fast solver vs reference ILP on the same real node sets (2-3 nodes, so the ILP finishes in seconds).
    pm = RooflineModel()
    job = next(j for j in scenario_jobs(sc, builtin_catalog()) if j.model.name == "qwen3-32b")
    prep = prepare_job(job, pm)
    rng = np.random.default_rng(0)
    pool = np.flatnonzero((prep.sizes >= 2) & (prep.sizes <= 3))
    rows = rng.choice(pool, size=min(args.ilp_sets, len(pool)), replace=False)
    sets = np.where(prep.node_sets[rows] >= 0, prep.node_sets[rows], 0)
    solve_node_sets(sets[:1], prep.sizes[rows][:1], prep.tables)  # compile outside the timing
    t2 = time.perf_counter()
    fast, _, _ = solve_node_sets(sets, prep.sizes[rows], prep.tables)
    fast_s = time.perf_counter() - t2
    ilp_s, agree = 0.0, 0
    for i, r in enumerate(rows):
        slots = [int(c) for c in prep.node_sets[r] if c >= 0]
        ref = solve_reference(slots, prep.tables)
        ilp_s += ref.seconds
        agree += bool(abs(ref.throughput - fast[i]) <= 1e-6 * max(1.0, ref.throughput))

    result = {
        "scenario": sc.name,
        "cores": os.cpu_count(),
        "workers": args.workers,
        "templates": len(lib),
        "non_dominated": int((~lib.dominated).sum()),
        "candidates": sum(s["candidates"] for s in stats.values()),
        "build_seconds": round(build_s, 2),
        "load_seconds": round(load_s, 3),
        "library_mb": round(path.stat().st_size / 1e6, 1),
        "per_job": stats,
        "ilp_sets": len(rows),
        "ilp_agree": agree,
        "ilp_seconds": round(ilp_s, 3),
        "fast_seconds": round(fast_s, 6),
        "speedup": round(ilp_s / max(fast_s, 1e-9), 1),
        **comparison,
    }
    table = Table(title=f"Template library benchmark ({sc.name}, {args.workers} workers)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in result.items():
        if isinstance(v, dict) and k != "per_job":
            for kk, vv in v.items():
                table.add_row(f"{k}: {kk}", f"{vv:,}" if isinstance(vv, int) else str(vv))
        elif k != "per_job":
            table.add_row(k, f"{v:,}" if isinstance(v, int) else str(v))
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "templates.json").write_text(stamped_json(result, indent=2))


if __name__ == "__main__":
    main()
