"""Benchmark the online stage: solve time and gap vs library size, with and without the reductions.

    python benchmarks/allocator.py [--scenario extended] [--factor 1.75] [--scales 1 4 16] [--time-limit 60]

Library size k×: every template of the scenario's library plus k−1 copies with throughput × U(0.97, 1.0)
(seeded), i.e. extra placements of the same node multisets that are never better, so the optimum is the same at
every size and any difference in cost is a solver failure. Availability: the headroom rule at `--factor`
(scarce: 1.75 for extended). Also times the other modes at 1×. Prints a table and writes
out/benchmarks/allocator.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from coral.allocation import baselines
from coral.allocation.allocator import allocate
from coral.allocation.availability import resolve_availability
from coral.catalog.loader import load_scenario
from coral.experiments.allocation import load_library
from coral.templates.library import TemplateLibrary


def scaled_library(lib: TemplateLibrary, k: int, seed: int = 0) -> TemplateLibrary:
    if k == 1:
        return lib
    rows = np.tile(np.arange(len(lib)), k)
    big = lib.subset(rows)
    jitter = np.random.default_rng(seed).uniform(0.97, 1.0, len(rows))
    jitter[: len(lib)] = 1.0
    big.throughput = big.throughput * jitter
    return big


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default="extended")
    ap.add_argument("--factor", type=float, default=1.75)
    ap.add_argument("--scales", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--no-reduce-max-scale", type=int, default=4, help="largest scale also solved unreduced")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--gap", type=float, default=1e-3)
    ap.add_argument("--library-dir", type=Path, default=Path("out"))
    ap.add_argument("--out", type=Path, default=Path("out/benchmarks"))
    args = ap.parse_args()
    console = Console()
    sc = load_scenario(args.scenario)
    base = load_library(args.scenario, args.library_dir)
    avail = resolve_availability(sc, base, factor=args.factor)
    rows = []
    for k in args.scales:
        lib = scaled_library(base, k)
        for reduce in (True, False):
            if not reduce and k > args.no_reduce_max_scale:
                continue
            if reduce:  # dominance depends on the library only: computed once (offline) and cached
                allocate(lib, sc, availability=avail, time_limit=args.time_limit, gap=args.gap)
            t0 = time.perf_counter()
            plan = allocate(lib, sc, availability=avail, time_limit=args.time_limit, gap=args.gap, reduce=reduce)
            wall = time.perf_counter() - t0
            rows.append({"case": f"cost x{args.factor:g}", "scale": k, "templates": len(lib), "reduce": reduce,
                         "status": plan.solve.status, "cost": plan.cost_per_hour, "gap": plan.solve.gap,
                         "solve_s": plan.solve.time_s, "wall_s": wall, "mip_columns": plan.solve.n_variables})
            console.print(rows[-1])
    for mode in ("goodput", "scaled"):
        t0 = time.perf_counter()
        plan = allocate(base, sc, availability=avail, mode=mode, time_limit=args.time_limit, gap=args.gap)  # type: ignore[arg-type]
        rows.append({"case": f"{mode} x{args.factor:g}", "scale": 1, "templates": len(base), "reduce": True,
                     "status": plan.solve.status, "cost": plan.cost_per_hour, "gap": plan.solve.gap,
                     "solve_s": plan.solve.time_s, "wall_s": time.perf_counter() - t0,
                     "mip_columns": plan.solve.n_variables})
    for name, fn in (("homo", baselines.homo), ("cauchy", baselines.cauchy)):
        t0 = time.perf_counter()
        plan = fn(base, sc, availability=avail)
        rows.append({"case": f"{name} x{args.factor:g}", "scale": 1, "templates": len(base), "reduce": True,
                     "status": plan.solve.status, "cost": plan.cost_per_hour, "gap": plan.solve.gap,
                     "solve_s": plan.solve.time_s, "wall_s": time.perf_counter() - t0,
                     "mip_columns": plan.solve.n_variables})
    table = Table(title=f"Allocator on {args.scenario} (availability factor {args.factor:g}, gap {args.gap:g})")
    for col in rows[0]:
        table.add_column(col, justify="left" if col in ("case", "status") else "right")
    for r in rows:
        table.add_row(*[f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()])
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "allocator.json"
    path.write_text(json.dumps({"scenario": args.scenario, "factor": args.factor, "gap": args.gap, "rows": rows},
                               indent=2, default=str))
    console.print(f"-> {path}")


if __name__ == "__main__":
    main()
