"""`coral simulate`: run a plan (or the allocator every epoch) on request traces, without GPUs."""

from __future__ import annotations

from pathlib import Path

import typer

from coral.allocation.plan import Plan
from coral.catalog.loader import CoralInputError
from coral.cli.common import DEFAULT_OUT, OFFERINGS_HELP, console, friendly_errors, scenario_and_market
from coral.report.terminal import FoldingTable
from coral.report.view import plan_fingerprint
from coral.simulation.availability import load_availability
from coral.simulation.engine import Replanner
from coral.simulation.metrics import SimResult
from coral.simulation.replan import allocator_replanner
from coral.simulation.run import simulate
from coral.simulation.stand_in import greedy_plan
from coral.templates.store import load_library
from coral.workload.traces import SHIPPED_TRACES, shipped_path, stand_in_notes, workload_for


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate_cmd)


def parse_traces(values: list[str], models: list[str]) -> dict[str, Path]:
    """'PATH' (every model) or 'MODEL=PATH' (one model) -> {model: path}; PATH may also name a shipped trace
    (azure-code, azure-conversation, burstgpt)."""
    out: dict[str, Path] = {}
    for v in values:
        name, sep, path = v.partition("=")
        if sep and name in models:
            out[name] = shipped_path(path) if path in SHIPPED_TRACES else Path(path)
        elif v in SHIPPED_TRACES:
            out.update(dict.fromkeys(models, shipped_path(v)))
        elif sep and not Path(v).exists():
            raise CoralInputError(f"--trace {v}: {name!r} is not a model of the scenario ({', '.join(models)})")
        else:
            out.update(dict.fromkeys(models, Path(v)))
    for m, p in out.items():
        if not p.exists():
            raise CoralInputError(f"--trace for {m}: {p}: no such file")
    return out


