"""Simulator speed: simulated requests per wall-clock second on the extended scenario at 25 req/s per model for
30 simulated minutes (~270k requests), with the paper's WRR router and the least-outstanding router.
Target: each run under 60 s on one core.

    .venv/bin/python benchmarks/simulator.py [--duration 1800] [--plan PLAN.json]

The plan is the given one, else the allocator's cost-optimal plan for the scenario's demand (or, with --greedy,
the greedy stand-in), from out/extended.templates.sqlite (built first when missing: a couple of minutes).
Planning is not timed; only `simulate` is.
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

from _console import stamped_json, table_console  # benchmarks/_console.py
from rich.table import Table

from coral.allocation.allocator import allocate
from coral.allocation.plan import Plan
from coral.catalog.loader import load_scenario
from coral.simulation import simulate, workload_for
from coral.simulation.stand_in import greedy_plan
from coral.templates.store import load_library

TARGET_S = 60.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="extended")
    ap.add_argument("--duration", type=float, default=1800.0)
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
    requests = workload_for(sc, args.duration, seed=0)
    rows = []
    for router in ("wrr", "lor"):
        res = simulate(plan, sc, requests, duration_s=args.duration, seed=0, router=router)
        rows.append({
            "router": router, "requests": res.requests, "finished": res.finished, "wall_s": round(res.wall_s, 3),
            "req_per_wall_s": round(res.requests_per_wall_s), "slo_attain": round(res.slo_attainment, 4),
            "goodput_tok_s": round(res.goodput_tokens_s, 1), "cost_per_h": round(res.mean_cost_per_hour, 2),
            "gpu_util": round(res.gpu_utilisation, 3), "under_60s": res.wall_s < TARGET_S,
        })
    table = Table(title=f"Simulator: {sc.name}, {args.duration:g} s simulated, {len(plan.instances)} instances "
                        f"({plan.method} plan, {plan.cost_per_hour:.2f} $/h)")
    for col in rows[0]:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(*(f"{v:,}" if isinstance(v, int | float) and not isinstance(v, bool) else str(v)
                        for v in r.values()))
    console.print(table)
    out = args.out / "benchmarks" / "simulator.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(stamped_json({
        "scenario": sc.name, "duration_s": args.duration, "plan_method": plan.method,
        "instances": len(plan.instances), "target_wall_s": TARGET_S, "python": platform.python_version(),
        "machine": platform.machine(), "runs": rows,
    }, indent=2))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
