"""Benchmark the online stage: solve time of the default and scarce settings, with and without the LP
strengthening (rounding cuts) and the separate optima of the demand keys, with and without request classes; optimality against an independent formulation
on core; solve time and gap vs library size, with and without the reductions.

    python benchmarks/allocator.py [--scenario extended] [--factor 1.75] [--scales 1 4 16] [--time-limit 60]

Settings: "default" = the scenario's availability (headroom rule, resolved once, outside the timing), "scarce" =
the headroom rule at `--factor`. Variants: "neither" disables the rounding cuts (core.CUTS_PER_KEY =
solver.CUT_ROUNDS = 0) and the separate optima of the parts (solver.SEPARATE = False), "cuts" has the cuts only,
"cuts+parts" is the shipped solver; all run in one process, back to back, so their ratios are fair on a loaded
machine.
Classes "off" plans one class per (model, phase) (the default), "auto" classes from the traces
(see coral.allocation.classes).

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

from coral.allocation import baselines, core, solver
from coral.allocation.allocator import allocate
from coral.allocation.availability import resolve_availability
from coral.allocation.plan import Plan
from coral.allocation.reference import plain_cost
from coral.catalog.loader import load_scenario
from coral.catalog.schema import Scenario
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


def with_classes(sc: Scenario, classes: str) -> Scenario:
    return sc.model_copy(update={"models": [m.model_copy(update={"request_classes": classes}) for m in sc.models]})


def solve_row(case: str, plan: Plan, wall: float, **extra: object) -> dict[str, object]:
    r = plan.solve
    return {"case": case, **extra, "status": r.status, "cost": plan.cost_per_hour, "bound": r.bound, "gap": r.gap,
            "solve_s": r.time_s, "wall_s": wall, "mip_columns": r.n_variables}


VARIANTS = {"neither": (False, False), "cuts": (True, False), "cuts+parts": (True, True)}  # the last is shipped


def strengthened(cuts: bool, parts: bool) -> None:
    """Switch the rounding cuts and the separate optima of the parts on (shipped) or off."""
    core.CUTS_PER_KEY = 6 if cuts else 0
    solver.CUT_ROUNDS = 12 if cuts else 0
    solver.SEPARATE = parts


def settings_rows(sc: Scenario, lib: TemplateLibrary, factor: float, time_limit: float, gap: float,
                  class_modes: list[str], console: Console) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for classes, scen in ((c, with_classes(sc, c)) for c in class_modes):
        for setting, avail in (("default", resolve_availability(scen, lib)),
                               (f"scarce x{factor:g}", resolve_availability(scen, lib, factor=factor))):
            allocate(lib, scen, availability=avail, time_limit=time_limit, gap=gap)  # warm the offline caches
            for variant, switches in VARIANTS.items():
                strengthened(*switches)
                t0 = time.perf_counter()
                plan = allocate(lib, scen, availability=avail, time_limit=time_limit, gap=gap)
                rows.append(solve_row(setting, plan, time.perf_counter() - t0, classes=classes, variant=variant))
                console.print(rows[-1])
    strengthened(True, True)
    return rows


def exactness_rows(time_limit: float, library_dir: Path, console: Console) -> list[dict[str, object]]:
    """Core: the allocator's optimum (gap 1e-9) against `reference.plain_cost` (no reductions, cuts or column
    generation), with and without classes, at the scenario's availability."""
    sc = load_scenario("core")
    lib = load_library("core", library_dir)
    rows: list[dict[str, object]] = []
    for classes, scen in (("off", with_classes(sc, "off")), ("auto", with_classes(sc, "auto"))):
        avail = resolve_availability(scen, lib)
        t0 = time.perf_counter()
        plan = allocate(lib, scen, availability=avail, time_limit=time_limit, gap=1e-9)
        wall = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref = plain_cost(lib, scen, avail, time_limit=time_limit)
        rows.append({"case": "core exactness", "classes": classes, "coral_cost": plan.cost_per_hour,
                     "reference_cost": ref, "match": ref is not None and abs(plan.cost_per_hour - ref) <= 1e-6 * ref,
                     "coral_s": wall, "reference_s": time.perf_counter() - t0})
        console.print(rows[-1])
    return rows


def print_table(title: str, rows: list[dict[str, object]], console: Console) -> None:
    if not rows:
        return
    table = Table(title=title)
    for col in rows[0]:
        table.add_column(col, justify="left" if col in ("case", "status", "classes", "variant") else "right")
    for r in rows:
        table.add_row(*[f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()])
    console.print(table)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default="extended")
    ap.add_argument("--factor", type=float, default=1.75)
    ap.add_argument("--scales", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--no-reduce-max-scale", type=int, default=4, help="largest scale also solved unreduced")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--gap", type=float, default=1e-3)
    ap.add_argument("--classes", nargs="+", choices=["off", "auto"], default=["off", "auto"])
    ap.add_argument("--library-dir", type=Path, default=Path("out"))
    ap.add_argument("--out", type=Path, default=Path("out/benchmarks"))
    args = ap.parse_args()
    console = Console()
    sc = load_scenario(args.scenario)
    base = load_library(args.scenario, args.library_dir)
    settings = settings_rows(sc, base, args.factor, args.time_limit, args.gap, args.classes, console)
    exact = exactness_rows(args.time_limit, args.library_dir, console)
    sc = with_classes(sc, "off")  # the library-size and mode rows below: one class
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
        plan = allocate(base, sc, availability=avail, mode=mode, time_limit=args.time_limit, gap=args.gap)
        rows.append({"case": f"{mode} x{args.factor:g}", "scale": 1, "templates": len(base), "reduce": True,
                     "status": plan.solve.status, "cost": plan.cost_per_hour, "gap": plan.solve.gap,
                     "solve_s": plan.solve.time_s, "wall_s": time.perf_counter() - t0,
                     "mip_columns": plan.solve.n_variables})
    for name, fn in (("homo-ilp", baselines.homo_ilp), ("cauchy", baselines.cauchy_paper)):
        t0 = time.perf_counter()
        plan = fn(base, sc, availability=avail)
        rows.append({"case": f"{name} x{args.factor:g}", "scale": 1, "templates": len(base), "reduce": True,
                     "status": plan.solve.status, "cost": plan.cost_per_hour, "gap": plan.solve.gap,
                     "solve_s": plan.solve.time_s, "wall_s": time.perf_counter() - t0,
                     "mip_columns": plan.solve.n_variables})
    print_table(f"Online solve on {args.scenario}, gap {args.gap:g}: without/with rounding cuts and separate parts",
                settings, console)
    for r in settings[len(VARIANTS) - 1::len(VARIANTS)]:
        same = [b for b in settings if b["case"] == r["case"] and b["classes"] == r["classes"]]
        ratios = ", ".join(f"{b['variant']} {float(b['solve_s']) / float(r['solve_s']):.2f}x"  # type: ignore[arg-type]
                           for b in same if b is not r)
        console.print(f"{r['case']}, classes {r['classes']}: solve time relative to the shipped solver: {ratios}")
    print_table("Exactness on core: allocator vs independent formulation", exact, console)
    print_table(f"Allocator on {args.scenario} (availability factor {args.factor:g}, gap {args.gap:g})", rows,
                console)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "allocator.json"
    path.write_text(json.dumps({"scenario": args.scenario, "factor": args.factor, "gap": args.gap,
                                "settings": settings, "exactness": exact, "rows": rows}, indent=2, default=str))
    console.print(f"-> {path}")


if __name__ == "__main__":
    main()
