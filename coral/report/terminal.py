"""Rich terminal output shared by the CLI modules: plan tables, comparisons, experiment series, progress bars."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from rich._ratio import ratio_distribute
from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Column, Table
from rich.text import Text

from coral.allocation.plan import Plan, PlanInstance, SolveReport
from coral.report.inputs import ReportInputs
from coral.report.view import comparison, instance_groups, latency_charts, solver_in_words


class FoldingTable(Table):
    """A rich Table for narrow terminals: columns added with `optional=True` are left out, last first, while the
    table cannot fit the width without breaking a word, then those that fit again are put back, first first (a dim
    line under the table names the ones left out); the remaining cells fold onto more lines instead of being cut
    with '…'. Pass `no_wrap=True` for name columns: rich narrows them last."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._optional: list[Column] = []

    def add_column(self, *args: Any, optional: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("overflow", "fold")
        super().add_column(*args, **kwargs)
        if optional:
            self._optional.append(self.columns[-1])

    def _calculate_column_widths(self, console: Console, options: ConsoleOptions) -> list[int]:
        """rich's widths, unless they give a column less than its longest word where the words of every column
        fit: then each column its longest word (a no_wrap one its whole text) and the room left shared in
        proportion to what each lacks of its widest line."""
        widths = super()._calculate_column_widths(console, options)
        ranges = [self._measure_column(console, options, c) for c in self.columns]
        if all(w >= r.minimum for w, r in zip(widths, ranges, strict=True)):
            return widths
        lows = [r.maximum if c.no_wrap else r.minimum for r, c in zip(ranges, self.columns, strict=True)]
        room = options.max_width - sum(lows)
        wants = [r.maximum - low for r, low in zip(ranges, lows, strict=True)]
        if room < 0 or not any(wants):
            return widths
        return [low + extra for low, extra in zip(lows, ratio_distribute(room, wants), strict=True)]

    def _breaks_words(self, console: Console, options: ConsoleOptions) -> bool:
        """Whether rich would give some column less than its longest word at this width."""
        inner = options.update_width(options.max_width - self._extra_width)
        widths = self._calculate_column_widths(console, inner)
        return any(w < self._measure_column(console, inner, c).minimum
                   for w, c in zip(widths, self.columns, strict=True))

    def _fitting_columns(self, console: Console, options: ConsoleOptions) -> set[int]:
        """Sets self.columns to the columns to show at this width; returns their ids."""
        every = self.columns
        shown = {id(c) for c in every}
        for col in reversed(self._optional):
            if not self._breaks_words(console, options):
                break
            shown.discard(id(col))
            self.columns = [c for c in every if id(c) in shown]
        for col in self._optional:
            if id(col) in shown:
                continue
            self.columns = [c for c in every if id(c) in shown or c is col]
            if self._breaks_words(console, options):
                self.columns = [c for c in every if id(c) in shown]
            else:
                shown.add(id(col))
        return shown

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        every = self.columns
        try:
            shown = self._fitting_columns(console, options)
            yield from super().__rich_console__(console, options)
        finally:
            self.columns = every
        left_out = [_plain(c.header) for c in every if id(c) not in shown]
        if left_out:
            yield Text(f"(left out for the terminal's width: {', '.join(left_out)}; widen it or set COLUMNS)",
                       style="dim")


def _plain(header: RenderableType) -> str:
    """A column header as the text it shows (a str header is rich markup)."""
    if isinstance(header, str):
        return Text.from_markup(header).plain
    return header.plain if isinstance(header, Text) else str(header)


#: table headers for the field names of results (experiment rows, JSON keys) that are not words
HEADERS = {
    "cost_per_hour": "$/h",
    "penalty_per_hour": "penalty $/h",
    "ratio": "× Coral",
    "demand_met": "demand met",
    "heterogeneous": "mixed GPUs",
    "min_served": "least served",
    "demand_scale": "demand ×",
    "demand_x": "demand ×",
    "avail_factor": "avail. ×",
    "solve_s": "solve s",
    "wall_s": "wall s",
    "all_met": "all met",
    "sim_goodput": "SLO goodput tok/s",
    "goodput_share": "goodput share",
    "goodput_x": "Coral goodput ×",
    "attainment": "SLO attainment",
    "least_attainment": "least attainment",
}

#: result fields that are shares of 1, shown in percent
SHARE_FIELDS = frozenset({"min_served", "served", "goodput_share", "attainment", "least_attainment"})
#: result fields that are dollars (per hour), shown to the cent
MONEY_FIELDS = frozenset({"cost_per_hour", "penalty_per_hour"})


def header(field: str) -> str:
    """A readable column header for a result field name: 'cost_per_hour' -> '$/h', 'solve_s' -> 'solve s'."""
    return HEADERS.get(field, field.replace("_", " "))


def human(value: object) -> str:
    """A table cell for people: '-' for None, yes/no, integers with thousands separators, and floats rounded:
    below 1e-9 in size 0 (solver noise), below 1 three significant digits, else two decimals (none when whole)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if abs(value) < 1e-9:
            return "0"
        if abs(value) < 1:
            return f"{value:.3g}"
        return f"{value:,.2f}".removesuffix(".00")
    return str(value)


def cell(field: str, value: object) -> str:
    """A table cell of a result field: shares (SHARE_FIELDS) in percent, dollars (MONEY_FIELDS) to the cent,
    anything else by `human`."""
    if field in SHARE_FIELDS and isinstance(value, float):
        return f"{value:.1%}"
    if field in MONEY_FIELDS and isinstance(value, int | float) and not isinstance(value, bool):
        return f"{value:,.2f}"
    return human(value)


def gap_text(gap: float | None) -> str:
    """A relative MIP gap for people, in percent: '-' when unknown, '0 %' below 1e-9 (rounding noise)."""
    if gap is None:
        return "-"
    if abs(gap) < 1e-9:
        return "0 %"
    return "< 0.01 %" if abs(gap) < 1e-4 else f"{gap * 100:.2g} %"


def solve_line(sv: SolveReport) -> str:
    """The solver's figures on one line, rounded for people: status, objective and bound to the cent, gap."""
    cents = "-" if sv.objective is None else f"{sv.objective:,.2f}"
    bound = "-" if sv.bound is None else f"{sv.bound:,.2f}"
    return (f"solver: {sv.status}, objective {cents}, bound {bound}, gap {gap_text(sv.gap)}, {sv.time_s:.2f} s, "
            f"{sv.n_variables:,} variables, {sv.n_constraints:,} constraints")


def layout_text(inst: PlanInstance) -> str:
    """'[1xL40S] L0-19 → [4xL4] L20-43 → [2×1xA10G] L44-63': stages left to right, nodes per stage."""
    parts = []
    for st in inst.stages:
        nodes = ", ".join(f"{n}×{c}" if n > 1 else c for c, n in sorted(Counter(st.nodes).items()))
        parts.append(f"[{nodes}] L{st.first_layer}-{st.first_layer + st.layers - 1}")
    return " → ".join(parts)


def money(dollars: float) -> str:
    """Dollars for people, to the cent: '$0.80', '$1,234.50'."""
    return f"${dollars:,.2f}"


def _money(v: float) -> str:
    return f"{money(v)}/h"


def plan_tables(plan: Plan) -> list[Table]:
    """The serving (demand/capacity/cost per model and phase) and instance tables of a plan."""
    serving = FoldingTable(
        title=f"Plan {plan.scenario} · {plan.method} · {plan.mode} · {_money(plan.cost_per_hour)}"
    )
    serving.add_column("model", no_wrap=True)
    serving.add_column("phase")
    for col in ("demand tok/s", "capacity tok/s", "served", "instances", "cost"):
        serving.add_column(col, justify="right")
    for s in sorted(plan.serving, key=lambda s: (s.model, s.phase)):
        short = s.served_fraction < 0.999
        serving.add_row(
            s.model,
            s.phase,
            f"{s.demand:,.0f}",
            f"{s.capacity:,.0f}",
            f"[red]{s.served_fraction:.1%}[/]" if short else f"{s.served_fraction:.1%}",
            str(len(plan.instances_of(s.model, s.phase))),
            _money(s.cost_per_hour),
        )
    serving.add_section()
    serving.add_row(
        "total", "", "", "", "", str(len(plan.instances)), _money(plan.cost_per_hour), style="bold"
    )

    instances = FoldingTable(title="Instances (identical ones grouped)")
    instances.add_column("instance")
    instances.add_column("layout (stage → stage)", ratio=1)
    instances.add_column("tok/s each", justify="right")
    instances.add_column("$/h each", justify="right")
    by_id = {i.id: i for i in plan.instances}
    for g in instance_groups(plan):
        instances.add_row(
            f"{g['model']} {g['phase']}\n[dim]×{g['count']} · t{g['template_id']} · {g['region']}[/]",
            layout_text(by_id[g["ids"][0]]),
            f"{g['throughput']:,.0f}",
            _money(g["cost_per_hour"]),
        )
    return [serving, instances]


def print_plan(plan: Plan, console: Console | None = None) -> None:
    """Print a plan's serving and instance tables (and solver status) to the terminal."""
    console = console or Console()
    for table in plan_tables(plan):
        console.print(table)
    sv = plan.solve
    console.print(f"solver: {solver_in_words(sv, plan.mode)}")
    if plan.penalty_per_hour:
        console.print(f"scale-up penalty against the running plan: {_money(plan.penalty_per_hour)}")
    for note in sv.notes:
        console.print(f"[dim]solver detail: {note}[/]")


def print_comparison(plan: Plan, baselines: Sequence[Plan], console: Console | None = None) -> None:
    """Cost per model and total per method, with the ratio baseline / plan."""
    console = console or Console()
    cmp = comparison(plan, baselines)
    table = FoldingTable(title="Comparison with baselines (costs in $/h)")
    table.add_column("method", no_wrap=True)
    for col in [*cmp["models"], "served", "total", f"vs {plan.method}"]:
        table.add_column(col, justify="right")
    for r in cmp["rows"]:
        ratio = "–" if r["ratio"] is None else f"{r['ratio']:.2f}×"
        table.add_row(
            r["method"],
            *(f"{r['by_model'][m]:,.2f}" for m in cmp["models"]),
            f"{r['min_served_fraction']:.1%}",
            f"{r['cost_per_hour']:,.2f}",
            ratio,
        )
    console.print(table)


def print_inputs(inputs: ReportInputs, default_method: str = "", console: Console | None = None) -> None:
    """Per-epoch series and latency-vs-SLO tables of an experiment or simulation."""
    console = console or Console()
    if inputs.epochs:
        table = FoldingTable(title="Per epoch")
        table.add_column("method", no_wrap=True)
        for col in ("epoch", "cost", "goodput tok/s", "churn"):
            table.add_column(col, justify="right")
        for p in sorted(inputs.epochs, key=lambda p: (p.method or default_method, p.epoch)):
            table.add_row(
                p.method or default_method,
                str(p.epoch),
                _money(p.cost_per_hour),
                f"{p.goodput:,.0f}",
                f"{p.churn:g}",
            )
        console.print(table)
    charts = latency_charts(inputs.latency)
    if charts:
        table = FoldingTable(title="Latency against SLOs (ms)")
        table.add_column("model", no_wrap=True)
        table.add_column("metric")
        for col in ("n", "p50", "p90", "p99", "SLO", "within SLO"):
            table.add_column(col, justify="right")
        for c in charts:
            att = c["attainment"]
            table.add_row(
                c["model"],
                c["metric"].upper(),
                str(c["n"]),
                *(f"{c[q]:,.1f}" for q in ("p50", "p90", "p99")),
                "–" if c["slo_ms"] is None else f"{c['slo_ms']:,.0f}",
                "–" if att is None else (f"[red]{att:.1%}[/]" if att < c.get("target", 0.9) else f"{att:.1%}"),
            )
        console.print(table)


def progress(console: Console | None = None, transient: bool = False) -> Progress:
    """The project's progress bar (description, bar, done/total, elapsed) for builds, simulations and sweeps:

    with progress() as bar:
        task = bar.add_task("templates", total=n)
        ...; bar.advance(task)
    """
    return Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=transient,
    )
