"""`coral run`: the main job, end to end on one scenario (library, plans, baselines, simulation, report)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from coral.catalog.loader import builtin_catalog, load_scenario
from coral.cli.common import DEFAULT_OUT, ENGINE_HELP, console, friendly_errors
from coral.report.terminal import FoldingTable


def register(app: typer.Typer) -> None:
    app.command("run")(run_cmd)


@friendly_errors
def run_cmd(
    scenario: str = typer.Argument("core", help="built-in scenario name or scenario YAML"),
    out: Path = typer.Option(DEFAULT_OUT, help="output folder"),
    duration: float | None = typer.Option(None, help="simulated seconds (default: epochs x epoch length)"),
    seed: int = typer.Option(0, help="workload seed"),
    engine: str = typer.Option("coral", help=ENGINE_HELP),
) -> None:
    """Build (or load) the template library, plan with Coral and the baselines, simulate the Coral plan with
    re-planning every epoch and every method's plan held fixed (same requests), and write plans, simulation
    results and an HTML report."""
    from coral.allocation import baselines
    from coral.allocation.allocator import allocate
    from coral.allocation.availability import resolve_availability
    from coral.deploy.vllm import engine_library
    from coral.experiments.allocation import load_library
    from coral.report import build_report
    from coral.report.adapters import inputs_from_sim, method_result
    from coral.report.terminal import print_comparison, print_plan
    from coral.report.view import plan_fingerprint
    from coral.simulation.replan import allocator_replanner
    from coral.simulation.run import simulate
    from coral.workload.traces import workload_for

    sc = load_scenario(scenario)
    folder = out / f"run-{sc.name}"
    folder.mkdir(parents=True, exist_ok=True)
    lib = engine_library(load_library(scenario, out), engine, builtin_catalog())
    console.print(f"library: {len(lib):,} templates for {len(lib.keys())} (model, phase) pairs")

    avail = resolve_availability(sc, lib)
    plan = allocate(lib, sc, availability=avail)
    plan.engine = engine  # type: ignore[assignment]  # checked by engine_library
    others = [baselines.homo_greedy(lib, sc, availability=avail),
              baselines.cauchy_paper(lib, sc, availability=avail)]
    print_plan(plan, console)
    print_comparison(plan, others, console)
    for p in (plan, *others):
        p.save(folder / f"plan.{p.mode}.{p.method}.json")

    duration_s = duration or sc.epochs * sc.epoch_minutes * 60.0
    requests = workload_for(sc, duration_s, seed)
    with console.status(f"simulating {duration_s:.0f} s of traffic with re-planning every {sc.epoch_minutes:g} min"):
        sim = simulate(allocator_replanner(lib, sc), sc, requests, duration_s=duration_s, seed=seed)
    sim.plan_fingerprint = plan_fingerprint(plan)  # the run starts from this plan, then re-plans
    sim.save_json(folder / "sim.json")
    sim.plots(folder)
    fixed = []
    for p in (plan, *others):
        with console.status(f"simulating the {p.method} plan held fixed"):
            run = simulate(p, sc, requests, duration_s=duration_s, seed=seed)
        run.plan_fingerprint = plan_fingerprint(p)
        run.save_json(folder / f"sim.fixed.{p.method}.json")
        fixed.append(method_result(run, p.method, "plan held fixed"))
    inputs = inputs_from_sim(sim, sc, plan.method)
    inputs.methods = [method_result(sim, plan.method, f"re-planned every {sc.epoch_minutes:g} min"), *fixed]
    (folder / "report-inputs.json").write_text(inputs.model_dump_json(indent=1))
    report = folder / "report.html"
    report.write_text(build_report(plan, baselines=others, sim=inputs))

    table = FoldingTable(title=f"Coral on {sc.name}: simulated {duration_s:.0f} s")
    for col in ("model", "requests", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "SLO attainment", "goodput tok/s"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for m in sim.models:
        table.add_row(m.model, f"{m.requests:,}", f"{m.ttft_ms.p50:,.0f} / {m.ttft_ms.p99:,.0f}",
                      f"{m.tpot_ms.p50:,.1f} / {m.tpot_ms.p99:,.1f}", f"{m.slo_attainment:.1%}",
                      f"{m.goodput_tokens_s:,.0f}")
    console.print(table)
    attainment = FoldingTable(title="SLO attainment per method (same requests)")
    for col in ("method", "run", *(m.model for m in sim.models), "all", "cost $/h"):
        attainment.add_column(col, justify="left" if col in ("method", "run") else "right")
    for r in inputs.methods:
        attainment.add_row(r.method, r.how, *(f"{r.by_model.get(m.model, 0.0):.1%}" for m in sim.models),
                           f"{r.slo_attainment:.1%}", f"{r.cost_per_hour:,.2f}")
    console.print(attainment)
    summary = {
        "scenario": sc.name,
        "planned_cost_per_hour": {p.method: round(p.cost_per_hour, 4) for p in (plan, *others)},
        "served_fraction": {p.method: min((s.served_fraction for s in p.serving), default=1.0)
                            for p in (plan, *others)},
        "solve_seconds": plan.solve.time_s,
        "simulated_cost_per_hour": sim.mean_cost_per_hour,
        "slo_attainment": sim.slo_attainment,
        "goodput_tokens_s": sim.goodput_tokens_s,
        "fixed_plan_slo_attainment": {r.method: r.slo_attainment for r in fixed},
        "fixed_plan_cost_per_hour": {r.method: r.cost_per_hour for r in fixed},
    }
    (folder / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(f"Coral ${plan.cost_per_hour:,.2f}/h vs " + ", ".join(
        f"{p.method} ${p.cost_per_hour:,.2f}/h" for p in others) +
        f"; simulated SLO attainment {sim.slo_attainment:.1%}, cost ${sim.mean_cost_per_hour:,.2f}/h")
    console.print(f"wrote [bold]{report}[/] and plans, sim*.json, report-inputs.json, plots, summary.json in "
                  f"{folder}")
