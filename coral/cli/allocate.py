"""`coral allocate` (the online stage) and `coral experiment NAME` (allocation experiments)."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from coral.catalog.loader import CoralInputError
from coral.cli.common import (
    DEFAULT_OUT,
    ENGINE_HELP,
    OFFERINGS_HELP,
    console,
    friendly_errors,
    scenario_and_market,
)
from coral.report.terminal import FoldingTable, solver_in_words


def register(app: typer.Typer) -> None:
    """Add `allocate` and `experiment` to `app`."""
    app.command("allocate")(allocate_cmd)
    app.command("experiment")(experiment_cmd)


def plan_table(plan: object) -> FoldingTable:
    from coral.allocation.plan import Plan

    assert isinstance(plan, Plan)
    table = FoldingTable(title=f"{plan.method} plan for {plan.scenario} ({plan.mode}), ${plan.cost_per_hour:,.2f}/h")
    for col in ("model/phase", "instances (template@region ×n)", "$/h", "demand tok/s", "capacity tok/s",
                "spare", "served"):
        table.add_column(col, justify="left" if col.startswith(("model", "inst")) else "right")
    for s in plan.serving:
        groups: dict[str, int] = {}
        for i in plan.instances_of(s.model, s.phase):
            label = "+".join(f"{c}*{n}" if n > 1 else c for c, n in sorted(i.counts.items()))
            name = f"t{i.template_id}[{label}]@{i.region}"
            groups[name] = groups.get(name, 0) + 1
        text = ", ".join(f"{k} ×{n}" for k, n in groups.items()) or "-"
        spare = (s.capacity - s.demand) / s.demand if s.demand else 0.0
        table.add_row(f"{s.model}/{s.phase}", text, f"{s.cost_per_hour:,.2f}", f"{s.demand:,.0f}",
                      f"{s.capacity:,.0f}", f"{spare:+.1%}", f"{s.served_fraction:.1%}")
    return table


def served_in_words(plan: object) -> str:
    """How much of the demand a plan serves, and which (model, phase)s fall short, in plain words."""
    from coral.allocation.plan import Plan

    assert isinstance(plan, Plan)
    demand = sum(s.demand for s in plan.serving)
    served = sum(min(s.capacity, s.demand) for s in plan.serving)
    short = sorted((s for s in plan.serving if s.served_fraction < 1 - 1e-9), key=lambda s: s.served_fraction)
    if not short:
        return f"all demand ({demand:,.0f} tok/s) at ${plan.cost_per_hour:,.2f}/h"
    gaps = ", ".join(f"{s.model}/{s.phase} gets {s.served_fraction:.0%}" for s in short)
    return (f"{served / demand:.1%} of demand ({served:,.0f} of {demand:,.0f} tok/s) at ${plan.cost_per_hour:,.2f}/h; "
            f"{demand - served:,.0f} tok/s unserved: {gaps}; least served {short[0].served_fraction:.1%}")


@friendly_errors
def allocate_cmd(
    scenario: str = typer.Argument("core", help="built-in scenario name or scenario YAML"),
    mode: str = typer.Option("cost", help="cost | goodput | maxmin | scaled"),
    method: str = typer.Option("coral", help="coral | homo-greedy | homo-ilp | cauchy-paper"),
    availability_factor: float | None = typer.Option(None, help="headroom factor overriding the scenario's"),
    running: Path | None = typer.Option(None, help="previous plan JSON (scale-up penalty against it)"),
    time_limit: float = typer.Option(30.0, help="solver time limit, s"),
    gap: float = typer.Option(1e-4, help="relative MIP gap"),
    out: Path = typer.Option(DEFAULT_OUT, help="folder with the library; the plan is written here"),
    engine: str = typer.Option("coral", help=ENGINE_HELP),
    offerings: Path | None = typer.Option(None, help=OFFERINGS_HELP),
) -> None:
    """Plan instances per (template, region) for the scenario's demand."""
    from coral.allocation import baselines
    from coral.allocation.allocator import MODES, allocate
    from coral.allocation.availability import resolve_availability
    from coral.allocation.plan import Plan
    from coral.templates.engines import engine_library
    from coral.templates.store import load_library

    if mode not in MODES:
        raise CoralInputError(f"--mode: must be one of {', '.join(MODES)}, not {mode!r}")
    t0 = time.perf_counter()
    sc, cat = scenario_and_market(scenario, offerings)
    lib = engine_library(load_library(scenario, out, cat), engine, cat)
    t_lib = time.perf_counter()
    avail = resolve_availability(sc, lib, cat, factor=availability_factor)
    t_avail = time.perf_counter()
    if method == "coral":
        prev = Plan.load(running) if running else None
        plan = allocate(lib, sc, availability=avail, running=prev, mode=mode,  # type: ignore[arg-type]
                        catalog=cat, time_limit=time_limit, gap=gap)
    elif method == "homo-greedy":
        plan = baselines.homo_greedy(lib, sc, availability=avail, catalog=cat)
    elif method == "homo-ilp":
        plan = baselines.homo_ilp(lib, sc, availability=avail, mode=mode,  # type: ignore[arg-type]
                                  catalog=cat, time_limit=time_limit, gap=gap)
    elif method == "cauchy-paper":
        plan = baselines.cauchy_paper(lib, sc, availability=avail, catalog=cat, time_limit=time_limit, gap=gap)
    else:
        raise CoralInputError(f"--method: must be coral, homo-greedy, homo-ilp or cauchy-paper, not {method!r}")
    plan.engine = engine  # type: ignore[assignment]  # checked by engine_library
    console.print(plan_table(plan))
    s = plan.solve
    console.print(f"status {s.status}, objective {s.objective}, bound {s.bound}, gap {s.gap}, "
                  f"{s.time_s:.3f} s, {s.n_variables} vars, {s.n_constraints} rows; penalty "
                  f"${plan.penalty_per_hour:,.2f}/h")
    console.print(f"in words: {solver_in_words(s)}")
    console.print(f"served: {served_in_words(plan)}")
    total = time.perf_counter() - t0
    console.print(f"time: {total:.2f} s end to end (library {t_lib - t0:.2f} s, availability {t_avail - t_lib:.2f} s, "
                  f"plan {total - (t_avail - t0):.2f} s of which solver {s.time_s:.2f} s)")
    for note in s.notes:
        console.print(f"  [dim]{note}[/]")
    engine_tag = "" if engine == "coral" else f".{engine}"
    path = plan.save(out / f"{Path(scenario).stem}.{mode}.{method}{engine_tag}.plan.json")
    console.print(f"-> [bold]{path}[/]")


