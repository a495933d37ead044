"""`coral allocate` (the online stage) and `coral experiment NAME` (allocation experiments)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console

from coral.catalog.loader import CoralInputError, scenario_and_market
from coral.cli.common import (
    DEFAULT_OUT,
    ENGINE_HELP,
    JSON_HELP,
    OFFERINGS_HELP,
    check_out_folder,
    console,
    friendly_errors,
    out_console,
    plain,
    print_json,
)
from coral.cli.deploy import TARGET_HELP, plan_file_name

if TYPE_CHECKING:
    from coral.allocation.plan import Plan
    from coral.experiments.allocation import ExperimentResult
    from coral.report.terminal import FoldingTable


def register(app: typer.Typer) -> None:
    """Add `allocate` and `experiment` to `app`."""
    app.command("allocate")(allocate_cmd)
    app.command("experiment")(experiment_cmd)


def instance_groups(plan: Plan, model: str, phase: str) -> dict[str, int]:
    """{'t57[1xL40S*2]@aws-us-east-2': count} of the plan's instances of one (model, phase)."""
    groups: dict[str, int] = {}
    for i in plan.instances_of(model, phase):
        label = "+".join(f"{c}*{n}" if n > 1 else c for c, n in sorted(i.counts.items()))
        name = f"t{i.template_id}[{label}]@{i.region}"
        groups[name] = groups.get(name, 0) + 1
    return groups


def plan_table(plan: Plan) -> FoldingTable:
    """One row per (model, phase): instances (one group a line), cost, share served, demand, capacity, spare. A
    template string is never broken: in a narrow terminal spare, capacity, demand and served are left out (named
    under the table), and the instances last."""
    from rich.markup import escape

    from coral.report.terminal import FoldingTable

    table = FoldingTable(title=plain(f"{plan.method} plan for {plan.scenario} ({plan.mode}), "
                                     f"${plan.cost_per_hour:,.2f}/h"))
    table.add_column("model", no_wrap=True)
    table.add_column("phase")
    table.add_column(escape("instances (template[nodes]@region ×count)"), optional=True)
    for col in ("$/h", "served", "demand tok/s", "capacity tok/s", "spare"):
        table.add_column(col, justify="right", optional=col != "$/h")
    for s in plan.serving:
        text = "\n".join(escape(f"{k} ×{n}") for k, n in instance_groups(plan, s.model, s.phase).items()) or "-"
        spare = (s.capacity - s.demand) / s.demand if s.demand else 0.0
        table.add_row(plain(s.model), s.phase, text, f"{s.cost_per_hour:,.2f}", f"{s.served_fraction:.1%}",
                      f"{s.demand:,.0f}", f"{s.capacity:,.0f}", f"{spare:+.1%}")
    return table


def served_in_words(plan: Plan) -> str:
    """How much of the demand a plan serves, in plain words: per model the share of its requests both its
    phases can take (the least served of the two), and the generated tokens/s that makes."""
    share = plan.model_shares()
    asked = sum(s.demand for s in plan.serving if s.phase == "decode")
    if all(v >= 1 - 1e-9 for v in share.values()):
        return f"all demand ({asked:,.0f} generated tok/s planned) at ${plan.cost_per_hour:,.2f}/h"
    got = sum(s.demand * share[s.model] for s in plan.serving if s.phase == "decode")
    short = sorted((m for m, v in share.items() if v < 1 - 1e-9), key=lambda m: share[m])
    return (f"{got / asked:.1%} of the generated tokens/s planned ({got:,.0f} of {asked:,.0f}) at "
            f"${plan.cost_per_hour:,.2f}/h; share of its requests each model can take (the lesser of its phases): "
            + ", ".join(f"{m} {share[m]:.0%}" for m in short) + f"; the others all; least {share[short[0]]:.1%}")


