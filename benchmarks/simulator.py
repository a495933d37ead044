"""Simulator speed: simulated requests per wall-clock second of the compiled event loop and of the Python loop
it replaced (the reference), side by side on one plan and one request set, with the paper's WRR router and the
least-outstanding router, plus a whole simulated day (compiled only; `--day-python` runs the reference too).
Each row checks that both loops give the same result (every model's SLO attainment, cost, finished requests,
every request's finishing time) and records the process's peak memory so far (request sets included).

    .venv/bin/python benchmarks/simulator.py [--scenario extended] [--duration 1800] [--day 86400] [--plan PLAN]

The plan is the given one, else the allocator's cost-optimal plan for the scenario's demand (or, with --greedy,
the greedy stand-in), from out/<scenario>.templates.sqlite (built first when missing: a couple of minutes).
Planning and numba's first compile (run once before timing) are not timed; `simulate` is, end to end (request
set, kernels, loop, metrics).
"""

from __future__ import annotations

import argparse
import platform
import resource
from pathlib import Path

import numpy as np
from _console import stamped_json, table_console  # benchmarks/_console.py
from rich.table import Table

from coral.allocation.allocator import allocate
from coral.allocation.plan import Plan
from coral.catalog.loader import load_scenario
from coral.catalog.schema import MAX_RUN_REQUESTS
from coral.simulation import SimResult, simulate, workload_for
from coral.simulation.stand_in import greedy_plan
from coral.templates.store import load_library


def _same(a: SimResult, b: SimResult) -> bool:
    """Every model's attainment and finished requests, the cost, and every request's finishing time."""
    def verdict(r: SimResult) -> tuple[object, ...]:
        return tuple((m.model, m.slo_attainment, m.finished) for m in r.models), r.mean_cost_per_hour

    done = [np.asarray(r.per_request()["done_s"]) for r in (a, b)]
    return verdict(a) == verdict(b) and bool(np.array_equal(*done, equal_nan=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="extended")
    ap.add_argument("--duration", type=float, default=1800.0)
    ap.add_argument("--day", type=float, default=None,
                    help="simulated seconds of the long run (default: as long as a run may be, about 10 million "
                         "requests; 0: none)")
    ap.add_argument("--day-python", action="store_true", help="time the reference loop on the long run too")
    ap.add_argument("--plan", type=Path, default=None)
    ap.add_argument("--greedy", action="store_true", help="greedy stand-in plan instead of the allocator's")
    ap.add_argument("--out", type=Path, default=Path("out"))
    args = ap.parse_args()
    console = table_console()
    sc = load_scenario(args.scenario)
    if args.plan:
        plan = Plan.load(args.plan)
    else:
        library = load_library(args.scenario, args.out)
        plan = greedy_plan(library, sc) if args.greedy else allocate(library, sc, time_limit=120.0)
    simulate(plan, sc, workload_for(sc, 60.0, seed=0), duration_s=60.0)  # numba's first compile, untimed
    rows = []
    runs = [(args.duration, router, True) for router in ("wrr", "lor")]
    day = args.day if args.day is not None else 0.99 * MAX_RUN_REQUESTS / sum(m.request_rate for m in sc.models)
    if day:
        runs.append((round(day), "wrr", args.day_python))
    for duration, router, reference in runs:
        requests = workload_for(sc, duration, seed=0)
        res = {loop: simulate(plan, sc, requests, duration_s=duration, seed=0, router=router, loop=loop)
               for loop in (("python", "compiled") if reference else ("compiled",))}
        fast, ref = res["compiled"], res.get("python")
        rows.append({
            "router": router, "simulated_s": duration, "requests": fast.requests,
            "python_s": round(ref.wall_s, 3) if ref else None, "compiled_s": round(fast.wall_s, 3),
            "speed_up": round(ref.wall_s / fast.wall_s, 1) if ref else None,
            "compiled_req_per_s": round(fast.requests_per_wall_s),
            "same_result": _same(ref, fast) if ref else None,
            "slo_attain": round(fast.slo_attainment, 4), "cost_per_h": round(fast.mean_cost_per_hour, 2),
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),  # so far (KiB)
        })
    table = Table(title=f"Simulator: {sc.name}, {len(plan.instances)} instances ({plan.method} plan, "
                        f"{plan.cost_per_hour:.2f} $/h); compiled loop against the Python reference")
    for col in rows[0]:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(*("-" if v is None else f"{v:,}" if isinstance(v, int | float) and not isinstance(v, bool)
                        else str(v) for v in r.values()))
    console.print(table)
    out = args.out / "benchmarks" / "simulator.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(stamped_json({
        "scenario": sc.name, "duration_s": args.duration, "plan_method": plan.method,
        "instances": len(plan.instances), "python": platform.python_version(),
        "machine": platform.machine(), "runs": rows,
    }, indent=2))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
