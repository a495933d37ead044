"""Request classes in the loop: does planning (and routing) by prompt-length class pay in simulation?

    python benchmarks/classes.py [--scenario core extended] [--duration 1800] [--seed 0]

Per scenario, three runs on the same requests (the scenario's real traces), each plan held fixed:
  "off"            classes off: one class at the scenario's mean lengths (the default);
  "auto, by class" `request_classes: auto` for every model, requests routed by their class with each instance's
                   planned tokens/s of the class as its weight (as the simulator and gateway do for such plans);
  "auto, pooled"   the same plan with its classes removed: every instance takes every class, by throughput.
Prints planned $/h and SLO attainment (all requests and per model) and writes out/benchmarks/classes.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _console import stamped_json, table_console  # benchmarks/_console.py
from allocator import with_classes  # benchmarks/allocator.py (this script's folder is on sys.path)
from rich.table import Table

from coral.allocation.allocator import allocate
from coral.allocation.plan import Plan
from coral.catalog.loader import load_scenario
from coral.simulation import simulate
from coral.templates.store import load_library


def pooled(plan: Plan) -> Plan:
    """`plan` with its request classes removed: routed by instance throughput alone."""
    return plan.model_copy(update={"request_classes": {}, "instances": [
        i.model_copy(update={"class_throughput": None}) for i in plan.instances]})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", nargs="+", default=["core", "extended"])
    ap.add_argument("--duration", type=float, default=1800.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--library-dir", type=Path, default=Path("out"))
    ap.add_argument("--out", type=Path, default=Path("out/benchmarks"))
    args = ap.parse_args()
    console = table_console()
    rows: list[dict[str, object]] = []
    for name in args.scenario:
        base = load_scenario(name)
        lib = load_library(name, args.library_dir)
        plans = {"off": allocate(lib, with_classes(base, "off"))}
        plans["auto, by class"] = allocate(lib, with_classes(base, "auto"))
        plans["auto, pooled"] = pooled(plans["auto, by class"])
        for variant, plan in plans.items():
            res = simulate(plan, base, duration_s=args.duration, seed=args.seed)
            rows.append({"scenario": name, "variant": variant, "cost_per_hour": plan.cost_per_hour,
                         "classes": {m: len(c) for m, c in plan.request_classes.items()},
                         "slo_attainment": res.slo_attainment,
                         "per_model": {m.model: m.slo_attainment for m in res.models}})
            console.print(f"{name} {variant}: ${plan.cost_per_hour:.2f}/h, attainment {res.slo_attainment:.1%}")
    models = list(dict.fromkeys(m for r in rows for m in r["per_model"]))  # type: ignore[attr-defined]
    table = Table(title=f"Request classes, plans held fixed, {args.duration:g} simulated s (seed {args.seed})")
    for col in ["scenario", "variant", "$/h", "all", *models]:
        table.add_column(col, justify="left" if col in ("scenario", "variant") else "right")
    for r in rows:
        per = r["per_model"]
        assert isinstance(per, dict)
        table.add_row(str(r["scenario"]), str(r["variant"]), f"{r['cost_per_hour']:.2f}", f"{r['slo_attainment']:.1%}",
                      *[f"{per[m]:.1%}" if m in per else "" for m in models])
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "classes.json"
    path.write_text(stamped_json({"duration_s": args.duration, "seed": args.seed, "rows": rows}, indent=2))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
