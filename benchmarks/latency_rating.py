"""The latency rating (`coral.allocation.latency`): what it keeps, what it costs, and Coral's plan against the
homogeneous ILP's at equal demand.

    python benchmarks/latency_rating.py [--scenario core extended] [--library-dir out] [--market best-gpu-4]

Per scenario and (model, phase): templates, templates kept (share of sampled requests within the SLO served alone
≥ the floor), the best share, the floor, whether the key is latency-bound, and the seconds the rating of the
whole scenario took (once per library). Then, at the scenario's burst demand, Coral's cost plan, Coral's plan
pricing slack (the SLO search's variant, `SEARCH_SLACK`) and homo-ilp's: $/h, capacity planned per (model,
phase), and each model's attainment on the tuning request sets (the same requests for all). Prints tables and
writes out/benchmarks/latency_rating.json (`--market best-gpu-N`: the comparison in `equal_attainment.py`'s market
of N best GPUs, written to latency_rating.best-gpu-N.json).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from _console import stamped_json, table_console  # benchmarks/_console.py
from equal_attainment import best_gpu_market  # benchmarks/equal_attainment.py
from rich.table import Table

from coral.allocation import baselines
from coral.allocation.allocator import allocate, resolve_availability
from coral.allocation.demand import run_length_s, scenario_demand
from coral.allocation.latency import scenario_latency
from coral.catalog.loader import load_scenario, market_catalog
from coral.planning import SearchSettings
from coral.planning.slo_search import SEARCH_SLACK, simulator_evaluator
from coral.templates.store import load_library


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", nargs="+", default=["core", "extended"])
    ap.add_argument("--library-dir", type=Path, default=Path("out"))
    ap.add_argument("--out", type=Path, default=Path("out/benchmarks"))
    ap.add_argument("--market", default="default", help="default (the scenario's) | best-gpu-N (equal_attainment.py's)")
    args = ap.parse_args()
    console = table_console()
    report: dict[str, Any] = {}
    for name in args.scenario:
        sc = load_scenario(name)
        cat = market_catalog(sc)
        lib = load_library(name, args.library_dir, cat)
        t0 = time.perf_counter()
        rating = scenario_latency(lib, sc, cat)
        seconds = time.perf_counter() - t0
        keys = Table(title=f"{name}: latency rating ({seconds:.1f} s for the scenario)")
        for col in ("model/phase", "templates", "kept", "best share", "floor", "latency-bound"):
            keys.add_column(col, justify="left" if col == "model/phase" else "right")
        rows = []
        for (m, p), kl in rating.items():
            rows.append({"key": f"{m}/{p.value}", "templates": len(kl.rows), "kept": len(kl.kept), "best": kl.best,
                         "floor": kl.floor, "bound": kl.bound})
            keys.add_row(f"{m}/{p.value}", f"{len(kl.rows):,}", f"{len(kl.kept):,}", f"{kl.best:.1%}",
                         f"{kl.floor:.1%}", "yes" if kl.bound else "no")
        console.print(keys)
        avail = (best_gpu_market(sc, int(args.market.split("-")[-1])) if args.market.startswith("best-gpu-")
                 else resolve_availability(sc, lib, cat))
        demand = scenario_demand(sc)
        evaluate = simulator_evaluator(sc, run_length_s(sc), cat)
        plans = {"coral": allocate(lib, sc, demand=demand, availability=avail, catalog=cat),
                 "coral, slack priced": allocate(lib, sc, demand=demand, availability=avail, catalog=cat,
                                                 slack=SEARCH_SLACK),
                 "homo-ilp": baselines.homo_ilp(lib, sc, demand=demand, availability=avail, catalog=cat)}
        seeds = SearchSettings().tune_seeds
        same = Table(title=f"{name}, market {args.market}: at equal demand (the burst rule's), tuning sets "
                           f"{', '.join(map(str, seeds))}")
        for col in ("method", "$/h", "model", "prefill capacity tok/s", "decode capacity tok/s", "attainment per set"):
            same.add_column(col, justify="left" if col in ("method", "model") else "right")
        equal: dict[str, Any] = {}
        for method, plan in plans.items():
            sets = [evaluate(plan, seed, 1.0) for seed in seeds]
            cap = {(s.model, s.phase): s.capacity for s in plan.serving}
            equal[method] = {"cost_per_hour": plan.cost_per_hour, "capacity": {f"{m}/{p}": c for (m, p), c in cap.items()},
                             "attainment": {m.model: [r[m.model].slo for r in sets] for m in sc.models}}
            for i, m in enumerate(sc.models):
                same.add_row(method if i == 0 else "", f"{plan.cost_per_hour:,.2f}" if i == 0 else "", m.model,
                             f"{cap.get((m.model, 'prefill'), 0.0):,.0f}", f"{cap.get((m.model, 'decode'), 0.0):,.0f}",
                             " / ".join(f"{r[m.model].slo:.1%}" for r in sets))
        console.print(same)
        report[name] = {"rating_seconds": seconds, "keys": rows, "equal_demand": equal}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("latency_rating.json" if args.market == "default" else f"latency_rating.{args.market}.json")
    path.write_text(stamped_json(report, indent=1))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