def results_table(result: SimResult) -> FoldingTable:
    table = FoldingTable(title=f"Simulation of {result.scenario} ({result.router} router, {result.duration_s:g} s)")
    for col in ("model", "requests", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "SLO att.", "goodput tok/s",
                "util P/D", "batch fill"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for m in [*result.models, result.overall]:
        table.add_row(
            m.model, f"{m.finished}/{m.requests}", f"{m.ttft_ms.p50:.0f} / {m.ttft_ms.p99:.0f}",
            f"{m.tpot_ms.p50:.1f} / {m.tpot_ms.p99:.1f}", f"{m.slo_attainment:.1%}", f"{m.goodput_tokens_s:,.0f}",
            f"{m.prefill_gpu_util:.0%} / {m.decode_gpu_util:.0%}", f"{m.decode_batch_fill:.0%}",
        )
    return table


@friendly_errors
def simulate_cmd(
    scenario: str = typer.Argument(..., help="built-in scenario name or scenario YAML"),
    plan: Path | None = typer.Option(None, help="plan JSON to run unchanged (default: the allocator every epoch)"),
    trace: list[str] = typer.Option(
        [], help="trace CSV (Azure or BurstGPT) or shipped trace name (azure-code, azure-conversation, burstgpt) as PATH or "
        "MODEL=PATH, rescaled to the model's rate; repeatable"
    ),
    duration: float = typer.Option(0.0, help="simulated seconds (default: the scenario's epochs x epoch length)"),
    seed: int = typer.Option(0, help="seed of the workload (trace offsets, synthetic requests)"),
    router: str = typer.Option(
        "wrr", help="wrr (weighted round-robin, the paper), lor (least outstanding, weighted) or both (compare)"
    ),
    rate_scale: float = typer.Option(1.0, help="multiply every model's request rate"),
    trace_scaling: str = typer.Option("", help="superpose (overlay independent trace segments) or compress "
                                      "(compress time); default: the scenario's trace_scaling"),
    startup_delay: float = typer.Option(300.0, help="seconds before a newly planned instance serves"),
    availability: Path | None = typer.Option(
        None, help="availability schedule (YAML/JSON) or trace (CSV); default: the scenario's availability_schedule"
    ),
    greedy: bool = typer.Option(False, help="no plan: run the greedy stand-in plan instead of the allocator"),
    headroom: float = typer.Option(1.0, help="allocator: plan for observed demand x this"),
    handover: bool = typer.Option(True, help="removed instances serve until their replacements are ready"),
    oracle: bool = typer.Option(False, help="allocator sees the coming epoch's demand, not the previous one's"),
    requests_csv: bool = typer.Option(False, help="also write requests.csv (one row per request)"),
    kv_reserve: str = typer.Option("mean", help="KV charged per decoding request: mean (prompt + output/2) or max"),
    out: Path = typer.Option(DEFAULT_OUT, help="output folder (library looked up here; results in out/sim/...)"),
    offerings: Path | None = typer.Option(None, help=OFFERINGS_HELP),
) -> None:
    """Simulate serving a plan: TTFT/TPOT, SLO attainment, goodput, cost, GPU utilisation (JSON + PNG)."""
    routers = ["wrr", "lor"] if router == "both" else [router]
    if router not in ("wrr", "lor", "both"):
        raise CoralInputError(f"--router must be wrr, lor or both, not {router!r}")
    if kv_reserve not in ("mean", "max"):
        raise CoralInputError(f"--kv-reserve must be mean or max, not {kv_reserve!r}")
    sc, cat = scenario_and_market(scenario, offerings)
    duration_s = duration or sc.epochs * sc.epoch_minutes * 60.0
    names = [m.model for m in sc.models]
    files = parse_traces(trace, names)
    requests = workload_for(sc, duration_s, seed, files, rate_scale=rate_scale,
                            scaling=trace_scaling or None)  # type: ignore[arg-type]  # checked there
    for note in stand_in_notes(sc, files):
        console.print(f"[yellow]note:[/] {note}")
    sched = load_availability(availability, sc) if availability else sc.availability_schedule
    fixed_plan = Plan.load(plan) if plan is not None else None
    library = load_library(scenario, out, cat) if fixed_plan is None else None
    results = []
    for r in routers:
        runner: Plan | Replanner
        log: list[str] = []
        if fixed_plan is not None:
            runner = fixed_plan
        elif greedy:
            assert library is not None
            runner = greedy_plan(library, sc, rate_scale=rate_scale)
        else:
            assert library is not None
            runner = allocator_replanner(library, sc, headroom=headroom, log=log)
        with console.status(f"simulating {sum(len(x) for x in requests.values()):,} requests ({r} router)..."):
            result = simulate(
                runner, sc, requests, duration_s=duration_s, seed=seed, router=r, startup_delay_s=startup_delay,
                availability=sched, handover=handover, forecast="oracle" if oracle else "previous",
                kv_reserve=kv_reserve,  # type: ignore[arg-type]
            )
        result.notes.extend(log)
        if fixed_plan is not None:
            result.plan_fingerprint = plan_fingerprint(fixed_plan)
        report(result, out / "sim" / f"{Path(scenario).stem}-{r}", requests_csv)
        results.append(result)
    if len(results) > 1:
        console.print(compare_table(results))


def report(result: SimResult, folder: Path, requests_csv: bool) -> None:
    """Save JSON and plots (and the per-request CSV) of one run and print its summary."""
    path = result.save_json(folder / "result.json")
    if requests_csv:
        result.save_requests_csv(folder / "requests.csv")
    pngs = result.plots(folder)
    console.print(results_table(result))
    console.print(
        f"cost {result.mean_cost_per_hour:,.2f} $/h (total ${result.total_cost:,.2f}), GPU utilisation "
        f"{result.gpu_utilisation:.0%}, {result.requests_per_wall_s:,.0f} simulated requests per second"
    )
    for note in result.notes:
        console.print(f"[yellow]note:[/] {note}")
    for e in result.epochs:
        if e.over_availability:
            console.print(f"[yellow]epoch {e.epoch} uses more nodes than available:[/] {', '.join(e.over_availability)}")
    if result.unfinished:
        console.print(f"[yellow]{result.unfinished} requests did not finish[/]")
    console.print(f"wrote {path}, " + ", ".join(str(p) for p in pngs))


def compare_table(results: list[SimResult]) -> FoldingTable:
    table = FoldingTable(title="Routers compared")
    for col in ("router", "SLO att.", "goodput tok/s", "TTFT p99 ms", "TPOT p99 ms", "finished"):
        table.add_column(col, justify="left" if col == "router" else "right")
    for r in results:
        o = r.overall
        table.add_row(r.router, f"{o.slo_attainment:.1%}", f"{o.goodput_tokens_s:,.0f}", f"{o.ttft_ms.p99:,.0f}",
                      f"{o.tpot_ms.p99:,.1f}", f"{o.finished}/{o.requests}")
    return table
