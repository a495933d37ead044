"""Online re-planning on the real traces: does forecasting the next epoch and correcting by observed latency pay?

    python benchmarks/online.py [--scenario core] [--static search|allocate] [--seed 1] [--duration S]

Per scenario, one starting plan and the same requests (the scenario's traces, workload seed `--seed`; the
planner tunes on seed 0, so the default scores on requests it never saw), the scenario's epochs and the
simulator's 300 s start-up delay; re-planners keep a (model, phase)'s running instances while their capacity is
within 1 to 1 + `--hold` times what it asks for (`allocator_replanner(hold=...)`):
  static                      the plan held fixed;
  last epoch                  re-planned every epoch for the previous epoch's mean traffic × the plan's headroom;
  forecast                    ... for the forecast of the coming epoch (Holt + peak tracking, per-minute rates);
  correction                  ... for the previous epoch's mean × the latency correction (observed ÷ SLO);
  forecast + correction       both (`coral.allocation.forecast`);
  oracle                      re-planned for the coming epoch's actual mean (a perfect forecast, for reference).
The starting plan is the SLO-true search's (`--static search`, `coral.planning`) or the allocator's default
(`--static allocate`: mean traffic × the percentile rule's burst factor). Three traffic cases: the scenario's
("as planned"), and two surges the starting plan was not sized for, made of independent segments of the same
real traces: a step to `--surge`× the scenario's rate at `--surge-at` s, and a ramp from 1× there to `--surge`×
at the end. Prints mean $/h and SLO attainment (all requests and per model), the seconds each epoch's re-plan
took (the allocator call, mean and most), and the end-to-end seconds of `coral allocate SCENARIO` in a fresh
process with the library built: the first run after `--out`'s latency ratings are removed (it rates every
template and caches the ratings beside the library) and the best of `--replans` runs after it (it reads them:
what a re-planner started anew pays). Writes `--json` (default out/benchmarks/online.json).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from _console import stamped_json, table_console  # benchmarks/_console.py
from rich.console import Console
from rich.table import Table

from coral.allocation.allocator import allocate, resolve_availability
from coral.allocation.demand import run_length_s, scenario_traffic
from coral.allocation.forecast import DemandForecaster, LatencyCorrection
from coral.allocation.plan import Plan
from coral.catalog.loader import load_scenario
from coral.catalog.schema import Scenario
from coral.planning import SearchSettings, allocator_planner, search_plan
from coral.planning.slo_search import with_traffic
from coral.simulation import simulate
from coral.simulation.engine import ObservedDemand, Replanner
from coral.simulation.replan import allocator_replanner
from coral.templates.library import TemplateLibrary
from coral.templates.store import load_library
from coral.workload.traces import RequestSet, workload_for

VARIANTS = ("static", "last epoch", "forecast", "correction", "forecast + correction", "oracle")


def starting_plan(lib: TemplateLibrary, sc: Scenario, how: str, console: Console) -> Plan:
    avail = resolve_availability(sc, lib)
    if how == "allocate":
        return with_traffic(allocate(lib, sc, availability=avail), scenario_traffic(sc))
    with console.status("SLO-true search for the starting plan") as status:
        result = search_plan(allocator_planner(lib, sc, avail), sc, SearchSettings(held_out_seeds=()),
                             availability=avail, progress=lambda line: status.update(f"search: {line}"))
    if result.plan is None:
        raise SystemExit(f"{sc.name}: the search found no plan")
    return result.plan


def traffic_cases(sc: Scenario, duration: float, seed: int, surge: float, at_s: float) -> dict[str, dict]:
    """{case name: requests per model}: the scenario's traffic and, with `surge` > 1, two surges the starting plan
    was not sized for, made of independent segments of the same traces (workload seed + 1000): a step of
    (`surge` − 1)× the scenario's rate from `at_s` on, and a ramp from 1× at `at_s` to `surge`× at the end."""
    base = workload_for(sc, duration, seed)
    cases = {"as planned": base}
    if surge <= 1:
        return cases
    extra = workload_for(sc, duration, seed + 1000, rate_scale=surge - 1)
    rng = np.random.default_rng(seed)
    for name, share in ((f"step x{surge:g} at {at_s:g} s", lambda t: (t >= at_s).astype(float)),
                        (f"ramp to x{surge:g} from {at_s:g} s", lambda t: np.clip((t - at_s) / (duration - at_s), 0, 1))):
        more: dict[str, RequestSet] = {}
        for m, r in base.items():
            e = extra[m]
            keep = rng.random(len(e)) < share(e.arrival_s)
            t = np.r_[r.arrival_s, e.arrival_s[keep]]
            order = np.argsort(t, kind="stable")
            more[m] = RequestSet(t[order], np.r_[r.input_tokens, e.input_tokens[keep]][order],
                                 np.r_[r.output_tokens, e.output_tokens[keep]][order], r.source)
        cases[name] = more
    return cases


def timed(replan: Replanner, seconds: list[float]) -> Replanner:
    """`replan`, appending the wall-clock seconds of each call to `seconds`."""
    def call(epoch: int, observed: ObservedDemand, running: Plan | None) -> Plan:
        t0 = time.perf_counter()
        plan = replan(epoch, observed, running)
        seconds.append(time.perf_counter() - t0)
        return plan

    return call


