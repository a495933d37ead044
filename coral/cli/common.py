"""Helpers shared by the CLI modules: console, error reporting, default paths."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console

from coral.catalog.loader import Catalog, CoralInputError, load_offerings, load_scenario, market_catalog
from coral.catalog.schema import Scenario

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
OFFERINGS_HELP = ("offerings file (the schema of coral/data/offerings.yaml) replacing the market: prices, instance "
                  "types, regions (default: the scenario's `offerings` file, else the shipped one)")


def scenario_and_market(scenario: str, offerings: Path | None) -> tuple[Scenario, Catalog]:
    """The scenario, checked against the market it plans in (`offerings` when given, which then becomes the
    scenario's `offerings` file), and that market."""
    sc = load_scenario(scenario, load_offerings(offerings) if offerings is not None else None)
    if offerings is not None:  # downstream readers of the scenario (re-planners, baselines) plan in it too
        sc = sc.model_copy(update={"offerings": str(offerings.resolve())})
    return sc, market_catalog(sc)


def library_path(scenario: str, out: Path = DEFAULT_OUT) -> Path:
    return out / f"{Path(scenario).stem}.templates.sqlite"
