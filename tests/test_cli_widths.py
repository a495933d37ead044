"""Tables in narrow terminals and in pipes: words and names never broken (optional columns left out and named
instead), money to the cent, and the benchmarks' tables as wide as the CLI's when piped."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

from coral.cli.allocate import instance_groups, plan_table
from coral.cli.common import PIPE_WIDTH
from coral.report.examples import example_plan
from coral.report.terminal import FoldingTable, cell, money

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
INSTANCES = "instances (template[nodes]@region ×count)"


def rendered(table: Table, width: int) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text()


def left_out(text: str) -> str:
    """The note naming the columns left out, on one line ('' when none is)."""
    joined = " ".join(text.split())
    start = joined.find("(left out for the terminal's width: ")
    return "" if start < 0 else joined[start:]


@pytest.mark.parametrize("width", [160, 100, 80, 60])
def test_allocate_never_breaks_a_template_string(width: int) -> None:
    plan = example_plan()
    names = [k for s in plan.serving for k in instance_groups(plan, s.model, s.phase)]
    assert any("+" in n for n in names) and max(len(n) for n in names) > 35  # multi-stage, two regions
    text = rendered(plan_table(plan), width)
    assert max(len(line) for line in text.splitlines()) <= width
    lines = text.splitlines()
    if INSTANCES in left_out(text):
        assert not any(n.split("[")[0] + "[" in line for n in names for line in lines)
    else:
        assert all(any(n in line for line in lines) for n in names), text
    if width >= 80:  # the column every plan is read for stays; details go first
        assert INSTANCES not in left_out(text)
    if width == 80:
        assert "spare" in left_out(text) and "demand tok/s" in left_out(text)


def test_folding_table_puts_back_what_fits_and_keeps_words_whole() -> None:
    """A wide optional column that cannot fit is left out and a later narrow one put back; where every word fits,
    a column is never given less than its longest word (rich's own sharing would break '$10.05' here)."""
    def table(kind: type[Table]) -> Table:
        t = kind(title="t", show_footer=True)
        t.add_column("region", no_wrap=True, footer="total")
        t.add_column("instance type", no_wrap=True)
        t.add_column("GPU × per node")
        t.add_column("count", justify="right", footer="11")
        t.add_column("$/h each", justify="right")
        t.add_column("$/h total", justify="right", footer="$10.05")
        if isinstance(t, FoldingTable):
            t.add_column("plan instances", optional=True)
            t.add_column("ok", optional=True)
        t.add_row("aws-ap-northeast-2", "g6e.xlarge", "L40S × 1", "1", "$2.00", "$2.00",
                  *(["qwen3-32b.decode.t77.aws-ap-northeast-2.0", "y"] if isinstance(t, FoldingTable) else []))
        return t

    assert "$10.05" not in rendered(table(Table), 72)  # rich alone gives that column less than the word
    text = rendered(table(FoldingTable), 72)
    assert "$10.05" in text and "aws-ap-northeast-2" in text and max(len(x) for x in text.splitlines()) <= 72
    assert "plan instances, ok;" in left_out(text)
    text = rendered(table(FoldingTable), 78)
    assert "plan instances;" in left_out(text) and "┃ ok ┃" in text and "$10.05" in text


def test_money_is_to_the_cent() -> None:
    assert money(0.8048) == "$0.80" and money(1234.5) == "$1,234.50"
    assert cell("cost_per_hour", 0.8048) == "0.80" and cell("penalty_per_hour", 3.0) == "3.00"
    assert cell("cost_per_hour", 57.6234) == "57.62" and cell("solve_s", 0.8048) == "0.805"


def test_benchmark_tables_are_160_columns_when_piped() -> None:
    """The shared console of benchmarks/ (benchmarks/_console.py) follows coral.cli.common: PIPE_WIDTH columns in
    a pipe, COLUMNS when set; a benchmark's table printed through it keeps long cells on one line."""
    code = ("import allocator, _console\n"
            "c = _console.table_console()\n"
            "print(c.width)\n"
            "allocator.print_table('t', [{'case': 'a-case-name-' * 6, 'coral_cost': 1.5, 'variant': 'v' * 40}], c)\n")
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    run = subprocess.run([sys.executable, "-c", code], cwd=BENCHMARKS, env=env, capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, check=True)
    width, *table = run.stdout.splitlines()
    assert int(width) == PIPE_WIDTH == 160
    assert any("a-case-name-" * 6 in line and "v" * 40 in line for line in table), run.stdout
    assert max(len(line) for line in table) > 120
    narrow = subprocess.run([sys.executable, "-c", code], cwd=BENCHMARKS, env={**env, "COLUMNS": "100"},
                            capture_output=True, text=True, stdin=subprocess.DEVNULL, check=True)
    assert narrow.stdout.splitlines()[0] == "100"
