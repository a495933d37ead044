"""`coral report`: a self-contained HTML report of a plan, its baselines and its simulation, plus terminal tables."""

from __future__ import annotations

from pathlib import Path

import typer

from coral.catalog.loader import scenario_and_market
from coral.cli.common import (
    DEFAULT_OUT,
    check_out_file,
    console,
    for_terminal,
    friendly_errors,
    plain,
    plan_or_current,
)


@friendly_errors
def report(
    plan: Path | None = typer.Option(None, "--plan", help="Plan JSON (from `coral allocate` or `coral run`; "
                                     "default: --scenario's current plan, the one `coral run` chose)."),
    scenario: str | None = typer.Option(None, "--scenario", help="built-in scenario name or scenario YAML: whose "
                                        "current plan to report without --plan (default core), and the market and "
                                        "demand to show the plan in (default: the plan's own built-in scenario)"),
    baseline: list[Path] = typer.Option(
        [], "--baseline", help="Baseline Plan JSON (homo, cauchy, ...); repeatable."
    ),
    sim: Path | None = typer.Option(
        None, "--sim", help="SimResult JSON from `coral simulate`, or ReportInputs JSON/YAML."
    ),
    experiment: list[Path] = typer.Option(
        [], "--experiment", help="Experiment JSON/YAML with per-epoch cost/goodput/churn; repeatable."
    ),
    out: Path = typer.Option(
        DEFAULT_OUT / "report.html", "--out", "-o", help="Where to write the HTML report."
    ),
    screenshot: Path | None = typer.Option(
        None, "--screenshot", help="Also save a PNG of the rendered page (needs Debian's chromium)."
    ),
    example: bool = typer.Option(False, "--example", help="Report on the built-in example plan instead."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only print where the report went."),
) -> None:
    """Write a self-contained HTML report (open it in any browser, no network needed) and print the plan."""
    from coral.allocation.plan import Plan
    from coral.http_serving import with_policy_meta
    from coral.report.adapters import load_inputs
    from coral.report.browser import run_chromium
    from coral.report.html import build_report
    from coral.report.inputs import ReportInputs
    from coral.report.terminal import print_comparison, print_inputs, print_plan
    from coral.report.view import mismatch_notes

    check_out_file(out)
    if example:
        from coral.report.examples import example_baseline, example_inputs, example_plan

        the_plan, baselines, inputs = example_plan(), [example_baseline()], example_inputs()
    else:
        the_plan = Plan.load(plan_or_current(plan, scenario or "core"))
        baselines = [Plan.load(p) for p in baseline]
        inputs = load_inputs(sim) if sim else ReportInputs()
        for path in experiment:
            inputs = inputs.merged(load_inputs(path))
    for note in mismatch_notes(the_plan, inputs):
        console.print(f"[yellow]warning:[/] {plain(note)}")
    if not quiet:
        shown_plan = for_terminal(the_plan)  # the plan's text as text, never markup or terminal control codes
        print_plan(shown_plan, console)
        if baselines:
            print_comparison(shown_plan, [for_terminal(b) for b in baselines], console)
        print_inputs(inputs, shown_plan.method, console)
    sc, cat = (None, None) if example or scenario is None else scenario_and_market(scenario, None)
    if sc is not None and the_plan.scenario != sc.name:
        console.print(f"[yellow]warning:[/] the plan was made for {plain(the_plan.scenario)}, shown in "
                      f"{plain(sc.name)}'s market and demand (--scenario)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(with_policy_meta(build_report(the_plan, baselines=baselines, sim=inputs, catalog=cat, scenario=sc)))
    console.print(f"[green]wrote[/] {out}")
    if screenshot is not None:
        run_chromium(out.resolve().as_uri(), screenshot=screenshot)
        console.print(f"[green]wrote[/] {screenshot}")


def register(app: typer.Typer) -> None:
    """Add `coral report` to the root app."""
    app.command("report")(report)