def cli_replan_s(scenario: str, out: Path, runs: int) -> dict[str, float]:
    """End-to-end seconds of `coral allocate SCENARIO --out OUT` in a fresh process: the first with the cached
    latency ratings removed (it rates and caches them), then the best of `runs` (they read the cache)."""
    def once() -> float:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "coral.cli.main", "allocate", scenario, "--out", str(out), "--json"],
                       check=True, capture_output=True)
        return time.perf_counter() - t0

    (out / f"{Path(scenario).stem}.templates.latency.npz").unlink(missing_ok=True)
    first = once()
    return {"first_s": first, "cached_s": min(once() for _ in range(runs))}


def run_variant(name: str, lib: TemplateLibrary, sc: Scenario, plan: Plan, requests: dict, duration: float,
                seed: int, startup_s: float, hold: float) -> dict:
    log: list[str] = []
    replans: list[float] = []
    forecaster = DemandForecaster(60.0) if "forecast" in name else None
    correction = LatencyCorrection.for_scenario(sc) if "correction" in name else None
    runner = plan if name == "static" else timed(allocator_replanner(
        lib, sc, initial=plan, forecaster=forecaster, correction=correction, ahead_s=startup_s, hold=hold, log=log),
        replans)
    t0 = time.perf_counter()
    res = simulate(runner, sc, requests, duration_s=duration, seed=seed, startup_delay_s=startup_s,
                   forecast="oracle" if name == "oracle" else "previous", interval_s=60.0)
    return {
        "variant": name,
        "mean_cost_per_hour": res.mean_cost_per_hour,
        "slo_attainment": res.slo_attainment,
        "models": {m.model: m.slo_attainment for m in res.models},
        "ttft_attainment": {m.model: m.ttft_attainment for m in res.models},
        "tpot_attainment": {m.model: m.tpot_attainment for m in res.models},
        "epoch_cost_per_hour": [e.cost_per_hour for e in res.epochs],
        "epoch_attainment": [e.slo_attainment for e in res.epochs],
        "log": log,
        "replan_s": replans,
        "wall_s": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", nargs="+", default=["core"])
    ap.add_argument("--static", choices=("search", "allocate"), default="search")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--duration", type=float, default=None, help="default: the scenario's epochs")
    ap.add_argument("--startup", type=float, default=300.0, help="seconds until a new instance serves")
    ap.add_argument("--hold", type=float, default=0.25,
                    help="keep the running plan while its capacity is within 1 to 1 + this x the demand")
    ap.add_argument("--surge", type=float, default=1.5, help="rate multiple of the surge cases (1: none)")
    ap.add_argument("--surge-at", type=float, default=540.0, help="seconds into the run the surges start")
    ap.add_argument("--out", type=Path, default=Path("out"), help="folder of the template libraries")
    ap.add_argument("--replans", type=int, default=3, help="cached `coral allocate` runs timed (the best is kept)")
    ap.add_argument("--json", type=Path, default=Path("out/benchmarks/online.json"))
    args = ap.parse_args()
    console = table_console()
    rows: list[dict] = []
    cli: dict[str, dict[str, float]] = {}
    for name in args.scenario:
        sc = load_scenario(name)
        lib = load_library(name, args.out)
        with console.status(f"{sc.name}: timing `coral allocate {name}` end to end"):
            cli[sc.name] = cli_replan_s(name, args.out, args.replans)
        console.print(f"{sc.name}: `coral allocate {name}` end to end {cli[sc.name]['first_s']:.2f} s rating and "
                      f"caching the latency ratings, {cli[sc.name]['cached_s']:.2f} s reading them (best of "
                      f"{args.replans})")
        duration = args.duration or run_length_s(sc)
        plan = starting_plan(lib, sc, args.static, console)
        for case, requests in traffic_cases(sc, duration, args.seed, args.surge, args.surge_at).items():
            for variant in VARIANTS:
                with console.status(f"{sc.name}, {case}: {variant}"):
                    row = run_variant(variant, lib, sc, plan, requests, duration, args.seed, args.startup,
                                      args.hold)
                row.update(scenario=sc.name, traffic=case, static=args.static, seed=args.seed, duration_s=duration,
                           hold=args.hold, plan_cost_per_hour=plan.cost_per_hour)
                rows.append(row)
                console.print(f"{sc.name}, {case}, {variant}: ${row['mean_cost_per_hour']:.2f}/h, "
                              f"{row['slo_attainment']:.1%} in {row['wall_s']:.0f} s")
    models = list(dict.fromkeys(m for r in rows for m in r["models"]))
    table = Table("scenario", "traffic", "re-planning", "mean $/h", "all", *models, "re-plan s (mean / most)",
                  title=f"SLO attainment and cost of online re-planning ({args.static} starting plan, seed "
                  f"{args.seed}, hold {args.hold:g})")
    for r in rows:
        table.add_row(r["scenario"], r["traffic"], r["variant"], f"{r['mean_cost_per_hour']:.2f}",
                      f"{r['slo_attainment']:.1%}",
                      *(f"{r['models'][m]:.1%}" if m in r["models"] else "" for m in models),
                      f"{np.mean(r['replan_s']):.2f} / {max(r['replan_s']):.2f}" if r["replan_s"] else "")
    console.print(table)
    cli_table = Table("scenario", "first run s (rates, caches)", "re-plan s (reads the cache)",
                      title="`coral allocate SCENARIO` end to end, a fresh process, library built")
    for name, t in cli.items():
        cli_table.add_row(name, f"{t['first_s']:.2f}", f"{t['cached_s']:.2f}")
    console.print(cli_table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(stamped_json({"variants": rows, "coral_allocate": cli}, indent=1))
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
