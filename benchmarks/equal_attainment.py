"""Methods compared at equal certified attainment: for Coral and each baseline, the cheapest plan found whose every
model meets the attainment target, each certified by the same rule on the same held-out windows
(`coral.planning.certify`).

    python benchmarks/equal_attainment.py [--scenario core extended] [--target 0.9 0.99] [--method ...]
                                          [--setting default scarce imbalanced] [--rounds N] [--budget S]
    python benchmarks/equal_attainment.py --merge A.json B.json    # one table from runs made in parallel
    python benchmarks/equal_attainment.py --previous --scenario core   # the previous default sizing, scored

Each (scenario, target, method) runs `coral.planning.search_plan` with the method as the planner (same library,
market, availability, traffic and search settings), then scores the chosen plan on the held-out request sets.
Prints a table ($/h, × Coral, least held-out attainment, rounds, seconds) and writes
out/benchmarks/equal_attainment.json. A method whose plan misses a target on held-out requests is marked; its
cost is not comparable and gets no ratio. Settings: "default" (the scenario as shipped: its market, unlimited),
"best-gpu-N" (a market of our own making, independent of any plan: N GPUs of the scenario's best type in all, the
weaker types plentiful), "scarce" (availability by the headroom rule at 1.25× Coral's cheapest plan's nodes),
"imbalanced" (the paper's small-heavy setting: 80 % of the total request rate on the smallest third of the
models, the rest shared by the others). Each row carries its plan's fingerprint ("plan"), so a run with `--load N`
(N busy processes meanwhile) can be compared with an idle one: the plans must be the same.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import multiprocessing
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _console import run_stamp, stamped_json, table_console  # benchmarks/_console.py
from rich.console import Console
from rich.table import Table

from coral.allocation import baselines
from coral.allocation.allocator import allocate, resolve_availability
from coral.allocation.availability import market_availability
from coral.allocation.demand import run_length_s
from coral.allocation.plan import Plan
from coral.catalog.loader import load_scenario, market_catalog
from coral.catalog.schema import Scenario, TargetUtilization
from coral.experiments.allocation import paper_imbalanced_rates, with_rates
from coral.planning import SearchSettings, search_method
from coral.planning.slo_search import Evaluator, simulator_evaluator
from coral.simulation.run import simulate
from coral.templates.library import TemplateLibrary
from coral.templates.store import load_library
from coral.workload.traces import workload_for

METHODS: dict[str, Callable[..., Plan]] = {
    "coral": allocate,
    "coral-throughput": functools.partial(allocate, latency=False),  # templates rated by throughput alone (before)
    "homo-ilp": baselines.homo_ilp,
    "homo-greedy": baselines.homo_greedy,
    "cauchy-paper": baselines.cauchy_paper,
}


def with_target(scenario: Scenario, target: float) -> Scenario:
    return scenario.model_copy(update={"models": [m.model_copy(update={"slo_attainment": target})
                                                  for m in scenario.models]})


SCARCE_FACTOR = 1.25
#: the sizing the previous releases shipped: mean demand ÷ a target utilisation per phase, traces compressed
PREVIOUS = {"target_utilization": TargetUtilization(prefill=0.55, decode=0.8), "trace_scaling": "compress"}


def previous_default(name: str, library_dir: Path, console: Console) -> dict[str, Any]:
    """The previous default plan (mean ÷ 0.55 / 0.8, no simulator), scored like the searched ones: its
    attainment over the held-out sets, with traces compressed (as then) and superposed (as now)."""
    base = load_scenario(name)
    old = base.model_copy(update=PREVIOUS)
    lib = load_library(name, library_dir)
    plan = allocate(lib, old, availability=resolve_availability(old, lib))
    row: dict[str, Any] = {"scenario": name, "cost_per_hour": plan.cost_per_hour}
    for label, sc in (("compressed", old), ("superposed", base)):
        sets = [simulate(plan, sc, workload_for(sc, run_length_s(sc), seed), duration_s=run_length_s(sc), seed=seed)
                for seed in SearchSettings().held_out_seeds]
        row[label] = {m.model: sum(r.model(m.model).slo_attainment for r in sets) / len(sets) for m in sets[0].models}
        console.print(f"{name} previous default ${plan.cost_per_hour:,.2f}/h, traces {label}: " + ", ".join(
            f"{m} {a:.1%}" for m, a in row[label].items()))
    return row


def best_gpu_market(scenario: Scenario, gpus: int) -> dict[str, dict[str, int]] | str:
    """A scarce market of our own making: the scenario's best GPU type (most TFLOPS) limited to `gpus` GPUs in
    all, spread evenly over the regions selling it in its smallest node type (larger node types of it: none),
    every other GPU type as plentiful as asked. Independent of any method's plan."""
    catalog = market_catalog(scenario)
    used = {o.gpu for o in catalog.offerings if o.region in scenario.regions and o.config in scenario.configs}
    best = max(used, key=lambda g: catalog.gpus[g].tflops)
    mine = [o for o in catalog.offerings if o.gpu == best and o.region in scenario.regions
            and o.config in scenario.configs]
    regions = sorted({o.region for o in mine})
    limited = []
    for o in catalog.offerings:
        if o in mine:
            quota = gpus // len(regions) + (1 if regions.index(o.region) < gpus % len(regions) else 0)
            smallest = min(m.gpus_per_node for m in mine if m.region == o.region)
            o = o.model_copy(update={"available": quota // o.gpus_per_node if o.gpus_per_node == smallest else 0})
        limited.append(o)
    return market_availability(scenario, catalog.with_offerings(limited))


def imbalanced(scenario: Scenario) -> Scenario:
    """The paper's small-heavy setting: 80 % of the total request rate on the smallest third of the models."""
    return with_rates(scenario, paper_imbalanced_rates(scenario, large_heavy=False), "paper small-heavy")


def search_row(name: str, setting: str, sc: Scenario, method: str, lib: TemplateLibrary, availability: Any,
               settings: SearchSettings, evaluate: Evaluator | None = None) -> tuple[dict[str, Any], Plan | None]:
    t0 = time.perf_counter()
    res = search_method(METHODS[method], lib, sc, availability, settings, evaluate=evaluate)
    plan = res.plan
    slo = plan.slo if plan is not None else None
    return {
        "scenario": name, "setting": setting, "target": sc.models[0].slo_attainment, "method": method,
        "cost_per_hour": plan.cost_per_hour if plan is not None else None,
        "met_held_out": res.met,
        "held_out": slo.held_out if slo else {}, "held_out_worst": slo.held_out_worst if slo else {},
        # per model: the certified lower bound the verdict is on (`coral.planning.certify`), and its cost
        "certified": {m: c.lower_bound for m, c in slo.certified.items()} if slo else {},
        "certification_s": slo.certification_s if slo else 0.0,
        "certification_windows": slo.certification_windows if slo else 0,
        "tuned": slo.tuned if slo else {},
        "verdict": slo.verdict if slo else {}, "held_out_seeds": slo.held_out_seeds if slo else [],
        "headroom": {f"{m}/{p.value}": round(h, 4) for (m, p), h in res.headroom.items()},
        "heterogeneous_instances": sum(i.heterogeneous for i in plan.instances) if plan is not None else 0,
        "plan_sha": hashlib.sha256(plan.model_dump_json(include={"instances"}).encode()).hexdigest()[:16]
        if plan is not None else None,
        "rounds": len(res.rounds), "rounds_meeting_targets": sum(r.passed for r in res.rounds),
        # which planner's round the plan came from: "subset" (homo-ilp's), "planner", "variant 1" (slack priced),
        # "composed" (the cheapest passing part of each model from any rounds), "refined" (one model at a time)
        "chosen_trial": res.chosen_trial,
        "safety_net": res.safety_net,  # None: the row depends on its inputs alone, not on the machine's load
        "seconds": time.perf_counter() - t0,
        "meta": run_stamp(),  # where and when this row was measured (rows of --merge keep theirs)
    }, plan


def spin() -> None:
    """A busy process (the --load option)."""
    x = 0
    while True:
        x = (x * 7 + 1) % 1_000_003


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", nargs="+", default=["core", "extended"])
    ap.add_argument("--target", nargs="+", type=float, default=[0.9, 0.99])
    ap.add_argument("--method", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--setting", nargs="+", default=["default"],
                    help="default | scarce (headroom rule at 1.25x Coral's cheapest plan) | imbalanced | best-gpu-N "
                         "(a market with N GPUs of the scenario's best type in all, the others plentiful)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds per search, its budget (default: the search's, 14 for 3 models, 17 for extended)")
    ap.add_argument("--budget", type=float, default=None,
                    help="wall-clock safety net per search, s, checked between rounds (default: the search's, 480 "
                         "for 3 models, 1920 for extended, x1.5 for Coral's three trials); a row it stopped records "
                         "it in safety_net")
    ap.add_argument("--library-dir", type=Path, default=Path("out"))
    ap.add_argument("--out", type=Path, default=Path("out/benchmarks"))
    ap.add_argument("--name", default="equal_attainment", help="JSON file name (without .json)")
    ap.add_argument("--previous", action="store_true",
                    help="no search: score the previous default sizing of each --scenario (writes previous.json)")
    ap.add_argument("--merge", nargs="+", type=Path, default=[],
                    help="no runs: merge the rows of these JSON files (runs made in parallel; a later file's row for the "
                         "same scenario, setting, target and method wins) into --name")
    ap.add_argument("--load", type=int, default=0,
                    help="keep this many busy processes running meanwhile (a loaded machine: plans must not change)")
    args = ap.parse_args()
    console = table_console()
    busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.load)]
    for proc in busy:
        proc.start()
    if args.previous:
        out = [previous_default(name, args.library_dir, console) for name in args.scenario]
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "previous.json").write_text(stamped_json({"rows": out}, indent=1))
        return
    merged = {(r["scenario"], r["setting"], r["target"], r["method"]): r  # a later file's row replaces an earlier one
              for f in args.merge for r in json.loads(f.read_text())["rows"]}
    rows: list[dict[str, Any]] = list(merged.values())
    path = args.out / f"{args.name}.json"
    plans = args.out / f"{args.name}.plans"
    args.out.mkdir(parents=True, exist_ok=True)
    if rows:
        path.write_text(stamped_json({"rows": rows}, indent=1))
    for name in ([] if args.merge else args.scenario):
        lib = load_library(name, args.library_dir)
        for setting in args.setting:
            for target in args.target:
                sc = with_target(load_scenario(name), target)
                sc = imbalanced(sc) if setting == "imbalanced" else sc
                avail = (best_gpu_market(sc, int(setting.split("-")[-1])) if setting.startswith("best-gpu-") else
                         resolve_availability(sc, lib, factor=SCARCE_FACTOR if setting == "scarce" else None))
                settings = SearchSettings(max_rounds=args.rounds, time_budget_s=args.budget)
                # one evaluator per (scenario, setting, target): a plan two searches share is simulated once
                evaluate = simulator_evaluator(sc, run_length_s(sc), windows=settings.window_seeds)
                for method in args.method:
                    row, plan_of_row = search_row(name, setting, sc, method, lib, avail, settings, evaluate)
                    rows.append(row)
                    if plan_of_row is not None:
                        plan_of_row.save(plans / f"{name}.{setting}.{target:g}.{method}.json")
                    console.print(f"{name} {setting} ≥{target:.0%} {method}: ${row['cost_per_hour'] or 0:,.2f}/h, "
                                  f"held-out {min(row['held_out'].values(), default=0):.1%} (least model), "
                                  f"{'meets' if row['met_held_out'] else 'MISSES'} every target, "
                                  f"{row['rounds']} rounds, {row['seconds']:.0f} s")
                    path.write_text(stamped_json({"rows": rows}, indent=1))
    table = Table(title="Cheapest plan meeting every model's target, certified on held-out windows")
    for col in ("scenario", "setting", "target", "method", "$/h", "× coral", "certified, least model",
                "held-out, least model", "worst set", "het. inst.", "rounds", "s", "plan"):
        table.add_column(col, justify="left" if col in ("scenario", "setting", "method") else "right")
    for r in rows:
        coral = next((c for c in rows if (c["scenario"], c["setting"], c["target"], c["method"])
                      == (r["scenario"], r["setting"], r["target"], "coral")), None)
        ratio = (f"{r['cost_per_hour'] / coral['cost_per_hour']:.3f}×" if coral and r["met_held_out"]
                 and coral["met_held_out"] and r["cost_per_hour"] else "–")
        table.add_row(r["scenario"], r["setting"], f"≥{r['target']:.0%}",
                      r["method"] + ("" if r["met_held_out"] else " (misses)"), f"{r['cost_per_hour'] or 0:,.2f}",
                      ratio, f"{min(r.get('certified', {}).values(), default=0):.1%}",
                      f"{min(r['held_out'].values(), default=0):.1%}",
                      f"{min(r['held_out_worst'].values(), default=0):.1%}", str(r["heterogeneous_instances"]),
                      str(r["rounds"]), f"{r['seconds']:.0f}", (r.get("plan_sha") or "–")[:8])
    console.print(table)
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
