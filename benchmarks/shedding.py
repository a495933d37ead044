"""Shedding at the planned share, simulated: held-out goodput after a GPU type is lost mid-run, with and without.

    python benchmarks/shedding.py [--scenario core] [--lose 1xL40S] [--at 600] [--seed 1] [--duration S]

The scenario's allocator plan serves its held-out requests (workload seed `--seed`, the held-out half of each
trace); at `--at` s every node of `--lose` in every region is taken away (an availability schedule: the instances
on them are lost at once, `coral.simulation.engine.Engine.lose`), and the allocator re-plans every epoch within what
is left, in goodput mode once the demand no longer fits (`allocator_replanner`). Two runs on the same requests:
shedding at the capacity serving each model while the plan in force serves only a share of some model's demand
(`shed="plan"`, the gateway's rule, `coral.allocation.shedding`), and no shedding (`shed="off"`: every request
queues). Per model, over the requests arriving after the loss: SLO attainment, SLO goodput (generated tokens/s of
requests meeting both SLOs) and requests shed. Prints a table and writes `--json` (default
out/benchmarks/shedding.json).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from _console import stamped_json, table_console  # benchmarks/_console.py
from rich.table import Table

from coral.allocation.allocator import allocate
from coral.allocation.demand import run_length_s
from coral.catalog.loader import load_scenario
from coral.catalog.schema import AvailabilitySchedule
from coral.simulation.metrics import SimResult
from coral.simulation.replan import allocator_replanner
from coral.simulation.run import simulate
from coral.templates.store import load_library
from coral.workload.traces import workload_for


def after_loss(res: SimResult, names: list[str], at_s: float, duration_s: float) -> dict[str, dict[str, float]]:
    """Per model and for all: requests arriving after `at_s`, their SLO attainment, SLO goodput and shed count."""
    per = res.per_request()
    late = per["arrival_s"] >= at_s
    span = duration_s - at_s
    out: dict[str, dict[str, float]] = {}
    for k, name in [*enumerate(names), (None, "all")]:
        sel = late & (per["model"] == k) if k is not None else late
        n = int(sel.sum())
        good = sel & per["good"]
        shed = sel & per["refused"]
        out[name] = {"requests": n, "slo_attainment": float(good.sum() / n) if n else 0.0,
                     "goodput_tokens_s": float(per["output_tokens"][good].sum() / span), "shed": int(shed.sum())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", default="core")
    ap.add_argument("--lose", default="1xL40S", help="node config lost in every region")
    ap.add_argument("--at", type=float, default=600.0, help="seconds into the run when it is lost")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--duration", type=float, default=None, help="default: the scenario's run length")
    ap.add_argument("--json", type=Path, default=Path("out/benchmarks/shedding.json"))
    args = ap.parse_args()

    sc = load_scenario(args.scenario)
    lib = load_library(args.scenario, Path("out"))
    duration = args.duration or run_length_s(sc)
    requests = workload_for(sc, duration, args.seed, part="held_out")
    plan = allocate(lib, sc)
    schedule = AvailabilitySchedule.model_validate(
        {"steps": [{"at_s": args.at, "counts": {r: {args.lose: 0} for r in sc.regions}}]})
    names = [m.model for m in sc.models]
    rows = {}
    for shed in ("plan", "off"):
        log: list[str] = []
        replan = allocator_replanner(lib, sc, initial=plan, log=log)
        t0 = time.perf_counter()
        res = simulate(replan, sc, requests, duration_s=duration, seed=args.seed, availability=schedule, shed=shed)
        rows[shed] = {"after_loss": after_loss(res, names, args.at, duration), "refused": res.refused,
                      "mean_cost_per_hour": res.mean_cost_per_hour, "notes": res.notes, "replans": log,
                      "wall_s": time.perf_counter() - t0}

    console = table_console()
    table = Table(title=f"{sc.name}: every {args.lose} node lost at {args.at:.0f} s of {duration:.0f} s (held-out "
                        f"requests, seed {args.seed}); requests arriving after the loss")
    for col in ("model", "requests", "shed: attainment", "shed: goodput tok/s", "shed: refused",
                "no shedding: attainment", "no shedding: goodput tok/s"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name in [*names, "all"]:
        a, b = rows["plan"]["after_loss"][name], rows["off"]["after_loss"][name]
        table.add_row(name, f"{a['requests']:,}", f"{a['slo_attainment']:.1%}", f"{a['goodput_tokens_s']:,.0f}",
                      f"{a['shed']:,}", f"{b['slo_attainment']:.1%}", f"{b['goodput_tokens_s']:,.0f}")
    console.print(table)
    for shed, row in rows.items():
        console.print(f"shed={shed}: mean ${row['mean_cost_per_hour']:,.2f}/h, {row['wall_s']:.1f} s; "
                      + "; ".join(row["notes"]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(stamped_json({"scenario": sc.name, "lose": args.lose, "at_s": args.at, "seed": args.seed,
                                     "duration_s": duration, "runs": rows}, indent=1))
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
