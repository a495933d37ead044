"""Helpers shared by the CLI modules: consoles, JSON output, error reporting, default paths.

Command modules import only this, typer and rich at module level; every stage package (numpy, the allocator,
the simulator, the runtime) is imported inside the command that needs it, so that `coral --help` is quick."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape

from coral.catalog.loader import CoralInputError
from coral.catalog.schema import shown

#: columns of output that goes to no terminal (a pipe, a file, a test) when COLUMNS is unset: wide enough that
#: tables keep model and instance names on one line
PIPE_WIDTH = 160


def console_width() -> int | None:
    """None (rich's own choice: COLUMNS, else the terminal's width) when either is there, else PIPE_WIDTH."""
    if os.environ.get("COLUMNS"):
        return None
    for fd in (0, 1, 2):
        try:
            os.get_terminal_size(fd)
        except OSError:
            continue
        return None
    return PIPE_WIDTH


console = Console(width=console_width())
err_console = Console(stderr=True, width=console_width())

F = TypeVar("F", bound=Callable[..., Any])
M = TypeVar("M", bound=BaseModel)

DEFAULT_OUT = Path("out")


def plain(value: object, keep: str = "") -> str:
    """`value` as text to print through rich: its control characters (terminal escapes among them) but those in
    `keep` escaped (`shown`), and its markup escaped, so a plan's or an input's text reaches the terminal as text."""
    return escape(shown(str(value), keep))


def for_terminal(document: M) -> M:
    """A copy of `document` (a plan) for printing only, each of its strings and keys as `plain` makes it."""
    return type(document).model_validate(_plain_strings(document.model_dump()))


def _plain_strings(value: Any) -> Any:
    if isinstance(value, str):
        return plain(value)
    if isinstance(value, dict):
        return {_plain_strings(k): _plain_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_strings(v) for v in value]
    return value


def friendly_errors(fn: F) -> F:
    """Turn CoralInputError into a one-line red message and exit code 2 (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CoralInputError as exc:
            err_console.print(f"[bold red]error:[/] {plain(exc, keep=chr(10))}")
            raise typer.Exit(code=2) from None

    return wrapper  # type: ignore[return-value]


ENGINE_HELP = "engine the plan must run on: coral (every template) | vllm (only what stock vLLM launches)"
OFFERINGS_HELP = ("offerings file (the schema of coral/data/offerings.yaml) replacing the market: prices, instance "
                  "types, regions (default: the scenario's `offerings` file, else the shipped one)")


def out_console(as_json: bool) -> Console:
    """Where a command's human output goes: stderr when its result goes to stdout as JSON (`--json`)."""
    return err_console if as_json else console


def print_json(document: Any) -> None:
    """Write `document` to stdout as one strict JSON document: no markup; paths as strings, numpy numbers as
    numbers, infinite or NaN numbers as null."""
    sys.stdout.write(json.dumps(_plain(document), indent=2, allow_nan=False) + "\n")
    sys.stdout.flush()


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):  # numpy scalar
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


JSON_HELP = "print the result as one JSON document on stdout (progress and notes go to stderr)"


def check_out_folder(path: Path, flag: str = "--out") -> None:
    """CoralInputError naming `flag` unless `path` is a folder or can be made one: neither it nor a folder above
    it is a file. Checked before any work, so a bad output path fails at once."""
    for p in (path, *path.parents):
        if p.exists():
            if p.is_dir():
                return
            raise CoralInputError(f"{flag}: {path} is a file, not a folder" if p == path
                                  else f"{flag}: cannot make folder {path}: {p} is a file")


def check_out_file(path: Path, flag: str = "--out") -> None:
    """CoralInputError naming `flag` unless `path` can be written as a file (not a folder; its folder can be made)."""
    if path.is_dir():
        raise CoralInputError(f"{flag}: {path} is a folder, not a file")
    check_out_folder(path.parent, flag)


def library_path(scenario: str, out: Path = DEFAULT_OUT) -> Path:
    return out / f"{Path(scenario).stem}.templates.sqlite"


def current_plan_path(scenario: str, out: Path = DEFAULT_OUT) -> Path:
    """The scenario's current plan: the one `coral run` chose last (the plan to rent), which `serve`, `deploy`,
    `plan bom` and `report` take when no plan is given."""
    return out / f"{Path(scenario).stem}.current.plan.json"


def plan_or_current(plan: Path | None, scenario: str, flag: str = "--plan", out: Path = DEFAULT_OUT) -> Path:
    """`plan` when given, else the scenario's current plan, saying on stderr which file is used; CoralInputError
    naming `flag` and what to run when there is none."""
    if plan is not None:
        return plan
    path = current_plan_path(scenario, out)
    if not path.is_file():
        give = f"{flag} PLAN.json" if flag.startswith("-") else f"a plan file as {flag}"
        raise CoralInputError(f"{flag}: not given, and {scenario} has no current plan ({path}, written by "
                              f"`coral run {scenario}`): run it, or give {give}")
    err_console.print(f"plan: {escape(str(path))} (the current plan of {escape(scenario)}, chosen by the last "
                      f"`coral run {escape(scenario)}`)")
    return path


@contextlib.contextmanager
def staged_folder(folder: Path) -> Iterator[Path]:
    """A folder beside `folder` for a command's outputs, moved into place as `folder` when the block ends without
    error; on an error or interrupt it is removed and the previous `folder` is left as it was."""
    work = folder.with_name(f".{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        yield work
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
    if folder.exists():
        folder.rename(old)
    work.rename(folder)
    shutil.rmtree(old, ignore_errors=True)

