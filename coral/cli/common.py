"""Helpers shared by the CLI modules: console, error reporting, default paths."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console

from coral.catalog.loader import CoralInputError

console = Console()
err_console = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_OUT = Path("out")


def friendly_errors(fn: F) -> F:
    """Turn CoralInputError into a one-line red message and exit code 2 (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CoralInputError as exc:
            err_console.print(f"[bold red]error:[/] {exc}")
            raise typer.Exit(code=2) from None

    return wrapper  # type: ignore[return-value]


ENGINE_HELP = "engine the plan must run on: coral (every template) | vllm (only what stock vLLM launches)"


def library_path(scenario: str, out: Path = DEFAULT_OUT) -> Path:
    return out / f"{Path(scenario).stem}.templates.sqlite"
