"""The rich Console of the benchmarks' tables: the rule of coral's CLI (coral.cli.common), so that a table piped to
a file or `tee` is not cut to 80 columns.

Imported by the scripts beside it as `from _console import table_console` (a script's folder is on sys.path)."""

from __future__ import annotations

from rich.console import Console

from coral.cli.common import PIPE_WIDTH, console_width


def table_console(stderr: bool = False, pipe_width: int = PIPE_WIDTH) -> Console:
    """A Console as wide as the terminal (or COLUMNS) when there is one, else `pipe_width` columns."""
    return Console(stderr=stderr, width=None if console_width() is None else pipe_width)
