"""How far heterogeneity can go in a scarce market: each model searched alone under each share of the scarce GPUs,
then the cheapest split of them.

    python benchmarks/scarce_split.py [--scenario core] [--gpus 4] [--target 0.9] [--rounds 6]

In a `best-gpu-N` market (`equal_attainment.py`: N GPUs of the scenario's best type in all, the others
plentiful) the models compete for the few best GPUs only. A model's attainment depends on its own instances only
(`coral.planning.compose`), so for every model and every share of the scarce nodes (none; 1 or 2 in one region;
all but those; one in each; all), Coral's SLO search (its allocator, then pricing slack; `--rounds` per trial) is run for that
model alone: its planner plans the model's demand within that share, the other models keep the instances of
homo-ilp's searched plan (which meets their targets), so a round passes exactly when the model meets its target.
The cheapest passing part of each (model, share) is one option, and so is each model's part of Coral's own
searched plan; the exact choice of one option per model within the market (`cheapest_parts`) is the cheapest
split, checked on the tuning sets and scored on the held-out ones like any plan. Prints the options and the split
beside Coral's and homo-ilp's searched plans, and writes out/benchmarks/scarce_split.json (`--name`).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from _console import stamped_json, table_console  # benchmarks/_console.py
from equal_attainment import best_gpu_market, with_target
from rich.table import Table

from coral.allocation.allocator import allocate
from coral.allocation.availability import PLENTY
from coral.allocation.baselines import homo_ilp
from coral.allocation.demand import run_length_s, scenario_traffic
from coral.catalog.loader import load_scenario
from coral.planning import SearchSettings, allocator_planner, search_method, search_plan
from coral.planning.compose import Part, alone, availability_limits, cheapest_parts, composed_plan, part_of
from coral.planning.slo_search import (
    SEARCH_SLACK,
    score,
    simulator_evaluator,
    tuning_attainment,
    with_traffic,
)
from coral.templates.store import load_library


def shares(avail: Mapping[str, Mapping[str, int]]) -> dict[str, dict[tuple[str, str], int]]:
    """The shares of the scarce nodes tried per model: none, 1 or 2 in one region, one in each, all, and all but
    1 or 2 in one region (what is left to the others when they take those)."""
    scarce = sorted((r, c) for r, cs in avail.items() for c, n in cs.items() if 0 < n < PLENTY)
    full = {key: avail[key[0]][key[1]] for key in scarce}
    out: dict[str, dict[tuple[str, str], int]] = {"none": {}}
    for key in scarce:
        for n in range(1, min(2, full[key]) + 1):
            out[f"{n} in {key[0]}"] = {key: n}
            rest = {k: full[k] - (n if k == key else 0) for k in scarce}
            out[f"all but {n} in {key[0]}"] = {k: v for k, v in rest.items() if v > 0}
    if len(scarce) > 1:
        out["1 in each"] = {key: 1 for key in scarce}
    out["all"] = full
    unique: dict[str, dict[tuple[str, str], int]] = {}
    for label, share in out.items():  # one label per distinct share
        if share not in unique.values():
            unique[label] = share
    return unique


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default="core")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--rounds", type=int, default=6, help="rounds per trial of each model's search")
    ap.add_argument("--library-dir", type=Path, default=Path("out"))
    ap.add_argument("--out", type=Path, default=Path("out/benchmarks"))
    ap.add_argument("--only", nargs="+", default=[], metavar="MODEL=SHARE",
                    help="search only these (model, share) pairs (shares as printed), e.g. a split found before")
    ap.add_argument("--name", default="scarce_split", help="JSON file name (without .json)")
    args = ap.parse_args()
    only = {tuple(pair.split("=", 1)) for pair in args.only}
    console = table_console()
    sc = with_target(load_scenario(args.scenario), args.target)
    lib = load_library(args.scenario, args.library_dir)
    avail = best_gpu_market(sc, args.gpus)
    assert not isinstance(avail, str)
    evaluate = simulator_evaluator(sc, run_length_s(sc))
    t0 = time.perf_counter()
    searched: dict[str, Any] = {}
    for name, method in (("coral", allocate), ("homo-ilp", homo_ilp)):
        res = search_method(method, lib, sc, avail, evaluate=evaluate)
        assert res.plan is not None and res.tuned_passed, f"{name}'s search found no passing plan"
        searched[name] = res.plan
        console.print(f"{name}'s search: ${res.plan.cost_per_hour:,.2f}/h in {len(res.rounds)} rounds")
    others = searched["homo-ilp"]
    # each model's part of Coral's searched plan is an option too: the split is never dearer than that plan
    options: dict[str, list[Part]] = {m.model: [part_of(searched["coral"], m.model, 0)] for m in sc.models}
    rows: list[dict[str, Any]] = []
    share_of: dict[int, str] = {id(options[m][0]): "as in Coral's search" for m in options}
    for m in options:
        for label, share in shares(avail).items():
            if only and (m, label) not in only:
                continue
            within = {r: {c: (share.get((r, c), 0) if 0 < n < PLENTY else n) for c, n in cs.items()}
                      for r, cs in avail.items()}
            plain = allocator_planner(lib, sc, within)
            priced = allocator_planner(lib, sc, within, slack=SEARCH_SLACK)
            res = search_plan(alone(m, others, plain), sc, SearchSettings(max_rounds=args.rounds, held_out_seeds=()),
                              evaluate=evaluate, variants=[alone(m, others, priced)], availability="unlimited")
            passing = [r for r in res.rounds if r.passed]
            row: dict[str, Any] = {"model": m, "share": label, "rounds": len(res.rounds), "cost_per_hour": None}
            if res.plan is not None and res.tuned_passed:
                part = part_of(res.plan, m, res.chosen or 0)
                options[m].append(part)
                share_of[id(part)] = label
                row.update(cost_per_hour=part.cost_per_hour, attainment=res.rounds[res.chosen or 0].attainment[m],
                           nodes={f"{r}/{c}": n for (r, c), n in part.nodes.items() if (r, c) in share})
            rows.append(row)
            console.print(f"{m}, {label}: " + (f"${row['cost_per_hour']:,.2f}/h" if row["cost_per_hour"] else
                                              "no passing part") + f" ({len(passing)} of {len(res.rounds)} rounds passed)")
    best = cheapest_parts(options, availability_limits(avail))
    split = sum(p.cost_per_hour for p in best) if best else None
    held: dict[str, float] = {}
    if best:  # the split as one plan: checked on the tuning sets, scored on the held-out ones like any plan
        plan = with_traffic(composed_plan(best), scenario_traffic(sc))
        tuned = tuning_attainment(plan, SearchSettings(), evaluate)
        check = score(plan, sc, SearchSettings(), run_length_s(sc), {m: a.slo for m, a in tuned.items()}, {},
                      evaluate=evaluate)
        held = check.held_out
        console.print("the split on the tuning sets: " + ", ".join(f"{m} {a.slo:.1%}" for m, a in tuned.items())
                      + "; held-out: " + ", ".join(f"{m} {a:.1%}" for m, a in held.items()))
    table = Table(title=f"{args.scenario}, {args.gpus} best GPUs, ≥ {args.target:.0%}: each model alone, per share")
    for col in ("model", "share", "$/h", "tuned attainment", "scarce nodes used", "rounds"):
        table.add_column(col, justify="left" if col in ("model", "share") else "right")
    for r in rows:
        table.add_row(r["model"], r["share"], f"{r['cost_per_hour']:,.2f}" if r["cost_per_hour"] else "–",
                      f"{r['attainment']:.1%}" if r["cost_per_hour"] else "–",
                      ", ".join(f"{k} {v}" for k, v in r.get("nodes", {}).items()), str(r["rounds"]))
    console.print(table)
    coral, homo = searched["coral"].cost_per_hour, searched["homo-ilp"].cost_per_hour
    console.print("cheapest split: " + (f"${split:,.2f}/h (" + ", ".join(
        f"{p.model} {share_of[id(p)]}" for p in best) + ")" if best and split else "none")
        + f"; Coral's search ${coral:,.2f}/h, homo-ilp's "
        f"${homo:,.2f}/h ({homo / coral:.3f}x" + (f"; at the split {homo / split:.3f}x" if split else "") + ")")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    path.write_text(stamped_json({"scenario": args.scenario, "gpus": args.gpus, "target": args.target, "rows": rows,
                                "split": {p.model: share_of[id(p)] for p in best or []},
                                "split_cost_per_hour": split, "split_held_out": held, "coral_cost_per_hour": coral,
                                "homo_ilp_cost_per_hour": homo, "seconds": time.perf_counter() - t0}, indent=1))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
