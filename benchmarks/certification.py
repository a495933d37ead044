"""Does a plan's certified verdict hold on traffic no step of its run used? Each plan simulated held fixed on
workload seeds of the whole traces, exactly as `coral simulate SCENARIO --plan PLAN --seed S` does, beside the
verdict the plan carries (its certificate: lower bound, pooled, p5 and worst window, windows, the certification's
seconds).

    python benchmarks/certification.py out/run-core/plan.cost.coral.json --scenario core --seeds 2001-2012

Prints one row per (plan, model): target, certified bound, pooled over the seeds, worst seed, seeds more than 3
points under the target; writes JSON (`--json`, default out/benchmarks/certification.json).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from _console import stamped_json, table_console  # benchmarks/_console.py
from rich.table import Table

from coral.allocation.plan import Plan
from coral.catalog.loader import scenario_and_market
from coral.simulation.run import simulate
from coral.workload.traces import workload_for


def seeds_of(text: str) -> list[int]:
    """'2001-2012' or '5,7,9'."""
    if "-" in text:
        lo, hi = (int(x) for x in text.split("-", 1))
        return list(range(lo, hi + 1))
    return [int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plans", nargs="+", type=Path)
    ap.add_argument("--scenario", default="core")
    ap.add_argument("--offerings", type=Path, default=None)
    ap.add_argument("--seeds", default="2001-2012", help="workload seeds no run used (default 2001-2012)")
    ap.add_argument("--json", type=Path, default=Path("out/benchmarks/certification.json"))
    args = ap.parse_args()
    sc, cat = scenario_and_market(args.scenario, args.offerings)
    duration = sc.epochs * sc.epoch_minutes * 60.0
    seeds = seeds_of(args.seeds)
    workloads = {s: workload_for(sc, duration, s) for s in seeds}
    rows, out = [], []
    for path in args.plans:
        plan = Plan.load(path)
        t0 = time.perf_counter()
        per_seed = []
        for s in seeds:
            sim = simulate(plan, sc, workloads[s], duration_s=duration, seed=s, catalog=cat)
            per_seed.append({m.model: (m.slo_attainment, m.requests) for m in sim.models})
        wall = time.perf_counter() - t0
        slo = plan.slo
        for sm in sc.models:
            m = sm.model
            goal = slo.target.get(m, sm.slo_attainment) if slo is not None else sm.slo_attainment  # the plan's own
            vals = [r[m] for r in per_seed if m in r]
            pooled = sum(a * n for a, n in vals) / max(1, sum(n for _, n in vals))
            worst = min(a for a, _ in vals)
            under = sum(a < goal - 0.03 for a, _ in vals)
            cert = slo.certified.get(m) if slo is not None else None
            rec = {"plan": str(path), "method": plan.method, "cost_per_hour": plan.cost_per_hour, "model": m,
                   "target": goal, "verdict_pass": bool(slo and slo.passed(m)),
                   "certified": cert.lower_bound if cert else None, "certified_pooled": cert.pooled if cert else None,
                   "certified_windows": cert.windows if cert else 0,
                   "certification_s": slo.certification_s if slo else 0.0,
                   "unseen_seeds": seeds, "unseen_pooled": pooled, "unseen_worst": worst,
                   "unseen_per_seed": [a for a, _ in vals], "seeds_over_3_points_under": under,
                   "holds": pooled >= goal and under == 0, "simulate_s": wall}
            out.append(rec)
            rows.append([path.name, plan.method, f"{plan.cost_per_hour:,.2f}", m, f"{goal:.0%}",
                         "pass" if rec["verdict_pass"] else "fail",
                         f"{cert.lower_bound:.1%}" if cert else "-", f"{pooled:.1%}", f"{worst:.1%}", str(under),
                         "yes" if rec["holds"] else "NO"])
    table = Table("plan", "method", "$/h", "model", "target", "verdict", "certified", "unseen pooled", "worst seed",
                  "seeds > 3 pts under", "holds", title=f"Verdicts against {len(seeds)} unseen workload seeds "
                  f"({args.seeds}, {duration:.0f} s each, scenario {sc.name})")
    for row in rows:
        table.add_row(*row)
    table_console().print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(stamped_json({"scenario": sc.name, "rows": out}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
