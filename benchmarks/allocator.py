"""Benchmark the online stage: solve time of the default and scarce settings, with and without the LP
strengthening (rounding cuts) and the separate optima of the demand keys, with and without request classes; optimality against an independent formulation
on core; solve time and gap vs library size, with and without the reductions.

    python benchmarks/allocator.py [--scenario extended] [--factor 1.75] [--scales 1 4 16] [--time-limit 60]
    python benchmarks/allocator.py --replan [--scenario extended]      # end-to-end re-plan times only
    python benchmarks/allocator.py --scale [--time-limit 10]            # models x regions growth only

Re-plan (`--replan`): what a planning call costs end to end, on a built library: "cold" = load the library file,
the availability estimate (the headroom rule's unlimited solve) and the plan, in a fresh library object;
"re-plan" = the plan alone, as every later epoch of a run pays it (the estimate and the library's dominance and
row groups are memoised per library object). Default availability in cost mode, scarce (`--scarce-factor`,
default 0.5) in goodput mode.

Scale (`--scale`): the scenario grown by copies of its models (request rates × U(0.5, 1.5), seeded) and of its
regions (prices × U(0.8, 1.2)): 6×3, 12×3, 24×3, 48×3 and 6×12 models × regions on extended; cost mode at
availability 1.75× and goodput mode at 0.5× of the headroom estimate (timed separately, it is computed once per
run), `allocate` with `--time-limit` for the whole call (default 10 s) and gap 1e-4. Each row: wall and CPU
seconds of the call, share of demand served, least served share, models with a phase at 0 and the stages a
limit stopped.

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
import time
from pathlib import Path

import numpy as np
from _console import stamped_json, table_console  # benchmarks/_console.py
from rich.console import Console
from rich.table import Table

from coral.allocation import baselines, core, solver
from coral.allocation.allocator import allocate, estimated_nodes, resolve_availability
from coral.allocation.availability import headroom_availability
from coral.allocation.plan import Plan
from coral.allocation.reference import plain_cost
from coral.catalog.loader import Catalog, builtin_catalog, load_scenario
from coral.catalog.schema import Scenario
from coral.templates.library import TemplateLibrary
from coral.templates.store import load_library


def scaled_library(lib: TemplateLibrary, k: int, seed: int = 0) -> TemplateLibrary:
    if k == 1:
        return lib
    rows = np.tile(np.arange(len(lib)), k)
    big = lib.subset(rows)
    jitter = np.random.default_rng(seed).uniform(0.97, 1.0, len(rows))
    jitter[: len(lib)] = 1.0
    big.throughput = big.throughput * jitter
    return big


def grown(sc: Scenario, lib: TemplateLibrary, catalog: Catalog, models_x: int, regions_x: int,
          seed: int = 0) -> tuple[Scenario, TemplateLibrary, Catalog]:
    """The scenario, library and catalog with `models_x` copies of every model (rates varied) and `regions_x`
    copies of every region (prices varied); copy 0 is the original."""
    rng = np.random.default_rng(seed)
    models, archs, names = list(sc.models), [], lib.model.copy()
    rows = np.arange(len(lib))
    for i in range(1, models_x):
        for sm in sc.models:
            name = f"{sm.model}.c{i}"
            models.append(sm.model_copy(update={"model": name, "request_rate": sm.request_rate * rng.uniform(0.5, 1.5)}))
            archs.append(catalog.model(sm.model).model_copy(update={"name": name}))
        names = np.concatenate([names, np.array([f"{m}.c{i}" for m in lib.model.tolist()], dtype=object)])
    big = lib.subset(np.tile(rows, models_x))  # copies of whole keys: every dominator is copied with its rows
    big.model = names
    regions, offerings = list(sc.regions), list(catalog.offerings)
    for i in range(1, regions_x):
        for r in sc.regions:
            regions.append(f"{r}.c{i}")
            offerings += [o.model_copy(update={"region": f"{r}.c{i}", "price_per_hour": o.price_per_hour * rng.uniform(0.8, 1.2)})
                          for o in catalog.offerings if o.region == r]
    return (sc.model_copy(update={"models": models, "regions": regions}), big,
            catalog.with_models(archs).with_offerings(offerings))


def timed_plan(lib: TemplateLibrary, sc: Scenario, avail: dict[str, dict[str, int]], mode: str, catalog: Catalog,
               time_limit: float, gap: float) -> dict[str, object]:
    """One `allocate` call: wall and CPU seconds (this process's: HiGHS runs in it, one thread; on a loaded
    machine wall > CPU), status, cost, share of demand served, least served share, models with a phase at 0, and
    the stages a limit stopped (`SolveReport.stopped`)."""
    t0, c0 = time.perf_counter(), time.process_time()
    plan = allocate(lib, sc, availability=avail, mode=mode, catalog=catalog, time_limit=time_limit,  # type: ignore[arg-type]
                    gap=gap)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    demand = sum(s.demand for s in plan.serving)
    return {"mode": mode, "wall_s": wall, "cpu_s": cpu, "solver_s": plan.solve.time_s, "status": plan.solve.status,
            "gap": plan.solve.gap, "cost": plan.cost_per_hour,
            "served": sum(min(s.capacity, s.demand) for s in plan.serving) / demand if demand else 1.0,
            "least_served": min((s.served_fraction for s in plan.serving), default=1.0),
            "models_at_0": len({s.model for s in plan.serving if s.demand > 0 and s.served_fraction <= 0}),
            "stopped": "; ".join(plan.solve.stopped) or "-"}


def scale_rows(sc: Scenario, lib: TemplateLibrary, time_limit: float, console: Console) -> list[dict[str, object]]:
    """Cost at 1.75× and goodput at 0.5× on the grown scenarios (module doc)."""
    rows: list[dict[str, object]] = []
    for mx, rx in ((1, 1), (2, 1), (4, 1), (8, 1), (1, 4)):
        gsc, glib, cat = grown(sc, lib, builtin_catalog(), mx, rx)
        t0 = time.perf_counter()
        est = estimated_nodes(gsc, glib, cat)
        est_s = time.perf_counter() - t0
        for mode, factor in (("cost", 1.75), ("goodput", 0.5)):
            avail = headroom_availability(gsc, est, factor, cat)
            rows.append({"models x regions": f"{len(gsc.models)} x {len(gsc.regions)}", "templates": len(glib),
                         "estimate_s": est_s, "factor": factor, **timed_plan(glib, gsc, avail, mode, cat, time_limit,
                                                                              1e-4)})
            console.print(rows[-1])
    return rows


def replan_rows(scenario: str, library_dir: Path, scarce: float, time_limit: float,
                console: Console) -> list[dict[str, object]]:
    """Cold (load + estimate + plan) and re-plan (plan alone) times, default and scarce (module doc)."""
    sc, cat = load_scenario(scenario), builtin_catalog()
    rows: list[dict[str, object]] = []
    for setting, mode, factor in (("default", "cost", None), (f"scarce x{scarce:g}", "goodput", scarce)):
        t0 = time.perf_counter()
        lib = TemplateLibrary.load(library_dir / f"{scenario}.templates.sqlite")
        t_load = time.perf_counter()
        avail = resolve_availability(sc, lib, cat, factor=factor)
        t_avail = time.perf_counter()
        first = timed_plan(lib, sc, avail, mode, cat, time_limit, 1e-4)
        again = timed_plan(lib, sc, resolve_availability(sc, lib, cat, factor=factor), mode, cat, time_limit, 1e-4)
        rows.append({"setting": setting, "mode": mode, "load_s": t_load - t0, "availability_s": t_avail - t_load,
                     "cold_s": time.perf_counter() - t0 - float(again["wall_s"]),  # type: ignore[arg-type]
                     "replan_s": again["wall_s"], "replan_solver_s": again["solver_s"], "status": again["status"],
                     "gap": again["gap"], "served": again["served"], "first_plan_s": first["wall_s"]})
        console.print(rows[-1])
    return rows


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
    ap.add_argument("--replan", action="store_true", help="only the end-to-end re-plan times")
    ap.add_argument("--scale", action="store_true", help="only the models x regions growth")
    ap.add_argument("--scarce-factor", type=float, default=0.5)
    args = ap.parse_args()
    console = table_console()
    if args.replan or args.scale:
        args.out.mkdir(parents=True, exist_ok=True)
        for flag, name, make in (
                (args.replan, "replan", lambda: replan_rows(args.scenario, args.library_dir, args.scarce_factor,
                                                             args.time_limit, console)),
                (args.scale, "scale", lambda: scale_rows(load_scenario(args.scenario),
                                                         load_library(args.scenario, args.library_dir),
                                                         args.time_limit, console))):
            if flag:
                rows = make()
                print_table(f"{name} ({args.scenario}, time limit {args.time_limit:g} s)", rows, console)
                path = args.out / f"allocator-{name}.json"
                path.write_text(stamped_json(rows, indent=2, default=str))
                console.print(f"-> {path}")
        return
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
    path.write_text(stamped_json({"scenario": args.scenario, "factor": args.factor, "gap": args.gap,
                                "settings": settings, "exactness": exact, "rows": rows}, indent=2, default=str))
    console.print(f"-> {path}")


if __name__ == "__main__":
    main()
