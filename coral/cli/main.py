"""The `coral` command line: a thin layer over the stage packages. Each sub-module registers its commands.

The sub-modules import the stage packages inside their commands (coral.cli.common), so that `coral --help` and
`coral --version` load as little as possible; tests/test_cli_output.py checks which packages stay unloaded."""

from __future__ import annotations

import typer

from coral import __version__
from coral.cli import allocate, deploy, models, perf, plan, report, run, runtime, simulate, templates


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"coral {__version__}")
        raise typer.Exit()


app = typer.Typer(
    name="coral",
    help="Cost-efficient multi-LLM serving over heterogeneous cloud GPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root(
    _version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                  help="print the version and exit"),
) -> None:
    """The root's own options (`--version`)."""


for module in (run, models, perf, templates, allocate, simulate, runtime, deploy, report, plan):
    module.register(app)


if __name__ == "__main__":
    app()