@friendly_errors
def allocate_cmd(
    scenario: str = typer.Argument("core", help="built-in scenario name or scenario YAML"),
    mode: str = typer.Option("cost", help="cost | goodput | maxmin | scaled"),
    method: str = typer.Option("coral", help="coral | homo-greedy | homo-ilp | cauchy-paper"),
    availability_factor: float | None = typer.Option(None, help="headroom factor overriding the scenario's"),
    running: Path | None = typer.Option(None, help="previous plan JSON (scale-up penalty against it)"),
    time_limit: float = typer.Option(30.0, help="wall-clock safety net for the whole call, s (solves stop on "
                                     "work limits; a plan it stopped says so)"),
    gap: float = typer.Option(1e-4, help="relative MIP gap"),
    fairness: float = typer.Option(0.5, help="goodput mode: every model keeps at least this share of the uniform "
                                   "max-min served fraction (0: pure SLO goodput)"),
    out: Path = typer.Option(DEFAULT_OUT, help="folder with the library; the plan is written here"),
    engine: str = typer.Option("coral", help=ENGINE_HELP),
    offerings: Path | None = typer.Option(None, help=OFFERINGS_HELP),
    target: str | None = typer.Option(None, help=TARGET_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Plan instances per (template, region) for the scenario's demand."""
    from coral.allocation import baselines
    from coral.allocation.allocator import MODES, allocate, resolve_availability
    from coral.allocation.plan import Plan
    from coral.report.terminal import solve_line, solver_in_words
    from coral.templates.engines import engine_library
    from coral.templates.store import load_library

    if mode not in MODES:
        raise CoralInputError(f"--mode: must be one of {', '.join(MODES)}, not {mode!r}")
    check_out_folder(out)
    t0 = time.perf_counter()
    sc, cat = scenario_and_market(scenario, offerings)
    engine = "vllm" if target else engine  # every deploy target launches stock vLLM
    lib = engine_library(load_library(scenario, out, cat), engine, cat, target)
    t_lib = time.perf_counter()
    avail = resolve_availability(sc, lib, cat, factor=availability_factor)
    t_avail = time.perf_counter()
    if method == "coral":
        prev = Plan.load(running) if running else None
        plan = allocate(lib, sc, availability=avail, running=prev, mode=mode,  # type: ignore[arg-type]
                        catalog=cat, time_limit=time_limit, gap=gap, fairness=fairness)
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
    plan.target = target  # type: ignore[assignment]  # checked by engine_library
    say = out_console(as_json)
    if not as_json:
        say.print(plan_table(plan))
    s = plan.solve
    say.print(f"{solve_line(s)}; scale-up penalty ${plan.penalty_per_hour:,.2f}/h")
    say.print(f"in words: {solver_in_words(s, plan.mode)}")
    say.print(f"served: {served_in_words(plan)}")
    path = plan.save(out / allocate_file_name(scenario, mode, method, engine, target, offerings))
    total = time.perf_counter() - t0
    times = {"total": total, "scenario_and_library": t_lib - t0, "availability": t_avail - t_lib,
             "planning": total - (t_avail - t0), "solver": s.time_s}
    say.print(f"time: {total:.2f} s end to end (scenario and library load {t_lib - t0:.2f} s, availability "
              f"{t_avail - t_lib:.2f} s, planning {times['planning']:.2f} s of which solver {s.time_s:.2f} s)")
    for note in s.notes:
        say.print(f"  [dim]{plain(note)}[/]")
    say.print(f"-> [bold]{path}[/]")
    if as_json:
        print_json(plan_summary(plan, path, times))


def allocate_file_name(scenario: str, mode: str, method: str, engine: str, target: str | None,
                       offerings: Path | None) -> str:
    """The name `coral allocate` gives its plan: `plan_file_name`'s, tagged `.offerings-<file stem>` before
    `.plan.json` when --offerings replaced the market, so that such a plan never overwrites the default one."""
    name = plan_file_name(scenario, mode, method, engine, target)
    if offerings is None:
        return name
    return f"{name.removesuffix('.plan.json')}.offerings-{offerings.stem}.plan.json"


def plan_summary(plan: Plan, path: Path, times: dict[str, float]) -> dict[str, Any]:
    """What `coral allocate --json` prints: the plan's cost, mode, method, each (model, phase)'s demand, capacity
    and share served, the solver's figures, the times (s) and where the plan was written."""
    s = plan.solve
    return {
        "scenario": plan.scenario,
        "mode": plan.mode,
        "method": plan.method,
        "engine": plan.engine,
        "target": plan.target,
        "cost_per_hour": round(plan.cost_per_hour, 4),
        "penalty_per_hour": round(plan.penalty_per_hour, 4),
        "serving": [{"model": v.model, "phase": v.phase, "demand_tokens_s": round(v.demand, 3),
                     "capacity_tokens_s": round(v.capacity, 3), "served_fraction": round(v.served_fraction, 6),
                     "cost_per_hour": round(v.cost_per_hour, 4),
                     "instances": instance_groups(plan, v.model, v.phase)} for v in plan.serving],
        "solve": {"status": s.status, "objective": s.objective, "bound": s.bound,
                  "gap": 0.0 if s.gap is not None and abs(s.gap) < 1e-9 else s.gap, "time_s": s.time_s,
                  "variables": s.n_variables, "constraints": s.n_constraints},
        "time_s": {k: round(v, 3) for k, v in times.items()},
        "plan_path": str(path),
    }


@friendly_errors
def experiment_cmd(
    name: str = typer.Argument(..., help="default | scarce | below | imbalanced | epochs | waterfall"),
    target: str | None = typer.Argument(None, help="scenario of epochs (default extended) or waterfall (core); "
                                        "scarce and imbalanced: one of core and extended (default both)"),
    out: Path = typer.Option(DEFAULT_OUT, help="output folder (libraries cached here; results in experiments/)"),
    time_limit: float = typer.Option(30.0, help="solver time limit per solve, s"),
    scenario: str | None = typer.Option(None, help="same as the second argument"),
    offerings: Path | None = typer.Option(None, help=OFFERINGS_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Run an allocation experiment: print a table, write JSON and a PNG plot."""
    from coral.experiments.allocation import EXPERIMENTS, run_experiment, takes

    chosen = target or scenario
    if chosen and name in EXPERIMENTS and not takes(name, "scenario"):
        raise CoralInputError(f"experiment {name!r} takes no scenario (epochs, waterfall, scarce and imbalanced do)")
    check_out_folder(out)
    t0 = time.perf_counter()
    options: dict[str, Any] = {"scenario": chosen} if chosen else {}
    err = Console(stderr=True)
    result = run_experiment(name, out, time_limit, offerings=offerings,
                            progress=lambda line: err.print(f"[dim]{line}[/]", highlight=False, soft_wrap=True),
                            **options)
    if as_json:
        print_json(experiment_summary(result))
        return
    console.print(experiment_table(result))
    for note in result.notes:
        console.print(f"[dim]{plain(note)}[/]")
    console.print(f"time: {time.perf_counter() - t0:.1f} s end to end (libraries, every solve, JSON and plot)")
    console.print("-> " + ", ".join(f"[bold]{p}[/]" for p in result.files))


#: experiment columns that hold names (never folded) and those left out first in a narrow terminal
NAME_FIELDS = ("setting", "method", "step")
DETAIL_FIELDS = ("nodes", "heterogeneous", "demand_scale", "solve_s", "wall_s", "gap", "status", "penalty_per_hour",
                 "started", "stopped")


def experiment_table(result: ExperimentResult) -> FoldingTable:
    """The experiment's rows with readable headers and rounded numbers."""
    from coral.report.terminal import FoldingTable, cell, header

    table = FoldingTable(title=result.title)
    for col in result.columns:
        table.add_column(header(col), justify="left" if col in (*NAME_FIELDS, "status", "change") else "right",
                         no_wrap=col in NAME_FIELDS, optional=col in DETAIL_FIELDS)
    for row in result.rows:
        table.add_row(*[cell(c, row.get(c)) for c in result.columns])
    return table


def experiment_summary(result: ExperimentResult) -> dict[str, Any]:
    """What `coral experiment --json` prints: the result's name, title, columns, rows, notes and files."""
    return {"name": result.name, "title": result.title, "columns": result.columns, "rows": result.rows,
            "notes": result.notes, "files": [str(f) for f in result.files]}
