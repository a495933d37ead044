"""`coral plan bom`: what to rent for a plan (cloud, region, instance type, count, $/h)."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from coral.cli.common import check_out_file, console, err_console, friendly_errors, plain, plan_or_current

if TYPE_CHECKING:
    from coral.deploy.bom import BillOfMaterials
    from coral.report.terminal import FoldingTable

plan_app = typer.Typer(help="Look into a plan: what to rent for it.", no_args_is_help=True)


class BomFormat(StrEnum):
    table = "table"
    csv = "csv"
    json = "json"


def register(app: typer.Typer) -> None:
    """Add `coral plan ...` to the root app."""
    app.add_typer(plan_app, name="plan")


def bom_table(bom: BillOfMaterials) -> FoldingTable:
    """The bill as a rich table with the total in its footer (the plan's names shown as text, never as markup or
    terminal control codes: `plain`); prices to the cent. A narrow terminal leaves out the plan instances each row
    serves, then the cloud (regions name it)."""
    from coral.report.terminal import FoldingTable, money

    table = FoldingTable(title=plain(f"What to rent: {bom.scenario} · {bom.method} (prices: {bom.offerings})"),
                         show_footer=True)
    for col, footer in (("cloud", ""), ("region", "total"), ("instance type", ""), ("GPU × per node", "")):
        table.add_column(col, footer=footer, no_wrap=col != "GPU × per node", optional=col == "cloud")
    table.add_column("count", justify="right", footer=str(sum(r.count for r in bom.rows)))
    table.add_column("$/h each", justify="right")
    table.add_column("$/h total", justify="right", footer=money(bom.total_per_hour))
    table.add_column("plan instances", optional=True)
    verdict = "equals" if bom.matches_plan else "differs from"
    table.caption = f"the total {verdict} the plan's {money(bom.plan_cost_per_hour)}/h"
    for r in bom.rows:
        table.add_row(*(plain(v) for v in (r.cloud, r.region, r.instance_type)),
                      f"{plain(r.gpu)} × {r.gpus_per_node}", str(r.count), money(r.price_per_hour),
                      money(r.total_per_hour), plain(", ".join(r.instances)))
    return table


@plan_app.command("bom")
@friendly_errors
def bom_cmd(
    plan: Path | None = typer.Argument(
        None, help="plan JSON (from `coral allocate` or `coral run`; default: --scenario's current plan, the one "
        "`coral run` chose last)"),
    offerings: Path | None = typer.Option(
        None, "--offerings", help="offerings file to price at (default: --scenario's, else the plan's scenario's when "
        "it is a built-in one, else the shipped one)"
    ),
    scenario: str | None = typer.Option(
        None, "--scenario", help="built-in scenario name or scenario file whose offerings to price at (a plan's own "
        "scenario is looked up among the built-in ones only), and whose current plan to take without PLAN "
        "(default: core)"),
    fmt: BomFormat = typer.Option(BomFormat.table, "--format", help="table | csv | json"),
    out: Path | None = typer.Option(None, "--out", "-o", help="write the bill here instead of printing it"),
) -> None:
    """Bill of materials: the cloud instances a plan rents, with counts, $/h each and in total."""
    from rich.console import Console

    from coral.allocation.plan import Plan
    from coral.deploy.bom import bill_of_materials, plan_market
    from coral.report.terminal import money

    if out is not None:
        check_out_file(out)
    the_plan = Plan.load(plan_or_current(plan, scenario or "core", flag="PLAN"))
    catalog, source = plan_market(the_plan, offerings, scenario)
    bom = bill_of_materials(the_plan, catalog, source)
    if fmt is BomFormat.table:
        if out is None:
            console.print(bom_table(bom))
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            with out.open("w") as fh:
                Console(file=fh, width=160).print(bom_table(bom))
    else:
        text = bom.to_csv() if fmt is BomFormat.csv else bom.model_dump_json(indent=2) + "\n"
        if out is None:
            typer.echo(text, nl=False)
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
    if out is not None:
        console.print(f"[green]wrote[/] {plain(out)}: {sum(r.count for r in bom.rows)} instance(s), "
                      f"{money(bom.total_per_hour)}/h")
    for note in bom.notes:
        err_console.print(f"[yellow]warning:[/] {plain(note)}")