@friendly_errors
def experiment_cmd(
    name: str = typer.Argument(..., help="default | scarce | imbalanced | epochs | waterfall"),
    target: str | None = typer.Argument(None, help="scenario of epochs (default extended) or waterfall (core)"),
    out: Path = typer.Option(DEFAULT_OUT, help="output folder (libraries cached here; results in experiments/)"),
    time_limit: float = typer.Option(30.0, help="solver time limit per solve, s"),
    scenario: str | None = typer.Option(None, help="same as the second argument"),
) -> None:
    """Run an allocation experiment: print a table, write JSON and a PNG plot."""
    from coral.experiments.allocation import run_experiment

    chosen = target or scenario
    if chosen and name not in ("epochs", "waterfall"):
        raise CoralInputError(f"experiment {name!r} takes no scenario (only epochs and waterfall do)")
    result = run_experiment(name, out, time_limit, **({"scenario": chosen} if chosen else {}))
    table = FoldingTable(title=result.title)
    for col in result.columns:
        table.add_column(col, justify="left" if col in ("setting", "method", "status", "change") else "right")
    for row in result.rows:
        table.add_row(*[_fmt(row.get(c)) for c in result.columns])
    console.print(table)
    for note in result.notes:
        console.print(f"[dim]{note}[/]")
    console.print("-> " + ", ".join(f"[bold]{p}[/]" for p in result.files))


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-2 and v else f"{v:,.3f}".rstrip("0").rstrip(".")
    return "-" if v is None else str(v)
